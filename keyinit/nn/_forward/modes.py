"""The two modes of a keyed forward: torch-function routing and ATen-level batch tracking and draws.

- :class:`FunctionMode` (a ``TorchFunctionMode``) answers the dropout family, SDPA
  with ``dropout_p > 0`` and multi-head attention with keyed masks
  (:mod:`keyinit.nn._forward.intercept`), gives ``x.shape``/``x.size()`` of batch-holding
  tensors as :class:`keyinit.nn._batch.records.BatchSize`, and tells the dispatch mode the
  batch of a factory sized by one;
- :class:`BatchMode` (a ``TorchDispatchMode``) carries each op's batch from its
  inputs to its outputs (:mod:`keyinit.nn._batch.rules`) and answers every random
  ATen op (``torch.Tag.nondeterministic_seeded``: ``rand``, ``bernoulli_``,
  ``normal_``, ``exponential_``, ``randperm``, ...) with keyed values
  (:mod:`keyinit.nn._forward.draws`), per sample or replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn._batch.records import Batch, BatchSize, DerivedSize, Foreign, Unknown, annotate, merge, record
from keyinit.nn._batch.rules_nn import restride_keeps_elements
from keyinit.nn._recompute.checkpoint import refuse_unseen
from keyinit.nn._batch.propagate import decomposed
from keyinit.nn._batch.routed import Routed, routed_draw
from keyinit.nn._forward.dropout import guard_alone, rows_dropout
from keyinit.nn._batch.memo import REMEMBERED, eligible, learn, replay, replayable, signature
from keyinit.nn._forward.intercept import (
    Keyed,
    argument,
    dropout_family,
    Frame,
    handle_dropout,
    keyed_mha,
    keyed_sdpa,
    placed,
    refuse_foreign,
)

__all__ = ["FunctionMode", "BatchMode", "GuardSuspended", "mode_is_active", "mode_is_top"]

_SHAPE = torch.Tensor.shape
_SIZE = torch.Tensor.size
_LEN = torch.Tensor.__len__
_NUMEL = torch.Tensor.numel
_FACTORIES = {
    torch.rand, torch.randn, torch.randint, torch.empty, torch.zeros, torch.ones, torch.full, torch.normal,
    torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full, torch.arange,
    torch.randperm, torch.empty_strided, torch.Tensor.new_tensor,
}


def _sizes(args: tuple, kwargs: dict) -> list:
    """The ints that size a factory call (its ``size`` sequence, or its int varargs)."""
    size = kwargs.get("size")
    if size is None:
        for a in args:
            if isinstance(a, (tuple, list)) and all(isinstance(v, int) for v in a):
                size = a
                break
    if size is None:
        size = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    return list(size)


def _factory_record(func: Any, args: tuple, kwargs: dict, escaped: set) -> Any:
    """The batch of a factory's output from the sizes it was given (None: replicated)."""
    sizes = _sizes(args, kwargs)
    tagged = [(d, v) for d, v in enumerate(sizes) if isinstance(v, BatchSize)]
    if not tagged:
        if any(isinstance(v, int) and v in escaped for v in sizes):
            return Unknown(f"{getattr(func, '__name__', func)} is sized {sizes}, and the batch size of a tensor in this "
                           "forward became one of these as a plain int (len(x) and int(x.shape[0]) drop the fact that "
                           "it is the batch size; in a forward of one row any plain 1 may be it); size it by x.shape[0] or "
                           "x.size(0)", constant=True)
        return None
    exact = [(d, v) for d, v in tagged if not isinstance(v, DerivedSize)]
    if len(exact) == 1 and len(tagged) == 1:
        d, v = exact[0]
        return Batch(d, int(v), v.batch.start)
    return Unknown(f"{getattr(func, '__name__', func)} is sized by arithmetic on the batch size ({sizes}), which "
                   "does not say where the samples are", constant=True)  # (a random factory's draw refuses it)


_EXPANDS = {torch.Tensor.expand, torch.Tensor.repeat}


