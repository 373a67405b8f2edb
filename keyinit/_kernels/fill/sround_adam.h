/*
 * A stochastically rounded Adam/AdamW step in one pass (keyinit.optim.stochastic_rounding's fused path,
 * docs/spec.md 17.5): per element, the low-precision parameter and gradient widened to binary32, torch's
 * single-tensor Adam arithmetic in binary32 with the float32 state updated in place, and the new value
 * rounded by section 17.2's rule with the word of the element's global index (the fill walk's words, as
 * keyinit_sround draws them). No float32 copy of the parameter or gradient is made.
 *
 * The arithmetic is torch.optim.adam._single_tensor_adam's (decoupled weight decay, no amsgrad, not
 * maximize), each operation with its own rounding as torch's CPU kernels do it:
 *   p = p * decay                          (param.mul_(1 - lr * weight_decay); skipped when weight_decay == 0)
 *   m = fma(w, g - m, m)  (w < 0.5)        (exp_avg.lerp_(grad, 1 - beta1))
 *     = fma(w - 1, g - m, g)  (otherwise)
 *   v = fma(s2 * g, g, v * beta2)          (exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2))
 *   d = sqrt(v) / bc2s + eps               ((exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps))
 *   p = (neg_step * m) / d + p             (param.addcdiv_(exp_avg, denom, value=-step_size))
 * keyinit/_sround_adam.py proves this equal to torch's own step on this machine before it is used (else
 * the generic float32 path runs). The binary32 parameter type writes p unrounded (that proof).
 * Included by fill_kernels.c after sround.h.
 */
#ifndef KEYINIT_FILL_SROUND_ADAM_H
#define KEYINIT_FILL_SROUND_ADAM_H

#include <math.h>

/* Parameter (and gradient) types of keyinit_sround_adam: the KI_SR_* targets, or binary32 (no rounding). */
#define KI_SRA_FLOAT32 4

struct ki_adam_s {
    const void *grad; /* the parameter's type, the parameter's element offsets */
    float *m, *v;     /* binary32 state, the parameter's element offsets */
    float decay, w, beta2, s2, bc2s, eps, neg_step;
    int has_decay;
    int ptype; /* KI_SR_BFLOAT16, KI_SR_FLOAT16 or KI_SRA_FLOAT32 */
};

/* The new binary32 value of one element; m, v updated. */
static inline float ki_adam_f32(const struct ki_adam_s *A, float p, float g, float *mk, float *vk)
{
    if (A->has_decay) p = p * A->decay;
    const float m0 = *mk;
    const float d = g - m0;
    const float m = A->w < 0.5f ? fmaf(A->w, d, m0) : fmaf(A->w - 1.0f, d, g);
    const float v = fmaf(A->s2 * g, g, *vk * A->beta2);
    *mk = m;
    *vk = v;
    const float den = sqrtf(v) / A->bc2s + A->eps;
    return (A->neg_step * m) / den + p;
}

#define ADAM_LOOP(T, LOAD, STORE)                                                \
    do {                                                                         \
        T *pp = (T *)P->out;                                                     \
        const T *gp = (const T *)A->grad;                                        \
        if (o == NULL && os == 1) {                                              \
            pp += o0;                                                            \
            gp += o0;                                                            \
            float *mp = A->m + o0, *vp = A->v + o0;                              \
            for (int64_t k = 0; k < m; k++) {                                    \
                const float nv = ki_adam_f32(A, LOAD(pp[k]), LOAD(gp[k]), mp + k, vp + k); \
                const uint32_t x = wp[k];                                        \
                pp[k] = STORE(nv, x);                                            \
            }                                                                    \
        } else {                                                                 \
            for (int64_t k = 0; k < m; k++) {                                    \
                const int64_t at = o != NULL ? o[k] : o0 + k * os;               \
                const float nv = ki_adam_f32(A, LOAD(pp[at]), LOAD(gp[at]), A->m + at, A->v + at); \
                const uint32_t x = wp[k];                                        \
                pp[at] = STORE(nv, x);                                           \
            }                                                                    \
        }                                                                        \
    } while (0)

#define KI_LOAD_BF16(h) ki_bf16_to_f32(h)
#define KI_LOAD_F16(h) ki_f16_to_f32(h)
#define KI_LOAD_F32(f) (f)
#define KI_STORE_BF16(f, x) ki_sr_bf16(ki_bits(f), x)
#define KI_STORE_F16(f, x) ((uint16_t)ki_sr_f32(ki_bits(f), x, 11, -14, 15, 16, 1, 0x7C00u, 0x7E00u, 0x7BFFu))
#define KI_STORE_F32(f, x) ((void)(x), (f))

static void adam_tile(const plan_t *P, const uint32_t *wp, const int64_t *o, int64_t o0, int64_t os, int64_t m)
{
    const struct ki_adam_s *A = P->adam;
    switch (A->ptype) {
    case KI_SR_BFLOAT16: ADAM_LOOP(uint16_t, KI_LOAD_BF16, KI_STORE_BF16); break;
    case KI_SR_FLOAT16: ADAM_LOOP(uint16_t, KI_LOAD_F16, KI_STORE_F16); break;
    case KI_SRA_FLOAT32: ADAM_LOOP(float, KI_LOAD_F32, KI_STORE_F32); break;
    }
}

/*
 * One Adam/AdamW step of a parameter of type ptype (KI_SR_BFLOAT16, KI_SR_FLOAT16, KI_SRA_FLOAT32) at
 * param, its gradient grad (the same type) and binary32 state m, v, all with the parameter's element
 * offsets, walked as keyinit_sround walks its destination (geometry: keyinit_fill's). scalars: decay, w,
 * beta2, s2, bc2s, eps, neg_step (ki_adam_s); has_decay: apply decay. Returns 0, or a negative number for
 * invalid arguments.
 */
KI_API int keyinit_sround_adam(int ptype, uint32_t k0, uint32_t k1, int ndim, int64_t base, const int64_t *size,
                               const int64_t *ostride, const int64_t *gstride, const int64_t *const *index,
                               void *param, const void *grad, float *m, float *v, const float *scalars,
                               int has_decay, int nthreads)
{
    if (ndim < 1 || ndim > KI_MAX_DIMS) return -1;
    if (ptype != KI_SR_BFLOAT16 && ptype != KI_SR_FLOAT16 && ptype != KI_SRA_FLOAT32) return -2;
    struct ki_adam_s A;
    A.grad = grad;
    A.m = m;
    A.v = v;
    A.decay = scalars[0];
    A.w = scalars[1];
    A.beta2 = scalars[2];
    A.s2 = scalars[3];
    A.bc2s = scalars[4];
    A.eps = scalars[5];
    A.neg_step = scalars[6];
    A.has_decay = has_decay;
    A.ptype = ptype;
    /* one word per element, as bits draws them */
    plan_t P = plan_of(KI_DIST_BITS, ptype == KI_SRA_FLOAT32 ? KI_DTYPE_FLOAT32 : KI_DTYPE_INT16, k0, k1, ndim, base,
                       size, ostride, gstride, index, param);
    P.adam = &A;
    static const double fzero[6];
    static const int64_t izero[4];
    ki_fpstate_t saved = ki_fp_enter(); /* subnormals kept, as torch's default */
    int rc = fill_planned(&P, fzero, izero, nthreads);
    ki_fp_leave(saved);
    return rc;
}

#endif /* KEYINIT_FILL_SROUND_ADAM_H */
