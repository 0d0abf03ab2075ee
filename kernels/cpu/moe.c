/* Routed MoE experts on the CPU in one call (built at first use by kernels/cpu/moe.py).
 *
 * The call takes the router's choices and does the rest of the routed half of a MoE layer:
 * groups the (token, choice) pairs by expert with a stable counting sort, runs every active
 * expert on its rows straight from x (no gathered copy), and sums each token's k expert outputs
 * weighted, in float32, into the output. No per-expert Python, no host sync, the same code for
 * a decode step (a few rows per expert: streaming the weights bounds it) and a prefill chunk
 * (hundreds of rows per expert: the FMAs bound it).
 *
 * Weights are packed once (kernels/cpu/moe.py) into panels of NB output columns stored
 * transposed, so the inner loop broadcasts one input element per row and streams one
 * contiguous NB-wide weight row into MR x NB float32 accumulators that live in registers:
 *   up:   (E, parts, I_pad / NB, D_k, NB)   parts 1: relu2's up_proj; 2: swiglu's gate, then up
 *   down: (E, D_pad / NB, I_pad, NB)          D_k = D (float32) or D rounded up to even (bf16)
 * Columns past I (or D) are zero, so the padded part of h is zero and the down projection
 * ignores it. Each panel is read once per block of up to MR rows: once per decode step.
 *
 * bfloat16 panels hold k in pairs ([K / 2][NB][2], K padded to even) for the CPU's bf16
 * dot-product instruction (AVX512-BF16), which halves the instructions per weight; without it
 * they are widened to float32 as they load. Products are exact in float32 and sums float32; the
 * projections' outputs and the activation are rounded to bfloat16 as a bf16 model computes them
 * (transformers: bf16 linears, the weighted sum in float32).
 *
 * Quantized experts (weight-only: fmt FP8 or NVFP4, x and h in float32) keep their codes in the
 * same panels, one byte per weight (FP8) or per pair of k (NVFP4: [K / 2][NB], the even k in the
 * low nibble), with their scales beside them per panel: FP8 [groups][NB] float32 (a column's
 * scale for each group of `group` k, times the decode's 2^120), NVFP4 [K / 16][NB] e4m3; `col`
 * (float32 per output column, may be NULL) multiplies the projection's outputs (NVFP4's
 * weight_scale_2). cpu/quant.h decodes them in registers, with AVX-512 or with AVX2 + FMA (there
 * 16 registers of 8 floats: a block of rows runs the panel in column chunks, below).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"
#include "quant.h"

#define NB 64 /* output columns per panel: four 16-float vectors */
#define MR 6  /* rows per register block: MR x NB accumulators = 24 vectors */
#define MAX_TOP_K 64 /* choices per token the combine sorts on the stack (kernels/cpu/moe.py) */

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_FP8 = 2, FMT_NVFP4 = 3 };

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* acc[r * NB + c] = sum_k x[r][k] * panel[k * NB + c] for r < R <= MR, c < NB (float32). */
static inline __attribute__((always_inline)) void block_f32(const int R, const void *const xv[MR],
                                                            const void *panel_v, int64_t K,
                                                            float *acc) {
    const float *const *x = (const float *const *)xv;
    const float *panel = (const float *)panel_v;
#if defined(__AVX512F__)
    __m512 c[MR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) c[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_ps(panel + k * NB + 16 * v);
        for (int r = 0; r < R; r++) {
            const __m512 b = _mm512_set1_ps(x[r][k]);
            for (int v = 0; v < 4; v++) c[r][v] = _mm512_fmadd_ps(w[v], b, c[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + r * NB + 16 * v, c[r][v]);
#else
    memset(acc, 0, sizeof(float) * R * NB);
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < R; r++) {
            const float b = x[r][k];
#pragma omp simd
            for (int j = 0; j < NB; j++) acc[r * NB + j] += panel[k * NB + j] * b;
        }
#endif
}

/* The same for bfloat16 rows and a bfloat16 panel stored in pairs along k, as the CPU's bf16
 * dot-product instruction takes them: panel[(k / 2) * NB * 2 + c * 2 + k % 2], K even. Products
 * are exact in float32, sums float32 (as oneDNN's bf16 GEMM). */
static inline __attribute__((always_inline)) void block_bf16(const int R, const void *const xv[MR],
                                                             const void *panel_v, int64_t K,
                                                             float *acc) {
    const uint16_t *const *x = (const uint16_t *const *)xv;
    const uint16_t *panel = (const uint16_t *)panel_v;
#if defined(__AVX512BF16__)
    __m512 c[MR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) c[r][v] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K / 2; k2++) {
        __m512bh w[4];
        for (int v = 0; v < 4; v++)
            w[v] = (__m512bh)_mm512_loadu_si512(panel + (k2 * NB + 16 * v) * 2);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x[r] + 2 * k2, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < 4; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], w[v], b);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + r * NB + 16 * v, c[r][v]);
