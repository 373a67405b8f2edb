"""Hostile round 5 (issue 34), forwards people run besides training: Monte-Carlo dropout under
``torch.inference_mode``, ``multinomial`` over per-row probabilities, ops of HF models that lacked a batch rule,
plain ``torch.compile(fullgraph=True)`` inside ``keyed`` and pipelining schedules without ``micro_batches``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from tests._support.splits import check_splits

# ---------------------------------------------------------------- 1. torch.inference_mode (Monte-Carlo dropout)


class _Block(nn.Module):
    """A small transformer-ish block: every dropout follows an op that inference_mode passes undecomposed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.drop(self.proj(self.norm(x))).chunk(3, dim=-1)
        scores = self.drop(torch.matmul(q, k.transpose(-1, -2)).softmax(-1))
        h = self.drop(torch.einsum("bqk,bkd->bqd", scores, v))
        h = self.drop(self.norm(x + self.out(h)))
        h = self.drop(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return h + self.drop(nn.functional.gelu(h))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.25, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.blocks(x))


def _keyed_forward(model: nn.Module, x: torch.Tensor, offset: int, grad_mode) -> torch.Tensor:
    with grad_mode(), keyinit.nn.keyed(model, 11, step=3, sample_offset=offset):
        return model(x).clone()


def test_inference_mode_keys_dropout_as_no_grad_does_and_is_split_invariant():
    torch.manual_seed(0)
    model = _Model().train()  # Monte-Carlo dropout: dropout on, no gradients
    x = torch.randn(6, 5, 8)
    reference = _keyed_forward(model, x, 0, torch.no_grad)
    whole = _keyed_forward(model, x, 0, torch.inference_mode)
    assert whole.is_inference()
    torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-6)
    check_splits(model, x, [((0, 1), (1, 4), (4, 6))], seed=11, step=3, grad_mode=torch.inference_mode,
                 rtol=1e-5, atol=1e-6)


class _Masks(nn.Module):
    """Each dropout's mask, exactly: dropout of ones after linear, layer_norm, matmul, einsum and conv."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv2d(3, 3, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> list:
        return [self.drop(torch.ones_like(h)) for h in (
            self.lin(x), self.norm(x), torch.matmul(x, x.transpose(-1, -2)), torch.einsum("bij,bkj->bik", x, x),
            self.conv(x.unsqueeze(1).expand(-1, 3, -1, -1)))]


def test_inference_mode_masks_equal_no_grad_masks_bitwise_and_split_invariant():
    model = _Masks().train()
    x = torch.randn(5, 3, 4)
    reference = [m.clone() for m in _keyed_list(model, x, 0, torch.no_grad)]
    whole = _keyed_list(model, x, 0, torch.inference_mode)
    for got, want in zip(whole, reference, strict=True):
        assert torch.equal(got, want)
        assert 0 < int((got == 0).sum()) < got.numel()
    check_splits(model, x, [((0, 2), (2, 3), (3, 5))], seed=5, step=0, grad_mode=torch.inference_mode, exact=True)


def _keyed_list(model: nn.Module, x: torch.Tensor, offset: int, grad_mode) -> list:
    with grad_mode(), keyinit.nn.keyed(model, 5, step=0, sample_offset=offset):
        return [t.clone() for t in model(x)]


# ---------------------------------------------------------------- 2. multinomial over per-row probabilities


class _Sampler(nn.Module):
    """Draws per row of its own probabilities: (B, C) rows, and (B*T, C) rows of T tokens per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> tuple:
        probs = self.head(x).softmax(-1)  # (B, T, C)
        rows = probs[:, 0]
        flat = probs.reshape(-1, probs.shape[-1])
        return (torch.multinomial(rows, 7, replacement=True), torch.multinomial(rows, 3),
                torch.multinomial(flat, 4, replacement=True), torch.multinomial(flat, 2))


def _sampled(model: nn.Module, x: torch.Tensor, offset: int) -> tuple:
    with keyinit.nn.keyed(model, 3, step=1, sample_offset=offset):
        return model(x)


def test_multinomial_over_per_row_probabilities_is_keyed_per_sample():
    torch.manual_seed(0)
    model = _Sampler()
    x = torch.randn(6, 3, 6)
    whole = _sampled(model, x, 0)
    torch.manual_seed(1)  # torch's generator plays no part
    assert all(torch.equal(a, b) for a, b in zip(_sampled(model, x, 0), whole, strict=True))
    check_splits(model, x, [((0, 1), (1, 4), (4, 6))], seed=3, step=1, exact=True)
    assert all(want.dtype == torch.int64 for want in whole)
    for picks in (whole[1], whole[3]):  # without replacement: distinct categories in each row
        assert all(len(set(row.tolist())) == row.numel() for row in picks)


class _Given(nn.Module):
    def forward(self, probs: torch.Tensor) -> tuple:
        return torch.multinomial(probs, 2, replacement=True), torch.multinomial(probs, 3)


