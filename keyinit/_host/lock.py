"""The process's one lock for Python's ``random`` and ``numpy.random`` global states while keyinit keys them.

Held from seeding the global generators to putting their states back (a keyed sample, a keyed collate,
a keyed forward). Python's ``random`` and ``numpy.random`` have one global state per process, so two
threads in keyed calls at once would draw from each other's seeds (and restore each other's states):
they take turns instead. Reentrant: a keyed dataset may read another keyed dataset in its
``__getitem__``. A forked child (a DataLoader worker) starts with a fresh lock.
"""

from __future__ import annotations

import os
import threading

__all__ = ["global_state_lock"]

_GLOBAL_STATE_LOCK = threading.RLock()


def global_state_lock() -> threading.RLock:
    """The lock held while Python's ``random`` and ``numpy.random`` are keyed (by a keyed sample, a keyed
    collate or a keyed forward): one per process, a fresh one in a forked child."""
    return _GLOBAL_STATE_LOCK


def _new_lock_after_fork() -> None:
    # a DataLoader worker forked while another thread held the lock starts with a free one
    global _GLOBAL_STATE_LOCK
    _GLOBAL_STATE_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)
