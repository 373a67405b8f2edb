/*
 * keyinit keyed dropout, CPU: the keep-mask and its application in one pass.
 *
 * Built on first use by keyinit/_kernels/dropout/cpu.py through common/build.py, with
 * the same flags as the init kernel (-O3 -std=c11 -ffp-contract=off ... and
 * -march=native where accepted). Never -ffast-math.
 *
 * Contract (docs/spec.md, "Keyed dropout"): element q of the contiguous input
 * (row-major over size[0..ndim-1]) sits at position (p_0, ..., p_{ndim-1}) and has
 * global flat index and high counter words
 *
 *     g = base + sum_d gstride[d] * idx_d(p_d),
 *     h = hbase + sum_d hstride[d] * idx_d(p_d)     (0 without hstride),
 *     idx_d(p) = index[d][p] if index[d] != NULL, else p
 *
 * (keyinit._draw.geometry.coalesce: every range's start is folded into base).
 *
 * It is kept iff word(K, g, h) < threshold, with word(K, j, h) lane j % 4 of
 * Philox4x32-10((lo32(j/4), hi32(j/4), lo32(h), hi32(h)), K) (philox.h): h is 0 for
 * the element stream of docs/spec.md section 4, and carries a keyed forward's sample
 * and third coordinate in its extent-free names (section 14.8). With h = 0 that is
 * keyinit.random.bernoulli(K, ..., p = 1 - p_drop)'s mask. The output is
 *
 *     float32:          kept ? x * s32 : +0
 *     float64:          kept ? x * s64 : +0
 *     bfloat16/float16: kept ? round_to_dtype(f32(x) * s32) : +0   (binary32 product, then RNE)
 *
 * with s64 = 1 / (1 - p) and s32 = f32(s64) (the conversions of convert.h);
 * backward is the same map applied to the gradient. Where a tile's global
 * indices are consecutive, each Philox block serves four elements and the
 * words come from philox.h's vector path (ki_philox_stream); elsewhere one
 * block per element. Chunks run on parallel.h's pool. Values never depend on
 * the thread count, the tiling or the vector width.
 */

#include <stdint.h>

#include "../common/convert.h"
#include "../common/ids.h"
#include "../common/parallel.h"
#include "../common/philox.h"

#define KD_API __attribute__((visibility("default")))
#define KD_MAX_DIMS 64
#define KD_TILE 1024
#define KD_CHUNK 65536

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
    uint64_t hbase;
    const int64_t *size, *gstride, *hstride; /* hstride: NULL for h = 0 */
    const int64_t *const *index;
    int64_t numel;
} kd_plan_t;

static inline int64_t kd_index(const kd_plan_t *P, int d, int64_t p)
{
    return P->index[d] != NULL ? P->index[d][p] : p;
}

/* y[k] = kept ? (EXPR) : 0 for the m elements from q, of type T (EXPR: x[k] scaled, in T). */
#define KD_APPLY_LOOP(T, EXPR)                                                   \
    do {                                                                         \
        const T *restrict x = (const T *)P->in + q;                              \
        T *restrict y = (T *)P->out + q;                                         \
        if (P->drop_all) {                                                       \
            for (int64_t k = 0; k < m; k++) y[k] = (T)0;                         \
        } else {                                                                 \
            for (int64_t k = 0; k < m; k++) {                                    \
                T v = (EXPR);                                                    \
                y[k] = w[k] <= thm1 ? v : (T)0;                                  \
            }                                                                    \
        }                                                                        \
    } while (0)

/* Elements q .. q+m-1 with stream words w[0..m-1]. */
static void kd_apply(const kd_plan_t *P, const uint32_t *restrict w, int64_t q, int64_t m)
{
    const uint32_t thm1 = P->thm1;
    switch (P->dtype) {
    case KI_DTYPE_FLOAT32: {
        const float s = P->s32;
        KD_APPLY_LOOP(float, x[k] * s);
        break;
    }
    case KI_DTYPE_FLOAT64: {
        const double s = P->s64;
        KD_APPLY_LOOP(double, x[k] * s);
        break;
    }
    case KI_DTYPE_BFLOAT16: {
        const float s = P->s32;
        KD_APPLY_LOOP(uint16_t, ki_f32_to_bf16(ki_bf16_to_f32(x[k]) * s));
        break;
    }
    case KI_DTYPE_FLOAT16: {
        const float s = P->s32;
        KD_APPLY_LOOP(uint16_t, ki_f32_to_f16(ki_f16_to_f32(x[k]) * s));
        break;
    }
    }
}

