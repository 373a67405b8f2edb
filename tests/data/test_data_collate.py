"""keyed_collate: HF's DataCollatorForLanguageModeling gives every sample the same mask and replacement
tokens for any world size, worker count, batch composition, padded length or resume; batch-level
draws and random/numpy.random draws are refused; global RNGs are untouched."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import keyinit
from keyinit import UnkeyedRandomnessError
from keyinit.data import KeyedBatch, KeyedSampler, collate_key, keyed_collate, keyed_samples, sample_index

N, B, SEED = 24, 8, 5


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(60)]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                      special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


class _Texts(torch.utils.data.Dataset):
    """Sample i: 6 + (7 i mod 19) words (so batches pad to different lengths)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.tokenizer(" ".join(f"w{(i * 5 + k) % 60}" for k in range(6 + (7 * i) % 19)))


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from transformers import DataCollatorForLanguageModeling

    tokenizer = _tokenizer()
    return tokenizer, DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)


def _masks(hf, world, workers, steps=6, start_step=0):
    """{(epoch, index): (input_ids, labels) on the sample's real tokens}, from every rank."""
    tokenizer, collator = hf
    out = {}
    for rank in range(world):
        sampler = KeyedSampler(N, 0, global_batch_size=B, rank=rank, world_size=world, num_steps=steps,
                               start_step=start_step)
        refs = list(KeyedSampler(N, 0, global_batch_size=B, rank=rank, world_size=world, num_steps=steps,
                                 start_step=start_step))
        loader = DataLoader(keyed_samples(_Texts(tokenizer), SEED), batch_size=B // world, sampler=sampler,
                            collate_fn=keyed_collate(collator, SEED), num_workers=workers,
                            generator=torch.Generator())  # its workers' base seed: not the global RNG
        rows = [(ids, labels, mask) for batch in loader
                for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"])]
        assert len(rows) == len(refs)
        for ref, (ids, labels, mask) in zip(refs, rows):
            length = int(mask.sum())
            assert bool(mask[:length].all()) and not bool(mask[length:].any())  # right padding
            out[(ref.epoch, int(ref))] = (ids[:length].clone(), labels[:length].clone())
    return out


@pytest.fixture(scope="module")
def reference(hf):
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False)
    got = _masks(hf, 1, 0)
    after = np.random.get_state(legacy=False)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert after["state"]["pos"] == states[2]["state"]["pos"] and np.array_equal(after["state"]["key"],
                                                                                  states[2]["state"]["key"])
    return got


@pytest.mark.parametrize("world,workers", [(2, 0), (4, 0), (1, 2), (2, 2)])
def test_mlm_masks_do_not_depend_on_world_size_or_workers(hf, reference, world, workers):
    got = _masks(hf, world, workers)
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.equal(got[k][0], reference[k][0]) and torch.equal(got[k][1], reference[k][1]), k


def test_mlm_masks_are_real_and_differ_between_epochs_and_survive_resume(hf, reference):
    tokenizer, _ = hf
    masked = sum(int((labels != -100).sum()) for _, labels in reference.values())
    tokens = sum(len(ids) - 2 for ids, _ in reference.values())  # [CLS] and [SEP] are never masked
    assert 0.2 < masked / tokens < 0.4  # mlm_probability=0.3
    mask_id = tokenizer.convert_tokens_to_ids("[MASK]")
    assert any(bool((ids == mask_id).any()) for ids, _ in reference.values())
    for (epoch, index), (ids, labels) in reference.items():
        assert labels[0] == -100 and labels[-1] == -100
    both = [i for (e, i) in reference if e == 0 and (1, i) in reference]
    assert both and any(not torch.equal(reference[(0, i)][1], reference[(1, i)][1]) for i in both)
    resumed = _masks(hf, 4, 0, steps=2, start_step=3)
    assert len(resumed) == 2 * B and all(torch.equal(resumed[k][1], reference[k][1]) for k in resumed)


def test_padded_rows_depend_only_on_their_sample():
    def collate(batch):
        x = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)
        return x, torch.bernoulli(torch.full(x.shape, 0.5)), torch.randint(1000, x.shape), torch.rand(x.shape[0], 2)

    items = {i: torch.zeros(3 + i) for i in range(6)}
    c = keyed_collate(collate, 9)
    one = c(KeyedBatch([items[i] for i in (0, 1, 2)], ((0, 0), (0, 1), (0, 2))))
    two = c(KeyedBatch([items[i] for i in (5, 2)], ((0, 5), (0, 2))))  # longer padding, another row
    for a, b in zip(one[1:], two[1:]):
        width = a.shape[1] if a.dim() == 2 else None
        assert torch.equal(a[2, :5] if width else a[2], b[1, :5] if width else b[1])
    # the definition (docs/spec.md 16.4): row of sample i, element e = flat index i * 2**24 + e
    want = keyinit.random.randint(collate_key(9, 0, 1, 0), (2**38, 2**24), low=0, high=1000,
                                  region=(torch.tensor([0, 1, 2]), slice(0, one[2].shape[1])))
    assert torch.equal(one[2], want)
    bits = keyinit.random.bits(collate_key(9, 0, 0, 0), (2**38, 2**24), region=(torch.tensor([5]), slice(0, 8)))
    assert torch.equal(two[1][0], (bits[0] < round(0.5 * 2**32)).float())
    assert not torch.equal(one[2][0, :3], c(KeyedBatch([items[0]], ((1, 0),)))[2][0, :3])  # another epoch


def test_refusals_name_the_op_and_leave_state_alone():
    batch = KeyedBatch([torch.zeros(4), torch.ones(4), torch.ones(4)], ((0, 3), (0, 4), (2, 5)))
    cases = [
        (lambda b: torch.randperm(3), r"randperm\(\).*for the batch as a whole"),
        (lambda b: torch.rand(()), r"rand\(\).*shape \(\), not one row per sample of the batch's 3"),
        (lambda b: torch.rand(2, 3), r"shape \(2, 3\), not one row per sample"),
        (lambda b: torch.poisson(torch.ones(3)), r"poisson\(\)"),
        (lambda b: random.random(), r"drew from random's global state"),
        (lambda b: np.random.rand(3), r"drew from numpy.random's global state"),
    ]
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False)
    for fn, message in cases:
        with pytest.raises(UnkeyedRandomnessError, match=r"keyed_collate \(a batch of 3 rows.*" + message):
            keyed_collate(fn, 0)(batch)
    after = np.random.get_state(legacy=False)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert after["state"]["pos"] == states[2]["state"]["pos"] and np.array_equal(after["state"]["key"],
                                                                                  states[2]["state"]["key"])
    with pytest.raises(TypeError, match=r"does not say its samples' \(epoch, index\).*keyed_samples"):
        keyed_collate(None, 0)([torch.zeros(2)])
    with pytest.raises(ValueError, match=r"sample index 274877906944 of epoch 0 is out of range"):
        keyed_collate(None, 0)(KeyedBatch([torch.zeros(2)], ((0, 2**38),)))
    default = keyed_collate(None, 0)(keyed_samples([torch.zeros(2), torch.ones(2)], 0).__getitems__(
        [sample_index(1, 0), sample_index(0, 0)]))
    assert torch.equal(default, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # default_collate
