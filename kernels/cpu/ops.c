/* Fused CPU decode kernels for baton (built at first use by kernels/cpu/ops.py).
 *
 * The torch path of a decode step touches each pool slot several times: gather into a scratch
 * buffer, scale, add the outer product, scatter back, reduce against C. These loops read and
 * write every state element once, in place in the pool, with the rows of a batch split across
 * OpenMP threads (the same libgomp runtime torch uses).
 *
 * Layouts are the pools' and kernels/ssu.py's / kernels/conv1d.py's: contiguous, row-major.
 * Every function checks its slot indices and returns the first bad row + 1 (0 when all are in
 * range) before it writes anything, so a bad index is an error rather than a stray write.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

static int64_t check_slots(const int64_t *slots, int64_t batch, int64_t num_slots) {
    for (int64_t b = 0; b < batch; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return b + 1;
    return 0;
}

/* One (row, head) of the selective state update, in place on its pool state (P, N):
 *   state = state * decay + (dt x) (outer) B;  y = state . C + D x   (y rounded like the model
 * dtype when bf16). */
static inline __attribute__((always_inline)) void ssu_head(float *state, const float *xv,
                                                           float dt, float decay, const float *Bv,
                                                           const float *Cv, float Dh, float *yv,
                                                           int64_t P, int64_t N, const int bf16) {
    for (int64_t p = 0; p < P; p++) {
        const float xdt = xv[p] * dt;
        float *row = state + p * N;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; n++) {
            const float s = row[n] * decay + xdt * Bv[n];
            row[n] = s;
            acc += s * Cv[n];
        }
        yv[p] = round_to(bf16, acc + Dh * xv[p]);
    }
}

/* One row's causal conv over `dim` channels: pre[c] = bias[c] + window . w[c] with the window
 * [pool (K-1) | x], then the pool window shifts left by one and takes x. The pool row starts at
 * `pool_row`; pool and x hold float32 or bfloat16 each. */
static inline __attribute__((always_inline)) void conv_row(
    void *pool, const int pool_bf16, int64_t pool_row, const void *x, const int x_bf16,
    int64_t x_off, const float *w, const float *bias, float *pre, int64_t dim, const int64_t K) {
    const int64_t km1 = K - 1;
    if (K == 4) { /* the usual width: straight-line window shift */
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) {
            const int64_t at = pool_row + c * 3;
            const float *wc = w + c * 4;
            const float w0 = load_any(pool, pool_bf16, at), w1 = load_any(pool, pool_bf16, at + 1);
            const float w2 = load_any(pool, pool_bf16, at + 2);
            const float xin = load_any(x, x_bf16, x_off + c);
            pre[c] = bias[c] + w0 * wc[0] + w1 * wc[1] + w2 * wc[2] + xin * wc[3];
            store_any(pool, pool_bf16, at, w1);
            store_any(pool, pool_bf16, at + 1, w2);
            store_any(pool, pool_bf16, at + 2, xin);
        }
    } else {
        for (int64_t c = 0; c < dim; c++) {
            const int64_t at = pool_row + c * km1;
            const float *wc = w + c * K;
            float acc = bias[c];
            for (int64_t k = 0; k < km1; k++) {
                const float v = load_any(pool, pool_bf16, at + k);
                acc += v * wc[k];
                if (k) store_any(pool, pool_bf16, at + k - 1, v);
            }
            const float xin = load_any(x, x_bf16, x_off + c);
            pre[c] = acc + xin * wc[km1];
            if (km1) store_any(pool, pool_bf16, at + km1 - 1, xin);
        }
    }
}

/* Selective state update, one token per row, float32 pool updated in place.
 *   state[s,h] <- state[s,h] * exp(dt[b,h] * A[h]) + (dt[b,h] * x[b,h]) (outer) B[b,g]
 *   y[b,h]      = state[s,h] . C[b,g] + D[h] * x[b,h]          (g = h / (H / G))
 * pool (num_slots, H, P, N); x, y (batch, H, P); dt (batch, H) already discretized;
 * A, D (H); B, C (batch, G, N). */
int64_t baton_ssu_f32(float *pool, int64_t num_slots, const int64_t *slots, int64_t batch,
                      const float *x, const float *dt, const float *A, const float *B,
                      const float *C, const float *D, float *y, int64_t H, int64_t P, int64_t N,
                      int64_t G, int nthreads) {
    int64_t bad = check_slots(slots, batch, num_slots);
    if (bad) return bad;
    const int64_t heads_per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / heads_per_group;
            const float dt_bh = dt[b * H + h];
            const float decay = expf(dt_bh * A[h]);
            const float *Bv = B + (b * G + g) * N;
            const float *Cv = C + (b * G + g) * N;
            const float *xv = x + (b * H + h) * P;
            float *yv = y + (b * H + h) * P;
            float *state = pool + (slots[b] * H + h) * P * N;
            ssu_head(state, xv, dt_bh, decay, Bv, Cv, D[h], yv, P, N, 0);
        }
    }
    return 0;
}

