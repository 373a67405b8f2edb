"""The Triton dropout kernel gives stream v2's extent-free names (docs/spec.md 14.8) bit for bit.

Each case lays out a keyed activation by v2's names (rows, attention probabilities with three
coordinates, sequence-first and sample-innermost permutations, a shard of the inner dimension, rows
picked by an index, the limits of the names) and compares the Triton kernel's output with the torch
reference and the C kernel, in float32, bfloat16 and float16. A padded activation (a longer sequence,
query or key dimension) must give its real elements the same values. Stream v1's layouts of the same
shapes still give v1's reference. A keyed forward of ``stream="v2"`` run through the Triton kernel
(standing in for the C kernel) equals the reference's, forward and backward, for non-contiguous inputs too.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), which
must be set before triton is imported: the cases run in a fresh subprocess (this file as a script) and
return one verdict per case as JSON, as tests/gpu/test_dropout_triton.py does. With CUDA the compiled kernel
is checked in-process on the same cases.
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
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed; the Triton dropout kernel is not tested")

K0, K1, P = 0x2545F491, 0x9E3779B9, 0.3
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _geometries():
    """``{name: (stream, local shape, gstrides, starts, indices, hstrides)}``, layouts of keyed activations."""
    from keyinit._draw.dropout_geometry import rows_layout
    from keyinit._draw.names import names_strides

    def rows(shape, offset, stream="v2"):
        layout = rows_layout(shape, offset, stream)
        return (stream, shape, layout.gstrides, layout.starts, layout.indices, layout.hstrides)

    def permuted(sample_shape, local_order, starts, shape, indices=None):
        """The canonical tensor ``(samples, *sample_shape)``'s names, its dims in ``local_order``."""
        lo, hi = names_strides(sample_shape)
        return ("v2", shape, tuple(lo[d] for d in local_order), starts, indices or (None,) * len(shape),
                tuple(hi[d] for d in local_order))

    return {
        "rows": rows((2, 3, 70), 11),  # rows of 70 from a Philox block: rows mode
        "rows-vectors": rows((2, 2, 96), 0),  # ... a multiple of every 16-byte vector: vector loads and stores
        "rows-short": rows((4, 7, 9), 3),  # rows shorter than the rows mode takes: one block per element
        "rows-long": rows((2, 1, 1100), 1),  # rows of several programs
        "one-row": rows((1, 1, 300), 5),  # one run with constant high words
        "attention": rows((2, 2, 3, 80), 7),  # (B, H, L, S): three coordinates
        "attention-short": rows((2, 3, 5, 12), 7),
        "sequence-first": permuted((5, 70), (1, 0, 2), (0, 4, 0), (3, 2, 70)),  # (L, B, D): h changes per row
        "sample-innermost": permuted((6, 70), (1, 2, 0), (0, 0, 3), (6, 70, 4)),  # (L, D, B)
        "inner-shard": permuted((4, 100), (0, 1, 2), (2, 1, 5), (2, 3, 90)),  # rows that start inside a block
        "routed": permuted((4, 100), (0, 1, 2), (0, 0, 0), (3, 2, 100), (torch.tensor([5, 0, 2]), None, None)),
        "routed-rows": permuted((4, 100), (0, 1, 2), (0, 0, 0), (3, 3, 100),  # (an index on the row's dim too)
                                (torch.tensor([5, 0, 2]), torch.tensor([3, 0, 1]), None)),
        "limits": permuted((5, 2**29 - 1, 80), (0, 1, 2, 3), (2**31 - 2, 3, 2**29 - 3, 0), (2, 2, 2, 80)),
        "limits-shard": permuted((5, 2**29 - 1, 80), (0, 1, 2, 3), (2**31 - 2, 3, 2**29 - 3, 20), (2, 2, 2, 60)),
        "v1-rows": rows((2, 3, 70), 11, "v1"),
        "v1-attention": rows((2, 2, 3, 80), 7, "v1"),
    }


#: Other launches of the rows mode (``Tuning(tile_bytes, warps, elements)``), the same values under each:
#: programs of one tile and two rows (a program starts inside an outer dim; float32), or of three rows; rows of
#: several tiles.
TUNINGS = {"cfg-2": (512, 1, 256), "cfg-3": (1024, 2, 384)}
TUNING_CASES = ("rows", "rows-long", "attention", "sequence-first", "inner-shard", "routed-rows", "limits")

