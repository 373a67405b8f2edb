"""keyinit.nn.stochastic_round / stochastic_round_grad: SR of activations and gradients keyed per sample
inside keyed() (docs/spec.md 17.8): row splits round as the whole batch, unbiased, refused outside."""

import pytest
import torch

import keyinit
from keyinit.errors import UnkeyedRandomnessError

SEED = 11


class Act(torch.nn.Module):
    """Rounds its input's activation to ``dtype`` (forward SR)."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.inner = torch.nn.Identity()

    def forward(self, x):
        return keyinit.nn.stochastic_round(self.inner(x), self.dtype)


class Grad(torch.nn.Module):
    """Identity times a fixed scale, whose incoming gradient is rounded to ``dtype`` (backward SR)."""

    def __init__(self, dtype, width):
        super().__init__()
        self.dtype = dtype
        self.scale = torch.nn.Parameter(torch.linspace(0.3, 1.7, width))

    def forward(self, x):
        return keyinit.nn.stochastic_round_grad(x, self.dtype) * self.scale


def _data(rows, width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, width, generator=g)


def _spec_round(x, words, dtype):
    """17.2 with given words, written from the spec's bfloat16 bit rule (binary32 to bfloat16)."""
    assert dtype is torch.bfloat16
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    up = ((words >> 16) + (u & 0xFFFF)) >= (1 << 16)
    bits = (u >> 16) + up.to(torch.int64)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_forward_row_splits_round_as_the_whole_batch(dtype):
    model, x = Act(dtype), _data(6)
    with keyinit.nn.keyed(model, SEED, step=3):
        whole = model(x)
    parts = []
    for start, stop in ((0, 1), (1, 4), (4, 6)):
        with keyinit.nn.keyed(model, SEED, step=3, sample_offset=start):
            parts.append(model(x[start:stop]))
    split = torch.cat(parts)
    assert whole.dtype == dtype and torch.equal(whole.view(torch.uint8), split.view(torch.uint8))
    with keyinit.nn.keyed(model, SEED, step=4):
        other = model(x)
    assert not torch.equal(whole.view(torch.uint8), other.view(torch.uint8))  # the step keys the rounding


def test_forward_values_are_17_2_with_the_keyed_randint_words():
    class Words(torch.nn.Module):
        def forward(self, x):
            return torch.randint_like(x, 0, 1 << 32, dtype=torch.int64)

    x = _data(4)
    act, words = Act(torch.bfloat16), Words()
    with keyinit.nn.keyed(act, SEED, step=1, sample_offset=5):
        got = act(x)
    with keyinit.nn.keyed(words, SEED, step=1, sample_offset=5):
        w = words(x)  # same FQN (root ""), same ordinal 0: the same words
    assert torch.equal(got.view(torch.int16), _spec_round(x, w, torch.bfloat16).view(torch.int16))


def test_forward_unbiased():
    x = torch.full((1, 4096), 1.0 + 2.0 ** -9 + 2.0 ** -11)  # between 1 and 1 + 2**-7: P(up) = 5/16
    model = Act(torch.bfloat16)
    total = torch.zeros_like(x, dtype=torch.float64)
    steps = 8
    for step in range(steps):
        with keyinit.nn.keyed(model, SEED, step=step):
            total += model(x).double()
    mean = float(total.mean()) / steps
    n, p, q = x.numel() * steps, 5 / 16, 2.0 ** -7
    se = q * (p * (1 - p) / n) ** 0.5
    assert abs(mean - float(x[0, 0])) < 4 * se


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_backward_row_splits_round_as_the_whole_batch(dtype):
    model, x = Grad(dtype, 8), _data(6)
    c = _data(6, seed=1)

    def grads(start, stop, **kw):
        xs = x[start:stop].clone().requires_grad_(True)
        with keyinit.nn.keyed(model, SEED, step=2, **kw):
            (model(xs) * c[start:stop]).sum().backward()
        return xs.grad

    whole = grads(0, 6)
    split = torch.cat([grads(0, 2, sample_offset=0), grads(2, 6, sample_offset=2)])
    assert torch.equal(whole, split)
    plain = (c * model.scale).detach()
    assert torch.equal(whole.to(dtype).float(), whole)  # representable in dtype
    assert not torch.equal(whole, plain) and torch.allclose(whole, plain, rtol=0.3)


