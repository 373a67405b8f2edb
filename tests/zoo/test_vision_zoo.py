"""Acceptance (issue 13): models that keep their init in ``__init__``, built with ``keyinit.deferred``.

Every torchvision, timm and open_clip model of ``tests/_support/vision_zoo.py`` and every HF model
of ``tests/_support/hf_zoo.py`` is built as ``keyinit.deferred(builder)`` and initialized with
``keyinit.materialize(model, seed, device="cpu")`` and nothing else. The tests check:

- one process: every tensor follows the model's OWN eager init (the builder run on CPU with
  torch's RNG, twice, under two global seeds): a tensor the eager init makes deterministic
  is bit-identical to it; a random one passes a two-sample Kolmogorov-Smirnov test against
  the eager draws; values do not depend on ``torch.manual_seed`` and the global RNG is
  neither read nor advanced; every tensor's values come from its constructor's record;
- the check can fail: the same model built on meta without ``deferred`` gets torch.nn
  defaults (``report.defaults``), and the check names the tensors that are wrong;
- HF: a deferred model gets exactly the values ``init_method=model._init_weights`` gives
  (the same programs keyed the same way), and CLIP's ``logit_scale``, which
  ``_init_weights`` never writes, comes from its constructor;
- real gloo ranks, FSDP2 over 4 ranks and FSDP2 x TP on a 2x2 mesh (vision models and a
  varied subset of the HF zoo): every tensor bit-identical to the one-process values with 0
  collectives during ``materialize``; the rest of the vision zoo on simulated ranks (every region
  a rank of those layouts holds, replayed in one process as ``keyinit verify`` does).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from tests._support import hf_zoo as _zoo, vision_zoo as _vision_zoo
from tests._support.dist import requires_gloo, run_distributed
from tests.init.test_model_dist import count_collectives
from tests.zoo.test_zoo import assert_same_bits, check_same_distribution, full_state, named_tensors, reference, same_bits

SEED = 20261124

pytest.importorskip("torchvision.version", reason="the vision zoo needs torchvision (pip install -e '.[test]')")


def deferred_state(builder, seed: int = SEED) -> tuple[dict[str, torch.Tensor], keyinit.InitReport]:
    model = keyinit.deferred(builder)
    report = keyinit.materialize(model, seed, device="cpu")
    return full_state(model), report


@functools.lru_cache(maxsize=None)
def eager_state(name: str, global_seed: int) -> dict[str, torch.Tensor]:
    """The model's own init: its builder on CPU with torch's global RNG seeded ``global_seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(global_seed)
        return full_state(_vision_zoo.build(name))


def unfaithful(ours: dict[str, torch.Tensor], eager_a: dict[str, torch.Tensor],
               eager_b: dict[str, torch.Tensor]) -> list[str]:
    """Tensors whose keyed values do not follow the eager init (deterministic: bitwise; random: KS)."""
    assert set(ours) == set(eager_a), sorted(set(ours) ^ set(eager_a))
    wrong = []
    for fqn, a in eager_a.items():
        mine = ours[fqn]
        if mine.dtype != a.dtype or mine.shape != a.shape:
            wrong.append(f"{fqn} (dtype/shape)")
        elif same_bits(a, eager_b[fqn]):
            if not same_bits(mine, a):
                wrong.append(f"{fqn} (deterministic)")
        elif a.is_floating_point():
            try:
                check_same_distribution(mine, torch.cat([a.reshape(-1), eager_b[fqn].reshape(-1)]), fqn)
            except AssertionError as exc:
                wrong.append(f"{fqn} ({exc})")
    return wrong


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", list(_vision_zoo.VISION))
def test_deferred_follows_the_models_own_init(name):
    torch.manual_seed(1)
    before = torch.get_rng_state()
    ours, report = deferred_state(_vision_zoo.VISION[name])
    assert torch.equal(torch.get_rng_state(), before), f"{name}: deferred/materialize touched the global RNG"
    assert report.defaults == (), f"{name}: torch.nn defaults applied over the constructor: {report.defaults}"
    sources = {r.source for r in report.records}
    assert sources == {"constructor"}, f"{name}: values not from the constructor's record: {sources}"
    wrong = unfaithful(ours, eager_state(name, 0), eager_state(name, 1))
    assert not wrong, f"{name}: {len(wrong)} tensors do not follow the model's own init: {wrong}"

    torch.manual_seed(2)
    again, _ = deferred_state(_vision_zoo.VISION[name])
    assert_same_bits(again, ours, f"{name}: torch.manual_seed(2) vs torch.manual_seed(1)")


