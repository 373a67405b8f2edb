"""Triton keyed-dropout kernel (CUDA tensors), bit-identical to the C kernel and the reference.

Imported only when a CUDA tensor needs it (``keyinit.nn._ops.op`` imports this module
lazily and falls back to the reference when triton is missing). Under
``TRITON_INTERPRET=1`` it runs on CPU tensors, which is how the tests check it
without a GPU (:func:`run` with ``interpret_ok=True``).

One pass: each program computes the Philox words of its elements, the keep
decision ``word < threshold`` and ``kept ? x * scale : +0``; the backward is the
same launch on the gradient. An element's word is lane ``g % 4`` of
``Philox4x32-10((lo32(g / 4), hi32(g / 4), lo32(h), hi32(h)), K)`` for its global
index ``g`` and high counter words ``h = hbase + sum_d hstrides[d] * idx_d(p_d)``,
as the C kernel takes them: ``h`` is 0 except in stream v2's extent-free names of
keyed forwards (``docs/spec.md`` 14.8: sample and third coordinate), and the
constexpr ``HIGH`` leaves the ``h = 0`` kernels as they were. Three modes:

- ``RUN``: the tensor's global indices are one run ``base, base+1, ...`` with one
  ``h`` (a plain tensor, rows of a batch, Replicate/Shard(0) DTensors, one v2
  row): a program covers 1024 consecutive stream words from a multiple of 4,
  computes each Philox block once (256 blocks) and interleaves the four lanes into
  word order. ``VEC > 1`` (the run starts on a Philox block and ``numel`` is a
  multiple of ``VEC``, a 16-byte vector of the dtype) tells the compiler that
  positions are block-aligned and the bounds mask constant over ``VEC`` elements,
  so loads and stores are vectors;
- ``ROWS`` (high words only, rows of at least ``ROWS_MIN``): the innermost
  dimension is a run with one ``h`` per row (v2's ``c_1``; the row's sample and
  other coordinates give its start and ``h``). A program takes ``rows_per``
  consecutive rows and each row in tiles of ``BLOCK`` words, ``RUN``'s tile: the
  outer positions are divided out once per program, and from row to row only the
  innermost outer coordinate steps (the others again when it wraps), so the
  divisions and the loads of the layout's table are not paid per tile (one
  program per tile of 1024 spent about as much on them as on the Philox rounds).
  :class:`Tuning` sets the tile, the warps and the elements a program takes;
- general: any layout (index vectors, sharded inner dimensions, short rows); each
  element computes its own block and picks its lane.

Arithmetic as in ``docs/spec.md`` section 14: a lone IEEE multiply (no FMA to
contract; ``enable_fp_fusion=False`` all the same); bfloat16 is rounded from the
binary32 product to nearest even (torch's rule) by the hardware's conversion on the
GPU, on its bits under the interpreter (``Tuning.bf16_cvt``), float16 by the
round-to-nearest-even conversion. The keep test is one 32-bit comparison,
``word <= threshold - 1`` (``p = 1``, threshold 0, zeroes the output on the host). The scales reach the kernel as bit patterns, so
no host conversion can round them. Throughput: benchmarks/bench_dropout.py
(``--device cuda``; the H100 numbers are in docs/benchmarks.md).
"""

# (no ``from __future__ import annotations``: Triton reads the parameters' annotations as objects, I64 included)
import struct
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from keyinit._kernels.common.ids import DTYPE, DTYPE_IDS
from keyinit._kernels.common.triton_philox import philox, philox_hi  # Philox4x32-10 of (c0, c1, 0|c2, 0|c3)

__all__ = ["run", "BLOCK", "Tuning", "TUNING"]

