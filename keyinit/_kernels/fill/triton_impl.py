"""The Triton kernel of stream v1 (imported only when triton is installed).

See :mod:`keyinit._kernels.fill.triton` for the contract and the host side.
Triton resolves the helpers below through this module's globals, so they live
at module level here rather than in the lazily importing module.

One kernel with two paths, chosen per launch by the ``RUN`` constexpr:

- RUN: the region's innermost dimension is a run of consecutive global indices
  (a unit-step slice; a full tensor of any shape is one run). Each program owns
  ``loops`` tiles of ``NB`` consecutive Philox blocks of one row, taken in turn
  (the host picks ``loops``); it computes each block once and turns its 4 words
  into 4 consecutive elements (2 for two-word ``randint``), stored as one
  ``[NB, 4]`` tile. The row's outer position is decoded once per program
  (scalar integer ops); no per-element division. ``ALIGNED`` (the host's
  promise that every row starts on a Philox block, holds whole blocks and is
  contiguous in memory from a block-aligned offset) stores each block's
  elements as one vector: the offsets and the mask are per block.
- GENERAL: any region (strided, reversed or listed dims): each element decodes
  its position through the (at most 4) dims, computes its own block and keeps
  one lane.

Compiled variants depend only on the path, the value family (float / integer /
boolean values), words per element, the output storage type and the pointer's
alignment: a float model, whose tensors and shards are runs, initializes with
ONE compiled kernel. Geometry, distribution and parameters are runtime
arguments that are never specialized. (The paths are separate variants rather
than one kernel with a runtime branch because each compiles in about half the
time, and the GENERAL one is rarely needed.)
"""

import triton
import triton.language as tl

from keyinit._kernels.common.ids import DIST, DTYPE
from keyinit._kernels.common.triton_philox import philox
from keyinit._kernels.fill.launch import BLOCK, MAX_DIMS, NB

__all__ = ["fill_kernel", "NB", "BLOCK", "MAX_DIMS"]

# Distribution and dtype ids of the one table (keyinit._kernels.common.ids, which the C kernels get too),
# as constexpr globals that the jitted code can read.
DIST_UNIFORM = tl.constexpr(DIST["uniform"])
DIST_NORMAL = tl.constexpr(DIST["normal"])
DIST_TRUNCATED_NORMAL = tl.constexpr(DIST["truncated_normal"])
DIST_RANDINT = tl.constexpr(DIST["randint"])
DTYPE_BFLOAT16 = tl.constexpr(DTYPE["bfloat16"])
DTYPE_FLOAT16 = tl.constexpr(DTYPE["float16"])


@triton.jit
def _philox_blocks(block, k0, k1):
    """Philox4x32-10 of the counters ``(lo32(block), hi32(block), 0, 0)``."""
    c0 = (block & 0xFFFFFFFF).to(tl.uint32)
    c1 = (block >> 32).to(tl.uint32)
    key0 = tl.zeros_like(c0) + k0.to(tl.uint32)
    key1 = tl.zeros_like(c0) + k1.to(tl.uint32)
    return philox(c0, c1, key0, key1)


# Constants: the binary32 values of keyinit._bits.fp32math.V1_CONSTANTS, written
# as the shortest decimal of each (exact as binary32); a test checks them.
@triton.jit
def _log_f32(x):
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    halve = mantissa > 1.4142135381698608  # SQRT2
    mantissa = tl.where(halve, mantissa * 0.5, mantissa)
    e = (exponent + halve.to(tl.int32)).to(tl.float32)
    s = tl.math.div_rn(mantissa - 1.0, mantissa + 1.0)
    t = s * s
    poly = t * (((0.1111111119389534 * t + 0.1428571492433548) * t + 0.20000000298023224) * t
                + 0.3333333432674408)  # LOG_ATANH
    two_s = s * 2.0
    log_m = two_s + two_s * poly
    return e * 0.693145751953125 + (e * 1.428606765330187e-06 + log_m)  # LN2_HI, LN2_LO


