"""Acceptance (issue 17 item 6): torchtune's builders through ``keyinit.deferred``.

torchtune 0.6 builds ``RMSNorm.scale`` as ``torch.ones`` in ``__init__`` and computes its RoPE
buffers in the constructor (Llama 3.1's ``rope_init`` returns early on meta), so a model built
on meta has nothing to replay. ``keyinit.deferred(builder, **kwargs)`` records the constructor,
and ``keyinit.materialize`` replays it for the region each rank holds. Tiny models of the
builders as torchtune users call them (Llama 3 in fp32 and bf16, Llama 3.1, Qwen2, Gemma with
tied embeddings, LoRA and DoRA, CLIP's vision encoder, whose layers are ``deepcopy`` clones;
torchtune 0.6 has no MoE builder):

- one process: every tensor follows torchtune's own eager init (the builder run on CPU under
  ``torch.random.fork_rng`` with two global seeds): deterministic tensors (RMSNorm scales,
  ``lora_b`` zeros, RoPE ``theta`` and ``cache``) bit-identical, random ones by a two-sample
  Kolmogorov-Smirnov test and a ratio of standard deviations (``keyinit.cli._fidelity``);
  the global RNG is neither read nor advanced;
- the materialized model runs: its forward equals the eager model's with the same weights,
  and ``setup_caches`` then KV-cached generation give the eager model's tokens and logits;
- real gloo ranks, FSDP2 over 4 ranks (torchtune's ``training.shard_model``) and FSDP2 x TP
  on a 2x2 mesh (``training.prepare_mha_for_tp`` and torchtune's Llama TP plan): every tensor
  bit-identical to the one-process values, with 0 collectives during ``materialize``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from keyinit._engine.capture.capture import CaptureError
from keyinit.cli._fidelity import compare
from tests._support.dist import requires_gloo, run_distributed
from tests._support.vision import define_torchvision_schemas
from tests.init.test_model_dist import count_collectives
from tests.zoo.test_zoo import assert_same_bits, full_state, same_bits

try:  # not pytest.importorskip: without torchao (or with one too new) torchtune raises a plain ImportError
    import torchtune.models.llama3 as llama3_models
except ImportError as exc:
    pytest.skip(f"torchtune cannot be imported (pip install -e '.[test]'): {exc}", allow_module_level=True)

from torchtune.models.gemma import gemma  # noqa: E402
from torchtune.models.llama3 import llama3, lora_llama3  # noqa: E402
from torchtune.models.llama3_1 import llama3_1  # noqa: E402
from torchtune.models.qwen2 import qwen2  # noqa: E402

SEED = 20261124
EAGER_SEEDS = (1, 2)

_DECODER = dict(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64,
                intermediate_dim=96)


def _clip_vision() -> nn.Module:
    """CLIP's vision encoder (Llama 3.2 Vision's): ``VisionTransformer`` deep-copies one layer per
    depth, the CLS embedding, projection and tile/token positions are ``scale * torch.randn``,
    the tile gates zeros."""
    define_torchvision_schemas()  # torchtune.models.clip imports torchvision (see tests/_support/vision.py)
    from torchtune.models.clip import clip_vision_encoder

    return clip_vision_encoder(tile_size=32, patch_size=8, embed_dim=64, num_layers=2, num_heads=4,
                               cls_output_dim=32, max_num_tiles=2, output_cls_projection=True)


def _llama3_bf16() -> nn.Module:
    """As torchtune's recipes build it: parameters in bf16 (the default dtype), RoPE buffers in fp32."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return llama3(**_DECODER)
    finally:
        torch.set_default_dtype(saved)


