/*
 * Keyed stochastic rounding of binary64 values to FP4 E2M1 (docs/spec.md 17.7) on keyinit_sround's walk:
 * the source is the quotient v = x / scale already taken in binary64 (the caller refuses NaN), laid out with
 * the destination's element strides; each element's word is word(K, g) of its global index, as for the
 * other targets, and its value is rounded by section 17.2's integer rule with E2M1's p = 2, emin = 0,
 * emax = 2, saturating (|v| >= 6, infinities, and a NaN should one come: sign | 0x7). One uint8 per
 * element, the 4-bit code (sign bit 3) in its low bits. Bit-identical to keyinit._bits.sround.round_bits
 * with E2M1; integer operations only, every shift amount below 64. Included by sround.h.
 */
#ifndef KEYINIT_FILL_SROUND_FP4_H
#define KEYINIT_FILL_SROUND_FP4_H

/* The target id (keyinit._kernels.fill.cpu.SROUND_FP4): a binary64 source, uint8 codes. */
#define KI_SR_FP4_E2M1 4

/* binary64 bits u rounded with word x to E2M1's code. |v| = m * 2**(field - 1075) (a subnormal source:
 * field 1); lo's binade E = max(field - 1023, 0), so the shift from m to E2M1's quantum 2**(E - 1) is
 * E + 1074 - field: 51 from 1 upwards, 52 .. 1073 below 1. With shift >= 51 > 32, R is rem >> (shift - 32);
 * both shifts are clamped to 62 (m < 2**53: past 53 the shifted value is 0 either way). */
static inline uint8_t ki_sr_fp4(uint64_t u, uint32_t x)
{
    const uint64_t sign = (u >> 63) << 3;
    const uint64_t mag = u & 0x7FFFFFFFFFFFFFFFull;
    const uint64_t field0 = mag >> 52;
    const uint64_t m = (mag & 0xFFFFFFFFFFFFFull) | ((uint64_t)(field0 != 0) << 52);
    const int64_t field = field0 != 0 ? (int64_t)field0 : 1;
    const int64_t big_e = field > 1023 ? field - 1023 : 0;
    const int64_t shift = big_e + 1074 - field;                       /* >= 51 */
    const int64_t s1 = shift > 62 ? 62 : shift;
    const int64_t s2 = shift - 32 > 62 ? 62 : shift - 32;             /* >= 19 */
    const uint64_t units = m >> s1;                                   /* lo / q */
    const uint64_t r = (m - (units << s1)) >> s2;                     /* R < 2**32 */
    const uint64_t up = ((uint64_t)x + r) >> 32;
    const uint64_t bits = ((uint64_t)big_e << 1) + units + up;
    /* |v| >= 6 (0x4018...: overflow past 6, the binade [6, 8) whose round-up passes 6, inf, NaN) saturates;
     * below 6, bits <= 7 */
    return (uint8_t)(sign | (mag >= 0x4018000000000000ull ? 7u : bits));
}

/* m elements: source and destination offsets o[k] if o != NULL, else o0 + k*os. */
static void sround_fp4_tile(const plan_t *P, const uint32_t *wp, const int64_t *o, int64_t o0, int64_t os,
                            int64_t m)
{
    uint8_t *d = (uint8_t *)P->out;
    const uint64_t *s = (const uint64_t *)P->src;
    if (o != NULL) {
        for (int64_t k = 0; k < m; k++) d[o[k]] = ki_sr_fp4(s[o[k]], wp[k]);
        return;
    }
    d += o0;
    s += o0;
    if (os == 1) { /* dense: the common case, vectorized */
        for (int64_t k = 0; k < m; k++) d[k] = ki_sr_fp4(s[k], wp[k]);
        return;
    }
    for (int64_t k = 0; k < m; k++) d[k * os] = ki_sr_fp4(s[k * os], wp[k]);
}

#endif /* KEYINIT_FILL_SROUND_FP4_H */
