/* The CPU linears' GEMM, y = x @ W^T (+ bias) (relu), on weights packed once into column panels
 * (kernels/cpu/gemm.py packs them and says when this runs instead of oneDNN).
 *
 * Packed layouts (16 output columns per block, the pad columns zero):
 *   float32:  [N/16][K][16]          one 64-byte line per block per k
 *   bfloat16: [N/16][K/2][16][2]     k pairs interleaved, the operand order of VDPBF16PS
 *
 * A tile is 3 blocks (48 columns); each thread takes whole tiles (the weight is read from memory
 * once per chunk of rows, row_chunk). Inside a tile, an 8-row by 48-column register block of
 * float32 accumulators runs over all of K; the tile's panel is read once from memory by the first
 * row block and from L2 by the others. While a tile runs, its rows prefetch the thread's next
 * tile, spread evenly over the row blocks: decode streams weights far larger than the caches, and
 * a panel fetched on demand left the FMA units idle for most of each call (oneDNN's prepacked
 * linear reaches ~65% of the machine's bf16 peak on the 110M model's decode sequence at 32 rows;
 * this, ~88%).
 *
 * Accumulation is in float32 in k order; the bf16 output rounds to nearest even (torch's). */
#define _GNU_SOURCE /* syscall() */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
#define TILE 3 /* blocks of 16 columns per tile */
#define MR 8   /* rows per register block */

/* Which dtypes this build runs (bit DTYPE_F32, bit DTYPE_BF16): the file is compiled with
 * -march=native, so a CPU without the instructions gets a build that runs neither. */
int baton_gemm_supported(void) {
    int bits = 0;
#if defined(__AVX512F__)
    bits |= 1 << DTYPE_F32;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    bits |= 1 << DTYPE_BF16;
#endif
    return bits;
}

#if defined(__AVX512F__)

/* The output of one register block: accumulators + bias, relu, stored masked to `ncols`. */
#define EPILOGUE(ROWS, NR, STORE)                                                              \
    for (int r = 0; r < ROWS; r++)                                                             \
        for (int j = 0; j < NR; j++) {                                                         \
            const int64_t left = ncols - 16 * j;                                               \
            const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);       \
            __m512 v = acc[r][j];                                                              \
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * j));        \
            if (relu) v = _mm512_max_ps(v, _mm512_setzero_ps());                               \
            STORE(y + r * ldy + 16 * j, mask, v);                                              \
        }

#define PREFETCH_NEXT(LINE)                                                                    \
    if (pf) {                                                                                  \
        const int64_t q = pf_lo + ((p * pf_step) >> 16);                                       \
        for (int j = 0; j < TILE; j++)                                                         \
            _mm_prefetch((const char *)(pf + j * wstride + q * (LINE)), _MM_HINT_T0);          \
    }

#define STORE_F32(dst, mask, v) _mm512_mask_storeu_ps((dst), (mask), (v))

/* float32: ROWS x NR blocks, one k per step (16 FMAs per accumulator). pf: the next tile's
 * panel; lines pf_lo + p * pf_step / 2^16 of each of its blocks are prefetched at step p. */
#define KERNEL_F32(ROWS, NR)                                                                   \
    static void f32_##ROWS##_##NR(const float *x, int64_t ldx, int64_t k, const float *w,      \
                                  int64_t wstride, const float *bias, int relu, float *y,      \
                                  int64_t ldy, int64_t ncols, const float *pf, int64_t pf_lo,  \
                                  int64_t pf_step) {                                           \
        __m512 acc[ROWS][NR];                                                                  \
        for (int r = 0; r < ROWS; r++)                                                         \
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();                      \
        for (int64_t p = 0; p < k; p++) {                                                      \
            __m512 b[NR];                                                                      \
            for (int j = 0; j < NR; j++) b[j] = _mm512_loadu_ps(w + j * wstride + p * 16);     \
            PREFETCH_NEXT(16)                                                                  \
            for (int r = 0; r < ROWS; r++) {                                                   \
                const __m512 a = _mm512_set1_ps(x[r * ldx + p]);                               \
                for (int j = 0; j < NR; j++) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);  \
            }                                                                                  \
        }                                                                                      \
        EPILOGUE(ROWS, NR, STORE_F32)                                                          \
    }

#define KERNELS(K) K(8, 3) K(4, 3) K(2, 3) K(1, 3) K(8, 2) K(4, 2) K(2, 2) K(1, 2)             \
                   K(8, 1) K(4, 1) K(2, 1) K(1, 1)
