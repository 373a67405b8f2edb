"""Layouts: which global elements a local tensor holds.

A :class:`Target` says where an initializer writes: the GLOBAL shape of a
parameter, the :class:`~keyinit.regions.Region` of it that this process holds,
and the plain local tensor (shaped like the region) that receives those
elements. A layout adapter turns a model tensor (plain, DTensor, a declared
manual shard, or anything a third party registers) into a Target.

The adapter protocol is deliberately tiny, in the spirit of
``torch.distributed.algorithms.Join``'s ``Joinable``: implement
:meth:`LayoutAdapter.target` and register the adapter.

Built-in layouts, in the order :func:`target_for` asks them (after the
user-registered adapters):

1. manual shards: a plain local tensor declared to be a region of a global
   parameter, either in a ``{fqn: ManualShard}`` mapping passed to
   :func:`target_for` as ``shards=``, or with :func:`declare_shard` (stored on
   the owning module, so it survives ``module.to_empty()``);
2. DTensor (``torch.distributed.tensor.DTensor``, including FSDP2, TP,
   FSDP+TP and HSDP parameters): the region follows from the device mesh, this
   rank's mesh coordinate and the placements, see :func:`dtensor_region`
   (:mod:`keyinit._sharding.placements`);
3. tensors megatron-core marks as tensor-parallel (``tensor_model_parallel``,
   ``partition_dim``, ``partition_stride``): see :class:`MegatronLayout`;
4. plain tensors: the whole of their global parameter. A plain local shard
   that nothing marks is indistinguishable from a whole tensor: declare it.

Computing a Target never communicates: it reads only the mesh shape, this
rank's coordinate and the placements.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol, Union, runtime_checkable

import attrs
import torch

from keyinit._sharding import megatron as _megatron
from keyinit._sharding.placements import partial_error, placement_classes, placement_str, chunk_bounds, dtensor_region
from keyinit.errors import PlanError
from keyinit.regions import Region, RegionEntry, make_region, normalize_shape

__all__ = [
    "Target",
    "LayoutAdapter",
    "register_layout",
    "unregister_layout",
    "target_for",
    "global_shape",
    "ManualShard",
    "MegatronLayout",
    "declare_shard",
    "declared_shards",
    "undeclare_shard",
    "dtensor_region",
    "chunk_bounds",
    "SHARDS_ATTR",
]

#: Name of the dict attribute :func:`declare_shard` stores on a module: ``{local name: ManualShard}``.
SHARDS_ATTR = "_keyinit_shards"


@attrs.frozen(eq=False)
class Target:
    """A region of a global tensor, and the local tensor that holds it.

    ``out.shape == region.region_shape``; ``region.shape`` is the global shape.
    ``description`` names the layout for reports (e.g. ``"plain"``,
    ``"DTensor[Shard(0)] mesh(2,)"``, ``"manual[0:17, :] of (33, 16)"``).
    """

    fqn: str
    region: Region
    out: torch.Tensor
    description: str = "plain"

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.region.shape


@runtime_checkable
class LayoutAdapter(Protocol):
    """Maps a tensor to the part of its global parameter it holds.

    ``target`` returns ``None`` when the adapter does not handle ``tensor``, so
    the next adapter is asked. ``module``/``name`` are where the tensor lives
    (``getattr(module, name) is tensor``); ``fqn`` is its canonical name.
    """

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        ...


def dtensor_class() -> Optional[type]:
    try:
        import torch.distributed as dist

        if not dist.is_available():  # pragma: no cover - torch built without distributed
            return None
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None
    return DTensor


def _mesh_str(mesh: Any) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    sizes = tuple(int(s) for s in mesh.shape)
    if names:
        return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)) + ")"
    return f"mesh({sizes[0]},)" if len(sizes) == 1 else "mesh(" + ", ".join(map(str, sizes)) + ")"


def _plain_coordinate(coordinate: Optional[Sequence[Any]], fqn: str) -> Optional[tuple[int, ...]]:
    if coordinate is None:
        return None
    try:
        return tuple(int(c) for c in coordinate)
    except Exception as exc:  # noqa: BLE001 - e.g. per-rank SymInts under LocalTensorMode
        raise ValueError(
            f"{fqn}: this process's mesh coordinate {coordinate!r} is not a tuple of ints (several simulated "
            "ranks, e.g. under LocalTensorMode?); target_for describes the tensor of one real rank, "
            "use keyinit.layouts.dtensor_region for each simulated coordinate instead"
        ) from exc


class _DTensorLayout:
    """A DTensor holds the region its mesh coordinate and placements select; ``out`` is its local tensor."""

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        dtensor_cls = dtensor_class()
        if dtensor_cls is None or not isinstance(tensor, dtensor_cls):
            return None
        spec = tensor._spec
        mesh = spec.mesh
        placements = tuple(spec.placements)
        _, _, _, partial_cls = placement_classes()
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, partial_cls):
                raise partial_error(fqn, placement, mesh_dim)
        description = f"DTensor[{', '.join(placement_str(p) for p in placements)}] {_mesh_str(mesh)}"
        coordinate = _plain_coordinate(mesh.get_coordinate(), fqn)
        local = tensor._local_tensor
        region = dtensor_region(
            tuple(tensor.shape),
            tuple(mesh.shape),
            coordinate,
            placements,
            spec.shard_order,
            strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order,
        )
        if coordinate is None:
            # A rank outside the mesh holds an empty local tensor of shape (0,).
            local = local.reshape(region.region_shape)
            description += " (rank not in mesh)"
        if tuple(local.shape) != region.region_shape:
            raise ValueError(
                f"{fqn}: the local tensor of {description} at mesh coordinate {tuple(coordinate or ())} has shape "
                f"{tuple(local.shape)}, but its placements select a region of shape {region.region_shape} of the "
                f"global shape {tuple(tensor.shape)}; keyinit cannot tell which elements it holds"
            )
        return Target(fqn, region, local, description)


# ---------------------------------------------------------------------------
# Manual shards: user-defined parallelism without DTensor.


def _region_str(region: Region) -> str:
    parts = []
    for size, index in zip(region.shape, region.indices):
        n = int(index.numel())
        if n == size and (n == 0 or bool((index == torch.arange(size, device="cpu")).all())):
            parts.append(":")
        elif n == 0:
            parts.append("[]")
        elif n == 1:
            parts.append(str(int(index[0])))
        else:
            start, step = int(index[0]), int(index[1] - index[0])
            if step > 0 and bool((index == torch.arange(n, device="cpu") * step + start).all()):
                stop = start + step * (n - 1) + 1
                parts.append(f"{start}:{stop}" + (f":{step}" if step != 1 else ""))
            else:
                parts.append(f"[{n} indices]")
    return "[" + ", ".join(parts) + "]"


@attrs.frozen(eq=False)
class ManualShard:
    """A plain local tensor is ``full[region]`` of a parameter of shape ``global_shape``.

    ``region`` takes anything :func:`keyinit.regions.make_region` accepts (one
    slice / int sequence / 1-D int tensor per dim, ``None`` for the whole
    tensor, or a :class:`Region`) and is stored normalized. Shapes and indices
    are checked on construction (``ValueError``/``TypeError``/``IndexError``).
    """

    global_shape: tuple[int, ...]
    region: Region = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        shape = normalize_shape(self.global_shape)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "region", make_region(shape, self.region))

    @property
    def region_shape(self) -> tuple[int, ...]:
        return self.region.region_shape

    @property
    def description(self) -> str:
        return f"manual{_region_str(self.region)} of {self.global_shape}"

    def check(self, tensor: torch.Tensor, what: str) -> None:
        """Raise unless ``tensor`` is a plain tensor shaped like the region; errors name ``what``."""
        dtensor_cls = dtensor_class()
        if dtensor_cls is not None and isinstance(tensor, dtensor_cls):
            raise TypeError(
                f"{what} is a DTensor, whose layout keyinit reads from its placements; "
                "declare manual shards only for plain local tensors"
            )
        if tuple(tensor.shape) != self.region_shape:
            raise ValueError(
                f"{what}: the declared region {_region_str(self.region)} of global shape {self.global_shape} "
                f"has shape {self.region_shape}, but the local tensor has shape {tuple(tensor.shape)}"
            )

    def target(self, tensor: torch.Tensor, *, fqn: str) -> Target:
        """The Target writing this shard of ``fqn`` into ``tensor``."""
        self.check(tensor, fqn)
        return Target(fqn, self.region, tensor, self.description)


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def declare_shard(
    module: torch.nn.Module,
    name: str,
    *,
    global_shape: Sequence[int],
    region: Union[None, Region, Sequence[RegionEntry]],
) -> ManualShard:
    """Declare that ``module.<name>`` (a plain local tensor) is ``full[region]`` of a ``global_shape`` parameter.

    For user-defined ("manual") parallelism without DTensor, e.g. a row-sharded
    embedding: ``declare_shard(emb, "weight", global_shape=(V, D),
    region=(slice(r0, r1), slice(None)))``. ``name`` may be dotted
    (``"layers.0.weight"``); the declaration is stored on the module that owns
    the tensor, in its ``_keyinit_shards`` dict, so it survives
    ``module.to_empty()`` (which replaces the Parameter objects but keeps the
    modules). Meta tensors may be declared (their shape is checked). Declaring
    the same name again replaces the declaration. Returns the ManualShard.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"declare_shard needs an nn.Module, got {type(module).__name__}")
    owner, leaf = _owner(module, name)
    tensor = getattr(owner, leaf, None)
    if not isinstance(tensor, torch.Tensor):
        raise AttributeError(
            f"{type(owner).__name__} has no tensor {leaf!r} to declare a shard of"
            + (f" (found {type(tensor).__name__})" if tensor is not None else "")
        )
    shard = ManualShard(global_shape, region)
    shard.check(tensor, f"{type(owner).__name__}.{leaf}")
    shards = owner.__dict__.get(SHARDS_ATTR)
    if shards is None:
        shards = {}
        owner.__dict__[SHARDS_ATTR] = shards
    shards[leaf] = shard
    return shard