def _expanded_record(func: Any, t: torch.Tensor, out: torch.Tensor, rec: Any) -> Any:
    """The batch of a replicated tensor expanded or repeated to a batch size (``pos.expand(L, x.shape[1], D)``):
    copies of the same values, one per sample, in the dimension sized by the ``BatchSize``; None if that
    dimension was not broadcast (a no-op expand)."""
    if isinstance(rec, Unknown):  # arithmetic on the batch size, or a plain int that was one: placement unknown,
        return Unknown(rec.why, constant=True)  # but copies of replicated values are the same for every sample
    if not isinstance(rec, Batch):
        return rec  # None: no batch size among the sizes
    padded = (1,) * (out.dim() - t.dim()) + tuple(t.shape)
    if func is torch.Tensor.repeat:
        return Batch(rec.dim, rec.count, rec.start, int(padded[rec.dim]))  # tile i of the dimension: sample i
    return Batch(rec.dim, rec.count, rec.start) if padded[rec.dim] == 1 else None


def _shape_of(t: torch.Tensor, sizes: Any, forward: Any) -> Any:
    """``t.shape``/``t.size()`` with the batch dimension's size as a :class:`BatchSize`."""
    rec = record(t, forward)
    if isinstance(rec, Foreign) and not isinstance(sizes, int):
        # a tensor of unknown origin: its sizes say nothing of where samples are (a factory sized by
        # them holds an unknown batch)
        return torch.Size(tuple(DerivedSize(int(n)) for n in sizes))
    if type(rec) is Routed and not isinstance(sizes, int) and rec.dim < len(sizes):
        # rows picked by values: a factory sized by their number holds an unknown batch
        return torch.Size(tuple(DerivedSize(int(n)) if i == rec.dim else n for i, n in enumerate(sizes)))
    if not isinstance(rec, Batch) or rec.dim is None:
        return sizes
    d = rec.dim
    if isinstance(sizes, int) or d >= len(sizes):
        return sizes
    n = int(sizes[d])
    value = BatchSize(n, rec, forward.escaped) if rec.inner == 1 and n == rec.count else DerivedSize(n)
    return torch.Size(tuple(sizes[:d]) + (value,) + tuple(sizes[d + 1:]))


def mode_is_top(mode: Any) -> bool:
    """``mode`` is the innermost of its stack (torch function or dispatch modes)."""
    if isinstance(mode, TorchFunctionMode):
        from torch.overrides import _get_current_function_mode_stack

        stack = _get_current_function_mode_stack()
    else:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        stack = _get_current_dispatch_mode_stack()
    return bool(stack) and stack[-1] is mode


def mode_is_active(mode: Any) -> bool:
    """``mode`` is on its stack (torch function or dispatch modes), looked at from the top (where it is
    while a forward runs: every module's hook asks)."""
    if isinstance(mode, TorchFunctionMode):
        length, at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    else:
        length, at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
    for i in range(length() - 1, -1, -1):
        if at(i) is mode:
            return True
    return False


