"""The Triton rounding to FP4 E2M1 (``keyinit._kernels.fill.triton_sround.sround_fp4``) gives the reference's
codes (``keyinit._draw.reference_sround.round_fp4_into``, ``docs/spec.md`` 17.7): the C kernel's golden
self-test cases (their inputs, regions and layouts) and every kind of binary64 quotient over dense, strided,
listed and transposed regions, general kernel and RUN kernel (one run of consecutive global indices); and
both compile for an NVIDIA target. Without a GPU it runs under Triton's
interpreter (``TRITON_INTERPRET=1``) in a fresh subprocess (this file run as a script), as
``tests/gpu/test_sround_triton.py`` does; with CUDA, on the GPU too, through
``keyinit.random.stochastic_round_fp4``'s dispatch. Skipped when triton is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from tests._support.interpreter import interpreter_results as run_worker

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed; Triton kernel not tested")

#: case id -> (global shape, region, layout): the values are computed by the worker.
CASES = {
    "every-kind": (None, None, "dense"),
    "strided": ((40, 50), (slice(None, None, 3), slice(1, None, 2)), "dense"),
    "listed-transposed": ((37, 29), ([36, 0, 5, 5, 11], slice(None, None, -1)), "transposed"),
    "off-block": ((7, 300), (slice(None), slice(3, 290)), "dense"),
    "run-off-block": ((2053,), (slice(3, 2001),), "dense"),
    "run-rows": ((9, 301), (slice(2, 7), slice(None)), "dense"),
}
#: The cases that take the RUN kernel (one run, stored contiguously); the others the general one.
RUN_CASES = ("every-kind", "run-off-block", "run-rows")


def _run_case(case, round_fn, device) -> str:
    import keyinit
    from keyinit._draw import reference_sround
    from keyinit._kernels.fill import selftest_sround
    from keyinit.regions import make_region
    from tests.kernels.test_sround_fp4_kernel import _every_kind

    shape, region, layout = case
    if shape is None:
        v = _every_kind()
        reg = make_region((v.numel(),), None)
    else:
        reg = make_region(shape, region)
        v = selftest_sround.fp4_inputs(reg.numel).reshape(reg.region_shape)
    key = keyinit.key(2**40 + 11)
    expected = torch.empty(reg.region_shape, dtype=torch.uint8)
    reference_sround.round_fp4_into(expected, v, key, reg)
    if layout == "transposed":
        got = torch.zeros(tuple(reversed(reg.region_shape)), dtype=torch.uint8, device=device).t()
    else:
        got = torch.zeros(reg.region_shape, dtype=torch.uint8, device=device)
    if not round_fn(got, v.to(device), key, reg):
        return "kernel declined"
    got = got.cpu()
    if torch.equal(got, expected):
        return "ok"
    bad = (got.reshape(-1) != expected.reshape(-1)).nonzero().flatten()[:5].tolist()
    return f"mismatch at flat positions {bad}"


def _golden_cases(round_fn) -> list[str]:
    """The C kernel's golden FP4 self-test cases, through the Triton kernel (threads are irrelevant here)."""
    from keyinit._kernels.fill import selftest_sround

    return selftest_sround.run_fp4(lambda out, v, key, region, threads: round_fn(out, v, key, region))


@pytest.fixture(scope="module")
def interpreter_results():
    return run_worker(__file__)


def test_runs_take_the_run_kernel_and_other_regions_the_general_one():
    """Which kernel each case's launch takes (host side: no triton needed)."""
    from keyinit._kernels.fill.triton import launch_args
    from keyinit._kernels.fill.triton_sround import _single_run
    from keyinit.regions import make_region

    for case_id, (shape, region, layout) in CASES.items():
        reg = make_region(shape or (10,), region)
        out = torch.empty(reg.region_shape, dtype=torch.uint8)
        assert _single_run(launch_args(out, reg, 1)) == (case_id in RUN_CASES), case_id


@pytest.mark.parametrize("case_id", [*CASES, "golden"])
def test_interpreter_kernel_equals_reference(interpreter_results, case_id):
    assert interpreter_results[case_id] == "ok", interpreter_results[case_id]


