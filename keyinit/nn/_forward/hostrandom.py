"""Python's ``random`` and ``numpy.random`` inside a keyed forward (``docs/spec.md`` section 14.7).

Their global generators have no notion of samples: a draw from them cannot be
placed in a sample the way a torch op on a batch-holding tensor is. So inside a
root forward both are seeded from a key of their own and given back their state
when the forward returns (no value depends on the global states, and they are
left as they were), and what that key is follows what the forward holds
(``keyed(..., randomness=keyinit.nn.Randomness(host=...))``; the deprecated ``host_random=`` spells
``"rows"`` as ``"forward"``):

- ``"sample"`` (the default): a forward of exactly one sample ``s`` seeds them
  from (root forward key, ``s``), so each sample's values are its own, whatever
  the split (HF's SpecAugment run one sample per micro-batch); a forward whose
  inputs hold no batch seeds them from the root forward key (replicated). A
  forward of several samples that draws from either generator (its state moved)
  raises :class:`~keyinit.errors.UnkeyedRandomnessError` before its output
  reaches the caller: a draw there would depend on which rows the local batch
  holds.
- ``"rows"``: a forward of samples ``s .. s+n-1`` seeds them from (root
  forward key, ``s``, ``n``): the same values on every rank and run for the same
  rows, but they depend on how the batch is split into forwards.
- ``"replicated"``: every forward seeds them from the root forward key alone, so
  every forward of the step draws the same values whatever rows it holds: split
  invariant for draws that are the same for every sample (a per-layer decision,
  BigBird's random blocks), the same values at every local row for draws made
  per row.

A module that activation checkpointing recomputes in backward continues from the
states its first execution began with (recorded, under checkpointing only, by
``keyinit.nn._forward.pieces.remember_host``), so its recompute draws what it drew;
where none was recorded, a draw in such a recompute is refused rather than
drawn from the forward's seed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from keyinit._host.lock import global_state_lock
from keyinit._host.states import global_states
from keyinit._kernels.fill.folds import fold_with, fold_words, kernel_library
from keyinit.keys import Key

__all__ = ["HOST_RANDOM", "HostRandom", "SAMPLE_FIXES", "fold", "host_stream_folds"]

#: The values of ``keyed(..., host_random=...)``.
HOST_RANDOM = ("sample", "forward", "replicated")


def fold(parent: Key, data: int | str) -> Key:
    """``fold_in(parent, data)``, its Philox in C where the CPU kernel library is loaded (a root forward
    derives its host key at every step)."""
    return fold_with(kernel_library(), parent, data)


def host_stream_folds(start: int, count: int, mode: str) -> tuple:
    """What is folded into a root forward's host key (the root forward's module key folded with ``"host"``,
    and its repeat) for its host generators: nothing when ``mode`` is ``"replicated"`` or the forward holds
    no batch, else its samples (``"samples"``, ``start``, ``count``)."""
    if mode == "replicated" or count == 0:
        return ()
    return ("samples", start, count)


class HostRandom:
    """Seeds ``random`` and ``numpy.random`` from ``key`` on enter; restores both on exit.

    ``refuse`` (or None): a draw from either generator between enter and exit is not allowed
    there; it is ``(before, after)``, the error's text around the generators' names. ``drawn``
    (or None) is called on exit when either generator was drawn from (and nothing is refused).
    ``resume`` (or None): a :meth:`state` to continue from after seeding (the recompute of a module
    that activation checkpointing runs: the states its first execution started from).
    :meth:`__exit__` then leaves the error in :attr:`refusal` (after restoring both states) for
    the caller to raise once the forward's modes are left, or raises it itself where
    :attr:`raises` is set (a plain ``with``) and no other exception is on its way. The states are
    saved, seeded and put back through :mod:`keyinit._host.states` (as bytes where it can), under
    the process's one lock for them (:mod:`keyinit._host.lock`).
    """

    __slots__ = ("key", "refuse", "drawn", "resume", "refusal", "raises", "_saved", "_seeded", "_lock")

    def __init__(self, key: Key, refuse: Optional[tuple[str, str]] = None,
                 drawn: Optional[Callable[[], None]] = None, resume: Any = None) -> None:
        self.key = key
        self.refuse = refuse
        self.drawn = drawn
        self.resume = resume
        self.refusal: Optional[BaseException] = None
        self.raises = False
        self._saved: Any = None
        self._seeded: Any = None
        self._lock: Any = None

    def __enter__(self) -> "HostRandom":
        self._lock = global_state_lock()  # the one lock of the process's global generators
        self._lock.acquire()
        try:
            states = global_states()
            self._saved = states.save()
            lib = kernel_library()
            try:
                states.seed(lib, fold_words(lib, self.key, "python.random"),
                            fold_words(lib, self.key, "numpy.random"), self._saved)
                if self.resume is not None:
                    states.restore(self.resume)
                self._seeded = states.save()
            except BaseException:
                states.restore(self._saved)
                raise
        except BaseException:
            self._lock.release()
            raise
        return self

    def moved(self) -> bool:
        """Either generator was drawn from since it was seeded (or resumed)."""
        return bool(self._drew()) or self.resume is not None

    def state(self) -> Any:
        """Both generators' states now (for :attr:`resume`)."""
        return global_states().save()

    def _drew(self) -> list[str]:
        return global_states().drew(self._seeded)

    def __exit__(self, *exc_info: Any) -> None:
        try:
            states = global_states()
            drew = states.drew(self._seeded)
            states.restore(self._saved)
        finally:
            self._lock.release()
        drawn, self.drawn = self.drawn, None  # (called once: the callback, often its owner's, is let go)
        if drew and self.refuse is None:
            if drawn is not None:
                drawn()
        elif drew:
            from keyinit.errors import UnkeyedRandomnessError

            before, after = self.refuse  # type: ignore[misc]
            self.refusal = UnkeyedRandomnessError(f"{before}{' and '.join(drew)}{after}")
            if self.raises and exc_info[0] is None:
                raise self.refusal


#: The end of the error of a forward of several samples that drew (``host_random="sample"``).
SAMPLE_FIXES = (
    "'s global state. The global generators have no notion of samples, so keyinit cannot tell which sample such a draw "
    "belongs to (HF's SpecAugment draws one value per batch and then one per row; a per-row draw in a "
    "forward of several rows depends on which rows the local batch holds). The global states are restored "
    "and the forward's output discarded. Fixes: run the forward one sample at a time (a batch of one row, "
    "or ctx.micro_batch(offset) per row: each sample's generators are then seeded by its own key); or declare "
    "keyinit.nn.keyed(..., randomness=keyinit.nn.Randomness(host='rows')) (keyed by the forward's rows: the "
    "same on every rank for the same rows, but depending on how the batch is split; the deprecated "
    "host_random='forward') or Randomness(host='replicated') (every forward draws the same values: right for "
    "draws that are the same for every sample, such as a per-layer decision; the deprecated "
    "host_random='replicated'); or turn the host-side randomness off (for Wav2Vec2-style models mask_time_prob=0 and "
    "mask_feature_prob=0) or draw it with torch ops on the batch, which keyed() keys per sample"
)
