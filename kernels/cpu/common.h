/* Scalar helpers shared by baton's CPU kernels (kernels/cpu/*.c), which include this header; kernels/cpu_ops.compile_library hashes it into each library's cache key,
 * so a change here rebuilds all three. */
#ifndef BATON_CPU_COMMON_H
#define BATON_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, like torch */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded); /* no branch */
}

/* exp for vectorised loops: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial
 * (relative error ~2e-7, below float32 rounding of the results it feeds). Branch-free so
 * `omp simd` loops vectorise it. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest by the 1.5 * 2^23 trick: branch-free, no libm call */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float silu(float v) { return v / (1.0f + exp_approx(-v)); }

/* A float32 or bfloat16 (bf16 = 1) element of a model-dtype tensor. */
static inline float load_any(const void *base, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_any(void *base, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

/* The value a tensor of the model dtype holds (the torch path rounds between ops). */
static inline float round_to(int bf16, float v) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* sum_i x[i] w[i] over a row of x (float32 or bf16) and a row of w (float32 or bf16): one
 * loop per dtype pair, so each vectorises (cpu/lora.c's shrink, cpu/moe.c's expert LoRA). */
static inline float mixed_dot(const void *x, int x_bf16, int64_t xat, const void *w, int w_bf16,
                        int64_t wat, int64_t n) {
    float acc = 0.0f;
    if (x_bf16 && w_bf16) {
        const uint16_t *xr = (const uint16_t *)x + xat, *wr = (const uint16_t *)w + wat;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += bf16_to_f32(xr[i]) * bf16_to_f32(wr[i]);
    } else if (x_bf16) {
        const uint16_t *xr = (const uint16_t *)x + xat;
        const float *wr = (const float *)w + wat;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += bf16_to_f32(xr[i]) * wr[i];
    } else if (w_bf16) {
        const float *xr = (const float *)x + xat;
        const uint16_t *wr = (const uint16_t *)w + wat;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += xr[i] * bf16_to_f32(wr[i]);
    } else {
        const float *xr = (const float *)x + xat, *wr = (const float *)w + wat;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += xr[i] * wr[i];
    }
    return acc;
}

#endif
