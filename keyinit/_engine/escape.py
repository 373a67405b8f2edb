"""No stand-in escapes a capture: tensors code stored outside a model's parameters and buffers get
their real values.

Init code and constructors keep computed tensors in plain attributes, lists, dicts and cache
objects (OLMo-core's RoPE ``BufferCache``, nn.LSTM's ``_flat_weights``). After a capture,
:func:`concretize_attributes` walks a module's attributes and replaces every
:class:`~keyinit._engine.capture.LazyTensor` found there by the value eager torch would hold,
so nothing fails at the first forward with a stand-in in hand.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import torch

from keyinit._engine.capture import Capture, LazyTensor
from keyinit.errors import UnkeyedRandomnessError

__all__ = ["concretize_attributes"]

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
                          seen: Optional[dict[int, Any]] = None) -> None:
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
    for name, value in list(vars(module).items()):
        if name in _MODULE_INTERNALS:
            continue
        where = f"{module_fqn}.{name}" if module_fqn else name
        converted = _concrete_tree(capture, value, where, replaced or {}, seen, _WALK_DEPTH)
        if converted is not value:
            object.__setattr__(module, name, converted)

def _concrete_tree(capture: Capture, value: Any, where: str, replaced: Mapping[int, torch.Tensor],
                   seen: dict[int, Any], depth: int) -> Any:
    """``value`` with every stand-in inside it replaced by its real value (containers in place)."""
    if id(value) in seen:
        return seen[id(value)][1]
    if isinstance(value, LazyTensor):
        if id(value) in replaced:
            return replaced[id(value)]
        try:
            seen[id(value)] = (value, capture.concrete(value, f"attribute {where}"))
        except UnkeyedRandomnessError as exc:
            raise UnkeyedRandomnessError(
                f"{where}: code stored a tensor computed from random draws outside the model's parameters "
                f"and buffers; keyinit keys a draw by the parameter or buffer it lands in: register it as a "
                f"buffer (register_buffer) or a parameter") from exc
        return seen[id(value)][1]
    if depth <= 0 or isinstance(value, _LEAVES):
        return value
    seen[id(value)] = (value, value)

    def inner(item: Any, suffix: str) -> Any:
        return _concrete_tree(capture, item, where + suffix, replaced, seen, depth - 1)

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
