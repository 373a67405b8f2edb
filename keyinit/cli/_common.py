"""Shared helpers of the ``keyinit`` command line: errors, factories, comparison, tables."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from keyinit._engine.planning.options import InitOptions

__all__ = [
    "CLIError",
    "add_subcommand",
    "load_factory",
    "build_model",
    "bitwise_equal",
    "digest",
    "format_table",
]


class CLIError(Exception):
    """A user-facing error: printed as one line on stderr, exit code 2."""


def add_subcommand(sub: Any, name: str, doc: Optional[str], help: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: ``help`` in ``keyinit --help``, the module's ``doc`` as its description."""
    return sub.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def load_factory(spec: str) -> Any:
    """Resolve ``pkg.module:attr`` (or ``path/to/file.py:attr``) to a callable.

    The current directory is importable, as with ``python -m``.
    """
    if ":" not in spec:
        raise CLIError(f"expected MODULE:FACTORY (e.g. examples.models:tiny_llama), got {spec!r}")
    module_name, _, attr_path = spec.rpartition(":")
    if not module_name or not attr_path:
        raise CLIError(f"expected MODULE:FACTORY (e.g. examples.models:tiny_llama), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise CLIError(f"cannot import {module_name!r}: no such file")
            name = "_keyinit_user_" + hashlib.sha256(path.encode()).hexdigest()[:12]
            spec_obj = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec_obj)  # type: ignore[arg-type]
            sys.modules[name] = module
            spec_obj.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except CLIError:
        raise
    except ModuleNotFoundError as exc:
        raise CLIError(f"cannot import {module_name!r}: {exc}") from exc
    except SystemExit as exc:
        raise CLIError(f"importing {module_name!r} called exit({exc.code!r}); nothing was checked") from exc
    except Exception as exc:
        raise CLIError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise CLIError(f"module {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise CLIError(f"{spec} is a {type(target).__name__}, not a callable factory")
    return target


BUILDS = ("deferred", "meta", "eager")


def build_model(factory: Any, spec: str, *, build: str = "meta") -> tuple[torch.nn.Module, dict[str, Any]]:
    """Call ``factory()`` and return ``(model, init_model kwargs)``.

    The factory returns an ``nn.Module`` or ``(module, init_model_kwargs)``
    (e.g. ``{"rules": {...}, "init_method": "init_weights"}``). ``build`` says how:

    - ``"deferred"``: through :func:`keyinit.deferred` (construction captured on stand-ins,
      the model on meta with its constructor's record), what ``keyinit.materialize``
      replays for a training script that builds with ``deferred``;
    - ``"meta"``: under ``torch.device("meta")``, where constructors' init code computes nothing;
    - ``"eager"``: under ``torch.device("cpu")``, init code running with torch's global RNG.

    A factory that raises (``SystemExit`` included: ``sys.exit()`` in a script's top level
    must not end the check as if it passed) is a :class:`CLIError`.
    """
    if build not in BUILDS:
        raise ValueError(f"build must be one of {BUILDS}, got {build!r}")
    extra: dict[str, Any] = {}

    def call() -> Any:
        built = factory()
        if isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], Mapping):
            built, extra["kwargs"] = built[0], dict(built[1])
        if not isinstance(built, torch.nn.Module):
            raise _NotAModule(type(built).__name__)
        return built

    try:
        if build == "deferred":
            import keyinit

            model = keyinit.deferred(call)
        else:
            with torch.device("meta" if build == "meta" else "cpu"):
                model = call()
    except _NotAModule as exc:
        raise CLIError(f"{spec}() returned {exc}; expected an nn.Module or (nn.Module, dict)") from None
    except SystemExit as exc:  # sys.exit() in the factory: no model, so nothing could be checked
        raise CLIError(f"{spec}() called sys.exit({exc.code!r}) instead of returning a model; nothing was checked") from exc
    except Exception as exc:
        raise CLIError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    kwargs = extra.get("kwargs", {})
    unknown = set(kwargs) - InitOptions.names()
    if unknown:
        raise CLIError(f"{spec}() returned init_model kwargs it does not take: {sorted(unknown)}")
    return model, kwargs


class _NotAModule(Exception):
    """The factory returned something else than a module (its type name)."""


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.view(_INT_VIEWS[tensor.element_size()] if not tensor.dtype.is_complex else torch.int64)
    return tensor


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (so ``-0.0 != 0.0`` and NaN payloads count)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return bool(torch.equal(_as_bits(a), _as_bits(b)))


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of dtype, shape and the raw bytes, row-major."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(_as_bits(t).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def take_region(full: torch.Tensor, region: Any) -> torch.Tensor:
    """``full[region]`` with ``numpy.ix_`` semantics (one index vector per dim)."""
    block = full
    for dim, index in enumerate(region.indices):
        block = block.index_select(dim, index)
    return block


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, align: Optional[str] = None) -> str:
    """A plain-text table; ``align`` is one of ``l``/``r`` per column (default: left)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    align = align or "l" * len(headers)

    def fmt(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)]
        return "  ".join(parts).rstrip()

    lines = [fmt(list(headers)), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)

