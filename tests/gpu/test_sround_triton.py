"""The Triton stochastic rounding kernel (``keyinit._kernels.fill.triton_sround``) gives the reference's bits
(``keyinit._draw.reference_sround``, ``docs/spec.md`` section 17) for every target: the golden self-test's
cases (their inputs, regions and layouts) and every kind of binary32 value over strided, listed and
transposed regions; so does its fused Adam/AdamW step (17.6) on the C kernel's self-test cases and a
listed region, and both compile for an NVIDIA target with IEEE operations only. Without a GPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh
subprocess (this file run as a script), as ``tests/gpu/test_kernels_triton.py`` does; with CUDA, on the GPU
too, through ``keyinit.random.stochastic_round``'s dispatch. Skipped when triton is not installed."""

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
TARGETS = (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)


def _cases() -> dict:
    """case id -> (target, global shape, region, layout): the values are computed by the worker."""
    cases = {}
    for target in TARGETS:
        name = str(target).removeprefix("torch.")
        cases[f"{name}-dense"] = (target, (2053,), None, "dense")
        cases[f"{name}-strided"] = (target, (40, 50), (slice(None, None, 3), slice(1, None, 2)), "dense")
        cases[f"{name}-listed-transposed"] = (target, (37, 29), ([36, 0, 5, 5, 11], slice(None, None, -1)),
                                              "transposed")
        # one run of consecutive global indices (the RUN kernel): from an index off a Philox block, and rows
        cases[f"{name}-run-off-block"] = (target, (2053,), (slice(3, 2001),), "dense")
        cases[f"{name}-run-rows"] = (target, (40, 50), (slice(5, 17), slice(None)), "dense")
    return cases


#: The cases that take the RUN kernels (one run, stored contiguously); the others the general ones.
RUN_CASES = ("dense", "run-off-block", "run-rows")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8)


def _run_case(case, round_fn, device) -> str:
    import keyinit
    from keyinit._draw import reference_sround
    from keyinit.regions import make_region
    from tests.kernels.test_sround_kernel import _values

    target, shape, region, layout = case
    reg = make_region(shape, region)
    x = _values(reg.numel, seed=len(shape)).reshape(reg.region_shape)
    key = keyinit.key(2**40 + 7)
    expected = torch.empty(reg.region_shape, dtype=target)
    reference_sround.round_into(expected, x, key, reg)
    if layout == "transposed":
        got = torch.zeros(tuple(reversed(reg.region_shape)), dtype=target, device=device).t()
    else:
        got = torch.zeros(reg.region_shape, dtype=target, device=device)
    if not round_fn(got, x.to(device), key, reg):
        return "kernel declined"
    got = got.cpu()
    if torch.equal(_bits(got), _bits(expected)):
        return "ok"
    bad = (_bits(got).reshape(-1) != _bits(expected).reshape(-1)).nonzero().flatten()[:5].tolist()
    return f"mismatch at flat positions {bad}"


def _golden_cases(round_fn) -> list[str]:
    """The C kernel's golden self-test cases, through the Triton kernel (threads are irrelevant here)."""
    from keyinit._kernels.fill import selftest_sround

    return selftest_sround.run(lambda out, x, key, region, threads: round_fn(out, x, key, region))


@pytest.fixture(scope="module")
def interpreter_results():
    return run_worker(__file__)


def _adam_cases() -> dict:
    from keyinit._kernels.fill import selftest_sround

    # (its two-thread case is the CPU kernel's concern: 70001 elements cost the interpreter seconds)
    cases = {name: case for name, *case in selftest_sround.adam_cases() if case[-1] == 1}
    cases["adam-bf16-listed"] = (torch.bfloat16, (9, 300), ([8, 0, 3], slice(None, None, -2)), 1, 1)
    cases["adam-bf16-rows"] = (torch.bfloat16, (9, 300), (slice(2, 7), slice(1, None)), 1, 1)
    cases["adam-f16-run-shard"] = (torch.float16, (9, 301), (slice(3, 8), slice(None)), 0, 1)
    cases["adam-bf16-run-off-block"] = (torch.bfloat16, (1031,), (slice(5, 1000),), 1, 1)
    return cases


