/* Decoding quantized weights in registers, for the weight-only CPU kernels (cpu_quant.c for the
 * linears, cpu_moe.c for the routed experts). Nothing here keeps a dequantized copy: 16 weights
 * at a time become float32 lanes right before their FMAs.
 *
 * FP8 (e4m3, bias 7): sign-extending the byte to 32 bits and shifting it left by 20 puts the
 * 7 exponent|mantissa bits at float32's bits 20..26 and copies of the sign in 27..31; masking
 * with 0x87F00000 keeps the sign and those 7 bits. The float32 read from those bits is the e4m3
 * value times 2^-120 exactly (a float32 denormal for e4m3's own subnormals), so one multiply by
 * `scale * 2^120` gives `value * scale` rounded once, as `weight.float() * scale` does in torch.
 * Denormals must then be kept: QUANT_DENORMALS_ON clears MXCSR's DAZ/FTZ for the call.
 * The two e4m3 NaN codes (0x7f, 0xff) are refused at load (engine/quantization), never decoded.
 *
 * NVFP4 (e2m1): each byte holds two values, the even input in the low nibble (ModelOpt's packing,
 * vLLM's `low nibble first`); bit 3 of a nibble is the sign. VPERMPS indexes a 16-entry table
 * with the low 4 bits of each lane, so a nibble needs no mask. The table holds the e2m1 values
 * times 2^120 and the e4m3 group scale goes through the FP8 decode above: their product is
 * value * scale exactly (few significant bits each).
 *
 * AVX2 + FMA (no AVX-512: AMD Zen 3, older Intel) decodes 8 lanes at a time the same way: FP8 as
 * above. For NVFP4, VPERMPS only indexes 8 entries, so VPSHUFB looks each nibble up in a 16-byte
 * table of twice the e2m1 values as int8, into the top byte of a 32-bit lane (the lane's other
 * index bytes are 0, looking up +0, or have bit 7 set, giving 0), and VCVTDQ2PS turns that
 * integer into the value times 2^25, exactly. Multiplying by the e4m3 decode of the scale times
 * 2^95 gives value * scale exactly again: the two ISAs compute the same products.
 */
#ifndef BATON_CPU_QUANT_H
#define BATON_CPU_QUANT_H

#include <stdint.h>

#define QUANT_E4M3_MASK 0x87F00000
#define QUANT_TWO_POW_120 1.329227995784916e36f /* 2^120 */
#define QUANT_TWO_POW_60 0x1p60f
#define QUANT_TWO_POW_M60 0x1p-60f

#if defined(__AVX512F__)
#define QUANT_AVX512 1
#include <immintrin.h>

/* 16 e4m3 codes -> their values times 2^-120, as float32 lanes. */
static inline __m512 e4m3_scaled_down(const uint8_t *codes) {
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes));
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_slli_epi32(wide, 20), _mm512_set1_epi32(QUANT_E4M3_MASK)));
}

/* The e2m1 values times t (2^120, or 1), indexed by nibble. */
static inline __m512 fp4_table(const float t) {
    return _mm512_setr_ps(0.0f, 0.5f * t, 1.0f * t, 1.5f * t, 2.0f * t, 3.0f * t, 4.0f * t,
                          6.0f * t, -0.0f, -0.5f * t, -1.0f * t, -1.5f * t, -2.0f * t, -3.0f * t,
                          -4.0f * t, -6.0f * t);
}

/* 16 bytes of packed e2m1 (one per column: inputs 2p low, 2p+1 high) -> the two inputs' values
 * times 2^120. */
static inline void fp4_pair(const uint8_t *bytes, __m512 table, __m512 *even, __m512 *odd) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    *even = _mm512_permutexvar_ps(wide, table);
    *odd = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
}

#elif defined(__AVX2__) && defined(__FMA__)
#define QUANT_AVX2 1
#include <immintrin.h>

#define QUANT_TWO_POW_95 0x1p95f /* 2^(120 - 25): the AVX2 e2m1 decode's 2^25 taken back */

/* 8 e4m3 codes -> their values times 2^-120, as float32 lanes (the AVX-512 decode, 8 wide). */
static inline __m256 e4m3_scaled_down8(const uint8_t *codes) {
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(wide, 20), _mm256_set1_epi32(QUANT_E4M3_MASK)));
}

/* Twice the e2m1 values as int8, indexed by nibble, in both 128-bit lanes (VPSHUFB is in-lane). */
static inline __m256i fp4_table8(void) {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3,
                            4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

/* 8 bytes of packed e2m1 (one per column: inputs 2p low, 2p+1 high) -> the two inputs' values
 * times 2^25. A byte b widened to a lane: b << 20 puts the high nibble alone in the top byte
 * and the low nibble in bits 4..7 of the byte below (index 0 or bit 7 set: 0); b << 24 masked
 * to 0x0F000000 puts the low nibble alone in the top byte. */
static inline void fp4_pair8(const uint8_t *bytes, __m256i table, __m256 *even, __m256 *odd) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    const __m256i low =
        _mm256_and_si256(_mm256_slli_epi32(wide, 24), _mm256_set1_epi32(0x0F000000));
    *even = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(table, low));
    *odd = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(table, _mm256_slli_epi32(wide, 20)));
}

#endif /* __AVX512F__, __AVX2__ && __FMA__ */

#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
/* Denormals must not be flushed while decoding (see the top); restores the caller's MXCSR. */
#define QUANT_DENORMALS_ON(saved)                                                               \
    const unsigned int saved = _mm_getcsr();                                                    \
    _mm_setcsr(saved & ~0x8040u)
#define QUANT_DENORMALS_RESTORE(saved) _mm_setcsr(saved)
#endif

#endif
