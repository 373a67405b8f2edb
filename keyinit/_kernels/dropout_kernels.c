/*
 * keyinit keyed dropout, CPU: the keep-mask and its application in one pass.
 *
 * Built on first use by keyinit/_kernels/_dropout_cpu.py through _build.py, with
 * the same flags as the init kernel (-O3 -std=c11 -ffp-contract=off ... and
 * -march=native where accepted). Never -ffast-math.
 *
 * Contract (docs/spec.md, "Keyed dropout"): element q of the contiguous input
 * (row-major over size[0..ndim-1]) sits at position (p_0, ..., p_{ndim-1}) and has
 * global flat index
 *
 *     g = base + sum_d gstride[d] * idx_d(p_d),
 *     idx_d(p) = index[d][p] if index[d] != NULL, else start[d] + p.
 *
 * It is kept iff word(K, g) < threshold, with word(K, j) lane j % 4 of
 * Philox4x32-10((lo32(j/4), hi32(j/4), 0, 0), K) (philox.h). That is
 * keyinit.random.bernoulli(K, ..., p = 1 - p_drop)'s mask. The output is
 *
 *     float32:          kept ? x * s32 : +0
 *     float64:          kept ? x * s64 : +0
 *     bfloat16/float16: kept ? round_to_dtype(f32(x) * s32) : +0   (binary32 product, then RNE)
 *
 * with s64 = 1 / (1 - p) and s32 = f32(s64); backward is the same map applied
 * to the gradient. Where a tile's global indices are consecutive, each Philox
 * block serves four elements and the words are made eight blocks per AVX2
 * vector; elsewhere one block per element. Values never depend on the thread
 * count, the tiling or the vector width.
 */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "philox.h"

#define KD_API __attribute__((visibility("default")))
#define KD_MAX_DIMS 64
#define KD_TILE 1024
#define KD_CHUNK 65536

/* dtype ids (keep in sync with _dropout_cpu.py) */
enum { KD_F32 = 0, KD_F64 = 1, KD_BF16 = 2, KD_F16 = 3 };

static inline uint32_t kd_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kd_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* bfloat16 -> binary32: exact. */
static inline float kd_bf16_to_f32(uint16_t h) { return kd_float((uint32_t)h << 16); }

/* binary32 -> bfloat16, round to nearest even (torch's rule; NaN -> 0x7FC0). */
static inline uint16_t kd_f32_to_bf16(float f)
{
    uint32_t u = kd_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

/* float16 -> binary32: exact (subnormals are m * 2^-24, exact in binary32). */
static inline float kd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    uint32_t special = sign | 0x7F800000u | (mantissa << 13);
    float sub = (float)mantissa * 0x1p-24f;
    uint32_t subnormal = sign | kd_bits(sub);
    uint32_t out = exponent == 0x1Fu ? special : (exponent == 0 ? subnormal : normal);
    return kd_float(out);
}

/* binary32 -> float16, round to nearest even; overflow to infinity; NaN -> sign | 0x7E00.
 * Every case is computed and one is selected (no branches, so the loops vectorize). */
static inline uint16_t kd_f32_to_f16(float f)
{
    uint32_t u = kd_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    /* normal half (2^-14 <= |f| < 65520): drop 13 mantissa bits with RNE, rebias the exponent 127 -> 15 */
    uint32_t normal = (a + 0x0FFFu + ((a >> 13) & 1u) - 0x38000000u) >> 13;
    /* subnormal half (|f| < 2^-14): round(|f| * 2^24), ties to even, read off the bits of 2^23 + |f| * 2^24
     * (the scaling is exact; the addition rounds to an integer); 1024 is the smallest normal, 0x0400 */
    uint32_t subnormal = kd_bits(kd_float(a) * 0x1p24f + 0x1p23f) - 0x4B000000u;
    uint32_t out = a >= 0x38800000u ? normal : subnormal;
    out = a >= 0x477FF000u ? 0x7C00u : out; /* >= 65520 (and inf) rounds to infinity */
    out = a > 0x7F800000u ? 0x7E00u : out;  /* NaN */
    return (uint16_t)(sign | out);
}

