"""``keyed_collate``: the randomness of a collate function keyed per row by that row's sample.

A DataLoader over ``keyed_samples(dataset, seed)`` hands its ``collate_fn`` a :class:`KeyedBatch`,
which says each item's ``(epoch, index)``. Inside the wrapped collate function, the ``c``-th random
aten op of the call (counted once per call, from 0) must return one row per sample: a result whose
first dimension is the batch's rows. Its ``j``-th draw (the table of :mod:`keyinit._engine.programs.random_ops`: one
for most ops) is drawn under

    collate_key(seed, epoch, c, j) = fold_in(fold_in(fold_in(fold_in(key(seed), COLLATE_DOMAIN), epoch), c), j)

and row ``r`` (sample ``index`` of ``epoch``), element ``e`` of the row (row-major over
``result.shape[1:]``), takes that sampler's element at global flat index ``index * 2**24 + e``. So
element ``(r, e)`` depends only on row ``r``'s sample, ``c``, ``j`` and ``e``: not on the other rows,
the batch's size or order, the world size, the workers, or the padded length of a ``(batch, length)``
draw. The arithmetic after the draw is the table's (``bernoulli`` with a tensor ``p``: the word
against ``round(p * 2**32)``), element by element.

Keyed per row: ``uniform_``, ``normal_``, ``rand``, ``randn``, ``rand_like``, ``randn_like``,
``randint``, ``randint_like``, ``random_``, ``bernoulli``/``bernoulli_`` (scalar or tensor ``p``).
Refused (:class:`keyinit.UnkeyedRandomnessError`): any other random op; a draw that is not one row per
sample (a scalar, a Mixup lambda per batch, ``randperm`` of the batch to pair rows, a shape whose first
dimension is not the batch's rows), rows of more than ``2**24`` elements; and any draw from Python's
``random`` or ``numpy.random`` global state (a collate function's loop over its examples cannot say
which row it is on; the draw is detected, the state restored and the result discarded). Do such work
per sample in the dataset's ``__getitem__`` (keyed by ``keyed_samples``), or key it yourself.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch

from keyinit._host.draws import HostDrawsPutBack
from keyinit._samples.padding import check_collated
from keyinit.data import _fast, _fill
from keyinit.data._augment import Interception
from keyinit.data._positions import attach, sample_positions
from keyinit.keys import Key, as_uint64, fold_in, key

__all__ = ["COLLATE_DOMAIN", "collate_key", "keyed_collate", "KeyedCollate"]

#: The int folded into the root key first: the ASCII bytes of "collate", big-endian.
COLLATE_DOMAIN = int.from_bytes(b"collate", "big")

#: A row's elements are global flat indices ``index * ROW_STRIDE + e``: at most ROW_STRIDE elements a row,
#: sample indices below MAX_INDEX (so every flat index is below 2**62).
ROW_STRIDE = 1 << 24
MAX_INDEX = 1 << 38


def _epoch_key(root: Key, epoch: int) -> Key:
    return _fill.folded(_fill.folded(root, COLLATE_DOMAIN), epoch)


def collate_key(seed: Union[int, Key], epoch: int, call: int, draw: int = 0) -> Key:
    """The key of draw ``draw`` of random op ``call`` in the collate calls of epoch ``epoch``; row
    ``r`` (sample ``index``) takes its elements at global flat indices ``index * 2**24 + e``."""
    root = seed if isinstance(seed, Key) else key(seed)  # type: ignore[arg-type]
    parts = [as_uint64(v, what) for v, what in ((epoch, "epoch"), (call, "call"), (draw, "draw"))]
    return fold_in(fold_in(_epoch_key(root, parts[0]), parts[1]), parts[2])


def _op_name(func: Any) -> str:
    return func._schema.name.replace("aten::", "") + ("" if func._overloadname == "default" else f".{func._overloadname}")


class _RowKeyer:
    """The random ops of one collate call, drawn for all rows at once (see the module docstring)."""

    def __init__(self, root: Key, refs: tuple, site: str) -> None:
        self.rows = len(refs)
        self.site = site
        self.ordinal = 0
        self.lib = _fill.kernel_library()
        self._geometries: dict = {}
        self._root, self._refs = root, refs
        self._groups: Optional[list] = None

    @property
    def groups(self) -> list:
        """``(epoch key, the rows of that epoch (None: all), their sample indices)`` per epoch of the batch
        (made at the first random op: a collate call that draws nothing does not pay for it)."""
        if self._groups is None:
            refs, root = self._refs, self._root
            epochs = {epoch for epoch, _ in refs}
            if len(epochs) == 1:  # the usual batch: one epoch, every row
                self._groups = [(_epoch_key(root, refs[0][0]), None,
                                 torch.tensor([index for _, index in refs], dtype=torch.int64))]
            else:
                by_epoch: dict[int, list[int]] = {}
                for r, (epoch, _) in enumerate(refs):
                    by_epoch.setdefault(epoch, []).append(r)
                self._groups = [(_epoch_key(root, epoch), torch.tensor(rows),
                                 torch.tensor([refs[r][1] for r in rows], dtype=torch.int64))
                                for epoch, rows in by_epoch.items()]
        return self._groups

    def _geometry(self, rows: int, row_size: int, indices: torch.Tensor) -> "_fill.Geometry":
        cached = self._geometries.get((id(indices), row_size))
        if cached is None:
            cached = self._geometries[(id(indices), row_size)] = _fill.Geometry((rows, row_size), indices, ROW_STRIDE)
        return cached

    def refuse(self, func: Any, why: str) -> None:
        from keyinit.errors import UnkeyedRandomnessError

        raise UnkeyedRandomnessError(
            f"{self.site}: the collate function called {_op_name(func)}(), which keyed_collate cannot key per "
            f"sample: {why}. Draw it per sample in the dataset's __getitem__ (keyed_samples keys it), or "
            f"key it yourself (docs/data.md, 'Keyed collate')")

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        c = self.ordinal
        self.ordinal += 1
        recipe = _fast.plan(func, args, kwargs, randperm=False)
        if recipe is None:
            self.refuse(func, "keyed_collate keys, row by row, uniform_, normal_, rand, randn, rand_like, "
                              "randn_like, randint, randint_like, random_ and bernoulli (scalar or tensor p); "
                              "this op, these arguments or a draw for the batch as a whole (randperm, multinomial) "
                              "it does not")
        shape = recipe.shape
        if not shape or shape[0] != self.rows:
            self.refuse(func, f"its result has shape {shape}, not one row per sample of the batch's {self.rows}; "
                              f"a draw for the batch as a whole depends on which samples share it")
        row_size = math.prod(shape[1:])
        if row_size > ROW_STRIDE:
            self.refuse(func, f"a row has {row_size} elements, more than keyed_collate's 2**24")
        values: list = []
        j = 0
        for draw in recipe.draws:
            if draw is None:
                values.append(None)
                continue
            dist, dtype, _ = draw
            out = torch.empty((self.rows, row_size), dtype=dtype)
            for epoch_key, rows, indices in self.groups:
                draw_key = _fill.draw_key(epoch_key, c, j)
                geometry = self._geometry(len(indices), row_size, indices)
                if rows is None:
                    _fill.fill(self.lib, out, dist, draw_key, geometry)
                else:
                    part = torch.empty((len(rows), row_size), dtype=dtype)
                    _fill.fill(self.lib, part, dist, draw_key, geometry)
                    out[rows] = part
            values.append(out.view(shape))
            j += 1
        return recipe.result(values)


class KeyedCollate:
    """A collate function whose randomness is keyed per row (see :func:`keyed_collate`)."""

    def __init__(self, collate_fn: Optional[Callable[[Any], Any]], seed: Union[int, Key]) -> None:
        self.collate_fn = collate_fn if collate_fn is not None else torch.utils.data.default_collate
        self.root = seed if isinstance(seed, Key) else key(seed)  # type: ignore[arg-type]

    def __call__(self, batch: Any) -> Any:
        refs = getattr(batch, "refs", None)
        if refs is None:
            raise TypeError(
                f"keyed_collate got a {type(batch).__name__} that does not say its samples' (epoch, index); give "
                f"the DataLoader keyed_samples(dataset, seed) (its __getitems__ passes them) and a "
                f"keyinit.data.KeyedSampler, or call it with keyinit.data.KeyedBatch(items, refs)")
        for epoch, index in refs:
            if not 0 <= index < MAX_INDEX or not 0 <= epoch < 1 << 64:
                raise ValueError(f"keyed_collate: sample index {index} of epoch {epoch} is out of range (sample "
                                 f"indices below 2**38, epochs below 2**64)")
        first = f"{refs[0][1]} of epoch {refs[0][0]}" if refs else "none"
        site = f"keyed_collate (a batch of {len(refs)} rows, the first sample {first})"
        collated = _call_refusing_global_draws(self.collate_fn, batch, _RowKeyer(self.root, refs, site), site)
        # the rows' places in the run, for keyed(samples=); a left-padded batch warned about (keyinit._samples.padding)
        return check_collated(attach(collated, sample_positions(batch)))


def _call_refusing_global_draws(fn: Callable[[Any], Any], batch: Any, keyer: _RowKeyer, site: str) -> Any:
    """``fn(batch)`` with torch's random ops sent to ``keyer``; a draw from ``random``/``numpy.random``
    is refused (detected by comparing their states before and after; the states are restored)."""
    with HostDrawsPutBack(hold=True) as host:
        with Interception(keyer):
            result = fn(batch)
    drew = host.drew
    if drew:
        from keyinit.errors import UnkeyedRandomnessError

        raise UnkeyedRandomnessError(
            f"{site}: the collate function drew from {' and '.join(drew)}'s global state, which keyed_collate "
            f"cannot key per sample (a loop over the batch's examples does not say which row it is on); the "
            f"state is restored and the result discarded. Draw per sample in the dataset's __getitem__ "
            f"(keyed_samples keys random and numpy.random there), or use torch ops on the (batch, ...) tensor")
    return result


def keyed_collate(collate_fn: Optional[Callable[[Any], Any]], seed: Union[int, Key]) -> KeyedCollate:
    """Wrap ``collate_fn`` (None: torch's ``default_collate``) so its torch randomness is keyed per row.

    For a DataLoader over ``keyed_samples(dataset, seed)`` fed by a :class:`KeyedSampler`: row ``r``'s
    random values depend only on its sample's (epoch, index), so a sample's mask is the same for any
    world size, worker count, batch composition, padded length or resume. Batch-level draws and
    ``random``/``numpy.random`` draws are refused (:class:`keyinit.UnkeyedRandomnessError`).
    """
    return KeyedCollate(collate_fn, seed)