def _run_adam_case(case, adam_fn, device) -> str:
    from keyinit._draw import reference_sround
    from keyinit._kernels.fill import selftest_sround
    from keyinit.keys import key
    from keyinit.regions import make_region

    dtype, shape, region, which, _ = case
    reg = make_region(shape, region)
    mine = [t.reshape(reg.region_shape).to(device) for t in selftest_sround.adam_inputs(reg.numel, dtype)]
    ref = [t.cpu().clone() for t in mine]
    scalars, has_decay = selftest_sround.ADAM_SCALARS[which]
    k = key(2**40 + 9)
    if not adam_fn(*mine, k, reg, scalars, has_decay):
        return "kernel declined"
    reference_sround.adam_into(*ref, k, reg, scalars, has_decay)
    for what, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), mine, ref):
        if not torch.equal(a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            return f"{what} differs"
    return "ok"


ADAM_IDS = ["adam-bf16-dense", "adam-f16-off-block", "adam-f32-dense", "adam-bf16-listed", "adam-bf16-rows",
            "adam-f16-run-shard", "adam-bf16-run-off-block"]


def test_runs_take_the_run_kernels_and_other_regions_the_general_ones():
    """Which kernel each case's launch takes (host side: no triton needed): the cases named for runs are
    one run of consecutive global indices stored contiguously; rows of a column slice are not."""
    from keyinit._kernels.fill.triton import launch_args
    from keyinit._kernels.fill.triton_sround import _single_run
    from keyinit.regions import make_region

    for case_id, (target, shape, region, layout) in _cases().items():
        reg = make_region(shape, region)
        out = torch.empty(reg.region_shape, dtype=target)
        assert _single_run(launch_args(out, reg, 1)) == case_id.endswith(RUN_CASES), case_id
    for case_id, (dtype, shape, region, _, _) in _adam_cases().items():
        reg = make_region(shape, region)
        single = _single_run(launch_args(torch.empty(reg.region_shape, dtype=dtype), reg, 1))
        assert single == (case_id in ("adam-bf16-dense", "adam-f32-dense", "adam-f16-run-shard",
                                      "adam-bf16-run-off-block")), case_id


@pytest.mark.parametrize("case_id", [*_cases(), "golden", *ADAM_IDS])
def test_interpreter_kernel_equals_reference(interpreter_results, case_id):
    assert interpreter_results[case_id] == "ok", interpreter_results[case_id]


def test_kernel_declines_what_it_does_not_round():
    import keyinit
    from keyinit._kernels.fill import triton_sround
    from keyinit.regions import make_region

    reg = make_region((8,), None)
    out = torch.empty(8, dtype=torch.bfloat16)
    assert triton_sround.sround(out, torch.ones(8), keyinit.key(0), reg) is False  # CPU, no interpreter
    assert triton_sround.sround(out, torch.ones(8, dtype=torch.float64), keyinit.key(0), reg,
                                interpret_ok=True) is False  # float64 sources: the reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled GPU path is not exercised")
def test_gpu_kernel_equals_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the compiled GPU path is not exercised")
    from keyinit._kernels.fill import triton_sround
    from keyinit.random import stochastic_round

    def through_dispatch(out, x, key, reg):  # what users call: the dispatch picks the Triton kernel on CUDA
        assert triton_sround.available()
        stochastic_round(key, x, out.dtype, global_shape=reg.shape, region=reg.entries, out=out)
        return True

    results = {case_id: _run_case(case, through_dispatch, "cuda") for case_id, case in _cases().items()}
    assert {k: v for k, v in results.items() if v != "ok"} == {}

    def on_gpu(out, x, key, reg):
        got = out.to("cuda")  # its strides kept
        done = triton_sround.sround(got, x.to("cuda"), key, reg)
        out.copy_(got.cpu())
        return done

    assert _golden_cases(on_gpu) == []
    adam = {name: _run_adam_case(case, triton_sround.sround_adam, "cuda") for name, case in _adam_cases().items()}
    assert {k: v for k, v in adam.items() if v != "ok"} == {}


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.fill import triton_sround

    assert triton_sround.available(), "triton could not be imported"

    def round_fn(out, x, key, reg):
        return triton_sround.sround(out, x, key, reg, interpret_ok=True)

    results = {}
    for case_id, case in _cases().items():
        try:
            results[case_id] = _run_case(case, round_fn, "cpu")
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case_id] = f"{type(exc).__name__}: {exc}"
    for case_id, case in _adam_cases().items():
        try:
            results[case_id] = _run_adam_case(
                case, lambda *a: triton_sround.sround_adam(*a, interpret_ok=True), "cpu")
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