#else
    memset(acc, 0, sizeof(float) * R * NB);
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < R; r++) {
            const float b = bf16_to_f32(x[r][k]);
            const uint16_t *wk = panel + (k / 2) * NB * 2 + k % 2;
#pragma omp simd
            for (int j = 0; j < NB; j++) acc[r * NB + j] += bf16_to_f32(wk[2 * j]) * b;
        }
#endif
}

#if defined(QUANT_AVX512)
/* FP8 codes [K][NB] with float32 scales [groups][NB] (times 2^120), float32 rows. */
static inline __attribute__((always_inline)) void block_fp8(const int R, const void *const xv[MR],
                                                            const void *panel_v,
                                                            const void *scales_v, int64_t group,
                                                            int64_t K, float *acc) {
    const float *const *x = (const float *const *)xv;
    const uint8_t *panel = (const uint8_t *)panel_v;
    const float *scales = (const float *)scales_v;
    __m512 c[MR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) c[r][v] = _mm512_setzero_ps();
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        const int64_t k1 = k0 + group < K ? k0 + group : K;
        __m512 s[4];
        for (int v = 0; v < 4; v++) s[v] = _mm512_loadu_ps(scales + g * NB + 16 * v);
        for (int64_t k = k0; k < k1; k++)
            for (int v = 0; v < 4; v++) {
                const __m512 w = _mm512_mul_ps(e4m3_scaled_down(panel + k * NB + 16 * v), s[v]);
                for (int r = 0; r < R; r++)
                    c[r][v] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r][k]), c[r][v]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + r * NB + 16 * v, c[r][v]);
}

/* NVFP4 codes [K / 2][NB] (k pairs in a byte) with e4m3 scales [K / 16][NB], float32 rows. */
static inline __attribute__((always_inline)) void block_fp4(const int R, const void *const xv[MR],
                                                            const void *panel_v,
                                                            const void *scales_v, int64_t K,
                                                            float *acc) {
    const float *const *x = (const float *const *)xv;
    const uint8_t *panel = (const uint8_t *)panel_v, *scales = (const uint8_t *)scales_v;
    const __m512 table = fp4_table(QUANT_TWO_POW_120);
    __m512 c[MR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) c[r][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / 16; g++) {
        __m512 s[4];
        for (int v = 0; v < 4; v++) s[v] = e4m3_scaled_down(scales + g * NB + 16 * v);
        for (int64_t p = 8 * g; p < 8 * g + 8; p++)
            for (int v = 0; v < 4; v++) {
                __m512 even, odd;
                fp4_pair(panel + p * NB + 16 * v, table, &even, &odd);
                even = _mm512_mul_ps(even, s[v]);
                odd = _mm512_mul_ps(odd, s[v]);
                for (int r = 0; r < R; r++) {
                    c[r][v] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[r][2 * p]), c[r][v]);
                    c[r][v] = _mm512_fmadd_ps(odd, _mm512_set1_ps(x[r][2 * p + 1]), c[r][v]);
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + r * NB + 16 * v, c[r][v]);
}
#elif defined(QUANT_AVX2)
/* AVX2's 16 registers hold 12 accumulators of 8 floats, not MR x NB: the panel runs in column
 * chunks of CHUNK(R) vectors, each over all of K, R x CHUNK(R) <= 12 (one row: the whole width).
 * A chunk after the first finds the panel's lines in cache (K x 64 bytes of codes at most). */
