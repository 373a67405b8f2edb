"""Keyed attention dropout: SDPA, nn.MultiheadAttention and nn.Transformer*Layer under keyinit.nn.keyed.

Masks are asserted bitwise (with ``value = I`` the attention output IS the dropped
probability matrix, exactly); torch's matmul/softmax results are compared with a
tolerance (they are not batch-invariant bitwise and differ between CPU ISAs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit
import keyinit.nn as knn
import keyinit.nn.functional as KF
from keyinit.random import bernoulli

B, H, L, S, E = 4, 4, 6, 5, 8
TOL = dict(rtol=1e-5, atol=1e-6)


def _qk(seed: int = 0, shape=(B, H, L, S, E)):
    b, h, l, s, e = shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, l, e, generator=g), torch.randn(b, h, s, e, generator=g)


def _eye(shape) -> torch.Tensor:
    """A value tensor that makes SDPA's output its dropped probability matrix, exactly."""
    b, h, _, s = shape
    return torch.eye(s).expand(b, h, s, s).contiguous()


def _keep(key, shape, p, region=None):
    return bernoulli(key, shape, p=1.0 - p, region=region)


@pytest.mark.parametrize("region", [
    (slice(1, 3), slice(None), slice(None), slice(None)),      # a batch shard
    (slice(None), slice(2, 4), slice(None), slice(None)),      # a head shard (tensor parallel)
    (slice(None), slice(None), slice(3, 6), slice(None)),      # a query shard (sequence parallel)
    (slice(None), slice(None), slice(None), slice(1, 4)),      # a key shard
])
def test_functional_masks_are_the_same_slice_of_the_whole(region):
    q, k = _qk()
    key = keyinit.key(5)
    full_shape = (B, H, L, S)
    whole = KF.scaled_dot_product_attention(q, k, _eye(full_shape), dropout_p=0.4, rng_key=key)
    keep = _keep(key, full_shape, 0.4)
    assert torch.equal(whole != 0, keep)  # all probabilities are > 0 here
    local = KF.scaled_dot_product_attention(
        q[region[:3]], k[region[:2] + (region[3],)], _eye(full_shape)[region[:2] + (region[3], region[3])],
        dropout_p=0.4, rng_key=key, global_shape=full_shape, region=region)
    assert torch.equal(local != 0, keep[region])
    if region[3] == slice(None):  # a whole softmax row: the same values (torch's kernels, with a tolerance)
        torch.testing.assert_close(local, whole[region], **TOL)


