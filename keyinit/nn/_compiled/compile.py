"""``keyinit.nn.compile(module)``: a keyed forward under ``torch.compile``, with its keys as graph inputs.

``keyed()`` tracks the batch and keys every draw with a Python dispatch mode,
under which dynamo cannot trace. A module wrapped by :func:`compile` is compiled
by dynamo with keyinit's backend instead:

1. dynamo captures the forward's graphs as it always does (keyed()'s hooks and
   modes are taken out of its sight for the call, so a keyed forward adds no
   graph break);
2. for each graph, on its first call (and again for new input shapes or batch
   records), the backend runs the graph once for real under keyed()'s own modes
   (what it writes to its inputs, running statistics included, is put back
   afterwards: the compiled run that follows is the call's one run)
   (:mod:`keyinit.nn._forward.modes`), inside ``make_fx``: the batch of every tensor is
   tracked by the same rules as in an eager keyed forward, each module's calls
   numbered from the graph's ``nn_module_stack``, and every draw recorded as a
   site op of :mod:`keyinit.nn._compiled.sites` whose key and sample offset come from a
   control tensor (``ctl``), a graph input;
3. the traced graph is compiled by the inner backend (``inductor`` by default);
   every call builds ``ctl`` from the running context (seed, step, sample
   offset, micro-batch, repeat count), so a new step or offset is a new input,
   never a recompilation, and the values are the eager keyed forward's.

Each graph keeps its traced forms in a cache keyed by what changes a trace (input shapes, scalars, the
inputs' batch records relative to the forward's start, grad mode, stream and call numbering), never by
step, seed or sample offset (those are ``ctl``). A graph whose batch goes where values say runs eagerly
under keyed()'s modes, for any values: a graph fed rows a router picked by values (a compiled MoE
expert) has one entry per grad mode and numbering, whatever the routing or the rows' count, and once a
graph's trace has needed values it is not traced again. The cache holds at most :data:`CACHE_SIZE`
entries per graph, least recently used first out (an evicted form is traced again when it comes back).

A compiled block inside a compiled model is traced by dynamo as part of the outer forward (its module's
code, keyed by the outer trace like any submodule). The compiled module's own calls are numbered on across its graphs (a graph
break in its forward is fine). A draw that cannot be keyed this way (a random
op that dynamo ran eagerly, outside the compiled graphs, as after LayerDrop's
branch on a draw; a draw in a forward dynamo compiled as a frame of its own or
inside a custom ``autograd.Function``) raises :class:`RanEagerly` before it
draws. Until a call of the module has drawn in compiled graphs, that call is
undone and run again as an eager keyed forward, which the module then stays
(with a warning); later, it is an :class:`~keyinit.errors.UnkeyedRandomnessError`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
import warnings
from typing import Any, Callable, Optional

import torch

from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn._batch.records import Batch, annotate, record
from keyinit.nn._forward.pieces import Forward
from keyinit.nn._context.keyed import context_of
from keyinit.nn._batch.routed import Routed
from keyinit.nn._compiled.sites import Trace
from keyinit.nn._compiled.tracing import (
    Call, Frames, Interpreter, RanEagerly, TraceContext, TraceForward, bind, source_name,
)
from keyinit.nn._compiled.undo import Restoring, Snapshot, fake

__all__ = ["compile", "KeyedCompiled", "CACHE_SIZE"]

_runtime = threading.local()  # .call: the Call running in this thread (None: outside keyed)
_CAPACITY = 1024  # random sites a trace has room for at first (a larger model retraces with more)
#: The most traced forms one dynamo graph keeps (least recently used first out): a bound on the cache
#: whatever the shapes a long run brings (its key never holds a step, seed, offset or routing).
CACHE_SIZE = 64


# ----------------------------------------------------------------------------- one graph


class _Entry:
    """One traced and compiled form of a graph: its function (None: run eagerly under keyed()'s modes),
    whether it takes the control tensor (``keyed``), its slots, its outputs' batch records, and how many
    call ordinals its modules take (``own``: ``{FQN relative to the compiled module: count}``)."""

    __slots__ = ("fn", "keyed", "slots", "outputs", "own")

    def __init__(self, fn: Optional[Callable], keyed: bool, slots: list, outputs: list,
                 own: Optional[dict] = None) -> None:
        self.fn, self.keyed, self.slots, self.outputs = fn, keyed, slots, outputs
        self.own: dict = {} if own is None else own


class _Graph:
    """The callable keyinit's backend returns for one dynamo graph."""

    def __init__(self, owner: "KeyedCompiled", gm: torch.fx.GraphModule, frame: tuple) -> None:
        self.owner, self.gm, self.frame = owner, gm, frame
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()  # (least recently used first)
        self.eager: set = set()  # (grad mode, stream, numbering) for which this graph's trace needed values
        self.constant = [_is_constant(n) for n in gm.graph.nodes if n.op == "placeholder"]
        owner._graphs.add(self)

    def _signature(self, args: tuple, call: Optional[Call]) -> tuple:
        """What a trace is specialized on beyond dynamo's guards: the inputs' shapes (dynamo keeps the batch
        dimension dynamic, a trace does not), scalars, the batch records of the inputs that are not
        parameters or buffers (their starts relative to the forward's), and how calls are numbered. A graph
        that runs eagerly (an input of rows picked by values, or a trace that needed values before) has one
        signature, ``("eager", mode)``: its entry does not depend on shapes, values or routings."""
        mode = (torch.is_grad_enabled(), None if call is None else (call.ctx.root.stream, call.ctx.calls))
        if call is not None and mode in self.eager:
            return ("eager", mode)
        parts: list = [mode]
        for constant, value in zip(self.constant, args):
            if constant:
                continue
            if isinstance(value, torch.Tensor):
                parts.append(tuple(value.shape))
                if call is not None:
                    rec = record(value, call.forward)
                    if type(rec) is Routed:  # rows picked by values: the graph runs eagerly, for any routing
                        return ("eager", mode)
                    if isinstance(rec, Batch):
                        rec = (rec.dim, rec.count, rec.start - call.forward.start, rec.inner)
                    parts.append(rec)
            elif isinstance(value, (int, float, bool)):
                parts.append(value)
        return tuple(parts)

    def __call__(self, *args: Any) -> Any:
        call: Optional[Call] = getattr(_runtime, "call", None)
        signature = self._signature(args, call)
        entry = self.entries.get(signature)
        if entry is None:
            if signature[0] == "eager":
                _warn_eager(self.owner, "it is fed rows picked by values (a router's dispatch), so where its "
                                        "batch goes depends on values")
                entry = _Entry(None, True, [], [])
            else:
                entry = self._compile(args, call)
                if entry.fn is None and call is not None:  # its trace needed values: it runs eagerly from now on
                    mode = signature[0]
                    self.eager.add(mode)
                    signature = ("eager", mode)
            self.entries[signature] = entry
            while len(self.entries) > CACHE_SIZE:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(signature)
        if not entry.keyed:
            return entry.fn(*args)
        if call is None:
            raise UnkeyedRandomnessError(_outside(self.owner))
        if entry.fn is None:  # runs eagerly under keyed()'s modes (see _trace)
            with _Untrapped():
                out, forward, own = self._interpret(args, call, None)
            entry = _Entry(None, True, [], _relative_records(out, forward, call), own)
        else:
            words = [call.forward.start]
            for relative, ordinal in entry.slots:
                k = call.key(relative, ordinal)
                words += (k.k0, k.k1)
            out = entry.fn(*args, torch.tensor(words, dtype=torch.int64))
            call.drew = call.drew or bool(entry.slots)
        call.taken(entry.own)  # its ordinals taken: the next graph (or eager code) numbers on
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        for leaf, rec in zip(leaves, entry.outputs):  # the outputs' batch, for what the forward does next
            if isinstance(leaf, torch.Tensor):
                if isinstance(rec, tuple):
                    dim, count, delta, inner = rec
                    rec = Batch(dim, count, call.forward.start + delta, inner)
                annotate(leaf, call.forward, rec)
        return out

    def _compile(self, args: tuple, call: Optional[Call]) -> _Entry:
        from torch.fx.experimental.proxy_tensor import make_fx

        if call is None:  # outside keyed: fine if the graph draws nothing
            probe = _probe(self.owner)
            with torch.no_grad(), _Untrapped(), Restoring(args), _refuse_draws(probe):
                traced = make_fx(lambda *a: self.gm(*a), tracing_mode="real")(*args)
            return _Entry(self.owner.inner(traced, list(args)), False, [], [])
        capacity = _CAPACITY
        while True:
            try:
                return self._trace(args, call, capacity)
            except OverflowError:
                capacity *= 8

    def _interpret(self, args: tuple, call: Call, trace: Optional[Trace]) -> tuple[Any, TraceForward, dict]:
        """Run the graph under keyed()'s modes, its calls numbered from its nodes' modules: with ``trace``,
        every draw is a site op (inside ``make_fx``); without, the eager keyed forward's draws. Returns the
        output, the forward that holds its records, and the call ordinals its modules took."""
        forward = TraceForward(call.ctx, call.fqn, call.forward.start, call.forward.count, call.forward.repeat)
        forward.trace, forward.numbered, forward.owner_call = trace, set(), call
        code, module = self.frame
        frames = Frames(self.owner.module, forward)
        if module is not self.owner.module:  # a frame of its own: which module it is is not known at run time
            frames.fqns = {}
        forward.why = lambda fqn: _unnumbered(self.owner, fqn, code, module)
        tctx = TraceContext(call, trace)
        bound = bind(self.gm, args, call, forward)
        for mode in tctx.modes:
            mode.__enter__()
        try:
            out = Interpreter(self.gm, tctx, frames).run(*bound)
        finally:
            for mode in reversed(tctx.modes):
                mode.__exit__(None, None, None)
        return out, forward, frames.own_calls()

    def _trace(self, args: tuple, call: Call, capacity: int) -> _Entry:
        from torch.fx.experimental.proxy_tensor import make_fx

        trace = Trace(call.forward.start, call.ctx.root.stream, call.key, capacity)
        results: list = []

        def run(*inputs: Any) -> Any:
            out, forward, own = self._interpret(tuple(inputs[:-1]), call, trace)
            results.append((out, forward, own))
            return out

        with torch.no_grad(), _Untrapped(), Restoring(args):  # (the compiled run is the call's one run)
            try:
                traced = make_fx(run, tracing_mode="real")(*args, trace.ctl)
            except RuntimeError as exc:
                if "get value out of a tracing tensor" not in str(exc):  # .item(), torch.equal, ... on a value
                    raise
                # the graph reads a tensor's value (.item()): a trace would freeze it, so this graph runs
                # eagerly under keyed()'s modes (the eager keyed forward's values, not compiled)
                _warn_eager(self.owner, "it reads a tensor's value (.item(), float(t)), or where its batch goes "
                                        "depends on values (rows picked by index, "
                                        "keyinit.nn._batch.propagate.propagate_traced)")
                return _Entry(None, True, [], [])
        out, forward, own = results[0]
        slots = list(trace.slots)
        ctl = torch.zeros(1 + 2 * len(slots), dtype=torch.int64)
        fn = self.owner.inner(_reshaping_views(traced), list(args) + [ctl])
        return _Entry(fn, True, slots, _relative_records(out, forward, call), own)


def _warn_eager(owner: "KeyedCompiled", why: str) -> None:
    warnings.warn(f"keyinit.nn.compile({type(owner.module).__name__}): a graph runs eagerly under keyinit.nn.keyed, "
                  f"not compiled: {why}", stacklevel=3)


def _reshaping_views(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its ``aten.view`` nodes made ``aten.reshape``. The graph was traced on real tensors,
    which fixed each view's legality by their strides; the backend traces it again on fake tensors under
    its own decompositions, whose intermediate strides may differ (a ``cat`` with an empty tensor, as
    HF's cache does, gives back its other input), so a view legal on the real strides can fail there.
    ``reshape`` is the view wherever one exists (graph inputs keep their strides, so views of them stay
    views) and a copy otherwise, with the same values."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def _relative_records(out: Any, forward: Forward, call: Call) -> list:
    """The batch records of a graph's outputs, each start relative to the forward's."""
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    records = []
    for leaf in leaves:
        rec = record(leaf, forward) if isinstance(leaf, torch.Tensor) else None
        if isinstance(rec, Batch):
            rec = (rec.dim, rec.count, rec.start - call.forward.start, rec.inner)
        records.append(rec)
    return records


def _is_constant(node: torch.fx.Node) -> bool:
    """A parameter or buffer of the compiled module (its batch record is always None)."""
    source = source_name(node) or ""
    return "_parameters" in source or "_buffers" in source


def _outside(owner: "KeyedCompiled") -> str:
    return (f"keyinit.nn.compile({type(owner.module).__name__}): its forward draws (dropout or another random op "
            "in training mode), and it was called outside keyinit.nn.keyed: call it inside "
            "`with keyinit.nn.keyed(model, seed, step=...)`, or in eval mode")


def _unnumbered(owner: "KeyedCompiled", fqn: str, code: str, module: Any) -> str:
    where = fqn.strip("<>")
    if where.startswith("inside torch.ops.higher_order."):
        reason = (f"the draw runs {where} (a custom autograd.Function, a control-flow op, ...), whose body keyinit "
                  "does not trace node by node")
    elif module is not owner.module:
        reason = (f"dynamo compiled the forward of {type(module).__name__} as a frame of its own ({code}), so "
                  "keyinit cannot tell which module of the model it is")
    else:
        reason = f"keyinit cannot find the module {where} of this draw in the compiled module"
    return (f"keyinit.nn.compile({type(owner.module).__name__}): a draw keyinit cannot key: {reason}. Remove the "
            "graph break (torch._dynamo.explain lists them), or run this module eagerly under keyinit.nn.keyed")


def _probe(owner: "KeyedCompiled") -> Callable[[Any], None]:
    def refuse(func: Any) -> None:
        raise UnkeyedRandomnessError(_outside(owner) + f" ({func})")

    return refuse


def _refuse_draws(refuse: Callable[[Any], None]) -> Any:
    """keyinit's mode that refuses draws (:mod:`keyinit._engine.programs.refusal`): every random op that draws (outside keyed)."""
    from keyinit._engine.programs.random_ops import is_random
    from keyinit._engine.programs.refusal import RefuseDraws
    from keyinit.nn._forward.modes import draws_nothing

    return RefuseDraws(refuse, lambda func, args, kwargs: is_random(func) and not draws_nothing(func, args, kwargs))


# ----------------------------------------------------------------------------- eager random ops: refused


class _Trap:
    """While compiled code runs, a random ATen op that reaches torch's kernels ran eagerly (outside the
    compiled graphs): it is refused before it draws (:mod:`keyinit._engine.keyed.intercept`)."""

    def __init__(self, owner: "KeyedCompiled") -> None:
        self.owner = owner
        self.saved: Any = None

    def handler(self, op: Any, args: tuple, kwargs: dict) -> Any:
        from keyinit.nn._forward.modes import draws_nothing

        if getattr(_runtime, "untrapped", 0) or draws_nothing(op, args, kwargs) or fake(args, kwargs):
            return op(*args, **kwargs)
        raise RanEagerly(
            str(op),
            f"keyinit.nn.compile({type(self.owner.module).__name__}): {op} ran eagerly, outside the compiled "
            "graphs (dynamo fell back to Python for that code, e.g. after a graph break on a draw such as "
            "LayerDrop's `if torch.rand([]) < p`), where keyinit cannot key it. Remove the graph break "
            "(torch._dynamo.explain lists them), or run this module eagerly under keyinit.nn.keyed"
        )

    def __enter__(self) -> None:
        from keyinit._engine.keyed import intercept as _intercept

        if _intercept.available():
            self.saved = _intercept.enter(self.handler)

    def __exit__(self, *exc: Any) -> None:
        from keyinit._engine.keyed import intercept as _intercept

        if self.saved is not None:
            _intercept.leave(self.saved)


class _Untrapped:
    def __enter__(self) -> None:
        _runtime.untrapped = getattr(_runtime, "untrapped", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _runtime.untrapped -= 1


# ----------------------------------------------------------------------------- the module


def _strip_orig_mod(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A KeyedCompiled's state_dict entries (and their metadata) under ``prefix`` without ``_orig_mod.``."""
    inner = prefix + "_orig_mod."
    for name in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + name[len(inner):]] = state_dict.pop(name)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # the module's own metadata (its version) in place of the wrapper's
        for name in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[prefix + name[len(inner):] if name != inner[:-1] else prefix[:-1]] = metadata.pop(name)


def _add_orig_mod(state_dict: dict, prefix: str, local_metadata: Any, strict: bool, missing_keys: list,
                  unexpected_keys: list, error_msgs: list) -> None:
    """A state_dict loaded into a KeyedCompiled: names without ``_orig_mod.`` are the module's."""
    inner = prefix + "_orig_mod."
    for name in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + name[len(prefix):]] = state_dict.pop(name)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # (read by the module's own _load_from_state_dict: its version)
        for name in [k for k in metadata if (k == prefix[:-1] or k.startswith(prefix)) and not k.startswith(inner)]:
            metadata[inner + name[len(prefix):] if name != prefix[:-1] else inner[:-1]] = metadata[name]


def _frame_info(owner: "KeyedCompiled") -> tuple:
    """``(code name, module)`` of the frame dynamo is compiling (the backend runs inside its translation):
    the compiled module when the frame holds it (``self``, by any name, or the first of a decorator's
    ``*args``), else the module the frame is a method of, or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, values = tx.f_code, tx.f_locals
    except (ImportError, AttributeError, RuntimeError, AssertionError):
        return "<unknown>", None
    for value in values.values():
        inner = value if isinstance(value, (tuple, list)) else (value,)
        if any(item is owner.module for item in inner):
            return code.co_name, owner.module
    first = code.co_varnames[0] if code.co_argcount else None
    module = values.get(first) if first is not None else None
    return code.co_name, module if isinstance(module, torch.nn.Module) else None


class KeyedCompiled(torch.nn.Module):
    """``module`` compiled by dynamo with keyinit's backend (see :func:`compile`).

    A module of its own, holding ``module`` as ``_orig_mod`` (as ``torch.compile`` does):
    canonical FQNs strip that name, so keys do not change, and its ``state_dict`` hooks strip it
    (and add it back on load), so ``state_dict`` names are the plain module's.
    """

    #: keyed() puts no hooks on this module nor its submodules: its calls key their own draws
    keys_its_calls = True

    def __init__(self, module: torch.nn.Module, backend: Any, options: dict) -> None:
        super().__init__()
        self._orig_mod = module
        options = dict(options)
        # mode= and options= are the inner backend's (torch.compile hands them to its backend, and keyinit's
        # backend hands them to the one that compiles the traced graphs); dynamic= is both dynamo's and its
        mode, inner_options = options.pop("mode", None), options.pop("options", None)
        if mode is not None and inner_options is not None:
            raise ValueError("keyinit.nn.compile: mode= and options= cannot both be given (as in torch.compile); "
                             f"got mode={mode!r} and options={inner_options!r}")
        if inner_options is not None and not isinstance(inner_options, dict):
            raise TypeError(f"keyinit.nn.compile: options= must be a dict of backend options, got "
                            f"{type(inner_options).__name__}")
        dynamic = options.get("dynamic")
        if isinstance(backend, str) and backend == "inductor":
            backend = torch._TorchCompileInductorWrapper(mode, inner_options, dynamic)
        elif mode not in (None, "default") or inner_options:
            backend = torch._TorchCompileWrapper(backend, mode, inner_options, dynamic)
        elif isinstance(backend, str):
            from torch._dynamo import lookup_backend

            backend = lookup_backend(backend)
        object.__setattr__(self, "_inner", backend)
        object.__setattr__(self, "_eager", False)  # its draws run eagerly: it runs as an eager keyed forward
        object.__setattr__(self, "_proven", False)  # a call drew in compiled graphs (no more undo)
        object.__setattr__(self, "_unkeyed_ran", False)  # a training call outside keyed ran through (no more undo)
        object.__setattr__(self, "_graphs", weakref.WeakSet())  # its graphs (_Graph) that dynamo holds
        object.__setattr__(self, "_compiled", torch.compile(module, backend=self._backend, **options))
        # state_dict names are the module's own (no "_orig_mod."), and a state_dict of the plain module loads
        self._register_state_dict_hook(_strip_orig_mod)
        self._register_load_state_dict_pre_hook(_add_orig_mod)

    @property
    def module(self) -> torch.nn.Module:
        return self._orig_mod

    @property
    def runs_eagerly(self) -> bool:
        """Its draws run eagerly under dynamo, so it runs as an eager keyed forward (see :func:`compile`)."""
        return self._eager

    @property
    def cached_traces(self) -> int:
        """How many traced forms its graphs hold now (at most :data:`CACHE_SIZE` per graph)."""
        return sum(len(graph.entries) for graph in list(self._graphs))

    def inner(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return self._inner(gm, example_inputs)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return _Graph(self, gm, _frame_info(self))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._orig_mod
        if torch.compiler.is_dynamo_compiling():
            # traced by dynamo as part of an outer compiled forward (a compiled block in a compiled model):
            # its module's code is the outer graph's, keyed by the outer module's trace like any submodule
            return module(*args, **kwargs)
        ctx = context_of(module)
        if ctx is None:
            if not self._unkeyed_ran and any(m.training for m in module.modules()):
                # a training forward outside keyed is refused at its first draw: until one such call has run
                # through, what a refused call changed before its draw (running statistics) is put back
                snapshot = Snapshot(module, args, kwargs)
                try:
                    out = self._run(None, args, kwargs)
                except UnkeyedRandomnessError:
                    snapshot.restore("a draw outside keyinit.nn.keyed was refused")
                    raise
                object.__setattr__(self, "_unkeyed_ran", True)
                return out
            return self._run(None, args, kwargs)
        if ctx.index != "tracked":
            raise ValueError(f"keyinit.nn.compile({type(module).__name__}): called inside "
                             f"keyinit.nn.keyed(..., index={ctx.index!r}), which a compiled module does not support "
                             "(its draws are keyed by the default index='tracked'); use keyed(model, seed, step) "
                             "or run the module uncompiled")
        if self._eager:
            return self._run_eagerly(ctx, args, kwargs)
        fqn = ctx.module_fqn(module)
        frame = ctx.current_frame()
        if frame is not None:  # inside an eager keyed forward: its root forward, its host generators
            forward, host = frame.forward, contextlib.nullcontext()
        else:
            forward = ctx.root_forward(module, fqn, args, kwargs)
            host = ctx.host_random(forward)
        # until a call has drawn in compiled graphs, a call that turns out to run a draw eagerly is undone and
        # run again eagerly: what it drew is forgotten and the buffers it wrote (running statistics) put back
        undo = None if self._proven else (ctx.save_draws(forward), Snapshot(module, args, kwargs))
        suspended = ctx.suspend(module, fqn, forward)  # modes off, the module's own frame open
        call = Call(ctx, forward, fqn, module, suspended[-1])
        try:
            with host:
                out = self._run(call, args, kwargs)
        except RanEagerly as exc:
            if undo is None:
                raise
            ctx.resume(suspended)
            suspended = None
            ctx.restore_draws(forward, undo[0])
            undo[1].restore("its call ran a draw eagerly and cannot be run again as an eager keyed forward")
            object.__setattr__(self, "_eager", True)
            warnings.warn(f"keyinit.nn.compile({type(module).__name__}): dynamo runs part of its forward eagerly "
                          f"(a graph break it cannot compile around), where keyinit cannot key a draw ({exc.what}); "
                          "the module runs eagerly under keyinit.nn.keyed from now on (the same values, not "
                          "compiled). torch._dynamo.explain lists the graph breaks", stacklevel=2)
            return self._run_eagerly(ctx, args, kwargs)
        finally:
            if suspended is not None:
                ctx.resume(suspended)
        if call.drew:
            object.__setattr__(self, "_proven", True)
        return out

    def _run_eagerly(self, ctx: Any, args: tuple, kwargs: dict) -> Any:
        """The module's forward as an eager keyed forward (keyed()'s hooks on its modules for the call)."""
        added = ctx.hook_modules(self._orig_mod)
        try:
            return self._orig_mod(*args, **kwargs)
        finally:
            ctx.unhook_modules(added)

    def _run(self, call: Optional[Call], args: tuple, kwargs: dict) -> Any:
        if call is not None:
            for t in (a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)):
                rec = record(t, call.forward)
                if isinstance(rec, Batch) and rec.dim is not None and rec.inner == 1 and t.shape[rec.dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, rec.dim)
        saved = getattr(_runtime, "call", None)
        _runtime.call = call
        try:
            with _Trap(self):
                return self._compiled(*args, **kwargs)
        finally:
            _runtime.call = saved


def compile(module: torch.nn.Module, *, backend: Any = "inductor", **options: Any) -> KeyedCompiled:
    """``torch.compile(module)`` for keyed forwards: inside :func:`keyinit.nn.keyed` its draws are keyed.

    Use the result where the module was, and key it as usual::

        model = keyinit.nn.compile(model)                  # or a block: model.layers[i] = compile(block)
        with keyinit.nn.keyed(model, seed, step=step, sample_offset=first_sample):
            loss = loss_fn(model(batch), target)
        loss.backward()

    Every random op of the compiled forward gets the values the eager keyed
    forward gives it (``docs/spec.md`` section 14), from keys and a sample offset
    passed to the compiled graph as a tensor: no graph break is added and a new
    step, seed, sample offset or micro-batch is not a recompilation. ``backend``
    (the one that compiles the keyed graphs, ``"inductor"`` by default) and
    ``options`` (``fullgraph``, ``dynamic``, ``mode``, ``options``, ...) are ``torch.compile``'s:
    ``mode`` and ``options`` reach ``backend`` as ``torch.compile`` passes them.
    Outside ``keyed`` the module runs compiled as long as it draws nothing (eval
    mode); a draw there is an :class:`~keyinit.errors.UnkeyedRandomnessError`.
    See ``docs/dropout.md`` (torch.compile) for what is refused and why.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"keyinit.nn.compile: module must be a torch.nn.Module, got {type(module).__name__}")
    return KeyedCompiled(module, backend, options)