def declared_shards(module: torch.nn.Module) -> dict[str, ManualShard]:
    """``{fqn relative to module: ManualShard}`` for every shard declared in ``module``'s tree."""
    found = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for leaf, shard in sub.__dict__.get(SHARDS_ATTR, {}).items():
            found[f"{prefix}.{leaf}" if prefix else leaf] = shard
    return found


def undeclare_shard(module: torch.nn.Module, name: str) -> None:
    """Forget the declaration of ``module.<name>`` (no error if there is none)."""
    owner, leaf = _owner(module, name)
    owner.__dict__.get(SHARDS_ATTR, {}).pop(leaf, None)


class _DeclaredShardLayout:
    """A tensor declared with :func:`declare_shard` holds the declared region."""

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        shard = module.__dict__.get(SHARDS_ATTR, {}).get(name)
        if shard is None:
            return None
        return shard.target(tensor, fqn=fqn)


@attrs.frozen
class MegatronLayout:
    """Megatron-core tensor parallelism: parameters marked ``tensor_model_parallel``.

    megatron-core marks a TP-sharded parameter with ``tensor_model_parallel = True``,
    ``partition_dim`` and ``partition_stride``. Its global shape is the local one with
    ``partition_dim`` multiplied by ``tp_size``; rank ``tp_rank`` holds, along that dim,
    chunks ``k * tp_size + tp_rank`` (``k < partition_stride``) of ``local_size /
    partition_stride`` elements each, as megatron's CPU initialization splits a master weight.

    Where ``tp_rank``/``tp_size`` come from, first that applies:

    1. the layer that owns the parameter: megatron-core layers keep their process group as
       ``self.tp_group`` (the expert tensor-parallel group for expert layers, ``None`` for a
       group of one), so a layer built with an explicit ``tp_group`` is read with it, whatever
       ``parallel_state`` says;
    2. the values of a registered ``MegatronLayout(tp_rank, tp_size)``;
    3. ``megatron.core.parallel_state`` (its expert tensor-parallel group for a layer with
       ``is_expert = True``).

    A registered layout whose values contradict the layer's group, or a size that contradicts
    the layer's own global and per-partition sizes (``output_size`` and
    ``output_size_per_partition``, ...), is a ``ValueError`` naming the FQN. Local shards
    without these markers are plain tensors to keyinit: declare them (:func:`declare_shard`).
    """

    tp_rank: Optional[int] = None
    tp_size: Optional[int] = None

    def _rank_and_size(self, fqn: str, module: Optional[torch.nn.Module] = None) -> tuple[int, int]:

        given = self.tp_rank is not None and self.tp_size is not None
        if module is not None and _megatron.has_layer_group(module):
            rank, size = _megatron.layer_tp(module, fqn)
            if given and (int(self.tp_rank), int(self.tp_size)) != (rank, size):
                raise ValueError(
                    f"{fqn}: the registered MegatronLayout(tp_rank={self.tp_rank}, tp_size={self.tp_size}) "
                    f"contradicts its layer's own tp_group (rank {rank} of {size}); unregister it, keyinit "
                    "reads the layer's group"
                )
            return rank, size
        if given:
            return int(self.tp_rank), int(self.tp_size)
        try:
            return _megatron.parallel_state_tp(bool(getattr(module, "is_expert", False)))
        except Exception as exc:  # noqa: BLE001 - not installed, or not initialized
            raise ValueError(
                f"{fqn} is marked tensor_model_parallel by megatron-core, but keyinit cannot tell this process's "
                f"tensor-parallel rank and size (its layer keeps no tp_group; megatron.core.parallel_state: "
                f"{exc}); register keyinit.layouts.MegatronLayout(tp_rank, tp_size)"
            ) from None

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        if not getattr(tensor, "tensor_model_parallel", False):
            return None
        rank, size = self._rank_and_size(fqn, module)
        if not 0 <= rank < size:
            raise ValueError(f"{fqn}: tensor-parallel rank {rank} is not in [0, {size})")
        shape = tuple(tensor.shape)
        dim = int(getattr(tensor, "partition_dim", 0))
        stride = int(getattr(tensor, "partition_stride", 1))
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"{fqn}: partition_dim {dim} is out of range for a {len(shape)}-D tensor")
        dim %= len(shape)
        if stride < 1 or shape[dim] % stride:
            raise ValueError(f"{fqn}: partition_stride {stride} does not divide its local size {shape[dim]} on "
                             f"partition_dim {dim}")

        _megatron.check_layer_sizes(module, fqn, dim, shape[dim], size)
        chunk = shape[dim] // stride
        rows = torch.cat([torch.arange((k * size + rank) * chunk, (k * size + rank + 1) * chunk, dtype=torch.int64,
                                       device="cpu") for k in range(stride)]) if chunk else \
            torch.zeros(0, dtype=torch.int64, device="cpu")
        global_shape = tuple(s * size if d == dim else s for d, s in enumerate(shape))
        entries: list[Any] = [slice(None)] * len(shape)
        entries[dim] = rows
        region = make_region(global_shape, tuple(entries))
        description = f"megatron TP[{rank}/{size}] dim {dim}" + (f" stride {stride}" if stride > 1 else "")
        return Target(fqn, region, tensor, description)


