"""keyinit.data.permutation: a bijection for every n, random access, reference == C kernel,
and statistics as good as torch.randperm's (chi-square over many keys)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyinit
from keyinit._kernels.permutation import cpu as _permutation_cpu
from keyinit._draw import reference_permutation
from keyinit.data import inverse_permutation, permutation


def _chi2(counts: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of counts against the uniform expectation, and its degrees of freedom."""
    counts = counts.double().reshape(-1)
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum()), counts.numel() - 1


def _assert_uniform(counts: torch.Tensor, what: str) -> None:
    stat, dof = _chi2(counts)
    # about 6 standard deviations of the chi-square distribution: fails by chance ~1e-8
    assert stat < dof + 6 * math.sqrt(2 * dof), f"{what}: chi-square {stat:.1f} with {dof} dof"


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_exhaustive_bijection_small_n(seed):
    k = keyinit.key(seed)
    for n in list(range(1, 70)) + [127, 128, 129, 255, 256, 257, 1023, 1025]:
        p = permutation(k, n)
        assert p.dtype == torch.int64 and p.shape == (n,)
        assert torch.equal(torch.sort(p).values, torch.arange(n)), n
        assert torch.equal(inverse_permutation(k, n, p), torch.arange(n)), n


def test_bijection_odd_and_even_bit_counts_with_cycle_walking():
    k = keyinit.key(7)
    for n in (2**16 + 1, 3 * 2**15, 2**17 - 1, 2**17):
        p = permutation(k, n)
        assert torch.equal(torch.bincount(p, minlength=n), torch.ones(n, dtype=torch.int64)), n


