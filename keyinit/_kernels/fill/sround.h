/*
 * Keyed stochastic rounding of binary32 values (docs/spec.md section 17) on the fill kernel's walk: a
 * tile's words are word(K, g) of its elements' global indices, computed exactly as for `bits`
 * (keyinit_fill, w = 1), and each element's value is then rounded by section 17.2's integer rule. The
 * source has the destination's element strides, so the tile's destination offsets address both.
 * Bit-identical to keyinit._bits.sround.round_bits; integer operations only. Included by
 * fill_kernels.c once plan_t, fill_planned and the tile walk are defined.
 */
#ifndef KEYINIT_FILL_SROUND_H
#define KEYINIT_FILL_SROUND_H

/* Targets (keyinit._kernels.fill.sround.TARGET_IDS). */
#define KI_SR_BFLOAT16 0
#define KI_SR_FLOAT16 1
#define KI_SR_FLOAT8_E5M2 2
#define KI_SR_FLOAT8_E4M3FN 3

/* binary32 bits u rounded with word x to a target of P significand bits, exponents EMIN..EMAX, NBITS
 * wide, with magnitudes INF (HAS_INF: else none, saturating at MAXF) and NAN: section 17.2. */
static inline uint32_t ki_sr_f32(uint32_t u, uint32_t x, const int P, const int EMIN, const int EMAX,
                                 const int NBITS, const int HAS_INF, const uint32_t INF, const uint32_t NAN_,
                                 const uint32_t MAXF)
{
    const uint32_t sign = (u >> 31) << (NBITS - 1);
    const uint32_t mag = u & 0x7FFFFFFFu;
    int32_t field = (int32_t)(mag >> 23);
    const uint32_t fraction = mag & 0x7FFFFFu;
    if (field == 255) return sign | (HAS_INF ? (fraction ? NAN_ : INF) : NAN_);
    const uint64_t m = field ? (fraction | 0x800000u) : fraction;
    field = field ? field : 1;
    const int32_t e = field - 150;                                   /* |v| = m * 2**e */
    const int32_t big_e = field - 127 > EMIN ? field - 127 : EMIN; /* lo's binade */
    int32_t shift = big_e - (P - 1) - e;                             /* >= 1 */
    shift = shift > 62 ? 62 : shift; /* m < 2**24: past 24 bits every shifted value below is as at 62 */
    const uint64_t units = m >> shift;
    const uint64_t rem = m - (units << shift);
    const uint64_t r = shift <= 32 ? rem << (32 - shift) : rem >> (shift - 32);
    const uint64_t up = ((uint64_t)x + r) >> 32;
    uint64_t bits = ((uint64_t)(big_e - EMIN) << (P - 1)) + units + up;
    if (HAS_INF) {
        if (big_e > EMAX) bits = INF;
    } else if (big_e > EMAX || bits > MAXF) {
        bits = MAXF;
    }
    return sign | (uint32_t)bits;
}

/* binary32 to bfloat16: the carry of the word's high half into the value's low half (section 17.2). */
static inline uint16_t ki_sr_bf16(uint32_t u, uint32_t x)
{
    const uint32_t mag = u & 0x7FFFFFFFu;
    uint32_t r = (mag >> 16) + (((x >> 16) + (mag & 0xFFFFu)) >> 16);
    r = mag > 0x7F800000u ? 0x7FC0u : (mag == 0x7F800000u ? 0x7F80u : r);
    return (uint16_t)(r | ((u >> 16) & 0x8000u));
}

/* Source and destination element offsets: o[k] if o != NULL, else o0 + k*os. */
#define SR_LOOP(T, EXPR)                                                         \
    do {                                                                         \
        T *d = (T *)P->out;                                                      \
        const uint32_t *s = (const uint32_t *)P->src;                            \
        if (o != NULL) {                                                         \
            for (int64_t k = 0; k < m; k++) {                                    \
                const uint32_t u = s[o[k]], x = wp[k];                           \
                d[o[k]] = (T)(EXPR);                                             \
            }                                                                    \
        } else {                                                                 \
            d += o0;                                                             \
            s += o0;                                                             \
            for (int64_t k = 0; k < m; k++) {                                    \
                const uint32_t u = s[k * os], x = wp[k];                         \
                d[k * os] = (T)(EXPR);                                           \
            }                                                                    \
        }                                                                        \
    } while (0)

#include "sround_fp4.h"