KERNELS(KERNEL_F32)

typedef void (*f32_kernel)(const float *, int64_t, int64_t, const float *, int64_t,
                           const float *, int, float *, int64_t, int64_t, const float *, int64_t,
                           int64_t);
static const f32_kernel F32_KERNELS[4][TILE] = {
    {f32_8_1, f32_8_2, f32_8_3}, {f32_4_1, f32_4_2, f32_4_3},
    {f32_2_1, f32_2_2, f32_2_3}, {f32_1_1, f32_1_2, f32_1_3}};

#if defined(__AVX512BF16__)

/* bf16 x: a pair of inputs as one 32-bit lane. An odd K's last pair has a zero high half (the
 * element past the row is never read: it may be another row's, or past the buffer). */
static inline __m512bh bf16_pair(const uint16_t *row, int64_t p) {
    int32_t pair;
    memcpy(&pair, row + 2 * p, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline __m512bh bf16_last_odd(const uint16_t *row, int64_t p) {
    return (__m512bh)_mm512_set1_epi32((int32_t)row[2 * p]);
}

#define STORE_BF16(dst, mask, v) \
    _mm256_mask_storeu_epi16((dst), (mask), (__m256i)_mm512_cvtneps_pbh(v))

/* One k pair into every accumulator; PAIR reads a row's pair p. */
#define BF16_STEP(ROWS, NR, PAIR)                                                              \
    {                                                                                          \
        __m512bh b[NR];                                                                        \
        for (int j = 0; j < NR; j++)                                                           \
            b[j] = (__m512bh)_mm512_loadu_si512(w + j * wstride + p * 32);                     \
        PREFETCH_NEXT(32)                                                                      \
        for (int r = 0; r < ROWS; r++) {                                                       \
            const __m512bh a = PAIR(x + r * ldx, p);                                           \
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);     \
        }                                                                                      \
    }

/* bfloat16: ROWS x NR blocks, one k pair per step (VDPBF16PS: 32 multiply-adds per block). */
#define KERNEL_BF16(ROWS, NR)                                                                  \
    static void bf16_##ROWS##_##NR(const uint16_t *x, int64_t ldx, int64_t k,                  \
                                   const uint16_t *w, int64_t wstride, const float *bias,      \
                                   int relu, uint16_t *y, int64_t ldy, int64_t ncols,          \
                                   const uint16_t *pf, int64_t pf_lo, int64_t pf_step) {       \
        __m512 acc[ROWS][NR];                                                                  \
        for (int r = 0; r < ROWS; r++)                                                         \
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();                      \
        const int64_t k2 = (k + 1) / 2, full = k / 2;                                          \
        for (int64_t p = 0; p < full; p++) BF16_STEP(ROWS, NR, bf16_pair)                      \
        if (k2 > full) {                                                                       \
            const int64_t p = full;                                                            \
            BF16_STEP(ROWS, NR, bf16_last_odd)                                                 \
        }                                                                                      \
        EPILOGUE(ROWS, NR, STORE_BF16)                                                         \
    }

KERNELS(KERNEL_BF16)

typedef void (*bf16_kernel)(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t,
                            const float *, int, uint16_t *, int64_t, int64_t, const uint16_t *,
                            int64_t, int64_t);
static const bf16_kernel BF16_KERNELS[4][TILE] = {
    {bf16_8_1, bf16_8_2, bf16_8_3}, {bf16_4_1, bf16_4_2, bf16_4_3},
    {bf16_2_1, bf16_2_2, bf16_2_3}, {bf16_1_1, bf16_1_2, bf16_1_3}};

#endif /* __AVX512BF16__ */


#if defined(BATON_AMX)
/* bfloat16 on AMX (TDPBF16PS), for amx_min_rows rows and more: a B tile is 16 k pairs of one
 * block, 16 rows of 64 bytes, which is the packed panel as it lies ([K/2][16][2]), so AMX reads
 * the same weights the register kernels read. The rows are copied once per call into a buffer
 * padded with zeros to 16 rows and 32 inputs (A tiles of 16 rows x 32 inputs); a block's last
 * partial run of k pairs is copied into a zeroed tile (the panel ends there). Each thread takes
 * its run of blocks two at a time (4 C tiles: 2 row tiles x 2 blocks) over every row pair,
 * K innermost; the output goes through a float32 tile buffer for bias, relu and rounding.
 * Accumulation is float32 in the instruction's order (denormal inputs and outputs flushed). */
#define AMX_ROW_PANEL 128 /* rows per panel: a multiple of 32 */

