"""Only the random aten ops reach Python: a dispatch key that holds keyinit's kernels for them.

``keyed_samples`` and ``keyed_collate`` must replace every random aten op of a call with its keyed
equivalent. A ``TorchDispatchMode`` sees every op of the call in Python (a transforms.v2 pipeline
makes about 150 per sample, of which about 10 draw), which cost several times the call itself. Here
keyinit registers a Python kernel for each random op (every aten overload tagged
``nondeterministic_seeded``, and ``random``/``random_``, that has no CompositeImplicitAutograd
decomposition: exactly the random ops a dispatch mode sees) under one dispatch key that nothing
else uses on CPU or CUDA builds, ``AutocastIPU``, with a C++ fallthrough for every other op.
Entering a keyed call turns that key on for the calling thread only (thread-local included and
excluded sets), so every other op falls through in C++ and each random op lands in
:func:`_kernel`, which hands it to the active handler of this thread.

The registrations are process-wide and permanent (``torch.library`` has no unregistering): the
documented registry of this module, made on first use, never at import. With the key off (any
thread that is not inside a keyed call) the kernels are never reached. If an IPU autocast ever
turned the key on outside a keyed call, a kernel passes the op on unchanged.

``keyinit.nn.compile`` enters the same kernels with a handler that refuses a random op run eagerly
outside its compiled graphs.

Where this torch cannot register the kernels (no such key, a changed private API), :func:`active`
returns False and callers use the dispatch mode, which gives the same values.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from keyinit._engine.capture.capture import capturing

__all__ = ["available", "enter", "leave", "Handler"]

#: The dispatch key of keyinit's random-op kernels (see the module docstring).
KEY_NAME = "AutocastIPU"

Handler = Callable[[Any, tuple, dict], Any]

_state = threading.local()
_lock = threading.Lock()
#: The libraries that hold the registrations (kept alive: dropping one would unregister), or False.
_REGISTRY: dict[str, Any] = {}


def _handler() -> Optional[Handler]:
    return getattr(_state, "handler", None)


def _random_op_names() -> list[str]:
    from keyinit._engine.programs.random_ops import is_random

    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        base, _, overload = qualified[len("aten::"):].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
        except (AttributeError, RuntimeError):  # pragma: no cover - an op Python cannot resolve
            continue
        if not is_random(op):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
            continue  # decomposes into ops that draw: those are intercepted (as a dispatch mode sees them)
        names.append(qualified[len("aten::"):])
    return names


def _make_kernel(op: Any) -> Callable[..., Any]:
    key = getattr(torch._C.DispatchKey, KEY_NAME)
    excluded = torch._C.DispatchKeySet(key)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            handler = getattr(_state, "handler", None)  # _handler(), inlined: this runs for every random op
            if handler is None or capturing():  # not inside a keyed call, or a capture (keyinit.deferred in
                return op(*args, **kwargs)  # __getitem__) keys it: the op goes on, to the capture's mode
            return handler(op, args, kwargs)

    _not_traced(kernel.__code__)
    return kernel


def _not_traced(code: Any) -> None:
    """dynamo never compiles a kernel's frame, nor what it calls: it runs eagerly below compiled code
    (a random op that ran eagerly inside a ``keyinit.nn.compile`` call lands here)."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - another torch
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def available() -> bool:
    """Register the kernels on first call; True when they are in place."""
    if "ok" in _REGISTRY:
        return bool(_REGISTRY["ok"])
    with _lock:
        if "ok" in _REGISTRY:
            return bool(_REGISTRY["ok"])
        try:
            key = getattr(torch._C.DispatchKey, KEY_NAME)
            for probe in ("_dispatch_tls_set_dispatch_key_included", "_dispatch_tls_set_dispatch_key_excluded",
                          "_dispatch_tls_is_dispatch_key_included", "_dispatch_tls_is_dispatch_key_excluded",
                          "_ExcludeDispatchKeyGuard"):
                getattr(torch._C, probe)
            names = _random_op_names()
            fallback = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a fallthrough, no kernels
            fallback.fallback(torch.library.fallthrough_kernel, dispatch_key=KEY_NAME)
            kernels = torch.library.Library("aten", "IMPL")  # noqa: TOR901
            for name in names:
                base, _, overload = name.partition(".")
                op = getattr(getattr(torch.ops.aten, base), overload or "default")
                kernels.impl(name, _make_kernel(op), KEY_NAME)
        except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - another torch
            _REGISTRY["ok"] = False
            return False
        _REGISTRY.update(ok=True, key=key, fallback=fallback, kernels=kernels, ops=tuple(names))
        return True


def enter(handler: Handler) -> tuple:
    """Send this thread's random ops to ``handler(op, args, kwargs)``; returns what :func:`leave` restores."""
    key = _REGISTRY["key"]
    saved = (_handler(), torch._C._dispatch_tls_is_dispatch_key_included(key),
             torch._C._dispatch_tls_is_dispatch_key_excluded(key))
    _state.handler = handler
    torch._C._dispatch_tls_set_dispatch_key_included(key, True)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    return saved


def leave(saved: tuple) -> None:
    key = _REGISTRY["key"]
    handler, included, excluded = saved
    torch._C._dispatch_tls_set_dispatch_key_included(key, included)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)
    _state.handler = handler
