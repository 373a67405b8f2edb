"""megatron-core's layout facts, read from its modules by duck typing (megatron is never imported here).

Two questions, both answered without communicating (what a :func:`keyinit.deferred` constructor
gave the whole of a split parameter is :mod:`keyinit._engine.deferred.megatron_records`):

- which tensor-parallel rank and size a marked parameter (``tensor_model_parallel``) is split
  over: the group of the LAYER that owns it (megatron's ``self.tp_group``, which for expert
  layers is the expert tensor-parallel group), see :func:`layer_tp`;
- which GLOBAL expert a local expert is: an experts module (``SequentialMLP``) holds
  ``local_experts`` (a ``ModuleList``), ``num_local_experts`` and ``ep_group``; its local
  expert ``i`` is global expert ``ep_group.rank() * num_local_experts + i``, as megatron's own
  distributed checkpoint numbers them. See :func:`expert_child_names`.
"""

from __future__ import annotations

from typing import Any, Optional

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
