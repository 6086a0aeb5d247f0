/* Small-M weight-only quantized linear layers for x86-64 with AVX512-BF16 (batch-1..8 decode):
 *   int8: y[M, N] = x[M, K] @ (q[N, K] * scale[N, g])^T (+ bias[N])   (symmetric, per channel or per group)
 *   int4: y[M, N] = x[M, K] @ (q[N, K] * scale[N, g] + min[N, g])^T (+ bias)  (g = k / group_size)
 *
 * Weights are widened to bfloat16 exactly in registers and multiplied with the unchanged bf16 activations
 * by vdpbf16ps (fp32 accumulation), so the only roundings are fp32 sums and the final bf16 output, as in
 * gemv_bf16.c. int8: vpmovsxbd + vcvtdq2ps + vcvtne2ps2bf16. int4: a nibble q is OR-ed into the mantissa
 * of bf16 128.0 (0x4300 | q == 128 + q exactly), so a group's dot product is sum x (128 + q); the 128 *
 * sum(x) it carries is removed together with the mins term: y = sum_g s_g A_g + (min_g - 128 s_g) S_g,
 * where S_g = sum of x over group g (fp32, computed once per call). The nibbles come out of 16-bit lanes by
 * shifts and masks, in the order k = 4 l + i (see BLOCK_K), so x is permuted once per call to match.
 * Each loaded weight slice is shared by all M rows; threads split N like gemv_bf16.c. Built and loaded by
 * cpu_qgemv.py; links against the libgomp already in the process (torch's copy).
 */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "linear_call.h"
#include "row_driver.h"

#define MAX_ROWS LEANLM_MAX_ROWS
#define BLOCK_N 32  /* weight rows per unit of work handed to a thread; a multiple of every NB below */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* of 2-32 KiB on the SmolLM2 chain (a busy machine): best or near it for M = 1 and 4 */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif

/* Per-row side data (scales, mins, bias) are separate streams that a tile needs at once (a demand miss
 * would stall every tile for a DRAM latency): prefetch rows [row, row + num_rows) of such an array,
 * `row_bytes` per row, clipped to its N rows. */
ALWAYS_INLINE void prefetch_rows(const void *base, int64_t row_bytes, int64_t row, int64_t num_rows, int64_t N) {
    if (base == NULL || row >= N) return;
    if (row + num_rows > N) num_rows = N - row;
    const uintptr_t begin = ((uintptr_t)base + (uintptr_t)(row * row_bytes)) & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)base + (uintptr_t)((row + num_rows) * row_bytes);
    for (uintptr_t a = begin; a < end; a += 64) _mm_prefetch((const char *)a, PREFETCH_HINT);
}

/* How many weight rows ahead the weight prefetch reaches: side data is prefetched that far ahead. */
ALWAYS_INLINE int64_t rows_ahead(int64_t weight_row_bytes) {
    return (PREFETCH_BYTES + weight_row_bytes - 1) / weight_row_bytes;
}

/* ------------------------------------------------------------------------------------------------ int8 */

/* 32 int8 weights (two 16-byte halves, each optionally masked) -> 32 bf16, exactly. */
ALWAYS_INLINE __m512bh i8_to_bf16(__m128i lo, __m128i hi) {
    const __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    const __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    return _mm512_cvtne2ps_pbh(fhi, flo);
}

