/* Lightning attention (MiniMax) on the CPU for baton: the threaded scan on pool slots that
 * kernels/cpu/lightning.py calls for prefill and decode (kernels/lightning.py is the torch path it
 * agrees with to float32 rounding). Per head h, with the constant ratio g = exp(-lambda_h):
 *   S <- g S + k v^T;  o = q^T S
 * rewritten so that each token reads and writes the state once:
 *   o = g (q^T S_old) + (q . k) v,  row i of S: S_i <- g S_i + k_i v
 * The columns of a head's state evolve independently, so a task is one (sequence, head, block of
 * BV columns) whose dk x BV block stays in L1 across the sequence's tokens; tasks need no
 * synchronisation.
 *
 * With chunk_states, the block is also copied at every end of an aligned chunk (the chunk grid of
 * kernels/ssd.py) and at the sequence's last token; chunks past the sequence's end repeat its final
 * state. Rows whose slot is 0 are decode padding when skip_padding is set: no read, no write,
 * o = 0. Slots are checked before anything is written: the first bad row + 1 is returned, else 0.
 *
 * baton_lightning_decode is the layer's whole decode step on one rank (SiLU, the step, the output
 * norm and gate) over the same per-token update.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define BV 32 /* state columns per task */

static inline void copy_block(float *dst, const float *S, int64_t dk, int64_t dv, int64_t nc) {
    for (int64_t i = 0; i < dk; i++) memcpy(dst + i * dv, S + i * dv, nc * sizeof(float));
}

static inline __attribute__((always_inline)) void lightning_token(float *S, int64_t ld,
                                                                  const float *q, const float *k,
                                                                  const float *v, float ratio,
                                                                  float *o, int64_t dk,
                                                                  const int64_t nc) {
    float qs[BV] = {0};
    float qk = 0.0f;
    for (int64_t i = 0; i < dk; i++) qk += q[i] * k[i];
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * ld;
        const float qi = q[i], ki = k[i];
#pragma omp simd
        for (int64_t c = 0; c < nc; c++) {
            qs[c] += qi * row[c];
            row[c] = ratio * row[c] + ki * v[c];
        }
    }
#pragma omp simd
    for (int64_t c = 0; c < nc; c++) o[c] = ratio * qs[c] + qk * v[c];
}

/* q, k (T, H, dk); v, o (T, H, dv): float32, contiguous; ratio (H,) = exp(-lambda). pool
 * (num_slots, H, dk, dv) float32; sequence s is tokens cu[s]..cu[s+1], starts from (and leaves its
 * final state in) pool[slots[s]]. chunk_states (S, num_chunks_out, H, dk, dv) or NULL (then
 * start_pos and chunk are unused). */
int64_t baton_lightning_scan(const float *q, const float *k, const float *v, const float *ratio,
                             float *pool, int64_t num_slots, const int64_t *slots,
                             const int64_t *cu, const int64_t *start_pos, int64_t num_seqs,
                             int64_t chunk, float *chunk_states, int64_t num_chunks_out,
                             int skip_padding, float *o, int64_t H, int64_t dk, int64_t dv,
                             int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t blocks = (dv + BV - 1) / BV, tasks = num_seqs * H * blocks, state = dk * dv;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = task / (H * blocks), h = (task / blocks) % H;
        const int64_t c0 = (task % blocks) * BV, nc = dv - c0 < BV ? dv - c0 : BV;
        const int64_t t0 = cu[s], n = cu[s + 1] - t0;
        if (skip_padding && slots[s] == 0) {
            for (int64_t t = t0; t < t0 + n; t++)
                memset(o + (t * H + h) * dv + c0, 0, nc * sizeof(float));
            continue;
        }
        float *S = pool + (slots[s] * H + h) * state + c0;
        float *cs = chunk_states ? chunk_states + s * num_chunks_out * H * state : NULL;
        const int64_t offset = cs ? start_pos[s] % chunk : 0;
        int64_t written = 0; /* chunks whose end state is stored */
        for (int64_t j = 0; j < n; j++) {
            const int64_t th = (t0 + j) * H + h;
            lightning_token(S, dv, q + th * dk, k + th * dk, v + th * dv + c0, ratio[h],
                            o + th * dv + c0, dk, nc);
            if (cs && ((offset + j + 1) % chunk == 0 || j == n - 1)) {
                copy_block(cs + (written * H + h) * state + c0, S, dk, dv, nc);
                written++;
            }
        }
        for (; cs && written < num_chunks_out; written++)
            copy_block(cs + (written * H + h) * state + c0, S, dk, dv, nc);
    }
    return 0;
}

