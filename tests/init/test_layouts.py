"""Layouts in one process: DTensor regions against torch's own sharding, manual shards, target_for.

Big meshes are simulated with ``torch.distributed._local_tensor.LocalTensorMode``
over a "fake" process group: ``distribute_tensor`` of an ``arange`` gives every
simulated rank's local tensor, which must equal ``arange[np.ix_(region)]``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import keyinit
from keyinit import layouts
from keyinit.layouts import ManualShard, Target, declare_shard, dtensor_region, target_for
from keyinit.regions import make_region

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

if dist.is_available():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

FAKE_WORLD = 512  # the largest simulated mesh (64 x 8)


@pytest.fixture(scope="module")
def fake_pg():
    """A 'fake' default process group of FAKE_WORLD ranks (this process is rank 0)."""
    if dist.is_initialized():
        if dist.get_world_size() < FAKE_WORLD:
            pytest.skip("a smaller default process group is already initialized")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=FAKE_WORLD, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(shape, names=None):
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).view(shape), mesh_dim_names=names)


def _coord(mesh_shape, rank):
    return tuple(int(c) for c in np.unravel_index(rank, mesh_shape))


def _arange(shape):
    return torch.arange(math.prod(shape), dtype=torch.int64).view(shape)


def _take(full, region):
    return full[np.ix_(*[index.numpy() for index in region.indices])] if full.dim() else full


def _region(shape, mesh_shape, rank, placements, **kwargs):
    return dtensor_region(shape, mesh_shape, _coord(mesh_shape, rank), placements, **kwargs)


def _torch_locals(shape, mesh_shape, placements):
    """Every rank's local tensor of ``distribute_tensor(arange)``, from torch itself."""
    world = math.prod(mesh_shape)
    mesh = _mesh(mesh_shape)
    with LocalTensorMode(frozenset(range(world))):
        dtensor = distribute_tensor(_arange(shape), mesh, placements, src_data_rank=None)
        local = dtensor._local_tensor
    return {r: local._local_tensors[r] for r in range(world)}


def S(d):
    return Shard(d)


def SS(d, sf):
    return _StridedShard(d, split_factor=sf)


R = Replicate() if dist.is_available() else None

# (global shape, mesh shape, placements): torch's distribute_tensor is the reference.
DISTRIBUTE_CASES = [
    ((33, 16), (2,), [S(0)]),  # FSDP-like uneven: 17 + 16 rows
    ((3, 5), (4,), [S(0)]),  # world > dim: the last rank gets zero rows
    ((1, 16), (2,), [S(0)]),
    ((4, 6), (8,), [S(1)]),
    ((5, 7), (3,), [R]),
    ((10, 3), (2, 4), [S(0), S(0)]),  # two mesh dims nest on one tensor dim
    ((9, 7), (2, 2), [S(0), S(1)]),
    ((9, 7), (2, 2), [R, S(0)]),  # HSDP
    ((9, 7), (2, 2), [S(1), R]),
    ((20, 13), (8, 8), [S(0), S(1)]),
    ((3, 100), (8, 8), [S(1), S(1)]),
    ((1000, 2), (64, 8), [S(0), S(0)]),
    ((37, 70), (64, 8), [S(1), S(0)]),  # most ranks hold empty shards
    ((50, 3), (64, 8), [R, S(0)]),
    ((30, 7), (2, 3, 4), [S(0), S(1), S(0)]),
    ((5, 3, 9), (2, 2, 2), [S(2), R, S(0)]),
    ((4, 6, 8), (2, 3, 2), [S(2), S(1), S(2)]),
    ((7,), (3,), [S(0)]),
    # _StridedShard where torch's split semantics and the shard order agree (even sizes).
    ((8, 4), (2, 2), [SS(0, 2), S(0)]),
    ((16, 3), (2, 4), [SS(0, 4), S(0)]),
    ((3, 16), (4, 2), [SS(1, 2), S(1)]),
    ((16, 2), (2, 2, 2), [SS(0, 4), SS(0, 2), S(0)]),
    ((8, 6), (2, 2, 3), [SS(0, 2), S(0), S(1)]),
    ((8, 6), (2, 2, 2), [R, SS(0, 2), S(0)]),  # HSDP + TP
    ((64, 16), (8, 8), [SS(1, 8), S(1)]),
    ((128, 3), (8, 8), [SS(0, 8), S(0)]),
    ((12, 40), (4, 8), [SS(1, 8), S(0)]),
    # split factors that encode no shard order (as view ops produce): _StridedShard._split_tensor
    ((16, 4), (4, 2), [SS(0, 2), S(1)]),
    ((10, 3), (3,), [SS(0, 2)]),
]


