"""DTensor placements as index sets: which global elements rank ``coordinate`` of a device mesh
holds, as a pure function of (global shape, mesh shape, coordinate, placements).

``Shard(d)`` splits dimension ``d`` as ``torch.chunk`` does (:func:`chunk_bounds`: uneven and
empty chunks included), ``_StridedShard`` (FSDP2 x TP) as torch 2.13 lays it out, ``Replicate``
keeps everything and ``Partial`` is refused. :mod:`keyinit.layouts` turns a DTensor parameter
into a :class:`~keyinit.layouts.Target` with :func:`dtensor_region`; ``keyinit verify`` and
keyed dropout use it to place simulated and activation shards. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from keyinit.regions import Region, make_region, normalize_shape

__all__ = ["chunk_bounds", "dtensor_region"]


# ---------------------------------------------------------------------------
# Chunking: torch.chunk semantics, as DTensor's Shard uses them.


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` into ``num_chunks``.

    Chunks have ``ceil(size / num_chunks)`` elements except at the end: the
    last non-empty chunk may be shorter and trailing chunks may be EMPTY (e.g.
    5 over 4 gives 2, 2, 1, 0; 1 over 2 gives 1, 0). Empty chunks are reported
    as ``(size, size)``.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if not 0 <= index < num_chunks:
        raise IndexError(f"chunk index {index} out of range for {num_chunks} chunks")
    full = -(-size // num_chunks)
    return min(full * index, size), min(full * (index + 1), size)


def _chunk(indices: torch.Tensor, num_chunks: int, index: int) -> torch.Tensor:
    start, stop = chunk_bounds(int(indices.numel()), num_chunks, index)
    return indices[start:stop]


def _strided_chunk(indices: torch.Tensor, split_factor: int, num_chunks: int, index: int) -> torch.Tensor:
    """``_StridedShard._split_tensor``: chunk into ``split_factor`` pieces, chunk each piece into
    ``num_chunks``, and concatenate chunk ``index`` of every piece."""
    pieces = [_chunk(indices, split_factor, j) for j in range(split_factor)]
    return torch.cat([_chunk(piece, num_chunks, index) for piece in pieces])


# ---------------------------------------------------------------------------
# DTensor placements, as a pure function of (global shape, mesh shape, coordinate, placements).


def placement_classes() -> tuple[type, type, type, type]:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    return Shard, _StridedShard, Replicate, Partial


def placement_str(placement: Any) -> str:
    _, strided_cls, _, _ = placement_classes()
    if isinstance(placement, strided_cls):
        return f"_StridedShard({placement.dim}, sf={int(placement.split_factor)})"
    return repr(placement).replace("dim=", "")


def partial_error(fqn: str, placement: Any, mesh_dim: int) -> ValueError:
    return ValueError(
        f"keyinit cannot initialize {fqn} ({placement_str(placement)} on mesh dim {mesh_dim}): "
        "a Partial tensor has no element-wise global values (each rank holds a summand); "
        "redistribute it to Shard/Replicate placements first"
    )


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"placement shards dim {dim} of a {ndim}-D tensor")
    return dim + ndim if dim < 0 else dim


def _decode_shard_order(
    ndim: int, mesh_shape: Sequence[int], placements: Sequence[Any]
) -> Optional[dict[int, list[int]]]:
    """Mesh dims that shard each tensor dim, in the order they were applied (torch's shard order).

    Mirrors ``DTensorSpec._maybe_convert_StridedShard_to_shard_order`` (torch 2.13):
    ``_StridedShard(d, sf)`` on mesh dim ``m`` means ``m`` was applied after the
    mesh dims to its right whose sizes multiply to ``sf``. Returns ``None`` when
    the split factors match no order.
    """
    shard_cls, strided_cls, _, _ = placement_classes()
    order: dict[int, list[int]] = {}
    for mesh_dim in reversed(range(len(placements))):
        placement = placements[mesh_dim]
        if not isinstance(placement, (shard_cls, strided_cls)):
            continue
        dims = order.setdefault(_norm_dim(placement.dim, ndim), [])
        split_factor = int(placement.split_factor) if isinstance(placement, strided_cls) else 1
        accumulated = 1
        for position in range(len(dims) + 1):
            if accumulated == split_factor:
                dims.insert(position, mesh_dim)
                break
            if position < len(dims):
                accumulated *= mesh_shape[dims[position]]
        else:
            return None
    return order


def dtensor_region(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Optional[Sequence[int]],
    placements: Sequence[Any],
    shard_order: Optional[Sequence[Any]] = None,
    *,
    strided_shard_as_shard_order: Optional[bool] = None,
) -> Region:
    """The region of a ``global_shape`` tensor that the rank at ``coordinate`` holds.

    ``placements`` has one torch placement per mesh dim (``Replicate``,
    ``Shard(d)``, ``_StridedShard(d, split_factor=sf)``); ``Partial`` raises.
    ``coordinate`` is the rank's mesh coordinate (``mesh.get_coordinate()``),
    or ``None`` for a rank outside the mesh, which holds nothing.
    ``shard_order`` and ``strided_shard_as_shard_order`` are the
    ``DTensorSpec`` fields of the same names (leave them out for the defaults).

    Semantics (torch 2.13, checked against real tensors in the tests):

    - ``Replicate``: every index.
    - ``Shard(d)`` over a mesh dim of size ``k``: the current index vector of
      dim ``d`` is split like ``torch.chunk`` (chunks of ``ceil(n/k)``; trailing
      ranks may get fewer or zero) and the rank keeps chunk ``coordinate[m]``.
      Several mesh dims sharding the same tensor dim nest, in mesh-dim order.
    - ``_StridedShard`` (FSDP2 + TP): like ``DTensorSpec``, the ``_StridedShard``
      split factors encode a shard ORDER (``strided_shard_as_shard_order``,
      default: True iff a ``_StridedShard`` is present): ``_StridedShard(d, sf)``
      on mesh dim ``m`` was applied after the mesh dims to its right whose sizes
      multiply to ``sf``. Each tensor dim is then chunked, ``torch.chunk``-style,
      by its mesh dims in that order. For FSDP2+TP on a ``(dp, tp)`` mesh with
      ``(_StridedShard(0, sf=tp), Shard(0))`` the rank ``(i, j)`` holds
      ``chunk_i(chunk_j(rows))``: what FSDP2 stores and what ``full_tensor()``
      reassembles, also when the sharding is uneven.
    - ``_StridedShard`` whose split factors decode to no order, or with
      ``strided_shard_as_shard_order=False``: ``_StridedShard._split_tensor``
      semantics, applied in ``shard_order`` (default: mesh-dim order): split the
      current vector into ``sf`` chunks, split each into ``k`` chunks, and keep
      the concatenation of chunk ``coordinate[m]`` of every piece.
    - ``shard_order`` (``DTensorSpec.shard_order`` entries with ``tensor_dim``
      and ``mesh_dims``) sets the order of plain ``Shard`` mesh dims when
      ``strided_shard_as_shard_order`` is False.
    """
    shape = normalize_shape(tuple(global_shape))
    ndim = len(shape)
    mesh_shape = tuple(int(size) for size in mesh_shape)
    placements = tuple(placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh_shape)}-D mesh {mesh_shape}")
    if any(size < 1 for size in mesh_shape):
        raise ValueError(f"mesh shape {mesh_shape} must have positive sizes")
    shard_cls, strided_cls, replicate_cls, partial_cls = placement_classes()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, partial_cls):
            raise ValueError(
                f"{placement_str(placement)} on mesh dim {mesh_dim}: a Partial tensor has no element-wise "
                "global values; redistribute it to Shard/Replicate placements first"
            )
        if not isinstance(placement, (shard_cls, strided_cls, replicate_cls)):
            raise TypeError(f"unsupported placement {placement!r} on mesh dim {mesh_dim}")
        if isinstance(placement, (shard_cls, strided_cls)):
            _norm_dim(placement.dim, ndim)
    if coordinate is None:
        return make_region(shape, tuple(torch.zeros(0, dtype=torch.int64) for _ in shape))
    coordinate = tuple(int(c) for c in coordinate)
    if len(coordinate) != len(mesh_shape) or not all(0 <= c < s for c, s in zip(coordinate, mesh_shape)):
        raise ValueError(f"coordinate {coordinate} is not in a mesh of shape {mesh_shape}")

    if strided_shard_as_shard_order is None:
        strided_shard_as_shard_order = any(isinstance(p, strided_cls) for p in placements)
    decoded = _decode_shard_order(ndim, mesh_shape, placements) if strided_shard_as_shard_order else None
    if decoded is not None:
        order = decoded
        strided_as_split = False
    else:
        strided_as_split = True
        order = {}
        if shard_order is not None and not strided_shard_as_shard_order:
            for entry in shard_order:
                order[_norm_dim(entry.tensor_dim, ndim)] = [int(m) for m in entry.mesh_dims]
        else:
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, (shard_cls, strided_cls)):
                    order.setdefault(_norm_dim(placement.dim, ndim), []).append(mesh_dim)
        for tensor_dim, mesh_dims in order.items():
            for mesh_dim in mesh_dims:
                placement = placements[mesh_dim]
                if not isinstance(placement, (shard_cls, strided_cls)) or _norm_dim(placement.dim, ndim) != tensor_dim:
                    raise ValueError(
                        f"shard order puts mesh dim {mesh_dim} on tensor dim {tensor_dim}, "
                        f"but its placement is {placement_str(placement)}"
                    )

    indices = [torch.arange(size, dtype=torch.int64, device="cpu") for size in shape]
    for tensor_dim, mesh_dims in order.items():
        vector = indices[tensor_dim]
        for mesh_dim in mesh_dims:
            placement = placements[mesh_dim]
            if strided_as_split and isinstance(placement, strided_cls):
                vector = _strided_chunk(vector, int(placement.split_factor), mesh_shape[mesh_dim], coordinate[mesh_dim])
            else:
                vector = _chunk(vector, mesh_shape[mesh_dim], coordinate[mesh_dim])
        indices[tensor_dim] = vector
    return make_region(shape, tuple(indices))
