/* Mamba1 selective scan on the CPU for baton (built at first use by kernels/cpu/mamba1.py).
 *
 * The recurrence of kernels/selective_scan.py, per channel d and state index n:
 *   h[d, n] = exp(delta A[d, n]) h[d, n] + delta x B[n];  y = h[d, :] . C + D[d] x
 * times silu(z) when a gate is given. delta = softplus(dt + dt_bias) comes discretised (torch's
 * vectorised softplus: one libm log1p/exp pair per element here cost more than the scan).
 * with the state held in its pool slot (num_slots, d_inner, d_state), read there first and left
 * there last. Each OpenMP task owns one (sequence, block of CHANNELS channels): its block of the
 * state (CHANNELS x d_state floats) stays in L1 while the task walks the sequence's tokens, and a
 * token costs 2 d_state FMA and one exp per (channel, state) pair, the same work as the torch
 * step loop without its per-step dispatch and state round trips through memory.
 *
 * Prefill follows the aligned chunk grid of kernels/ssd.py: the state after every token that ends
 * a chunk (absolute position + 1 a multiple of L) is copied to chunk_states[s, chunk], and chunks
 * at or past the sequence's end hold its final state (what the torch path's padded no-op steps
 * leave there).
 *
 * Layouts: rows of x, delta, z (T, d_inner), B, C (T, d_state) with the given row strides and unit
 * column stride (views into the projections' outputs need no copy); y (T, d_inner) contiguous;
 * chunk_states (S, Cn, d_inner, d_state) contiguous or NULL. Slots are checked before anything is
 * written: the first bad row + 1 comes back, 0 when all are in range.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define CHANNELS 16

/* One token of one channel: its state row (N) updated in place; returns h . C. */
static inline __attribute__((always_inline)) float step(float *h, const float *Ad, float delta,
                                                         float u, const float *Bt, const float *Ct,
                                                         int64_t N) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < N; n++) {
        const float v = h[n] * exp_approx(delta * Ad[n]) + u * Bt[n];
        h[n] = v;
        acc += v * Ct[n];
    }
    return acc;
}

int64_t baton_mamba1_scan(const float *x, int64_t x_stride, const float *delta,
                          int64_t delta_stride, const float *A, const float *B, const float *C,
                          int64_t bc_stride, const float *D, const float *z, int64_t z_stride,
                          float *pool, int64_t num_slots, const int64_t *slots,
                          const int64_t *cu_seqlens, const int64_t *start_pos, int64_t num_seqs,
                          float *y, float *chunk_states, int64_t num_chunks, int64_t Dm, int64_t N,
                          int64_t L, int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t blocks = (Dm + CHANNELS - 1) / CHANNELS;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < num_seqs * blocks; task++) {
        const int64_t s = task / blocks, d0 = (task % blocks) * CHANNELS;
        const int64_t nb = Dm - d0 < CHANNELS ? Dm - d0 : CHANNELS;
        const int64_t t0 = cu_seqlens[s], n = cu_seqlens[s + 1] - t0, offset = start_pos[s] % L;
        float *h = pool + (slots[s] * Dm + d0) * N; /* the block's rows, contiguous */
        float *cs = chunk_states ? chunk_states + s * num_chunks * Dm * N : NULL;
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = t0 + j;
            const float *Bt = B + t * bc_stride, *Ct = C + t * bc_stride;
            for (int64_t c = 0; c < nb; c++) {
                const int64_t d = d0 + c;
                const float xv = x[t * x_stride + d];
                const float dl = delta[t * delta_stride + d];
                float out = step(h + c * N, A + d * N, dl, dl * xv, Bt, Ct, N) + D[d] * xv;
                if (z) out *= silu(z[t * z_stride + d]);
                y[t * Dm + d] = out;
            }
            if (cs && (offset + j + 1) % L == 0)
                memcpy(cs + ((offset + j) / L * Dm + d0) * N, h, sizeof(float) * nb * N);
        }
        if (cs)
            for (int64_t k = (offset + n) / L; k < num_chunks; k++)
                memcpy(cs + (k * Dm + d0) * N, h, sizeof(float) * nb * N);
    }
    return 0;
}

/* One decode token per row: x, delta, z (batch, d_inner) contiguous (z may be NULL), B, C (batch,
 * d_state) contiguous, y (batch, d_inner). Padded rows point at dummy slot 0 and write only
 * there. */
int64_t baton_mamba1_update(float *pool, int64_t num_slots, const int64_t *slots, int64_t batch,
                            const float *x, const float *delta, const float *A,
                            const float *B, const float *C, const float *D, const float *z,
                            float *y, int64_t Dm, int64_t N, int nthreads) {
    for (int64_t b = 0; b < batch; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return b + 1;
    const int64_t blocks = (Dm + CHANNELS - 1) / CHANNELS;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (batch * Dm * N > 16384)
    for (int64_t task = 0; task < batch * blocks; task++) {
        const int64_t b = task / blocks, d0 = (task % blocks) * CHANNELS;
        const int64_t d1 = Dm - d0 < CHANNELS ? Dm : d0 + CHANNELS;
        for (int64_t d = d0; d < d1; d++) {
            const int64_t i = b * Dm + d;
            float out = step(pool + (slots[b] * Dm + d) * N, A + d * N, delta[i], delta[i] * x[i],
                             B + b * N, C + b * N, N) +
                        D[d] * x[i];
            if (z) out *= silu(z[i]);
            y[i] = out;
        }
    }
    return 0;
}
