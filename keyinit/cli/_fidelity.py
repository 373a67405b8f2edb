"""Fidelity: do a model's keyed values follow its own eager initialization?

``keyinit verify`` replays a model's init keyed (``keyinit.materialize``'s plan). Layout
checks say every rank gets the single-process values; fidelity says those values are
what the model's own code would have given it. The factory is built eagerly on CPU
twice, with torch's global RNG seeded differently each time (inside
``torch.random.fork_rng``, so the caller's RNG state is restored), and each tensor is
compared with its keyed values:

- identical in both eager builds (constants, ``arange``/``triu`` buffers, ``eye``):
  deterministic, so the keyed tensor must be bit-identical to it;
- otherwise random: a two-sample Kolmogorov-Smirnov test and a test of the ratio of the
  standard deviations, both at :data:`ALPHA` (a correct init fails with probability about
  ``ALPHA`` per tensor, so the check does not flake);
- fewer than :data:`MIN_ELEMENTS` random elements: too few to test, only shape, dtype and
  finiteness are checked.

A difference on a tensor whose keyed values come from a rule the user gave (``rules=``,
``@keyinit.register``) or from their ``init_method`` is *explained*: the user asked for
another init there. Every other difference is a finding.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import attrs
import torch

from keyinit.cli._common import CLIError, bitwise_equal, build_model

__all__ = [
    "ALPHA",
    "MIN_ELEMENTS",
    "EAGER_SEEDS",
    "MAX_SAMPLE",
    "ks_statistic",
    "ks_critical",
    "distribution_difference",
    "compare",
    "TensorFidelity",
    "Fidelity",
    "eager_builds",
    "check_fidelity",
]

#: Significance of the per-tensor tests: a tensor that follows its eager init is flagged with
#: probability about ALPHA (a flaky test is a useless one; a real init change moves the
#: statistics far past these bounds on any tensor of a few hundred elements).
ALPHA = 1e-6
#: Random tensors with fewer elements are checked for shape, dtype and finiteness only.
MIN_ELEMENTS = 16
#: Larger random tensors are tested on this many of their elements, chosen uniformly without
#: replacement (a private generator, never the global RNG): KS then still sees differences of
#: about 0.7% in a CDF, and a tensor of a billion elements is not sorted.
MAX_SAMPLE = 1 << 18
#: The two ``torch.manual_seed`` values of the eager builds.
EAGER_SEEDS = (1, 2)
_Z = statistics.NormalDist().inv_cdf(1 - ALPHA / 2)  # two-sided normal quantile of ALPHA (4.89)


def _sample(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t``, flat, in a dtype that holds them exactly (float32 for 16/32-bit floats)."""
    t = t.detach().to("cpu")
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    return t.reshape(-1).to(torch.int64 if t.dtype != torch.uint64 else torch.float64)


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic ``max |F_a - F_b|`` (ties handled: the ECDFs are
    compared after the last of each run of equal pooled values). One sort of the pooled values."""
    x, y = _sample(a), _sample(b)
    dtype = torch.promote_types(x.dtype, y.dtype)
    pooled, order = torch.cat([x.to(dtype), y.to(dtype)]).sort()
    n, m = x.numel(), y.numel()
    gap = torch.where(order < n, m, -n).cumsum(0)  # n m (F_x - F_y), exact in integers
    last = torch.ones_like(pooled, dtype=torch.bool)
    last[:-1] = pooled[1:] != pooled[:-1]
    return int(gap[last].abs().max()) / (n * m) if gap.numel() else 0.0


def ks_critical(n: int, m: int, alpha: float = ALPHA) -> float:
    """The KS statistic above which samples of sizes ``n`` and ``m`` differ at level ``alpha``:
    ``c(alpha) sqrt((n + m) / (n m))``, ``c = sqrt(-ln(alpha / 2) / 2)`` (conservative with ties)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def _subsample(x: torch.Tensor) -> torch.Tensor:
    if x.numel() <= MAX_SAMPLE:
        return x
    generator = torch.Generator(device="cpu").manual_seed(x.numel())
    return x[torch.randperm(x.numel(), generator=generator)[:MAX_SAMPLE]]


def _log_std_se(x: torch.Tensor) -> float:
    """Standard error of ``log(std)`` of a sample: ``sqrt((kurtosis - 1) / (4 n))``."""
    centered = x - x.mean()
    var = float((centered**2).mean())
    kurtosis = float((centered**4).mean()) / var**2 if var > 0 else 1.0
    return math.sqrt(max(kurtosis - 1.0, 0.0) / (4 * x.numel()))