def _case_id(case):
    shape, mesh_shape, placements = case
    return f"{shape}-mesh{mesh_shape}-{'_'.join(str(p) for p in placements)}"


@pytest.mark.parametrize("case", DISTRIBUTE_CASES, ids=[_case_id(c) for c in DISTRIBUTE_CASES])
def test_region_matches_distribute_tensor(fake_pg, case):
    shape, mesh_shape, placements = case
    full = _arange(shape)
    locals_ = _torch_locals(shape, mesh_shape, placements)
    for rank, local in locals_.items():
        region = _region(shape, mesh_shape, rank, placements)
        assert region.shape == shape
        assert region.region_shape == tuple(local.shape), (rank, _coord(mesh_shape, rank))
        assert torch.equal(_take(full, region), local), (rank, _coord(mesh_shape, rank))


def _roundtrip_full(shape, mesh_shape, placements, spec_kwargs=None):
    """Build each rank's local tensor as arange[region] and let torch reassemble the whole tensor."""
    world = math.prod(mesh_shape)
    mesh = _mesh(mesh_shape)
    full = _arange(shape)
    with LocalTensorMode(frozenset(range(world))) as mode:
        local = mode.rank_map(lambda r: _take(full, _region(shape, mesh_shape, r, placements, **(spec_kwargs or {}))))
        if spec_kwargs:
            spec = DTensorSpec(
                mesh,
                tuple(placements),
                tensor_meta=TensorMeta(torch.Size(shape), full.stride(), full.dtype),
                shard_order=spec_kwargs.get("shard_order"),
                use_strided_shard_as_shard_order=spec_kwargs.get("strided_shard_as_shard_order"),
            )
            dtensor = DTensor(local, spec, requires_grad=False)
        else:
            dtensor = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=full.stride()
            )
        gathered = dtensor.full_tensor()
    return {r: gathered._local_tensors[r] for r in range(world)}


@pytest.mark.parametrize(
    "shape, mesh_shape, placements",
    [((1024, 2), (64, 8), [SS(0, 8), S(0)]), ((3, 1024), (8, 64), [SS(1, 64), S(1)]),
     ((2048, 2), (16, 8, 4), [SS(0, 32), SS(0, 4), S(0)])],
)
def test_big_mesh_strided_matches_compute_local_shape_and_global_offset(shape, mesh_shape, placements):
    # FSDP (64) x TP (8) sized meshes. Sharding is even here, so torch's per-mesh-dim computation
    # agrees with the shard order and every rank holds one contiguous block per dim.
    # (distribute_tensor under LocalTensorMode checks the same on 8 x 8 above; at 512 ranks it is slow.)
    seen = torch.zeros(shape, dtype=torch.int64)
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        region = dtensor_region(shape, mesh_shape, coord, placements)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert region.region_shape == tuple(local_shape)
        for index, start in zip(region.indices, offset):
            assert index.tolist() == list(range(start, start + index.numel()))
        seen[np.ix_(*[i.numpy() for i in region.indices])] += 1
    assert bool((seen == 1).all())


