"""No stand-in escapes a capture: tensors code stored outside a model's parameters and buffers get
their real values.

Init code and constructors keep computed tensors in plain attributes, lists, dicts and cache
objects (OLMo-core's RoPE ``BufferCache``, nn.LSTM's ``_flat_weights``). After a capture,
:func:`concretize_attributes` walks a module's attributes and replaces every
:class:`~keyinit._engine.capture.capture.LazyTensor` found there by the value eager torch would hold,
so nothing fails at the first forward with a stand-in in hand. The tensor torch's hook-based
``weight_norm``, ``spectral_norm`` and pruning keep in a plain attribute (``weight``, computed from
``weight_g``/``weight_v`` or ``weight_orig``/``weight_mask``) is a meta tensor until the model's
tensors hold values; then :func:`keyinit._engine.writing.kept.recompute_derived` computes it, as the hook does.

Stand-ins kept where no walk of the model reaches them (a ``functools.lru_cache`` helper's table, a
closure cell of a hook, a ``functools.partial`` forward hook, a class attribute cache) are found by
:func:`sweep_escaped` (the capture keeps a weak reference to each stand-in it makes: those still alive
when the build ends escaped it) and turned into real tensors in place
(``torch.utils.swap_tensors``), so every reference sees the values eager torch would hold. A model
tensor such a holder shares (``register_buffer("cos", rope_table(n))`` of an ``lru_cache`` helper) is one
too: the model gets a meta tensor, the holder keeps the stand-in object, which gets its real value.
"""

from __future__ import annotations

import functools
import gc
import sys
import types
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import torch

from keyinit._engine.capture.capture import Capture, CaptureError, LazyTensor
from keyinit.errors import UnkeyedRandomnessError

__all__ = ["concretize_attributes", "derived_attributes", "sweep_escaped", "escaped_values", "swap_in",
           "forget_escaped"]

#: nn.Module's own bookkeeping attributes (its parameter, buffer, module and hook tables).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
#: Values stand-ins are never looked for inside: other tensors, modules (each module of a model is
#: walked on its own), classes, functions, Python modules and scalars.
_LEAVES = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
#: How deep containers and plain objects are walked from a module attribute (a cache class holding a
#: dict of dicts of tensors is 4 levels down).
_WALK_DEPTH = 8


def concretize_attributes(capture: Capture, module: torch.nn.Module, module_fqn: str,
                          replaced: Optional[Mapping[int, torch.Tensor]] = None,
                          seen: Optional[dict[int, Any]] = None, site: str = "init code") -> None:
    """Give stand-ins that code stored outside parameters and buffers their real values, as
    eager torch would have them, so no stand-in escapes the capture: plain attributes, tensors
    inside lists, tuples and dicts there, and inside the attributes of plain objects and
    mappings held there (OLMo-core's RoPE ``BufferCache``, a mapping over a dict of dicts).

    Their values must not depend on a draw: a draw is keyed by the parameter or buffer it
    lands in, and a plain attribute is neither (:class:`UnkeyedRandomnessError`, naming it).
    A stand-in that IS a model tensor (nn.LSTM's ``_flat_weights`` list) becomes its
    replacement in ``replaced`` (``id(stand-in) -> tensor``) instead. ``seen`` (``id -> (object,
    what it became)`` of what was walked; the object is kept so its id stays its own) is shared across the modules of one model, so an object many
    modules hold (a cache shared by every block) is walked once, and a stand-in or tuple held in
    two places becomes one real value."""
    seen = {} if seen is None else seen
    derived = derived_attributes(module)
    for name, value in list(vars(module).items()):
        if name in _MODULE_INTERNALS:
            continue
        if name in derived and isinstance(value, LazyTensor):  # torch's hook recomputes it from the parameters
            with torch.utils._python_dispatch._disable_current_modes():
                object.__setattr__(module, name, torch.empty(value.shape, dtype=value.dtype, device="meta"))
            continue
        where = f"{module_fqn}.{name}" if module_fqn else name
        converted = _concrete_tree(capture, value, where, replaced or {}, seen, _WALK_DEPTH,
                                   f"{site}: {{}} (an attribute of {type(module).__name__})")
        if converted is not value:
            object.__setattr__(module, name, converted)


