/* e^x in 16 float lanes, shared by the kernels that need it (softmax, SiLU); build.py hashes this header into
 * every kernel's cache key. */
#ifndef LEANLM_EXP512_H
#define LEANLM_EXP512_H

#include <immintrin.h>

/* 2^(x log2 e) as 2^n * p(f), |f| <= 0.5. Inputs below -87 give e^-87 (softmax inputs after subtracting the
 * max are <= 0; 1 + e^-87 rounds to 1, as 1 + e^x does for any x below it); large inputs overflow to inf
 * through vscalefps. */
static inline __m512 exp512_ps(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, log2e);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
    // 2^f by its Taylor series in f*ln2 (degree 6: relative error < 2e-7 on the interval)
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);  // p * 2^n
}

#endif
