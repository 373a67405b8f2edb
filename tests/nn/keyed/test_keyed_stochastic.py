"""keyed() on stochastic layers beyond dropout (issue 22): each keyed per sample or replicated, split-invariant.

timm's DropPath (``drop_path_rate=0.2``) in ViT, ConvNeXt, EfficientNet and Swin; a Mixtral/Qwen-MoE
router's jitter (``torch.empty_like(h).uniform_(1 - eps, 1 + eps)``) on ``(B, L, D)`` and on the
flattened ``(B*L, D)`` rows; MAE's random masking (``torch.rand(N, L)``, ``argsort``, keep the
first); HF LayerDrop (``torch.rand([])`` per layer: replicated, the same decision on every split);
and the ops with ``p = 0`` that draw nothing and touch no RNG.

Each forward runs on a batch of 4 and on rows 0:2 and 2:4 with ``sample_offset`` 0 and 2; the
draws are compared bitwise, model outputs with a tolerance (torch's kernels are not batch-invariant).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit.nn as knn

HALVES = ((0, 2), (2, 4))


def _rng_state() -> tuple:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _assert_rng_untouched(before: tuple) -> None:
    after = _rng_state()
    assert torch.equal(before[0], after[0]), "the global torch RNG was read or advanced"
    assert before[1][0] == after[1][0] and np.array_equal(before[1][1], after[1][1]) and before[1][2:] == after[1][2:]
    assert before[2] == after[2], "Python's random was read or advanced"


def _split_runs(model: nn.Module, x: torch.Tensor, step: int = 0) -> tuple:
    """``(whole, [half 0, half 1])`` outputs of keyed forwards of the batch and of its halves."""
    with knn.keyed(model, 0, step=step):
        whole = model(x)
    parts = []
    for lo, hi in HALVES:
        with knn.keyed(model, 0, step=step, sample_offset=lo):
            parts.append(model(x[lo:hi]))
    return whole, parts


# ----------------------------------------------------------------------------- timm DropPath


def _timm_models():
    from tests._support.vision_zoo import _timm

    timm = _timm()
    torch.manual_seed(0)  # (under fork_rng: the same weights whatever ran before)
    yield "vit", timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, embed_dim=18,
                                   num_heads=3, mlp_ratio=2.0, num_classes=7, drop_path_rate=0.2), 16
    yield "convnext", timm.create_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 12, 16, 22), num_classes=7,
                                        ls_init_value=0.5, drop_path_rate=0.2), 32
    yield "efficientnet", timm.create_model("tinynet_e", num_classes=7, drop_path_rate=0.2), 32
    yield "swin", timm.create_model("swin_tiny_patch4_window7_224", img_size=56, patch_size=4, window_size=7,
                                    embed_dim=12, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), num_classes=7,
                                    drop_path_rate=0.2), 56


def test_timm_drop_path_is_keyed_per_sample_and_split_invariant():
    pytest.importorskip("timm")
    from tests._support.vision import define_torchvision_schemas

    define_torchvision_schemas()
    with torch.random.fork_rng(devices=[]):
        models = list(_timm_models())
    for name, model, size in models:
        drop_paths = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "DropPath"]
        assert drop_paths, f"{name}: no DropPath built"
        model.train()
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(5))
        taps: dict[str, list] = {}
        handles = [m.register_forward_hook(lambda m, a, out, n=n: taps.setdefault(n, []).append(
            (out == 0).flatten(1).all(1) & (a[0] != 0).flatten(1).any(1))) for n, m in drop_paths]
        before = _rng_state()
        outputs, patterns = [], set()
        with torch.no_grad():
            for step in range(4):
                whole, parts = _split_runs(model, x, step=step)
                torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-5)
                for n, calls in taps.items():  # which samples each DropPath dropped: bitwise the same
                    assert len(calls) % 3 == 0, (name, n, len(calls))
                    for k in range(0, len(calls), 3):
                        assert torch.equal(torch.cat(calls[k + 1:k + 3]), calls[k]), f"{name} {n}: split-dependent"
                patterns.add(tuple(tuple(v[0].tolist()) for _, v in sorted(taps.items())))
                taps.clear()
                outputs.append(whole)
            model.eval()
            eval_out = model(x)
        for handle in handles:
            handle.remove()
        _assert_rng_untouched(before)
        scale = eval_out.abs().max()  # (tinynet's logits are ~1e-5 at init)
        assert max((o - eval_out).abs().max() for o in outputs) > 1e-3 * scale, f"{name}: DropPath is not live"
        dropped = [p for p in patterns if any(any(call) for call in p)]
        assert dropped and len(patterns) > 1, f"{name}: no sample dropped, or the same paths at every step"


# ----------------------------------------------------------------------------- MoE router jitter


class JitterRouter(nn.Module):
    """A Mixtral/Switch-style router: multiplicative jitter noise on the input, then the gate."""

    def __init__(self, eps: float, flat: bool) -> None:
        super().__init__()
        self.eps, self.flat = eps, flat
        self.gate = nn.Linear(6, 3, bias=False)
        self.noise: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.flat:  # Qwen-MoE / Mixtral: (batch * sequence_length, hidden_dim)
            h = h.view(-1, h.shape[-1])
        self.noise = torch.empty_like(h).uniform_(1.0 - self.eps, 1.0 + self.eps)
        return self.gate(h * self.noise)


@pytest.mark.parametrize("flat", [False, True], ids=["BLD", "BL_D"])
def test_router_jitter_is_keyed_per_sample(flat):
    router = JitterRouter(0.01, flat)
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(1))
    before = _rng_state()
    noises = []
    for lo, hi in ((0, 4), *HALVES):
        with knn.keyed(router, 0, step=0, sample_offset=lo):
            router(x[lo:hi])
        noises.append(router.noise.reshape(hi - lo, 5, 6))
    with knn.keyed(router, 0, step=1):
        router(x)
    step1 = router.noise.reshape(4, 5, 6)
    _assert_rng_untouched(before)
    whole = noises[0]
    assert torch.equal(torch.cat(noises[1:]), whole)  # per sample: bitwise the same under any split
    assert whole.min() >= 0.99 and whole.max() <= 1.01 and whole.unique().numel() > 100
    assert not torch.equal(whole, step1)
    # the element's index within its sample is its place in (L, D), however the rows are laid out:
    # the flattened rows draw what the (B, L, D) tensor draws
    other = JitterRouter(0.01, not flat)
    with knn.keyed(other, 0, step=0):
        other(x)
    assert torch.equal(other.noise.reshape(4, 5, 6), whole)


# ----------------------------------------------------------------------------- MAE random masking


class MaskedEncoder(nn.Module):
    """MAE's ``random_masking`` (per-sample noise, argsort, keep the first), then a dropout."""

    def __init__(self, mask_ratio: float) -> None:
        super().__init__()
        self.mask_ratio = mask_ratio
        self.proj = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor):
        N, L, D = x.shape
        len_keep = int(L * (1 - self.mask_ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, dim=1, index=ids_restore)
        return self.drop(self.proj(x_masked)), mask, noise


def test_mae_random_masking_is_keyed_per_sample():
    model = MaskedEncoder(0.75).train()
    x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(2))
    before = _rng_state()
    with torch.no_grad():
        whole, parts = _split_runs(model, x)
        step1 = _split_runs(model, x, step=1)[0]
    _assert_rng_untouched(before)
    out, mask, noise = whole
    assert torch.equal(torch.cat([p[2] for p in parts]), noise)  # the noise, bitwise
    assert torch.equal(torch.cat([p[1] for p in parts]), mask)  # so the kept patches
    assert torch.equal(mask.sum(1), torch.full((4,), 6.0)) and not torch.equal(mask[0], mask[1])
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), out, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([p[0] == 0 for p in parts]), out == 0)  # the dropout after the gather
    assert not torch.equal(step1[2], noise)


