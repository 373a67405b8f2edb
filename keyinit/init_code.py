"""Running existing init code on stand-ins: the calls to capture, and the model while they run.

:class:`Installed` swaps every parameter and buffer of a model for its
:class:`keyinit.capture.LazyTensor` stand-in and restores every module exactly
afterwards (parameters, buffers, attributes, the non-persistent set), reporting
tensors the code re-assigned or created. :class:`PerModuleCall` is a per-module
init method (HF's ``_init_weights``); the parametrization helpers turn a rule for a
parametrized tensor, and spectral norm's constructor state, into init code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from keyinit.capture import Capture, LazyTensor
from keyinit.errors import PlanError
from keyinit.deferred import seed_storage
from keyinit.program import Geometry, Node, Random

if TYPE_CHECKING:
    from keyinit.plan import PlannedTensor

__all__ = ["Installed", "PerModuleCall", "bind_call", "takes_module", "per_module", "call_once", "child_fqn",
           "parametrized_names",
           "through_right_inverse", "parametrization_start"]


#: Set on a callable by :func:`keyinit.per_module` (True) or :func:`keyinit.call_once` (False).
FORM_ATTRIBUTE = "_keyinit_per_module"


def takes_module(fn: Callable[..., Any]) -> bool:
    """Whether a callable init method takes the module as its first argument (HF's ``_init_weights``).

    Decided by what the callable accepts: a required positional parameter means a module is
    passed (per-module form); no positional parameter, only optional ones, or ``*args, **kwargs``
    (torchtitan's and OLMo-core's ``init_weights``) means it is called once. A callable wrapped
    by :func:`keyinit.per_module` or :func:`keyinit.call_once` says so explicitly."""
    explicit = getattr(fn, FORM_ATTRIBUTE, None)
    if isinstance(explicit, bool):
        return explicit
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return parameter.default is parameter.empty
    return False


def per_module(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a per-module init method: ``init_method=keyinit.per_module(fn)`` calls
    ``fn(module, **init_kwargs)`` for every module, children first (HF's ``smart_apply``)."""
    return _with_form(fn, True)


def call_once(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as called once: ``init_method=keyinit.call_once(fn)`` calls ``fn(**init_kwargs)``."""
    return _with_form(fn, False)


def _with_form(fn: Callable[..., Any], per_module_form: bool) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"expected a callable init method, got {type(fn).__name__}")

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(marked, FORM_ATTRIBUTE, per_module_form)
    return marked


def parametrized_names(module: torch.nn.Module) -> list[str]:
    plists = getattr(module, "parametrizations", None)
    if not isinstance(plists, torch.nn.ModuleDict) or not torch.nn.utils.parametrize.is_parametrized(module):
        return []
    return list(plists.keys())


def through_right_inverse(module: torch.nn.Module, module_fqn: str, name: str, shape: tuple[int, ...],
                           dtype: torch.dtype, initializer: Any) -> Callable[[], Any]:
    """Init code for a rule on a parametrized tensor: draw the tensor as the rule says (or start it
    from its constructor record, a :class:`keyinit.program.Node`), then set the originals from it through the parametrizations' ``right_inverse`` (what assigning
    ``module.<name> = value`` does in torch)."""

    def call() -> None:
        plist = module.parametrizations[name]
        capture = next(t for t in plist.parameters())._capture  # type: ignore[attr-defined]
        fqn = f"{module_fqn}.{name}" if module_fqn else name
        if isinstance(initializer, Node):  # a constructor's record (keyinit.deferred)
            value = capture.standin(shape, initializer.dtype, fqn)
            seed_storage(capture.storage_of(value), initializer, capture.label)
        else:
            value = capture.standin(shape, dtype, fqn)
            draw = Random(shape, dtype, f"{fqn} ({initializer!r})", capture.site, initializer,
                          element_local=getattr(initializer, "element_local", True))
            capture.storage_of(value).write(Geometry.contiguous(shape), draw, capture.label)
        for parametrization in reversed(plist):
            if not hasattr(parametrization, "right_inverse"):
                raise PlanError(f"{fqn}: {type(parametrization).__name__} has no right_inverse, so a rule for the "
                                f"parametrized tensor cannot set its originals; give rules for "
                                f"{fqn.rsplit('.', 1)[0] + '.' if '.' in fqn else ''}parametrizations.{name}.original* instead")
            value = parametrization.right_inverse(value)
        if plist.is_tensor:
            plist.original.copy_(value)
        else:
            for i, part in enumerate(value):
                getattr(plist, f"original{i}").copy_(part)

    return call


def parametrization_start(module: torch.nn.Module, parent: Optional[torch.nn.Module]) -> Optional[Callable[[], Any]]:
    """Init code for the state a parametrization module computes in its constructor.

    ``spectral_norm``'s ``_u``/``_v`` start as normalized normal vectors refined by 15 power
    iterations on the weight, as ``torch.nn.utils.parametrizations._SpectralNorm.__init__`` does.
    """
    from torch.nn.utils.parametrizations import _SpectralNorm

    if not isinstance(module, _SpectralNorm) or not hasattr(module, "_u"):
        return None
    if not isinstance(parent, torch.nn.utils.parametrize.ParametrizationList):
        return None
    owner = parent

    def call() -> None:
        weight = owner.original if owner.is_tensor else owner.original0
        matrix = module._reshape_weight_to_matrix(weight)
        rows, cols = matrix.shape
        u = matrix.new_empty(rows).normal_(0, 1)
        v = matrix.new_empty(cols).normal_(0, 1)
        module._u.copy_(torch.nn.functional.normalize(u, dim=0, eps=module.eps))
        module._v.copy_(torch.nn.functional.normalize(v, dim=0, eps=module.eps))
        module._power_method(matrix, 15)

    return call


def child_fqn(module: torch.nn.Module, fqn: str, name: str) -> str:
    from keyinit.fqn import WRAPPER_ATTRIBUTES, _is_data_parallel

    if name in WRAPPER_ATTRIBUTES or (_is_data_parallel(module) and name == "module"):
        return fqn
    return f"{fqn}.{name}" if fqn else name


class PerModuleCall:
    """``fn(module, **kwargs)`` of a per-module init method (HF's ``_init_weights``).

    Runs with the module's tied aliases untied (``untie``): HF initializes every module on
    untied weights and ties them afterwards, so a tied tensor keeps its first owner's init
    (the embedding's padding row, not ``lm_head``'s plain normal draw)."""

    untie = True

    def __init__(self, fn: Callable[..., Any], kwargs: Mapping[str, Any], module: torch.nn.Module) -> None:
        self.fn, self.kwargs, self.module = fn, kwargs, module

    def __call__(self) -> Any:
        return self.fn(self.module, **self.kwargs)


def bind_call(fn: Callable[..., Any], kwargs: Mapping[str, Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args, **kwargs)


class Installed:
    """Stand-ins swapped into the model's modules (``with`` restores every module exactly).

    Init code may also assign tensors to new attributes or register new buffers; those are
    taken back out on exit and reported by :meth:`assigned`.
    """

    def __init__(self, tensors: list[PlannedTensor], standins: dict[int, LazyTensor], capture: Capture,
                 modules: list[tuple[torch.nn.Module, str]]) -> None:
        self.entries: list[tuple[PlannedTensor, dict, str, Any, Any]] = []  # (tensor, table, attr, original, stand-in)
        self.modules = modules
        self.capture = capture
        for t in tensors:
            stand = standins[id(t)]
            original = t.tensor
            replacement: Any = stand
            if isinstance(original, torch.nn.Parameter):
                with capture.active("keyinit", "keyinit"):
                    replacement = torch.nn.Parameter(stand, requires_grad=original.requires_grad)
            for name, value in vars(original).items():  # flags init code reads (HF's _is_hf_initialized, ...)
                if not name.startswith("_") or name == "_is_hf_initialized":
                    try:
                        setattr(replacement, name, value)
                    except (AttributeError, TypeError):
                        pass
            for module, attr in t.locations():
                table = module._parameters if attr in module._parameters else module._buffers
                self.entries.append((t, table, attr, table[attr], replacement))
        self._assigned: list[tuple[torch.nn.Module, str, str, str, LazyTensor]] = []

    def __enter__(self) -> "Installed":
        self.snapshots = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
                          for m, _ in self.modules]
        for _t, table, attr, _original, replacement in self.entries:
            table[attr] = replacement
        return self

    def __exit__(self, *exc: Any) -> None:
        installed = {(id(table), attr) for _t, table, attr, _o, _r in self.entries}
        fqns = {id(m): fqn for m, fqn in self.modules}
        for module, attributes, parameters, buffers, non_persistent in self.snapshots:
            for kind, table, before in (("parameter", module._parameters, parameters), ("buffer", module._buffers, buffers)):
                for name in list(table):
                    if name not in before and isinstance(table[name], LazyTensor):
                        persistent = name not in module._non_persistent_buffers_set
                        self._assigned.append((module, fqns[id(module)], name,
                                               kind if persistent or kind == "parameter" else "buffer (not persistent)",
                                               table[name]))
                    if name not in before:
                        del table[name]
                for name, value in before.items():
                    if (id(table), name) not in installed:
                        table[name] = value
            for name in list(vars(module)):
                value = vars(module)[name]
                if name in attributes and attributes[name] is value:
                    continue
                if isinstance(value, LazyTensor):
                    self._assigned.append((module, fqns[id(module)], name, "attribute", value))
                if name in attributes:
                    object.__setattr__(module, name, attributes[name])
                elif isinstance(value, LazyTensor):
                    delattr(module, name)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
        for _t, table, attr, original, _replacement in reversed(self.entries):
            table[attr] = original
        seen: set[int] = set()  # a cache many modules share (OLMo-core's BufferCache) is walked once
        for module, fqn in self.modules:  # caches init code filled in place (a dict of RoPE tables)
            self.capture.concretize_attributes(module, fqn, seen=seen)

    @contextlib.contextmanager
    def untied(self, module: Optional[torch.nn.Module], capture: Capture) -> Iterator[None]:
        """While ``module``'s init runs, its aliases of tensors first owned elsewhere are throwaway copies."""
        swapped = []
        if module is not None:
            for t, table, attr, _original, replacement in self.entries:
                owned_here = table is module._parameters or table is module._buffers
                if owned_here and not (t.module is module and t.attr == attr):
                    stand = capture.standin(tuple(replacement.shape), replacement.dtype, f"{t.fqn} (untied alias)")
                    if isinstance(replacement, torch.nn.Parameter):
                        stand = torch.nn.Parameter(stand, requires_grad=replacement.requires_grad)
                    swapped.append((table, attr, table[attr]))
                    table[attr] = stand
        try:
            yield
        finally:
            for table, attr, value in reversed(swapped):
                table[attr] = value

    def reassigned(self) -> dict[int, LazyTensor]:
        """Tensors the init code assigned in place of a stand-in (``self.cache = ...``)."""
        found: dict[int, LazyTensor] = {}
        for t, table, attr, _original, replacement in self.entries:
            value = table.get(attr)
            if value is not replacement and isinstance(value, LazyTensor):
                found[id(t)] = value
        return found

    def assigned(self) -> list[tuple[torch.nn.Module, str, str, str, LazyTensor]]:
        """``(module, module fqn, name, kind, value)`` of tensors init code put where no tensor was."""
        return list(self._assigned)
