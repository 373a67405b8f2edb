"""The fused Adam/AdamW step of several parameters, and the rounding of several tensors, in one Triton
launch (``keyinit._kernels.fill.triton_sround_many``) give each tensor exactly the reference's bits with
the key ``key_for(base, fqn)`` (``docs/spec.md`` 17.2, 17.6), the key derived on the device: parameters
of both dtypes and every target format, FQNs of one to five components, runs from an index off a Philox
block, rows of a shard; what they cannot take is handed back untouched. Without a GPU it runs under Triton's interpreter
(``TRITON_INTERPRET=1``) in a fresh subprocess (this file run as a script); with CUDA, also on the GPU
through ``keyinit.optim.stochastic_rounding(..., fused=True)`` against the one-parameter kernel.
Skipped when triton is not installed."""

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

#: (FQN, dtype, global shape, region, scalars index): the parameters of one step
PARAMS = (
    ("embed.weight", torch.bfloat16, (1031,), None, 0),
    ("layers.0.attn.qkv.weight", torch.bfloat16, (9, 300), (slice(3, 8), slice(None)), 1),
    ("layers.0.attn.qkv.bias", torch.float16, (1031,), (slice(5, 1000),), 0),
    ("layers.1.mlp.fc1.lora_A.weight", torch.bfloat16, (3, 5), None, 1),
    ("head", torch.float16, (2, 700), None, 1),
    ("layers.1.norm.weight", torch.bfloat16, (9, 300), (slice(2, 7), slice(1, None)), 0),  # rows: handed back
    ("layers.2.w", torch.float32, (64,), None, 0),  # float32: handed back
)
HANDED_BACK = {"layers.1.norm.weight", "layers.2.w"}


def _inputs(device):
    from keyinit._draw.dispatch import AdamItem
    from keyinit._kernels.fill import selftest_sround
    from keyinit.regions import make_region

    items = []
    for i, (fqn, dtype, shape, region, which) in enumerate(PARAMS):
        reg = make_region(shape, region)
        p, g, m, v = (t.reshape(reg.region_shape).to(device)
                      for t in selftest_sround.adam_inputs(reg.numel, torch.float32 if dtype == torch.float32 else dtype))
        g = g.roll(i)  # each parameter its own values
        scalars, has_decay = selftest_sround.ADAM_SCALARS[which]
        items.append(AdamItem(p, g, m, v, fqn, reg, list(scalars), has_decay))
    return items


