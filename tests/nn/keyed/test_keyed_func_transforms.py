"""torch.func transforms inside keyinit.nn.keyed: functional_call, grad, vjp and jacrev keep the batch, and
vmap over samples is a batch dimension (each sample's draws are its row's of the batched forward)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError


class Net(nn.Module):
    """Dropout last (its mask shows in the output), and a random op of the forward (rand_like)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.lin(x)
        h = h + 0.001 * torch.rand_like(h)
        return F.dropout(self.drop(h), 0.25, training=self.training)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _x(rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(1))


def _snapshot(m: nn.Module):
    return ({k: v.clone() for k, v in m.state_dict().items()},
            [(len(s._forward_hooks), len(s._forward_pre_hooks), "forward" in s.__dict__) for s in m.modules()])


def _plain(m, x, **kw):
    with knn.keyed(m, 3, step=2, **kw):
        return m(x)


def _unchanged(m, before):
    after = _snapshot(m)
    assert after[1] == before[1]
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])


def test_functional_call_is_the_plain_forward():
    m, x = _net(), _x()
    ref = _plain(m, x)
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    before = _snapshot(m)
    with knn.keyed(m, 3, step=2):
        out = functional_call(m, params, (x,))
    assert torch.equal(out != 0, ref != 0)
    assert torch.equal(out, ref)
    _unchanged(m, before)


@pytest.mark.parametrize("offset", [0, 11])
def test_grad_and_vjp_draw_as_the_plain_forward(offset):
    m, x = _net(), _x()
    ref = _plain(m, x, sample_offset=offset)
    xr = x.clone().requires_grad_()
    with knn.keyed(m, 3, step=2, sample_offset=offset):
        (m(xr) * torch.arange(3.0, 11.0)).sum().backward()
    before = _snapshot(m)
    with knn.keyed(m, 3, step=2, sample_offset=offset):
        out, pullback = vjp(m, x)
        (gx,) = pullback(torch.arange(3.0, 11.0).expand(5, 8))
    with knn.keyed(m, 3, step=2, sample_offset=offset):  # (a second forward of the same rows is a repeat)
        g = grad(lambda xx: (m(xx) * torch.arange(3.0, 11.0)).sum())(x)
    assert torch.equal(out != 0, ref != 0)
    assert torch.equal(out, ref)
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(g, xr.grad)
    _unchanged(m, before)


def test_grad_over_parameters_with_functional_call():
    m, x = _net(), _x()
    ref = _plain(m, x)
    m.zero_grad()
    with knn.keyed(m, 3, step=2):
        m(x).square().sum().backward()
    params = {k: v.detach() for k, v in m.named_parameters()}
    with knn.keyed(m, 3, step=2):
        grads, out = grad(lambda p: (lambda o: (o.square().sum(), o))(functional_call(m, p, (x,))),
                          has_aux=True)(params)
    assert torch.equal(out != 0, ref != 0)
    for k, v in m.named_parameters():
        torch.testing.assert_close(grads[k], v.grad)


def test_jacrev_is_grad_of_every_output():
    m, x = _net(), _x(3)
    ref = _plain(m, x)
    with knn.keyed(m, 3, step=2):
        jac = jacrev(m)(x)  # (3, 8, 3, 4)
    # an output element whose mask dropped it has a zero row of the Jacobian; a kept one has its weights
    dropped = (jac.flatten(2) == 0).all(-1)
    assert torch.equal(dropped, ref == 0)


@pytest.mark.parametrize("in_dim", [0, 1])
def test_vmap_over_samples_is_the_batch(in_dim):
    m, x = _net(), _x()
    ref = _plain(m, x, sample_offset=4)
    xs = x if in_dim == 0 else x.T.contiguous()
    before = _snapshot(m)
    with knn.keyed(m, 3, step=2, sample_offset=4):
        out = vmap(m, in_dims=in_dim, randomness="different")(xs)  # (torch refuses rand_like otherwise)
    assert torch.equal(out != 0, ref != 0)
    torch.testing.assert_close(out, ref)
    _unchanged(m, before)


def test_vmap_of_grad_per_sample_gradients():
    m, x = _net(), _x()
    xr = x.clone().requires_grad_()
    with knn.keyed(m, 3, step=2):
        m(xr).sum().backward()
    with knn.keyed(m, 3, step=2):
        per_sample = vmap(grad(lambda s: m(s).sum()), randomness="different")(x)
    torch.testing.assert_close(per_sample, xr.grad)  # each row's gradient is its own sample's


def test_vmap_channel_dropout_is_refused_naming_vmap():
    class Channels(nn.Module):
        def forward(self, x):
            return F.dropout1d(x, 0.5, training=True)

    m = Channels()
    with knn.keyed(m, 3, step=2):
        with pytest.raises(UnkeyedRandomnessError) as info:
            vmap(m)(torch.ones(5, 3, 4))
    assert str(info.value) == (
        "the root module (Channels): dropout1d(p=0.5) on a tensor of torch.func.vmap: under torch.func.vmap keyinit keys "
        "element-wise dropout (one vmap level over the samples, not compiled), not channel-wise or alpha dropout; "
        "call the model on the whole batch (torch.func.grad, vjp, jacrev and functional_call keep the batch)")


def test_vmap_attention_dropout_and_nested_vmap_are_refused_naming_vmap():
    class Attend(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)

    m = Attend()
    with knn.keyed(m, 0, step=0):
        with pytest.raises(UnkeyedRandomnessError, match="it is a tensor of torch.func.vmap, whose samples are the "
                                                         "vmapped dimension that the function does not see"):
            vmap(m)(torch.ones(3, 2, 4, 8))
    d = nn.Sequential(nn.Dropout(0.5))
    with knn.keyed(d, 0, step=0):
        with pytest.raises(TypeError) as info:
            vmap(vmap(d))(torch.ones(3, 2, 4))
    assert str(info.value) == (
        "keyinit.nn.keyed: the model is called on a tensor of 2 nested torch.func.vmap levels (vmap inside vmap): "
        "keyinit keys one vmap level over the samples of a batch; call the model on the batch, or vmap once over it")