def test_keyed_multinomial_draws_each_row_from_its_own_probabilities():
    n = 4000
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0], [0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.5]]).repeat(n, 1)
    model = _Given()
    with keyinit.nn.keyed(model, 0, step=0):
        with_replacement, without = model(probs)
    assert bool((with_replacement[1::3] == 2).all())
    assert bool((without[1::3, 0] == 2).all())
    first = with_replacement[0::3].reshape(-1)
    frequencies = torch.bincount(first, minlength=4).double() / first.numel()
    torch.testing.assert_close(frequencies, probs[0].double(), atol=0.02, rtol=0)
    assert set(with_replacement[2::3].reshape(-1).tolist()) == {0, 3}
    assert bool((without[2::3, :2].sort(dim=1).values == torch.tensor([0, 3])).all())


# ---------------------------------------------------------------- 3. batch rules of log_sigmoid_forward, solve_triangular


class _Solve(nn.Module):
    """Dropout after log-sigmoid and after triangular solves: by a parameter matrix, by each sample's own
    matrix, with the batch in the right-hand side's free dimension (left and right solves)."""

    def __init__(self) -> None:
        super().__init__()
        self.tri = nn.Parameter(torch.eye(4) * 2 + torch.arange(16.0).reshape(4, 4).tril(-1) / 20)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> list:  # x: (B, 4, 3)
        own = x.transpose(1, 2) @ x * 0.01 + torch.eye(3)  # (B, 3, 3): each sample's matrix
        per_column = x.permute(1, 0, 2).reshape(4, -1)  # (4, B*3): the batch in the columns
        solves = [
            nn.functional.logsigmoid(x),
            torch.linalg.solve_triangular(self.tri, x, upper=False),
            torch.linalg.solve_triangular(own.triu(), x.transpose(1, 2), upper=True),
            torch.linalg.solve_triangular(self.tri.T, x.transpose(1, 2), upper=True, left=False),
            torch.linalg.solve_triangular(self.tri, per_column, upper=False).reshape(4, -1, 3).permute(1, 0, 2),
        ]
        return [self.drop(torch.ones_like(h)) * h for h in solves]


def _solved(model: nn.Module, x: torch.Tensor, offset: int) -> list:
    with keyinit.nn.keyed(model, 2, step=0, sample_offset=offset):
        return model(x)


def test_log_sigmoid_and_triangular_solves_carry_the_batch():
    torch.manual_seed(0)
    model = _Solve().train()
    x = torch.randn(5, 4, 3)
    whole = _solved(model, x, 0)
    check_splits(model, x, [((0, 2), (2, 3), (3, 5))], seed=2, step=0, rtol=1e-5, atol=1e-6)  # masks bitwise
    for want in whole:
        assert 0 < int((want == 0).sum()) < want.numel()


class _Mixed(nn.Module):
    """A solve whose rows are the batch's (left=True solves along them): nothing to key, refused."""

    def __init__(self) -> None:
        super().__init__()
        self.tri = nn.Parameter(torch.eye(5) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3): the batch in the rows of the solve
        return nn.functional.dropout(torch.linalg.solve_triangular(self.tri, x, upper=False), 0.5)


def test_a_solve_along_the_batch_is_refused_naming_the_op():
    with pytest.raises(keyinit.errors.UnkeyedRandomnessError,
                       match=r"aten.linalg_solve_triangular.default solves along the batch dimension 0 of its "
                             r"right-hand side"):
        with keyinit.nn.keyed(model := _Mixed(), 2, step=0):
            model(torch.randn(5, 3))


@pytest.mark.parametrize("model_type,class_name,layers", [
    ("inkling_text", "InklingForCausalLM", None),  # log_sigmoid_forward in the first layer's attention gates
    ("olmo_hybrid", "OlmoHybridForCausalLM", ["linear_attention", "full_attention"]),  # gated delta rule solves
])
def test_hf_models_with_these_ops_are_keyed_and_split_invariant(model_type, class_name, layers):
    import warnings

    transformers = pytest.importorskip("transformers")
    from tests._support.hf_arch import tiny_config

    if not hasattr(transformers, class_name):
        pytest.skip(f"the installed transformers has no {class_name}")
    config = tiny_config(model_type, dropout=0.1)
    config.num_hidden_layers = 2  # a draw in the second layer, on what the first layer's op computed
    config.layer_types = layers or config.layer_types[:2]
    if getattr(config, "mlp_layer_types", None):
        config.mlp_layer_types = config.mlp_layer_types[:2]
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(config).train()
        ids = (torch.arange(32).reshape(4, 8) * 7 + 3) % 60 + 4
        with torch.no_grad():
            plain = model.eval()(input_ids=ids).logits
            model.train()
            whole = check_splits(model, ids, [((0, 2), (2, 4))], seed=0, step=0, rtol=1e-4, atol=1e-4,
                                 forward=lambda m, ids: m(input_ids=ids).logits)
    assert not torch.allclose(whole, plain, rtol=1e-4, atol=1e-4)  # the draws are live