/* Rows from which bf16 runs on AMX (below, the register kernels: decode's few rows stream the
 * weights, where their next-panel prefetch keeps up with memory). */
static int64_t amx_min_rows = 8;

static void gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                          const uint16_t *packed, int64_t n, const float *bias, int relu,
                          uint16_t *y, int64_t ldy, int threads, uint16_t *a) {
    const int64_t blocks = (n + 15) / 16, pairs = (k + 1) / 2, wstride = pairs * 32;
    const int64_t chunks = (pairs + 15) / 16, lda = chunks * 32; /* A buffer: inputs per row */
    const int64_t mpad = (m + 15) / 16 * 16, tail = pairs - 16 * (chunks - 1);
    amx_pad_rows(x, m, k, ldx, a);
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
        const int64_t first = blocks * part / parts, end = blocks * (part + 1) / parts;
        amx_configure();
        float c[4][256] __attribute__((aligned(64)));
        uint16_t last[2][512] __attribute__((aligned(64))); /* a block's last k pairs, zero-padded */
        /* rows in panels of AMX_ROW_PANEL (the panel's padded rows stay in L2 while the
         * thread's blocks pass over them), then the thread's blocks two at a time */
        for (int64_t p0 = 0; p0 < mpad; p0 += AMX_ROW_PANEL)
        for (int64_t b0 = first; b0 < end; b0 += 2) {
            const int64_t p1 = p0 + AMX_ROW_PANEL < mpad ? p0 + AMX_ROW_PANEL : mpad;
            const int two = b0 + 1 < end;
            const uint16_t *w0 = packed + b0 * wstride, *w1 = w0 + wstride;
            if (tail < 16) {
                memset(last, 0, sizeof last);
                memcpy(last[0], w0 + (chunks - 1) * 512, 64 * tail);
                if (two) memcpy(last[1], w1 + (chunks - 1) * 512, 64 * tail);
            }
            for (int64_t m0 = p0; m0 < p1; m0 += 32) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                const uint16_t *a0 = a + m0 * lda, *a1 = a0 + 16 * lda;
                const int both = m0 + 16 < p1; /* a second row tile */
                const uint16_t *pf = m0 == p0 && b0 + 2 < end ? w0 + 2 * wstride : NULL;
                for (int64_t q = 0; q < chunks; q++) {
                    const int partial = q == chunks - 1 && tail < 16;
                    if (pf) /* the first row pair fetches the next pair's panels */
                        for (int l = 0; l < 32; l++)
                            _mm_prefetch((const char *)(pf + q * 512 + (l & 15) * 32 +
                                                        (l >> 4) * wstride),
                                         _MM_HINT_T0);
                    _tile_loadd(4, a0 + q * 32, 2 * lda);
                    _tile_loadd(6, partial ? last[0] : w0 + q * 512, 64);
                    if (two) _tile_loadd(7, partial ? last[1] : w1 + q * 512, 64);
                    else _tile_zero(7);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (both) {
                        _tile_loadd(5, a1 + q * 32, 2 * lda);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                for (int i = 0; i < 2; i++) {
                    const int64_t row0 = m0 + 16 * i;
                    const int64_t rows = m - row0 >= 16 ? 16 : m - row0;
                    if (rows <= 0) break;
                    for (int j = 0; j <= two; j++) {
                        const int64_t col0 = (b0 + j) * 16;
                        amx_epilogue(c[2 * i + j], rows, n - col0, NULL,
                                     bias ? bias + col0 : NULL, relu, y + row0 * ldy + col0,
                                     ldy);
                    }
                }
            }
        }
        _tile_release();
    }
}
#endif /* AMX */

/* Rows per chunk (a multiple of MR, at least 4 register blocks): a chunk's inputs take about
 * CHUNK_BYTES, so they stay in L2 beside the tile's panel while the thread's tiles pass over
 * them. One chunk of all the rows read the inputs from L3 once per tile: a prefill's 2048 rows
 * of 768 float32 inputs are 6 MB; in chunks, that linear runs ~10% faster. Decode's few rows
 * are one chunk. */
#define CHUNK_BYTES (512 * 1024)
static inline int64_t row_chunk(int64_t m, int64_t k, int64_t elem) {
    int64_t rows = CHUNK_BYTES / (k * elem) / MR * MR;
    if (rows < 4 * MR) rows = 4 * MR;
    return rows < m ? rows : m;
}

