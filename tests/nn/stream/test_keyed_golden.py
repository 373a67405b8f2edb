"""Golden vectors of keyed forwards (docs/spec.md sections 14.6 and 14.7), and the same values from the spec.

``tests/nn/stream/golden_keyed_draws_v1.json`` pins what ``keyinit.nn.keyed`` draws for
activations whose batch is not their dimension 0 (a ``(B*H, L, S)`` view, a
sequence-first ``(L*B, d)`` flattening), per-sample draws of other random ops
(``rand`` sized by ``x.shape[0]``, a DropPath ``bernoulli_``, ``normal_`` on
flattened rows), a replicated ``rand([])`` and a repeated forward. It was
generated ONCE by running this file as a script (which refuses to overwrite
it); never regenerate it to make a test pass.

Each case is also recomputed from the spec text with the samplers alone
(``keyinit.random`` over the tensor of samples, ``dropout_key``, ``fold_in``):
the keyed forward must equal both.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

if __name__ == "__main__":  # the generator
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

import keyinit.nn as knn
import keyinit.random as kr
from keyinit.keys import fold_in

GOLDEN = pathlib.Path(__file__).with_name("golden_keyed_draws_v1.json")
SEED, STEP, OFFSET = 11, 4, 3


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _keyed(fn, x, repeat: int = 0):
    model = Fn(fn).train()
    with knn.keyed(model, SEED, step=STEP, sample_offset=OFFSET, stream="v1"):
        for _ in range(repeat):
            model(x)
        return model(x)


def _rows(rank: int) -> tuple:
    return (slice(OFFSET, None),) + (slice(None),) * rank


def _key(ordinal: int = 0, repeat: int = 0):
    k = knn.dropout_key(SEED, step=STEP, fqn="", ordinal=ordinal)
    return fold_in(fold_in(k, "repeat"), repeat) if repeat else k


# each case: (name, keyed run, the spec's values)
B, H, L, S, D = 2, 3, 2, 4, 5


def _heads():  # (B, H, L, S) probabilities viewed as (B*H, L, S)
    x = torch.ones(B, H, L, S)
    got = _keyed(lambda t: F.dropout(t.reshape(B * H, L, S), 0.3), x) != 0
    keep = kr.bernoulli(_key(), (OFFSET + B, H, L, S), p=0.7, region=_rows(3))
    return got.reshape(B, H, L, S), keep


def _sequence_first():  # (L, B, D), declared, flattened to (L*B, D)
    x = knn.batch_dim(torch.ones(L, B, D), 1)
    got = _keyed(lambda t: F.dropout(t.reshape(L * B, D), 0.4), x) != 0
    keep = kr.bernoulli(_key(), (OFFSET + B, L, D), p=0.6, region=_rows(2))  # sample, then (l, d)
    return got.reshape(L, B, D).transpose(0, 1), keep


def _rand_rows():
    got = _keyed(lambda t: torch.rand(t.shape[0], 5), torch.ones(B, 7))
    return got, kr.uniform(fold_in(_key(), 0), (OFFSET + B, 5), region=_rows(1))


def _drop_path():
    got = _keyed(lambda t: t.new_empty((t.shape[0], 1, 1)).bernoulli_(0.7), torch.ones(B, L, D))
    return got, kr.bernoulli(fold_in(_key(), 0), (OFFSET + B, 1, 1), p=0.7, region=_rows(2)).float()


def _normal_flat():
    got = _keyed(lambda t: torch.empty_like(t.reshape(B * L, D)).normal_(), torch.ones(B, L, D))
    return got.reshape(B, L, D), kr.normal(fold_in(_key(), 0), (OFFSET + B, L, D), region=_rows(2))


def _replicated():
    got = _keyed(lambda t: torch.rand([]), torch.ones(B, D))
    return got, kr.uniform(fold_in(_key(), 0), ())


def _repeat():
    got = _keyed(lambda t: F.dropout(t, 0.5), torch.ones(B, D), repeat=1) != 0
    return got, kr.bernoulli(_key(repeat=1), (OFFSET + B, D), p=0.5, region=_rows(1))


CASES = {"heads": _heads, "sequence_first": _sequence_first, "rand_rows": _rand_rows, "drop_path": _drop_path,
         "normal_flat": _normal_flat, "replicated": _replicated, "repeat": _repeat}


def _as_list(t: torch.Tensor) -> list:
    return t.to(torch.float64 if t.is_floating_point() else torch.int64).reshape(-1).tolist()


def test_keyed_draws_equal_the_spec_and_the_golden_vectors():
    golden = json.loads(GOLDEN.read_text())
    assert golden["stream"] == "v1" and set(golden["cases"]) == set(CASES)
    for name, case in CASES.items():
        got, spec = case()
        assert tuple(got.shape) == tuple(spec.shape), name
        assert torch.equal(got.to(spec.dtype), spec), name
        assert _as_list(spec) == golden["cases"][name], name


def test_masks_of_merged_batches_differ_from_the_dim0_rule():
    """What index='dim0' (14.4) would draw for the (B*H, L, S) view: rows of B*H, not samples."""
    x = torch.ones(B, H, L, S)
    model = Fn(lambda t: F.dropout(t.reshape(B * H, L, S), 0.3)).train()
    with knn.keyed(model, SEED, step=STEP, sample_offset=OFFSET, index="dim0", stream="v1"):
        old = model(x) != 0
    keep = kr.bernoulli(_key(), (OFFSET + B * H, L, S), p=0.7, region=_rows(2))
    assert torch.equal(old, keep)
    assert not torch.equal(old.reshape(B, H, L, S), _heads()[1])


if __name__ == "__main__":
    if GOLDEN.exists():
        sys.exit(f"{GOLDEN} exists; golden vectors are never regenerated")
    cases = {name: _as_list(case()[1]) for name, case in CASES.items()}
    GOLDEN.write_text(json.dumps({"stream": "v1", "comment": "docs/spec.md 14.6-14.7; generated once",
                                  "seed": SEED, "step": STEP, "sample_offset": OFFSET, "cases": cases}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
