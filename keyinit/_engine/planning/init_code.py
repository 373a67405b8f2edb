"""Running existing init code on stand-ins: the calls to capture, and the model while they run.

:class:`Installed` swaps every parameter and buffer of a model for its
:class:`keyinit._engine.capture.capture.LazyTensor` stand-in and restores every module exactly
afterwards (parameters, buffers, attributes, the non-persistent set), reporting
tensors the code re-assigned or created. While they are installed, the memory-management
calls init code makes on the model (``to_empty``, ``.to(device)`` and everything else that goes
through ``Module._apply``; FSDP2's ``unshard``/``reshard``/``reset_sharded_param``) act on the
stand-ins, which are global and hold no memory, instead of on the model's real tensors or
shards. :class:`PerModuleCall` is a per-module init method (HF's ``_init_weights``); the
parametrization helpers turn a rule for a parametrized tensor, and spectral norm's
constructor state, into init code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from keyinit._engine.capture.capture import Capture, CaptureError, LazyTensor
from keyinit.errors import PlanError
from keyinit._engine.deferred.deferred import seed_storage
from keyinit._engine.capture.escape import concretize_attributes
from keyinit._engine.programs.program import Alloc, StridedView, Node, Random

if TYPE_CHECKING:
    from keyinit._engine.planning.planned import PlannedTensor

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
    from its constructor record, a :class:`keyinit._engine.programs.program.Node`), then set the originals from it through the parametrizations' ``right_inverse`` (what assigning
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
            capture.storage_of(value).write(StridedView.contiguous(shape), draw, capture.label)
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
    from keyinit.fqn import WRAPPER_ATTRIBUTES, is_data_parallel

    if name in WRAPPER_ATTRIBUTES or (is_data_parallel(module) and name == "module"):
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
        self._held = _hold_memory_calls(self.modules, self.capture)
        return self

    def __exit__(self, *exc: Any) -> None:
        _release_memory_calls(self._held)
        installed = {(id(table), attr) for _t, table, attr, _o, _r in self.entries}
        fqns = {id(m): fqn for m, fqn in self.modules}
        for module, attributes, parameters, buffers, non_persistent in self.snapshots:
            for kind, table, before in (("parameter", module._parameters, parameters), ("buffer", module._buffers, buffers)):
                for name in list(table.keys()):  # keys(): a torch.jit.script module's table iterates by index
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
        seen: dict[int, Any] = {}  # a cache many modules share (OLMo-core's BufferCache) is walked once
        for module, fqn in self.modules:  # caches init code filled in place (a dict of RoPE tables)
            concretize_attributes(self.capture, module, fqn, seen=seen)

    @contextlib.contextmanager
    def untied(self, module: Optional[torch.nn.Module], capture: Capture,
               owners: Optional[Mapping[int, tuple[torch.nn.Module, str]]] = None) -> Iterator[None]:
        """While ``module``'s init runs, aliases are throwaway copies.

        HF initializes every module on untied weights and ties them afterwards (``tie_weights``), so
        a tensor it ties keeps the init of its tie source and nothing written through another name
        of it, by this module or by an ancestor writing into a descendant's alias (ModernBERT's root
        writes ``decoder.weight``). ``owners`` (HF models): ``id(tensor) -> (module, attr)`` of the
        tie source of each tensor HF ties; every other location of it in ``module``'s subtree is
        untied. Without ``owners``: ``module``'s own aliases of tensors first owned elsewhere."""
        swapped = []
        if module is not None:
            # HF (``owners`` given): the tensors tie_weights ties, anywhere in the subtree; otherwise
            # the module's own aliases of tensors first owned elsewhere
            subtree = module.modules() if owners is not None else [module]
            tables = {id(table) for sub in subtree for table in (sub._parameters, sub._buffers)}
            for t, table, attr, _original, replacement in self.entries:
                if not t.aliases or id(table) not in tables or (owners is not None and id(t) not in owners):
                    continue
                owner_module, owner_attr = (owners or {}).get(id(t), (t.module, t.attr))
                if table is owner_module._parameters or table is owner_module._buffers:
                    if attr == owner_attr:
                        continue
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