@pytest.mark.parametrize("name", ["tv_resnet_bottleneck", "timm_swin", "clip_vit"])
def test_without_deferred_the_defaults_are_reported_and_caught(name):
    """The same model built on meta: its constructor's init is lost; the report and the check say so."""
    with torch.device("meta"):
        model = _vision_zoo.build(name)
    if any(t.device.type != "meta" for _, t in named_tensors(model)):
        pytest.skip(f"{name} makes some tensors off meta")
    try:
        report = keyinit.materialize(model, SEED, device="cpu")
    except keyinit.PlanError as exc:  # open_clip's own parameters: nothing covers them
        assert exc.fqns
        return
    assert report.defaults, f"{name}: report.defaults is empty although torch.nn defaults were applied"
    wrong = unfaithful(full_state(model), eager_state(name, 0), eager_state(name, 1))
    assert wrong, f"{name}: the fidelity check did not notice the lost constructor init"


def test_resnet_zero_init_residual_is_exact():
    """torchvision's zero_init_residual: every block's last BN weight exactly 0 (1 without deferred)."""
    ours, _ = deferred_state(_vision_zoo.VISION["tv_resnet_bottleneck"])
    last = [k for k in ours if k.endswith("bn3.weight")]
    assert last and all(torch.count_nonzero(ours[k]) == 0 for k in last), last
    assert all(torch.all(ours[k] == 1) for k in ours if k.endswith("bn1.weight"))


# ----------------------------------------------------------------------------- HF through deferred
@pytest.mark.parametrize("name", _zoo.NAMES)
def test_hf_deferred_equals_init_method(name):
    """``deferred(from_config)`` replays ``post_init``'s ``_init_weights``: the same values, bitwise."""
    model = keyinit.deferred(_zoo.build, name, "cpu")
    report = keyinit.materialize(model, _zoo_seed(), device="cpu")
    assert report.defaults == ()
    assert_same_bits(full_state(model), reference(name), f"{name}: deferred vs init_method=model._init_weights")


def test_hf_clip_logit_scale_comes_from_the_constructor():
    """CLIP's ``_init_weights`` never writes ``logit_scale``; built with deferred, the constructor's value is kept."""
    model = keyinit.deferred(_zoo.build, "clip", "cpu")
    keyinit.materialize(model, SEED, device="cpu")
    eager = _zoo.build("clip", "cpu")
    assert same_bits(model.logit_scale.detach(), eager.logit_scale.detach())


def _zoo_seed() -> int:
    from tests.zoo import test_zoo

    return test_zoo.SEED


# ----------------------------------------------------------------------------- real ranks
#: HF models run on real ranks through deferred (tests/zoo/test_zoo.py runs every one through init_method, and
#: test_hf_deferred_equals_init_method shows the two give the same values): tied, padded, encoder-decoder,
#: sinusoids, vision, state-space.
HF_DIST = ("llama_tied", "roberta", "t5", "whisper", "convnext", "mamba")

def _hf_deferred(name: str) -> nn.Module:
    return keyinit.deferred(_zoo.build, name, "cpu")


