"""Keyed samples: keys, derived keys, and a region of a draw equal to the slice of the full draw.

Run from the repository root:  python examples/keyed_samples.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import keyinit  # noqa: E402
from keyinit import random as kr  # noqa: E402


def main() -> None:
    root = keyinit.key(0)
    print("key(0)                      ", root)
    print("bits(key(0), (4,))          ", [f"{w:08x}" for w in kr.bits(root, (4,)).tolist()],
          " <- Random123 Philox4x32-10 known-answer vector")
    print("split(key(0), 2)            ", keyinit.split(root, 2))
    print("fold_in(key(0), 1)          ", keyinit.fold_in(root, 1))
    print("fold_in(key(0), '1')        ", keyinit.fold_in(root, "1"), " <- ints and strings are separate domains")

    fqn = "layers.0.attention.wq.weight"
    k = keyinit.key_for(0, fqn)
    print(f"key_for(0, {fqn!r})", k)

    shape = (6, 8)  # the GLOBAL shape of the parameter
    full = kr.normal(k, shape, std=0.02)
    region = (slice(1, 6, 2), [7, 0, 3])  # rows 1, 3, 5; columns 7, 0, 3 (numpy.ix_ semantics)
    part = kr.normal(k, shape, std=0.02, region=region)
    expected = full[torch.tensor([1, 3, 5])[:, None], torch.tensor([7, 0, 3])]
    print(f"\nnormal(std=0.02) of global shape {shape}, region rows 1:6:2 x columns [7, 0, 3]:")
    print(part)
    same = torch.equal(part.view(torch.int32), expected.view(torch.int32))
    print("region == slice of the full draw, bit for bit:", same)

    # a shard of a huge tensor, without ever materializing it: 2**34 elements
    huge = (2**20, 2**14)
    shard = kr.normal(k, huge, std=0.02, region=(slice(2**19, 2**19 + 2), slice(0, 4)))
    print(f"\nrows 2**19 .. 2**19+1, columns 0..3 of a {huge} tensor (never allocated):")
    print(shard)
    print("bfloat16 draw == float32 draw rounded:",
          torch.equal(kr.normal(k, shape, std=0.02, dtype=torch.bfloat16), full.to(torch.bfloat16)))
    if not same:
        raise SystemExit("region mismatch")


if __name__ == "__main__":
    main()
