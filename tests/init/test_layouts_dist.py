"""Layouts in real multi-process runs (gloo, CPU): DTensor, FSDP2, TP, FSDP+TP, HSDP.

For every parameter, each rank writes ``normal(key, global_shape, region=..., out=local)``
into its own local tensor only; ``param.full_tensor()`` (and FSDP's unshard, and a
forward pass) must then see exactly ``normal(key, global_shape)`` drawn in one
process. Computing the Target and writing must issue no collective
(``CommDebugMode`` counts them).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from keyinit.layouts import target_for

try:  # tests/ as a package
    from tests._support.dist import DistributedFailure, requires_gloo, run_distributed
except ImportError:  # tests/ on sys.path (pytest's default rootdir-relative imports)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _dist import DistributedFailure, requires_gloo, run_distributed

pytestmark = requires_gloo

SEED = 1234


# ---------------------------------------------------------------------------
# Child-side helpers (run inside every rank).


def _init_param(module: nn.Module, fqn: str) -> dict:
    """Write keyinit values into ``module``'s parameter ``fqn`` (this rank's part only); no collectives."""
    from torch.distributed.tensor.debug import CommDebugMode

    owner_name, _, leaf = fqn.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    param = getattr(owner, leaf)
    key = keyinit.key_for(SEED, fqn)
    with CommDebugMode() as comm:
        target = target_for(param, fqn=fqn, module=owner, name=leaf)
        keyinit.random.normal(key, target.global_shape, region=target.region, out=target.out)
    return {
        "fqn": fqn,
        "description": target.description,
        "collectives": comm.get_total_counts(),
        "local_shape": tuple(target.out.shape),
        "rows": target.region.indices[0].tolist() if target.region.indices else [],
    }


def _expected(fqn: str, shape) -> torch.Tensor:
    return keyinit.random.normal(keyinit.key_for(SEED, fqn), tuple(shape))


def _full(param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _check_model(model: nn.Module, tag: str) -> list[dict]:
    """Init every parameter, then compare each full tensor with the one-process reference."""
    records = []
    for fqn, _ in list(model.named_parameters()):
        record = _init_param(model, fqn)
        record["tag"] = tag
        records.append(record)
    for record in records:
        param = model.get_parameter(record["fqn"])
        record["equal"] = torch.equal(_full(param), _expected(record["fqn"], param.shape))
    return records


def _check_unsharded(model: nn.Module, records: list[dict], inputs: torch.Tensor) -> None:
    """FSDP's own all-gather (unshard) and a forward pass see the same values."""
    model.unshard()
    for record in records:
        param = model.get_parameter(record["fqn"])
        record["equal_unsharded"] = torch.equal(_full(param), _expected(record["fqn"], param.shape))
    model.reshard()
    model(inputs)  # lazy init re-pads FSDP's sharded storage: values must survive
    for record in records:
        param = model.get_parameter(record["fqn"])
        record["equal_after_forward"] = torch.equal(_full(param), _expected(record["fqn"], param.shape))


def _distribute_checks(mesh, cases, tag) -> list[dict]:
    from torch.distributed.tensor import distribute_tensor

    records = []
    for i, (shape, placements) in enumerate(cases):
        holder = nn.Module()
        holder.w = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))
        records += _check_model(holder, f"{tag}[{i}] {shape}")
    return records


def _mlp(dims, device="meta") -> nn.Sequential:
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers.append(nn.Linear(a, b, device=device))
    return nn.Sequential(*layers)


def _comm_mode_sees_gloo(param) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        param.full_tensor()
    return comm.get_total_counts()


# ---------------------------------------------------------------------------
# Rank bodies.


