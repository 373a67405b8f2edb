"""torchtitan 0.3.0's llama3 ``debugmodel`` keyed through the recipe of docs/torchtitan.md (issue 37, item 3).

The recipe (``examples/torchtitan_keyed.py``) plugs into what torchtitan's ``Trainer`` does,
without forking it: the model is built on meta, parallelized by the spec's ``parallelize_fn``
(here torchtitan's own ``parallelize_llama``: FSDP2, selective activation checkpointing as the
debug config has it), moved with ``to_empty`` and initialized by ``model.init_weights(
buffer_device=None)`` under ``torch.no_grad()``, the Trainer's calls in the Trainer's order.
``keyed_model_spec`` makes that ``init_weights`` keyinit's replay of torchtitan's own
``init_states``. The tests check:

- one process: every parameter follows torchtitan's own init in distribution (KS and std
  ratio against two eager inits under different global seeds, :func:`keyinit.cli._fidelity.compare`;
  keyinit replaces the RNG, so not bitwise), the deterministic ones (norms, the RoPE caches)
  bit for bit, and the global RNG neither read nor advanced;
- two pipeline stages cut by torchtitan's own split: each equal to the full model;
- torchtitan's ``parallelize_llama`` (selective AC) on 2 gloo ranks (FSDP2, ``Shard(0)``) and on
  4 (FSDP2 x TP 2x2, the TP plan torchtitan's ``set_llama3_sharding_config`` sets): every parameter
  and buffer bit-identical to the one-process values, with 0 collectives during ``init_weights``;
- data: ``KeyedDataLoader``, built through torchtitan's ``Config.build`` as the Trainer builds its
  dataloader, gives each optimizer step the same samples in the same order on 1 and 2 dp ranks
  (with and without gradient accumulation), and resumes from its state at another dp degree.

torchtitan's ``Trainer`` itself is not run: it needs an accelerator (its device is "cuda"
when none is found) and, in this test environment, importing ``torchtitan.trainer`` fails in
torchao's prototype MoE kernels (torchao <0.14, pinned for torchtune, against triton 3.9).
The RoPE caches are cut to the training ``seq_len`` as the Trainer's ``update_from_config``
cuts them. torchtitan needs Python >= 3.11: these tests skip without it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import keyinit
from keyinit.cli._fidelity import compare
from tests._support.dist import requires_gloo, run_distributed
from tests.init.test_model_dist import count_collectives

titan_llama3 = pytest.importorskip("torchtitan.models.llama3", reason="needs torchtitan (Python >= 3.11)")

from examples.torchtitan_keyed import KeyedDataLoader, TokenWindows, keyed_init_weights, keyed_model_spec  # noqa: E402
from keyinit.data import KeyedSampler  # noqa: E402

SEED = 20260137
SEQ_LEN = 32


def _model_config() -> Any:
    """The debugmodel's config with RoPE caches of ``SEQ_LEN`` rows (the Trainer's ``update_from_config``)."""
    config = titan_llama3.model_registry("debugmodel").model
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    return config


def _as_trainer_allocates(model: torch.nn.Module) -> torch.nn.Module:
    model.to_empty(device="cpu")
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (gathered when sharded) and buffers, under names without checkpoint wrappers."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name.replace("._checkpoint_wrapped_module", "")] = full.detach().clone()
    return out


@functools.lru_cache(maxsize=None)
def _keyed() -> tuple[dict[str, torch.Tensor], keyinit.InitReport, bool]:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with torch.device("meta"):
        model = keyed_init_weights(_model_config().build(), SEED)
    _as_trainer_allocates(model)
    with torch.no_grad():
        report = model.init_weights(buffer_device=None)
    return _state(model), report, torch.equal(torch.get_rng_state(), before)


@functools.lru_cache(maxsize=None)
def _eager(global_seed: int) -> dict[str, torch.Tensor]:
    """torchtitan's own init, drawing from torch's global RNG (seeded, and restored after)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(global_seed)
        with torch.device("meta"):
            model = _model_config().build()
        _as_trainer_allocates(model)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return _state(model)


# ----------------------------------------------------------------------------- init, one process
def test_keyed_init_follows_torchtitans_own_init():
    ours, report, rng_untouched = _keyed()
    assert rng_untouched, "the keyed init_weights read or advanced the global RNG"
    assert {r.source for r in report.records} == {"init_states"}, report.by_source().keys()
    assert report.defaults == ()
    first, second = _eager(0), _eager(1)
    assert set(ours) == set(first), sorted(set(ours) ^ set(first))
    checks: dict[str, int] = {}
    wrong = []
    for fqn, eager in first.items():
        check, difference = compare(ours[fqn], eager, second[fqn])
        checks[check] = checks.get(check, 0) + 1
        if difference is not None:
            wrong.append(f"{fqn} ({check}: {difference})")
    assert not wrong, f"{len(wrong)} of {len(first)} tensors do not follow torchtitan's init: {wrong}"
    # 6 layers x (wqkv, wo, w1, w2, w3) + embeddings + lm_head drawn; 13 norms + 6 RoPE caches exact
    assert checks == {"distribution": 32, "exact": 19}, checks


