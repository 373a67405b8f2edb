"""``keyed_samples``: the randomness of ``dataset[i]`` keyed by (seed, epoch, sample index, call ordinal).

Inside the wrapped ``__getitem__``:

- every random aten op (``torch.rand``, ``randn``, ``randint``, ``randperm``, ``bernoulli``,
  ``multinomial``, ``normal``, ``Tensor.uniform_``/``normal_``/``random_``/``bernoulli_``/
  ``exponential_``, ..., with or without ``generator=``) is replaced by its keyed equivalent
  (the table of :mod:`keyinit._engine.random_ops`, shared with captured init code) under the key
  ``fold_in(sample_key(seed, epoch, index), c)``, ``c`` the op's ordinal in this call;
  the op's generator (and the global one) is neither read nor advanced;
- Python's ``random`` and ``numpy.random`` global state are seeded from the sample key
  and restored afterwards (one global state per process: threads in keyed calls take turns);
- an op with no keyed equivalent (``poisson``, gamma, fused dropout kernels) raises
  :class:`keyinit.UnkeyedRandomnessError`.

Only the random ops reach Python (:mod:`keyinit.data._intercept`: kernels under a dispatch key
turned on for the calling thread; a dispatch mode where a torch build lacks the hooks), and the
common ones are keyed without a program (:mod:`keyinit.data._fast`, the same values).

``sample_key(seed, epoch, index) = fold_in(fold_in(fold_in(key(seed), AUGMENT_DOMAIN), epoch), index)``.
"""

from __future__ import annotations

import os
import random as _py_random
import threading
from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keyinit._engine.outside import ThreadDrawsRefused
from keyinit.data import _fast, _intercept
from keyinit.data._index import SampleIndex
from keyinit.keys import Key, as_uint64, key

__all__ = ["AUGMENT_DOMAIN", "SampleRef", "KeyedBatch", "sample_key", "keyed_samples", "KeyedSamples", "keyed_randomness"]

#: The int folded into the root key first: the ASCII bytes of "augment", big-endian.
AUGMENT_DOMAIN = int.from_bytes(b"augment", "big")


class SampleRef(NamedTuple):
    """A reference to sample ``index`` in epoch ``epoch`` (what ``KeyedSampler(yield_epoch=True)`` yields)."""

    index: int
    epoch: int


def sample_key(seed: Union[int, Key], epoch: int, index: int) -> Key:
    """The key of sample ``index``'s randomness in epoch ``epoch``."""
    root = seed if isinstance(seed, Key) else key(seed)  # type: ignore[arg-type]
    epoch = as_uint64(epoch, "epoch")
    index = as_uint64(index, "sample index")
    return _fast.fold(_epoch_key(root, epoch), index)


def _epoch_key(root: Key, epoch: int) -> Key:
    return _fast.folded(_fast.folded(root, AUGMENT_DOMAIN), epoch)


def _keyed_call(func: Any, args: tuple, kwargs: dict, call_key: Key, site: str) -> Any:
    """A random op in a keyed ``__getitem__`` (or collate): the engine's keyed values for ``call_key``."""
    from keyinit._engine.keyed_op import keyed_op

    return keyed_op(func, args, kwargs, call_key, site, "the dataset's __getitem__")


class _Keyer:
    """Replaces the random ops of one keyed call: the ``c``-th under ``fold_in(sample, c)``."""

    def __init__(self, sample: Key, site: str) -> None:
        self.sample = sample
        self.site = site
        self.ordinal = 0
        self.lib = _fast.kernel_library()

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        call_key = _fast.fold(self.sample, self.ordinal)
        self.ordinal += 1
        recipe = _fast.plan(func, args, kwargs)
        if recipe is None:
            return _keyed_call(func, args, kwargs, call_key, self.site)
        values: list = []
        j = 0
        for draw in recipe.draws:  # the draws _keyed_call would number j = 0, 1, ...
            if draw is None:
                values.append(None)
                continue
            dist, dtype, shape = draw
            out = torch.empty(shape, dtype=dtype)
            _fast.fill(self.lib, out, dist, _fast.fold(call_key, j))
            values.append(out)
            j += 1
        return recipe.result(values)


class _KeyedMode(TorchDispatchMode):
    """The keyer as a dispatch mode (every op through Python): where :mod:`._intercept` is unavailable."""

    def __init__(self, keyer: Any) -> None:
        super().__init__()
        self.keyer = keyer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        from keyinit._engine.random_ops import is_random

        kwargs = kwargs or {}
        if not is_random(func):
            return func(*args, **kwargs)
        return self.keyer(func, args, kwargs)


class _Interception:
    """Random ops to ``keyer`` while active: the dispatch-key kernels of :mod:`._intercept` where this
    torch has them (only the random ops reach Python), else a dispatch mode (the same values)."""

    def __init__(self, keyer: Any) -> None:
        self.keyer = keyer

    def __enter__(self) -> None:
        if _intercept.available():
            self._mode: Optional[_KeyedMode] = None
            self._saved = _intercept.enter(self.keyer)
        else:
            self._mode = _KeyedMode(self.keyer)
            self._mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._mode is None:
            _intercept.leave(self._saved)
        else:
            self._mode.__exit__(*exc)


#: Held from entering a keyed sample to leaving it. Python's ``random`` and ``numpy.random`` have one
#: global state per process, so two threads in keyed ``__getitem__`` calls at once would draw from each
#: other's seeds (and restore each other's states): they take turns instead. Reentrant: a keyed dataset
#: may read another keyed dataset in its ``__getitem__``.
_GLOBAL_STATE_LOCK = threading.RLock()


