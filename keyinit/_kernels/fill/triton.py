"""Triton kernel for stream v1 (CUDA tensors), bit-identical to :mod:`keyinit._draw.reference_fill`.

Triton is optional: this module imports it lazily, and :func:`fill` returns
``False`` (so the caller falls back to the reference) when it is missing.

Bit-exactness on a GPU needs three things, all done here:

- IEEE division and square root: ``tl.math.div_rn`` and ``tl.math.sqrt_rn``
  (Triton's ``/`` and ``tl.sqrt`` on fp32 may be approximate);
- no contraction of ``a * b + c`` into FMA: every launch passes
  ``enable_fp_fusion=False``;
- no library transcendental: ``log`` and ``ndtri`` are the binary32 sequences of
  :mod:`keyinit._bits.fp32math`, operation for operation.

Philox4x32-10 is written out here (``umulhi`` plus a wrapping multiply), with
the counter ``(lo32(b), hi32(b), 0, 0)`` of block ``b = (w * i) // 4``; Triton's
own ``randint4x`` puts a 64-bit offset into a different Philox variant, so it is
not used. bfloat16 rounding is done on the bits (torch's rule); float16 uses the
hardware round-to-nearest-even conversion.

Structure (see :mod:`keyinit._kernels.fill.triton_impl`): a region whose innermost
dimension is a run of consecutive global indices (every full tensor, every
dim-0 shard, rows of a unit-step column slice of at least ``RUN_MIN`` elements)
takes the RUN path: each program decodes its row with a few scalar operations,
then computes up to ``LOOP`` tiles of ``NB`` Philox blocks of it in turn (fewer
where the launch would otherwise have under ``MIN_PROGRAMS`` programs), each
block once, storing all their words as consecutive elements; an aligned run
(rows of whole blocks from block-aligned offsets, contiguous in ``out``) stores
each block as one vector. Everything else takes the GENERAL path (per-element
position decoding). The geometry and the parameters are scalar arguments (no
host-to-device copy, except for explicit index lists), and the compiled
variant depends only on the path, its alignment, the value family, the output
storage type and the pointer alignment.

Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (numpy
semantics, IEEE binary32), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

import torch

from keyinit.distributions import Bernoulli, Bits, Distribution, Normal, Randint, TruncatedNormal, Uniform
from keyinit.keys import Key
from keyinit.regions import Region
from keyinit._kernels.common.ids import DIST_IDS, DTYPE_IDS
from keyinit._draw.geometry import geometry
from keyinit._draw.names import naming_shape
from keyinit._kernels.fill.launch import BLOCK, LOOP, MAX_DIMS, MIN_PROGRAMS, NB

__all__ = ["available", "fill", "fill_v2", "MAX_DIMS", "RUN_MIN", "launch_args", "launch_for", "device_geometry",
           "run_kernel"]

#: Shortest row of a multi-row region that takes the RUN path (shorter rows waste most of a RUN program).
RUN_MIN = 256
_MAX_GRID = 2**31 - 1

#: Value family of each distribution: 0 float, 1 integer, 2 boolean (the Triton kernel's own grouping;
#: the distribution and dtype ids themselves are the one table, keyinit._kernels.common.ids).
_FAMILY = {Bits: 1, Uniform: 0, Normal: 0, TruncatedNormal: 0, Bernoulli: 2, Randint: 1}


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted Triton kernel; ``None`` when triton cannot be imported."""
    try:
        from keyinit._kernels.fill.triton_impl import fill_kernel
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return fill_kernel


def available() -> bool:
    return _kernel() is not None


def _storage_view(out: torch.Tensor) -> torch.Tensor:
    """``out`` as the tensor the kernel stores into (bf16 as int16 bits, bool as uint8)."""
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16)
    if out.dtype == torch.bool:
        return out.view(torch.uint8)
    return out


