/* Few-row weight-only quantized linear layers for x86-64 CPUs with AVX2 and FMA (no AVX512), float32 activations:
 *   int4: y[M, N] = x[M, K] @ (q[N, K] * scale[N, g] + min[N, g])^T (+ bias[N])   (g = k / gs, codes 0..15)
 *   int8: y[M, N] = x[M, K] @ (q[N, K] * scale[N, g])^T (+ bias[N])              (symmetric; gs = K: per channel)
 * and the dequantization of both to float32 [N, K] for many-row products (one sgemm instead of a pass per 8 rows).
 *
 * The weights stay packed: each 32-code slice is widened in registers and never written back. Per group, the dot
 * product of the raw codes with x is accumulated in fp32 (A_g), then scaled into the row's total; the min term is
 * sum_g min_g * S_g with S_g = the sum of x over group g, computed once per call. So y = sum_g s_g A_g + m_g S_g:
 * the same sum as the reference (x . (q s + m)), grouped differently, with fp32 roundings only.
 * int4 codes sit two a byte, low nibble first (k even), so x is reordered once per call, per 32 inputs, as
 * [x0 x2 .. x30 | x1 x3 .. x31] to meet the codes as the nibble masks deliver them.
 * Threads split N in contiguous blocks of whole weight rows (row_driver.h), so every output element is computed by
 * one thread in the same order whatever the thread count. Built and loaded by cpu_qgemv_avx2.py.
 */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_driver.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define BLOCK_N 16 /* weight rows per unit of work a thread takes */
#define SUB_ROWS 4 /* rows of x held in registers at once (a pass of up to 8 is done in two) */

ALWAYS_INLINE float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* Per calling thread: the reordered x and its group sums, kept between calls (grown when a call needs more). */
static __thread float *scratch;
static __thread size_t scratch_floats;

static float *scratch_buffer(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        scratch_floats = scratch == NULL ? 0 : floats;
    }
    return scratch;
}

/* ------------------------------------------------------------------------------------------------ int4 */

typedef struct {
    const float *xp;   /* [M, K] x reordered per 32 inputs (see the header) */
    const float *sums; /* [M, G] x summed per group */
    const uint8_t *w;  /* [N, K / 2] */
    const float *scales, *mins, *bias;
    float *y;
    int64_t K, N, gs;
} int4_args;

/* 32 codes of one weight row from 16 bytes, as floats in the reordered x's order: q[0..1] the low nibbles
 * (k = 0, 2, .., 30), q[2..3] the high nibbles (k = 1, 3, .., 31). */
ALWAYS_INLINE void unpack_i4(const uint8_t *src, __m256 q[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)src);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* Rows [m0, m0 + R) of x against weight rows [n0, n0 + NB); R * NB <= 4 keeps every accumulator in a register. */
ALWAYS_INLINE void tile_i4(const int4_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    const int64_t K = a->K, gs = a->gs, G = K / gs, N = a->N;
    __m256 tot[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) tot[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 acc[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) {
                __m256 q[4];
                unpack_i4(a->w + (n0 + j) * (K / 2) + k / 2, q);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const float *xr = a->xp + (m0 + r) * K + k;
                    __m256 p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
                    __m256 t = _mm256_mul_ps(q[2], _mm256_loadu_ps(xr + 16));
                    p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), p);
                    t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t);
                    acc[r][j] = _mm256_add_ps(acc[r][j], _mm256_add_ps(p, t));
                }
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) {
            const __m256 s = _mm256_broadcast_ss(a->scales + (n0 + j) * G + g);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) tot[r][j] = _mm256_fmadd_ps(acc[r][j], s, tot[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float *mn = a->mins + (n0 + j) * G;
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *S = a->sums + (m0 + r) * G;
            float min_term = 0.0f;
            for (int64_t g = 0; g < G; g++) min_term += mn[g] * S[g];
            a->y[(m0 + r) * N + n0 + j] = hsum(tot[r][j]) + min_term + b;
        }
    }
}

/* Weight rows [n_begin, n_end) for R rows: NB weight rows at a time, one at a time at the end. */
ALWAYS_INLINE void rows_i4(const int4_args *a, int64_t m0, int64_t n_begin, int64_t n_end, const int R, const int NB) {
    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) tile_i4(a, m0, n, R, NB);
    for (; n < n_end; n++) tile_i4(a, m0, n, R, 1);
}

