"""Capture: run existing init code once, on global-shape stand-ins, and record what it does.

:class:`Capture` gives every model tensor a *stand-in*: a :class:`LazyTensor` with the
tensor's GLOBAL shape and dtype, reporting device ``cpu``, holding no memory. Init code
(``reset_parameters``, ``init_weights(**kwargs)``, HF's ``_init_weights``) runs on the
stand-ins unchanged, so it never sees a DTensor, a shard or a meta tensor. Under the
capture's ``TorchDispatchMode`` every aten op the code issues is recorded into
:mod:`keyinit._engine.programs.program` nodes instead of being computed:

- views (slicing, ``select``, ``.T``, ``.data``, ``view``, ``chunk``, ...) share the
  buffer of their base; in-place ops, ``copy_`` and ``out=`` become writes into it;
- factories (``empty``, ``zeros``, ``arange``, ``torch.tensor``) become new buffers;
- element-wise ops, ``cat``/``stack`` and everything else become nodes over their inputs;
- random ops become keyed draws (:mod:`keyinit._engine.programs.random_ops`). ``nn.init.trunc_normal_``
  and ``nn.init.orthogonal_``, whose torch algorithms draw in loops, are recognised by
  their frames and recorded as the :mod:`keyinit.init` initializer of the same
  distribution (the draw keyinit gives every rule); the rest of their body is suppressed;
- ``copy.deepcopy`` of a stand-in (a layer cloned per depth) is a ``clone``: the copy starts
  with the original's values, as in eager torch.

Python that needs a value (``.item()``, ``bool(t)``, ``.tolist()``, ``torch.tensor`` of a
list of 0-d tensors) gets it computed on the spot when it depends on no random draw;
depending on one is an :class:`keyinit.UnkeyedRandomnessError`, because a draw is keyed
by where it lands. The global torch RNG is never read or advanced.

The stand-in tensor itself is :mod:`keyinit._engine.capture.standin`; what each aten op is to a capture (the
op tables, schema facts) is :mod:`keyinit._engine.capture.aten_kinds`; giving real values to stand-ins that
code stored outside parameters and buffers is :mod:`keyinit._engine.capture.escape`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_unflatten

from keyinit._engine.programs.random_ops import Effects, bind_arguments, is_random, keyed_effects
from keyinit.errors import UnkeyedRandomnessError
from keyinit._engine.programs.program import Alloc, Cat, Const, StridedView, Item, Literal, Node, Pointwise, Random, Read
from keyinit._engine.programs.program import Storage, Suppressed, Whole
from keyinit._engine.capture.aten_kinds import (
    ALLOC, CAT, CONST_FACTORIES, COPY, DATA_DEPENDENT, FILL_VALUE, FULL, IDENTITY, INDEXING, LAZY_NEW, LIFTS, LOADERS,
    REINTERPRETING, SET_STORAGE, VALUE_OPS, ZERO, aten, convert, fit, is_kwarg_only, mutated_args, op_name, recognised, reinterprets,
    returns_self,
)
from keyinit._engine.capture.outside import came_from_outside, watched
from keyinit._engine.programs.replay import Evaluator
from keyinit._engine.capture.standin import CaptureError, LazyTensor, tensor_leaves, tree_map

__all__ = ["LazyTensor", "Capture", "CaptureError", "capturing"]

_THREAD = threading.local()  # .depth: how many captures run on this thread now (capturing())


def capturing() -> bool:
    """Whether code on this thread runs under a capture now: a random op there is the capture's to key
    (one thread-local read; keyed samples' op kernels pass such an op on, see keyinit._engine.keyed.intercept)."""
    return getattr(_THREAD, "depth", 0) > 0


class _Mode(TorchDispatchMode):
    def __init__(self, capture: "Capture") -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):  # noqa: ANN001
        return self.capture.handle(func, args, kwargs or {})


