/*
 * The keyed permutation of stream v1 (docs/spec.md section 16), for CPU tensors.
 * Bit-identical to keyinit/data/_feistel.py; integer arithmetic only.
 *
 *     b = bit_length(n - 1); rb = b / 2; lb = b - rb; x = (l << rb) | r
 *     round i (0..R-1, R = 12 if b <= 16 else 6): even i: l ^= F(i, r) & lmask;  odd i: r ^= F(i, l) & rmask
 *     F(i, v) = Philox4x32-10((v, i, 0, 0), Kp)[0]
 *     perm(p) = E(p), re-applied while >= n (cycle walking)
 *
 * Elements are processed in chunks of CHUNK, round by round over the chunk (so
 * the compiler vectorizes the Philox of CHUNK independent elements); elements
 * that must walk again are compacted and processed the same way.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "philox.h"

/* rounds: 12 for domains of at most 16 bits, else 6 (spec section 16) */
#define KI_PERM_ROUNDS(b) ((b) <= 16 ? 12 : 6)
#define CHUNK 256

/* F(i, v) for v[0..count) into out: the Philox rounds run over the whole chunk (vectorizable). */
static inline void round_values(uint32_t k0, uint32_t k1, uint32_t i, const uint32_t *restrict v,
                                uint32_t *restrict out, int count)
{
    int done = 0;
#if defined(__AVX2__)
    /* sixteen elements at a time, two interleaved groups of eight, all ten rounds in registers */
    const __m256i m0 = _mm256_set1_epi64x(KI_PHILOX_M0), m1 = _mm256_set1_epi64x(KI_PHILOX_M1);
    for (; done + 16 <= count; done += 16) {
        __m256i c[2][4];
        for (int g = 0; g < 2; g++) {
            c[g][0] = _mm256_loadu_si256((const __m256i *)(v + done + 8 * g));
            c[g][1] = _mm256_set1_epi32((int)i);
            c[g][2] = _mm256_setzero_si256();
            c[g][3] = _mm256_setzero_si256();
        }
        uint32_t a = k0, b = k1;
        for (int round = 0; round < 10; round++) {
            if (round) {
                a += KI_PHILOX_W0;
                b += KI_PHILOX_W1;
            }
            const __m256i key0 = _mm256_set1_epi32((int)a), key1 = _mm256_set1_epi32((int)b);
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
        _mm256_storeu_si256((__m256i *)(out + done), c[0][0]);
        _mm256_storeu_si256((__m256i *)(out + done + 8), c[1][0]);
    }
#endif
    v += done;
    out += done;
    count -= done;
    uint32_t c0[CHUNK], c1[CHUNK], c2[CHUNK], c3[CHUNK];
    for (int j = 0; j < count; j++) {
        c0[j] = v[j];
        c1[j] = i;
        c2[j] = 0;
        c3[j] = 0;
    }
    for (int round = 0; round < 10; round++) {
        const uint32_t a = k0 + (uint32_t)round * KI_PHILOX_W0, b = k1 + (uint32_t)round * KI_PHILOX_W1;
        for (int j = 0; j < count; j++) {
            uint64_t p0 = (uint64_t)KI_PHILOX_M0 * c0[j];
            uint64_t p1 = (uint64_t)KI_PHILOX_M1 * c2[j];
            uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[j] ^ a;
            uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[j] ^ b;
            c1[j] = (uint32_t)p1;
            c3[j] = (uint32_t)p0;
            c0[j] = n0;
            c2[j] = n2;
        }
    }
    for (int j = 0; j < count; j++) out[j] = c0[j];
}

/* One Feistel pass (inverse: rounds reversed) of x[0..count) in place. */
static void feistel(uint32_t k0, uint32_t k1, int lb, int rb, int inverse, uint64_t *x, int count)
{
    uint32_t left[CHUNK], right[CHUNK], f[CHUNK];
    const uint32_t lmask = (uint32_t)((1ull << lb) - 1), rmask = (uint32_t)((1ull << rb) - 1);
    for (int j = 0; j < count; j++) {
        left[j] = (uint32_t)(x[j] >> rb);
        right[j] = (uint32_t)(x[j] & rmask);
    }
    const int rounds = KI_PERM_ROUNDS(lb + rb);
    for (int s = 0; s < rounds; s++) {
        int i = inverse ? rounds - 1 - s : s;
        if (i % 2 == 0) {
            round_values(k0, k1, (uint32_t)i, right, f, count);
            for (int j = 0; j < count; j++) left[j] ^= f[j] & lmask;
        } else {
            round_values(k0, k1, (uint32_t)i, left, f, count);
            for (int j = 0; j < count; j++) right[j] ^= f[j] & rmask;
        }
    }
    for (int j = 0; j < count; j++) x[j] = ((uint64_t)left[j] << rb) | right[j];
}

typedef struct {
    uint32_t k0, k1;
    int lb, rb, inverse;
    uint64_t n;
    const int64_t *positions; /* NULL: start + step * k */
    int64_t start, step;
    int64_t *out;
    int64_t begin, end;
} job_t;

static void *run_job(void *arg)
{
    job_t *job = (job_t *)arg;
    uint64_t x[CHUNK], walk[CHUNK];
    int where[CHUNK];
    for (int64_t base = job->begin; base < job->end; base += CHUNK) {
        int count = (int)((job->end - base) < CHUNK ? (job->end - base) : CHUNK);
        for (int j = 0; j < count; j++)
            x[j] = job->positions ? (uint64_t)job->positions[base + j]
                                  : (uint64_t)(job->start + job->step * (base + j));
        feistel(job->k0, job->k1, job->lb, job->rb, job->inverse, x, count);
        int pending = 0;
        for (int j = 0; j < count; j++)
            if (x[j] >= job->n) {
                where[pending] = j;
                walk[pending++] = x[j];
            }
        while (pending) {
            feistel(job->k0, job->k1, job->lb, job->rb, job->inverse, walk, pending);
            int still = 0;
            for (int m = 0; m < pending; m++) {
                if (walk[m] >= job->n) {
                    where[still] = where[m];
                    walk[still++] = walk[m];
                } else {
                    x[where[m]] = walk[m];
                }
            }
            pending = still;
        }
        for (int j = 0; j < count; j++) job->out[base + j] = (int64_t)x[j];
    }
    return NULL;
}

/*
 * out[k] = perm(p_k) (inverse = 0) or perm^-1(p_k) (inverse = 1) for k < count, where
 * p_k = positions[k] if positions is not NULL, else start + step * k. Every p_k must be
 * in [0, n), 2 <= n <= 2**62 (checked by the caller). Returns 0.
 */
int keyinit_permute(uint32_t k0, uint32_t k1, uint64_t n, int inverse, const int64_t *positions, int64_t start,
                    int64_t step, int64_t count, int64_t *out, int threads)
{
    int b = 64 - __builtin_clzll(n - 1);
    int rb = b / 2, lb = b - rb;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (count < (int64_t)threads * 4096) threads = (int)(count / 4096) > 0 ? (int)(count / 4096) : 1;
    job_t jobs[64];
    pthread_t ids[64];
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        job_t job = {k0, k1, lb, rb, inverse, n, positions, start, step, out,
                     count * t / threads, count * (t + 1) / threads};
        jobs[t] = job;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_job(&jobs[t]);
    }
    return 0;
}
