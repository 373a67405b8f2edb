"""keyinit._draw.dispatch: the one seam between keyinit and its kernels, for every kernel family."""

from __future__ import annotations

import torch

import keyinit
from keyinit._draw import dispatch
from keyinit import random as kr
from keyinit.nn import functional as KF


def _spy(monkeypatch):
    calls = []
    original = dispatch.Kernels.run

    def run(self, device, *args, **kwargs):
        family = {id(dispatch.kernels("v1", name)): name for name in dispatch.FAMILIES}.get(id(self), "other")
        calls.append((family, device))
        return original(self, device, *args, **kwargs)

    monkeypatch.setattr(dispatch.Kernels, "run", run)
    return calls


def test_every_kernel_family_goes_through_the_dispatcher(monkeypatch):
    calls = _spy(monkeypatch)
    k = keyinit.key(5)
    kr.normal(k, (64,))
    KF.dropout(torch.ones(8, 8), 0.5, rng_key=k)
    KF.dropout(torch.ones(8, 8, requires_grad=True), 0.5, rng_key=k).sum().backward()
    keyinit.data.permutation(k, 1000, range(10))
    assert calls == [("fill", "cpu"), ("dropout", "cpu"), ("dropout", "cpu"), ("dropout", "cpu"),
                     ("permutation", "cpu")]


def test_kernels_disabled_give_the_same_bits_for_every_family(monkeypatch):
    k = keyinit.key(17)
    x = torch.randn(16, 33, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(0, 120).reshape(12, 10) * 547  # 2-D positions, n just above 2**16: cycle walking
    fast = (kr.normal(k, (1000,)), KF.dropout(x, 0.3, rng_key=k), keyinit.data.permutation(k, 2**16 + 1, positions),
            keyinit.data.inverse_permutation(k, 2**16 + 1, positions))
    monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")
    slow = (kr.normal(k, (1000,)), KF.dropout(x, 0.3, rng_key=k), keyinit.data.permutation(k, 2**16 + 1, positions),
            keyinit.data.inverse_permutation(k, 2**16 + 1, positions))
    for a, b in zip(fast, slow):
        assert a.shape == b.shape and torch.equal(a, b)


def test_kernel_refs_import_nothing_until_called():
    ref = dispatch.KernelRef("keyinit._no_such_module", "fill")
    assert ref.resolve() is None
    assert dispatch.kernels("v1", "fill").devices["cpu"].resolve() is keyinit._kernels.fill.cpu.fill