ALWAYS_INLINE void tile_i8(const uint16_t *x, const int8_t *w, const float *scales, const uint16_t *bias,
                           uint16_t *y, int64_t K, int64_t N, int64_t n0, const int M, const int NB) {
    __m512 acc[MAX_ROWS][8];
    const int8_t *wr[8];
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) wr[j] = w + (n0 + j) * K;
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();

    /* Prefetch PREFETCH_BYTES ahead along the tile's (contiguous) rows, at the rate the loads consume
     * them (NB * 32 bytes per step), as in gemv_bf16.c. */
    const char *ahead = (const char *)(w + n0 * K) + PREFETCH_BYTES;
    prefetch_rows(scales, sizeof(float), n0 + rows_ahead(K), NB, N);
    prefetch_rows(bias, sizeof(uint16_t), n0 + rows_ahead(K), NB, N);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, ahead += 32 * NB) {
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < NB; j += 2) _mm_prefetch(ahead + 32 * j, PREFETCH_HINT);
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++)
            wv[j] = i8_to_bf16(_mm_loadu_si128((const __m128i *)(wr[j] + k)),
                               _mm_loadu_si128((const __m128i *)(wr[j] + k + 16)));
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) { /* K % 32 leftover elements: masked loads read zeros past the end, which add nothing */
        const __mmask32 mask = (__mmask32)((1u << (K - k)) - 1u);
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++)
            wv[j] = i8_to_bf16(_mm_maskz_loadu_epi8((__mmask16)(mask & 0xffffu), wr[j] + k),
                               _mm_maskz_loadu_epi8((__mmask16)(mask >> 16), wr[j] + k + 16));
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }

#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        const float s = scales[n0 + j];
        const float b = bias ? bf16_to_f32(bias[n0 + j]) : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) y[i * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(acc[i][j]) * s + b);
    }
}

/* The group-wise form (GGUF Q8_0 / Q5_0: gs a multiple of 32 dividing K): each group's dot product is
 * accumulated on its own, then scaled into the row's total (tot += acc_g * s_g) as tile_i4 does, because a
 * group scale times an int8 code is not exact in bf16. */
ALWAYS_INLINE void tile_i8g(const uint16_t *x, const int8_t *w, const float *scales, const uint16_t *bias,
                            uint16_t *y, int64_t K, int64_t N, int64_t gs, int64_t n0, const int M, const int NB) {
    __m512 tot[MAX_ROWS][8];
    const int8_t *wr[8];
    const float *sr[8];
    const int64_t G = K / gs;
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) wr[j] = w + (n0 + j) * K, sr[j] = scales + (n0 + j) * G;
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) tot[i][j] = _mm512_setzero_ps();

    const char *ahead = (const char *)(w + n0 * K) + PREFETCH_BYTES;
    prefetch_rows(scales, G * (int64_t)sizeof(float), n0 + rows_ahead(K), NB, N);
    prefetch_rows(bias, sizeof(uint16_t), n0 + rows_ahead(K), NB, N);
    for (int64_t g = 0; g < G; g++) {
        __m512 acc[MAX_ROWS][8];
#pragma GCC unroll 8
        for (int i = 0; i < M; i++)
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 32, ahead += 32 * NB) {
            __m512bh wv[8];
#pragma GCC unroll 8
            for (int j = 0; j < NB; j += 2) _mm_prefetch(ahead + 32 * j, PREFETCH_HINT);
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++)
                wv[j] = i8_to_bf16(_mm_loadu_si128((const __m128i *)(wr[j] + k)),
                                   _mm_loadu_si128((const __m128i *)(wr[j] + k + 16)));
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
#pragma GCC unroll 8
                for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const __m512 sv = _mm512_set1_ps(sr[j][g]);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) tot[i][j] = _mm512_fmadd_ps(acc[i][j], sv, tot[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        const float b = bias ? bf16_to_f32(bias[n0 + j]) : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) y[i * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(tot[i][j]) + b);
    }
}

/* Groups of 16 (GGUF Q6_K): a 32-k step holds two groups. vdpbf16ps lane p sums k + 2p and k + 2p + 1, so
 * lanes 0-7 belong to the first group and 8-15 to the second: each step's partial sums are scaled lane-wise
 * by [s_g x 8, s_g+1 x 8] into the total. */
