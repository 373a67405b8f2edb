"""The Triton kernel reproduces the reference bit for bit.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``,
CPU tensors). That variable must be set before the kernel module is first
imported, which a full pytest run cannot promise for its own process, so the
interpreter cases run in a fresh subprocess (this file, run as a script) and
each case's verdict comes back as JSON. With CUDA and triton present, the
kernel is also checked on the GPU in-process.

Skipped, with the reason shown, when triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from tests._support.interpreter import interpreter_results as run_worker

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (pip install 'keyinit[triton]'); Triton kernel not tested"
)



def _cases():
    """``{case_id: (dist, dtype, shape, region, layout)}``: every distribution x dtype, small."""
    from keyinit.distributions import (
        FLOAT_DTYPES,
        INT_DTYPES,
        Bernoulli,
        Bits,
        Normal,
        Randint,
        TruncatedNormal,
        Uniform,
    )

    dists = [
        ("bits", Bits(), (torch.int64,)),
        ("uniform", Uniform.create(-1.5, 2.25), FLOAT_DTYPES),
        ("normal", Normal.create(0.25, 2.0), FLOAT_DTYPES),
        ("normal_huge", Normal.create(1.0, 3e37), (torch.bfloat16, torch.float16)),
        ("trunc", TruncatedNormal.create(0.0, 1.0, -2.0, 2.0, torch.float32), FLOAT_DTYPES),
        ("trunc_flip", TruncatedNormal.create(1.0, 0.5, 1.2, 9.0, torch.float32), (torch.float32,)),
        ("trunc_far", TruncatedNormal.create(0.0, 1.0, -14.0, -13.0, torch.float32), (torch.float32,)),
        ("bernoulli", Bernoulli.create(0.3), (torch.bool, *FLOAT_DTYPES, *INT_DTYPES)),
        ("randint", Randint.create(-7, 100, torch.int8), INT_DTYPES),
        ("randint_2_32", Randint.create(-(2**31), 2**31, torch.int64), (torch.int64,)),
    ]
    geometries = [
        ("n1031", (1031,), None, "contiguous"),
        ("region3d", (5, 7, 9), (slice(None, None, -1), slice(2, 7), [0, 8, 4, 4]), "contiguous"),
        ("transposed", (19, 23), (slice(1, None, 2), slice(None)), "transposed"),
    ]
    # RUN-path geometries: rows of consecutive global indices that start anywhere in a Philox
    # block, rows picked by lists and reversed slices, near 2**33 and 2**62.
    run_geometries = [
        ("rows-offset", (3, 700), (slice(None), slice(3, 690)), "contiguous"),
        ("rows-listed", (6, 301), ([5, 0, 3, 3], slice(1, 300)), "contiguous"),
        ("rows-3d", (4, 3, 300), (slice(None, None, -1), [2, 0], slice(7, 300)), "contiguous"),
        ("rows-transposed-out", (5, 260), (slice(1, 4), slice(2, 259)), "transposed"),
        ("rows-aligned", (6, 512), ([4, 1, 1, 5], slice(4, 260)), "contiguous"),  # whole blocks, vector stores
        ("rows-long", (2, 4200), (slice(None), slice(5, 4195)), "contiguous"),  # 1048 blocks a row: 5 tiles
        ("run-2**33", (2**20, 2**14), (slice(2**19 - 1, 2**19 + 1), slice(None)), "contiguous"),
        ("run-2**62", (2**31, 2**31), (slice(2**31 - 2, None), slice(2**31 - 700, None)), "contiguous"),
    ]
    cases = {}
    for name, dist, dtypes in dists:
        for dtype in dtypes:
            dt = str(dtype).replace("torch.", "")
            for gname, shape, region, layout in geometries:
                cases[f"{name}-{dt}-{gname}"] = (dist, dtype, shape, region, layout, None)
        # flat indices near 2**62 (block counters with a non-zero high word)
        cases[f"{name}-huge"] = (dist, dtypes[0], (2**31, 2**31), (slice(2**31 - 2, None), slice(2**31 - 70, None, 3)),
                                 "contiguous", None)
        for gname, shape, region, layout in run_geometries:
            cases[f"{name}-{gname}"] = (dist, dtypes[-1], shape, region, layout, None)
            if gname == "rows-long":  # rows of 5 tiles, programs taking 2 in turn (the last half-empty)
                cases[f"{name}-{gname}-loops"] = (dist, dtypes[-1], shape, region, layout, None, (1, 2))
        # short rows through the RUN path (RUN_MIN = 1), into a transposed destination
        cases[f"{name}-short-rows-run-path"] = (dist, dtypes[0], (19, 23), (slice(1, None, 2), slice(3, 20)),
                                                "transposed", 1)
    # RUN path rows of many lengths, each starting at every offset within a Philox block
    # (rows of length L + 3 make the starts walk through all residues mod 4)
    for name, dist, dtypes in dists:
        if name not in ("bits", "normal", "randint"):
            continue
        for length in (1, 2, 3, 4, 5, 7, 8, 9, 31, 33, 257, 1029):
            cases[f"{name}-run-len{length}"] = (dist, dtypes[0], (8, length + 3), (slice(None), slice(1, 1 + length)),
                                               "contiguous", 1)
    return cases


def _run_case(case, fill_fn, device):
    from keyinit._draw import reference_fill
    from keyinit.keys import key
    from keyinit.regions import make_region

    from keyinit._kernels.fill import triton as triton_kernel

    dist, dtype, shape, region, layout, run_min, *loops = case  # loops: (MIN_PROGRAMS, LOOP) to use
    reg = make_region(shape, region)
    k = key(2**40 + 12345)
    expected = torch.empty(reg.region_shape, dtype=dtype)
    reference_fill.fill(expected, dist, k, reg)
    if layout == "transposed":
        got = torch.zeros(tuple(reversed(reg.region_shape)), dtype=dtype, device=device).t()
    else:
        got = torch.zeros(reg.region_shape, dtype=dtype, device=device)
    saved = triton_kernel.RUN_MIN, triton_kernel.MIN_PROGRAMS, triton_kernel.LOOP
    triton_kernel.RUN_MIN = saved[0] if run_min is None else run_min
    triton_kernel.MIN_PROGRAMS, triton_kernel.LOOP = loops[0] if loops else saved[1:]
    try:
        if not fill_fn(got, dist, k, reg):
            return "kernel declined"
    finally:
        triton_kernel.RUN_MIN, triton_kernel.MIN_PROGRAMS, triton_kernel.LOOP = saved
    got = torch.empty(got.shape, dtype=dtype).copy_(got)  # dense, on the CPU
    if dtype == torch.bool:
        same = torch.equal(got, expected)
    else:
        same = torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    if same:
        return "ok"
    bad = (got.reshape(-1) != expected.reshape(-1)).nonzero().flatten()[:5].tolist()
    return f"mismatch at flat positions {bad}"


@pytest.fixture(scope="module")
def interpreter_results():
    return run_worker(__file__, timeout=1800)


CASE_IDS = list(_cases())


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_interpreter_kernel_equals_reference(interpreter_results, case_id):
    assert interpreter_results[case_id] == "ok", interpreter_results[case_id]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled GPU path is not exercised")
def test_gpu_kernel_equals_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the compiled GPU path is not exercised")
    from keyinit._kernels.fill import triton as triton_kernel

    results = {case_id: _run_case(case, triton_kernel.fill, "cuda") for case_id, case in _cases().items()}
    assert {k: v for k, v in results.items() if v != "ok"} == {}


def test_kernel_declines_cpu_tensors_outside_the_interpreter():
    from keyinit._kernels.fill import triton as triton_kernel
    from keyinit.distributions import Uniform
    from keyinit.keys import key
    from keyinit.regions import make_region

    out = torch.empty(8)
    assert triton_kernel.fill(out, Uniform.create(0, 1), key(0), make_region((8,), None)) is False


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.fill import triton as triton_kernel

    assert triton_kernel.available(), "triton could not be imported"

    def fill_fn(out, dist, k, reg):
        return triton_kernel.fill(out, dist, k, reg, interpret_ok=True)

    results = {}
    for case_id, case in _cases().items():
        try:
            results[case_id] = _run_case(case, fill_fn, "cpu")
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case_id] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()


def test_launch_plan_takes_the_run_path_for_runs_and_the_general_path_otherwise(monkeypatch):
    from keyinit._kernels.fill import triton_impl as _triton_impl
    from keyinit._kernels.fill import triton as triton_kernel
    from keyinit.regions import make_region

    assert (triton_kernel.NB, triton_kernel.BLOCK, triton_kernel.MAX_DIMS) == (
        _triton_impl.NB, _triton_impl.BLOCK, _triton_impl.MAX_DIMS)

    def plan(shape, region=None, out=None, w=1):
        reg = make_region(shape, region)
        return triton_kernel.launch_args(torch.empty(reg.region_shape) if out is None else out, reg, w)

    full = plan((4096, 4096))  # one run of 2**24 consecutive indices
    assert full["run"] == 1 and full["run_len"] == 2**24 and full["dims"][:3] == [[1, 0, 0, -1]] * 3
    # 16385 tiles of NB blocks: as many per program as keeps MIN_PROGRAMS programs (at most LOOP)
    row_tiles = -(-(2**22 + 1) // triton_kernel.NB)
    loops = min(triton_kernel.LOOP, row_tiles // triton_kernel.MIN_PROGRAMS)
    assert full["loops"] == loops > 1
    assert full["tiles"] == -(-row_tiles // loops) and full["grid"] == full["tiles"]
    assert full["aligned"] == 1  # rows of whole Philox blocks from block-aligned offsets: vector stores
    aligned_rows = plan((6, 512), ([4, 1, 1, 5], slice(4, 260)))
    assert aligned_rows["run"] == 1 and aligned_rows["aligned"] == 1 and aligned_rows["base"] == 4
    assert plan((6, 512), ([4, 1], slice(4, 258)))["aligned"] == 0  # a row ends inside a block
    assert plan((6, 510), ([4, 1], slice(4, 260)))["aligned"] == 0  # rows 510 apart: not all block-aligned
    assert plan((6, 510), ([4, 1], slice(4, 260)), w=2)["aligned"] == 1  # two words: blocks of 2 elements
    rows = plan((64, 1000), (slice(None), slice(3, 999)))  # 64 rows of 996, starting anywhere in a block
    assert rows["run"] == 1 and rows["run_len"] == 996 and rows["grid"] == 64 * rows["tiles"] and rows["base"] == 3
    assert rows["aligned"] == 0
    two_words = plan((64, 1000), (slice(None), slice(3, 999)), w=2)
    assert two_words["loops"] == 1 and two_words["tiles"] == 2  # 64 x 2 tiles: fewer than MIN_PROGRAMS
    assert plan((7, 5))["loops"] == 1
    monkeypatch.setattr(triton_kernel, "MIN_PROGRAMS", 1)
    few = plan((64, 1000), (slice(None), slice(3, 999)), w=2)
    assert few["loops"] == 2 and few["tiles"] == 1 and few["grid"] == 64  # 499 blocks: two tiles, one program
    monkeypatch.undo()
    assert plan((64, 1000), (slice(None), slice(None, None, 2)))["run"] == 0  # strided: general
    assert plan((64, 100), (slice(None), slice(3, 99)))["run"] == 0  # rows shorter than RUN_MIN
    assert plan((7, 5))["run"] == 1 and plan((7, 5))["run_len"] == 35  # one short run: still the RUN path
    transposed = torch.empty(1000, 64).t()
    crossed = plan((64, 1000), None, out=transposed)  # runs in the global tensor, strided stores into out
    assert crossed["run"] == 1 and crossed["dims"][2:] == [[64, 1, 1000, -1], [1000, 64, 1, -1]]
    assert crossed["aligned"] == 0
    listed = plan((64, 1000), ([5, 1, 9], slice(None)))
    assert listed["run"] == 1 and listed["dims"][2][3] == 0 and listed["index"].tolist() == [5, 1, 9]
    assert plan((3, 3, 3, 3, 3), ([0, 2], [1, 0], [2, 0], [0, 1], [1, 2])) is None  # more than 4 dims
    monkeypatch.setattr(triton_kernel, "RUN_MIN", 1)
    assert plan((64, 100), (slice(None), slice(3, 99)))["run"] == 1


def _compile_for_cuda(family: int, words: int, out_type: str, arch: int, run: int, aligned: int = 0):
    """Compile the kernel for an NVIDIA target without a GPU (Triton's bundled ptxas)."""
    import inspect

    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keyinit._kernels.fill import triton_impl as impl

    fn = impl._fill_kernel
    params = inspect.signature(fn.fn).parameters
    constexprs = {"FAMILY": family, "W": words, "OUT": 0 if out_type == "*fp32" else 4, "NB": impl.NB,
                  "BLOCK": impl.BLOCK, "RUN": run, "ALIGNED": aligned}
    signature = {}
    for name in fn.arg_names:
        if name == "out_ptr":
            signature[name] = out_type
        elif name == "index_ptr":
            signature[name] = "*i64"
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if params[name].annotation is impl.F32 else "i64"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton_compile(source, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False})


