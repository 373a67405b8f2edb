"""The fused Adam/AdamW step of several parameters in one Triton launch (``docs/spec.md`` 17.6): the
``sround_adam_many`` family's CUDA kernel.

A step of N parameters through :func:`keyinit._kernels.fill.triton_sround.sround_adam` makes N launches,
each with its own key derivation, region planning and Triton dispatch on the host (a few tens of
microseconds each: on a GPU most of a small model's step). Here the host writes one int64 table per
parameter dtype (a row per parameter: its four tensors' addresses, its run, the offset of its FQN's fold
inputs and the step's scalars; ``MANY_COLUMNS``), copies it to the device once, and launches
:func:`keyinit._kernels.fill.triton_sround_run.adam_many_kernel` once: each program finds its row,
derives the row's key from the step's base key on the device (``key_for``'s string folds, section 3)
and steps its elements as the one-parameter RUN kernel does. The bits are the one-parameter kernel's,
which are the reference's.

A parameter whose region is not one run of consecutive global indices stored contiguously, or whose
tensors do not match (dtype, device, layout), is returned to the caller, which steps it alone. Triton
is imported lazily; without it every item is returned. Under ``TRITON_INTERPRET=1`` CPU tensors are
accepted with ``interpret_ok`` (the tests).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any, Optional

import torch

from keyinit._bits.streams import derives_as_v1, stream_words
from keyinit.keys import Key, fold_inputs
from keyinit.regions import Region, row_major_strides

__all__ = ["sround_adam_many", "run_start"]

#: The parameter types the kernel steps (its ``PTYPE``: keyinit._kernels.fill.cpu.ADAM_TYPES's ids).
_PTYPES = {torch.bfloat16: 0, torch.float16: 1}
#: Philox blocks a program steps (4 elements each), as the one-parameter RUN kernel.
_NB = 256


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    try:
        from keyinit._kernels.fill import triton_sround_run
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return triton_sround_run


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
    """The binary32 bit patterns of ``values`` rounded to nearest (as unsigned ints)."""
    return list(struct.unpack(f"<{len(values)}I", struct.pack(f"<{len(values)}f", *values)))


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def sround_adam_many(items: Sequence[Any], base: Key, *, interpret_ok: bool = False) -> list:
    """Step ``items`` (:class:`keyinit._draw.dispatch.AdamItem`: parameter, gradient, moments, FQN, region,
    scalars, has_decay; each keyed by ``key_for(base, fqn)``) with one launch per parameter dtype and
    device; returns the items it did not step. CUDA tensors (CPU with ``interpret_ok``, under the
    interpreter)."""
    impl = _kernel()
    if impl is None or base.impl.words is not stream_words or not derives_as_v1(base.stream):
        return list(items)
    rest: list = []
    groups: dict[tuple, list] = {}
    for item in items:
        param, grad, exp_avg, exp_avg_sq = item.param, item.grad, item.exp_avg, item.exp_avg_sq
        ptype = _PTYPES.get(param.dtype)
        tensors = (param, grad, exp_avg, exp_avg_sq)
        if (ptype is None or grad.dtype != param.dtype or exp_avg.dtype != torch.float32
                or exp_avg_sq.dtype != torch.float32 or (param.device.type != "cuda" and not interpret_ok)
                or any(t.device != param.device or t.shape != param.shape or not t.is_contiguous()
                       for t in tensors)):
            rest.append(item)
            continue
        start = run_start(item.region)
        if start is None:
            rest.append(item)
            continue
        if param.numel():
            groups.setdefault((param.device, ptype), []).append((item, start))
    for (device, ptype), group in groups.items():
        _launch(impl, group, base, device, ptype)
    return rest


def _launch(impl: Any, group: list, base: Key, device: torch.device, ptype: int) -> None:
    rows: list[list[int]] = []
    words: list[int] = []
    firsts = [0]
    tag = None
    for item, start in group:
        folds = [fold_inputs(part) for part in item.fqn.split(".")]
        tag = folds[0][0]
        decay, w, beta2, s2, bc2s, eps, neg_step = (_f32(s) for s in item.scalars)
        numel = item.param.numel()
        rows.append([item.param.data_ptr(), item.grad.data_ptr(), item.exp_avg.data_ptr(), item.exp_avg_sq.data_ptr(),
                     numel, start, firsts[-1], int(bool(item.has_decay)), len(folds), len(words) // 3,
                     *_f32_bits([decay, w, w - 1.0, beta2, s2, bc2s, eps, neg_step])])
        for _, data in folds:
            words.extend(data)
        firsts.append(firsts[-1] + -(-(numel + start % 4) // (4 * _NB)))
    nrows = len(rows)
    host = torch.tensor(firsts + [v for row in rows for v in row] + words, dtype=torch.int64)
    table = host.to(device)
    firsts_at, rows_at = 0, nrows + 1
    words_at = rows_at + nrows * impl.MANY_COLUMNS
    search = max(1, nrows.bit_length())
    k0, k1 = base.words
    args = (table[rows_at:], table[firsts_at:], table[words_at:] if words else table, nrows, k0, k1, tag)
    options = dict(PTYPE=ptype, NB=_NB, SEARCH=search, enable_fp_fusion=False)
    grid = (firsts[-1],)
    if device.type == "cuda":
        with torch.cuda.device(device):
            impl.adam_many_kernel[grid](*args, **options)
    else:
        impl.adam_many_kernel[grid](*args, **options)
    for item, _ in group:
        for t in (item.param, item.exp_avg, item.exp_avg_sq):
            torch.autograd.graph.increment_version(t)
