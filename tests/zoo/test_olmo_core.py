"""OLMo-core 3 models materialized the way OLMo-core users call keyinit (issue 17).

Tiny configs of several OLMo-core families (OLMo-2, ``llama_like`` with each of its init
methods, tied embeddings, nGPT, a small MoE) are built on meta and materialized with
``keyinit.materialize(model, seed, device=..., init_method="init_weights", init_kwargs=...)``,
``init_kwargs`` being what OLMo-core's train module passes its ``init_weights``
(``max_seq_len``, ``max_local_microbatch_size``, ``device``, ``world_mesh``,
``model_part_idx``). That ``init_weights`` calls ``self.to_empty(...)`` itself, draws from its
own ``torch.Generator``, warms the RoPE and MoE tables in a ``BufferCache`` (a mapping
class, not module buffers) and, for nGPT (``init_weights(*args, **kwargs)``), normalizes
every matrix afterwards. The tests check:

- one process: every tensor follows OLMo-core's own eager ``init_weights`` on CPU (run
  twice with two ``init_seed``s: identical in both, so deterministic, means bit-identical;
  otherwise a KS and a std-ratio test, :func:`keyinit.cli._fidelity.compare`); the global
  RNG is neither read nor advanced; the caches hold real tensors bit-identical to eager's,
  and the model runs forward;
- real gloo ranks, FSDP2 over 4 ranks and FSDP2 x TP on a 2x2 mesh, laid out with
  OLMo-core's own ``apply_tp``/``prepare_experts_for_fsdp``/``apply_fsdp`` (nGPT, which
  OLMo-core cannot tensor-parallelize, with a torch TP plan): every tensor bit-identical to
  the one-process values, with 0 collectives during ``materialize``.

ai2-olmo-core is an optional test dependency: these tests skip without it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from keyinit.cli._fidelity import compare
from tests._support.dist import requires_gloo, run_distributed
from tests.init.test_model_dist import count_collectives



def _import_olmo_core() -> Any:
    """``olmo_core.nn.transformer``, leaving this process's environment as it was: importing
    OLMo-core points ``TRITON_CACHE_DIR`` at a per-process directory it makes under /tmp (asked
    not to here) and sets ``TORCHINDUCTOR_CACHE_DIR``, for every test after it."""
    saved = dict(os.environ)
    os.environ["OLMO_DISABLE_PER_RANK_TRITON_CACHE"] = "1"
    try:
        return pytest.importorskip("olmo_core.nn.transformer", reason="needs ai2-olmo-core (pip install -e '.[test]')")
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)


olmo_transformer = _import_olmo_core()

SEED = 20260117
VOCAB = 256
#: Methods of OLMo-core's InitMethod that llama_like models use (``normalized`` is nGPT's).
LLAMA_INIT_METHODS = [m.value for m in olmo_transformer.InitMethod if m != olmo_transformer.InitMethod.normalized]
FAMILIES = ["olmo2_1M", "olmo2", "tied", "ngpt", "moe", *(f"llama_{m}" for m in LLAMA_INIT_METHODS)]
#: The families run on real ranks (the llama init methods differ only in their standard deviations).
DIST = ["olmo2", "tied", "ngpt", "moe", "llama_llama_depth"]


def _config(name: str, init_seed: int) -> Any:
    """A tiny OLMo-core TransformerConfig of family ``name``."""
    config = olmo_transformer.TransformerConfig
    common = dict(d_model=64, vocab_size=VOCAB, n_layers=2, n_heads=4, hidden_size_multiple_of=64, init_seed=init_seed)
    if name == "olmo2_1M":  # OLMo-core's own smallest OLMo-2 preset
        return config.olmo2_1M(vocab_size=VOCAB, n_layers=2, init_seed=init_seed)
    if name == "olmo2":  # reordered norms and QK norm, as the OLMo-2 presets
        return config.llama_like(**common, block_name=olmo_transformer.TransformerBlockType.reordered_norm,
                                 qk_norm=True, layer_norm_eps=1e-6)
    if name == "tied":
        return config.llama_like(**common, tie_word_embeddings=True)
    if name == "ngpt":
        return config.ngpt_like(**common)
    if name == "moe":
        return config.llama_like_moe(**common, num_experts=4, top_k=2, expert_hidden_size=32,
                                     shared_expert_hidden_size=32)
    if name.startswith("llama_"):
        return config.llama_like(**common, n_kv_heads=2, init_method=olmo_transformer.InitMethod(name[len("llama_"):]))
    raise ValueError(name)  # pragma: no cover - a typo in this file


def _init_kwargs(world_mesh: Any = None) -> dict[str, Any]:
    """What OLMo-core's train module passes ``init_weights`` (train_module/transformer/common.py)."""
    return dict(max_seq_len=64, max_local_microbatch_size=128, device=torch.device("cpu"), world_mesh=world_mesh,
                model_part_idx=0)