def distribution_difference(keyed: torch.Tensor, eager: torch.Tensor, alpha: float = ALPHA) -> Optional[str]:
    """Why ``keyed`` is not a sample of ``eager``'s distribution (``None``: it may well be).

    Fails on a KS statistic above :func:`ks_critical`, on a ratio of standard deviations
    outside ``exp(+-z sqrt(se_keyed^2 + se_eager^2))`` (``z`` the two-sided normal quantile
    of ``alpha``, ``se`` of ``log std`` from each sample's kurtosis), or on non-finite values
    eager does not have."""
    x, y = _subsample(_sample(keyed)), _subsample(_sample(eager))
    if bool((~torch.isfinite(x)).any()) and not bool((~torch.isfinite(y)).any()):
        return f"{int((~torch.isfinite(x)).sum())} non-finite values (eager has none)"
    x, y = x[torch.isfinite(x)], y[torch.isfinite(y)]
    if not x.numel() or not y.numel():
        return None
    d, critical = ks_statistic(x, y), ks_critical(x.numel(), y.numel(), alpha)
    x, y = x.double(), y.double()
    sx, sy = float(x.std(correction=0)), float(y.std(correction=0))
    stats = f"mean {float(x.mean()):.3g} vs {float(y.mean()):.3g}, std {sx:.3g} vs {sy:.3g}"
    if d > critical:
        return f"KS {d:.3f} > {critical:.3f}; {stats}"
    if (sx == 0) != (sy == 0):
        return f"one is constant; {stats}"
    if sx > 0:
        z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
        bound = z * math.hypot(_log_std_se(x), _log_std_se(y))
        if abs(math.log(sx / sy)) > bound:
            return f"std ratio {sx / sy:.3f} outside exp(+-{bound:.3f}); {stats}"
    return None


def _exact_difference(keyed: torch.Tensor, eager: torch.Tensor) -> str:
    k, e = keyed.detach().to("cpu"), eager.detach().to("cpu")
    if k.is_floating_point() or k.is_complex():
        same = (k == e) | (k.isnan() & e.isnan())
    else:
        same = k == e
    count = int((~same).sum())
    text = f"{count} of {k.numel()} elements differ from eager's (identical in both eager builds)"
    if k.is_floating_point() and count:
        diff = (k.double() - e.double()).abs()[~same]
        text += f", max |diff| {float(diff[torch.isfinite(diff)].max()) if torch.isfinite(diff).any() else float('nan'):.3g}"
    return text