/* One causal-conv decode step on the conv pool (num_slots, dim, K-1), then SiLU (silu_out = 1)
 * or no activation (LFM2's short conv).
 * x, out (batch, dim) float32; w (dim, K) float32; bias (dim) float32 (zeros for none). The
 * pool holds float32 (pool_bf16 = 0) or bfloat16 (pool_bf16 = 1). */
int64_t baton_conv_update(void *pool, int pool_bf16, int64_t num_slots, const int64_t *slots,
                          int64_t batch, const float *x, const float *w, const float *bias,
                          float *out, int64_t dim, int64_t K, int silu_out, int nthreads) {
    int64_t bad = check_slots(slots, batch, num_slots);
    if (bad) return bad;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < batch; b++) {
        float *ob = out + b * dim;
        const int64_t pool_row = slots[b] * dim * (K - 1);
        if (pool_bf16)
            conv_row(pool, 1, pool_row, x, 0, b * dim, w, bias, ob, dim, K);
        else
            conv_row(pool, 0, pool_row, x, 0, b * dim, w, bias, ob, dim, K);
        if (silu_out) {
#pragma omp simd
            for (int64_t c = 0; c < dim; c++) ob[c] = silu(ob[c]);
        }
    }
    return 0;
}

/* Row-wise argmax of a float32 (rows, cols) matrix with row stride `stride`; the first index of
 * the maximum wins, like torch.argmax. A row holding NaN gets `cols` (the caller resolves it).
 * Vectorised block maxima find the first block holding the row maximum; one short scalar scan
 * of that block finds the position. */
#define ARGMAX_BLOCK 256
void baton_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out,
                      int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float best = row[0];
        int64_t best_block = 0;
        int nan = 0;
        for (int64_t start = 0; start < cols; start += ARGMAX_BLOCK) {
            const int64_t end = start + ARGMAX_BLOCK < cols ? start + ARGMAX_BLOCK : cols;
            float m = row[start];
#pragma omp simd reduction(max : m) reduction(| : nan)
            for (int64_t c = start; c < end; c++) {
                m = row[c] > m ? row[c] : m;
                nan |= row[c] != row[c];
            }
            if (m > best) {
                best = m;
                best_block = start;
            }
        }
        int64_t at = best_block;
        while (row[at] != best) at++;
        out[r] = nan ? cols : at;
    }
}

/* One Mamba2 decode step for `batch` rows, from the in_proj output to the out_proj input:
 *   xBC = silu(conv(window[slot] | xBC_in)) (window shifted in place)
 *   dt  = clamp(softplus(dt_in + dt_bias), dt_min, dt_max)
 *   state[slot] = state * exp(dt A) + dt x (outer) B;  y = state . C + D x      (SSM pool fp32)
 *   out = norm_w * rmsnorm_per_group(y * silu(z))
 * zxbcdt: (batch, row_stride) model dtype rows [z (I) | xBC (conv_dim) | dt (H)];
 * conv pool (num_slots, conv_dim, K-1) model dtype; conv_w (conv_dim, K), conv_b, dt_bias, A, D
 * and norm_w float32; xbc, y: float32 scratch (batch, conv_dim), (batch, I); out (batch, I)
 * model dtype (conv_b zeros when the conv has no bias). `bf16` says whether the model dtype
 * is bfloat16 (else float32); values are rounded to it where the torch path rounds, so both
 * paths agree to float32 rounding. */