def test_causal_uses_global_query_positions():
    q, k = _qk(1, (1, 2, 6, 6, 4))
    key = keyinit.key(1)
    v = torch.randn(1, 2, 6, 4)
    whole = KF.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3, rng_key=key)
    region = (slice(None), slice(None), slice(2, 6), slice(None))
    part = KF.scaled_dot_product_attention(q[:, :, 2:], k, v, is_causal=True, dropout_p=0.3, rng_key=key,
                                           global_shape=(1, 2, 6, 6), region=region)
    torch.testing.assert_close(part, whole[:, :, 2:], **TOL)
    no_dropout = KF.scaled_dot_product_attention(q, k, v, is_causal=True, rng_key=key)
    torch.testing.assert_close(no_dropout, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


def test_backward_matches_the_explicit_mask_reference():
    q, k = _qk(2)
    v = torch.randn(B, H, S, E, generator=torch.Generator().manual_seed(3))
    mask = torch.randn(L, S, generator=torch.Generator().manual_seed(4))
    key, p = keyinit.key(9), 0.3
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = KF.scaled_dot_product_attention(*inputs, attn_mask=mask, dropout_p=p, rng_key=key)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    rq, rk, rv = ref_inputs
    probs = torch.softmax(rq @ rk.transpose(-2, -1) / E**0.5 + mask, dim=-1)
    ref = (probs * _keep(key, (B, H, L, S), p) / (1 - p)) @ rv
    ref.backward(grad)
    torch.testing.assert_close(out, ref, **TOL)
    for mine, theirs in zip(inputs, ref_inputs):
        torch.testing.assert_close(mine.grad, theirs.grad, **TOL)


class _Attention(nn.Module):
    """SDPA with dropout, or the same attention written out with a separate F.dropout (HF's eager form)."""

    def __init__(self, p: float, eager: bool) -> None:
        super().__init__()
        self.p, self.eager = p, eager

    def forward(self, q, k, v):
        if self.eager:
            probs = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
            return F.dropout(probs, self.p, self.training) @ v
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


class _Wrap(nn.Module):
    def __init__(self, p: float, eager: bool = False) -> None:
        super().__init__()
        self.attn = _Attention(p, eager)

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def test_keyed_sdpa_masks_are_invariant_to_the_batch_split_and_equal_the_eager_form():
    q, k = _qk(6)
    v = _eye((B, H, L, S))
    model, eager = _Wrap(0.5), _Wrap(0.5, eager=True)
    rng = torch.get_rng_state()
    with knn.keyed(model, 7, step=3, stream="v1"):
        whole = model(q, k, v)
    assert torch.equal(rng, torch.get_rng_state())  # the global RNG is never read or advanced
    keep = _keep(knn.dropout_key(7, step=3, fqn="attn", ordinal=0), (B, H, L, S), 0.5)
    assert torch.equal(whole != 0, keep)
    parts = []
    for lo, hi in ((0, 1), (1, 4)):
        with knn.keyed(model, 7, step=3, sample_offset=lo, stream="v1"):
            parts.append(model(q[lo:hi], k[lo:hi], v[lo:hi]))
    assert torch.equal(torch.cat(parts) != 0, keep)
    torch.testing.assert_close(torch.cat(parts), whole, **TOL)
    with knn.keyed(eager, 7, step=3, stream="v1"):
        torch.testing.assert_close(eager(q, k, v), whole, **TOL)  # same key, same index: the same mask
    with knn.keyed(model, 7, step=4, stream="v1"):
        assert not torch.equal(model(q, k, v) != 0, keep)


def _mha_reference(mha: nn.MultiheadAttention, x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """batch_first MHA self-attention with an explicit keep-mask on its (B, H, L, L) probabilities."""
    b, l, e = x.shape
    h = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.view(b, l, h, e // h).transpose(1, 2) for t in (q, k, v))
    probs = torch.softmax(q @ k.transpose(-2, -1) / (e // h) ** 0.5, dim=-1)
    out = ((probs * keep / (1 - p)) @ v).transpose(1, 2).reshape(b, l, e)
    return F.linear(out, mha.out_proj.weight, mha.out_proj.bias)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_is_keyed(need_weights):
    mha = nn.MultiheadAttention(16, 4, dropout=0.4, batch_first=True)
    keyinit.init_model(mha, 0)
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with knn.keyed(mha, 2, step=1, stream="v1"):
        out, weights = mha(x, x, x, need_weights=need_weights, average_attn_weights=False)
    keep = _keep(knn.dropout_key(2, step=1, fqn="", ordinal=0), (5, 4, 7, 7), 0.4)
    torch.testing.assert_close(out, _mha_reference(mha, x, keep, 0.4), **TOL)
    if need_weights:
        assert torch.equal(weights != 0, keep)
    out.sum().backward()  # the backward regenerates the mask; compare with the reference's gradient
    grad = x.grad.clone()
    x.grad = None
    _mha_reference(mha, x, keep, 0.4).sum().backward()
    torch.testing.assert_close(grad, x.grad, **TOL)


def test_transformer_encoder_is_keyed_and_invariant_to_the_batch_split():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)  # dropout 0.1 by default
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    keyinit.init_model(model, 0)
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(1))
    rng = torch.get_rng_state()
    with knn.keyed(model, 4, step=2):
        whole = model(x)
        whole.sum().backward()
    assert torch.equal(rng, torch.get_rng_state())
    parts = []
    for lo, hi in ((0, 2), (2, 6)):
        with knn.keyed(model, 4, step=2, sample_offset=lo):
            parts.append(model(x[lo:hi]))
    torch.testing.assert_close(torch.cat(parts), whole, **TOL)
    with knn.keyed(model, 4, step=3):
        assert not torch.allclose(model(x), whole)


@pytest.mark.parametrize("layer_type", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer])
def test_a_sequence_first_layer_drops_as_its_batch_first_twin(layer_type):
    """torch's default ``batch_first=False``: the layer's activations are (sequence, batch, features), so
    its own dropouts read dimension 1 as the batch: the same masks as the batch-first layer, and so
    invariant to the batch split (they were keyed as if the sequence were the batch)."""
    twins = [layer_type(16, 4, 32, batch_first=first) for first in (True, False)]
    for layer in twins:
        keyinit.init_model(layer, 0)
    g = torch.Generator().manual_seed(2)
    x, memory = torch.randn(6, 5, 16, generator=g), torch.randn(6, 3, 16, generator=g)

    def run(layer, rows, sample_offset, first):
        args = (x[rows], memory[rows]) if layer_type is nn.TransformerDecoderLayer else (x[rows],)
        if not first:
            args = tuple(a.transpose(0, 1) for a in args)
        with knn.keyed(layer, 4, step=1, sample_offset=sample_offset):
            out = layer(*args)
        return out if first else out.transpose(0, 1)

    batch_first = run(twins[0], slice(None), 0, True)
    sequence_first = run(twins[1], slice(None), 0, False)
    torch.testing.assert_close(sequence_first, batch_first, **TOL)
    parts = [run(twins[1], slice(lo, hi), lo, False) for lo, hi in ((0, 2), (2, 6))]
    torch.testing.assert_close(torch.cat(parts), sequence_first, **TOL)


def test_unsupported_multihead_attention_options_are_named():
    mha = nn.MultiheadAttention(8, 2, dropout=0.1, add_bias_kv=True)
    with knn.keyed(mha, 0, step=0), pytest.raises(TypeError, match=r"root module.*bias_k"):
        mha(torch.ones(3, 2, 8), torch.ones(3, 2, 8), torch.ones(3, 2, 8))


# ----------------------------------------------------------------------------- HF models with SDPA


def _hf_bert(attn_implementation: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1,
    )
    config._attn_implementation = attn_implementation
    model = transformers.BertModel(config)
    keyinit.init_model(model, 0, init_method=model._init_weights)
    return model.train()


def test_hf_bert_sdpa_is_keyed_like_eager():
    ids = (torch.arange(6 * 7).reshape(6, 7) * 5) % 64
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model = _hf_bert(implementation)
        with knn.keyed(model, 3, step=1):
            outputs[implementation] = model(ids).last_hidden_state
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], rtol=1e-4, atol=1e-5)
    model = _hf_bert("sdpa")
    parts = []
    for lo, hi in ((0, 4), (4, 6)):
        with knn.keyed(model, 3, step=1, sample_offset=lo):
            parts.append(model(ids[lo:hi]).last_hidden_state)
    torch.testing.assert_close(torch.cat(parts), outputs["sdpa"], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- golden vectors (spec 14.5)

GOLDEN = __import__("json").loads(
    (__import__("pathlib").Path(__file__).with_name("golden_attention_dropout_v1.json")).read_text())


class _Leaf(nn.Module):
    """Makes ``ordinal`` dropout calls first (ordinals 0..ordinal-1), then the SDPA call."""

    def __init__(self, p: float, ordinal: int) -> None:
        super().__init__()
        self.p, self.ordinal = p, ordinal

    def forward(self, q, k, v):
        for _ in range(self.ordinal):
            F.dropout(q, 0.5)
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)  # draws nothing, takes no ordinal
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)