# Cases where torch's distribute_tensor cannot serve as the reference: uneven _StridedShard
# (distribute_tensor applies _StridedShard._split_tensor mesh dim by mesh dim, which for uneven
# sizes disagrees with what full_tensor()/redistribute and FSDP2 use: the shard ORDER encoded by
# the split factors) and explicit shard orders. full_tensor() of arange[region] must be arange.
ROUNDTRIP_CASES = [
    ((7, 3), (3, 2), [SS(0, 2), S(0)]),  # FSDP(dp=3) + TP(tp=2) on 7 rows
    ((11, 2), (2, 3), [SS(0, 3), S(0)]),
    ((9, 2), (4, 2), [SS(0, 2), S(0)]),
    ((13, 1), (2, 2, 2), [SS(0, 4), SS(0, 2), S(0)]),
    ((3, 5), (2, 2), [SS(0, 2), S(0)]),  # world > rows
    ((5, 7), (2, 2, 3), [R, SS(0, 3), S(0)]),  # HSDP + TP, uneven
    ((10, 7), (2, 4), [S(0), S(0)]),
    ((9, 7), (2, 3), [S(1), S(0)]),
    ((5, 3, 9), (2, 2, 2), [S(2), R, S(0)]),
    ((10, 3), (3,), [SS(0, 2)]),  # no shard order: torch's greedy redistribution, split semantics
    ((11, 4), (3, 2), [SS(0, 2), S(1)]),
]


@pytest.mark.parametrize("case", ROUNDTRIP_CASES, ids=[_case_id(c) for c in ROUNDTRIP_CASES])
def test_region_roundtrips_through_full_tensor(fake_pg, case):
    shape, mesh_shape, placements = case
    for rank, gathered in _roundtrip_full(shape, mesh_shape, placements).items():
        assert torch.equal(gathered, _arange(shape)), rank


def test_uneven_strided_shard_is_right_to_left_chunking():
    # FSDP2 on dp=3 after TP on tp=2 over 7 rows: rank (i, j) holds chunk_i(chunk_j(rows)).
    placements = [SS(0, 2), S(0)]
    rows = {coord: dtensor_region((7,), (3, 2), coord, placements).indices[0].tolist()
            for coord in itertools.product(range(3), range(2))}
    assert rows == {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [], (0, 1): [4], (1, 1): [5], (2, 1): [6]}
    # torch's per-mesh-dim _StridedShard._split_tensor semantics would give (2, 0) row 6 instead:
    split = dtensor_region((7,), (3, 2), (2, 0), placements, strided_shard_as_shard_order=False)
    assert split.indices[0].tolist() == [6]


def test_explicit_shard_order_roundtrips(fake_pg):
    # Tensor dim 0 sharded on mesh dim 1 first, then mesh dim 0 (a DTensorSpec.shard_order).
    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    kwargs = {"shard_order": order, "strided_shard_as_shard_order": False}
    regions = {r: _region((7,), (3, 2), r, [S(0), S(0)], **kwargs).indices[0].tolist() for r in range(6)}
    assert regions == {0: [0, 1], 1: [4], 2: [2, 3], 3: [5], 4: [], 5: [6]}
    for rank, gathered in _roundtrip_full((7, 2), (3, 2), [S(0), S(0)], kwargs).items():
        assert torch.equal(gathered, _arange((7, 2))), rank


# ---------------------------------------------------------------------------
# Property tests: simple placements against compute_local_shape_and_global_offset, coverage.


@st.composite
def _layouts(draw, strided=False):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=mesh_ndim, max_size=mesh_ndim)))
    placements = [draw(st.one_of(st.just(R), st.integers(0, ndim - 1).map(S))) for _ in range(mesh_ndim)]
    order = None
    if strided:
        # A random shard order per tensor dim, encoded the way torch does it (_StridedShard split factors).
        by_dim = {}
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                by_dim.setdefault(p.dim, []).append(mesh_dim)
        order = tuple(
            ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(draw(st.permutations(ms)))) for d, ms in sorted(by_dim.items())
        )
        placements = list(DTensorSpec._convert_shard_order_to_StridedShard(order, tuple(placements), _MeshSizes(mesh_shape)))
    return shape, mesh_shape, placements, order


class _MeshSizes:
    def __init__(self, shape):
        self.shape = shape

    def size(self, dim):
        return self.shape[dim]