BLOCK = 1024
#: dtype ids (the one table, keyinit._kernels.common.ids) of the dtypes dropout takes, as the C kernel gets them.
_KINDS = {dtype: DTYPE_IDS[dtype] for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
DTYPE_FLOAT32 = tl.constexpr(DTYPE["float32"])
DTYPE_FLOAT64 = tl.constexpr(DTYPE["float64"])
DTYPE_BFLOAT16 = tl.constexpr(DTYPE["bfloat16"])
#: The kernel's modes (see the module docstring), as the host picks them and as the kernel reads them.
RUN, ROWS, ANY = 0, 1, 2
MODE_RUN = tl.constexpr(RUN)
MODE_ROWS = tl.constexpr(ROWS)
#: Rows mode needs rows at least this long (shorter ones: one Philox block per element, the general mode).
ROWS_MIN = 64


class Tuning(NamedTuple):
    """How the kernel runs; no value depends on it. The rows mode's launch: tiles of at most ``tile_bytes``
    bytes of the dtype (a power of two: 1024 float32 or 2048 bfloat16 words for 4096; shorter rows, the next
    power of two of their span, at least 128 words), at most ``warps`` warps a program (and 256 words a warp
    at least), about ``elements`` elements a program (whole rows, at least one).
    ``bf16_cvt`` (every mode, compiled kernels): bfloat16 rounded by the hardware's conversion (round to nearest
    even, two a word), not by integer arithmetic on the bits (both torch's rule; NaN is set to 0x7FC0 after
    either). Triton's interpreter does not round its conversion to nearest even, so it always takes the bits.
    ``bf16_nan=False`` (with ``bf16_cvt``): a kept NaN is the conversion's NaN, not set to 0x7FC0 (the C
    kernel's bits): docs/spec.md 14.3 leaves a NaN's sign and payload out of the contract, every other value
    is the same."""

    tile_bytes: int = 4096
    warps: int = 4
    elements: int = 16384
    bf16_cvt: bool = True
    bf16_nan: bool = True


#: How the kernel runs unless :func:`run` is given another (benchmarks/triton_dropout_sweep.py times others).
#: ``bf16_cvt`` is on since a GPU run (H200, 2026-11-28: the sweep over every bfloat16 bit pattern and
#: ``tests/gpu/test_dropout_triton_v2.py``) found the hardware conversion's bits equal to the integer rounding's
#: and the C kernel's; the interpreter checks only the integer rounding.
TUNING = Tuning()
#: The kernel's runtime integers: every one int64 and none specialized on its value (Triton would otherwise
#: type each i32 or i64 by value and specialize on divisibility, compiling a variant per batch offset).
_INTS = ["numel", "base", "hbase", "inner", "tiles", "rows_per", "k0", "k1", "threshold", "s32_bits", "s64_bits"]
I64 = tl.int64
_INT64_MAX = (1 << 63) - 1


@triton.jit
def _dropped(x, keep, s32, s64, KIND: tl.constexpr, CVT: tl.constexpr, NAN: tl.constexpr):
    """``keep ? x * scale : +0`` in the dtype's arithmetic, as stored (bfloat16 as int16 bits)."""
    if KIND == DTYPE_FLOAT32:
        value = x * s32
        return tl.where(keep, value, tl.zeros_like(value))
    elif KIND == DTYPE_FLOAT64:
        value = x * s64
        return tl.where(keep, value, tl.zeros_like(value))
    elif KIND == DTYPE_BFLOAT16:
        # the binary32 product, zeroed where dropped, rounded to nearest even; NaN as torch rounds it (0x7FC0)
        v = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True) * s32
        v = tl.where(keep, v, tl.zeros_like(v))
        if CVT:  # the hardware's conversion (cvt.rn.bf16x2.f32: two a word), whatever bits it gives a NaN
            rounded = v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
            if NAN:
                rounded = tl.where(v != v, tl.zeros_like(rounded) + 0x7FC0, rounded)
            return rounded
        else:
            u = v.to(tl.uint32, bitcast=True)
            rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
            rounded = tl.where(v != v, 0x7FC0, rounded)
            return rounded.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        value = (x.to(tl.float32) * s32).to(tl.float16)
        return tl.where(keep, value, tl.zeros_like(value))


