"""Stream v2's extent-free names of keyed forwards (docs/spec.md 14.8): a sample's masks do not depend on how
far its batch is padded, nor on the batch split; the kernels give the reference's bits; v1 stays selectable.

The masks are keyinit's promise and are compared bitwise; outputs go through torch's floating point and are
compared with a tolerance.
"""

from __future__ import annotations

import json
import re
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit._bits.philox import philox4x32
from keyinit._draw import dispatch
from keyinit._draw.dropout_geometry import constants, make_geometry
from keyinit._draw.names import names_strides
from keyinit._draw.reference_dropout import dropout as reference_dropout
from keyinit.nn import dropout_key

GOLDEN = pathlib.Path(__file__).with_name("golden_names_v2.json")


def _spec_word(k, sample: int, coords: tuple[int, ...], j: int = 0, w: int = 1) -> int:
    """docs/spec.md 14.8 from its text: coordinates of extent-1 dimensions already dropped, innermost last."""
    c = (0, 0, 0) + tuple(coords)
    c1, c2, c3 = c[-1], c[-2], c[-3]
    if len(coords) > 3:  # c_3 .. c_k share counter word 2, b = 32 // (k - 2) bits each, c_3 lowest
        b = 32 // (len(coords) - 2)
        c3 = sum(ci << (b * i) for i, ci in enumerate(reversed(coords[:-2])))
    t = c1 * w + j
    return philox4x32((t >> 2, c2, c3, sample), (k.k0, k.k1))[t & 3]


def test_golden_words_of_the_spec_text():
    data = json.loads(GOLDEN.read_text())
    for case in data["words"]:
        k = keyinit.Key(case["key"][0], case["key"][1], "v2")
        assert _spec_word(k, case["sample"], tuple(case["coords"]), case["j"], case["w"]) == case["word"], case


def test_keyed_masks_are_the_spec_words():
    """A keyed dropout of a (B, L, D) activation keeps element (b, l, d) iff word(K; s=o+b, c=(l, d)) < T."""
    data = json.loads(GOLDEN.read_text())["mask"]
    p, offset = data["p"], data["offset"]
    x = torch.ones(data["shape"])
    drop = nn.Dropout(p).train()
    with knn.keyed(drop, 7, step=3, sample_offset=offset, stream="v2"):
        out = drop(x)
    k = dropout_key(keyinit.key(7, stream="v2"), step=3, fqn="", ordinal=0)
    threshold = constants(p)[0]
    B, L, D = data["shape"]
    expected = torch.tensor([[[_spec_word(k, offset + b, (l, d)) < threshold for d in range(D)] for l in range(L)]
                             for b in range(B)])
    assert torch.equal(out != 0, expected)
    assert data["kept"] == (out != 0).flatten().int().tolist()  # pinned


def _kernel_and_reference(shape, lo, hi, starts, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    g = make_geometry(shape, 0x12345678, 0x9abcdef0, 0.3, lo, starts, (None,) * len(shape), "v2", hi)
    ref = torch.empty_like(x)
    reference_dropout(x, ref, g)
    return dispatch.dropout(x, g), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 4, 6, 33), (5, 1, 130), (2, 3, 1, 1, 9)])
def test_kernel_equals_reference(shape, dtype):
    lo, hi = names_strides(shape[1:])
    out, ref = _kernel_and_reference(shape, lo, hi, (11,) + (0,) * (len(shape) - 1), dtype)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def test_kernel_with_the_sample_innermost_equals_reference():
    """A layout whose innermost local dimension carries the sample (high words per element)."""
    lo, hi = names_strides((6, 5))
    # local (L, D, B): canonical (B, L, D) permuted so the sample is innermost
    out, ref = _kernel_and_reference((6, 5, 4), lo[1:] + lo[:1], hi[1:] + hi[:1], (0, 0, 3), torch.float32)
    assert torch.equal(out, ref)


def test_more_than_three_coordinates_share_the_third_word():
    """A (B, 3, 4, 5, 6) activation (four coordinates, as ProphetNet's n-gram attention or a Conv3d's
    feature maps): c_3 and c_4 share counter word 2, 16 bits each; the kernel gives the spec's words, and
    padding any dimension at its end keeps the real elements' masks."""
    drop = nn.Dropout(0.5).train()
    x = torch.ones(2, 3, 4, 5, 6)
    with knn.keyed(drop, 4, step=1, stream="v2"):
        out = drop(x)
    k = dropout_key(keyinit.key(4, stream="v2"), step=1, fqn="", ordinal=0)
    threshold = constants(0.5)[0]
    expected = torch.tensor([_spec_word(k, b, (c, t, h, w_)) < threshold
                             for b in range(2) for c in range(3) for t in range(4) for h in range(5)
                             for w_ in range(6)]).reshape(x.shape)
    assert torch.equal(out != 0, expected)
    with knn.keyed(drop, 4, step=1, stream="v2"):
        padded = drop(torch.ones(2, 4, 6, 5, 7))
    assert torch.equal(padded[:, :3, :4, :, :6], out)
    five = names_strides((2, 3, 4, 5, 6))[1]  # five coordinates: 10 bits each for c_3 .. c_5
    assert five[1:] == (1 << 20, 1 << 10, 1, 0, 0)
    with pytest.raises(ValueError, match=re.escape(
            "dimension 1 of extent 70000 exceeds stream v2's limit of 65536 for coordinate 4 of a sample with 4 "
            "coordinates")):
        names_strides((70000, 2, 3, 4))


