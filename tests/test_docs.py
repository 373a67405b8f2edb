"""Every ```python block in docs/*.md and README.md runs, and docs/api.md covers every public name.

Blocks of one file run in order in one namespace (a later block may use an
earlier block's names), with the repository root as the working directory.
A block fenced as ```python no-run is not executed: it needs several processes
or a GPU. Keep those minimal; each has a runnable counterpart in examples/ or tests/.
A block fenced as ```python requires=PACKAGE runs only where that optional package
is installed (OLMo-core), and is compiled only elsewhere.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [p for p in [ROOT / "README.md"] if p.exists()]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)

#: Fence info strings that are not executed.
SKIP_MARKER = "no-run"
#: Fence info prefix of blocks that need an optional package: ```python requires=olmo_core
REQUIRES = "requires="


def _runs(info: str, where: str) -> bool:
    """Whether a block with fence info ``info`` is executed here (else it is only compiled)."""
    if info.startswith(REQUIRES):
        return importlib.util.find_spec(info[len(REQUIRES):]) is not None
    assert info in ("", SKIP_MARKER), \
        f"{where}: unknown fence info {info!r} (use ```python, ```python no-run or ```python requires=PACKAGE)"
    return info == ""


def blocks(path: Path) -> list[tuple[int, str, str]]:
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(path, monkeypatch):
    import keyinit

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    registry = keyinit.REGISTRY
    saved = (dict(registry._module_rules), list(registry._patterns))
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    try:
        for line, info, source in blocks(path):
            if not _runs(info, f"{path.name}:{line}"):
                compile(source, f"{path.name}:{line}", "exec")  # must still be valid Python
                continue
            exec(compile(source, f"{path.name}:{line}", "exec"), namespace)
    finally:
        registry._module_rules, registry._patterns = saved


def test_every_doc_page_has_blocks_checked():
    names = {p.name for p in DOCS}
    for page in ("index.md", "quickstart.md", "concepts.md", "api.md", "migration.md", "faq.md"):
        assert page in names
    assert sum(len(blocks(p)) for p in DOCS) >= 20


def test_api_reference_names_every_public_name():
    import keyinit

    text = (ROOT / "docs" / "api.md").read_text()
    missing = []
    for module, prefix in ((keyinit, "keyinit."), (keyinit.random, "keyinit.random."),
                           (keyinit.init, "keyinit.init."), (keyinit.layouts, "keyinit.layouts.")):
        for name in module.__all__:
            if f"`{prefix}{name}" not in text:
                missing.append(prefix + name)
    assert not missing, f"docs/api.md does not document {missing}"


#: Pages other branches own; links to them may not resolve until those branches are merged.
OWNED_ELSEWHERE = {"spec.md", "benchmarks.md"}


def test_relative_links_resolve():
    bad = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or (path.parent / target).exists() or Path(target).name in OWNED_ELSEWHERE:
                continue
            bad.append(f"{path.name} -> {target}")
    assert not bad, bad