/* One fused decode step of MiniMax's lightning attention layer, from the projections to the
 * out_proj input (one rank: the output norm spans every head):
 *   q | k | v = silu(qkv_in)                 per head [q_h | k_h | v_h], rounded to the dtype
 *   o = g (q^T S) + (q . k) v,  S <- g S + k v^T    (state[slot], float32), o rounded
 *   out = sigmoid(gate) * (norm_w * rmsnorm(o))     over the row's H d values, eps `eps`
 * rounded where the torch path (engine/layers/lightning_attention.py) rounds. qkv (batch, 3 H d)
 * and gate (batch, H d): model-dtype rows with their own row strides; norm_w (H d) model dtype;
 * ratio (H) = exp(-lambda); pool (num_slots, H, d, d) float32; o (batch, H d) float32 scratch;
 * out (batch, H d) model dtype. Rows with slot 0 are padding: no read, no write, out = 0. */
int64_t baton_lightning_decode(const void *qkv, int64_t qkv_stride, const void *gate,
                               int64_t gate_stride, const void *norm_w, const float *ratio,
                               float *pool, int64_t num_slots, const int64_t *slots, int64_t batch,
                               float eps, float *o, void *out, int bf16, int64_t H, int64_t d,
                               int nthreads) {
    for (int64_t r = 0; r < batch; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return r + 1;
    const int64_t W = H * d;
    if (d > 256) return -1; /* the per-head vectors below live on the stack */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            for (int64_t h = 0; h < H; h++) {
                if (slots[r] == 0) continue;
                float q[256], k[256], v[256];
                const int64_t in = r * qkv_stride + h * 3 * d;
                for (int64_t i = 0; i < d; i++) {
                    q[i] = round_to(bf16, silu(load_any(qkv, bf16, in + i)));
                    k[i] = round_to(bf16, silu(load_any(qkv, bf16, in + d + i)));
                    v[i] = round_to(bf16, silu(load_any(qkv, bf16, in + 2 * d + i)));
                }
                float *S = pool + (slots[r] * H + h) * d * d, *oh = o + r * W + h * d;
                for (int64_t c0 = 0; c0 < d; c0 += BV)
                    lightning_token(S + c0, d, q, k, v + c0, ratio[h], oh + c0, d,
                                    d - c0 < BV ? d - c0 : BV);
                for (int64_t i = 0; i < d; i++) oh[i] = round_to(bf16, oh[i]);
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            const float *orow = o + r * W;
            if (slots[r] == 0) {
                for (int64_t c = 0; c < W; c++) store_any(out, bf16, r * W + c, 0.0f);
                continue;
            }
            float squares = 0.0f;
            for (int64_t c = 0; c < W; c++) squares += orow[c] * orow[c];
            const float scale = 1.0f / sqrtf(squares / (float)W + eps);
            for (int64_t c = 0; c < W; c++) {
                const float normed = round_to(bf16, orow[c] * scale);
                const float y = round_to(bf16, load_any(norm_w, bf16, c) * normed);
                const float g = load_any(gate, bf16, r * gate_stride + c);
                const float s = round_to(bf16, 1.0f / (1.0f + expf(-g)));
                store_any(out, bf16, r * W + c, s * y);
            }
        }
    }
    return 0;
}
