"""KeyedSampler: world-size-invariant global batches, once per epoch, resume with any world size,
state_dict, DataLoader and real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import keyinit
from keyinit.data import KeyedSampler, SampleRef, permutation
from tests._support.dist import requires_gloo, run_distributed


def _global_batches(n, seed, B, W, steps, start_step=0):
    """The global batches of steps start_step .. start_step+steps-1, put together from W ranks' iteration."""
    per_rank = [list(KeyedSampler(n, seed, global_batch_size=B, rank=r, world_size=W, start_step=start_step,
                                  num_steps=steps)) for r in range(W)]
    local = B // W
    return [sum((p[s * local:(s + 1) * local] for p in per_rank), []) for s in range(steps)]


def test_global_batches_do_not_depend_on_world_size():
    want = _global_batches(37, 5, 12, 1, 9)
    for W in (2, 3, 4, 6, 12):
        assert _global_batches(37, 5, 12, W, 9) == want, W


def test_definition_and_every_sample_once_per_epoch():
    n, B = 37, 12
    flat = sum(_global_batches(n, 5, B, 4, 10), [])  # 120 positions: 3 full epochs and a part
    root = keyinit.key(5)
    for epoch in range(3):
        chunk = flat[epoch * n:(epoch + 1) * n]
        assert sorted(chunk) == list(range(n))
        assert chunk == permutation(keyinit.fold_in(root, epoch), n).tolist()
    assert flat[3 * n:] == permutation(keyinit.fold_in(root, 3), n)[:120 - 3 * n].tolist()


def test_no_padding_steps_span_epochs_and_shuffle_false():
    s = KeyedSampler(10, 0, global_batch_size=4, shuffle=False, num_steps=3)
    assert list(s) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert len(KeyedSampler(10, 0, global_batch_size=4, rank=1, world_size=2)) == 3 * 2  # ceil(10/4) steps


def test_resume_with_any_world_size():
    want = _global_batches(50, 1, 8, 1, 12)
    assert _global_batches(50, 1, 8, 4, 7, start_step=5) == want[5:]
    s = KeyedSampler(50, 1, global_batch_size=8, rank=0, world_size=2, num_steps=3)
    first = list(s)
    assert s.step == 3 and s.state_dict()["step"] == 3
    resumed = [KeyedSampler(50, 1, global_batch_size=8, rank=r, world_size=4, num_steps=2) for r in range(4)]
    for r in resumed:
        r.load_state_dict(s.state_dict())
    parts = [list(r) for r in resumed]
    assert sum((p[:2] for p in parts), []) == want[3]
    assert first[:4] == want[0][:4]