def _recomputing_hooks() -> tuple[type, ...]:
    from torch.nn.utils import prune
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return WeightNorm, SpectralNorm, prune.BasePruningMethod


def derived_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """``{attribute: hook}`` of the tensors torch's hook-based ``weight_norm``, ``spectral_norm`` and pruning
    keep in a plain attribute of ``module`` and recompute from its parameters before every forward."""
    hooks = _recomputing_hooks()
    return {getattr(h, "name", None) or h._tensor_name: h for h in module._forward_pre_hooks.values()
            if isinstance(h, hooks)}


def _concrete_tree(capture: Capture, value: Any, where: str, replaced: Mapping[int, torch.Tensor],
                   seen: dict[int, Any], depth: int, owner: str) -> Any:
    """``value`` with every stand-in inside it replaced by its real value (containers in place); ``owner``
    names where it is in errors (``{}`` stands for ``where``)."""
    if id(value) in seen:
        return seen[id(value)][1]
    if isinstance(value, LazyTensor):
        if id(value) in replaced:
            return replaced[id(value)]
        try:
            seen[id(value)] = (value, capture.concrete(value, f"attribute {where}"))
        except UnkeyedRandomnessError as exc:
            raise UnkeyedRandomnessError(
                f"{owner.replace('{}', where)}: code stored a tensor computed from random draws outside the model's "
                f"parameters and buffers; keyinit keys a draw by the parameter or buffer it lands in: register it "
                f"as a buffer (register_buffer) or a parameter") from exc
        return seen[id(value)][1]
    if depth <= 0 or isinstance(value, _LEAVES):
        return value
    seen[id(value)] = (value, value)

    def inner(item: Any, suffix: str) -> Any:
        return _concrete_tree(capture, item, where + suffix, replaced, seen, depth - 1, owner)

    if isinstance(value, (list, tuple)):
        items = [inner(v, f"[{i}]") for i, v in enumerate(value)]
        if all(new is old for new, old in zip(items, value)):
            return value
        if isinstance(value, list):
            value[:] = items  # in place: other references to the list see real values too
            return value
        seen[id(value)] = (value, type(value)(*items) if hasattr(value, "_fields") else type(value)(items))
        return seen[id(value)][1]
    if isinstance(value, dict):
        changed = {k: new for k, v in list(value.items()) if (new := inner(v, f"[{k!r}]")) is not v}
        value.update(changed)
        return value
    if isinstance(value, MutableMapping):  # a mapping class of its own: through its items
        try:
            items = list(value.items())
        except Exception:  # noqa: BLE001 - a mapping that cannot list itself: its attributes below
            items = []
        for k, v in items:
            new = inner(v, f"[{k!r}]")
            if new is not v:
                value[k] = new
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):  # a plain object (a cache class): through its attributes
        for name, v in list(attributes.items()):
            new = inner(v, f".{name}")
            if new is not v:
                attributes[name] = new
    return value


def _alive(capture: Capture, replaced: Mapping[int, torch.Tensor]) -> list[Any]:
    """Weak references to the stand-ins of ``capture`` still alive that are not model tensors."""
    return [r for r in capture.made if (t := r()) is not None and id(t) not in replaced]


def _deref(reference: Any) -> Any:
    return reference()


def _only_a_base_of(lazy: torch.Tensor, bases: set[int], found: list) -> bool:
    """``lazy`` is alive only as (a view of) the base a model tensor was viewed from
    (``register_buffer("b", p.data[:2])``, ``view_as_complex(x.reshape(n, 2))``): no Python object holds it,
    so it goes with the stand-ins the model's tables drop."""
    if id(lazy) not in bases and (lazy._base is None or id(lazy._base) not in bases):
        return False
    return not any(h is not found and not isinstance(h, types.FrameType) for h in gc.get_referrers(lazy))


