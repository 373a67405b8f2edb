"""Simulated ranks in one process: a meta model whose tensors become declared manual shards.

``shard_in_place(model, region_for)`` replaces every tensor of a meta-device
model with a plain CPU tensor holding only ``region_for(...)`` of it, and
declares that with :func:`keyinit.layouts.declare_shard`. ``keyinit.init_model``
then runs its real planner and writer over the model and writes exactly the
elements a rank of that layout would hold. Nothing else is allocated: a tensor
whose region is empty costs no memory.

Layouts (``--layouts`` of ``keyinit verify``) are parsed by :func:`parse_layout`
and turned into per-rank regions by :class:`LayoutSpec`, using
:func:`keyinit.layouts.dtensor_region` for the DTensor placements that FSDP2,
HSDP, TP and FSDP2xTP would give each parameter.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, Optional

import attrs
import torch

from keyinit.cli._common import CLIError
from keyinit.regions import Region, make_region

__all__ = [
    "Slot",
    "slots_of",
    "shard_in_place",
    "empty_region",
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


@attrs.define(eq=False)
class Slot:
    """One distinct tensor of a model: its canonical FQN, every (module, attr) location, and metadata."""

    fqn: str
    kind: str
    locations: list[tuple[torch.nn.Module, str, str]]  # (module, attr, fqn at this location)
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def module(self) -> torch.nn.Module:
        return self.locations[0][0]

    @property
    def attr(self) -> str:
        return self.locations[0][1]

    @property
    def names(self) -> list[str]:
        return [name for _, _, name in self.locations]


def slots_of(model: torch.nn.Module) -> list[Slot]:
    """Every distinct tensor of ``model``, named by its first canonical FQN, in module order."""
    from keyinit.fqn import canonical_modules

    by_id: dict[int, Slot] = {}
    order: list[Slot] = []
    for _raw, canonical, module in canonical_modules(model):
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is None:
                    continue
                fqn = f"{canonical}.{attr}" if canonical else attr
                slot = by_id.get(id(tensor))
                if slot is None:
                    slot = Slot(fqn, kind, [], tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad))
                    by_id[id(tensor)] = slot
                    order.append(slot)
                if all(m is not module or a != attr for m, a, _ in slot.locations):
                    slot.locations.append((module, attr, fqn))
    return order


def empty_region(shape: tuple[int, ...]) -> Region:
    """A region of no elements (a 0-D tensor has no empty region: it is its one element)."""
    if not shape:
        return make_region(shape, ())
    return make_region(shape, (slice(0, 0),) + tuple(slice(None) for _ in shape[1:]))


def shard_in_place(model: torch.nn.Module, region_for: Callable[[Slot], Region],
                   slots: Optional[list[Slot]] = None) -> dict[str, tuple[Slot, Region, torch.Tensor]]:
    """Give every tensor of ``model`` a CPU local tensor of ``region_for(slot)`` and declare the shard.

    Returns ``{fqn: (slot, region, local tensor)}``. Tied tensors stay tied.
    """
    from keyinit.layouts import declare_shard

    out = {}
    for slot in slots if slots is not None else slots_of(model):
        region = region_for(slot)
        local = torch.empty(region.region_shape, dtype=slot.dtype, device="cpu")
        new: torch.Tensor = torch.nn.Parameter(local, requires_grad=slot.requires_grad) if slot.kind == "parameter" else local
        for module, attr, _name in slot.locations:
            table = module._parameters if slot.kind == "parameter" else module._buffers
            table[attr] = new
            declare_shard(module, attr, global_shape=slot.shape, region=region)
        out[slot.fqn] = (slot, region, new)
    return out


# --------------------------------------------------------------------------- layouts


def tp_shard_dim(slot: Slot, rowwise: frozenset) -> Optional[int]:
    """The tensor dim tensor parallelism shards (torchtitan-style plans), or None for replicated.

    ``nn.Linear``: weight ``Shard(0)`` (column-wise) or ``Shard(1)`` (row-wise, when the
    module's leaf name is in ``rowwise``); bias ``Shard(0)`` (column-wise) or replicated
    (row-wise). ``nn.Embedding``: ``Shard(0)``. Any other tensor of 2 or more dims:
    ``Shard(0)``. 1-D and 0-D tensors of other modules (norms): replicated.
    """
    module, attr = slot.module, slot.attr
    leaf = slot.fqn.rsplit(".", 2)[-2] if slot.fqn.count(".") >= 1 else ""
    if isinstance(module, torch.nn.Linear):
        is_row = leaf in rowwise
        if attr == "weight":
            return 1 if is_row else 0
        if attr == "bias":
            return None if is_row else 0
        return None
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and attr == "weight":
        return 0
    if len(slot.shape) >= 2:
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

    def ranks(self) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """``(rank, stage, mesh coordinate)`` for every rank, pipeline-major."""
        rank = 0
        for stage in range(self.pp):
            for coordinate in itertools.product(*(range(s) for s in self.mesh_shape)):
                yield rank, stage, coordinate
                rank += 1

    def placements(self, slot: Slot) -> tuple[Any, ...]:
        """The DTensor placements this layout gives ``slot`` (one per mesh dim).

        FSDP2: ``Shard(0)`` (``_StridedShard(0, split_factor=tp)`` over a TP ``Shard(0)``,
        as ``fully_shard`` does on a TP-parallelized module); 0-D tensors and buffers are
        replicated. TP: see :func:`tp_shard_dim`. Replicas: ``Replicate()``.
        """
        from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

        if slot.kind != "parameter":  # FSDP2 and TP leave buffers as plain, replicated tensors
            return tuple(Replicate() for _ in self.mesh_kinds)
        tp_dim = tp_shard_dim(slot, self.rowwise) if "tp" in self.mesh_kinds else None
        tp_size = self.mesh_shape[self.mesh_kinds.index("tp")] if "tp" in self.mesh_kinds else 1
        out: list[Any] = []
        for kind in self.mesh_kinds:
            if kind == "replicate":
                out.append(Replicate())
            elif kind == "fsdp":
                if not slot.shape:
                    out.append(Replicate())
                elif tp_dim == 0:
                    out.append(_StridedShard(0, split_factor=tp_size))
                else:
                    out.append(Shard(0))
            else:  # tp
                out.append(Replicate() if tp_dim is None else Shard(tp_dim))
        return tuple(out)

    def region(self, slot: Slot, coordinate: tuple[int, ...]) -> Region:
        from torch.distributed.tensor.placement_types import _StridedShard

        from keyinit.layouts import dtensor_region

        if not self.mesh_shape:
            return make_region(slot.shape, None)
        placements = self.placements(slot)
        strided = any(isinstance(p, _StridedShard) for p in placements)
        return dtensor_region(slot.shape, self.mesh_shape, coordinate, placements,
                              strided_shard_as_shard_order=True if strided else None)

    def distinct_regions(self, slot: Slot) -> list[tuple[Region, tuple[int, ...], int]]:
        """``(region, a mesh coordinate holding it, how many coordinates hold it)`` for each distinct
        region ranks of this layout hold of ``slot``: costs grow with the number of distinct shards,
        not with the number of ranks (a mesh dim of size ``k`` that shards a dim of size ``n < k``
        gives ``n`` non-empty chunks and empty ones, which are all alike)."""
        if not self.mesh_shape:
            return [(make_region(slot.shape, None), (), 1)]
        from torch.distributed.tensor.placement_types import Replicate

        placements = self.placements(slot)
        choices: list[list[tuple[int, int]]] = []
        for size, placement in zip(self.mesh_shape, placements):
            if isinstance(placement, Replicate):
                choices.append([(0, size)])
                continue
            bound = slot.shape[placement.dim] if slot.shape else 0
            if size <= bound + 1:
                choices.append([(c, 1) for c in range(size)])
            else:  # coordinates >= bound all hold empty chunks
                choices.append([(c, 1) for c in range(bound)] + [(bound, size - bound)])
        combos = math.prod(len(c) for c in choices)
        if combos > MAX_DISTINCT_SHARDS:
            raise CLIError(f"{self.name}: {slot.fqn} would have {combos:,} distinct shards to check "
                           f"(more than {MAX_DISTINCT_SHARDS:,}); choose a smaller layout")
        seen: dict[tuple, list] = {}
        for combo in itertools.product(*choices):
            coordinate = tuple(c for c, _ in combo)
            count = math.prod(w for _, w in combo)
            region = self.region(slot, coordinate)
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


# --------------------------------------------------------------------------- pipeline stages


def _block_container(model: torch.nn.Module) -> Optional[tuple[str, torch.nn.Module]]:
    """The ModuleList/ModuleDict holding the most parameters (the transformer's ``layers``)."""
    from keyinit.fqn import canonical_modules

    best: Optional[tuple[int, str, torch.nn.Module]] = None
    for _raw, canonical, module in canonical_modules(model):
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) and len(module._modules) >= 1:
            numel = sum(math.prod(p.shape) for p in module.parameters())
            if best is None or numel > best[0]:
                best = (numel, canonical, module)
    return None if best is None else (best[1], best[2])


def stage_assignment(model: torch.nn.Module, slots: list[Slot], stages: int) -> dict[str, int]:
    """``{fqn: stage}``: blocks of the largest ModuleList/ModuleDict split into contiguous runs;
    tensors before it go to the first stage, tensors after it to the last."""
    found = _block_container(model)
    if found is None or len(found[1]._modules) < stages:
        # no ModuleList/ModuleDict to split: split the root's children that hold tensors
        children = [n for n, c in model._modules.items() if c is not None and any(True for _ in c.parameters())]
        if len(children) < stages:
            raise CLIError(f"pp{stages}: cannot split the model into {stages} stages: no nn.ModuleList/ModuleDict "
                           f"and only {len(children)} top-level submodules with parameters")
        found = ("", model)
    prefix, container = found
    names = [n for n, c in container._modules.items()
             if c is not None and (container is not model or any(True for _ in c.parameters()))]
    per, extra = divmod(len(names), stages)
    block_stage = {}
    start = 0
    for stage in range(stages):
        count = per + (stage < extra)
        for name in names[start:start + count]:
            block_stage[name] = stage
        start += count
    assignment: dict[str, int] = {}
    seen_block = False
    block_prefix = f"{prefix}." if prefix else ""
    for slot in slots:
        for _module, _attr, fqn in slot.locations:
            if fqn.startswith(block_prefix):
                block = fqn[len(block_prefix):].split(".", 1)[0]
                if block in block_stage:
                    assignment[fqn] = block_stage[block]
                    seen_block = True
                    continue
            assignment[fqn] = stages - 1 if seen_block else 0
    return assignment


def cut_stage(model: torch.nn.Module, slots: list[Slot], assignment: dict[str, int], stage: int) -> list[Slot]:
    """Cut ``model`` in place to pipeline stage ``stage``, torchtitan style, keeping FQNs.

    A submodule whose tensors all belong to other stages is removed: deleted
    from a ModuleList/ModuleDict (the other entries keep their names) or set to
    None in any other parent (``model.tok_embeddings = None``). Remaining tensors
    of other stages are deleted from their module. Returns the kept slots, with
    only their kept locations.
    """
    owned_ids: dict[int, bool] = {}
    for slot in slots:
        for module, attr, fqn in slot.locations:
            owned_ids[id(module)] = owned_ids.get(id(module), False) or assignment[fqn] == stage

    def owns_any(module: torch.nn.Module) -> "bool | None":
        """True if ``module``'s subtree holds a tensor of this stage; None if it holds no tensors at all."""
        any_tensor = False
        for sub in module.modules():
            if id(sub) in owned_ids:
                any_tensor = True
                if owned_ids[id(sub)]:
                    return True
        return False if any_tensor else None

    def prune(module: torch.nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if owns_any(child) is False:
                if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
                    module._modules.pop(name)
                else:
                    module._modules[name] = None
            else:
                prune(child)

    prune(model)
    kept = []
    for slot in slots:
        locations = []
        for module, attr, fqn in slot.locations:
            if assignment[fqn] == stage:
                locations.append((module, attr, fqn))
            else:
                (module._parameters if slot.kind == "parameter" else module._buffers).pop(attr, None)
        if locations:
            kept.append(Slot(locations[0][2], slot.kind, locations, slot.shape, slot.dtype, slot.requires_grad))
    return kept