static inline __attribute__((always_inline)) void mamba_decode_body(
    const void *zxbcdt, int64_t row_stride, void *conv_pool, float *ssm_pool,
    const int64_t *slots, int64_t batch, const float *conv_w, const float *conv_b,
    const float *dt_bias, const float *A, const float *D, float dt_min, float dt_max,
    const float *norm_w, float eps, float *xbc, float *y, void *out, const int bf16, int64_t I,
    int64_t H, int64_t P, int64_t N, int64_t G, const int64_t K, int64_t norm_group,
    int64_t norm_mode, int nthreads) {
    const int64_t conv_dim = I + 2 * G * N, km1 = K - 1, heads_per_group = H / G;
    const int64_t num_norm_groups = I / norm_group;
#pragma omp parallel num_threads(nthreads)
    {
        /* 1. conv + SiLU, window shift. */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            const int64_t in = b * row_stride + I;
            const int64_t pool_row = slots[b] * conv_dim * km1;
            float *xb = xbc + b * conv_dim;
            conv_row(conv_pool, bf16, pool_row, zxbcdt, bf16, in, conv_w, conv_b, xb, conv_dim, K);
#pragma omp simd
            for (int64_t c = 0; c < conv_dim; c++) xb[c] = round_to(bf16, silu(round_to(bf16, xb[c])));
        }
        /* 2. selective state update per (row, head). */
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < H; h++) {
                const int64_t g = h / heads_per_group;
                float dt = load_any(zxbcdt, bf16, b * row_stride + I + conv_dim + h) + dt_bias[h];
                dt = dt > 20.0f ? dt : log1pf(expf(dt)); /* softplus, torch's threshold */
                dt = dt < dt_min ? dt_min : (dt > dt_max ? dt_max : dt);
                const float decay = expf(dt * A[h]);
                const float *xv = xbc + b * conv_dim + h * P;
                const float *Bv = xbc + b * conv_dim + I + g * N;
                const float *Cv = xbc + b * conv_dim + I + G * N + g * N;
                float *yv = y + b * I + h * P;
                float *state = ssm_pool + (slots[b] * H + h) * P * N;
                ssu_head(state, xv, dt, decay, Bv, Cv, D[h], yv, P, N, bf16);
            }
        }
        /* 3. the gate and the grouped RMS norm, by norm_mode:
         *    0: w * norm(y * silu(z))  (NemotronH, Bamba, Granite; Falcon-H1 norm after gate)
         *    1: (w * norm(y)) * silu(z) (Falcon-H1 mamba_norm_before_gate)
         *    2: y * silu(z), no norm    (Falcon-H1 without mamba_rms_norm) */
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t q = 0; q < num_norm_groups; q++) {
                float *yg = y + b * I + q * norm_group;
                const int64_t zoff = b * row_stride + q * norm_group;
                const int64_t o = b * I + q * norm_group;
                if (norm_mode == 2) {
                    for (int64_t i = 0; i < norm_group; i++) {
                        const float v = yg[i] * silu(load_any(zxbcdt, bf16, zoff + i));
                        if (bf16)
                            ((uint16_t *)out)[o + i] = f32_to_bf16(v);
                        else
                            ((float *)out)[o + i] = v;
                    }
                    continue;
                }
                float ss = 0.0f;
                if (norm_mode == 0) {
#pragma omp simd reduction(+ : ss)
                    for (int64_t i = 0; i < norm_group; i++) {
                        const float hv = yg[i] * silu(load_any(zxbcdt, bf16, zoff + i));
                        yg[i] = hv;
                        ss += hv * hv;
                    }
                } else {
#pragma omp simd reduction(+ : ss)
                    for (int64_t i = 0; i < norm_group; i++) ss += yg[i] * yg[i];
                }
                const float inv = 1.0f / sqrtf(ss / (float)norm_group + eps);
                const float *wg = norm_w + q * norm_group;
                if (norm_mode == 1) {
                    for (int64_t i = 0; i < norm_group; i++) {
                        const float v = (wg[i] * (yg[i] * inv)) * silu(load_any(zxbcdt, bf16, zoff + i));
                        if (bf16)
                            ((uint16_t *)out)[o + i] = f32_to_bf16(v);
                        else
                            ((float *)out)[o + i] = v;
                    }
                } else if (bf16) {
                    for (int64_t i = 0; i < norm_group; i++)
                        ((uint16_t *)out)[o + i] =
                            f32_to_bf16(wg[i] * round_to(1, yg[i] * inv));
                } else {
#pragma omp simd
                    for (int64_t i = 0; i < norm_group; i++)
                        ((float *)out)[o + i] = wg[i] * (yg[i] * inv);
                }
            }
        }
    }
}

int64_t baton_mamba_decode(const void *zxbcdt, int64_t row_stride, void *conv_pool,
                           float *ssm_pool, int64_t num_slots, const int64_t *slots,
                           int64_t batch, const float *conv_w, const float *conv_b,
                           const float *dt_bias, const float *A, const float *D, float dt_min,
                           float dt_max, const float *norm_w, float eps, float *xbc, float *y,
                           void *out, int bf16, int64_t I, int64_t H, int64_t P, int64_t N,
                           int64_t G, int64_t K, int64_t norm_group, int64_t norm_mode,
                           int nthreads) {
    int64_t bad = check_slots(slots, batch, num_slots);
    if (bad) return bad;
    /* Copies of the body per model dtype and for the usual kernel width 4, so the inner loops
     * carry no dtype branch and the conv window loops unroll. */
#define BODY(BF16, KW)                                                                           \
    mamba_decode_body(zxbcdt, row_stride, conv_pool, ssm_pool, slots, batch, conv_w, conv_b,     \
                      dt_bias, A, D, dt_min, dt_max, norm_w, eps, xbc, y, out, BF16, I, H, P, N, \
                      G, KW, norm_group, norm_mode, nthreads)
    if (bf16 && K == 4)
        BODY(1, 4);
    else if (bf16)
        BODY(1, K);
    else if (K == 4)
        BODY(0, 4);
    else
        BODY(0, K);
#undef BODY
    return 0;
}

/* SwiGLU's elementwise part, out = up * silu(gate * gate_mult) for (rows, inter) outputs from
 * rows of [gate | up] (row_stride elements apart), each op rounded to the model dtype as torch
 * rounds it (bf16 = 1): the multiplied gate (when gate_mult != 1), silu's result, the product. */
