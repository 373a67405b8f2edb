"""``keyed_samples``: the randomness of ``dataset[i]`` keyed by (seed, epoch, sample index, call ordinal).

Inside the wrapped ``__getitem__``:

- every random aten op (``torch.rand``, ``randn``, ``randint``, ``randperm``, ``bernoulli``,
  ``multinomial``, ``normal``, ``Tensor.uniform_``/``normal_``/``random_``/``bernoulli_``/
  ``exponential_``, ..., with or without ``generator=``) is replaced by its keyed equivalent
  (the table of :mod:`keyinit._engine.programs.random_ops`, shared with captured init code) under the key
  ``fold_in(sample_key(seed, epoch, index), c)``, ``c`` the op's ordinal in this call;
  the op's generator (and the global one) is neither read nor advanced;
- Python's ``random`` and ``numpy.random`` global state are seeded from the sample key
  and restored afterwards (one global state per process: threads in keyed calls take turns);
- an op with no keyed equivalent (``poisson``, gamma, fused dropout kernels) raises
  :class:`keyinit.UnkeyedRandomnessError`.

Only the random ops reach Python (:mod:`keyinit._engine.keyed.intercept`: kernels under a dispatch key
turned on for the calling thread; a dispatch mode where a torch build lacks the hooks), and the
common ones are keyed without a program (:mod:`keyinit.data._fast`, the same values).

``sample_key(seed, epoch, index) = fold_in(fold_in(fold_in(key(seed), AUGMENT_DOMAIN), epoch), index)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keyinit._engine.keyed import intercept as _intercept
from keyinit._engine.capture.outside import ThreadDrawsRefused
from keyinit._host.lock import global_state_lock
from keyinit._host.states import global_states
from keyinit.data import _fast, _fill
from keyinit.data._index import SampleIndex
from keyinit.data._positions import SamplePositions, sample_positions
from keyinit.keys import Key, as_uint64, key

__all__ = ["AUGMENT_DOMAIN", "SampleRef", "KeyedBatch", "sample_key", "keyed_samples", "KeyedSamples", "keyed_randomness",
           "Interception", "global_state_lock"]

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
    return _fill.fold_with(_fill.kernel_library(), _epoch_key(root, epoch), index)


def _epoch_key(root: Key, epoch: int) -> Key:
    return _fill.folded(_fill.folded(root, AUGMENT_DOMAIN), epoch)


def _keyed_call(func: Any, args: tuple, kwargs: dict, call_key: Key, site: str) -> Any:
    """A random op in a keyed ``__getitem__`` (or collate): the engine's keyed values for ``call_key``."""
    from keyinit._engine.keyed.keyed_op import keyed_op

    return keyed_op(func, args, kwargs, call_key, site, "the dataset's __getitem__")


class _Keyer:
    """Replaces the random ops of one keyed call: the ``c``-th under ``fold_in(sample, c)``."""

    __slots__ = ("sample", "site", "ordinal", "lib")

    def __init__(self, sample: Key, site: str, lib: Any) -> None:
        self.sample = sample
        self.site = site
        self.ordinal = 0
        self.lib = lib

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        call = self.ordinal
        self.ordinal = call + 1
        recipe = _fast.plan(func, args, kwargs)
        if recipe is None:
            return _keyed_call(func, args, kwargs, _fill.fold_with(self.lib, self.sample, call), self.site)
        return recipe.drawn(self.lib, self.sample, call)  # draw j under fold_in(fold_in(sample, call), j)


class _KeyedMode(TorchDispatchMode):
    """The keyer as a dispatch mode (every op through Python): where :mod:`keyinit._engine.keyed.intercept` is unavailable."""

    def __init__(self, keyer: Any) -> None:
        super().__init__()
        self.keyer = keyer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        from keyinit._engine.programs.random_ops import is_random

        kwargs = kwargs or {}
        if not is_random(func):
            return func(*args, **kwargs)
        return self.keyer(func, args, kwargs)


class Interception:
    """Random ops to ``keyer`` while active: the dispatch-key kernels of :mod:`keyinit._engine.keyed.intercept`
    where this torch has them (only the random ops reach Python), else a dispatch mode (the same values)."""

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


_RESOLVE = object()  # keyed_randomness(lib=...) not given: the kernel library is looked up


