"""``keyed(model, seed, step=step, samples=batch)``: the batch keyinit.data made says where its rows sit.

One process, 2 ranks (in process, and on real gloo ranks, where ``keyed`` without ``sample_offset``
is refused) and 2 ranks x 2 micro-batches (gradient accumulation), each with ``samples=`` the
collated batch of a DataLoader over ``keyed_samples`` with ``KeyedSampler.batch_sampler`` and
``keyed_collate`` (fixed padded length): every sample's dropout masks are bitwise the one-process
run's, a resume from the sampler's ``state_dict`` included. Errors are exact.
"""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import keyinit.nn as knn
from keyinit.data import (KeyedBatch, KeyedSampler, SampleDict, SampleList, SamplePositions, keyed_collate,
                          keyed_samples, sample_positions)
from tests._support.dist import requires_gloo, run_distributed

N, B, LENGTH, SEED, DATA_SEED, STEPS = 24, 8, 6, 5, 9, 3


class Tokens(Dataset):
    """Sample ``i``: ``LENGTH`` tokens (a fixed padded length) and its index."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return {"tokens": (torch.arange(LENGTH) * 7 + i) % 50 + 1, "idx": torch.tensor(int(i))}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # (the test's own weights; keyed() never reads the global generator)
        self.emb = nn.Embedding(51, 8)
        self.drop = nn.Dropout(0.5)
        self.proj = nn.Linear(8, 8)
        self.drop2 = nn.Dropout(0.3)

    def forward(self, tokens):
        return self.drop2(self.proj(self.drop(self.emb(tokens))))


def _loader(rank: int, world: int, micro, sampler=None, workers: int = 0):
    sampler = sampler or KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=rank, world_size=world,
                                      num_steps=STEPS)
    return DataLoader(keyed_samples(Tokens(), DATA_SEED), batch_sampler=sampler.batch_sampler(micro),
                      collate_fn=keyed_collate(None, DATA_SEED), num_workers=workers), sampler


def _train(model: Net, batches, masks: dict, steps_of=None) -> None:
    """Forward and backward each batch under keyed(samples=batch); record each sample's dropout masks."""
    seen: list = []
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: seen.append((name, (o == 0) & (i[0] != 0))))
             for name, m in (("drop", model.drop), ("drop2", model.drop2))]
    try:
        for batch in batches:
            step = sample_positions(batch).step if steps_of is None else steps_of(batch)
            seen.clear()
            with knn.keyed(model, SEED, step=step, samples=batch):
                model(batch["tokens"]).sum().backward()
            for name, dropped in seen:
                for row, idx in enumerate(batch["idx"].tolist()):
                    masks[(step, idx, name)] = dropped[row].clone()
    finally:
        for h in hooks:
            h.remove()


def _masks(world: int, micro=None, ranks=None) -> dict:
    masks: dict = {}
    for rank in range(world) if ranks is None else ranks:
        _train(Net(), _loader(rank, world, micro)[0], masks)
    return masks


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) == STEPS * B * 2
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _masks(1)


def test_masks_do_not_depend_on_ranks_or_micro_batches(one_process):
    # not trivially equal: every sample of the run has its own masks
    rows = [v for (s, idx, name), v in one_process.items() if name == "drop"]
    assert len({tuple(r.flatten().tolist()) for r in rows}) == len(rows) == STEPS * B
    _assert_same(_masks(2), one_process)
    _assert_same(_masks(2, micro=2), one_process)
    _assert_same(_masks(1, micro=4), one_process)


def test_samples_equals_the_hand_computed_offset(one_process):
    """samples= is the sample_offset rank * local_batch + micro_batch * micro_size, no more."""
    masks: dict = {}
    model = Net()
    for rank in range(2):
        sampler = KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=rank, world_size=2, num_steps=STEPS)
        data = keyed_samples(Tokens(), DATA_SEED)
        for step in range(STEPS):
            for micro in range(2):
                refs = sampler.local_batch(step)[micro * 2:(micro + 1) * 2].tolist()
                batch = keyed_collate(None, DATA_SEED)(KeyedBatch([data[(i, 0)] for i in refs],
                                                                  tuple((0, i) for i in refs)))
                seen: list = []
                hook = model.drop.register_forward_hook(lambda m, i, o: seen.append((o == 0) & (i[0] != 0)))
                with knn.keyed(model, SEED, step=step, sample_offset=rank * 4 + micro * 2):
                    model(batch["tokens"])
                hook.remove()
                for row, idx in enumerate(batch["idx"].tolist()):
                    masks[(step, idx, "drop")] = seen[0][row]
    assert masks.keys() == {k for k in one_process if k[2] == "drop"}
    assert all(torch.equal(v, one_process[k]) for k, v in masks.items())


