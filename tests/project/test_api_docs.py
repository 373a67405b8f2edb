"""The public API and docs/api.md agree: every exported name has an entry, every entry names an export.

docs/api.md is the list of what is public. A module is public when it has its own heading
(``## keyinit.data``); its public names are its ``__all__``. Every other module of the package whose
path has no leading underscore is named in the "Other modules" section (they define what the public
modules re-export, or are the command line), so a new module is either documented or said not to be.
"""

import functools
import importlib
import pkgutil
import re
from pathlib import Path

import keyinit

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"

#: Names api.md documents that are deliberately not in their module's ``__all__``.
NOT_EXPORTED = {
    "keyinit.init.trunc_normal": "torch's name, kept working with a DeprecationWarning",
}


def _text() -> str:
    return API.read_text()


def _public_modules(text: str) -> list[str]:
    return re.findall(r"^#{2,3} (keyinit(?:\.[a-z_]+)*)\s*$", text, flags=re.M)


def _other_modules(text: str) -> set[str]:
    section = re.search(r"^## Other modules\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, "docs/api.md has no '## Other modules' section"
    named = set(re.findall(r"`(keyinit(?:\.[a-z_]+)+)`", section.group(1)))
    return {name for name in named if name in _package_modules()}  # (not the names they define)


@functools.lru_cache(maxsize=None)
def _package_modules() -> tuple[str, ...]:
    found = ["keyinit"]
    for info in pkgutil.walk_packages(keyinit.__path__, "keyinit.", onerror=lambda name: None):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue  # keyinit._engine, keyinit.nn._context.keyed, keyinit.__main__: private
        found.append(info.name)
    return tuple(found)


def test_every_module_is_documented_or_said_not_to_be():
    text = _text()
    public, other = set(_public_modules(text)), _other_modules(text)
    assert public >= {"keyinit", "keyinit.nn", "keyinit.nn.functional", "keyinit.data", "keyinit.random",
                      "keyinit.optim", "keyinit.init", "keyinit.layouts", "keyinit.regions"}
    unclassified = [name for name in _package_modules() if name not in public and name not in other]
    assert not unclassified, (f"docs/api.md neither documents nor lists under 'Other modules' {unclassified}: give "
                              f"each a '## <module>' section documenting its __all__, or name it as not API")
    assert not public & other, f"docs/api.md lists public modules as other modules: {sorted(public & other)}"


def test_every_exported_name_has_an_entry():
    text = _text()
    missing = []
    for name in _public_modules(text):
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"public module {name} has no __all__"
        missing += [f"{name}.{n}" for n in exported if f"`{name}.{n}" not in text]
    assert not missing, f"docs/api.md does not document {missing}"


def _longest_module(dotted: str) -> tuple[str, list[str]]:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:cut])).__name__, parts[cut:]
        except ImportError:
            continue
    raise AssertionError(f"docs/api.md names {dotted}, which does not import")


def test_every_entry_names_an_export():
    text = _text()
    public = set(_public_modules(text))
    not_exported, unresolved = [], []
    for dotted in sorted(set(re.findall(r"`(keyinit(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))):
        if any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")):
            continue  # a private module named as such (keyinit._engine, keyinit._bits.streams.STREAMS)
        module_name, rest = _longest_module(dotted)
        obj = importlib.import_module(module_name)
        try:
            for attr in rest:
                obj = getattr(obj, attr)
        except AttributeError:
            unresolved.append(dotted)
            continue
        if rest and module_name in public and dotted not in NOT_EXPORTED:
            exported = importlib.import_module(module_name).__all__
            if rest[0] not in exported and f"{module_name}.{rest[0]}" not in public:
                not_exported.append(dotted)
    assert not unresolved, f"docs/api.md names what does not exist: {unresolved}"
    assert not not_exported, f"docs/api.md documents names their module does not export (__all__): {not_exported}"


def test_exports_exist():
    text = _text()
    broken = [f"{name}.{n}" for name in _public_modules(text)
              for n in importlib.import_module(name).__all__ if not hasattr(importlib.import_module(name), n)]
    assert not broken, f"__all__ names what the module does not have: {broken}"
