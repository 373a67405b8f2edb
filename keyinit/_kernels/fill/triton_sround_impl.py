"""The Triton kernel of keyed stochastic rounding (imported only when triton is installed).

See :mod:`keyinit._kernels.fill.triton_sround` for the host side. Each program owns ``BLOCK``
consecutive region elements; each element decodes its position through the (at most 4) dims (the fill
kernel's GENERAL path: :func:`~keyinit._kernels.fill.triton_impl._locate`), takes stream word ``g`` of
its global index ``g`` (Philox block ``g // 4``, lane ``g % 4``: as ``bits`` draws it) and rounds its
binary32 value by ``docs/spec.md`` 17.2's integer rule (int64 operations on the bit pattern, so the
interpreter and every GPU give the reference's bits). The target format is constexpr (one compiled
variant per target); geometry and key are runtime arguments. FP4 E2M1 (17.7) has its own kernel,
:data:`sround_fp4_kernel`: binary64 quotients (their int64 view) to uint8 codes, ``fill/sround_fp4.h``'s
arithmetic.
"""

import triton
import triton.language as tl

from keyinit._kernels.fill.triton_impl import _locate, _philox_blocks

__all__ = ["sround_kernel", "sround_fp4_kernel", "adam_kernel"]

I64 = tl.int64
_INTS = ["numel", "base", "k0", "k1", "n0", "n1", "n2", "n3", "os0", "os1", "os2", "os3",
         "gs0", "gs1", "gs2", "gs3", "ix0", "ix1", "ix2", "ix3"]


@triton.jit
def _round(u, x, P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, NBITS: tl.constexpr,
           HAS_INF: tl.constexpr, INF: tl.constexpr, NAN: tl.constexpr, MAXF: tl.constexpr):
    """binary32 bits ``u`` rounded with word ``x`` (both int64 in [0, 2**32)): the target's bits (17.2)."""
    sign = (u >> 31) << (NBITS - 1)
    mag = u & 0x7FFFFFFF
    field = mag >> 23
    fraction = mag & 0x7FFFFF
    m = tl.where(field != 0, fraction | 0x800000, fraction)
    field = tl.maximum(field, 1)
    e = field - 150
    big_e = tl.maximum(field - 127, EMIN)
    shift = tl.minimum(big_e - (P - 1) - e, 62)
    units = m >> shift
    rem = m - (units << shift)
    r = tl.where(shift <= 32, rem << tl.maximum(32 - shift, 0), rem >> tl.maximum(shift - 32, 0))
    up = (x + r) >> 32
    bits = ((big_e - EMIN) << (P - 1)) + units + up
    special = mag >= 0x7F800000
    if HAS_INF:
        bits = tl.where(big_e > EMAX, INF, bits)
        bits = tl.where(special, tl.where(fraction != 0, NAN, INF), bits)
    else:
        bits = tl.where((big_e > EMAX) | (bits > MAXF), MAXF, bits)
        bits = tl.where(special, NAN, bits)
    return bits | sign


@triton.jit
def _word(g, k0, k1):
    """Stream word ``g`` (int64 in [0, 2**32)) of each global index ``g``: lane ``g % 4`` of Philox block
    ``g // 4``, as ``bits`` draws it."""
    r0, r1, r2, r3 = _philox_blocks(g >> 2, k0, k1)
    lane = (g & 3).to(tl.int32)
    word = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return word.to(tl.int64) & 0xFFFFFFFF


