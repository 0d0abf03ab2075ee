/* Weight-only quantized linears on the CPU: y = x @ W^T (* col) (+ bias) (relu), W read as the
 * checkpoint quantized it, FP8 (e4m3) or NVFP4 (e2m1), decoded in registers (cpu/quant.h), never
 * dequantized into memory. kernels/cpu/quant.py packs the weights and scales and says when this
 * runs.
 *
 * Packed layouts (16 output columns per block, pad columns zero; G inputs per scale group):
 *   fp8:   codes  [N/16][K][16]        uint8 (e4m3)
 *          scales [N/16][ceil(K/G)][16] float32: each column's scale for the group, times
 *                                       2^(120 - shift) (the decode's 2^-120, see the header)
 *   nvfp4: codes  [N/16][K/8][16][4]   uint8 (AVX-512): a 32-bit lane per column c and step e of 8
 *                                       inputs, input 8e + 2t's nibble at nibble t (t < 4) and
 *                                       8e + 2t + 1's at nibble 4 + t (kernels/cpu/quant.py)
 *          codes  [N/16][K/2][16]      uint8 (AVX2): byte (p, c) = the checkpoint's byte (row c,
 *                                       p), inputs 2p (low nibble) and 2p + 1 (high)
 *          scales [N/16][K/16][16]     uint8 (e4m3 group scales as stored)
 *   col    [N] float32 or NULL: multiplies each output (NVFP4's global scale weight_scale_2;
 *          FP8's 2^shift when the scales needed one)
 *
 * Work is cut as in cpu/gemm.c: each thread a contiguous run of blocks in tiles of 3 (the codes
 * read from memory once per call), an 8-row register block over all of K, the next tile
 * prefetched while one runs. x and y are float32 (baton_qgemm_bf16, at the end, widens a bf16
 * model's rows and narrows the result around the same call); sums are float32 in k order.
 * With AVX512-BF16 and no AMX, NVFP4 on a bf16 model's rows skips the widening: VDPBF16PS takes
 * the rows' bf16 input pairs as they are (KERNEL_FP4_DOT, register blocks of 4, 2 and 1 rows;
 * baton_qgemm_fp4_dot says where it pays).
 *
 * With AVX2 + FMA and no AVX-512 (16 registers of 8 floats) a block is two registers wide:
 * tiles of 2 blocks, row blocks of 6, 3, 2 and 1. Up to 2 rows run a tile's blocks together
 * (partial sums per scale group as with AVX-512, 8 registers at most; the scaled sums wait in
 * memory); 3 and 6 rows run one block at a time over all of K (12 accumulators), the rows
 * sharing each decoded weight. The same layouts, the same products (cpu/quant.h).
 */
#define _GNU_SOURCE /* syscall(), cpu/amx.h */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"
#include "quant.h"

enum { FORMAT_FP8 = 0, FORMAT_NVFP4 = 1 };

int baton_qgemm_supported(void) {
#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
    return 1;
#else
    return 0;
#endif
}

#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
/* Prefetch line q of each block (or of block j) of the next tile at step `step` of `steps`: the
 * row blocks of a tile share the next tile's lines [pf_lo, pf_lo + pf_span) between them. */
#define PREFETCH_BLOCK(step, j)                                                                 \
    if (pf) {                                                                                   \
        const int64_t q = pf_lo + (int64_t)(((step) * pf_step) >> 16);                          \
        _mm_prefetch((const char *)(pf + (j) * wstride + q * 64), _MM_HINT_T0);                 \
    }
#define PREFETCH_NEXT(step, NR)                                                                 \
    if (pf) {                                                                                   \
        const int64_t q = pf_lo + (int64_t)(((step) * pf_step) >> 16);                          \
        for (int j = 0; j < NR; j++)                                                            \
            _mm_prefetch((const char *)(pf + j * wstride + q * 64), _MM_HINT_T0);               \
    }

#define KERNEL_ARGS                                                                             \
    const void *xv, int64_t ldx, int64_t k, const uint8_t *w, int64_t wstride,                  \
        const void *scales_v, int64_t sstride, int64_t group, const float *col,                 \
        const float *bias, int relu, float *y, int64_t ldy, int64_t ncols, const uint8_t *pf,   \
        int64_t pf_lo, int64_t pf_step
#endif

#if defined(QUANT_AVX512)
#define TILE 3 /* blocks of 16 columns per tile */
static const int BLOCK_ROWS[4] = {8, 4, 2, 1}; /* rows per register block, largest first */

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
        const float *x = (const float *)xv;                                                     \
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
                    if (((p - k0) & 3) == 0) { PREFETCH_NEXT(p, NR) } /* a line per 4 inputs */  \
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