class _Node(nn.Module):
    def forward(self, *args):
        return next(iter(self.children()))(*args)


def _nested(fqn: str, leaf: nn.Module) -> nn.Module:
    if not fqn:
        return leaf
    root = node = _Node()
    parts = fqn.split(".")
    for name in parts[:-1]:
        node.add_module(name, child := _Node())
        node = child
    node.add_module(parts[-1], leaf)
    return root


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["fqn"] or "root")
def test_golden_attention_masks(case):
    shape = tuple(case["global_shape"])
    region = tuple(slice(a, b) for a, b in case["region"])
    key = knn.dropout_key(case["seed"], step=case["step"], fqn=case["fqn"], ordinal=case["ordinal"])
    assert [f"0x{w:08x}" for w in key.words] == case["key"]
    expected = torch.tensor([c == "1" for c in case["keep"]]).view(*(b - a for a, b in case["region"]))
    q, k = _qk(0, (*shape, 4))
    v = _eye(shape)
    local = KF.scaled_dot_product_attention(
        q[region[:3]], k[region[:2]][:, :, region[3]], v[region[:2]][:, :, region[3], region[3]],
        dropout_p=case["p"], rng_key=key, global_shape=shape, region=region)
    assert torch.equal(local != 0, expected)
    model = _nested(case["fqn"], _Leaf(case["p"], case["ordinal"]))
    with knn.keyed(model, case["seed"], step=case["step"], stream="v1"):
        whole = model(q, k, v)
    assert torch.equal((whole != 0)[region], expected)


@pytest.mark.parametrize("boolean", [True, False])
def test_a_fully_masked_query_row_gives_zeros_and_finite_gradients_as_in_torch(boolean):
    q, k = _qk(8, (1, 2, 3, 3, 4))
    v = torch.randn(1, 2, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    if not boolean:
        mask = torch.zeros(3, 3).masked_fill(~mask, float("-inf"))
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = KF.scaled_dot_product_attention(*inputs, attn_mask=mask, dropout_p=0.3, rng_key=keyinit.key(0))
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 4))
    torch.testing.assert_close(out[:, :, 1], F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, 1])
    out.sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in inputs)


def test_keyed_sdpa_backward_under_bf16_autocast():
    """Under CPU autocast (an HF/TRL Trainer with ``bf16=True``) the keyed attention's matmul runs in bfloat16
    while the saved probabilities are float32: the backward computes in the autocast dtype and returns each
    gradient in its input's dtype (it raised "expected scalar type Float but found BFloat16"). Gradients are
    those of the same keyed forward in float32, to bfloat16's precision; the masks are the keyed ones."""
    q, k = _qk(3)
    v = torch.randn(B, H, S, E, generator=torch.Generator().manual_seed(4))
    model = _Wrap(0.5)

    def grads(autocast: bool, step: int = 3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with knn.keyed(model, 7, step=step):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the forward only, as a Trainer
                out = model(*leaves)
            out.float().square().sum().backward()
        return out, [t.grad for t in leaves]

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    out16, g16 = grads(True)
    out32, g32 = grads(False)
    assert all(g.dtype == torch.float32 for g in g16)
    assert max(rel(a, b) for a, b in zip(g16, g32)) < 0.03 and rel(out16, out32) < 0.03
    _, other = grads(True, step=4)  # another step's masks: other gradients
    assert rel(other[2], g16[2]) > 0.3