void baton_silu_mul(const void *gate_up, int64_t row_stride, void *out, int64_t rows,
                    int64_t inter, float gate_mult, int bf16, int nthreads) {
    const int scaled = gate_mult != 1.0f;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * inter > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g0 = r * row_stride, u0 = g0 + inter, o0 = r * inter;
        if (bf16) {
            const uint16_t *in = (const uint16_t *)gate_up;
            uint16_t *o = (uint16_t *)out;
#pragma omp simd
            for (int64_t i = 0; i < inter; i++) {
                float g = bf16_to_f32(in[g0 + i]);
                if (scaled) g = round_to(1, g * gate_mult);
                o[o0 + i] = f32_to_bf16(bf16_to_f32(in[u0 + i]) * round_to(1, silu(g)));
            }
        } else {
            const float *in = (const float *)gate_up;
            float *o = (float *)out;
#pragma omp simd
            for (int64_t i = 0; i < inter; i++) {
                const float g = scaled ? in[g0 + i] * gate_mult : in[g0 + i];
                o[o0 + i] = in[u0 + i] * silu(g);
            }
        }
    }
}

/* RMSNorm of (rows, hidden) rows like kernels/norm.py's torch path: float32 statistics,
 * out = weight * (x / sqrt(mean(x^2) + eps)) rounded once to the model dtype (bf16 = 1). */
void baton_rms_norm(const void *x, int64_t x_stride, const float *weight, void *out, int64_t rows,
                    int64_t hidden, float eps, int bf16, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * hidden > 16384)
    for (int64_t r = 0; r < rows; r++) {
        float ss = 0.0f;
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = bf16_to_f32(xr[i]);
                ss += v * v;
            }
            const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
            uint16_t *o = (uint16_t *)out + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) o[i] = f32_to_bf16(weight[i] * (bf16_to_f32(xr[i]) * inv));
        } else {
            const float *xr = (const float *)x + r * x_stride;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) ss += xr[i] * xr[i];
            const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
            float *o = (float *)out + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (xr[i] * inv);
        }
    }
}

/* One row of rotate_half rotary, as kernels/attention.py's torch path computes it in the model
 * dtype: out = x * c + rotate_half(x) * s on the first 2 * half channels (c, s the float32
 * cos / sin rounded to the dtype, each product and the sum rounded to it), the rest copied.
 * Two loops, one per half of the rotated channels, so that each vectorises (-std=c11 keeps the
 * products and the sum apart: no fused multiply-add, the torch path's roundings). */
static inline void rotary_row(const void *x, int64_t x_off, void *out, int64_t out_off,
                              const float *c, const float *s, int64_t half, int64_t Dh, int bf16) {
    if (!bf16) {
        const float *xr = (const float *)x + x_off;
        float *o = (float *)out + out_off;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) o[i] = xr[i] * c[i] + (-xr[i + half]) * s[i];
#pragma omp simd
        for (int64_t i = 0; i < half; i++) o[half + i] = xr[half + i] * c[i] + xr[i] * s[i];
        memcpy(o + 2 * half, xr + 2 * half, sizeof(float) * (size_t)(Dh - 2 * half));
        return;
    }
    for (int64_t i = 0; i < 2 * half; i++) {
        const int64_t p = i < half ? i : i - half; /* the cos / sin pair of channel i */
        const float other = load_any(x, bf16, x_off + (i < half ? i + half : i - half));
        const float a = round_to(bf16, load_any(x, bf16, x_off + i) * c[p]);
        const float b = round_to(bf16, (i < half ? -other : other) * s[p]);
        store_any(out, bf16, out_off + i, a + b);
    }
    for (int64_t i = 2 * half; i < Dh; i++) store_any(out, bf16, out_off + i, load_any(x, bf16, x_off + i));
}

/* Rotary embedding of q and k and the K/V store of an attention step (kernels/attention.py's
 * rotary_store_kv_torch in one pass): q (T, H, Dh), k and v (T, KVH, Dh) rows with token strides
 * q_stride / k_stride / v_stride (each row's heads contiguous); cos_t, sin_t (T, half) float32;
 * rotated q -> q_out (T, H, Dh) contiguous, rotated k and v -> the caches' rows (slots, KVH, Dh)
 * at slot_mapping (T). Everything in the model dtype (bf16 = 1). Returns the first token with a
 * slot outside the caches + 1 (nothing written), else 0. */