ALWAYS_INLINE void tile_i8h(const uint16_t *x, const int8_t *w, const float *scales, const uint16_t *bias,
                            uint16_t *y, int64_t K, int64_t N, int64_t n0, const int M, const int NB) {
    __m512 tot[MAX_ROWS][8];
    const int8_t *wr[8];
    const float *sr[8];
    const int64_t G = K / 16;
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) wr[j] = w + (n0 + j) * K, sr[j] = scales + (n0 + j) * G;
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) tot[i][j] = _mm512_setzero_ps();

    const char *ahead = (const char *)(w + n0 * K) + PREFETCH_BYTES;
    prefetch_rows(scales, G * (int64_t)sizeof(float), n0 + rows_ahead(K), NB, N);
    prefetch_rows(bias, sizeof(uint16_t), n0 + rows_ahead(K), NB, N);
    for (int64_t k = 0; k < K; k += 32, ahead += 32 * NB) {
#pragma GCC unroll 8
        for (int j = 0; j < NB; j += 2) _mm_prefetch(ahead + 32 * j, PREFETCH_HINT);
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const __m512bh wv = i8_to_bf16(_mm_loadu_si128((const __m128i *)(wr[j] + k)),
                                           _mm_loadu_si128((const __m128i *)(wr[j] + k + 16)));
            const __m512 sv = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castsi128_ps(
                                                                _mm_loadl_epi64((const __m128i *)(sr[j] + k / 16)))));
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) { /* a fresh chain per step: out-of-order overlaps the steps */
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
                tot[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, wv), sv, tot[i][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        const float b = bias ? bf16_to_f32(bias[n0 + j]) : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) y[i * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(tot[i][j]) + b);
    }
}

ALWAYS_INLINE void warm_range(const void *start, int64_t range_bytes) {
    /* Nothing is in flight yet at the start of a thread's range: request its first PREFETCH_BYTES. */
    const int64_t warm = range_bytes < PREFETCH_BYTES ? range_bytes : PREFETCH_BYTES;
    for (int64_t off = 0; off < warm; off += 64) _mm_prefetch((const char *)start + off, PREFETCH_HINT);
}

/* gs == K: per channel (tile_i8, any K); 16: tile_i8h; otherwise groups of a multiple of 32 (tile_i8g),
 * which holds two accumulators per (row, weight row), hence its own, smaller NB. */
#define DEFINE_ROWS_I8(M_, NB_, NBG_)                                                                    \
    static void rows_i8_m##M_(const uint16_t *x, const int8_t *w, const float *s, const uint16_t *bias,  \
                              uint16_t *y, int64_t K, int64_t N, int64_t gs, int64_t n_begin,            \
                              int64_t n_end) {                                                           \
        const int64_t G = K / gs;                                                                        \
        warm_range(w + n_begin * K, (n_end - n_begin) * K);                                              \
        prefetch_rows(s, G * (int64_t)sizeof(float), n_begin, rows_ahead(K) + NB_, n_end);               \
        prefetch_rows(bias, sizeof(uint16_t), n_begin, rows_ahead(K) + NB_, n_end);                      \
        int64_t n = n_begin;                                                                             \
        if (G == 1) {                                                                                    \
            for (; n + NB_ <= n_end; n += NB_) tile_i8(x, w, s, bias, y, K, N, n, M_, NB_);              \
            for (; n < n_end; n++) tile_i8(x, w, s, bias, y, K, N, n, M_, 1);                            \
        } else if (gs == 16) {                                                                           \
            for (; n + NB_ <= n_end; n += NB_) tile_i8h(x, w, s, bias, y, K, N, n, M_, NB_);             \
            for (; n < n_end; n++) tile_i8h(x, w, s, bias, y, K, N, n, M_, 1);                           \
        } else {                                                                                         \
            for (; n + NBG_ <= n_end; n += NBG_) tile_i8g(x, w, s, bias, y, K, N, gs, n, M_, NBG_);      \
            for (; n < n_end; n++) tile_i8g(x, w, s, bias, y, K, N, gs, n, M_, 1);                       \
        }                                                                                                \
    }
