"""Golden vectors of keyed dropout (docs/spec.md section 14), and a from-the-spec reimplementation.

``tests/nn/stream/golden_dropout_v1.json`` pins dropout keys (``dropout_key``), keep-masks
and outputs of ``keyinit.nn.functional.dropout`` for every dtype and several
``p``, plus the keys ``keyed`` uses. It was generated ONCE by running this file
as a script::

    python tests/nn/stream/test_dropout_golden.py     # refuses to overwrite an existing file

NEVER regenerate it to make a failing test pass: a failure means a change
altered dropout masks of stream v1 (see docs/spec.md section 11).

The second half recomputes the golden values in numpy from the spec text alone
(Philox4x32-10, fold_in, the threshold and the per-dtype arithmetic), so the
section is complete enough to reimplement.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import numpy as np
import pytest
import torch

if __name__ == "__main__":  # the generator
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

import keyinit
from keyinit.nn import dropout_key
from keyinit.nn import functional as KF

GOLDEN = pathlib.Path(__file__).with_name("golden_dropout_v1.json")

KEY_CASES = [
    (0, 0, "", 0),
    (0, 1, "", 0),
    (0, 0, "", 1),
    (1234, 7, "layers.0.attention", 0),
    (1234, 7, "layers.0.attention", 2),
    (1234, 8, "layers.0.attention", 0),
    (1234, 7, "layers.0.dropout", 0),
    (2**64 - 1, 2**64 - 1, "model.layers.11.self_attn", 2**64 - 1),
]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK_CASES = [  # (seed, step, fqn, ordinal, p, global shape, region as [start, stop] per dim)
    (0, 0, "", 0, 0.5, [64], [[0, 64]]),
    (1234, 7, "layers.0.attention", 0, 0.1, [4, 3, 16], [[0, 4], [0, 3], [0, 16]]),
    (1234, 7, "layers.0.attention", 1, 0.1, [9, 40], [[5, 9], [3, 11]]),
    (99, 3, "drop", 0, 0.9, [2**31, 2**31], [[2**31 - 1, 2**31], [2**31 - 40, 2**31]]),
    (5, 0, "a.b", 0, 1e-9, [32], [[0, 32]]),
]
OUTPUT_PS = (0.0, 0.1, 0.5, 0.75, 1.0)


def _input(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic inputs: a ramp with both signs, exact-ish halves, a large and a tiny value."""
    values = [(i - n // 2) * 0.3125 + (0.001953125 if i % 3 == 0 else 0.0) for i in range(n)]
    values[1] = 60000.0 if dtype == torch.float16 else 3.0e38 if dtype == torch.float32 else 1.0e300
    values[2] = 1.0e-6
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def _hex(t: torch.Tensor) -> list[str]:
    width = t.element_size() * 2
    return [format(int(v) & ((1 << (4 * width)) - 1), f"0{width}x") for v in t.contiguous().view(_BITS[t.dtype]).tolist()]


def _from_hex(words: list[str], dtype: torch.dtype) -> torch.Tensor:
    bits = _BITS[dtype]
    info = torch.iinfo(bits)
    ints = [int(w, 16) - (1 << info.bits) if int(w, 16) > info.max else int(w, 16) for w in words]
    return torch.tensor(ints, dtype=bits).view(dtype)


def _mask_bits(keep: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in keep.reshape(-1).tolist())


def compute() -> dict:
    keys = [
        {"seed": s, "step": st, "fqn": f, "ordinal": n, "key": list(dropout_key(s, step=st, fqn=f, ordinal=n).words)}
        for s, st, f, n in KEY_CASES
    ]
    masks = []
    for seed, step, fqn, ordinal, p, shape, region in MASK_CASES:
        k = dropout_key(seed, step=step, fqn=fqn, ordinal=ordinal)
        local = [b - a for a, b in region]
        ones = torch.ones(local, dtype=torch.float32)
        out = KF.dropout(ones, p, rng_key=k, global_shape=shape, region=tuple(slice(a, b) for a, b in region))
        masks.append({"seed": seed, "step": step, "fqn": fqn, "ordinal": ordinal, "p": p, "shape": shape,
                      "region": region, "threshold": round((1.0 - p) * 2.0**32), "keep": _mask_bits(out != 0)})
    outputs = []
    k = dropout_key(42, step=1, fqn="layers.3.feed_forward", ordinal=0)
    for name, dtype in DTYPES.items():
        x = _input(24, dtype)
        for p in OUTPUT_PS:
            y = KF.dropout(x, p, rng_key=k)
            outputs.append({"dtype": name, "p": p, "key": list(k.words), "input": _hex(x), "output": _hex(y)})
    return {
        "stream": "v1",
        "comment": "Golden vectors of keyinit keyed dropout (docs/spec.md section 14), generated once by "
                   "tests/nn/stream/test_dropout_golden.py. Floats are hex bit patterns. Never regenerate this file to make "
                   "a test pass.",
        "torch": torch.__version__,
        "dropout_domain": keyinit.nn.DROPOUT_DOMAIN,
        "keys": keys,
        "masks": masks,
        "outputs": outputs,
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_dropout_domain_is_pinned(golden):
    assert golden["dropout_domain"] == keyinit.nn.DROPOUT_DOMAIN == int.from_bytes(b"dropout", "big")


def test_dropout_keys(golden):
    for case in golden["keys"]:
        k = dropout_key(case["seed"], step=case["step"], fqn=case["fqn"], ordinal=case["ordinal"])
        assert list(k.words) == case["key"], case


def test_masks(golden):
    for case in golden["masks"]:
        k = dropout_key(case["seed"], step=case["step"], fqn=case["fqn"], ordinal=case["ordinal"])
        region = tuple(slice(a, b) for a, b in case["region"])
        keep = keyinit.random.bernoulli(k, case["shape"], p=1 - case["p"], region=region)
        assert _mask_bits(keep) == case["keep"], case["fqn"]
        ones = torch.ones(keep.shape)
        out = KF.dropout(ones, case["p"], rng_key=k, global_shape=case["shape"], region=region)
        assert _mask_bits(out != 0) == case["keep"]


def test_outputs_every_dtype_and_p(golden):
    for case in golden["outputs"]:
        dtype = DTYPES[case["dtype"]]
        x = _from_hex(case["input"], dtype)
        y = KF.dropout(x, case["p"], rng_key=keyinit.Key(*case["key"]))
        assert _hex(y) == case["output"], (case["dtype"], case["p"])


def test_the_spec_example_key():
    import re

    spec = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "spec.md").read_text()
    match = re.search(r'`dropout_key\(key\(0\), 0, "", 0\) = \((0x[0-9a-f]{8}), (0x[0-9a-f]{8})\)`', spec)
    assert match is not None, "docs/spec.md section 14.1 lost its example"
    assert dropout_key(0, step=0, fqn="", ordinal=0).words == (int(match.group(1), 16), int(match.group(2), 16))


# ---------------------------------------------------------------- from the spec text alone

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _philox(c: tuple[int, int, int, int], k: tuple[int, int]) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = c
    k0, k1 = k
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _U32, p1 & _U32, ((p0 >> 32) ^ c3 ^ k1) & _U32, p0 & _U32
    return c0, c1, c2, c3


def _fold_int(k, d):
    out = _philox((d & _U32, d >> 32, 2, 0), k)
    return out[0], out[1]


def _fold_str(k, s):
    h = hashlib.sha256(s.encode()).digest()
    w = [int.from_bytes(h[4 * m:4 * m + 4], "little") for m in range(3)]
    out = _philox((w[0], w[1], 3, w[2]), k)
    return out[0], out[1]


def _spec_key(seed, step, fqn, ordinal):
    k = (seed & _U32, seed >> 32)
    k = _fold_int(_fold_int(k, int.from_bytes(b"dropout", "big")), step)
    for part in fqn.split(".") if fqn else ():
        k = _fold_str(k, part)
    return _fold_int(k, ordinal)


def _spec_keep(k, flat: np.ndarray, p: float) -> np.ndarray:
    threshold = round((1.0 - p) * 2.0**32)
    words = np.array([_philox(((j >> 2) & _U32, j >> 34, 0, 0), k)[j & 3] for j in flat.tolist()], dtype=np.uint64)
    return words < threshold


def test_spec_reimplementation_reproduces_keys_and_masks(golden):
    for case in golden["keys"]:
        assert list(_spec_key(case["seed"], case["step"], case["fqn"], case["ordinal"])) == case["key"]
    for case in golden["masks"]:
        k = _spec_key(case["seed"], case["step"], case["fqn"], case["ordinal"])
        strides = np.cumprod([1] + case["shape"][::-1])[:-1][::-1].astype(object)
        grids = np.meshgrid(*[np.arange(a, b, dtype=object) for a, b in case["region"]], indexing="ij")
        flat = sum(g * s for g, s in zip(grids, strides)).reshape(-1)
        keep = _spec_keep(k, flat, case["p"])
        assert "".join("1" if v else "0" for v in keep) == case["keep"], case["fqn"]


def test_spec_reimplementation_reproduces_outputs(golden):
    np_float = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
    for case in golden["outputs"]:
        dtype = DTYPES[case["dtype"]]
        x = _from_hex(case["input"], dtype)
        expected = _from_hex(case["output"], dtype)
        p = case["p"]
        if p == 0.0:
            assert torch.equal(expected.view(_BITS[dtype]), x.view(_BITS[dtype]))
            continue
        keep = _spec_keep(tuple(case["key"]), np.arange(x.numel(), dtype=object), p)
        s64 = 1.0 / (1.0 - p) if p < 1.0 else 0.0
        s32 = np.float32(s64)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is part of the contract
            if case["dtype"] == "float64":
                kept = x.numpy() * np.float64(s64)
            elif case["dtype"] == "bfloat16":  # binary32 product, then round to nearest even on the bits
                product = (x.float().numpy() * s32).astype(np.float32)
                kept = torch.from_numpy(product).to(torch.bfloat16)
            else:
                product = (x.float().numpy() * s32).astype(np.float32)
                kept = product.astype(np_float[case["dtype"]])
        kept = torch.as_tensor(kept).to(dtype)
        spec = torch.where(torch.from_numpy(keep), kept, torch.zeros((), dtype=dtype))
        assert torch.equal(spec.view(_BITS[dtype]), expected.view(_BITS[dtype])), (case["dtype"], p)


if __name__ == "__main__":
    if GOLDEN.exists():
        sys.exit(f"{GOLDEN} exists; golden vectors are generated once and never overwritten")
    GOLDEN.write_text(json.dumps(compute(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