#: name -> zero-argument builder (a partial: ``keyinit.deferred`` gets its function and arguments, as users call it).
BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama3": functools.partial(llama3, **_DECODER),
    "llama3_bf16": _llama3_bf16,
    "llama3_1": functools.partial(llama3_1, **_DECODER),  # scaled RoPE: a Python loop over the frequencies
    "qwen2": functools.partial(qwen2, **_DECODER),  # q/k/v biases
    "gemma": functools.partial(gemma, vocab_size=128, num_layers=2, num_heads=4, head_dim=16, num_kv_heads=2,
                               embed_dim=64, intermediate_dim=96, max_seq_len=64),  # tied output, (1 + scale) norms
    "lora_llama3": functools.partial(lora_llama3, lora_attn_modules=["q_proj", "v_proj", "output_proj"],
                                     apply_lora_to_mlp=True, apply_lora_to_output=True, lora_rank=4, lora_alpha=8.0,
                                     **_DECODER),
    "clip_vision": _clip_vision,
}
#: Built on the ranks (one launch per layout).
DIST = ("llama3_1", "qwen2", "gemma", "lora_llama3", "clip_vision")


def deferred_state(name: str) -> tuple[nn.Module, keyinit.InitReport, list[str]]:
    """The call under test, and the messages of the ``SharedDrawWarning`` s planning gave."""
    model = _deferred(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", keyinit.SharedDrawWarning)
        report = keyinit.materialize(model, SEED, device="cpu")
    shared = [str(w.message) for w in caught if issubclass(w.category, keyinit.SharedDrawWarning)]
    for w in caught:
        if not issubclass(w.category, keyinit.SharedDrawWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model, report, shared


def _deferred(name: str) -> nn.Module:
    """``keyinit.deferred(llama3, vocab_size=..., ...)``: the builder and its arguments, as users call it."""
    build = BUILDERS[name]
    if isinstance(build, functools.partial):
        return keyinit.deferred(build.func, *build.args, **build.keywords)
    return keyinit.deferred(build)


@functools.lru_cache(maxsize=None)
def _one_process(name: str) -> dict[str, torch.Tensor]:
    return full_state(deferred_state(name)[0])


def eager(name: str, global_seed: int) -> nn.Module:
    """torchtune's own init: the builder on CPU, torch's global RNG seeded ``global_seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(global_seed)
        return BUILDERS[name]()


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", list(BUILDERS))
def test_follows_torchtunes_own_init(name):
    first, second = (full_state(eager(name, s)) for s in EAGER_SEEDS)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    model, report, shared = deferred_state(name)
    assert torch.equal(torch.get_rng_state(), before), f"{name}: deferred/materialize touched the global RNG"
    assert report.defaults == (), f"{name}: torch.nn defaults applied over the constructor: {report.defaults}"
    assert {r.source for r in report.records} == {"constructor"}
    ours = full_state(model)
    assert set(ours) == set(first), sorted(set(ours) ^ set(first))

    checks: dict[str, str] = {}
    wrong = []
    for fqn, keyed in ours.items():
        checks[fqn], difference = compare(keyed, first[fqn], second[fqn])
        if difference is not None:
            wrong.append(f"{fqn} ({checks[fqn]}: {difference})")
    assert not wrong, f"{name}: {len(wrong)} tensors do not follow torchtune's own init: {wrong}"

    # the deterministic tensors were compared bit for bit, and are what torchtune makes them
    exact = {fqn for fqn, check in checks.items() if check == "exact"}
    buffers = {fqn for fqn, _ in model.named_buffers(remove_duplicate=False)}
    assert buffers <= exact, sorted(buffers - exact)
    if name != "clip_vision":
        assert {f for f in ours if f.endswith((".theta", ".cache"))} == buffers and buffers
        norms = [f for f in ours if f.endswith(".scale")]
        assert norms and set(norms) <= exact
        assert all(torch.all(ours[f] == (0 if name == "gemma" else 1)) for f in norms)  # Gemma: x * (1 + scale)
    if name == "lora_llama3":
        zeros = [f for f in ours if f.endswith("lora_b.weight")]
        assert zeros and all(checks[f] == "exact" and torch.count_nonzero(ours[f]) == 0 for f in zeros)
    assert bool(shared) == (name == "clip_vision"), shared
    if name == "clip_vision":  # deepcopy clones: every layer starts as the first, as in eager
        assert all("keyed by 'layers.0." in m for m in shared)  # one draw, keyed by the first tensor it lands in
        for fqn in (f for f in ours if f.startswith("layers.1.")):
            twin = "layers.0." + fqn[len("layers.1."):]
            assert same_bits(ours[fqn], ours[twin]) and same_bits(first[fqn], first[twin]), fqn


def test_the_check_names_a_wrong_init():
    """The comparison above can fail: rules that replace torchtune's init are named, nothing else."""
    first, second = (full_state(eager("llama3", s)) for s in EAGER_SEEDS)
    model = _deferred("llama3")
    keyinit.materialize(model, SEED, device="cpu", rules={
        "norm.scale": keyinit.init.constant(0.5), "output.weight": keyinit.init.normal(std=0.02),
        "layers.0.mlp.w1.weight": keyinit.init.kaiming_uniform(a=5**0.5)})  # nn.Linear's own: still faithful
    wrong = {fqn for fqn, t in full_state(model).items() if compare(t, first[fqn], second[fqn])[1] is not None}
    assert wrong == {"norm.scale", "output.weight"}


def test_on_meta_without_deferred_nothing_covers_the_norms():
    """Why deferred: built on meta, RMSNorm's ``torch.ones`` is lost and Llama 3.1's RoPE has no buffers."""
    with torch.device("meta"):
        model = BUILDERS["llama3_1"]()
    assert not list(model.buffers())
    with pytest.raises(keyinit.PlanError) as info:
        keyinit.materialize(model, SEED, device="cpu")
    assert "layers.0.sa_norm.scale" in info.value.fqns and "norm.scale" in info.value.fqns


@pytest.mark.parametrize("name", ["llama3_1", "gemma", "lora_llama3", "clip_vision"])
def test_forward_matches_eager_with_the_same_weights(name):
    model, _, _ = deferred_state(name)
    reference = BUILDERS[name]()
    reference.load_state_dict(model.state_dict())  # non-persistent RoPE buffers: eager's own (bit-equal)
    if name == "clip_vision":
        images = torch.linspace(-1, 1, 2 * 2 * 3 * 32 * 32).reshape(2, 1, 2, 3, 32, 32)
        ratios = torch.tensor([[[1, 2]], [[2, 1]]])
        (ours, _), (theirs, _) = model(images, ratios), reference(images, ratios)
    else:
        tokens = torch.arange(2 * 24).reshape(2, 24) * 7 % 128
        ours, theirs = model(tokens), reference(tokens)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama3_1", "gemma"])
def test_kv_cached_generation_after_materialize(name):
    """``setup_caches`` on the materialized model, then torchtune's KV-cached ``generate``: the eager
    model's tokens and logits (greedy: ``top_k=1``)."""
    from torchtune.generation import generate

    model, _, _ = deferred_state(name)
    reference = BUILDERS[name]()
    reference.load_state_dict(model.state_dict())
    prompt = torch.tensor([[5, 17, 99, 3, 42, 8], [1, 2, 3, 4, 5, 6]])
    results = []
    for m in (model, reference):
        m.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=16)
        with torch.no_grad():
            results.append(generate(m, prompt, max_generated_tokens=6, top_k=1,
                                    rng=torch.Generator().manual_seed(0)))
        assert m.caches_are_enabled()
    (tokens, logits), (eager_tokens, eager_logits) = results
    assert tokens.shape == (2, 12) and torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-6)
    cache = model.layers[0].attn.kv_cache
    assert not cache.k_cache.is_meta and torch.count_nonzero(cache.k_cache[:, :, :11]) > 0


