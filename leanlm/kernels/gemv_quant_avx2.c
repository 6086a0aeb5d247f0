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
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemv_avx2.h"
#include "linear_call.h"

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
    if (m0 == 0) prefetch_tile(a->w, K / 2, a->scales, a->mins, G * 4, n0, NB, N); /* later rows find it cached */
    __m256 tot[4][4], mins[4][4];
    zero_tile(tot, R, NB);
    zero_tile(mins, R, NB);
    for (int64_t g = 0; g < G; g++) {
        __m256 acc[4][4];
        zero_tile(acc, R, NB);
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
            const __m256 mn = _mm256_broadcast_ss(a->mins + (n0 + j) * G + g);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                tot[r][j] = _mm256_fmadd_ps(acc[r][j], s, tot[r][j]);
                /* the min term, in every lane alike: vector FMAs, so no scalar chain of G dependent FMAs per output */
                mins[r][j] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(a->sums + (m0 + r) * G + g), mins[r][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a->y[(m0 + r) * N + n0 + j] = hsum(tot[r][j]) + _mm256_cvtss_f32(mins[r][j]) + b;
    }
}

ROW_PASSES(int4, int4_args, tile_i4)

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

/* ------------------------------------------------------------------------------------- int4, int8 activations
 * W4A8: x quantized per call to int8 in groups of 32 (scale = max(absmax / 127, 1e-12), codes = x / scale rounded
 * half to even, as numerics.quantize_act_int8), then exact integer dot products of codes by vpmaddubsw (unsigned
 * nibbles times signed codes) and vpmaddwd, scaled by the activation group's and the weight group's scales in fp32.
 * The min term is min_g * (x scale * the sum of the codes), so the result is the float reference on the
 * fake-quantized x (cpu_a8.reference) to fp32 rounding: llama.cpp's Q4_1 x Q8_1 arithmetic.
 * 64 codes at a time (K a multiple of 64; groups of 32 or of a multiple of 64): one 32-byte load holds two 32-code
 * slices, whose low nibbles meet both slices' even inputs and high nibbles both odd ones (x is reordered per 64 to
 * match), so a pair costs two vpmaddubsw, one vpmaddwd and one conversion (a per-32 form, tried first, ran at half
 * the speed). Lanes 0-3 then belong to the first slice and 4-7 to the second; each is scaled by its own activation
 * and weight scale. The min term is a dot product of the row's mins with the groups' scaled code sums. */

typedef struct {
    const int8_t *xq;   /* [M, K] codes, reordered per 64 */
    const float *sxv;   /* [M, K / 64, 8]: each pair's activation scales, 4 lanes each */
    const float *tmin;  /* [M, G]: per weight group, the sum over its slices of scale * sum of codes */
    const uint8_t *w;
    const void *scales, *mins; /* [N, G]: float32, or IEEE half (GGUF's own d and m, read as stored) */
    const float *bias;
    float *y;
    int64_t K, N, gs;
} int4_a8_pair_args;

/* Weight scale g of a row, float32 or half. */
ALWAYS_INLINE float scale_at(const void *row, int64_t g, const int HALF) {
    return HALF ? _cvtsh_ss(((const uint16_t *)row)[g]) : ((const float *)row)[g];
}

/* The weight scales of a pair's two slices, 4 lanes each: two groups of 32, or one larger group for both. */
ALWAYS_INLINE __m256 pair_scales(const void *row, int64_t p, int64_t gs, const int HALF) {
    if (gs == 32) {
        const __m128 two = HALF ? _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)((const uint16_t *)row + 2 * p)))
                                : _mm_castpd_ps(_mm_load_sd((const double *)((const float *)row + 2 * p)));
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    }
    return _mm256_set1_ps(scale_at(row, 64 * p / gs, HALF));
}

/* sum_g mins[g] * T[g] over a row's G groups. */
ALWAYS_INLINE float min_dot(const void *mins, const float *T, int64_t G, const int HALF) {
    __m256 mv = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 m = HALF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)mins + g)))
                              : _mm256_loadu_ps((const float *)mins + g);
        mv = _mm256_fmadd_ps(m, _mm256_loadu_ps(T + g), mv);
    }
    float total = hsum(mv);
    for (; g < G; g++) total += scale_at(mins, g, HALF) * T[g];
    return total;
}

