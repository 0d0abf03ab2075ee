/* Weight-only quantized linears on the CPU: y = x @ W^T (* col) (+ bias) (relu), W read as the
 * checkpoint quantized it, FP8 (e4m3) or NVFP4 (e2m1), decoded in registers (cpu_quant.h), never
 * dequantized into memory. kernels/cpu_quant.py packs the weights and scales and says when this
 * runs.
 *
 * Packed layouts (16 output columns per block, pad columns zero; G inputs per scale group):
 *   fp8:   codes  [N/16][K][16]        uint8 (e4m3)
 *          scales [N/16][ceil(K/G)][16] float32: each column's scale for the group, times
 *                                       2^(120 - shift) (the decode's 2^-120, see the header)
 *   nvfp4: codes  [N/16][K/2][16]      uint8: byte (p, c) = the checkpoint's byte (row c, p),
 *                                       inputs 2p (low nibble) and 2p + 1 (high)
 *          scales [N/16][K/16][16]     uint8 (e4m3 group scales as stored)
 *   col    [N] float32 or NULL: multiplies each output (NVFP4's global scale weight_scale_2;
 *          FP8's 2^shift when the scales needed one)
 *
 * Work is cut as in cpu_gemm.c: each thread a contiguous run of blocks in tiles of 3 (the codes
 * read from memory once per call), an 8-row register block over all of K, the next tile
 * prefetched while one runs. x and y are float32 (kernels/cpu_quant.py widens a bf16 model's
 * rows and narrows the result); sums are float32 in k order.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_quant.h"

enum { FORMAT_FP8 = 0, FORMAT_NVFP4 = 1 };
#define TILE 3 /* blocks of 16 columns per tile */
#define MR 8   /* rows per register block */

int baton_qgemm_supported(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)

/* Prefetch line q of each block of the next tile at step `step` of `steps`: the row blocks of a
 * tile share the next tile's lines [pf_lo, pf_lo + pf_span) between them. */
#define PREFETCH_NEXT(step, NR)                                                                   \
    if (pf) {                                                                                   \
        const int64_t q = pf_lo + (int64_t)(((step) * pf_step) >> 16);                          \
        for (int j = 0; j < NR; j++)                                                            \
            _mm_prefetch((const char *)(pf + j * wstride + q * 64), _MM_HINT_T0);               \
    }

/* Multiply by the column scale, add the bias, relu, store the ncols columns left. */
#define EPILOGUE(ROWS, NR)                                                                      \
    for (int j = 0; j < NR; j++) {                                                              \
        const int64_t left = ncols - 16 * j;                                                    \
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);            \
        const __m512 cs = col ? _mm512_maskz_loadu_ps(mask, col + 16 * j) : _mm512_set1_ps(1.f); \
        const __m512 bs = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps(); \
        for (int r = 0; r < ROWS; r++) {                                                        \
            __m512 v = _mm512_fmadd_ps(acc[r][j], cs, bs);                                      \
            if (relu) v = _mm512_max_ps(v, _mm512_setzero_ps());                                \
            _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, v);                               \
        }                                                                                       \
    }

#define KERNEL_ARGS                                                                             \
    const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t wstride,                  \
        const void *scales_v, int64_t sstride, int64_t group, const float *col,                 \
        const float *bias, int relu, float *y, int64_t ldy, int64_t ncols, const uint8_t *pf,   \
        int64_t pf_lo, int64_t pf_step

/* FP8: per input, 16 codes per block decoded and scaled by their group's column scales. With
 * few rows (decode) the codes are summed unscaled per group and the group's scales applied once
 * to the partial sums: one multiply per group instead of one per input and block. Decode at
 * batch 1 is bound by these instructions as much as by memory (Zen 4 splits each 512-bit op in
 * two), so that multiply is ~1/6 of the work per code. The decoded codes are values times
 * 2^-120, so the inputs are taken times 2^60 and the scales times 2^-60 (exact powers of two):
 * the partial sums stay in float32's normal range. More rows keep the per-input multiply: a
 * second set of accumulators would not fit in the registers. */
