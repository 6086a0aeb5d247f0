/* Small-M bfloat16 linear layer that skips the weight rows of zeroed inputs (activation sparsity, TEAL/CATS):
 *   y[M, N] = s(x)[M, K] @ Wt[K, N] (+ bias[N]),  s(x)_tk = x_tk where |x_tk| > threshold, else 0,
 * with the weight stored transposed (Wt = W^T, [K, N] row-major), so input column k's weights are one
 * contiguous row. The columns read are those where any of the M rows keeps its input (the batch-size effect:
 * at batch 1 a 40% sparse input reads 60% of the bytes, at batch 8 the union of 8 rows' columns).
 *
 * Threads split N into slices; a slice is walked in tiles of 16 * C output columns (M * C fp32 accumulators
 * in registers), each tile reading the active rows' 32 * C bytes in increasing k with the next rows
 * prefetched. Every y[t, n] is the fp32 fma chain over the active k in increasing order from 0, plus the bias,
 * rounded once to bf16 (nearest-even): the same bits whatever the thread count. Built by cpu_act_sparse.py.
 */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_ROWS 8
#define PREFETCH_ROWS 6 /* active rows ahead whose tile slice is prefetched */

ALWAYS_INLINE __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

ALWAYS_INLINE __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* Columns [n0, n0 + 16 * C) (the last chunk masked at N) of M rows, over the `nnz` active input rows. */
ALWAYS_INLINE void tile(const float *xs, const int32_t *active, int64_t nnz, const uint16_t *wt, const uint16_t *bias,
                        uint16_t *y, int64_t N, int64_t n0, const int M, const int C) {
    __m512 acc[MAX_ROWS][8];
    __mmask16 mk[8];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) mk[c] = lanes(N - n0 - 16 * c);
#pragma GCC unroll 8
    for (int t = 0; t < M; t++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[t][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nnz; j++) {
        if (j + PREFETCH_ROWS < nnz) {
            const char *ahead = (const char *)(wt + (int64_t)active[j + PREFETCH_ROWS] * N + n0);
#pragma GCC unroll 8
            for (int c = 0; c < C; c += 2) _mm_prefetch(ahead + 32 * c, _MM_HINT_T0);
        }
        const uint16_t *row = wt + (int64_t)active[j] * N + n0;
        __m512 w[8];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) w[c] = load_bf16x16(row + 16 * c, mk[c]);
#pragma GCC unroll 8
        for (int t = 0; t < M; t++) {
            const __m512 xv = _mm512_set1_ps(xs[t * nnz + j]);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) acc[t][c] = _mm512_fmadd_ps(xv, w[c], acc[t][c]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        const int64_t n = n0 + 16 * c;
        if (n >= N) break;
        float out[16], b[16] = {0};
        if (bias != NULL) _mm512_storeu_ps(b, load_bf16x16(bias + n, mk[c]));
        for (int t = 0; t < M; t++) {
            _mm512_storeu_ps(out, acc[t][c]);
            const int64_t count = N - n < 16 ? N - n : 16;
            for (int64_t i = 0; i < count; i++) y[t * N + n + i] = f32_to_bf16(out[i] + b[i]);
        }
    }
}

ALWAYS_INLINE void slice(const float *xs, const int32_t *active, int64_t nnz, const uint16_t *wt,
                         const uint16_t *bias, uint16_t *y, int64_t N, int64_t n_begin, int64_t n_end, const int M,
                         const int C) {
    int64_t n = n_begin;
    for (; n + 16 * C <= n_end; n += 16 * C) tile(xs, active, nnz, wt, bias, y, N, n, M, C);
    for (; n < n_end; n += 16) tile(xs, active, nnz, wt, bias, y, N, n, M, 1);
}

/* One instantiation per M; C keeps M * C <= 16 accumulators and C weight vectors in registers. */
#define DEFINE_ROWS(M_, C_)                                                                                    \
    static void slice_m##M_(const float *xs, const int32_t *active, int64_t nnz, const uint16_t *wt,          \
                            const uint16_t *bias, uint16_t *y, int64_t N, int64_t n_begin, int64_t n_end) {   \
        slice(xs, active, nnz, wt, bias, y, N, n_begin, n_end, M_, C_);                                      \
    }
DEFINE_ROWS(1, 8)
DEFINE_ROWS(2, 8)
DEFINE_ROWS(3, 4)
DEFINE_ROWS(4, 4)
DEFINE_ROWS(5, 2)
DEFINE_ROWS(6, 2)
DEFINE_ROWS(7, 2)
DEFINE_ROWS(8, 2)

typedef void (*slice_fn)(const float *, const int32_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *,
                         int64_t, int64_t, int64_t);
static const slice_fn SLICE_FOR_M[MAX_ROWS + 1] = {0,        slice_m1, slice_m2, slice_m3, slice_m4,
                                                   slice_m5, slice_m6, slice_m7, slice_m8};

/* Exported entry point. x [M, K], wt [K, N], bias [N] or NULL, y [M, N]: contiguous bfloat16 bit patterns;
 * M <= 8 rows per pass (more rows loop over passes). Runs on up to num_threads threads (one when the active
 * rows hold fewer than min_parallel_bytes). Returns 0, -1 on bad sizes, -2 when out of memory. */
int leanlm_linear_act_sparse(const uint16_t *x, const uint16_t *wt, double threshold, const uint16_t *bias,
                             uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads,
                             int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || K > INT32_MAX) return -1;
    if (M == 0 || N == 0) return 0;
    const float thr = (float)threshold;
    int32_t *active = (int32_t *)malloc(sizeof(int32_t) * (size_t)K);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(K * (M < MAX_ROWS ? M : MAX_ROWS)));
    if (active == NULL || xs == NULL) {
        free(active);
        free(xs);
        return -2;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t m = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        const uint16_t *xm = x + m0 * K;
        int64_t nnz = 0; /* the union of the m rows' kept columns, in increasing k */
        for (int64_t k = 0; k < K; k++) {
            int keep = 0;
            for (int64_t t = 0; t < m; t++) keep |= fabsf(bf16_to_f32(xm[t * K + k])) > thr;
            if (keep) active[nnz++] = (int32_t)k;
        }
        for (int64_t t = 0; t < m; t++)
            for (int64_t j = 0; j < nnz; j++) {
                const float v = bf16_to_f32(xm[t * K + active[j]]);
                xs[t * nnz + j] = fabsf(v) > thr ? v : 0.0f;
            }
        const int64_t chunks = (N + 15) / 16;
        int threads = num_threads < 1 ? 1 : num_threads;
        if (threads > chunks) threads = (int)chunks;
        const int parallel = threads > 1 && nnz * N * 2 >= min_parallel_bytes;
        const slice_fn fn = SLICE_FOR_M[m];
        uint16_t *ym = y + m0 * N;
#pragma omp parallel num_threads(threads) if (parallel)
        {
            const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
            const int64_t n_begin = chunks * tid / nthr * 16;
            int64_t n_end = chunks * (tid + 1) / nthr * 16;
            if (n_end > N) n_end = N;
            if (n_begin < n_end) fn(xs, active, nnz, wt, bias, ym, N, n_begin, n_end);
        }
    }
    free(active);
    free(xs);
    return 0;
}
