/*
 * binary32 <-> bfloat16 / float16 conversions, the one copy every keyinit C kernel
 * includes (docs/spec.md section 8: round to nearest even, overflow to infinity).
 *
 *   ki_f32_to_bf16: c10::BFloat16's round_to_nearest_even on the bits; NaN -> 0x7FC0.
 *   ki_f32_to_f16:  fp16_ieee_from_fp32_value of the FP16 library (what c10::Half
 *                   uses): IEEE round-to-nearest-even, overflow to infinity,
 *                   NaN -> sign | 0x7E00.
 *   ki_bf16_to_f32, ki_f16_to_f32: exact.
 *
 * Branch-free (every case computed, one selected), so loops over them vectorize.
 * ki_f32_to_f16 gives the same bits whatever the flush-to-zero / denormals-are-zero
 * mode: its float operations only see values that are normal, or so small that
 * they cannot change the rounded result. tests/kernels/test_conversions.py checks both
 * directions against torch and against the bit-select formulation the dropout
 * kernel used before this header (equal for all 2**32 inputs, NaNs included).
 */
#ifndef KEYINIT_CONVERT_H
#define KEYINIT_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t ki_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float ki_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t ki_f32_to_bf16(float f)
{
    uint32_t u = ki_bits(f);
    uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

static inline uint16_t ki_f32_to_f16(float f)
{
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    uint32_t w = ki_bits(f);
    float base = (ki_float(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
    uint32_t shl1_w = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = ki_float((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = ki_bits(base);
    uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    uint32_t mantissa_bits = bits & 0x00000FFFu;
    uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float ki_bf16_to_f32(uint16_t h) { return ki_float((uint32_t)h << 16); }

/* Subnormal halves are m * 2^-24, exact in binary32. */
static inline float ki_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    uint32_t special = sign | 0x7F800000u | (mantissa << 13);
    uint32_t subnormal = sign | ki_bits((float)mantissa * 0x1p-24f);
    return ki_float(exponent == 0x1Fu ? special : (exponent == 0 ? subnormal : normal));
}

#endif /* KEYINIT_CONVERT_H */