def test_iteration_continues_and_yield_epoch():
    s = KeyedSampler(6, 2, global_batch_size=4, num_steps=2, yield_epoch=True)
    a, b = list(s), list(s)
    assert all(isinstance(x, SampleRef) for x in a + b)
    assert [x.epoch for x in a + b] == [p // 6 for p in range(16)]
    plain = KeyedSampler(6, 2, global_batch_size=4, num_steps=4)
    assert [x.index for x in a + b] == list(plain)


def test_state_dict_mismatch_and_bad_arguments():
    s = KeyedSampler(100, 3, global_batch_size=8)
    for other in (KeyedSampler(101, 3, global_batch_size=8), KeyedSampler(100, 4, global_batch_size=8),
                  KeyedSampler(100, 3, global_batch_size=16)):
        with pytest.raises(ValueError, match="does not match this sampler"):
            other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="does not match this sampler.*stream"):
        bad = s.state_dict()
        bad["fingerprint"]["stream"] = "v0"
        KeyedSampler(100, 3, global_batch_size=8).load_state_dict(bad)
    with pytest.raises(ValueError, match="not a KeyedSampler state_dict"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="global_batch_size=10 is not divisible by world_size=4"):
        KeyedSampler(100, 3, global_batch_size=10, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\)"):
        KeyedSampler(100, 3, global_batch_size=10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        KeyedSampler(0, 3, global_batch_size=10)
    with pytest.raises(TypeError, match="global_batch_size must be an int"):
        KeyedSampler(10, 3, global_batch_size=2.0)


class _Identity(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader(workers):
    s = KeyedSampler(30, 9, global_batch_size=8, rank=1, world_size=2, num_steps=5)
    loader = DataLoader(_Identity(30), batch_size=4, sampler=s, num_workers=workers)
    got = [b.tolist() for b in loader]
    want = _global_batches(30, 9, 8, 2, 5)
    assert got == [w[4:] for w in want]


@pytest.mark.parametrize("workers,batch_sampler", [(0, False), (2, True)])
def test_stateful_dataloader_round_trip(workers, batch_sampler):
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")

    def loader(sampler):
        if batch_sampler:
            return torchdata.StatefulDataLoader(_Identity(30), batch_sampler=sampler.batch_sampler(),
                                                num_workers=workers)
        return torchdata.StatefulDataLoader(_Identity(30), batch_size=4, sampler=sampler, num_workers=workers)

    first_loader = loader(KeyedSampler(30, 9, global_batch_size=4, num_steps=6))
    it = iter(first_loader)
    first = [next(it).tolist() for _ in range(2)]
    state = first_loader.state_dict()  # mid-pass; with workers the sampler has already run ahead
    rest = [b.tolist() for b in it]
    del it
    loader2 = loader(KeyedSampler(30, 9, global_batch_size=4, num_steps=6))
    loader2.load_state_dict(state)
    assert [b.tolist() for b in loader2] == rest
    assert first + rest == _global_batches(30, 9, 4, 1, 6)
    assert [b.tolist() for b in loader2] == _global_batches(30, 9, 4, 1, 12)[6:]  # the next pass follows on


# ------------------------------------------------------------------ real gloo ranks

N, B, SEED = 101, 16, 77


def _rank_batches(steps, start_step=0, state=None):
    """In each rank: iterate a DataLoader over KeyedSampler (rank/world from torch.distributed),
    all_gather each step's local batch into the global batch; return the global batches and the state."""
    sampler = KeyedSampler(N, SEED, global_batch_size=B, start_step=start_step, num_steps=steps)
    if state is not None:
        sampler.load_state_dict(state)
    W = dist.get_world_size()
    loader = DataLoader(_Identity(N), batch_size=B // W, sampler=sampler)
    out = []
    for local in loader:
        gathered = [torch.empty_like(local) for _ in range(W)]
        dist.all_gather(gathered, local)
        out.append(torch.cat(gathered).tolist())
    return out, sampler.state_dict()


@requires_gloo
def test_gloo_world_sizes_and_resume_changing_world_size():
    want = _global_batches(N, SEED, B, 1, 12)
    for W in (2, 4):
        results = run_distributed(_rank_batches, W, args=(12,))
        assert all(batches == want for batches, _ in results), W
    first = run_distributed(_rank_batches, 2, args=(5,))
    state = first[0][1]
    assert state["step"] == 5 and first[0][0] == want[:5]
    resumed = run_distributed(_rank_batches, 4, args=(7,), kwargs={"state": state})
    assert all(batches == want[5:] for batches, _ in resumed)


def test_batch_sampler_gives_the_same_steps_and_state():
    s = KeyedSampler(30, 9, global_batch_size=8, rank=1, world_size=2, num_steps=5, yield_epoch=True)
    got = [[(r.index, r.epoch) for r in b] for b in DataLoader(_Identity(30), batch_sampler=s.batch_sampler(),
                                                               collate_fn=lambda x: x)]
    assert s.step == 5 and s.batch_sampler().state_dict()["step"] == 5
    want = _global_batches(30, 9, 8, 2, 5)
    assert [[i for i, _ in b] for b in got] == [w[4:] for w in want]
    assert [[e for _, e in b] for b in got][-1] == [1, 1, 1, 1]  # positions 36..39 are epoch 1


def test_sampler_and_permutation_leave_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    list(KeyedSampler(100, 1, global_batch_size=10, num_steps=15))
    permutation(keyinit.key(0), 10**9, range(0, 1000))
    assert torch.equal(torch.get_rng_state(), state)


def test_set_epoch_as_with_distributed_sampler():
    n, B = 10, 4  # a pass is ceil(10 / 4) = 3 steps
    whole = list(KeyedSampler(n, 0, global_batch_size=B, num_steps=9))
    s = KeyedSampler(n, 0, global_batch_size=B)
    passes = []
    for epoch in range(3):
        s.set_epoch(epoch)
        passes.append(list(s))
    assert sum(passes, []) == whole  # the same steps as without set_epoch
    s.set_epoch(1)  # back to pass 1, as DistributedSampler.set_epoch(1) gives its order again
    assert list(s) == passes[1]
    skipped = KeyedSampler(n, 0, global_batch_size=B)
    skipped.set_epoch(2)  # a pass not begun: all of it, from its first step
    assert list(skipped) == passes[2]
    resumed = KeyedSampler(n, 0, global_batch_size=B, start_step=4)  # step 4 lies in pass 1 (steps 3-5)
    resumed.set_epoch(1)
    assert list(resumed) == passes[1][B:]  # the rest of the resumed pass, not all of it again
    assert list(resumed) == passes[2]
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        s.set_epoch(-1)
    batches = KeyedSampler(n, 0, global_batch_size=B)
    batches.batch_sampler().set_epoch(2)  # as Lightning calls it on a DataLoader's batch_sampler
    assert sum(batches.batch_sampler(), []) == passes[2]


def test_positions_past_int64_are_an_error_not_a_wraparound():
    s = KeyedSampler(2**62, 0, global_batch_size=8)
    last = 2**60 - 1  # its last position is 2**63 - 1
    assert torch.equal(s.global_batch(last), permutation(keyinit.fold_in(keyinit.key(0), 1), 2**62,
                                                         range(2**62 - 8, 2**62)))
    assert torch.equal(s.local_batch(last), s.global_batch(last))
    for step in (2**60, 2**61):
        with pytest.raises(OverflowError, match=r"past the last one \(2\*\*63 - 1\)"):
            s.local_batch(step)
        with pytest.raises(OverflowError, match=r"past the last one"):
            s.global_batch(step)
