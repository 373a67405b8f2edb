"""megatron-core's layout facts, read from its modules by duck typing (megatron is never imported here).

Two questions, both answered without communicating:

- which tensor-parallel rank and size a marked parameter (``tensor_model_parallel``) is split
  over: the group of the LAYER that owns it (megatron's ``self.tp_group``, which for expert
  layers is the expert tensor-parallel group), see :func:`layer_tp`;
- what a :func:`keyinit.deferred` constructor gave the WHOLE of a split parameter: megatron's
  CPU initialization draws a master weight of the global shape and keeps this rank's chunks,
  see :func:`whole_node`;
- which GLOBAL expert a local expert is: an experts module (``SequentialMLP``) holds
  ``local_experts`` (a ``ModuleList``), ``num_local_experts`` and ``ep_group``; its local
  expert ``i`` is global expert ``ep_group.rank() * num_local_experts + i``, as megatron's own
  distributed checkpoint numbers them. See :func:`expert_child_names`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

#: Experts modules whose parameters hold several experts at once (no per-expert submodule).
_PACKED_EXPERTS = ("GroupedMLP", "TEGroupedMLP")

# A layer's (global size, per-partition size) attribute pairs, as megatron names them.
_SIZE_PAIRS = (("output_size", "output_size_per_partition"), ("input_size", "input_size_per_partition"),
               ("num_embeddings", "num_embeddings_per_partition"))


def _packed(module: torch.nn.Module) -> bool:
    return any(cls.__name__ in _PACKED_EXPERTS for cls in type(module).__mro__)


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def group_rank_and_size(group: Any, what: str) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``, as megatron's ``get_pg_rank``/``get_pg_size`` read it.

    ``None`` (or torch.distributed not initialized) is a group of one, as in megatron.
    """
    if group is None or not _dist_initialized():
        return 0, 1
    try:
        rank, size = int(group.rank()), int(group.size())
    except Exception as exc:  # noqa: BLE001 - not a process group
        raise ValueError(f"{what} is {group!r}, which has no rank()/size() like a process group") from exc
    if not 0 <= rank < size:
        raise ValueError(f"{what}: this process is not a member (rank {rank} of a group of {size})")
    return rank, size


def has_layer_group(module: torch.nn.Module) -> bool:
    """Whether ``module`` keeps its own tensor-parallel group (megatron-core >= 0.13 layers do)."""
    return "tp_group" in vars(module)


def layer_tp(module: torch.nn.Module, fqn: str) -> tuple[int, int]:
    """This process's ``(tp_rank, tp_size)`` in the tensor-parallel group of the layer owning ``fqn``."""
    return group_rank_and_size(vars(module)["tp_group"], f"{fqn}: its layer's tp_group")