def test_kernel_declines_what_it_does_not_round():
    import keyinit
    from keyinit._kernels.fill import triton_sround
    from keyinit.regions import make_region

    reg = make_region((8,), None)
    v = torch.ones(8, dtype=torch.float64)
    out = torch.empty(8, dtype=torch.uint8)
    assert triton_sround.sround_fp4(out, v, keyinit.key(0), reg) is False  # CPU, no interpreter
    assert triton_sround.sround_fp4(out, v.float(), keyinit.key(0), reg, interpret_ok=True) is False
    assert triton_sround.sround_fp4(out.view(torch.int8), v, keyinit.key(0), reg, interpret_ok=True) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled GPU path is not exercised")
def test_gpu_kernel_equals_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the compiled GPU path is not exercised")
    from keyinit._draw import reference_sround
    from keyinit._kernels.fill import triton_sround
    from keyinit.random import stochastic_round_fp4

    def through_dispatch(out, v, key, reg):  # what users call: the dispatch picks the Triton kernel on CUDA
        assert triton_sround.available()
        reference = reference_sround.round_fp4_into
        reference_sround.round_fp4_into = None  # unreachable while the public function runs
        try:  # (v / 1.0 is v)
            stochastic_round_fp4(key, v, 1.0, global_shape=reg.shape, region=reg.entries, out=out)
        finally:
            reference_sround.round_fp4_into = reference
        return True

    results = {case_id: _run_case(case, through_dispatch, "cuda") for case_id, case in CASES.items()}
    assert {k: v for k, v in results.items() if v != "ok"} == {}

    def on_gpu(out, v, key, reg):
        got = out.to("cuda")  # its strides kept
        done = triton_sround.sround_fp4(got, v.to("cuda"), key, reg)
        out.copy_(got.cpu())
        return done

    assert _golden_cases(on_gpu) == []


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.fill import triton_sround

    assert triton_sround.available(), "triton could not be imported"

    def round_fn(out, v, key, reg):
        return triton_sround.sround_fp4(out, v, key, reg, interpret_ok=True)

    results = {}
    for case_id, case in CASES.items():
        try:
            results[case_id] = _run_case(case, round_fn, "cpu")
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case_id] = f"{type(exc).__name__}: {exc}"
    try:
        failed = _golden_cases(round_fn)
        results["golden"] = "ok" if not failed else f"failed: {failed}"
    except Exception as exc:  # noqa: BLE001
        results["golden"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()


def test_kernel_compiles_for_cuda(tmp_path, monkeypatch):
    """Without a GPU: the kernel passes Triton's compiler for an NVIDIA target (the interpreter checks far
    less), and every runtime integer is typed int64 and never specialized on its value."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {exc}")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keyinit._kernels.fill import triton_sround_impl as impl
    from keyinit._kernels.fill.launch import BLOCK

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = impl._sround_fp4_kernel
    runtime = [p for p in fn.params if p.name not in ("out_ptr", "src_ptr", "index_ptr") and not p.is_constexpr]
    assert {p.name for p in runtime} == set(impl._INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    signature = {name: "*u8" if name == "out_ptr" else "*i64" if name in ("src_ptr", "index_ptr") else
                 "constexpr" if name == "BLOCK" else "i64" for name in fn.arg_names}
    compiled = triton_compile(ASTSource(fn=fn, signature=signature, constexprs={"BLOCK": BLOCK}),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx
    assert ".f64" not in ptx  # integer operations only: no floating-point arithmetic on the quotient
    from keyinit._kernels.fill import triton_sround_run as run_impl
    from keyinit._kernels.fill.triton_sround import RUN_NB

    fn = run_impl._sround_fp4_run_kernel
    runtime = [p for p in fn.params if p.name not in ("out_ptr", "src_ptr") and not p.is_constexpr]
    assert {p.name for p in runtime} == set(run_impl.RUN_INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    signature = {name: "*u8" if name == "out_ptr" else "*i64" if name == "src_ptr" else
                 "constexpr" if name == "NB" else "i64" for name in fn.arg_names}
    ptx = triton_compile(ASTSource(fn=fn, signature=signature, constexprs={"NB": RUN_NB}),
                         target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx and ".f64" not in ptx
