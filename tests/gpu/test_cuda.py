"""On a CUDA device keyinit gives the CPU's values bit for bit, and keyed() holds there too.

What runs on the GPU here: the samplers (every distribution and dtype, whole tensors and
regions, Triton or not), whole-model ``materialize`` of real timm, torchvision and HF models,
keyed dropout (forward and backward), keyed forwards of real models (every mask the CPU's),
activation checkpointing whose recompute runs in autograd's CUDA worker thread, and
``keyinit.nn.compile`` with inductor's CUDA kernels. None of it reads or advances torch's CPU
or CUDA generator.

Skipped without CUDA. ``KEYINIT_TEST_DEVICE=cpu`` runs the same code with the CPU standing
in for the GPU (a dry run of this file: it then compares the CPU with itself).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit import random as kr
from tests.conftest import assert_bits_equal
from tests._support.vision import import_vision
from tests.nn.checkpoint.test_keyed_checkpoint import _grads  # three checkpointable blocks: Linear, Dropout, bernoulli_

DEVICE = os.environ.get("KEYINIT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device: the GPU paths are not exercised"
)

KEY = keyinit.key(20261126)


@contextlib.contextmanager
def generators_untouched(cpu: bool = True):
    """torch's CPU generator (unless ``cpu`` is False) and, on CUDA, the device's generator are neither read
    nor advanced."""
    cpu_state = torch.get_rng_state() if cpu else None
    cuda = torch.cuda.get_rng_state() if DEVICE == "cuda" else None
    yield
    if cpu_state is not None:
        assert torch.equal(cpu_state, torch.get_rng_state()), "torch's CPU generator moved"
    if cuda is not None:
        assert torch.equal(cuda, torch.cuda.get_rng_state()), "torch's CUDA generator moved"


# ------------------------------------------------------------------------------------ samplers

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
GEOMETRIES = {
    "n1031": ((1031,), None),
    "region3d": ((5, 7, 9), (slice(None, None, -1), slice(2, 7), [0, 8, 4, 4])),
    "rows": ((64, 1000), (slice(3, 61), slice(5, 997))),
    "big": ((2048, 4096), None),
    "rows-2**62": ((2**31, 2**31), (slice(2**31 - 3, None), slice(2**31 - 700, None))),
}
SAMPLERS = {
    "bits": (kr.bits, (torch.int64,)),
    "uniform": (lambda **kw: kr.uniform(low=-1.5, high=2.25, **kw), FLOATS),
    "normal": (lambda **kw: kr.normal(mean=0.25, std=2.0, **kw), FLOATS),
    "truncated_normal": (lambda **kw: kr.truncated_normal(std=0.02, a=-0.04, b=0.04, **kw), FLOATS),
    "bernoulli": (lambda **kw: kr.bernoulli(p=0.3, **kw), (torch.bool, torch.float32, torch.bfloat16)),
    "randint": (lambda **kw: kr.randint(low=-7, high=100, **kw), (torch.int64, torch.int32, torch.int8)),
}
SAMPLER_CASES = [(name, dtype, geometry) for name, (_, dtypes) in SAMPLERS.items() for dtype in dtypes
                 for geometry in GEOMETRIES]


@pytest.mark.parametrize("name,dtype,geometry", SAMPLER_CASES,
                         ids=[f"{n}-{str(d)[6:]}-{g}" for n, d, g in SAMPLER_CASES])
def test_sampler_on_the_device_equals_the_cpu(name, dtype, geometry):
    draw = SAMPLERS[name][0]
    shape, region = GEOMETRIES[geometry]
    with generators_untouched():
        on_device = draw(key=KEY, shape=shape, region=region, dtype=dtype, device=DEVICE)
    assert on_device.device.type == DEVICE
    assert_bits_equal(on_device.cpu(), draw(key=KEY, shape=shape, region=region, dtype=dtype, device="cpu"))


def test_out_tensor_on_the_device_strided():
    full = kr.normal(KEY, (300, 200), device="cpu")
    out = torch.empty(200, 300, device=DEVICE).t()  # a transposed view
    kr.normal(KEY, (300, 200), out=out)
    assert_bits_equal(out.cpu(), full)


# ----------------------------------------------------------------------------- materialize


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return keyinit.deferred(transformers.LlamaForCausalLM, config)


def _vit():
    timm = import_vision("timm")
    return keyinit.deferred(timm.create_model, "vit_tiny_patch16_224", pretrained=False, num_classes=10)


def _resnet():
    torchvision = import_vision("torchvision")
    return keyinit.deferred(torchvision.models.resnet18, num_classes=10)


def _encoder_layer():
    return keyinit.deferred(nn.TransformerEncoderLayer, d_model=64, nhead=4)


BUILDERS = {"hf-llama": _llama, "timm-vit": _vit, "torchvision-resnet18": _resnet,
            "torch-encoder-layer": _encoder_layer}


@pytest.mark.parametrize("model", list(BUILDERS))
def test_materialize_on_the_device_equals_the_cpu(model):
    with generators_untouched():
        on_device = BUILDERS[model]()
        keyinit.materialize(on_device, seed=7, device=DEVICE)
    on_cpu = BUILDERS[model]()
    keyinit.materialize(on_cpu, seed=7, device="cpu")
    got, expected = on_device.state_dict(), on_cpu.state_dict()
    assert list(got) == list(expected)
    for name, tensor in got.items():
        assert tensor.device.type == DEVICE, name
        assert_bits_equal(tensor.cpu(), expected[name])


def test_init_model_of_a_module_on_the_device():
    model = nn.Sequential(nn.Linear(96, 200), nn.LayerNorm(200), nn.Linear(200, 33))
    on_cpu = nn.Sequential(nn.Linear(96, 200), nn.LayerNorm(200), nn.Linear(200, 33))
    model.to(DEVICE)
    with generators_untouched():
        keyinit.init_model(model, 3)
    keyinit.init_model(on_cpu, 3)
    for a, b in zip(model.parameters(), on_cpu.parameters()):
        assert_bits_equal(a.detach().cpu(), b.detach())


# --------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8, 33, 70), (4, 512, 1024)])
def test_dropout_on_the_device_equals_the_cpu(dtype, shape):
    x = kr.normal(KEY, shape, dtype=dtype)
    grad = kr.uniform(keyinit.fold_in(KEY, 1), shape, dtype=dtype)
    results = []
    for device in ("cpu", DEVICE):
        xd = x.to(device, copy=True).requires_grad_()
        with generators_untouched():
            out = knn.functional.dropout(xd, 0.3, rng_key=KEY)
            out.backward(grad.to(device))
        results.append((out.detach().cpu(), xd.grad.cpu()))
    (out_cpu, grad_cpu), (out_dev, grad_dev) = results
    assert_bits_equal(out_dev, out_cpu)
    assert_bits_equal(grad_dev, grad_cpu)
    # a region of the global tensor, as a shard holds it
    rows = slice(1, shape[0] - 1)
    part = knn.functional.dropout(x[rows].to(DEVICE), 0.3, rng_key=KEY, global_shape=shape,
                                  region=(rows, slice(None), slice(None)))
    assert_bits_equal(part.cpu(), out_cpu[rows])


class _V2Drops(nn.Module):
    """Element-wise dropouts of (B, L, D) rows, (B, H, L, S) probabilities and a transposed (L, B, D) view."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x, probs, y):
        return self.drop(x), self.drop(probs), self.drop(y.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_v2_keyed_dropout_on_the_device_equals_the_cpu(dtype, monkeypatch):
    """Stream v2's extent-free names (docs/spec.md 14.8) on the device (the Triton kernel, when triton is
    installed): forward and backward bit for bit the CPU's, and a shorter padding keeps the real elements'."""
    shapes = ((4, 33, 96), (4, 3, 33, 70), (4, 17, 130))
    inputs = [kr.normal(keyinit.fold_in(KEY, i), s, dtype=dtype) for i, s in enumerate(shapes)]
    grads = [kr.uniform(keyinit.fold_in(KEY, 10 + i), s if i < 2 else (s[1], s[0], s[2]), dtype=dtype)
             for i, s in enumerate(shapes)]
    launched = []
    if DEVICE == "cuda" and importlib.util.find_spec("triton") is not None:
        from keyinit._kernels.dropout import triton as triton_dropout

        kernel = triton_dropout.run

        def counted(x, out, geometry, **kwargs):
            done = kernel(x, out, geometry, **kwargs)
            launched.append((geometry.stream, done))
            return done

        monkeypatch.setattr(triton_dropout, "run", counted)

    def forward(device, trim=None):
        leaves = [t[trim[i]] if trim else t for i, t in enumerate(inputs)]
        leaves = [t.to(device, copy=True).requires_grad_() for t in leaves]
        net = _V2Drops().train()
        with generators_untouched():
            with knn.keyed(net, 5, step=1, sample_offset=3, stream="v2"):
                outs = net(*leaves)
            if trim is None:
                torch.autograd.backward(outs, [g.to(device) for g in grads])
        return [o.detach().cpu() for o in outs] + ([t.grad.cpu() for t in leaves] if trim is None else [])

    on_cpu = forward("cpu")
    on_device = forward(DEVICE)
    for got, want in zip(on_device, on_cpu):
        assert_bits_equal(got, want)
    if launched:
        assert launched == [("v2", True)] * 6  # three forward dropouts, three backward
    # padded less far: sequence 20 of 33, probabilities (20, 50) of (33, 70), sequence 10 of 17
    trim = ((slice(None), slice(0, 20)), (slice(None), slice(None), slice(0, 20), slice(0, 50)),
            (slice(None), slice(0, 10)))
    short = forward(DEVICE, trim)
    assert_bits_equal(short[0], on_cpu[0][:, :20])
    assert_bits_equal(short[1], on_cpu[1][:, :, :20, :50])
    assert_bits_equal(short[2], on_cpu[2][:10])


# ------------------------------------------------------------------------ keyed forwards


def _masks_of(model: nn.Module, inputs, seed: int, step: int, offset: int = 0):
    """Run a keyed forward; return its output and, per stochastic module, the elements it zeroed."""
    masks: dict[str, list] = {}

    def hook(name):
        def record(module, args, output):
            masks.setdefault(name, []).append(((output == 0) & (args[0] != 0)).cpu())
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if "Drop" in type(m).__name__]
    try:
        with generators_untouched(), knn.keyed(model, seed, step=step, sample_offset=offset):
            out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return out, masks


