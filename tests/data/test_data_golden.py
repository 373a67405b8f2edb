"""Golden vectors of keyed data order (docs/spec.md section 16), and a from-the-spec reimplementation.

``tests/data/golden_data_v1.json`` pins permutation keys, permutations (whole for small
``n``, random positions for huge ``n``), KeyedSampler global batches and
augmentation sample keys. It was generated ONCE by running this file as a script::

    python tests/data/test_data_golden.py     # refuses to overwrite an existing file

NEVER regenerate it to make a failing test pass: a failure means a change altered
stream v1 (docs/spec.md section 11). The second half recomputes the values with
plain Python integers from the spec text alone.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import pytest
import torch

if __name__ == "__main__":  # the generator
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keyinit
from keyinit.data import KeyedSampler, inverse_permutation, permutation, sample_key
from keyinit._draw.reference_permutation import PERMUTE_DOMAIN, permutation_key
from keyinit.data._augment import AUGMENT_DOMAIN

GOLDEN = pathlib.Path(__file__).with_name("golden_data_v1.json")

WHOLE = [(0, n) for n in range(1, 11)] + [(0, 17), (1, 100), (2**64 - 1, 33), (5, 65537)]
SPARSE_N = [1000, 10**9, 2**40 + 3, 10**12, 2**61 + 1, 2**62]
SAMPLERS = [(10, 0, 4, [0, 1, 2, 3, 4, 5]), (1000, 7, 64, [0, 15, 16, 100]), (10**12, 3, 8, [0, 10**9])]
SAMPLE_KEYS = [(0, 0, 0), (0, 1, 0), (0, 0, 1), (1234, 7, 99), (2**64 - 1, 2**64 - 1, 2**64 - 1)]


def _positions(n: int) -> list[int]:
    return sorted({0, 1, 2, 3, n // 3, n // 2, n - 2, n - 1})


def _digest(values: torch.Tensor) -> str:
    return hashlib.sha256(values.to(torch.int64).numpy().astype("<i8").tobytes()).hexdigest()


def _generate() -> dict:
    data: dict = {
        "stream": "v1",
        "comment": "Golden vectors of keyinit.data (docs/spec.md section 16), generated once by "
                   "tests/data/test_data_golden.py. Never regenerate this file to make a test pass.",
        "permute_domain": PERMUTE_DOMAIN,
        "augment_domain": AUGMENT_DOMAIN,
        "whole": [], "sparse": [], "samplers": [], "sample_keys": [],
    }
    for seed, n in WHOLE:
        perm = permutation(keyinit.key(seed), n)
        entry = {"seed": seed, "n": n, "kp": list(permutation_key(keyinit.key(seed), n).words)}
        if n <= 100:
            entry["values"] = perm.tolist()
        else:
            entry["sha256_le_int64"] = _digest(perm)
        data["whole"].append(entry)
    for n in SPARSE_N:
        pos = _positions(n)
        data["sparse"].append({"seed": 42, "n": n, "positions": pos,
                               "values": permutation(keyinit.key(42), n, torch.tensor(pos)).tolist()})
    for n, seed, batch, steps in SAMPLERS:
        sampler = KeyedSampler(n, seed, global_batch_size=batch, rank=0, world_size=1)
        data["samplers"].append({"n": n, "seed": seed, "global_batch_size": batch,
                                 "batches": {str(t): sampler.global_batch(t).tolist() for t in steps}})
    for seed, epoch, index in SAMPLE_KEYS:
        data["sample_keys"].append({"seed": seed, "epoch": epoch, "index": index,
                                    "key": list(sample_key(seed, epoch, index).words)})
    return data


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_domains(golden):
    assert golden["permute_domain"] == PERMUTE_DOMAIN == int.from_bytes(b"permute", "big")
    assert golden["augment_domain"] == AUGMENT_DOMAIN == int.from_bytes(b"augment", "big")


def test_whole_permutations(golden):
    for entry in golden["whole"]:
        k = keyinit.key(entry["seed"])
        assert list(permutation_key(k, entry["n"]).words) == entry["kp"]
        perm = permutation(k, entry["n"])
        if "values" in entry:
            assert perm.tolist() == entry["values"], entry["n"]
        else:
            assert _digest(perm) == entry["sha256_le_int64"], entry["n"]


def test_sparse_positions_and_inverse(golden):
    for entry in golden["sparse"]:
        k = keyinit.key(entry["seed"])
        got = permutation(k, entry["n"], torch.tensor(entry["positions"]))
        assert got.tolist() == entry["values"], entry["n"]
        assert inverse_permutation(k, entry["n"], got).tolist() == entry["positions"]


def test_sampler_batches(golden):
    for entry in golden["samplers"]:
        for world in (1, 2, 4):
            if entry["global_batch_size"] % world:
                continue
            for t, want in entry["batches"].items():
                got = torch.cat([KeyedSampler(entry["n"], entry["seed"], global_batch_size=entry["global_batch_size"],
                                              rank=r, world_size=world).local_batch(int(t)) for r in range(world)])
                assert got.tolist() == want, (entry["n"], t, world)


def test_sample_keys(golden):
    for entry in golden["sample_keys"]:
        assert list(sample_key(entry["seed"], entry["epoch"], entry["index"]).words) == entry["key"]


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


def _spec_perm(seed, n, p):
    if n == 1:
        return 0
    kp = _fold_int(_fold_int((seed & MASK, seed >> 32), int.from_bytes(b"permute", "big")), n)
    b = (n - 1).bit_length()
    rb = b // 2
    lb = b - rb
    rounds = 12 if b <= 16 else 6

    def e(x):
        left, right = x >> rb, x & ((1 << rb) - 1)
        for i in range(rounds):
            if i % 2 == 0:
                left ^= _philox((right, i, 0, 0), kp)[0] & ((1 << lb) - 1)
            else:
                right ^= _philox((left, i, 0, 0), kp)[0] & ((1 << rb) - 1)
        return (left << rb) | right

    y = e(p)
    while y >= n:
        y = e(y)
    return y


def test_spec_text_reproduces_golden(golden):
    for entry in golden["whole"]:
        if "values" in entry:
            assert [_spec_perm(entry["seed"], entry["n"], p) for p in range(entry["n"])] == entry["values"]
    for entry in golden["sparse"]:
        assert [_spec_perm(entry["seed"], entry["n"], p) for p in entry["positions"]] == entry["values"]
    for entry in golden["samplers"]:
        n, seed, batch = entry["n"], entry["seed"], entry["global_batch_size"]
        root = (seed & MASK, seed >> 32)
        for t, want in entry["batches"].items():
            got = []
            for p in range(int(t) * batch, (int(t) + 1) * batch):
                epoch_key = _fold_int(root, p // n)
                seed_of_epoch = epoch_key[0] | (epoch_key[1] << 32)  # key(seed') has words (lo32, hi32)
                got.append(_spec_perm(seed_of_epoch, n, p % n))
            assert got == want
    for entry in golden["sample_keys"]:
        k = (entry["seed"] & MASK, entry["seed"] >> 32)
        for d in (int.from_bytes(b"augment", "big"), entry["epoch"], entry["index"]):
            k = _fold_int(k, d)
        assert list(k) == entry["key"]


if __name__ == "__main__":
    if GOLDEN.exists():
        raise SystemExit(f"{GOLDEN} exists; golden vectors are generated once and never regenerated")
    GOLDEN.write_text(json.dumps(_generate(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
