/*
 * keyinit compiled CPU kernel: stream v1, bit-identical to keyinit._draw.reference_fill.fill.
 *
 * Built on first use by keyinit/_kernels/common/build.py with
 *     cc -O3 -std=c11 -ffp-contract=off -fno-math-errno -fno-trapping-math -fPIC -shared -pthread
 * plus -march=native where the compiler accepts it. AVX-512 and AVX2 targets get
 * explicit Philox code (philox.h), other targets a portable loop; all give the same integers.
 * The binary32 transforms (log, the normal quantile) are in fp32math.h.
 * Never -ffast-math: every float operation below is the IEEE-754 binary32
 * operation the reference performs, in the same order, with no fused
 * multiply-add and no flush-to-zero. The only math function is sqrt
 * (__builtin_sqrtf), which IEEE-754 requires to be correctly rounded; with
 * -fno-math-errno it is the sqrtss / vsqrtps instruction. The caller's
 * flush-to-zero / denormals-are-zero modes cannot change a value either: every
 * thread clears them while it computes (x86). keyinit_fp_probe lets the loader
 * refuse a build whose flags (e.g. added by a $CC wrapper) broke any of this.
 *
 * Addressing (see keyinit_fill): element (p_0, ..., p_{d-1}) of the destination
 * has global flat index  g = base + sum_k idx_k(p_k) * gstride[k]  and sits at
 * element offset  sum_k p_k * ostride[k]  from out, where idx_k(p) = index[k][p]
 * for an index-list dim and idx_k(p) = p for a slice dim (index[k] == NULL: its
 * start is folded into base and its step into gstride; no index vector exists).
 * It consumes stream words w*g .. w*g + w - 1 (w = 2 for randint, else 1); word
 * j is lane j % 4 of Philox4x32-10((lo32(j/4), hi32(j/4), 0, 0), (k0, k1)).
 *
 * Where a row's global indices are consecutive (a unit-step innermost slice, or
 * a tile of an index list that happens to be consecutive), the row is a run:
 * each Philox block is computed once and all of its words are used, 4/w
 * elements per block, whatever the run's start and length. Elsewhere (strided
 * and listed dims) each element gets its own block through the same SIMD
 * Philox and keeps its lane(s). Positions advance by carries; the only integer
 * divisions are one decomposition per chunk.
 *
 * Work is split into chunks of CHUNK region elements taken by threads from an
 * atomic counter, and each chunk into tiles of at most TILE elements held in
 * fixed-size stack buffers, so the workspace is bounded and the values never
 * depend on the thread count, the chunking or the vector width: each one is a
 * pure function of its global index.
 */

#include <stdint.h>
#include <string.h>

#include "../common/convert.h"
#include "../common/ids.h"
#include "../common/parallel.h"
#include "../common/philox.h"

#define KI_MAX_DIMS 64
#define TILE 512
#define CHUNK 32768

#define KI_API __attribute__((visibility("default")))

#include "fp32math.h"
#include "keys.h"

/* Exported for the tests: Philox blocks first .. first+n-1 through the path the fills use. */
KI_API void keyinit_philox_range(uint64_t first, int64_t n, uint32_t k0, uint32_t k1, uint32_t *out)
{
    ki_philox_stream(first, n, k0, k1, out);
}

/* Words of elements with arbitrary global indices g[0..m-1] (m <= TILE) and high
 * counter words h[0..m-1] (h == NULL: all h0): element k gets words[w*k .. w*k + w - 1]
 * (w is 1 or 2; an element's words lie in one block). The blocks go through the same
 * SIMD Philox as runs, each block once where neighbouring elements share it (short
 * rows gathered into one tile: a keyed collate's (batch, length) draws), else one
 * per element. */
