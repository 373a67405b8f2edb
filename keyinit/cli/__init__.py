"""The ``keyinit`` command line: ``demo``, ``verify`` and ``slice``.

Run ``python -m keyinit --help`` (or the ``keyinit`` console script).
Usage errors (bad import path, a factory that raises, unknown FQN, bad slice
syntax) print ONE line on stderr and exit with code 2; ``--debug`` shows the
full traceback instead. A failed check exits with code 1.

:func:`spawn` (run a function in N local gloo ranks, no torchrun) is what
``keyinit demo`` and the examples use; it is a convenience, not part of
keyinit's core API.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn, Optional, Sequence

from keyinit.cli._common import CLIError
from keyinit.cli._spawn import SpawnError, spawn

__all__ = ["main", "CLIError", "spawn", "SpawnError"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is ONE line on stderr (exit code 2)."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from keyinit import __version__
    from keyinit.cli import demo, slicing, verify

    parser = _Parser(
        prog="keyinit",
        description="keyinit: layout-invariant, communication-free weight initialization for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"keyinit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="{demo,verify,slice}")
    sub.required = True
    demo.add_parser(sub)
    verify.add_parser(sub)
    slicing.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    # --debug is accepted anywhere on the line, also after the subcommand.
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args = parser.parse_args(argv)
    args.debug = debug
    try:
        return int(args.run(args) or 0)
    except CLIError as exc:
        if debug:
            traceback.print_exc()
        print(f"keyinit {args.command}: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"keyinit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line unless --debug
        if debug:
            traceback.print_exc()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"keyinit {args.command}: error: {type(exc).__name__}: {message} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 2
