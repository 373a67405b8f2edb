"""Padding: keyed_collate's and keyed_samples' values of a sample do not depend on how far its batch is
padded (docs/spec.md 16.3-16.4, conformance), and left padding, which moves real tokens to other places,
gets a LeftPaddingWarning from keyed_collate and keyed(samples=) (docs/dropout.md, "Padding and packing")."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.data import KeyedBatch, SampleDict, SamplePositions, keyed_collate, keyed_samples, sample_index
from keyinit.data._positions import attach

LENGTHS = (3, 11, 6, 1, 8)  # words per text (and [CLS] ... [SEP] around them)

COLLATE_MESSAGE = (
    "keyed_collate: the collate function returned a left-padded batch (its attention_mask has padding before "
    "a real token). keyed_collate keys a row's draws by their place in the row, and keyed() a forward's "
    "random values by their coordinates in the sample, so a real token after padding gets the values of "
    "another place, which with dynamic padding depend on how far its batch is padded: pad on the right "
    "(tokenizer.padding_side = \"right\"; DataCollatorWithPadding and DataCollatorForLanguageModeling pad on "
    "the tokenizer's side), or pad every batch to one fixed length (docs/dropout.md, \"Padding and packing\")")
KEYED_MESSAGE = (
    "keyed(samples=): the batch's attention_mask has padding before a real token (left padding). keyed() "
    "names a random value by its coordinates within its sample (not by the token's position in the text), so "
    "a real token after padding gets another coordinate's masks, which with dynamic padding depend on how "
    "far its batch is padded (stream v2, docs/spec.md 14.8, leaves a sample's masks alone only under right "
    "padding): pad on the right (tokenizer.padding_side = \"right\"; DataCollatorWithPadding and "
    "DataCollatorForLanguageModeling pad on the tokenizer's side), or pad every batch to one fixed length "
    "(docs/dropout.md, \"Padding and packing\")")

# batchings of the samples: each alone, pairs with shorter and longer partners, all in two orders
BATCHINGS = [[(i,) for i in range(len(LENGTHS))], [(0, 1), (2, 3), (4,)], [(1, 2), (3, 0), (4,)],
             [(3, 4), (0, 2), (1,)], [tuple(range(len(LENGTHS)))], [(4, 3, 2, 1, 0)]]


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.data.test_data_collate import _tokenizer

    tokenizer = _tokenizer()
    items = [tokenizer(" ".join(f"w{(7 * i + k) % 60}" for k in range(n))) for i, n in enumerate(LENGTHS)]
    return tokenizer, items


def _mlm(hf, side, batchings, pad_to_multiple_of=None):
    """{sample: [(its real input_ids, labels, padded length) in each batch]} over ``batchings``."""
    from transformers import DataCollatorForLanguageModeling

    tokenizer, items = hf
    tokenizer.padding_side = side
    try:
        collate = keyed_collate(DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.4,
                                                                pad_to_multiple_of=pad_to_multiple_of), 3)
        out: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", keyinit.LeftPaddingWarning)
            for batches in batchings:
                for rows in batches:
                    batch = collate(KeyedBatch([items[i] for i in rows], tuple((2, i) for i in rows)))
                    for r, i in enumerate(rows):
                        real = batch["attention_mask"][r] != 0
                        out.setdefault(i, []).append((batch["input_ids"][r][real], batch["labels"][r][real],
                                                      real.numel()))
    finally:
        tokenizer.padding_side = "right"
    return out


def test_mlm_collate_values_do_not_depend_on_the_padded_length(hf):
    """Conformance (docs/spec.md 16.4): DataCollatorForLanguageModeling through keyed_collate, right padding
    to each batch's longest (and to a multiple of 8): every sample's masked positions, [MASK]s and random
    replacement tokens are the same in every batch it lands in, alone or with longer or shorter samples."""
    got = _mlm(hf, "right", BATCHINGS)
    more = _mlm(hf, "right", BATCHINGS[1:3], pad_to_multiple_of=8)
    for i, seen in got.items():
        seen = seen + more[i]
        assert len({length for _, _, length in seen}) >= (2 if i == 1 else 3), (i, [n for _, _, n in seen])  # 1: longest
        for ids, labels, _ in seen[1:]:
            assert torch.equal(ids, seen[0][0]) and torch.equal(labels, seen[0][1]), i
    tokenizer, items = hf
    masked = sum(int((s[0][1] != -100).sum()) for s in got.values())
    assert masked >= 5  # the masks are real (mlm_probability=0.4 of 29 maskable tokens)
    assert any(bool((s[0][0] != torch.tensor(items[i]["input_ids"])).any()) for i, s in got.items())


def test_left_padding_moves_the_values_and_keyed_collate_warns_once_per_batch(hf):
    """Left padding: a sample's real tokens sit after its batch's padding, so its masks change with the
    batch (the reason for the warning); one warning per left-padded batch, none for right padding."""
    left = _mlm(hf, "left", BATCHINGS)
    assert any(not torch.equal(ids, left[i][0][0]) or not torch.equal(labels, left[i][0][1])
               for i in left for ids, labels, _ in left[i][1:])
    from transformers import DataCollatorWithPadding

    tokenizer, items = hf
    collate = keyed_collate(DataCollatorWithPadding(tokenizer), 3)
    seen = []
    for side in ("left", "right"):
        tokenizer.padding_side = side
        try:
            for rows in ((0, 1), (1, 0), (2,), (1, 4)):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    collate(KeyedBatch([items[i] for i in rows], tuple((0, i) for i in rows)))
                seen.append((side, rows, [(w.category, str(w.message), w.filename) for w in caught]))
        finally:
            tokenizer.padding_side = "right"
    for side, rows, caught in seen:
        padded = side == "left" and rows != (2,)  # a batch of one is not padded
        assert caught == ([(keyinit.LeftPaddingWarning, COLLATE_MESSAGE, __file__)] if padded else []), (side, rows)


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.drop = nn.Embedding(16, 8), nn.Dropout(0.5)

    def forward(self, input_ids, attention_mask):
        return self.drop(self.embed(input_ids)) * attention_mask[..., None]


def _batch(mask, positions=SamplePositions(step=0, first=0, rows=2, global_batch_size=2)):
    mask = torch.tensor(mask)
    return attach({"input_ids": torch.ones(mask.shape, dtype=torch.long), "attention_mask": mask}, positions)


@pytest.mark.parametrize("mask,warns", [
    ([[1, 1, 1, 1], [0, 0, 1, 1]], True),     # left padding
    ([[1, 1, 1, 1], [1, 0, 1, 1]], True),     # padding before a real token in the row's middle
    ([[1, 1, 1, 1], [1, 1, 0, 0]], False),    # right padding
    ([[1, 1, 1, 1], [1, 1, 1, 1]], False),    # no padding
    ([[1, 1, 1, 1], [0, 0, 0, 0]], False),    # an empty row: no real token moved
    ([[1.0, 1.0], [0.0, 1.0]], True),         # a float mask
])
def test_keyed_samples_warns_for_left_padding_once_per_block(mask, warns):
    model = _Tagger().train()
    keyinit.init_model(model, seed=0)
    batch = _batch(mask)
    for stream in ("v1", "v2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with knn.keyed(model, 0, step=0, samples=batch, stream=stream):
                for _ in range(3):  # three forwards of one block
                    model(**batch)
        got = [(w.category, str(w.message), w.filename) for w in caught]  # at the line that entered keyed()
        assert got == ([(keyinit.LeftPaddingWarning, KEYED_MESSAGE, __file__)] if warns else []), stream


def test_keyed_samples_reads_what_it_can_and_trusts_keyed_collate():
    model = _Tagger().train()
    keyinit.init_model(model, seed=0)
    quiet = [
        attach({"input_ids": torch.ones(2, 3, dtype=torch.long)}, SamplePositions(0, 0, 2, 2)),  # no mask
        attach({"attention_mask": torch.ones(2, 1, 3, 3)}, SamplePositions(0, 0, 2, 2)),  # 4-D: not read
        SamplePositions(0, 0, 2, 2),
    ]
    listed = attach({"attention_mask": [[1, 1], [0, 1]]}, SamplePositions(0, 0, 2, 2))  # lists (no tensors)
    checked = _batch([[1, 1, 1], [0, 1, 1]])
    object.__setattr__(checked, "keyinit_left_padding", os.getpid())  # keyed_collate warned in this process
    clean = _batch([[1, 1, 1], [0, 1, 1]])
    object.__setattr__(clean, "keyinit_left_padding", 0)  # keyed_collate found no left padding
    worker = _batch([[1, 1, 1], [0, 1, 1]])
    object.__setattr__(worker, "keyinit_left_padding", os.getpid() + 1)  # warned in a DataLoader worker
    for samples, count in [(q, 0) for q in quiet] + [(listed, 1), (checked, 0), (clean, 0), (worker, 1)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with knn.keyed(model, 0, step=0, samples=samples):
                pass
        assert [str(w.message) for w in caught] == [KEYED_MESSAGE] * count, samples


def test_keyed_collate_and_keyed_warn_once_for_one_batch_in_one_process():
    def pad(items):
        mask = [[0] * (3 - len(t)) + [1] * len(t) for t in items]
        ids = [[0] * (3 - len(t)) + t for t in items]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}

    dataset = keyed_samples([[1, 2], [3, 4, 5]], 0)
    batch_of = dataset.__getitems__([sample_index(0, 0), sample_index(1, 0)])
    batch_of = KeyedBatch(list(batch_of), batch_of.refs, SamplePositions(0, 0, 2, 2))
    model = _Tagger().train()
    keyinit.init_model(model, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = keyed_collate(pad, 0)(batch_of)
        assert isinstance(batch, SampleDict)
        with knn.keyed(model, 0, step=0, samples=batch):
            model(**batch)
    assert [str(w.message) for w in caught] == [COLLATE_MESSAGE]


def test_right_padding_keeps_v2_masks_and_left_padding_does_not():
    """Why keyed() warns: under stream v2 a right-padded sample's masks are those of the sample alone;
    left-padded, its real tokens take other coordinates' masks."""
    model = _Tagger().train()
    keyinit.init_model(model, seed=0)
    ids = torch.tensor([[3, 4, 5]])

    def run(batch, mask, first):
        positions = SamplePositions(1, first, batch.shape[0], 4)
        samples = attach({"input_ids": batch, "attention_mask": mask}, positions)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", keyinit.LeftPaddingWarning)
            with knn.keyed(model, 7, step=1, samples=samples, stream="v2"):
                return model(**samples)

    alone = run(ids, torch.ones(1, 3, dtype=torch.long), 1)
    right = run(torch.tensor([[1, 2, 3, 4, 5, 6], [3, 4, 5, 0, 0, 0]]), torch.tensor([[1] * 6, [1] * 3 + [0] * 3]), 0)
    left = run(torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 0, 3, 4, 5]]), torch.tensor([[1] * 6, [0] * 3 + [1] * 3]), 0)
    assert torch.equal(right[1, :3], alone[0])
    assert not torch.equal(left[1, 3:], alone[0])


