"""Golden vectors of keyed collate draws (docs/spec.md section 16.4), and a from-the-spec check.

``tests/data/golden_collate_v1.json`` pins collate keys and the rows a collate function's draws give.
It was generated ONCE by running this file as a script::

    python tests/data/test_data_collate_golden.py     # refuses to overwrite an existing file

NEVER regenerate it to make a failing test pass: a failure means a change altered stream v1.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

if __name__ == "__main__":  # the generator
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keyinit  # noqa: E402
from keyinit.data import KeyedBatch, collate_key, keyed_collate  # noqa: E402
from keyinit.data._collate import COLLATE_DOMAIN  # noqa: E402

GOLDEN = pathlib.Path(__file__).with_name("golden_collate_v1.json")
KEYS = [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1234, 7, 3, 2), (2**64 - 1, 2**64 - 1, 5, 1)]
REFS = ((0, 3), (0, 7), (1, 3), (0, 2**38 - 1))


def _collate(batch):
    rows = len(batch)
    p = torch.tensor([0.0, 0.25, 0.5, 1.0, 0.1])
    return {"randint": torch.randint(100, (rows, 4)), "bernoulli": torch.bernoulli(p.expand(rows, 5)),
            "rand": torch.rand(rows, 3), "randn": torch.randn(rows, 2, dtype=torch.float64),
            "uniform_": torch.empty(rows, 2).uniform_(-1, 1), "bernoulli_": torch.empty(rows, 3).bernoulli_(0.5)}


def _encode(t: torch.Tensor) -> list:
    return [float(x).hex() if t.dtype.is_floating_point else int(x) for x in t.reshape(-1).tolist()]


def _generate() -> dict:
    rows = keyed_collate(_collate, 0)(KeyedBatch([None] * len(REFS), REFS))
    return {
        "stream": "v1",
        "comment": "Golden vectors of keyed_collate (docs/spec.md section 16.4), generated once by "
                   "tests/data/test_data_collate_golden.py. Never regenerate this file to make a test pass.",
        "collate_domain": COLLATE_DOMAIN,
        "keys": [{"seed": s, "epoch": e, "call": c, "draw": j, "key": list(collate_key(s, e, c, j).words)}
                 for s, e, c, j in KEYS],
        "seed": 0, "refs": [list(r) for r in REFS],
        "rows": {name: {"shape": list(t.shape), "dtype": str(t.dtype), "values": _encode(t)} for name, t in rows.items()},
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_collate_keys_and_rows(golden):
    assert golden["collate_domain"] == COLLATE_DOMAIN == int.from_bytes(b"collate", "big")
    for entry in golden["keys"]:
        assert list(collate_key(entry["seed"], entry["epoch"], entry["call"], entry["draw"]).words) == entry["key"]
    refs = tuple(tuple(r) for r in golden["refs"])
    rows = keyed_collate(_collate, golden["seed"])(KeyedBatch([None] * len(refs), refs))
    for name, want in golden["rows"].items():
        assert list(rows[name].shape) == want["shape"] and str(rows[name].dtype) == want["dtype"]
        assert _encode(rows[name]) == want["values"], name
    # one row alone, in another batch, gives the same values (16.4)
    alone = keyed_collate(_collate, golden["seed"])(KeyedBatch([None], (refs[2],)))
    for name in rows:
        assert torch.equal(alone[name][0], rows[name][2]), name


# --------------------------------------------------------------- from the spec text alone (Python ints)

M0, M1, W0, W1, MASK = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF


def _philox(c, k):
    c0, c1, c2, c3 = c
    k0, k1 = k
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


def _fold_int(k, d):
    return _philox((d & MASK, d >> 32, 2, 0), k)[:2]


def test_spec_text_reproduces_golden(golden):
    for entry in golden["keys"]:
        k = (entry["seed"] & MASK, entry["seed"] >> 32)
        for d in (int.from_bytes(b"collate", "big"), entry["epoch"], entry["call"], entry["draw"]):
            k = _fold_int(k, d)
        assert list(k) == entry["key"]
    # "bernoulli" is the collate call's op 1 (after randint), one draw of 32-bit words: row r, element e
    # is word i * 2**24 + e of the stream (section 4: lane w % 4 of Philox((lo32(w // 4), hi32(w // 4), 0, 0)))
    p = [0.0, 0.25, 0.5, 1.0, 0.1]
    values = golden["rows"]["bernoulli"]["values"]
    for r, (epoch, index) in enumerate(golden["refs"]):
        k = (0, 0)
        for d in (int.from_bytes(b"collate", "big"), epoch, 1, 0):
            k = _fold_int(k, d)
        for e in range(5):
            w = index * 2**24 + e
            word = _philox((w // 4 & MASK, w // 4 >> 32, 0, 0), k)[w % 4]
            assert float.fromhex(values[r * 5 + e]) == float(word < round(p[e] * 2**32))


if __name__ == "__main__":
    if GOLDEN.exists():
        raise SystemExit(f"{GOLDEN} exists; golden vectors are generated once and never regenerated")
    GOLDEN.write_text(json.dumps(_generate(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