@triton.jit
def _ndtri_tail(tail):
    """PPND7 ``|Phi^-1(t)|`` by ONE rational evaluation, coefficients chosen per element.

    central (q <= 0.425): x = 0.180625 - q*q, s = q, N = A, D = B;
    near (r <= 5): x = r - 1.6, s = 1, N = C, D = (1, D1, D2, 0);
    far: x = r - 5, s = 1, N = E, D = (1, F1, F2, 0); result (s * N(x)) / D(x).
    The same bits as the selected branch alone (1 * v == v; 0 * x + c == c).
    """
    q = 0.5 - tail
    central = q <= 0.42500001192092896  # PPND_SPLIT_CENTRAL
    r = tl.math.sqrt_rn(-_log_f32(tl.maximum(tail, 1.1754943508222875e-38)))  # SMALLEST_NORMAL
    near = r <= 5.0  # PPND_SPLIT_TAIL
    x = tl.where(central, 0.18062500655651093 - q * q,  # PPND_CENTRAL_R0
                 tl.where(near, r - 1.600000023841858, r - 5.0))  # PPND_TAIL_SHIFT, PPND_SPLIT_TAIL
    n0 = tl.where(central, 3.3871326446533203, tl.where(near, 1.423437237739563, 6.657905101776123))
    n1 = tl.where(central, 50.43427276611328, tl.where(near, 2.7568154335021973, 3.081226348876953))
    n2 = tl.where(central, 159.2911376953125, tl.where(near, 1.306728482246399, 0.42868295311927795))
    n3 = tl.where(central, 59.109375, tl.where(near, 0.1702382117509842, 0.01733720488846302))
    d1 = tl.where(central, 17.895170211791992, tl.where(near, 0.7370016574859619, 0.2419789433479309))
    d2 = tl.where(central, 78.75775909423828, tl.where(near, 0.12021133303642273, 0.012258202768862247))
    d3 = tl.where(central, 67.18756103515625, 0.0)
    s = tl.where(central, q, 1.0)
    num = ((n3 * x + n2) * x + n1) * x + n0
    den = ((d3 * x + d2) * x + d1) * x + 1.0
    return tl.math.div_rn(s * num, den)


@triton.jit
def _values(x, x1, dist, fa, fb, p_low, p_span, lower, upper, flip, threshold, ilow, ispan,
            FAMILY: tl.constexpr):
    """The distribution's values for words ``x`` (and ``x1``, randint's second word)."""
    if FAMILY == 0:  # float values: uniform, normal, truncated normal
        if dist == DIST_UNIFORM:
            u = (x >> 8).to(tl.float32) * 5.9604644775390625e-08
            value = fa + fb * u
        else:
            if dist == DIST_NORMAL:
                tail = (x | 1).to(tl.float32) * 1.16415321826934814453125e-10
                negative = (x & 1) != 0
            else:
                u = (((x >> 9) << 1) | 1).to(tl.float32) * 5.9604644775390625e-08
                pr = p_low + u * p_span
                negative = pr < 0.5
                tail = tl.where(negative, pr, 1.0 - pr)
            magnitude = _ndtri_tail(tail)
            z = tl.where(negative, -magnitude, magnitude)
            if flip != 0:
                z = -z
            value = fa + fb * z
            if dist == DIST_TRUNCATED_NORMAL:
                value = tl.where(value < lower, lower, value)
                value = tl.where(value > upper, upper, value)
    elif FAMILY == 1:  # integer values: bits, randint
        if dist == DIST_RANDINT:
            n = ispan.to(tl.uint64)
            carry = (x.to(tl.uint64) * n) >> 32
            value = ilow + ((x1.to(tl.uint64) * n + carry) >> 32).to(tl.int64)
        else:
            value = x.to(tl.int64)
    else:  # bernoulli
        value = x.to(tl.int64) < threshold
    return value


@triton.jit
def _store(out_ptr, offsets, value, mask, FAMILY: tl.constexpr, OUT: tl.constexpr):
    if FAMILY == 2:
        if OUT == DTYPE_BFLOAT16:
            stored = tl.where(value, 0x3F80, 0).to(tl.int16)
        elif OUT == DTYPE_FLOAT16:
            stored = tl.where(value, 1.0, 0.0).to(tl.float16)
        else:
            stored = value.to(out_ptr.dtype.element_ty)
    elif FAMILY == 1:
        stored = value.to(out_ptr.dtype.element_ty)
    else:
        if OUT == DTYPE_BFLOAT16:  # bfloat16 bits, torch's round-to-nearest-even
            bits = value.to(tl.uint32, bitcast=True)
            rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            rounded = tl.where(value != value, 0x7FC0, rounded)
            stored = rounded.to(tl.uint16).to(tl.int16, bitcast=True)
        else:
            stored = value.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, stored, mask=mask)