def _nested_chunks(shape, mesh_shape, coord, order):
    indices = [list(range(n)) for n in shape]
    for entry in order:
        vector = indices[entry.tensor_dim]
        for m in entry.mesh_dims:
            k = mesh_shape[m]
            size = -(-len(vector) // k)
            vector = vector[size * coord[m]: size * (coord[m] + 1)]
        indices[entry.tensor_dim] = vector
    return indices


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_simple_placements_match_compute_local_shape_and_global_offset(layout):
    shape, mesh_shape, placements, _ = layout
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        region = dtensor_region(shape, mesh_shape, coord, placements)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert region.region_shape == tuple(local_shape)
        for index, start in zip(region.indices, offset):
            if index.numel():
                assert index.tolist() == list(range(start, start + index.numel()))


@settings(max_examples=150, deadline=None)
@given(_layouts(strided=True))
def test_strided_placements_follow_their_shard_order(layout):
    shape, mesh_shape, placements, order = layout
    replicas = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
    counts = torch.zeros(math.prod(shape), dtype=torch.int64)
    full = _arange(shape)
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        region = dtensor_region(shape, mesh_shape, coord, placements)
        assert [i.tolist() for i in region.indices] == _nested_chunks(shape, mesh_shape, coord, order)
        counts[_take(full, region).reshape(-1)] += 1
    assert bool((counts == replicas).all())  # every element held, once per replica


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 3), (4, 3), (2, 2, 2), (3, 2, 2), (2, 3, 4)])
def test_every_shard_order_of_one_dim(mesh_shape):
    # Every order in which the mesh dims can shard dim 0, every size up to 25 (most uneven):
    # the _StridedShard encoding torch builds for that order must give the nested chunks.
    base = tuple(Shard(0) for _ in mesh_shape)
    full = _arange((26,))
    for mesh_dims in itertools.permutations(range(len(mesh_shape))):
        order = (ShardOrderEntry(tensor_dim=0, mesh_dims=mesh_dims),)
        placements = DTensorSpec._convert_shard_order_to_StridedShard(order, base, _MeshSizes(mesh_shape))
        for n in range(26):
            seen = []
            for coord in itertools.product(*[range(k) for k in mesh_shape]):
                region = dtensor_region((n,), mesh_shape, coord, placements)
                assert [region.indices[0].tolist()] == _nested_chunks((n,), mesh_shape, coord, order)
                seen += region.indices[0].tolist()
            assert sorted(seen) == full[:n].tolist()


def test_chunk_bounds_is_torch_chunk():
    for size in range(0, 20):
        for k in range(1, 9):
            pieces = torch.arange(size).chunk(k) if size else ()
            for i in range(k):
                start, stop = layouts.chunk_bounds(size, k, i)
                expected = pieces[i].tolist() if i < len(pieces) else []
                assert list(range(start, stop)) == expected


def test_dtensor_region_errors():
    with pytest.raises(ValueError, match=r"Partial\(sum\) on mesh dim 1.*redistribute"):
        dtensor_region((4, 4), (2, 2), (0, 0), [S(0), Partial()])
    with pytest.raises(ValueError, match="2 placements for a 1-D mesh"):
        dtensor_region((4,), (2,), (0,), [S(0), S(0)])
    with pytest.raises(ValueError, match="not in a mesh"):
        dtensor_region((4,), (2,), (2,), [S(0)])
    with pytest.raises(ValueError, match="shards dim 2 of a 2-D tensor"):
        dtensor_region((4, 4), (2,), (0,), [S(2)])
    outside = dtensor_region((4, 5), (2,), None, [S(0)])
    assert outside.region_shape == (0, 0)
    assert dtensor_region((4, 5), (2,), (1,), [S(-1)]).indices[1].tolist() == [3, 4]


# ---------------------------------------------------------------------------
# The DTensor adapter: target_for on real DTensor objects, one simulated rank at a time.


def _dtensor_for_rank(monkeypatch, mesh, placements, shape, rank, local):
    coord = list(_coord(tuple(mesh.shape), rank))
    monkeypatch.setattr(mesh, "get_coordinate", lambda: coord)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_arange(shape).stride())


