"""Keyed stochastic rounding on a CUDA device gives the CPU's values bit for bit, through the public API.

What runs on the GPU here: ``keyinit.random.stochastic_round`` for every target (whole tensors, regions,
``out=``), ``stochastic_round_fp4``, ``stochastic_round_words`` (the compile pattern, eager and under
``torch.compile``), ``keyinit.nn.stochastic_round``/``stochastic_round_grad`` inside a keyed forward, and
the fused Adam/AdamW step of ``keyinit.optim.stochastic_rounding(..., fused=True)`` (``docs/spec.md``
17.6: its arithmetic is keyinit's, so parameters and state equal the CPU's after several steps). The
``fused=False`` step is torch's optimizer arithmetic, which differs between devices; its rounding is the
primitive's. None of it reads or advances torch's CPU or CUDA generator.

Skipped without CUDA. ``KEYINIT_TEST_DEVICE=cpu`` runs the same code with the CPU standing in for the GPU
(a dry run: it then compares the CPU with itself).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import keyinit
import keyinit.nn as knn
import keyinit.optim
from keyinit import random as kr

DEVICE = os.environ.get("KEYINIT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device: the GPU paths are not exercised"
)
KEY = keyinit.key(20261128)
TARGETS = (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)


@contextlib.contextmanager
def generators_untouched():
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if DEVICE == "cuda" else None
    yield
    assert torch.equal(cpu, torch.get_rng_state()), "torch's CPU generator moved"
    if cuda is not None:
        assert torch.equal(cuda, torch.cuda.get_rng_state()), "torch's CUDA generator moved"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))


def _values(n: int) -> torch.Tensor:
    """Normal values over many binades, plus zeros, subnormals, infinities, NaN and values past every
    target's range (float32, on the CPU)."""
    x = kr.normal(keyinit.key(3), (n,), std=4.0) * torch.exp2(kr.randint(keyinit.key(4), (n,), low=-30, high=20)
                                                              .to(torch.float32))
    special = torch.tensor([0.0, -0.0, 1e-45, -3e-39, float("inf"), float("-inf"), float("nan"), 7e4, -1e6,
                            448.0, 464.0, 57344.0, 65520.0, 3.4e38])
    x[: special.numel()] = special
    return x


@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: str(d).removeprefix("torch."))
def test_stochastic_round_on_the_device_equals_the_cpu(dtype):
    x = _values(1 << 16).reshape(256, 256)
    with generators_untouched():
        assert_same_bits(kr.stochastic_round(KEY, x.to(DEVICE), dtype), kr.stochastic_round(KEY, x, dtype))
        region = (slice(3, 250, 2), [255, 0, 7, 7, 128])
        part = x[3:250:2][:, [255, 0, 7, 7, 128]].contiguous()
        want = kr.stochastic_round(KEY, part, dtype, global_shape=x.shape, region=region)
        assert_same_bits(kr.stochastic_round(KEY, part.to(DEVICE), dtype, global_shape=x.shape, region=region),
                         want)
        out = torch.empty(256, 256, dtype=dtype, device=DEVICE).t()  # a transposed destination
        kr.stochastic_round(KEY, x.t().contiguous().to(DEVICE), dtype, out=out)
        assert_same_bits(out, kr.stochastic_round(KEY, x.t().contiguous(), dtype))


def test_stochastic_round_fp4_on_the_device_equals_the_cpu():
    x = _values(1 << 14).nan_to_num(0.0).reshape(128, 128)
    scale = torch.exp2(kr.randint(keyinit.key(5), (128, 4), low=-8, high=8).to(torch.float32))
    full_scale = scale.repeat_interleave(32, dim=1)
    with generators_untouched():
        want = kr.stochastic_round_fp4(KEY, x, full_scale)
        assert_same_bits(kr.stochastic_round_fp4(KEY, x.to(DEVICE), full_scale.to(DEVICE)), want)


def test_round_words_eager_and_compiled_on_the_device_equal_the_cpu():
    x = _values(4099)
    want = kr.stochastic_round(KEY, x, torch.bfloat16)
    words = kr.key_words(KEY, device=DEVICE)
    with generators_untouched():
        assert_same_bits(kr.stochastic_round_words(words, x.to(DEVICE), torch.bfloat16), want)
        compiled = torch.compile(kr.stochastic_round_words, backend="inductor", fullgraph=True)
        assert_same_bits(compiled(words, x.to(DEVICE), torch.bfloat16), want)


