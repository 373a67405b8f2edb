"""``KeyedSampler``: one rank's share of a keyed, world-size-invariant stream of global batches.

Global sample position ``p`` (``p = 0, 1, ...`` over the whole run) is sample
``permutation(fold_in(R, p // n), n)[p % n]`` of epoch ``p // n`` (``R`` the root
key of ``seed``); global step ``t`` is positions ``[t*B, (t+1)*B)``; rank ``r`` of
``W`` takes ``[t*B + r*B/W, t*B + (r+1)*B/W)``. Nothing is padded or dropped.
"""

from __future__ import annotations

import functools
import math
from itertools import repeat
from typing import Any, Iterable, Iterator, Optional, Union

import torch
from torch.utils.data import Sampler

from keyinit.data._augment import SampleRef
from keyinit.data._index import epoch_class
from keyinit.data._permutation import permutation
from keyinit.data._positions import SampleList, SamplePositions, attach
from keyinit.keys import Key, as_int_in, fold_in, key

__all__ = ["KeyedSampler", "sample_indices"]

#: The last global sample position (positions are int64).
_MAX_POSITION = (1 << 63) - 1
#: Positions computed per call of ``permutation`` while iterating (bounded memory, amortized calls).
_CHUNK = 1 << 14


def _int(value: object, what: str, minimum: int) -> int:
    return as_int_in(value, what, minimum)


@functools.lru_cache(maxsize=256)
def _epoch_key(root: Key, epoch: int) -> Key:
    return fold_in(root, epoch)


