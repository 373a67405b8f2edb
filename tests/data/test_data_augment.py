"""keyed_samples: randomness inside __getitem__ keyed by (seed, epoch, index, call ordinal),
the same whatever num_workers, persistent workers, order or world size; global state untouched."""

from __future__ import annotations

import importlib.util
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import keyinit
from keyinit import UnkeyedRandomnessError
from keyinit.data import KeyedSampler, SampleRef, keyed_samples, sample_key
from keyinit.data._augment import AUGMENT_DOMAIN


class _Draws(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1)
        t = torch.empty(3)
        return {
            "rand": torch.rand(4),
            "randn_gen": torch.randn(3, generator=g),
            "randint": torch.randint(0, 10, (3,)),
            "randperm": torch.randperm(6),
            "bernoulli": torch.bernoulli(torch.full((5,), 0.3)),
            "multinomial": torch.multinomial(torch.ones(6), 3),
            "normal": torch.normal(2.0, 3.0, (2,)),
            "uniform_": t.uniform_(-1, 1).clone(),
            "normal_": torch.empty(2).normal_(),
            "random_": torch.empty(2, dtype=torch.int64).random_(0, 100),
            "bernoulli_": torch.empty(3).bernoulli_(0.5),
            "exponential_": torch.empty(2).exponential_(),
            "generator_state": g.get_state(),
            "py": random.random(),
            "np": float(np.random.rand()),
        }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_keyed_values_are_keyinit_draws_and_depend_on_epoch_and_index():
    d = keyed_samples(_Draws(), 3)
    a = d[SampleRef(5, 2)]
    assert all(_same(a[k], v) for k, v in d[(5, 2)].items())
    for other in (d[(5, 3)], d[(6, 2)], keyed_samples(_Draws(), 4)[(5, 2)]):
        assert not torch.equal(a["rand"], other["rand"]) and a["py"] != other["py"] and a["np"] != other["np"]
    sk = sample_key(3, 2, 5)
    assert sk == keyinit.fold_in(keyinit.fold_in(keyinit.fold_in(keyinit.key(3), AUGMENT_DOMAIN), 2), 5)
    # draw 0 of random op 0, draw 0 of random op 1 (generator= ignored)
    assert torch.equal(a["rand"], keyinit.random.uniform(keyinit.fold_in(keyinit.fold_in(sk, 0), 0), (4,)))
    assert torch.equal(a["randn_gen"], keyinit.random.normal(keyinit.fold_in(keyinit.fold_in(sk, 1), 0), (3,)))
    assert torch.equal(a["generator_state"], torch.Generator().manual_seed(1).get_state())  # and not advanced
    # spec 16.3: random seeded with k0 + 2**32 k1, numpy with [k0, k1], of string folds of the sample key
    kp, kn = keyinit.fold_in(sk, "python.random"), keyinit.fold_in(sk, "numpy.random")
    assert a["py"] == random.Random(kp.k0 + (kp.k1 << 32)).random()
    assert a["np"] == np.random.RandomState([kn.k0, kn.k1]).rand()
    assert sorted(a["randperm"].tolist()) == list(range(6))
    assert len(set(a["multinomial"].tolist())) == 3


def test_global_state_is_untouched_and_restored():
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    keyed_samples(_Draws(), 0)[(1, 0)]
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]