/* Rows of consecutive global indices shorter than KD_SHORT_ROW elements (a keyed forward's rows of 40,
 * 64 or 128 under stream v2's names, docs/spec.md 14.8, where v1's whole tensor is one run) are packed
 * into whole vector passes of philox.h: each row takes its blocks in runs of KI_LANES, one vector group
 * each (ki_philox_simd_runs), up to KD_SHORT_GROUPS groups and KD_SHORT_SEGMENTS rows at a time, in
 * place of one short pass per row. Without a vector Philox (KI_SIMD), rows are runs as any other. */
#ifdef KI_SIMD
#define KD_SHORT_ROW 256
#define KD_SHORT_GROUPS (4 * KI_GROUPS)
#define KD_SHORT_SEGMENTS 64

typedef struct {
    uint64_t first[KD_SHORT_GROUPS], high[KD_SHORT_GROUPS]; /* group g: blocks first[g] .. + KI_LANES - 1 */
    int64_t q[KD_SHORT_SEGMENTS], m[KD_SHORT_SEGMENTS], at[KD_SHORT_SEGMENTS]; /* at: the row's first word */
    int64_t ngroups, nsegments;
} kd_short_t;

static void kd_short_flush(const kd_plan_t *P, kd_short_t *S)
{
    uint32_t lanes[4 * KI_LANES * KD_SHORT_GROUPS];
    for (int64_t g = S->ngroups; g % KI_GROUPS; g++) { /* a last pass's spare groups: computed, unused */
        S->first[g] = S->first[0];
        S->high[g] = S->high[0];
    }
    for (int64_t g = 0; g < S->ngroups; g += KI_GROUPS)
        ki_philox_simd_runs(S->first + g, S->high + g, P->k0, P->k1, lanes + 4 * KI_LANES * g);
    for (int64_t s = 0; s < S->nsegments; s++) kd_apply(P, lanes + S->at[s], S->q[s], S->m[s]);
    S->ngroups = S->nsegments = 0;
}

/* Elements q .. q+m-1 (m < KD_SHORT_ROW) with consecutive global indices from j0 and high words h. */
static void kd_short_add(const kd_plan_t *P, kd_short_t *S, uint64_t j0, uint64_t h, int64_t q, int64_t m)
{
    const uint64_t b0 = j0 >> 2, b1 = (j0 + (uint64_t)m + 3u) >> 2;
    const int64_t groups = (int64_t)((b1 - b0 + KI_LANES - 1) / KI_LANES);
    if (S->ngroups + groups > KD_SHORT_GROUPS || S->nsegments == KD_SHORT_SEGMENTS) kd_short_flush(P, S);
    const int64_t at = 4 * KI_LANES * S->ngroups + (int64_t)(j0 & 3u), last = S->nsegments - 1;
    if (last >= 0 && S->q[last] + S->m[last] == q && S->at[last] + S->m[last] == at) {
        S->m[last] += m; /* rows of whole groups: one segment, one kd_apply */
    } else {
        S->q[S->nsegments] = q;
        S->m[S->nsegments] = m;
        S->at[S->nsegments++] = at;
    }
    for (int64_t g = 0; g < groups; g++) {
        S->first[S->ngroups] = b0 + (uint64_t)(g * KI_LANES);
        S->high[S->ngroups++] = h;
    }
}
#else
#define KD_SHORT_ROW 0
#endif