#: ``{name: (stream, short shape, padded shape, offset)}``: the padded activation's real elements are the short's.
PADDED = {
    "padded-sequence": ((2, 3, 70), (2, 5, 70), 3),
    "padded-modes": ((2, 3, 40), (2, 3, 100), 3),  # one block per element, then the rows mode
    "padded-attention": ((1, 2, 3, 70), (1, 2, 5, 90), 1),
}


def _case_ids():
    ids = [f"{name}-{str(dtype)[6:]}" for name in _geometry_names() for dtype in DTYPES]
    ids += ["rows-float64", "attention-float64"]
    ids += [f"{name}-{str(dtype)[6:]}" for name in PADDED for dtype in DTYPES]
    ids += ["keyed-forward-bfloat16"]
    ids += [f"{name}@{cfg}-{str(dtype)[6:]}" for name in TUNING_CASES for cfg in TUNINGS
            for dtype in (torch.float32, torch.bfloat16)]
    ids += [f"bf16-patterns-{mode}-bfloat16" for mode in ("run", "rows", "general")]
    return ids


def _geometry_names():
    return ("rows", "rows-vectors", "rows-short", "rows-long", "one-row", "attention", "attention-short",
            "sequence-first", "sample-innermost", "inner-shard", "routed", "routed-rows", "limits", "limits-shard",
            "v1-rows", "v1-attention")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    bad = (_bits(got) != _bits(want)).reshape(-1).nonzero().flatten()[:5].tolist()
    return f"{what}: mismatch at byte positions {bad}"


def _kernel_case(run_fn, device, name, dtype) -> str:
    from keyinit._draw.dropout_geometry import make_geometry
    from keyinit._draw.reference_dropout import dropout as reference
    from keyinit._kernels.dropout import cpu

    stream, shape, gstrides, starts, indices, hstrides = _geometries()[name]
    geometry = make_geometry(shape, K0, K1, P, gstrides, starts, indices, stream, hstrides)
    if (stream == "v2") != bool(geometry.hstrides):
        return f"the geometry of {stream} has hstrides {geometry.hstrides}"
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(name)), dtype=torch.float64).to(dtype)
    want = torch.empty_like(x)
    reference(x, want, geometry)
    c_out = torch.empty_like(x)
    if cpu.run(x, c_out, geometry) and not torch.equal(_bits(c_out), _bits(want)):
        return _mismatch(c_out, want, "the C kernel against the reference")
    out = torch.empty_like(x, device=device)
    if not run_fn(x.to(device), out, geometry):
        return "kernel declined"
    got = out.cpu()
    return "ok" if torch.equal(_bits(got), _bits(want)) else _mismatch(got, want, "Triton against the reference")