static void words_gather(const int64_t *restrict g, const uint64_t *restrict h, uint64_t h0, int64_t m, int w,
                         uint32_t k0, uint32_t k1, uint32_t *restrict words)
{
    uint64_t blocks[TILE], highs[TILE];
    int32_t slot[TILE]; /* element k's block is blocks[slot[k]] */
    uint32_t lanes[4 * TILE];
    const unsigned shift = w == 1 ? 2u : 1u; /* block of element i: (w*i) >> 2 */
    int64_t n = 0;
    for (int64_t k = 0; k < m; k++) {
        const uint64_t b = (uint64_t)g[k] >> shift, hk = h != NULL ? h[k] : h0;
        if (n == 0 || blocks[n - 1] != b || highs[n - 1] != hk) {
            blocks[n] = b;
            highs[n++] = hk;
        }
        slot[k] = (int32_t)(n - 1);
    }
    ki_philox_list_hi(blocks, highs, n, k0, k1, lanes);
    if (w == 1) {
        for (int64_t k = 0; k < m; k++) words[k] = lanes[4 * slot[k] + ((uint64_t)g[k] & 3u)];
    } else {
        for (int64_t k = 0; k < m; k++) {
            const uint32_t *b = lanes + 4 * slot[k] + 2 * ((uint64_t)g[k] & 1u);
            words[2 * k] = b[0];
            words[2 * k + 1] = b[1];
        }
    }
}

/* ---------------------------------------------------- binary32 transforms (fp32math.h) */

KI_API int keyinit_constants(float *dst, int capacity)
{
    int n = (int)(sizeof(ki_constants) / sizeof(ki_constants[0]));
    for (int i = 0; i < n && i < capacity; i++) dst[i] = ki_constants[i];
    return n;
}

/* Exported for the tests: ndtri_tail_batch over any number of tails. */
KI_API void keyinit_ndtri_tail(const float *tail, int64_t n, float *mag);

/* ------------------------------------------------------------------ plan */

#include "plan.h"

static int elsize_of(int dtype)
{
    switch (dtype) {
    case KI_DTYPE_FLOAT64: case KI_DTYPE_INT64: return 8;
    case KI_DTYPE_FLOAT32: case KI_DTYPE_INT32: return 4;
    case KI_DTYPE_BFLOAT16: case KI_DTYPE_FLOAT16: case KI_DTYPE_INT16: return 2;
    default: return 1;
    }
}

/* Values of one tile. */
typedef union {
    float f[TILE];
    int64_t i[TILE];
    uint8_t u[TILE];
} values_t;

/* ----------------------------------------------------- transform a tile */

static void transform_float(const plan_t *P, const uint32_t *wp, int64_t m, float *v)
{
    float tail[TILE] = {0}, mag[TILE];
    switch (P->dist) {
    case KI_DIST_UNIFORM: {
        const float low = P->a, span = P->b;
        for (int64_t k = 0; k < m; k++) {
            float u = (float)(wp[k] >> 8) * 0x1p-24f;
            v[k] = low + span * u;
        }
        break;
    }
    case KI_DIST_NORMAL: {
        const float mean = P->a, std = P->b;
        for (int64_t k = 0; k < m; k++) tail[k] = (float)(wp[k] | 1u) * 0x1p-33f;
        ndtri_tail_batch(tail, m, mag);
        for (int64_t k = 0; k < m; k++) {
            float z = (wp[k] & 1u) ? -mag[k] : mag[k];
            v[k] = mean + std * z;
        }
        break;
    }
    case KI_DIST_TRUNCATED_NORMAL: {
        const float mean = P->a, std = P->b, p_low = P->p_low, p_span = P->p_span;
        const float lower = P->lower, upper = P->upper;
        const int flip = P->flip;
        float p[TILE];
        for (int64_t k = 0; k < m; k++) {
            float u = (float)(((wp[k] >> 9) << 1) | 1u) * 0x1p-24f;
            p[k] = p_low + u * p_span;
            tail[k] = p[k] < 0.5f ? p[k] : 1.0f - p[k];
        }
        ndtri_tail_batch(tail, m, mag);
        for (int64_t k = 0; k < m; k++) {
            float z = p[k] < 0.5f ? -mag[k] : mag[k];
            z = flip ? -z : z;
            float y = mean + std * z;
            y = y < lower ? lower : y;
            y = y > upper ? upper : y;
            v[k] = y;
        }
        break;
    }
    }
}