def launch_args(out: torch.Tensor, region: Region, words_per_element: int) -> Optional[dict]:
    """The kernel's geometry arguments and grid for filling ``out``, or ``None`` if it cannot take it.

    Returns ``{"run", "aligned", "run_len", "tiles", "loops", "grid", "base", "dims", "index"}``: ``dims``
    is 4 ``[size, out_stride, global_stride, index_offset]`` rows, innermost last
    (offset -1 for a slice), ``index`` the concatenated index lists (CPU) or ``None``.
    """
    base, dims = geometry(out, region)
    if len(dims) > MAX_DIMS:
        return None
    numel = out.numel()
    rows = []
    pieces = []
    offset = 0
    for size, ostride, gstride, index in dims:
        if index is None:
            rows.append([size, ostride, gstride, -1])
        else:
            rows.append([size, ostride, gstride, offset])
            pieces.append(index)
            offset += int(index.numel())
    rows = [[1, 0, 0, -1]] * (MAX_DIMS - len(rows)) + rows
    inner_size, _, inner_gstride, inner_offset = rows[-1]
    per_block = 4 // words_per_element
    # A single run (any full tensor) always takes the RUN path; many short rows would waste it.
    run = inner_offset < 0 and inner_gstride == 1 and (inner_size >= RUN_MIN or inner_size == numel)
    # Aligned runs (every row starts on a Philox block, holds whole blocks, and is stored contiguously
    # from a block-aligned offset: any full tensor of a multiple of 4 elements) store whole blocks.
    aligned = run and (base % per_block == 0 and inner_size % per_block == 0 and rows[-1][1] == 1
                       and all(size == 1 or (ostride % per_block == 0 and gstride % per_block == 0)
                               for size, ostride, gstride, _ in rows[:-1]))
    if run:
        blocks_per_row = (inner_size + per_block - 2) // per_block + 1  # most blocks a row can touch
        row_tiles = -(-blocks_per_row // NB)
        # tiles of NB blocks per program, in turn: up to LOOP, while the launch keeps MIN_PROGRAMS programs
        loops = max(1, min(LOOP, row_tiles, numel // inner_size * row_tiles // MIN_PROGRAMS))
        tiles = -(-row_tiles // loops)  # programs per row
        grid = numel // inner_size * tiles
    else:
        tiles = loops = 1
        grid = -(-numel // BLOCK)
    if grid > _MAX_GRID:
        return None
    return {"run": int(run), "aligned": int(aligned), "run_len": inner_size if run else 0, "tiles": tiles,
            "loops": loops, "grid": grid, "base": base, "dims": rows,
            "index": torch.cat(pieces) if pieces else None}


def launch_for(kernel: Any, out: torch.Tensor, region: Region, words_per_element: int) -> "Union[dict, bool]":
    """:func:`launch_args` for a launch of ``kernel`` into ``out``; ``True`` when there is nothing to do (an
    empty ``out``), ``False`` when the kernel cannot run (no triton: ``kernel`` is ``None``; a geometry it
    cannot take)."""
    if kernel is None:
        return False
    if out.numel() == 0:
        return True
    launch = launch_args(out, region, words_per_element)
    return False if launch is None else launch


def device_geometry(launch: dict, device: torch.device) -> "tuple[torch.Tensor, list[int]]":
    """``launch``'s index lists on ``device`` (a one-element placeholder, never read, when every dim is a
    slice: the kernel needs a pointer) and its 16 geometry arguments (4 sizes, 4 out strides, 4 global
    strides, 4 index offsets, innermost last)."""
    if launch["index"] is not None:
        index = launch["index"].to(device)
    else:
        index = torch.empty(1, dtype=torch.int64, device=device)
    dims = launch["dims"]
    return index, [d[0] for d in dims] + [d[1] for d in dims] + [d[2] for d in dims] + [d[3] for d in dims]


def run_kernel(kernel: Any, grid: tuple, device: torch.device, args: tuple, options: dict) -> None:
    """Launch ``kernel`` on ``device``'s CUDA context, or as is on the CPU (the interpreter: the tests)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **options)
    else:
        kernel[grid](*args, **options)


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region, *, interpret_ok: bool = False) -> bool:
    """Fill ``out`` with the Triton kernel; ``False`` (nothing written) if it cannot.

    Runs for CUDA tensors; CPU tensors are accepted only with ``interpret_ok``
    (the tests, under ``TRITON_INTERPRET=1``).
    """
    dist_id = DIST_IDS.get(type(dist))
    out_kind = DTYPE_IDS.get(out.dtype)
    if dist_id is None or out_kind is None:
        return False
    if out.device.type != "cuda" and not interpret_ok:
        return False
    kernel = _kernel()
    launch = launch_for(kernel, out, region, dist.words_per_element)
    if not isinstance(launch, dict):
        return launch
    fa = fb = p_low = p_span = lower = upper = 0.0
    flip = threshold = ilow = ispan = 0
    if isinstance(dist, Uniform):
        fa, fb = dist.low, dist.span
    elif isinstance(dist, Normal):
        fa, fb = dist.mean, dist.std
    elif isinstance(dist, TruncatedNormal):
        fa, fb, p_low, p_span, lower, upper = dist.mean, dist.std, dist.p_low, dist.p_span, dist.lower, dist.upper
        flip = int(dist.flip)
    elif isinstance(dist, Bernoulli):
        threshold = dist.threshold
    elif isinstance(dist, Randint):
        ilow, ispan = dist.low, dist.span
    index, geometry_args = device_geometry(launch, out.device)
    k0, k1 = key.words
    args = (_storage_view(out), index, out.numel(), launch["base"], k0, k1, dist_id,
            float(fa), float(fb), float(p_low), float(p_span), float(lower), float(upper),
            flip, threshold, ilow, ispan, launch["run_len"], launch["tiles"], launch["loops"],
            *geometry_args)
    options = dict(FAMILY=_FAMILY[type(dist)], W=dist.words_per_element, OUT=out_kind, NB=NB, BLOCK=BLOCK,
                   RUN=launch["run"], ALIGNED=launch["aligned"], enable_fp_fusion=False)
    run_kernel(kernel, (launch["grid"],), out.device, args, options)
    # The write bypassed torch's in-place ops, so bump the version counter as they would.
    torch.autograd.graph.increment_version(out)
    return True


def fill_v2(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> bool:
    """Stream v2's CUDA fill kernel: :func:`fill`, except for a keyed forward's draw by extent-free names
    (:func:`keyinit._draw.names.naming` open: ``False``, the reference draws it; such draws are made on the
    CPU)."""
    return naming_shape() is None and fill(out, dist, key, region)
