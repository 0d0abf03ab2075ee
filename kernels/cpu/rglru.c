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
#include <string.h>

#include "common.h"

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

#define BW 64 /* channels per scan task */

/* The RG-LRU's diagonal scan for packed sequences on pool slots (prefill): h <- a h + u per
 * channel, y = h. a, u (T, W) float32, contiguous (rglru_inputs' values); pool (num_slots, W)
 * float32; sequence s is tokens cu[s]..cu[s+1], starts from (and leaves its final state in)
 * pool[slots[s]]. chunk_states (S, num_chunks_out, W): the state at every end of an aligned chunk
 * and at the sequence's last token, repeated into the chunks past its end. y (T, W) float32. A task
 * is one (sequence, block of BW channels). */
int64_t baton_rglru_scan(const float *a, const float *u, float *pool, int64_t num_slots,
                         const int64_t *slots, const int64_t *cu, const int64_t *start_pos,
                         int64_t num_seqs, int64_t chunk, float *chunk_states,
                         int64_t num_chunks_out, float *y, int64_t W, int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t blocks = (W + BW - 1) / BW, tasks = num_seqs * blocks;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = task / blocks, c0 = (task % blocks) * BW;
        const int64_t nc = W - c0 < BW ? W - c0 : BW;
        const int64_t t0 = cu[s], n = cu[s + 1] - t0, offset = start_pos[s] % chunk;
        float h[BW];
        float *state = pool + slots[s] * W + c0;
        float *cs = chunk_states + s * num_chunks_out * W + c0;
        memcpy(h, state, nc * sizeof(float));
        int64_t written = 0;
        for (int64_t j = 0; j < n; j++) {
            const int64_t at = (t0 + j) * W + c0;
#pragma omp simd
            for (int64_t c = 0; c < nc; c++) {
                h[c] = a[at + c] * h[c] + u[at + c];
                y[at + c] = h[c];
            }
            if ((offset + j + 1) % chunk == 0 || j == n - 1)
                memcpy(cs + (written++) * W, h, nc * sizeof(float));
        }
        for (; written < num_chunks_out; written++) memcpy(cs + written * W, h, nc * sizeof(float));
        memcpy(state, h, nc * sizeof(float));
    }
    return 0;
}