DEFINE_ROWS_I8(1, 8, 8)
DEFINE_ROWS_I8(2, 8, 4)
DEFINE_ROWS_I8(3, 4, 2)
DEFINE_ROWS_I8(4, 4, 2)
DEFINE_ROWS_I8(5, 2, 1)
DEFINE_ROWS_I8(6, 2, 1)
DEFINE_ROWS_I8(7, 2, 1)
DEFINE_ROWS_I8(8, 2, 1)

typedef void (*rows_i8_fn)(const uint16_t *, const int8_t *, const float *, const uint16_t *, uint16_t *,
                           int64_t, int64_t, int64_t, int64_t, int64_t);
static const rows_i8_fn ROWS_I8[MAX_ROWS + 1] = {0,           rows_i8_m1, rows_i8_m2, rows_i8_m3, rows_i8_m4,
                                                 rows_i8_m5, rows_i8_m6, rows_i8_m7, rows_i8_m8};

typedef struct {
    const uint16_t *x;
    const int8_t *w;
    const float *scales;
    const uint16_t *bias;
    uint16_t *y;
    int64_t K, N, gs;
} int8_args;

static void int8_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const int8_args *a = args;
    ROWS_I8[m](a->x + m0 * a->K, a->w, a->scales, a->bias, a->y + m0 * a->N, a->K, a->N, a->gs, n_begin, n_end);
}

/* x [M, K] bf16, w [N, K] int8, scales [N, K / gs] fp32, bias [N] bf16 or NULL, y [M, N] bf16; all
 * contiguous. gs == K: one scale per channel (any K); else 16 or a multiple of 32, dividing K (K % 32 == 0).
 * Returns 0, or -1 on bad sizes. */
int leanlm_linear_int8(const uint16_t *x, const int8_t *w, const float *scales, const uint16_t *bias,
                       uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads,
                       int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0) return -1;
    if (M == 0 || N == 0) return 0;
    if (gs != K && (gs <= 0 || (gs % 32 != 0 && gs != 16) || K % gs != 0 || K % 32 != 0)) return -1;
    const int8_args args = {x, w, scales, bias, y, K, N, gs};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K, min_parallel_bytes);
    leanlm_row_passes(int8_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ int4 */

/* Weights go in blocks of 128 k = 64 bytes of a row. Seen as 32 16-bit lanes, lane l holds the nibbles of
 * k = 4l, 4l + 1, 4l + 2, 4l + 3 at bits 0, 4, 8, 12; OR-ing one of them into bf16 128.0 (0x4300) gives
 * 128 + q exactly, so four shift/mask steps (no shuffles) make four bf16 vectors, w[i] lane l <-> k = 4l + i.
 * x is permuted once per call to match: xp[128 b + 32 i + l] = x[128 b + 4 l + i]. */
#define BLOCK_K 128

ALWAYS_INLINE void nibbles_to_bf16(__m512i v, __m512bh wv[4]) {
    const __m512i low4 = _mm512_set1_epi16(0x000f), magic = _mm512_set1_epi16(0x4300);
    wv[0] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, magic, 0xea); /* (a & b) | c */
    wv[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, magic, 0xea);
    wv[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, magic, 0xea);
    wv[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), magic);
}

/* Per 128-k block (used when group_size % 128 != 0): the block's first group g0, a mask of the groups it
 * touches (from g0), and for fp32 lane p the group of its k minus g0. vdpbf16ps lane p sums input lanes
 * 2p, 2p + 1, i.e. k = 8p + i and 8p + 4 + i: the 32-k quarter p / 4 of the block. */
typedef struct {
    __m512i idx;
    int64_t g0;
    __mmask16 mask;
} block_groups;

/* NB weight rows [n0, n0 + NB) against M rows of permuted x (xp [M, Kp]) and group sums S [M, G].
 * WHOLE: group_size % 128 == 0, so each group is whole blocks and its scale is applied once per group;
 * otherwise every block's partial sums are scaled lane-wise through the block_groups table bg. */
