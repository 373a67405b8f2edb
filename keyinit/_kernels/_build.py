"""Just-in-time build of the compiled CPU kernel, cached on disk.

The C source ships inside the package (``keyinit_kernels.c``). On first use it
is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``)
into a shared library in the cache directory::

    $KEYINIT_CACHE_DIR, else $XDG_CACHE_HOME/keyinit, else ~/.cache/keyinit

named by a hash of the source, the compiler's identity, the flags and (with
``-march=native``) the compiler's view of this CPU, so a changed source, compiler
or machine never reuses a stale build. The library is written to a temporary
file and renamed into place, so concurrent processes are safe. The library is
loaded with :mod:`ctypes`; nothing needs torch headers, ninja or setuptools.

Flags: ``-O3 -std=c11 -ffp-contract=off -fno-math-errno -fno-trapping-math -fPIC
-shared -pthread``, plus ``-march=native`` when the compiler accepts it. None of
them can change a result: there is no ``-ffast-math`` (no reassociation, no
flush-to-zero), no FP contraction into FMA, and the only math function,
``sqrtf``, is correctly rounded by IEEE-754. ``-fno-math-errno`` only drops the
``errno`` write and ``-fno-trapping-math`` only lets the compiler assume no FP
trap handler is watching (so selects can be vectorized); neither permits a
value-changing transformation. With ``-march=native`` the cache key includes the
target macros the compiler predefines on this machine.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["SOURCE", "BASE_FLAGS", "cache_dir", "find_compiler", "build", "load"]

SOURCE = Path(__file__).with_name("keyinit_kernels.c")
BASE_FLAGS = (
    "-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread",
)
NATIVE_FLAGS = ("-march=native",)


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded."""


def cache_dir() -> Path:
    explicit = os.environ.get("KEYINIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "keyinit"
    try:
        return Path.home() / ".cache" / "keyinit"
    except RuntimeError:  # no home directory
        return Path(tempfile.gettempdir()) / f"keyinit-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def find_compiler() -> Optional[str]:
    candidates = [os.environ.get("CC"), "cc", "gcc", "clang"]
    for name in candidates:
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def _run(cmd: list[str], stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def _compiler_identity(cc: str, flags: tuple[str, ...]) -> str:
    """Version banner plus, for ``-march=native``, the target macros the compiler predefines here."""
    version = _run([cc, "--version"]).stdout
    macros = ""
    if any(flag.startswith(("-march", "-mcpu", "-mtune", "-mavx", "-msse")) for flag in flags):
        result = _run([cc, *flags, "-dM", "-E", "-x", "c", "-"], stdin="")
        if result.returncode != 0:
            raise BuildError(f"{cc} does not accept {' '.join(flags)}: {result.stderr.strip()[:500]}")
        macros = "\n".join(sorted(result.stdout.splitlines()))
    return version + "\n" + macros


def _library_path(cc: str, flags: tuple[str, ...], source: bytes) -> Path:
    digest = hashlib.sha256()
    for part in (source, cc.encode(), " ".join(flags).encode(), _compiler_identity(cc, flags).encode(),
                 sys.platform.encode()):
        digest.update(part)
        digest.update(b"\0")
    suffix = ".dll" if sys.platform == "win32" else ".so"
    return cache_dir() / f"keyinit_kernels-{digest.hexdigest()[:20]}{suffix}"


def _compile(cc: str, flags: tuple[str, ...], target: Path, source: Path = SOURCE) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        result = _run([cc, *flags, "-o", tmp_name, str(source)])
        if result.returncode != 0:
            raise BuildError(
                f"compiling {source.name} with {cc} {' '.join(flags)} failed:\n{result.stderr.strip()[:2000]}"
            )
        os.replace(tmp_name, target)  # atomic: readers see the old file or the whole new one
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def build(native: bool = True, extra_flags: tuple[str, ...] = (), source: Optional[Path] = None) -> Path:
    """Path of the compiled library, compiling it if the cache has no matching build.

    ``native=False`` builds for the compiler's default target (no ``-march=native``);
    ``extra_flags`` are appended (the tests use them to build the AVX2 and portable variants).
    ``source`` is the C file to build (default :data:`SOURCE`).
    """
    source_path = SOURCE if source is None else Path(source)
    cc = find_compiler()
    if cc is None:
        raise BuildError("no C compiler found (set $CC, or install cc/gcc/clang)")
    source_bytes = source_path.read_bytes()
    extra = tuple(extra_flags)
    attempts = [BASE_FLAGS + NATIVE_FLAGS + extra, BASE_FLAGS + extra] if native else [BASE_FLAGS + extra]
    errors = []
    for flags in attempts:
        try:
            target = _library_path(cc, flags, source_bytes)
            if not target.exists():
                try:
                    _compile(cc, flags, target, source_path)
                except OSError:
                    # Unwritable cache directory: build into a private temporary one.
                    private = Path(tempfile.mkdtemp(prefix="keyinit-"))
                    target = private / target.name
                    _compile(cc, flags, target, source_path)
            return target
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
    raise BuildError("\n".join(errors))


def load(native: bool = True, extra_flags: tuple[str, ...] = (), source: Optional[Path] = None) -> ctypes.CDLL:
    path = build(native, extra_flags, source)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise BuildError(f"could not load {path}: {exc}") from exc
