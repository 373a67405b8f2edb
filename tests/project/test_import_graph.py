"""keyinit's own import graph has no cycle and no reference up the floors, counting every import:
module level, under ``TYPE_CHECKING`` and inside functions (a lazy import is still a dependency;
hiding a cycle in a function is still a cycle), and every string that names a keyinit module (a
module imported by name through ``importlib`` is a dependency too).

The floors are those of ``docs/architecture.md``: each room (a top-level module or subpackage)
references only rooms on its own floor or below.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "keyinit"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The keyinit module that importing ``name`` runs (``keyinit.x.y`` for a name inside it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


_MODULE_STRING = re.compile(r"^keyinit(\.[A-Za-z_]\w*)+$")


def imports_of(module: str) -> set[str]:
    """Every keyinit module ``module`` imports, wherever in the file the import statement is, and every
    keyinit module one of its string constants names (``"keyinit._kernels.fill.cpu"``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == "keyinit")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] == "keyinit":
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else _resolve(base))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            found.add(_resolve(node.value))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


#: The floors of docs/architecture.md, bottom up: each room references only rooms on its floor or below.
FLOORS = (
    ("_bits", "errors"),  # the stream's math and registry; errors
    ("keys", "regions", "distributions", "_sharding", "fqn"),  # _sharding: DTensor placements, megatron facts
    ("layouts", "walk", "_samples"),  # local -> global elements; the model walk; a batch's global samples
    ("_draw",),  # dispatch (the kernel table), geometries, references
    ("_kernels", "random", "_host"),  # kernels register into _draw's table; samplers; host generators' states
    ("_initializers",),
    ("init",),
    ("rules", "nn_defaults"),
    ("_engine",),
    ("data", "model", "nn", "optim"),
    ("cli", "__main__", "integrations"),  # the command line; frameworks' training loops keyed
)


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the package itself (keyinit/__init__) is the roof


def test_the_import_graph_has_no_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    assert cycles(graph) == []


def test_every_reference_stays_on_its_floor_or_below():
    floor = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms <= set(floor), f"rooms on no floor (add them to FLOORS and docs/architecture.md): {rooms - set(floor)}"
    upward = sorted(
        f"{m} -> {target}"
        for m in MODULES if _room(m) is not None
        for target in imports_of(m)
        if _room(target) is not None and floor[_room(target)] > floor[_room(m)]
    )
    assert upward == []



#: The floors inside keyinit/nn/ (docs/architecture.md, "Inside keyinit/nn/"), bottom up; keyinit/nn/__init__ is
#: its roof.
NN_FLOORS = (
    ("_ops", "policy"),  # the keyinit::dropout op, keyed attention, the keys of dropout calls; keyed()'s policy value
    ("functional", "_batch"),  # the public functions; the batch model (records, the rules table, the memo)
    ("_recompute",),  # checkpointing's recomputes
    ("_forward",),  # a running forward: its modes and what its draws become
    ("_context",),  # the keyed() context: hooks, frames, entry points, pipelines
    ("_compiled", "modules", "sround"),  # keyinit.nn.compile; keyinit.nn.Dropout; keyed SR of activations/gradients
)


def _nn_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "nn" else None


def test_every_reference_inside_nn_stays_on_its_floor_or_below():
    floor = {room: level for level, rooms in enumerate(NN_FLOORS) for room in rooms}
    rooms = {_nn_room(m) for m in MODULES} - {None}
    assert rooms <= set(floor), f"rooms of keyinit/nn on no floor (add them to NN_FLOORS): {rooms - set(floor)}"
    upward = sorted(
        f"{m} -> {target}"
        for m in MODULES if _nn_room(m) is not None
        for target in imports_of(m)
        if _nn_room(target) is not None and floor[_nn_room(target)] > floor[_nn_room(m)]
    )
    assert upward == []

#: Rooms on one floor that must not reference each other: (room, the rooms it never names).
APART = (
    ("nn", ("data",)),  # keyed forwards share with keyed data only what lies below both (_samples, _host, ...)
)


def test_rooms_kept_apart_do_not_reference_each_other():
    """``keyinit.nn`` names nothing of ``keyinit.data`` (by import, lazily, or by a string): what both need
    (sample positions, host generators, key folds, the random-op interceptor) is on a floor below both."""
    found = sorted(
        f"{m} -> {target}"
        for room, others in APART
        for m in MODULES if _room(m) == room
        for target in imports_of(m)
        if _room(target) in others
    )
    assert found == []


def test_the_checker_sees_module_strings_and_lazy_imports_across_rooms(tmp_path, monkeypatch):
    """What the rooms-apart check relies on: a lazy ``from keyinit.data import x``, a ``keyinit.data._x``
    string and an ``importlib`` name are each a reference to ``keyinit.data``."""
    fake = tmp_path / "probe.py"
    fake.write_text(
        "import importlib\n"
        "def f():\n"
        "    from keyinit.data import _fill\n"
        "def g():\n"
        "    return importlib.import_module('keyinit.data._collate')\n"
        "NAME = 'keyinit.data._augment'\n"
    )
    monkeypatch.setitem(MODULES, "keyinit.nn._probe", fake)
    assert {"keyinit.data._fill", "keyinit.data._collate", "keyinit.data._augment"} <= imports_of("keyinit.nn._probe")


def test_the_checker_sees_cycles_through_lazy_and_type_checking_imports():
    """The checker itself: a cycle closed by a function-local or TYPE_CHECKING import is found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # imports_of reads function-local and TYPE_CHECKING imports of a real module of the package
    planned = imports_of("keyinit._engine.planning.init_code")
    assert "keyinit._engine.planning.planned" in planned  # a TYPE_CHECKING import
    assert "keyinit.fqn" in planned  # an import inside a function
    layouts = imports_of("keyinit.layouts")
    assert "keyinit._sharding.megatron" in layouts
    # a string naming a module is a reference: the kernel table's references, the kernels' registrations
    assert "keyinit._draw.reference_fill" in imports_of("keyinit._draw.dispatch")
    assert "keyinit._kernels.fill.cpu" in imports_of("keyinit._kernels")


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def test_the_architecture_doc_draws_these_floors():
    """docs/architecture.md's diagram is FLOORS: the floors a reader sees are the ones the test holds."""
    diagram = ARCHITECTURE.read_text().split("```")[1]
    drawn = {}
    for line in diagram.splitlines():
        match = re.match(r"^\s*(\d+)\s+(.+?)(?:\s{2,}.*)?$", line)
        if match:
            rooms = re.sub(r"\(.*?\)", "", match.group(2))
            drawn[int(match.group(1))] = {room.strip().rstrip("/") for room in rooms.split("·")}
    assert drawn == {level: set(rooms) for level, rooms in enumerate(FLOORS)}


def test_every_module_the_architecture_doc_names_exists():
    text = ARCHITECTURE.read_text()
    paths = set(re.findall(r"`(keyinit/[\w/]*?(?:\.py|/))`", text))
    files = set(re.findall(r"`([a-z_]+\.py)`", text))
    assert len(paths) >= 20 and len(files) >= 15  # the doc names its modules: the check checks something
    root = PACKAGE.parent
    missing = sorted(p for p in paths if not (root / p).exists())
    missing += sorted(f for f in files if not any(PACKAGE.rglob(f)))
    assert missing == []
    # every room of the package is named in the doc
    unnamed = sorted(room for room in {_room(m) for m in MODULES} - {None}
                     if f"keyinit/{room}.py" not in text and f"keyinit/{room}/" not in text and room != "__main__")
    assert unnamed == []