def test_resume_from_the_sampler_state(one_process):
    """A run stopped after step 0 and resumed from the sampler's state_dict (the step is in it) goes on with
    the same masks; the step keyed() needs is the batch's own (sample_positions(batch).step)."""
    loader, sampler = _loader(1, 2, 2)
    masks: dict = {}
    it = iter(loader)
    _train(Net(), [next(it), next(it)], masks)  # step 0's two micro-batches
    state = pickle.loads(pickle.dumps(sampler.state_dict()))
    assert state["step"] == 1
    resumed = KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=1, world_size=2, num_steps=STEPS - 1)
    resumed.load_state_dict(state)
    _train(Net(), _loader(1, 2, 2, sampler=resumed)[0], masks)
    _train(Net(), _loader(0, 2, 2)[0], masks)
    _assert_same(masks, one_process)


def test_worker_processes_carry_the_positions(one_process):
    masks: dict = {}
    for rank in range(2):
        loader, _ = _loader(rank, 2, 2, workers=1)
        _train(Net(), loader, masks)
    _assert_same(masks, one_process)


def _encoded(items):
    import transformers

    return transformers.BatchEncoding({"tokens": torch.stack([x["tokens"] for x in items]),
                                       "idx": torch.stack([x["idx"] for x in items])})


def test_worker_processes_carry_the_positions_of_a_batch_encoding(one_process):
    """HF collators return a ``BatchEncoding``, whose pickling keeps only its data: across a worker
    process (and a copy, as ``pin_memory`` makes) its batch still carries its positions."""
    pytest.importorskip("transformers")
    masks: dict = {}
    for rank in range(2):
        sampler = KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=rank, world_size=2, num_steps=STEPS)
        loader = DataLoader(keyed_samples(Tokens(), DATA_SEED), batch_sampler=sampler.batch_sampler(2),
                            collate_fn=keyed_collate(_encoded, DATA_SEED), num_workers=1)
        batches = list(loader)
        assert all(type(b).__name__ == "BatchEncoding" for b in batches)
        _train(Net(), [copy.copy(b) for b in batches], masks)
    _assert_same(masks, one_process)


def test_what_carries_the_positions():
    loader, _ = _loader(1, 2, 2)
    batch = next(iter(loader))
    want = SamplePositions(step=0, first=4, rows=2, global_batch_size=B)
    assert type(batch) is SampleDict and sample_positions(batch) == want
    assert sample_positions(pickle.loads(pickle.dumps(batch))) == want
    indices = next(iter(KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=1, world_size=2).batch_sampler(2)))
    assert type(indices) is SampleList and sample_positions(indices) == want
    items = keyed_samples(Tokens(), DATA_SEED).__getitems__(indices)
    assert sample_positions(items) == want and sample_positions(pickle.loads(pickle.dumps(items))) == want
    # a collate function returning a tuple, a tensor, or a BatchEncoding (whose .to(device) returns itself)
    as_tuple = keyed_collate(lambda b: (b[0]["tokens"], b[1]["tokens"]), 0)(items)
    assert isinstance(as_tuple, tuple) and sample_positions(as_tuple) == want
    as_tensor = keyed_collate(lambda b: torch.stack([x["tokens"] for x in b]), 0)(items)
    assert sample_positions(as_tensor) == want
    transformers = pytest.importorskip("transformers")
    encoded = keyed_collate(lambda b: transformers.BatchEncoding({"tokens": torch.stack([x["tokens"] for x in b])}),
                            0)(items)
    assert sample_positions(encoded.to("cpu")) == want
    assert isinstance(encoded, transformers.BatchEncoding)
    for again in (pickle.loads(pickle.dumps(encoded)), copy.copy(encoded), copy.deepcopy(encoded)):
        assert isinstance(again, transformers.BatchEncoding) and sample_positions(again) == want
        assert again.keys() == encoded.keys() and torch.equal(again["tokens"], encoded["tokens"])
    plain = transformers.BatchEncoding({"tokens": torch.zeros(2)})
    assert type(pickle.loads(pickle.dumps(plain))) is transformers.BatchEncoding  # (others untouched)
    assert want.slice(1, 2) == SamplePositions(step=0, first=5, rows=1, global_batch_size=B)


def test_batches_pickle_under_their_module_paths_old_and_new():
    """``SamplePositions`` lives in ``keyinit._samples.positions`` (``keyinit.nn`` reads it without importing
    ``keyinit.data``); a batch pickled when it was ``keyinit.data._positions``' still loads, and the
    collated containers keep the module path their pickles have always named."""
    batch = next(iter(_loader(1, 2, 2)[0]))
    want = SamplePositions(step=0, first=4, rows=2, global_batch_size=B)
    new = pickle.dumps(batch, protocol=2)  # protocol 2: classes named by "module\nname\n" (GLOBAL)
    assert b"keyinit.data._positions\nSampleDict\n" in new
    assert b"keyinit._samples.positions\nSamplePositions\n" in new
    old = new.replace(b"keyinit._samples.positions\nSamplePositions\n", b"keyinit.data._positions\nSamplePositions\n")
    assert old != new
    for data in (new, old, pickle.dumps(batch)):
        again = pickle.loads(data)
        assert type(again) is SampleDict and sample_positions(again) == want
        assert type(sample_positions(again)) is SamplePositions
        assert again.keys() == batch.keys() and all(torch.equal(again[k], batch[k]) for k in batch)