class FunctionMode(TorchFunctionMode):
    """Keyed dropout and attention, batch sizes that carry the batch, and the batch of sized factories.

    Each function it answers has its handler in one table built with the mode; a function in no entry
    runs as it is (its ATen ops still pass the dispatch mode), and one of
    :func:`keyinit.nn._batch.memo.replayable` may replay its outputs' records instead (in ``__torch_function__``).
    """

    def __init__(self, ctx: "Keyed") -> None:
        super().__init__()
        self.ctx = ctx
        family = dropout_family()  # the functions as they are now (a test may have patched one)
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.mha = torch.nn.functional.multi_head_attention_forward
        # the tables of the last functions seen, shared by the modes made with them (read only)
        signature = (tuple(family.items()), self.sdpa, self.mha)
        cached = _TABLES.get("modes")
        if cached is None or cached[0] != signature:
            handlers = dict(_handlers())
            handlers.update(dict.fromkeys(family, FunctionMode._dropout))
            handlers[self.sdpa] = FunctionMode._sdpa
            handlers[self.mha] = FunctionMode._mha
            cached = _TABLES["modes"] = (signature, family, handlers)
        self.family, self.handlers = cached[1], cached[2]
        self.functional_dropout = torch.nn.functional.dropout  # (as it is now: see _rows_dropout)
        self.local = ctx.thread_local

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = self.handlers.get(func)
        if handler is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if handler is not _REPLAYED:
            return handler(self, func, args, kwargs or {})
        # A function of keyinit.nn._batch.memo.replayable: its outputs' records replayed when its signature was
        # seen (the dispatch mode off), else learned from the dispatch mode (inline: most calls of a forward)
        state = getattr(self.local, "state", None)
        if state is None or not state.frames or (kwargs and "out" in kwargs) or not eligible(state.modes[1]):
            return func(*args, **kwargs) if kwargs else func(*args)
        forward = state.frames[-1].forward
        found = signature(func, args, kwargs or _NO_KWARGS, forward)
        if found is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        key, inputs, before = found
        remembered = REMEMBERED.get(key)
        if remembered is not None:
            with _NoDispatch():
                out = func(*args, **kwargs) if kwargs else func(*args)
            replay(remembered, inputs, out, forward)
            return out
        mode = state.modes[1]
        events = mode.events
        out = func(*args, **kwargs) if kwargs else func(*args)
        if mode.events == events:
            learn(REMEMBERED, key, inputs, before, out, forward)
        return out

    def _length(self, func, args, kwargs):
        out = func(*args, **kwargs)
        frame = self.ctx.current_frame()
        if frame is None or self.ctx.index == "dim0" or not args:
            return out
        rec = record(args[0], frame.forward)
        if func is _LEN:
            # len() hands Python a plain int whatever __len__ returns: remember the size, so that a
            # factory sized by it is refused rather than drawn as replicated
            if rec is not None:
                frame.forward.escaped.add(int(out))
            return out
        return out if rec is None else DerivedSize(out)  # sized by the batch, in a way that says not where

    def _shape(self, func, args, kwargs):
        out = func(*args, **kwargs)
        frame = self.ctx.current_frame()
        if frame is None or self.ctx.index == "dim0":
            return out
        if func is _SIZE and isinstance(out, int):
            if not args or len(args) < 2:
                return out
            full = _shape_of(args[0], tuple(args[0].shape), frame.forward)
            return full[int(args[1])] if isinstance(full, torch.Size) else out
        return _shape_of(args[0], out, frame.forward)

    def _expand(self, func, args, kwargs):
        out = func(*args, **kwargs)
        frame = self.ctx.current_frame()
        if frame is not None and self.ctx.index != "dim0" and isinstance(out, torch.Tensor) and \
                record(out, frame.forward) is None:
            rec = _expanded_record(func, args[0], out, _factory_record(func, args[1:], kwargs, frame.forward.escaped))
            if rec is not None:
                annotate(out, frame.forward, rec)
        return out

    def _factory(self, func, args, kwargs):
        frame = self.ctx.current_frame()
        if frame is not None and self.ctx.index != "dim0":
            rec = _factory_record(func, args, kwargs, frame.forward.escaped)
            if rec is not None:
                state = self.ctx.thread_state()
                state.pending = rec
                try:
                    out = func(*args, **kwargs)
                finally:
                    state.pending = None
                annotate(out, frame.forward, rec)
                return out
        return func(*args, **kwargs)

    def _dropout(self, func, args, kwargs):
        frame = self.ctx.current_frame()
        if frame is None:
            return func(*args, **kwargs)
        if func is self.functional_dropout and len(args) == 1:
            out = self._rows_dropout(frame, args[0], kwargs)
            if out is not None:
                return out
        kind, mask, inplace = self.family[func]
        if mask == "element" and guard_alone(self.ctx, args[0] if args else kwargs.get("input")):
            # the guard is the only dispatch mode and the input a plain tensor: the handler's ops (all on
            # plain tensors) skip it, as with the guard left, without leaving and re-entering it
            with _NoDispatch():
                return handle_dropout(self.ctx, frame, kind, mask, inplace, args, kwargs)
        with GuardSuspended(self.ctx):
            return handle_dropout(self.ctx, frame, kind, mask, inplace, args, kwargs)

    def _rows_dropout(self, frame: Frame, input: Any, kwargs: dict) -> Any:
        """``F.dropout(x, p, training=True)`` (``nn.Dropout``'s call): :func:`keyinit.nn._forward.dropout.rows_dropout`
        in ``frame``, None where it does not apply."""
        if len(kwargs) != 3 or kwargs.get("training") is not True or kwargs.get("inplace") is not False:
            return None
        return rows_dropout(self.ctx, frame.forward, frame.foreign, input, kwargs.get("p"), frame.fqn, frame.counts,
                            frame.describe)

    def _sdpa(self, func, args, kwargs):
        dropout_p = argument(args, kwargs, 4, "dropout_p", 0.0)
        frame = self.ctx.current_frame()
        if frame is not None and dropout_p:
            from keyinit.nn.functional import check_p

            with GuardSuspended(self.ctx):
                return keyed_sdpa(self.ctx, frame, check_p(dropout_p), args, kwargs)
        return func(*args, **kwargs)

    def _mha(self, func, args, kwargs):
        frame = self.ctx.current_frame()
        if frame is not None:
            with GuardSuspended(self.ctx):
                out = keyed_mha(self.ctx, frame, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


_REPLAYED = "replayed"  # the handler entry of replayable functions (FunctionMode.__torch_function__ runs them)
_NO_KWARGS: dict = {}
_TABLES: dict = {}  # "handlers" (function -> FunctionMode handler), built once; "modes": FunctionMode's last tables


def _handlers() -> dict:
    """``{torch function: FunctionMode handler}`` for the functions fixed at import (built on first use); the
    mode adds the dropout family and attention as they are when it is made."""
    table = _TABLES.get("handlers")
    if table is None:
        table = dict.fromkeys(replayable(), _REPLAYED)
        table.update(dict.fromkeys((_LEN, _NUMEL), FunctionMode._length))
        table.update(dict.fromkeys((_SHAPE.__get__, _SIZE), FunctionMode._shape))
        table.update(dict.fromkeys(_EXPANDS, FunctionMode._expand))
        table.update(dict.fromkeys(_FACTORIES, FunctionMode._factory))
        _TABLES["handlers"] = table
    return table


_NoDispatch = torch._C._DisableTorchDispatch


class GuardSuspended:
    """Leaves this thread's seeded-op guard while keyinit's own code (which draws nothing unkeyed) runs.

    Every ATen op under a Python dispatch mode costs a trip through Python, and the
    ``keyinit::dropout`` custom op takes torch's slow path there; keyinit's handlers
    only run keyed ops, torch's matmul/softmax and projections. Only when the guard is
    the innermost dispatch mode (so no other mode's order changes).
    """

    __slots__ = ("guard",)

    def __init__(self, ctx: "Keyed") -> None:
        state = getattr(ctx.thread_local, "state", None)
        guard = state.modes[-1] if state is not None and state.modes else None
        self.guard = guard if guard is not None and _innermost_dispatch_mode() is guard else None

    def __enter__(self) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)

    def __exit__(self, *exc_info: Any) -> None:
        if self.guard is not None:
            self.guard.__enter__()