/* Elements q = qs .. qe-1 (row-major positions of the input). */
static void kd_chunk(const kd_plan_t *P, int64_t qs, int64_t qe)
{
    const int last = P->ndim - 1;
    const int64_t inner = P->size[last];
    const int run = P->index[last] == NULL && P->gstride[last] == 1 && (P->hstride == NULL || P->hstride[last] == 0);
    int64_t pos[KD_MAX_DIMS];
    int64_t rest = qs;
    for (int d = last; d >= 0; d--) {
        pos[d] = rest % P->size[d];
        rest /= P->size[d];
    }
    uint32_t words[KD_TILE + 8];
    const int short_rows = run && inner < KD_SHORT_ROW;
#ifdef KI_SIMD
    kd_short_t S;
    S.ngroups = S.nsegments = 0;
#endif
    int64_t q = qs;
    /* the outer dims' part of the indices: computed once, then advanced with the carries where no outer
     * dim has an index vector (each row's own sums otherwise) */
    int stepped = 1;
    for (int d = 0; d < last; d++) stepped &= P->index[d] == NULL;
    int64_t gouter = 0;
    uint64_t houter = 0;
    int fresh = 1;
    while (q < qe) {
        if (fresh) {
            gouter = P->base;
            houter = P->hbase;
            for (int d = 0; d < last; d++) gouter += kd_index(P, d, pos[d]) * P->gstride[d];
            if (P->hstride != NULL)
                for (int d = 0; d < last; d++) houter += (uint64_t)(kd_index(P, d, pos[d]) * P->hstride[d]);
            fresh = !stepped;
        }
        const int64_t p0 = pos[last];
        const int64_t count = inner - p0 < qe - q ? inner - p0 : qe - q;
#ifdef KI_SIMD
        if (short_rows) kd_short_add(P, &S, (uint64_t)(gouter + p0), houter, q, count);
#endif
        for (int64_t t = 0; t < count && !short_rows; t += KD_TILE) {
            const int64_t m = count - t < KD_TILE ? count - t : KD_TILE;
            if (run) {
                /* consecutive global indices j0 .. j0+m-1: blocks j0/4 .. (j0+m-1)/4 */
                const uint64_t j0 = (uint64_t)(gouter + p0 + t);
                const uint64_t b0 = j0 >> 2, b1 = (j0 + (uint64_t)m + 3u) >> 2;
                ki_philox_stream_hi(b0, (int64_t)(b1 - b0), houter, P->k0, P->k1, words);
                kd_apply(P, words + (j0 & 3u), q + t, m);
            } else {
                const int64_t gs = P->gstride[last];
                const int64_t hs = P->hstride != NULL ? P->hstride[last] : 0;
                for (int64_t k = 0; k < m; k++) {
                    const int64_t idx = kd_index(P, last, p0 + t + k);
                    uint64_t g = (uint64_t)(gouter + idx * gs);
                    words[k] = ki_philox_word_hi(g, houter + (uint64_t)(idx * hs), P->k0, P->k1);
                }
                kd_apply(P, words, q + t, m);
            }
        }
        q += count;
        pos[last] += count;
        for (int d = last; d > 0 && pos[d] == P->size[d]; d--) {
            pos[d] = 0;
            pos[d - 1] += 1;
            if (stepped) { /* dim d back to 0 (the innermost is not in gouter), dim d - 1 one on */
                /* (modulo 2**64: the sums stay in range, a product alone may not) */
                uint64_t g = (uint64_t)gouter;
                if (d < last) {
                    g -= (uint64_t)P->size[d] * (uint64_t)P->gstride[d];
                    if (P->hstride != NULL) houter -= (uint64_t)P->size[d] * (uint64_t)P->hstride[d];
                }
                gouter = (int64_t)(g + (uint64_t)P->gstride[d - 1]);
                if (P->hstride != NULL) houter += (uint64_t)P->hstride[d - 1];
            }
        }
    }
#ifdef KI_SIMD
    if (S.nsegments) kd_short_flush(P, &S);
#endif
}

/* Chunk c: elements c*KD_CHUNK .. (c+1)*KD_CHUNK - 1 (ki_parallel_for's body). */
static void kd_chunk_body(void *ctx, int64_t c)
{
    const kd_plan_t *P = (const kd_plan_t *)ctx;
    int64_t qs = c * KD_CHUNK;
    int64_t qe = qs + KD_CHUNK < P->numel ? qs + KD_CHUNK : P->numel;
    kd_chunk(P, qs, qe);
}

/*
 * Dropout of the contiguous tensor `in` into the contiguous tensor `out` (same
 * shape size[0..ndim-1], same dtype; out may equal in). threshold is in
 * [0, 2**32]. Returns 0, or a negative number for invalid arguments.
 */
KD_API int keyinit_dropout(int dtype, uint32_t k0, uint32_t k1, int64_t threshold, float s32, double s64,
                           const void *in, void *out, int ndim, int64_t base, const int64_t *size,
                           const int64_t *gstride, const int64_t *const *index,
                           int nthreads, uint64_t hbase, const int64_t *hstride)
{
    if (ndim < 1 || ndim > KD_MAX_DIMS) return -1;
    if (dtype != KI_DTYPE_FLOAT32 && dtype != KI_DTYPE_FLOAT64 && dtype != KI_DTYPE_BFLOAT16 &&
        dtype != KI_DTYPE_FLOAT16)
        return -2;
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
    P.hbase = hbase;
    P.size = size;
    P.gstride = gstride;
    P.hstride = hstride;
    P.index = index;
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (size[d] < 0) return -4;
        numel *= size[d];
    }
    if (numel == 0) return 0;
    P.numel = numel;
    /* the caller's floating-point modes are left as they are (clear_fp = 0), as for torch's own dropout */
    ki_parallel_for((numel + KD_CHUNK - 1) / KD_CHUNK, nthreads, 0, kd_chunk_body, &P);
    return 0;
}

/* For the tests: Philox blocks first .. first+n-1 through ki_philox_stream (out: 4n words). */
KD_API void keyinit_dropout_philox_stream(uint64_t first, int64_t n, uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_philox_stream(first, n, k0, k1, out);
}

/* For the tests: the float16 conversions of convert.h, element-wise. */
KD_API void keyinit_dropout_f16_roundtrip(const float *src, int64_t n, uint16_t *half, float *back)
{
    for (int64_t i = 0; i < n; i++) {
        half[i] = ki_f32_to_f16(src[i]);
        back[i] = ki_f16_to_f32(half[i]);
    }
}
