"""Building and loading the compiled CPU kernel: compilers, caches, fast-math refusal, self-test.

Each test builds into its own cache directory, so nothing here touches the
library the rest of the suite uses. Tests that could change this process's
floating-point state run in a fresh subprocess.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from keyinit._draw import reference_fill
from keyinit._kernels.common import build as _build
from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.fill import selftest as _selftest
from keyinit.keys import Key
from keyinit.regions import make_region

REPO = Path(__file__).resolve().parents[2]
GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is not installed")


def _wrapper(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)


# ------------------------------------------------------------- fast math refused

_FAST_MATH_CHILD = r"""
import json, warnings
warnings.simplefilter("always")
import torch
from keyinit import random as kr
from keyinit._draw import reference_fill
from keyinit._kernels.common import build as _build
from keyinit._kernels.fill import cpu as _cpu
from keyinit.distributions import Uniform, Normal
from keyinit.keys import key
from keyinit.regions import make_region

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tiny = kr.uniform(key(3), (300,), low=0.0, high=1e-40)   # subnormal values
    normal = kr.normal(key(3), (1000,))
    kr.normal(key(4), (10,))
expected_tiny = torch.empty(300); reference_fill.fill(expected_tiny, Uniform.create(0.0, 1e-40), key(3), make_region((300,), None))
expected_normal = torch.empty(1000); reference_fill.fill(expected_normal, Normal.create(0.0, 1.0), key(3), make_region((1000,), None))
print(json.dumps({
    "available": _cpu.available(),
    "reason": _cpu.failure_reason(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    "same": bool(torch.equal(tiny, expected_tiny) and torch.equal(normal, expected_normal)),
    "subnormal_values": int(((tiny != 0) & (tiny.abs() < 1.1754943508222875e-38)).sum()),
    "python_subnormals": _build.subnormals_preserved(),
    "torch_subnormals": bool((torch.tensor([1e-40]) * 1.0).item() != 0.0),
}))
"""


@pytest.mark.parametrize("flags", ["-ffast-math", "-Ofast"])
def test_fast_math_wrapper_is_refused_with_one_warning(tmp_path, flags):
    """A $CC wrapper that appends fast-math: the library sets flush-to-zero when loaded. keyinit
    notices by behaviour, undoes it, refuses the library, warns once and uses the reference."""
    cc = _wrapper(tmp_path, "fastcc", f'exec {GCC} "$@" {flags}')
    proc = _python(_FAST_MATH_CHILD, {"CC": str(cc), "KEYINIT_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["available"] is False
    assert "flush-to-zero" in result["reason"]
    assert len(result["warnings"]) == 1 and "reference" in result["warnings"][0]
    assert result["same"] and result["subnormal_values"] == 300
    assert result["python_subnormals"] and result["torch_subnormals"]


def test_value_changing_flags_without_flush_to_zero_are_refused(tmp_path, monkeypatch):
    """Reassociation / reciprocal division / finite-math-only without the fast-math startup
    file: loading changes nothing in the process, and keyinit_fp_probe catches the code."""
    cc = _wrapper(tmp_path, "reassoc",
                  f'exec {GCC} "$@" -fassociative-math -fno-signed-zeros -fno-trapping-math '
                  "-freciprocal-math -ffinite-math-only")
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(_build.BuildError, match=r"reassociation.*reciprocal division.*finite-math-only"):
        _build.load()
    assert _build.subnormals_preserved()


def test_plain_build_passes_the_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(tmp_path))
    lib = _build.load()
    lib.keyinit_fp_probe.restype = ctypes.c_int
    assert lib.keyinit_fp_probe() == 0


def test_probe_ignores_the_callers_flush_to_zero(tmp_path, monkeypatch):
    """A process that chose flush-to-zero itself still gets a working kernel with v1 values."""
    proc = _python(
        "import torch; torch.set_flush_denormal(True)\n"
        "from keyinit import random as kr\n"
        "from keyinit._draw import reference_fill\n"
        "from keyinit._kernels.fill import cpu as _cpu\n"
        "from keyinit.distributions import Uniform\n"
        "from keyinit.keys import key\n"
        "from keyinit.regions import make_region\n"
        "assert _cpu.available(), _cpu.failure_reason()\n"
        "got = kr.uniform(key(3), (300,), low=0.0, high=1e-40)\n"
        "torch.set_flush_denormal(False)\n"
        "exp = torch.empty(300); reference_fill.fill(exp, Uniform.create(0.0, 1e-40), key(3), make_region((300,), None))\n"
        "assert torch.equal(got, exp) and bool((got != 0).all())\n"
        "print('ok')\n",
        {"KEYINIT_CACHE_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ------------------------------------------------------------ compiler command


def test_multi_word_cc_is_honoured(tmp_path, monkeypatch):
    """CC="<wrapper> gcc" (like "ccache gcc"): the wrapper runs, with gcc as its first argument."""
    wrap_dir = tmp_path / "dir with space"
    wrap_dir.mkdir()
    log = tmp_path / "calls.log"
    wrapper = _wrapper(wrap_dir, "cachewrap", f'echo "$@" >> {shlex.quote(str(log))}\nexec "$@"')
    monkeypatch.setenv("CC", f"{shlex.quote(str(wrapper))} gcc")
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(tmp_path / "cache"))
    assert shlex.split(_build.find_compiler()) == [str(wrapper), "gcc"]
    path = _build.build()
    calls = log.read_text().splitlines()
    assert any(c.startswith("gcc ") and "-o" in c and "fill_kernels.c" in c for c in calls), calls
    lib = _cpu.declare(_build.load())  # the same, now cached build
    assert _build.build() == path
    out = torch.empty(4, dtype=torch.int64)
    assert _cpu.fill(out, __import__("keyinit").distributions.Bits(), Key(0, 0), make_region((4,), None), lib=lib)
    assert [hex(v) for v in out.tolist()] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]


def test_unusable_cc_falls_back_to_the_default_compilers(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz --flag")
    assert _build.find_compiler() is not None and "no-such-compiler" not in _build.find_compiler()


# ------------------------------------------------------------------ cache dirs


def _unwritable_cache(tmp_path: Path) -> Path:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file, so nothing can be created beneath it (also as root)")
    return blocker / "cache"


def test_unwritable_cache_dir_reuses_one_temporary_cache(tmp_path, monkeypatch):
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(_unwritable_cache(tmp_path)))
    first = _build.build(native=False)
    assert first.parent == temp_root / f"keyinit-{os.getuid()}"
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    stamp = first.stat().st_mtime_ns
    # a second build (another process would compute the same path) reuses it, compiling nothing
    assert _build.build(native=False) == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in temp_root.iterdir()) == [first.parent.name]


def test_temporary_cache_taken_by_someone_else_is_not_used(tmp_path, monkeypatch):
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(_unwritable_cache(tmp_path)))
    shared = temp_root / f"keyinit-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)  # writable by anyone: a planted library could be waiting there
    path = _build.build(native=False)
    assert path.parent != shared and path.parent.parent == temp_root
    assert not list(shared.iterdir())


# ------------------------------------------------------------ another source


def test_build_and_load_take_another_source_hashing_its_headers(tmp_path, monkeypatch):
    """What the dropout kernel needs: a second C source with the same flags, cache and checks."""
    monkeypatch.setenv("KEYINIT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "helper.h").write_text("#define HELPER 7\n")
    source = src / "other_kernels.c"
    source.write_text('#include "helper.h"\nint other_value(void) { return HELPER; }\n')
    first = _build.build(source=source)
    assert first.name.startswith("other_kernels-") and first.parent == tmp_path / "cache"
    assert _build.load(source=source).other_value() == 7
    (src / "helper.h").write_text("#define HELPER 8\n")  # a header change is a new library
    second = _build.build(source=source)
    assert second != first
    assert ctypes.CDLL(str(second)).other_value() == 8
    assert _build.build() != first  # the default source is unaffected


# ------------------------------------------------------------ golden self-test


def test_selftest_golden_digests_are_the_reference_values():
    key = Key(*_selftest.KEY_WORDS)
    names = []
    for name, dist, dtype, shape, region, layout, _threads in _selftest.cases():
        reg = make_region(shape, region)
        out = _selftest._empty(reg.region_shape, dtype, layout)
        reference_fill.fill(out, dist, key, reg)
        assert _selftest.digest(out) == _selftest.GOLDEN[name], name
        names.append(name)
    assert sorted(names) == sorted(_selftest.GOLDEN)


def test_selftest_passes_for_the_loaded_kernel():
    lib = _cpu.library()
    assert _selftest.run(lambda out, dist, key, region, threads: _cpu.fill(out, dist, key, region, threads=threads,
                                                                           lib=lib)) == []


def test_failed_selftest_means_reference_with_one_warning(monkeypatch):
    monkeypatch.setitem(_selftest.GOLDEN, "normal-f32", "0" * 16)
    monkeypatch.setattr(_cpu.LIBRARY, "library", None)
    monkeypatch.setattr(_cpu.LIBRARY, "failure", None)
    monkeypatch.setattr(_cpu.LIBRARY, "warned", False)
    assert _cpu.library() is None
    assert "golden self-test (normal-f32)" in _cpu.failure_reason()
    with pytest.warns(RuntimeWarning, match="golden self-test"):
        out = torch.empty(8)
        from keyinit._draw import dispatch
        from keyinit.distributions import Normal

        dispatch.fill(out, Normal.create(0, 1), Key(1, 2), make_region((8,), None))
    expected = torch.empty(8)
    reference_fill.fill(expected, Normal.create(0, 1), Key(1, 2), make_region((8,), None))
    assert torch.equal(out, expected)