/* The register block for the rows left: 8, 4, 2 or 1 (index into the kernel tables). */
static inline int row_block(int64_t left) { return left >= 8 ? 0 : left >= 4 ? 1 : left >= 2 ? 2 : 3; }

#endif /* __AVX512F__ */

/* AMX from `rows` rows (< 1: never); returns whether this build and process run AMX (tests
 * run both paths on every shape). */
int baton_gemm_amx(int64_t rows) {
#if defined(BATON_AMX)
    amx_min_rows = rows < 1 ? INT64_MAX : rows;
    return amx_permitted();
#else
    (void)rows;
    return 0;
#endif
}

/* y[m][ldy] = x[m][ldx] @ W^T (+ bias[n]) (relu), W packed as above for `dtype` (n columns of k
 * inputs). bias: float32 or NULL. Returns 0, or -1 when this build does not run `dtype`. */
int baton_gemm(int dtype, const void *x, int64_t m, int64_t k, int64_t ldx, const void *packed,
               int64_t n, const float *bias, int relu, void *y, int64_t ldy, int threads) {
    if (!(baton_gemm_supported() >> dtype & 1)) return -1;
#if defined(__AVX512F__)
#if defined(BATON_AMX)
    if (dtype == DTYPE_BF16 && m >= amx_min_rows && amx_permitted()) {
        const int64_t lda = amx_lda(k), mpad = (m + 15) / 16 * 16;
        uint16_t *a = aligned_alloc(64, (size_t)(mpad * lda * 2));
        if (a) {
            gemm_bf16_amx(x, m, k, ldx, packed, n, bias, relu, y, ldy, threads, a);
            free(a);
            return 0;
        }
    }
#endif
    const int64_t blocks = (n + 15) / 16;
    const int64_t lines = dtype == DTYPE_BF16 ? (k + 1) / 2 : k; /* 64-byte lines per block */
    const int64_t wstride = lines * (dtype == DTYPE_BF16 ? 32 : 16); /* elements per block */
    const int64_t chunk = row_chunk(m, k, dtype == DTYPE_BF16 ? 2 : 4);
#pragma omp parallel num_threads(threads)
    {
        /* each thread a contiguous run of blocks, balanced to one block (whole tiles of 3 left a
         * thread a tile more: 22 vs 21 on a 2048-wide layer), cut into tiles of up to 3 */
        const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
        const int64_t first = blocks * part / parts, end = blocks * (part + 1) / parts;
        /* rows in chunks whose inputs stay in L2 while the thread's tiles pass over them */
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t c1 = c0 + chunk < m ? c0 + chunk : m, cm = c1 - c0;
        for (int64_t b0 = first; b0 < end; b0 += TILE) {
            const int64_t nr = end - b0 < TILE ? end - b0 : TILE;
            const int64_t ncols = n - b0 * 16;
            const float *tile_bias = bias ? bias + b0 * 16 : NULL;
            /* the tile to prefetch: this thread's next, or its first for the next chunk */
            const int64_t nb = b0 + TILE < end ? b0 + TILE : c1 < m ? first : -1;
            for (int64_t r = c0; r < c1;) {
                const int idx = row_block(c1 - r);
                const int64_t rows = MR >> idx;
                /* this row block prefetches lines [lo, hi) of each block of the next tile */
                const int64_t lo = lines * (r - c0) / cm, hi = lines * (r - c0 + rows) / cm;
                const int64_t step = ((hi - lo) << 16) / lines;
                if (dtype == DTYPE_F32) {
                    const float *w = (const float *)packed + b0 * wstride;
                    F32_KERNELS[idx][nr - 1]((const float *)x + r * ldx, ldx, k, w, wstride,
                                             tile_bias, relu, (float *)y + r * ldy + b0 * 16,
                                             ldy, ncols,
                                             nb >= 0 ? (const float *)packed + nb * wstride : NULL,
                                             lo, step);
                }
#if defined(__AVX512BF16__)
                else {
                    const uint16_t *w = (const uint16_t *)packed + b0 * wstride;
                    BF16_KERNELS[idx][nr - 1]((const uint16_t *)x + r * ldx, ldx, k, w,
                                              wstride, tile_bias, relu,
                                              (uint16_t *)y + r * ldy + b0 * 16, ldy, ncols,
                                              nb >= 0 ? (const uint16_t *)packed + nb * wstride
                                                      : NULL,
                                              lo, step);
                }
#endif
                r += rows;
            }
        }
        }
    }
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)packed; (void)n; (void)bias; (void)relu;
    (void)y; (void)ldy; (void)threads;
#endif
    return 0;
}