#define CHUNK(R) ((R) == 1 ? 8 : (R) <= 3 ? 4 : 2)

/* FP8 codes [K][NB] with float32 scales [groups][NB] (times 2^120), float32 rows. */
static inline __attribute__((always_inline)) void block_fp8(const int R, const void *const xv[MR],
                                                            const void *panel_v,
                                                            const void *scales_v, int64_t group,
                                                            int64_t K, float *acc) {
    const float *const *x = (const float *const *)xv;
    const uint8_t *panel = (const uint8_t *)panel_v;
    const float *scales = (const float *)scales_v;
    const int V = CHUNK(R);
    for (int c0 = 0; c0 < NB; c0 += 8 * V) {
        __m256 c[MR][8];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < V; v++) c[r][v] = _mm256_setzero_ps();
        for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
            const int64_t k1 = k0 + group < K ? k0 + group : K;
            for (int64_t k = k0; k < k1; k++)
                for (int v = 0; v < V; v++) {
                    const int64_t at = c0 + 8 * v;
                    const __m256 w = _mm256_mul_ps(e4m3_scaled_down8(panel + k * NB + at),
                                                   _mm256_loadu_ps(scales + g * NB + at));
                    for (int r = 0; r < R; r++)
                        c[r][v] = _mm256_fmadd_ps(w, _mm256_set1_ps(x[r][k]), c[r][v]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < V; v++) _mm256_storeu_ps(acc + r * NB + c0 + 8 * v, c[r][v]);
    }
}

/* NVFP4 codes [K / 2][NB] (k pairs in a byte) with e4m3 scales [K / 16][NB], float32 rows; 16
 * columns (two vectors) decoded at a time. */
static inline __attribute__((always_inline)) void block_fp4(const int R, const void *const xv[MR],
                                                            const void *panel_v,
                                                            const void *scales_v, int64_t K,
                                                            float *acc) {
    const float *const *x = (const float *const *)xv;
    const uint8_t *panel = (const uint8_t *)panel_v, *scales = (const uint8_t *)scales_v;
    const __m256i table = fp4_table8();
    const int V = CHUNK(R);
    for (int c0 = 0; c0 < NB; c0 += 8 * V) {
        __m256 c[MR][8];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < V; v++) c[r][v] = _mm256_setzero_ps();
        for (int64_t g = 0; g < K / 16; g++) {
            __m256 s[8];
            for (int v = 0; v < V; v++)
                s[v] = _mm256_mul_ps(e4m3_scaled_down8(scales + g * NB + c0 + 8 * v),
                                     _mm256_set1_ps(QUANT_TWO_POW_95));
            for (int64_t p = 8 * g; p < 8 * g + 8; p++)
                for (int v = 0; v < V; v += 2) {
                    __m256 w[4];
                    fp4_step16(panel + p * NB + c0 + 8 * v, table, w);
                    for (int h = 0; h < 2; h++) {
                        const __m256 even = _mm256_mul_ps(w[h], s[v + h]);
                        const __m256 odd = _mm256_mul_ps(w[2 + h], s[v + h]);
                        for (int r = 0; r < R; r++) {
                            c[r][v + h] =
                                _mm256_fmadd_ps(even, _mm256_set1_ps(x[r][2 * p]), c[r][v + h]);
                            c[r][v + h] =
                                _mm256_fmadd_ps(odd, _mm256_set1_ps(x[r][2 * p + 1]), c[r][v + h]);
                        }
                    }
                }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < V; v++) _mm256_storeu_ps(acc + r * NB + c0 + 8 * v, c[r][v]);
    }
}
#endif

/* One block of nr <= MR rows, with a copy of the loop per row count: a decode step's few rows
 * per expert cost no FMAs for absent rows. scales / group: a quantized panel's (else unused). */
