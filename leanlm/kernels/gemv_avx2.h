/* What the AVX2 GEMV libraries share (gemv_quant_avx2.c, gemv_kquant_avx2.c): the tiling constants, prefetch,
 * accumulator tiles, the row passes around a tile, the per-thread scratch, and int8 quantization of x per 32. */
#ifndef LEANLM_GEMV_AVX2_H
#define LEANLM_GEMV_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2.h"
#include "row_driver.h"

#define BLOCK_N 16 /* weight rows per unit of work a thread takes */
#define SUB_ROWS 4 /* rows of x held in registers at once (a pass of up to 8 is done in two) */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far ahead of a tile its weight rows (and their scales, mins) are prefetched */
#endif

/* Prefetch rows [row, row + n) of a row-major array with row_bytes per row (clipped to N rows): a tile's codes,
 * scales and mins are three streams the hardware prefetcher follows late, and a miss stalls every FMA after it. */
static inline void prefetch_rows(const void *base, int64_t row_bytes, int64_t row, int64_t n, int64_t N) {
    if (row >= N) return;
    if (row + n > N) n = N - row;
    const char *p = (const char *)base + row * row_bytes, *end = (const char *)base + (row + n) * row_bytes;
    for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}


/* Prefetch weight rows [n0, n0 + NB) of the tile PREFETCH_BYTES of codes ahead, with their scales and mins (mins
 * NULL: none); row_bytes of codes and side_bytes of scales (or mins) per row. */
ALWAYS_INLINE void prefetch_tile(const void *w, int64_t row_bytes, const void *scales, const void *mins,
                                 int64_t side_bytes, int64_t n0, const int NB, int64_t N) {
    const int64_t ahead = n0 + (PREFETCH_BYTES + row_bytes - 1) / row_bytes;
    prefetch_rows(w, row_bytes, ahead, NB, N);
    prefetch_rows(scales, side_bytes, ahead, NB, N);
    if (mins != NULL) prefetch_rows(mins, side_bytes, ahead, NB, N);
}

/* v[r][j] = 0 over an R x NB tile of accumulators. */
ALWAYS_INLINE void zero_tile(__m256 v[4][4], const int R, const int NB) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) v[r][j] = _mm256_setzero_ps();
}

/* tot[r][j] += acc[r][j] * the scale of weight row n0 + j's group g (float32 scales [N, G]). */
ALWAYS_INLINE void scale_into(__m256 tot[4][4], __m256 acc[4][4], const float *scales, int64_t n0, int64_t G,
                              int64_t g, const int R, const int NB) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const __m256 s = _mm256_broadcast_ss(scales + (n0 + j) * G + g);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) tot[r][j] = _mm256_fmadd_ps(acc[r][j], s, tot[r][j]);
    }
}

/* rows_NAME (weight rows [n_begin, n_end) for R rows of x: NB at a time, one at a time at the end) and NAME_pass
 * (the row driver's pass: rows of x in groups of SUB_ROWS, R * NB kept at 4 tiles of accumulators) around
 * TILE(args, m0, n0, R, NB), whose R and NB are compile-time constants in each call. */
#define ROW_PASSES(NAME, ARGS, TILE)                                                                                  \
    ALWAYS_INLINE void rows_##NAME(const ARGS *a, int64_t m0, int64_t n_begin, int64_t n_end, const int R,             \
                                   const int NB) {                                                                    \
        int64_t n = n_begin;                                                                                          \
        for (; n + NB <= n_end; n += NB) TILE(a, m0, n, R, NB);                                                       \
        for (; n < n_end; n++) TILE(a, m0, n, R, 1);                                                                  \
    }                                                                                                                 \
    static void NAME##_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {                \
        const ARGS *a = (const ARGS *)args;                                                                           \
        for (int64_t i = m0; i < m0 + m; i += SUB_ROWS) {                                                             \
            const int64_t r = m0 + m - i < SUB_ROWS ? m0 + m - i : SUB_ROWS;                                          \
            if (r == 1) rows_##NAME(a, i, n_begin, n_end, 1, 1);                                                      \
            else if (r == 2) rows_##NAME(a, i, n_begin, n_end, 2, 1);                                                 \
            else if (r == 3) rows_##NAME(a, i, n_begin, n_end, 3, 1);                                                 \
            else rows_##NAME(a, i, n_begin, n_end, 4, 1);                                                             \
        }                                                                                                             \
    }