def test_unknown_stream_is_refused():
    with pytest.raises(ValueError, match="unknown stream version 'v9'"):
        knn.keyed(nn.Dropout(0.5), 0, step=0, stream="v9")


def _padded_masks(model, ids, lengths, stream, offset=0):
    """Per dropout call: the (mask, input non-zero) of the forward on ``ids`` right-padded (attention mask)."""
    taps: dict = {}

    def post(name):
        def hook(module, args, out):
            taps.setdefault(name, []).append(((out == 0).detach().clone(), (args[0] != 0).detach().clone()))
        return hook

    handles = [m.register_forward_hook(post(n)) for n, m in model.named_modules() if isinstance(m, nn.Dropout)]
    mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
    try:
        with knn.keyed(model, 0, step=1, sample_offset=offset, stream=stream):
            out = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in handles:
            h.remove()
    return out, taps


def _bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = keyinit.deferred(transformers.BertForMaskedLM, config)
    keyinit.materialize(model, seed=0)
    return model.train()


def _real(t: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Sample ``b``'s elements on its first ``n`` tokens (every token dimension: (L, D) or (H, Lq, Lk))."""
    row = t[b]
    if row.dim() == 3:
        return row[:, :n, :n]
    return row[:n]


@pytest.mark.parametrize("stream", ["v2", "v1"])
def test_dynamic_padding_keeps_every_real_tokens_mask(stream):
    """The whole batch padded to 8, a split padded to each part's own longest, each sample alone: under v2 the
    masks of every real token (hidden and attention dropout) are the whole batch's, bit for bit; under v1 the
    control: they differ."""
    model = _bert()
    lengths = [8, 5, 7, 3]
    ids = (torch.arange(32).reshape(4, 8) * 5 + 3) % 60 + 4
    whole, whole_taps = _padded_masks(model, ids, lengths, stream)
    parts = [(0, [0, 1]), (2, [2, 3])] + [(b, [b]) for b in range(4)]
    differ = 0
    for offset, rows in parts:
        longest = max(lengths[b] for b in rows)
        out, taps = _padded_masks(model, ids[rows][:, :longest], [lengths[b] for b in rows], stream, offset)
        assert taps.keys() == whole_taps.keys()
        for name, calls in taps.items():
            for (mask, _), (wmask, _) in zip(calls, whole_taps[name]):
                for i, b in enumerate(rows):
                    same = torch.equal(_real(mask, i, lengths[b]), _real(wmask, b, lengths[b]))
                    differ += not same
                    if stream == "v2":
                        assert same, (name, rows, b)
        if stream == "v2":
            for i, b in enumerate(rows):
                torch.testing.assert_close(out[i, :lengths[b]], whole[b, :lengths[b]], rtol=1e-5, atol=1e-5)
    if stream == "v1":
        assert differ > 0  # the control: v1's names depend on the padded length


def test_channel_dropout_and_random_ops_do_not_depend_on_padding():
    """Feature dropout and a random op (rand_like) of a padded activation: the real elements' values."""

    class Net(nn.Module):
        def forward(self, x):
            y = F.dropout2d(x.transpose(1, 2).unsqueeze(-1), 0.5, True).squeeze(-1).transpose(1, 2)
            return y + torch.rand_like(x)

    net = Net()
    x = torch.randn(3, 6, 4)
    with knn.keyed(net, 0, step=0, stream="v2"):
        whole = net(x)
    with knn.keyed(net, 0, step=0, sample_offset=1, stream="v2"):
        part = net(torch.cat([x[1:, :4], torch.zeros(2, 1, 4)], 1))  # padded to 5 instead of 6
    assert torch.equal(part[:, :4], whole[1:, :4])


def test_v2_is_the_default_and_v1_is_selectable_with_its_masks_unchanged():
    drop = nn.Dropout(0.5).train()
    x = torch.ones(2, 3, 4)
    with knn.keyed(drop, 0, step=0):
        default = drop(x)
    with knn.keyed(drop, 0, step=0, stream="v2"):
        v2 = drop(x)
    with knn.keyed(drop, 0, step=0, stream="v1"):
        v1 = drop(x)
    with knn.keyed(drop, keyinit.key(0), step=0):  # a Key as the seed: the same block as its int
        of_key = drop(x)
    k = dropout_key(0, step=0, fqn="", ordinal=0)
    assert torch.equal(default, v2) and torch.equal(of_key, v2) and not torch.equal(v1, v2)
    assert torch.equal(v1 != 0, keyinit.random.bernoulli(k, (2, 3, 4), p=0.5))


def test_routed_rows_are_named_as_the_virtual_tensor():
    """Rows picked by values (a router's ``x[idx]``, written back by ``index_add``): each element's mask is
    the one of the same element in its place in the batch, whatever the split and the routing."""

    class Routed(nn.Module):
        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            idx = flat[:, 0].argsort()
            y = F.dropout(flat[idx], 0.5, self.training)
            return torch.zeros(flat.shape).index_add(0, idx, y).view(x.shape)

    net = Routed().train()
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(2)) + 2  # (no zero, so a mask is out == 0)
    with knn.keyed(net, 0, step=0, stream="v2"):
        whole = net(x)
    with knn.keyed(net, 0, step=0, sample_offset=2, stream="v2"):
        part = net(x[2:])
    assert torch.equal(part == 0, whole[2:] == 0)
    plain = nn.Dropout(0.5).train()  # the same names as a dropout of the rows in place
    with knn.keyed(plain, 0, step=0, stream="v2"):
        assert torch.equal(plain(x) == 0, whole == 0)
