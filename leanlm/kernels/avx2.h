/* Small AVX2 helpers the float32 kernels share (gemv_quant_avx2.c, decode_layers_f32.c). */
#ifndef LEANLM_AVX2_H
#define LEANLM_AVX2_H

#include <immintrin.h>

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#endif

/* The sum of 8 float lanes, in a fixed order. */
ALWAYS_INLINE float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#endif