@pytest.mark.parametrize(
    "shape, mesh_shape, names, placements, description",
    [
        ((33, 16), (2,), None, [S(0)], "DTensor[Shard(0)] mesh(2,)"),
        ((9, 6), (2, 2), ("dp", "tp"), [SS(0, 2), S(0)], "DTensor[_StridedShard(0, sf=2), Shard(0)] mesh(dp=2, tp=2)"),
        ((5, 6), (2, 3), ("dp", "tp"), [R, S(1)], "DTensor[Replicate(), Shard(1)] mesh(dp=2, tp=3)"),
        ((3, 4), (4,), None, [S(0)], "DTensor[Shard(0)] mesh(4,)"),
    ],
)
def test_target_for_dtensor(fake_pg, monkeypatch, shape, mesh_shape, names, placements, description):
    mesh = _mesh(mesh_shape, names)
    world = math.prod(mesh_shape)
    key = keyinit.key_for(7, "layers.0.w")
    expected = keyinit.random.normal(key, shape)
    assembled = torch.full(shape, float("nan"))
    for rank in range(world):
        region = _region(shape, mesh_shape, rank, placements)
        local = torch.zeros(region.region_shape)
        with monkeypatch.context() as patch:
            dtensor = _dtensor_for_rank(patch, mesh, placements, shape, rank, local)
            holder = torch.nn.Module()
            holder.w = torch.nn.Parameter(dtensor)
            target = target_for(holder.w, fqn="layers.0.w", module=holder, name="w")
        assert target.description == description
        assert target.out is holder.w._local_tensor
        assert target.global_shape == shape
        assert [i.tolist() for i in target.region.indices] == [i.tolist() for i in region.indices]
        keyinit.random.normal(key, target.global_shape, region=target.region, out=target.out)
        assembled[np.ix_(*[i.numpy() for i in target.region.indices])] = holder.w._local_tensor
    assert torch.equal(assembled, expected)


def test_target_for_partial_dtensor_names_fqn(fake_pg, monkeypatch):
    mesh = _mesh((2, 2))
    dtensor = _dtensor_for_rank(monkeypatch, mesh, [S(0), Partial()], (4, 4), 0, torch.zeros(2, 4))
    with pytest.raises(ValueError) as err:
        target_for(dtensor, fqn="layers.0.w", module=torch.nn.Module(), name="w")
    message = str(err.value)
    assert "layers.0.w" in message and "Partial(sum) on mesh dim 1" in message and "redistribute" in message


def test_target_for_meta(fake_pg, monkeypatch):
    holder = torch.nn.Linear(3, 4, device="meta")
    with pytest.raises(ValueError, match=r"lin\.weight \(plain\) is on the meta device.*to_empty"):
        target_for(holder.weight, fqn="lin.weight", module=holder, name="weight")
    planned = target_for(holder.weight, fqn="lin.weight", module=holder, name="weight", allow_meta=True)
    assert planned.global_shape == (4, 3)
    assert layouts.global_shape(holder.weight, fqn="lin.weight", module=holder, name="weight") == (4, 3)
    mesh = _mesh((2,))
    dtensor = _dtensor_for_rank(monkeypatch, mesh, [S(0)], (5, 3), 1, torch.empty(2, 3, device="meta"))
    with pytest.raises(ValueError, match=r"w \(DTensor\[Shard\(0\)\] mesh\(2,\)\) is on the meta device"):
        target_for(dtensor, fqn="w", module=holder, name="w")
    assert target_for(dtensor, fqn="w", module=holder, name="w", allow_meta=True).region.indices[0].tolist() == [3, 4]
    assert layouts.global_shape(dtensor, fqn="w", module=holder, name="w") == (5, 3)
    meta = torch.nn.Embedding(3, 4, device="meta")
    shards = {"emb.weight": ManualShard((10, 4), (slice(3, 6), slice(None)))}
    assert layouts.global_shape(meta.weight, fqn="emb.weight", module=meta, name="weight", shards=shards) == (10, 4)


def test_target_for_empty_shard(fake_pg, monkeypatch):
    mesh = _mesh((4,))
    dtensor = _dtensor_for_rank(monkeypatch, mesh, [S(0)], (3, 5), 3, torch.empty(0, 5))
    target = target_for(dtensor, fqn="w", module=torch.nn.Module(), name="w")
    assert target.region.region_shape == (0, 5) and target.out.numel() == 0
    keyinit.random.normal(keyinit.key(0), target.global_shape, region=target.region, out=target.out)


