"""keyed() gives each ``nn.Dropout`` of the model a forward of its own for the block instead of hooks
(keyinit/nn/_forward/dropout.py; issue 22, item 7): the same keys and values as the hooks give, in every
case, and the module as it was after the block.

Each case runs a training step (forward, backward) twice under the same keys, once as keyed() does and
once with the Dropout forward turned off (every module hooked, as before it existed), and compares the
outputs and every gradient bit for bit; another step's values differ.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn._context import keyed as _keyed
from keyinit.nn._forward import dropout as _keyed_dropout
from keyinit.nn._forward.dropout import DropoutForward


class Block(nn.Module):
    """A dropout module called twice, on rows and on flattened rows, beside a functional dropout."""

    def __init__(self, dim: int = 8, p: float = 0.25, inplace: bool = False, flatten: bool = False,
                 checkpointed: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p, inplace=inplace)
        self.flatten, self.checkpointed = flatten, checkpointed

    def forward(self, x):
        h = self.lin(x) + 1.0  # (nothing saved for backward: an in-place dropout may write it)
        if self.checkpointed:
            h = checkpoint(self.drop, h, use_reentrant=False)
        else:
            h = self.drop(h)
        if self.flatten:  # (B*L, D): a layout the rows fast path does not take
            b, length, d = h.shape
            h = self.drop(h.reshape(b * length, d)).reshape(b, length, d)
        else:
            h = self.drop(h * 2)
        return F.dropout(h, 0.5, self.training) + x


def _model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(**kwargs), Block(**kwargs)).train()


def _step(model: nn.Module, x: torch.Tensor, step: int, **keyed_kwargs) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with knn.keyed(model, 7, step=step, **keyed_kwargs):
        out = model(x)
        out.pow(2).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


def _without_dropout_forward(monkeypatch) -> None:
    monkeypatch.setattr(_keyed, "takes_dropout_forward", lambda module: False)


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int32) for t in tensors]


CASES = {
    "rows": dict(),
    "flattened": dict(flatten=True),
    "inplace": dict(inplace=True),
    "p=0": dict(p=0.0),
    "checkpointed": dict(checkpointed=True),
}


@pytest.mark.parametrize("calls", ["forward", "execution"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_dropout_forward_gives_the_hooks_values(case, calls, monkeypatch):
    model = _model(**CASES[case])
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    fast = _step(model, x, 3, calls=calls)
    fast_next = _step(model, x, 4, calls=calls)
    with monkeypatch.context() as patch:
        _without_dropout_forward(patch)
        hooked = _step(model, x, 3, calls=calls)
    for a, b in zip(_bits(fast), _bits(hooked)):
        assert torch.equal(a, b)
    if CASES[case].get("p", 0.25):
        assert not torch.equal(fast[0], fast_next[0])


class Scale(nn.Module):
    def forward(self, x):
        return x * 3.0 - 1.0


def test_split_batches_get_the_whole_batch_rows():
    # elementwise ops only (a matmul's last bits depend on the batch size): outputs bitwise
    model = nn.Sequential(nn.Dropout(0.3), Scale(), nn.Sequential(nn.Dropout(0.6), Scale())).train()
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with knn.keyed(model, 7, step=0):
            whole = model(x)
        halves = []
        for offset in (0, 2):
            with knn.keyed(model, 7, step=0, sample_offset=offset):
                halves.append(model(x[offset:offset + 2]))
    assert torch.equal(torch.cat(halves).view(torch.int32), whole.view(torch.int32))


def test_the_module_is_given_back_its_forward():
    model = _model()
    drop = model[0].drop
    assert "forward" not in vars(drop)
    with knn.keyed(model, 7, step=0):
        assert isinstance(vars(drop)["forward"], DropoutForward)
        model(torch.randn(2, 3, 8))
    assert "forward" not in vars(drop) and not drop._forward_pre_hooks and not drop._forward_hooks
    with pytest.raises(ZeroDivisionError):
        with knn.keyed(model, 7, step=1):
            model(torch.randn(2, 3, 8))
            raise ZeroDivisionError
    assert "forward" not in vars(drop)


def test_a_forward_set_on_the_instance_keeps_its_hooks():
    model = _model()
    drop = model[0].drop
    calls = []

    def forward(input):
        calls.append(1)
        return nn.Dropout.forward(drop, input)

    drop.forward = forward
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), knn.keyed(model, 7, step=0):
        assert vars(drop)["forward"] is forward and drop._forward_pre_hooks
        out = model(x)
    assert calls == [1, 1] and vars(drop)["forward"] is forward
    del drop.forward
    with torch.no_grad(), knn.keyed(model, 7, step=0):
        assert torch.equal(model(x).view(torch.int32), out.view(torch.int32))


def test_a_sequence_first_layer_keeps_its_dropouts_hooked():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.3).train()  # batch_first=False
    x = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(4))  # (sequence, batch, features)
    knn.batch_dim(x, 1)
    with torch.no_grad(), knn.keyed(layer, 7, step=0):
        assert all("forward" not in vars(m) for m in layer.modules())
        whole = layer(x)
    halves = []
    for offset in (0, 2):
        part = x[:, offset:offset + 2]
        knn.batch_dim(part, 1)
        with torch.no_grad(), knn.keyed(layer, 7, step=0, sample_offset=offset):
            halves.append(layer(part))
    torch.testing.assert_close(torch.cat(halves, dim=1), whole)


def test_another_function_mode_takes_the_general_path(monkeypatch):
    class Counting(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen += 1
            return func(*args, **(kwargs or {}))

    model = _model()
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), knn.keyed(model, 7, step=0):
        plain = model(x)
    taken = []
    original = _keyed_dropout.rows_dropout
    monkeypatch.setattr(_keyed_dropout, "rows_dropout", lambda *a: taken.append(1) or original(*a))
    mode = Counting()
    with torch.no_grad(), knn.keyed(model, 7, step=0), mode:
        under = model(x)
    assert torch.equal(under.view(torch.int32), plain.view(torch.int32))
    assert mode.seen and not taken  # the modules ran with their hooks' frames, under the other mode


def test_a_forward_in_another_thread_is_refused():
    model = _model()
    errors = []

    def run():
        try:
            model(torch.randn(2, 3, 8))
        except UnkeyedRandomnessError as exc:
            errors.append(str(exc))

    with knn.keyed(model, 7, step=0):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert len(errors) == 1 and "thread" in errors[0]


class _Direct(nn.Module):
    """Calls its dropout's forward directly (no hooks run for that call) and as a module, and has a hook of its
    own on the dropout (torch then calls the module's forward from inside its hook loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.drop.register_forward_pre_hook(lambda module, args: None)

    def forward(self, x):
        return self.drop.forward(x) * 2 + self.drop(x) + F.dropout(x, 0.5, self.training)


def test_a_direct_forward_call_is_keyed_as_without_hooks(monkeypatch):
    model = _Direct().train()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(6))
    taken = []
    original = _keyed_dropout.rows_dropout
    with monkeypatch.context() as patch:
        patch.setattr(_keyed_dropout, "rows_dropout", lambda *a: taken.append(1) or original(*a))
        fast = _step(model, x, 0)
    with monkeypatch.context() as patch:
        _without_dropout_forward(patch)
        hooked = _step(model, x, 0)
    for a, b in zip(_bits(fast), _bits(hooked)):
        assert torch.equal(a, b)
    assert len(taken) == 1  # the module call (under the user's hook) took the fast path; the direct call did not


def test_a_copy_made_during_the_block_runs_torchs_forward():
    import copy
    import pickle

    model = _model()
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(7))
    with knn.keyed(model, 7, step=0):
        clone = copy.deepcopy(model)
        pickled = pickle.loads(pickle.dumps(model[0].drop))
    for drop in (clone[0].drop, pickled):
        assert not isinstance(vars(drop).get("forward"), DropoutForward)
        assert drop(x) is not None  # (torch's own forward, outside any block)
    with torch.no_grad():
        assert torch.equal(clone.eval()(x), model.eval()(x))