#define KERNEL_FP8(ROWS, NR)                                                                    \
    static void fp8_##ROWS##_##NR(KERNEL_ARGS) {                                                \
        const float *sc = (const float *)scales_v;                                              \
        __m512 acc[ROWS][NR];                                                                   \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (int64_t k0 = 0, g = 0; k0 < k; k0 += group, g++) {                                 \
            const int64_t k1 = k0 + group < k ? k0 + group : k;                                 \
            __m512 s[NR];                                                                       \
            for (int j = 0; j < NR; j++) s[j] = _mm512_loadu_ps(sc + j * sstride + g * 16);     \
            if (ROWS <= 2) {                                                                    \
                __m512 part[ROWS][NR];                                                          \
                for (int r = 0; r < ROWS; r++)                                                  \
                    for (int j = 0; j < NR; j++) part[r][j] = _mm512_setzero_ps();              \
                for (int64_t p = k0; p < k1; p++) {                                             \
                    PREFETCH_NEXT(p, NR)                                                         \
                    __m512 xs[ROWS];                                                            \
                    for (int r = 0; r < ROWS; r++)                                              \
                        xs[r] = _mm512_set1_ps(x[r * ldx + p] * QUANT_TWO_POW_60);              \
                    for (int j = 0; j < NR; j++) {                                              \
                        const __m512 b = e4m3_scaled_down(w + j * wstride + p * 16);            \
                        for (int r = 0; r < ROWS; r++)                                          \
                            part[r][j] = _mm512_fmadd_ps(xs[r], b, part[r][j]);                 \
                    }                                                                           \
                }                                                                               \
                for (int j = 0; j < NR; j++) {                                                  \
                    const __m512 sj = _mm512_mul_ps(s[j], _mm512_set1_ps(QUANT_TWO_POW_M60));   \
                    for (int r = 0; r < ROWS; r++)                                              \
                        acc[r][j] = _mm512_fmadd_ps(part[r][j], sj, acc[r][j]);                 \
                }                                                                               \
                continue;                                                                       \
            }                                                                                   \
            for (int64_t p = k0; p < k1; p++) {                                                 \
                PREFETCH_NEXT(p, NR)                                                             \
                for (int j = 0; j < NR; j++) {                                                  \
                    const __m512 b =                                                            \
                        _mm512_mul_ps(e4m3_scaled_down(w + j * wstride + p * 16), s[j]);        \
                    for (int r = 0; r < ROWS; r++)                                              \
                        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + p]), b,          \
                                                    acc[r][j]);                                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        EPILOGUE(ROWS, NR)                                                                      \
    }

/* NVFP4: per pair of inputs, 16 bytes per block give both inputs' 16 values; a group of 16
 * inputs (8 pairs) shares each column's e4m3 scale. */
#define KERNEL_FP4(ROWS, NR)                                                                    \
    static void fp4_##ROWS##_##NR(KERNEL_ARGS) {                                                \
        (void)group;                                                                            \
        const uint8_t *sc = (const uint8_t *)scales_v;                                          \
        const __m512 table = fp4_table(QUANT_TWO_POW_120), plain = fp4_table(1.0f);             \
        __m512 acc[ROWS][NR];                                                                   \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (int64_t g = 0; g < k / 16; g++) {                                                  \
            __m512 s[NR];                                                                       \
            for (int j = 0; j < NR; j++) s[j] = e4m3_scaled_down(sc + j * sstride + g * 16);    \
            if (ROWS <= 2) { /* as FP8: the group's scale once, on its partial sums, which */   \
                /* sum the plain e2m1 values (the 2^120 table would overflow them) */          \
                __m512 part[ROWS][NR];                                                          \
                for (int r = 0; r < ROWS; r++)                                                  \
                    for (int j = 0; j < NR; j++) part[r][j] = _mm512_setzero_ps();              \
                for (int64_t p = 8 * g; p < 8 * g + 8; p++) {                                   \
                    PREFETCH_NEXT(p, NR)                                                         \
                    for (int j = 0; j < NR; j++) {                                              \
                        __m512 even, odd;                                                       \
                        fp4_pair(w + j * wstride + p * 16, plain, &even, &odd);                 \
                        for (int r = 0; r < ROWS; r++) {                                        \
                            part[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p]),    \
                                                         even, part[r][j]);                     \
                            part[r][j] = _mm512_fmadd_ps(                                       \
                                _mm512_set1_ps(x[r * ldx + 2 * p + 1]), odd, part[r][j]);       \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
                for (int j = 0; j < NR; j++) {                                                  \
                    const __m512 sj = _mm512_mul_ps(s[j], _mm512_set1_ps(QUANT_TWO_POW_120));   \
                    for (int r = 0; r < ROWS; r++)                                              \
                        acc[r][j] = _mm512_fmadd_ps(part[r][j], sj, acc[r][j]);                 \
                }                                                                               \
                continue;                                                                       \
            }                                                                                   \
            for (int64_t p = 8 * g; p < 8 * g + 8; p++) {                                       \
                PREFETCH_NEXT(p, NR)                                                             \
                for (int j = 0; j < NR; j++) {                                                  \
                    __m512 even, odd;                                                           \
                    fp4_pair(w + j * wstride + p * 16, table, &even, &odd);                     \
                    even = _mm512_mul_ps(even, s[j]);                                           \
                    odd = _mm512_mul_ps(odd, s[j]);                                             \
                    for (int r = 0; r < ROWS; r++) {                                            \
                        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p]), even,   \
                                                    acc[r][j]);                                 \
                        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p + 1]),     \
                                                    odd, acc[r][j]);                            \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        EPILOGUE(ROWS, NR)                                                                      \
    }

