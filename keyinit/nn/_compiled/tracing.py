"""Tracing one graph dynamo captured under keyed()'s modes (for :mod:`keyinit.nn._compiled.compile`).

- :class:`Call`: a compiled module's call inside a keyed context (its root forward, its FQN);
- :class:`TraceContext`: what keyed()'s modes read of a context, with frames from the graph;
- :class:`TraceForward`: the traced forward, whose calls' keys are slots of the control tensor
  (:class:`keyinit.nn._compiled.sites.Trace`), or the call's own keys when a graph runs eagerly;
- :class:`Frames`: the module execution of each node, from its ``nn_module_stack``: the calls of
  one execution are numbered in order, as the eager forward's hooks number them;
- :class:`Interpreter`: runs the graph node by node in those frames (the body of activation
  checkpointing too);
- :func:`bind`: the graph's inputs with their batch records, and the ints that are batch sizes.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn._batch.records import Batch, BatchSize, DerivedSize, annotate, record
from keyinit.nn._forward.drawer import EAGER
from keyinit.nn._forward.pieces import Forward
from keyinit.nn._forward.intercept import Frame
from keyinit.nn._compiled.sites import Trace

__all__ = ["Call", "RanEagerly", "TraceContext", "TraceForward", "Frames", "Interpreter", "bind", "source_name"]


class Call:
    """A compiled module's call inside a keyed context: the context, its root forward, the module's FQN, and
    the frame of the module's execution. Call ordinals go on from the frame's counts, as in an eager forward:
    a graph's ``n``-th draw of module ``m`` is call ``counts[m] + n`` (under ``keyed(..., calls="execution")``
    only the compiled module's own draws go on across its graphs; a submodule's restart at each execution)."""

    __slots__ = ("ctx", "forward", "fqn", "module", "frame", "drew")

    def __init__(self, ctx: Any, forward: Forward, fqn: str, module: torch.nn.Module, frame: Frame) -> None:
        self.ctx, self.forward, self.fqn, self.module, self.frame = ctx, forward, fqn, module, frame
        self.drew = False  # a compiled graph of this call drew (keyinit.nn._compiled.compile)

    def full_fqn(self, relative: str) -> str:
        """The canonical FQN of module ``relative`` (to the compiled module)."""
        if not relative:
            return self.fqn
        return f"{self.fqn}.{relative}" if self.fqn else relative

    def numbered_on(self, relative: str) -> bool:
        """The calls of module ``relative`` go on from the counts of the call's frame."""
        return not relative or self.ctx.calls == "forward"

    def key(self, relative: str, ordinal: int) -> Any:
        """The key of the graph's call ``ordinal`` of module ``relative`` (to the compiled module)."""
        fqn = self.full_fqn(relative)
        if self.numbered_on(relative):
            ordinal += self.frame.counts.get(fqn, 0)
        return self.forward.call_key(self.ctx, fqn, ordinal)

    def taken(self, counts: dict) -> None:
        """A graph of the call ran: the ordinals it took (``{relative FQN: count}``) are taken."""
        mine = self.frame.counts
        for relative, n in counts.items():
            if self.numbered_on(relative):
                fqn = self.full_fqn(relative)
                mine[fqn] = mine.get(fqn, 0) + n


# ----------------------------------------------------------------------------- the trace


class TraceContext:
    """What keyed()'s modes read of a context, for one trace: frames come from the graph's nodes."""

    index = "tracked"

    def __init__(self, call: Call, trace: Trace) -> None:
        from keyinit.nn._forward.modes import BatchMode, FunctionMode

        self.drawer = EAGER if trace is None else trace  # (run eagerly: the eager forward's draws)
        self.root, self.step, self.sample_offset = call.ctx.root, call.ctx.step, call.ctx.sample_offset
        self.sequence_first: frozenset[int] = frozenset()  # read only by index="dim0"
        self._local = threading.local()
        self._local.state = _State([FunctionMode(self), BatchMode(self)])
        self.frame: Optional[Frame] = None

    @property
    def modes(self) -> list:
        """keyed()'s two modes for this trace (entered around the graph's run)."""
        return self._local.state.modes

    @property
    def thread_local(self) -> threading.local:
        return self._local

    def current_frame(self) -> Optional[Frame]:
        return self.frame

    def thread_state(self) -> "_State":
        return self._local.state

    def __repr__(self) -> str:
        return f"keyinit.nn.compile trace (seed key {self.root}, step {self.step})"


class _State:
    __slots__ = ("modes", "pending", "frames", "foreign")

    def __init__(self, modes: list) -> None:
        self.modes, self.pending, self.frames, self.foreign = modes, None, [], False


class RanEagerly(UnkeyedRandomnessError):
    """A draw of a compiled module that dynamo ran eagerly (or in a frame of its own): keyinit cannot key it
    there. Until a call of the module has drawn in compiled graphs, it makes the module run as an eager keyed
    forward instead."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


class TraceForward(Forward):
    """The traced forward: its calls' keys become slots of the control tensor."""

    __slots__ = ("trace", "numbered", "why", "owner_call")

    def call_key(self, ctx: Any, fqn: str, ordinal: int) -> Any:
        if fqn not in self.numbered:
            raise RanEagerly(fqn.strip("<>"), self.why(fqn))
        if self.trace is None:  # run eagerly: the call's key itself
            return self.owner_call.key(fqn, ordinal)
        return self.trace.slot(fqn, ordinal)


