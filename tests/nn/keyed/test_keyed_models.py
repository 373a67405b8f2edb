"""keyinit.nn.keyed on whole models (one process): batch splits, steps, eval, errors, HF Llama.

:class:`DropLlama` is a small Llama-like decoder with every kind of dropout
call: ``nn.Dropout`` modules, a ``keyinit.nn.Dropout``, and functional
``F.dropout`` calls inside the attention and the feed-forward. Its attention is
written out (matmul, softmax, dropout), so with DTensor activations it runs
under tensor + sequence parallelism too (tests/nn/keyed/test_keyed_models_dist.py). Every
dropout output is recorded (``taps``), and a mask is read back as ``out != 0``
(the inputs to every dropout are non-zero almost surely).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn import dropout_key
from keyinit.nn import functional as KF
from tests._support.splits import check_splits

SEED = 2024


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, p: float) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.p = p
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.taps: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        weights = ((q @ k.transpose(-2, -1)) * self.head_dim**-0.5).softmax(dim=-1)
        weights = F.dropout(weights, self.p, self.training)  # call 0 of this module
        if self.taps is not None:
            self.taps.append(weights)
        out = (weights @ v).transpose(1, 2).reshape(b, t, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, p: float) -> None:
        super().__init__()
        self.p = p
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.taps: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(F.silu(self.w1(x)) * self.w3(x), p=self.p, training=self.training)
        if self.taps is not None:
            self.taps.append(hidden)
        return self.w2(hidden)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, p: float) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, p)
        self.resid_dropout = nn.Dropout(p)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden, p)
        self.ffn_dropout = knn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.resid_dropout(self.attention(self.attention_norm(x)))
        return h + self.ffn_dropout(self.feed_forward(self.ffn_norm(h)))


class DropLlama(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 16, heads: int = 4, hidden: int = 24, layers: int = 2,
                 p: float = 0.25) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.emb_dropout = nn.Dropout(p)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden, p) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pipeline stages (torchtitan style) set tok_embeddings or norm/output to None and drop layers."""
        h = self.emb_dropout(self.tok_embeddings(tokens)) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def dropout_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Dropout, knn.Dropout))]


