"""A module that grows past about 600 lines is usually two ideas (docs/architecture.md): split it along
the idea, or say in its docstring why it stays one module, in a paragraph that starts "One module:"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "keyinit"
LIMIT = 600
SOURCES = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")])


def _reason(path: Path) -> bool:
    text = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
    else:  # the leading block comment of a C source or header
        doc = text.split("*/", 1)[0] if text.lstrip().startswith("/*") else ""
    return any(line.lstrip(" *").startswith("One module:") for line in doc.splitlines())


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_long_module_says_why_it_is_one_module(path):
    lines = len(path.read_text().splitlines())
    assert lines <= LIMIT or _reason(path), (
        f"keyinit/{path.relative_to(PACKAGE)} has {lines} lines: split it along its ideas, or say why it stays "
        f"one module in a docstring paragraph starting 'One module:'"
    )


def test_the_check_reads_docstrings(tmp_path):
    long = tmp_path / "long.py"
    long.write_text('"""Two ideas.\n\nOne module: the reason."""\n' + "x = 1\n" * 700)
    assert _reason(long)
    long.write_text('"""Two ideas."""\n# One module: only in a comment\n' + "x = 1\n" * 700)
    assert not _reason(long)