def test_kernel_compiles_for_cuda_with_ieee_arithmetic_only(tmp_path, monkeypatch):
    """Without a GPU: the kernel passes Triton's compiler (the interpreter checks far less), and its
    PTX has no fused multiply-add and no approximate division, square root or transcendental."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {exc}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for run in (1, 0):
        floats = _compile_for_cuda(0, 1, "*fp32", 90, run).asm["ptx"]
        assert "fma." not in floats and ".approx" not in floats and "ex2" not in floats and "lg2" not in floats
        assert "div.rn.f32" in floats and "sqrt.rn.f32" in floats
    bools = _compile_for_cuda(2, 1, "*u8", 80, 1).asm["ptx"]
    assert "fma." not in bools


def test_kernel_arguments_cannot_make_new_variants():
    """Every runtime integer is typed int64 (Triton would otherwise type it i32 or i64 by value, so
    a key word above 2**31 compiled a second kernel) and none is specialized on its value."""
    from keyinit._kernels.fill import triton_impl as impl

    fn = impl._fill_kernel
    constexprs = {"FAMILY", "W", "OUT", "NB", "BLOCK", "RUN", "ALIGNED"}
    runtime_ints = [p for p in fn.params if p.name not in constexprs and p.name not in ("out_ptr", "index_ptr")
                    and p.annotation_type != "fp32"]
    assert {p.name for p in runtime_ints} == set(impl._INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime_ints)