static void panel_block(int fmt, int64_t nr, const void *const x[MR], const void *panel,
                        const void *scales, int64_t group, int64_t K, float *acc) {
#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
#define QUANT_BLOCKS(R)                                                                            \
    if (fmt == FMT_FP8) { block_fp8(R, x, panel, scales, group, K, acc); break; }                  \
    if (fmt == FMT_NVFP4) { block_fp4(R, x, panel, scales, K, acc); break; }
#else
#define QUANT_BLOCKS(R) (void)scales; (void)group;
#endif
#define BLOCK(R)                                                                                   \
    QUANT_BLOCKS(R)                                                                                \
    if (fmt == FMT_BF16) block_bf16(R, x, panel, K, acc);                                          \
    else block_f32(R, x, panel, K, acc);                                                           \
    break;
    switch (nr) {
    case 1: BLOCK(1)
    case 2: BLOCK(2)
    case 3: BLOCK(3)
    case 4: BLOCK(4)
    case 5: BLOCK(5)
    default: BLOCK(MR)
    }
#undef BLOCK
#undef QUANT_BLOCKS
}

/* h = relu(g)^2 or silu(g) * u over one panel row; a bf16 model rounds the projections and
 * silu to bf16 first, and h itself. exp_approx keeps the silu loop vectorised. */
