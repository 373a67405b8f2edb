"""The one loader of the C kernel libraries (``keyinit._kernels.common.library``) and the permutation self-test."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import keyinit
from keyinit._kernels.common import build as _build
from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.dropout import cpu as _dropout_cpu
from keyinit._kernels.permutation import cpu as _permutation_cpu
from keyinit._kernels.permutation import selftest as _permutation_selftest
from keyinit._kernels.common.library import CompiledLibrary
from keyinit._draw import reference_permutation
from keyinit.keys import Key

ON_CI = os.environ.get("CI", "").lower() == "true"
needs_compiler = pytest.mark.skipif(_build.find_compiler() is None and not ON_CI, reason="no C compiler")

MODULES = (_cpu, _dropout_cpu, _permutation_cpu)


def test_every_library_goes_through_the_one_loader():
    sources = set()
    for module in MODULES:
        assert isinstance(module.KERNEL, CompiledLibrary)
        assert module.LIBRARY is module.KERNEL.checked and module.UNCHECKED is module.KERNEL.unchecked
        sources.add(module.KERNEL.source.name)
    assert sources == {path.name for path in _cpu.KERNEL.source.parents[1].glob("*/*.c")}


def test_permutation_selftest_golden_digests_are_the_reference_values():
    root = Key(*_permutation_selftest.KEY_WORDS)
    names = []
    for name, n, spec, inverse, _threads in _permutation_selftest.cases():
        index, r = _permutation_selftest.positions(n, spec)
        pos = index if index is not None else torch.tensor(list(r), dtype=torch.int64)
        walk = reference_permutation.unpermute_reference if inverse else reference_permutation.permute_reference
        assert _permutation_selftest.digest(walk(root, n, pos)) == _permutation_selftest.GOLDEN[name], name
        names.append(name)
    assert sorted(names) == sorted(_permutation_selftest.GOLDEN)


def test_permutation_selftest_catches_wrong_values():
    def off_by_one(kp, n, inverse, out, **kwargs):
        assert _permutation_cpu.run(kp, n, inverse, out, **kwargs)
        out[-1] ^= 1
        return True

    assert "n5-whole" in _permutation_selftest.run(off_by_one)
    assert _permutation_selftest.run(lambda *args, **kwargs: False) == [c[0] for c in _permutation_selftest.cases()]


@needs_compiler
def test_every_library_passes_its_selftest():
    for module in MODULES:
        assert module.available(), module.failure_reason()
        assert module.KERNEL.selftest(module.library()) == []


@needs_compiler
@pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])
def test_permutation_variants_pass_the_selftest(native):
    lib = _permutation_cpu.build_library(native=native)
    assert _permutation_cpu.KERNEL.selftest(lib) == []


@needs_compiler
def test_a_permutation_library_failing_its_selftest_is_refused_with_one_warning(monkeypatch):
    k = keyinit.key(11)
    want = keyinit.data.permutation(k, 10**6, range(0, 5000, 3))
    monkeypatch.setitem(_permutation_selftest.GOLDEN, "n7-inverse", "0" * 16)
    for attribute, value in (("library", None), ("failure", None), ("warned", False)):
        monkeypatch.setattr(_permutation_cpu.LIBRARY, attribute, value)
    assert _permutation_cpu.library() is None
    assert "golden self-test (n7-inverse)" in _permutation_cpu.failure_reason()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = keyinit.data.permutation(k, 10**6, range(0, 5000, 3))
        second = keyinit.data.permutation(k, 10**6, range(0, 5000, 3))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "reference" in messages[0] and "golden self-test" in messages[0]
    assert torch.equal(first, want) and torch.equal(second, want)


# ------------------------------------------------------------ one table of kernel ids


def test_the_kernel_ids_are_one_table():
    from keyinit._kernels.common import ids as _ids
    from keyinit._kernels.fill import triton as triton_kernel

    assert _cpu.DIST_IDS is _ids.DIST_IDS and _cpu.DTYPE_IDS is _ids.DTYPE_IDS
    assert all(_dropout_cpu.DTYPE_IDS[dtype] == _ids.DTYPE_IDS[dtype] for dtype in _dropout_cpu.DTYPE_IDS)
    assert triton_kernel.DIST_IDS is _ids.DIST_IDS and triton_kernel.DTYPE_IDS is _ids.DTYPE_IDS
    assert sorted(_ids.DIST_IDS.values()) == list(range(len(_ids.DISTRIBUTIONS)))
    assert sorted(_ids.DTYPE_IDS.values()) == list(range(len(_ids.DTYPES)))
    defines = _ids.c_defines()
    assert "-DKI_DIST_TRUNCATED_NORMAL=3" in defines and "-DKI_DTYPE_BFLOAT16=2" in defines
    # no kernel source keeps ids of its own "in sync" with another file
    for path in sorted(_cpu.KERNEL.source.parents[1].rglob("*")):
        if path.suffix in (".c", ".h", ".py"):
            assert "keep in sync" not in path.read_text().lower(), path.name


@needs_compiler
def test_a_kernel_source_does_not_compile_without_the_table(tmp_path):
    import shlex
    import subprocess

    cc = shlex.split(_build.find_compiler())
    for module in (_cpu, _dropout_cpu):
        proc = subprocess.run([*cc, "-fsyntax-only", "-std=c11", str(module.KERNEL.source)], capture_output=True,
                              text=True)
        assert proc.returncode != 0 and "common/ids.py" in proc.stderr, module.KERNEL.source.name