def _two_ranks() -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    records = _distribute_checks(
        mesh,
        [((33, 16), [Shard(0)]), ((16, 33), [Shard(1)]), ((5, 3), [Replicate()]), ((1, 16), [Shard(0)]),
         ((2, 3, 5), [Shard(2)])],
        "distribute_tensor",
    )

    # FSDP2 from a meta model: uneven [33, 16] (17 + 16 rows) and [1, 33] (rank 1 holds no row).
    fsdp = _mlp([16, 33, 1])
    for layer in fsdp:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp.to_empty(device="cpu")
    fsdp_records = _check_model(fsdp, "fsdp")
    _check_unsharded(fsdp, fsdp_records, torch.ones(2, 16))
    records += fsdp_records

    # FSDP2 of a model built on the CPU (no to_empty): local tensors are views into padded storage.
    fsdp_cpu = _mlp([16, 33, 1], device="cpu")
    for layer in fsdp_cpu:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp_cpu, mesh=mesh)
    cpu_records = _check_model(fsdp_cpu, "fsdp cpu")
    _check_unsharded(fsdp_cpu, cpu_records, torch.ones(2, 16))
    records += cpu_records

    # TP: colwise (weight Shard(0), bias Shard(0)) then rowwise (weight Shard(1), bias Replicate).
    tp = _mlp([16, 9, 5])
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    tp.to_empty(device="cpu")
    records += _check_model(tp, "tp")
    records.append({"tag": "sanity", "full_tensor_collectives": _comm_mode_sees_gloo(tp[0].weight)})
    return records