class Frames:
    """The module execution each node of a dynamo graph belongs to, from its ``nn_module_stack``."""

    def __init__(self, root: torch.nn.Module, forward: TraceForward) -> None:
        from keyinit.fqn import canonical_modules

        self.root = root
        self.forward = forward
        self.fqns = {}
        for _, fqn, module in canonical_modules(root):
            self.fqns.setdefault(id(module), fqn)
        self.frames: dict[str, Frame] = {}
        # keyed(..., calls="forward"): one count per module for all its executions in the graph
        self.shared: Optional[dict[str, int]] = {} if forward.owner_call.ctx.calls == "forward" else None

    def module_at(self, path: str) -> Optional[torch.nn.Module]:
        _, _, relative = path.partition(".")  # "L['self'].layers.0.drop" -> "layers.0.drop"
        if not relative:
            return self.root
        try:
            return self.root.get_submodule(relative)
        except AttributeError:
            return None

    def own_calls(self) -> dict:
        """The ordinals the graph's frames took: ``{FQN relative to the compiled module: count}``."""
        if self.shared is not None:
            return dict(self.shared)
        frame = self.frames.get("")  # each execution numbered from 0: only the compiled module's own go on
        return {"": frame.counts.get(frame.fqn, 0)} if frame is not None and frame.fqn == "" else {}

    def opaque(self, name: str, around: Optional[Frame]) -> Frame:
        """The frame of what runs inside higher-order op ``name``: its draws are refused."""
        module = around.module if around is not None else self.root
        return Frame(module, f"<inside torch.ops.higher_order.{name}>", False, self.forward)

    def frame(self, node: torch.fx.Node) -> Frame:
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            execution, module = "", self.root
        else:
            execution, (path, _) = list(stack.items())[-1]
            module = self.module_at(path)
        frame = self.frames.get(execution)
        if frame is None:
            fqn = self.fqns.get(id(module)) if module is not None else None
            if fqn is None:
                fqn = f"<{execution}>"
            else:
                self.forward.numbered.add(fqn)
            frame = self.frames[execution] = Frame(module if module is not None else self.root, fqn, False,
                                                   self.forward, self.shared)
        return frame


#: Higher-order ops whose body is the forward's own code (activation checkpointing, dynamo's ``wrap``): their
#: body is run node by node, each node in its module's frame (the recompute of checkpointing is then
#: replaced by saved activations). Any other higher-order op runs as one call: a draw inside it is refused.
_INLINED = ("tag_activation_checkpoint", "wrap")


class Interpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, tctx: TraceContext, frames: Frames) -> None:
        super().__init__(gm)
        self.tctx, self.frames_of = tctx, frames

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("call_function", "call_method", "call_module"):
            self.tctx.frame = self.frames_of.frame(n)
        try:
            return super().run_node(n)
        finally:
            self.tctx.frame = None

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(target, torch._ops.HigherOrderOperator):
            if target.name() in _INLINED:
                body, *inputs = args
                return Interpreter(body, self.tctx, self.frames_of).run(*inputs)
            frame = self.tctx.frame
            self.tctx.frame = self.frames_of.opaque(target.name(), frame)
            try:
                return super().call_function(target, args, kwargs)
            finally:
                self.tctx.frame = frame
        return super().call_function(target, args, kwargs)


def bind(gm: torch.fx.GraphModule, args: tuple, call: Call, forward: TraceForward) -> list:
    """The graph's inputs for the trace: tensors keep their batch records (copied from the running
    forward); ints that are a batch-holding input's batch size become a :class:`BatchSize`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_source: dict[str, Any] = {}
    for node, value in zip(placeholders, args):
        if isinstance(value, torch.Tensor):
            rec = record(value, call.forward)
            annotate(value, forward, rec)
            source = source_name(node)
            if source is not None:
                by_source[source] = (value, rec)
            example = node.meta.get("example_value")
            if isinstance(rec, Batch) and rec.dim is not None and rec.inner == 1 and example is not None \
                    and not isinstance(example.shape[rec.dim], torch.SymInt):
                forward.escaped.add(rec.count)  # dynamo made the batch size a constant: sizes equal to it are refused
    counts = {rec.count for _, rec in by_source.values() if isinstance(rec, Batch)}
    bound = list(args)
    for i, (node, value) in enumerate(zip(placeholders, args)):
        if isinstance(value, int) and not isinstance(value, bool):
            base, dim = _sizesource_name(node)
            found = by_source.get(base) if base is not None else None
            rec = found[1] if found is not None else None
            if isinstance(rec, Batch) and rec.dim == dim and rec.inner == 1 and value == rec.count:
                bound[i] = BatchSize(value, rec, forward.escaped)
            elif rec is not None and not isinstance(rec, Batch):
                bound[i] = DerivedSize(value)
            elif found is None and value in counts:
                forward.escaped.add(value)  # an input int that may be a batch size: a factory sized by it is refused
    return bound


def _dynamosource_name(node: torch.fx.Node) -> Any:
    """Where dynamo took a graph input from (``L['x']``, ``L['x'].size()[0]``, a parameter), or None."""
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        source = getattr(node.meta.get("grapharg"), "source", None)
    return source


def source_name(node: torch.fx.Node) -> Optional[str]:
    source = _dynamosource_name(node)
    return source.name if source is not None else None


def _sizesource_name(node: torch.fx.Node) -> tuple[Optional[str], Optional[int]]:
    source = _dynamosource_name(node)
    base, idx = getattr(source, "base", None), getattr(source, "idx", None)
    prop = str(getattr(source, "prop", ""))
    if base is None or idx is None or "SIZE" not in prop:
        return None, None
    return base.name, idx