def test_dora_magnitude_from_its_own_init_method():
    """DoRA's constructor leaves ``magnitude`` as ``torch.empty`` (torchtune fills it once the weights
    are there): a ``PlanError`` naming it, and ``init_method="initialize_dora_magnitude"`` replays
    torchtune's own method on the materialized weights, per shard."""
    build = functools.partial(lora_llama3, lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8.0,
                              use_dora=True, **_DECODER)
    model = keyinit.deferred(build)
    with pytest.raises(keyinit.PlanError) as info:
        keyinit.materialize(model, SEED, device="cpu")
    assert set(info.value.fqns) == {f"layers.{i}.attn.{p}.magnitude" for i in (0, 1) for p in ("q_proj", "v_proj")}
    report = keyinit.materialize(model, SEED, device="cpu", init_method="initialize_dora_magnitude")
    assert set(report.non_local) == set(info.value.fqns)  # a row norm: evaluated whole, still keyed
    for fqn in info.value.fqns:
        dora = model.get_submodule(fqn.rsplit(".", 1)[0])
        with torch.no_grad():
            expected = dora._get_weight_norm(dora.weight, dora.lora_b.weight @ dora.lora_a.weight)
        assert same_bits(dora.magnitude.detach(), expected), fqn


def test_qlora_is_refused_naming_the_builder():
    """QLoRA's NF4Tensor wraps the stand-ins and runs ops on them beneath the capture: a clear error."""
    with pytest.raises(CaptureError, match=r"lora_llama3\(\.\.\.\).*NF4Tensor"):
        keyinit.deferred(lora_llama3, lora_attn_modules=["q_proj"], vocab_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=4, embed_dim=128, max_seq_len=64, intermediate_dim=256, lora_rank=4,
                         lora_alpha=8.0, quantize_base=True)  # NF4 blocks: every weight a multiple of 16384