static void transform_tile(const plan_t *P, const uint32_t *wp, int64_t m, values_t *v)
{
    switch (P->dist) {
    case KI_DIST_BITS:
        for (int64_t k = 0; k < m; k++) v->i[k] = (int64_t)wp[k];
        break;
    case KI_DIST_BERNOULLI: {
        const uint64_t th = P->threshold;
        for (int64_t k = 0; k < m; k++) v->u[k] = (uint64_t)wp[k] < th;
        break;
    }
    case KI_DIST_RANDINT: {
        const uint64_t n = P->span;
        const int64_t low = P->low;
        for (int64_t k = 0; k < m; k++) {
            uint64_t carry = ((uint64_t)wp[2 * k] * n) >> 32;
            uint64_t hi = ((uint64_t)wp[2 * k + 1] * n + carry) >> 32;
            v->i[k] = low + (int64_t)hi;
        }
        break;
    }
    default:
        transform_float(P, wp, m, v->f);
    }
}

/* ---------------------------------------------------------- store a tile (store.h) */

#include "store.h"
#include "sround.h"
#include "sround_adam.h"

/* ---------------------------------------------------------------- a tile */

/* m elements (m <= TILE). Global indices: g0 .. g0+m-1 if g == NULL, else
 * g[0..m-1]; high counter words h[0..m-1], or h0 for all if h == NULL (a run
 * has one h0). Destination offsets: o[k] if o != NULL, else o0 + k*os. */
static void finish_tile(const plan_t *P, const uint32_t *wp, const int64_t *o, int64_t o0, int64_t os, int64_t m);

static void do_tile(const plan_t *P, const int64_t *g, int64_t g0, const uint64_t *h, uint64_t h0,
                    const int64_t *o, int64_t o0, int64_t os, int64_t m)
{
    const int w = P->w;
    uint32_t words[2 * TILE + 16];
    const uint32_t *wp;
    if (g == NULL) {
        /* A run: global indices g0 .. g0+m-1 use words w*g0 .. w*(g0+m)-1, so each
         * Philox block is computed once and all of its words are used. */
        uint64_t j0 = (uint64_t)g0 * (uint64_t)w;
        uint64_t j1 = j0 + (uint64_t)(m * w); /* exclusive */
        uint64_t b0 = j0 >> 2, b1 = (j1 + 3) >> 2;
        ki_philox_stream_hi(b0, (int64_t)(b1 - b0), h0, P->k0, P->k1, words);
        wp = words + (j0 & 3u);
    } else {
        words_gather(g, h, h0, m, w, P->k0, P->k1, words);
        wp = words;
    }
    finish_tile(P, wp, o, o0, os, m);
}

/* The values of m elements (m <= TILE) of words wp, stored (o, o0, os: as do_tile's). */
static void finish_tile(const plan_t *P, const uint32_t *wp, const int64_t *o, int64_t o0, int64_t os, int64_t m)
{
    if (P->adam != NULL) { adam_tile(P, wp, o, o0, os, m); return; } /* keyinit_sround_adam */
    if (P->src != NULL) { /* keyinit_sround: the words round the source's values */
        sround_tile(P, wp, o, o0, os, m);
        return;
    }
    /* Write straight into the destination when it has the value buffer's type. */
    const int float_values = P->dist == KI_DIST_UNIFORM || P->dist == KI_DIST_NORMAL ||
                             P->dist == KI_DIST_TRUNCATED_NORMAL;
    const int int_values = P->dist == KI_DIST_BITS || P->dist == KI_DIST_RANDINT;
    int direct = o == NULL && os == 1 &&
                 ((float_values && P->dtype == KI_DTYPE_FLOAT32) || (int_values && P->dtype == KI_DTYPE_INT64));
    if (direct) {
        transform_tile(P, wp, m, (values_t *)(P->out + o0 * (int64_t)P->elsize));
        return;
    }
    values_t v;
    transform_tile(P, wp, m, &v);
    store_tile(P, &v, m, o, o0, os);
}

