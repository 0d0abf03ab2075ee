/* RecurrentGemma's recurrent block on the CPU for baton: the fused decode step of its conv and
 * RG-LRU (kernels/cpu/rglru.py calls it; kernels/rglru.py is the torch path it agrees with to
 * float32 rounding). Per row r (one token) and LRU channel c of width W = H * bw:
 *
 *   window = [conv_pool[slot, c, 0 .. K-2] | x_c];  u_c = sum_k window_k w_ck + b_c
 *   conv_pool[slot, c] <- window[1 .. K-1]
 *   i_c = sigmoid(bi_c + sum_j u_(h bw + j) Wi[h, j, c - h bw])     (h = c / bw; block diagonal)
 *   r_c = sigmoid(br_c + sum_j u_(h bw + j) Wr[h, j, c - h bw])
 *   log_a = (-8 r_c) softplus(lambda_c);  a = exp(log_a);  m = sqrt(1 - exp(2 log_a))
 *   h_c <- a h_c + (u_c i_c) m                    (state float32, in its pool slot)
 *   y_c = h_c
 *
 * A decode token is never at position 0, so the reset of a sequence's first token does not
 * apply here. Values the torch path holds in the model dtype (the conv's output, the gates, the
 * normalised input, y) are rounded to it when bf16 is set. Rows are independent: one thread per
 * row. Slots are checked before anything is written: the first bad row + 1 is returned, else 0.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

static inline float load_any(const void *base, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_any(void *base, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

static inline float round_to(int bf16, float v) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

int64_t baton_rglru_decode(const void *x, void *conv_pool, float *state_pool, int64_t num_slots,
                           const int64_t *slots, int64_t batch, const float *conv_w,
                           const float *conv_b, int64_t K, const float *input_w,
                           const float *input_b, const float *recurrent_w,
                           const float *recurrent_b, const float *softplus_lambda, float *u,
                           void *y, int bf16, int64_t H, int64_t bw, int nthreads) {
    for (int64_t r = 0; r < batch; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return r + 1;
    const int64_t W = H * bw, km1 = K - 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < batch; r++) {
        const int64_t slot = slots[r];
        float *ur = u + r * W;
        for (int64_t c = 0; c < W; c++) {
            const int64_t base = (slot * W + c) * km1;
            const float xc = load_any(x, bf16, r * W + c);
            float acc = 0.0f;
            for (int64_t k = 0; k < km1; k++) acc += load_any(conv_pool, bf16, base + k) * conv_w[c * K + k];
            acc += xc * conv_w[c * K + km1];
            for (int64_t k = 0; k + 1 < km1; k++)
                store_any(conv_pool, bf16, base + k, load_any(conv_pool, bf16, base + k + 1));
            if (km1 > 0) store_any(conv_pool, bf16, base + km1 - 1, xc);
            ur[c] = round_to(bf16, round_to(bf16, acc) + conv_b[c]);
        }
        float *state = state_pool + slot * W;
        for (int64_t h = 0; h < H; h++) {
            const float *uh = ur + h * bw;
            const float *wi = input_w + h * bw * bw, *wr = recurrent_w + h * bw * bw;
            for (int64_t j = 0; j < bw; j++) {
                const int64_t c = h * bw + j;
                float gi = input_b[c], gr = recurrent_b[c];
                for (int64_t i = 0; i < bw; i++) {
                    gi += uh[i] * wi[i * bw + j];
                    gr += uh[i] * wr[i * bw + j];
                }
                const float ig = round_to(bf16, sigmoidf(round_to(bf16, gi)));
                const float rg = round_to(bf16, sigmoidf(round_to(bf16, gr)));
                const float log_a = round_to(bf16, round_to(bf16, -8.0f * rg) * softplus_lambda[c]);
                const float a = round_to(bf16, expf(log_a));
                const float m = round_to(bf16, sqrtf(round_to(bf16, 1.0f - round_to(bf16, expf(2.0f * log_a)))));
                const float normed = round_to(bf16, round_to(bf16, uh[j] * ig) * m);
                state[c] = a * state[c] + normed;
                store_any(y, bf16, r * W + c, state[c]);
            }
        }
    }
    return 0;
}
