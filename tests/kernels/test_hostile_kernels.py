"""Compiled kernels under hostile conditions: damaged cached libraries, the dropout self-test, CI strictness."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keyinit._kernels.common import build as _build
from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.dropout import cpu as _dropout_cpu
from keyinit._kernels.dropout import selftest as _dropout_selftest
from keyinit._draw import reference_dropout as dropout_reference
from keyinit._draw.dropout_geometry import layout_for, make_geometry
from keyinit.regions import make_region

REPO = Path(__file__).resolve().parents[2]
ON_CI = os.environ.get("CI", "").lower() == "true"
HAS_COMPILER = _build.find_compiler() is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER and not ON_CI, reason="no C compiler")


def _child(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, KEYINIT_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


_DRAW = (
    "import torch\n"
    "from keyinit import random as kr\n"
    "from keyinit._draw import reference_fill\n"
    "from keyinit._kernels.fill import cpu as _cpu\n"
    "from keyinit.distributions import Normal\n"
    "from keyinit.keys import key\n"
    "from keyinit.regions import make_region\n"
    "got = kr.normal(key(5), (3000,))\n"
    "want = torch.empty(3000); reference_fill.fill(want, Normal.create(0.0, 1.0), key(5), make_region((3000,), None))\n"
    "assert _cpu.available(), _cpu.failure_reason()\n"
    "assert torch.equal(got, want)\n"
    "print('ok')\n"
)


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache directory holding the kernel library built (once) by a child process."""
    cache = tmp_path_factory.mktemp("cache")
    first = _child(_DRAW, cache)
    assert first.returncode == 0 and first.stdout.strip() == "ok", first.stderr[-3000:]
    return cache


@needs_compiler
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path, built_cache):
    """A truncated library can pass dlopen and die with SIGBUS on its first call: it must never be loaded."""
    shutil.copytree(built_cache, tmp_path / "cache")
    [library] = list((tmp_path / "cache").glob("fill_kernels-*.so"))
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])
    assert not _build.verified(library)
    second = _child(_DRAW, tmp_path / "cache")
    assert second.returncode == 0 and second.stdout.strip() == "ok", (second.returncode, second.stderr[-3000:])
    assert library.read_bytes() == data and _build.verified(library)


@needs_compiler
def test_the_build_record_holds_size_and_hash_and_any_change_fails_it(tmp_path, built_cache):
    shutil.copytree(built_cache, tmp_path / "cache")
    [library] = list((tmp_path / "cache").glob("fill_kernels-*.so"))
    record = library.with_name(library.name + ".sha256")
    data = library.read_bytes()
    assert record.read_text() == f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"
    assert _build.verified(library)
    middle = len(data) // 2
    library.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    assert not _build.verified(library)
    library.write_bytes(data)
    assert _build.verified(library)
    record.unlink()  # a library from before records (or a crash between the two renames)
    assert not _build.verified(library)


@needs_compiler
def test_load_refuses_a_library_replaced_after_build(tmp_path, monkeypatch):
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(tmp_path))
    path = _build.build(native=False)
    monkeypatch.setattr(_build, "build", lambda *args, **kwargs: path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(_build.BuildError, match="does not match the size and SHA-256 recorded"):
        _build.load(native=False)


# ------------------------------------------------------------ the dropout library's golden self-test


def test_dropout_selftest_golden_digests_are_the_reference_values():
    names = []
    for name, dtype, shape, region, p, _threads, values in _dropout_selftest.cases():
        local = make_region(shape, region).region_shape
        x = _dropout_selftest.inputs(local, dtype, values)
        layout = layout_for(local, shape, region)
        geometry = make_geometry(local, *_dropout_selftest.KEY_WORDS, p, layout.gstrides, layout.starts, layout.indices)
        out = torch.full_like(x, 7.0)
        dropout_reference.dropout(x, out, geometry, chunk_elements=997)
        assert _dropout_selftest.digest(out) == _dropout_selftest.GOLDEN[name], name
        names.append(name)
    assert sorted(names) == sorted(_dropout_selftest.GOLDEN)


def test_dropout_selftest_catches_a_wrong_mask():
    def off_by_one(x, out, geometry, threads):
        import attrs

        dropout_reference.dropout(x, out, attrs.evolve(geometry, threshold=geometry.threshold - 2**24))
        return True

    def wrong_scale(x, out, geometry, threads):
        dropout_reference.dropout(x, out, geometry)
        out.mul_(1.0000001)
        return True

    assert "f32-whole" in _dropout_selftest.run(off_by_one)
    assert "f32-whole" in _dropout_selftest.run(wrong_scale)
    assert _dropout_selftest.run(lambda *args: False) == [
        name for name, *_ in (*_dropout_selftest.cases(), *_dropout_selftest.named_cases())]


@needs_compiler
def test_dropout_library_passes_its_selftest_and_a_failing_one_is_refused(monkeypatch):
    lib = _dropout_cpu.build_library()
    assert _dropout_selftest.run(lambda x, out, g, threads: _dropout_cpu.run(x, out, g, threads=threads, lib=lib)) == []
    monkeypatch.setitem(_dropout_selftest.GOLDEN, "bf16-index", "0" * 16)
    monkeypatch.setattr(_dropout_cpu.LIBRARY, "library", None)
    monkeypatch.setattr(_dropout_cpu.LIBRARY, "failure", None)
    monkeypatch.setattr(_dropout_cpu.LIBRARY, "warned", False)
    assert _dropout_cpu.library() is None
    assert "golden self-test (bf16-index)" in _dropout_cpu.failure_reason()


# ------------------------------------------------------------ CI: no silent loss of kernel coverage


@pytest.mark.skipif(not ON_CI, reason="only under CI=true: locally a missing compiler is a skip")
def test_on_ci_both_compiled_kernels_load_and_pass_their_selftests():
    assert HAS_COMPILER, "CI=true but no C compiler: the kernel tests would all skip"
    assert _cpu.available(), f"the compiled CPU kernel is unavailable on CI: {_cpu.failure_reason()}"
    assert _dropout_cpu.available(), f"the compiled dropout kernel is unavailable on CI: {_dropout_cpu.failure_reason()}"


@needs_compiler
def test_unchecked_libraries_load_even_when_the_selftest_would_reject_them(monkeypatch):
    """What the kernel-vs-reference tests use: a kernel bug then fails the tests that describe it."""
    monkeypatch.setitem(_dropout_selftest.GOLDEN, "f32-whole", "0" * 16)
    monkeypatch.setattr(_dropout_cpu.UNCHECKED, "library", None)
    monkeypatch.setattr(_dropout_cpu.UNCHECKED, "failure", None)
    assert _dropout_cpu.unchecked_library() is not None
    assert _cpu.unchecked_library() is not None