@triton.jit
def _index(index_ptr, ix, p):
    """Position ``p`` through a dim's index list (``ix`` its offset in ``index_ptr``), or ``p`` (``ix < 0``)."""
    if ix >= 0:
        p = tl.load(index_ptr + ix + p)
    return p


@triton.jit
def _digit(rest, n, index_ptr, ix, gs, os):
    """One dimension of a row-major position, innermost first: ``(rest // n, global offset, output offset)``
    of its digit ``rest % n`` (a dim of size ``n``, global stride ``gs``, output stride ``os``)."""
    p = rest % n
    return rest // n, _index(index_ptr, ix, p) * gs, p * os


_INTS = ["numel", "base", "k0", "k1", "dist", "flip", "threshold", "ilow", "ispan", "run_len", "tiles", "loops",
         "n0", "n1", "n2", "n3", "os0", "os1", "os2", "os3", "gs0", "gs1", "gs2", "gs3",
         "ix0", "ix1", "ix2", "ix3"]


# Every integer argument is typed int64 and never specialized, every float argument float32:
# the compiled variant cannot depend on a value (Triton would otherwise pick i32 or i64 by
# value and specialize on divisibility by 16 and on == 1).
I64 = tl.int64
F32 = tl.float32


@triton.jit(do_not_specialize=_INTS)
def _fill_kernel(out_ptr, index_ptr, numel: I64, base: I64, k0: I64, k1: I64, dist: I64,
                 fa: F32, fb: F32, p_low: F32, p_span: F32, lower: F32, upper: F32,
                 flip: I64, threshold: I64, ilow: I64, ispan: I64,
                 run_len: I64, tiles: I64, loops: I64,
                 n0: I64, n1: I64, n2: I64, n3: I64, os0: I64, os1: I64, os2: I64, os3: I64,
                 gs0: I64, gs1: I64, gs2: I64, gs3: I64, ix0: I64, ix1: I64, ix2: I64, ix3: I64,
                 FAMILY: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr,
                 NB: tl.constexpr, BLOCK: tl.constexpr, RUN: tl.constexpr, ALIGNED: tl.constexpr):
    # Dims 0..3, innermost last; unused outer dims have size 1. Dim d's position p
    # adds (ix_d < 0 ? p : index[ix_d + p]) * gs_d to the global index, p * os_d to the offset.
    pid = tl.program_id(0).to(tl.int64)
    if RUN:
        _run_path(out_ptr, index_ptr, pid, base, k0, k1, dist, fa, fb, p_low, p_span, lower, upper, flip,
                  threshold, ilow, ispan, run_len, tiles, loops, n1, n2, os0, os1, os2, os3, gs0, gs1, gs2, ix0, ix1,
                  ix2, FAMILY, W, OUT, NB, ALIGNED)
    else:
        _general_path(out_ptr, index_ptr, pid, numel, base, k0, k1, dist, fa, fb, p_low, p_span, lower, upper,
                      flip, threshold, ilow, ispan, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3,
                      ix0, ix1, ix2, ix3, FAMILY, W, OUT, BLOCK)


@triton.jit
def _run_path(out_ptr, index_ptr, pid, base, k0, k1, dist, fa, fb, p_low, p_span, lower, upper, flip,
              threshold, ilow, ispan, run_len, tiles, loops, n1, n2, os0, os1, os2, os3, gs0, gs1, gs2, ix0, ix1, ix2,
              FAMILY: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr):
    """RUN: program ``pid`` owns ``loops * NB`` consecutive Philox blocks of one row of consecutive global indices."""
    E: tl.constexpr = 4 // W  # elements per Philox block
    row = pid // tiles
    tile = pid - row * tiles
    rest, g, o_row = _digit(row, n2, index_ptr, ix2, gs2, os2)
    g_row = base + g
    rest, g, o = _digit(rest, n1, index_ptr, ix1, gs1, os1)
    g_row += g
    o_row += o
    g_row += _index(index_ptr, ix0, rest) * gs0
    o_row += rest * os0
    # the row holds global indices g_row .. g_row + run_len - 1, in order
    first_block = g_row // E + tile * loops * NB
    for i in range(loops):
        block = first_block + i * NB + tl.arange(0, NB).to(tl.int64)
        _run_tile(out_ptr, block, g_row, o_row, run_len, os3, k0, k1, dist, fa, fb, p_low, p_span, lower, upper,
                  flip, threshold, ilow, ispan, FAMILY, W, OUT, NB, ALIGNED)