static void int4_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const int4_args *a = (const int4_args *)args;
    for (int64_t i = m0; i < m0 + m; i += SUB_ROWS) {
        const int64_t r = m0 + m - i < SUB_ROWS ? m0 + m - i : SUB_ROWS;
        if (r == 1) rows_i4(a, i, n_begin, n_end, 1, 4);
        else if (r == 2) rows_i4(a, i, n_begin, n_end, 2, 2);
        else if (r == 3) rows_i4(a, i, n_begin, n_end, 3, 1);
        else rows_i4(a, i, n_begin, n_end, 4, 1);
    }
}

int leanlm_linear_int4_f32(const float *x, const uint8_t *w, const float *scales, const float *mins,
                           const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads,
                           int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || gs <= 0 || gs % 32 != 0 || K % gs != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / gs;
    float *xp = scratch_buffer((size_t)(M * K + M * G));
    if (xp == NULL) return -2;
    float *sums = xp + M * K;
    for (int64_t i = 0; i < M; i++) {
        const float *xr = x + i * K;
        float *dst = xp + i * K;
        for (int64_t k = 0; k < K; k += 32)
            for (int t = 0; t < 16; t++) dst[k + t] = xr[k + 2 * t], dst[k + 16 + t] = xr[k + 2 * t + 1];
        for (int64_t g = 0; g < G; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + k));
            sums[i * G + g] = hsum(s);
        }
    }
    const int4_args args = {xp, sums, w, scales, mins, bias, y, K, N, gs};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K / 2, min_parallel_bytes);
    leanlm_row_passes(int4_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ int8 */

typedef struct {
    const float *x; /* [M, K] */
    const int8_t *w; /* [N, K] */
    const float *scales, *bias;
    float *y;
    int64_t K, N, gs;
} int8_args;

ALWAYS_INLINE __m256 load_i8(const int8_t *src) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
}

ALWAYS_INLINE void tile_i8(const int8_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    const int64_t K = a->K, gs = a->gs, G = K / gs, N = a->N;
    __m256 tot[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) tot[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 acc[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) {
                const __m256 q = load_i8(a->w + (n0 + j) * K + k);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    acc[r][j] = _mm256_fmadd_ps(q, _mm256_loadu_ps(a->x + (m0 + r) * K + k), acc[r][j]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) {
            const __m256 s = _mm256_broadcast_ss(a->scales + (n0 + j) * G + g);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) tot[r][j] = _mm256_fmadd_ps(acc[r][j], s, tot[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) a->y[(m0 + r) * N + n0 + j] = hsum(tot[r][j]) + b;
    }
}

ALWAYS_INLINE void rows_i8(const int8_args *a, int64_t m0, int64_t n_begin, int64_t n_end, const int R, const int NB) {
    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) tile_i8(a, m0, n, R, NB);
    for (; n < n_end; n++) tile_i8(a, m0, n, R, 1);
}

static void int8_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const int8_args *a = (const int8_args *)args;
    for (int64_t i = m0; i < m0 + m; i += SUB_ROWS) {
        const int64_t r = m0 + m - i < SUB_ROWS ? m0 + m - i : SUB_ROWS;
        if (r == 1) rows_i8(a, i, n_begin, n_end, 1, 4);
        else if (r == 2) rows_i8(a, i, n_begin, n_end, 2, 2);
        else if (r == 3) rows_i8(a, i, n_begin, n_end, 3, 1);
        else rows_i8(a, i, n_begin, n_end, 4, 1);
    }
}

int leanlm_linear_int8_f32(const float *x, const int8_t *w, const float *scales, const float *bias, float *y,
                           int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || gs <= 0 || gs % 8 != 0 || K % gs != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int8_args args = {x, w, scales, bias, y, K, N, gs};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K, min_parallel_bytes);
    leanlm_row_passes(int8_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* ------------------------------------------------------------------------------------------ dequantization */

/* out [N, K] = q * scale + min per group, the product and the sum rounded separately as the reference does. */
void leanlm_dequantize_int4_f32(const uint8_t *w, const float *scales, const float *mins, float *out, int64_t N,
                                int64_t K, int64_t gs, int num_threads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * (K / 2);
        float *dst = out + n * K;
        for (int64_t g = 0; g < G; g++) {
            const float s = scales[n * G + g], m = mins[n * G + g];
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
                const uint8_t b = row[k / 2];
                const float lo = (float)(b & 0x0F) * s, hi = (float)(b >> 4) * s;
                dst[k] = lo + m;
                dst[k + 1] = hi + m;
            }
        }
    }
}

void leanlm_dequantize_int8_f32(const int8_t *w, const float *scales, float *out, int64_t N, int64_t K, int64_t gs,
                                int num_threads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const float s = scales[n * G + g];
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) out[n * K + k] = (float)w[n * K + k] * s;
        }
}
