"""numpy.random and Python's random inside a keyed forward (docs/spec.md 14.7).

A forward of one sample draws from a stream keyed by that sample; a forward of several samples
that draws is refused unless ``host_random`` declares how (``"forward"``: keyed by its rows;
``"replicated"``: the same stream in every forward); the global states are never read or moved.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.keys import fold_in, key
from keyinit.nn._ops.keys import keyed_module_key


class SpecAugmentLike(nn.Module):
    """Draws on the host as HF's _compute_mask_indices does: one value per batch, then one per row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = random.random()
        starts = np.random.randint(0, x.shape[1], size=x.shape[0])
        mask = torch.ones_like(x)
        for row, start in enumerate(starts):
            mask[row, int(start)] = 0
        return x * mask * scale


def _states() -> tuple:
    return np.random.get_state(), random.getstate()


def _same_states(a: tuple, b: tuple) -> bool:
    (na, pa), (nb, pb) = a, b
    numpy_same = na[0] == nb[0] and np.array_equal(na[1], nb[1]) and na[2:] == nb[2:]
    return numpy_same and pa == pb


def _host_base(seed: int, step: int, fqn: str = "") -> keyinit.Key:
    """H of spec 14.7, from its text: the module key of the root forward, folded with "host"."""
    return fold_in(keyed_module_key(key(seed), step, fqn), "host")


def _stream(base: keyinit.Key, start: int, count: int) -> keyinit.Key:
    return fold_in(fold_in(fold_in(base, "samples"), start), count)


def _expected(k: keyinit.Key, rows: int, width: int) -> torch.Tensor:
    """SpecAugmentLike's output on ones((rows, width)) with generators seeded from ``k`` (spec 14.7)."""
    kp, kn = fold_in(k, "python.random"), fold_in(k, "numpy.random")
    scale = random.Random(kp.k0 | (kp.k1 << 32)).random()
    starts = np.random.RandomState([kn.k0, kn.k1]).randint(0, width, size=rows)
    out = torch.full((rows, width), scale)
    for row, start in enumerate(starts):
        out[row, int(start)] = 0
    return out


def test_a_forward_of_one_sample_draws_that_samples_stream_in_any_split():
    np.random.seed(1)
    random.seed(1)
    before = _states()
    model, x = SpecAugmentLike(), torch.ones(4, 6)
    with knn.keyed(model, 5, step=0) as ctx:
        rows = []
        for r in range(4):
            with ctx.micro_batch(r):
                rows.append(model(x[r:r + 1]))
    assert _same_states(before, _states())
    for r in range(4):  # the values of spec 14.7: (H, "samples", sample, 1)
        assert torch.equal(rows[r], _expected(_stream(_host_base(5, 0), r, 1), 1, 6))
    assert len({tuple(row.flatten().tolist()) for row in rows}) == 4  # each sample its own values
    np.random.seed(123)  # another global state, another rank holding samples 2 and 3: the same values
    random.seed(123)
    with knn.keyed(model, 5, step=0, sample_offset=2) as ctx:
        with ctx.micro_batch(1):
            assert torch.equal(model(x[3:]), rows[3])
        with ctx.micro_batch(0):
            assert torch.equal(model(x[2:3]), rows[2])
    with knn.keyed(model, 5, step=1, sample_offset=2):
        assert not torch.equal(model(x[2:3]), rows[2])  # another step: other values


def test_a_forward_of_several_samples_that_draws_is_refused_and_leaves_the_states():
    np.random.seed(7)
    random.seed(7)
    before = _states()
    model = SpecAugmentLike()
    result = None
    with pytest.raises(keyinit.UnkeyedRandomnessError) as err:
        with knn.keyed(model, 5, step=0, sample_offset=2):
            result = model(torch.ones(2, 6))
    assert result is None  # the output never reached the caller
    message = str(err.value)
    assert "keyed(SpecAugmentLike): the forward of the root module over samples 2..3 (2 rows)" in message
    assert "drew from random and numpy.random's global state" in message
    assert "micro_batch" in message and "host_random='forward'" in message and "host_random='replicated'" in message
    assert _same_states(before, _states())
    with knn.keyed(model, 5, step=0):  # the context was left cleanly: a later keyed forward runs
        model(torch.ones(1, 6))