/* Global index of inner position p of a row that starts at gouter. */
static inline int64_t inner_global(const plan_t *P, int64_t gouter, int64_t p)
{
    const int last = P->ndim - 1;
    const int64_t *iv = P->index[last];
    return gouter + (iv != NULL ? iv[p] : p) * P->gstride[last];
}

/* What position p of dimension d adds to the high counter words. */
static inline uint64_t dim_high(const plan_t *P, int d, int64_t p)
{
    if (P->hstride == NULL) return 0u;
    const int64_t *hv = P->hindex != NULL ? P->hindex[d] : NULL;
    if (hv != NULL) return (uint64_t)hv[p];
    const int64_t *iv = P->index[d];
    return (uint64_t)((iv != NULL ? iv[p] : p) * P->hstride[d]);
}

/* The innermost dimension changes the high counter words along a row. */
static inline int inner_high(const plan_t *P)
{
    const int last = P->ndim - 1;
    return P->hstride != NULL && (P->hstride[last] != 0 || (P->hindex != NULL && P->hindex[last] != NULL));
}

/* Elements p0 .. p0+m-1 (m <= TILE) of one row of the innermost dimension; the
 * row's outer dimensions give it gouter and the high words houter. */
static void do_row_tile(const plan_t *P, int64_t gouter, uint64_t houter, int64_t oouter, int64_t p0, int64_t m)
{
    const int last = P->ndim - 1;
    const int64_t *iv = P->index[last];
    const int64_t gs = P->gstride[last], os = P->ostride[last];
    if (inner_high(P)) { /* each element its own high words (a layout with the sample innermost) */
        int64_t g[TILE];
        uint64_t h[TILE];
        for (int64_t k = 0; k < m; k++) {
            g[k] = inner_global(P, gouter, p0 + k);
            h[k] = houter + dim_high(P, last, p0 + k);
        }
        do_tile(P, g, 0, h, 0u, NULL, oouter + p0 * os, os, m);
        return;
    }
    if (iv == NULL) {
        if (gs == 1) { /* a slice with unit step: consecutive global indices */
            do_tile(P, NULL, gouter + p0, NULL, houter, NULL, oouter + p0 * os, os, m);
            return;
        }
        int64_t g[TILE];
        const int64_t g0 = gouter + p0 * gs;
        for (int64_t k = 0; k < m; k++) g[k] = g0 + k * gs;
        do_tile(P, g, 0, NULL, houter, NULL, oouter + p0 * os, os, m);
        return;
    }
    /* An index list: a tile whose indices happen to be consecutive is still a run. */
    const int64_t *ivp = iv + p0;
    int contiguous = gs == 1;
    for (int64_t k = 1; k < m && contiguous; k++) contiguous = ivp[k] == ivp[0] + k;
    if (contiguous) {
        do_tile(P, NULL, gouter + ivp[0], NULL, houter, NULL, oouter + p0 * os, os, m);
        return;
    }
    int64_t g[TILE];
    for (int64_t k = 0; k < m; k++) g[k] = gouter + ivp[k] * gs;
    do_tile(P, g, 0, NULL, houter, NULL, oouter + p0 * os, os, m);
}

/* Rows shorter than this are batched into tiles that span rows (each element's block through
 * words_gather); longer rows are runs, each block computed once. Measured per element on
 * 256 listed rows (keyinit_fill, float32 uniform, one thread): 8 columns 4.5 ns either way,
 * 50 columns 1.9 ns as runs against 3.6 ns batched. */
#define SHORT_ROW 8

/* Region elements start .. stop-1 in row-major order. The position is decomposed
 * once per chunk; after that, rows advance by carries, with no division. */