#define KERNELS(K) K(8, 3) K(4, 3) K(2, 3) K(1, 3) K(8, 2) K(4, 2) K(2, 2) K(1, 2)              \
                   K(8, 1) K(4, 1) K(2, 1) K(1, 1)
KERNELS(KERNEL_FP8)
KERNELS(KERNEL_FP4)

typedef void (*qkernel)(KERNEL_ARGS);
static const qkernel KERNELS_BY_FORMAT[2][4][TILE] = {
    {{fp8_8_1, fp8_8_2, fp8_8_3}, {fp8_4_1, fp8_4_2, fp8_4_3},
     {fp8_2_1, fp8_2_2, fp8_2_3}, {fp8_1_1, fp8_1_2, fp8_1_3}},
    {{fp4_8_1, fp4_8_2, fp4_8_3}, {fp4_4_1, fp4_4_2, fp4_4_3},
     {fp4_2_1, fp4_2_2, fp4_2_3}, {fp4_1_1, fp4_1_2, fp4_1_3}}};

static inline int row_block(int64_t left) { return left >= 8 ? 0 : left >= 4 ? 1 : left >= 2 ? 2 : 3; }

#endif /* __AVX512F__ */

/* y[m][ldy] = x[m][ldx] @ W^T (* col) (+ bias) (relu) for W packed as above (n columns of k
 * inputs; nvfp4: k a multiple of 16). Returns 0, -1 without AVX-512, -2 for a bad format/k. */
int baton_qgemm(int format, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w,
                const void *scales, int64_t group, const float *col, int64_t n, const float *bias,
                int relu, float *y, int64_t ldy, int threads) {
#if defined(__AVX512F__)
    if (format != FORMAT_FP8 && format != FORMAT_NVFP4) return -2;
    if (format == FORMAT_NVFP4 ? k % 16 != 0 : group < 1) return -2;
    const int64_t blocks = (n + 15) / 16;
    const int64_t steps = format == FORMAT_NVFP4 ? k / 2 : k;  /* 16 bytes per block each */
    const int64_t wstride = steps * 16;                          /* bytes per block */
    const int64_t lines = (wstride + 63) / 64;
    const int64_t sstride = format == FORMAT_NVFP4 ? k : (k + group - 1) / group * 16;
    const int64_t sbytes = format == FORMAT_NVFP4 ? 1 : 4;
#pragma omp parallel num_threads(threads)
    {
        QUANT_DENORMALS_ON(saved);
        const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
        const int64_t first = blocks * part / parts, end = blocks * (part + 1) / parts;
        for (int64_t b0 = first; b0 < end; b0 += TILE) {
            const int64_t nr = end - b0 < TILE ? end - b0 : TILE;
            const int64_t ncols = n - b0 * 16;
            const uint8_t *wt = w + b0 * wstride;
            const char *st = (const char *)scales + b0 * sstride * sbytes;
            const int next = b0 + TILE < end;
            for (int64_t r = 0; r < m;) {
                const int idx = row_block(m - r);
                const int64_t rows = MR >> idx;
                const int64_t lo = lines * r / m, hi = lines * (r + rows) / m;
                const int64_t step = ((hi - lo) << 16) / steps;
                KERNELS_BY_FORMAT[format][idx][nr - 1](
                    x + r * ldx, ldx, k, wt, wstride, st, sstride, group,
                    col ? col + b0 * 16 : NULL, bias ? bias + b0 * 16 : NULL, relu,
                    y + r * ldy + b0 * 16, ldy, ncols, next ? wt + TILE * wstride : NULL, lo,
                    step);
                r += rows;
            }
        }
        QUANT_DENORMALS_RESTORE(saved);
    }
    return 0;
#else
    (void)format; (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)scales; (void)group;
    (void)col; (void)n; (void)bias; (void)relu; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}