def test_reference_equals_kernel_and_random_access():
    k = keyinit.key(42)
    for n in (101, 1000, 12345, 10**9, 2**40 + 3, 2**61 + 1, 2**62):
        m = min(n, 600)
        pos = torch.arange(m) * (n // m) + (n % m) // 2
        want = reference_permutation.permute_reference(k, n, pos)
        assert torch.equal(permutation(k, n, pos), want), n
        assert torch.equal(permutation(k, n, range(int(pos[0]), n, n // m)[:m]), want), n
        assert torch.equal(inverse_permutation(k, n, want), pos), n
        # any subset, any order, any shape: the same values
        shuffled = pos.flip(0)[:100].reshape(10, 10)
        assert torch.equal(permutation(k, n, shuffled), want.flip(0)[:100].reshape(10, 10))
    whole = permutation(k, 5000)
    assert torch.equal(permutation(k, 5000, slice(4000, 100, -7)), whole[torch.arange(4000, 100, -7)])
    assert torch.equal(permutation(k, 5000, slice(10, None, 3)), whole[10::3])
    assert torch.equal(permutation(k, 5000, range(0, 0)), whole[:0])


def test_kernel_variants_and_threads_agree():
    k = keyinit.key(3)
    n = 10**9 + 7
    kp = reference_permutation.permutation_key(k, n).words
    want = permutation(k, n, range(0, 20000))
    lib = _permutation_cpu.build_library(native=False)
    for threads in (1, 3):
        out = torch.empty(20000, dtype=torch.int64)
        assert _permutation_cpu.run(kp, n, False, out, start=0, step=1, threads=threads, lib=lib)
        assert torch.equal(out, want)


def test_disabled_kernels_give_the_same_values(monkeypatch):
    k = keyinit.key(9)
    want = permutation(k, 99991, range(0, 3000))
    monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")
    assert torch.equal(permutation(k, 99991, range(0, 3000)), want)


def test_huge_n_first_batch_is_cheap():
    k = keyinit.key(0)
    n = 10**12
    batch = permutation(k, n, range(0, 4096))
    assert batch.shape == (4096,) and int(batch.min()) >= 0 and int(batch.max()) < n
    assert len(set(batch.tolist())) == 4096
    assert torch.equal(inverse_permutation(k, n, batch), torch.arange(4096))


def test_keys_and_n_select_unrelated_permutations():
    a = permutation(keyinit.key(0), 1000)
    assert not torch.equal(a, permutation(keyinit.key(1), 1000))
    assert not torch.equal(a, permutation(keyinit.fold_in(keyinit.key(0), 0), 1000))
    assert not torch.equal(a[:999].sort().values, torch.arange(999))  # n = 999 is a different permutation
    assert not torch.equal(permutation(keyinit.key(0), 999), a[a < 999])


def test_errors():
    k = keyinit.key(0)
    with pytest.raises(TypeError, match="keyinit.Key"):
        permutation(0, 10)
    with pytest.raises(ValueError, match=r"n must be an int in \[0, 2\*\*62\], got -1"):
        permutation(k, -1)
    with pytest.raises(ValueError, match=r"n must be an int in \[0, 2\*\*62\]"):
        permutation(k, 2**62 + 1)
    with pytest.raises(TypeError, match="n must be an int"):
        permutation(k, 10.0)
    with pytest.raises(TypeError, match="got bool"):
        permutation(k, True)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 0\)"):
        permutation(k, 0, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\), got values in \[-1, 3\]"):
        permutation(k, 10, torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=r"values must lie in \[0, 10\)"):
        inverse_permutation(k, 10, torch.tensor([10]))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\)"):
        permutation(k, 10, range(5, 11))
    for floats in (torch.tensor([0.5]), [1.5], [1, 2.0], torch.tensor([True])):  # never truncated to an int
        with pytest.raises(TypeError, match="must hold integers"):
            permutation(k, 10, floats)


def test_empty_and_scalar_positions():
    k = keyinit.key(0)
    for empty in (permutation(k, 0), inverse_permutation(k, 0), permutation(k, 0, slice(0, 5)),
                  permutation(k, 10, []), permutation(k, 10, range(3, 3))):
        assert empty.dtype == torch.int64 and empty.shape == (0,)
    assert permutation(k, 10, 4).shape == () and int(permutation(k, 10, torch.tensor(4))) == int(permutation(k, 10)[4])
    assert torch.equal(permutation(k, 10, [4, 2]), permutation(k, 10)[[4, 2]])


def _many(n: int, keys: int) -> torch.Tensor:
    root = keyinit.key(12345)
    return torch.stack([permutation(keyinit.fold_in(root, s), n) for s in range(keys)])


@pytest.mark.parametrize("n", [5, 8, 11])
def test_position_and_adjacent_pair_chi_square(n):
    perms = _many(n, 3000)
    counts = torch.zeros(n, n, dtype=torch.int64)
    counts.index_put_((torch.arange(n).repeat(perms.shape[0]), perms.reshape(-1)),
                      torch.ones(perms.numel(), dtype=torch.int64), accumulate=True)
    _assert_uniform(counts, f"P(perm[i] = j), n={n}")
    for i in (0, n // 2, n - 2):
        pair = perms[:, i] * n + perms[:, i + 1]
        pairs = torch.bincount(pair, minlength=n * n).reshape(n, n)
        off_diagonal = pairs[~torch.eye(n, dtype=torch.bool)]
        assert int(pairs.diagonal().sum()) == 0
        _assert_uniform(off_diagonal, f"(perm[{i}], perm[{i + 1}]), n={n}")


def test_whole_permutations_of_small_n_are_uniform():
    """n = 4: all 24 permutations equally likely (as randperm)."""
    perms = _many(4, 4800)
    code = ((perms[:, 0] * 4 + perms[:, 1]) * 4 + perms[:, 2]) * 4 + perms[:, 3]
    counts = torch.bincount(code, minlength=256)
    seen = counts[counts > 0]
    assert seen.numel() == 24
    _assert_uniform(seen, "permutations of 4")


@pytest.mark.parametrize("n", [2**16 + 1, 10**6])
def test_first_order_displacement(n):
    """Within one permutation: the steps (perm[i+1] - perm[i]) mod n and the displacements
    (perm[i] - i) mod n are spread uniformly, as for randperm."""
    p = permutation(keyinit.key(5), n)
    bins = 64
    step = (p[1:] - p[:-1]) % n
    _assert_uniform(torch.bincount(step * bins // n, minlength=bins), f"steps, n={n}")
    shift = (p - torch.arange(n)) % n
    _assert_uniform(torch.bincount(shift * bins // n, minlength=bins), f"displacements, n={n}")
    # and the fixed points: about 1 per permutation (Poisson(1)) in expectation; here a loose bound
    assert int((p == torch.arange(n)).sum()) < 12


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(0, 3000), st.integers(0, 2**62),
                   st.integers(1, 61).flatmap(lambda b: st.sampled_from([2**b - 1, 2**b, 2**b + 1]))),
       seed=st.integers(0, 2**64 - 1), data=st.data())
def test_any_n_random_positions_kernel_equals_reference_and_inverts(n, seed, data):
    positions = data.draw(st.lists(st.integers(0, n - 1), max_size=40)) if n else []
    k = keyinit.key(seed)
    pos = torch.tensor(positions, dtype=torch.int64)
    got = permutation(k, n, pos)
    assert got.shape == pos.shape and bool(((got >= 0) & (got < max(n, 1))).all())
    if n:
        assert torch.equal(got, reference_permutation.permute_reference(k, n, pos))
    assert torch.equal(inverse_permutation(k, n, got), pos)
    # distinct positions, distinct values (a bijection restricted to them)
    assert len(set(got.tolist())) == len(set(positions))
