"""keyed() replays the batch records of pure torch functions (keyinit/nn/_batch/memo.py; issue 22, item 7).

A replayed call runs with the dispatch mode off and sets the records its first call with the same
signature got from the ATen rules. They must be exactly the records the rules give: every torch
function call of a keyed forward is recorded from inside the forward (a torch-function mode entered
there sees each call before keyed's own mode), with the records of its outputs, once with replay off
(every call op by op under the dispatch mode, as before replay existed) and twice with it on (the
first run learns, the second replays). The three sequences of calls and records are equal, the
outputs are bitwise equal, and the second run did replay.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import keyinit.nn as knn
from keyinit.nn._forward import modes as _modes
from keyinit.nn._batch import memo as _replay
from keyinit.nn._batch.records import record
from keyinit.nn._context.keyed import current_forward


class _Recorder(TorchFunctionMode):
    """Every torch function call it sees, with the records of its tensor outputs in the running forward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        with torch._C.DisableTorchFunction():  # read records without keyed's mode seeing sizes asked for
            forward = current_forward()
            leaves = out if isinstance(out, (tuple, list)) else (out,)
            records = tuple(record(t, forward) if isinstance(t, torch.Tensor) and forward is not None else None
                            for t in leaves)
        self.calls.append((getattr(func, "__qualname__", None) or str(func), records))
        return out


class _Recorded(nn.Module):
    """The model under test, its forward run inside a recorder (entered after keyed's modes)."""

    def __init__(self, model: nn.Module, run: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.model = model
        self.run = run
        self.recorder = _Recorder()

    def forward(self, x: Any) -> Any:
        with self.recorder:
            return self.run(self.model, x)


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict) or hasattr(out, "values"):
        return [v for v in out.values() if isinstance(v, torch.Tensor)]
    return [v for v in out if isinstance(v, torch.Tensor)]


def _recorded_runs(model: nn.Module, x: Any, run: Callable[[nn.Module, Any], Any], monkeypatch, grad: bool = True
                   ) -> None:
    """Replay off once and on twice: equal calls and records, bitwise equal outputs, replays made."""
    replays = []
    real_replay = _modes.replay

    def counting_replay(*args: Any) -> None:
        replays.append(args[0])
        real_replay(*args)

    monkeypatch.setattr(_modes, "replay", counting_replay)
    results = []
    for replay_on in (False, True, True):
        wrapped = _Recorded(model, run)
        with monkeypatch.context() as patch:
            if not replay_on:
                patch.setattr(_modes, "eligible", lambda mode: False)
            else:
                replays.clear()
            with torch.set_grad_enabled(grad), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with knn.keyed(wrapped, 7, step=3, sample_offset=2):
                    out = [t.detach().clone() for t in _leaves(wrapped(x))]
        results.append((wrapped.recorder.calls, out))
    (calls_off, out_off), (calls_learn, out_learn), (calls_replay, out_replay) = results
    assert replays, "the second run replayed nothing: the test would not see a wrong replay"
    assert len(calls_off) > 0
    for calls in (calls_learn, calls_replay):
        assert len(calls) == len(calls_off)
        for got, want in zip(calls, calls_off):
            assert got == want, f"replayed records differ from the ATen rules': {got} != {want}"
    for out in (out_learn, out_replay):
        assert len(out) == len(out_off)
        for got, want in zip(out, out_off):
            assert torch.equal(got, want)


