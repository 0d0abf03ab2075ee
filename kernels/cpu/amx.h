/* AMX tiles (TDPBF16PS) for the bf16 GEMMs of cpu/gemm.c (bf16 weights) and cpu/quant.c (FP8 and
 * NVFP4 weights decoded into bf16 tiles). Both read B tiles of 16 k pairs x 16 columns, a 64-byte
 * row per k pair holding each column's (input 2p, input 2p + 1) as two bf16 words, and A tiles of
 * 16 rows x 32 inputs from the rows copied into a buffer padded with zeros to whole tiles.
 * A C tile is 16 x 16 float32; TDPBF16PS adds both products of a pair to it (float32, the
 * instruction's own order, denormal inputs and outputs flushed).
 *
 * Linux hands the tile state only to a process that asked for it (arch_prctl, once per process);
 * a file including this defines _GNU_SOURCE (syscall()) before its first include. */
#ifndef BATON_CPU_AMX_H
#define BATON_CPU_AMX_H

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BATON_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_tile_config;

static int amx_permitted(void) {
    static int state = 0; /* 0 not asked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 1;
    return state == 1;
}

/* Every tile 16 rows of 64 bytes (a thread's tile registers; call in each thread). */
static inline void amx_configure(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* The A buffer's inputs per row: k rounded up to whole tiles (32 inputs). */
static inline int64_t amx_lda(int64_t k) { return ((k + 1) / 2 + 15) / 16 * 32; }

/* x[m][ldx] (bf16) -> a[mpad][lda], zero-padded to mpad = m rounded up to 16 rows and lda inputs. */
static void amx_pad_rows(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, uint16_t *a) {
    const int64_t lda = amx_lda(k), mpad = (m + 15) / 16 * 16;
    for (int64_t r = 0; r < mpad; r++) {
        uint16_t *dst = a + r * lda;
        const int64_t have = r < m ? k : 0;
        if (have) memcpy(dst, x + r * ldx, 2 * have);
        memset(dst + have, 0, 2 * (lda - have));
    }
}

/* One block's 16 x 16 float32 tile (stride 16) -> y: times col (or 1), plus bias, relu, bf16
 * rounded to nearest even. */
static inline void amx_epilogue(const float *c, int64_t rows, int64_t ncols, const float *col,
                                const float *bias, int relu, uint16_t *y, int64_t ldy) {
    const __mmask16 mask = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
    const __m512 s = col ? _mm512_maskz_loadu_ps(mask, col) : _mm512_set1_ps(1.0f);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, b);
        if (relu) v = _mm512_max_ps(v, _mm512_setzero_ps());
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

#endif