def test_fused_qkv_draws_distinct_blocks_and_seeds_differ():
    """torchtitan draws the fused wqkv in one ``trunc_normal_``; its rows of q, k and v are distinct
    draws, every layer's differ, and another seed changes every drawn tensor."""
    ours, _, _ = _keyed()
    wqkv = [ours[f"layers.{i}.attention.qkv_linear.wqkv.weight"] for i in range(6)]
    assert float(wqkv[0].abs().max()) <= 2.0 and not torch.equal(wqkv[0][:256], wqkv[0][256:512])
    assert all(not torch.equal(wqkv[i], wqkv[j]) for i in range(6) for j in range(i))
    with torch.device("meta"):
        other = keyed_init_weights(_model_config().build(), SEED + 1)
    _as_trainer_allocates(other)
    with torch.no_grad():
        other.init_weights(buffer_device=None)
    theirs = _state(other)
    drawn = [k for k in ours if not torch.equal(_eager(0)[k], _eager(1)[k])]
    assert len(drawn) == 32 and all(not torch.equal(ours[k], theirs[k]) for k in drawn)


@pytest.mark.slow
def test_two_pipeline_stages_equal_the_full_model():
    """torchtitan's own split (what ``pipeline_llm`` runs before ``parallelize_fn`` on each stage):
    stages keep the full model's FQNs, so each keyed stage holds the full model's values."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _split_module

    expected, _, _ = _keyed()
    with torch.device("meta"):
        whole = _model_config().build()
    covered: set[str] = set()
    for names in _generate_llm_fqn_per_model_part(2, 6):
        stage = keyed_init_weights(_split_module(whole, names), SEED)
        _as_trainer_allocates(stage)
        with torch.no_grad():
            stage.init_weights(buffer_device=None)
        state = _state(stage)
        assert set(state) <= set(expected), sorted(set(state) - set(expected))
        assert all(torch.equal(v, expected[k]) for k, v in state.items()), names
        assert not covered & set(state)
        covered |= set(state)
    assert covered == set(expected), sorted(set(expected) - covered)


# ----------------------------------------------------------------------------- init, gloo ranks
def _titan_rank(tp: int) -> dict[str, Any]:
    """torchtitan's parallelize_llama over all ranks: FSDP2 (``tp == 1``) or FSDP2 x TP, with selective AC."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    # torchtitan picks "cuda" when no accelerator is found; its meshes are built on this device type
    parallel_dims_module.device_type = "cpu"
    spec = keyed_model_spec(titan_llama3.model_registry("debugmodel"), SEED)
    world = dist.get_world_size()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world // tp, tensor_parallel_degree=tp,
                                    spmd_backend="partial_dtensor")
    dims = parallel_dims_module.ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    config = _model_config()
    # the TP plan that the Trainer's update_from_config sets (that method imports torchtitan.trainer)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)

    def parallelized(parallelize_fn: Any) -> torch.nn.Module:
        with torch.device("meta"):
            model = config.build()
        model = parallelize_fn(model, parallel_dims=dims, parallelism=parallelism, compile_config=CompileConfig(),
                               training=TrainingConfig(seq_len=SEQ_LEN, mixed_precision_param="float32"),
                               ac_config=SelectiveAC.Config(), dump_folder="")
        return _as_trainer_allocates(model)

    model = parallelized(spec.parallelize_fn)
    with count_collectives() as counts, torch.no_grad():
        model.init_weights(buffer_device=None)
    plain = parallelized(titan_llama3.parallelize_llama)  # the control: torchtitan's own init, counted alike
    with count_collectives() as plain_counts, torch.no_grad():
        plain.init_weights(buffer_device=None)
    return {"counts": counts, "plain_counts": plain_counts, "class": type(model).__name__, "state": _state(model),
            "placements": sorted({str(p.placements) for p in model.parameters()}),
            "wrapped": any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())}


@requires_gloo
@pytest.mark.slow
@pytest.mark.parametrize("world,tp,placement", [(2, 1, "(Shard(dim=0),)"), (4, 2, "_StridedShard")],
                         ids=["fsdp2", "fsdp2xtp2"])