int64_t baton_rotary_store_kv(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                              const void *v, int64_t v_stride, const float *cos_t,
                              const float *sin_t, int64_t half, void *q_out, void *k_cache,
                              void *v_cache, int64_t num_token_slots, const int64_t *slot_mapping,
                              int64_t T, int64_t H, int64_t KVH, int64_t Dh, int bf16,
                              int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_token_slots) return t + 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * (H + KVH) * Dh > 16384)
    for (int64_t t = 0; t < T; t++) {
        float c[256], s[256]; /* half <= 256: the wrapper checks */
        for (int64_t i = 0; i < half; i++) {
            c[i] = round_to(bf16, cos_t[t * half + i]);
            s[i] = round_to(bf16, sin_t[t * half + i]);
        }
        for (int64_t h = 0; h < H; h++)
            rotary_row(q, t * q_stride + h * Dh, q_out, (t * H + h) * Dh, c, s, half, Dh, bf16);
        const int64_t slot = slot_mapping[t];
        for (int64_t h = 0; h < KVH; h++) {
            rotary_row(k, t * k_stride + h * Dh, k_cache, (slot * KVH + h) * Dh, c, s, half, Dh,
                       bf16);
            const size_t row_bytes = (size_t)Dh * (bf16 ? 2 : 4);
            memcpy((char *)v_cache + (slot * KVH + h) * (int64_t)row_bytes,
                   (const char *)v + (t * v_stride + h * Dh) * (bf16 ? 2 : 4), row_bytes);
        }
    }
    return 0;
}

/* Attention reads cold rows (the step's GEMMs evicted the cache) through the page table, whose
 * indirection defeats the hardware prefetcher: each pass asks for the row of one KV head a few
 * keys ahead of the one it reads, keys in pass 1 and values in pass 3. Prefetching the values
 * during pass 1 instead left pass 3 waiting on memory all the same (its prefetches were dropped
 * or evicted by the keys'): on a 32-sequence x 192-key decode call, pass 3's own prefetches took
 * the call from 1.5-1.6 to 1.2-1.3 ms (12 KV heads). always_inline: left to gcc's own (later)
 * inlining, the same source compiled to a loop as slow as having no value prefetch at all; forced,
 * 1.6 -> 1.05 ms on that call, and 28.5 -> 14.5 ms on 64 sequences x 1024 keys (32 heads on 8 KV
 * heads). */
#define KEYS_AHEAD 8
#define VALUES_AHEAD 16
static inline __attribute__((always_inline)) void prefetch_row(const void *cache,
                                                               const int64_t *slot, int64_t j,
                                                               int64_t len, int64_t KVH,
                                                               int64_t kvh, int64_t row_bytes) {
    if (j < len) {
        const char *row = (const char *)cache + (slot[j] * KVH + kvh) * row_bytes;
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
    }
}

/* Scores row -> softmax weights in place over its first n entries; returns 1 / their sum (0 for
 * an empty row). */
static inline float softmax_row(float *sg, int64_t n) {
    float m = -INFINITY, l = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; j++) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < n; j++) {
        const float p = exp_approx(sg[j] - m);
        sg[j] = p;
        l += p;
    }
    return l > 0.0f ? 1.0f / l : 0.0f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 consecutive elements of a model-dtype row, widened to float32. */
static inline __attribute__((always_inline)) __m512 attn_load16(const void *base, int bf16, int64_t off) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off))),
            16));
    return _mm512_loadu_ps((const float *)base + off);
}