static void do_chunk(const plan_t *P, int64_t start, int64_t stop)
{
    const int last = P->ndim - 1;
    const int64_t inner = P->size[last];
    int64_t pos[KI_MAX_DIMS];
    int64_t rest = start;
    for (int k = last; k >= 0; k--) {
        pos[k] = rest % P->size[k];
        rest /= P->size[k];
    }
    const int short_rows = inner < SHORT_ROW, row_high = inner_high(P);
    /* Rows of consecutive indices shorter than a tile, contiguous in out (a keyed forward's rows under
     * stream v2's names, docs/spec.md 14.8, where v1's whole draw is one run): packed into whole tiles
     * (pw: words of pm elements whose destination starts at po0), one transform and store per tile. */
    const int w = P->w;
    const int packed = !short_rows && inner < TILE && P->index[last] == NULL && P->gstride[last] == 1 &&
                       !row_high && P->ostride[last] == 1;
    uint32_t pw[2 * TILE + 16];
    int64_t pm = 0, po0 = 0;
    int64_t g[TILE], o[TILE];
    uint64_t h[TILE];
    int64_t fill = 0; /* elements gathered into g/o/h (short rows) */
    int64_t done = start;
    while (done < stop) {
        int64_t gouter = P->base, oouter = 0;
        uint64_t houter = P->hbase;
        for (int d = 0; d < last; d++) {
            const int64_t *iv = P->index[d];
            gouter += (iv != NULL ? iv[pos[d]] : pos[d]) * P->gstride[d];
            oouter += pos[d] * P->ostride[d];
            houter += dim_high(P, d, pos[d]);
        }
        int64_t p0 = pos[last];
        int64_t cnt = inner - p0 < stop - done ? inner - p0 : stop - done;
        if (packed) { /* a whole or partial row, appended to the tile (flushed first if it is full) */
            const int64_t dest = oouter + p0;
            if (pm && (pm + cnt > TILE || dest != po0 + pm)) {
                finish_tile(P, pw, NULL, po0, 1, pm);
                pm = 0;
            }
            if (!pm) po0 = dest;
            const uint64_t j0 = (uint64_t)(gouter + p0) * (uint64_t)w, b0 = j0 >> 2;
            const uint64_t b1 = (j0 + (uint64_t)(cnt * w) + 3u) >> 2;
            if ((j0 & 3u) == 0) { /* whole blocks from the row's start: straight into the tile (past it: slack) */
                ki_philox_stream_hi(b0, (int64_t)(b1 - b0), houter, P->k0, P->k1, pw + pm * w);
            } else {
                uint32_t row[2 * TILE + 16];
                ki_philox_stream_hi(b0, (int64_t)(b1 - b0), houter, P->k0, P->k1, row);
                memcpy(pw + pm * w, row + (j0 & 3u), (size_t)(cnt * w) * sizeof(uint32_t));
            }
            pm += cnt;
        } else if (!short_rows) {
            for (int64_t t = 0; t < cnt; t += TILE)
                do_row_tile(P, gouter, houter, oouter, p0 + t, cnt - t < TILE ? cnt - t : TILE);
        } else {
            const int64_t os = P->ostride[last];
            for (int64_t j = 0; j < cnt; j++) {
                g[fill] = inner_global(P, gouter, p0 + j);
                h[fill] = houter + (row_high ? dim_high(P, last, p0 + j) : 0u);
                o[fill] = oouter + (p0 + j) * os;
                if (++fill == TILE || done + j + 1 == stop) {
                    int contiguous = 1, dense = 1, one_high = 1;
                    for (int64_t k = 1; k < fill; k++) {
                        contiguous &= g[k] == g[0] + k;
                        dense &= o[k] == o[0] + k;
                        one_high &= h[k] == h[0];
                    }
                    contiguous &= one_high;
                    do_tile(P, contiguous ? NULL : g, g[0], one_high ? NULL : h, h[0], dense ? NULL : o, o[0], 1,
                            fill);
                    fill = 0;
                }
            }
        }
        done += cnt;
        pos[last] += cnt;
        for (int d = last; d > 0 && pos[d] == P->size[d]; d--) {
            pos[d] = 0;
            pos[d - 1] += 1;
        }
    }
    if (pm) finish_tile(P, pw, NULL, po0, 1, pm);
}