/* NVFP4, in 64-byte steps of 8 inputs: one 32-bit lane per column holds the 8 inputs' nibbles,
 * input 8e + 2t in nibble t and 8e + 2t + 1 in nibble 4 + t, so a lane shifted right by 4t
 * looks both inputs' values up in one VPERMW (fp4_lane_pair, cpu/quant.h): a plain load, a
 * shift and one lookup per pair of inputs, where a byte per pair took a widening load and two
 * lookups. A group of 16 inputs (two steps) shares each column's e4m3 scale. Sums in k order.
 * More than 2 rows go a pair of inputs at a time over the tile's blocks (few registers live:
 * unrolled over the pairs the 8-row block spilled); still ~20% slower than the byte-per-pair
 * layout at 8 rows of float32 (the bf16 rows of a bf16 model take KERNEL_FP4_DOT instead where
 * the CPU has no AMX). Up to 2 rows look each input's value up as a float32 directly: VPERMPS
 * reads the low 4 bits of each lane, so the lanes shifted right by 4t (input 8e + 2t) and by
 * 16 + 4t (input 8e + 2t + 1) index the e2m1 table as they are: a shift, a lookup and an FMA per
 * input, where the lookup of both as bf16 words took the shift, a VPERMW and a shift or a mask
 * for each (1.1x the GB/s at one row on a Sapphire Rapids Xeon). */
#define FP4_STEP(j, e, d)                                                                       \
    const __m512i d = _mm512_loadu_si512((const void *)(w + (j) * wstride + (e) * 64))
#define KERNEL_FP4(ROWS, NR)                                                                    \
    static void fp4_##ROWS##_##NR(KERNEL_ARGS) {                                                \
        (void)group;                                                                            \
        const float *x = (const float *)xv;                                                     \
        const uint8_t *sc = (const uint8_t *)scales_v;                                          \
        const __m512i table = fp4_table_bf16(120);                                              \
        const __m512 ftable = fp4_table(1.0f);                                                  \
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
                for (int64_t e = 2 * g; e < 2 * g + 2; e++) {                                   \
                    PREFETCH_NEXT(4 * e, NR)                                                     \
                    for (int j = 0; j < NR; j++) {                                              \
                        FP4_STEP(j, e, d);                                                      \
                        for (int t = 0; t < 4; t++) {                                           \
                            const __m512 even = _mm512_permutexvar_ps(                          \
                                t ? _mm512_srli_epi32(d, 4 * t) : d, ftable);                   \
                            const __m512 odd =                                                  \
                                _mm512_permutexvar_ps(_mm512_srli_epi32(d, 16 + 4 * t), ftable);\
                            for (int r = 0; r < ROWS; r++) {                                    \
                                const float *xp = x + r * ldx + 8 * e + 2 * t;                  \
                                part[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xp[0]), even,       \
                                                             part[r][j]);                       \
                                part[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xp[1]), odd,        \
                                                             part[r][j]);                       \
                            }                                                                   \
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
            for (int64_t e = 2 * g; e < 2 * g + 2; e++) {                                       \
                PREFETCH_NEXT(4 * e, NR)                                                         \
                _Pragma("GCC unroll 1") /* a body that fits the op cache */                    \
                for (int t = 0; t < 4; t++)                                                     \
                    for (int j = 0; j < NR; j++) {                                              \
                        FP4_STEP(j, e, lanes);                                                  \
                        __m512 even, odd;                                                       \
                        fp4_lane_pair(_mm512_srl_epi32(lanes, _mm_cvtsi32_si128(4 * t)), table, \
                                      &even, &odd);                                             \
                        even = _mm512_mul_ps(even, s[j]);                                       \
                        odd = _mm512_mul_ps(odd, s[j]);                                         \
                        for (int r = 0; r < ROWS; r++) {                                        \
                            const float *xp = x + r * ldx + 8 * e + 2 * t;                      \
                            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xp[0]), even, acc[r][j]); \
                            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xp[1]), odd, acc[r][j]); \
                        }                                                                       \
                    }                                                                           \
            }                                                                                   \
        }                                                                                       \
        EPILOGUE(ROWS, NR)                                                                      \
    }

#if defined(QUANT_DOT_BF16)
/* NVFP4 for a bf16 model's rows, where AVX512-BF16 is there: the same 64-byte steps, each lane
 * shifted right by 4t looked up by VPERMW as two bf16 words (input 2t's value low, 2t + 1's
 * high), and VDPBF16PS adds both products to the lane's partial sum against each row's own bf16
 * pair of inputs, broadcast: one lookup per 16 bytes and one instruction per row and pair of
 * inputs, where float32 rows take two FMAs and the conversions around them (the decode at
 * batch 1 is bound by these instructions on Zen 4, which runs each 512-bit op as two halves;
 * 1.4x the GB/s of the widened rows at 1 to 32 rows). The products are exact (bf16 times e2m1),
 * the sums float32 with the instruction's own order (the odd input first) and denormal inputs
 * flushed; each group's scale multiplies its partial sums, at every row count (4 rows: 24
 * registers of partial sums and sums). */
/* Independent VDPBF16PS chains per accumulator: at 1-2 rows a single chain waits on the
 * instruction's latency (one chain per t at 1 row, two at 2: 1.1-1.4x the GB/s at one row on a
 * Sapphire Rapids Xeon); 4 rows have enough. */