class _PlainTensorLayout:
    """A plain tensor is the whole of its global parameter."""

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        shape = tuple(tensor.shape)
        return Target(fqn, make_region(shape, None), tensor, "plain")


# The documented registry of layout adapters: user-registered ones are asked first.
_USER_LAYOUTS: list[LayoutAdapter] = []


def register_layout(adapter: LayoutAdapter) -> LayoutAdapter:
    """Register ``adapter`` ahead of the built-in layouts (later registrations win)."""
    if not isinstance(adapter, LayoutAdapter):
        raise TypeError(f"{adapter!r} does not implement LayoutAdapter.target(tensor, *, fqn, module, name)")
    _USER_LAYOUTS.insert(0, adapter)
    return adapter


def unregister_layout(adapter: LayoutAdapter) -> None:
    """Remove a registered adapter (``ValueError`` if it is not registered)."""
    for i, registered in enumerate(_USER_LAYOUTS):
        if registered is adapter:
            del _USER_LAYOUTS[i]
            return
    raise ValueError(f"{adapter!r} is not a registered layout adapter")


_DECLARED = _DeclaredShardLayout()
_MEGATRON = MegatronLayout()
_DTENSOR = _DTensorLayout()
_PLAIN = _PlainTensorLayout()


def _builtin_layouts() -> list[LayoutAdapter]:
    return [_DECLARED, _DTENSOR, _MEGATRON, _PLAIN]