ALWAYS_INLINE void tile_i4(const uint16_t *xp, const float *S, const block_groups *bg, const uint8_t *w,
                           const float *scales, const float *mins, const uint16_t *bias, uint16_t *y, int64_t K,
                           int64_t Kp, int64_t N, int64_t G, int64_t gs, int64_t n0, const int M, const int NB,
                           const int WHOLE) {
    __m512 tot[MAX_ROWS][8];
    const uint8_t *wr[8];
    const float *sr[8];
    const int64_t row_bytes = K / 2;
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) wr[j] = w + (n0 + j) * row_bytes, sr[j] = scales + (n0 + j) * G;
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) tot[i][j] = _mm512_setzero_ps();

    /* Prefetch ahead at the rate the loads consume the tile's contiguous rows (NB lines per block). */
    const char *ahead = (const char *)(w + n0 * row_bytes) + PREFETCH_BYTES;
    const int64_t side_row = n0 + rows_ahead(row_bytes);
    prefetch_rows(scales, G * (int64_t)sizeof(float), side_row, NB, N);
    prefetch_rows(mins, G * (int64_t)sizeof(float), side_row, NB, N);
    prefetch_rows(bias, sizeof(uint16_t), side_row, NB, N);
    if (WHOLE) {
        for (int64_t g = 0; g < G; g++) {
            __m512 acc[MAX_ROWS][8];
#pragma GCC unroll 8
            for (int i = 0; i < M; i++)
#pragma GCC unroll 8
                for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += BLOCK_K, ahead += 64 * NB) {
#pragma GCC unroll 8
                for (int j = 0; j < NB; j++) {
                    _mm_prefetch(ahead + 64 * j, PREFETCH_HINT);
                    __m512bh wv[4];
                    nibbles_to_bf16(_mm512_loadu_si512((const void *)(wr[j] + k / 2)), wv);
#pragma GCC unroll 8
                    for (int i = 0; i < M; i++) {
                        const uint16_t *xk = xp + i * Kp + k;
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(xk), wv[0]);
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(xk + 32), wv[1]);
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(xk + 64), wv[2]);
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(xk + 96), wv[3]);
                    }
                }
            }
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) {
                const __m512 sv = _mm512_set1_ps(sr[j][g]);
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) tot[i][j] = _mm512_fmadd_ps(acc[i][j], sv, tot[i][j]);
            }
        }
    } else {
        for (int64_t k = 0; k < K; k += BLOCK_K, ahead += 64 * NB) {
            const block_groups *b = bg + k / BLOCK_K;
            /* The last block may be partial: read only its bytes (zero codes times xp's zero padding). */
            const __mmask64 bytes = K - k >= BLOCK_K ? ~(__mmask64)0 : (((__mmask64)1 << ((K - k) / 2)) - 1);
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) {
                _mm_prefetch(ahead + 64 * j, PREFETCH_HINT);
                __m512bh wv[4];
                nibbles_to_bf16(_mm512_maskz_loadu_epi8(bytes, wr[j] + k / 2), wv);
                const __m512 sv = _mm512_permutexvar_ps(b->idx, _mm512_maskz_loadu_ps(b->mask, sr[j] + b->g0));
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) { /* a fresh chain per block: out-of-order overlaps blocks */
                    const uint16_t *xk = xp + i * Kp + k;
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xk), wv[0]);
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xk + 32), wv[1]);
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xk + 64), wv[2]);
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xk + 96), wv[3]);
                    tot[i][j] = _mm512_fmadd_ps(a, sv, tot[i][j]);
                }
            }
        }
    }

    /* + sum_g (min_g - 128 scale_g) * S_g, 16 groups at a time. */
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        const float *mr = mins + (n0 + j) * G;
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 mask = G - g >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (G - g)) - 1u);
            const __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_maskz_loadu_ps(mask, sr[j] + g),
                                              _mm512_maskz_loadu_ps(mask, mr + g));
#pragma GCC unroll 8
            for (int i = 0; i < M; i++)
                tot[i][j] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, S + i * G + g), tot[i][j]);
        }
        const float b = bias ? bf16_to_f32(bias[n0 + j]) : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) y[i * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(tot[i][j]) + b);
    }
}