# ----------------------------------------------------------------------------- memory management on stand-ins
#: FSDP2's calls that gather or free a module's shards (``FSDPModule.unshard``/``reshard``): on
#: stand-ins, which are the global tensors already, there is nothing to gather or free.
_FSDP_MODULE_CALLS = ("unshard", "reshard")


def _hold_memory_calls(modules: list[tuple[torch.nn.Module, str]], capture: Capture) -> list[tuple[Any, str]]:
    """Shadow the memory-management methods of ``modules`` (instance attributes over their class
    methods) while stand-ins are installed; returns what :func:`_release_memory_calls` removes.

    ``Module._apply``, which ``to_empty``, ``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.float()``
    and ``.type()`` all call, applies its function to every stand-in: a result of the same shape and
    dtype that holds a copy is a move (nothing changes); one that holds nothing (``to_empty``'s
    ``empty_like``) leaves the stand-in's elements uninitialized, as eager ``to_empty`` does, so the
    code must write them again; a dtype conversion is a :class:`CaptureError` naming the tensor.
    FSDP2's own ``_apply`` (which re-pads its shards through ``reset_sharded_param``) is shadowed
    with the rest, and so are ``unshard``/``reshard`` and every ``FSDPParam.reset_sharded_param``
    (a ``load_state_dict`` post-hook calls it)."""
    held: list[tuple[Any, str]] = []
    for module, fqn in modules:
        _shadow(module, "_apply", _standin_apply(module, fqn, capture), held)
        if callable(getattr(module, "_get_fsdp_state", None)):
            for name in _FSDP_MODULE_CALLS:
                if callable(getattr(module, name, None)):
                    _shadow(module, name, _nothing_to_move, held)
            for fsdp_param in _fsdp_params(module):
                _shadow(fsdp_param, "reset_sharded_param", _nothing_to_move, held)
    return held


def _release_memory_calls(held: list[tuple[Any, str]]) -> None:
    for owner, name in reversed(held):
        vars(owner).pop(name, None)


def _shadow(owner: Any, name: str, replacement: Callable[..., Any], held: list[tuple[Any, str]]) -> None:
    attributes = getattr(owner, "__dict__", None)
    if not isinstance(attributes, dict) or name in attributes:
        return  # no instance dictionary, or an instance attribute of its own: left alone
    attributes[name] = replacement
    held.append((owner, name))


def _nothing_to_move(*args: Any, **kwargs: Any) -> None:
    """Gathering, freeing or re-padding shards: stand-ins are whole and hold no memory."""
    return None


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects of an FSDP2 module (torch internals: none if they moved)."""
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - not an FSDP2 module after all, or other torch internals
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [p for group in groups for p in getattr(group, "fsdp_params", ())]


def _standin_apply(module: torch.nn.Module, fqn: str, capture: Capture) -> Callable[..., torch.nn.Module]:
    """``module._apply(fn, recurse=True)`` over stand-ins (see :func:`_hold_memory_calls`)."""

    def _apply(fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> torch.nn.Module:
        if recurse:
            for child in module.children():
                child._apply(fn)
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if isinstance(tensor, LazyTensor):
                    _apply_to_standin(fn, tensor, f"{fqn}.{name}" if fqn else name, capture)
        return module

    return _apply


def _apply_to_standin(fn: Callable[[torch.Tensor], Any], standin: LazyTensor, fqn: str, capture: Capture) -> None:
    with torch.no_grad():
        result = fn(standin)
    if result is standin:
        return
    if not isinstance(result, LazyTensor) or tuple(result.shape) != tuple(standin.shape):
        what = getattr(fn, "__qualname__", fn)
        raise CaptureError(f"{fqn}: init code's Module._apply ({what}) turns the tensor into {type(result).__name__} "
                           f"of shape {tuple(getattr(result, 'shape', ()))}; keyinit follows only moves (to_empty, "
                           f".to(device)) of the tensors it materializes")
    if result.dtype != standin.dtype:
        raise CaptureError(f"{fqn}: init code converts it from {standin.dtype} to {result.dtype} (Module.to, .half, "
                           f".float, ...); keyinit materializes a tensor in the dtype the model declares: build the "
                           f"model in {result.dtype}, or convert it after materialize")
    moved = capture.storage_of(result)
    if isinstance(moved.current, Alloc):  # to_empty: fresh memory, nothing written
        capture.forget(standin)