def target_for(
    tensor: torch.Tensor,
    *,
    fqn: str,
    module: torch.nn.Module,
    name: str,
    shards: Optional[Mapping[str, ManualShard]] = None,
    allow_meta: bool = False,
) -> Target:
    """The Target of ``tensor``: the first adapter that handles it decides.

    Order: user-registered adapters (latest first), ``shards[fqn]`` when
    ``shards`` (a ``{fqn: ManualShard}`` mapping) has it, a shard declared with
    :func:`declare_shard` on ``module``, DTensor, plain.

    The Target is checked: ``out`` must be shaped like the region and must not
    be on the meta device (``ValueError`` naming ``fqn``; materialize first, e.g.
    with ``module.to_empty(device=...)``). ``allow_meta=True`` skips the meta
    check, for planning from a meta model (global shapes, regions) before it is
    materialized. Zero-size shards give a valid, empty Target.
    """
    found: Optional[Target] = None
    for adapter in _USER_LAYOUTS:
        found = adapter.target(tensor, fqn=fqn, module=module, name=name)
        if found is not None:
            break
    if found is None and shards is not None and fqn in shards:
        shard = shards[fqn]
        if not isinstance(shard, ManualShard):
            raise TypeError(f"shards[{fqn!r}] must be a keyinit.layouts.ManualShard, got {type(shard).__name__}")
        found = shard.target(tensor, fqn=fqn)
    if found is None:
        for adapter in _builtin_layouts():
            found = adapter.target(tensor, fqn=fqn, module=module, name=name)
            if found is not None:
                break
    if found is None:  # pragma: no cover - the plain layout handles every tensor
        raise TypeError(f"{fqn}: no layout adapter handles a {type(tensor).__name__}")
    if not isinstance(found, Target):
        raise TypeError(f"{fqn}: a layout adapter returned {type(found).__name__}, not a Target")
    if tuple(found.out.shape) != found.region.region_shape:
        raise ValueError(
            f"{fqn}: layout {found.description!r} gives a local tensor of shape {tuple(found.out.shape)} "
            f"for a region of shape {found.region.region_shape}"
        )
    if not allow_meta and found.out.device.type == "meta":
        raise ValueError(
            f"{fqn} ({found.description}) is on the meta device: it has no storage to initialize; "
            "materialize the model first (e.g. module.to_empty(device=...))"
        )
    return found


