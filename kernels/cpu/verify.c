/* The fused CPU Mamba2 step of a speculative verify (built at first use by kernels/cpu/verify.py):
 * q tokens per request, from the in_proj output to the out_proj input, keeping the conv window
 * and the SSM state after EACH token in its own pool slot so the engine can keep the state of
 * whichever position acceptance stops at (no replay, no copy).
 *
 *   slots (batch, q + 1): column 0 is read, column i + 1 receives the state after token i
 *   (for baton's verify: [working, working, scratch_1 .. scratch_{q-1}]: token 0 in place)
 *
 * Each (request, head, state row) keeps its dstate-vector in registers across the q tokens:
 * one read of the old state, q writes, against one read and one write of a decode step.
 * Semantics are kernels/cpu/ops.c's baton_mamba_decode applied q times in a row. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAX_KM1 63 /* conv window (K - 1), kernels/cpu/ops.py's MAX_CONV_KERNEL - 1 */
#define MAX_STATE 512 /* dstate: one state row lives on the stack */
#define MAX_TOKENS 64 /* q: a verify feeds k + 1 <= 17 tokens per request */

static int64_t check_table(const int64_t *slots, int64_t n, int64_t num_slots) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return i + 1;
    return 0;
}

/* zxbcdt: (batch * q, row_stride) model dtype rows [z (I) | xBC (conv_dim) | dt (H)], request b's
 * tokens at rows b * q .. b * q + q - 1; conv pool (num_slots, conv_dim, K-1) model dtype; ssm
 * pool (num_slots, H, P, N) float32; conv_w (conv_dim, K), conv_b, dt_bias, A, D, norm_w
 * float32; xbc (batch * q, conv_dim), y (batch * q, I) float32 scratch; out (batch * q, I) model
 * dtype. norm_mode as baton_mamba_decode: 0 norm(y * silu(z)), 1 norm(y) * silu(z), 2 none.
 * Returns 0, or the first bad slot-table entry + 1 (nothing written then). */
int64_t baton_mamba_verify(const void *zxbcdt, int64_t row_stride, void *conv_pool,
                           float *ssm_pool, int64_t num_slots, const int64_t *slots,
                           int64_t batch, int64_t q, const float *conv_w, const float *conv_b,
                           const float *dt_bias, const float *A, const float *D, float dt_min,
                           float dt_max, const float *norm_w, float eps, float *xbc, float *y,
                           void *out, int bf16, int64_t I, int64_t H, int64_t P, int64_t N,
                           int64_t G, int64_t K, int64_t norm_group, int64_t norm_mode,
                           int nthreads) {
    int64_t bad = check_table(slots, batch * (q + 1), num_slots);
    if (bad) return bad;
    if (K - 1 > MAX_KM1 || N > MAX_STATE || q > MAX_TOKENS) return -1;
    const int64_t conv_dim = I + 2 * G * N, km1 = K - 1, heads_per_group = H / G;
    const int64_t num_norm_groups = I / norm_group, rows = batch * q;
#pragma omp parallel num_threads(nthreads)
    {
        /* 1. conv + SiLU per (request, channel): the window walks through the q tokens. */
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t c = 0; c < conv_dim; c++) {
                const int64_t *row_slots = slots + b * (q + 1);
                float window[MAX_KM1];
                for (int64_t k = 0; k < km1; k++)
                    window[k] = load_any(conv_pool, bf16, (row_slots[0] * conv_dim + c) * km1 + k);
                const float *wc = conv_w + c * K;
                for (int64_t i = 0; i < q; i++) {
                    const int64_t r = b * q + i;
                    const float xin = load_any(zxbcdt, bf16, r * row_stride + I + c);
                    float acc = conv_b[c];
                    for (int64_t k = 0; k < km1; k++) acc += window[k] * wc[k];
                    acc += xin * wc[km1];
                    for (int64_t k = 0; k + 1 < km1; k++) window[k] = window[k + 1];
                    if (km1) window[km1 - 1] = round_to(bf16, xin);
                    const int64_t at = (row_slots[i + 1] * conv_dim + c) * km1;
                    for (int64_t k = 0; k < km1; k++) store_any(conv_pool, bf16, at + k, window[k]);
                    xbc[r * conv_dim + c] = round_to(bf16, silu(round_to(bf16, acc)));
                }
            }
        }
        /* 2. selective state update per (request, head): each state row through the q tokens,
         * written to its slot after every token. */
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < H; h++) {
                const int64_t *row_slots = slots + b * (q + 1);
                const int64_t g = h / heads_per_group;
                float dts[MAX_TOKENS], decays[MAX_TOKENS];
                for (int64_t i = 0; i < q; i++) {
                    float dt = load_any(zxbcdt, bf16, (b * q + i) * row_stride + I + conv_dim + h) +
                               dt_bias[h];
                    dt = dt > 20.0f ? dt : log1pf(expf(dt)); /* softplus, torch's threshold */
                    dts[i] = dt < dt_min ? dt_min : (dt > dt_max ? dt_max : dt);
                    decays[i] = expf(dts[i] * A[h]);
                }
                for (int64_t p = 0; p < P; p++) {
                    float state[MAX_STATE];
                    memcpy(state, ssm_pool + ((row_slots[0] * H + h) * P + p) * N,
                           N * sizeof(float));
                    for (int64_t i = 0; i < q; i++) {
                        const int64_t r = b * q + i;
                        const float xv = xbc[r * conv_dim + h * P + p];
                        const float xdt = xv * dts[i];
                        const float *Bv = xbc + r * conv_dim + I + g * N;
                        const float *Cv = xbc + r * conv_dim + I + G * N + g * N;
                        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                        for (int64_t n = 0; n < N; n++) {
                            const float s = state[n] * decays[i] + xdt * Bv[n];
                            state[n] = s;
                            acc += s * Cv[n];
                        }
                        memcpy(ssm_pool + ((row_slots[i + 1] * H + h) * P + p) * N, state,
                               N * sizeof(float));
                        y[r * I + h * P + p] = round_to(bf16, acc + D[h] * xv);
                    }
                }
            }
        }
        /* 3. the gate and the grouped RMS norm per token row, as baton_mamba_decode. */
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t grp = 0; grp < num_norm_groups; grp++) {
                float *yg = y + r * I + grp * norm_group;
                const int64_t zoff = r * row_stride + grp * norm_group;
                const int64_t o = r * I + grp * norm_group;
                if (norm_mode == 2) {
                    for (int64_t i = 0; i < norm_group; i++)
                        store_any(out, bf16, o + i, yg[i] * silu(load_any(zxbcdt, bf16, zoff + i)));
                    continue;
                }
                float ss = 0.0f;
                if (norm_mode == 0) {
                    for (int64_t i = 0; i < norm_group; i++) {
                        const float hv = yg[i] * silu(load_any(zxbcdt, bf16, zoff + i));
                        yg[i] = hv;
                        ss += hv * hv;
                    }
                } else {
                    for (int64_t i = 0; i < norm_group; i++) ss += yg[i] * yg[i];
                }
                const float inv = 1.0f / sqrtf(ss / (float)norm_group + eps);
                const float *wg = norm_w + grp * norm_group;
                for (int64_t i = 0; i < norm_group; i++) {
                    float v;
                    if (norm_mode == 1)
                        v = (wg[i] * (yg[i] * inv)) * silu(load_any(zxbcdt, bf16, zoff + i));
                    else
                        v = bf16 ? wg[i] * round_to(1, yg[i] * inv) : wg[i] * (yg[i] * inv);
                    store_any(out, bf16, o + i, v);
                }
            }
        }
    }
    return 0;
}
