"""Triton keyed-dropout kernel (CUDA tensors), bit-identical to the C kernel and the reference.

Imported only when a CUDA tensor needs it (``keyinit.nn._op`` imports this module
lazily and falls back to the reference when triton is missing). Under
``TRITON_INTERPRET=1`` it runs on CPU tensors, which is how the tests check it
without a GPU (:func:`run` with ``interpret_ok=True``).

One pass: each program computes the Philox words of its elements, the keep
decision ``word < threshold`` and ``kept ? x * scale : +0``; the backward is the
same launch on the gradient. Two modes:

- ``RUN``: the tensor's global indices are one run ``base, base+1, ...`` (a plain
  tensor, rows of a batch, Replicate/Shard(0) DTensors): a program covers 1024
  consecutive stream words from a multiple of 4, computes each Philox block once
  (256 blocks) and interleaves the four lanes into word order. ``VEC > 1`` (the
  run starts on a Philox block and ``numel`` is a multiple of ``VEC``, a 16-byte
  vector of the dtype) tells the compiler that positions are block-aligned and the
  bounds mask constant over ``VEC`` elements, so loads and stores are vectors;
- general: any layout (index vectors, sharded inner dimensions); each element
  computes its own block and picks its lane.

Arithmetic as in ``docs/spec.md`` section 14: a lone IEEE multiply (no FMA to
contract; ``enable_fp_fusion=False`` all the same); bfloat16 is rounded from the
binary32 product on its bits (nearest even, torch's rule), float16 by the
round-to-nearest-even conversion. The scales reach the kernel as bit patterns, so
no host conversion can round them. Throughput: benchmarks/bench_dropout.py
(``--device cuda``; the H100 numbers are in docs/benchmarks.md).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from keyinit._kernels.common.ids import DTYPE, DTYPE_IDS
from keyinit._kernels.common.triton_philox import philox  # Philox4x32-10 of (c0, c1, 0, 0) under (k0, k1)

__all__ = ["run", "BLOCK"]

BLOCK = 1024
#: dtype ids (the one table, keyinit._kernels.common.ids) of the dtypes dropout takes, as the C kernel gets them.
_KINDS = {dtype: DTYPE_IDS[dtype] for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
DTYPE_FLOAT32 = tl.constexpr(DTYPE["float32"])
DTYPE_FLOAT64 = tl.constexpr(DTYPE["float64"])
DTYPE_BFLOAT16 = tl.constexpr(DTYPE["bfloat16"])


@triton.jit
def _scaled(x, s32, s64, KIND: tl.constexpr):
    """``x * scale`` in the dtype's arithmetic, as stored (bfloat16 as int16 bits)."""
    if KIND == DTYPE_FLOAT32:
        return x * s32
    elif KIND == DTYPE_FLOAT64:
        return x * s64
    elif KIND == DTYPE_BFLOAT16:
        bits = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        v = bits * s32
        u = v.to(tl.uint32, bitcast=True)
        rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        return (x.to(tl.float32) * s32).to(tl.float16)


@triton.jit(do_not_specialize=["numel", "base", "k0", "k1", "threshold", "s32_bits", "s64_bits"])
def _dropout_kernel(x_ptr, out_ptr, meta_ptr, index_ptr, numel, base, k0, k1, threshold, s32_bits, s64_bits,
                    NDIM: tl.constexpr, RUN: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr,
                    VEC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    key0 = k0.to(tl.uint32)
    key1 = k1.to(tl.uint32)
    s32 = s32_bits.to(tl.int32).to(tl.float32, bitcast=True)
    s64 = s64_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if RUN:
        # Global indices base .. base+numel-1. This program: words first .. first+BLOCK-1, first % 4 == 0.
        first = (base - (base & 3)) + pid * BLOCK
        blocks = (first >> 2) + tl.arange(0, BLOCK // 4).to(tl.int64)
        c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
        c1 = (blocks >> 32).to(tl.uint32)
        r0, r1, r2, r3 = philox(c0, c1, tl.zeros_like(c0) + key0, tl.zeros_like(c0) + key1)
        words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # block-major, lane-minor
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
        # meta rows: size, global stride, offset of the dim's indices in index_ptr
        for d in tl.static_range(NDIM - 1, -1, -1):
            size = tl.load(meta_ptr + 3 * d)
            gstride = tl.load(meta_ptr + 3 * d + 1)
            offset = tl.load(meta_ptr + 3 * d + 2)
            g += tl.load(index_ptr + offset + rest % size) * gstride
            rest = rest // size
        c0 = ((g >> 2) & 0xFFFFFFFF).to(tl.uint32)
        c1 = (g >> 34).to(tl.uint32)
        r0, r1, r2, r3 = philox(c0, c1, tl.zeros_like(c0) + key0, tl.zeros_like(c0) + key1)
        lane = (g & 3).to(tl.int32)
        words = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
        position = tl.where(mask, position, 0)
    keep = words.to(tl.int64) < threshold
    x = tl.load(x_ptr + position, mask=mask, other=0)
    value = _scaled(x, s32, s64, KIND)
    tl.store(out_ptr + position, tl.where(keep, value, tl.zeros_like(value)), mask=mask)


def _storage(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def run(x: torch.Tensor, out: torch.Tensor, geometry, *, interpret_ok: bool = False) -> bool:
    """``out = dropout(x)`` for contiguous ``x``/``out`` laid out by ``geometry``; ``False``: nothing written.

    Runs for CUDA tensors; CPU tensors only with ``interpret_ok`` (the tests, under ``TRITON_INTERPRET=1``).
    """
    kind = _KINDS.get(x.dtype)
    if kind is None or (x.device.type != "cuda" and not interpret_ok):
        return False
    if geometry.hbase or geometry.hstrides:  # extent-free names (docs/spec.md 14.8): the reference, for now
        return False
    numel = x.numel()
    if numel == 0:
        return True
    s32_bits = struct.unpack("<i", struct.pack("<f", geometry.scale32))[0]
    s64_bits = struct.unpack("<q", struct.pack("<d", geometry.scale64))[0]
    run_mode = len(geometry.sizes) == 1 and geometry.indices[0] is None and geometry.gstrides[0] == 1
    if run_mode:
        base = geometry.base
        meta = torch.zeros(3, dtype=torch.int64, device=x.device)
        index_all = torch.zeros(1, dtype=torch.int64, device=x.device)
        grid = (triton.cdiv((base & 3) + numel, BLOCK),)
        ndim = 1
        vec = 16 // x.element_size()
        if base & 3 or numel % vec:
            vec = 1
    else:
        base = geometry.base
        rows, pieces, offset = [], [], 0
        for size, gstride, index in zip(geometry.sizes, geometry.gstrides, geometry.indices):
            vector = torch.arange(size, dtype=torch.int64) if index is None else index
            rows.append([size, gstride, offset])
            pieces.append(vector)
            offset += size
        meta = torch.tensor(rows, dtype=torch.int64).reshape(-1).to(x.device)
        index_all = torch.cat(pieces).to(x.device)
        grid = (triton.cdiv(numel, BLOCK),)
        ndim = len(rows)
        vec = 1
    args = (_storage(x), _storage(out), meta, index_all, numel, base, geometry.k0, geometry.k1,
            geometry.threshold, s32_bits, s64_bits)
    options = dict(NDIM=ndim, RUN=run_mode, KIND=kind, BLOCK=BLOCK, VEC=vec, enable_fp_fusion=False)
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            _dropout_kernel[grid](*args, **options)
    else:
        _dropout_kernel[grid](*args, **options)
    torch.autograd.graph.increment_version(out)
    return True