# ----------------------------------------------------------------------------- real ranks
def _tp_plan(model: nn.Module) -> dict[str, Any]:
    """torchtune's Llama TP plan, for the modules of ``model`` it can shard (LoRA linears stay whole)."""
    plan = {}
    for pattern, style in llama3_models.base_llama_tp_plan().items():
        matches = [m for n, m in model.named_modules() if _matches(n, pattern)]
        if matches and all(type(m) in (nn.Linear, nn.Embedding) for m in matches):
            plan[pattern] = style
    return plan


def _matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in ("*", p) for p, w in zip(parts, wanted))


def _apply_layout(model: nn.Module, layout: str) -> None:
    """As torchtune's distributed recipes: TP first (attention heads scaled to the local shard), then
    FSDP2 per transformer layer and the root (``training.shard_model``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import prepare_mha_for_tp, shard_model

    dp_mesh = None
    if layout == "fsdp2xtp2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = _tp_plan(model)
        assert plan, "nothing to shard over tp"
        prepare_mha_for_tp(model, mesh["tp"])
        parallelize_module(model, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    shard_model(model, [lambda _, m: isinstance(m, TransformerSelfAttentionLayer)], cpu_offload=False,
                dp_mesh=dp_mesh)


def _rank(layout: str) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name in DIST:
        model = _deferred(name)
        _apply_layout(model, layout)
        error, counts = None, None
        try:
            with count_collectives() as counts:
                keyinit.materialize(model, SEED, device="cpu")
        except Exception as exc:  # noqa: BLE001 - reported per model to the parent
            error = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        placements = sorted({str(p.placements) for p in model.parameters() if hasattr(p, "placements")})
        results[name] = {"error": error, "counts": counts, "placements": placements,
                         "state": full_state(model) if int(ok) == 1 else None}
    return results


@pytest.fixture(scope="module", params=["fsdp4", "fsdp2xtp2"])
def layout_results(request) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    """One launch of 4 gloo ranks per layout; each rank builds, lays out and materializes every model."""
    return request.param, run_distributed(_rank, 4, args=(request.param,), timeout=600,
                                          env={"CUDA_VISIBLE_DEVICES": ""})


@requires_gloo
@pytest.mark.slow
def test_bit_identical_on_real_ranks_without_collectives(layout_results):
    layout, per_rank = layout_results
    wanted = "_StridedShard" if layout == "fsdp2xtp2" else "Shard(dim=0)"
    for name in DIST:
        placements = per_rank[0][name]["placements"]
        assert any(wanted in p for p in placements), f"{name} {layout}: not laid out: {placements}"
        expected = _one_process(name)
        for rank, results in enumerate(per_rank):
            result = results[name]
            assert result["error"] is None, f"{name} {layout} rank {rank}: {result['error']}"
            assert result["counts"] == {"c10d": 0, "comm_debug": 0}, (name, layout, rank, result["counts"])
            assert_same_bits(result["state"], expected, f"{name} {layout} rank {rank} vs one process")