@triton.jit(do_not_specialize=_INTS)
def _sround_kernel(out_ptr, src_ptr, index_ptr, numel: I64, base: I64, k0: I64, k1: I64,
                   n0: I64, n1: I64, n2: I64, n3: I64, os0: I64, os1: I64, os2: I64, os3: I64,
                   gs0: I64, gs1: I64, gs2: I64, gs3: I64, ix0: I64, ix1: I64, ix2: I64, ix3: I64,
                   P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, NBITS: tl.constexpr,
                   HAS_INF: tl.constexpr, INF: tl.constexpr, NAN: tl.constexpr, MAXF: tl.constexpr,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    mask, g, o = _locate(index_ptr, pid, numel, base, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3,
                         ix0, ix1, ix2, ix3, BLOCK)
    x = _word(g, k0, k1)
    u = tl.load(src_ptr + o, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF  # the int32 view of the source
    bits = _round(u, x, P, EMIN, EMAX, NBITS, HAS_INF, INF, NAN, MAXF)
    if NBITS == 16:
        tl.store(out_ptr + o, tl.where(bits >= 32768, bits - 65536, bits).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + o, bits.to(tl.uint8), mask=mask)


sround_kernel = _sround_kernel


@triton.jit
def _round_fp4(u, x):
    """binary64 bits ``u`` (int64) rounded with word ``x`` (int64 in [0, 2**32)): E2M1's code (17.7; 17.2
    with p = 2, emin = 0, emax = 2, saturating at 6), as ``fill/sround_fp4.h``'s ``ki_sr_fp4``."""
    sign = tl.where(u < 0, 8, 0).to(tl.int64)
    mag = u & 0x7FFFFFFFFFFFFFFF
    field0 = mag >> 52
    m = tl.where(field0 != 0, (mag & 0xFFFFFFFFFFFFF) | 0x10000000000000, mag & 0xFFFFFFFFFFFFF)
    field = tl.maximum(field0, 1)
    big_e = tl.maximum(field - 1023, 0)
    shift = big_e + 1074 - field  # >= 51
    s1 = tl.minimum(shift, 62)
    s2 = tl.minimum(shift - 32, 62)
    units = m >> s1
    r = (m - (units << s1)) >> s2
    up = (x + r) >> 32
    bits = (big_e << 1) + units + up
    return sign | tl.where(mag >= 0x4018000000000000, 7, bits)


@triton.jit(do_not_specialize=_INTS)
def _sround_fp4_kernel(out_ptr, src_ptr, index_ptr, numel: I64, base: I64, k0: I64, k1: I64,
                       n0: I64, n1: I64, n2: I64, n3: I64, os0: I64, os1: I64, os2: I64, os3: I64,
                       gs0: I64, gs1: I64, gs2: I64, gs3: I64, ix0: I64, ix1: I64, ix2: I64, ix3: I64,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    mask, g, o = _locate(index_ptr, pid, numel, base, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3,
                         ix0, ix1, ix2, ix3, BLOCK)
    x = _word(g, k0, k1)
    u = tl.load(src_ptr + o, mask=mask, other=0)  # the int64 view of the binary64 quotients
    tl.store(out_ptr + o, _round_fp4(u, x).to(tl.uint8), mask=mask)


sround_fp4_kernel = _sround_fp4_kernel


F32 = tl.float32
_ADAM_INTS = _INTS + ["has_decay"]


@triton.jit(do_not_specialize=_ADAM_INTS)
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, index_ptr, numel: I64, base: I64, k0: I64, k1: I64,
                 n0: I64, n1: I64, n2: I64, n3: I64, os0: I64, os1: I64, os2: I64, os3: I64,
                 gs0: I64, gs1: I64, gs2: I64, gs3: I64, ix0: I64, ix1: I64, ix2: I64, ix3: I64,
                 decay: F32, w: F32, w_minus_1: F32, beta2: F32, s2: F32, bc2s: F32, eps: F32, neg_step: F32,
                 has_decay: I64, PTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """The fused Adam/AdamW step of ``docs/spec.md`` 17.6 (``fill/sround_adam.h``'s arithmetic, each
    operation rounded once: explicit ``fma``, ``div_rn``, ``sqrt_rn``, no other contraction); parameter
    and gradient bfloat16 (``PTYPE`` 0, as int16 bits), float16 (1) or float32 (4, written unrounded)."""
    pid = tl.program_id(0).to(tl.int64)
    mask, g, o = _locate(index_ptr, pid, numel, base, n1, n2, n3, os0, os1, os2, os3, gs0, gs1, gs2, gs3,
                         ix0, ix1, ix2, ix3, BLOCK)
    p, grad, m0, v0 = _adam_load(p_ptr, g_ptr, m_ptr, v_ptr, o, mask, PTYPE)
    new, m, v = _adam_update(p, grad, m0, v0, decay, w, w_minus_1, beta2, s2, bc2s, eps, neg_step, has_decay)
    x = tl.zeros_like(g)  # (no word for a float32 parameter)
    if PTYPE != 4:
        x = _word(g, k0, k1)
    _adam_store(p_ptr, m_ptr, v_ptr, o, mask, new, m, v, x, PTYPE)


@triton.jit
def _adam_load(p_ptr, g_ptr, m_ptr, v_ptr, o, mask, PTYPE: tl.constexpr):
    """Parameter and gradient (as float32) and the two moments at offsets ``o``."""
    if PTYPE == 0:
        p = ((tl.load(p_ptr + o, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        grad = ((tl.load(g_ptr + o, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + o, mask=mask, other=0).to(tl.float32)
        grad = tl.load(g_ptr + o, mask=mask, other=0).to(tl.float32)
    return p, grad, tl.load(m_ptr + o, mask=mask, other=0), tl.load(v_ptr + o, mask=mask, other=0)


@triton.jit
def _adam_update(p, grad, m0, v0, decay, w, w_minus_1, beta2, s2, bc2s, eps, neg_step, has_decay):
    """17.6's arithmetic: the new parameter and moments (float32, each operation rounded once)."""
    if has_decay != 0:
        p = p * decay
    d = grad - m0
    if w < 0.5:
        m = tl.fma(tl.zeros_like(d) + w, d, m0)
    else:
        m = tl.fma(tl.zeros_like(d) + w_minus_1, d, grad)
    v = tl.fma(s2 * grad, grad, v0 * beta2)
    den = tl.math.div_rn(tl.math.sqrt_rn(v), tl.zeros_like(v) + bc2s) + eps
    new = tl.math.div_rn(neg_step * m, den) + p
    return new, m, v


@triton.jit
def _adam_store(p_ptr, m_ptr, v_ptr, o, mask, new, m, v, x, PTYPE: tl.constexpr):
    """The moments and the new parameter (rounded stochastically with words ``x``, int64 in [0, 2**32),
    unless float32) stored at offsets ``o``."""
    tl.store(m_ptr + o, m, mask=mask)
    tl.store(v_ptr + o, v, mask=mask)
    if PTYPE == 4:
        tl.store(p_ptr + o, new, mask=mask)
    else:
        u = new.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        if PTYPE == 0:
            bits = _round(u, x, 8, -126, 127, 16, 1, 0x7F80, 0x7FC0, 0x7F7F)
            tl.store(p_ptr + o, tl.where(bits >= 32768, bits - 65536, bits).to(tl.int16), mask=mask)
        else:
            bits = _round(u, x, 11, -14, 15, 16, 1, 0x7C00, 0x7E00, 0x7BFF)
            tl.store(p_ptr + o, tl.where(bits >= 32768, bits - 65536, bits).to(tl.int16).to(tl.float16, bitcast=True),
                     mask=mask)


adam_kernel = _adam_kernel
