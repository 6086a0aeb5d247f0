/* Small-M bfloat16 linear layer that skips the weight rows of zeroed inputs (activation sparsity, TEAL/CATS):
 *   y[M, N] = s(x)[M, K] @ Wt[K, N] (+ bias[N]),  s(x)_tk = x_tk where |x_tk| * scale_k > threshold, else 0
 * (scale: per input column, 1 when NULL; TEAL's score is |x|, a weight-aware one |x_k| ||W[:, k]||), with the
 * weight stored transposed, Wt = W^T [K, N] row-major: input k's weights are one contiguous row of 2N bytes, and
 * a zeroed input is a row never read. Only rows where any of the M inputs is kept are read (the batch-size
 * effect: at batch 1 a 40% sparse input reads 60% of the bytes, at batch 8 the union of 8 rows' columns).
 *
 * Whole rows, not slices of rows, are the unit: a CPU's stream prefetchers run ahead along contiguous memory,
 * so skipping 128-byte pieces of a stream saves nothing (the prefetcher reads them anyway). Walking the kept rows
 * one after another saves less than the skipped share too (on a Zen 4, 40% of 1152-byte rows skipped saved
 * ~10%): each gap ends a stream and the next row starts with a stall. So the kept rows are walked GROUP at a time,
 * GROUP streams in flight (rows_grouped), and the rows about PREFETCH_BYTES ahead in the active list are
 * prefetched by hand. Threads split K into fixed halves (thirds, ...), each summing its rows in increasing k into
 * fp32 partial outputs in L1, which are then added in thread order, plus the bias, and rounded once to bf16
 * (nearest-even). Both walks apply the same operations in the same order. A row's result does
 * not depend on the other rows of its batch (a skipped or zeroed term adds exactly 0); it does depend on the
 * thread count, like any split sum. Built by cpu_act_sparse.py.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "linear_call.h"

#define MAX_ROWS 8
#define MAX_THREADS 64
#define PREFETCH_BYTES 16384 /* how far ahead in the active rows the lines read are prefetched */
#define GROUP 8 /* active rows walked together (rows_grouped) */
/* The grouped walk is taken when at most this share (in tenths) of the rows is active: the measured crossover on a
 * Zen 4 lies between 80% and 90% active (at 100% the single walk is up to 1.6x faster, at 60% 1.2-1.7x slower). */
#define GROUPED_MAX_TENTHS 9

ALWAYS_INLINE __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

ALWAYS_INLINE void store_bf16x16(uint16_t *p, __m512 f, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(f32x16_to_bf16_bits(f)));
}

ALWAYS_INLINE __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* part[t][n] += sum over active rows j in [j0, j1) of xs[t][j] * Wt[active[j], n], for M rows, one row after
 * another (each a fused multiply-add into the partial sums, in increasing j). Rows about PREFETCH_BYTES ahead
 * are prefetched, a line per line read. The fastest walk when nearly every row is active: one stream. */
ALWAYS_INLINE void rows_single(const float *xs, const int32_t *active, int64_t nnz, int64_t j0, int64_t j1,
                               const uint16_t *wt, float *part, int64_t N, const int M) {
    const int64_t ahead_rows = PREFETCH_BYTES / (2 * N) > 1 ? PREFETCH_BYTES / (2 * N) : 1;
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *row = wt + (int64_t)active[j] * N;
        const char *ahead = j + ahead_rows < j1 ? (const char *)(wt + (int64_t)active[j + ahead_rows] * N) : NULL;
        float xv[MAX_ROWS];
#pragma GCC unroll 8
        for (int t = 0; t < M; t++) xv[t] = xs[t * nnz + j];
        for (int64_t n = 0; n < N; n += 16) {
            if (ahead != NULL && (n & 31) == 0) _mm_prefetch(ahead + 2 * n, _MM_HINT_T0);
            const __mmask16 m0 = lanes(N - n);
            const __m512 w = load_bf16x16(row + n, m0);
#pragma GCC unroll 8
            for (int t = 0; t < M; t++) {
                float *p = part + t * N + n;
                _mm512_mask_storeu_ps(p, m0, _mm512_fmadd_ps(_mm512_set1_ps(xv[t]), w, _mm512_maskz_loadu_ps(m0, p)));
            }
        }
    }
}

/* The same sums, GROUP active rows at a time: each 16 columns of the partial sums are loaded once, take the
 * group's GROUP multiply-adds in increasing j, and are stored once, so every output gets the same operations
 * in the same order as rows_single (the results are bit for bit equal). With rows skipped, the prefetchers lose
 * the stream at every gap and a single walk stalls at the start of each row; GROUP rows in flight hide that
 * (Zen 4, 40% of the rows skipped: 1.2-1.7x the single walk, and 1.2-1.6x the dense GEMV). With nearly every
 * row active one stream is faster (GROUP interleaved streams confuse the prefetchers), so the caller picks. */