class Capture:
    """A capture session: stand-ins, the dispatch mode, and the buffers of everything recorded.

    ``site`` names the code running now (for errors); ``label`` names it in reports.
    """

    def __init__(self) -> None:
        self._storages: dict[int, Storage] = {}
        self._bases: list[torch.Tensor] = []  # keeps meta storages alive, so their ids stay unique
        self._claimed: list[types.FrameType] = []
        self._recognised = recognised()
        self.emptied: dict[int, str] = {}  # id(storage) -> the site whose to_empty forgot its contents
        self.made: list = []  # weak references to the stand-ins made (escape.sweep_escaped)
        self.made_limit = 1024
        self.overwritten: list[tuple[torch.Tensor, torch.Tensor]] = []  # real tensors written: (memory, old values)
        # id(storage) of a view that reinterprets memory, computed as a copy -> (the storage it views, its version)
        self._copied_views: dict[int, tuple[Storage, Any]] = {}
        self.site = "<init code>"
        self.label = "init code"
        self._mode = _Mode(self)

    @staticmethod
    def running() -> Optional["Capture"]:
        """The capture whose mode is active on this thread's dispatch-mode stack, if any."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        for mode in reversed(_get_current_dispatch_mode_stack()):
            if isinstance(mode, _Mode):
                return mode.capture
        return None

    # ------------------------------------------------------------------ stand-ins
    def standin(self, shape: tuple[int, ...], dtype: torch.dtype, label: str) -> LazyTensor:
        """A fresh stand-in of a contiguous buffer of ``shape`` (nothing written yet)."""
        with _disable_current_modes():  # also from inside init code running under the capture
            meta = torch.empty(shape, dtype=dtype, device="meta")
        self._register(meta, label)
        return LazyTensor(meta, self)

    def storage_of(self, tensor: LazyTensor) -> Storage:
        return self._storages[tensor._meta.untyped_storage()._cdata]

    def _register(self, meta: torch.Tensor, label: str) -> Storage:
        cdata = meta.untyped_storage()._cdata
        storage = self._storages.get(cdata)
        if storage is None:
            numel = meta.untyped_storage().nbytes() // max(meta.element_size(), 1)
            storage = Storage(numel, meta.dtype, label)
            self._storages[cdata] = storage
            self._bases.append(meta)
        return storage

    def forget(self, tensor: LazyTensor) -> None:
        """From now on the elements of ``tensor``'s buffer are uninitialized, as after eager
        ``to_empty``: what was written before is dead, and reading it is an error."""
        storage = self.storage_of(tensor)
        storage.current = Alloc(storage)
        self.emptied[id(storage)] = self.site

    @contextlib.contextmanager
    def active(self, site: str, label: str) -> Iterator[None]:
        """Run init code under capture; ``site`` names it in errors, ``label`` in reports."""
        before = (self.site, self.label)
        self.site, self.label = site, label
        _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
        try:
            with watched(site), torch.no_grad(), self._mode:  # Python's and numpy's generators, threads
                yield
        finally:
            _THREAD.depth -= 1
            self.site, self.label = before
            self._claimed.clear()

    # ------------------------------------------------------------------ reading values
    def node(self, value: Any, fresh: bool = False) -> Node:
        """The node of a tensor argument at this moment (``fresh``: made now from Python data, not from outside)."""
        if isinstance(value, LazyTensor):
            storage = self.storage_of(value)
            taken = self._copied_views.get(id(storage))
            if taken is not None and taken[0].current is not taken[1]:
                raise CaptureError(f"{self.site}: init code wrote into {taken[0].label} after taking a view of it "
                                   f"that reinterprets its memory ({REINTERPRETING}), which keyinit computes as a "
                                   f"copy of its values when it is taken: take that view after the last write")
            return Read(storage.current, StridedView.of(value._meta), value.dtype)
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                raise CaptureError(f"{self.site}: init code used a meta tensor of shape {tuple(value.shape)} that keyinit "
                                   "did not create; it holds no values")
            return Literal((value if fresh else came_from_outside(value)).detach().to("cpu").contiguous())
        raise TypeError(f"internal: not a tensor: {type(value).__name__}")

    def concrete(self, value: LazyTensor, why: str) -> torch.Tensor:
        """The real value of a stand-in now (deterministic code only)."""
        with _disable_current_modes():
            evaluator = Evaluator({}, why_unkeyed=f"uses the values of a tensor in Python ({why})")
            return evaluator.full(self.node(value))

    # ------------------------------------------------------------------ frames
    def _stack(self) -> list[types.FrameType]:
        frames = []
        frame: Optional[types.FrameType] = sys._getframe(2)
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return frames

    def _suppressed(self, stack: list[types.FrameType]) -> bool:
        if not self._claimed:
            return False
        live = {id(f) for f in stack}
        self._claimed = [f for f in self._claimed if id(f) in live]
        return bool(self._claimed)

    def _claim(self, stack: list[types.FrameType]) -> bool:
        """Record the innermost recognised init function on the stack as a keyed initializer."""
        for frame in stack:
            make = self._recognised.get(frame.f_code)
            if make is None:
                continue
            target = frame.f_locals.get("tensor")
            if not isinstance(target, LazyTensor):
                raise UnkeyedRandomnessError(
                    f"{self.site}: init code called nn.init.{frame.f_code.co_name.lstrip('_')}() on a tensor keyinit "
                    f"does not manage (not a parameter, buffer or tensor created inside the init code)")
            initializer = make(frame.f_locals)
            self._writable(target)
            draw = Random(tuple(target.shape), target.dtype, f"nn.init.{frame.f_code.co_name}", self.site,
                          initializer, by_index=False, element_local=initializer.element_local)
            self.storage_of(target).write(StridedView.of(target._meta), draw, self.label)
            self._claimed.append(frame)
            return True
        return False

    # ------------------------------------------------------------------ dispatch
    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:
        stack = self._stack()
        if any(f.f_code in LOADERS or f.f_code in LAZY_NEW for f in stack) and not any(isinstance(x, LazyTensor) for x in tensor_leaves(args)):
            with _disable_current_modes():  # torch.load's tensors are real: constants where they land
                return func(*args, **kwargs)
        if func in SET_STORAGE and isinstance(args[0], LazyTensor) and not isinstance(args[1], LazyTensor):
            return self._from_memory(func, args, kwargs)
        if torch.Tag.inplace_view in getattr(func, "tags", ()):
            return self._inplace_view(func, args, kwargs)
        if self._suppressed(stack):
            return self._run_suppressed(func, args, kwargs)
        if func in VALUE_OPS:
            concrete = tree_map(lambda x: self.concrete(x, op_name(func)) if isinstance(x, LazyTensor) else x,
                                (args, kwargs))
            return func(*concrete[0], **concrete[1])
        if is_random(func):
            if self._claim(stack):
                return self._run_suppressed(func, args, kwargs)
            return self._record(func, args, kwargs, random=True)
        fixed_shape = False  # an indexing op with integer indices only: its shape does not depend on values
        if func in INDEXING:
            args = self._concrete_masks(func, args)
            fixed_shape = not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        flat = tensor_leaves((args, kwargs))
        if DATA_DEPENDENT & set(getattr(func, "tags", ())) and not fixed_shape \
                and any(isinstance(x, LazyTensor) for x in flat):
            # allclose, nonzero, unique: what they return depends on the values, so they are computed
            # on real values (deterministic ones; a draw's values cannot be known: UnkeyedRandomnessError)
            concrete = tree_map(lambda x: self.concrete(x, op_name(func)) if isinstance(x, LazyTensor) else x,
                                (args, kwargs))
            return func(*concrete[0], **concrete[1])
        if not any(isinstance(x, LazyTensor) for x in flat) and any(isinstance(x, torch.Tensor) for x in flat) \
                and func not in IDENTITY:
            self._keep_overwritten(func, args, kwargs)
            return func(*args, **kwargs)  # real tensors only: run it for real
        return self._record(func, args, kwargs, random=False)

    def _concrete_masks(self, func: Any, args: tuple) -> tuple:
        """``t[mask]`` / ``t[mask] = v`` with a boolean stand-in mask whose values are known (no draw in them:
        ``mask == 1`` of a mask of ones, as torch's pruning container takes): the mask becomes its real
        positions (``nonzero``), so the op has a fixed shape and ``t`` may hold draws. A mask that depends
        on a draw is left as it is (its op needs the draw's values: see :meth:`handle`)."""
        indices = args[1]
        if not any(isinstance(i, LazyTensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return args
        resolved: list[Any] = []
        for index in indices:
            if isinstance(index, LazyTensor) and index.dtype in (torch.bool, torch.uint8):
                try:
                    mask = self.concrete(index, op_name(func))
                except UnkeyedRandomnessError:
                    return args
                with _disable_current_modes():
                    resolved.extend(mask.bool().nonzero(as_tuple=True))
            else:
                resolved.append(index)
        return (args[0], resolved, *args[2:])

    def _from_memory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``t.set_(storage, ...)`` of a fresh stand-in (``torch.asarray(storage)``: how safetensors, and so
        Hugging Face and timm, make tensors of a checkpoint): the stand-in now holds that real memory,
        a constant of the record, as ``torch.load``'s tensors are."""
        target = args[0]
        label = self.storage_of(target).label
        if label != "temporary":
            raise CaptureError(f"{self.site}: init code's {op_name(func)} replaces the memory of {label}; keyinit "
                               f"captures model tensors of fixed memory (copy_ the values in instead)")
        with _disable_current_modes():
            real = func(torch.empty((0,), dtype=target.dtype), *args[1:], **kwargs)
            whole = torch.empty((0,), dtype=target.dtype).set_(real.untyped_storage())  # all the storage holds
            base = torch.empty(whole.shape, dtype=target.dtype, device="meta")
            meta = base.as_strided(real.size(), real.stride(), real.storage_offset())
        with no_dispatch():  # the wrapper's own sizes and strides, which Python code sees
            func(*args, **kwargs)
        self._register(base, label).write(StridedView.of(base), Literal(came_from_outside(whole)), self.label)
        target._meta = meta
        return target

    def _keep_overwritten(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Before an op writes real tensors (a pretrained module the builder was given:
        ``backbone.fc.bias.zero_()``), keep what it overwrites, for :meth:`put_back`."""
        names = mutated_args(func)
        if not names:
            return
        bound = bind_arguments(func, args, kwargs)
        for tensor in tensor_leaves([bound.get(name) for name in names]):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                alias = tensor.detach()  # the memory written now, whatever tensor.data becomes later
                self.overwritten.append((alias, alias.clone()))

    def put_back(self) -> None:
        """Put back every real tensor's values the captured code overwrote (latest first)."""
        with torch.no_grad(), _disable_current_modes():
            while self.overwritten:
                alias, values = self.overwritten.pop()
                alias.copy_(values)

    def _inplace_view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``t_``, ``transpose_``, ``unsqueeze_``, ``squeeze_``, ``as_strided_``: the tensor becomes a view of
        its own buffer. Nothing is written; the stand-in's metadata (and its meta twin's) change in place."""
        [name] = mutated_args(func)
        target = bind_arguments(func, args, kwargs)[name]
        if not isinstance(target, LazyTensor):
            return func(*args, **kwargs)
        if self._inplace_view_is_noop(func, args, kwargs, target):
            return target  # resize_ to its own shape (torch's out= handling): nothing changes
        label = self.storage_of(target).label
        if label != "temporary":
            raise CaptureError(f"{self.site}: init code's {op_name(func)} changes the shape of {label} in place; "
                               f"keyinit captures model tensors of fixed shape (assign a new tensor instead)")
        margs, mkwargs = self._to_meta(func, args, kwargs)
        func(*margs, **mkwargs)  # the meta twin: the buffer geometry every later op reads
        with no_dispatch():  # the wrapper's own sizes and strides, which Python code sees
            include = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                func(*args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(include)
        return target

    def _inplace_view_is_noop(self, func: Any, args: tuple, kwargs: dict, target: LazyTensor) -> bool:
        """Run the op on a private meta copy of ``target``'s geometry: does it change anything?"""
        meta = target._meta
        with _disable_current_modes():
            base = torch.empty(meta.untyped_storage().nbytes() // max(meta.element_size(), 1), dtype=meta.dtype,
                               device="meta")
            probe = base.as_strided(meta.size(), meta.stride(), meta.storage_offset())
        margs, mkwargs = tree_map(lambda x: probe if x is target else (x._meta if isinstance(x, LazyTensor) else x),
                                  (args, kwargs))
        before = StridedView.of(probe)
        with _disable_current_modes():
            func(*margs, **mkwargs)
        return StridedView.of(probe) == before

    def _to_meta(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def convert(x: Any) -> Any:
            if isinstance(x, LazyTensor):
                return x._meta
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            if isinstance(x, torch.device):
                return torch.device("meta")
            return x

        margs, mkwargs = tree_map(convert, (args, kwargs))
        if "device" in mkwargs or any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
            mkwargs["device"] = torch.device("meta")  # a factory without a device would run for real
        return margs, mkwargs

    def _run_meta(self, func: Any, args: tuple, kwargs: dict) -> Any:
        margs, mkwargs = self._to_meta(func, args, kwargs)
        return func(*margs, **mkwargs)

    def _run_suppressed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Inside a recognised init function: shapes only, nothing recorded."""
        if func in VALUE_OPS:
            return False if func is not aten._local_scalar_dense.default else 0
        out = self._run_meta(func, args, kwargs)
        outputs = [o for o in tensor_leaves(out) if isinstance(o, torch.Tensor)]
        returns = [Suppressed(tuple(o.shape), o.dtype) for o in outputs]
        return self._wrap(args, kwargs, bind_arguments(func, args, kwargs), mutated_args(func), out, returns)

    def _record(self, func: Any, args: tuple, kwargs: dict, *, random: bool) -> Any:
        bound = bind_arguments(func, args, kwargs)
        mutated = [bound[m] for m in mutated_args(func) if isinstance(bound.get(m), LazyTensor)]
        before = [StridedView.of(t._meta) for t in mutated]
        try:
            # An in-place draw returns its own argument: no need to run torch's (Python) meta decomposition.
            out = mutated[0]._meta if random and mutated and returns_self(func) else self._run_meta(func, args, kwargs)
        except Exception as exc:  # no meta kernel, or a data-dependent shape: compute it for real
            if random:
                try:
                    out = self._infer(func, args, kwargs, exc)  # shapes only: the draw itself is keyed below
                except CaptureError as failure:
                    raise UnkeyedRandomnessError(f"{self.site}: init code called {op_name(func)}(), which keyinit "
                                                 f"cannot key: it cannot run on stand-ins ({exc})") from failure
            else:
                try:
                    return self._run_concrete(func, args, kwargs, exc)
                except UnkeyedRandomnessError:
                    out = self._infer(func, args, kwargs, exc)  # the inputs depend on draws: record it
        if any(StridedView.of(t._meta) != g for t, g in zip(mutated, before)):
            raise CaptureError(f"{self.site}: init code's {op_name(func)} resizes the tensor it writes into (an out= "
                               f"argument of another shape); keyinit captures writes into tensors of fixed shape")
        outputs = [o for o in tensor_leaves(out) if isinstance(o, torch.Tensor)]
        if random:
            effects = keyed_effects(func, args, kwargs, outputs, self.site, self.node)
            names = mutated_args(func)
            if names and not effects.writes and any(v is not None for v in effects.returns):
                # an out= variant: the returns are written into the out arguments, in order
                effects = Effects((None,) * len(effects.returns), tuple(zip(names, effects.returns)))
        else:
            effects = self._effects(func, args, kwargs, bound, outputs)
        for name, value in effects.writes:
            self._write(bound.get(name), value)
        return self._wrap(args, kwargs, bound, mutated_args(func), out, list(effects.returns))

    def _infer(self, func: Any, args: tuple, kwargs: dict, why: Exception) -> Any:
        """Output shapes of an op with no meta kernel (``geqrf``): run it on zeros of the inputs' shapes.

        Only for ops whose output shapes cannot depend on the input values."""
        tags = set(getattr(func, "tags", ()))
        if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
            raise CaptureError(f"{self.site}: cannot capture {op_name(func)}: its output shape depends on values "
                               f"that depend on random draws ({why})") from why
        random = is_random(func)
        if random and not any(a.name == "generator" for a in func._schema.arguments):
            raise CaptureError(f"{self.site}: cannot capture {op_name(func)}: no meta kernel ({why})") from why
        with _disable_current_modes():
            def zeros(x: Any) -> Any:
                if isinstance(x, LazyTensor):
                    return torch.zeros_like(x._meta, device="cpu")
                if isinstance(x, torch.device):
                    return torch.device("cpu")
                return x

            dummy_args, dummy_kwargs = tree_map(zeros, (args, kwargs))
            if random:  # draw from a private generator: the global RNG is never touched
                position = [a.name for a in func._schema.arguments].index("generator")
                if position < len(dummy_args):
                    dummy_args = (*dummy_args[:position], torch.Generator(device="cpu"), *dummy_args[position + 1:])
                else:
                    dummy_kwargs["generator"] = torch.Generator(device="cpu")
            try:
                result = func(*dummy_args, **dummy_kwargs)
            except Exception as exc:
                raise CaptureError(f"{self.site}: cannot capture {op_name(func)}: {why}") from exc
            return tree_map(lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                            if isinstance(x, torch.Tensor) else x, result)

    def _run_concrete(self, func: Any, args: tuple, kwargs: dict, why: Exception) -> Any:
        with _disable_current_modes():
            concrete_args = tree_map(lambda x: self.concrete(x, op_name(func)) if isinstance(x, LazyTensor) else x,
                                     (args, kwargs))
            try:
                result = func(*concrete_args[0], **concrete_args[1])
            except Exception as exc:
                raise CaptureError(f"{self.site}: cannot capture {op_name(func)}: {why}") from exc

        def lift(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                lazy = self.standin(tuple(x.shape), x.dtype, "temporary")
                self.storage_of(lazy).write(StridedView.of(lazy._meta), Literal(x.contiguous()), self.label)
                return lazy
            return x

        return tree_map(lift, result)

    def _write(self, target: Any, value: Node) -> None:
        if not isinstance(target, LazyTensor):
            raise UnkeyedRandomnessError(
                f"{self.site}: init code writes into a tensor keyinit does not manage"
                + (f" (shape {tuple(target.shape)})" if isinstance(target, torch.Tensor) else "")
                + ": not a parameter, buffer or tensor created inside the init code")
        self._writable(target)
        self.storage_of(target).write(StridedView.of(target._meta), fit(value, target._meta), self.label)

    def _writable(self, target: LazyTensor) -> None:
        """A view that reinterprets memory is a copy (see :meth:`_wrap`): a write into it would not reach
        what it views."""
        taken = self._copied_views.get(id(self.storage_of(target)))
        if taken is not None:
            raise CaptureError(f"{self.site}: init code writes into a view of {taken[0].label} that reinterprets its "
                               f"memory ({REINTERPRETING}), which keyinit computes as a copy of its values: the write "
                               f"would not reach them; write into the tensor itself")

    def _effects(self, func: Any, args: tuple, kwargs: dict, bound: dict[str, Any],
                 outputs: list[torch.Tensor]) -> Effects:
        """What a deterministic op computes: values of its new outputs and of its mutated arguments."""
        name = op_name(func)
        mutated = mutated_args(func)
        first = outputs[0] if outputs else None

        def result(value: Optional[Node]) -> Effects:
            if mutated:
                return Effects((None,) * len(outputs), ((mutated[0], value),) if value is not None else ())
            return Effects((value,), ())

        if func in ALLOC:
            return Effects((None,) * len(outputs), ())
        if func in CONST_FACTORIES:
            return result(Const(tuple(first.shape), first.dtype, CONST_FACTORIES[func]))
        if func in FULL:
            return result(Const(tuple(first.shape), first.dtype, bound.get("fill_value", bound.get("s"))))
        if func in ZERO or func in FILL_VALUE:
            value = 0 if func in ZERO else bound["value"]
            if isinstance(value, torch.Tensor):
                return result(convert(self.node(value), tuple(first.shape), first.dtype, name))
            return result(Const(tuple(first.shape), first.dtype, value))
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        if not positions:  # a factory with no tensor inputs (arange, linspace, eye, ...): compute it
            values = self._factory(func, args, kwargs)
            return Effects(tuple(values), ())
        if func in COPY:
            return result(convert(self.node(bound["src"]), tuple(first.shape), first.dtype, name))
        if func in IDENTITY:
            return result(convert(self.node(flat[positions[0]], func in LIFTS), tuple(first.shape), first.dtype, name))
        if func in CAT:
            nodes = [self.node(t) for t in bound["tensors"]]
            d = int(bound.get("dim", 0)) % len(first.shape)
            if not CAT[func]:  # torch.cat skips 1-D empty tensors of any other shape
                nodes = [n for n in nodes if n.numel or len(n.shape) == len(first.shape)]
            return result(Cat(tuple(first.shape), first.dtype,
                              tuple(convert(n, n.shape, first.dtype, name) for n in nodes), d, CAT[func]))
        out_kwargs = {m for m in mutated if is_kwarg_only(func, m)}
        # the position of each written argument, in the order of the op's mutated arguments: an in-place
        # op's own tensor (``w.mul_(w)`` reads w as the other operand), an out= argument in the kwargs
        # (``torch.add(x, 1, out=x)`` reads x as the input)
        n_args = len(tree_flatten(args)[0]) if out_kwargs else 0
        slots = [(m, next(j for j, i in enumerate(positions)
                          if flat[i] is bound[m] and (i >= n_args or m not in out_kwargs)))
                 for m in mutated if isinstance(bound.get(m), torch.Tensor)]
        fresh = [j for _m, j in slots]
        out_at = {j for m, j in slots if m in out_kwargs}
        # an out= argument's old contents are never read (``call`` passes an empty tensor in its place):
        # not an input, so an out= tensor fresh from torch.empty is not a read of uninitialized memory
        inputs = tuple(Const(tuple(flat[i].shape), flat[i].dtype, 0) if j in out_at else self.node(flat[i])
                       for j, i in enumerate(positions))
        # ``call`` gets every tensor as a value: the program keeps no stand-in alive (escape.sweep_escaped)
        flat = [None if isinstance(x, torch.Tensor) else x for x in flat]

        def call(*values: torch.Tensor) -> Any:
            rebuilt = list(flat)
            for j, (i, v) in enumerate(zip(positions, values)):
                if j in fresh:
                    # the written argument: a copy (an out= argument's old contents are never read)
                    v = torch.empty(0, dtype=v.dtype) if j in out_at else v.clone()
                rebuilt[i] = v
            a, k = tree_unflatten(rebuilt, spec)
            if k.get("device") is not None:
                k = {**k, "device": torch.device("cpu")}
            produced = func(*a, **k)
            if mutated:  # the written argument's new contents
                written = [rebuilt[positions[j]] for j in fresh]
                return written[0] if len(written) == 1 else tuple(written)
            return produced

        if torch.Tag.pointwise in func.tags and len(outputs) == 1 and len(fresh) <= 1:
            return result(Pointwise(tuple(first.shape), first.dtype, call, inputs, name))
        if len(outputs) == 1 or (mutated and len(fresh) == 1):
            return result(Whole(tuple(first.shape), first.dtype, call, inputs, name))
        whole = Whole((), first.dtype, call, inputs, name)
        if mutated:
            return Effects((None,) * len(outputs), tuple((m, Item(tuple(bound[m].shape), bound[m].dtype, whole, j))
                                                         for j, m in enumerate(mutated) if m in bound))
        return Effects(tuple(Item(tuple(o.shape), o.dtype, whole, j) for j, o in enumerate(outputs)), ())

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> list[Node]:
        with _disable_current_modes():
            k = dict(kwargs)
            if any(a.name == "device" for a in func._schema.arguments):
                k["device"] = torch.device("cpu")
            result = func(*args, **k)
        return [Literal(r.contiguous()) for r in tensor_leaves(result) if isinstance(r, torch.Tensor)]

    def _wrap(self, args: tuple, kwargs: dict, bound: dict[str, Any], mutated: list[str], out: Any,
              returns: list[Optional[Node]]) -> Any:
        """Turn meta results into stand-ins: views and mutated arguments share their input's buffer."""
        by_storage = {}
        for x in tensor_leaves((args, kwargs)):
            if isinstance(x, LazyTensor):
                by_storage.setdefault(x._meta.untyped_storage()._cdata, x)
        written = [bound[m] for m in mutated if isinstance(bound.get(m), LazyTensor)]
        values = iter(returns)

        def wrap(meta: Any) -> Any:
            if not isinstance(meta, torch.Tensor):
                return meta
            value = next(values, None)
            cdata = meta.untyped_storage()._cdata
            for arg in written:
                if arg._meta.untyped_storage()._cdata == cdata and StridedView.of(arg._meta) == StridedView.of(meta):
                    return arg  # an in-place or out= op returns the argument it wrote
            if cdata in by_storage and not reinterprets(meta, by_storage[cdata]._meta):
                return LazyTensor(meta, self)  # a view
            source = self.storage_of(by_storage[cdata]) if cdata in by_storage else None
            if source is not None:  # a view that reinterprets its memory (view(dtype), view_as_real, conj()): a copy
                with _disable_current_modes():
                    meta = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="meta")
            storage = self._register(meta, "temporary")
            if source is not None:
                self._copied_views[id(storage)] = (source, source.current)
            if value is not None:
                storage.write(StridedView.of(meta), fit(value, meta), self.label)
            return LazyTensor(meta, self)

        return tree_map(wrap, out)