def test_parallelize_llama_bit_identical_without_collectives(world, tp, placement):
    expected, _, _ = _keyed()
    per_rank = run_distributed(_titan_rank, world, args=(tp,), timeout=400, env={"CUDA_VISIBLE_DEVICES": ""})
    for rank, result in enumerate(per_rank):
        assert result["class"] == "FSDPLlama3Model", result["class"]
        assert any(placement in p for p in result["placements"]), result["placements"]
        assert result["wrapped"], "selective activation checkpointing did not wrap the blocks"
        assert result["counts"] == {"c10d": 0, "comm_debug": 0}, f"rank {rank}: collectives {result['counts']}"
        if tp > 1:  # torchtitan's own init re-distributes the TP-laid RoPE caches: the counter sees that
            assert result["plain_counts"]["comm_debug"] > 0, result["plain_counts"]
        state = result["state"]
        assert set(state) == set(expected), sorted(set(state) ^ set(expected))
        differ = [k for k, v in expected.items() if not (v.dtype == state[k].dtype and torch.equal(v, state[k]))]
        assert not differ, f"rank {rank}: differ from one process: {differ}"


# ----------------------------------------------------------------------------- data order
N_TOKENS = 23 * SEQ_LEN + 1  # 23 windows: steps of 8 cross the epoch boundary


def _windows(tokenizer: Any = None, seq_len: int = SEQ_LEN) -> TokenWindows:
    return TokenWindows(torch.arange(N_TOKENS) * 7 % 1009, seq_len)


def _loaders(world: int, local_batch: int) -> list[KeyedDataLoader]:
    config = KeyedDataLoader.Config(seed=SEED, dataset_fn=_windows)
    return [config.build(dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=SEQ_LEN,
                         local_batch_size=local_batch) for rank in range(world)]


def _steps(loaders: list[KeyedDataLoader], global_batch: int, steps: int) -> list[torch.Tensor]:
    """Each optimizer step's inputs, micro-steps in order, ranks in order inside each micro-step."""
    iterators = [iter(loader) for loader in loaders]
    accumulation = global_batch // (loaders[0].local_batch_size * len(loaders))
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(accumulation):
            for iterator in iterators:
                inputs, labels = next(iterator)
                assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
                rows.append(inputs["input"])
        out.append(torch.cat(rows))
    return out


@pytest.mark.parametrize("world,local_batch", [(2, 4), (2, 2), (4, 2)])
def test_data_order_same_on_one_and_more_ranks(world, local_batch):
    """Global batch 8: one rank with 2 micro-steps of 4 is the reference; 2 ranks without accumulation,
    2 ranks with 2 micro-steps of 2, 4 ranks without: the same samples in the same order each step."""
    steps = 6  # 48 positions over 23 samples: three epochs, steps spanning two of them
    one = _steps(_loaders(1, 4), 8, steps)
    assert all(torch.equal(a, b) for a, b in zip(_steps(_loaders(world, local_batch), 8, steps), one))
    windows = _windows()
    sampler = KeyedSampler(len(windows), SEED, global_batch_size=8, rank=0, world_size=1)
    for t, batch in enumerate(one):  # it is keyinit's keyed global batch of each step
        expected = torch.stack([windows[int(i)][0]["input"] for i in sampler.global_batch(t)])
        assert torch.equal(batch, expected), t
    positions = [int(i) for t in range(3) for i in sampler.global_batch(t)]
    assert sorted(positions[:23]) == list(range(23))  # epoch 0: every window once


def test_resume_at_another_dp_degree():
    """State saved by 2 dp ranks after 3 micro-steps of 2 x 4 positions resumes on 1 rank
    (micro-steps of 4) where an uninterrupted one-rank run is."""
    two = _loaders(2, 4)
    iterators = [iter(loader) for loader in two]
    for _ in range(3):
        for iterator in iterators:
            next(iterator)
    states = [loader.state_dict() for loader in two]
    assert states == [{"keyed_position": 24}] * 2
    resumed = _loaders(1, 4)[0]
    resumed.load_state_dict(states[0])
    uninterrupted = iter(_loaders(1, 4)[0])
    for _ in range(6):
        next(uninterrupted)
    continued = iter(resumed)
    for _ in range(4):
        assert torch.equal(next(continued)[0]["input"], next(uninterrupted)[0]["input"])
    misaligned = _loaders(2, 4)[0]
    misaligned.load_state_dict({"keyed_position": 20})
    with pytest.raises(ValueError, match=r"^KeyedDataLoader: cannot resume at global position 20 with 8 positions "
                                         r"per micro-step \(local_batch_size 4 x dp 2\): it must divide the position$"):
        next(iter(misaligned))


def test_data_seed_changes_the_order_and_torch_rng_is_untouched():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = _steps(_loaders(1, 4), 8, 2)
    assert torch.equal(torch.get_rng_state(), before)
    other = KeyedDataLoader.Config(seed=SEED + 1, dataset_fn=_windows).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=8)
    assert not torch.equal(next(iter(other))[0]["input"], first[0])
