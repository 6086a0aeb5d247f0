/* Small-M bfloat16 linear layer for x86-64 with AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * Batch-1 decode is bound by reading W, so each loaded 32-element slice of a weight row is shared by all
 * rows of x (W is read once per call for M <= 8), products are accumulated in fp32 with vdpbf16ps, and the
 * result is rounded to bfloat16 to nearest-even. Threads split N into contiguous ranges (OpenMP, static).
 * Built and loaded by cpu_gemv.py; links against the libgomp already in the process (torch's copy).
 */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "linear_call.h"
#include "row_driver.h"

#define MAX_ROWS LEANLM_MAX_ROWS
#define BLOCK_N 32     /* weight rows per unit of work handed to a thread; a multiple of every NB below */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* best of 1-32 KiB on the 210-matrix SmolLM2 chain, M = 1 and 4 */
#endif

/* NB weight rows [n0, n0 + NB) against M rows of x. M and NB are compile-time constants at every call
 * site, so the loops unroll and acc[][] lives in registers (M * NB <= 16 accumulators + NB + 1 loads). */
ALWAYS_INLINE void tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                        int64_t K, int64_t N, int64_t n0, const int M, const int NB) {
    __m512 acc[MAX_ROWS][8];
    const uint16_t *wr[8];
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) wr[j] = w + (n0 + j) * K;
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();

    /* Software prefetch PREFETCH_BYTES ahead, walking the tile's memory linearly at the rate the loads
     * consume it (NB lines per step): rows are contiguous, so this runs on into the next tile. It may
     * point past W near the end, which is harmless (prefetches never fault). Measured on Zen 4: 1.1-1.8x
     * over the hardware prefetcher alone, whose NB interleaved row streams keep too few lines in flight. */
    const char *ahead = (const char *)(w + n0 * K) + PREFETCH_BYTES;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, ahead += 64 * NB) {
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(wr[j] + k));
        }
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
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[j] + k);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }

#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        const float b = bias ? bf16_to_f32(bias[n0 + j]) : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) y[i * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(acc[i][j]) + b);
    }
}

/* Weight rows [n_begin, n_end) for M rows of x: tiles of NB rows, then single rows for the remainder. */
ALWAYS_INLINE void rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t K,
                        int64_t N, int64_t n_begin, int64_t n_end, const int M, const int NB) {
    /* Nothing is in flight yet at the start of the range: request its first PREFETCH_BYTES at once. */
    const char *start = (const char *)(w + n_begin * K);
    const int64_t range_bytes = (n_end - n_begin) * K * (int64_t)sizeof(uint16_t);
    const int64_t warm = range_bytes < PREFETCH_BYTES ? range_bytes : PREFETCH_BYTES;
    for (int64_t off = 0; off < warm; off += 64) _mm_prefetch(start + off, _MM_HINT_T0);

    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) tile(x, w, bias, y, K, N, n, M, NB);
    for (; n < n_end; n++) tile(x, w, bias, y, K, N, n, M, 1);
}

/* One instantiation per M; NB keeps M * NB <= 16 accumulators so nothing spills. */
#define DEFINE_ROWS(M_, NB_)                                                                              \
    static void rows_m##M_(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,      \
                           int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {                       \
        rows(x, w, bias, y, K, N, n_begin, n_end, M_, NB_);                                               \
    }
DEFINE_ROWS(1, 8)
DEFINE_ROWS(2, 8)
DEFINE_ROWS(3, 4)
DEFINE_ROWS(4, 4)
DEFINE_ROWS(5, 2)
DEFINE_ROWS(6, 2)
DEFINE_ROWS(7, 2)
DEFINE_ROWS(8, 2)

typedef void (*rows_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                        int64_t, int64_t);
static const rows_fn ROWS_FOR_M[MAX_ROWS + 1] = {0,        rows_m1, rows_m2, rows_m3, rows_m4,
                                                 rows_m5, rows_m6, rows_m7, rows_m8};

typedef struct {
    const uint16_t *x, *w, *bias;
    uint16_t *y;
    int64_t K, N;
} bf16_args;

static void bf16_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const bf16_args *a = args;
    ROWS_FOR_M[m](a->x + m0 * a->K, a->w, a->bias, a->y + m0 * a->N, a->K, a->N, n_begin, n_end);
}

/* Exported entry point. x [M, K], w [N, K], bias [N] or NULL, y [M, N]: all contiguous bfloat16 bit
 * patterns. Runs on up to num_threads threads, and on one when the weight is smaller than
 * min_parallel_bytes (row_driver.h). Returns 0, or -1 on bad sizes. */
int leanlm_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K, int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t weight_bytes = N * K * (int64_t)sizeof(uint16_t);
    const bf16_args args = {x, w, bias, y, K, N};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, weight_bytes, min_parallel_bytes);
    leanlm_row_passes(bf16_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* The decode loop's entry (linear_call.h): tensors weight bf16 [N, K], bias bf16 [N] or NULL. */
int leanlm_linear_bf16_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                            int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_bf16(x, (const uint16_t *)c->tensors[0], (const uint16_t *)c->tensors[1], y, M, N, K, threads,
                              min_parallel_bytes);
}