typedef struct {
    int dtype;
    uint32_t k0, k1;
    int drop_all;  /* threshold == 0 */
    uint32_t thm1; /* threshold - 1: kept iff word <= thm1 */
    float s32;
    double s64;
    const char *in;
    char *out;
    int ndim;
    int64_t base;
    const int64_t *size, *gstride, *start;
    const int64_t *const *index;
    int64_t numel, nchunks;
    int64_t next_chunk __attribute__((aligned(64)));
} kd_plan_t;

static inline int64_t kd_index(const kd_plan_t *P, int d, int64_t p)
{
    return P->index[d] != NULL ? P->index[d][p] : P->start[d] + p;
}

/* Elements q .. q+m-1 with stream words w[0..m-1]. */
static void kd_apply(const kd_plan_t *P, const uint32_t *restrict w, int64_t q, int64_t m)
{
    const uint32_t thm1 = P->thm1;
    switch (P->dtype) {
    case KD_F32: {
        const float *restrict x = (const float *)P->in + q;
        float *restrict y = (float *)P->out + q;
        const float s = P->s32;
        if (P->drop_all) {
            for (int64_t k = 0; k < m; k++) y[k] = 0.0f;
        } else {
            for (int64_t k = 0; k < m; k++) {
                float v = x[k] * s;
                y[k] = w[k] <= thm1 ? v : 0.0f;
            }
        }
        break;
    }
    case KD_F64: {
        const double *restrict x = (const double *)P->in + q;
        double *restrict y = (double *)P->out + q;
        const double s = P->s64;
        if (P->drop_all) {
            for (int64_t k = 0; k < m; k++) y[k] = 0.0;
        } else {
            for (int64_t k = 0; k < m; k++) {
                double v = x[k] * s;
                y[k] = w[k] <= thm1 ? v : 0.0;
            }
        }
        break;
    }
    case KD_BF16: {
        const uint16_t *restrict x = (const uint16_t *)P->in + q;
        uint16_t *restrict y = (uint16_t *)P->out + q;
        const float s = P->s32;
        if (P->drop_all) {
            for (int64_t k = 0; k < m; k++) y[k] = 0;
        } else {
            for (int64_t k = 0; k < m; k++) {
                uint16_t v = kd_f32_to_bf16(kd_bf16_to_f32(x[k]) * s);
                y[k] = w[k] <= thm1 ? v : (uint16_t)0;
            }
        }
        break;
    }
    case KD_F16: {
        const uint16_t *restrict x = (const uint16_t *)P->in + q;
        uint16_t *restrict y = (uint16_t *)P->out + q;
        const float s = P->s32;
        if (P->drop_all) {
            for (int64_t k = 0; k < m; k++) y[k] = 0;
        } else {
            for (int64_t k = 0; k < m; k++) {
                uint16_t v = kd_f32_to_f16(kd_f16_to_f32(x[k]) * s);
                y[k] = w[k] <= thm1 ? v : (uint16_t)0;
            }
        }
        break;
    }
    }
}

/* Elements q = qs .. qe-1 (row-major positions of the input). */
static void kd_chunk(const kd_plan_t *P, int64_t qs, int64_t qe)
{
    const int last = P->ndim - 1;
    const int64_t inner = P->size[last];
    const int run = P->index[last] == NULL && P->gstride[last] == 1;
    int64_t pos[KD_MAX_DIMS];
    int64_t rest = qs;
    for (int d = last; d >= 0; d--) {
        pos[d] = rest % P->size[d];
        rest /= P->size[d];
    }
    uint32_t words[KD_TILE + 8];
    int64_t q = qs;
    while (q < qe) {
        int64_t gouter = P->base;
        for (int d = 0; d < last; d++) gouter += kd_index(P, d, pos[d]) * P->gstride[d];
        const int64_t p0 = pos[last];
        const int64_t count = inner - p0 < qe - q ? inner - p0 : qe - q;
        for (int64_t t = 0; t < count; t += KD_TILE) {
            const int64_t m = count - t < KD_TILE ? count - t : KD_TILE;
            if (run) {
                /* consecutive global indices j0 .. j0+m-1: blocks j0/4 .. (j0+m-1)/4 */
                const uint64_t j0 = (uint64_t)(gouter + P->start[last] + p0 + t);
                const uint64_t b0 = j0 >> 2, b1 = (j0 + (uint64_t)m + 3u) >> 2;
                ki_philox_stream(b0, (int64_t)(b1 - b0), P->k0, P->k1, words);
                kd_apply(P, words + (j0 & 3u), q + t, m);
            } else {
                const int64_t gs = P->gstride[last];
                for (int64_t k = 0; k < m; k++) {
                    uint64_t g = (uint64_t)(gouter + kd_index(P, last, p0 + t + k) * gs);
                    words[k] = ki_philox_word(g, P->k0, P->k1);
                }
                kd_apply(P, words, q + t, m);
            }
        }
        q += count;
        pos[last] += count;
        for (int d = last; d > 0 && pos[d] == P->size[d]; d--) {
            pos[d] = 0;
            pos[d - 1] += 1;
        }
    }
}

