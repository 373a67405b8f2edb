"""The Triton dropout kernel equals the bernoulli mask put through the spec's arithmetic, bit for bit.

Without a GPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU
tensors), which must be set before triton is imported: the cases run in a fresh
subprocess (this file as a script) and return one verdict per case as JSON, as
tests/gpu/test_kernels_triton.py does for the init kernel. With CUDA, the compiled
kernel is checked in-process too (forward and backward through the op).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._support.interpreter import interpreter_results as run_worker

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed; the Triton dropout kernel is not tested")

REPO = Path(__file__).resolve().parents[2]


def _cases():
    """``{case_id: (dtype, p, global shape, region)}``: run and general modes, every dtype."""
    geometries = {
        "whole": ((3, 37, 11), None),
        "whole-vectors": ((4, 64, 24), None),  # a multiple of every dtype's 16-byte vector: vector loads, stores
        "rows-vectors": ((9, 8, 16), (slice(4, 8), slice(None), slice(None))),  # a block-aligned run of 512
        "rows-unaligned": ((9, 37, 11), (slice(5, 8), slice(None), slice(None))),
        "inner-split": ((3, 37, 22), (slice(None), slice(None), slice(11, 22))),
        "index-vectors": ((9, 40, 11), ([0, 8, 3], list(range(39, 2, -1)), slice(None))),
        "near-2**62": ((2**31, 2**31), (slice(2**31 - 3, None), slice(2**31 - 407, None))),
    }
    cases = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for name, (shape, region) in geometries.items():
            cases[f"{str(dtype)[6:]}-{name}"] = (dtype, 0.3, shape, region)
    for p in (1e-12, 0.9, 1.0):
        cases[f"float32-p{p}"] = (torch.float32, p, (2, 3000), None)
    return cases


def _run_case(case, run_fn, device):
    import keyinit
    from keyinit.nn import dropout_key
    from keyinit._draw.dropout_geometry import layout_for, make_geometry as plan

    dtype, p, shape, region = case
    key = dropout_key(5, step=2**40, fqn="layers.7.attention", ordinal=3)
    local = keyinit.regions.make_region(shape, region).region_shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(local, generator=g, dtype=torch.float64).to(dtype)
    keep = keyinit.random.bernoulli(key, shape, p=1 - p, region=region)
    if dtype == torch.float64:
        kept = x * (1.0 / (1.0 - p)) if p < 1 else x
    else:
        kept = (x.float() * torch.tensor(1.0 / (1.0 - p) if p < 1 else 0.0, dtype=torch.float32)).to(dtype)
    want = torch.where(keep, kept, torch.zeros((), dtype=dtype))
    layout = layout_for(local, shape, region)
    geometry = plan(local, *key.words, p, layout.gstrides, layout.starts, layout.indices)
    x_dev = x.to(device)
    out = torch.empty_like(x_dev)
    if not run_fn(x_dev, out, geometry):
        return "kernel declined"
    got = out.cpu()
    if torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
        return "ok"
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).reshape(-1).nonzero().flatten()[:5].tolist()
    return f"mismatch at byte positions {bad}"


@pytest.fixture(scope="module")
def interpreter_results():
    return run_worker(__file__)


@pytest.mark.parametrize("case_id", list(_cases()))
def test_interpreter_kernel_is_bit_exact(interpreter_results, case_id):
    assert interpreter_results[case_id] == "ok", interpreter_results[case_id]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled Triton path is not exercised")
def test_gpu_kernel_is_bit_exact_forward_and_backward():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process")
    from keyinit._kernels.dropout import triton as triton_dropout
    from keyinit.nn import dropout_key
    from keyinit.nn import functional as KF

    results = {case_id: _run_case(case, triton_dropout.run, "cuda") for case_id, case in _cases().items()}
    assert {k: v for k, v in results.items() if v != "ok"} == {}
    key = dropout_key(1, step=2, fqn="a", ordinal=0)
    x = torch.randn(4, 33, 65, dtype=torch.bfloat16)
    xc = x.cuda().requires_grad_()
    out = KF.dropout(xc, 0.2, rng_key=key)
    out.backward(torch.ones_like(out))
    assert torch.equal(out.cpu().view(torch.int16), KF.dropout(x, 0.2, rng_key=key).view(torch.int16))
    assert torch.equal(xc.grad.cpu().view(torch.int16), KF.dropout(torch.ones_like(x), 0.2, rng_key=key).view(torch.int16))


def test_run_declines_cpu_tensors_outside_the_interpreter():
    code = (
        "import torch\n"
        "from keyinit._kernels.dropout import triton as triton_dropout\n"
        "from keyinit._draw.dropout_geometry import make_geometry as plan\n"
        "g = plan((4,), 1, 2, 0.5, [1], [0], [None])\n"
        "assert triton_dropout.run(torch.ones(4), torch.empty(4), g) is False\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.dropout import triton as triton_dropout

    def run_fn(x, out, geometry):
        return triton_dropout.run(x, out, geometry, interpret_ok=True)

    results = {}
    for case_id, case in _cases().items():
        try:
            results[case_id] = _run_case(case, run_fn, "cpu")
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case_id] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()