# ---------------------------------------------------------------- 4. torch.compile(fullgraph=True) inside keyed


@pytest.mark.parametrize("keyed_target", ["model", "compiled"])
def test_plain_full_graph_compile_inside_keyed_names_keyinit_nn_compile(keyed_target):
    import re
    import warnings

    from keyinit.nn._context.fullgraph import FULL_GRAPH

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = torch.randn(3, 4)
    hooks = [dict(m._forward_pre_hooks) | dict(m._forward_hooks) for m in model.modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning that a torch.compile forward runs eagerly under keyed)
        with pytest.raises(RuntimeError, match="^" + re.escape(FULL_GRAPH) + "$") as info:
            with keyinit.nn.keyed(model if keyed_target == "model" else compiled, 0, step=0):
                compiled(x)
    cause = info.value.__cause__  # dynamo's own error, kept: a graph break in keyinit's code, or no frame compiled
    assert type(cause).__module__ == "torch._dynamo.exc" or str(cause).startswith("torch.compile with fullgraph")
    assert "keyinit.nn.compile(model, fullgraph=True)" in FULL_GRAPH
    assert [dict(m._forward_pre_hooks) | dict(m._forward_hooks) for m in model.modules()] == hooks
    with keyinit.nn.keyed(model, 0, step=0):  # the model is as it was: keyed eagerly as before
        eager = model(x)
    with keyinit.nn.keyed(model, 0, step=0):
        assert torch.equal(model(x), eager)


# ---------------------------------------------------------------- 5. a pipelining schedule without micro_batches


def _one_rank_pipeline(tmp_path, run):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        return run()
    finally:
        dist.destroy_process_group()


def test_a_pipelining_schedule_without_micro_batches_is_refused_naming_them(tmp_path):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("gloo is not available")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    x = torch.randn(6, 4)
    with keyinit.nn.keyed(net, 0, step=0):
        reference = net(x)

    def run():
        stage = PipelineStage(net, stage_index=0, num_stages=1, device=torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=2)
        with keyinit.nn.keyed(net, 0, step=0) as ctx, \
                keyinit.nn.micro_batches(stage, ctx, batch_size=6, n_microbatches=2):
            wrapped = schedule.step(x)
            schedule.step(x)  # the schedule run twice in one block: a second pass, as a double forward
        with pytest.raises(RuntimeError, match=r"^keyinit.nn.keyed: the root module \(Sequential\) runs micro-batch 1 "
                           r"of a torch.distributed.pipelining schedule \(3 rows\) as a repeat of rows an earlier "
                           r"micro-batch drew for: its masks would not be the unpipelined forward's. Give each "
                           r"micro-batch its rows with keyinit.nn.micro_batches\(stage, ctx, batch_size=B, "
                           r"n_microbatches=M\) around schedule.step\(\)$"):
            with keyinit.nn.keyed(net, 0, step=0):
                schedule.step(x)
        return wrapped

    hooks = [dict(m._forward_pre_hooks) for m in net.modules()]
    wrapped = _one_rank_pipeline(tmp_path, run)
    torch.testing.assert_close(wrapped, reference, rtol=1e-5, atol=1e-6)
    assert [dict(m._forward_pre_hooks) for m in net.modules()] == hooks


def test_the_repeat_of_an_unwrapped_chunk_is_refused_where_it_is_counted():
    """The detection alone, without a process group: torch's own ``forward_one_chunk`` (the method a schedule
    calls) run on a stand-in stage for two chunks of the same rows; torch's method is its own again after."""
    from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase

    from keyinit.nn._context.unwrapped import UnwrappedChunkError

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))

    class StandIn:  # what torch's forward_one_chunk reads of a first stage
        is_first, is_last, _runtime_validate, log_prefix = True, False, False, "[Stage 0]"

        def __init__(self) -> None:
            self.fwd_cache: dict = {}

        def forward_maybe_with_nosync(self, *args, **kwargs):
            return model(*args, **kwargs)

    method = _PipelineStageBase.__dict__["forward_one_chunk"]
    stage = StandIn()
    x = torch.randn(6, 4)
    with pytest.raises(UnwrappedChunkError, match=r"runs micro-batch 1 of a torch.distributed.pipelining "
                                                   r"schedule \(3 rows\)"):  # surfaced from under the stage's error
        with keyinit.nn.keyed(model, 0, step=0):
            PipelineStage.forward_one_chunk(stage, 0, (x[:3],))
            PipelineStage.forward_one_chunk(stage, 1, (x[3:],))
    with keyinit.nn.keyed(model, 0, step=0):  # a double forward outside a schedule stays a repeat, as documented
        first = model(x)
        again = model(x)
    assert not torch.equal(first != 0, again != 0)
    assert _PipelineStageBase.__dict__["forward_one_chunk"] is method