def sample_indices(root: Key, n: int, positions: torch.Tensor, shuffle: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample index, epoch)`` of global sample positions ``positions`` (1-D int64)."""
    epochs = torch.div(positions, n, rounding_mode="floor")
    within = positions - epochs * n
    if not shuffle or positions.numel() == 0:
        return within, epochs
    out = torch.empty_like(within)
    first, last = int(epochs.min()), int(epochs.max())
    if first == last:
        return permutation(_epoch_key(root, first), n, within), epochs
    for epoch in torch.unique(epochs).tolist():
        mask = epochs == epoch
        out[mask] = permutation(_epoch_key(root, epoch), n, within[mask])
    return out, epochs


class _Chunk:
    """The items of a chunk of consecutive global positions, made a step at a time.

    :class:`SampleIndex` ints (``yield_epoch`` None), ``SampleRef`` pairs (True) or plain ints (False).
    Made when their step is handed out, not for the whole chunk at once: an int subclass's instances
    are tracked by the garbage collector, and thousands of them alive at once made it run full
    collections (a trivial DataLoader epoch took 3-4x RandomSampler's); made per step, they die young.
    """

    __slots__ = ("indices", "epochs", "first", "make", "kind")

    def __init__(self, indices: torch.Tensor, epochs: torch.Tensor, yield_epoch: Optional[bool]) -> None:
        self.indices: list[int] = indices.tolist()
        first, last = int(epochs[0]), int(epochs[-1])
        self.first = first
        self.epochs: Optional[list[int]] = None if first == last else epochs.tolist()  # one epoch: None
        self.kind = yield_epoch
        self.make = epoch_class(first) if yield_epoch is None and first == last else None

    def items(self, lo: int, hi: int) -> Iterable[Any]:
        """The items of positions ``lo .. hi - 1`` of the chunk (made as they are iterated)."""
        indices = self.indices[lo:hi]
        if self.kind is False:
            return indices
        epochs = repeat(self.first, len(indices)) if self.epochs is None else self.epochs[lo:hi]
        if self.kind:
            return map(SampleRef, indices, epochs)
        if self.make is not None:  # one epoch: ints of its class, built in C
            return map(self.make, indices)
        return map(_sample_index, indices, epochs)


def _sample_index(index: int, epoch: int) -> Any:
    return epoch_class(epoch)(index)


class KeyedSampler(Sampler[int]):
    """A ``torch.utils.data.Sampler`` for one rank of a keyed global batch stream.

    ``n`` samples, ``seed`` (an int or a :class:`~keyinit.Key`), ``global_batch_size`` ``B``
    (divisible by ``world_size``). Iterating yields this rank's ``B / world_size`` sample
    indices (:class:`~keyinit.data.SampleIndex`: ints that carry their epoch) of each step
    from the current step (``start_step`` at first) for ``num_steps`` steps (default ``ceil(n / B)``, about one epoch), and advances the current step as it
    goes, so the next iteration continues where this one stopped. A state saved in the
    middle of an iteration (torchdata's ``StatefulDataLoader``) restores it: the next
    iteration finishes it. The indices are plain ints to a plain dataset and tell
    :func:`keyinit.data.keyed_samples` and :func:`keyinit.data.keyed_collate` their epoch;
    ``yield_epoch=True`` (kept for compatibility) yields :class:`SampleRef` ``(index, epoch)``
    pairs instead, and ``yield_epoch=False`` plain ints (for plain datasets only; cheaper to make,
    see docs/benchmarks.md). ``shuffle=False`` gives the order ``p % n``.

    ``rank``/``world_size`` default to torch.distributed's when it is initialized, else 0 and 1.
    """

    def __init__(self, n: int, seed: Union[int, Key], *, global_batch_size: int, rank: Optional[int] = None,
                 world_size: Optional[int] = None, start_step: int = 0, shuffle: bool = True,
                 num_steps: Optional[int] = None, yield_epoch: Optional[bool] = None) -> None:
        self.n = _int(n, "n", 1)
        if self.n > 1 << 62:
            raise ValueError(f"n must be at most 2**62, got {self.n}")
        self.root = seed if isinstance(seed, Key) else key(seed)  # type: ignore[arg-type]
        self.global_batch_size = _int(global_batch_size, "global_batch_size", 1)
        if world_size is None or rank is None:
            initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
            if world_size is None:
                world_size = torch.distributed.get_world_size() if initialized else 1
            if rank is None:
                rank = torch.distributed.get_rank() if initialized else 0
        self.world_size = _int(world_size, "world_size", 1)
        self.rank = _int(rank, "rank", 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.global_batch_size % self.world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by "
                             f"world_size={self.world_size}: every rank takes an equal contiguous slice of "
                             f"each global batch; choose a world size that divides it")
        self.local_batch_size = self.global_batch_size // self.world_size
        self.step = _int(start_step, "start_step", 0)
        self._stop: Optional[int] = None  # the end of an iteration in progress (or interrupted)
        self.shuffle = bool(shuffle)
        self.num_steps = math.ceil(self.n / self.global_batch_size) if num_steps is None \
            else _int(num_steps, "num_steps", 0)
        self.yield_epoch = None if yield_epoch is None else bool(yield_epoch)

    # ------------------------------------------------------------------ positions
    def _check_steps(self, first_step: int, steps: int) -> None:
        # global positions are int64: past 2**63 - 1 they would wrap around, silently
        if (first_step + steps) * self.global_batch_size > _MAX_POSITION + 1:
            raise OverflowError(f"step {first_step + steps - 1} with global_batch_size={self.global_batch_size} "
                                f"reaches global sample position {(first_step + steps) * self.global_batch_size - 1}"
                                f", past the last one (2**63 - 1)")

    def _positions(self, first_step: int, steps: int) -> torch.Tensor:
        self._check_steps(first_step, steps)
        local = self.local_batch_size
        base = torch.arange(first_step, first_step + steps, dtype=torch.int64) * self.global_batch_size \
            + self.rank * local
        return (base.unsqueeze(1) + torch.arange(local, dtype=torch.int64)).reshape(-1)

    def local_batch(self, step: int) -> torch.Tensor:
        """This rank's sample indices of global step ``step``."""
        return sample_indices(self.root, self.n, self._positions(_int(step, "step", 0), 1), self.shuffle)[0]

    def global_batch(self, step: int) -> torch.Tensor:
        """All ``global_batch_size`` sample indices of global step ``step`` (the same for every world size)."""
        step = _int(step, "step", 0)
        self._check_steps(step, 1)
        positions = torch.arange(self.global_batch_size, dtype=torch.int64) + step * self.global_batch_size
        return sample_indices(self.root, self.n, positions, self.shuffle)[0]

    # ------------------------------------------------------------------ Sampler protocol
    def __len__(self) -> int:
        return self.num_steps * self.local_batch_size

    def _begin(self) -> int:
        """The step the iteration starting now ends at: the end of an interrupted one (restored by
        ``load_state_dict``, as torchdata's ``StatefulDataLoader`` does mid-epoch), else ``num_steps`` on."""
        if self._stop is None or self.step >= self._stop:
            self._stop = self.step + self.num_steps
        return self._stop

    def _steps(self) -> Iterator[tuple["_Chunk", int, int]]:
        """``(chunk, first, end)`` for each step left in this iteration: its entries are the chunk's items
        ``first .. end - 1``; the caller counts the step done (``self.step += 1``) once it hands them out."""
        stop = self._begin()
        per_chunk = max(1, _CHUNK // self.local_batch_size)
        local = self.local_batch_size
        while self.step < stop:
            steps = min(per_chunk, stop - self.step)
            chunk = _Chunk(*sample_indices(self.root, self.n, self._positions(self.step, steps), self.shuffle),
                           self.yield_epoch)
            for s in range(steps):
                yield chunk, s * local, (s + 1) * local

    def __iter__(self) -> Iterator[Any]:
        for chunk, first, end in self._steps():
            yield from chunk.items(first, end - 1)
            last, = chunk.items(end - 1, end)
            self.step += 1  # the step is done once its last sample is handed out
            yield last

    def set_epoch(self, epoch: int) -> None:
        """``DistributedSampler.set_epoch`` compatibility: the next iteration is pass ``epoch``.

        Pass ``e`` is steps ``[e * S, (e + 1) * S)``, ``S = num_steps`` (by default ``ceil(n / B)``,
        so pass ``e`` is about epoch ``e`` of the data). If the current step already lies in pass
        ``epoch`` (its start, or a resume there by ``start_step`` or ``load_state_dict``), the next
        iteration goes on from it to the end of the pass; otherwise it runs the whole pass. So the
        usual ``for epoch in ...: sampler.set_epoch(epoch); for batch in loader: ...`` loop gives the
        same steps with or without the call, and after a resume it finishes the resumed pass.
        """
        epoch = _int(epoch, "epoch", 0)
        first, stop = epoch * self.num_steps, (epoch + 1) * self.num_steps
        if not first <= self.step < stop:
            self.step = first
        self._stop = stop

    def _micro(self, micro_batch_size: Optional[int]) -> int:
        if micro_batch_size is None:
            return self.local_batch_size
        micro = _int(micro_batch_size, "micro_batch_size", 1)
        if self.local_batch_size % micro:
            raise ValueError(f"micro_batch_size={micro} does not divide this rank's batch of "
                             f"global_batch_size / world_size = {self.local_batch_size} samples a step")
        return micro

    def batches(self, micro_batch_size: Optional[int] = None) -> Iterator[list[Any]]:
        """Like iterating, but one list per step (this rank's ``B / W`` entries), or per micro-batch of
        ``micro_batch_size`` entries (which must divide ``B / W``); advances the same state (a step is done
        once its last micro-batch is handed out).

        Each list carries where its entries sit in the run (``.keyinit_samples``, a
        :class:`~keyinit.data.SamplePositions`: the step and the first entry's place in the step's global
        batch), which ``keyed_samples`` and ``keyed_collate`` pass on to the collated batch for
        ``keyinit.nn.keyed(..., samples=batch)``. To any other code they are plain lists."""
        micro = self._micro(micro_batch_size)
        start = self.rank * self.local_batch_size
        for chunk, first, end in self._steps():
            for m in range(first, end, micro):
                batch = attach(SampleList(chunk.items(m, m + micro)),
                               SamplePositions(self.step, start + m - first, micro, self.global_batch_size))
                if m + micro == end:
                    self.step += 1
                yield batch

    def batch_sampler(self, micro_batch_size: Optional[int] = None) -> "Sampler[list[Any]]":
        """This sampler as a DataLoader ``batch_sampler`` (one list per step, or per micro-batch of
        ``micro_batch_size`` entries; no per-sample Python loop)::

            DataLoader(dataset, batch_sampler=sampler.batch_sampler())

        Over ``keyed_samples(dataset, seed)`` with ``collate_fn=keyed_collate(...)``, each batch carries its
        rows' global positions: ``keyinit.nn.keyed(model, seed, step=step, samples=batch)`` (see
        :meth:`batches`).
        """
        return _Batches(self, self._micro(micro_batch_size))

    # ------------------------------------------------------------------ checkpointing
    def fingerprint(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same samples (world size need not)."""
        return {"n": self.n, "key": list(self.root.words), "global_batch_size": self.global_batch_size,
                "stream": self.root.stream, "shuffle": self.shuffle}

    def state_dict(self) -> dict[str, Any]:
        """``{"step": the next step to yield, "stop": the end of the iteration in progress (None when
        none is), "fingerprint": ...}``."""
        stop = self._stop if self._stop is not None and self.step < self._stop else None
        return {"step": self.step, "stop": stop, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state["step"]``; a state saved with another ``n``, seed, batch size or
        stream version is an error (any world size is fine)."""
        if not isinstance(state, dict) or "step" not in state or "fingerprint" not in state:
            raise ValueError(f"not a KeyedSampler state_dict (expected keys 'step' and 'fingerprint'): {state!r}")
        mine, theirs = self.fingerprint(), dict(state["fingerprint"])
        theirs["key"] = list(theirs.get("key", ()))
        differ = [f"{k}: saved {theirs.get(k)!r}, this sampler {v!r}" for k, v in mine.items() if theirs.get(k) != v]
        if differ:
            raise ValueError("KeyedSampler state_dict does not match this sampler (" + "; ".join(differ) + ")")
        step, stop = _int(state["step"], "state_dict step", 0), state.get("stop")
        self._stop, self.step = None if stop is None else _int(stop, "state_dict stop", step), step


class _Batches(Sampler[list[Any]]):
    """A :class:`KeyedSampler` as a ``batch_sampler``; ``state_dict`` is the sampler's."""

    def __init__(self, sampler: KeyedSampler, micro_batch_size: Optional[int] = None) -> None:
        self.sampler = sampler
        self.micro_batch_size = sampler.local_batch_size if micro_batch_size is None else micro_batch_size

    def __len__(self) -> int:
        return self.sampler.num_steps * (self.sampler.local_batch_size // self.micro_batch_size)

    def __iter__(self) -> Iterator[list[Any]]:
        return self.sampler.batches(self.micro_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """:meth:`KeyedSampler.set_epoch` (frameworks call it on a DataLoader's ``batch_sampler`` too)."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