#define DEFINE_ROWS_I4(M_, NB_, WHOLE_, NAME)                                                               \
    static void NAME(const uint16_t *xp, const float *S, const block_groups *bg, const uint8_t *w,          \
                     const float *s, const float *mn, const uint16_t *bias, uint16_t *y, int64_t K,         \
                     int64_t Kp, int64_t N, int64_t G, int64_t gs, int64_t n_begin, int64_t n_end) {         \
        warm_range(w + n_begin * (K / 2), (n_end - n_begin) * (K / 2));                                      \
        prefetch_rows(s, G * (int64_t)sizeof(float), n_begin, rows_ahead(K / 2) + NB_, n_end);              \
        prefetch_rows(mn, G * (int64_t)sizeof(float), n_begin, rows_ahead(K / 2) + NB_, n_end);             \
        prefetch_rows(bias, sizeof(uint16_t), n_begin, rows_ahead(K / 2) + NB_, n_end);                     \
        int64_t n = n_begin;                                                                                \
        for (; n + NB_ <= n_end; n += NB_)                                                                  \
            tile_i4(xp, S, bg, w, s, mn, bias, y, K, Kp, N, G, gs, n, M_, NB_, WHOLE_);                     \
        for (; n < n_end; n++) tile_i4(xp, S, bg, w, s, mn, bias, y, K, Kp, N, G, gs, n, M_, 1, WHOLE_);    \
    }
/* M * NB >= 4 independent accumulator chains (vdpbf16ps has a latency of several cycles), and no spills:
 * the whole-group path keeps two accumulators per row pair (acc and tot), hence its smaller NB. */
DEFINE_ROWS_I4(1, 4, 1, rows_i4_m1_w)
DEFINE_ROWS_I4(2, 2, 1, rows_i4_m2_w)
DEFINE_ROWS_I4(3, 2, 1, rows_i4_m3_w)
DEFINE_ROWS_I4(4, 2, 1, rows_i4_m4_w)
DEFINE_ROWS_I4(5, 1, 1, rows_i4_m5_w)
DEFINE_ROWS_I4(6, 1, 1, rows_i4_m6_w)
DEFINE_ROWS_I4(7, 1, 1, rows_i4_m7_w)
DEFINE_ROWS_I4(8, 1, 1, rows_i4_m8_w)
DEFINE_ROWS_I4(1, 8, 0, rows_i4_m1_b)
DEFINE_ROWS_I4(2, 4, 0, rows_i4_m2_b)
DEFINE_ROWS_I4(3, 2, 0, rows_i4_m3_b)
DEFINE_ROWS_I4(4, 2, 0, rows_i4_m4_b)
DEFINE_ROWS_I4(5, 1, 0, rows_i4_m5_b)
DEFINE_ROWS_I4(6, 1, 0, rows_i4_m6_b)
DEFINE_ROWS_I4(7, 1, 0, rows_i4_m7_b)
DEFINE_ROWS_I4(8, 1, 0, rows_i4_m8_b)

typedef void (*rows_i4_fn)(const uint16_t *, const float *, const block_groups *, const uint8_t *, const float *,
                           const float *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t);
static const rows_i4_fn ROWS_I4[2][MAX_ROWS + 1] = {
    {0, rows_i4_m1_b, rows_i4_m2_b, rows_i4_m3_b, rows_i4_m4_b, rows_i4_m5_b, rows_i4_m6_b, rows_i4_m7_b,
     rows_i4_m8_b},
    {0, rows_i4_m1_w, rows_i4_m2_w, rows_i4_m3_w, rows_i4_m4_w, rows_i4_m5_w, rows_i4_m6_w, rows_i4_m7_w,
     rows_i4_m8_w},
};

/* A 64-byte aligned buffer of at least `bytes`, owned by the calling thread and reused by its later calls
 * (grown as needed, never freed: one per thread that calls the kernel). NULL when out of memory. */
