"""Just-in-time build of the compiled CPU kernels, cached on disk.

The C sources ship inside the package, one per kernel family (``fill/fill_kernels.c`` by default;
``dropout/dropout_kernels.c`` and ``permutation/permutation_kernels.c`` are built the same way by
passing their path), with the headers they share in ``common/``.
On first use a source is compiled with the system C compiler (``$CC``, which may
be a command with arguments such as ``ccache gcc``; else ``cc``/``gcc``/``clang``)
into a shared library in the cache directory::

    $KEYINIT_CACHE_DIR, else $XDG_CACHE_HOME/keyinit, else ~/.cache/keyinit

named by the source's stem and a hash of the source, the headers next to it
and in ``common/`` (``*.h``), the compiler command and identity, the flags and (with
``-march=native``) the compiler's view of this CPU, so a changed source,
header, compiler or machine never reuses a stale build. The library is written
to a temporary file and renamed into place, so concurrent processes are safe.
Its size and SHA-256 are recorded beside it (``<name>.sha256``) and checked
before every load: a cached file that does not match (truncated by an
interrupted copy, a restored backup, a shared filesystem) is compiled again,
never loaded, since such a file can pass ``dlopen`` and crash the process with
SIGBUS on its first call.
If the cache directory cannot be written, every process of the user shares ONE
private temporary cache, ``<tmp>/keyinit-<uid>`` (mode 0700, owned by the
user; a fresh private directory only if that name is taken by someone else).
The library is loaded with :mod:`ctypes`; nothing needs torch headers, ninja or
setuptools.

Flags: ``-O3 -std=c11 -ffp-contract=off -fno-math-errno -fno-trapping-math -fPIC
-shared -pthread``, plus ``-march=native`` when the compiler accepts it. None of
them can change a result: there is no ``-ffast-math`` (no reassociation, no
flush-to-zero), no FP contraction into FMA, and the only math function,
``sqrtf``, is correctly rounded by IEEE-754. ``-fno-math-errno`` only drops the
``errno`` write and ``-fno-trapping-math`` only lets the compiler assume no FP
trap handler is watching (so selects can be vectorized); neither permits a
value-changing transformation. With ``-march=native`` the cache key includes the
target macros the compiler predefines on this machine. Every build also gets the ``-D``
definitions of the kernels' distribution and dtype ids (:mod:`keyinit._kernels.common.ids`),
which are part of the cache key like any flag.

A compiler wrapper can still add flags behind our back (``CC`` set to a script
that adds ``-ffast-math``). :func:`load` therefore judges the library by what it
does, not by its command line: loading it must leave this thread's handling of
subnormal numbers unchanged (a ``-ffast-math`` link adds a constructor that
turns on flush-to-zero for the whole process; it is undone at once), and its
``keyinit_fp_probe`` must find IEEE semantics (no reassociation, no
reciprocal division, NaN compares, no flush-to-zero) in code compiled with its
flags. Otherwise it raises :class:`BuildError`; the caller falls back to the
reference implementation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["SOURCE", "BASE_FLAGS", "BuildError", "cache_dir", "find_compiler", "build", "load",
           "subnormals_preserved"]

#: The headers every kernel source includes (``#include "../common/philox.h"``).
COMMON = Path(__file__).parent
SOURCE = COMMON.parent / "fill" / "fill_kernels.c"
BASE_FLAGS = (
    "-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread",
)
NATIVE_FLAGS = ("-march=native",)


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded."""


def _user_tag() -> str:
    if hasattr(os, "getuid"):
        return str(os.getuid())
    return "".join(c for c in os.environ.get("USERNAME", "user") if c.isalnum()) or "user"


def _shared_temp_cache() -> Path:
    """``<tmp>/keyinit-<uid>``: one private cache for all of this user's processes.

    Created with mode 0700. It is used only if it is a real directory owned by
    this user and writable by no one else (another user could otherwise plant a
    library there); failing that, a fresh private directory for this process.
    """
    path = Path(tempfile.gettempdir()) / f"keyinit-{_user_tag()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
        owned = not hasattr(os, "getuid") or info.st_uid == os.getuid()
        if stat.S_ISDIR(info.st_mode) and owned and not info.st_mode & 0o022 and os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="keyinit-"))


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
        return _shared_temp_cache()


def find_compiler() -> Optional[str]:
    """The C compiler command (a shell-quoted string), or ``None``.

    ``$CC`` may hold a command with arguments (``ccache gcc``, ``gcc -m64``); its
    first word is looked up on ``PATH``. Without a usable ``$CC``: ``cc``, ``gcc``, ``clang``.
    """
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            argv = shlex.split(cc)
        except ValueError:
            argv = []
        path = shutil.which(argv[0]) if argv else None
        if path:
            return shlex.join([path, *argv[1:]])
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return shlex.join([path])
    return None


def _run(cmd: list[str], stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def _compiler_identity(cc: list[str], flags: tuple[str, ...]) -> str:
    """Version banner plus, for ``-march=native``, the target macros the compiler predefines here."""
    version = _run([*cc, "--version"]).stdout
    macros = ""
    if any(flag.startswith(("-march", "-mcpu", "-mtune", "-mavx", "-msse")) for flag in flags):
        result = _run([*cc, *flags, "-dM", "-E", "-x", "c", "-"], stdin="")
        if result.returncode != 0:
            raise BuildError(f"{shlex.join(cc)} does not accept {' '.join(flags)}: {result.stderr.strip()[:500]}")
        macros = "\n".join(sorted(result.stdout.splitlines()))
    return version + "\n" + macros


def _source_digest(source: Path) -> bytes:
    """The source, every header beside it and the shared headers of :data:`COMMON` (what its
    ``#include "x.h"`` and ``#include "../common/x.h"`` can reach)."""
    digest = hashlib.sha256(source.read_bytes())
    headers = dict.fromkeys([*sorted(source.parent.glob("*.h")), *sorted(COMMON.glob("*.h"))])
    for header in headers:
        digest.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    return digest.digest()


def _library_name(cc: list[str], flags: tuple[str, ...], source: Path) -> str:
    digest = hashlib.sha256()
    for part in (_source_digest(source), "\0".join(cc).encode(), " ".join(flags).encode(),
                 _compiler_identity(cc, flags).encode(), sys.platform.encode()):
        digest.update(part)
        digest.update(b"\0")
    suffix = ".dll" if sys.platform == "win32" else ".so"
    return f"{source.stem}-{digest.hexdigest()[:20]}{suffix}"


def _compile(cc: list[str], flags: tuple[str, ...], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        result = _run([*cc, *flags, "-o", tmp_name, str(source)])
        if result.returncode != 0:
            raise BuildError(
                f"compiling {source.name} with {shlex.join(cc)} {' '.join(flags)} failed:\n"
                f"{result.stderr.strip()[:2000]}"
            )
        _write_record(Path(tmp_name), target)  # the record first: a library without one is rebuilt
        os.replace(tmp_name, target)  # atomic: readers see the old file or the whole new one
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_record(path: Path) -> str:
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _write_record(built: Path, target: Path) -> None:
    """Record the size and SHA-256 of a freshly built library next to where it will live."""
    record = _record_path(target)
    fd, tmp_name = tempfile.mkstemp(prefix=record.name + ".", suffix=".tmp", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        f.write(_file_record(built))
    os.replace(tmp_name, record)


def verified(library: Path) -> bool:
    """Whether a cached library is exactly the file that was built: its size and SHA-256 match the
    record written at build time. A truncated or altered file (an interrupted copy, a restored
    backup, a shared filesystem) can pass ``dlopen`` and then crash the process with SIGBUS on
    its first call, so it is never loaded; :func:`build` compiles it again."""
    try:
        return _record_path(library).read_text() == _file_record(library)
    except OSError:
        return False


def build(native: bool = True, extra_flags: tuple[str, ...] = (), source: Optional[Path] = None) -> Path:
    """Path of the compiled library of ``source`` (default :data:`SOURCE`), compiling it if needed.

    ``native=False`` builds for the compiler's default target (no ``-march=native``);
    ``extra_flags`` are appended (the tests use them to build the AVX2 and portable variants).
    Every build also gets the kernels' distribution and dtype ids as ``-D`` definitions
    (:func:`keyinit._kernels.common.ids.c_defines`, the one table the Triton kernels import too).
    """
    from keyinit._kernels.common import ids as _ids

    source = SOURCE if source is None else Path(source)
    command = find_compiler()
    if command is None:
        raise BuildError("no C compiler found (set $CC, or install cc/gcc/clang)")
    cc = shlex.split(command)
    extra = _ids.c_defines() + tuple(extra_flags)
    attempts = [BASE_FLAGS + NATIVE_FLAGS + extra, BASE_FLAGS + extra] if native else [BASE_FLAGS + extra]
    errors = []
    for flags in attempts:
        try:
            name = _library_name(cc, flags, source)
            target = cache_dir() / name
            if verified(target):
                return target
            try:
                _compile(cc, flags, source, target)
            except OSError:
                # Unwritable cache directory: the user's one shared temporary cache.
                target = _shared_temp_cache() / name
                if not verified(target):
                    _compile(cc, flags, source, target)
            return target
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
    raise BuildError("\n".join(errors))


# ----------------------------------------------------------- floating-point guard


def subnormals_preserved() -> bool:
    """True when this thread's float arithmetic keeps subnormals (no flush-to-zero, no denormals-are-zero).

    Measured, not looked up: a subnormal result (``min_normal / 2``) and a
    subnormal operand (``5e-324 * 1``) must both survive.
    """
    half = sys.float_info.min * 0.5
    smallest = float.fromhex("0x0.0000000000001p-1022")  # parsed in software: a subnormal whatever the mode
    return half != 0.0 and smallest * 1.0 != 0.0


def _libm() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("m")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _restore_fp_env(libm: Optional[ctypes.CDLL], saved: Optional[ctypes.Array]) -> None:
    """Put this thread's floating-point environment back as it was before the load."""
    if libm is not None and saved is not None and libm.fesetenv(saved) == 0 and subnormals_preserved():
        return
    import torch  # sets MXCSR (x86) / FPCR (ARM) flush bits of this thread

    torch.set_flush_denormal(False)


# Bits of keyinit_fp_probe: what value-changing "fast math" the compiled code shows.
_FP_PROBE_FAULTS = {
    1: "reassociation ((a + b) - b folded to a)",
    2: "reciprocal division (x / 3 computed as x * (1/3))",
    4: "finite-math-only (NaN != NaN folded to false)",
    8: "flush-to-zero of a subnormal float result",
    16: "denormals-are-zero on a subnormal float operand",
}


def load(native: bool = True, extra_flags: tuple[str, ...] = (), source: Optional[Path] = None) -> ctypes.CDLL:
    """Build (if needed) and load the library of ``source`` (default :data:`SOURCE`), checked for IEEE behaviour.

    Raises :class:`BuildError` when it cannot be built or loaded, when loading it
    changed how this thread treats subnormals (undone before raising), or when its
    ``keyinit_fp_probe`` (if it exports one) reports a fast-math transformation.
    """
    path = build(native, extra_flags, source)
    if not verified(path):  # replaced since build() checked it
        raise BuildError(f"{path} does not match the size and SHA-256 recorded when it was built; not loaded")
    libm = _libm()
    saved = None
    if libm is not None:
        saved = ctypes.create_string_buffer(512)  # >= sizeof(fenv_t) on every libc
        if libm.fegetenv(saved) != 0:
            saved = None
    before = subnormals_preserved()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise BuildError(f"could not load {path}: {exc}") from exc
    if before and not subnormals_preserved():
        _restore_fp_env(libm, saved)
        raise BuildError(
            f"loading {path} turned on flush-to-zero for this process (it was linked with -ffast-math or "
            f"similar, e.g. by a $CC wrapper); refused and undone"
        )
    probe = getattr(lib, "keyinit_fp_probe", None)
    if probe is not None:
        probe.restype = ctypes.c_int
        probe.argtypes = []
        faults = probe()
        if faults:
            found = [text for bit, text in _FP_PROBE_FAULTS.items() if faults & bit]
            raise BuildError(f"{path} was compiled with value-changing float optimizations "
                             f"({'; '.join(found)}), e.g. -ffast-math added by a $CC wrapper; refused")
    return lib