def _innermost_dispatch_mode() -> Any:
    length = torch._C._len_torch_dispatch_stack()
    return torch._C._get_dispatch_stack_at(length - 1) if length else None


def draws_nothing(func, args: tuple, kwargs: dict) -> bool:
    """A seeded op that provably draws nothing: ``dropout_p``/``p`` equal to 0, or ``train``/``training`` False."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    for position, schema_argument in enumerate(schema.arguments):
        if schema_argument.name not in ("dropout_p", "p", "train", "training"):
            continue
        if position < len(args):
            value = args[position]
        elif schema_argument.name in kwargs:
            value = kwargs[schema_argument.name]
        elif schema_argument.has_default_value():
            value = schema_argument.default_value
        else:
            continue
        if schema_argument.name in ("train", "training"):
            if value is False:
                return True
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return True
    return False


_AS_STRIDED_ = torch.ops.aten.as_strided_.default
_NEW = {"aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::new_empty_strided"}


def _tensor_inputs(args: tuple, kwargs: dict) -> list:
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            found.append(v)
    return found


class BatchMode(TorchDispatchMode):
    """Tracks each tensor's batch through the forward's ATen ops, and keys every random op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says no: a Python
        # frame more per ATen op. Under keyed, compiled code runs eagerly anyway (docs/dropout.md).
        return False

    def __init__(self, ctx: Keyed) -> None:
        super().__init__()
        self.ctx = ctx
        self.events = 0  # draws and in-place restrides seen: a call that made one is not replayed (_replay)

    def _output_record(self, func: Any, frame: Frame, args: tuple, kwargs: dict, records: list) -> Any:
        """The batch of a random op's output: the sized factory's, the input's (``*_like``, in place), or the
        inputs' broadcast (``bernoulli(p)``, ``normal(mean, std)``, ``multinomial``): the op's ``batch`` in the
        random-op table."""
        from keyinit._engine.programs.random_ops import INPUT, random_op

        name = func._schema.name
        state = self.ctx.thread_state()
        if not records or name in _NEW:
            return state.pending
        if random_op(name).batch == INPUT:
            return records[0][1]
        out_ndim = max(t.dim() for t, _ in records)
        return merge([(r, t.dim(), int(t.shape[r.dim]) if isinstance(r, Batch) and r.dim is not None else None)
                      for t, r in records], out_ndim, func)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from keyinit._engine.programs.random_ops import is_random, random_op

        kwargs = kwargs or {}
        frame = self.ctx.current_frame()
        if frame is None:
            return func(*args, **kwargs)
        forward = frame.forward
        tensors = _tensor_inputs(args, kwargs)
        records = [(t, record(t, forward)) for t in tensors]
        if is_random(func):
            nothing = draws_nothing(func, args, kwargs)
            # at p = 0 an op whose torch kernel still advances the generator is answered by keyinit (ops such
            # as fused attention with dropout_p = 0 touch no generator and run as they are)
            if not nothing or random_op(func._schema.name).advances_at_p0:
                return self._draw(func, frame, args, kwargs, records, nothing)
        if func is _AS_STRIDED_ and records and records[0][1] is not None:
            self.events += 1
            # in place: whether it keeps the elements is known only before it runs
            keeps = restride_keeps_elements(args[0], args)
            out = func(*args, **kwargs)
            annotate(out, forward, records[0][1] if keeps else Unknown(f"{func} reinterprets the memory of a "
                                                                        "batch-holding tensor"))
            return out
        if records and decomposed(func) and any(r is not None for _, r in records):
            # (torch.inference_mode: a composite op arrives whole; its parts are the ops no_grad would show)
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        state = self.ctx.thread_state()
        if not tensors or func._schema.name in _NEW:
            # a factory: laid out by its sizes (a BatchSize among them: the function mode's pending batch)
            annotate(out, forward, state.pending)
            return out
        leaves = list(out) if isinstance(out, (tuple, list)) else [out]
        if not any(r is not None for _, r in records):
            for leaf in leaves:  # computed in this forward from replicated tensors: replicated
                annotate(leaf, forward, None)
            return out
        found = self.ctx.drawer.propagate(func, args, kwargs, out, records)  # (traced: on metadata only)
        for leaf, rec in zip(leaves, found):
            annotate(leaf, forward, rec)
        return out

    def _draw(self, func: Any, frame: Frame, args: tuple, kwargs: dict, records: list, nothing: bool) -> Any:
        from keyinit.nn._ops.keys import DROPOUT_DOMAIN
        from keyinit.keys import key as make_key

        ctx = self.ctx
        self.events += 1
        if frame.foreign:
            refuse_foreign(ctx, frame, str(func))
        refuse_unseen(frame, str(func))
        if ctx.index == "dim0" and not nothing:
            raise UnkeyedRandomnessError(
                f"{frame.describe()}: {func} inside a keyinit.nn.keyed(index='dim0') forward: that rule keys only "
                "the dropout family and attention dropout; use the default index='tracked' to key every random op"
            )
        shape = tuple(records[0][0].shape) if records else ()
        found = self._output_record(func, frame, args, kwargs, records)
        if type(found) is Routed:  # rows picked by values (keyinit.nn._batch.routed)
            ctx.drawer.on_values(frame, f"{func} on rows picked by values")  # (traced: refused, run eagerly)
            found = routed_draw(frame, found, str(func), shape)
        rec = found if type(found) is Routed else placed(frame, found, str(func), shape)
        # a draw of p = 0 (no randomness) takes no call ordinal: any key gives its values
        key = make_key(DROPOUT_DOMAIN) if nothing else frame.key(ctx)
        site = f"{frame.describe()}: {func}"
        batch = rec if isinstance(rec, (Batch, Routed)) else None
        out = ctx.drawer.values(func, args, kwargs, key, batch, site)  # (traced: a site op of the graph)
        leaves = list(out) if isinstance(out, (tuple, list)) else [out]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dim():
                annotate(leaf, frame.forward, rec)
        return out