/* The sums of a, b, c and d's 16 lanes each, as one 4-lane vector. */
static inline __attribute__((always_inline)) __m128 attn_reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] of that lane */
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 half = _mm256_add_ps(
        _mm512_castps512_ps256(abcd),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* One work item of attention_rows in AVX-512: G rows (a compile-time constant after inlining:
 * 1..8) that read one KV head, each a query head of one query (row g's output at out_off[g],
 * its keys the first lens[g] of `slot`): the heads of a GQA group, or, in an extend, the group's
 * heads for a few consecutive queries. Dh a multiple of 16. The same three passes and float32
 * arithmetic as the portable loop below, with the rows' partial dot products and output
 * accumulators held in registers; every key row is read once for all G rows. Pass 3 walks the
 * keys once per 64 columns of the value rows so that G x 4 accumulators stay in registers for
 * any Dh. */
static inline __attribute__((always_inline)) void attend_item_avx512(
    const float *qv, const void *k_cache, const void *v_cache, const int64_t *slot,
    const int64_t *lens, int64_t len, int64_t KVH, int64_t kvh, int64_t Dh, int bf16,
    float *scores, int64_t max_len, float *inv, void *out, const int64_t *out_off, const int G,
    const int per_row, const int64_t *firsts) {
    /* scores are computed over the first `len` keys for every row; with per_row (a constant
     * after inlining, 0 for decode) row g uses its first lens[g] <= len and writes at
     * out_off[g], else every row uses all `len` and row g writes at out_off[0] + g * Dh;
     * firsts (per_row only, NULL: none): row g's keys start at firsts[g] (a sliding window),
     * the keys before it get weight 0 */
    const int64_t row_bytes = Dh * (bf16 ? 2 : 4);
    int64_t j = 0;
    /* Four keys at a time: their G x 4 dot products reduce together (one horizontal pass
     * for four scores instead of one per score). */
    for (; j + 4 <= len; j += 4) {
        int64_t row[4];
        for (int i = 0; i < 4; i++) {
            row[i] = (slot[j + i] * KVH + kvh) * Dh;
            prefetch_row(k_cache, slot, j + i + KEYS_AHEAD, len, KVH, kvh, row_bytes);
        }
        __m512 dot[8][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) dot[g][i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < Dh; d += 16) {
            __m512 kvec[4];
            for (int i = 0; i < 4; i++) kvec[i] = attn_load16(k_cache, bf16, row[i] + d);
            for (int g = 0; g < G; g++) {
                const __m512 qg = _mm512_loadu_ps(qv + g * Dh + d);
                for (int i = 0; i < 4; i++) dot[g][i] = _mm512_fmadd_ps(qg, kvec[i], dot[g][i]);
            }
        }
        for (int g = 0; g < G; g++)
            _mm_storeu_ps(scores + g * max_len + j,
                          attn_reduce4(dot[g][0], dot[g][1], dot[g][2], dot[g][3]));
    }
    for (; j < len; j++) {
        const int64_t row = (slot[j] * KVH + kvh) * Dh;
        prefetch_row(k_cache, slot, j + KEYS_AHEAD, len, KVH, kvh, row_bytes);
        __m512 dot[8];
        for (int g = 0; g < G; g++) dot[g] = _mm512_setzero_ps();
        for (int64_t d = 0; d < Dh; d += 16) {
            const __m512 kvec = attn_load16(k_cache, bf16, row + d);
            for (int g = 0; g < G; g++)
                dot[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qv + g * Dh + d), kvec, dot[g]);
        }
        for (int g = 0; g < G; g++) scores[g * max_len + j] = _mm512_reduce_add_ps(dot[g]);
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * max_len;
        const int64_t n = per_row ? lens[g] : len;
        const int64_t first = per_row && firsts ? firsts[g] : 0;
        for (int64_t j = 0; j < first; j++) sg[j] = 0.0f; /* behind this query's window */
        inv[g] = softmax_row(sg + first, n - first);
        if (per_row)
            for (int64_t j = n; j < len; j++) sg[j] = 0.0f; /* past this query: weight 0 */
    }
    for (int64_t d0 = 0; d0 < Dh; d0 += 64) {
        const int nv = (int)((Dh - d0) / 16 < 4 ? (Dh - d0) / 16 : 4);
        __m512 acc[8][4];
        for (int g = 0; g < G; g++)
            for (int v = 0; v < 4; v++) acc[g][v] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j++) {
            const int64_t row = (slot[j] * KVH + kvh) * Dh + d0;
            if (d0 == 0) prefetch_row(v_cache, slot, j + VALUES_AHEAD, len, KVH, kvh, row_bytes);
            __m512 vv[4];
            for (int v = 0; v < 4; v++)
                vv[v] = v < nv ? attn_load16(v_cache, bf16, row + 16 * v) : _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * max_len + j]);
                for (int v = 0; v < 4; v++) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 scale = _mm512_set1_ps(inv[g]);
            for (int v = 0; v < nv; v++) {
                const __m512 o = _mm512_mul_ps(acc[g][v], scale);
                const int64_t at = (per_row ? out_off[g] : out_off[0] + g * Dh) + d0 + 16 * v;
                if (bf16) {
                    float tmp[16];
                    _mm512_storeu_ps(tmp, o);
                    for (int i = 0; i < 16; i++) ((uint16_t *)out)[at + i] = f32_to_bf16(tmp[i]);
                } else {
                    _mm512_storeu_ps((float *)out + at, o);
                }
            }
        }
    }
}
#endif

/* Decode attention straight from the paged K/V cache (one query per sequence, GQA, no mask
 * beyond each sequence's length), float32 arithmetic, no gathered copy of the keys.
 * q, out (S, H, Dh) model dtype rows; caches (num_token_slots, KVH, Dh) model dtype;
 * kv_indices (S, >= max kv_len) token slots with row stride idx_stride; kv_lens (S) int32.
 * Returns the first bad sequence + 1 when a token slot is outside the cache, before writing.
 *
 * A work item is one (sequence, KV head) with its H / KVH query heads, in three passes: every
 * key row is read (and widened) once for the whole group into scores (group, len); the softmax
 * is one vectorised exp per score after the row maximum is known; every value row is read once
 * and added into the group's accumulators. The one-pass online softmax this replaced (two
 * scalar libm exps and an accumulator rescale per key and head) took 1.1-1.5x this kernel's
 * time on a decode call of a real 19M / 110M run (32 sequences x ~150 keys, 1 thread).
 * Pass 1 does little arithmetic per cache line and the step's GEMMs have evicted the cache:
 * without the prefetches below it waits on every miss (the page-table indirection defeats the
 * hardware prefetcher) and was slower than the one-pass kernel inside `generate`. */