def test_only_a_draw_is_refused():
    class Reads(nn.Module):  # looks at the generators' states without drawing
        def forward(self, x):
            np.random.get_state()
            random.getstate()
            return x * 2

    with knn.keyed(model := Reads(), 0, step=0):
        assert torch.equal(model(torch.ones(4, 3)), torch.full((4, 3), 2.0))

    class NumpyOnly(nn.Module):
        def forward(self, x):
            return x * float(np.random.rand())

    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"drew from numpy.random's global state"):
        with knn.keyed(model := NumpyOnly(), 0, step=0):
            model(torch.ones(4, 3))


def test_the_forwards_own_error_is_not_replaced():
    class Fails(nn.Module):
        def forward(self, x):
            np.random.rand()
            raise ValueError("the model's own error")

    before = _states()
    with pytest.raises(ValueError, match="the model's own error"):
        with knn.keyed(model := Fails(), 0, step=0):
            model(torch.ones(4, 3))
    assert _same_states(before, _states())


def test_host_random_forward_keys_a_forward_by_its_rows():
    model, x = SpecAugmentLike(), torch.ones(4, 6)
    np.random.seed(3)
    with knn.keyed(model, 5, step=0, host_random="forward"):
        whole = model(x)
    assert torch.equal(whole, _expected(_stream(_host_base(5, 0), 0, 4), 4, 6))
    np.random.seed(4)  # the same rows on another rank, another global state: the same values
    before = _states()
    with knn.keyed(model, 5, step=0, host_random="forward"):
        assert torch.equal(model(x), whole)
    assert _same_states(before, _states())
    # other rows get their own stream (not rows 0:2's values), and a split changes them: documented
    with knn.keyed(model, 5, step=0, sample_offset=2, host_random="forward"):
        assert torch.equal(model(x[2:]), _expected(_stream(_host_base(5, 0), 2, 2), 2, 6))
    with knn.keyed(model, 5, step=0, sample_offset=2, host_random="forward"):  # one sample: its own stream
        assert torch.equal(model(x[2:3]), _expected(_stream(_host_base(5, 0), 2, 1), 1, 6))


def test_host_random_replicated_gives_every_forward_one_stream():
    model, x = SpecAugmentLike(), torch.ones(4, 6)
    with knn.keyed(model, 5, step=0, host_random="replicated") as ctx:
        whole = model(x)
        with ctx.micro_batch(2):
            later = model(x[2:])
    assert torch.equal(whole, _expected(_host_base(5, 0), 4, 6))
    assert torch.equal(later, _expected(fold_in(_host_base(5, 0), 1), 2, 6))  # a repeat of rows 2..3: r = 1
    with knn.keyed(model, 5, step=0, sample_offset=2, host_random="replicated"):
        assert torch.equal(model(x[2:]), whole[:2])  # per-row draws: row r of every forward alike


def test_a_forward_without_a_batch_draws_the_replicated_stream():
    seen = {}

    class Probe(nn.Module):
        def forward(self, scale):
            seen["np"] = np.random.randint(0, 2**31, size=3)
            seen["py"] = random.random()
            return scale

    with knn.keyed(model := Probe(), 5, step=2):
        model(torch.tensor(1.0))  # a 0-d input holds no batch
    h = _host_base(5, 2)
    kn, kp = fold_in(h, "numpy.random"), fold_in(h, "python.random")
    assert np.array_equal(seen["np"], np.random.RandomState([kn.k0, kn.k1]).randint(0, 2**31, size=3))
    assert seen["py"] == random.Random(kp.k0 | (kp.k1 << 32)).random()


def test_a_named_block_of_several_samples_refuses_a_host_draw():
    before = _states()
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"keyed block 'augment.pick' over samples 0..2"):
        with knn.keyed("augment.pick", 0, step=0, inputs=(torch.ones(3, 2),)):
            random.random()
    assert _same_states(before, _states())
    with knn.keyed("augment.pick", 0, step=0, sample_offset=1, inputs=(torch.ones(1, 2),)):
        one = random.random()  # one sample: its stream
    k = fold_in(_stream(fold_in(keyed_module_key(key(0), 0, "augment.pick"), "host"), 1, 1), "python.random")
    assert one == random.Random(k.k0 | (k.k1 << 32)).random()


