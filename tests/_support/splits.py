"""The central invariant of keyed forwards, as one check: a split of the batch never changes a value.

:func:`check_splits` runs a model under ``keyinit.nn.keyed`` on the whole batch (``sample_offset=0``)
and on each split of its rows (a part ``lo:hi`` keyed with ``sample_offset=lo``, as a data-parallel
rank or a micro-batch is), joins each split's parts along dimension 0 and compares them with the
whole batch's outputs: bitwise where ``exact`` (keyed values: masks, samples, integer draws), else with
a tolerance (torch's own float kernels may round differently for another batch size or CPU ISA).
Whatever the outputs, the keep-mask of every ``nn.Dropout``-family module call is compared bitwise
(where its input is nonzero: a zero input gives a zero output whatever the mask).

    whole = check_splits(model, x, [((0, 2), (2, 6))], seed=3, step=1)

Inputs and outputs may be tensors or nested tuples, lists and dicts of them (every tensor carries the
batch in dimension 0); ``forward`` says how to call the model when ``model(*inputs)`` does not.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

import keyinit.nn as knn
from tests.conftest import assert_bits_equal

#: A split: the ``(lo, hi)`` row ranges of its parts, in order, covering the batch.
Split = Sequence[tuple[int, int]]


def keyed_forward(model: nn.Module, inputs: Any, *, seed: int, step: int = 0, sample_offset: int = 0,
                  grad_mode: Callable[[], Any] = contextlib.nullcontext, forward: Callable[..., Any] | None = None,
                  **keyed_kwargs: Any) -> Any:
    """``forward(model, *inputs)`` (default ``model(*inputs)``) under ``grad_mode()`` and
    ``keyed(model, seed, step=step, sample_offset=sample_offset, **keyed_kwargs)``; tensors cloned."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    call = forward or (lambda m, *xs: m(*xs))
    with grad_mode(), knn.keyed(model, seed, step=step, sample_offset=sample_offset, **keyed_kwargs):
        out = call(model, *inputs)
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


class _DropoutTaps:
    """Forward hooks on every dropout module of ``model``: per call, ``(output != 0, input != 0)``."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()
                         if isinstance(module, nn.modules.dropout._DropoutNd)]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if module.training and isinstance(output, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                self.calls.setdefault(name, []).append(((output != 0).detach(), (args[0] != 0).detach()))
        return hook

    def take(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        calls, self.calls = self.calls, {}
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _rows(inputs: Any, lo: int, hi: int) -> Any:
    return pytree.tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, inputs)


def check_splits(model: nn.Module, inputs: Any, splits: Sequence[Split], *, seed: int, step: int = 0,
                 exact: bool = False, rtol: float | None = None, atol: float | None = None,
                 grad_mode: Callable[[], Any] = contextlib.nullcontext, forward: Callable[..., Any] | None = None,
                 masks: bool = True, **keyed_kwargs: Any) -> Any:
    """Assert that every split in ``splits`` gives the whole batch's outputs (and dropout masks); return the
    whole batch's outputs. ``rtol``/``atol`` as ``torch.testing.assert_close`` (its defaults when None)."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    rows = pytree.tree_leaves(inputs)[0].shape[0]
    taps = _DropoutTaps(model) if masks else None
    run = dict(seed=seed, step=step, grad_mode=grad_mode, forward=forward, **keyed_kwargs)
    try:
        whole = keyed_forward(model, inputs, sample_offset=0, **run)
        whole_masks = taps.take() if taps else {}
        for split in splits:
            assert [lo for lo, _ in split] == [0] + [hi for _, hi in split[:-1]] and split[-1][1] == rows, \
                f"split {split} does not cover the {rows} rows in order"
            parts, part_masks = [], []
            for lo, hi in split:
                parts.append(keyed_forward(model, _rows(inputs, lo, hi), sample_offset=lo, **run))
                part_masks.append(taps.take() if taps else {})
            _compare_outputs(whole, parts, split, exact, rtol, atol)
            _compare_masks(whole_masks, part_masks, split)
    finally:
        if taps:
            taps.remove()
    return whole


def _compare_outputs(whole: Any, parts: list, split: Split, exact: bool, rtol: float | None,
                     atol: float | None) -> None:
    want, spec = pytree.tree_flatten(whole)
    got = [pytree.tree_flatten(part) for part in parts]
    assert all(s == spec for _, s in got), f"split {split}: the parts' outputs are not structured as the whole's"
    for i, leaf in enumerate(want):
        if not isinstance(leaf, torch.Tensor):
            continue
        joined = torch.cat([leaves[i] for leaves, _ in got])
        if exact:
            try:
                assert_bits_equal(joined, leaf)
            except AssertionError as exc:
                raise AssertionError(f"split {split} changes output {i}: {exc}") from None
        else:
            torch.testing.assert_close(joined, leaf, rtol=rtol, atol=atol,
                                       msg=lambda m, i=i: f"split {split} changes output {i}: {m}")


def _compare_masks(whole: dict, parts: list[dict], split: Split) -> None:
    for part in parts:
        assert part.keys() == whole.keys() and all(len(part[n]) == len(whole[n]) for n in whole), \
            f"split {split}: other dropout calls than the whole batch's: {sorted(part)} vs {sorted(whole)}"
    for name, calls in whole.items():
        for call, (mask, live) in enumerate(calls):
            joined = torch.cat([part[name][call][0] for part in parts])
            joined_live = torch.cat([part[name][call][1] for part in parts])
            assert joined.shape == mask.shape, f"split {split}: {name} call {call} has rows {joined.shape}, " \
                                               f"the whole batch {mask.shape} (is the batch not in dimension 0?)"
            both = live & joined_live
            assert torch.equal(joined & both, mask & both), f"split {split} changes the mask of {name} call {call}"