def test_keyed_samples_draws_do_not_depend_on_the_batch_padding():
    """Conformance (docs/spec.md 16.3): a draw in __getitem__ is over the sample's own shape, before any
    padding, so a sample's values are the same whatever the batch pads it to."""
    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return len(LENGTHS)

        def __getitem__(self, i):
            x = torch.arange(LENGTHS[i], dtype=torch.float32)
            return x + torch.randn(LENGTHS[i]) * torch.bernoulli(torch.full((LENGTHS[i],), 0.5))

    def pad(items):
        return torch.nn.utils.rnn.pad_sequence(list(items), batch_first=True)

    dataset, collate = keyed_samples(Noisy(), 4), keyed_collate(pad, 4)
    seen: dict = {}
    for batches in BATCHINGS:
        for rows in batches:
            batch = collate(dataset.__getitems__([sample_index(i, 1) for i in rows]))
            for r, i in enumerate(rows):
                seen.setdefault(i, []).append((batch[r, :LENGTHS[i]], batch.shape[1]))
    for i, values in seen.items():
        assert all(torch.equal(v, values[0][0]) for v, _ in values), i
        assert len({width for _, width in values}) >= (1 if LENGTHS[i] == max(LENGTHS) else 2), i


def test_only_the_first_dimension_after_the_rows_may_be_padded():
    """The limit of 16.4's statement: element e of a row is its row-major index within the row, so a
    padded dimension after the first (a draw of shape (rows, L, L)) changes the real elements' values,
    while (rows, L, d) with d fixed does not."""
    def draws(items):
        x = torch.nn.utils.rnn.pad_sequence(list(items), batch_first=True)
        return torch.rand(x.shape[0], x.shape[1], 3), torch.rand(x.shape[0], x.shape[1], x.shape[1])

    collate = keyed_collate(draws, 5)
    items = [torch.zeros(n) for n in (2, 5)]
    alone = collate(KeyedBatch([items[0]], ((0, 0),)))
    padded = collate(KeyedBatch(items, ((0, 0), (0, 1))))
    assert torch.equal(alone[0][0], padded[0][0, :2])
    assert not torch.equal(alone[1][0], padded[1][0, :2, :2])