def tapped(model: nn.Module, tokens: torch.Tensor, **keyed_kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the outputs of every dropout call, in call order, under keyed(model, SEED, ...)."""
    taps: list = []
    for m in model.modules():
        if isinstance(m, (Attention, FeedForward)):
            m.taps = taps
    handles = [m.register_forward_hook(lambda mod, args, out: taps.append(out)) for m in dropout_modules(model)]
    try:
        with knn.keyed(model, SEED, **keyed_kwargs):
            logits = model(tokens)
    finally:
        for h in handles:
            h.remove()
        for m in model.modules():
            if isinstance(m, (Attention, FeedForward)):
                m.taps = None
    return logits, taps


def build(seed: int = 0, **kwargs) -> DropLlama:
    model = DropLlama(**kwargs)
    keyinit.init_model(model, seed)
    return model.train()


def tokens(batch: int = 8, seq: int = 7) -> torch.Tensor:
    return (torch.arange(batch * seq).reshape(batch, seq) * 5) % 37


def masks(taps: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t != 0 for t in taps]


# ----------------------------------------------------------------------------- the batch split


def test_batch_of_8_equals_calls_of_3_and_5_with_sample_offset():
    model, ids = build(), tokens()
    full, full_taps = tapped(model, ids, step=3)
    first, taps_a = tapped(model, ids[:3], step=3, sample_offset=0)
    second, taps_b = tapped(model, ids[3:], step=3, sample_offset=3)
    assert len(full_taps) == len(taps_a) == len(taps_b) == 1 + 2 * 4
    # keyinit's promise, bitwise: the masks, and the keyed values of the (exact) embedding lookup
    assert torch.equal(full_taps[0], torch.cat([taps_a[0], taps_b[0]]))
    for whole, a, b in zip(full_taps, taps_a, taps_b):
        assert torch.equal(whole != 0, torch.cat([a, b]) != 0), "a dropout mask differs under the batch split"
        # values after torch's matmuls: not batch-invariant bitwise on every CPU ISA
        torch.testing.assert_close(whole, torch.cat([a, b]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full, torch.cat([first, second]), rtol=1e-5, atol=1e-5)
    dropped = sum(int((~m).sum()) for m in masks(full_taps))
    total = sum(m.numel() for m in masks(full_taps))
    assert 0.2 < dropped / total < 0.3  # p = 0.25: the masks do drop


def test_gradient_accumulation_split_gives_the_same_input_gradients():
    model, ids = build(), tokens()

    def grads(pieces):
        out = []
        for lo, hi in pieces:
            emb = model.tok_embeddings(ids[lo:hi]).detach().requires_grad_()
            knn.batch_dim(emb, 0)  # it enters the forward through a hook, not as an input: declared
            handle = model.tok_embeddings.register_forward_hook(lambda m, a, o, emb=emb: emb)
            try:
                with knn.keyed(model, SEED, step=9, sample_offset=lo):
                    model(ids[lo:hi]).sum().backward()
            finally:
                handle.remove()
            out.append(emb.grad)
        model.zero_grad()
        return torch.cat(out)

    # the masks are equal (previous test); the backward's matmuls are torch's: compared with a tolerance
    torch.testing.assert_close(grads([(0, 8)]), grads([(0, 2), (2, 8)]), rtol=1e-5, atol=1e-6)


def test_masks_follow_the_documented_keys():
    model, ids = build(), tokens(batch=4)
    _, taps = tapped(model, ids[1:], step=5, sample_offset=1, stream="v1")
    emb = model.tok_embeddings(ids[1:])
    expected = KF.dropout(emb, 0.25, rng_key=dropout_key(SEED, step=5, fqn="emb_dropout", ordinal=0), global_shape=(4, 7, 16),
                          region=(slice(1, 4), slice(None), slice(None)))
    assert torch.equal(taps[0], expected)
    # functional call 0 inside layers.0.attention: the attention weights (batch, heads, seq, seq)
    keep = keyinit.random.bernoulli(dropout_key(SEED, step=5, fqn="layers.0.attention", ordinal=0), (4, 4, 7, 7), p=0.75,
                                    region=(slice(1, 4), slice(None), slice(None), slice(None)))
    assert torch.equal(taps[1] != 0, keep)


def test_step_and_seed_change_masks_and_eval_is_identity():
    model, ids = build(), tokens()
    _, step1 = tapped(model, ids, step=1)
    _, step2 = tapped(model, ids, step=2)
    assert all(not torch.equal(a, b) for a, b in zip(masks(step1), masks(step2)))
    model.eval()
    plain = model(ids)
    under_keyed, taps = tapped(model, ids, step=1)
    assert torch.equal(plain, under_keyed)
    assert all(torch.equal(m, torch.ones_like(m)) for m in masks(taps))


def test_nn_dropout_and_keyinit_dropout_draw_the_same_mask():
    model, ids = build(), tokens()
    reference, _ = tapped(model, ids, step=4)
    for block in model.layers.values():
        block.resid_dropout = knn.Dropout(0.25)
        block.ffn_dropout = nn.Dropout(0.25)
    swapped, _ = tapped(model, ids, step=4)
    assert torch.equal(reference, swapped)


def test_global_rng_is_never_read_or_advanced():
    model, ids = build(), tokens()
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with knn.keyed(model, SEED, step=0):
        model(ids).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(4), expected)


def test_calls_in_a_child_belong_to_the_child_and_ordinals_count_per_forward():
    class Parent(nn.Module):
        def __init__(self, child_dropout: bool) -> None:
            super().__init__()
            self.child = nn.Dropout(0.5) if child_dropout else nn.Identity()

        def forward(self, x):
            a = F.dropout(x, 0.5)
            b = self.child(x)
            return a, F.dropout(x, 0.5), b

    x = torch.ones(3, 40)
    with knn.keyed(with_child := Parent(True), 1, step=0, stream="v1"):
        a1, c1, b1 = with_child(x)
    with knn.keyed(without := Parent(False), 1, step=0, stream="v1"):
        a2, c2, _ = without(x)
    assert torch.equal(a1, a2) and torch.equal(c1, c2)  # the child's call did not shift the parent's ordinals
    assert not torch.equal(a1, c1)
    assert torch.equal(c1, KF.dropout(x, 0.5, rng_key=dropout_key(1, step=0, fqn="", ordinal=1)))
    assert torch.equal(b1, KF.dropout(x, 0.5, rng_key=dropout_key(1, step=0, fqn="child", ordinal=0)))
    with knn.keyed(with_child, 1, step=0, stream="v1"):  # a second forward restarts the ordinals
        again = with_child(x)
    assert torch.equal(again[0], a1)


def test_dropout_variants_are_keyed_and_split_invariant():
    class Variants(nn.Module):
        def forward(self, x):
            outs = [F.dropout1d(x[..., 0], 0.3), F.dropout2d(x, 0.3), F.dropout3d(x.unsqueeze(-1), 0.3),
                    F.alpha_dropout(x, 0.3, True), F.feature_alpha_dropout(x, 0.3, True),
                    torch.feature_dropout(x, 0.3, True), torch.dropout(x, 0.3, True)]
            y = x.clone()
            F.dropout(y, 0.3, True, inplace=True)
            outs.append(y)
            z = x.clone()
            F.dropout2d(z, 0.3, True, inplace=True)
            outs.append(z)
            return outs

    model = Variants()
    x = torch.randn(6, 5, 4, 3, generator=torch.Generator().manual_seed(1)) + 3.0  # no zeros
    whole = check_splits(model, x, [((0, 2), (2, 6))], seed=3, step=1, exact=True, stream="v1")
    # channel-wise: a whole (sample, channel) plane is kept or dropped
    planes = (whole[1] != 0).flatten(2)
    assert torch.equal(planes.all(-1), planes.any(-1))
    # each call is keyed by its ordinal (0 .. 8 in the order above)
    scale = torch.tensor(1 / 0.7, dtype=torch.float32)

    def channel_dropout(ordinal):
        keep = keyinit.random.bernoulli(dropout_key(3, step=1, fqn="", ordinal=ordinal), (6, 5), p=0.7)
        return torch.where(keep[:, :, None, None], x * scale, torch.zeros(()))

    for ordinal in (1, 5, 8):
        assert torch.equal(whole[ordinal], channel_dropout(ordinal)), ordinal
    for ordinal in (6, 7):
        assert torch.equal(whole[ordinal], KF.dropout(x, 0.3, rng_key=dropout_key(3, step=1, fqn="", ordinal=ordinal))), ordinal


def test_activation_checkpointing_recomputes_the_same_masks():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner: DropLlama) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            h = self.inner.emb_dropout(self.inner.tok_embeddings(ids))
            for layer in self.inner.layers.values():
                h = checkpoint(layer, h, use_reentrant=False)
            return self.inner.output(self.inner.norm(h))

    ids = tokens()
    plain = build(seed=3)
    with knn.keyed(plain, SEED, step=2):
        plain(ids).sum().backward()
    wrapped = Checkpointed(build(seed=3))
    with knn.keyed(wrapped.inner, SEED, step=2):
        wrapped(ids).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.inner.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_pipeline_stages_draw_the_whole_models_masks():
    ids = tokens()
    whole, whole_taps = tapped(build(), ids, step=8, sample_offset=16)
    first, second = build(), build()
    del first.layers["1"]
    first.norm = first.output = None
    del second.layers["0"]
    second.tok_embeddings = second.emb_dropout = None
    hidden, taps_a = tapped(first, ids, step=8, sample_offset=16)
    logits, taps_b = tapped(second, hidden, step=8, sample_offset=16)
    assert torch.equal(logits, whole)
    assert all(torch.equal(a, b) for a, b in zip(taps_a + taps_b, whole_taps))


def test_wrappers_do_not_change_fqns():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, ids = build(), tokens()
    reference, _ = tapped(model, ids, step=6)
    for name in list(model.layers):
        model.layers[name] = checkpoint_wrapper(model.layers[name])
    with knn.keyed(model, SEED, step=6):
        wrapped = model(ids)
    assert torch.equal(reference, wrapped)


# ----------------------------------------------------------------------------- errors


def test_unkeyable_randomness_names_module_and_op():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            # each row written to the other sample's position: which sample is where, unknown
            swapped = torch.zeros(2, 4).index_add(0, torch.tensor([1, 0]), x)
            return self.inner(x) + torch.rand_like(swapped)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Noisy()

        def forward(self, x):
            return self.block(x)

    model = Root()
    with pytest.raises(UnkeyedRandomnessError, match=r"module 'block' \(Noisy\).*rand_like"):
        with knn.keyed(model, 0, step=0):
            model(torch.ones(2, 4))
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_function_mode_stack() == [] and _get_current_dispatch_mode_stack() == []  # nothing leaked
    assert not model.block._forward_pre_hooks and not model.block._forward_hooks

    class Sdpa(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, dropout_p=self.p)

    class AtenDropout(nn.Module):
        def forward(self, x):
            return torch.ops.aten.native_dropout(x, 0.5, True)[0]  # below F.dropout: keyed per sample too

    x = torch.ones(4, 2, 3, 4)
    with knn.keyed(model := AtenDropout(), 0, step=0):
        whole = model(x)
    halves = []
    for lo in (0, 2):
        with knn.keyed(model, 0, step=0, sample_offset=lo):
            halves.append(model(x[lo:lo + 2]))
    assert torch.equal(whole, torch.cat(halves)) and 0 < int((whole == 0).sum()) < whole.numel()
    with knn.keyed(sdpa := Sdpa(0.1), 0, step=0):
        sdpa(x)  # keyed (tests/nn/dropout/test_dropout_attention.py)
        Sdpa(0.1)(x)  # not a module of the keyed model: left to torch
    with knn.keyed(no_dropout := Sdpa(0.0), 0, step=0):
        assert torch.equal(no_dropout(x), F.scaled_dot_product_attention(x, x, x))

    class Bernoulli(nn.Module):
        def forward(self, x):
            return torch.bernoulli(x, generator=torch.Generator().manual_seed(0))

    probs = torch.full((6, 3), 0.5)
    with knn.keyed(model := Bernoulli(), 0, step=0):
        whole = model(probs)  # keyed per sample; the generator is not used
    with knn.keyed(model, 0, step=0, sample_offset=3):
        assert torch.equal(model(probs[3:]), whole[3:])
    with knn.keyed(model, 0, step=1):
        assert not torch.equal(model(probs), whole)


def test_randomness_outside_the_models_forward_is_left_alone():
    model = nn.Linear(3, 3)
    with knn.keyed(model, 0, step=0):
        torch.manual_seed(5)
        inside = (torch.rand(3), F.dropout(torch.ones(100), 0.5))
    torch.manual_seed(5)
    outside = (torch.rand(3), F.dropout(torch.ones(100), 0.5))
    assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])


def test_keyinit_dropout_never_draws_unkeyed():
    drop = knn.Dropout(0.5)
    x = torch.ones(10)
    with pytest.raises(UnkeyedRandomnessError, match=r"keyinit.nn.Dropout\(p=0.5\).*outside a keyinit.nn.keyed"):
        drop(x)
    with knn.keyed(nn.Linear(1, 1), 0, step=0), pytest.raises(UnkeyedRandomnessError):
        drop(x)  # inside keyed(), but not inside the keyed model's forward
    assert drop.eval()(x) is x
    assert knn.Dropout(0.0)(x) is x
    with pytest.raises(ValueError, match="between 0 and 1"):
        knn.Dropout(1.5)


def test_keyed_arguments_and_single_use():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="step must be an int"):
        knn.keyed(model, 0, step=1.5)
    with pytest.raises(ValueError, match="sample_offset"):
        knn.keyed(model, 0, step=0, sample_offset=-1)
    with pytest.raises(TypeError, match="nn.Module or a block name"):
        knn.keyed(3, 0, step=0)
    with pytest.raises(TypeError, match="inputs= is for a named block"):
        knn.keyed(model, 0, step=0, inputs=(torch.ones(2),))
    ctx = knn.keyed(model, 0, step=0)
    with ctx:
        with pytest.raises(RuntimeError, match="already inside"):
            with knn.keyed(model, 0, step=1):
                pass
    with pytest.raises(RuntimeError, match="entered once"):
        with ctx:
            pass
    assert not model._forward_hooks and not model._forward_pre_hooks  # hooks removed on exit


def test_a_0d_activation_is_replicated_keyed_by_its_call_alone():
    class Scalar(nn.Module):
        def forward(self, x):
            return F.dropout(x.sum() + 1.0, 0.5)

    x = torch.ones(3)
    expected = knn.functional.dropout(x.sum() + 1.0, 0.5, rng_key=knn.dropout_key(0, step=0, fqn="", ordinal=0))
    for rows in (slice(0, 3), slice(0, 1)):  # a reduced batch is the same draw for every split
        with knn.keyed(model := Scalar(), 0, step=0):
            out = model(x[rows])
        assert (out == 0) == (expected == 0)


# ----------------------------------------------------------------------------- HF Llama


def _hf_llama(attn_implementation: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.3, max_position_embeddings=32,
    )
    config._attn_implementation = attn_implementation
    model = transformers.LlamaForCausalLM(config)
    keyinit.init_model(model, 0, init_method=model._init_weights)
    return model.train()


def test_hf_llama_eager_is_invariant_to_the_batch_split():
    model = _hf_llama("eager")
    ids = (torch.arange(8 * 9).reshape(8, 9) * 7) % 64
    whole = check_splits(model, ids, [((0, 3), (3, 8))], seed=11, step=1, rtol=1e-5, atol=1e-5,  # torch's matmuls
                         forward=lambda m, ids: m(ids).logits)
    with knn.keyed(model, 11, step=2):
        assert not torch.allclose(whole, model(ids).logits, rtol=1e-3, atol=1e-3)  # the attention dropout is live, and keyed by step
    model.eval()
    with knn.keyed(model, 11, step=1):
        assert torch.equal(model(ids).logits, model(ids).logits)


def test_hf_llama_sdpa_attention_dropout_is_keyed_like_eager():
    ids = (torch.arange(4 * 9).reshape(4, 9) * 7) % 64
    logits = {}
    for implementation in ("sdpa", "eager"):
        with knn.keyed(model := _hf_llama(implementation), 11, step=1):
            logits[implementation] = model(ids).logits
    # the same key and global index for the attention probabilities: the same masks (spec 14.5)
    torch.testing.assert_close(logits["sdpa"], logits["eager"], rtol=1e-4, atol=1e-5)