def _four_ranks() -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    records = _distribute_checks(mesh1, [((3, 5), [Shard(0)]), ((6, 10), [Shard(1)])], "distribute_tensor 1-D")
    records += _distribute_checks(
        mesh2,
        [((5, 7), [Shard(0), Shard(1)]), ((9, 4), [Shard(0), Shard(0)]), ((3, 7), [Shard(1), Shard(1)]),
         ((5, 7), [Replicate(), Shard(1)])],
        "distribute_tensor 2-D",
    )

    # FSDP2 with world size 4 > 3 rows: rank 3 holds nothing.
    small = _mlp([8, 3])
    fully_shard(small, mesh=mesh1)
    small.to_empty(device="cpu")
    small_records = _check_model(small, "fsdp world>rows")
    _check_unsharded(small, small_records, torch.ones(1, 8))
    records += small_records

    # FSDP2 + TP on a 2-D mesh: colwise weight/bias become (_StridedShard(0, sf=2), Shard(0)).
    fsdp_tp = _mlp([16, 18, 6])  # TP: 9 + 9 rows; FSDP then 5 + 4 (uneven forward under TP fails in torch)
    parallelize_module(fsdp_tp, mesh2["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    for layer in fsdp_tp:
        fully_shard(layer, mesh=mesh2["dp"])
    fully_shard(fsdp_tp, mesh=mesh2["dp"])
    fsdp_tp.to_empty(device="cpu")
    fsdp_tp_records = _check_model(fsdp_tp, "fsdp+tp")
    _check_unsharded(fsdp_tp, fsdp_tp_records, torch.ones(2, 16))
    records += fsdp_tp_records

    # HSDP: replicate over mesh dim 0, shard over mesh dim 1.
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = _mlp([16, 33, 3])
    for layer in hsdp:
        fully_shard(layer, mesh=hsdp_mesh)
    fully_shard(hsdp, mesh=hsdp_mesh)
    hsdp.to_empty(device="cpu")
    hsdp_records = _check_model(hsdp, "hsdp")
    _check_unsharded(hsdp, hsdp_records, torch.ones(2, 16))
    records += hsdp_records
    return records


def _six_ranks_uneven_fsdp_tp() -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    # dp=3, tp=2 over 7 rows: FSDP2 stores chunk_dp(chunk_tp(rows)), which torch's per-mesh-dim
    # _StridedShard split (distribute_tensor, compute_local_shape_and_global_offset) does not match.
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp([4, 7])
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    records = _check_model(model, "fsdp+tp uneven")
    _check_unsharded(model, records, torch.ones(2, 4))
    return records


# ---------------------------------------------------------------------------
# Tests (parent side).


def _assert_all_good(results: list[list[dict]]) -> list[dict]:
    flat = []
    for rank, records in enumerate(results):
        for record in records:
            if record.get("tag") == "sanity":
                continue
            where = f"rank {rank} {record['tag']} {record['fqn']} ({record['description']})"
            assert record["collectives"] == 0, f"{where}: {record['collectives']} collectives"
            assert record["equal"], f"{where}: full_tensor differs from the one-process draw"
            for extra in ("equal_unsharded", "equal_after_forward"):
                if extra in record:
                    assert record[extra], f"{where}: {extra} is False"
            flat.append({**record, "rank": rank})
    return flat


def _by(flat, tag, fqn):
    return {r["rank"]: r for r in flat if r["tag"] == tag and r["fqn"] == fqn}


def test_two_ranks_distribute_fsdp_tp():
    results = run_distributed(_two_ranks, 2, timeout=180)
    flat = _assert_all_good(results)
    # The layouts were what we think they were.
    fsdp_w = _by(flat, "fsdp", "0.weight")
    assert fsdp_w[0]["description"] == "DTensor[Shard(0)] mesh(2,)"
    assert [fsdp_w[r]["local_shape"] for r in (0, 1)] == [(17, 16), (16, 16)]
    assert [_by(flat, "fsdp", "1.weight")[r]["local_shape"] for r in (0, 1)] == [(1, 33), (0, 33)]
    assert [_by(flat, "tp", "1.weight")[r]["description"] for r in (0, 1)] == ["DTensor[Shard(1)] mesh(2,)"] * 2
    assert _by(flat, "tp", "1.bias")[0]["description"] == "DTensor[Replicate()] mesh(2,)"
    # CommDebugMode does see gloo collectives (so the zero counts above mean something).
    assert all(r[-1]["full_tensor_collectives"] > 0 for r in results)


def test_four_ranks_fsdp_tp_hsdp():
    results = run_distributed(_four_ranks, 4, timeout=240)
    flat = _assert_all_good(results)
    strided = _by(flat, "fsdp+tp", "0.weight")
    assert strided[0]["description"] == "DTensor[_StridedShard(0, sf=2), Shard(0)] mesh(dp=2, tp=2)"
    # rank = 2 * dp + tp; TP takes rows 0-8 / 9-17, FSDP then splits each 5 + 4: no rank holds a
    # block of the dp-major order.
    assert {r: strided[r]["rows"] for r in range(4)} == {
        0: list(range(0, 5)), 1: list(range(9, 14)), 2: list(range(5, 9)), 3: list(range(14, 18))}
    assert _by(flat, "fsdp+tp", "1.weight")[0]["description"] == "DTensor[Shard(0), Shard(1)] mesh(dp=2, tp=2)"
    hsdp = _by(flat, "hsdp", "0.weight")
    assert hsdp[0]["description"] == "DTensor[Replicate(), Shard(0)] mesh(replicate=2, shard=2)"
    assert {r: hsdp[r]["rows"] for r in range(4)} == {
        0: list(range(17)), 1: list(range(17, 33)), 2: list(range(17)), 3: list(range(17, 33))}
    assert _by(flat, "fsdp world>rows", "0.weight")[3]["local_shape"] == (0, 8)


@pytest.mark.slow
def test_six_ranks_uneven_fsdp_tp_follows_shard_order():
    results = run_distributed(_six_ranks_uneven_fsdp_tp, 6, timeout=300)
    flat = _assert_all_good(results)
    rows = {r: rec["rows"] for r, rec in _by(flat, "fsdp+tp uneven", "0.weight").items()}
    # mesh (dp, tp) = (3, 2), rank = 2 * dp + tp: rank (i, j) holds chunk_i(chunk_j(range(7))).
    assert rows == {0: [0, 1], 1: [4], 2: [2, 3], 3: [5], 4: [], 5: [6]}


def _fails_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever: the harness must kill it
    return dist.get_rank()


def _hangs():
    import time

    time.sleep(60)


def _crashes_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _all_reduce_rank(scale, *, offset):
    t = torch.full((2,), float(dist.get_rank()))
    dist.all_reduce(t)
    return t * scale + offset


def test_harness_reports_child_traceback_and_kills_waiting_ranks():
    with pytest.raises(DistributedFailure, match=r"(?s)rank 1 failed.*RuntimeError: boom on rank 1"):
        run_distributed(_fails_on_rank_1, 2, timeout=60, grace=2)
    with pytest.raises(DistributedFailure, match=r"rank 1 exited with code 3 without reporting"):
        run_distributed(_crashes_on_rank_1, 2, timeout=60, grace=1)
    with pytest.raises(DistributedFailure, match=r"timed out after 4 s"):
        run_distributed(_hangs, 2, timeout=4)


def test_harness_returns_per_rank_values():
    results = run_distributed(_all_reduce_rank, 3, args=(2.0,), kwargs={"offset": 1.0})
    assert [r.tolist() for r in results] == [[7.0, 7.0]] * 3