def test_target_for_dtensor_with_wrong_local_shape(fake_pg, monkeypatch):
    mesh = _mesh((2,))
    dtensor = _dtensor_for_rank(monkeypatch, mesh, [S(0)], (5, 3), 0, torch.zeros(2, 3))  # rank 0 holds 3 rows
    with pytest.raises(ValueError, match=r"w: the local tensor .* has shape \(2, 3\).*region of shape \(3, 3\)"):
        target_for(dtensor, fqn="w", module=torch.nn.Module(), name="w")


def test_target_for_under_local_tensor_mode_says_what_to_do(fake_pg):
    mesh = _mesh((2,))
    with LocalTensorMode(frozenset(range(2))):
        dtensor = distribute_tensor(torch.zeros(5, 3), mesh, [S(0)])
        with pytest.raises(ValueError, match=r"w: this process's mesh coordinate .* use keyinit.layouts.dtensor_region"):
            target_for(dtensor, fqn="w", module=torch.nn.Module(), name="w")


def test_rank_outside_mesh(fake_pg, monkeypatch):
    mesh = _mesh((2,))
    dtensor = _dtensor_for_rank(monkeypatch, mesh, [S(0)], (5, 3), 0, torch.zeros(3, 3))
    monkeypatch.setattr(mesh, "get_coordinate", lambda: None)
    object.__setattr__(dtensor, "_local_tensor", torch.empty(0))
    target = target_for(dtensor, fqn="w", module=torch.nn.Module(), name="w")
    assert target.region.region_shape == (0, 0) and target.out.shape == (0, 0)


# ---------------------------------------------------------------------------
# Manual shards.


def test_declare_shard_row_sharded_embedding_matches_full():
    vocab, dim = 11, 4
    key = keyinit.key_for(3, "emb.weight")
    expected = keyinit.random.normal(key, (vocab, dim))
    cuts = [(0, 4), (4, 8), (8, 11), (11, 11)]  # an empty last shard too
    pieces = []
    for start, stop in cuts:
        model = torch.nn.Module()
        model.emb = torch.nn.Embedding(stop - start, dim, device="meta")
        shard = declare_shard(model, "emb.weight", global_shape=(vocab, dim), region=(slice(start, stop), slice(None)))
        assert layouts.declared_shards(model) == {"emb.weight": shard}
        model.to_empty(device="cpu")  # replaces the Parameter; the declaration lives on the module
        target = target_for(model.emb.weight, fqn="emb.weight", module=model.emb, name="weight")
        assert target.description == f"manual[{start}:{stop}, :] of ({vocab}, {dim})" or stop - start <= 1
        keyinit.random.normal(key, target.global_shape, region=target.region, out=target.out)
        pieces.append(model.emb.weight.detach().clone())
    assert torch.equal(torch.cat(pieces), expected)


def test_declare_shard_index_forms():
    key = keyinit.key(1)
    full = keyinit.random.uniform(key, (6, 5))
    for region in [
        ([5, 0, 2], slice(None)),
        (torch.tensor([-1, 1]), slice(1, None, 2)),
        (slice(None, None, -2), [4]),
        make_region((6, 5), (slice(2, 3), slice(None))),
    ]:
        module = torch.nn.Module()
        shard = ManualShard((6, 5), region)
        module.w = torch.nn.Parameter(torch.empty(shard.region_shape))
        declare_shard(module, "w", global_shape=[6, 5], region=region)
        target = target_for(module.w, fqn="w", module=module, name="w")
        keyinit.random.uniform(key, target.global_shape, region=target.region, out=target.out)
        assert torch.equal(module.w.detach(), _take(full, shard.region))


