/* Few-row dense linear layers for x86-64 CPUs with AVX2 and FMA, float32 weights and activations:
 *   y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N])
 * for the float32 decode loop (decode_layers_f32.c), which a dense float32 model (what dtype="auto" gives a CPU
 * without AVX512-BF16) otherwise could not run: its linears had no float32 call, so each step ran PyTorch op by op.
 * One weight row per tile, R <= 4 rows of x against it (gemv_avx2.h's row passes), 8 independent accumulators per
 * row; each output is summed in a fixed order whatever the thread count. Built and loaded by cpu_gemv_avx2.py. */

#include <immintrin.h>
#include <stdint.h>

#include "gemv_avx2.h"
#include "linear_call.h"

typedef struct {
    const float *x, *w, *bias; /* x [M, K], w [N, K] */
    float *y;
    int64_t K, N;
} f32_args;

ALWAYS_INLINE void tile_f32(const f32_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    const int64_t K = a->K;
    (void)NB; /* one weight row per tile */
    if (m0 == 0) prefetch_rows(a->w, K * 4, n0 + (PREFETCH_BYTES + K * 4 - 1) / (K * 4), 1, a->N);
    const float *wr = a->w + n0 * K;
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *xr = a->x + (m0 + r) * K + k;
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
        }
    }
    const float b = a->bias ? a->bias[n0] : 0.0f;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float total = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        for (int64_t t = k; t < K; t++) total += wr[t] * a->x[(m0 + r) * K + t];
        a->y[(m0 + r) * a->N + n0] = total + b;
    }
}

ROW_PASSES(f32, f32_args, tile_f32)

int leanlm_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                      int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0) return -1;
    if (M == 0 || N == 0) return 0;
    const f32_args args = {x, w, bias, y, K, N};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K * 4, min_parallel_bytes);
    leanlm_row_passes(f32_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* linear_call.h's uniform entry with float32 x and y: tensors (weight, bias). */
int leanlm_linear_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                           int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_f32(x, (const float *)c->tensors[0], (const float *)c->tensors[1], y, M, N, K, threads,
                             min_parallel_bytes);
}