ALWAYS_INLINE void tile_i4a8p(const int4_a8_pair_args *a, int64_t m0, int64_t n0, const int R, const int NB,
                              const int HALF) {
    const int64_t K = a->K, gs = a->gs, G = K / gs, P = K / 64, side = HALF ? 2 : 4; /* bytes per scale */
    if (m0 == 0) prefetch_tile(a->w, K / 2, a->scales, a->mins, G * side, n0, NB, a->N);
    __m256 tot[4][4];
    zero_tile(tot, R, NB);
    for (int64_t p = 0; p < P; p++) {
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) {
            __m256i lo, hi;
            pair_nibbles(a->w + (n0 + j) * (K / 2), p, &lo, &hi);
            const __m256 ws = pair_scales((const char *)a->scales + (n0 + j) * G * side, p, gs, HALF);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) tot[r][j] = pair_row(a->xq, a->sxv, m0 + r, K, p, lo, hi, ws, tot[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const void *mn = (const char *)a->mins + (n0 + j) * G * side;
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a->y[(m0 + r) * a->N + n0 + j] = hsum(tot[r][j]) + min_dot(mn, a->tmin + (m0 + r) * G, G, HALF) + b;
    }
}

ALWAYS_INLINE void tile_i4a8p_float(const int4_a8_pair_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    tile_i4a8p(a, m0, n0, R, NB, 0);
}

ALWAYS_INLINE void tile_i4a8p_half(const int4_a8_pair_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    tile_i4a8p(a, m0, n0, R, NB, 1);
}

ROW_PASSES(int4_a8_pair, int4_a8_pair_args, tile_i4a8p_float)
ROW_PASSES(int4_a8_pair_half, int4_a8_pair_args, tile_i4a8p_half)

static int int4_a8_pairs(const float *x, const uint8_t *w, const void *scales, const void *mins, const float *bias,
                         float *y, int64_t M, int64_t N, int64_t K, int64_t gs, int half, int num_threads,
                         int64_t min_parallel_bytes) {
    const int64_t C = K / ACT_GROUP, G = K / gs, P = K / 64;
    float *buf = scratch_buffer((size_t)(M * K / 4 + 2 * M * C + M * P * 8 + M * G));
    if (buf == NULL) return -2;
    float *sx = buf, *t32 = sx + M * C, *sxv = t32 + M * C, *tmin = sxv + M * P * 8;
    int8_t *xq = (int8_t *)(tmin + M * G);
    quantize_pairs(x, M, K, xq, sx, t32, sxv);
    for (int64_t i = 0; i < M; i++) {
        for (int64_t g = 0; g < G; g++) {
            float t = 0.0f;
            for (int64_t c = g * gs / ACT_GROUP; c < (g + 1) * gs / ACT_GROUP; c++) t += t32[i * C + c];
            tmin[i * G + g] = t;
        }
    }
    const int4_a8_pair_args args = {xq, sxv, tmin, w, scales, mins, bias, y, K, N, gs};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K / 2, min_parallel_bytes);
    leanlm_row_passes(half ? int4_a8_pair_half_pass : int4_a8_pair_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* K a multiple of 64, groups of 32 or of a multiple of 64 (else -1). half_scales: scales and mins are IEEE half
 * [N, G] (where they are exactly so: GGUF's Q4_0 / Q4_1 blocks keep theirs in half), read in place of float32. */
int leanlm_linear_int4_a8_f32(const float *x, const uint8_t *w, const void *scales, const void *mins,
                              const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t gs, int64_t half,
                              int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || gs <= 0 || K % 64 != 0 || K % gs != 0 || (gs != 32 && gs % 64 != 0)) return -1;
    if (M == 0 || N == 0) return 0;
    return int4_a8_pairs(x, w, scales, mins, bias, y, M, N, K, gs, (int)half, num_threads, min_parallel_bytes);
}

/* W8A8: symmetric int8 weights (per channel: gs = K, or groups of a multiple of 32) with x quantized as for W4A8;
 * vpmaddubsw needs one unsigned operand, so it multiplies |w| by x carrying w's sign (llama.cpp's Q8_0 trick). */
typedef struct {
    const int8_t *xq; /* [M, K] codes in their own order */
    const float *sx;  /* [M, K / 32] */
    const int8_t *w;  /* [N, K] */
    const float *scales, *bias;
    float *y;
    int64_t K, N, gs;
} int8_a8_args;

ALWAYS_INLINE void tile_i8a8(const int8_a8_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    const int64_t K = a->K, gs = a->gs, G = K / gs, C = K / ACT_GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    if (m0 == 0) prefetch_tile(a->w, K, a->scales, NULL, G * 4, n0, NB, a->N);
    __m256 tot[4][4];
    zero_tile(tot, R, NB);
    for (int64_t g = 0; g < G; g++) {
        __m256 acc[4][4];
        zero_tile(acc, R, NB);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(a->w + (n0 + j) * K + k));
                const __m256i aw = _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) { /* x from L1, not held in registers (see pair_row) */
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->xq + (m0 + r) * K + k));
                    const __m256 sxv = _mm256_broadcast_ss(a->sx + (m0 + r) * C + k / ACT_GROUP);
                    const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
                    const __m256i p = _mm256_madd_epi16(p16, ones);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sxv, acc[r][j]);
                }
            }
        }
        scale_into(tot, acc, a->scales, n0, G, g, R, NB);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) a->y[(m0 + r) * a->N + n0 + j] = hsum(tot[r][j]) + b;
    }
}