@triton.jit
def _run_tile(out_ptr, block, g_row, o_row, run_len, os3, k0, k1, dist, fa, fb, p_low, p_span, lower, upper, flip,
              threshold, ilow, ispan, FAMILY: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr, NB: tl.constexpr,
              ALIGNED: tl.constexpr):
    """The Philox blocks ``block`` of a row, stored where they fall inside it."""
    E: tl.constexpr = 4 // W
    r0, r1, r2, r3 = _philox_blocks(block, k0, k1)
    if W == 1:
        # element [j, i, l] of join(join(r0, r2), join(r1, r3)) is lane 2*i + l of block j
        x = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [NB, 4])
        x1 = x
    else:
        x = tl.join(r0, r2)
        x1 = tl.join(r1, r3)
    value = _values(x, x1, dist, fa, fb, p_low, p_span, lower, upper, flip, threshold, ilow, ispan, FAMILY)
    if ALIGNED:
        # g_row, run_len and o_row are multiples of E and os3 == 1: a block is stored whole or not at all,
        # its E elements consecutive from an E-aligned offset (one vector store each)
        q0 = block * E - g_row
        first = tl.multiple_of(o_row + q0, E)
        offsets = first[:, None] + tl.arange(0, E).to(tl.int64)[None, :]
        mask = tl.broadcast_to((q0 < run_len)[:, None], (NB, E))
    else:
        q = block[:, None] * E + tl.arange(0, E).to(tl.int64)[None, :] - g_row
        mask = (q >= 0) & (q < run_len)
        offsets = o_row + q * os3
    _store(out_ptr, offsets, value, mask, FAMILY, OUT)


@triton.jit
def _locate(index_ptr, pid, numel, base, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3, ix0, ix1, ix2, ix3,
            BLOCK: tl.constexpr):
    """The GENERAL path's positions: program ``pid``'s BLOCK consecutive region elements as ``(mask, g, o)``
    (in the region, global flat index, element offset in ``out``), each decoded through the dims."""
    position = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = position < numel
    rest, g3, o = _digit(tl.where(mask, position, 0), n3, index_ptr, ix3, gs3, os3)
    g = base + g3
    if n2 != 1:
        rest, g2, o2 = _digit(rest, n2, index_ptr, ix2, gs2, os2)
        g += g2
        o += o2
    if n1 != 1:
        rest, g1, o1 = _digit(rest, n1, index_ptr, ix1, gs1, os1)
        g += g1
        o += o1
    g += _index(index_ptr, ix0, rest) * gs0
    o += rest * os0
    return mask, g, o


@triton.jit
def _general_path(out_ptr, index_ptr, pid, numel, base, k0, k1, dist, fa, fb, p_low, p_span, lower, upper,
                  flip, threshold, ilow, ispan, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3,
                  ix0, ix1, ix2, ix3, FAMILY: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr,
                  BLOCK: tl.constexpr):
    """GENERAL: program ``pid`` owns BLOCK consecutive region elements; each decodes its own position."""
    mask, g, o = _locate(index_ptr, pid, numel, base, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3,
                         ix0, ix1, ix2, ix3, BLOCK)
    word = g * W
    r0, r1, r2, r3 = _philox_blocks(word >> 2, k0, k1)
    lane = (word & 3).to(tl.int32)
    if W == 1:
        x = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
        x1 = x
    else:
        x = tl.where(lane == 0, r0, r2)
        x1 = tl.where(lane == 0, r1, r3)
    value = _values(x, x1, dist, fa, fb, p_low, p_span, lower, upper, flip, threshold, ilow, ispan, FAMILY)
    _store(out_ptr, o, value, mask, FAMILY, OUT)


fill_kernel = _fill_kernel
