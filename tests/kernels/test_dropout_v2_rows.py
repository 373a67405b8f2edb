"""The CPU dropout kernel on stream v2's names (docs/spec.md 14.8): rows shorter than a vector pass are
packed into whole passes (``kd_short_add``), and the outer dims' indices are advanced with the carries;
the masks and values are the reference's bit for bit for rows of every length around the packing's
edges, chunk boundaries inside rows, offset samples, two threads, and the native, AVX2 and portable
builds.

Compared as bytes: the kernel's promise is the reference's bits.
"""

from __future__ import annotations

import pytest
import torch

from keyinit._draw.dropout_geometry import rows_template, with_key
from keyinit._draw.reference_dropout import dropout as reference_dropout
from keyinit._kernels.dropout import cpu as _dropout_cpu

KEY = (0x3C6EF372, 0xA54FF53A)

# (B, ..., inner): inner rows of 3, 40, 64, 127, 128, 129, 255, 256 and 257 elements, a 3-coordinate
# sample; (5, 41, 331) and (3, 4, 97, 61) cross the kernel's 65536-element chunks inside a row
SHAPES = [(4, 9, 3), (16, 8, 40), (6, 5, 64), (3, 7, 127), (2, 3, 5, 128), (3, 7, 129), (2, 6, 255),
          (3, 4, 256), (2, 5, 257), (5, 41, 331), (3, 4, 97, 61)]


def _geometry(shape, offset):
    return with_key(rows_template(tuple(shape), offset, 0.3, "v2"), *KEY)


def _check(lib, shape, offset=0, threads=1, dtype=torch.float32):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    geometry = _geometry(shape, offset)
    want = torch.empty_like(x)
    reference_dropout(x, want, geometry)
    got = torch.full_like(x, 7.0)
    assert _dropout_cpu.run(x, got, geometry, threads=threads, lib=lib)
    assert torch.equal(got.view(torch.uint8) if dtype == torch.float32 else got.view(torch.int16),
                       want.view(torch.uint8) if dtype == torch.float32 else want.view(torch.int16)), shape


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_native_kernel_equals_reference(shape):
    _check(_dropout_cpu.library(), shape, offset=11)


def test_threads_offsets_and_bfloat16_equal_reference():
    lib = _dropout_cpu.library()
    _check(lib, (5, 41, 331), offset=2**31 - 5, threads=2)
    _check(lib, (6, 5, 64), offset=3, threads=2, dtype=torch.bfloat16)
    _check(lib, (64, 16, 64), threads=2)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # pragma: no cover - not Linux
        return ""


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_other_builds_equal_reference(variant):
    if variant == "avx2" and " avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    lib = _dropout_cpu.build_library(native=False, extra_flags=("-mavx2",) if variant == "avx2" else ())
    for shape in [(4, 9, 3), (16, 8, 40), (3, 7, 129), (2, 3, 5, 128), (5, 41, 331)]:
        _check(lib, shape, offset=5)


def test_selftest_named_digests_are_the_reference_values():
    from keyinit._kernels.dropout import selftest

    names = []
    for name, dtype, shape, first, p, _threads, values in selftest.named_cases():
        x = selftest.inputs(shape, dtype, values)
        out = torch.full_like(x, 7.0)
        reference_dropout(x, out, selftest.named_geometry(shape, first, p))
        assert selftest.digest(out) == selftest.NAMED_GOLDEN[name], name
        names.append(name)
    assert sorted(names) == sorted(selftest.NAMED_GOLDEN)
    lib = _dropout_cpu.library()
    assert selftest.run(lambda x, out, geometry, threads: _dropout_cpu.run(x, out, geometry, threads=threads,
                                                                            lib=lib)) == []