class _Poisson(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.poisson(torch.ones(3))


def test_unkeyable_randomness_is_an_error_and_plain_index_needs_an_epoch():
    with pytest.raises(UnkeyedRandomnessError, match=r"sample 0 of epoch 0: the dataset's __getitem__ called "
                                                     r"poisson\(\), which keyinit cannot key"):
        keyed_samples(_Poisson(), 0)[(0, 0)]
    with pytest.raises(TypeError, match=r"does not say the epoch.*yield_epoch=True"):
        keyed_samples(_Draws(), 0)[3]
    assert torch.equal(keyed_samples(_Draws(), 0, epoch=4)[3]["rand"], keyed_samples(_Draws(), 0)[(3, 4)]["rand"])


class _Vision(torch.utils.data.Dataset):
    """Small uint8 images through a torchvision.transforms.v2 pipeline (imported lazily: works in workers)."""

    def __init__(self, n=12):
        self.n = n
        self.transform = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.transform is None:
            from tests._support.torchvision_import import import_torchvision

            import_torchvision()
            from torchvision.transforms import v2

            self.transform = v2.Compose([
                v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip(), v2.ColorJitter(0.4, 0.4, 0.4, 0.1),
                v2.RandAugment(), v2.ToDtype(torch.float32, scale=True), v2.RandomErasing(p=0.5, value="random"),
            ])
        image = ((torch.arange(3 * 24 * 24).reshape(3, 24, 24) * (i + 3)) % 251).to(torch.uint8)
        return self.transform(image), i


def _epoch_samples(workers, persistent=False, world=1, start_step=0, steps=3, n=12, batch=4):
    """{(epoch, index): image} over steps, from every rank of a world of `world` ranks."""
    out = {}
    for rank in range(world):
        sampler = KeyedSampler(n, 0, global_batch_size=batch, rank=rank, world_size=world, start_step=start_step,
                               num_steps=steps, yield_epoch=True)
        loader = DataLoader(keyed_samples(_Vision(n), 11), batch_size=batch // world, sampler=sampler,
                            num_workers=workers, persistent_workers=persistent and workers > 0)
        refs = list(KeyedSampler(n, 0, global_batch_size=batch, rank=rank, world_size=world, start_step=start_step,
                                 num_steps=steps, yield_epoch=True))
        images = torch.cat([images for images, _ in loader])
        for ref, image in zip(refs, images):
            out[(ref.epoch, ref.index)] = image
    return out


@pytest.fixture(scope="module")
def vision_reference():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed")
    from tests._support.torchvision_import import import_torchvision

    import_torchvision()
    return _epoch_samples(0, steps=4)


@pytest.mark.parametrize("workers,persistent,world", [(1, False, 1), (2, True, 1), (4, False, 1), (2, False, 2)])
def test_torchvision_augmentation_is_bitwise_identical(vision_reference, workers, persistent, world):
    got = _epoch_samples(workers, persistent, world, steps=4)
    assert got.keys() == vision_reference.keys()
    assert all(torch.equal(got[k].view(torch.int32), vision_reference[k].view(torch.int32)) for k in got)


def test_torchvision_resume_and_order(vision_reference):
    resumed = _epoch_samples(0, world=4, start_step=2, steps=2)
    assert all(torch.equal(resumed[k], vision_reference[k]) for k in resumed) and len(resumed) == 8
    d = keyed_samples(_Vision(), 11)
    backwards = {(epoch, index): d[SampleRef(index, epoch)][0] for epoch, index in sorted(vision_reference, reverse=True)}
    assert all(torch.equal(backwards[k], vision_reference[k]) for k in vision_reference)
    epochs = {e for e, _ in vision_reference}
    assert epochs == {0, 1}  # steps 0..3 of 4 over n = 12 cover one and a third epochs
    assert not torch.equal(d[(0, 0)][0], d[(1, 0)][0])


def test_torchvision_persistent_workers_over_two_passes(vision_reference):
    """The same worker processes serve both passes of the loader (a sampler iteration each)."""
    sampler = KeyedSampler(12, 0, global_batch_size=4, num_steps=2, yield_epoch=True)
    loader = DataLoader(keyed_samples(_Vision(), 11), batch_size=4, sampler=sampler, num_workers=2,
                        persistent_workers=True)
    images = [torch.cat([images for images, _ in loader]) for _ in range(2)]
    refs = list(KeyedSampler(12, 0, global_batch_size=4, num_steps=4, yield_epoch=True))
    assert sampler.step == 4 and loader._iterator is not None  # persistent: one iterator, reused
    for ref, image in zip(refs, torch.cat(images)):
        assert torch.equal(image, vision_reference[(ref.epoch, ref.index)])


class _SlowGlobalDraws(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        a = random.random()
        time.sleep(0.002)  # another thread runs here
        return a, float(np.random.rand()), torch.rand(2).tolist()


def test_threads_take_turns_with_the_global_random_state():
    """Python's random and numpy.random have one state per process: two threads in keyed calls at once
    would draw from each other's seeds (they did: 20 of 24 samples differed); they take turns."""
    d = keyed_samples(_SlowGlobalDraws(), 0)
    random.seed(5)
    state = random.getstate()
    want = [d[(i, 0)] for i in range(24)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: d[(i, 0)], range(24)))
    assert got == want
    assert random.getstate() == state