def test_errors():
    model = Net()
    loader, _ = _loader(0, 2, 2)
    batch = next(iter(loader))
    with pytest.raises(ValueError, match=re.escape(
            "keyed: give samples= or sample_offset=, not both (samples= says the batch's first sample; "
            "sample_offset= is that number given by hand)")):
        knn.keyed(model, SEED, step=0, samples=batch, sample_offset=0)
    with pytest.raises(ValueError, match=re.escape(
            "keyed: samples= holds rows of step 0 (KeyedSampler's step), but step=1: the sampler's steps must be "
            "the optimizer's")):
        knn.keyed(model, SEED, step=1, samples=batch)
    moved = {k: v.to("cpu") for k, v in batch.items()}  # a new dict: carries nothing
    no_positions = ("keyed: samples= got a dict that carries no sample positions; expected the batch a DataLoader "
                    "made over keyinit.data.keyed_samples(dataset, seed) with batch_sampler=KeyedSampler.batch_"
                    "sampler(...) and collate_fn=keyinit.data.keyed_collate(...) (the object it yielded, not a new "
                    "dict made from it), its KeyedBatch, or a keyinit.data.SamplePositions; or pass sample_offset= "
                    "instead")
    with pytest.raises(TypeError, match=re.escape(no_positions)):
        knn.keyed(model, SEED, step=0, samples=moved)
    # a DataLoader with sampler= (its own BatchSampler makes plain lists): the batch says no positions
    plain = DataLoader(keyed_samples(Tokens(), DATA_SEED), batch_size=2, collate_fn=keyed_collate(None, DATA_SEED),
                       sampler=KeyedSampler(N, DATA_SEED, global_batch_size=B))
    with pytest.raises(TypeError, match=re.escape(no_positions)):
        knn.keyed(model, SEED, step=0, samples=next(iter(plain)))
    with pytest.raises(ValueError, match=re.escape(
            "micro_batch_size=3 does not divide this rank's batch of global_batch_size / world_size = 4 samples a "
            "step")):
        KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=0, world_size=2).batch_sampler(3)
    with pytest.raises(ValueError, match=re.escape("micro_batch_size must be")):
        KeyedSampler(N, DATA_SEED, global_batch_size=B).batch_sampler(0)
    with pytest.raises(ValueError, match=re.escape(
            "SamplePositions: rows 6 .. 8 are not within the step's global batch of 8")):
        SamplePositions(step=0, first=6, rows=3, global_batch_size=B)
    with pytest.raises(ValueError, match=re.escape("KeyedBatch: positions must be None or the SamplePositions of "
                                                   "its 1 rows, got")):
        KeyedBatch([1], ((0, 1),), SamplePositions(0, 0, 2, B))


def _rank_masks() -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net()
    try:
        with knn.keyed(model, SEED, step=0):
            pass
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    masks: dict = {}
    _train(model, _loader(rank, world, 2)[0], masks)  # no rank, no offset: KeyedSampler reads torch.distributed's
    return {"refused": refused, "masks": masks}


@requires_gloo
def test_gloo_ranks_need_no_sample_offset(one_process):
    results = run_distributed(_rank_masks, 2)
    assert all(r["refused"].startswith("keyed: torch.distributed is initialized with 2 ranks, so sample_offset "
                                       "must be given") for r in results)
    _assert_same({**results[0]["masks"], **results[1]["masks"]}, one_process)


def test_a_forward_must_hold_the_rows_of_its_samples():
    """A batch flattened into one row (``DataCollatorWithFlattening``'s ``(1, N)``), or rows cut from it
    outside ``micro_batch``, would key other samples' rows: refused, naming the rows and the way out."""
    loader, _ = _loader(1, 2, None)
    batch = next(iter(loader))
    model = Net()
    flat = batch["tokens"].reshape(1, -1)
    with pytest.raises(ValueError, match=re.escape(
            "keyed: samples= is a batch of 4 rows (its SamplePositions), but the forward of 'Net' holds 1 rows "
            "(dimension 0 of a tensor of shape (1, 24)): each row of a keyed forward is one sample")):
        with knn.keyed(model, SEED, step=0, samples=batch):
            model(flat)
    with pytest.raises(ValueError, match="holds 2 rows"):
        with knn.keyed(model, SEED, step=0, samples=batch):
            model(batch["tokens"][:2])
    with pytest.raises(ValueError, match=re.escape("holds 2 rows (dimension 0 of a tensor of shape (2, 6), "
                                                   "from row 3 in a micro_batch)")):
        with knn.keyed(model, SEED, step=0, samples=batch) as ctx, ctx.micro_batch(3):
            model(batch["tokens"][2:])
    with knn.keyed(model, SEED, step=0, samples=batch) as ctx:  # micro-batches within the batch: keyed
        for offset in (0, 2):
            with ctx.micro_batch(offset):
                model(batch["tokens"][offset:offset + 2])
        model(batch["tokens"])
    assert not model._forward_hooks and not model._forward_pre_hooks
