"""The CLI's layout specs: ``--layouts`` parsed, and which region of each tensor each rank of a layout holds.

Layout names (``fsdp4``, ``fsdp2xtp2``, ``pp2``, ...) are parsed by :func:`parse_layout` into a
:class:`LayoutSpec`, which gives a tensor (a :class:`keyinit.PlanEntry`) its per-rank regions using
:func:`keyinit.layouts.dtensor_region` for the DTensor placements that FSDP2, HSDP, TP and FSDP2xTP
would give each parameter. The model walk and pipeline-stage cuts live in :mod:`keyinit.walk`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from typing import Any, Optional

import attrs
import torch

from keyinit.cli._common import CLIError
from keyinit.model import PlanEntry
from keyinit.regions import Region, make_region

__all__ = [
    "LayoutSpec",
    "parse_layout",
    "ROWWISE_NAMES",
    "tp_shard_dim",
]

#: Most distinct shards ``keyinit verify`` checks for one tensor under one layout.
MAX_DISTINCT_SHARDS = 1 << 16

#: Linear layers that tensor parallelism shards row-wise (input dim) by default, by the leaf module name.
ROWWISE_NAMES = frozenset({"wo", "w2", "o_proj", "down_proj", "out_proj", "c_proj", "fc2", "dense_4h_to_h",
                           "proj_out", "dense"})


# --------------------------------------------------------------------------- layouts


def tp_shard_dim(tensor: PlanEntry, rowwise: frozenset) -> Optional[int]:
    """The tensor dim tensor parallelism shards (torchtitan-style plans), or None for replicated.

    ``nn.Linear``: weight ``Shard(0)`` (column-wise) or ``Shard(1)`` (row-wise, when the
    module's leaf name is in ``rowwise``); bias ``Shard(0)`` (column-wise) or replicated
    (row-wise). ``nn.Embedding``: ``Shard(0)``. Any other tensor of 2 or more dims:
    ``Shard(0)``. 1-D and 0-D tensors of other modules (norms): replicated.
    """
    module, attr = tensor.locations[0]  # its owner
    leaf = tensor.fqn.rsplit(".", 2)[-2] if tensor.fqn.count(".") >= 1 else ""
    if isinstance(module, torch.nn.Linear):
        is_row = leaf in rowwise
        if attr == "weight":
            return 1 if is_row else 0
        if attr == "bias":
            return None if is_row else 0
        return None
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and attr == "weight":
        return 0
    if len(tensor.global_shape) >= 2:
        return 0
    return None


_TOKEN = re.compile(r"^(pp|fsdp|hsdp|dp|tp)?(\d+)$")


@attrs.frozen
class LayoutSpec:
    """A parallel layout: pipeline stages, then a DTensor mesh per stage.

    ``mesh_kinds[i]`` is ``"replicate"`` (DDP / HSDP replicas), ``"fsdp"`` (FSDP2's
    ``Shard(0)``) or ``"tp"`` (tensor parallel); ``mesh_shape[i]`` its size.
    """

    name: str
    pp: int
    mesh_kinds: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    rowwise: frozenset = ROWWISE_NAMES

    @property
    def world_size(self) -> int:
        return self.pp * math.prod(self.mesh_shape)

    def placements(self, tensor: PlanEntry) -> tuple[Any, ...]:
        """The DTensor placements this layout gives ``tensor`` (one per mesh dim).

        FSDP2: ``Shard(0)`` (``_StridedShard(0, split_factor=tp)`` over a TP ``Shard(0)``,
        as ``fully_shard`` does on a TP-parallelized module); 0-D tensors and buffers are
        replicated. TP: see :func:`tp_shard_dim`. Replicas: ``Replicate()``.
        """
        from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

        if tensor.kind != "parameter":  # FSDP2 and TP leave buffers as plain, replicated tensors
            return tuple(Replicate() for _ in self.mesh_kinds)
        tp_dim = tp_shard_dim(tensor, self.rowwise) if "tp" in self.mesh_kinds else None
        tp_size = self.mesh_shape[self.mesh_kinds.index("tp")] if "tp" in self.mesh_kinds else 1
        out: list[Any] = []
        for kind in self.mesh_kinds:
            if kind == "replicate":
                out.append(Replicate())
            elif kind == "fsdp":
                if not tensor.global_shape:
                    out.append(Replicate())
                elif tp_dim == 0:
                    out.append(_StridedShard(0, split_factor=tp_size))
                else:
                    out.append(Shard(0))
            else:  # tp
                out.append(Replicate() if tp_dim is None else Shard(tp_dim))
        return tuple(out)

    def region(self, tensor: PlanEntry, coordinate: tuple[int, ...]) -> Region:
        from torch.distributed.tensor.placement_types import _StridedShard

        from keyinit.layouts import dtensor_region

        if not self.mesh_shape:
            return make_region(tensor.global_shape, None)
        placements = self.placements(tensor)
        strided = any(isinstance(p, _StridedShard) for p in placements)
        return dtensor_region(tensor.global_shape, self.mesh_shape, coordinate, placements,
                              strided_shard_as_shard_order=True if strided else None)

    def distinct_regions(self, tensor: PlanEntry) -> list[tuple[Region, tuple[int, ...], int]]:
        """``(region, a mesh coordinate holding it, how many coordinates hold it)`` for each distinct
        region ranks of this layout hold of ``tensor``: costs grow with the number of distinct shards,
        not with the number of ranks (a mesh dim of size ``k`` that shards a dim of size ``n < k``
        gives ``n`` non-empty chunks and empty ones, which are all alike)."""
        if not self.mesh_shape:
            return [(make_region(tensor.global_shape, None), (), 1)]
        from torch.distributed.tensor.placement_types import Replicate

        placements = self.placements(tensor)
        choices: list[list[tuple[int, int]]] = []
        for size, placement in zip(self.mesh_shape, placements):
            if isinstance(placement, Replicate):
                choices.append([(0, size)])
                continue
            bound = tensor.global_shape[placement.dim] if tensor.global_shape else 0
            if size <= bound + 1:
                choices.append([(c, 1) for c in range(size)])
            else:  # coordinates >= bound all hold empty chunks
                choices.append([(c, 1) for c in range(bound)] + [(bound, size - bound)])
        combos = math.prod(len(c) for c in choices)
        if combos > MAX_DISTINCT_SHARDS:
            raise CLIError(f"{self.name}: {tensor.fqn} would have {combos:,} distinct shards to check "
                           f"(more than {MAX_DISTINCT_SHARDS:,}); choose a smaller layout")
        seen: dict[tuple, list] = {}
        for combo in itertools.product(*choices):
            coordinate = tuple(c for c, _ in combo)
            count = math.prod(w for _, w in combo)
            region = self.region(tensor, coordinate)
            signature = tuple(hashlib.sha256(index.numpy().tobytes()).hexdigest() for index in region.indices)
            entry = seen.get(signature)
            if entry is None:
                seen[signature] = [region, coordinate, count]
            else:
                entry[2] += count
        return [(r, c, n) for r, c, n in seen.values()]

    def describe(self) -> str:
        parts = [f"pp={self.pp}"] if self.pp > 1 else []
        parts += [f"{k}={s}" for k, s in zip(self.mesh_kinds, self.mesh_shape)]
        return f"{self.name} ({', '.join(parts) or 'single process'}; {self.world_size} ranks)"


def parse_layout(text: str, rowwise: frozenset = ROWWISE_NAMES) -> LayoutSpec:
    """Parse a layout name.

    Tokens joined by ``x``: ``ppN`` (pipeline stages; first), ``fsdpN`` (FSDP2,
    ``Shard(0)``), ``fsdpRxS`` or ``hsdpRxS`` (HSDP: FSDP2 on a 2-D mesh, R
    replicas of S shards), ``dpN`` (replicas), ``tpN`` (tensor parallel;
    innermost). ``1`` is a single process. Examples: ``fsdp4``, ``tp2``,
    ``fsdp2xtp2``, ``pp2``, ``fsdp8x8``, ``pp2xfsdp2xtp2``.
    """
    name = text.strip()
    bad = f"bad layout {name!r}"
    hint = " (expected e.g. fsdp4, tp2, fsdp2xtp2, pp2, fsdp8x8, hsdp2x4)"
    if name == "1":
        return LayoutSpec(name, 1, (), (), rowwise)
    tokens = name.lower().split("x") if name else [""]
    parsed = []
    for token in tokens:
        match = _TOKEN.match(token)
        if not match:
            raise CLIError(f"{bad}: cannot parse {token!r}{hint}")
        parsed.append((match.group(1), int(match.group(2))))
    pp = 1
    kinds: list[str] = []
    sizes: list[int] = []
    i = 0
    while i < len(parsed):
        kind, size = parsed[i]
        if size < 1:
            raise CLIError(f"{bad}: sizes must be >= 1")
        nxt = parsed[i + 1] if i + 1 < len(parsed) else None
        if kind == "pp":
            if i != 0:
                raise CLIError(f"{bad}: pp must come first (pp2xfsdp2)")
            pp = size
        elif kind in ("fsdp", "hsdp"):
            if nxt is not None and nxt[0] is None:
                kinds += ["replicate", "fsdp"]
                sizes += [size, nxt[1]]
                i += 1
            elif kind == "hsdp":
                raise CLIError(f"{bad}: hsdp takes two sizes (hsdp2x4: 2 replicas of 4 shards)")
            else:
                kinds.append("fsdp")
                sizes.append(size)
        elif kind == "dp":
            kinds.append("replicate")
            sizes.append(size)
        elif kind == "tp":
            kinds.append("tp")
            sizes.append(size)
        else:
            raise CLIError(f"{bad}: a bare size ({size}) may only follow fsdp (fsdp8x8 = HSDP 8x8){hint}")
        i += 1
    if kinds.count("fsdp") > 1 or kinds.count("tp") > 1:
        raise CLIError(f"{bad}: at most one fsdp and one tp mesh dimension")
    if "tp" in kinds and kinds[-1] != "tp":
        raise CLIError(f"{bad}: tp must be the innermost (last) mesh dimension")
    return LayoutSpec(name, pp, tuple(kinds), tuple(sizes), rowwise)