def global_state_lock() -> threading.RLock:
    """The lock held while Python's ``random`` and ``numpy.random`` are keyed (by a keyed sample, a keyed
    collate or a keyed forward): one per process, a fresh one in a forked child."""
    return _GLOBAL_STATE_LOCK


def _new_lock_after_fork() -> None:
    # a DataLoader worker forked while another thread held the lock starts with a free one
    global _GLOBAL_STATE_LOCK
    _GLOBAL_STATE_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


class keyed_randomness:
    """Context manager: torch, ``random`` and numpy randomness keyed by ``sample`` (a Key) inside."""

    def __init__(self, sample: Key, site: str = "keyed_samples") -> None:
        self.sample = sample
        self.site = site

    def __enter__(self) -> "keyed_randomness":
        # random's and numpy.random's global state is one per process: threads take turns
        _GLOBAL_STATE_LOCK.acquire()
        try:
            self._enter()
        except BaseException:
            _GLOBAL_STATE_LOCK.release()
            raise
        return self

    def _enter(self) -> None:
        k = _fast.fold_str(self.sample, "python.random")
        self._py_state = _py_random.getstate()
        _py_random.seed(k.k0 | (k.k1 << 32))
        try:
            import numpy
        except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
            self._np_state = None
        else:
            from keyinit.data._numpy_state import numpy_watch

            self._watch = numpy_watch()
            self._np_state = self._watch.look()
            kn = _fast.fold_str(self.sample, "numpy.random")
            numpy.random.seed([kn.k0, kn.k1])
            self._np_seeded = self._watch.snapshot()
        self._mode = _Interception(_Keyer(self.sample, self.site))
        self._mode.__enter__()
        self._threads = ThreadDrawsRefused(self.site)  # a thread started here cannot be keyed: refused
        self._threads.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            try:
                self._threads.__exit__(*exc)  # raises if a thread's draw was refused and swallowed
            finally:
                self._mode.__exit__(*exc)
        finally:
            try:
                _py_random.setstate(self._py_state)
                if self._np_state is not None:
                    self._watch.reseeded(self._np_state, self._np_seeded)
            finally:
                _GLOBAL_STATE_LOCK.release()


class KeyedSamples(torch.utils.data.Dataset):
    """A map-style dataset whose items' randomness is keyed (see :func:`keyed_samples`)."""

    def __init__(self, dataset: Any, seed: Union[int, Key], epoch: Optional[int] = None) -> None:
        self.dataset = dataset
        self.root = seed if isinstance(seed, Key) else key(seed)  # type: ignore[arg-type]
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def _ref(self, ref: Any) -> tuple[int, int]:
        """``(index, epoch)`` of an item: a :class:`SampleIndex`, an ``(index, epoch)`` pair, or a plain
        index with the wrapper's ``epoch``."""
        if isinstance(ref, SampleIndex):
            return int(ref), ref.epoch
        if isinstance(ref, tuple) and len(ref) == 2:
            return int(ref[0]), int(ref[1])
        if self.epoch is None:
            raise TypeError(
                f"keyed_samples got the plain index {ref!r}, which does not say the epoch; use the indices "
                f"keyinit.data.KeyedSampler yields (ints that carry their epoch; with yield_epoch=True, "
                f"(index, epoch) pairs) or keyed_samples(dataset, seed, epoch=...)")
        return int(ref), int(self.epoch)

    def __getitem__(self, ref: Any) -> Any:
        index, epoch = self._ref(ref)
        with keyed_randomness(sample_key(self.root, epoch, index), f"sample {index} of epoch {epoch}"):
            return self.dataset[index]

    def __getitems__(self, refs: list) -> "KeyedBatch":
        """The items of a DataLoader batch (torch's fetcher calls this), as a list that also says each
        item's ``(epoch, index)`` (``.refs``) for :func:`keyinit.data.keyed_collate`."""
        pairs = [self._ref(ref) for ref in refs]
        items = []
        for index, epoch in pairs:
            with keyed_randomness(sample_key(self.root, epoch, index), f"sample {index} of epoch {epoch}"):
                items.append(self.dataset[index])
        return KeyedBatch(items, tuple((epoch, index) for index, epoch in pairs))


class KeyedBatch(list):
    """A list of dataset items that knows each one's ``(epoch, index)`` (``.refs``, in order).

    ``KeyedSamples.__getitems__`` returns it, so a DataLoader hands it to its ``collate_fn``; to any
    other code it is a plain list.
    """

    def __init__(self, items: Any, refs: tuple[tuple[int, int], ...]) -> None:
        super().__init__(items)
        self.refs = refs

    def __reduce__(self) -> tuple:
        return (KeyedBatch, (list(self), self.refs))


def keyed_samples(dataset: Any, seed: Union[int, Key], *, epoch: Optional[int] = None) -> KeyedSamples:
    """Wrap a map-style ``dataset`` so each item's randomness is keyed by (seed, epoch, index, call).

    Index it with what :class:`KeyedSampler` yields (:class:`SampleIndex` ints that carry their epoch),
    with ``(index, epoch)`` pairs (:class:`SampleRef`, what ``yield_epoch=True`` yields), or with plain
    indices when ``epoch`` is given (an index that carries its epoch uses its own).
    """
    return KeyedSamples(dataset, seed, epoch)