static char *scratch_buffer(size_t bytes) {
    static _Thread_local char *buffer = NULL;
    static _Thread_local size_t capacity = 0;
    if (bytes > capacity) {
        const size_t want = (bytes + 4095) / 4096 * 4096;
        char *grown = aligned_alloc(64, want);
        if (grown == NULL) return NULL;
        free(buffer);
        buffer = grown, capacity = want;
    }
    return buffer;
}

/* One pass of the int4 kernel: xp and S hold this pass's rows (permuted, group sums), y is the whole output. */
typedef struct {
    rows_i4_fn fn;
    const uint16_t *xp;
    const float *S;
    const block_groups *bg;
    const uint8_t *w;
    const float *scales, *mins;
    const uint16_t *bias;
    uint16_t *y;
    int64_t K, Kp, N, G, gs;
} int4_args;

static void int4_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const int4_args *a = args;
    (void)m; /* fn is the instantiation for this pass's row count */
    a->fn(a->xp, a->S, a->bg, a->w, a->scales, a->mins, a->bias, a->y + m0 * a->N, a->K, a->Kp, a->N, a->G, a->gs,
          n_begin, n_end);
}

/* x [M, K] bf16, w [N, K / 2] uint8 (k even: low nibble, k odd: high nibble), scales and mins [N, K / gs]
 * fp32, bias [N] bf16 or NULL, y [M, N] bf16; all contiguous. gs: a multiple of 32 dividing K.
 * Returns 0, -1 on bad sizes, -2 when out of memory. */
int leanlm_linear_int4(const uint16_t *x, const uint8_t *w, const float *scales, const float *mins,
                       const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t gs,
                       int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || gs <= 0 || gs % 32 != 0 || K % gs != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / gs, Kp = (K + BLOCK_K - 1) / BLOCK_K * BLOCK_K, num_kblocks = Kp / BLOCK_K;
    const int64_t rows = M < MAX_ROWS ? M : MAX_ROWS;
    const int whole = gs % BLOCK_K == 0;
    /* Scratch (written here by the calling thread, only read by the team): permuted x, group sums and
     * the block table, in one per-thread buffer kept between calls. */
    const size_t xp_bytes = (size_t)(rows * Kp) * sizeof(uint16_t), S_bytes = (size_t)(rows * G) * sizeof(float);
    const size_t S_off = (xp_bytes + 63) / 64 * 64, bg_off = S_off + (S_bytes + 63) / 64 * 64;
    char *scratch = scratch_buffer(bg_off + (whole ? 0 : (size_t)num_kblocks * sizeof(block_groups)));
    if (scratch == NULL) return -2;
    uint16_t *xp = (uint16_t *)scratch;
    float *S = (float *)(scratch + S_off);
    block_groups *bg = whole ? NULL : (block_groups *)(scratch + bg_off);
    for (int64_t b = 0; !whole && b < num_kblocks; b++) {
        int32_t idx[16];
        const int64_t g0 = b * BLOCK_K / gs;
        int64_t last = g0;
        for (int p = 0; p < 16; p++) {
            int64_t g = (b * BLOCK_K + 32 * (p / 4)) / gs;
            if (g >= G) g = G - 1; /* a quarter past K (partial last block): its sums are zero */
            idx[p] = (int32_t)(g - g0);
            if (g > last) last = g;
        }
        bg[b].idx = _mm512_loadu_si512(idx);
        bg[b].g0 = g0;
        bg[b].mask = (__mmask16)((1u << (last - g0 + 1)) - 1u);
    }
    __m512i PERM_IDX[4];
    for (int q = 0; q < 4; q++) {
        int16_t idx[32];
        for (int l = 0; l < 32; l++) idx[l] = (int16_t)((4 * l + q) & 63);
        PERM_IDX[q] = _mm512_loadu_si512(idx);
    }
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * (K / 2), min_parallel_bytes);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t m = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        /* Permute each row to the nibble order, zero padded to Kp, and sum each group of x in fp32. */
        for (int64_t i = 0; i < m; i++) {
            const uint16_t *xr = x + (m0 + i) * K;
            uint16_t *pr = xp + i * Kp;
            for (int64_t k = 0; k < K; k += BLOCK_K) { /* masked loads read zeros past K */
                __m512i v[4];
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const int64_t left = K - k - 32 * c;
                    const __mmask32 mask = left >= 32 ? ~(__mmask32)0
                                         : left <= 0  ? (__mmask32)0
                                                      : (__mmask32)((1u << left) - 1u);
                    v[c] = _mm512_maskz_loadu_epi16(mask, xr + k + 32 * c);
                }
                /* output q, lane l <- element 4 l + q of the block: lanes 0-15 from v[0..1], 16-31 from v[2..3] */
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++)
                    _mm512_storeu_si512(pr + k + 32 * q,
                                        _mm512_mask_mov_epi16(_mm512_permutex2var_epi16(v[0], PERM_IDX[q], v[1]),
                                                              0xffff0000u,
                                                              _mm512_permutex2var_epi16(v[2], PERM_IDX[q], v[3])));
            }
            for (int64_t g = 0; g < G; g++) {
                __m512 sum = _mm512_setzero_ps();
                for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) /* gs % 32 == 0 */
                    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xr + k))), 16)));
                S[i * G + g] = _mm512_reduce_add_ps(sum);
            }
        }
        const int4_args args = {ROWS_I4[whole][m], xp, S, bg, w, scales, mins, bias, y, K, Kp, N, G, gs};
        leanlm_split_pass(int4_pass, &args, m0, m, N, BLOCK_N, threads);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------- dequantization */

