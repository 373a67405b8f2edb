"""Progress of a long run, on stderr: the one progress helper (the writer's and ``keyinit verify``'s)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Optional

__all__ = ["Progress"]

logger = logging.getLogger("keyinit")


class Progress:
    """A bar on a terminal; elsewhere a line every few seconds through ``log`` (default: the ``keyinit`` logger).

    ``enabled``: ``True`` shows it, ``False`` never; ``None`` shows it once the run has taken
    ``min_seconds``. ``update(step, note)`` counts ``step`` more of ``total`` done.
    """

    def __init__(self, total: int, label: str, *, enabled: Optional[bool] = None, min_seconds: float = 2.0,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.start = time.perf_counter()
        self.last = float("-inf")
        self.enabled = enabled
        self.min_seconds = min_seconds
        self.log = log if log is not None else logger.info
        self.tty = sys.stderr.isatty()
        self.shown = False

    def update(self, step: int = 1, note: str = "") -> None:
        self.done += step
        now = time.perf_counter()
        if self.enabled is False or (self.enabled is None and now - self.start < self.min_seconds):
            return
        if now - self.last < (0.2 if self.tty else 5.0) and self.done < self.total:
            return
        self.last = now
        self.shown = True
        fraction = min(self.done / self.total, 1.0)
        if self.tty:
            bar = "#" * int(30 * fraction)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * fraction:5.1f}% {note[:40]:<40}")
            sys.stderr.flush()
        else:
            self.log(f"{self.label}: {100 * fraction:.1f}% ({note})")

    def close(self) -> None:
        if self.shown and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
