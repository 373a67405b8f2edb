"""Property (issue 23): random constructors built with ``keyinit.deferred`` -- draws, writes through row and
column views, temporaries, keyinit's own samplers, caches stored outside the parameters (a plain attribute,
an ``lru_cache`` helper), boolean indexing of a draw, a second parameter copied from the first, ties, worker
threads doing deterministic work -- materialize to the distributions the eager constructor draws from:

- every element equal in all eager builds (zeros, caches, keyinit's samplers) is that value under every seed;
- every other element has, over 32 seeds, the mean and spread of the eager builds over 256 torch seeds;
- where the eager builds always hold ``u == w + 1``, the keyed model does too, and u and w are correlated
  as in the eager builds;

the same values under hand-cut shards of rows or columns, or a clear error naming the constructor (a draw
in a worker thread, numpy's global generator, a draw kept in a plain attribute). No global RNG is touched.
"""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import keyinit
from keyinit.layouts import ManualShard

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STEPS = ("normal", "uniform", "rows", "cols", "temp", "keyinit", "cache", "lru", "scale", "index", "copy", "thread")
REFUSED = ("thread_draw", "numpy", "stash")  # a clear UnkeyedRandomnessError, nothing touched
SEEDS = 32  # keyinit seeds materialized per example
EAGER_SEEDS = 256  # eager builds per example (cheap): their spread is the reference