def resolve_shard_names(
    shards: Mapping[str, Any], names: Mapping[str, str], *, strict: bool = True
) -> dict[str, Any]:
    """``shards`` re-keyed by each tensor's canonical FQN.

    ``names`` maps every name of every tensor of the model (a tied tensor has several) to the
    FQN its layout is looked up under. A shard declared under a tied tensor's other name
    applies to the tensor. A key naming no tensor is a :class:`keyinit.errors.PlanError`
    under ``strict`` (a typo must not silently turn a shard into a whole tensor), and so
    are different shards declared under two names of one tensor.
    """
    resolved: dict[str, Any] = {}
    declared_as: dict[str, str] = {}
    unknown = []
    for name, shard in shards.items():
        if not isinstance(name, str):
            raise PlanError(f"shards must map FQN strings to ManualShard, got key {name!r}")
        fqn = names.get(name)
        if fqn is None:
            unknown.append(name)
            continue
        if fqn in resolved and resolved[fqn] is not shard:
            raise PlanError(f"shards declares {declared_as[fqn]!r} and {name!r}, two names of one tied tensor, "
                            f"with different shards; declare it once", (fqn,))
        resolved[fqn] = shard
        declared_as[fqn] = name
    if unknown and strict:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, list(names), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise PlanError(f"shards names no tensor of this model: {', '.join(hints)}; the tensor would be "
                        f"treated as whole; pass strict=False for a mapping shared by pipeline stages",
                        tuple(unknown))
    return resolved


def global_shape(
    tensor: torch.Tensor,
    *,
    fqn: str,
    module: torch.nn.Module,
    name: str,
    shards: Optional[Mapping[str, ManualShard]] = None,
) -> tuple[int, ...]:
    """The GLOBAL shape of ``tensor``'s parameter, as :func:`target_for` would see it.

    Works on meta tensors (for planning before materialization) and computes
    nothing but the layout: no collectives, no allocation.
    """
    return target_for(tensor, fqn=fqn, module=module, name=name, shards=shards, allow_meta=True).global_shape
