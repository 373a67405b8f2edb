"""Acceptance (issue 8): HF ``_init_weights``, unmodified, over a zoo of tiny transformers models.

Every model is built on the meta device from a config (``tests/_support/hf_zoo.py``) and
initialized with ``keyinit.materialize(model, seed, init_method=model._init_weights)``
and nothing else. The tests check:

- one process: the values do not depend on ``torch.manual_seed``, the global RNG
  state is untouched, and HF's own init gives the same distributions: every tensor
  HF's init makes deterministic (norm weights, biases, buffers, sinusoids, RoPE
  frequencies, padding rows) is bit-identical to HF's, Linear/Embedding weights have
  std ``initializer_range`` (or the model's own std) within a chi-square bound for the
  tensor size, and every random tensor passes a two-sample Kolmogorov-Smirnov test
  against HF's own draws;
- real gloo ranks, FSDP2 over 4 ranks and FSDP2 x TP on a 2x2 mesh: every parameter
  and buffer bit-identical to the one-process values, with 0 collectives during
  ``materialize`` (one distributed launch per layout; each rank loops over the zoo);
- CLIP, whose ``_init_weights`` never writes ``logit_scale``: a ``PlanError`` naming it,
  raised before anything is allocated.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from tests._support import hf_zoo as _zoo
from tests._support.dist import requires_gloo, run_distributed
from tests.conftest import bit_view
from tests.init.test_model_dist import count_collectives

SEED = 20260817

#: Two-sided tail probability of the statistical checks. The seed is fixed, so each check is
#: deterministic; ALPHA bounds the chance that a correct implementation fails for this seed.
ALPHA = 1e-6
_Z = 4.9  # standard normal quantile for a two-sided ALPHA = 1e-6


# ----------------------------------------------------------------------------- helpers
def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name (tied tensors under each of theirs)."""
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, under every name (tied ones too), as a full plain CPU tensor.

    Gathers DTensors: call outside counted regions.
    """
    out = {}
    for name, tensor in named_tensors(model):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().to("cpu").clone()
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``tensor`` (complex: of its real and imaginary parts)."""
    return bit_view(torch.view_as_real(tensor) if tensor.is_complex() else tensor)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_bits(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Same names, and every tensor bit-identical (dtype, shape, every bit: tells 0.0 from -0.0)."""
    assert set(actual) == set(expected), f"{what}: tensor names differ: {sorted(set(actual) ^ set(expected))}"
    differ = [name for name, tensor in expected.items() if not same_bits(actual[name], tensor)]
    assert not differ, f"{what}: {len(differ)} of {len(expected)} tensors differ bitwise: {differ}"


def materialize_zoo(name: str) -> tuple[nn.Module, keyinit.InitReport]:
    """The call under test: ``materialize(model, seed, init_method=model._init_weights)``, nothing else."""
    model = _zoo.build(name)
    report = keyinit.materialize(model, SEED, init_method=model._init_weights)
    return model, report


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict[str, torch.Tensor]:
    """The one-process values of zoo model ``name``."""
    model, _ = materialize_zoo(name)
    return full_state(model)


@functools.lru_cache(maxsize=None)
def hf_init(name: str, seed: int) -> dict[str, torch.Tensor]:
    """HF's own init (the constructor on CPU runs ``initialize_weights``), from the global RNG.

    Runs under ``fork_rng`` so the test leaves the global RNG as it found it.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return full_state(_zoo.build(name, device="cpu"))


def _module_types(name: str) -> dict[str, type]:
    """``{weight fqn: type of its module}`` for every weight, under every (tied) name."""
    model = _zoo.build(name)
    types = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        if isinstance(module._parameters.get("weight"), torch.Tensor):
            types[f"{module_fqn}.weight" if module_fqn else "weight"] = type(module)
    return types


def _chi2_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard normal quantile ``z``."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def check_std(values: torch.Tensor, std: float, what: str) -> None:
    """Mean 0 and standard deviation ``std``, within two-sided ALPHA bounds for ``values.numel()`` samples.

    ``(n-1) s^2 / std^2`` is chi-square with n-1 degrees of freedom for normal samples; for
    uniform samples (lighter tails) the same bounds are conservative.
    """
    x = values.detach().double().reshape(-1)
    n = x.numel()
    assert n >= 8, f"{what}: too few elements ({n}) for a std check"
    mean = float(x.mean())
    assert abs(mean) <= _Z * std / math.sqrt(n), f"{what}: mean {mean:.3g}, expected 0 (std {std:.3g}, n={n})"
    var = float(x.var(unbiased=True))
    low = std**2 * _chi2_quantile(n - 1, -_Z) / (n - 1)
    high = std**2 * _chi2_quantile(n - 1, _Z) / (n - 1)
    assert low <= var <= high, (
        f"{what}: std {math.sqrt(var):.4g}, expected {std:.4g} (bounds {math.sqrt(low):.4g}..{math.sqrt(high):.4g}, n={n})"
    )


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic ``max |F_a - F_b|`` (ties handled: ECDFs at every pooled value)."""
    a = a.detach().double().reshape(-1).sort().values
    b = b.detach().double().reshape(-1).sort().values
    points = torch.cat([a, b])
    fa = torch.searchsorted(a, points, right=True).double() / a.numel()
    fb = torch.searchsorted(b, points, right=True).double() / b.numel()
    return float((fa - fb).abs().max())


def check_same_distribution(ours: torch.Tensor, hf: torch.Tensor, what: str) -> None:
    """KS two-sample test at ALPHA: ``D <= c(ALPHA) sqrt((n+m)/(n m))``, ``c = sqrt(-ln(ALPHA/2)/2)``."""
    n, m = ours.numel(), hf.numel()
    critical = math.sqrt(-math.log(ALPHA / 2) / 2) * math.sqrt((n + m) / (n * m))
    d = ks_statistic(ours, hf)
    assert d <= critical, f"{what}: KS statistic {d:.3f} > {critical:.3f} against HF's own init (n={n}, m={m})"


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", _zoo.NAMES)
def test_one_process_materialize_is_keyed(name):
    """Values do not depend on torch.manual_seed; materialize neither reads nor advances the global RNG."""
    states = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        model, report = materialize_zoo(name)
        assert torch.equal(torch.get_rng_state(), before), f"{name}: materialize changed the global RNG state"
        on_meta = [n for n, t in named_tensors(model) if t.device.type == "meta"]
        assert not on_meta, f"{name}: still on meta after materialize: {on_meta}"
        assert {r.fqn for r in report.records} >= set(dict(model.named_parameters())), f"{name}: report incomplete"
        kept = [r.fqn for r in report.records if r.source == "kept"]
        assert not kept, f"{name}: materialize reports tensors nothing wrote: {kept}"
        states.append(full_state(model))
    assert_same_bits(states[1], states[0], f"{name}: torch.manual_seed(2) vs torch.manual_seed(1)")


@pytest.mark.parametrize("name", _zoo.NAMES)
def test_one_process_matches_hf_distributions(name):
    """Deterministic tensors bit-identical to HF's; padding rows zero; stds as HF's; random tensors KS-equal to HF's."""
    entry = _zoo.ZOO[name]
    ours = reference(name)
    hf_a, hf_b = hf_init(name, 0), hf_init(name, 1)
    assert set(ours) == set(hf_a), f"{name}: names differ from HF's model: {sorted(set(ours) ^ set(hf_a))}"

    deterministic_wrong, random_tensors = [], []
    for fqn, hf in hf_a.items():
        mine = ours[fqn]
        assert mine.dtype == hf.dtype and mine.shape == hf.shape, (fqn, mine.dtype, hf.dtype, mine.shape, hf.shape)
        if same_bits(hf, hf_b[fqn]):
            # HF's init made it deterministic: norm weights 1 (Gemma 0, T5 factor), biases 0, buffers
            # (position ids, RoPE frequencies, BatchNorm statistics), sinusoids, layer scales, Mamba A_log/D.
            if not same_bits(mine, hf):
                deterministic_wrong.append(fqn)
        else:
            random_tensors.append(fqn)
    assert not deterministic_wrong, (
        f"{name}: tensors HF's _init_weights sets deterministically differ from HF's values: {deterministic_wrong}"
    )

    for fqn, row in entry.pad_rows.items():
        assert torch.count_nonzero(hf_a[fqn][row]) == 0, f"zoo: HF does not zero {fqn}[{row}]"
        assert same_bits(ours[fqn][row], torch.zeros_like(ours[fqn][row])), (
            f"{name}: padding row {fqn}[{row}] is not exactly zero"
        )

    model_std = _zoo.init_std(_zoo.build(name))
    checked = 0
    for fqn, module_type in _module_types(name).items():
        if module_type not in (nn.Linear, nn.Embedding) or fqn not in random_tensors:
            continue
        std = model_std
        for pattern, override in entry.std_overrides.items():
            if fnmatch.fnmatchcase(fqn, pattern):
                std = override
                break
        if std is None:
            continue
        values = ours[fqn]
        pad = entry.pad_rows.get(fqn)
        if pad is not None:
            values = torch.cat([values[:pad], values[pad + 1:]])
        check_std(values, std, f"{name}: {fqn}")
        checked += 1
    assert checked > 0, f"{name}: no Linear/Embedding weight was checked"

    for fqn in random_tensors:
        check_same_distribution(ours[fqn], torch.cat([hf_a[fqn].reshape(-1), hf_b[fqn].reshape(-1)]), f"{name}: {fqn}")


def test_clip_uncovered_logit_scale_is_a_plan_error_before_allocation():
    """CLIP's _init_weights never writes logit_scale: PlanError naming it, the model still entirely on meta."""
    model = _zoo.build("clip")
    with pytest.raises(keyinit.PlanError) as info:
        keyinit.materialize(model, SEED, init_method=model._init_weights)
    assert "logit_scale" in info.value.fqns, info.value.fqns
    assert "logit_scale" in str(info.value)
    not_meta = [n for n, t in named_tensors(model) if t.device.type != "meta"]
    assert not not_meta, f"PlanError left tensors allocated: {not_meta}"


# ----------------------------------------------------------------------------- real ranks
def _mesh(layout: str) -> Any:
    """The device mesh of ``layout`` (None: FSDP2 over the default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "fsdp4":
        return None
    if layout == "fsdp2xtp2":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    raise ValueError(layout)  # pragma: no cover - a typo in this file


def _apply_layout(model: nn.Module, mesh: Any) -> None:
    """FSDP2 per block + root; on a 2-D mesh, TP over "tp" first, then FSDP2 over "dp"."""
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh is None:
        _zoo.fsdp_wrap(model)
        return
    plan = _zoo.tp_plan(model)
    if plan:
        parallelize_module(model, mesh["tp"], plan)
    _zoo.fsdp_wrap(model, mesh["dp"])


def _zoo_rank(layout: str) -> dict[str, dict[str, Any]]:
    """Every zoo model, laid out and materialized on this rank; gathered only after counting."""
    results: dict[str, dict[str, Any]] = {}
    mesh = _mesh(layout)
    for name in _zoo.NAMES:
        model = _zoo.build(name)
        _apply_layout(model, mesh)
        placements = sorted({str(p.placements) for p in model.parameters() if hasattr(p, "placements")})
        error, counts = None, None
        try:
            with count_collectives() as counts:
                keyinit.materialize(model, SEED, init_method=model._init_weights)
        except Exception as exc:  # noqa: BLE001 - reported per model to the parent
            error = f"{type(exc).__name__}: {exc}"
        # Agree on success before gathering, so no rank waits in a gather the others skip.
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        state = full_state(model) if int(ok) == 1 else None
        results[name] = {"error": error, "counts": counts, "state": state, "placements": placements}
    return results


def _run_layout(layout: str) -> list[dict[str, dict[str, Any]]]:
    # CPU only: gloo ranks on a 2-D CPU mesh, even where CUDA exists.
    return run_distributed(_zoo_rank, 4, args=(layout,), timeout=600, env={"CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture(scope="module")
def fsdp4_results():
    return _run_layout("fsdp4")


@pytest.fixture(scope="module")
def fsdp2xtp2_results():
    return _run_layout("fsdp2xtp2")


def _assert_rank_results(per_rank, name: str, layout: str) -> None:
    expected = reference(name)
    for rank, results in enumerate(per_rank):
        result = results[name]
        assert result["error"] is None, f"{name} {layout} rank {rank}: {result['error']}"
        assert result["counts"] == {"c10d": 0, "comm_debug": 0}, (
            f"{name} {layout} rank {rank}: collectives during materialize: {result['counts']}"
        )
        assert_same_bits(result["state"], expected, f"{name} {layout} rank {rank} vs one process")


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", _zoo.NAMES)
def test_fsdp2_four_ranks_bit_identical_without_collectives(name, fsdp4_results):
    placements = fsdp4_results[0][name]["placements"]
    assert any("Shard(dim=0)" in p for p in placements), f"{name}: FSDP2 sharded nothing: {placements}"
    _assert_rank_results(fsdp4_results, name, "fsdp4")


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", _zoo.NAMES)
def test_fsdp2_x_tp_2x2_bit_identical_without_collectives(name, fsdp2xtp2_results):
    placements = fsdp2xtp2_results[0][name]["placements"]
    assert any("_StridedShard" in p for p in placements), f"{name}: no FSDP2 x TP placement: {placements}"
    _assert_rank_results(fsdp2xtp2_results, name, "fsdp2xtp2")
