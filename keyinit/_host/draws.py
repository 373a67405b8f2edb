"""One way to refuse draws from Python's ``random`` and ``numpy.random`` global generators: run a block,
then name the generators it advanced and put their states back; the caller raises its own error.

:class:`HostDrawsPutBack` saves both states (:mod:`keyinit._host.states`) before the block and compares them
after it; :attr:`HostDrawsPutBack.drew` names the ones that moved (``"random"``, ``"numpy.random"``), and those
are put back, also when the block raised. With ``hold=True`` the process's keyed-randomness lock
(:mod:`keyinit._host.lock`) is held for the whole block (a keyed collate, which runs briefly); with
``hold=False`` only while the states are read and put back, so a long block (a capture, whose code may wait
on a keyed sample read in another thread) does not stop other threads' keyed calls, and never sees the
seeded state one of them holds for its call.
"""

from __future__ import annotations

from typing import Any

from keyinit._host.lock import global_state_lock
from keyinit._host.states import global_states

__all__ = ["HostDrawsPutBack"]


class HostDrawsPutBack:
    """Context manager: afterwards :attr:`drew` names the global generators the block drew from (put back)."""

    __slots__ = ("hold", "drew", "_saved")

    def __init__(self, *, hold: bool) -> None:
        self.hold = hold
        self.drew: list[str] = []
        self._saved: Any = None

    def __enter__(self) -> "HostDrawsPutBack":
        lock = global_state_lock()
        lock.acquire()
        try:
            self._saved = global_states().save()
        finally:
            if not self.hold:
                lock.release()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        lock = global_state_lock()
        if not self.hold:
            lock.acquire()
        try:
            states = global_states()
            self.drew = states.drew(self._saved)
            if self.drew:
                states.restore(self._saved)
        finally:
            lock.release()
