"""Stand-ins: :class:`LazyTensor`, a tensor with a GLOBAL shape, strides and dtype and no data, that a
:class:`~keyinit._engine.capture.capture.Capture` hands to init code in place of each model tensor.

A stand-in reports device ``cpu`` and holds no memory; every aten op on it reaches the running
capture's dispatch mode and is recorded. Python that needs values (``.tolist()``, ``.numpy()``,
scalar conversions where Python dispatch is excluded) gets them from the capture, computed on
the spot; a stand-in used outside any capture is a :class:`CaptureError`. ``copy.deepcopy`` is a
recorded ``clone``. Also the small pytree helpers the capture uses on aten arguments.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch

__all__ = ["LazyTensor", "CaptureError", "tree_map"]


class CaptureError(RuntimeError):
    """Init code did something keyinit cannot record."""


class LazyTensor(torch.Tensor):
    """A tensor of a captured program: shape, strides and dtype, no data (see :class:`Capture`)."""

    _meta: torch.Tensor
    _capture: Any  # the keyinit._engine.capture.capture.Capture that made it (not imported: it imports this module)

    @staticmethod
    def __new__(cls, meta: torch.Tensor, capture: Any, requires_grad: bool = False) -> "LazyTensor":
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, meta.size(), strides=meta.stride(), storage_offset=meta.storage_offset(), dtype=meta.dtype,
            device="cpu", requires_grad=requires_grad,
        )
        tensor._meta = meta
        tensor._capture = capture
        made = getattr(capture, "made", None)
        if made is not None:  # what is still alive when a deferred build ends escaped it (escape.sweep_escaped)
            made.append(weakref.ref(tensor))
            if len(made) >= capture.made_limit:
                made[:] = [r for r in made if r() is not None]
                capture.made_limit = max(1024, 2 * len(made))
        return tensor

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __deepcopy__(self, memo: dict[int, Any]) -> "LazyTensor":
        """``copy.deepcopy`` of a module built from stand-ins (torchtune's ``_get_clones`` repeats one
        layer ``num_layers`` times): a recorded ``clone``, so each copy starts with the values the
        original holds now, as in eager torch. Its Python attributes (``_is_param``, markers) are
        deep-copied; the stand-in's own bookkeeping (its meta twin, the capture) is not."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            twin = self.clone(memory_format=torch.preserve_format)  # recorded by the running capture
        twin.requires_grad_(self.requires_grad)
        memo[id(self)] = twin
        for name, value in vars(self).items():
            if name not in ("_meta", "_capture"):
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _NEEDS_VALUES or (func in _SCALAR_CONVERSIONS and _python_dispatch_excluded()):
            capture = next(a._capture for a in tensor_leaves((args, kwargs)) if isinstance(a, LazyTensor))
            concrete = tree_map(lambda x: capture.concrete(x, getattr(func, "__name__", "value"))
                                if isinstance(x, LazyTensor) else x, (args, kwargs))
            return func(*concrete[0], **concrete[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):  # noqa: ANN001
        running = next((a._capture for a in tensor_leaves((args, kwargs or {})) if isinstance(a, LazyTensor)), None)
        site = running.site if running is not None and running.site != "<init code>" else None
        raise CaptureError(
            (f"{site}: " if site else "") + f"a keyinit stand-in tensor was used outside keyinit's capture ({func})"
            + ("; the op ran where the capture's dispatch mode is not: in a thread that was running before the "
               "capture started (keyinit records the thread that runs the code), or beneath the mode, inside "
               "another tensor subclass's __torch_dispatch__ (torchao's NF4Tensor: torchtune's QLoRA), whose ops "
               "on the stand-ins it wraps keyinit cannot record"
               if site else ""))


def tensor_leaves(tree: Any) -> list[Any]:
    """The leaves of aten arguments (tuples, lists, dicts of tensors and scalars): a fast
    ``tree_flatten(...)[0]`` for the structures aten ops take and return."""
    out: list[Any] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (tuple, list)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        else:
            out.append(node)
    return out


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` over the leaves of aten arguments, keeping tuples (named ones too), lists and dicts."""
    if isinstance(tree, list):
        return [tree_map(fn, x) for x in tree]
    if isinstance(tree, tuple):
        items = [tree_map(fn, x) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


_NEEDS_VALUES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
#: Scalar conversions reach the capture's dispatch mode as ``_local_scalar_dense``, except where torch
#: runs them with Python dispatch excluded: ``torch.tensor([...])`` of tensor elements converts each
#: element that way (Llama 3.1's RoPE scaling builds ``torch.tensor(new_freqs)`` from 0-d tensors).
_SCALAR_CONVERSIONS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                       torch.Tensor.__bool__, torch.Tensor.__complex__}


def _python_dispatch_excluded() -> bool:
    """Dispatch modes cannot see the aten ops issued now (inside ``torch.tensor``'s data conversion)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python)