ALWAYS_INLINE void rows_grouped(const float *xs, const int32_t *active, int64_t nnz, int64_t j0, int64_t j1,
                                const uint16_t *wt, float *part, int64_t N, const int M) {
    const int64_t ahead_rows = PREFETCH_BYTES / (2 * N) > GROUP ? PREFETCH_BYTES / (2 * N) : GROUP;
    int64_t j = j0;
    for (; j + GROUP <= j1; j += GROUP) {
        const uint16_t *row[GROUP];
        const char *ahead[GROUP];
        float xv[MAX_ROWS][GROUP];
#pragma GCC unroll 8
        for (int g = 0; g < GROUP; g++) {
            row[g] = wt + (int64_t)active[j + g] * N;
            ahead[g] = j + g + ahead_rows < j1 ? (const char *)(wt + (int64_t)active[j + g + ahead_rows] * N) : NULL;
        }
#pragma GCC unroll 8
        for (int t = 0; t < M; t++)
#pragma GCC unroll 8
            for (int g = 0; g < GROUP; g++) xv[t][g] = xs[t * nnz + j + g];
        for (int64_t n = 0; n < N; n += 16) {
            const __mmask16 m0 = lanes(N - n);
            __m512 w[GROUP];
#pragma GCC unroll 8
            for (int g = 0; g < GROUP; g++) {
                if (ahead[g] != NULL && (n & 31) == 0) _mm_prefetch(ahead[g] + 2 * n, _MM_HINT_T0);
                w[g] = load_bf16x16(row[g] + n, m0);
            }
#pragma GCC unroll 8
            for (int t = 0; t < M; t++) {
                float *p = part + t * N + n;
                __m512 acc = _mm512_maskz_loadu_ps(m0, p);
#pragma GCC unroll 8
                for (int g = 0; g < GROUP; g++) acc = _mm512_fmadd_ps(_mm512_set1_ps(xv[t][g]), w[g], acc);
                _mm512_mask_storeu_ps(p, m0, acc);
            }
        }
    }
    rows_single(xs, active, nnz, j, j1, wt, part, N, M);
}

#define DEFINE_ROWS(M_)                                                                                        \
    static void rows_m##M_(const float *xs, const int32_t *active, int64_t nnz, int64_t j0, int64_t j1,       \
                           const uint16_t *wt, float *part, int64_t N, int grouped) {                         \
        if (grouped) rows_grouped(xs, active, nnz, j0, j1, wt, part, N, M_);                                  \
        else rows_single(xs, active, nnz, j0, j1, wt, part, N, M_);                                           \
    }
DEFINE_ROWS(1)
DEFINE_ROWS(2)
DEFINE_ROWS(3)
DEFINE_ROWS(4)
DEFINE_ROWS(5)
DEFINE_ROWS(6)
DEFINE_ROWS(7)
DEFINE_ROWS(8)

typedef void (*rows_fn)(const float *, const int32_t *, int64_t, int64_t, int64_t, const uint16_t *, float *, int64_t,
                        int);
static const rows_fn ROWS_FOR_M[MAX_ROWS + 1] = {0,       rows_m1, rows_m2, rows_m3, rows_m4,
                                                 rows_m5, rows_m6, rows_m7, rows_m8};

/* Scratch grown on demand and kept per calling thread (a decode step makes ~200 calls: no malloc per call). */
static __thread void *scratch_ptr = NULL;
static __thread size_t scratch_bytes = 0;

static void *scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch_ptr);
        scratch_ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch_ptr != NULL ? (bytes + 63) / 64 * 64 : 0;
    }
    return scratch_ptr;
}

/* The kept inputs of m rows: active[] = the k (increasing) where any row's |x| * scale > thr; returns how many.
 * 16 columns at a time, the kept indices compressed out of a vector (vpcompressd). */
static int64_t active_columns(const uint16_t *xm, int64_t m, int64_t K, const float *scale, float thr,
                              int32_t *active) {
    int64_t nnz = 0;
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 vthr = _mm512_set1_ps(thr);
    for (int64_t k = 0; k < K; k += 16, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 valid = lanes(K - k);
        const __m512 s = scale != NULL ? _mm512_maskz_loadu_ps(valid, scale + k) : _mm512_set1_ps(1.0f);
        __mmask16 keep = 0;
        for (int64_t t = 0; t < m; t++) {
            const __m512 v = _mm512_abs_ps(load_bf16x16(xm + t * K + k, valid));
            keep |= _mm512_mask_cmp_ps_mask(valid, _mm512_mul_ps(v, s), vthr, _CMP_GT_OQ);
        }
        _mm512_mask_compressstoreu_epi32(active + nnz, keep, idx);
        nnz += __builtin_popcount((unsigned)keep);
    }
    return nnz;
}

