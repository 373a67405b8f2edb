"""A compiled library loaded on first use: built once, its failure remembered, one warning on fallback."""

from __future__ import annotations

import ctypes
import threading
import warnings
from typing import Callable, Optional

__all__ = ["LazyLibrary"]


class LazyLibrary:
    """``load()`` runs on the first :meth:`get`; any exception makes the library unavailable for good.

    ``what`` names the library in the fallback warning (e.g. ``"the compiled CPU kernel"``).
    The state (``library``, ``failure``, ``warned``) is plain attributes, so tests can reset it.
    """

    def __init__(self, what: str, load: Callable[[], ctypes.CDLL]) -> None:
        self.what = what
        self._load = load
        self._lock = threading.Lock()
        self.library: Optional[ctypes.CDLL] = None
        self.failure: Optional[str] = None
        self.warned = False

    def get(self) -> Optional[ctypes.CDLL]:
        """The library, loading it on the first call; ``None`` if it cannot be loaded."""
        if self.library is not None or self.failure is not None:
            return self.library
        with self._lock:
            if self.library is None and self.failure is None:
                try:
                    self.library = self._load()
                except Exception as exc:  # noqa: BLE001 - any failure means: use the reference
                    self.failure = f"{type(exc).__name__}: {exc}"
        return self.library

    def failure_reason(self) -> Optional[str]:
        self.get()
        return self.failure

    def warn_once(self, stacklevel: int = 4) -> None:
        """One ``RuntimeWarning`` per process: the reference implementation runs instead (same values)."""
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"keyinit: {self.what} is unavailable, falling back to the reference implementation "
                f"(same values, slower). Reason: {self.failure}",
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )
