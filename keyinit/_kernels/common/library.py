"""The one loader of keyinit's C kernel libraries: build, cache, verify, load, self-test, fall back.

Each compiled library (the fill kernel ``fill/fill_kernels.c``, the dropout
kernel ``dropout/dropout_kernels.c``, the permutation kernel ``permutation/permutation_kernels.c``)
is described by one :class:`CompiledLibrary`: its source, the ctypes
signatures of its exports and its golden self-test. Loading goes the same way
for all of them:

1. :func:`keyinit._kernels.common.build.load` builds the source on first use (or
   reuses the cached build: the cache key covers the source, the headers beside
   it, the compiler, the flags and this CPU), checks the library's size and
   SHA-256 against the record written at build time, ``dlopen``\\ s it and
   refuses any build that changes floating-point semantics;
2. ``declare`` sets the ctypes signatures;
3. the golden self-test runs the library on small cases and compares digests
   of the outputs with the reference's: a library that compiles and loads can
   still be wrong (a compiler wrapper, a miscompiled vector path, a CPU quirk).

:attr:`CompiledLibrary.checked` is the library after all three, loaded once per
process; any failure makes it ``None`` for good, and the caller falls back to
the reference implementation (same values) with one ``RuntimeWarning``.
:attr:`CompiledLibrary.unchecked` skips step 3, for the tests that compare a
kernel with the reference case by case (a kernel bug must fail the tests that
describe it, not turn them into skips).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Callable, Optional

from keyinit._kernels.common import build as _build
from keyinit._kernels.common.lazy import LazyLibrary

__all__ = ["CompiledLibrary", "MAX_DIMS", "I64P"]

#: The most dimensions a C kernel takes (``KI_MAX_DIMS``, ``KD_MAX_DIMS`` in the sources); more: the reference.
MAX_DIMS = 64
#: ``int64_t *`` in a ctypes signature.
I64P = ctypes.POINTER(ctypes.c_int64)

#: keyinit/_kernels: a library's ``source`` is a path below it (``fill/fill_kernels.c``).
KERNEL_DIR = Path(__file__).parents[1]


class CompiledLibrary:
    """A C kernel library of this package: ``source`` (a path below ``keyinit/_kernels``, e.g. ``fill/fill_kernels.c``),
    ``declare`` (sets the ctypes signatures, returns the library) and ``selftest``
    (the names of the golden cases a library fails; empty: it passes).

    ``what`` names the library in errors and in the fallback warning.
    """

    def __init__(self, what: str, source: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL],
                 selftest: Callable[[ctypes.CDLL], list[str]]) -> None:
        self.what = what
        self.source = KERNEL_DIR / source
        self.declare = declare
        self.selftest = selftest
        #: The library built for this machine, after its golden self-test (loaded on first use).
        self.checked = LazyLibrary(what, self._load_checked)
        #: The same library without the self-test (tests only).
        self.unchecked = LazyLibrary(f"{what} (not self-tested)", self.build)

    def build(self, native: bool = True, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
        """Build (or reuse from the cache), verify and load a variant of the library, with its signatures set.

        ``native=False`` builds for the compiler's default target; ``extra_flags`` are
        appended (the tests build the portable and AVX2 variants this way).
        """
        return self.declare(_build.load(native, tuple(extra_flags), source=self.source))

    def _load_checked(self) -> ctypes.CDLL:
        lib = self.build()
        failed = self.selftest(lib)
        if failed:
            raise _build.BuildError(
                f"{self.what} failed its golden self-test ({', '.join(failed)}): its values differ from the "
                "reference"
            )
        return lib

    def library(self) -> Optional[ctypes.CDLL]:
        """The self-tested library, loading it on the first call; ``None`` if it cannot be used."""
        return self.checked.get()

    def usable(self, load: Callable[[], Optional[ctypes.CDLL]]) -> Optional[ctypes.CDLL]:
        """``load()`` (a kernel module's patchable ``library``), or ``None`` after the one fallback warning."""
        lib = load()
        if lib is None:
            self.checked.warn_once(stacklevel=5)
        return lib

    def available(self) -> bool:
        return self.checked.get() is not None

    def failure_reason(self) -> Optional[str]:
        return self.checked.failure_reason()

    #: The names a kernel module gives its library (``module.LIBRARY``, ...): the module sets
    #: ``__getattr__ = KERNEL.module_attribute``, so the aliases are written once, here.
    MODULE_ATTRIBUTES = {
        "SOURCE": lambda kernel: kernel.source,
        "LIBRARY": lambda kernel: kernel.checked,  # after its golden self-test, loaded on first use
        "UNCHECKED": lambda kernel: kernel.unchecked,  # without it: tests that compare case by case
        "build_library": lambda kernel: kernel.build,  # a variant (portable, AVX2): the tests build several
        "available": lambda kernel: kernel.available,
        "failure_reason": lambda kernel: kernel.failure_reason,
        "unchecked_library": lambda kernel: kernel.unchecked.get,
    }

    def module_attribute(self, name: str) -> Any:
        """A kernel module's ``__getattr__``: the library's names of :data:`MODULE_ATTRIBUTES`."""
        alias = self.MODULE_ATTRIBUTES.get(name)
        if alias is None:
            raise AttributeError(f"a kernel module has no attribute {name!r}")
        return alias(self)
