"""The pieces of a keyed block: root forwards, micro-batches, named blocks, and checkpoint recomputes.

- :class:`Forward`: one root forward (an outermost module execution): the rows it
  holds (``start``, ``count``), its repeat count, its tensors' batch records
  (:mod:`keyinit.nn._batch`), the keys of its calls and of its host generators;
- :func:`remember` / :func:`recomputed`: how a forward that activation
  checkpointing recomputes in backward finds its first execution (non-reentrant:
  the same input tensors; reentrant: the memory of the detached inputs);
- :class:`MicroBatch` (``ctx.micro_batch(offset)``) and :class:`Named`
  (``keyed("a.name", ...)``).

The context that uses them is :mod:`keyinit.nn._keyed`.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from keyinit.keys import Key, as_uint64, fold_in
from keyinit.nn._batch import annotate, record
from keyinit.nn._keys import keyed_call_key, keyed_module_key

__all__ = ["Forward", "MicroBatch", "Named", "input_tensors", "sequence_first_module", "sequence_first_dropouts",
           "resolve_sample_offset", "remember", "recomputed"]


class Forward:
    """One root forward: an outermost module execution in a keyed block, and the rows it holds.

    ``start`` is the global sample of its inputs' row 0 (``sample_offset`` plus the
    micro-batch's offset); ``repeat`` counts the earlier root forwards of the same
    module in the block whose rows overlap these (a double forward, R-Drop), and
    is folded into every key of this forward when it is not 0.
    """

    __slots__ = ("start", "count", "repeat", "fqn", "constants", "owner", "grad", "drew", "records", "probe", "escaped",
                 "__weakref__")

    def __init__(self, ctx: Any, fqn: str, start: int, count: int, repeat: int) -> None:
        self.fqn, self.start, self.count, self.repeat = fqn, start, count, repeat
        self.constants = ctx._constants  # ids of the model's buffers: replicated unless computed otherwise
        self.owner = weakref.ref(ctx)
        self.grad = torch.is_grad_enabled()  # autograd on at the start (off inside: reentrant checkpointing)
        self.drew = False  # a keyed draw was made: later forwards of these rows are repeats
        self.records: dict[int, tuple[Any, Any]] = {}  # id(tensor) -> (weakref, its batch record): _batch.py
        # a shape probe (meta tensors, a pipeline stage's shape inference): later forwards do not repeat it
        self.probe = False
        self.escaped: set[int] = set()  # batch sizes len() turned into plain ints (keyinit.nn._modes)

    def host_key(self, ctx: Any) -> Key:
        """The key that seeds Python's and numpy's generators in this forward (docs/spec.md 14.7)."""
        k = fold_in(keyed_module_key(ctx.root, ctx.step, self.fqn), "host")
        return fold_in(k, self.repeat) if self.repeat else k

    def call_key(self, ctx: Any, fqn: str, ordinal: int) -> Key:
        if not self.drew and not self.probe:
            self.drew = True
            ctx._history.setdefault(self.fqn, []).append((self.start, self.start + self.count))
        k = keyed_call_key(ctx.root, ctx.step, fqn, ordinal)
        if self.repeat:
            k = fold_in(fold_in(k, "repeat"), self.repeat)
        return k


def sequence_first_module(module: torch.nn.Module) -> bool:
    """torch's transformer modules built sequence-first (``batch_first=False``, torch's default)."""
    nn = torch.nn
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not module.self_attn.batch_first
    if isinstance(module, nn.MultiheadAttention):
        return not module.batch_first
    if isinstance(module, nn.Transformer):
        return not module.batch_first
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(module.layers):
        return sequence_first_module(module.layers[0])
    return False


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def resolve_sample_offset(model: torch.nn.Module, sample_offset: Optional[int]) -> int:
    """The rule: explicit under more than one process; never 0 on a DDP rank other than 0."""
    if sample_offset is None:
        world = _world()
        if world > 1:
            raise ValueError(
                f"keyed: torch.distributed is initialized with {world} ranks, so sample_offset must be given: the "
                "global index of this rank's first sample in the step's batch (e.g. dp_rank * local_batch + "
                "micro-batch offset), or 0 where every rank holds the whole batch (tensor/sequence parallelism; "
                "DTensor activations add their own placements)"
            )
        return 0
    offset = as_uint64(sample_offset, "sample_offset")
    if offset == 0 and _world() > 1:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            import torch.distributed as dist

            rank = dist.get_rank(model.process_group)
            if rank > 0:
                raise ValueError(
                    f"keyed: sample_offset=0 on rank {rank} of the DistributedDataParallel group: each data-parallel "
                    "rank holds its own rows of the batch, so its first sample is not global sample 0; pass "
                    "sample_offset = rank * local_batch (+ the micro-batch offset)"
                )
    return offset


def sequence_first_dropouts(model: torch.nn.Module) -> frozenset[int]:
    """The dropout modules of torch's sequence-first (``batch_first=False``, torch's default)
    ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``: their activations are
    ``(sequence, batch, features)``, so dimension 1, not 0, is the batch."""
    layers = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
    found = set()
    for module in model.modules():
        if isinstance(module, layers) and not getattr(module.self_attn, "batch_first", True):
            found.update(id(child) for child in module.children() if isinstance(child, torch.nn.Dropout))
    return frozenset(found)


def input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth < 2 and isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)

    visit(args, 0)
    visit(kwargs, 0)
    return found


def _replay_key(fqn: str, t: torch.Tensor) -> tuple:
    return (fqn, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

def remember(ctx: Any, fqn: str, forward: "Forward", args: tuple, kwargs: dict) -> None:
    """A module run with autograd off inside a forward that had it on (reentrant activation
    checkpointing): its input tensors are remembered, for the recompute in backward to find this
    forward and their batch records."""
    for t in input_tensors(args, kwargs):
        ctx._replays[_replay_key(fqn, t)] = (weakref.ref(t), forward)

def recomputed(ctx: Any, fqn: str, args: tuple, kwargs: dict) -> Optional["Forward"]:
    """The forward whose execution of module ``fqn`` a forward run in backward recomputes, or None."""
    tensors = input_tensors(args, kwargs)
    for t in tensors:  # non-reentrant checkpointing: the very input tensors of the first execution
        holders = [forward for forward in ctx._forwards
                   if (entry := forward.records.get(id(t))) is not None and entry[0]() is t]
        if holders:  # the root forward of this module itself, else the one it ran inside
            return next((f for f in holders if f.fqn == fqn), holders[0])
    found_forward = None
    for t in tensors:  # reentrant checkpointing: detached copies of the inputs, the same memory
        found = ctx._replays.get(_replay_key(fqn, t))
        original = None if found is None else found[0]()
        if original is not None:
            found_forward = found[1]
            annotate(t, found_forward, record(original, found_forward))
    return found_forward

class Named(torch.nn.Module):
    """The stand-in module of a named block (``keyed("name", ...)``): its FQN is the name."""

    _keyinit_block = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class MicroBatch:
    __slots__ = ("ctx", "offset", "saved")

    def __init__(self, ctx: Any, offset: int) -> None:
        self.ctx, self.offset, self.saved = ctx, offset, 0

    def __enter__(self) -> Any:
        self.saved = self.ctx._rows
        self.ctx._rows = self.offset
        return self.ctx

    def __exit__(self, *exc_info: Any) -> None:
        self.ctx._rows = self.saved