def _holders(tensor: torch.Tensor, found: list, drawn: list) -> tuple[str, list[Any]]:
    """What refers to ``tensor`` (but the lists ``found`` and ``drawn`` of the sweep), in words (a closure
    cell is named by its function, an object's attribute by its name and class), and the objects named."""
    names, objects = [], []
    referrers = gc.get_referrers(tensor)
    for holder in referrers:
        if isinstance(holder, types.FrameType) or holder is tensor or holder is found or holder is drawn:
            continue
        if type(holder).__name__ == "cell":
            functions = [f for f in gc.get_referrers(holder) if isinstance(f, tuple)]
            owners = [g.__qualname__ for t in functions for g in gc.get_referrers(t)
                      if isinstance(g, types.FunctionType) and g.__closure__ is t]
            names.append(f"a closure of {owners[0]}" if owners else "a closure")
            continue
        owner = _owner_of(holder) if type(holder) is dict else holder
        attributes = vars(owner) if isinstance(getattr(owner, "__dict__", None), dict) else {}
        attribute = None  # (no generator over ``tensor`` here: it would be a closure cell holding it)
        for key, value in attributes.items():
            if value is tensor:
                attribute = key
        if attribute is not None:
            names.append(f"attribute {attribute} of a {type(owner).__module__}.{type(owner).__qualname__}")
            objects.append(owner)
        elif type(holder) is dict:  # a plain dict: named by what holds it (a functools.partial's keywords)
            parents = [r for r in gc.get_referrers(holder)
                       if r is not referrers and r is not found and not isinstance(r, types.FrameType)]
            names.append(f"a dict in a {type(parents[0]).__module__}.{type(parents[0]).__qualname__}" if parents
                         else "a dict")
            objects.append(parents[0] if parents else holder)
        else:
            names.append(f"a {type(holder).__module__}.{type(holder).__qualname__}")
            objects.append(holder)
    return ", ".join(dict.fromkeys(names)), objects


def _draws(capture: Capture, lazy: torch.Tensor) -> bool:
    """Whether ``lazy``'s value depends on a random draw."""
    try:
        capture.concrete(lazy, "a tensor stored outside the model")
    except UnkeyedRandomnessError:
        return True
    return False


def _owner_of(attributes: dict) -> Any:
    """The object whose ``__dict__`` is ``attributes``, if any."""
    for candidate in gc.get_referrers(attributes):
        if getattr(candidate, "__dict__", None) is attributes:
            return candidate
    return None


def _referrers(obj: Any, found: list, depth: int) -> list[Any]:
    """What refers to ``obj``, and what refers to those, ``depth`` levels up (frames and ``found`` left out)."""
    level, seen, out = [obj], {id(obj), id(found)}, []
    for _ in range(depth):
        level = [h for o in level for h in gc.get_referrers(o)
                 if id(h) not in seen and not isinstance(h, types.FrameType) and h is not level and h is not out]
        seen.update(id(h) for h in level)
        out.extend(level)
    return out


def sweep_escaped(capture: Capture, replaced: Mapping[int, torch.Tensor], site: str) -> None:
    """Give every stand-in of ``capture`` still alive outside the model its real value, in place; one
    whose value depends on a random draw is an :class:`UnkeyedRandomnessError` naming what holds it
    (nothing is changed then). Stand-ins of model tensors (``replaced``) are left alone."""
    swap_in(escaped_values(capture, replaced, site), site)


