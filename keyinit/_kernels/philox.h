/*
 * Philox4x32-10 (Salmon et al., SC'11; Random123) as static inline functions,
 * shared by keyinit's C kernels. See docs/spec.md sections 1 and 4.
 *
 * One round, with M0 = 0xD2511F53, M1 = 0xCD9E8D57:
 *     (hi0, lo0) = mulhilo32(M0, c0);  (hi1, lo1) = mulhilo32(M1, c2)
 *     (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
 * ten rounds, the key bumped by (W0, W1) = (0x9E3779B9, 0xBB67AE85) between rounds.
 *
 * The element stream of a key uses block b = word index / 4 as the counter
 * (lo32(b), hi32(b), 0, 0); word j is lane j % 4 of block j / 4.
 *
 * Everything here is integer arithmetic: the results do not depend on the
 * compiler, the flags or the vector width. The AVX2 functions compute exactly
 * what ki_philox_block computes, eight blocks per vector.
 */
#ifndef KEYINIT_PHILOX_H
#define KEYINIT_PHILOX_H

#include <stdint.h>

#define KI_PHILOX_M0 0xD2511F53u
#define KI_PHILOX_M1 0xCD9E8D57u
#define KI_PHILOX_W0 0x9E3779B9u
#define KI_PHILOX_W1 0xBB67AE85u

/* Philox4x32-10 of an arbitrary counter ctr[0..3] under (k0, k1); out may alias ctr. */
static inline void ki_philox4x32_10(const uint32_t ctr[4], uint32_t k0, uint32_t k1, uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += KI_PHILOX_W0;
            k1 += KI_PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)KI_PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)KI_PHILOX_M1 * c2;
        uint32_t next0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t next2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = next0;
        c2 = next2;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* Block b of the element stream: the counter (lo32(b), hi32(b), 0, 0). */
static inline void ki_philox_block(uint64_t b, uint32_t k0, uint32_t k1, uint32_t out[4])
{
    const uint32_t ctr[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0u, 0u};
    ki_philox4x32_10(ctr, k0, k1, out);
}

/* Word j of the element stream. */
static inline uint32_t ki_philox_word(uint64_t j, uint32_t k0, uint32_t k1)
{
    uint32_t out[4];
    ki_philox_block(j >> 2, k0, k1, out);
    return out[j & 3u];
}

#if defined(__AVX2__)
#include <immintrin.h>

/* (hi, lo) of the 32x32->64 products of each 32-bit lane of a with the constant m
 * (m is broadcast in the low half of every 64-bit lane). */
static inline void ki_mulhilo_avx2(__m256i a, __m256i m, __m256i *hi, __m256i *lo)
{
    __m256i even = _mm256_mul_epu32(a, m);                        /* lanes 0, 2, 4, 6 */
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  /* lanes 1, 3, 5, 7 */
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

/* Blocks first .. first+15 as two interleaved groups of eight (the two groups
 * hide each other's multiply latency). Lane i of c[g][w] is word w of block
 * first + 8g + i. */
static inline void ki_philox_blocks16_avx2(uint64_t first, uint32_t k0, uint32_t k1, __m256i c[2][4])
{
    const __m256i m0 = _mm256_set1_epi64x(KI_PHILOX_M0), m1 = _mm256_set1_epi64x(KI_PHILOX_M1);
    const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int g = 0; g < 2; g++) {
        uint64_t b0 = first + 8u * (uint64_t)g;
        __m256i lo0 = _mm256_set1_epi32((int)(uint32_t)b0);
        __m256i lo = _mm256_add_epi32(lo0, step);
        /* a carry into the high word where lo wrapped: unsigned lo < lo0 */
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(lo0, sign), _mm256_xor_si256(lo, sign));
        __m256i hi = _mm256_sub_epi32(_mm256_set1_epi32((int)(uint32_t)(b0 >> 32)), wrapped);
        c[g][0] = lo;
        c[g][1] = hi;
        c[g][2] = _mm256_setzero_si256();
        c[g][3] = _mm256_setzero_si256();
    }
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += KI_PHILOX_W0;
            k1 += KI_PHILOX_W1;
        }
        const __m256i key0 = _mm256_set1_epi32((int)k0), key1 = _mm256_set1_epi32((int)k1);
        for (int g = 0; g < 2; g++) {
            __m256i hi0, lo0, hi1, lo1;
            ki_mulhilo_avx2(c[g][0], m0, &hi0, &lo0);
            ki_mulhilo_avx2(c[g][2], m1, &hi1, &lo1);
            c[g][0] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[g][1]), key0);
            c[g][2] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[g][3]), key1);
            c[g][1] = lo1;
            c[g][3] = lo0;
        }
    }
}

/* Store eight blocks (word vectors w0..w3, lane i = block i) as 32 consecutive
 * stream words: out[4*i + w]. */
static inline void ki_store_words8_avx2(__m256i w0, __m256i w1, __m256i w2, __m256i w3, uint32_t *out)
{
    __m256i a = _mm256_unpacklo_epi32(w0, w1); /* b0w0 b0w1 b1w0 b1w1 | b4.. b5.. */
    __m256i b = _mm256_unpackhi_epi32(w0, w1); /* b2.. b3.. | b6.. b7.. */
    __m256i c = _mm256_unpacklo_epi32(w2, w3);
    __m256i d = _mm256_unpackhi_epi32(w2, w3);
    __m256i blk04 = _mm256_unpacklo_epi64(a, c); /* block 0 | block 4 */
    __m256i blk15 = _mm256_unpackhi_epi64(a, c); /* block 1 | block 5 */
    __m256i blk26 = _mm256_unpacklo_epi64(b, d); /* block 2 | block 6 */
    __m256i blk37 = _mm256_unpackhi_epi64(b, d); /* block 3 | block 7 */
    _mm256_storeu_si256((__m256i *)(out + 0), _mm256_permute2x128_si256(blk04, blk15, 0x20));
    _mm256_storeu_si256((__m256i *)(out + 8), _mm256_permute2x128_si256(blk26, blk37, 0x20));
    _mm256_storeu_si256((__m256i *)(out + 16), _mm256_permute2x128_si256(blk04, blk15, 0x31));
    _mm256_storeu_si256((__m256i *)(out + 24), _mm256_permute2x128_si256(blk26, blk37, 0x31));
}
#endif /* __AVX2__ */

/* The stream words of blocks first .. first+n-1, in order: out[4*i + w] is
 * word w of block first + i (4n words). */
static inline void ki_philox_stream(uint64_t first, int64_t n, uint32_t k0, uint32_t k1, uint32_t *out)
{
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 16 <= n; i += 16) {
        __m256i c[2][4];
        ki_philox_blocks16_avx2(first + (uint64_t)i, k0, k1, c);
        ki_store_words8_avx2(c[0][0], c[0][1], c[0][2], c[0][3], out + 4 * i);
        ki_store_words8_avx2(c[1][0], c[1][1], c[1][2], c[1][3], out + 4 * i + 32);
    }
#endif
    for (; i < n; i++) ki_philox_block(first + (uint64_t)i, k0, k1, out + 4 * i);
}

#endif /* KEYINIT_PHILOX_H */