/* The values never depend on the caller's floating-point environment: each
 * thread clears flush-to-zero and denormals-are-zero while it computes (and the
 * calling thread restores its own state afterwards): ki_fp_enter / ki_fp_leave
 * and the clear_fp pool of parallel.h. */

/* Chunk c: region elements c*CHUNK .. (c+1)*CHUNK - 1 (ki_parallel_for's body). */
static void fill_chunk(void *ctx, int64_t c)
{
    const plan_t *P = (const plan_t *)ctx;
    int64_t start = c * CHUNK;
    int64_t stop = start + CHUNK < P->numel ? start + CHUNK : P->numel;
    do_chunk(P, start, stop);
}

KI_API void keyinit_ndtri_tail(const float *tail, int64_t n, float *mag)
{
    ki_fpstate_t saved = ki_fp_enter();
    for (int64_t i = 0; i < n; i += TILE) ndtri_tail_batch(tail + i, n - i < TILE ? n - i : TILE, mag + i);
    ki_fp_leave(saved);
}

/* Exported: which value-changing "fast math" transformations this compiled code
 * shows, as bits (0: none; see _build._FP_PROBE_FAULTS). Every operand comes
 * from a volatile, so nothing is folded unless the flags permit folding that
 * IEEE arithmetic forbids. _build.load refuses a library that reports any. */
static volatile float probe_small = 1.0e-8f, probe_one = 1.0f, probe_five = 5.0f;
static volatile float probe_nan = __builtin_nanf(""), probe_min = 0x1p-126f, probe_sub = 0x1p-140f;

KI_API int keyinit_fp_probe(void)
{
    ki_fpstate_t saved = ki_fp_enter();
    int faults = 0;
    float a = probe_small, b = probe_one;
    if ((a + b) - b != 0.0f) faults |= 1;          /* 1 + 1e-8 rounds to 1 */
    float x = probe_five;
    if (x / 3.0f != 0x1.aaaaaap+0f) faults |= 2;    /* 5 * f32(1/3) is 0x1.aaaaacp+0 */
    float n = probe_nan;
    if (!(n != n)) faults |= 4;
    float m = probe_min;
    if (m * 0.5f == 0.0f) faults |= 8;
    float s = probe_sub, t = probe_one;
    if (s * t == 0.0f) faults |= 16;
    ki_fp_leave(saved);
    return faults;
}

/* ------------------------------------------------------------ entry point */

/*
 * Element (p_0, ..., p_{d-1}) of the destination has global flat index
 * base + sum_k idx_k(p_k) * gstride[k], where idx_k(p) = index[k][p] if
 * index[k] != NULL and p otherwise (a slice: its start is folded into base and
 * its step into gstride), and destination element offset sum_k p_k * ostride[k]
 * (in elements of the output dtype).
 * fparams: [a, b, p_low, p_span, lower, upper]   (binary32 values, passed as
 *          binary64 so that no caller-side conversion can flush a subnormal)
 * iparams: [flip, threshold, low, span]
 * Returns 0 on success, a negative number for invalid arguments.
 */
static int fill_planned(plan_t *P, const double *fparams, const int64_t *iparams, int nthreads);

/*
 * keyinit_fill with high counter words: element (p_0, ..., p_{d-1}) also has the high counter words
 * h = hbase + sum_k high_k(p_k), high_k(p) = hindex[k][p] where hindex and hindex[k] are not NULL, else
 * idx_k(p) * hstride[k] (hstride NULL: h = 0, keyinit_fill), and its word j is lane j % 4 of
 * Philox4x32-10((lo32(j/4), hi32(j/4), lo32(h), hi32(h)), (k0, k1)): a keyed forward's draw by the
 * elements' extent-free names (docs/spec.md 14.8; keyinit._draw.names.fill_named is the reference).
 */
