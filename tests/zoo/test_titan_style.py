"""Acceptance (issue 8): torchtitan-style init code (``tests/_support/titan.py``), unmodified, keyed.

The model is built on meta and materialized with its own root-level
``init_weights(buffer_device=...)``::

    keyinit.materialize(model, seed, device="cpu", init_method="init_weights",
                        init_kwargs={"buffer_device": torch.device("cpu")})

Its init code draws q/k/v on temporaries (``trunc_normal_`` in the Llama3 flavour,
``normal_`` in the Qwen3-MoE flavour) and ``cat`` + ``copy_``s them into the fused
``wqkv``; it re-creates the RoPE cache and the MoE buffers by assignment. The tests
check: values independent of ``torch.manual_seed`` (global RNG untouched), the
distributions the code asks for, each of two pipeline stages equal to the full
model, a rule for the fused weight winning with exactly the rule's values, and
FSDP2 over 4 gloo ranks and FSDP2 x TP on a 2x2 mesh bit-identical to one process
with 0 collectives.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from tests._support import titan as _titan
from tests._support.dist import requires_gloo, run_distributed
from tests.init.test_model_dist import count_collectives
from tests.zoo.test_zoo import assert_same_bits, check_std, full_state, same_bits

SEED = 31337
INIT_KWARGS = {"buffer_device": torch.device("cpu")}
FLAVOURS = _titan.FLAVOURS
FUSED_RULE = "layers.*.attention.wqkv.weight"


def materialize_titan(model: nn.Module, **kwargs: Any) -> keyinit.InitReport:
    return keyinit.materialize(model, SEED, device="cpu", init_method="init_weights", init_kwargs=dict(INIT_KWARGS),
                               **kwargs)


@functools.lru_cache(maxsize=None)
def reference(flavour: str) -> dict[str, torch.Tensor]:
    """The one-process values of the full model."""
    model = _titan.build(flavour)
    materialize_titan(model)
    return full_state(model)


def rule_values(fqn: str, shape: tuple[int, ...], initializer: Any) -> torch.Tensor:
    """``initializer`` applied to ``key_for(SEED, fqn)`` on a plain tensor of global ``shape``."""
    out = torch.empty(shape)
    target = keyinit.layouts.target_for(out, fqn=fqn, module=nn.Module(), name="weight")
    initializer(keyinit.key_for(SEED, fqn), target)
    return out


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_values_independent_of_global_seed_and_rng_untouched(flavour):
    states = []
    for global_seed in (3, 4):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        model = _titan.build(flavour)
        materialize_titan(model)
        assert torch.equal(torch.get_rng_state(), before), f"{flavour}: materialize changed the global RNG state"
        state = full_state(model)
        on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        assert not on_meta, f"{flavour}: still on meta: {on_meta}"
        states.append(state)
    assert_same_bits(states[1], states[0], f"{flavour}: manual_seed(4) vs manual_seed(3)")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_init_code_distributions_and_buffers(flavour):
    """What the init code asks for: stds, truncation, distinct q/k/v draws, norms 1, buffers re-created."""
    state = reference(flavour)
    args = _titan.TitanArgs(flavour)
    model = _titan.build(flavour)

    expected_freqs = _titan.precompute_freqs_cis(args.head_dim, args.max_seq_len * 2, args.rope_theta)
    assert same_bits(state["freqs_cis"], expected_freqs), "freqs_cis is not the re-created RoPE cache"
    check_std(state["tok_embeddings.weight"], 1.0, "tok_embeddings.weight")
    out_std = args.dim**-0.5
    check_std(state["output.weight"], out_std, "output.weight")
    assert float(state["output.weight"].abs().max()) <= 3 * out_std, "output.weight exceeds its trunc bounds"
    assert same_bits(state["norm.weight"], torch.ones(args.dim))

    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    fused_values = []
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        wqkv = state[f"{prefix}.attention.wqkv.weight"]
        check_std(wqkv, 0.02, f"{prefix}.attention.wqkv.weight")
        q, k, v = wqkv[:q_rows], wqkv[q_rows:q_rows + kv_rows], wqkv[q_rows + kv_rows:]
        assert not same_bits(k, v), f"{prefix}: k and v temporaries drew the same values"
        assert not same_bits(q[:kv_rows], k) and not same_bits(q[:kv_rows], v), f"{prefix}: q repeats k or v"
        fused_values.append(wqkv)
        check_std(state[f"{prefix}.attention.wo.weight"], block.weight_init_std, f"{prefix}.attention.wo.weight")
        for norm in ("attention_norm", "ffn_norm"):
            assert same_bits(state[f"{prefix}.{norm}.weight"], torch.ones(args.dim)), f"{prefix}.{norm}"
        if flavour == "qwen3_moe":
            for norm in ("q_norm", "k_norm"):
                assert same_bits(state[f"{prefix}.attention.{norm}.weight"], torch.ones(args.head_dim))
            check_std(state[f"{prefix}.moe.experts.w1"], 0.02, f"{prefix}.moe.experts.w1")
            check_std(state[f"{prefix}.moe.experts.w2"], block.weight_init_std, f"{prefix}.moe.experts.w2")
            for buffer in ("expert_bias", "tokens_per_expert"):
                assert same_bits(state[f"{prefix}.moe.{buffer}"], torch.zeros(args.num_experts)), f"{prefix}.{buffer}"
        else:
            check_std(state[f"{prefix}.feed_forward.w1.weight"], 0.02, f"{prefix}.feed_forward.w1.weight")
            check_std(state[f"{prefix}.feed_forward.w2.weight"], block.weight_init_std, f"{prefix}.feed_forward.w2")
    for i in range(len(fused_values)):
        for j in range(i):
            assert not same_bits(fused_values[i], fused_values[j]), f"layers {j} and {i} share wqkv values"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_pipeline_stages_equal_the_full_model(flavour):
    """torchtitan's manual split (FQNs kept, absent modules None): each stage gets the full model's values."""
    full = reference(flavour)
    covered: set[str] = set()
    for stage in (0, 1):
        model = _titan.pipeline_stage(_titan.build(flavour), stage)
        materialize_titan(model)
        state = full_state(model)
        assert set(state) <= set(full), f"stage {stage}: FQNs the full model lacks: {sorted(set(state) - set(full))}"
        assert_same_bits(state, {name: full[name] for name in state}, f"{flavour} stage {stage} vs the full model")
        covered |= set(state)
    assert covered == set(full), f"the stages miss {sorted(set(full) - covered)}"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_rule_for_the_fused_weight_wins(flavour):
    """A rule for wqkv gives exactly the rule's values; the code's draws into wqkv are discarded, nothing else moves."""
    initializer = keyinit.init.normal(std=0.01)
    model = _titan.build(flavour)
    report = materialize_titan(model, rules={FUSED_RULE: initializer})
    state = full_state(model)
    expected = dict(reference(flavour))
    for name in model.layers:
        fqn = f"layers.{name}.attention.wqkv.weight"
        expected[fqn] = rule_values(fqn, tuple(state[fqn].shape), initializer)
    assert_same_bits(state, expected, f"{flavour} with rules={{{FUSED_RULE!r}: normal(std=0.01)}}")
    sources = {r.fqn: r.source for r in report.records}
    for name in model.layers:
        assert FUSED_RULE in sources[f"layers.{name}.attention.wqkv.weight"], sources


# ----------------------------------------------------------------------------- real ranks
def _titan_rank(layout: str) -> dict[str, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    results: dict[str, dict[str, Any]] = {}
    mesh = None if layout == "fsdp4" else init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for flavour in FLAVOURS:
        model = _titan.build(flavour)
        if mesh is None:
            _titan.fsdp_wrap(model)
        else:
            parallelize_module(model, mesh["tp"], _titan.tp_plan(model))
            _titan.fsdp_wrap(model, mesh["dp"])
        placements = sorted({str(p.placements) for p in model.parameters()})
        error, counts = None, None
        try:
            with count_collectives() as counts:
                materialize_titan(model)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            error = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # agree before gathering
        results[flavour] = {"error": error, "counts": counts, "placements": placements,
                            "state": full_state(model) if int(ok) == 1 else None}
    return results


@pytest.fixture(scope="module")
def titan_fsdp4():
    return run_distributed(_titan_rank, 4, args=("fsdp4",), timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture(scope="module")
def titan_fsdp2xtp2():
    return run_distributed(_titan_rank, 4, args=("fsdp2xtp2",), timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})


def _assert_layout(per_rank, flavour: str, layout: str) -> None:
    expected = reference(flavour)
    for rank, results in enumerate(per_rank):
        result = results[flavour]
        assert result["error"] is None, f"{flavour} {layout} rank {rank}: {result['error']}"
        assert result["counts"] == {"c10d": 0, "comm_debug": 0}, (
            f"{flavour} {layout} rank {rank}: collectives during materialize: {result['counts']}"
        )
        assert_same_bits(result["state"], expected, f"{flavour} {layout} rank {rank} vs one process")


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fsdp2_four_ranks_bit_identical_without_collectives(flavour, titan_fsdp4):
    assert any("Shard(dim=0)" in p for p in titan_fsdp4[0][flavour]["placements"])
    _assert_layout(titan_fsdp4, flavour, "fsdp4")


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fsdp2_x_tp_2x2_bit_identical_without_collectives(flavour, titan_fsdp2xtp2):
    placements = titan_fsdp2xtp2[0][flavour]["placements"]
    assert any("_StridedShard" in p for p in placements), placements
    _assert_layout(titan_fsdp2xtp2, flavour, "fsdp2xtp2")


def test_tp_and_pp_helpers_cover_the_model():
    """The layouts above are real: every Linear/expert is in the TP plan; the stages partition the FQNs."""
    for flavour in FLAVOURS:
        model = _titan.build(flavour)
        plan = _titan.tp_plan(model)
        linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {
            n for n in (f"layers.{i}.moe.router" for i in model.layers)}
        assert linears <= set(plan), sorted(linears - set(plan))
        names = [set(dict(_titan.pipeline_stage(_titan.build(flavour), s).named_parameters())) for s in (0, 1)]
        assert not names[0] & names[1] and names[0] | names[1] == set(dict(model.named_parameters()))
