"""``python -m keyinit``: the command line (see :mod:`keyinit.cli`)."""

from __future__ import annotations

import sys

from keyinit.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