def test_index_dim0_refuses_host_draws():
    before = _states()
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"index='dim0'\) drew from random"):
        with knn.keyed(model := SpecAugmentLike(), 0, step=0, index="dim0"):
            model(torch.ones(1, 6))
    assert _same_states(before, _states())


def test_host_random_is_checked():
    with pytest.raises(ValueError, match=r"host_random must be one of \('sample', 'forward', 'replicated'\)"):
        knn.keyed(nn.Linear(2, 2), 0, step=0, host_random="batch")


# ----------------------------------------------------------------------------- HF's SpecAugment


def _wav2vec2():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(2, 2), conv_kernel=(3, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.4, mask_time_length=2, mask_feature_prob=0.0,
        hidden_dropout=0.1, activation_dropout=0.1, attention_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.1)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.Wav2Vec2ForCTC(config).train()
    with torch.no_grad():
        model.wav2vec2.masked_spec_embed.fill_(1000.0)  # a masked frame is recognisable at the encoder's input
    masks: list[torch.Tensor] = []
    model.wav2vec2.encoder.register_forward_pre_hook(lambda m, args: masks.append((args[0] == 1000.0).all(-1)))
    return model, masks


def _rows(model, masks, x, offset, rows, **options):
    """Each of ``rows`` (indices into x) as a 1-row micro-batch of one keyed block at ``offset``."""
    masks.clear()
    with knn.keyed(model, 0, step=0, sample_offset=offset, **options) as ctx:
        logits = []
        for r in rows:
            with ctx.micro_batch(r - offset):
                logits.append(model(x[r:r + 1]).logits)
    return torch.cat(masks), torch.cat(logits)


def test_wav2vec2_specaugment_is_keyed_per_sample_and_refused_over_a_batch():
    model, masks = _wav2vec2()
    x = torch.randn(1, 120, generator=torch.Generator().manual_seed(0)).repeat(4, 1)  # 4 equal samples
    before = _states()
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"keyed\(Wav2Vec2ForCTC\).* over samples 0..3 .*"
                                                              r"drew from numpy.random's global state"):
        with knn.keyed(model, 0, step=0):
            model(x)
    assert _same_states(before, _states())

    whole_masks, whole = _rows(model, masks, x, 0, range(4))
    assert whole_masks.any(dim=1).all() and not whole_masks.all()  # SpecAugment is live in every sample
    assert len({tuple(m.tolist()) for m in whole_masks}) == 4  # equal inputs, four samples' own masks
    assert _same_states(before, _states())
    np.random.seed(99)  # another rank's global state: samples 2 and 3 alone, in another order
    random.seed(99)
    before = _states()
    part_masks, part = _rows(model, masks, x, 2, [3, 2])
    assert torch.equal(part_masks, whole_masks[[3, 2]])
    torch.testing.assert_close(part, whole[[3, 2]], rtol=1e-4, atol=1e-4)
    for r in range(4):  # a keyed forward per sample, its own sample_offset: the same
        alone_masks, alone = _rows(model, masks, x, r, [r])
        assert torch.equal(alone_masks, whole_masks[r:r + 1])
        torch.testing.assert_close(alone, whole[r:r + 1], rtol=1e-4, atol=1e-4)
    masks.clear()
    with knn.keyed(model, 0, step=1) as ctx, ctx.micro_batch(0):
        model(x[:1])
    assert not torch.equal(masks[0], whole_masks[:1])  # another step: another mask
    assert _same_states(before, _states())


def test_wav2vec2_specaugment_with_host_random_forward():
    model, masks = _wav2vec2()
    x = torch.randn(1, 120, generator=torch.Generator().manual_seed(0)).repeat(4, 1)
    first = []
    for seed in (1, 2):  # two ranks with other global states, the same rows: the same masks
        np.random.seed(seed)
        before = _states()
        masks.clear()
        with knn.keyed(model, 0, step=0, sample_offset=2, host_random="forward"):
            model(x[2:])
        assert _same_states(before, _states())
        first.append(masks[0])
    assert torch.equal(first[0], first[1]) and first[0].any()
    masks.clear()
    with knn.keyed(model, 0, step=0, host_random="forward"):
        model(x[:2])
    assert not torch.equal(masks[0], first[0])  # rows 0..1 are not given rows 2..3's masks