class _Rounds(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.proj(x)
        return knn.stochastic_round_grad(h, torch.bfloat16), knn.stochastic_round(h, torch.float8_e4m3fn)


def test_rounding_in_a_keyed_forward_and_backward_on_the_device_equals_the_cpu():
    results = {}
    for device in ("cpu", DEVICE):
        model = _Rounds()
        keyinit.init_model(model, seed=1)
        model.to(device)
        x = kr.normal(keyinit.key(6), (8, 64), device=device).requires_grad_()
        with generators_untouched(), knn.keyed(model, seed=9, step=2):
            h, q = model(x)
            (h * torch.arange(64, device=device)).sum().backward()
        results[device] = (h, q, x.grad, model.proj.weight.grad)
    for got, want in zip(results[DEVICE], results["cpu"]):
        if got.dtype == torch.float8_e4m3fn:
            assert_same_bits(got, want)
        else:  # the matmuls are torch's: the rounded values' exact bits are compared through the keyed rounding
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _mlp(device: str, dtype: torch.dtype) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(96, 384), torch.nn.GELU(), torch.nn.Linear(384, 96))
    keyinit.init_model(model, seed=0)
    return model.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("opt", ("Adam", "AdamW"))
def test_the_fused_step_on_the_device_equals_the_cpu(opt, dtype):
    states = {}
    for device in ("cpu", DEVICE):
        model = _mlp(device, dtype)
        kwargs = {"lr": 1e-2, "weight_decay": 0.1 if opt == "AdamW" else 0.0, "betas": (0.8, 0.95)}
        optimizer = getattr(torch.optim, opt)(model.parameters(), **kwargs)
        keyinit.optim.stochastic_rounding(optimizer, 11, names=model, fused=True)
        with generators_untouched():
            for step in range(4):
                for fqn, p in model.named_parameters():
                    p.grad = kr.normal(keyinit.key_for(keyinit.key(step), fqn), p.shape, std=1e-2, dtype=dtype,
                                       device=device)
                optimizer.step()
        states[device] = ([p for p in model.parameters()],
                          [t for s in optimizer.state.values() for k, t in sorted(s.items()) if k != "step"])
    for got, want in zip(*(sum(states[d], []) for d in (DEVICE, "cpu"))):
        assert_same_bits(got, want)


@pytest.mark.parametrize("fused", (True, False), ids=("fused", "float32"))
def test_a_compiled_step_on_the_device_compiles_once_and_rounds_with_the_keys(fused):
    """``torch.compile(optimizer.step)`` (inductor's device kernels) under ``stochastic_rounding``: nothing
    compiled after the second step; with ``fused=True`` the bf16 parameters step outside the graph, so they
    and their state are the eager step's bit for bit; with ``fused=False`` the first step's rounded values are
    within one bf16 unit (plus 1e-6) of the eager step's: inductor's float32 arithmetic differs from eager's by
    a few float32 units of the operands (up to 7.5e-8 here, seen where ``p + update`` cancels), and the keyed
    rounding of values that close differs by at most one unit; later steps start from parameters that differ"""
    from torch._dynamo.testing import CompileCounterWithBackend

    runs = {}
    for compiled in (False, True):
        model = _mlp(DEVICE, torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        keyinit.optim.stochastic_rounding(optimizer, 11, names=model, fused=fused)
        counter = CompileCounterWithBackend("inductor")
        step = torch.compile(optimizer.step, backend=counter) if compiled else optimizer.step
        frames = []
        with generators_untouched():
            for t in range(4):
                for fqn, p in model.named_parameters():
                    p.grad = kr.normal(keyinit.key_for(keyinit.key(t), fqn), p.shape, std=1e-2, dtype=p.dtype,
                                       device=DEVICE)
                with torch._dynamo.config.patch(error_on_recompile=compiled and t >= 2):
                    step()
                frames.append(counter.frame_count)
                if t == 0:
                    first = [p.detach().clone() for p in model.parameters()]
        if compiled:
            assert frames[1] == frames[-1], frames
        runs[compiled] = (first, [p.detach().clone() for p in model.parameters()])
    for (eager_first, eager_last), (comp_first, comp_last) in zip(*(zip(*runs[c]) for c in (False, True))):
        if fused:
            assert_same_bits(comp_last, eager_last)
        else:  # |difference| <= one bf16 unit (2**(e - 8) for a value m * 2**e, 0.5 <= m < 1) of either value
            a, b = eager_first.float(), comp_first.float()
            unit = torch.maximum(*(torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 8) for v in (a, b)))
            assert bool(((a - b).abs() <= unit + 1e-6).all())
