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

from keyinit.keys import Key, fold_in
from keyinit.nn._batch import annotate, record
from keyinit.nn._keys import keyed_call_key, keyed_module_key

__all__ = ["Forward", "MicroBatch", "Named", "input_tensors", "sequence_first_module", "remember", "recomputed"]


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