#define FP4_CHAINS(ROWS) ((ROWS) == 1 ? 4 : (ROWS) == 2 ? 2 : 1)
#define KERNEL_FP4_DOT(ROWS, NR)                                                                \
    static void fp4dot_##ROWS##_##NR(KERNEL_ARGS) {                                             \
        (void)group;                                                                            \
        const uint16_t *x = (const uint16_t *)xv;                                               \
        const uint8_t *sc = (const uint8_t *)scales_v;                                          \
        const __m512i table = fp4_table_bf16(0);                                                \
        __m512 acc[ROWS][NR];                                                                   \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (int64_t g = 0; g < k / 16; g++) {                                                  \
            __m512 part[FP4_CHAINS(ROWS)][ROWS][NR];                                            \
            for (int c = 0; c < FP4_CHAINS(ROWS); c++)                                          \
                for (int r = 0; r < ROWS; r++)                                                  \
                    for (int j = 0; j < NR; j++) part[c][r][j] = _mm512_setzero_ps();           \
            for (int64_t e = 2 * g; e < 2 * g + 2; e++) {                                       \
                PREFETCH_NEXT(4 * e, NR)                                                         \
                for (int t = 0; t < 4; t++) { /* pairs outside: ROWS broadcasts live */        \
                    __m512i xs[ROWS];                                                           \
                    for (int r = 0; r < ROWS; r++) {                                            \
                        int32_t pair;                                                           \
                        memcpy(&pair, x + r * ldx + 8 * e + 2 * t, 4);                          \
                        xs[r] = _mm512_set1_epi32(pair);                                        \
                    }                                                                           \
                    for (int j = 0; j < NR; j++) {                                              \
                        FP4_STEP(j, e, d);                                                      \
                        const __m512i pairs =                                                   \
                            _mm512_permutexvar_epi16(_mm512_srli_epi32(d, 4 * t), table);       \
                        for (int r = 0; r < ROWS; r++) {                                        \
                            __m512 *chain = &part[t % FP4_CHAINS(ROWS)][r][j];                  \
                            *chain = _mm512_dpbf16_ps(*chain, (__m512bh)pairs, (__m512bh)xs[r]);\
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int j = 0; j < NR; j++) {                                                      \
                const __m512 sj = _mm512_mul_ps(e4m3_scaled_down(sc + j * sstride + g * 16),    \
                                                _mm512_set1_ps(QUANT_TWO_POW_120));             \
                for (int r = 0; r < ROWS; r++) {                                                \
                    __m512 sum = part[0][r][j];                                                 \
                    for (int c = 1; c < FP4_CHAINS(ROWS); c++)                                  \
                        sum = _mm512_add_ps(sum, part[c][r][j]);                                \
                    acc[r][j] = _mm512_fmadd_ps(sum, sj, acc[r][j]);                            \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        EPILOGUE(ROWS, NR)                                                                      \
    }
#endif

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
#if defined(QUANT_DOT_BF16)
KERNEL_FP4_DOT(4, 3) KERNEL_FP4_DOT(2, 3) KERNEL_FP4_DOT(1, 3) KERNEL_FP4_DOT(4, 2)
KERNEL_FP4_DOT(2, 2) KERNEL_FP4_DOT(1, 2) KERNEL_FP4_DOT(4, 1) KERNEL_FP4_DOT(2, 1)
KERNEL_FP4_DOT(1, 1)
/* Row blocks of 4, 2 and 1 (partial sums and sums for 4 rows fill 24 registers; the last entry
 * repeats the 1-row block, as row_block needs 4 entries). */
static const int DOT_BLOCK_ROWS[4] = {4, 2, 1, 1};
static const qkernel FP4_DOT_KERNELS[4][TILE] = {{fp4dot_4_1, fp4dot_4_2, fp4dot_4_3},
                                                 {fp4dot_2_1, fp4dot_2_2, fp4dot_2_3},
                                                 {fp4dot_1_1, fp4dot_1_2, fp4dot_1_3},
                                                 {fp4dot_1_1, fp4dot_1_2, fp4dot_1_3}};
#endif

#if defined(BATON_AMX)
/* A bf16 model's rows on AMX tiles, from amx_min_rows rows (a batched decode step, a prefill
 * chunk): each block's codes are decoded once per row panel into bf16 B tiles (cpu/amx.h) that
 * every 16 rows of the panel then read, so the decode is spread over the rows where the
 * register kernels above repeat it per 4 or 8 rows.
 * NVFP4: a tile row holds value * group scale, exact in bf16 (e2m1 has 2 significant bits, e4m3
 * 4: the product has at most 6; 2^-10 <= |product| <= 2688), so the products TDPBF16PS forms are
 * those of the dequantized weight; the global scale multiplies the sums (col).
 * FP8: a tile row holds the e4m3 values (exact in bf16); each group's sums leave the C tiles as
 * float32 and are multiplied by the group's column scales there, as the register kernels do.
 * Groups must fill whole tiles (a multiple of 32 inputs, or one group for all of K: per-tensor
 * scales); other block shapes take the register kernels. */
#define AMX_ROW_PANEL 128 /* rows per panel: a multiple of 32 */
static int64_t amx_min_rows = 8;

/* Block `codes` / `sc` -> `panel`: chunks x 16 k pairs x 16 columns of (even, odd) bf16 words, the
 * pairs past K zero. */
static void amx_decode_block(int format, const uint8_t *codes, const void *sc, int64_t k,
                             int64_t chunks, uint32_t *panel) {
    const __m512 up = _mm512_set1_ps(QUANT_TWO_POW_120);
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    int64_t pairs = 0;
#define AMX_PAIR(even, odd) /* two float32 vectors exact in bf16 -> one tile row */            \
    _mm512_store_si512((void *)(panel + 16 * pairs++),                                          \
                       _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),        \
                                       _mm512_and_si512(_mm512_castps_si512(odd), high)))
    if (format == FORMAT_NVFP4) {
        const __m512i table = fp4_table_bf16(0);
        for (int64_t g = 0; g < k / 16; g++) {
            const __m512 s = _mm512_mul_ps(e4m3_scaled_down((const uint8_t *)sc + g * 16), up);
            for (int64_t e = 2 * g; e < 2 * g + 2; e++) {
                const __m512i d = _mm512_loadu_si512((const void *)(codes + e * 64));
                for (int t = 0; t < 4; t++) {
                    __m512 even, odd;
                    fp4_lane_pair(_mm512_srli_epi32(d, 4 * t), table, &even, &odd);
                    AMX_PAIR(_mm512_mul_ps(even, s), _mm512_mul_ps(odd, s));
                }
            }
        }
    } else {
        for (int64_t p = 0; p < k / 2; p++)
            AMX_PAIR(_mm512_mul_ps(e4m3_scaled_down(codes + 32 * p), up),
                     _mm512_mul_ps(e4m3_scaled_down(codes + 32 * p + 16), up));
        if (k % 2)
            AMX_PAIR(_mm512_mul_ps(e4m3_scaled_down(codes + 16 * (k - 1)), up),
                     _mm512_setzero_ps());
    }
#undef AMX_PAIR
    memset(panel + 16 * pairs, 0, 64 * (size_t)(16 * chunks - pairs));
}

/* y (bf16) = x @ W^T (* col) (+ bias) (relu) on AMX; `a` holds the padded rows (amx_pad_rows),
 * `panels` two decoded blocks per thread. */
static void qgemm_bf16_amx(int format, int64_t m, int64_t k, const uint8_t *w,
                           const void *scales, int64_t group, const float *col, int64_t n,
                           const float *bias, int relu, uint16_t *y, int64_t ldy, int threads,
                           const uint16_t *a, uint32_t *panels) {
    const int64_t blocks = (n + 15) / 16, lda = amx_lda(k), chunks = lda / 32;
    const int64_t mpad = (m + 15) / 16 * 16;
    const int64_t wstride = format == FORMAT_NVFP4 ? 8 * k : 16 * k; /* bytes per block */
    const int fp8 = format == FORMAT_FP8;
    const int64_t groups = fp8 ? (k + group - 1) / group : 1;
    const int64_t sstride = fp8 ? groups * 16 : k; /* scales per block */
    const int64_t span = fp8 && groups > 1 ? group / 32 : chunks; /* chunks per group */
#pragma omp parallel num_threads(threads)
    {
        QUANT_DENORMALS_ON(saved);
        const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
        const int64_t first = blocks * part / parts, end = blocks * (part + 1) / parts;
        uint32_t *pan[2] = {panels + part * 2 * chunks * 256, panels + (part * 2 + 1) * chunks * 256};
        float c[4][256] __attribute__((aligned(64)));
        float acc[4][256] __attribute__((aligned(64)));
        amx_configure();
        for (int64_t p0 = 0; p0 < mpad; p0 += AMX_ROW_PANEL)
        for (int64_t b0 = first; b0 < end; b0 += 2) {
            const int64_t p1 = p0 + AMX_ROW_PANEL < mpad ? p0 + AMX_ROW_PANEL : mpad;
            const int two = b0 + 1 < end;
            for (int j = 0; j <= two; j++)
                amx_decode_block(format, w + (b0 + j) * wstride,
                                 (const char *)scales + (b0 + j) * sstride * (fp8 ? 4 : 1), k,
                                 chunks, pan[j]);
            for (int64_t m0 = p0; m0 < p1; m0 += 32) {
                const uint16_t *a0 = a + m0 * lda, *a1 = a0 + 16 * lda;
                const int both = m0 + 16 < p1; /* a second row tile */
                for (int64_t q0 = 0, g = 0; q0 < chunks; q0 += span, g++) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    const int64_t q1 = q0 + span < chunks ? q0 + span : chunks;
                    for (int64_t q = q0; q < q1; q++) {
                        _tile_loadd(4, a0 + q * 32, 2 * lda);
                        _tile_loadd(6, pan[0] + q * 256, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two) {
                            _tile_loadd(7, pan[1] + q * 256, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (both) {
                            _tile_loadd(5, a1 + q * 32, 2 * lda);
                            _tile_dpbf16ps(2, 5, 6);
                            if (two) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    if (two) _tile_stored(1, c[1], 64);
                    if (both) _tile_stored(2, c[2], 64);
                    if (both && two) _tile_stored(3, c[3], 64);
                    if (!fp8) continue; /* one group: c holds the sums */
                    for (int t = 0; t < 4; t++) { /* FP8: acc (+)= c * the group's scales */
                        if ((t & 1 && !two) || (t >= 2 && !both)) continue;
                        const float *sp = (const float *)scales + (b0 + (t & 1)) * sstride + g * 16;
                        const __m512 sg = _mm512_mul_ps(
                            _mm512_mul_ps(_mm512_loadu_ps(sp), _mm512_set1_ps(QUANT_TWO_POW_M60)),
                            _mm512_set1_ps(QUANT_TWO_POW_M60));
                        for (int r = 0; r < 16; r++) {
                            const __m512 v = _mm512_load_ps(c[t] + 16 * r);
                            _mm512_store_ps(acc[t] + 16 * r,
                                            g ? _mm512_fmadd_ps(v, sg, _mm512_load_ps(acc[t] + 16 * r))
                                              : _mm512_mul_ps(v, sg));
                        }
                    }
                }
                for (int i = 0; i < 2; i++) {
                    const int64_t row0 = m0 + 16 * i;
                    const int64_t rows = m - row0 >= 16 ? 16 : m - row0;
                    if (rows <= 0) break;
                    for (int j = 0; j <= two; j++) {
                        const int64_t col0 = (b0 + j) * 16;
                        amx_epilogue(fp8 ? acc[2 * i + j] : c[2 * i + j], rows, n - col0,
                                     col ? col + col0 : NULL, bias ? bias + col0 : NULL, relu,
                                     y + row0 * ldy + col0, ldy);
                    }
                }
            }
        }
        _tile_release();
        QUANT_DENORMALS_RESTORE(saved);
    }
}
#endif /* BATON_AMX */

#elif defined(QUANT_AVX2)
#define TILE 2 /* blocks of 16 columns per tile */
static const int BLOCK_ROWS[4] = {6, 3, 2, 1};

/* y[0..8) = acc (* col) (+ bias) (relu) for the lanes below `left` (none when left <= 0). */
static inline void store8(float *y, __m256 acc, const float *col, const float *bias, int relu,
                          int64_t left) {
    const int lanes = left <= 0 ? 0 : left >= 8 ? 8 : (int)left;
    const __m256i mask =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 cs = col ? _mm256_maskload_ps(col, mask) : _mm256_set1_ps(1.f);
    const __m256 bs = bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
    __m256 v = _mm256_fmadd_ps(acc, cs, bs);
    if (relu) v = _mm256_max_ps(v, _mm256_setzero_ps());
    _mm256_maskstore_ps(y, mask, v);
}

/* The up-to-2-row path: partial sums part[ROWS][2 NR] over one scale group, then each added
 * into sums[ROWS][16 NR] times the group's scales. */
#define FLUSH_PARTS(ROWS, NR, SCALE_OF)                                                         \
    for (int j = 0; j < NR; j++)                                                                \
        for (int h = 0; h < 2; h++) {                                                           \
            const __m256 sj = SCALE_OF(j, h);                                                   \
            for (int r = 0; r < ROWS; r++) {                                                    \
                float *at = sums[r] + 16 * j + 8 * h;                                           \
                _mm256_storeu_ps(at, _mm256_fmadd_ps(part[r][2 * j + h], sj, _mm256_loadu_ps(at))); \
            }                                                                                   \
        }

#define STORE_SUMS(ROWS, NR)                                                                    \
    for (int r = 0; r < ROWS; r++)                                                              \
        for (int c = 0; c < 2 * NR; c++)                                                        \
            store8(y + r * ldy + 8 * c, _mm256_loadu_ps(sums[r] + 8 * c), col ? col + 8 * c : NULL, \
                   bias ? bias + 8 * c : NULL, relu, ncols - 8 * c);

#define STORE_ACC(ROWS, j)                                                                      \
    for (int r = 0; r < ROWS; r++)                                                              \
        for (int h = 0; h < 2; h++)                                                             \
            store8(y + r * ldy + 16 * (j) + 8 * h, acc[r][h],                                   \
                   col ? col + 16 * (j) + 8 * h : NULL, bias ? bias + 16 * (j) + 8 * h : NULL,  \
                   relu, ncols - 16 * (j) - 8 * h);

/* FP8 (see the AVX-512 kernel above for the 2^60 / 2^-60 around the partial sums). */
#define KERNEL_FP8(ROWS, NR)                                                                    \
    static void fp8_##ROWS##_##NR(KERNEL_ARGS) {                                                \
        const float *x = (const float *)xv;                                                     \
        const float *sc = (const float *)scales_v;                                              \
        if (ROWS <= 2) {                                                                        \
            float sums[ROWS][16 * NR];                                                          \
            memset(sums, 0, sizeof(sums));                                                      \
            for (int64_t k0 = 0, g = 0; k0 < k; k0 += group, g++) {                             \
                const int64_t k1 = k0 + group < k ? k0 + group : k;                             \
                __m256 part[ROWS][2 * NR];                                                      \
                for (int r = 0; r < ROWS; r++)                                                  \
                    for (int c = 0; c < 2 * NR; c++) part[r][c] = _mm256_setzero_ps();          \
                for (int64_t p = k0; p < k1; p++) {                                             \
                    PREFETCH_NEXT(p, NR)                                                        \
                    __m256 xs[ROWS];                                                            \
                    for (int r = 0; r < ROWS; r++)                                              \
                        xs[r] = _mm256_set1_ps(x[r * ldx + p] * QUANT_TWO_POW_60);              \
                    for (int c = 0; c < 2 * NR; c++) {                                          \
                        const __m256 b =                                                        \
                            e4m3_scaled_down8(w + (c >> 1) * wstride + p * 16 + 8 * (c & 1));   \
                        for (int r = 0; r < ROWS; r++)                                          \
                            part[r][c] = _mm256_fmadd_ps(xs[r], b, part[r][c]);                 \
                    }                                                                           \
                }                                                                               \
                FLUSH_PARTS(ROWS, NR, FP8_SCALE)                                                \
            }                                                                                   \
            STORE_SUMS(ROWS, NR)                                                                \
            return;                                                                             \
        }                                                                                       \
        for (int j = 0; j < NR; j++) {                                                          \
            __m256 acc[ROWS][2];                                                                \
            for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();         \
            for (int64_t k0 = 0, g = 0; k0 < k; k0 += group, g++) {                             \
                const int64_t k1 = k0 + group < k ? k0 + group : k;                             \
                const __m256 s0 = _mm256_loadu_ps(sc + j * sstride + g * 16);                   \
                const __m256 s1 = _mm256_loadu_ps(sc + j * sstride + g * 16 + 8);               \
                for (int64_t p = k0; p < k1; p++) {                                             \
                    PREFETCH_BLOCK(p, j)                                                        \
                    const uint8_t *codes = w + j * wstride + p * 16;                            \
                    const __m256 b0 = _mm256_mul_ps(e4m3_scaled_down8(codes), s0);              \
                    const __m256 b1 = _mm256_mul_ps(e4m3_scaled_down8(codes + 8), s1);          \
                    for (int r = 0; r < ROWS; r++) {                                            \
                        const __m256 xr = _mm256_set1_ps(x[r * ldx + p]);                       \
                        acc[r][0] = _mm256_fmadd_ps(xr, b0, acc[r][0]);                         \
                        acc[r][1] = _mm256_fmadd_ps(xr, b1, acc[r][1]);                         \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            STORE_ACC(ROWS, j)                                                                  \
        }                                                                                       \
    }
#define FP8_SCALE(j, h)                                                                         \
    _mm256_mul_ps(_mm256_loadu_ps(sc + (j) * sstride + g * 16 + 8 * (h)),                      \
                  _mm256_set1_ps(QUANT_TWO_POW_M60))

/* NVFP4: per pair of inputs, 16 bytes per block give both inputs' 16 values (times 2^25,
 * cpu/quant.h), scaled per group of 16 inputs by the e4m3 scale decoded times 2^95. */
#define KERNEL_FP4(ROWS, NR)                                                                    \
    static void fp4_##ROWS##_##NR(KERNEL_ARGS) {                                                \
        const float *x = (const float *)xv;                                                     \
        (void)group;                                                                            \
        const uint8_t *sc = (const uint8_t *)scales_v;                                          \
        const __m256i table = fp4_table8();                                                     \
        if (ROWS <= 2) {                                                                        \
            float sums[ROWS][16 * NR];                                                          \
            memset(sums, 0, sizeof(sums));                                                      \
            for (int64_t g = 0; g < k / 16; g++) {                                              \
                __m256 part[ROWS][2 * NR];                                                      \
                for (int r = 0; r < ROWS; r++)                                                  \
                    for (int c = 0; c < 2 * NR; c++) part[r][c] = _mm256_setzero_ps();          \
                for (int64_t p = 8 * g; p < 8 * g + 8; p++) {                                   \
                    PREFETCH_NEXT(p, NR)                                                        \
                    for (int j = 0; j < NR; j++) {                                              \
                        __m256 v[4];                                                            \
                        fp4_step16(w + j * wstride + p * 16, table, v);                         \
                        for (int r = 0; r < ROWS; r++) {                                        \
                            const __m256 xe = _mm256_set1_ps(x[r * ldx + 2 * p]);               \
                            const __m256 xo = _mm256_set1_ps(x[r * ldx + 2 * p + 1]);           \
                            for (int h = 0; h < 2; h++) {                                       \
                                __m256 *acc = &part[r][2 * j + h];                              \
                                *acc = _mm256_fmadd_ps(xo, v[2 + h], _mm256_fmadd_ps(xe, v[h], *acc)); \
                            }                                                                   \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
                FLUSH_PARTS(ROWS, NR, FP4_SCALE)                                                \
            }                                                                                   \
            STORE_SUMS(ROWS, NR)                                                                \
            return;                                                                             \
        }                                                                                       \
        for (int j = 0; j < NR; j++) {                                                          \
            __m256 acc[ROWS][2];                                                                \
            for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();         \
            for (int64_t g = 0; g < k / 16; g++) {                                              \
                const __m256 s[2] = {FP4_SCALE(j, 0), FP4_SCALE(j, 1)};                         \
                for (int64_t p = 8 * g; p < 8 * g + 8; p++) {                                   \
                    PREFETCH_BLOCK(p, j)                                                        \
                    __m256 v[4];                                                                \
                    fp4_step16(w + j * wstride + p * 16, table, v);                             \
                    for (int c = 0; c < 4; c++) v[c] = _mm256_mul_ps(v[c], s[c & 1]);           \
                    for (int r = 0; r < ROWS; r++) {                                            \
                        const __m256 xe = _mm256_set1_ps(x[r * ldx + 2 * p]);                   \
                        const __m256 xo = _mm256_set1_ps(x[r * ldx + 2 * p + 1]);               \
                        for (int h = 0; h < 2; h++)                                             \
                            acc[r][h] = _mm256_fmadd_ps(xo, v[2 + h],                           \
                                                        _mm256_fmadd_ps(xe, v[h], acc[r][h]));  \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            STORE_ACC(ROWS, j)                                                                  \
        }                                                                                       \
    }
#define FP4_SCALE(j, h)                                                                         \
    _mm256_mul_ps(e4m3_scaled_down8(sc + (j) * sstride + g * 16 + 8 * (h)),                    \
                  _mm256_set1_ps(QUANT_TWO_POW_95))

#define KERNELS(K) K(6, 2) K(3, 2) K(2, 2) K(1, 2) K(6, 1) K(3, 1) K(2, 1) K(1, 1)
KERNELS(KERNEL_FP8)
KERNELS(KERNEL_FP4)

typedef void (*qkernel)(KERNEL_ARGS);
static const qkernel KERNELS_BY_FORMAT[2][4][TILE] = {
    {{fp8_6_1, fp8_6_2}, {fp8_3_1, fp8_3_2}, {fp8_2_1, fp8_2_2}, {fp8_1_1, fp8_1_2}},
    {{fp4_6_1, fp4_6_2}, {fp4_3_1, fp4_3_2}, {fp4_2_1, fp4_2_2}, {fp4_1_1, fp4_1_2}}};

#endif /* QUANT_AVX512, QUANT_AVX2 */

#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
/* The largest register block that fits the rows left: an index into BLOCK_ROWS. */
static inline int row_block(const int block_rows[4], int64_t left) {
    int idx = 0;
    while (block_rows[idx] > left) idx++;
    return idx;
}
#endif

/* The NVFP4 layout this build packs for: inputs per 32-bit lane and step (8, the AVX-512
 * kernels' 64-byte steps) or per byte (2, a byte per column and input pair: AVX2). */
int baton_qgemm_fp4_inputs_per_lane(void) {
#if defined(QUANT_AVX512)
    return 8;
#else
    return 2;
#endif
}

#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
/* Runs `kernels` (one per row block and tile width) over y = x @ W^T: each thread a contiguous
 * run of blocks in tiles, the rows in register blocks, the next tile prefetched. x holds m rows
 * of `xsize`-byte elements, ldx apart. */
static void qgemm_run(const qkernel (*kernels)[TILE], const int block_rows[4], int format,
                      const void *x, size_t xsize,
                      int64_t m, int64_t k, int64_t ldx, const uint8_t *w, const void *scales,
                      int64_t group, const float *col, int64_t n, const float *bias, int relu,
                      float *y, int64_t ldy, int threads) {
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
                const int idx = row_block(block_rows, m - r);
                const int64_t rows = block_rows[idx];
                const int64_t lo = lines * r / m, hi = lines * (r + rows) / m;
                const int64_t step = ((hi - lo) << 16) / steps;
                kernels[idx][nr - 1]((const char *)x + r * ldx * (int64_t)xsize, ldx, k, wt,
                                     wstride, st, sstride, group, col ? col + b0 * 16 : NULL,
                                     bias ? bias + b0 * 16 : NULL, relu, y + r * ldy + b0 * 16,
                                     ldy, ncols, next ? wt + TILE * wstride : NULL, lo, step);
                r += rows;
            }
        }
        QUANT_DENORMALS_RESTORE(saved);
    }
}
#endif

/* y[m][ldy] = x[m][ldx] @ W^T (* col) (+ bias) (relu) for W packed as above (n columns of k
 * inputs; nvfp4: k a multiple of 16). Returns 0, -1 without AVX-512 or AVX2 + FMA, -2 for a bad
 * format/k. */
int baton_qgemm(int format, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w,
                const void *scales, int64_t group, const float *col, int64_t n, const float *bias,
                int relu, float *y, int64_t ldy, int threads) {
#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
    if (format != FORMAT_FP8 && format != FORMAT_NVFP4) return -2;
    if (format == FORMAT_NVFP4 ? k % 16 != 0 : group < 1) return -2;
    qgemm_run(KERNELS_BY_FORMAT[format], BLOCK_ROWS, format, x, sizeof(float), m, k, ldx, w,
              scales, group, col, n, bias, relu, y, ldy, threads);
    return 0;
#else
    (void)format; (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)scales; (void)group;
    (void)col; (void)n; (void)bias; (void)relu; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}

/* AMX for a bf16 model's rows from `rows` rows (< 1: never); returns whether this build and
 * process run AMX (tests run both paths on every shape). */
int baton_qgemm_amx(int64_t rows) {
#if defined(BATON_AMX)
    amx_min_rows = rows < 1 ? INT64_MAX : rows;
    return amx_permitted();
#else
    (void)rows;
    return 0;
#endif
}

/* Whether NVFP4 on a bf16 model's rows (below AMX's rows) takes KERNEL_FP4_DOT (VDPBF16PS on the
 * rows as they are) or the float32 kernels on widened rows. VDPBF16PS pays where it is fast (Zen
 * 4: 1.4x the GB/s of the widened rows at 1 to 32 rows); on an Intel Xeon with AMX (Sapphire
 * Rapids class) it measured ~2.2 cycles per instruction against 0.5 for a 512-bit FMA, and the
 * float32 kernels read 1.02-1.15x its GB/s at 1 to 6 rows (a paired benchmark, in the results
 * of 2026-12-03 s8): the dot kernels are the default only where the CPU has no AMX. */
#if defined(QUANT_DOT_BF16) && !defined(BATON_AMX)
static int fp4_dot = 1;
#else
static int fp4_dot = 0;
#endif

/* Sets the choice above (on: 1 or 0; < 0 leaves it) where this build has the dot kernels;
 * returns the choice in force. */
int baton_qgemm_fp4_dot(int on) {
#if defined(QUANT_DOT_BF16)
    if (on >= 0) fp4_dot = on != 0;
#else
    (void)on;
#endif
    return fp4_dot;
}

/* baton_qgemm for a bf16 model's rows: x[m][ldx] and y[m][ldy] bfloat16, widened and narrowed
 * here (y rounded to nearest even, as torch's .to(torch.bfloat16)), so that a decode step's
 * call costs one ctypes call instead of two more tensor ops around it (~20 us of a 2-core
 * machine's time per call). NVFP4 with AVX512-BF16 reads the bf16 rows as they are
 * (KERNEL_FP4_DOT). Returns baton_qgemm's status, -3 when out of memory. */
int baton_qgemm_bf16(int format, const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                     const uint8_t *w, const void *scales, int64_t group, const float *col,
                     int64_t n, const float *bias, int relu, uint16_t *y, int64_t ldy,
                     int threads) {
#if defined(BATON_AMX)
    const int tiles_fit = format == FORMAT_NVFP4 ? k % 16 == 0
                                                 : format == FORMAT_FP8 && group >= 1 &&
                                                       (group >= k || group % 32 == 0);
    if (m >= amx_min_rows && tiles_fit && amx_permitted()) {
        const int64_t lda = amx_lda(k), mpad = (m + 15) / 16 * 16;
        const int64_t team = threads > 0 ? threads : 1;
        /* the padded rows, then two decoded blocks (64 bytes per k pair) per thread */
        uint16_t *a = aligned_alloc(64, (size_t)(mpad * lda * 2 + team * 2 * lda * 32));
        if (!a) return -3;
        amx_pad_rows(x, m, k, ldx, a);
        qgemm_bf16_amx(format, m, k, w, scales, group, col, n, bias, relu, y, ldy, (int)team, a,
                       (uint32_t *)(a + mpad * lda));
        free(a);
        return 0;
    }
#endif
#if defined(QUANT_DOT_BF16)
    const int dot = fp4_dot && format == FORMAT_NVFP4 && k % 16 == 0; /* no widening */
#else
    const int dot = 0;
#endif
    const int64_t widened = dot ? 0 : m * k;
    float *rows = malloc(sizeof(float) * (size_t)(widened + m * n));
    if (!rows) return -3;
    float *out = rows + widened;
    const int wide = m * (k + n) > (1 << 16); /* a prefill chunk: convert in parallel */
    int status = 0;
#if defined(QUANT_DOT_BF16)
    if (dot)
        qgemm_run(FP4_DOT_KERNELS, DOT_BLOCK_ROWS, format, x, sizeof(uint16_t), m, k, ldx, w,
                  scales, group, col, n, bias, relu, out, n, threads);
#endif
    if (!dot) {
#pragma omp parallel for num_threads(threads) if (wide)
        for (int64_t i = 0; i < m; i++)
            for (int64_t p = 0; p < k; p++) rows[i * k + p] = bf16_to_f32(x[i * ldx + p]);
        status = baton_qgemm(format, rows, m, k, k, w, scales, group, col, n, bias, relu, out, n,
                             threads);
    }
    if (status == 0) {
#pragma omp parallel for num_threads(threads) if (wide)
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < n; c++) y[i * ldy + c] = f32_to_bf16(out[i * n + c]);
    }
    free(rows);
    return status;
}