def compare(keyed: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> tuple[str, Optional[str]]:
    """``(check, difference)`` of ``keyed`` against two eager builds of the same tensor.

    ``check`` is ``"exact"`` (both eager builds agree bit for bit), ``"distribution"``,
    ``"finite"`` (random and smaller than :data:`MIN_ELEMENTS`) or ``"shape/dtype"``;
    ``difference`` is ``None`` when ``keyed`` passes."""
    if tuple(keyed.shape) != tuple(first.shape) or keyed.dtype != first.dtype:
        return "shape/dtype", (f"keyed {tuple(keyed.shape)} {keyed.dtype}, eager {tuple(first.shape)} "
                               f"{first.dtype}")
    if bitwise_equal(first, second):
        return "exact", None if bitwise_equal(keyed, first) else _exact_difference(keyed, first)
    if keyed.numel() < MIN_ELEMENTS:
        x, y = _sample(keyed), _sample(first)
        bad = int((~torch.isfinite(x)).sum()) if not bool((~torch.isfinite(y)).any()) else 0
        return "finite", f"{bad} non-finite values (eager has none)" if bad else None
    return "distribution", distribution_difference(keyed, first)


@attrs.frozen
class TensorFidelity:
    """One tensor's verdict. ``status``: ``ok``, ``explained``, ``DIFFERS`` or ``not compared``."""

    fqn: str
    shape: tuple[int, ...]
    check: str
    difference: Optional[str] = None
    explained_by: Optional[str] = None
    why_not_compared: Optional[str] = None

    @property
    def status(self) -> str:
        if self.why_not_compared is not None:
            return "not compared"
        if self.difference is None:
            return "ok"
        return "explained" if self.explained_by else "DIFFERS"


@attrs.frozen
class Fidelity:
    """Every tensor's :class:`TensorFidelity`, or ``skipped`` (why nothing was compared)."""

    tensors: tuple[TensorFidelity, ...] = ()
    skipped: Optional[str] = None
    seconds: float = 0.0

    def with_status(self, status: str) -> list[TensorFidelity]:
        return [t for t in self.tensors if t.status == status]

    @property
    def ok(self) -> bool:
        """No unexplained difference (a skipped check has none to report, and claims nothing)."""
        return not self.with_status("DIFFERS")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            key = t.check if t.status in ("ok", "explained", "DIFFERS") else "not compared"
            out[key] = out.get(key, 0) + 1
        return out


def eager_builds(factory: Callable[[], Any], spec: str,
                 seeds: Sequence[int] = EAGER_SEEDS) -> list[torch.nn.Module]:
    """The factory's model built eagerly on CPU once per seed, each after ``torch.manual_seed(seed)``.

    Runs inside ``torch.random.fork_rng``: the global RNG state is what it was before."""
    models = []
    for seed in seeds:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, _ = build_model(factory, spec, build="eager")
        models.append(model)
    return models


def _available_memory() -> Optional[int]:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _explanation(entry: Any, init_label: Optional[str]) -> Optional[str]:
    """The user's rule or init method that wrote ``entry``'s tensor last, if any (a :class:`keyinit.PlanEntry`)."""
    if entry.origin in ("rule", "pattern") and entry.rule is not None:
        label = entry.rule
        if label.startswith("pattern "):
            return f"rule {label[len('pattern '):]!r}"
        return label if label.startswith("rule ") else f"rule {label}"
    if init_label and init_label in entry.writers:
        return f"init_method {init_label}"
    return None


def _init_label(init_method: Any) -> Optional[str]:
    if init_method is None:
        return None
    return init_method if isinstance(init_method, str) else getattr(init_method, "__name__", "init_method")


def _uninitialized(entry: Any) -> bool:
    """Built by ``keyinit.deferred`` but its constructor left it uninitialized (``torch.empty``)."""
    return entry.built_deferred and not entry.constructed


def check_fidelity(plan: Any, keyed: Mapping[str, torch.Tensor], factory: Callable[[], Any], spec: str, *,
                   kwargs: Mapping[str, Any]) -> Fidelity:
    """Compare every tensor of ``plan`` (its single-process keyed values in ``keyed``, by FQN)
    with the factory's eager builds (see the module docstring)."""
    from keyinit.fqn import apply_fqn_mapping

    start = time.perf_counter()
    entries = [e for e in plan.entries if e.fqn in keyed]  # kept tensors (of no elements) have no values
    needed = 2 * sum(math.prod(e.global_shape) * e.dtype.itemsize for e in entries)
    available = _available_memory()
    if available is not None and needed > 0.8 * available:
        return Fidelity(skipped=f"the two eager builds need {needed / 2**30:.1f} GiB of CPU memory and "
                                f"{available / 2**30:.1f} GiB is available", seconds=time.perf_counter() - start)
    try:
        first, second = eager_builds(factory, spec)
    except CLIError as exc:
        return Fidelity(skipped=f"the eager build failed: {exc}", seconds=time.perf_counter() - start)
    prefix, fqn_map = kwargs.get("fqn_prefix"), kwargs.get("fqn_map")

    def tensors_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from keyinit.walk import tensors

        return {apply_fqn_mapping(t.fqn, prefix, fqn_map): t.tensor for t in tensors(model)}

    eager_a, eager_b = tensors_of(first), tensors_of(second)
    on_meta = [fqn for fqn, t in eager_a.items() if t.device.type == "meta"]
    if eager_a and len(on_meta) == len(eager_a):
        return Fidelity(skipped="the factory's eager build is on the meta device (it builds on meta itself), so it "
                                "has no init to compare with; let the factory build on the default device",
                        seconds=time.perf_counter() - start)
    init_label = _init_label(kwargs.get("init_method"))
    verdicts = []
    for tensor in entries:
        shape = tuple(tensor.global_shape)
        name = next((n for n in tensor.names if n in eager_a), None)
        explained = _explanation(tensor, init_label)
        why_not = None
        if name is None:
            why_not = "not in the eager model (created by init code)"
        elif eager_a[name].device.type == "meta":
            why_not = "on the meta device in the eager build"
        elif _uninitialized(tensor):
            why_not = f"its constructor leaves it uninitialized (torch.empty); keyinit gives it {tensor.source}"
        if why_not is not None:
            verdicts.append(TensorFidelity(tensor.fqn, shape, "-", explained_by=explained, why_not_compared=why_not))
            continue
        check, difference = compare(keyed[tensor.fqn], eager_a[name], eager_b[name])
        verdicts.append(TensorFidelity(tensor.fqn, shape, check, difference, explained))
    return Fidelity(tuple(verdicts), seconds=time.perf_counter() - start)