# ----------------------------------------------------------------------------- HF LayerDrop


def test_hf_layerdrop_decision_is_replicated_across_splits():
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=32, d_model=16, decoder_layers=4, decoder_attention_heads=2,
                                     decoder_ffn_dim=24, encoder_layers=1, encoder_attention_heads=2,
                                     encoder_ffn_dim=24, max_position_embeddings=16, decoder_layerdrop=0.5,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BartForCausalLM(config).train()
    ids = (torch.arange(32).reshape(4, 8) * 5) % 28 + 4
    ran: list[int] = []
    layers = model.model.decoder.layers
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    before = _rng_state()
    patterns = []
    with torch.no_grad():
        for step in range(8):
            runs = []
            for lo, hi in ((0, 4), *HALVES):
                ran.clear()
                with knn.keyed(model, 0, step=step, sample_offset=lo):
                    model(input_ids=ids[lo:hi], use_cache=False)  # (HF's cache breaks on a dropped layer)
                runs.append(tuple(ran))
            assert runs[1] == runs[0] and runs[2] == runs[0], f"step {step}: LayerDrop decided per split: {runs}"
            patterns.append(runs[0])
    for handle in handles:
        handle.remove()
    _assert_rng_untouched(before)
    # a live draw: with p = 0.5 over 4 layers and 8 steps, layers are dropped and the pattern changes by step
    assert any(len(p) < len(layers) for p in patterns) and len(set(patterns)) > 1, patterns


# ----------------------------------------------------------------------------- p = 0


class ZeroP(nn.Module):
    def __init__(self, zero_ops: bool) -> None:
        super().__init__()
        self.zero_ops = zero_ops
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_ops:
            self.seen = [torch.bernoulli(x, p=0.0), x.clone().bernoulli_(0.0),
                         torch.ops.aten.native_dropout(x, 0.0, True)]
        return F.dropout(x, 0.5)


def test_p_zero_ops_draw_nothing_and_touch_no_rng():
    x = torch.rand(4, 7, generator=torch.Generator().manual_seed(3)) + 0.5
    with knn.keyed(plain := ZeroP(False), 0, step=0):
        expected = plain(x)
    model = ZeroP(True)
    before = _rng_state()
    with knn.keyed(model, 0, step=0):
        out = model(x)
    _assert_rng_untouched(before)
    bern, bern_, (dropped, keep) = model.seen
    assert torch.equal(bern, torch.zeros_like(x)) and torch.equal(bern_, torch.zeros_like(x))
    assert torch.equal(dropped, x) and bool(keep.all())
    assert torch.equal(out, expected)  # they took no call ordinal: the dropout after them is unchanged
    # outside keyed(), torch's own kernels would consume the global RNG for the same calls
    with torch.random.fork_rng(devices=[]):
        state = torch.get_rng_state()
        torch.bernoulli(x, p=0.0)
        assert not torch.equal(state, torch.get_rng_state())