/* Per calling thread: the reordered x and its group sums, kept between calls (grown when a call needs more). */
static __thread float *scratch;
static __thread size_t scratch_floats;

static inline float *scratch_buffer(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        scratch_floats = scratch == NULL ? 0 : floats;
    }
    return scratch;
}

#define ACT_GROUP 32

/* One row of x [K] to int8 codes in groups of 32 (reordered per 64 when `reorder`), with each group's scale and
 * scale * sum of codes: numerics.quantize_act_int8's arithmetic (a true division, rounding half to even). */
static inline void quantize_row(const float *x, int64_t K, int reorder, int8_t *codes, float *sx, float *tmin) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    for (int64_t c = 0; c < K / ACT_GROUP; c++) {
        const float *xg = x + c * ACT_GROUP;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xg + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float s = _mm_cvtss_f32(_mm_max_ss(h2, _mm_movehdup_ps(h2))) / 127.0f;
        if (s < 1e-12f) s = 1e-12f;
        const __m256 sv = _mm256_set1_ps(s);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, nlim), lim));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
        const __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (!reorder) {
            _mm256_storeu_si256((__m256i *)(codes + c * ACT_GROUP), p8);
        } else { /* per pair of 32s: both slices' evens, then both slices' odds */
            int8_t t8[ACT_GROUP];
            _mm256_storeu_si256((__m256i *)t8, p8);
            int8_t *even = codes + (c / 2) * 64 + (c % 2) * 16, *odd = even + 32;
            for (int t = 0; t < ACT_GROUP / 2; t++) even[t] = t8[2 * t], odd[t] = t8[2 * t + 1];
        }
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        const int total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
        sx[c] = s;
        tmin[c] = s * (float)total;
    }
}


/* The W4A8 pair form (64 codes: one 32-byte load of nibbles against x reordered per 64; gemv_quant_avx2.c's W4A8
 * and gemv_kquant_avx2.c's Q4_K share it). */

/* A weight row's pair p (32 bytes of nibbles) as low and high nibbles. */
ALWAYS_INLINE void pair_nibbles(const uint8_t *row, int64_t p, __m256i *lo, __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + 32 * p));
    *lo = _mm256_and_si256(bytes, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
}

/* tot + the pair's exact integer products (lanes 0-3: the first 32-code slice, 4-7: the second) times scale. Each
 * 16-bit lane is at most 2 * 15 * 127 per product pair: the sum of both stays below 2^15. */
ALWAYS_INLINE __m256 pair_fma(__m256i lo, __m256i hi, __m256i xe, __m256i xo, __m256 scale, __m256 tot) {
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1))), scale, tot);
}

/* tot + row `row` of x's pair p against a weight pair's nibbles (lo, hi) and scales ws. x is read from memory (L1)
 * here, per weight row, on purpose: holding a tile's x in registers (8 code vectors and 4 scale vectors for 4 rows)
 * spilled the accumulators to the stack, and each FMA then waited on a store-to-load round trip (4x slower). */
ALWAYS_INLINE __m256 pair_row(const int8_t *xq, const float *sxv, int64_t row, int64_t K, int64_t p, __m256i lo,
                              __m256i hi, __m256 ws, __m256 tot) {
    const int8_t *xr = xq + row * K + 64 * p;
    const __m256i xe = _mm256_loadu_si256((const __m256i *)xr), xo = _mm256_loadu_si256((const __m256i *)(xr + 32));
    const __m256 sx = _mm256_loadu_ps(sxv + (row * (K / 64) + p) * 8);
    return pair_fma(lo, hi, xe, xo, _mm256_mul_ps(sx, ws), tot);
}

/* M rows of x [M, K] quantized per 32 and reordered per 64 for the pair form: codes xq, scales sx and scale * code
 * sums t32 [M, K / 32], and each pair's scales spread over its lanes, sxv [M, K / 64, 8]. */
static inline void quantize_pairs(const float *x, int64_t M, int64_t K, int8_t *xq, float *sx, float *t32, float *sxv) {
    const int64_t C = K / ACT_GROUP, P = K / 64;
    for (int64_t i = 0; i < M; i++) {
        quantize_row(x + i * K, K, 1, xq + i * K, sx + i * C, t32 + i * C);
        for (int64_t c = 0; c < C; c++)
            for (int l = 0; l < 4; l++) sxv[(i * P + c / 2) * 8 + (c % 2) * 4 + l] = sx[i * C + c];
    }
}

#endif