def test_backward_outside_the_block_rounds_as_inside():
    model, x = Grad(torch.bfloat16, 8), _data(4)
    xs = x.clone().requires_grad_(True)
    with keyinit.nn.keyed(model, SEED, step=0, sample_offset=2):
        model(xs).sum().backward()
    first = xs.grad
    xs = x.clone().requires_grad_(True)
    with keyinit.nn.keyed(model, SEED, step=0, sample_offset=2):
        out = model(xs)
    out.sum().backward()  # the backward outside the block: the keys were drawn in the forward
    assert torch.equal(first, xs.grad)


def test_backward_unbiased():
    width = 2048
    model = Grad(torch.bfloat16, width)
    with torch.no_grad():
        model.scale.fill_(1.0 + 2.0 ** -9)  # P(up) = 1/4 in bfloat16
    total = torch.zeros(1, width, dtype=torch.float64)
    steps = 8
    for step in range(steps):
        xs = torch.zeros(1, width, requires_grad=True)
        with keyinit.nn.keyed(model, SEED, step=step):
            model(xs).sum().backward()
        total += xs.grad.double()
    mean = float(total.mean()) / steps
    n, p, q = width * steps, 0.25, 2.0 ** -7
    assert abs(mean - (1.0 + 2.0 ** -9)) < 4 * q * (p * (1 - p) / n) ** 0.5


def test_refused_outside_a_keyed_forward():
    x = torch.randn(2, 3)
    with pytest.raises(UnkeyedRandomnessError, match=r"keyinit\.nn\.stochastic_round ran outside a keyinit\.nn\.keyed "
                       r"forward.*keyinit\.random\.stochastic_round\(key, x, dtype\)"):
        keyinit.nn.stochastic_round(x, torch.bfloat16)
    with pytest.raises(UnkeyedRandomnessError, match=r"stochastic_round_grad ran outside"):
        keyinit.nn.stochastic_round_grad(x, torch.bfloat16)


def test_bad_input():
    with pytest.raises(TypeError, match="x must be float32 or float64, got torch.bfloat16"):
        keyinit.nn.stochastic_round(torch.zeros(2, dtype=torch.bfloat16), torch.float16)
    with pytest.raises(TypeError, match="dtype must be one of"):
        keyinit.nn.stochastic_round(torch.zeros(2), torch.int8)


def test_global_rng_untouched():
    state = torch.get_rng_state()
    model, x = Act(torch.bfloat16), _data(3)
    grad_model = Grad(torch.float16, 8)
    xs = x.clone().requires_grad_(True)
    with keyinit.nn.keyed(model, SEED, step=0):
        model(x)
    with keyinit.nn.keyed(grad_model, SEED, step=0):
        grad_model(xs).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_under_keyinit_nn_compile_the_values_are_the_eager_forwards():
    """keyinit.nn.compile cannot keep the refusal's check in its graph: the module runs eagerly (with
    compile's warning) and rounds as the eager forward does."""
    model, x = Act(torch.bfloat16), _data(6)
    with keyinit.nn.keyed(model, SEED, step=1):
        eager = model(x)
    compiled = keyinit.nn.compile(model, backend="eager")
    with pytest.warns(UserWarning, match="runs eagerly under keyinit.nn.keyed"):
        with keyinit.nn.keyed(compiled, SEED, step=1):
            whole = compiled(x)
    with keyinit.nn.keyed(compiled, SEED, step=1, sample_offset=2):
        rows = compiled(x[2:])
    assert torch.equal(whole.view(torch.int16), eager.view(torch.int16))
    assert torch.equal(rows.view(torch.int16), eager[2:].view(torch.int16))


def test_backward_values_are_17_8s_per_row_keys():
    """Row ``s``'s gradient is keyinit.random.stochastic_round under the key of the two words the forward's
    keyed ``randint_like`` of a ``(rows, 2)`` tensor gives row ``s`` (docs/spec.md 17.8)."""

    class Keys(torch.nn.Module):
        def forward(self, x):
            return torch.randint_like(x.reshape(x.shape[0], -1)[:, :1].expand(-1, 2), 0, 1 << 32,
                                      dtype=torch.int64)

    model, x = Grad(torch.float16, 8), _data(4)
    c = _data(4, seed=2)
    xs = x.clone().requires_grad_(True)
    with keyinit.nn.keyed(model, SEED, step=5, sample_offset=3):
        (model(xs) * c).sum().backward()
    probe = Keys()
    with keyinit.nn.keyed(probe, SEED, step=5, sample_offset=3):
        keys = probe(x)
    incoming = (c * model.scale).detach()
    for s in range(4):
        key = keyinit.Key(int(keys[s, 0]), int(keys[s, 1]))
        want = keyinit.random.stochastic_round(key, incoming[s], torch.float16).float()
        assert torch.equal(xs.grad[s], want)