static void *kd_worker(void *arg)
{
    kd_plan_t *P = (kd_plan_t *)arg;
    for (;;) {
        int64_t c = __atomic_fetch_add(&P->next_chunk, 1, __ATOMIC_RELAXED);
        if (c >= P->nchunks) break;
        int64_t qs = c * KD_CHUNK;
        int64_t qe = qs + KD_CHUNK < P->numel ? qs + KD_CHUNK : P->numel;
        kd_chunk(P, qs, qe);
    }
    return NULL;
}

/*
 * Dropout of the contiguous tensor `in` into the contiguous tensor `out` (same
 * shape size[0..ndim-1], same dtype; out may equal in). threshold is in
 * [0, 2**32]. Returns 0, or a negative number for invalid arguments.
 */
KD_API int keyinit_dropout(int dtype, uint32_t k0, uint32_t k1, int64_t threshold, float s32, double s64,
                           const void *in, void *out, int ndim, int64_t base, const int64_t *size,
                           const int64_t *gstride, const int64_t *start, const int64_t *const *index,
                           int nthreads)
{
    if (ndim < 1 || ndim > KD_MAX_DIMS) return -1;
    if (dtype < KD_F32 || dtype > KD_F16) return -2;
    if (threshold < 0 || threshold > ((int64_t)1 << 32)) return -3;
    static kd_plan_t zero_plan;
    kd_plan_t P = zero_plan;
    P.dtype = dtype;
    P.k0 = k0;
    P.k1 = k1;
    P.drop_all = threshold == 0;
    P.thm1 = threshold == 0 ? 0u : (uint32_t)(threshold - 1);
    P.s32 = s32;
    P.s64 = s64;
    P.in = (const char *)in;
    P.out = (char *)out;
    P.ndim = ndim;
    P.base = base;
    P.size = size;
    P.gstride = gstride;
    P.start = start;
    P.index = index;
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (size[d] < 0) return -4;
        numel *= size[d];
    }
    if (numel == 0) return 0;
    P.numel = numel;
    P.nchunks = (numel + KD_CHUNK - 1) / KD_CHUNK;
    P.next_chunk = 0;
    if (nthreads > P.nchunks) nthreads = (int)P.nchunks;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 256) nthreads = 256;
    pthread_t threads[256];
    int started = 0;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&threads[started], NULL, kd_worker, &P) != 0) break;
        started++;
    }
    kd_worker(&P);
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
    return 0;
}

/* For the tests: Philox blocks first .. first+n-1 through ki_philox_stream (out: 4n words). */
KD_API void keyinit_dropout_philox_stream(uint64_t first, int64_t n, uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_philox_stream(first, n, k0, k1, out);
}

/* For the tests: the float16 conversions, element-wise. */
KD_API void keyinit_dropout_f16_roundtrip(const float *src, int64_t n, uint16_t *half, float *back)
{
    for (int64_t i = 0; i < n; i++) {
        half[i] = kd_f32_to_f16(src[i]);
        back[i] = kd_f16_to_f32(half[i]);
    }
}
