"""The Triton permutation kernel equals the reference bit for bit (under TRITON_INTERPRET=1 without a GPU).

The interpreter must be set before triton is imported, so the cases run in a fresh
subprocess (this file as a script) that prints one verdict per case as JSON, as
tests/gpu/test_dropout_triton.py does. With CUDA the compiled kernel is checked in-process.
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
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

CASES = {  # name: (seed, n, positions: "range" or "tensor", inverse)
    "n2": (0, 2, "range", False),
    "n5-small-domain": (1, 5, "range", False),
    "n1000": (2, 1000, "tensor", False),
    "n65537-walk": (3, 65537, "tensor", False),
    "n1e9": (4, 10**9, "range", False),
    "n2**62": (5, 2**62, "tensor", False),
    "n1e12-inverse": (6, 10**12, "tensor", True),
    "n17-inverse": (7, 17, "range", True),
}


def _run_case(case, run_fn, device):
    import keyinit
    from keyinit._draw import reference_permutation

    seed, n, kind, inverse = case
    k = keyinit.key(seed)
    m = min(n, 2000)
    positions = torch.arange(m, dtype=torch.int64) * (n // m)
    walk = reference_permutation.unpermute_reference if inverse else reference_permutation.permute_reference
    want = walk(k, n, positions)
    kp = reference_permutation.permutation_key(k, n).words
    out = torch.empty(m, dtype=torch.int64, device=device)
    if kind == "range":
        ok = run_fn(kp, n, inverse, out, start=0, step=n // m)
    else:
        ok = run_fn(kp, n, inverse, out, positions=positions.to(device))
    if not ok:
        return "kernel declined"
    return "ok" if torch.equal(out.cpu(), want) else f"mismatch: {out.cpu()[:4].tolist()} vs {want[:4].tolist()}"


@pytest.fixture(scope="module")
def interpreter_results():
    return run_worker(__file__, timeout=600)


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreter_kernel_is_bit_exact(interpreter_results, case_id):
    assert interpreter_results[case_id] == "ok", interpreter_results[case_id]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled Triton path is not exercised")
def test_gpu_kernel_is_bit_exact_and_used_by_permutation():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process")
    import keyinit
    from keyinit._kernels.permutation import triton as triton_permutation
    from keyinit.data import permutation

    results = {case_id: _run_case(case, triton_permutation.run, "cuda") for case_id, case in CASES.items()}
    assert {k: v for k, v in results.items() if v != "ok"} == {}
    k = keyinit.key(11)
    assert torch.equal(permutation(k, 10**9, range(0, 100000), device="cuda").cpu(),
                       permutation(k, 10**9, range(0, 100000)))


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from keyinit._kernels.permutation import triton as triton_permutation

    def run_fn(*args, **kwargs):
        return triton_permutation.run(*args, interpret_ok=True, **kwargs)

    results = {}
    for case_id, case in CASES.items():
        try:
            results[case_id] = _run_case(case, run_fn, "cpu")
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case_id] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()
