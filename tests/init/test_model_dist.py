"""init_model under real multi-process layouts (gloo, CPU): bit-identical to one process, zero collectives.

Each test spawns real ranks with ``tests/_support/dist.py``. Every rank initializes its
own layout of the model; the collectives issued *during* ``init_model`` are
counted two ways (``CommDebugMode`` for DTensor/functional collectives, and
wrappers around every ``torch.distributed`` c10d entry point); full tensors are
gathered only afterwards and compared, bit for bit, with a single-process init.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

import keyinit
from tests._support.dist import run_distributed
from tests._support.models import ConvNet, TinyLlama, full_state, llama_rules, tp_plan

SEED = 1234

_C10D_NAMES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "send", "recv", "isend",
    "irecv", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "monitored_barrier",
)


@contextlib.contextmanager
def count_collectives():
    """Count c10d calls (patched entry points) and DTensor collectives (CommDebugMode)."""
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor.debug import CommDebugMode

    counts = {"c10d": 0, "comm_debug": 0}
    saved = []
    for module in (dist, distributed_c10d):
        for name in _C10D_NAMES:
            original = getattr(module, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def counting(*args, __original=original, **kwargs):
                counts["c10d"] += 1
                return __original(*args, **kwargs)

            saved.append((module, name, original))
            setattr(module, name, counting)
    try:
        with CommDebugMode() as comm:
            yield counts
        counts["comm_debug"] = comm.get_total_counts()
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def reference(model_cls) -> dict[str, torch.Tensor]:
    model = model_cls()
    rules = llama_rules() if model_cls is TinyLlama else None
    keyinit.init_model(model, SEED, rules=rules)
    return full_state(model)


def _init_counted(model, **kwargs):
    with count_collectives() as counts:
        report = keyinit.init_model(model, SEED, **kwargs)
    return report, counts


def _materialize_counted(model, **kwargs):
    with count_collectives() as counts:
        report = keyinit.materialize(model, SEED, device="cpu", **kwargs)
    return report, counts


# ----------------------------------------------------------------------------- per-rank programs
def _fsdp_llama_and_conv():
    from torch.distributed.fsdp import fully_shard

    results = {}
    model = TinyLlama()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    report, counts = _init_counted(model, rules=llama_rules())
    results["fsdp_llama"] = (full_state(model), counts, report.local_elements, report.elements)

    conv = ConvNet()
    fully_shard(conv)
    report, counts = _init_counted(conv)
    results["fsdp_conv"] = (full_state(conv), counts, report.local_elements, report.elements)

    with torch.device("meta"):
        meta = TinyLlama()
    for block in meta.layers.values():
        fully_shard(block)
    fully_shard(meta)
    report, counts = _materialize_counted(meta, rules=llama_rules())
    results["fsdp_meta_materialize"] = (full_state(meta), counts, report.local_elements, report.elements)
    return results


def _tp_and_pp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    results = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = TinyLlama()
    parallelize_module(model, mesh, tp_plan(model))
    report, counts = _init_counted(model, rules=llama_rules())
    results["tp"] = (full_state(model), counts, report.local_elements, report.elements)

    # torchtitan-style pipeline stage: keep the original FQNs, delete what the stage does not own.
    stage = TinyLlama()
    rank = dist.get_rank()
    if rank == 0:
        del stage.layers["1"]
        stage.norm = None
        stage.output = None
    else:
        del stage.layers["0"]
        stage.tok_embeddings = None
    report, counts = _init_counted(stage, rules=llama_rules(), strict=False)
    results["pp"] = (full_state(stage), counts, report.local_elements, report.elements)
    return results


def _two_d():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    results = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TinyLlama()
    parallelize_module(model, mesh["tp"], tp_plan(model))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {str(p.placements) for p in model.parameters()}
    report, counts = _init_counted(model, rules=llama_rules())
    results["fsdp2xtp2"] = (full_state(model), counts, report.local_elements, report.elements, placements)

    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = TinyLlama()
    for block in hsdp.layers.values():
        fully_shard(block, mesh=hsdp_mesh)
    fully_shard(hsdp, mesh=hsdp_mesh)
    report, counts = _init_counted(hsdp, rules=llama_rules())
    results["hsdp"] = (full_state(hsdp), counts, report.local_elements, report.elements, set())

    fsdp4 = TinyLlama(vocab=3)  # world size 4 > 3 rows: a rank holds an empty shard
    fully_shard(fsdp4)
    report, counts = _init_counted(fsdp4, rules=llama_rules())
    results["fsdp4_empty_shard"] = (full_state(fsdp4), counts, report.local_elements, report.elements, set())
    return results


# ----------------------------------------------------------------------------- assertions
def assert_layout(name, per_rank, expected, *, partial=False):
    for rank, result in enumerate(per_rank):
        state, counts = result[name][0], result[name][1]
        assert counts == {"c10d": 0, "comm_debug": 0}, f"{name} rank {rank}: collectives during init: {counts}"
        if not partial:
            assert set(state) == set(expected), f"{name} rank {rank}: {set(state) ^ set(expected)}"
        for fqn, tensor in state.items():
            assert torch.equal(tensor, expected[fqn]), f"{name} rank {rank}: {fqn} differs from one process"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_uneven_conv_and_meta_materialize(world_size):
    per_rank = run_distributed(_fsdp_llama_and_conv, world_size, timeout=240)
    llama, conv = reference(TinyLlama), reference(ConvNet)
    for name, expected in (("fsdp_llama", llama), ("fsdp_conv", conv), ("fsdp_meta_materialize", llama)):
        assert_layout(name, per_rank, expected)
        # each rank generated only its shard: the local counts add up to the global count
        local = sum(result[name][2] for result in per_rank)
        assert local == per_rank[0][name][3] or name == "fsdp_conv"


@pytest.mark.slow
def test_tp2_and_two_pipeline_stages():
    per_rank = run_distributed(_tp_and_pp, 2, timeout=240)
    llama = reference(TinyLlama)
    assert_layout("tp", per_rank, llama)
    assert_layout("pp", per_rank, llama, partial=True)
    covered = set(per_rank[0]["pp"][0]) | set(per_rank[1]["pp"][0])
    assert covered == set(llama)


@pytest.mark.slow
def test_fsdp2_x_tp_strided_shard_hsdp_and_empty_shards():
    per_rank = run_distributed(_two_d, 4, timeout=300)
    assert_layout("fsdp2xtp2", per_rank, reference(TinyLlama))
    assert any("_StridedShard" in p for p in per_rank[0]["fsdp2xtp2"][4]), per_rank[0]["fsdp2xtp2"][4]
    assert_layout("hsdp", per_rank, reference(TinyLlama))
    expected_small = TinyLlama(vocab=3)
    keyinit.init_model(expected_small, SEED, rules=llama_rules())
    assert_layout("fsdp4_empty_shard", per_rank, full_state(expected_small))