/* First index of `active` (sorted) holding a value >= k. */
static int64_t lower_bound(const int32_t *active, int64_t nnz, int64_t k) {
    int64_t lo = 0, hi = nnz;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (active[mid] < k) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Exported entry point. x [M, K], wt [K, N], bias [N] or NULL, y [M, N]: contiguous bfloat16 bit patterns;
 * scale [K] float32 or NULL. M <= 8 rows per pass (more rows loop over passes). Runs on up to num_threads
 * threads (one when the active rows hold fewer than min_parallel_bytes). Returns 0, -1 on bad sizes, -2 when out
 * of memory. */
int leanlm_linear_act_sparse(const uint16_t *x, const uint16_t *wt, double threshold, const float *scale,
                             const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads,
                             int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || K > INT32_MAX) return -1;
    if (M == 0 || N == 0) return 0;
    const float thr = (float)threshold;
    int threads = num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads;
    if (threads > K) threads = K < 1 ? 1 : (int)K;
    const int64_t rows_per_pass = M < MAX_ROWS ? M : MAX_ROWS;
    /* part: [threads][m][N] fp32 partial sums; xs: [m][nnz] kept inputs; active: [K] indices (64-byte aligned) */
    const size_t part_floats = (size_t)((threads * rows_per_pass * N + 15) / 16 * 16);
    const size_t xs_floats = (size_t)((K * rows_per_pass + 15) / 16 * 16);
    char *base = (char *)scratch(sizeof(float) * (part_floats + xs_floats) + sizeof(int32_t) * (size_t)(K + 16));
    if (base == NULL) return -2;
    float *part = (float *)base, *xs = part + part_floats;
    int32_t *active = (int32_t *)(xs + xs_floats);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t m = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        const uint16_t *xm = x + m0 * K;
        const int64_t nnz = active_columns(xm, m, K, scale, thr, active); /* the union of the rows' kept inputs */
        for (int64_t t = 0; t < m; t++)
            for (int64_t j = 0; j < nnz; j++) {
                const float v = bf16_to_f32(xm[t * K + active[j]]);
                xs[t * nnz + j] = fabsf(v) * (scale != NULL ? scale[active[j]] : 1.0f) > thr ? v : 0.0f;
            }
        const int nthr = threads > 1 && nnz * N * 2 >= min_parallel_bytes ? threads : 1;
        const rows_fn fn = ROWS_FOR_M[m];
        const int grouped = nnz * 10 <= K * GROUPED_MAX_TENTHS;
#pragma omp parallel for num_threads(nthr) schedule(static, 1) if (nthr > 1)
        for (int p = 0; p < nthr; p++) { /* part p: rows of k in [K p / nthr, K (p + 1) / nthr) */
            float *pp = part + (int64_t)p * m * N;
            memset(pp, 0, sizeof(float) * (size_t)(m * N));
            const int64_t j0 = lower_bound(active, nnz, K * p / nthr);
            const int64_t j1 = lower_bound(active, nnz, K * (p + 1) / nthr);
            fn(xs, active, nnz, j0, j1, wt, pp, N, grouped);
        }
        uint16_t *ym = y + m0 * N;
        for (int64_t t = 0; t < m; t++)
            for (int64_t n = 0; n < N; n += 16) {
                const __mmask16 mk = lanes(N - n);
                __m512 v = _mm512_maskz_loadu_ps(mk, part + t * N + n);
                for (int p = 1; p < nthr; p++) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, part + (int64_t)p * m * N + t * N + n));
                if (bias != NULL) v = _mm512_add_ps(v, load_bf16x16(bias + n, mk));
                store_bf16x16(ym + t * N + n, v, mk);
            }
    }
    return 0;
}

/* The decode loop's entry (linear_call.h): tensors weight_t bf16 [K, N], threshold float32 [1], column scales
 * float32 [K], bias bf16 [N] or NULL. */
int leanlm_linear_act_sparse_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                                  int64_t K, int threads, int64_t min_parallel_bytes) {
    const double threshold = (double)((const float *)c->tensors[1])[0];
    return leanlm_linear_act_sparse(x, (const uint16_t *)c->tensors[0], threshold, (const float *)c->tensors[2],
                                    (const uint16_t *)c->tensors[3], y, M, N, K, threads, min_parallel_bytes);
}