static void sround_tile(const plan_t *P, const uint32_t *wp, const int64_t *o, int64_t o0, int64_t os, int64_t m)
{
    if (P->target == KI_SR_FP4_E2M1) { sround_fp4_tile(P, wp, o, o0, os, m); return; } /* binary64 source */
    if (o == NULL && os == 1) { /* dense: the common case, written so the compiler vectorizes it */
        const uint32_t *s = (const uint32_t *)P->src + o0;
        if (P->target == KI_SR_BFLOAT16) {
            uint16_t *d = (uint16_t *)P->out + o0;
            for (int64_t k = 0; k < m; k++) d[k] = ki_sr_bf16(s[k], wp[k]);
            return;
        }
        if (P->target == KI_SR_FLOAT16) {
            /* float16's normal range, 2**-14 <= |v| < 2**16, in one vectorized pass (shift 13, section
             * 17.2; the carry into the exponent gives 0x7C00, infinity, past the largest finite value),
             * then the other values (subnormal results, overflow, NaN, inf) by the general rule */
            uint16_t *d = (uint16_t *)P->out + o0;
            uint32_t others = 0;
            for (int64_t k = 0; k < m; k++) {
                const uint32_t u = s[k], mag = u & 0x7FFFFFFFu;
                const uint32_t up = ((wp[k] >> 19) + (mag & 0x1FFFu)) >> 13;
                d[k] = (uint16_t)((((mag - 0x38000000u) >> 13) + up) | ((u >> 16) & 0x8000u));
                others |= (uint32_t)(mag - 0x38800000u >= 0x0F000000u);
            }
            if (others) {
                for (int64_t k = 0; k < m; k++) {
                    if ((s[k] & 0x7FFFFFFFu) - 0x38800000u >= 0x0F000000u)
                        d[k] = (uint16_t)ki_sr_f32(s[k], wp[k], 11, -14, 15, 16, 1, 0x7C00u, 0x7E00u, 0x7BFFu);
                }
            }
            return;
        }
    }
    switch (P->target) {
    case KI_SR_BFLOAT16: SR_LOOP(uint16_t, ki_sr_bf16(u, x)); break;
    case KI_SR_FLOAT16: SR_LOOP(uint16_t, ki_sr_f32(u, x, 11, -14, 15, 16, 1, 0x7C00u, 0x7E00u, 0x7BFFu)); break;
    case KI_SR_FLOAT8_E5M2: SR_LOOP(uint8_t, ki_sr_f32(u, x, 3, -14, 15, 8, 1, 0x7Cu, 0x7Eu, 0x7Bu)); break;
    case KI_SR_FLOAT8_E4M3FN: SR_LOOP(uint8_t, ki_sr_f32(u, x, 4, -6, 8, 8, 0, 0u, 0x7Fu, 0x7Eu)); break;
    }
}

static int fill_planned(plan_t *P, const double *fparams, const int64_t *iparams, int nthreads);

/*
 * src (binary32, the region's values; binary64 for KI_SR_FP4_E2M1, sround_fp4.h) rounded stochastically
 * into out, both addressed like keyinit_fill's destination (size, ostride in elements of each; the same
 * strides), element (p_0, ..., p_{d-1}) by the word of its global flat index base + sum_k idx_k(p_k) *
 * gstride[k] (keyinit_fill's addressing). target: KI_SR_*. Returns 0, or a negative number for invalid arguments.
 */
KI_API int keyinit_sround(int target, uint32_t k0, uint32_t k1, int ndim, int64_t base, const int64_t *size,
                          const int64_t *ostride, const int64_t *gstride, const int64_t *const *index,
                          const void *src, void *out, int nthreads)
{
    if (ndim < 1 || ndim > KI_MAX_DIMS) return -1;
    if (target < KI_SR_BFLOAT16 || target > KI_SR_FP4_E2M1) return -2;
    /* one word per element, as bits draws them */
    plan_t P = plan_of(KI_DIST_BITS, target <= KI_SR_FLOAT16 ? KI_DTYPE_INT16 : KI_DTYPE_UINT8, k0, k1, ndim, base,
                       size, ostride, gstride, index, out);
    P.src = (const char *)src;
    P.target = target;
    static const double fzero[6];
    static const int64_t izero[4];
    return fill_planned(&P, fzero, izero, nthreads);
}

#endif /* KEYINIT_FILL_SROUND_H */