def _compare(items, device, step_many) -> dict:
    import keyinit
    from keyinit._draw import reference_sround
    from keyinit.keys import key_for

    base = keyinit.fold_in(keyinit.key(2**40 + 11), "stochastic_rounding")
    refs = _inputs("cpu")
    results = {}
    rest = step_many(items, base)
    back = {item.fqn for item in rest}
    results["handed back"] = sorted(back)
    for item, ref in zip(items, refs):
        if item.fqn in back:
            fresh = _inputs("cpu")[[i.fqn for i in refs].index(item.fqn)]
            untouched = all(torch.equal(a.cpu(), b) for a, b in zip(item[:4], fresh[:4]))
            results[item.fqn] = "untouched" if untouched else "written"
            continue
        reference_sround.adam_into(*ref[:4], key_for(base, ref.fqn), ref.region, ref.scalars, ref.has_decay)
        same = all(torch.equal(a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                   for a, b in zip((item.param, item.exp_avg, item.exp_avg_sq), (ref.param, ref.exp_avg, ref.exp_avg_sq)))
        results[item.fqn] = "ok" if same else "differs"
    return results


def _check(results: dict) -> None:
    assert results["handed back"] == sorted(HANDED_BACK)
    for fqn, *_ in PARAMS:
        assert results[fqn] == ("untouched" if fqn in HANDED_BACK else "ok"), (fqn, results[fqn])


#: (FQN, target, global shape, region): the tensors of one rounding launch
ROUNDS = (
    ("embed.weight", torch.bfloat16, (1031,), None),
    ("layers.0.attn.qkv.weight", torch.float16, (9, 300), (slice(3, 8), slice(None))),
    ("layers.0.attn.qkv.bias", torch.bfloat16, (1031,), (slice(5, 1000),)),
    ("layers.1.mlp.fc1.lora_A.weight", torch.float8_e4m3fn, (3, 5), None),
    ("head", torch.float8_e5m2, (2, 700), None),
    ("layers.1.norm.weight", torch.bfloat16, (9, 300), (slice(2, 7), slice(1, None))),  # rows: handed back
    ("layers.2.w", torch.float16, (9,), (slice(None, None, 2),)),  # strided: handed back
)
ROUNDS_HANDED_BACK = {"layers.1.norm.weight", "layers.2.w"}


def _round_results(device, round_many) -> dict:
    import keyinit
    from keyinit._draw import reference_sround
    from keyinit._draw.dispatch import RoundItem
    from keyinit.keys import key_for
    from keyinit.regions import make_region
    from tests.kernels.test_sround_kernel import _values

    base = keyinit.fold_in(keyinit.key(2**40 + 13), "stochastic_rounding")
    items, wants = [], []
    for i, (fqn, target, shape, region) in enumerate(ROUNDS):
        reg = make_region(shape, region)
        x = _values(reg.numel, seed=i + 1).reshape(reg.region_shape)
        want = torch.zeros(reg.region_shape, dtype=target)
        reference_sround.round_into(want, x, key_for(base, fqn), reg)
        items.append(RoundItem(torch.zeros(reg.region_shape, dtype=target, device=device), x.to(device), fqn, reg))
        wants.append(want)
    back = {item.fqn for item in round_many(items, base)}
    results = {"handed back": sorted(back)}
    for item, want in zip(items, wants):
        got = item.out.cpu().view(torch.uint8)
        if item.fqn in back:
            results[item.fqn] = "untouched" if not got.any() else "written"
        else:
            results[item.fqn] = "ok" if torch.equal(got, want.view(torch.uint8)) else "differs"
    return results


def _check_rounds(results: dict) -> None:
    assert results["handed back"] == sorted(ROUNDS_HANDED_BACK)
    for fqn, *_ in ROUNDS:
        assert results[fqn] == ("untouched" if fqn in ROUNDS_HANDED_BACK else "ok"), (fqn, results[fqn])


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.fill import triton_sround_many

    results = _compare(_inputs("cpu"), "cpu",
                       lambda items, base: triton_sround_many.sround_adam_many(items, base, interpret_ok=True))
    results["rounds"] = _round_results(
        "cpu", lambda items, base: triton_sround_many.sround_many(items, base, interpret_ok=True))
    print(json.dumps(results))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()


def test_interpreter_kernel_equals_reference():
    results = run_worker(__file__)
    _check_rounds(results.pop("rounds"))
    _check(results)


def test_run_start_is_the_first_index_of_a_run_and_none_otherwise():
    from keyinit._kernels.fill.triton_sround_many import run_start
    from keyinit.regions import make_region

    runs = [((7, 5), None, 0), ((7, 5), (slice(2, 4), slice(None)), 10), ((7, 5), ([3], slice(1, 4)), 16),
            ((7, 5), ([6], [4]), 34), ((2, 3, 4), (slice(1, 2), slice(1, 3), slice(None)), 16),
            ((9,), (slice(4, 9),), 4), ((7, 5), ([1, 2], slice(None)), 5), ((7, 5), (slice(2, 4), slice(0, 4)), None),
            ((7, 5), ([1, 3], slice(None)), None), ((9,), (slice(0, 9, 2),), None),
            ((7, 5), (slice(None), slice(1, 2)), None), ((9,), (slice(None, None, -1),), None)]
    for shape, region, start in runs:
        reg = make_region(shape, region)
        assert run_start(reg) == start, (shape, region)
        if start is not None:  # a run's global indices are start, start + 1, ...
            assert torch.equal(reg.flat_indices(0, reg.numel), torch.arange(start, start + reg.numel))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled GPU path is not exercised")
def test_gpu_kernel_equals_reference_and_the_optimizer_takes_it():
    from keyinit._kernels.fill import triton_sround_many

    _check(_compare(_inputs("cuda"), "cuda", triton_sround_many.sround_adam_many))
    _check_rounds(_round_results("cuda", triton_sround_many.sround_many))


def test_kernel_compiles_for_cuda_with_ieee_arithmetic_only(tmp_path, monkeypatch):
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {exc}")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keyinit._bits.sround import TARGETS as FORMATS
    from keyinit._kernels.fill import triton_sround_many_impl as impl

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = impl._sround_many_kernel
    for target in (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn):
        f = FORMATS[target]
        constexprs = dict(P=f.p, EMIN=f.emin, EMAX=f.emax, NBITS=f.nbits, HAS_INF=int(f.inf is not None),
                          INF=f.inf or 0, NAN=f.nan, MAXF=f.max_finite, NB=256, SEARCH=4)
        signature = {name: "*i64" if name.endswith("_ptr") else "constexpr" if name in constexprs else "i64"
                     for name in fn.arg_names}
        ptx = triton_compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        assert "ld.global" in ptx and "st.global" in ptx, target
    fn = impl._adam_many_kernel
    runtime = [p for p in fn.params if not p.is_constexpr and not p.name.endswith("_ptr")]
    assert {p.name for p in runtime} == set(impl.MANY_INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime)
    for ptype in (0, 1):
        constexprs = dict(PTYPE=ptype, NB=256, SEARCH=4)
        signature = {name: "*i64" if name.endswith("_ptr") else "constexpr" if name in constexprs else "i64"
                     for name in fn.arg_names}
        ptx = triton_compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        assert ".approx" not in ptx and "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, ptype
        assert "fma.rn.f32" in ptx and "mul.rn.f32" in ptx and "add.rn.f32" in ptx, ptype
        assert "mul.f32" not in ptx and "add.f32" not in ptx, ptype
