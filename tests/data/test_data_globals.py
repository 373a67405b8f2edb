"""random's and numpy.random's global states in keyed calls (keyinit._host.states): read and written as
bytes, seeded without random.seed/numpy.random.seed, yet exactly the states those make, and put back
exactly (cached Gaussians and numpy's seed_seq included); the public-API fallback gives the same values."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from keyinit._host import states as _globals
from keyinit.data import KeyedBatch, _fill, keyed_collate, keyed_samples
from keyinit.errors import UnkeyedRandomnessError


class _Draws(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return (random.random(), random.gauss(0.0, 1.0), random.getrandbits(70), float(np.random.rand()),
                float(np.random.randn()), float(np.random.randn()), torch.rand(2))


def _values(n=3, epoch=0):
    data = keyed_samples(_Draws(), 5)
    return [data[(i, epoch)] for i in range(n)]


def _same(a, b):
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert (torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v), (u, v)


def test_the_states_are_read_as_bytes_here():
    states = _globals.global_states()
    assert states.python is not None and states.numpy is not None and states.numpy.offsets is not None
    assert states.save()[0] == "bytes"


def test_seeding_makes_the_states_of_random_seed_and_numpy_seed():
    """What keyed_samples seeds (spec 16.3) is random.seed(k0 | k1 << 32) and numpy.random.seed([k0, k1])."""
    lib = _fill.kernel_library()
    states = _globals.global_states()
    for words in ((0, 0), (7, 0), (0xFFFFFFFF, 1), (0x243F6A88, 0x85A308D3)):
        saved = states.save()
        try:
            states.seed(lib, words, words, saved)
            got_py, got_np = random.getstate(), np.random.get_state(legacy=False)
            random.seed(words[0] | (words[1] << 32))
            np.random.seed(list(words))
            assert random.getstate() == got_py
            want_np = np.random.get_state(legacy=False)
            assert got_np["state"]["pos"] == want_np["state"]["pos"] == 624
            assert np.array_equal(got_np["state"]["key"], want_np["state"]["key"])
            assert (got_np["has_gauss"], got_np["gauss"]) == (0, 0.0)
        finally:
            states.restore(saved)


def test_states_are_put_back_exactly_and_numpy_keeps_its_seed_seq():
    random.seed(3)
    random.gauss(0.0, 1.0)  # a cached gauss_next
    np.random.seed(4)
    np.random.randn()  # a cached Gaussian
    bitgen = np.random.get_state.__self__._bit_generator
    seed_seq = bitgen.seed_seq
    py, npy = random.getstate(), np.random.get_state(legacy=False)
    assert py[2] is not None and npy["has_gauss"] == 1
    _values()
    after = np.random.get_state(legacy=False)
    assert random.getstate() == py
    assert (after["has_gauss"], after["gauss"], after["state"]["pos"]) == (1, npy["gauss"], npy["state"]["pos"])
    assert np.array_equal(after["state"]["key"], npy["state"]["key"])
    assert bitgen.seed_seq is seed_seq  # numpy.random.seed would have set it to None


def test_a_failure_after_seeding_restores_the_states(monkeypatch):
    states = _globals.global_states()
    random.gauss(0.0, 1.0)
    py, npy = random.getstate(), np.random.get_state(legacy=False)
    seed = _globals.GlobalStates.seed

    def seed_then_fail(self, *args):
        seed(self, *args)
        raise RuntimeError("boom")

    monkeypatch.setattr(_globals.GlobalStates, "seed", seed_then_fail)
    with pytest.raises(RuntimeError, match="boom"):
        _values(1)
    after = np.random.get_state(legacy=False)
    assert random.getstate() == py and np.array_equal(after["state"]["key"], npy["state"]["key"])
    assert states.save()[0] == "bytes"


@pytest.mark.parametrize("fallback", ["no kernel library", "no byte offsets"])
def test_the_public_api_fallback_gives_the_same_values(monkeypatch, fallback):
    fast = _values()
    py, npy = random.getstate(), np.random.get_state(legacy=False)
    with monkeypatch.context() as m:
        if fallback == "no kernel library":
            m.setenv("KEYINIT_DISABLE_KERNELS", "1")
        else:
            m.setattr(_globals.global_states(), "python", None)
        assert (_fill.kernel_library() is None) == (fallback == "no kernel library")
        slow = _values()
    _same(fast, slow)
    after = np.random.get_state(legacy=False)
    assert random.getstate() == py and np.array_equal(after["state"]["key"], npy["state"]["key"])


@pytest.mark.parametrize("bytes_mode", [True, False])
@pytest.mark.parametrize("draw", [lambda: random.random(), lambda: np.random.rand(), lambda: random.gauss(0, 1)])
def test_collate_draws_from_the_global_states_are_seen_and_undone(monkeypatch, bytes_mode, draw):
    if not bytes_mode:
        monkeypatch.setattr(_globals.global_states(), "python", None)
    random.gauss(0.0, 1.0)
    py, npy = random.getstate(), np.random.get_state(legacy=False)

    def collate(batch):
        draw()
        return batch

    with pytest.raises(UnkeyedRandomnessError, match="drew from .*global state"):
        keyed_collate(collate, 0)(KeyedBatch([1, 2], ((0, 0), (0, 1))))
    after = np.random.get_state(legacy=False)
    assert random.getstate() == py and np.array_equal(after["state"]["key"], npy["state"]["key"])
    assert after["state"]["pos"] == npy["state"]["pos"]
    assert keyed_collate(lambda b: b, 0)(KeyedBatch([1, 2], ((0, 0), (0, 1)))) == [1, 2]  # no draw: no error


def test_a_cached_gaussian_alone_is_a_draw_collate_sees():
    """Taking numpy's or random's cached Gaussian changes no MT word: the flag and gauss_next still say it."""
    np.random.seed(2)
    np.random.randn()
    random.seed(2)
    random.gauss(0.0, 1.0)
    for draw in (np.random.randn, lambda: random.gauss(0.0, 1.0)):
        def collate(batch):
            draw()
            return batch

        with pytest.raises(UnkeyedRandomnessError):
            keyed_collate(collate, 0)(KeyedBatch([1], ((0, 0),)))


def test_the_mt_seed_self_test_fails_a_wrong_seeding():
    from keyinit._kernels.fill import cpu, selftest

    lib = _fill.kernel_library()
    assert selftest.run_mt_seed(lambda key: cpu.mt_seed(key, lib)) == []
    assert selftest.run_mt_seed(lambda key: cpu.mt_seed(key[:1], lib))  # the high word dropped
    assert selftest.run_mt_seed(lambda key: cpu.mt_seed([k ^ 1 for k in key], lib))


def test_the_folded_fill_self_test_fails_a_wrong_fold():
    from keyinit._kernels.fill import cpu, selftest

    lib = _fill.kernel_library()

    def fill(out, dist, k, region):
        return cpu.fill(out, dist, k, region, threads=1, lib=lib)

    good = selftest.run_folded(lib.keyinit_derive, fill,
                               lambda out, dist, k, f0, f1: cpu.fill_folded(out, dist, k, f0, f1, lib=lib))
    swapped = selftest.run_folded(lib.keyinit_derive, fill,
                                  lambda out, dist, k, f0, f1: cpu.fill_folded(out, dist, k, f1, f0, lib=lib))
    assert good == [] and swapped
    assert selftest.run_folded(lambda *words: lib.keyinit_derive(*words) ^ 1, fill,
                               lambda out, dist, k, f0, f1: cpu.fill_folded(out, dist, k, f0, f1, lib=lib))
