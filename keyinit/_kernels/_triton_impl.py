"""The Triton kernel of stream v1 (imported only when triton is installed).

See :mod:`keyinit._kernels.triton_kernel` for the contract. Triton resolves the
helpers below through this module's globals, so they live at module level here
rather than in the lazily importing module.
"""

import triton
import triton.language as tl

__all__ = ["fill_kernel"]


@triton.jit
def _philox(c0, c1, k0, k1):
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.math.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.math.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = tl.mul(a2, 0xCD9E8D57, sanitize_overflow=False)
        c3 = tl.mul(a0, 0xD2511F53, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3

@triton.jit
def _horner4(x, a0, a1, a2, a3):
    return ((a3 * x + a2) * x + a1) * x + a0

@triton.jit
def _horner3(x, a0, a1, a2):
    return (a2 * x + a1) * x + a0

# Constants: the binary32 values of keyinit._fp32math.V1_CONSTANTS, written
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
    poly = t * _horner4(t, 0.3333333432674408, 0.20000000298023224, 0.1428571492433548, 0.1111111119389534)
    two_s = s * 2.0
    log_m = two_s + two_s * poly
    return e * 0.693145751953125 + (e * 1.428606765330187e-06 + log_m)  # LN2_HI, LN2_LO

@triton.jit
def _ndtri_tail(tail):
    q = 0.5 - tail
    r_central = 0.18062500655651093 - q * q  # PPND_CENTRAL_R0
    num = _horner4(r_central, 3.3871326446533203, 50.43427276611328, 159.2911376953125, 59.109375)
    den = _horner4(r_central, 1.0, 17.895170211791992, 78.75775909423828, 67.18756103515625)
    z_central = tl.math.div_rn(q * num, den)
    clamped = tl.maximum(tail, 1.1754943508222875e-38)  # SMALLEST_NORMAL
    r = tl.math.sqrt_rn(-_log_f32(clamped))
    r_near = r - 1.600000023841858  # PPND_TAIL_SHIFT
    z_near = tl.math.div_rn(
        _horner4(r_near, 1.423437237739563, 2.7568154335021973, 1.306728482246399, 0.1702382117509842),
        _horner3(r_near, 1.0, 0.7370016574859619, 0.12021133303642273),
    )
    r_far = r - 5.0  # PPND_SPLIT_TAIL
    z_far = tl.math.div_rn(
        _horner4(r_far, 6.657905101776123, 3.081226348876953, 0.42868295311927795, 0.01733720488846302),
        _horner3(r_far, 1.0, 0.2419789433479309, 0.012258202768862247),
    )
    z_tail = tl.where(r <= 5.0, z_near, z_far)
    return tl.where(q <= 0.42500001192092896, z_central, z_tail)  # PPND_SPLIT_CENTRAL

@triton.jit(do_not_specialize=["numel", "base", "k0", "k1", "flip", "threshold", "ilow", "ispan"])
def _fill_kernel(out_ptr, meta_ptr, index_ptr, numel, base, k0, k1,
                 fa, fb, p_low, p_span, lower, upper, flip, threshold, ilow, ispan,
                 NDIM: tl.constexpr, DIST: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    position = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = position < numel
    position = tl.where(mask, position, 0)
    # meta rows: size, out stride, global stride, offset of the dim's indices in index_ptr
    g = tl.zeros([BLOCK], dtype=tl.int64) + base
    o = tl.zeros([BLOCK], dtype=tl.int64)
    rest = position
    for d in tl.static_range(NDIM - 1, -1, -1):
        size = tl.load(meta_ptr + 4 * d)
        ostride = tl.load(meta_ptr + 4 * d + 1)
        gstride = tl.load(meta_ptr + 4 * d + 2)
        offset = tl.load(meta_ptr + 4 * d + 3)
        p = rest % size
        rest = rest // size
        g += tl.load(index_ptr + offset + p) * gstride
        o += p * ostride
    W: tl.constexpr = 2 if DIST == 5 else 1
    word = g * W
    block = word >> 2
    lane = (word & 3).to(tl.int32)
    c0 = (block & 0xFFFFFFFF).to(tl.uint32)
    c1 = (block >> 32).to(tl.uint32)
    key0 = tl.zeros([BLOCK], dtype=tl.uint32) + k0.to(tl.uint32)
    key1 = tl.zeros([BLOCK], dtype=tl.uint32) + k1.to(tl.uint32)
    r0, r1, r2, r3 = _philox(c0, c1, key0, key1)
    if W == 1:
        x = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
        x1 = x
    else:
        x = tl.where(lane == 0, r0, r2)
        x1 = tl.where(lane == 0, r1, r3)

    if DIST == 0:  # bits
        ivalue = x.to(tl.int64)
    elif DIST == 1:  # uniform
        u = (x >> 8).to(tl.float32) * 5.9604644775390625e-08
        value = fa + fb * u
    elif DIST == 2:  # normal
        tail = (x | 1).to(tl.float32) * 1.16415321826934814453125e-10
        magnitude = _ndtri_tail(tail)
        z = tl.where((x & 1) != 0, -magnitude, magnitude)
        value = fa + fb * z
    elif DIST == 3:  # truncated normal
        u = (((x >> 9) << 1) | 1).to(tl.float32) * 5.9604644775390625e-08
        pr = p_low + u * p_span
        lower_half = pr < 0.5
        magnitude = _ndtri_tail(tl.where(lower_half, pr, 1.0 - pr))
        z = tl.where(lower_half, -magnitude, magnitude)
        z = tl.where(flip != 0, -z, z)
        value = fa + fb * z
        value = tl.minimum(tl.maximum(value, lower), upper)
    elif DIST == 4:  # bernoulli
        hit = x.to(tl.int64) < threshold
    else:  # randint
        n = ispan.to(tl.uint64)
        carry = (x.to(tl.uint64) * n) >> 32
        hi = (x1.to(tl.uint64) * n + carry) >> 32
        ivalue = ilow + hi.to(tl.int64)

    if DIST == 4:
        if OUT == 2:
            stored = tl.where(hit, 0x3F80, 0).to(tl.int16)
        elif OUT == 3:
            stored = tl.where(hit, 1.0, 0.0).to(tl.float16)
        else:
            stored = hit.to(out_ptr.dtype.element_ty)
    elif DIST == 0 or DIST == 5:
        stored = ivalue.to(out_ptr.dtype.element_ty)
    else:
        if OUT == 2:
            bits = value.to(tl.uint32, bitcast=True)
            rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            rounded = tl.where(value != value, 0x7FC0, rounded)
            stored = rounded.to(tl.uint16).to(tl.int16, bitcast=True)
        else:
            stored = value.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + o, stored, mask=mask)


fill_kernel = _fill_kernel