def _materialize(model: nn.Module, world_mesh: Any = None) -> keyinit.InitReport:
    return keyinit.materialize(model, SEED, device="cpu", init_method="init_weights",
                               init_kwargs=_init_kwargs(world_mesh))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter under every name (tied ones too), full and on the CPU (gathers DTensors)."""
    out = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().to("cpu").clone()
    return out


def _caches(model: nn.Module) -> dict[str, Any]:
    """Every ``BufferCache`` entry of the model (``namespace/key``), shared stores once."""
    from olmo_core.nn.buffer_cache import BufferCache

    out: dict[str, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, BufferCache):
                for namespace, entries in value._data.items():
                    out.update({f"{namespace}/{key}": tensor for key, tensor in entries.items()})
    return out


@functools.lru_cache(maxsize=None)
def _keyed(name: str) -> tuple[nn.Module, keyinit.InitReport]:
    model = _config(name, 0).build(init_device="meta")
    return model, _materialize(model)


@functools.lru_cache(maxsize=None)
def _eager(name: str, init_seed: int) -> nn.Module:
    """OLMo-core's own init: the model built on CPU, then its ``init_weights``. That draws from a
    generator seeded with ``init_seed``, but first calls every module's ``reset_parameters``, which
    draws from torch's global RNG (and is all the MoE's shared MLP gets): seeded differently too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + init_seed)
        model = _config(name, init_seed).build(init_device="cpu")
        model.init_weights(**_init_kwargs())
    return model


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", FAMILIES)
def test_follows_olmo_cores_own_init(name):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    model, report = _keyed(name)
    assert torch.equal(torch.get_rng_state(), before), f"{name}: materialize touched the global RNG"
    assert {r.source for r in report.records} == {"init_weights"}, report.by_source().keys()
    assert report.defaults == ()
    ours, first, second = _state(model), _state(_eager(name, 0)), _state(_eager(name, 1))
    assert set(ours) == set(first), sorted(set(ours) ^ set(first))
    checks: dict[str, int] = {}
    wrong = _unfaithful(ours, first, second, checks)
    assert not wrong, f"{name}: {len(wrong)} of {len(first)} tensors do not follow OLMo-core's init: {wrong}"
    assert checks.get("distribution", 0) >= 8 and checks.get("exact", 0) >= 1, (name, checks)


def _unfaithful(ours: dict[str, torch.Tensor], first: dict[str, torch.Tensor], second: dict[str, torch.Tensor],
                checks: dict[str, int]) -> list[str]:
    """Tensors whose values do not follow the two eager inits (``checks`` counts the kinds of check)."""
    wrong = []
    for fqn, eager in first.items():
        check, difference = compare(ours[fqn], eager, second[fqn])
        checks[check] = checks.get(check, 0) + 1
        if difference is not None:
            wrong.append(f"{fqn} ({check}: {difference})")
    return wrong


def test_the_check_notices_init_weights_left_out():
    """Without ``init_method``, a meta-built model gets torch.nn's defaults: reported, and the check fails."""
    model = _config("llama_llama", 0).build(init_device="meta")
    report = keyinit.materialize(model, SEED, device="cpu")
    assert report.defaults
    wrong = _unfaithful(_state(model), _state(_eager("llama_llama", 0)), _state(_eager("llama_llama", 1)), {})
    assert any("attention.w_q.weight" in w for w in wrong) and len(wrong) >= 8, wrong


def test_built_with_deferred_gives_the_same_values():
    """``deferred(config.build)`` records the constructor's init; ``init_weights`` starts with
    ``to_empty``, which drops it, then writes every tensor: the values of the model built on meta."""
    model = keyinit.deferred(_config("olmo2", 0).build, init_device="cpu")
    report = _materialize(model)
    assert {r.source for r in report.records} == {"init_weights"}
    expected = _state(_keyed("olmo2")[0])
    ours = _state(model)
    assert all(torch.equal(ours[k], v) for k, v in expected.items())


def test_tied_embeddings_stay_tied():
    model, report = _keyed("tied")
    assert model.lm_head.w_out.weight is model.embeddings.weight
    assert "lm_head.w_out.weight" not in {r.fqn for r in report.records}


