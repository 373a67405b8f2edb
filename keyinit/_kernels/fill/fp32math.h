/*
 * keyinit's binary32 transforms in C: the constants of keyinit._bits.fp32math (V1_CONSTANTS),
 * log_f32 and the PPND7 normal quantile (ndtri_tail_batch), operation for operation as the
 * reference computes them (docs/spec.md). Every operation is an IEEE-754 binary32 operation
 * in the reference's order: include it only in sources compiled with -ffp-contract=off and
 * without -ffast-math (keyinit/_kernels/common/build.py does both).
 *
 * The includer defines TILE (the most elements one call of ndtri_tail_batch takes) and
 * includes convert.h (ki_bits, ki_float) first.
 */
#ifndef KEYINIT_FP32MATH_H
#define KEYINIT_FP32MATH_H

#include <stdint.h>

#ifndef TILE
#error "define TILE before including fp32math.h"
#endif

/* Constants of keyinit._bits.fp32math (V1_CONSTANTS), as exact binary32 values. */

#define C_SQRT2 0x1.6a09e6p+0f
#define C_LN2_HI 0x1.62e4p-1f
#define C_LN2_LO 0x1.7f7d1cp-20f
#define C_AT3 0x1.555556p-2f
#define C_AT5 0x1.99999ap-3f
#define C_AT7 0x1.24924ap-3f
#define C_AT9 0x1.c71c72p-4f
#define C_SPLIT_CENTRAL 0x1.b33334p-2f
#define C_CENTRAL_R0 0x1.71eb86p-3f
#define C_A0 0x1.b18d9p+1f
#define C_A1 0x1.937964p+5f
#define C_A2 0x1.3e951p+7f
#define C_A3 0x1.d8ep+5f
#define C_B1 0x1.1e529ep+4f
#define C_B2 0x1.3b07f2p+6f
#define C_B3 0x1.0cc01p+6f
#define C_SPLIT_TAIL 0x1.4p+2f
#define C_TAIL_SHIFT 0x1.99999ap+0f
#define C_C0 0x1.6c6662p+0f
#define C_C1 0x1.60df54p+1f
#define C_C2 0x1.4e85c2p+0f
#define C_C3 0x1.5ca5dap-3f
#define C_D1 0x1.795848p-1f
#define C_D2 0x1.ec62b8p-4f
#define C_E0 0x1.aa1b1ep+2f
#define C_E1 0x1.8a65ap+1f
#define C_E2 0x1.b6f8aap-2f
#define C_E3 0x1.1c0d82p-6f
#define C_F1 0x1.ef92a8p-3f
#define C_F2 0x1.91ad42p-7f
#define C_SMALLEST_NORMAL 0x1p-126f

/* Exported so the tests can check these constants against V1_CONSTANTS. */
static const float ki_constants[] = {
    C_SQRT2, C_LN2_HI, C_LN2_LO, C_AT3, C_AT5, C_AT7, C_AT9, C_SPLIT_CENTRAL, C_CENTRAL_R0,
    C_A0, C_A1, C_A2, C_A3, 1.0f, C_B1, C_B2, C_B3, C_SPLIT_TAIL, C_TAIL_SHIFT,
    C_C0, C_C1, C_C2, C_C3, 1.0f, C_D1, C_D2, C_E0, C_E1, C_E2, C_E3, 1.0f, C_F1, C_F2,
    C_SMALLEST_NORMAL,
};

/* fp32math.log_f32: positive normal x. */
static inline float log_f32(float x)
{
    int32_t bits = (int32_t)ki_bits(x);
    int32_t exponent = (bits >> 23) - 127;
    float mantissa = ki_float((uint32_t)((bits & 0x007FFFFF) | 0x3F800000));
    int halve = mantissa > C_SQRT2;
    mantissa = halve ? mantissa * 0.5f : mantissa;
    float e = (float)(exponent + halve);
    float s = (mantissa - 1.0f) / (mantissa + 1.0f);
    float t = s * s;
    float h = ((C_AT9 * t + C_AT7) * t + C_AT5) * t + C_AT3;
    float poly = t * h;
    float two_s = s * 2.0f;
    float log_m = two_s + two_s * poly;
    return e * C_LN2_HI + (e * C_LN2_LO + log_m);
}

/* fp32math.ndtri_tail_f32 of tail[0..m-1] into mag[0..m-1] (m <= TILE). Each
 * element's magnitude is ONE rational evaluation, with the argument and the
 * coefficients of its PPND7 branch (q = 0.5 - t, r = sqrt(-log(max(t, 2**-126)))):
 *
 *   branch   condition        x                    magnitude
 *   central  q <= 0.425       0.180625 - q*q       (q * A(x)) / B(x)
 *   near     r <= 5           r - 1.6              C(x) / D(x)
 *   far      otherwise        r - 5                E(x) / F(x)
 *
 * which is the branch the reference selects, operation for operation (the
 * reference evaluates every branch and selects; only the selected one matters).
 * The choice is made in two SIMD passes rather than lane by lane: the central
 * evaluation runs on every element (about 85% keep it), then the elements with
 * q > 0.425 are compacted and get the log, the sqrt and one rational whose
 * coefficients (C, D or E, F: the same shapes) are chosen per element. The
 * Triton kernel merges all three branches per lane in one pass (on a GPU a
 * lane-wise select is cheaper than a second pass); both give the same bits. */
static void ndtri_tail_batch(const float *tail, int64_t m, float *mag)
{
    int32_t where[TILE];
    float tails[TILE], ztail[TILE];
    uint8_t is_tail[TILE];
    for (int64_t k = 0; k < m; k++) {
        float q = 0.5f - tail[k];
        float x = C_CENTRAL_R0 - q * q;
        float num = ((C_A3 * x + C_A2) * x + C_A1) * x + C_A0;
        float den = ((C_B3 * x + C_B2) * x + C_B1) * x + 1.0f;
        mag[k] = (q * num) / den;
        is_tail[k] = !(q <= C_SPLIT_CENTRAL);
    }
    /* Compaction through 64-bit masks: the work is per tail element, with no
     * store whose address depends on the previous element. */
    int64_t n = 0;
    for (int64_t base = 0; base < m; base += 64) {
        int64_t cnt = m - base < 64 ? m - base : 64;
        uint64_t bits = 0;
        for (int64_t j = 0; j < cnt; j++) bits |= (uint64_t)is_tail[base + j] << j;
        while (bits) {
            int j = __builtin_ctzll(bits);
            bits &= bits - 1;
            where[n] = (int32_t)(base + j);
            tails[n] = tail[base + j];
            n++;
        }
    }
    for (int64_t j = 0; j < n; j++) {
        float clamped = tails[j] < C_SMALLEST_NORMAL ? C_SMALLEST_NORMAL : tails[j];
        float r = __builtin_sqrtf(-log_f32(clamped));
        int near = r <= C_SPLIT_TAIL;
        float x = near ? r - C_TAIL_SHIFT : r - C_SPLIT_TAIL;
        float n0 = near ? C_C0 : C_E0, n1 = near ? C_C1 : C_E1, n2 = near ? C_C2 : C_E2, n3 = near ? C_C3 : C_E3;
        float d1 = near ? C_D1 : C_F1, d2 = near ? C_D2 : C_F2;
        float num = ((n3 * x + n2) * x + n1) * x + n0;
        float den = (d2 * x + d1) * x + 1.0f;
        ztail[j] = num / den;
    }
    for (int64_t j = 0; j < n; j++) mag[where[j]] = ztail[j];
}

#endif /* KEYINIT_FP32MATH_H */
