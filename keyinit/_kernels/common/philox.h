/*
 * Philox4x32-10 (Salmon et al., SC'11; Random123), the one implementation that
 * every keyinit C kernel includes (fill_kernels.c, dropout_kernels.c,
 * permutation_kernels.c). See docs/spec.md sections 1 and 4.
 *
 * One round, with M0 = 0xD2511F53, M1 = 0xCD9E8D57:
 *     (hi0, lo0) = mulhilo32(M0, c0);  (hi1, lo1) = mulhilo32(M1, c2)
 *     (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
 * ten rounds, the key bumped by (W0, W1) = (0x9E3779B9, 0xBB67AE85) between rounds.
 *
 * The element stream of a key uses block b = word index / 4 as the counter
 * (lo32(b), hi32(b), 0, 0); word j is lane j % 4 of block j / 4.
 *
 * Three layers:
 *   - scalar: ki_philox4x32_10 (any counter), ki_philox_block, ki_philox_word;
 *   - vector: where the target has AVX-512F (16 lanes) or AVX2 (8 lanes), a
 *     vector type ki_vec and ki_philox_rounds, which runs the ten rounds on
 *     KI_GROUPS independent vectors at once (interleaved, so the groups hide
 *     each other's multiply latency): KI_SIMD_BLOCKS = KI_LANES * KI_GROUPS
 *     counters per call;
 *   - what the kernels use, vector groups first and the scalar code for the rest:
 *     ki_philox_stream (consecutive blocks, words in stream order), ki_philox_simd_runs (a vector
 *     pass of runs of KI_LANES blocks, each its own), ki_philox_list(_hi) (blocks with arbitrary
 *     numbers, and high counter words) and ki_philox_first_words
 *     (word 0 of Philox((v[j], c1, 0, 0)): the Feistel round function).
 *
 * Everything here is integer arithmetic: the results do not depend on the
 * compiler, the flags or the vector width. Every vector function computes
 * exactly what ki_philox4x32_10 computes, lane by lane.
 */
#ifndef KEYINIT_PHILOX_H
#define KEYINIT_PHILOX_H

#include <stdint.h>

#define KI_PHILOX_M0 0xD2511F53u
#define KI_PHILOX_M1 0xCD9E8D57u
#define KI_PHILOX_W0 0x9E3779B9u
#define KI_PHILOX_W1 0xBB67AE85u

#define KI_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------ scalar */

