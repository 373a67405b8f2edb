"""Python's ``random`` and ``numpy.random`` inside a keyed forward: keyed per root forward.

Their global generators have no notion of samples, so a draw from them cannot
be keyed per sample. Inside a keyed forward they are seeded from the root
forward's key (``docs/spec.md`` section 14.7) and given back their state when
the forward returns: the values are a function of (seed, step, the root
module's FQN, the repeat count) and of the order of the draws, the same on
every rank, and the global states are untouched. Code that draws per sample in
a Python loop (HF's SpecAugment ``_compute_mask_indices``, BigBird's random
blocks) therefore gets values that depend on the rows of the local batch: that
is documented, not hidden (docs/dropout.md).
"""

from __future__ import annotations

import random as _py_random
from typing import Any

from keyinit.keys import Key, fold_in

__all__ = ["HostRandom"]


class HostRandom:
    """Seeds ``random`` and ``numpy.random`` from ``key`` on enter; restores both on exit."""

    __slots__ = ("key", "_py", "_np", "_lock")

    def __init__(self, key: Key) -> None:
        self.key = key
        self._py: Any = None
        self._np: Any = None
        self._lock: Any = None

    def __enter__(self) -> "HostRandom":
        from keyinit.data import _augment  # the one lock of the process's global generators

        self._lock = _augment.global_state_lock()
        self._lock.acquire()
        try:
            self._py = _py_random.getstate()
            k = fold_in(self.key, "python.random")
            _py_random.seed(k.k0 | (k.k1 << 32))
            try:
                import numpy
            except ImportError:  # pragma: no cover - numpy is a dependency
                self._np = None
            else:
                self._np = numpy.random.get_state()
                kn = fold_in(self.key, "numpy.random")
                numpy.random.seed([kn.k0, kn.k1])
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            _py_random.setstate(self._py)
            if self._np is not None:
                import numpy

                numpy.random.set_state(self._np)
        finally:
            self._lock.release()
