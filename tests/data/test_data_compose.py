"""KeyedSampler's default items (SampleIndex: ints that carry their epoch) feed keyed_samples with no
option, and are plain ints to plain datasets and DataLoader code."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from keyinit.data import KeyedBatch, KeyedSampler, SampleIndex, SampleRef, keyed_samples, sample_index


class _Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.full((3,), float(i)) + torch.randn(3)


def test_default_items_carry_the_epoch_and_are_plain_ints():
    items = list(KeyedSampler(10, 0, global_batch_size=4, num_steps=3))
    refs = list(KeyedSampler(10, 0, global_batch_size=4, num_steps=3, yield_epoch=True))
    assert all(isinstance(x, SampleIndex) and type(x) is not int for x in items)
    assert [(int(x), x.epoch) for x in items] == [(r.index, r.epoch) for r in refs]
    assert items == [r.index for r in refs] and [x.epoch for x in items[-2:]] == [1, 1]
    x = items[-1]
    assert pickle.loads(pickle.dumps(x)).epoch == 1 and pickle.loads(pickle.dumps(x)) == x
    assert hash(x) == hash(int(x)) and type(x + 1) is int and list(range(10))[x] == int(x)
    assert torch.equal(torch.utils.data.default_collate(items), torch.tensor([r.index for r in refs]))
    batches = list(KeyedSampler(10, 0, global_batch_size=4, num_steps=3).batch_sampler())
    assert sum(batches, []) == items and [x.epoch for x in sum(batches, [])] == [x.epoch for x in items]
    plain = list(KeyedSampler(10, 0, global_batch_size=4, num_steps=3, yield_epoch=False))
    assert plain == items and all(type(x) is int for x in plain)
    assert repr(sample_index(3, 2)) == "sample_index(3, epoch=2)"
    with pytest.raises(ValueError, match=r"sample_index: epoch must be an int >= 0, got -1"):
        sample_index(3, -1)
    with pytest.raises(TypeError, match=r"sample_index: index must be an int >= 0, got bool True"):
        sample_index(True, 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_sampler_feeds_keyed_samples_and_plain_datasets_with_no_option(workers):
    def load(dataset, **kw):
        sampler = KeyedSampler(10, 0, global_batch_size=4, num_steps=4, **kw)
        return torch.cat(list(DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)))

    keyed = keyed_samples(_Noisy(), 7)
    refs = list(KeyedSampler(10, 0, global_batch_size=4, num_steps=4, yield_epoch=True))
    want = torch.stack([keyed[ref] for ref in refs])
    assert torch.equal(load(keyed), want)                   # the default items: no option needed
    assert torch.equal(load(keyed, yield_epoch=True), want)  # the old flag still works
    assert not torch.equal(keyed[sample_index(3, 0)], keyed[sample_index(3, 1)])
    assert torch.equal(keyed[sample_index(3, 1)], keyed[(3, 1)])
    plain = list(range(100, 110))                             # a plain dataset, DataLoader(shuffle=False)-style
    assert load(plain).tolist() == [100 + r.index for r in refs]
    ordered = KeyedSampler(10, 0, global_batch_size=4, num_steps=3, shuffle=False)
    assert [plain[i] for i in ordered] == plain + plain[:2]


def test_getitems_says_each_items_epoch_and_index():
    keyed = keyed_samples(_Noisy(), 7)
    items = list(KeyedSampler(10, 0, global_batch_size=4, num_steps=3))[6:10]
    batch = keyed.__getitems__(items)
    assert isinstance(batch, KeyedBatch) and isinstance(batch, list)
    assert batch.refs == tuple((x.epoch, int(x)) for x in items)
    assert all(torch.equal(a, keyed[x]) for a, x in zip(batch, items))
    again = pickle.loads(pickle.dumps(batch))
    assert again.refs == batch.refs and all(torch.equal(a, b) for a, b in zip(again, batch))
    # an index's own epoch wins over the wrapper's default
    assert torch.equal(keyed_samples(_Noisy(), 7, epoch=5)[sample_index(2, 1)], keyed[SampleRef(2, 1)])
    with pytest.raises(TypeError, match=r"plain index 3, which does not say the epoch"):
        keyed.__getitems__([3])


def test_default_items_are_made_as_they_are_handed_out():
    """SampleIndex instances are tracked by the garbage collector: the sampler makes them a step at a
    time (so they die young), never a whole chunk of thousands at once; batch_sampler() makes one step's."""
    import gc

    def alive() -> int:
        return sum(1 for o in gc.get_objects() if isinstance(o, SampleIndex))

    before = alive()
    it = iter(KeyedSampler(50_000, 0, global_batch_size=64))
    first = [int(next(it)) for _ in range(100)]
    assert alive() - before <= 64
    batches = iter(KeyedSampler(50_000, 0, global_batch_size=64).batch_sampler())
    step = next(batches)
    assert len(step) == 64 and alive() - before <= 2 * 64
    assert [int(x) for x in step] == first[:64]