def escaped_values(capture: Capture, replaced: Mapping[int, torch.Tensor], site: str,
                   model: Optional[torch.nn.Module] = None) -> list:
    """The first half of :func:`sweep_escaped`: ``[(stand-in, its real value)]`` of every stand-in of
    ``capture`` alive outside the model, for :func:`swap_in`; errors are raised here, before anything is
    changed. Stand-ins of model tensors (``replaced``) are left out, but for one that ``model`` (its
    parameter and buffer tables) shares with another holder (``register_buffer("cos", table(n))`` of a
    ``functools.lru_cache`` helper): that holder keeps the stand-in object after the model's tables get meta
    tensors, so it gets its real value (at the end of construction, as eager torch holds it there). Swap
    them in once the model holds meta tensors: a model tensor that is a view of a cached table holds it."""
    shared = _shared_model_tensors(capture, replaced, model) if model is not None else []
    shared_fqns = {id(lazy): fqn for fqn, lazy in shared}
    if not shared and not _alive(capture, replaced):
        capture.made.clear()
        return []
    gc.collect()  # only what is still referenced counts (weak references do not keep it)
    bases = {id(model._base) for model in map(_deref, capture.made)
             if model is not None and id(model) in replaced and model._base is not None}
    # (no walrus here: its name would be a cell of this function holding the last stand-in)
    found = [lazy for lazy in map(_deref, _alive(capture, replaced)) if lazy is not None]
    found = [lazy for lazy in found if not _only_a_base_of(lazy, bases, found)]
    found += [lazy for _, lazy in shared]
    del shared  # (only ``found`` holds them from here: the referrer walks below must not see another list)
    capture.made.clear()  # swap_tensors refuses a tensor with weak references
    found.sort(key=lambda lazy: lazy._base is None)  # views first: what holds a view can be named
    values = []
    for lazy in found:
        try:
            values.append(capture.concrete(lazy, "a tensor stored outside the model"))
        except UnkeyedRandomnessError as exc:
            # every escaped stand-in that holds a draw: each cache holding one is cleared, and what holds
            # them is named (a stand-in only other stand-ins hold, a slice a kept view was taken through, has none)
            drawn = [lazy]  # (a loop, not a comprehension over ``lazy``: that would be a closure holding it)
            for other in found:
                if other is not lazy and _draws(capture, other):
                    drawn.append(other)
            names: list[str] = []
            objects: list[Any] = []
            caches: list[str] = []
            for tensor in drawn:
                held, by = _holders(tensor, found, drawn)
                names += [held] if held else []
                objects += by
                for cache in _referrers(tensor, found, depth=3):  # a cache: cleared, so later calls compute again
                    if isinstance(cache, functools._lru_cache_wrapper):
                        cache.cache_clear()
                        caches.append(_cache_name(cache))
            holders = ", ".join(dict.fromkeys(names)) or "an object keyinit cannot name"
            fqns = [shared_fqns[id(t)] for t in drawn if id(t) in shared_fqns]
            if fqns:
                where = ", ".join(dict.fromkeys(caches)) or holders
                raise UnkeyedRandomnessError(
                    f"{site}: {', '.join(fqns)} (shape {tuple(lazy.shape)}) holds random draws and is also held by "
                    f"{where}; keyinit keys a draw by the parameter or buffer it lands in when the model is "
                    f"materialized and cannot give that holder the same values: draw the tensor in the constructor "
                    f"without caching it, or cache only what holds no draw"
                    + (" (the cache was cleared)" if caches else "")) from exc
            remedy = ("torch's pruning keeps it in its forward pre-hook (global_unstructured, custom_from_mask on "
                      "drawn weights): prune after materialize, on the real weights"
                      if any(isinstance(o, _recomputing_hooks()[2]) for o in objects) else
                      "register it as a buffer (register_buffer) or a parameter")
            raise UnkeyedRandomnessError(
                f"{site}: code stored a tensor of shape {tuple(lazy.shape)} computed from random draws outside the "
                f"model's parameters and buffers, in {holders}; keyinit keys a draw by the parameter or "
                f"buffer it lands in: {remedy}") from exc
    # views first: once swapped, a view's old stand-in (left in ``pairs``) is dropped, and with it its hold
    # on its base, which swap_tensors needs gone
    pairs = sorted(zip(found, values), key=lambda pair: pair[0]._base is None)
    del found, values
    return pairs


