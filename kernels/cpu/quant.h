/* Decoding quantized weights in registers, for the weight-only CPU kernels (cpu/quant.c for the
 * linears, cpu/moe.c for the routed experts). Nothing here keeps a dequantized copy: 16 weights
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
 * The linears (cpu/quant.c) hold 8 nibbles per 32-bit lane and look two up at once with VPERMW
 * in a table of the values as bf16 (exact: e2m1 needs 2 significant bits), widened to float32
 * by a shift or a mask (fp4_lane_pair), or fed as they are to VDPBF16PS; the routed experts
 * (cpu/moe.c) keep a byte per input pair and VPERMPS (fp4_pair).
 *
 * AVX2 + FMA (no AVX-512: AMD Zen 3, older Intel) decodes 8 lanes at a time the same way: FP8 as
 * above. For NVFP4, VPERMPS only indexes 8 entries, so VPSHUFB looks a block step's 16 bytes of
 * nibbles up in a 16-byte table of twice the e2m1 values as int8 (both 128-bit halves of the
 * register hold the same 16 bytes), and a second VPSHUFB per 8 columns moves each int8 into the
 * top byte of its 32-bit lane: VCVTDQ2PS makes that the value times 2^25, exactly. Multiplying
 * by the e4m3 decode of the scale times 2^95 gives value * scale exactly again: the two ISAs
 * compute the same products. Only in-lane shuffles: on Zen 3 a lane-crossing widen (VPMOVZXBD
 * ymm) costs three times a VPSHUFB, and shuffles and shifts share two of the four vector pipes.
 */
#ifndef BATON_CPU_QUANT_H
#define BATON_CPU_QUANT_H

#include <stdint.h>

#define QUANT_E4M3_MASK 0x87F00000
#define QUANT_TWO_POW_120 1.329227995784916e36f /* 2^120 */
#define QUANT_TWO_POW_60 0x1p60f
#define QUANT_TWO_POW_M60 0x1p-60f

#if defined(__AVX512F__) && defined(__AVX512BW__)
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

/* The e2m1 values times 2^exponent as bf16 bits, indexed by VPERMW's 5 bits: the 16 values
 * twice (bit 4 of an index is the next nibble's bit 0). */
static inline __m512i fp4_table_bf16(const int exponent) {
    static const uint16_t values[32] = {
        0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
        0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
        0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
        0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
    const __m512i plain = _mm512_loadu_si512((const void *)values);
    const __m512i magnitude = _mm512_and_si512(plain, _mm512_set1_epi16(0x7FFF));
    return _mm512_mask_add_epi16(plain, _mm512_test_epi16_mask(magnitude, magnitude), plain,
                                 _mm512_set1_epi16((short)(exponent << 7)));
}

/* cpu/quant.c's NVFP4 steps hold 8 nibbles in each 32-bit lane (inputs 2t and 2t + 1 at nibbles
 * t and 4 + t): from lanes shifted right by 4t, VPERMW looks both up at once, input 2t's value
 * in the low bf16 word and 2t + 1's in the high one, and a shift or a mask makes each a float32
 * (one lookup where two VPERMPS would take two: the decode is bound by the shuffle pipes). */
static inline void fp4_lane_pair(__m512i lanes, __m512i table, __m512 *even, __m512 *odd) {
    const __m512i pairs = _mm512_permutexvar_epi16(lanes, table);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

#if defined(__AVX512BF16__)
#define QUANT_DOT_BF16 1
#endif

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

/* VPSHUFB controls putting byte c of a 16-byte half into the top byte of lane c % 8 (the other
 * bytes zero): columns 0..7 (bytes 0..3 in the low half, 4..7 in the high) or 8..15. */
#define FP4_TOP_BYTES(c)                                                                        \
    _mm256_setr_epi8(-1, -1, -1, (c), -1, -1, -1, (c) + 1, -1, -1, -1, (c) + 2, -1, -1, -1,    \
                     (c) + 3, -1, -1, -1, (c) + 4, -1, -1, -1, (c) + 5, -1, -1, -1, (c) + 6,    \
                     -1, -1, -1, (c) + 7)

/* 16 bytes of packed e2m1 (16 columns, inputs 2p in the low nibbles, 2p + 1 in the high) ->
 * the values times 2^25: out[0], out[1] input 2p's columns 0..7, 8..15; out[2], out[3] 2p + 1's. */
static inline void fp4_step16(const uint8_t *bytes, __m256i table, __m256 out[4]) {
    const __m256i packed = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i even = _mm256_shuffle_epi8(table, _mm256_and_si256(packed, nibble));
    const __m256i odd =
        _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble));
    const __m256i first = FP4_TOP_BYTES(0), second = FP4_TOP_BYTES(8);
    out[0] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(even, first));
    out[1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(even, second));
    out[2] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(odd, first));
    out[3] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(odd, second));
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
