/*
 * The plan of one kernel call (plan_t): the draw, the region's geometry (keyinit_fill's addressing) and
 * what a tile does with its words (store.h, sround.h, sround_adam.h); plan_of sets the fields every
 * entry point shares. Included by fill_kernels.c.
 */
#ifndef KEYINIT_FILL_PLAN_H
#define KEYINIT_FILL_PLAN_H

struct ki_adam_s;

typedef struct {
    int dist;
    int dtype;
    int w;
    uint32_t k0, k1;
    /* distribution parameters */
    float a, b;             /* uniform: low, span; normal/trunc: mean, std */
    float p_low, p_span;    /* trunc */
    float lower, upper;     /* trunc */
    int flip;               /* trunc */
    uint64_t threshold;     /* bernoulli (<= 2**32) */
    int64_t low;            /* randint */
    uint64_t span;          /* randint (<= 2**32) */
    /* geometry */
    int ndim;
    int64_t base;
    const int64_t *size;
    const int64_t *ostride;
    const int64_t *gstride;
    const int64_t *const *index; /* per dim: an index vector, or NULL for idx(p) = p */
    /* high counter words (docs/spec.md 14.8): h = hbase + sum_k high_k(p_k), high_k(p) = hindex[k][p]
     * where that vector is given, else idx_k(p) * hstride[k]; hstride == NULL: h = 0 */
    uint64_t hbase;
    const int64_t *hstride;
    const int64_t *const *hindex; /* NULL, or per dim a vector or NULL */
    char *out;
    int elsize;
    int64_t numel;
    const char *src; /* stochastic rounding (sround.h): the binary32 (FP4: binary64) values, out's strides; else NULL */
    int target;      /* its target format (KI_SR_*) */
    const struct ki_adam_s *adam; /* a fused Adam step (sround_adam.h): the parameter at out; else NULL */
} plan_t;

/* A plan of dist/dtype words keyed (k0, k1) over keyinit_fill's region geometry into out; every other
 * field zero (no high words, no source, no Adam step). */
static plan_t plan_of(int dist, int dtype, uint32_t k0, uint32_t k1, int ndim, int64_t base, const int64_t *size,
                      const int64_t *ostride, const int64_t *gstride, const int64_t *const *index, void *out)
{
    static plan_t zero_plan;
    plan_t P = zero_plan;
    P.dist = dist;
    P.dtype = dtype;
    P.k0 = k0;
    P.k1 = k1;
    P.ndim = ndim;
    P.base = base;
    P.size = size;
    P.ostride = ostride;
    P.gstride = gstride;
    P.index = index;
    P.out = (char *)out;
    return P;
}

#endif /* KEYINIT_FILL_PLAN_H */