/* Many-row products (prefill, batches past the passes' break-even) dequantize once to bf16 and use a GEMM.
 * Each value is computed as the reference path computes it in fp32 (a product, then a sum: no FMA, this
 * file is ISO C so contraction is off) and rounded once to bf16. Rows are split across threads. */

/* out [N, K] bf16 = q [N, K] int8 * scales [N, K / gs] (gs == K: per channel). */
void leanlm_dequantize_int8(const int8_t *w, const float *scales, uint16_t *out, int64_t N, int64_t K, int64_t gs,
                            int num_threads) {
    if (K == 0) return;
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = w + n * K;
        uint16_t *dst = out + n * K;
        for (int64_t g = 0; g < G; g++) {
            const float s = scales[n * G + g];
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) dst[k] = f32_to_bf16((float)row[k] * s);
        }
    }
}

/* out [N, K] bf16 = q * scales[n, g] + mins[n, g], q the nibble k of row n (low nibble for even k). */
void leanlm_dequantize_int4(const uint8_t *w, const float *scales, const float *mins, uint16_t *out, int64_t N,
                            int64_t K, int64_t gs, int num_threads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * (K / 2);
        uint16_t *dst = out + n * K;
        for (int64_t g = 0; g < G; g++) {
            const float s = scales[n * G + g], m = mins[n * G + g];
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                const float q = (float)((row[k / 2] >> (4 * (k & 1))) & 0x0F);
                const float scaled = q * s;
                dst[k] = f32_to_bf16(scaled + m);
            }
        }
    }
}

/* The decode loop's entries (linear_call.h). int8: tensors codes int8 [N, K], scales float32, bias bf16 or NULL;
 * ints[0] the group size (K: one per channel). int4: codes uint8 [N, K / 2], scales and mins float32
 * [N, K / group], bias; ints[0] the group size. */
int leanlm_linear_int8_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                            int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int8(x, (const int8_t *)c->tensors[0], (const float *)c->tensors[1],
                              (const uint16_t *)c->tensors[2], y, M, N, K, c->ints[0], threads, min_parallel_bytes);
}

int leanlm_linear_int4_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                            int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int4(x, (const uint8_t *)c->tensors[0], (const float *)c->tensors[1],
                              (const float *)c->tensors[2], (const uint16_t *)c->tensors[3], y, M, N, K, c->ints[0],
                              threads, min_parallel_bytes);
}