def _vit_for_training(device):
    timm = import_vision("timm")
    model = keyinit.deferred(timm.create_model, "vit_tiny_patch16_224", pretrained=False, num_classes=10,
                             img_size=32, patch_size=8, drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1,
                             drop_path_rate=0.2)
    keyinit.materialize(model, seed=1, device=device)
    return model.train()


def _bert_for_training(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1, attn_implementation="eager")
    model = keyinit.deferred(transformers.BertForMaskedLM, config)
    keyinit.materialize(model, seed=1, device=device)
    return model.train()


TRAINED = {  # (model on a device, its batch of 6 on that device)
    "timm-vit-droppath": (_vit_for_training, lambda d: kr.normal(KEY, (6, 3, 32, 32), device=d)),
    "hf-bert": (_bert_for_training, lambda d: kr.randint(KEY, (6, 16), low=0, high=128, device=d)),
}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", list(TRAINED))
def test_keyed_forward_on_the_device_draws_the_cpus_masks(name):
    build, batch = TRAINED[name]
    out_cpu, masks_cpu = _masks_of(build("cpu"), (batch("cpu"),), seed=5, step=3)
    model, whole = build(DEVICE), batch(DEVICE)
    out_dev, masks_dev = _masks_of(model, (whole,), seed=5, step=3)
    # a split batch on the device draws the whole batch's masks
    halves = [_masks_of(model, (whole[lo:lo + 3],), seed=5, step=3, offset=lo) for lo in (0, 3)]
    assert masks_cpu and set(masks_cpu) == set(masks_dev)
    for module, calls in masks_cpu.items():
        assert len(calls) == len(masks_dev[module]), module
        for a, b in zip(calls, masks_dev[module]):
            assert torch.equal(a, b), module
        for i, whole_mask in enumerate(masks_dev[module]):
            split = torch.cat([halves[0][1][module][i], halves[1][1][module][i]])
            assert torch.equal(split, whole_mask), module
    assert any(bool(m.any()) for calls in masks_cpu.values() for m in calls)
    # torch's own kernels (matmul, attention) differ between devices: a tolerance for the values
    torch.testing.assert_close(_logits(out_dev).detach().cpu(), _logits(out_cpu).detach(), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------------ checkpointing


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_checkpoint_recompute_on_the_device(reentrant, backward_inside):
    """With backward after the block, on CUDA the recompute runs in autograd's device thread. (``_grads``
    builds its model with torch's CPU generator, then checks that the keyed block left it alone.)"""
    with generators_untouched(cpu=False):
        expected = _grads(None, True, device=DEVICE)
        got = _grads(reentrant, backward_inside, device=DEVICE)
        other = _grads(reentrant, backward_inside, step=2, device=DEVICE)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)  # same device, same kernels: the recompute must match exactly
    assert not torch.equal(other[0], expected[0])


# ------------------------------------------------------------------------ torch.compile


class Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(128, 64)
        self.out = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x.new_empty((x.shape[0], 1, 1)).bernoulli_(0.8)
        h = self.b(self.drop(torch.nn.functional.gelu(self.a(x)))) * keep / 0.8
        return self.out(x + h + 0.01 * torch.randn_like(x))


def test_inductor_on_the_device_draws_the_eager_masks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Compiled().to(DEVICE).train()
    keyinit.init_model(model, 0)
    compiled = knn.compile(model)
    x = kr.normal(KEY, (6, 10, 64), device=DEVICE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step, offset, rows in [(0, 0, x), (1, 3, x[3:]), (2, 0, x[:3])]:
                with generators_untouched():
                    with knn.keyed(model, 9, step=step, sample_offset=offset):
                        eager = model(rows)
                    with knn.keyed(compiled, 9, step=step, sample_offset=offset):
                        got = compiled(rows)
                assert torch.equal(got == 0, eager == 0)
                torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
