"""Putting back what a compiled module's call changed: the writes of a graph traced for real, and a call undone.

:class:`Restoring` saves the graph inputs a trace writes (buffers such as BatchNorm's running statistics,
an input changed in place) before their first write and puts them back when the trace ends, so the
compiled run that follows is the call's one run of them. :class:`Snapshot` takes what a whole call may
change (buffers, parameters' bindings, scalar attributes, the call's tensor arguments) to undo it
(:mod:`keyinit.nn._compiled.compile`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Restoring", "Snapshot", "fake"]


def fake(args: tuple, kwargs: dict) -> bool:
    """The op runs on fake or meta tensors (dynamo or AOT tracing shapes): it draws nothing."""
    from torch._subclasses.fake_tensor import FakeTensor

    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, FakeTensor) or (isinstance(value, torch.Tensor) and value.device.type == "meta"):
            return True
    return False


_RUNNING_STATS = ("running_mean", "running_var")  # arguments some ops write, unannotated in their schema


class Restoring:
    """While a graph is traced (it runs for real), the graph inputs it writes (buffers such as BatchNorm's
    running statistics, an input changed in place) are saved before their first write and put back when the
    trace ends, raised or not: the compiled graph's run that follows is the call's one run of them."""

    def __init__(self, inputs: tuple) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.by_storage: dict[int, list] = {}
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and not fake((t,), {}):
                ptr = t.untyped_storage().data_ptr()
                if ptr:
                    self.by_storage.setdefault(ptr, []).append(t)
        self.saved: list = []
        outer = self

        class Save(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if outer.by_storage:
                    for position, argument in enumerate(func._schema.arguments):
                        info = argument.alias_info
                        # (native_batch_norm writes its running statistics, which its schema does not say)
                        if (info is None or not info.is_write) and argument.name not in _RUNNING_STATS:
                            continue
                        value = args[position] if position < len(args) else kwargs.get(argument.name)
                        for t in value if isinstance(value, (list, tuple)) else (value,):
                            if isinstance(t, torch.Tensor):
                                outer.save(t)
                return func(*args, **kwargs)

        self.mode = Save()

    def save(self, written: torch.Tensor) -> None:
        if fake((written,), {}) or written.device.type == "meta":
            return
        for t in self.by_storage.pop(written.untyped_storage().data_ptr(), ()):
            self.saved.append((t, t.detach().clone()))

    def __enter__(self) -> "Restoring":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        with torch.no_grad():
            for t, value in reversed(self.saved):
                t.copy_(value)
        self.saved = []


class Snapshot:
    """What a call of a compiled module may change, taken before it runs, to undo it (a call run again as an
    eager keyed forward; a call refused outside keyed): every module's buffers (which tensor each name holds,
    and its values), parameters (which tensor; their values cannot be written back, so a call that changed
    one cannot be undone), scalar attributes (``self.steps += 1``), and the values of the call's tensor
    arguments (an input normalised in place)."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        from torch.utils._pytree import tree_leaves

        modules = list(module.modules())
        self.bindings = [(m, dict(m._buffers), dict(m._parameters),
                          {k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float, str))})
                         for m in modules]
        seen: set = set()
        self.values = []
        for t in [b for m in modules for b in m._buffers.values()] + tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and id(t) not in seen:
                seen.add(id(t))
                self.values.append((t, t._version, t.detach().clone()))
        self.params = [(p, p._version) for p in module.parameters()]

    def restore(self, what: str) -> None:
        changed = [p for p, version in self.params if p._version != version]
        if changed:
            raise RuntimeError(f"keyinit.nn.compile: {what}, but the call wrote a parameter in place "
                               f"(shape {tuple(changed[0].shape)}), which keyinit cannot put back")
        with torch.no_grad():
            for m, buffers, parameters, attributes in self.bindings:
                if m._buffers != buffers or any(m._buffers[k] is not v for k, v in buffers.items()):
                    m._buffers.clear()
                    m._buffers.update(buffers)
                if any(m._parameters.get(k) is not v for k, v in parameters.items()) or \
                        len(m._parameters) != len(parameters):
                    m._parameters.clear()
                    m._parameters.update(parameters)
                for k, v in attributes.items():
                    if vars(m).get(k) is not v:
                        vars(m)[k] = v
            for t, version, value in self.values:  # (native_batch_norm's writes leave the version as it was)
                if t._version != version or not torch.equal(t, value):
                    t.copy_(value)