def swap_in(pairs: list, site: str) -> None:
    """Give each stand-in of ``pairs`` (from :func:`escaped_values`, which this empties) its real value in
    place (``torch.utils.swap_tensors``), so every reference sees it. Where torch refuses (a view of it is
    still held elsewhere), each ``functools.lru_cache`` holding one of them is cleared, so later calls compute
    real tensors, and a :class:`CaptureError` names what holds it."""
    for i in range(len(pairs)):
        lazy, value = pairs[i]
        pairs[i] = None
        value.requires_grad_(lazy.requires_grad)
        try:
            torch.utils.swap_tensors(lazy, value)
        except RuntimeError as exc:
            held, _ = _holders(lazy, pairs, [])
            rest = [pair[0] for pair in pairs if pair is not None]
            caches = []
            for tensor in [lazy] + rest:
                for cache in _referrers(tensor, pairs, depth=3):
                    if isinstance(cache, functools._lru_cache_wrapper):
                        cache.cache_clear()
                        caches.append(_cache_name(cache))
            del rest, tensor
            held = ", ".join(dict.fromkeys(caches)) or held
            raise CaptureError(f"{site}: code stored a tensor of shape {tuple(lazy.shape)} outside the model's "
                               f"parameters and buffers, in {held or 'an object keyinit cannot name'}, where keyinit "
                               f"cannot give it its values in place ({exc}); register it as a buffer, or compute it "
                               f"in forward (a functools.lru_cache holding it was cleared)") from exc
        del lazy, value


def _cache_name(cache: Any) -> str:
    """``the functools.lru_cache of module.function``."""
    fn = getattr(cache, "__wrapped__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"the functools.lru_cache of {getattr(fn, '__module__', None) or '?'}.{name}"


def _shared_model_tensors(capture: Capture, replaced: Mapping[int, torch.Tensor],
                          model: torch.nn.Module) -> list[tuple[str, LazyTensor]]:
    """``(fqn, stand-in)`` of each parameter or buffer stand-in of ``model`` that something besides the
    model's parameter and buffer tables holds (a ``functools.lru_cache``, a global dict, a closure)."""
    tables = {id(table): table for module in model.modules()
              for table in (module._parameters, module._buffers)}  # each table once (a module used twice)
    held: dict[int, int] = {}  # id(stand-in) -> how many table entries hold it (a tie: several)
    for table in tables.values():
        for tensor in table.values():
            if isinstance(tensor, LazyTensor) and tensor._capture is capture and id(tensor) in replaced:
                held[id(tensor)] = held.get(id(tensor), 0) + 1
    fqns: list[str] = []
    tensors: list[LazyTensor] = []
    for module_fqn, module in model.named_modules(remove_duplicate=True):
        for table in (module._parameters, module._buffers):
            for name in list(table.keys()):  # (not items(): its reused tuple would be one more reference)
                tensor = table[name]
                # a cheap test first: references beyond the tables' (and this loop's and getrefcount's own)
                if id(tensor) in held and sys.getrefcount(tensor) > held.pop(id(tensor)) + 2:
                    fqns.append(f"{module_fqn}.{name}" if module_fqn else name)
                    tensors.append(tensor)
    tensor = None
    out = []
    for i in range(len(tensors)):  # then who holds it: no frame, table or list of this function
        if any(id(h) not in tables and h is not tensors and not isinstance(h, types.FrameType)
               for h in gc.get_referrers(tensors[i])):
            out.append((fqns[i], tensors[i]))
    del tensors
    return out


def forget_escaped(capture: Capture) -> None:
    """After captured code failed: every ``functools.lru_cache`` holding one of ``capture``'s stand-ins
    is cleared, so code that calls it later (an eager model built next) computes real tensors again.
    (A failed build leaves no model whose stand-ins could be told from escaped ones, so none is made real.)"""
    made = {id(t) for t in map(_deref, capture.made) if t is not None}
    capture.made.clear()
    if not made:
        return
    for cache in [obj for obj in gc.get_objects() if type(obj) is functools._lru_cache_wrapper]:  # type(): no __class__
        if _reaches(cache, made, depth=4):  # the wrapper, its dict, a bounded cache's link, a tuple result
            cache.cache_clear()


def _reaches(obj: Any, ids: set[int], depth: int) -> bool:
    """Whether an object in ``ids`` is among what ``obj`` refers to, ``depth`` levels down (no modules or
    functions followed: a cache's wrapped function and its globals are not its contents)."""
    level = [obj]
    for _ in range(depth):
        level = [r for o in level for r in gc.get_referents(o)
                 if not isinstance(r, (types.ModuleType, types.FunctionType, type))]
        if any(id(r) in ids for r in level):
            return True
    return False