class keyed_randomness:
    """Context manager: torch, ``random`` and numpy randomness keyed by ``sample`` (a Key) inside.

    ``lib``: the CPU kernel library (:func:`keyinit.data._fill.kernel_library`, None: the reference
    paths), where the caller has already looked it up."""

    def __init__(self, sample: Key, site: str = "keyed_samples", *, lib: Any = _RESOLVE) -> None:
        self.sample = sample
        self.site = site
        self.lib = lib

    def __enter__(self) -> "keyed_randomness":
        # random's and numpy.random's global state is one per process: threads take turns
        global_state_lock().acquire()
        try:
            self._enter()
        except BaseException:
            global_state_lock().release()
            raise
        return self

    def _enter(self) -> None:
        lib = _fill.kernel_library() if self.lib is _RESOLVE else self.lib
        states = global_states()
        self._saved = states.save()
        try:
            states.seed(lib, _fill.fold_words(lib, self.sample, "python.random"),
                        _fill.fold_words(lib, self.sample, "numpy.random"), self._saved)
            self._mode = Interception(_Keyer(self.sample, self.site, lib))
            self._mode.__enter__()
        except BaseException:
            states.restore(self._saved)
            raise
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
                global_states().restore(self._saved)
            finally:
                global_state_lock().release()


class KeyedSamples(torch.utils.data.Dataset):
    """A map-style dataset whose items' randomness is keyed (see :func:`keyed_samples`)."""

    def __init__(self, dataset: Any, seed: Union[int, Key], epoch: Optional[int] = None) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(type(dataset), "__getitem__"):
            kind = "an IterableDataset" if isinstance(dataset, torch.utils.data.IterableDataset) else "not indexable"
            raise TypeError(
                f"keyed_samples: dataset must be map-style (dataset[index], each sample keyed by its index), got "
                f"{type(dataset).__name__}, {kind}: its samples have no index to key their randomness by")
        self.dataset = dataset
        self.root = seed if isinstance(seed, Key) else key(seed)  # type: ignore[arg-type]
        self.epoch = epoch
        self._epoch_keys: dict[int, Key] = {}  # epoch -> its key (a few per run)

    def _sample_key(self, lib: Any, index: int, epoch: int) -> Key:
        """:func:`sample_key` of this wrapper's seed, the epoch's key remembered and the fold in C (``lib``)."""
        epoch_key = self._epoch_keys.get(epoch)
        if epoch_key is None:
            if len(self._epoch_keys) >= 64:
                self._epoch_keys.clear()
            epoch_key = self._epoch_keys[epoch] = _epoch_key(self.root, as_uint64(epoch, "epoch"))
        return _fill.fold_with(lib, epoch_key, as_uint64(index, "sample index"))

    def _keyed(self, index: int, epoch: int) -> Any:
        """``self.dataset[index]`` with its randomness keyed by (epoch, index)."""
        lib = _fill.kernel_library()
        with keyed_randomness(self._sample_key(lib, index, epoch), f"sample {index} of epoch {epoch}", lib=lib):
            return self.dataset[index]

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
        return self._keyed(index, epoch)

    def __getitems__(self, refs: list) -> "KeyedBatch":
        """The items of a DataLoader batch (torch's fetcher calls this), as a list that also says each
        item's ``(epoch, index)`` (``.refs``) for :func:`keyinit.data.keyed_collate`."""
        pairs = [self._ref(ref) for ref in refs]
        items = [self._keyed(index, epoch) for index, epoch in pairs]
        return KeyedBatch(items, tuple((epoch, index) for index, epoch in pairs), sample_positions(refs))


class KeyedBatch(list):
    """A list of dataset items that knows each one's ``(epoch, index)`` (``.refs``, in order).

    ``KeyedSamples.__getitems__`` returns it, so a DataLoader hands it to its ``collate_fn``; to any
    other code it is a plain list. ``positions`` (a :class:`~keyinit.data.SamplePositions`, or None):
    where its rows sit in the run, as the indices from :meth:`KeyedSampler.batch_sampler` say; carried
    as ``.keyinit_samples`` and passed on by ``keyed_collate`` to the collated batch.
    """

    def __init__(self, items: Any, refs: tuple[tuple[int, int], ...],
                 positions: Optional[SamplePositions] = None) -> None:
        super().__init__(items)
        self.refs = refs
        if positions is not None:
            if not isinstance(positions, SamplePositions) or positions.rows != len(self):
                raise ValueError(f"KeyedBatch: positions must be None or the SamplePositions of its {len(self)} "
                                 f"rows, got {positions!r}")
            self.keyinit_samples = positions

    def __reduce__(self) -> tuple:
        return (KeyedBatch, (list(self), self.refs, sample_positions(self)))


def keyed_samples(dataset: Any, seed: Union[int, Key], *, epoch: Optional[int] = None) -> KeyedSamples:
    """Wrap a map-style ``dataset`` so each item's randomness is keyed by (seed, epoch, index, call).

    Index it with what :class:`KeyedSampler` yields (:class:`SampleIndex` ints that carry their epoch),
    with ``(index, epoch)`` pairs (:class:`SampleRef`, what ``yield_epoch=True`` yields), or with plain
    indices when ``epoch`` is given (an index that carries its epoch uses its own).
    """
    return KeyedSamples(dataset, seed, epoch)
