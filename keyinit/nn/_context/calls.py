"""What a compiled module (``keyinit.nn.compile``) asks of the ``keyed`` context around its call.

:class:`CompiledCalls` is the part of :class:`keyinit.nn._context.keyed.Keyed` that
:mod:`keyinit.nn._compiled.compile` calls: the FQN of a module, the running frame, a new
root forward and its host generators, hooks put on (and taken off) a compiled
module that runs eagerly, the draws of a call that is undone, and the modes and
hooks left while compiled code runs (dynamo traces neither). It reads the
context's own state (``_names``, ``_hooked``, ``_local``, ``calls``, ...), set
by ``Keyed.__init__`` and ``Keyed.__enter__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from keyinit.nn._forward.pieces import pure_leaf
from keyinit.nn._forward.hostrandom import HostRandom
from keyinit.nn._forward.intercept import Frame
from keyinit.nn._forward.modes import mode_is_active, mode_is_top

if TYPE_CHECKING:
    from keyinit.nn._forward.pieces import Forward

__all__ = ["CompiledCalls"]


class CompiledCalls:
    """The calls of :mod:`keyinit.nn._compiled.compile` into a :class:`keyinit.nn._context.keyed.Keyed` (its base
    class)."""

    # the context's state these read (set by Keyed; its _hook, thread_state, current_frame and
    # _root_forward are called)
    model: torch.nn.Module
    calls: str
    _names: dict
    _hooked: dict
    _handles: list
    _forwards: list
    _history: dict
    _state: str
    _installs: int

    def module_fqn(self, module: torch.nn.Module) -> Optional[str]:
        """The canonical FQN of ``module`` in this context's model (``""``: the model itself), or None."""
        found = self._names.get(id(module))
        if found is not None and found[0] is module:
            return found[1]
        return "" if module is self.model else None

    def current_frame(self) -> Optional[Frame]:
        """The frame of the module execution running in this thread inside this context, or None."""
        return self.current_frame()

    def root_forward(self, module: torch.nn.Module, fqn: str, args: tuple, kwargs: dict) -> "Forward":
        """A new root forward of ``module`` (its rows, repeat count and inputs' batch records), as its
        forward pre-hook makes one."""
        return self._root_forward(module, fqn, args, kwargs)

    def host_random(self, forward: "Forward") -> HostRandom:
        """What Python's ``random`` and ``numpy.random`` draw in root forward ``forward`` (a context manager
        that seeds them, puts their states back, and raises a refused draw when it is left)."""
        host = forward.host_random(self, forward.fqn)
        host.raises = True
        return host

    def hook_modules(self, module: torch.nn.Module) -> list:
        """Put this context's hooks on ``module`` and its submodules that have none (a compiled module
        run eagerly: its forward keyed as any eager one); :meth:`unhook_modules` takes them off."""
        added = []
        for sub in module.modules():
            fqn = self.module_fqn(sub)
            if fqn is not None and id(sub) not in self._hooked:
                self._hook(sub, fqn, light=sub is not self.model and pure_leaf(sub))  # (light: see __enter__)
                added.append(id(sub))
        return added

    def unhook_modules(self, added: list) -> None:
        for ident in added:
            found = self._hooked.pop(ident, None)
            for handle in found[2] if found is not None else ():
                handle.remove()

    def save_draws(self, forward: "Forward") -> tuple:
        """What a call that draws changes of the block's record of forwards and call ordinals (see
        :meth:`restore_draws`)."""
        frame = self.current_frame()
        counts = frame.counts if frame is not None and self.calls == "forward" else forward.counts
        return (list(self._forwards), forward.drew, {fqn: len(rows) for fqn, rows in self._history.items()},
                counts, dict(counts))

    def restore_draws(self, forward: "Forward", saved: tuple) -> None:
        """Forget the draws of a call that was abandoned (it runs again): no repeat is counted for it, and the
        call ordinals it took are taken again."""
        forwards, forward.drew, lengths, counts, before = saved
        counts.clear()
        counts.update(before)
        self._forwards[:] = forwards
        self._history = {fqn: rows[:lengths[fqn]] for fqn, rows in self._history.items() if fqn in lengths}

    def suspend(self, module: torch.nn.Module, fqn: str, forward: "Forward") -> list:
        """Leave this thread's modes and take this context's hooks off ``module`` and its submodules while
        compiled code runs (dynamo traces neither), and open the frame of ``module``'s execution (its calls
        numbered as in an eager forward; the modes stay off); :meth:`resume` undoes it."""
        state = getattr(self._local, "state", None)
        left = []
        if state is not None:
            for mode in reversed(state.modes):
                if mode_is_active(mode):
                    if not mode_is_top(mode):
                        raise RuntimeError(
                            "keyinit.nn.compile: a compiled module called inside a keyed forward while another "
                            f"torch mode is active above keyed's ({mode!r} is not the innermost)"
                        )
                    mode.__exit__(None, None, None)
                    left.append(mode)
        removed = []
        if self._hooked:  # hooks on its modules: only when the compiled module wraps the keyed model
            for sub in module.modules():
                found = self._hooked.pop(id(sub), None)
                if found is not None:
                    for handle in found[2]:
                        handle.remove()
                    removed.append(found)
        frames = self.thread_state().frames
        if self.calls == "execution":
            counts: dict = {}
        else:
            counts = frames[-1].counts if frames else forward.counts
        frame = Frame(module, fqn, False, forward, counts)
        frames.append(frame)
        return [left, removed, frame]

    def resume(self, suspended: list) -> None:
        left, removed, frame = suspended
        frames = self.thread_state().frames
        while frames:  # the frames of forwards that ran eagerly inside it and raised are left too
            top = frames.pop()
            for mode in reversed(top.pushed):
                mode.__exit__(None, None, None)
            if top is frame:
                break
        for module, fqn, handles in removed:
            self._handles = [h for h in self._handles if h not in handles]
            if self._state == "entered" or self._installs:
                self._hook(module, fqn, light=module is not self.model and pure_leaf(module))
        for mode in reversed(left):
            mode.__enter__()