def parallel_state_tp(is_expert: bool) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` from ``megatron.core.parallel_state`` (the expert TP group for experts).

    Raises whatever megatron raises when it is not installed or not initialized.
    """
    from megatron.core import parallel_state  # type: ignore[import-not-found]

    if is_expert:
        return (int(parallel_state.get_expert_tensor_parallel_rank()),
                int(parallel_state.get_expert_tensor_parallel_world_size()))
    return (int(parallel_state.get_tensor_model_parallel_rank()),
            int(parallel_state.get_tensor_model_parallel_world_size()))


def check_layer_sizes(module: torch.nn.Module, fqn: str, dim: int, local: int, size: int) -> None:
    """Raise if the layer's own sizes (``output_size`` and ``output_size_per_partition``, ...) contradict
    a split of ``local`` elements on ``dim`` over ``size`` ranks."""
    attributes = vars(module)
    for whole, part in _SIZE_PAIRS:
        total, per = attributes.get(whole), attributes.get(part)
        if not isinstance(total, int) or not isinstance(per, int) or per != local:
            continue
        if per * size != total:
            raise ValueError(
                f"{fqn}: read as split over {size} tensor-parallel ranks (dim {dim}, {local} here), its global "
                f"size would be {local * size}, but its layer ({type(module).__name__}) has {whole}={total} and "
                f"{part}={per}: the tensor-parallel size keyinit was given contradicts the layer's"
            )
    if _packed(module) and size > 1:
        raise ValueError(
            f"{fqn}: {type(module).__name__} packs all local experts into one tensor split over {size} expert "
            "tensor-parallel ranks; keyinit cannot key that layout by global expert index. Build the experts "
            "as SequentialMLP (one module per expert) or use expert tensor-parallel size 1"
        )


def expert_child_names(module: torch.nn.Module, fqn: str) -> Optional[dict[str, str]]:
    """For a megatron experts module, ``{local child name: global child name}`` of ``local_experts``.

    ``None`` for any other module. Raises ``ValueError`` naming ``fqn`` when the experts
    module contradicts itself (a rank outside its expert-parallel group, a count that does
    not match its ``local_experts``, or ``local_expert_indices`` that disagree).
    """
    attributes = vars(module)
    if "ep_group" not in attributes or "num_local_experts" not in attributes:
        return None
    experts = module._modules.get("local_experts")
    if experts is not None and not isinstance(experts, torch.nn.ModuleList):
        return None  # not megatron's experts module
    if experts is None and not _packed(module):
        return None  # e.g. megatron's MoELayer, which holds the experts module
    ep_rank, ep_size = group_rank_and_size(attributes["ep_group"], f"{fqn or 'the model'}: its ep_group")
    count = attributes["num_local_experts"]
    if experts is None:
        if ep_size > 1:
            raise ValueError(
                f"{fqn}: {type(module).__name__} packs its {count} local experts into one tensor per weight under "
                f"expert parallelism ({ep_size} ranks); keyinit keys experts by their global index only for "
                "SequentialMLP (one module per expert, local_experts.<i>)"
            )
        return None
    if not isinstance(count, int) or count != len(experts):
        raise ValueError(f"{fqn}: num_local_experts is {count!r} but local_experts holds {len(experts)} experts")
    globals_ = [ep_rank * count + i for i in range(count)]
    indices = attributes.get("local_expert_indices")
    if indices is not None and [int(i) for i in indices] != globals_:
        raise ValueError(
            f"{fqn}: local_expert_indices {list(indices)} contradict expert-parallel rank {ep_rank} of {ep_size} "
            f"with {count} local experts (global experts {globals_})"
        )
    return {str(i): str(g) for i, g in enumerate(globals_)}


def _copied_value(node: Any) -> Any:
    """``node`` with whole-buffer copies (``weight.data.copy_(x)``, ``torch.cat`` of one piece) unwrapped."""
    from keyinit.program import Alloc, Cat, Geometry, Read, Write

    while True:
        if isinstance(node, Cat) and not node.stack and len(node.args) == 1:
            node = node.args[0]
            continue
        if not isinstance(node, Read) or not isinstance(node.version, Write):
            return node
        write = node.version
        whole = Geometry.contiguous(tuple(write.geometry.size))
        if not (isinstance(write.value, (Read, Cat)) and isinstance(write.prev, Alloc) and write.geometry == whole
                and node.geometry == whole and write.prev.storage.numel == whole.numel
                and write.value.dtype == node.dtype):
            return node
        node = write.value


def _block(geometry: Any, shape: tuple[int, ...]) -> Optional[list[range]]:
    """The index ranges a view ``geometry`` of a contiguous ``shape`` buffer selects, if it is a block."""
    from keyinit.program import row_major_strides

    strides = row_major_strides(shape)
    if len(geometry.size) != len(shape) or any(
            size > 1 and stride != whole for size, stride, whole in zip(geometry.size, geometry.stride, strides)):
        return None
    offset, ranges = int(geometry.offset), []
    for size, stride, extent in zip(geometry.size, strides, shape):
        start, offset = divmod(offset, stride)
        if start + size > extent:
            return None
        ranges.append(range(start, start + size))
    return ranges if offset == 0 else None


def whole_node(module: torch.nn.Module, name: str, tensor: torch.Tensor, fqn: str,
               value_node: Callable[[torch.Tensor], Any]) -> Any:
    """For :func:`keyinit.deferred`: the constructor's value of the WHOLE split parameter ``module.<name>``.

    ``None`` unless ``tensor`` is marked ``tensor_model_parallel`` and its constructor value is
    recognized as the part of a whole that its layout (:class:`keyinit.layouts.MegatronLayout`)
    says this rank holds. ``value_node`` turns a stand-in into its program node. Two shapes of
    constructor code are recognized:

    - megatron's CPU initialization: ``init_method`` ran on a master weight of the global shape and
      ``weight`` is a copy of chunks of it; the chunks are checked to be exactly the layout's
      region (also with ``partition_stride``), and the whole is the master weight;
    - one constant written over the whole local tensor (megatron zeroes its split biases): the
      whole is that constant over the global shape.
    """
    if not getattr(tensor, "tensor_model_parallel", False):
        return None
    from keyinit.layouts import target_for
    from keyinit.program import Alloc, Cat, Const, Geometry, Read, Write

    node = value_node(tensor)
    try:
        region = target_for(tensor, fqn=fqn, module=module, name=name, allow_meta=True).region
    except (ValueError, TypeError):
        return None  # the planner reports the layout's error
    shape = tuple(region.shape)
    if isinstance(node, Read) and isinstance(node.version, Write) and isinstance(node.version.value, Const):
        write = node.version
        full = Geometry.contiguous(tuple(tensor.shape))
        if isinstance(write.prev, Alloc) and write.geometry == full == node.geometry \
                and write.prev.storage.numel == full.numel:
            return Const(shape, node.dtype, write.value.value)
        return None
    value = _copied_value(node)
    dim = int(getattr(tensor, "partition_dim", 0)) % len(shape)
    if isinstance(value, Cat) and not value.stack and value.dim % len(shape) == dim:
        pieces = value.args
    else:
        pieces = (value,)
    if not pieces or not all(isinstance(p, Read) and p.version is pieces[0].version for p in pieces):
        return None
    source = pieces[0].version
    if not isinstance(source, Write) or tuple(source.geometry.size) != shape \
            or source.geometry != Geometry.contiguous(shape) or _storage_numel(source) != source.geometry.numel:
        return None
    rows: list[int] = []
    for piece in pieces:
        block = _block(piece.geometry, shape)
        if block is None or any(r != range(n) for d, (r, n) in enumerate(zip(block, shape)) if d != dim):
            return None
        rows.extend(block[dim])
    if rows != [int(i) for i in region.indices[dim]] or any(
            len(region.indices[d]) != n for d, n in enumerate(shape) if d != dim):
        return None
    return Read(source, Geometry.contiguous(shape), pieces[0].dtype)


def _storage_numel(version: Any) -> int:
    from keyinit.program import Alloc

    while not isinstance(version, Alloc):
        version = version.prev
    return int(version.storage.numel)