KI_API int keyinit_fill_high(int dist, int dtype, uint32_t k0, uint32_t k1,
                             const double *fparams, const int64_t *iparams,
                             int ndim, int64_t base, const int64_t *size, const int64_t *ostride,
                             const int64_t *gstride, const int64_t *const *index,
                             void *out, int nthreads, uint64_t hbase, const int64_t *hstride,
                             const int64_t *const *hindex)
{
    if (ndim < 1 || ndim > KI_MAX_DIMS) return -1;
    if (dist < 0 || dist >= KI_DIST_COUNT || dtype < 0 || dtype >= KI_DTYPE_COUNT) return -2;
    plan_t P = plan_of(dist, dtype, k0, k1, ndim, base, size, ostride, gstride, index, out);
    P.hbase = hstride != NULL ? hbase : 0u;
    P.hstride = hstride;
    P.hindex = hstride != NULL ? hindex : NULL;
    ki_fpstate_t saved = ki_fp_enter(); /* before the conversions below: exact, subnormals kept */
    int rc = fill_planned(&P, fparams, iparams, nthreads);
    ki_fp_leave(saved);
    return rc;
}

KI_API int keyinit_fill(int dist, int dtype, uint32_t k0, uint32_t k1,
                        const double *fparams, const int64_t *iparams,
                        int ndim, int64_t base, const int64_t *size, const int64_t *ostride,
                        const int64_t *gstride, const int64_t *const *index,
                        void *out, int nthreads)
{
    return keyinit_fill_high(dist, dtype, k0, k1, fparams, iparams, ndim, base, size, ostride, gstride, index, out,
                             nthreads, 0u, NULL, NULL);
}

/*
 * keyinit_fill of a contiguous out (n elements, global flat indices 0 .. n-1) under the key
 * fold_in(fold_in((k0, k1), fold0), fold1): a keyed random op's draw (data/_fast) in one call,
 * the two key folds included.
 */
KI_API int keyinit_fill_folded(int dist, int dtype, uint32_t k0, uint32_t k1, uint64_t fold0, uint64_t fold1,
                               const double *fparams, const int64_t *iparams, int64_t n, void *out, int nthreads)
{
    uint64_t key = keyinit_derive(k0, k1, (uint32_t)fold0, (uint32_t)(fold0 >> 32), 2u, 0u);
    key = keyinit_derive((uint32_t)key, (uint32_t)(key >> 32), (uint32_t)fold1, (uint32_t)(fold1 >> 32), 2u, 0u);
    const int64_t size[1] = {n}, stride[1] = {1};
    const int64_t *const index[1] = {NULL};
    return keyinit_fill(dist, dtype, (uint32_t)key, (uint32_t)(key >> 32), fparams, iparams, 1, 0, size, stride,
                        stride, index, out, nthreads);
}

/* P: the geometry, key and distribution set; the parameters and derived fields set here. */
static int fill_planned(plan_t *P, const double *fparams, const int64_t *iparams, int nthreads)
{
    P->w = P->dist == KI_DIST_RANDINT ? 2 : 1;
    P->a = (float)fparams[0]; /* exact: each is a binary32 value */
    P->b = (float)fparams[1];
    P->p_low = (float)fparams[2];
    P->p_span = (float)fparams[3];
    P->lower = (float)fparams[4];
    P->upper = (float)fparams[5];
    P->flip = (int)iparams[0];
    P->threshold = (uint64_t)iparams[1];
    P->low = iparams[2];
    P->span = (uint64_t)iparams[3];
    P->elsize = elsize_of(P->dtype);
    int64_t numel = 1;
    for (int k = 0; k < P->ndim; k++) {
        if (P->size[k] < 0) return -3;
        numel *= P->size[k];
    }
    P->numel = numel;
    if (numel == 0) return 0;
    ki_parallel_for((numel + CHUNK - 1) / CHUNK, nthreads, 1, fill_chunk, P);
    return 0;
}