ROW_PASSES(int8_a8, int8_a8_args, tile_i8a8)

int leanlm_linear_int8_a8_f32(const float *x, const int8_t *w, const float *scales, const float *bias, float *y,
                              int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads,
                              int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || gs <= 0 || gs % 32 != 0 || K % gs != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t C = K / ACT_GROUP;
    float *buf = scratch_buffer((size_t)(M * K / 4 + 2 * M * C));
    if (buf == NULL) return -2;
    float *sx = buf, *tmin = sx + M * C;
    int8_t *xq = (int8_t *)(tmin + M * C);
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, K, 0, xq + i * K, sx + i * C, tmin + i * C);
    const int8_a8_args args = {xq, sx, w, scales, bias, y, K, N, gs};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K, min_parallel_bytes);
    leanlm_row_passes(int8_a8_pass, &args, M, N, BLOCK_N, threads);
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
    zero_tile(tot, R, NB);
    for (int64_t g = 0; g < G; g++) {
        __m256 acc[4][4];
        zero_tile(acc, R, NB);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) {
                const __m256 q = load_i8(a->w + (n0 + j) * K + k);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    acc[r][j] = _mm256_fmadd_ps(q, _mm256_loadu_ps(a->x + (m0 + r) * K + k), acc[r][j]);
            }
        }
        scale_into(tot, acc, a->scales, n0, G, g, R, NB);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) a->y[(m0 + r) * N + n0 + j] = hsum(tot[r][j]) + b;
    }
}

ROW_PASSES(int8, int8_args, tile_i8)

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

/* ---------------------------------------------------------------------------- the decode loop's entries
 * linear_call.h's uniform entry with float32 x and y (decode_layers_f32.c calls it so): int4 tensors (codes,
 * scales, mins, bias) and ints (group size; W4A8: and half); int8 tensors (codes, scales [N, K / gs], bias) and
 * ints (gs; K per channel), exact or W8A8. */

int leanlm_linear_int4_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                                int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int4_f32(x, (const uint8_t *)c->tensors[0], (const float *)c->tensors[1],
                                  (const float *)c->tensors[2], (const float *)c->tensors[3], y, M, N, K, c->ints[0],
                                  threads, min_parallel_bytes);
}

int leanlm_linear_int8_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                                int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int8_f32(x, (const int8_t *)c->tensors[0], (const float *)c->tensors[1],
                                  (const float *)c->tensors[2], y, M, N, K, c->ints[0], threads, min_parallel_bytes);
}

int leanlm_linear_int4_a8_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N,
                                   int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int4_a8_f32(x, (const uint8_t *)c->tensors[0], c->tensors[1], c->tensors[2],
                                     (const float *)c->tensors[3], y, M, N, K, c->ints[0], c->ints[1], threads,
                                     min_parallel_bytes);
}

int leanlm_linear_int8_a8_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N,
                                   int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int8_a8_f32(x, (const int8_t *)c->tensors[0], (const float *)c->tensors[1],
                                     (const float *)c->tensors[2], y, M, N, K, c->ints[0], threads, min_parallel_bytes);
}
