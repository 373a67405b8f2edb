/*
 * A tile of fill values stored in the destination's dtype (fill_kernels.c's last step): the binary32
 * values rounded by convert.h (bfloat16, float16: nearest even; float64: widened exactly), integers
 * narrowed to the integer dtype, bernoulli's 0/1 in any dtype; and keyinit_convert_f32, the conversions
 * exported for the tests. Included by fill_kernels.c once plan_t and values_t are defined.
 */
#ifndef KEYINIT_FILL_STORE_H
#define KEYINIT_FILL_STORE_H

/* Destination element offsets: o[k] if o != NULL, else o0 + k*os. */
#define STORE_LOOP(T, EXPR)                                                      \
    do {                                                                         \
        T *d = (T *)out;                                                         \
        if (o != NULL) {                                                         \
            for (int64_t k = 0; k < m; k++) d[o[k]] = (EXPR);                    \
        } else if (os == 1) {                                                    \
            d += o0;                                                             \
            for (int64_t k = 0; k < m; k++) d[k] = (EXPR);                       \
        } else {                                                                 \
            d += o0;                                                             \
            for (int64_t k = 0; k < m; k++) d[k * os] = (EXPR);                  \
        }                                                                        \
    } while (0)

static void store_tile(const plan_t *P, const values_t *v, int64_t m, const int64_t *o, int64_t o0, int64_t os)
{
    char *out = P->out;
    const float *f = v->f;
    const int64_t *iv = v->i;
    const uint8_t *u = v->u;
    switch (P->dist) {
    case KI_DIST_BITS:
    case KI_DIST_RANDINT:
        switch (P->dtype) {
        case KI_DTYPE_INT64: STORE_LOOP(int64_t, iv[k]); break;
        case KI_DTYPE_INT32: STORE_LOOP(int32_t, (int32_t)iv[k]); break;
        case KI_DTYPE_INT16: STORE_LOOP(int16_t, (int16_t)iv[k]); break;
        case KI_DTYPE_INT8: STORE_LOOP(int8_t, (int8_t)iv[k]); break;
        case KI_DTYPE_UINT8: STORE_LOOP(uint8_t, (uint8_t)iv[k]); break;
        }
        break;
    case KI_DIST_BERNOULLI:
        switch (P->dtype) {
        case KI_DTYPE_BOOL: case KI_DTYPE_UINT8: STORE_LOOP(uint8_t, u[k]); break;
        case KI_DTYPE_INT8: STORE_LOOP(int8_t, (int8_t)u[k]); break;
        case KI_DTYPE_INT16: STORE_LOOP(int16_t, (int16_t)u[k]); break;
        case KI_DTYPE_INT32: STORE_LOOP(int32_t, (int32_t)u[k]); break;
        case KI_DTYPE_INT64: STORE_LOOP(int64_t, (int64_t)u[k]); break;
        case KI_DTYPE_FLOAT32: STORE_LOOP(float, (float)u[k]); break;
        case KI_DTYPE_FLOAT64: STORE_LOOP(double, (double)u[k]); break;
        case KI_DTYPE_BFLOAT16: STORE_LOOP(uint16_t, (uint16_t)(u[k] ? 0x3F80u : 0u)); break;
        case KI_DTYPE_FLOAT16: STORE_LOOP(uint16_t, (uint16_t)(u[k] ? 0x3C00u : 0u)); break;
        }
        break;
    default:
        switch (P->dtype) {
        case KI_DTYPE_FLOAT32: STORE_LOOP(float, f[k]); break;
        case KI_DTYPE_FLOAT64: STORE_LOOP(double, (double)f[k]); break;
        case KI_DTYPE_BFLOAT16: STORE_LOOP(uint16_t, ki_f32_to_bf16(f[k])); break;
        case KI_DTYPE_FLOAT16: STORE_LOOP(uint16_t, ki_f32_to_f16(f[k])); break;
        }
    }
}

/* Exported for the exhaustive conversion tests (convert.h). */
KI_API void keyinit_convert_f32(const float *src, int64_t n, int dtype, void *dst)
{
    if (dtype == KI_DTYPE_BFLOAT16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = ki_f32_to_bf16(src[i]);
    } else if (dtype == KI_DTYPE_FLOAT16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = ki_f32_to_f16(src[i]);
    }
}

#endif /* KEYINIT_FILL_STORE_H */
