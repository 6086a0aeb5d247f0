/* bfloat16 <-> float32 scalars shared by the native kernels (each .c file includes this header; the
 * kernel cache key hashes the headers next to a source too, see build.py). */
#ifndef LEANLM_BF16_H
#define LEANLM_BF16_H

#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even (what torch does for float -> bfloat16); NaN stays a quiet NaN. */
ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 values -> fp32 (a bf16 is the high half of an fp32) */
ALWAYS_INLINE __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 of 16 lanes with integer ops (nearest-even, NaN kept quiet), in the low half of each 32-bit lane:
 * the same bits as the scalar, where vcvtneps2bf16 would flush denormals. */
ALWAYS_INLINE __m512i f32x16_to_bf16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))),
        16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}
#endif

#endif