static void store_act_f32(const float *g, const float *u, int swiglu, float *h) {
    if (swiglu) {
#pragma omp simd
        for (int j = 0; j < NB; j++) h[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
    } else {
#pragma omp simd
        for (int j = 0; j < NB; j++) h[j] = g[j] > 0.0f ? g[j] * g[j] : 0.0f;
    }
}

static void store_act_bf16(const float *g, const float *u, int swiglu, uint16_t *h) {
    if (swiglu) {
#pragma omp simd
        for (int j = 0; j < NB; j++) {
            const float v = round_bf16(g[j]);
            h[j] = f32_to_bf16(round_bf16(v / (1.0f + exp_approx(-v))) * round_bf16(u[j]));
        }
    } else {
#pragma omp simd
        for (int j = 0; j < NB; j++) {
            const float v = round_bf16(g[j]);
            h[j] = f32_to_bf16(v > 0.0f ? v * v : 0.0f);
        }
    }
}

/* The routed experts and the weighted sum over each token's k choices.
 *   x (T, x_stride): the rows' first D_k elements, float32, or bfloat16 when fmt is BF16 (then
 *   D_k is D rounded up to even, zero past D); ids (T, k) int64; weights (T, k) float32
 *   up, down: packed panels (see top), float32, bfloat16 in k-pairs, or quantized codes
 *   fmt: FMT_F32, FMT_BF16, FMT_FP8 or FMT_NVFP4 (quantized: x, h and out are float32)
 *   up_scales / down_scales, up_col / down_col, up_group / down_group: a quantized format's
 *   scales per panel, output multipliers (E, parts, I_pad) / (E, D_pad) or NULL, and FP8's
 *   inputs per scale group (NULL / unused otherwise)
 *   I_pad: the padded expert width (a multiple of NB); swiglu: 0 relu2, 1 silu(gate) * up
 *   scratch: offsets (E + 1) + pair_of (T * k) + pos (T * k) + active (E) int64;
 *   h (T * k, I_pad) float32 or bfloat16; ys (T * k, D) float32
 *   out (T, D): float32, or bfloat16 when fmt is BF16
 * Expert adapters (kernels/lora.py's ExpertDeltas; pair_slots NULL: none), pair p = t k + j:
 *   up_delta (T * k, up_width) float32: added to the pair's up projection before the
 *   activation (up_width = I, or 2 I for swiglu: gate then up)
 *   pair_slots (T * k,) int64: the pair's row group s E + e of down_a / down_b, -1 for none;
 *   down_a (groups * rank, I), down_b (groups * rank, D) float32 or bf16 (lora_bf16): ys of the
 *   pair += (down_a's rows . h) @ down_b's rows; low (T * k, rank) float32 scratch
 * Returns the first token with an expert id outside [0, E) + 1 before writing anything, or 0. */
int64_t baton_moe_routed(const void *x, int64_t x_stride, int64_t T, int64_t D, const int64_t *ids,
                         const float *weights, int64_t k, int64_t E, const void *up,
                         const void *down, int fmt, int64_t I_pad, int swiglu, int64_t *scratch,
                         void *h, float *ys, void *out, int threads, const void *up_scales,
                         const void *down_scales, const float *up_col, const float *down_col,
                         int64_t up_group, int64_t down_group, const float *up_delta,
                         int64_t up_width, const int64_t *pair_slots, const void *down_a,
                         const void *down_b, int lora_bf16, int64_t rank, int64_t inter,
                         float *low) {
    const int bf16 = fmt == FMT_BF16, quant = fmt == FMT_FP8 || fmt == FMT_NVFP4;
    const int64_t P = T * k, nbI = I_pad / NB, nbD = (D + NB - 1) / NB;
    const int64_t esize = bf16 ? 2 : 4, parts = swiglu ? 2 : 1, D_k = bf16 ? (D + 1) / 2 * 2 : D;
    /* bytes of one panel's codes, and of its scales, for K inputs */
#define PANEL_BYTES(K) (fmt == FMT_NVFP4 ? (K) / 2 * NB : fmt == FMT_FP8 ? (K) * NB : (K) * NB * esize)
#define SCALE_BYTES(K, G) (fmt == FMT_NVFP4 ? (K) / 16 * NB : fmt == FMT_FP8 ? ((K) + (G) - 1) / (G) * NB * 4 : 0)
    const int64_t up_panel = PANEL_BYTES(D_k), down_panel = PANEL_BYTES(I_pad);
    const int64_t up_scale = SCALE_BYTES(D_k, up_group), down_scale = SCALE_BYTES(I_pad, down_group);
#undef PANEL_BYTES
#undef SCALE_BYTES
    int64_t *offsets = scratch, *pair_of = offsets + E + 1, *pos = pair_of + P;
    int64_t *active = pos + P;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return p / k + 1;
    memset(offsets, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < P; p++) offsets[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int64_t *cursor = active; /* the fill cursor per expert, before it lists active experts */
    memcpy(cursor, offsets, sizeof(int64_t) * E);
    for (int64_t p = 0; p < P; p++) { /* token order within an expert, as transformers loops */
        const int64_t at = cursor[ids[p]]++;
        pair_of[at] = p;
        pos[p] = at;
    }
    int64_t n_active = 0; /* a decode step touches a subset of the experts */
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) active[n_active++] = e;

#pragma omp parallel num_threads(threads)
    {
#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
        QUANT_DENORMALS_ON(saved_csr);
#endif
        float acc_g[MR * NB], acc_u[MR * NB];
        /* up projection + activation: one item per (active expert, panel of NB columns of h) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n_active * nbI; item++) {
            const int64_t e = active[item / nbI], ib = item % nbI;
            const int64_t gate_at = e * parts * nbI + ib, up_at = gate_at + nbI; /* swiglu's up */
            const char *gate_panel = (const char *)up + gate_at * up_panel;
            const char *up_panel_p = (const char *)up + up_at * up_panel;
            const char *gate_scales = quant ? (const char *)up_scales + gate_at * up_scale : NULL;
            const char *up_scales_p = quant ? (const char *)up_scales + up_at * up_scale : NULL;
            const float *gate_col = up_col ? up_col + e * parts * I_pad + ib * NB : NULL;
            const float *up_col_p = up_col ? gate_col + I_pad : NULL;
            for (int64_t rb = offsets[e]; rb < offsets[e + 1]; rb += MR) {
                const int64_t nr = offsets[e + 1] - rb < MR ? offsets[e + 1] - rb : MR;
                const void *xr[MR];
                for (int64_t r = 0; r < nr; r++)
                    xr[r] = (const char *)x + pair_of[rb + r] / k * x_stride * esize;
                panel_block(fmt, nr, xr, gate_panel, gate_scales, up_group, D_k, acc_g);
                if (swiglu) panel_block(fmt, nr, xr, up_panel_p, up_scales_p, up_group, D_k, acc_u);
                for (int64_t r = 0; r < nr; r++) {
                    float *g = acc_g + r * NB, *u = acc_u + r * NB;
                    if (gate_col)
                        for (int j = 0; j < NB; j++) {
                            g[j] *= gate_col[j];
                            if (swiglu) u[j] *= up_col_p[j];
                        }
                    if (pair_slots) { /* the pair's adapter, before the activation */
                        const float *add = up_delta + pair_of[rb + r] * up_width + ib * NB;
                        const int64_t n = inter - ib * NB < NB ? inter - ib * NB : NB;
                        for (int64_t j = 0; j < n; j++) {
                            g[j] += add[j];
                            if (swiglu) u[j] += add[inter + j];
                        }
                    }
                    const int64_t at = (rb + r) * I_pad + ib * NB;
                    if (bf16) store_act_bf16(g, u, swiglu, (uint16_t *)h + at);
                    else store_act_f32(g, u, swiglu, (float *)h + at);
                }
            }
        }
        /* the adapters' down shrink: low[row] = A_(s E + e) h[row] (0 without an adapter) */
        if (pair_slots) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < P * rank; task++) {
                const int64_t at = task / rank, j = task % rank, c = pair_slots[pair_of[at]];
                low[task] = c < 0 ? 0.0f
                                  : mixed_dot(h, bf16, at * I_pad, down_a, lora_bf16,
                                              (c * rank + j) * inter, inter);
            }
        }
        /* down projection: one item per (active expert, panel of NB output columns) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n_active * nbD; item++) {
            const int64_t e = active[item / nbD], jb = item % nbD;
            const char *panel = (const char *)down + (e * nbD + jb) * down_panel;
            const char *scales = quant ? (const char *)down_scales + (e * nbD + jb) * down_scale : NULL;
            const float *col = down_col ? down_col + (e * nbD + jb) * NB : NULL;
            const int64_t width = D - jb * NB < NB ? D - jb * NB : NB;
            for (int64_t rb = offsets[e]; rb < offsets[e + 1]; rb += MR) {
                const int64_t nr = offsets[e + 1] - rb < MR ? offsets[e + 1] - rb : MR;
                const void *hr[MR];
                for (int64_t r = 0; r < nr; r++) hr[r] = (const char *)h + (rb + r) * I_pad * esize;
                panel_block(fmt, nr, hr, panel, scales, down_group, I_pad, acc_g);
                for (int64_t r = 0; r < nr; r++) {
                    float *yr = ys + (rb + r) * D + jb * NB;
                    const float *a = acc_g + r * NB;
                    if (bf16) {
#pragma omp simd
                        for (int64_t j = 0; j < width; j++) yr[j] = round_bf16(a[j]);
                    } else if (col) {
#pragma omp simd
                        for (int64_t j = 0; j < width; j++) yr[j] = a[j] * col[j];
                    } else {
                        memcpy(yr, a, sizeof(float) * width);
                    }
                    const int64_t c = pair_slots ? pair_slots[pair_of[rb + r]] : -1;
                    for (int64_t j = 0; j < (c < 0 ? 0 : rank); j++) { /* the adapter's expand */
                        const float l = low[(rb + r) * rank + j];
                        const int64_t at = (c * rank + j) * D + jb * NB;
                        if (lora_bf16) {
                            const uint16_t *b = (const uint16_t *)down_b + at;
                            for (int64_t jj = 0; jj < width; jj++) yr[jj] += l * bf16_to_f32(b[jj]);
                        } else {
                            const float *b = (const float *)down_b + at;
#pragma omp simd
                            for (int64_t jj = 0; jj < width; jj++) yr[jj] += l * b[jj];
                        }
                    }
                }
            }
        }
        /* weighted sum per token in ascending expert order (transformers' loop order) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            int64_t order[MAX_TOP_K];
            for (int64_t j = 0; j < k; j++) { /* insertion sort of the k choices by expert */
                int64_t i = j;
                for (; i > 0 && ids[t * k + order[i - 1]] > ids[t * k + j]; i--)
                    order[i] = order[i - 1];
                order[i] = j;
            }
            float row[D];
            for (int64_t d = 0; d < D; d++) row[d] = 0.0f;
            for (int64_t jj = 0; jj < k; jj++) {
                const float wt = weights[t * k + order[jj]];
                const float *yr = ys + pos[t * k + order[jj]] * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) row[d] += wt * yr[d];
            }
            if (bf16) {
                uint16_t *o = (uint16_t *)out + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(row[d]);
            } else
                memcpy((float *)out + t * D, row, sizeof(float) * D);
        }
#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
        QUANT_DENORMALS_RESTORE(saved_csr);
#endif
    }
    return 0;
}