def test_declare_shard_validation():
    module = torch.nn.Linear(4, 3)  # weight (3, 4)
    with pytest.raises(ValueError, match=r"Linear\.weight: .*region .* has shape \(2, 4\).*local tensor has shape \(3, 4\)"):
        declare_shard(module, "weight", global_shape=(10, 4), region=(slice(0, 2), slice(None)))
    with pytest.raises(TypeError, match="shape must be a tuple of ints"):
        declare_shard(module, "weight", global_shape=(10.0, 4), region=(slice(0, 3), slice(None)))
    with pytest.raises(IndexError, match="out of bounds"):
        declare_shard(module, "weight", global_shape=(10, 4), region=([8, 9, 10], slice(None)))
    with pytest.raises(ValueError, match="region has 1 entries"):
        declare_shard(module, "weight", global_shape=(10, 4), region=(slice(0, 3),))
    with pytest.raises(AttributeError, match="no tensor 'weights'"):
        declare_shard(module, "weights", global_shape=(10, 4), region=(slice(0, 3), slice(None)))
    assert layouts.declared_shards(module) == {}
    declare_shard(module, "bias", global_shape=(9,), region=(slice(3, 6),))
    assert list(layouts.declared_shards(module)) == ["bias"]
    layouts.undeclare_shard(module, "bias")
    assert layouts.declared_shards(module) == {}
    # a declaration checked at write time too: the tensor was swapped for one of another shape
    declare_shard(module, "bias", global_shape=(9,), region=(slice(3, 6),))
    module.bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"head\.bias: .*local tensor has shape \(4,\)"):
        target_for(module.bias, fqn="head.bias", module=module, name="bias")


def test_declare_shard_rejects_dtensor(fake_pg, monkeypatch):
    mesh = _mesh((2,))
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(_dtensor_for_rank(monkeypatch, mesh, [S(0)], (4, 3), 0, torch.zeros(2, 3)))
    with pytest.raises(TypeError, match="is a DTensor"):
        declare_shard(module, "w", global_shape=(4, 3), region=(slice(0, 2), slice(None)))


def test_adapter_order():
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(2, 3))
    assert target_for(module.w, fqn="m.w", module=module, name="w").description == "plain"
    declare_shard(module, "w", global_shape=(8, 3), region=(slice(2, 4), slice(None)))
    assert target_for(module.w, fqn="m.w", module=module, name="w").description == "manual[2:4, :] of (8, 3)"
    shards = {"m.w": ManualShard((4, 3), ([0, 3], slice(None)))}
    assert target_for(module.w, fqn="m.w", module=module, name="w", shards=shards).global_shape == (4, 3)
    assert target_for(module.w, fqn="m.w", module=module, name="w", shards={"x": shards["m.w"]}).global_shape == (8, 3)
    with pytest.raises(TypeError, match=r"shards\['m.w'\] must be a keyinit.layouts.ManualShard"):
        target_for(module.w, fqn="m.w", module=module, name="w", shards={"m.w": (4, 3)})

    class Custom:
        def target(self, tensor, *, fqn, module, name):
            if name != "w":
                return None
            return Target(fqn, make_region((2, 6), (slice(None), slice(0, 3))), tensor, "custom")

    adapter = layouts.register_layout(Custom())
    try:
        found = target_for(module.w, fqn="m.w", module=module, name="w", shards=shards)
        assert found.description == "custom" and found.global_shape == (2, 6)
    finally:
        layouts.unregister_layout(adapter)
    assert target_for(module.w, fqn="m.w", module=module, name="w").description.startswith("manual")
    with pytest.raises(TypeError, match="does not implement LayoutAdapter"):
        layouts.register_layout(object())
    with pytest.raises(ValueError, match="not a registered"):
        layouts.unregister_layout(adapter)


def test_adapter_returning_bad_target_is_caught():
    class Wrong:
        def target(self, tensor, *, fqn, module, name):
            return Target(fqn, make_region((5,), None), tensor, "wrong")

    module = torch.nn.Module()
    module.b = torch.nn.Parameter(torch.zeros(3))
    adapter = layouts.register_layout(Wrong())
    try:
        with pytest.raises(ValueError, match=r"b: layout 'wrong' gives a local tensor of shape \(3,\) for a region of shape \(5,\)"):
            target_for(module.b, fqn="b", module=module, name="b")
    finally:
        layouts.unregister_layout(adapter)