def _padded_case(run_fn, device, name, dtype) -> str:
    from keyinit._draw.dropout_geometry import make_geometry, rows_layout

    short, padded, offset = PADDED[name]
    x = torch.randn(padded, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    real = tuple(slice(0, n) for n in short)
    outs = []
    for tensor in (x[real].contiguous(), x):
        layout = rows_layout(tuple(tensor.shape), offset, "v2")
        geometry = make_geometry(tuple(tensor.shape), K0, K1, P, layout.gstrides, layout.starts, layout.indices,
                                 "v2", layout.hstrides)
        out = torch.empty_like(tensor, device=device)
        if not run_fn(tensor.to(device), out, geometry):
            return "kernel declined"
        outs.append(out.cpu())
    return "ok" if torch.equal(_bits(outs[0]), _bits(outs[1][real])) else _mismatch(outs[1][real], outs[0], name)


class _Net(torch.nn.Module):
    """Element-wise dropouts of a (B, L, D) activation, (B, H, L, S) probabilities and a transposed (L, B, D)
    view (a non-contiguous input whose batch is dimension 1)."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(P)

    def forward(self, x, probs, y):
        return self.drop(x), self.drop(probs), self.drop(y.transpose(0, 1))


def _keyed_forward(dtype):
    """Outputs and input gradients of a keyed forward of :class:`_Net` under stream v2 (CPU tensors)."""
    import keyinit.nn as knn

    g = torch.Generator().manual_seed(0)
    shapes = ((2, 3, 70), (2, 2, 2, 66), (2, 3, 65))
    inputs = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]
    net = _Net().train()
    with knn.keyed(net, 7, step=2, sample_offset=4, stream="v2"):
        outs = net(*inputs)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def _keyed_case(run_fn, dtype) -> str:
    """The keyed forward with the Triton kernel in the C kernel's place equals the reference's."""
    from keyinit._kernels.dropout import cpu

    os.environ["KEYINIT_DISABLE_KERNELS"] = "1"
    try:
        want = _keyed_forward(dtype)
    finally:
        del os.environ["KEYINIT_DISABLE_KERNELS"]
    calls = []

    def triton_in_place_of_c(x, out, geometry, *args, **kwargs):
        calls.append(geometry.stream)
        return run_fn(x, out, geometry)

    saved, cpu.run = cpu.run, triton_in_place_of_c  # (the dispatcher resolves cpu.run at each call)
    try:
        got = _keyed_forward(dtype)
    finally:
        cpu.run = saved
    if calls != ["v2"] * 6:
        return f"the Triton kernel ran for {calls}, not 3 forward and 3 backward dropouts of stream v2"
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(_bits(a), _bits(b)):
            return _mismatch(a, b, f"keyed forward tensor {i}")
    return "ok"


def _bf16_patterns_case(run_fn, device, mode: str) -> str:
    """bfloat16 inputs of every bit pattern (on the CPU a scattered quarter of them, and the specials: NaNs,
    infinities, subnormals, -0, the largest finite) through one launch mode: the rounding of ``x * scale``
    (the hardware's conversion on the GPU, and the integer rounding) equals the reference's bit for bit, a
    kept NaN is a NaN (its bits are not in the contract, and torch's own product gives other bits than the C
    kernel's 0x7FC0), and by default (and with the integer rounding) the C kernel's bits, NaNs included.
    ``p = 1/3`` (scale 1.5: ``x * 1.5`` has at most 9 significant bits, so the rounding meets its ties)."""
    from keyinit._draw.dropout_geometry import make_geometry, rows_layout
    from keyinit._draw.reference_dropout import dropout as reference
    from keyinit._kernels.dropout import cpu

    n = 65536 if device == "cuda" else 16384
    bits = (torch.arange(n, dtype=torch.int64) * 40503).remainder(65536)  # (an odd factor: a permutation)
    specials = [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FFF, 0x0001, 0x8001, 0x8000, 0x007F, 0x7F7F, 0xFF7F]
    bits[:len(specials)] = torch.tensor(specials)
    x = bits.to(torch.int16).view(torch.bfloat16)
    if mode == "run":
        shape = (n,)
        geometry = make_geometry(shape, K0, K1, 1 / 3, (1,), (0,), (None,), "v1")
    else:
        shape = (2, n // 2048, 1024) if mode == "rows" else (n // 64, 8, 8)
        layout = rows_layout(shape, 3, "v2")
        geometry = make_geometry(shape, K0, K1, 1 / 3, layout.gstrides, layout.starts, layout.indices, "v2",
                                 layout.hstrides)
    assert geometry.scale32 == 1.5
    x = x.reshape(shape)
    want, c_out = torch.empty_like(x), torch.empty_like(x)
    reference(x, want, geometry)
    if not cpu.run(x, c_out, geometry):
        return "the C kernel declined"
    nan = want.isnan()
    if not torch.equal(c_out.isnan(), nan) or not torch.equal(_bits(c_out[~nan]), _bits(want[~nan])):
        return _mismatch(c_out, want, "the C kernel against the reference")
    for tuning in (None, _tuning(4096, 4, 16384, bf16_cvt=False), _tuning(4096, 4, 16384, bf16_nan=False)):
        out = torch.empty_like(x, device=device)
        if not (run_fn(x.to(device), out, geometry) if tuning is None else
                run_fn(x.to(device), out, geometry, tuning=tuning)):
            return "kernel declined"
        got = out.cpu()
        if not torch.equal(got.isnan(), nan) or not torch.equal(_bits(got[~nan]), _bits(want[~nan])):
            return _mismatch(got, want, f"Triton ({tuning}) against the reference")
        if (tuning is None or tuning.bf16_nan) and not torch.equal(_bits(got), _bits(c_out)):
            return _mismatch(got, c_out, f"Triton ({tuning}) against the C kernel")
    return "ok"


def _tuning(tile_bytes, warps, elements, bf16_cvt=True, bf16_nan=True):
    from keyinit._kernels.dropout.triton import Tuning

    return Tuning(tile_bytes, warps, elements, bf16_cvt, bf16_nan)


def _results(run_fn, device, keyed=True) -> dict:
    results = {}
    for case_id in _case_ids():
        name, _, dt = case_id.rpartition("-")
        dtype = getattr(torch, dt)
        try:
            if name in PADDED:
                results[case_id] = _padded_case(run_fn, device, name, dtype)
            elif name == "keyed-forward":
                results[case_id] = _keyed_case(run_fn, dtype) if keyed else "ok"
            elif name.startswith("bf16-patterns-"):
                results[case_id] = _bf16_patterns_case(run_fn, device, name.rpartition("-")[2])
            elif "@" in name:
                name, cfg = name.split("@")
                tuning = _tuning(*TUNINGS[cfg])

                def tuned(x, out, geometry):
                    return run_fn(x, out, geometry, tuning=tuning)

                results[case_id] = _kernel_case(tuned, device, name, dtype)
            else:
                results[case_id] = _kernel_case(run_fn, device, name, dtype)
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case_id] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return run_worker(__file__, timeout=900, enable_kernels=True)


@pytest.mark.parametrize("case_id", _case_ids())
def test_interpreter_kernel_gives_the_names_bit_for_bit(interpreter_results, case_id):
    assert interpreter_results[case_id] == "ok", interpreter_results[case_id]


def test_the_kernel_modes_are_the_ones_the_cases_mean():
    """The cases reach every launch mode of v2 geometries (so a mode the cases miss shows here, not never)."""
    from keyinit._draw.dropout_geometry import make_geometry
    from keyinit._kernels.dropout import triton as triton_dropout

    modes, plans = {}, {}
    for name, (stream, shape, gstrides, starts, indices, hstrides) in _geometries().items():
        geometry = make_geometry(shape, K0, K1, P, gstrides, starts, indices, stream, hstrides)
        plan = triton_dropout._plan(geometry, geometry_numel(shape), 4)
        modes[name] = (plan.mode, plan.high, plan.vec > 1)
        for cfg, config in TUNINGS.items():
            plans[name, cfg] = triton_dropout._plan(geometry, geometry_numel(shape), 4, _tuning(*config))
    run_, rows, any_ = triton_dropout.RUN, triton_dropout.ROWS, triton_dropout.ANY
    assert modes["one-row"] == (run_, True, True)
    assert modes["rows"] == (rows, True, False) and modes["rows-vectors"] == (rows, True, True)
    assert modes["attention"][:2] == modes["sequence-first"][:2] == modes["inner-shard"][:2] == (rows, True)
    assert modes["routed"][:2] == modes["routed-rows"][:2] == (rows, True)  # (index vectors on outer dimensions)
    assert modes["rows-short"][:2] == modes["sample-innermost"][:2] == (any_, True)
    assert modes["limits"] == (rows, True, True) and modes["limits-shard"][:2] == (any_, True)
    assert not modes["v1-rows"][1] and not modes["v1-attention"][1]
    # the other launches: programs of several rows, several programs, rows of several tiles
    assert all(plans[name, cfg].mode == rows for name in TUNING_CASES for cfg in TUNINGS)
    assert [plans["attention", cfg][-4:-1] for cfg in TUNINGS] == [((6,), 1, 2), ((4,), 1, 3)]
    assert plans["routed-rows", "cfg-2"].gather and not plans["attention", "cfg-2"].gather
    assert plans["rows-long", "cfg-2"].tiles == 9 and plans["rows-long", "cfg-3"].tiles == 5
    stream, shape, gstrides, starts, indices, hstrides = _geometries()["rows-long"]
    geometry = make_geometry(shape, K0, K1, P, gstrides, starts, indices, stream, hstrides)
    with pytest.raises(ValueError, match="Tuning.tile_bytes must be a power of two, got 3000"):
        triton_dropout._plan(geometry, geometry_numel(shape), 4, _tuning(3000, 4, 16384))


def geometry_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ptx(dtype, mode: int, high: bool, block: int, vec: int, ndim: int, num_warps: int) -> str:
    """The kernel's PTX for an sm_90 target, compiled without a GPU (Triton's bundled ptxas)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keyinit._kernels.dropout import triton as triton_dropout

    fn = triton_dropout._dropout_kernel
    constexprs = {"NDIM": ndim, "MODE": mode, "HIGH": high, "GATHER": False, "CVT": True, "NAN": True,
                  "KIND": triton_dropout._KINDS[dtype], "BLOCK": block, "VEC": vec}
    pointer = {torch.float32: "*fp32", torch.bfloat16: "*i16"}[dtype]
    signature = {name: "constexpr" if name in constexprs else pointer if name in ("x_ptr", "out_ptr")
                 else "*i64" if name.endswith("_ptr") else "i64" for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                       attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                              for n in ("x_ptr", "out_ptr", "meta_ptr", "index_ptr")})
    options = {"enable_fp_fusion": False, "num_warps": num_warps}
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def test_rows_mode_compiles_for_cuda_with_vectors_and_a_quarter_of_the_philox(tmp_path, monkeypatch):
    """Without a GPU: the rows mode (v2's high words) passes Triton's compiler, loads and stores 16-byte vectors
    where rows start on a Philox block, computes a Philox block per four elements (a quarter of the general
    mode's multiplies) and has no fused multiply-add."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {exc}")
    from keyinit._kernels.dropout import triton as triton_dropout

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for dtype in (torch.float32, torch.bfloat16):
        rows = _ptx(dtype, triton_dropout.ROWS, True, 1024, 16 // dtype.itemsize, 3, 4)
        general = _ptx(dtype, triton_dropout.ANY, True, 1024, 1, 3, 4)
        assert "ld.global.v4.b32" in rows and "st.global.v4.b32" in rows, dtype
        assert "fma." not in rows and "fma." not in general
        assert 4 * rows.count("mul.hi") <= general.count("mul.hi") + 8, (rows.count("mul.hi"), general.count("mul.hi"))


def test_layout_tables_are_made_once_per_layout_without_index_vectors():
    """A layout's tables reach the device once (a copy per call waited for the device); a layout with index
    vectors, whose values the sizes and strides do not give, gets its own every call."""
    from keyinit._draw.dropout_geometry import make_geometry
    from keyinit._kernels.dropout import triton as triton_dropout

    def tables(name):
        stream, shape, gstrides, starts, indices, hstrides = _geometries()[name]
        geometry = make_geometry(shape, K0, K1, P, gstrides, starts, indices, stream, hstrides)
        plan = triton_dropout._plan(geometry, geometry_numel(shape), 4)
        hs = geometry.hstrides or (0,) * len(geometry.sizes)
        return triton_dropout._tables(geometry, hs, plan.mode, torch.device("cpu"))

    for name in ("rows", "attention", "one-row", "rows-short"):
        first, again = tables(name), tables(name)
        assert first[0] is again[0] and first[1] is again[1], name
    assert tables("rows")[0] is not tables("attention")[0]
    routed, again = tables("routed-rows"), tables("routed-rows")
    assert routed[0] is not again[0] and torch.equal(routed[1], again[1])
    assert torch.tensor([5, 0, 2, 3, 0, 1]).tolist() == routed[1][:6].tolist()


def test_kernel_arguments_cannot_make_new_variants():
    """Every runtime integer is int64 and none is specialized on its value: a batch offset (stream v2's high
    words), a key word above 2**31 or a row length does not compile another kernel."""
    from keyinit._kernels.dropout import triton as triton_dropout

    fn = triton_dropout._dropout_kernel
    runtime_ints = [p for p in fn.params if not p.is_constexpr and not p.name.endswith("_ptr")]
    assert {p.name for p in runtime_ints} == set(triton_dropout._INTS)
    assert all(p.annotation_type == "i64" and p.do_not_specialize for p in runtime_ints)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled Triton path is not exercised")
def test_gpu_kernel_gives_the_names_bit_for_bit():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process")
    from keyinit._kernels.dropout import triton as triton_dropout

    results = _results(triton_dropout.run, "cuda", keyed=False)
    assert {k: v for k, v in results.items() if v != "ok"} == {}


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.dropout import triton as triton_dropout

    def run_fn(x, out, geometry, **kwargs):
        return triton_dropout.run(x, out, geometry, interpret_ok=True, **kwargs)

    print(json.dumps(_results(run_fn, "cpu")))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()