/* Philox4x32-10 of an arbitrary counter ctr[0..3] under (k0, k1); out may alias ctr. */
KI_INLINE void ki_philox4x32_10(const uint32_t ctr[4], uint32_t k0, uint32_t k1, uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)KI_PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)KI_PHILOX_M1 * c2;
        uint32_t next0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t next2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = next0;
        c2 = next2;
        k0 += KI_PHILOX_W0; /* the bump after the last round is never used */
        k1 += KI_PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* Block b of the element stream of the high counter words h: the counter (lo32(b), hi32(b), lo32(h), hi32(h))
 * (h = 0 in every stream of docs/spec.md sections 4-14; keyed forwards' extent-free names, section 14.8, set it). */
KI_INLINE void ki_philox_block_hi(uint64_t b, uint64_t h, uint32_t k0, uint32_t k1, uint32_t out[4])
{
    const uint32_t ctr[4] = {(uint32_t)b, (uint32_t)(b >> 32), (uint32_t)h, (uint32_t)(h >> 32)};
    ki_philox4x32_10(ctr, k0, k1, out);
}

/* Block b of the element stream: the counter (lo32(b), hi32(b), 0, 0). */
KI_INLINE void ki_philox_block(uint64_t b, uint32_t k0, uint32_t k1, uint32_t out[4])
{
    const uint32_t ctr[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0u, 0u};
    ki_philox4x32_10(ctr, k0, k1, out);
}

/* Word j of the element stream. */
KI_INLINE uint32_t ki_philox_word(uint64_t j, uint32_t k0, uint32_t k1)
{
    uint32_t out[4];
    ki_philox_block(j >> 2, k0, k1, out);
    return out[j & 3u];
}

/* Word j of the element stream of high counter words h. */
KI_INLINE uint32_t ki_philox_word_hi(uint64_t j, uint64_t h, uint32_t k0, uint32_t k1)
{
    uint32_t out[4];
    ki_philox_block_hi(j >> 2, h, k0, k1, out);
    return out[j & 3u];
}

/* ------------------------------------------------------------------ vector */

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define KI_SIMD 1
#endif

#if defined(__AVX512F__)
#define KI_LANES 16
#define KI_GROUPS 4
typedef __m512i ki_vec;

KI_INLINE ki_vec ki_v_set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
KI_INLINE ki_vec ki_v_zero(void) { return _mm512_setzero_si512(); }
KI_INLINE ki_vec ki_v_load(const uint32_t *p) { return _mm512_loadu_si512((const void *)p); }
KI_INLINE void ki_v_store(uint32_t *p, ki_vec v) { _mm512_storeu_si512((void *)p, v); }
KI_INLINE ki_vec ki_v_xor3(ki_vec a, ki_vec b, ki_vec c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }

/* (hi, lo) of the 32x32->64 products of each lane of a with m (m in the low half of every 64-bit lane). */
KI_INLINE void ki_v_mulhilo(ki_vec a, ki_vec m, ki_vec *hi, ki_vec *lo)
{
    ki_vec even = _mm512_mul_epu32(a, m);
    ki_vec odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
    *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

KI_INLINE ki_vec ki_v_multiplier(uint32_t m) { return _mm512_set1_epi64((long long)m); }

/* lo32 and hi32 of the block numbers b0 + i, lane i (the carry out of the low word included). */
KI_INLINE void ki_v_counters(uint64_t b0, ki_vec *lo, ki_vec *hi)
{
    const ki_vec lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const ki_vec lo0 = ki_v_set1((uint32_t)b0), hi0 = ki_v_set1((uint32_t)(b0 >> 32));
    *lo = _mm512_add_epi32(lo0, lane);
    __mmask16 carry = _mm512_cmplt_epu32_mask(*lo, lo0);
    *hi = _mm512_mask_add_epi32(hi0, carry, hi0, ki_v_set1(1u));
}

/* Store 16 blocks (word vectors c0..c3, lane i = block i) as 64 words in stream order: out[4*i + w]. */
KI_INLINE void ki_v_store_blocks(ki_vec c0, ki_vec c1, ki_vec c2, ki_vec c3, uint32_t *out)
{
    ki_vec t0 = _mm512_unpacklo_epi32(c0, c1);
    ki_vec t1 = _mm512_unpackhi_epi32(c0, c1);
    ki_vec t2 = _mm512_unpacklo_epi32(c2, c3);
    ki_vec t3 = _mm512_unpackhi_epi32(c2, c3);
    ki_vec u0 = _mm512_unpacklo_epi64(t0, t2); /* 128-bit chunk j: block 4j */
    ki_vec u1 = _mm512_unpackhi_epi64(t0, t2); /* block 4j+1 */
    ki_vec u2 = _mm512_unpacklo_epi64(t1, t3); /* block 4j+2 */
    ki_vec u3 = _mm512_unpackhi_epi64(t1, t3); /* block 4j+3 */
    const ki_vec i01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const ki_vec i23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    ki_vec v01a = _mm512_permutex2var_epi64(u0, i01, u1); /* blocks 0 1 4 5 */
    ki_vec v01b = _mm512_permutex2var_epi64(u0, i23, u1); /* blocks 8 9 12 13 */
    ki_vec v23a = _mm512_permutex2var_epi64(u2, i01, u3); /* blocks 2 3 6 7 */
    ki_vec v23b = _mm512_permutex2var_epi64(u2, i23, u3); /* blocks 10 11 14 15 */
    const ki_vec j0 = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
    const ki_vec j1 = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
    ki_v_store(out + 0, _mm512_permutex2var_epi64(v01a, j0, v23a));
    ki_v_store(out + 16, _mm512_permutex2var_epi64(v01a, j1, v23a));
    ki_v_store(out + 32, _mm512_permutex2var_epi64(v01b, j0, v23b));
    ki_v_store(out + 48, _mm512_permutex2var_epi64(v01b, j1, v23b));
}

#elif defined(__AVX2__)
#define KI_LANES 8
#define KI_GROUPS 2
typedef __m256i ki_vec;

KI_INLINE ki_vec ki_v_set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
KI_INLINE ki_vec ki_v_zero(void) { return _mm256_setzero_si256(); }
KI_INLINE ki_vec ki_v_load(const uint32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
KI_INLINE void ki_v_store(uint32_t *p, ki_vec v) { _mm256_storeu_si256((__m256i *)p, v); }
KI_INLINE ki_vec ki_v_xor3(ki_vec a, ki_vec b, ki_vec c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }

KI_INLINE void ki_v_mulhilo(ki_vec a, ki_vec m, ki_vec *hi, ki_vec *lo)
{
    ki_vec even = _mm256_mul_epu32(a, m);                        /* lanes 0, 2, 4, 6 */
    ki_vec odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  /* lanes 1, 3, 5, 7 */
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

KI_INLINE ki_vec ki_v_multiplier(uint32_t m) { return _mm256_set1_epi64x((long long)m); }

KI_INLINE void ki_v_counters(uint64_t b0, ki_vec *lo, ki_vec *hi)
{
    const ki_vec lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const ki_vec lo0 = ki_v_set1((uint32_t)b0);
    *lo = _mm256_add_epi32(lo0, lane);
    /* a carry into the high word where lo wrapped: unsigned lo < lo0 (subtracting -1 adds 1) */
    const ki_vec sign = ki_v_set1(0x80000000u);
    ki_vec wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(lo0, sign), _mm256_xor_si256(*lo, sign));
    *hi = _mm256_sub_epi32(ki_v_set1((uint32_t)(b0 >> 32)), wrapped);
}

/* Store 8 blocks (word vectors c0..c3, lane i = block i) as 32 words in stream order: out[4*i + w]. */
KI_INLINE void ki_v_store_blocks(ki_vec c0, ki_vec c1, ki_vec c2, ki_vec c3, uint32_t *out)
{
    ki_vec a = _mm256_unpacklo_epi32(c0, c1); /* b0w0 b0w1 b1w0 b1w1 | b4.. b5.. */
    ki_vec b = _mm256_unpackhi_epi32(c0, c1); /* b2.. b3.. | b6.. b7.. */
    ki_vec c = _mm256_unpacklo_epi32(c2, c3);
    ki_vec d = _mm256_unpackhi_epi32(c2, c3);
    ki_vec blk04 = _mm256_unpacklo_epi64(a, c); /* block 0 | block 4 */
    ki_vec blk15 = _mm256_unpackhi_epi64(a, c); /* block 1 | block 5 */
    ki_vec blk26 = _mm256_unpacklo_epi64(b, d); /* block 2 | block 6 */
    ki_vec blk37 = _mm256_unpackhi_epi64(b, d); /* block 3 | block 7 */
    ki_v_store(out + 0, _mm256_permute2x128_si256(blk04, blk15, 0x20));
    ki_v_store(out + 8, _mm256_permute2x128_si256(blk26, blk37, 0x20));
    ki_v_store(out + 16, _mm256_permute2x128_si256(blk04, blk15, 0x31));
    ki_v_store(out + 24, _mm256_permute2x128_si256(blk26, blk37, 0x31));
}
#endif

#ifdef KI_SIMD
#define KI_SIMD_BLOCKS (KI_LANES * KI_GROUPS)

/* The ten rounds on KI_GROUPS vectors of counters (c0[g], c1[g], c2[g], c3[g]), in place. */
KI_INLINE void ki_philox_rounds(ki_vec c0[KI_GROUPS], ki_vec c1[KI_GROUPS], ki_vec c2[KI_GROUPS],
                                ki_vec c3[KI_GROUPS], uint32_t k0, uint32_t k1)
{
    const ki_vec m0 = ki_v_multiplier(KI_PHILOX_M0), m1 = ki_v_multiplier(KI_PHILOX_M1);
    for (int round = 0; round < 10; round++) {
        const ki_vec key0 = ki_v_set1(k0), key1 = ki_v_set1(k1);
        for (int g = 0; g < KI_GROUPS; g++) {
            ki_vec hi0, lo0, hi1, lo1;
            ki_v_mulhilo(c0[g], m0, &hi0, &lo0);
            ki_v_mulhilo(c2[g], m1, &hi1, &lo1);
            c0[g] = ki_v_xor3(hi1, c1[g], key0);
            c2[g] = ki_v_xor3(hi0, c3[g], key1);
            c1[g] = lo1;
            c3[g] = lo0;
        }
        k0 += KI_PHILOX_W0;
        k1 += KI_PHILOX_W1;
    }
}

/* The blocks with counters (lo[g], hi[g], c2[g], c3[g]) (consumed), stored in stream order:
 * lane i of group g is block KI_LANES * g + i, written to out[4 * (KI_LANES * g + i) + w]. */
KI_INLINE void ki_philox_simd_counters(ki_vec lo[KI_GROUPS], ki_vec hi[KI_GROUPS], ki_vec c2[KI_GROUPS],
                                       ki_vec c3[KI_GROUPS], uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_philox_rounds(lo, hi, c2, c3, k0, k1);
    for (int g = 0; g < KI_GROUPS; g++) ki_v_store_blocks(lo[g], hi[g], c2[g], c3[g], out + 4 * KI_LANES * g);
}

/* The element-stream blocks with counters (lo[g], hi[g], lo32(h), hi32(h)) (see ki_philox_simd_counters). */
KI_INLINE void ki_philox_simd_blocks_hi(ki_vec lo[KI_GROUPS], ki_vec hi[KI_GROUPS], uint64_t h, uint32_t k0,
                                        uint32_t k1, uint32_t *out)
{
    ki_vec c2[KI_GROUPS], c3[KI_GROUPS];
    for (int g = 0; g < KI_GROUPS; g++) {
        c2[g] = ki_v_set1((uint32_t)h);
        c3[g] = ki_v_set1((uint32_t)(h >> 32));
    }
    ki_philox_simd_counters(lo, hi, c2, c3, k0, k1, out);
}

/* The element-stream blocks with counters (lo[g], hi[g], 0, 0) (see ki_philox_simd_blocks_hi). */
KI_INLINE void ki_philox_simd_blocks(ki_vec lo[KI_GROUPS], ki_vec hi[KI_GROUPS], uint32_t k0, uint32_t k1,
                                     uint32_t *out)
{
    ki_philox_simd_blocks_hi(lo, hi, 0u, k0, k1, out);
}

/* KI_GROUPS runs of KI_LANES consecutive blocks, counters made in registers: group g is blocks first[g] ..
 * first[g] + KI_LANES - 1 of high words high[g], stored in stream order at out[4 * KI_LANES * g ...]
 * (short rows of a keyed forward under stream v2's names, docs/spec.md 14.8, packed into one pass). */
KI_INLINE void ki_philox_simd_runs(const uint64_t *first, const uint64_t *high, uint32_t k0, uint32_t k1,
                                   uint32_t *out)
{
    ki_vec lo[KI_GROUPS], hi[KI_GROUPS], c2[KI_GROUPS], c3[KI_GROUPS];
    for (int g = 0; g < KI_GROUPS; g++) {
        ki_v_counters(first[g], &lo[g], &hi[g]);
        c2[g] = ki_v_set1((uint32_t)high[g]);
        c3[g] = ki_v_set1((uint32_t)(high[g] >> 32));
    }
    ki_philox_simd_counters(lo, hi, c2, c3, k0, k1, out);
}

/* Blocks first .. first + KI_SIMD_BLOCKS - 1 of high words h, counters made in registers. */
KI_INLINE void ki_philox_simd_range(uint64_t first, uint64_t h, uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_vec lo[KI_GROUPS], hi[KI_GROUPS];
    for (int g = 0; g < KI_GROUPS; g++) ki_v_counters(first + (uint64_t)(KI_LANES * g), &lo[g], &hi[g]);
    ki_philox_simd_blocks_hi(lo, hi, h, k0, k1, out);
}
#endif /* KI_SIMD */

/* ---------------------------------------------------------- for the kernels */

/* The stream words of blocks first .. first+n-1, in order: out[4*i + w] is
 * word w of block first + i (4n words). */
static inline void ki_philox_stream_hi(uint64_t first, int64_t n, uint64_t h, uint32_t k0, uint32_t k1, uint32_t *out)
{
    int64_t i = 0;
#ifdef KI_SIMD
    for (; i + KI_SIMD_BLOCKS <= n; i += KI_SIMD_BLOCKS)
        ki_philox_simd_range(first + (uint64_t)i, h, k0, k1, out + 4 * i);
#endif
    for (; i < n; i++) ki_philox_block_hi(first + (uint64_t)i, h, k0, k1, out + 4 * i);
}

/* The same with high counter words 0: the element stream of docs/spec.md section 4. */
static inline void ki_philox_stream(uint64_t first, int64_t n, uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_philox_stream_hi(first, n, 0u, k0, k1, out);
}

/* The stream words of blocks blocks[0..n-1] (any numbers) of high counter words highs[0..n-1] (NULL: all 0):
 * out[4*i + w] is word w of Philox4x32-10((lo32(b), hi32(b), lo32(h), hi32(h))), b = blocks[i], h = highs[i]. */
static inline void ki_philox_list_hi(const uint64_t *blocks, const uint64_t *highs, int64_t n, uint32_t k0,
                                     uint32_t k1, uint32_t *out)
{
    int64_t i = 0;
#ifdef KI_SIMD
    for (; i + KI_SIMD_BLOCKS <= n; i += KI_SIMD_BLOCKS) {
        uint32_t w[4][KI_SIMD_BLOCKS];
        for (int j = 0; j < KI_SIMD_BLOCKS; j++) {
            const uint64_t h = highs != NULL ? highs[i + j] : 0u;
            w[0][j] = (uint32_t)blocks[i + j];
            w[1][j] = (uint32_t)(blocks[i + j] >> 32);
            w[2][j] = (uint32_t)h;
            w[3][j] = (uint32_t)(h >> 32);
        }
        ki_vec c0[KI_GROUPS], c1[KI_GROUPS], c2[KI_GROUPS], c3[KI_GROUPS];
        for (int g = 0; g < KI_GROUPS; g++) {
            c0[g] = ki_v_load(w[0] + KI_LANES * g);
            c1[g] = ki_v_load(w[1] + KI_LANES * g);
            c2[g] = ki_v_load(w[2] + KI_LANES * g);
            c3[g] = ki_v_load(w[3] + KI_LANES * g);
        }
        ki_philox_simd_counters(c0, c1, c2, c3, k0, k1, out + 4 * i);
    }
#endif
    for (; i < n; i++) ki_philox_block_hi(blocks[i], highs != NULL ? highs[i] : 0u, k0, k1, out + 4 * i);
}

/* The stream words of blocks blocks[0..n-1] (any numbers): out[4*i + w] is word w of block blocks[i]. */
static inline void ki_philox_list(const uint64_t *blocks, int64_t n, uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_philox_list_hi(blocks, NULL, n, k0, k1, out);
}

/* out[j] = word 0 of Philox4x32-10((v[j], c1, 0, 0), (k0, k1)) for j < count (count <= KI_FIRST_WORDS_MAX).
 * The scalar rest runs round by round over the elements, a loop the compiler can vectorize. */
#define KI_FIRST_WORDS_MAX 256
static inline void ki_philox_first_words(const uint32_t *v, uint32_t c1, int count, uint32_t k0, uint32_t k1,
                                         uint32_t *out)
{
    int done = 0;
#ifdef KI_SIMD
    for (; done + KI_SIMD_BLOCKS <= count; done += KI_SIMD_BLOCKS) {
        ki_vec c0[KI_GROUPS], cc1[KI_GROUPS], c2[KI_GROUPS], c3[KI_GROUPS];
        for (int g = 0; g < KI_GROUPS; g++) {
            c0[g] = ki_v_load(v + done + KI_LANES * g);
            cc1[g] = ki_v_set1(c1);
            c2[g] = ki_v_zero();
            c3[g] = ki_v_zero();
        }
        ki_philox_rounds(c0, cc1, c2, c3, k0, k1);
        for (int g = 0; g < KI_GROUPS; g++) ki_v_store(out + done + KI_LANES * g, c0[g]);
    }
#endif
    const int rest = count - done;
    uint32_t a0[KI_FIRST_WORDS_MAX], a1[KI_FIRST_WORDS_MAX], a2[KI_FIRST_WORDS_MAX], a3[KI_FIRST_WORDS_MAX];
    for (int j = 0; j < rest; j++) {
        a0[j] = v[done + j];
        a1[j] = c1;
        a2[j] = 0;
        a3[j] = 0;
    }
    for (int round = 0; round < 10; round++) {
        const uint32_t key0 = k0 + (uint32_t)round * KI_PHILOX_W0, key1 = k1 + (uint32_t)round * KI_PHILOX_W1;
        for (int j = 0; j < rest; j++) {
            uint64_t p0 = (uint64_t)KI_PHILOX_M0 * a0[j];
            uint64_t p1 = (uint64_t)KI_PHILOX_M1 * a2[j];
            uint32_t n0 = (uint32_t)(p1 >> 32) ^ a1[j] ^ key0;
            uint32_t n2 = (uint32_t)(p0 >> 32) ^ a3[j] ^ key1;
            a1[j] = (uint32_t)p1;
            a3[j] = (uint32_t)p0;
            a0[j] = n0;
            a2[j] = n2;
        }
    }
    for (int j = 0; j < rest; j++) out[done + j] = a0[j];
}

#endif /* KEYINIT_PHILOX_H */