class _Block(nn.Module):
    """benchmarks/bench_dropout.py's Llama-like block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = F.dropout((q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(-1), 0.1, self.training)
        x = x + self.drop(self.proj((w @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


def _call(model: nn.Module, x: Any) -> Any:
    return model(x)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("grad", [True, False])
def test_replayed_records_of_a_transformer_are_the_aten_rules(batch, grad, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(16, 4) for _ in range(2)]).train()
    x = torch.randn(batch, 5, 16, requires_grad=grad)
    _recorded_runs(model, x, _call, monkeypatch, grad=grad)


class _Layouts(nn.Module):
    """The layouts issue 22 names: batch merged with heads or tokens, transposed, sequence-first, split and
    joined, reduced; each followed by a dropout (which reads the record)."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        b, length, d = x.shape
        out = []
        heads = x.reshape(b, length, 2, d // 2).transpose(1, 2).reshape(b * 2, length, d // 2)  # (B*H, L, d)
        out.append(F.dropout(torch.matmul(heads, heads.transpose(1, 2)).softmax(-1), 0.2))
        rows = x.reshape(b * length, d)  # (B*L, D)
        out.append(F.dropout(F.linear(rows, torch.ones(d, d)), 0.2))
        seq_first = x.transpose(0, 1).contiguous()  # (L, B, D)
        out.append(F.dropout(seq_first.view(length * b, d) * 2.0, 0.2))
        first, second = x.chunk(2, dim=2)
        out.append(F.dropout(torch.cat([second, first], dim=2), 0.2))
        out.append(F.dropout(torch.stack(x.unbind(0), dim=1).sum(0), 0.2))  # the batch reduced away
        out.append(F.dropout(x.mean(dim=1, keepdim=True).expand_as(x) - x, 0.2))
        out.append(F.dropout(torch.where(x > 0, x, x.new_zeros(())).flatten(1), 0.2))
        out.append(F.dropout(x.permute(2, 0, 1).unsqueeze(0).squeeze(0).sum(-1), 0.2))
        out.append(F.dropout(x[:, 1:, : d // 2] + x[..., None, -1:, d // 2:].squeeze(1), 0.2))  # basic indexing
        out.append(F.dropout(x[1:] * 3.0, 0.2))  # slicing the batch
        out.append(F.dropout(x[0][None], 0.2))  # one sample
        return out


@pytest.mark.parametrize("batch", [2, 4])
def test_replayed_records_of_batch_layouts_are_the_aten_rules(batch, monkeypatch):
    x = torch.rand(batch, 6, 8, generator=torch.Generator().manual_seed(0)) + 0.5
    _recorded_runs(_Layouts(), x, _call, monkeypatch)


def test_a_sequence_first_batch_is_replayed_as_declared(monkeypatch):
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.LayerNorm(8))
    x = knn.batch_dim(torch.randn(5, 3, 8), 1)  # (L, B, D)
    _recorded_runs(layer, x, run, monkeypatch)


transformers = None
try:
    import transformers  # noqa: F811
except ImportError:  # pragma: no cover - transformers is installed where these tests run
    pass

HF = ("bert", "gpt2", "llama", "opt", "xlnet", "funnel")


@pytest.mark.skipif(transformers is None, reason="needs transformers")
@pytest.mark.parametrize("model_type", HF)
def test_replayed_records_of_hf_models_are_the_aten_rules(model_type, monkeypatch):
    from tests._support.hf_arch import lm_architectures, tiny_config

    class_name = dict(lm_architectures())[model_type]
    config = tiny_config(model_type, dropout=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(config).train()
    ids = (torch.arange(3 * 8).reshape(3, 8) * 7 + 3) % (int(config.vocab_size) - 4) + 4

    def run(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids)
        return out.logits if getattr(out, "logits", None) is not None else out[0]

    _recorded_runs(model, ids, run, monkeypatch)


def test_a_signature_tells_apart_what_the_rules_read():
    forward = type("F", (), {"records": {}, "start": 0, "constants": frozenset()})()
    x = torch.randn(2, 3)
    key = _replay.signature(torch.Tensor.add, (x, x), {}, forward)[0]
    assert _replay.signature(torch.Tensor.add, (x, x), {}, forward)[0] == key
    y = x.clone()
    assert _replay.signature(torch.Tensor.add, (x, y), {}, forward)[0] != key  # another tensor, not x twice
    assert _replay.signature(torch.Tensor.add, (x.t().contiguous().t(), x.t().contiguous().t()), {},
                             forward)[0] != key  # strides
    assert _replay.signature(torch.Tensor.add, (x, x), {"alpha": 2}, forward)[0] != key
    assert _replay.signature(torch.Tensor.add, (x.requires_grad_(), x), {}, forward)[0] != key
    with torch.no_grad():
        assert _replay.signature(torch.Tensor.add, (x, x), {}, forward)[0] != key
    assert _replay.signature(torch.Tensor.add, (x, object()), {}, forward) is None  # not describable
    # an integer tensor of one element may stand for an int (a size, a dim): its value, not described, counts
    assert _replay.signature(torch.Tensor.view, (x, torch.tensor(3), -1), {}, forward) is None
    assert _replay.signature(torch.Tensor.view, (x, (torch.tensor(3), -1)), {}, forward) is None
    assert _replay.signature(torch.Tensor.add, (x, torch.tensor(2.0)), {}, forward) is not None
    # basic indexing is described by its ints, slices, None and Ellipsis; a tensor index (advanced indexing,
    # x itself included) is not
    getitem = torch.Tensor.__getitem__
    assert _replay.signature(getitem, (x, (slice(None), slice(1, None))), {}, forward) is not None
    assert _replay.signature(getitem, (x, (Ellipsis, None, 0)), {}, forward) is not None
    assert _replay.signature(getitem, (x, (slice(None), slice(1, None))), {}, forward)[0] != \
        _replay.signature(getitem, (x, (slice(None), slice(2, None))), {}, forward)[0]
    for index in (x > 0, (slice(None), torch.tensor([0, 2])), x, [x]):
        assert _replay.signature(getitem, (x, index), {}, forward) is None


def test_functions_whose_outputs_depend_on_values_are_not_replayable():
    replayable = _replay.replayable()
    assert F.linear in replayable and torch.Tensor.view in replayable and torch.Tensor.__add__ in replayable
    # torch.where(condition) is nonzero(), narrow may take its start as a tensor, nonzero and masked_select
    # size their outputs by values, dropout and rand_like draw, add_ writes its input: none may be replayed
    # (indexing is, by ints and slices only: see the signature test)
    for function in (torch.where, torch.Tensor.narrow, torch.nonzero, F.dropout,
                     torch.Tensor.add_, torch.Tensor.masked_select, torch.Tensor.index_select, torch.rand_like):
        assert function not in replayable, function
