/* Batched LoRA on the CPU for baton (punica's bgmv: each row applies only its own slot's
 * adapter); kernels/cpu/lora.py calls it, kernels/lora.py's torch path agrees with it to float32
 * rounding. The slot table stacks every slot's A and (transposed, scaled) B, r = max_lora_rank
 * rows per slot (engine/lora/slots.py):
 *
 *   shrink:  low[t, p r + j] = sum_k x[t, k] A[p S r + s r + j, k]     s = slots[t] >= 0
 *            low[t, :] = 0                                              s = -1 (no adapter)
 *   expand:  out[t, c] += sum_j low[t, j] B[s r + j, c]                 rows with s = -1 untouched
 *
 * A: (parts * S * r, in), the parts of a fused projection (q|k|v, gate|up) stacked part-major;
 * B: (S * r, n) one part's; low: (T, parts * r) float32, so a fused projection shrinks once and
 * expands each part into its column range of out (a strided view: out_stride elements per row).
 * x and out are float32 or bf16 (x_bf16 / out_bf16), A and B the table's dtype (w_bf16);
 * products accumulate in float32 and out is rounded once. Slots are checked before anything is
 * written: the first bad row + 1 is returned, else 0.
 *
 * Threads: shrink over (row, part, rank row) dot products, expand over (row, block of NB
 * columns); rows without an adapter cost nothing. */
#include <stdint.h>
#include <string.h>

#include "common.h"

#define NB 256 /* output columns per expand task */

static int64_t check_slots(const int64_t *slots, int64_t T, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return t + 1;
    return 0;
}

/* low (T, parts * r) float32 := each row's x through its own slot's A of every part. */
int64_t baton_lora_shrink(const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t width,
                          const void *a_rows, int w_bf16, int64_t num_slots, int64_t rank,
                          int64_t parts, const int64_t *slots, float *low, int nthreads) {
    const int64_t bad = check_slots(slots, T, num_slots);
    if (bad) return bad;
    const int64_t cols = parts * rank;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t task = 0; task < T * cols; task++) {
        const int64_t t = task / cols, pj = task % cols, p = pj / rank, j = pj % rank;
        const int64_t s = slots[t];
        low[task] = s < 0 ? 0.0f
                          : mixed_dot(x, x_bf16, t * x_stride, a_rows, w_bf16,
                                ((p * num_slots + s) * rank + j) * width, width);
    }
    return 0;
}

/* out[t, :n] += low[t, :r] @ B[s r : (s + 1) r] for every row with a slot; low's row stride is
 * low_stride (a part's columns of a fused shrink start at low + p r). */
int64_t baton_lora_expand(const float *low, int64_t low_stride, int64_t T, const void *b_rows,
                          int w_bf16, int64_t num_slots, int64_t rank, int64_t n,
                          const int64_t *slots, void *out, int64_t out_stride, int out_bf16,
                          int nthreads) {
    const int64_t bad = check_slots(slots, T, num_slots);
    if (bad) return bad;
    const int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t task = 0; task < T * blocks; task++) {
        const int64_t t = task / blocks, c0 = (task % blocks) * NB;
        const int64_t s = slots[t], nc = n - c0 < NB ? n - c0 : NB;
        if (s < 0) continue;
        float acc[NB];
        memset(acc, 0, sizeof(acc));
        for (int64_t j = 0; j < rank; j++) {
            const float l = low[t * low_stride + j];
            const int64_t at = (s * rank + j) * n + c0;
            if (w_bf16) {
                const uint16_t *row = (const uint16_t *)b_rows + at;
#pragma omp simd
                for (int64_t c = 0; c < nc; c++) acc[c] += l * bf16_to_f32(row[c]);
            } else {
                const float *row = (const float *)b_rows + at;
#pragma omp simd
                for (int64_t c = 0; c < nc; c++) acc[c] += l * row[c];
            }
        }
        const int64_t at = t * out_stride + c0;
        if (out_bf16) {
            uint16_t *dst = (uint16_t *)out + at;
            for (int64_t c = 0; c < nc; c++) dst[c] = f32_to_bf16(bf16_to_f32(dst[c]) + acc[c]);
        } else {
            float *dst = (float *)out + at;
#pragma omp simd
            for (int64_t c = 0; c < nc; c++) dst[c] += acc[c];
        }
    }
    return 0;
}