def _apply_layout(model: nn.Module, mesh: Any) -> None:
    """As the HF zoo's layouts (TP over "tp" first, then FSDP2 per block and root), but 0-D
    parameters (open_clip's ``logit_scale``, which ``fully_shard`` refuses) are left unsharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    kwargs: dict[str, Any] = {}
    if mesh is not None:
        plan = _zoo.tp_plan(model)
        if plan:
            parallelize_module(model, mesh["tp"], plan)
        kwargs["mesh"] = mesh["dp"]
    scalars = {p for p in model.parameters() if p.dim() == 0}
    for block in _zoo.blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, ignored_params=scalars or None, **kwargs)


def _rank(layout: str) -> dict[str, dict[str, Any]]:
    from tests.zoo.test_zoo import _mesh

    mesh = _mesh(layout)
    results: dict[str, dict[str, Any]] = {}
    builds = [(f"vision:{n}", functools.partial(keyinit.deferred, _vision_zoo.VISION[n])) for n in _vision_zoo.DIST]
    builds += [(f"hf:{n}", functools.partial(_hf_deferred, n)) for n in HF_DIST]
    for label, build in builds:
        model = build()
        _apply_layout(model, mesh)
        error, counts = None, None
        try:
            with count_collectives() as counts:
                keyinit.materialize(model, SEED if label.startswith("vision") else _zoo_seed(), device="cpu")
        except Exception as exc:  # noqa: BLE001 - reported per model to the parent
            error = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        placements = sorted({str(p.placements) for p in model.parameters() if hasattr(p, "placements")})
        results[label] = {"error": error, "counts": counts, "placements": placements,
                          "state": full_state(model) if int(ok) == 1 else None}
    return results


@functools.lru_cache(maxsize=None)
def _layout_results(layout: str) -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_rank, 4, args=(layout,), timeout=900, env={"CUDA_VISIBLE_DEVICES": ""})


@functools.lru_cache(maxsize=None)
def _one_process(label: str) -> dict[str, torch.Tensor]:
    kind, name = label.split(":", 1)
    if kind == "vision":
        return deferred_state(_vision_zoo.VISION[name])[0]
    return reference(name)


_LABELS = [f"vision:{n}" for n in _vision_zoo.DIST] + [f"hf:{n}" for n in HF_DIST]


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp4", "fsdp2xtp2"])
@pytest.mark.parametrize("label", _LABELS)
def test_deferred_bit_identical_on_real_ranks_without_collectives(layout, label):
    per_rank = _layout_results(layout)
    wanted = "_StridedShard" if layout == "fsdp2xtp2" else "Shard(dim=0)"
    placements = per_rank[0][label]["placements"]
    if label.startswith("hf:") or label in ("vision:tv_vit", "vision:timm_vit", "vision:clip_vit"):
        assert any(wanted in p for p in placements), f"{label} {layout}: not laid out: {placements}"
    expected = _one_process(label)
    for rank, results in enumerate(per_rank):
        result = results[label]
        assert result["error"] is None, f"{label} {layout} rank {rank}: {result['error']}"
        assert result["counts"] == {"c10d": 0, "comm_debug": 0}, (label, layout, rank, result["counts"])
        assert_same_bits(result["state"], expected, f"{label} {layout} rank {rank} vs one process")


@pytest.mark.parametrize("name", [n for n in _vision_zoo.VISION if n not in _vision_zoo.DIST])
def test_the_rest_of_the_vision_zoo_is_bit_identical_on_simulated_ranks(name):
    """The vision models not run on real ranks above: every region a rank of FSDP2(4) and FSDP2xTP(2x2)
    would hold, replayed in one process from the DTensor placements (``keyinit verify``), is
    bit-identical to the one-process values."""
    from keyinit.cli.verify import verify

    result = verify(_vision_zoo.VISION[name], ["fsdp4", "fsdp2xtp2"], SEED, progress=False, label=name,
                    fidelity=False)
    assert result["layouts_ok"], [(p["fqn"], p["bad"]) for p in result["params"] if p["bad"]]
    assert {p["source"] for p in result["params"]} == {"constructor"}
    total = sum(math.prod(p["shape"]) for p in result["params"])
    for summary in result["layouts"]:  # each rank holds a part, not the whole model
        assert summary["identical"] == summary["total"] and summary["max_local_elements"] < total, summary
