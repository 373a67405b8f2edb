"""Several tensors rounded stochastically, or several parameters' fused Adam/AdamW steps, in one Triton
launch (``docs/spec.md`` 17.2, 17.6): the ``sround_many`` and ``sround_adam_many`` families' CUDA kernels.

An optimizer step of N parameters through the one-tensor kernels (:mod:`keyinit._kernels.fill.triton_sround`)
makes N launches, each with its own key derivation, region planning and Triton dispatch on the host (tens
of microseconds each: on a GPU, most of a small model's step). Here the host writes one int64 table per
launch (a row per tensor: its run, the offset of its FQN's fold inputs, its tensors' addresses and, for
Adam, the step's scalars), copies it to the device once, and launches one kernel
(:mod:`keyinit._kernels.fill.triton_sround_many_impl`) per target format or parameter dtype: each program
finds its row, derives the row's key from the step's base key on the device (``key_for``'s string folds)
and does what the one-tensor RUN kernel does. The bits are that kernel's, which are the reference's.

A tensor whose region is not one run of consecutive global indices stored contiguously, or whose tensors
do not match (dtype, device, layout), is handed back to the caller, which rounds or steps it alone.
Triton is imported lazily; without it everything is handed back. Under ``TRITON_INTERPRET=1`` CPU tensors
are accepted with ``interpret_ok`` (the tests).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any, Optional

import torch

from keyinit._bits.sround import TARGETS
from keyinit._bits.streams import derives_as_v1, stream_words
from keyinit._kernels.fill.triton_sround import format_options, round_f32
from keyinit.keys import Key, fold_inputs
from keyinit.regions import Region, row_major_strides

__all__ = ["sround_many", "sround_adam_many", "run_start"]

#: The parameter types of the fused step (its ``PTYPE``: keyinit._kernels.fill.cpu.ADAM_TYPES's ids).
_PTYPES = {torch.bfloat16: 0, torch.float16: 1}
#: Philox blocks a program takes (4 elements each), as the one-tensor RUN kernels.
_NB = 256


@functools.lru_cache(maxsize=None)
def _impl() -> Any:
    try:
        from keyinit._kernels.fill import triton_sround_many_impl
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return triton_sround_many_impl


def run_start(region: Region) -> Optional[int]:
    """The first global flat index of ``region`` if its elements, in row-major order, are consecutive
    global indices (a whole tensor, rows of full dims under a unit-step slice, one element ...); else
    ``None``."""
    shape, entries = region.shape, region.entries
    k = len(shape) - 1
    while k >= 0 and isinstance(entries[k], range) and entries[k] == range(shape[k]):
        k -= 1  # full dims, innermost first
    if k >= 0 and not (isinstance(entries[k], range) and (entries[k].step == 1 or len(entries[k]) == 1)):
        return None
    if any(len(entries[d]) != 1 for d in range(k)):
        return None
    base = 0
    for entry, stride in zip(entries, row_major_strides(shape)):
        if len(entry):
            base += int(entry[0]) * stride
    return base


def _f32_bits(values: "list[float]") -> "list[int]":
    """The binary32 bit patterns of ``values`` (binary32 values, or within binary32's range) rounded to
    nearest, as unsigned ints."""
    return list(struct.unpack(f"<{len(values)}I", struct.pack(f"<{len(values)}f", *values)))


def _usable(impl: Any, base: Key) -> bool:
    return impl is not None and base.impl.words is stream_words and derives_as_v1(base.stream)


def _matching(tensors: Sequence[torch.Tensor], interpret_ok: bool) -> bool:
    first = tensors[0]
    return ((first.device.type == "cuda" or interpret_ok)
            and all(t.device == first.device and t.shape == first.shape and t.is_contiguous() for t in tensors))


def _grouped(items: Sequence[Any], takes: Any) -> "tuple[list, dict[tuple, list]]":
    """``(handed back, {(device, dtype of item[0]): [(item, run start), ...]})``: the items ``takes`` accepts
    whose region is one run, grouped (empty ones dropped: nothing to do), and the others."""
    rest: list = []
    groups: dict[tuple, list] = {}
    for item in items:
        start = run_start(item.region) if takes(item) else None
        if start is None:
            rest.append(item)
        elif item[0].numel():
            groups.setdefault((item[0].device, item[0].dtype), []).append((item, start))
    return rest, groups


def sround_many(items: Sequence[Any], base: Key, *, interpret_ok: bool = False) -> list:
    """Round ``items`` (:class:`keyinit._draw.dispatch.RoundItem`: destination, float32 source, FQN,
    region; each keyed by ``key_for(base, fqn)``) with one launch per target format and device; returns
    the items it did not round."""
    impl = _impl()
    if not _usable(impl, base):
        return list(items)
    rest, groups = _grouped(items, lambda item: (item.out.dtype in TARGETS and item.x.dtype == torch.float32
                                                 and _matching((item.out, item.x), interpret_ok)))
    for (device, dtype), group in groups.items():
        rows = [[item.out.data_ptr(), item.x.data_ptr()] for item, _ in group]
        _launch(impl.sround_many_kernel, group, rows, base, device, format_options(TARGETS[dtype]))
        for item, _ in group:
            torch.autograd.graph.increment_version(item.out)
    return rest


def sround_adam_many(items: Sequence[Any], base: Key, *, interpret_ok: bool = False) -> list:
    """Step ``items`` (:class:`keyinit._draw.dispatch.AdamItem`: parameter, gradient, moments, FQN, region,
    scalars, has_decay; each keyed by ``key_for(base, fqn)``) with one launch per parameter dtype and
    device; returns the items it did not step."""
    impl = _impl()
    if not _usable(impl, base):
        return list(items)
    rest, groups = _grouped(items, lambda item: (
        item.param.dtype in _PTYPES and item.grad.dtype == item.param.dtype and item.exp_avg.dtype == torch.float32
        and item.exp_avg_sq.dtype == torch.float32 and _matching(item[:4], interpret_ok)))
    for (device, dtype), group in groups.items():
        rows = []
        for item, _ in group:
            decay, w, beta2, s2, bc2s, eps, neg_step = (round_f32(s) for s in item.scalars)
            rows.append([item.param.data_ptr(), item.grad.data_ptr(), item.exp_avg.data_ptr(),
                         item.exp_avg_sq.data_ptr(), int(bool(item.has_decay)),
                         *_f32_bits([decay, w, w - 1.0, beta2, s2, bc2s, eps, neg_step])])
        _launch(impl.adam_many_kernel, group, rows, base, device, dict(PTYPE=_PTYPES[dtype]))
        for item, _ in group:
            for t in (item.param, item.exp_avg, item.exp_avg_sq):
                torch.autograd.graph.increment_version(t)
    return rest


def _launch(kernel: Any, group: list, columns: "list[list[int]]", base: Key, device: torch.device,
            options: dict) -> None:
    """One launch of ``kernel`` over ``group`` (``(item, run start)`` pairs) whose rows end with
    ``columns``: the table (firsts, rows, fold inputs) copied to ``device`` in one transfer."""
    rows: list[int] = []
    words: list[int] = []
    firsts = [0]
    tag = 0
    for (item, start), tail in zip(group, columns):
        folds = [fold_inputs(part) for part in item.fqn.split(".")]
        tag = folds[0][0]
        numel = item.region.numel
        rows += [numel, start, len(folds), len(words) // 3, *tail]
        for _, data in folds:
            words.extend(data)
        firsts.append(firsts[-1] + -(-(numel + start % 4) // (4 * _NB)))
    nrows = len(group)
    table = torch.tensor(firsts + rows + words, dtype=torch.int64, device="cpu").to(device)
    rows_at = nrows + 1
    words_at = rows_at + len(rows)
    k0, k1 = base.words
    args = (table[rows_at:], table, table[words_at:] if words else table, nrows, k0, k1, tag)
    options = dict(options, NB=_NB, SEARCH=max(1, nrows.bit_length()), enable_fp_fusion=False)
    grid = (firsts[-1],)
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **options)
    else:
        kernel[grid](*args, **options)