static int64_t attention_rows(const void *q, const void *k_cache, const void *v_cache,
                              int64_t num_token_slots, const int64_t *kv_indices,
                              int64_t idx_stride, const int32_t *kv_lens, const int32_t *cu,
                              void *out, int64_t T, int64_t S, int64_t H, int64_t KVH, int64_t Dh,
                              float scale, int64_t window, int bf16, int nthreads) {
    int64_t max_len = 0;
    if (window < 0) return -2;
    if (cu != NULL && S == 0 && T != 0) return -2;
    for (int64_t s = 0; s < S; s++) {
        if (kv_lens[s] < 0) return -2;
        if (cu != NULL) { /* the sequence's queries are its last cu[s+1] - cu[s] tokens */
            const int64_t q_len = (int64_t)cu[s + 1] - cu[s];
            if (cu[0] != 0 || cu[S] != T || q_len < 0 || q_len > kv_lens[s]) return -2;
        }
        for (int64_t j = 0; j < kv_lens[s]; j++) {
            const int64_t t = kv_indices[s * idx_stride + j];
            if (t < 0 || t >= num_token_slots) return s + 1;
        }
        if (kv_lens[s] > max_len) max_len = kv_lens[s];
    }
    if (cu == NULL && T != S) return -2;
    const int64_t group = H / KVH;
    const int64_t per_block = group <= 8 ? 8 / group : 1; /* extend queries per AVX-512 item */
    int64_t failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* per thread, for `rows` query heads at once (the AVX-512 items take up to 8): scores
         * (rows, max_len); q and acc (rows, Dh); one widened row (Dh); 1 / softmax sum (rows) */
        const int64_t rows = cu == NULL || group > 8 ? group : 8;
        float *scratch = malloc(sizeof(float) * (rows * max_len + 2 * rows * Dh + Dh + rows));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *scores = scratch, *qv = scores + rows * max_len, *acc = qv + rows * Dh;
            float *row_f = acc + rows * Dh, *inv = row_f + Dh;
            /* dynamic: an extend's later queries see more keys than its first ones */
#pragma omp for collapse(2) schedule(dynamic, 4)
            for (int64_t r = 0; r < T; r++) {
                for (int64_t kvh = 0; kvh < KVH; kvh++) {
                    int64_t s = r, len;
                    if (cu == NULL) {
                        len = kv_lens[s];
                    } else { /* the sequence whose queries hold row r: cu[s] <= r < cu[s + 1] */
                        int64_t lo = 0, hi = S - 1;
                        while (lo < hi) {
                            const int64_t mid = (lo + hi + 1) / 2;
                            if (cu[mid] <= r) lo = mid; else hi = mid - 1;
                        }
                        s = lo;
                        /* causal: the query at position kv_len - q_len + i sees keys 0..that */
                        len = kv_lens[s] - (cu[s + 1] - cu[s]) + (r - cu[s]) + 1;
                    }
                    const int64_t h0 = kvh * group;
                    const int64_t *slot = kv_indices + s * idx_stride;
                    /* a sliding window (extend only): this row's keys start at len - window;
                     * the keys before the first one any query of the item reads are skipped
                     * (their slots may have been released), and `len` counts from there */
                    const int64_t skipped = window && len > window ? len - window : 0;
                    slot += skipped;
                    len -= skipped;
#if defined(__AVX512F__)
                    if (Dh % 16 == 0 && group <= 8) {
                        /* An extend's query r leads a block of `per_block` consecutive queries
                         * of its sequence, which share every key row they read (the others
                         * are done by their block's leader). */
                        int64_t lens[8], out_off[8];
                        if (cu == NULL) { /* decode: one query, its group's heads side by side */
                            out_off[0] = (r * H + h0) * Dh;
                            for (int64_t v = 0; v < group; v++)
                                for (int64_t d = 0; d < Dh; d++)
                                    qv[v * Dh + d] = load_any(q, bf16, out_off[0] + v * Dh + d) * scale;
                            switch (group) { /* a constant row count per copy: registers */
#define ITEM(G)                                                                                   \
    case G:                                                                                        \
        attend_item_avx512(qv, k_cache, v_cache, slot, lens, len, KVH, kvh, Dh, bf16, scores,     \
                           max_len, inv, out, out_off, G, 0, NULL);                                \
        break;
                                ITEM(1) ITEM(2) ITEM(3) ITEM(4) ITEM(5) ITEM(6) ITEM(7) ITEM(8)
#undef ITEM
                            }
                            continue;
                        }
                        if ((r - cu[s]) % per_block) continue;
                        const int64_t nq = cu[s + 1] - r < per_block ? cu[s + 1] - r : per_block;
                        int64_t firsts[8];
                        for (int64_t i = 0; i < nq; i++)
                            for (int64_t g = 0; g < group; g++) {
                                const int64_t v = i * group + g, row = ((r + i) * H + h0 + g) * Dh;
                                lens[v] = len + i;
                                /* query i's window starts i keys after the leader's */
                                firsts[v] = window && len + i > window ? len + i - window : 0;
                                out_off[v] = row;
                                for (int64_t d = 0; d < Dh; d++)
                                    qv[v * Dh + d] = load_any(q, bf16, row + d) * scale;
                            }
                        switch (nq * group) {
#define ITEM(G)                                                                                   \
    case G:                                                                                        \
        attend_item_avx512(qv, k_cache, v_cache, slot, lens, len + nq - 1, KVH, kvh, Dh, bf16,    \
                           scores, max_len, inv, out, out_off, G, 1, window ? firsts : NULL);      \
        break;
                            ITEM(1) ITEM(2) ITEM(3) ITEM(4) ITEM(5) ITEM(6) ITEM(7) ITEM(8)
#undef ITEM
                        }
                        continue;
                    }
#endif
                    for (int64_t g = 0; g < group; g++)
                        for (int64_t d = 0; d < Dh; d++) {
                            qv[g * Dh + d] = load_any(q, bf16, (r * H + h0 + g) * Dh + d) * scale;
                            acc[g * Dh + d] = 0.0f;
                        }
                    const int64_t row_bytes = Dh * (bf16 ? 2 : 4);
                    for (int64_t j = 0; j < len; j++) {
                        const int64_t row = (slot[j] * KVH + kvh) * Dh;
                        prefetch_row(k_cache, slot, j + KEYS_AHEAD, len, KVH, kvh, row_bytes);
                        const float *kr = (const float *)k_cache + row;
                        if (bf16) {
                            const uint16_t *kb = (const uint16_t *)k_cache + row;
#pragma omp simd
                            for (int64_t d = 0; d < Dh; d++) row_f[d] = bf16_to_f32(kb[d]);
                            kr = row_f;
                        }
                        for (int64_t g = 0; g < group; g++) {
                            const float *qg = qv + g * Dh;
                            float score = 0.0f;
#pragma omp simd reduction(+ : score)
                            for (int64_t d = 0; d < Dh; d++) score += qg[d] * kr[d];
                            scores[g * max_len + j] = score;
                        }
                    }
                    for (int64_t g = 0; g < group; g++) inv[g] = softmax_row(scores + g * max_len, len);
                    for (int64_t j = 0; j < len; j++) {
                        const int64_t row = (slot[j] * KVH + kvh) * Dh;
                        prefetch_row(v_cache, slot, j + VALUES_AHEAD, len, KVH, kvh, row_bytes);
                        const float *vr = (const float *)v_cache + row;
                        if (bf16) {
                            const uint16_t *vb = (const uint16_t *)v_cache + row;
#pragma omp simd
                            for (int64_t d = 0; d < Dh; d++) row_f[d] = bf16_to_f32(vb[d]);
                            vr = row_f;
                        }
                        for (int64_t g = 0; g < group; g++) {
                            const float p = scores[g * max_len + j];
                            float *ag = acc + g * Dh;
#pragma omp simd
                            for (int64_t d = 0; d < Dh; d++) ag[d] += p * vr[d];
                        }
                    }
                    for (int64_t g = 0; g < group; g++)
                        for (int64_t d = 0; d < Dh; d++)
                            store_any(out, bf16, (r * H + h0 + g) * Dh + d, acc[g * Dh + d] * inv[g]);
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

int64_t baton_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                               int64_t num_token_slots, const int64_t *kv_indices,
                               int64_t idx_stride, const int32_t *kv_lens, void *out, int64_t S,
                               int64_t H, int64_t KVH, int64_t Dh, float scale, int bf16,
                               int nthreads) {
    return attention_rows(q, k_cache, v_cache, num_token_slots, kv_indices, idx_stride, kv_lens,
                          NULL, out, S, S, H, KVH, Dh, scale, 0, bf16, nthreads);
}

/* Extend (prefill) attention, causal, straight from the paged cache: the queries of sequence s
 * are rows cu[s]..cu[s+1] of q / out (T, H, Dh), the last cu[s+1] - cu[s] of its kv_lens[s]
 * tokens (whose K/V are in the cache already); the same work items as decode, one per query
 * row and KV head. window > 0: each query sees only the last `window` keys up to its own
 * position (sliding-window attention; the slots behind every window are never read), 0: all.
 * Returns as baton_decode_attention, and -2 for query offsets that do not fit the lengths. */
int64_t baton_extend_attention(const void *q, const void *k_cache, const void *v_cache,
                               int64_t num_token_slots, const int64_t *kv_indices,
                               int64_t idx_stride, const int32_t *kv_lens, const int32_t *cu,
                               void *out, int64_t T, int64_t S, int64_t H, int64_t KVH, int64_t Dh,
                               float scale, int64_t window, int bf16, int nthreads) {
    return attention_rows(q, k_cache, v_cache, num_token_slots, kv_indices, idx_stride, kv_lens,
                          cu, out, T, S, H, KVH, Dh, scale, window, bf16, nthreads);
}