def test_ngpt_matrices_are_normalized_as_olmo_core_does():
    """nGPT's ``init_weights(*args, **kwargs)`` is called once; it normalizes every matrix's rows."""
    model, report = _keyed("ngpt")
    matrices = {k: v for k, v in _state(model).items() if v.dim() == 2}
    eager = _state(_eager("ngpt", 0))
    assert len(matrices) >= 10
    for fqn, weight in matrices.items():
        unit = [d for d in (0, 1) if torch.allclose(eager[fqn].norm(dim=d), torch.ones(()), atol=1e-5)]
        assert unit, f"{fqn}: eager normalizes no dimension"
        for d in unit:
            assert torch.allclose(weight.norm(dim=d), torch.ones(()), atol=1e-5), f"{fqn}: dim {d} not normalized"
    assert set(report.non_local) == set(matrices)  # a norm needs the whole row or column: reported


@pytest.mark.parametrize("name", ["olmo2", "ngpt", "moe"])
def test_caches_hold_real_tensors_equal_to_eagers(name):
    """``init_weights(max_seq_len=...)`` warms the RoPE (and MoE) tables in the BufferCache: real
    tensors, bit-identical to eager's, and the first forward uses them."""
    from keyinit._engine.capture.capture import LazyTensor

    model, _ = _keyed(name)
    ours, eager = _caches(model), _caches(_eager(name, 0))
    assert ours and set(ours) == set(eager), sorted(set(ours) ^ set(eager))
    for key, tensor in ours.items():
        assert type(tensor) is torch.Tensor and not isinstance(tensor, LazyTensor), key
        assert tensor.dtype == eager[key].dtype and torch.equal(tensor, eager[key]), key
    if name != "moe":  # OLMo-core's MoE forward runs Triton kernels (GPU only)
        logits = model(torch.randint(0, VOCAB, (2, 16)))
        assert logits.shape == (2, 16, VOCAB) and torch.isfinite(logits).all()


# ----------------------------------------------------------------------------- real ranks
def _ngpt_tp(model: nn.Module, tp_mesh: Any) -> None:
    """OLMo-core has no TP for nGPT: a torch plan over its linear layers (rowwise where the
    normalization then spans shards)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attention.w_q": ColwiseParallel(), "attention.w_k": ColwiseParallel(),
            "attention.w_v": ColwiseParallel(), "attention.w_out": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)


def _rank() -> dict[str, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, dict[str, Any]] = {}
    for layout in ("fsdp4", "fsdp2xtp2"):
        if layout == "fsdp4":
            world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        else:
            world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for name in DIST:
            model = _config(name, 0).build(init_device="meta")
            if layout == "fsdp2xtp2":  # TP first, then FSDP2 over "dp", as OLMo-core's parallelize_model
                if name == "ngpt":
                    _ngpt_tp(model, world["tp"])
                else:
                    model.apply_tp(world["tp"])
            if model.is_moe:
                model.prepare_experts_for_fsdp(world)
            model.apply_fsdp(dp_mesh=world["dp"])
            error = None
            try:
                with count_collectives() as counts:
                    _materialize(model, world)
            except Exception as exc:  # noqa: BLE001 - reported per model to the parent
                error = f"{type(exc).__name__}: {exc}"
            ok = torch.tensor([0 if error else 1])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            placements = sorted({str(p.placements) for p in model.parameters() if hasattr(p, "placements")})
            results[f"{layout}:{name}"] = {"error": error, "counts": counts, "placements": placements,
                                           "state": _state(model) if int(ok) == 1 else None}
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_rank, 4, timeout=600, env={"CUDA_VISIBLE_DEVICES": ""})


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp4", "fsdp2xtp2"])
@pytest.mark.parametrize("name", DIST)
def test_bit_identical_on_real_ranks_without_collectives(ranks, layout, name):
    label = f"{layout}:{name}"
    wanted = "_StridedShard" if layout == "fsdp2xtp2" else "Shard(dim=0)"
    assert any(wanted in p for p in ranks[0][label]["placements"]), (label, ranks[0][label]["placements"])
    expected = _state(_keyed(name)[0])
    for rank, results in enumerate(ranks):
        result = results[label]
        assert result["error"] is None, f"{label} rank {rank}: {result['error']}"
        assert result["counts"] == {"c10d": 0, "comm_debug": 0}, (label, rank, result["counts"])
        state = result["state"]
        assert set(state) == set(expected)
        differ = [k for k, v in expected.items() if not torch.equal(state[k], v)]
        assert not differ, f"{label} rank {rank}: {len(differ)} of {len(expected)} tensors differ: {differ}"