@functools.lru_cache
def _table(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 8


class Built(nn.Module):
    def __init__(self, rows: int, cols: int, steps: tuple, tied: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(rows, cols))
        if tied:
            self.v = self.w
        w = self.w
        with torch.no_grad():
            for kind, a, b in steps:
                if kind == "normal":
                    nn.init.normal_(w, std=0.5)
                elif kind == "uniform":
                    w.uniform_(-1.0, 1.0)
                elif kind == "rows":
                    lo, hi = sorted((a % (rows + 1), b % (rows + 1)))
                    w[lo:hi].normal_()
                elif kind == "cols":
                    lo, hi = sorted((a % (cols + 1), b % (cols + 1)))
                    w[:, lo:hi].uniform_(2.0, 3.0)
                elif kind == "temp":
                    w.copy_(torch.randn(cols, rows).t() * 0.25 + torch.arange(cols))
                elif kind == "keyinit":
                    w.copy_(keyinit.random.normal(keyinit.key(a), (rows, cols)))
                elif kind == "cache":
                    self.cache = torch.ones(rows, cols) * a  # a deterministic tensor kept outside the parameters
                    w.add_(self.cache)
                elif kind == "lru":
                    w.add_(_table(rows, cols))
                elif kind == "scale":
                    w.mul_(1.5)
                elif kind == "index":
                    every = torch.arange(rows) % (a % 3 + 1) == 0  # a known mask over rows of a draw
                    w[every] = w[every] * -2.0
                elif kind == "copy":
                    self.u = nn.Parameter(w.detach().clone() + 1.0)  # later steps change w, not u
                elif kind == "thread":
                    with ThreadPoolExecutor(1) as pool:
                        w.add_(pool.submit(torch.ones, rows, cols).result())  # deterministic work may use threads
                elif kind == "thread_draw":
                    with ThreadPoolExecutor(1) as pool:
                        w.add_(pool.submit(torch.rand, rows, cols).result())
                elif kind == "numpy":
                    w.add_(float(np.random.rand()))
                elif kind == "stash":
                    self.noise = torch.randn(rows)


steps_strategy = st.lists(st.tuples(st.sampled_from(STEPS + REFUSED), st.integers(0, 7), st.integers(0, 7)),
                          min_size=1, max_size=4).map(lambda steps: (("normal", 0, 0), *steps))


def _states() -> tuple:
    return torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _eager(rows: int, cols: int, steps: tuple, tied: bool) -> dict[str, torch.Tensor]:
    """Each parameter over EAGER_SEEDS eager builds (torch seeds 0, 1, ...), stacked on dim 0."""
    builds = []
    with torch.random.fork_rng(devices=[]):
        for seed in range(EAGER_SEEDS):
            torch.manual_seed(seed)
            builds.append({k: v.detach().clone() for k, v in Built(rows, cols, steps, tied).named_parameters()})
    return {name: torch.stack([b[name] for b in builds]) for name in builds[0]}


def _keyed(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter as materialize writes it, over keyinit seeds 0..SEEDS-1 (stacked on dim 0)."""
    names = [name for name, _ in model.named_parameters()]
    plans = [keyinit.plan_init(model, seed, materializing=True) for seed in range(SEEDS)]
    return {name: torch.stack([plan.values(name) for plan in plans]) for name in names}


def _follows(keyed: torch.Tensor, eager: torch.Tensor) -> None:
    """Elements fixed in every eager build are that value under every seed; the others have the eager
    builds' mean and spread: each element's mean within 5 standard errors and spread within a factor 1.8,
    and all of them together (the mean of the standardized differences, the mean variance ratio) within
    5 standard errors."""
    fixed = (eager == eager[:1]).all(0)
    assert torch.equal(keyed[:, fixed], eager[:1, fixed].expand(len(keyed), -1)), \
        "a value the eager constructor always gives differs"
    if bool(fixed.all()):
        return
    k, e = keyed[:, ~fixed].double(), eager[:, ~fixed].double()
    ks, es = k.std(0), e.std(0)
    assert bool((ks > 0).all()), "an element eager torch draws is the same under every seed"
    ratio = ks / es
    assert bool(((ratio > 0.55) & (ratio < 1.8)).all()), f"spread keyed/eager: {ratio.tolist()}"
    pooled = float((ratio ** 2).mean())
    assert abs(pooled - 1) <= 5 * (2 / (len(k) - 1)) ** 0.5 / ratio.numel() ** 0.5, f"variance ratio {pooled}"
    z = (k.mean(0) - e.mean(0)) / (ks ** 2 / len(k) + es ** 2 / len(e)).sqrt()
    assert bool((z.abs() <= 5).all()), f"mean differs from eager torch's by {z.tolist()} standard errors"
    assert abs(float(z.mean())) <= 5 / z.numel() ** 0.5, f"means differ from eager torch's overall: {z.tolist()}"


def _correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, over dim 0 (seeds): Fisher's z of the correlation of ``a`` and ``b``."""
    a, b = a.double() - a.double().mean(0), b.double() - b.double().mean(0)
    r = (a * b).sum(0) / ((a * a).sum(0) * (b * b).sum(0)).sqrt()
    return r.clamp(-0.999, 0.999).atanh()


def _joint(keyed: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> None:
    """Where eager torch's u and w both vary, their correlation (per element, over seeds) is eager torch's:
    a copy taken before later draws is keyed with the values it copied, not fresh ones."""
    varies = ~(eager["u"] == eager["u"][:1]).all(0) & ~(eager["w"] == eager["w"][:1]).all(0)
    if not bool(varies.any()):
        return
    zk = _correlation(keyed["u"][:, varies], keyed["w"][:, varies])
    ze = _correlation(eager["u"][:, varies], eager["w"][:, varies])
    tolerance = 5 * ((len(keyed["u"]) - 3) ** -0.5 + (len(eager["u"]) - 3) ** -0.5)
    assert bool(((zk - ze).abs() <= tolerance).all()), f"u-w correlation keyed {zk.tolist()} eager {ze.tolist()}"


def _every_step_last() -> list:
    """One example per step, as the last that changes a 4x3 weight (hypothesis alone repeats a few steps)."""
    return [example(rows=4, cols=3, steps=(("normal", 0, 0), ("rows", 1, 3), (kind, 1, 3)), tied=kind == "copy",
                    cut=(1, 3, 1, 2)) for kind in STEPS + REFUSED]


def _examples(test):
    for case in _every_step_last():
        test = case(test)
    return test


@SETTINGS
@given(rows=st.integers(1, 6), cols=st.integers(1, 4), steps=steps_strategy, tied=st.booleans(),
       cut=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 4), st.integers(0, 4)))
@_examples
def test_deferred_constructors_give_the_eager_distributions_the_same_values_per_shard_or_a_clear_error(
        rows, cols, steps, tied, cut):
    before = _states()
    try:
        full = keyinit.deferred(Built, rows, cols, steps, tied)
        keyinit.materialize(full, 5, device="cpu")
    except keyinit.UnkeyedRandomnessError as exc:
        assert any(kind in REFUSED for kind, _, _ in steps), exc
        assert "Built(...)" in str(exc)
        return
    finally:
        assert _same_states(before, _states()), "a global RNG was touched"
    assert not any(kind in REFUSED for kind, _, _ in steps)
    assert bool(full.w.isfinite().all())
    if tied:
        assert full.v is full.w
    eager = _eager(rows, cols, steps, tied)
    keyed = _keyed(keyinit.deferred(Built, rows, cols, steps, tied))
    assert keyed.keys() == eager.keys()
    for name in eager:
        _follows(keyed[name], eager[name])
    if "u" in eager:  # the copy: where eager torch always has u == w + 1, so does the keyed model
        same = (eager["u"] == eager["w"] + 1.0).all(0)
        assert bool((keyed["u"] == keyed["w"] + 1.0)[:, same].all())
        _joint(keyed, eager)
    assert torch.equal(keyed["w"][5], full.w.detach())  # plan.values is what materialize writes
    # hand-cut shards: rows, then columns
    lo, hi = sorted((min(cut[0], rows), min(cut[1], rows)))
    c0, c1 = sorted((min(cut[2], cols), min(cut[3], cols)))
    cuts = (((slice(lo, hi), slice(None)), (hi - lo, cols)), ((slice(None), slice(c0, c1)), (rows, c1 - c0)))
    for region, shape in cuts:
        shard = keyinit.deferred(Built, rows, cols, steps, tied)
        shard.w = nn.Parameter(torch.empty(shape, device="meta"))
        keyinit.materialize(shard, 5, device="cpu", shards={"w": ManualShard((rows, cols), region)})
        assert torch.equal(shard.w.detach(), full.w.detach()[region])