def test_kernel_compiles_for_cuda_one_variant_per_target(tmp_path, monkeypatch):
    """Without a GPU: the kernel passes Triton's compiler for an NVIDIA target (the interpreter checks far
    less) for every target, and every runtime integer is typed int64 and never specialized on its value."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {exc}")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keyinit._bits.sround import TARGETS as FORMATS
    from keyinit._kernels.fill import triton_sround_impl as impl
    from keyinit._kernels.fill.launch import BLOCK

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = impl._sround_kernel
    runtime = [p for p in fn.params if p.name not in ("out_ptr", "src_ptr", "index_ptr") and not p.is_constexpr]
    assert {p.name for p in runtime} == set(impl._INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    for target in TARGETS:
        f = FORMATS[target]
        constexprs = dict(P=f.p, EMIN=f.emin, EMAX=f.emax, NBITS=f.nbits, HAS_INF=int(f.inf is not None),
                          INF=f.inf or 0, NAN=f.nan, MAXF=f.max_finite, BLOCK=BLOCK)
        signature = {name: ("*i16" if f.nbits == 16 else "*u8") if name == "out_ptr" else
                     "*i32" if name == "src_ptr" else "*i64" if name == "index_ptr" else
                     "constexpr" if name in constexprs else "i64" for name in fn.arg_names}
        compiled = triton_compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
        assert "ld.global" in compiled.asm["ptx"], target
    adam = impl._adam_kernel
    floats = {p.name for p in adam.params if p.annotation_type == "fp32"}
    runtime = [p for p in adam.params if not p.is_constexpr and p.name not in floats and not p.name.endswith("_ptr")]
    assert {p.name for p in runtime} == set(impl._ADAM_INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    for ptype, pointer in ((0, "*i16"), (1, "*fp16"), (4, "*fp32")):
        constexprs = dict(PTYPE=ptype, BLOCK=BLOCK)
        signature = {name: (pointer if name in ("p_ptr", "g_ptr") else "*fp32" if name in ("m_ptr", "v_ptr") else
                            "*i64" if name == "index_ptr" else "constexpr" if name in constexprs else
                            "fp32" if name in floats else "i64") for name in adam.arg_names}
        ptx = triton_compile(ASTSource(fn=adam, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        assert ".approx" not in ptx and "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, ptype
        # 17.6's fmas are explicit; every other multiply and add keeps its own rounding (.rn: ptxas never
        # contracts those into an fma)
        assert "fma.rn.f32" in ptx and "mul.rn.f32" in ptx and "add.rn.f32" in ptx, ptype
        assert "mul.f32" not in ptx and "add.f32" not in ptx, ptype
    # the RUN kernels: the same checks; their runtime integers are the run's (no geometry)
    from keyinit._kernels.fill import triton_sround_run as run_impl
    from keyinit._kernels.fill.triton_sround import RUN_NB

    fn = run_impl._sround_run_kernel
    runtime = [p for p in fn.params if p.name not in ("out_ptr", "src_ptr") and not p.is_constexpr]
    assert {p.name for p in runtime} == set(run_impl.RUN_INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    for target in TARGETS:
        f = FORMATS[target]
        constexprs = dict(P=f.p, EMIN=f.emin, EMAX=f.emax, NBITS=f.nbits, HAS_INF=int(f.inf is not None),
                          INF=f.inf or 0, NAN=f.nan, MAXF=f.max_finite, NB=RUN_NB)
        signature = {name: ("*i16" if f.nbits == 16 else "*u8") if name == "out_ptr" else
                     "*i32" if name == "src_ptr" else "constexpr" if name in constexprs else "i64"
                     for name in fn.arg_names}
        compiled = triton_compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
        assert "ld.global" in compiled.asm["ptx"], target
    adam = run_impl._adam_run_kernel
    runtime = [p for p in adam.params if not p.is_constexpr and p.name not in floats and not p.name.endswith("_ptr")]
    assert {p.name for p in runtime} == set(run_impl.ADAM_RUN_INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    for ptype, pointer in ((0, "*i16"), (1, "*fp16"), (4, "*fp32")):
        constexprs = dict(PTYPE=ptype, NB=RUN_NB)
        signature = {name: (pointer if name in ("p_ptr", "g_ptr") else "*fp32" if name in ("m_ptr", "v_ptr") else
                            "constexpr" if name in constexprs else "fp32" if name in floats else "i64")
                     for name in adam.arg_names}
        ptx = triton_compile(ASTSource(fn=adam, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        assert ".approx" not in ptx and "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, ptype
        assert "fma.rn.f32" in ptx and "mul.rn.f32" in ptx and "add.rn.f32" in ptx, ptype
        assert "mul.f32" not in ptx and "add.f32" not in ptx, ptype