@triton.jit
def _run_words(first, h, key0, key1, HIGH: tl.constexpr, BLOCK: tl.constexpr):
    """The stream words ``first .. first+BLOCK-1`` (``first % 4 == 0``) of high counter words ``h`` (a scalar;
    0 unless ``HIGH``): each Philox block computed once, its four lanes interleaved into word order."""
    blocks = (first >> 2) + tl.arange(0, BLOCK // 4).to(tl.int64)
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    if HIGH:
        c2 = tl.zeros_like(c0) + (h & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.zeros_like(c0) + (h >> 32).to(tl.uint32)
        r0, r1, r2, r3 = philox_hi(c0, c1, c2, c3, tl.zeros_like(c0) + key0, tl.zeros_like(c0) + key1)
    else:
        r0, r1, r2, r3 = philox(c0, c1, tl.zeros_like(c0) + key0, tl.zeros_like(c0) + key1)
    return tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # block-major, lane-minor


@triton.jit
def _apply(x_ptr, out_ptr, position, mask, words, threshold, s32, s64, KIND: tl.constexpr, CVT: tl.constexpr,
           NAN: tl.constexpr):
    """``out[position] = word < threshold ? x[position] * scale : +0`` where ``mask`` (``threshold >= 1``)."""
    keep = words <= (threshold - 1).to(tl.uint32)  # word < threshold (1 .. 2**32) in one 32-bit comparison
    x = tl.load(x_ptr + position, mask=mask, other=0)
    tl.store(out_ptr + position, _dropped(x, keep, s32, s64, KIND, CVT, NAN), mask=mask)


@triton.jit
def _row_outer(row, meta_ptr, index_ptr, base, hbase, NDIM: tl.constexpr, GATHER: tl.constexpr):
    """Of row ``row`` (its position in the outer dims): the global index and high words of its dims before the
    innermost outer one, and its coordinate in that one. Meta rows: size, global stride, high stride, offset
    of the dim's indices in ``index_ptr`` (read only with ``GATHER``: some outer dim has an index vector)."""
    size = tl.load(meta_ptr + 4 * (NDIM - 2))
    c = row % size
    rest = row // size
    g = base
    h = hbase
    for d in tl.static_range(NDIM - 3, -1, -1):
        size = tl.load(meta_ptr + 4 * d)
        at = rest % size
        if GATHER:
            at = tl.load(index_ptr + tl.load(meta_ptr + 4 * d + 3) + at)
        g += at * tl.load(meta_ptr + 4 * d + 1)
        h += at * tl.load(meta_ptr + 4 * d + 2)
        rest = rest // size
    return g, h, c


@triton.jit
def _rows(x_ptr, out_ptr, meta_ptr, index_ptr, numel, base, hbase, inner, tiles, rows_per, key0, key1, threshold,
          s32, s64, NDIM: tl.constexpr, GATHER: tl.constexpr, KIND: tl.constexpr, CVT: tl.constexpr,
          NAN: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The rows mode: rows ``pid * rows_per ..`` (at most ``rows_per``), each a run of ``inner`` consecutive
    global indices from its ``g`` with high words ``h``, in ``tiles`` tiles of ``BLOCK`` words."""
    nrows = numel // inner
    first_row = tl.program_id(0).to(tl.int64) * rows_per
    last = NDIM - 2  # the innermost outer dim: from row to row its coordinate steps by one
    size = tl.load(meta_ptr + 4 * last)
    gstride = tl.load(meta_ptr + 4 * last + 1)
    hstride = tl.load(meta_ptr + 4 * last + 2)
    offset = tl.load(meta_ptr + 4 * last + 3)
    g0, h0, c = _row_outer(first_row, meta_ptr, index_ptr, base, hbase, NDIM, GATHER)
    for row in range(first_row, tl.minimum(first_row + rows_per, nrows)):
        at = c
        if GATHER:
            at = tl.load(index_ptr + offset + c)
        g = g0 + at * gstride
        h = h0 + at * hstride
        if VEC > 1:  # every row starts on a Philox block and inner % VEC == 0
            start = tl.multiple_of(row * inner, VEC)
            for tile in range(0, tiles):
                within = tile * BLOCK + tl.arange(0, BLOCK)
                mask = tl.max_constancy(within < inner, VEC)
                words = _run_words(g + tile * BLOCK, h, key0, key1, True, BLOCK)
                _apply(x_ptr + start, out_ptr + start, within, mask, words, threshold, s32, s64, KIND, CVT, NAN)
        else:
            start = row * inner
            for tile in range(0, tiles):
                first = (g - (g & 3)) + tile * BLOCK
                within = first + tl.arange(0, BLOCK).to(tl.int64) - g
                mask = (within >= 0) & (within < inner)
                words = _run_words(first, h, key0, key1, True, BLOCK)
                _apply(x_ptr + start, out_ptr + start, tl.where(mask, within, 0), mask, words, threshold, s32, s64,
                       KIND, CVT, NAN)
        c += 1
        if c == size:  # the next row starts the next position of the dims before
            g0, h0, c = _row_outer(tl.minimum(row + 1, nrows - 1), meta_ptr, index_ptr, base, hbase, NDIM, GATHER)


@triton.jit(do_not_specialize=_INTS)
def _dropout_kernel(x_ptr, out_ptr, meta_ptr, index_ptr, numel: I64, base: I64, hbase: I64, inner: I64, tiles: I64,
                    rows_per: I64, k0: I64, k1: I64, threshold: I64, s32_bits: I64, s64_bits: I64,
                    NDIM: tl.constexpr, MODE: tl.constexpr, HIGH: tl.constexpr, GATHER: tl.constexpr,
                    KIND: tl.constexpr, CVT: tl.constexpr, NAN: tl.constexpr, BLOCK: tl.constexpr,
                    VEC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    key0 = k0.to(tl.uint32)
    key1 = k1.to(tl.uint32)
    s32 = s32_bits.to(tl.int32).to(tl.float32, bitcast=True)
    s64 = s64_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if MODE == MODE_ROWS:
        _rows(x_ptr, out_ptr, meta_ptr, index_ptr, numel, base, hbase, inner, tiles, rows_per, key0, key1, threshold,
              s32, s64, NDIM, GATHER, KIND, CVT, NAN, BLOCK, VEC)
    else:
        if MODE == MODE_RUN:
            # Global indices base .. base+numel-1, high words hbase. This program: words first .. first+BLOCK-1.
            first = (base - (base & 3)) + pid * BLOCK
            words = _run_words(first, hbase, key0, key1, HIGH, BLOCK)
            if VEC > 1:  # base % 4 == 0 (first == base + pid * BLOCK) and numel % VEC == 0
                position = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
                mask = tl.max_constancy(position < numel, VEC)
            else:
                position = first + tl.arange(0, BLOCK).to(tl.int64) - base
                mask = (position >= 0) & (position < numel)
        else:
            position = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = position < numel
            rest = tl.where(mask, position, 0)
            g = tl.zeros([BLOCK], dtype=tl.int64) + base
            h = tl.zeros([BLOCK], dtype=tl.int64) + hbase
            for d in tl.static_range(NDIM - 1, -1, -1):
                size = tl.load(meta_ptr + 4 * d)
                at = tl.load(index_ptr + tl.load(meta_ptr + 4 * d + 3) + rest % size)
                g += at * tl.load(meta_ptr + 4 * d + 1)
                if HIGH:
                    h += at * tl.load(meta_ptr + 4 * d + 2)
                rest = rest // size
            c0 = ((g >> 2) & 0xFFFFFFFF).to(tl.uint32)
            c1 = (g >> 34).to(tl.uint32)
            if HIGH:
                c2 = (h & 0xFFFFFFFF).to(tl.uint32)
                c3 = (h >> 32).to(tl.uint32)
                r0, r1, r2, r3 = philox_hi(c0, c1, c2, c3, tl.zeros_like(c0) + key0, tl.zeros_like(c0) + key1)
            else:
                r0, r1, r2, r3 = philox(c0, c1, tl.zeros_like(c0) + key0, tl.zeros_like(c0) + key1)
            lane = (g & 3).to(tl.int32)
            words = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
            position = tl.where(mask, position, 0)
        _apply(x_ptr, out_ptr, position, mask, words, threshold, s32, s64, KIND, CVT, NAN)


def _storage(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


class _Plan(NamedTuple):
    """A launch: ``inner`` (the rows mode's row length), ``tiles`` (a row's), ``rows_per`` (a program's rows) and
    ``gather`` (an outer dim has an index vector) matter in the rows mode only."""

    mode: int
    high: bool
    ndim: int
    inner: int
    tiles: int
    block: int
    vec: int
    grid: tuple
    warps: int = 4
    rows_per: int = 1
    gather: bool = False


def _plan(geometry, numel: int, element_size: int, rows: Tuning = TUNING) -> _Plan:
    """The launch for ``geometry`` (``numel`` elements of ``element_size`` bytes); ``rows``: the rows mode's
    launch (``rows.bf16_cvt`` is the caller's)."""
    sizes, gstrides, indices = geometry.sizes, geometry.gstrides, geometry.indices
    hstrides = geometry.hstrides or (0,) * len(sizes)
    high = bool(geometry.hstrides) or geometry.hbase != 0
    last_is_run = indices[-1] is None and gstrides[-1] == 1 and hstrides[-1] == 0
    if len(sizes) == 1 and last_is_run:
        vec = 16 // element_size
        if geometry.base & 3 or numel % vec:
            vec = 1
        return _Plan(RUN, high, 1, 0, 1, BLOCK, vec, (triton.cdiv((geometry.base & 3) + numel, BLOCK),))
    inner = sizes[-1]
    if high and last_is_run and inner >= ROWS_MIN:
        # every row starts on a Philox block when base and the outer global strides are multiples of 4
        aligned = geometry.base % 4 == 0 and all(g % 4 == 0 for g in gstrides[:-1])
        span = inner if aligned else inner + 3
        block = min(max(1, rows.tile_bytes // element_size), max(128, triton.next_power_of_2(span)))
        if block & (block - 1):
            raise ValueError(f"keyinit::dropout: Tuning.tile_bytes must be a power of two, got {rows.tile_bytes}")
        vec = 16 // element_size
        if not aligned or inner % vec:
            vec = 1
        tiles = triton.cdiv(span, block)
        nrows = numel // inner
        rows_per = min(nrows, max(1, rows.elements // (tiles * block)))
        warps = max(1, min(rows.warps, block // 256))
        gather = any(index is not None for index in indices[:-1])
        return _Plan(ROWS, high, len(sizes), inner, tiles, block, vec, (triton.cdiv(nrows, rows_per),), warps,
                     rows_per, gather)
    return _Plan(ANY, high, len(sizes), 0, 1, BLOCK, 1, (triton.cdiv(numel, BLOCK),))


#: ``(device, mode, sizes, gstrides, hstrides) -> (meta, indices)`` on the device, for layouts without index
#: vectors: a layout's tables are copied to its device once, not per call (a copy from pageable memory waits
#: for the device: every dropout stalled the host until the GPU had caught up).
_TABLES: dict = {}
_TABLES_MAX = 256


def _tables(geometry, hstrides, mode: int, device: torch.device):
    """The kernel's ``meta`` (per dim: size, global stride, high stride, offset of its indices) and ``indices``
    (the dims' index vectors, ``arange`` where a dim has none) on ``device``; the run mode reads neither, the
    rows mode no index of its run's dim and none at all without index vectors."""
    gather = any(index is not None for index in geometry.indices)
    key = None
    if not gather:
        key = (device, RUN) if mode == RUN else (device, mode, geometry.sizes, geometry.gstrides, tuple(hstrides))
        cached = _TABLES.get(key)
        if cached is not None:
            return cached
    if mode == RUN:
        meta, indices = torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    else:
        table, pieces, offset = [], [], 0
        for d, (size, gstride, hstride, index) in enumerate(zip(geometry.sizes, geometry.gstrides, hstrides,
                                                                geometry.indices)):
            if mode == ROWS and (d == len(geometry.sizes) - 1 or not gather):
                vector = torch.zeros(1, dtype=torch.int64)  # (read by no program)
            else:
                vector = torch.arange(size, dtype=torch.int64) if index is None else index
            table.append([size, gstride, hstride, offset])
            pieces.append(vector)
            offset += int(vector.numel())
        meta, indices = torch.tensor(table, dtype=torch.int64).reshape(-1), torch.cat(pieces)
    if device.type == "cuda":  # from pinned memory: the copy does not wait for the device
        meta = meta.pin_memory().to(device, non_blocking=True)
        indices = indices.pin_memory().to(device, non_blocking=True)
    if key is not None:
        if len(_TABLES) >= _TABLES_MAX:  # (a launch on another stream may still read one: wait, then drop all)
            for cuda in {k[0] for k in _TABLES if k[0].type == "cuda"}:
                torch.cuda.synchronize(cuda)
            _TABLES.clear()
        _TABLES[key] = (meta, indices)
    return meta, indices


def run(x: torch.Tensor, out: torch.Tensor, geometry, *, interpret_ok: bool = False,
        tuning: Optional[Tuning] = None) -> bool:
    """``out = dropout(x)`` for contiguous ``x``/``out`` laid out by ``geometry``; ``False``: nothing written.

    Runs for CUDA tensors; CPU tensors only with ``interpret_ok`` (the tests, under ``TRITON_INTERPRET=1``).
    ``tuning``: how it runs (default :data:`TUNING`; the values are the same under any).
    """
    kind = _KINDS.get(x.dtype)
    if kind is None or (x.device.type != "cuda" and not interpret_ok):
        return False
    hstrides = geometry.hstrides or (0,) * len(geometry.sizes)
    if not 0 <= geometry.hbase <= _INT64_MAX or any(abs(h) > _INT64_MAX for h in hstrides):
        return False  # (stream v2's names stay below 2**63: docs/spec.md 14.8's limits)
    numel = x.numel()
    if numel == 0:
        return True
    if geometry.threshold == 0:  # (p = 1) nothing kept: +0 everywhere, all bits zero in every dtype
        out.zero_()
        return True
    s32_bits = struct.unpack("<i", struct.pack("<f", geometry.scale32))[0]
    s64_bits = struct.unpack("<q", struct.pack("<d", geometry.scale64))[0]
    tuning = TUNING if tuning is None else tuning
    plan = _plan(geometry, numel, x.element_size(), tuning)
    mode, ndim = plan.mode, plan.ndim
    meta, index_all = _tables(geometry, hstrides, mode, x.device)
    args = (_storage(x), _storage(out), meta, index_all, numel, geometry.base, geometry.hbase, plan.inner,
            plan.tiles, plan.rows_per, geometry.k0, geometry.k1, geometry.threshold, s32_bits, s64_bits)
    cvt = tuning.bf16_cvt and x.device.type == "cuda"  # (the interpreter's conversion is not the hardware's)
    options = dict(NDIM=ndim, MODE=mode, HIGH=plan.high, GATHER=plan.gather, KIND=kind, CVT=cvt,
                   NAN=tuning.bf16_nan or not cvt, BLOCK=plan.block, VEC=plan.vec, num_warps=plan.warps,
                   enable_fp_fusion=False)
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            _dropout_kernel[plan.grid](*args, **options)
    else:
        _dropout_kernel[plan.grid](*args, **options)
    torch.autograd.graph.increment_version(out)
    return True
