/* Small-M 2:4 sparse bfloat16 linear layer for x86-64 with AVX512-BF16 and AVX512-VBMI2:
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W stored as 2:4 semi-structured (Sparse24Linear's format):
 *   values [N, K / 2] bf16, the 2 kept values of each group of 4 input columns in column order, and
 *   mask [N, K / 8] uint8, 4 bits per group (byte b: group 2b in the low nibble, group 2b + 1 in the high;
 *   bit i of a nibble = column i of the group), exactly 2 set.
 *
 * So the 4 mask bytes of 32 dense columns, read as a little-endian uint32, have bit i set where column i holds
 * a kept value, and those 16 values lie next to each other in `values`: vpexpandw (VBMI2) with that mask puts
 * them back at their dense positions with zeros between, and vdpbf16ps multiplies with the dense x slice as
 * gemv_bf16.c does. Batch-1 decode is bound by reading W, and this reads 2 + 0.25 bytes per 2 weights, 56% of
 * dense bf16. The widened W is exactly the dense weight, and every fp32 sum runs in gemv_bf16.c's order (32
 * columns per vdpbf16ps, the same lanes, the same K tail, the same reduction), so y equals cpu_gemv on the
 * dense weight bit for bit. Threads split N as there. Built and loaded by cpu_sparse.py.
 */

/* The only VBMI2 instruction is the expand; the library is loaded only where /proc/cpuinfo shows the flag. */
#pragma GCC target("avx512vbmi2")

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "linear_call.h"
#include "row_driver.h"

#define MAX_ROWS LEANLM_MAX_ROWS
#define BLOCK_N 32  /* weight rows per unit of work handed to a thread; a multiple of every NB below */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far ahead (in value bytes) the software prefetch reads, as gemv_bf16.c */
#endif

/* The mask bits of dense columns [k, k + 32) of one row (k a multiple of 8; bytes past the row's end, when
 * fewer than 32 columns remain, are not read: their bits stay 0). */
ALWAYS_INLINE __mmask32 mask_bits(const uint8_t *row_mask, int64_t k, int64_t columns) {
    uint32_t bits = 0;
    memcpy(&bits, row_mask + k / 8, (size_t)(columns / 8));
    return (__mmask32)bits;
}

/* NB weight rows [n0, n0 + NB) against M rows of x; M and NB are compile-time constants at every call site
 * (unrolled loops, acc[][] in registers: M * NB <= 16 accumulators). */
ALWAYS_INLINE void tile(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const uint16_t *bias,
                        uint16_t *y, int64_t K, int64_t N, int64_t n0, const int M, const int NB) {
    __m512 acc[MAX_ROWS][8];
    const uint16_t *vr[8];
    const uint8_t *mr[8];
    const int64_t half = K / 2, mask_bytes = K / 8;
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        vr[j] = values + (n0 + j) * half;
        mr[j] = mask + (n0 + j) * mask_bytes;
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();

    /* Software prefetch ahead of both streams, walking each linearly at the rate the loads consume it (the
     * tile's rows are contiguous, so it runs on into the next tile; past the end is harmless): values at
     * NB * 64 bytes per 64-column step, one line per row; the mask at NB * 8 bytes per step (NB <= 8: at
     * most a line, so one prefetch a step keeps ahead). */
    const char *ahead = (const char *)(values + n0 * half) + PREFETCH_BYTES;
    const char *mask_ahead = (const char *)(mask + n0 * mask_bytes) + PREFETCH_BYTES / 8;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64, ahead += 64 * NB, mask_ahead += 8 * NB) {
        __m512bh lo[8], hi[8];
        _mm_prefetch(mask_ahead, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
            uint64_t bits;
            memcpy(&bits, mr[j] + k / 8, sizeof bits);
            const __m512i v = _mm512_loadu_si512((const void *)(vr[j] + k / 2)); /* 32 kept values */
            lo[j] = (__m512bh)_mm512_maskz_expand_epi16((__mmask32)bits, v);
            hi[j] = (__m512bh)_mm512_maskz_expand_epi16((__mmask32)(bits >> 32),
                                                        _mm512_castsi256_si512(_mm512_extracti64x4_epi64(v, 1)));
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512bh xa = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
            const __m512bh xb = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k + 32));
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xa, lo[j]);
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, hi[j]);
        }
    }
    /* Up to two more 32-column slices, the last possibly 8, 16 or 24 wide (K % 8 == 0): x loads are masked as
     * gemv_bf16.c's tail, and the expand already leaves zeros past the end. */
    for (; k < K; k += 32) {
        const int64_t columns = K - k < 32 ? K - k : 32;
        const __mmask32 xmask = (__mmask32)(columns == 32 ? 0xffffffffu : (1u << columns) - 1u);
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++)
            wv[j] = (__m512bh)_mm512_maskz_expandloadu_epi16(mask_bits(mr[j], k, columns), vr[j] + k / 2);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(xmask, x + i * K + k);
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
ALWAYS_INLINE void rows(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const uint16_t *bias,
                        uint16_t *y, int64_t K, int64_t N, int64_t n_begin, int64_t n_end, const int M, const int NB) {
    /* Nothing is in flight at the start of the range: request its first PREFETCH_BYTES (and masks) at once. */
    const char *start = (const char *)(values + n_begin * (K / 2));
    const char *mask_start = (const char *)(mask + n_begin * (K / 8));
    const int64_t range_bytes = (n_end - n_begin) * K; /* K / 2 values of 2 bytes per row */
    const int64_t warm = range_bytes < PREFETCH_BYTES ? range_bytes : PREFETCH_BYTES;
    for (int64_t off = 0; off < warm; off += 64) _mm_prefetch(start + off, _MM_HINT_T0);
    for (int64_t off = 0; off < warm / 8; off += 64) _mm_prefetch(mask_start + off, _MM_HINT_T0);

    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) tile(x, values, mask, bias, y, K, N, n, M, NB);
    for (; n < n_end; n++) tile(x, values, mask, bias, y, K, N, n, M, 1);
}

/* One instantiation per M; NB keeps M * NB <= 16 accumulators (plus 2 * NB widened slices) in registers. */
#define DEFINE_ROWS(M_, NB_)                                                                                   \
    static void rows_m##M_(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const uint16_t *bias, \
                           uint16_t *y, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {                \
        rows(x, values, mask, bias, y, K, N, n_begin, n_end, M_, NB_);                                         \
    }
DEFINE_ROWS(1, 8)
DEFINE_ROWS(2, 4)
DEFINE_ROWS(3, 4)
DEFINE_ROWS(4, 4)
DEFINE_ROWS(5, 2)
DEFINE_ROWS(6, 2)
DEFINE_ROWS(7, 2)
DEFINE_ROWS(8, 2)

typedef void (*rows_fn)(const uint16_t *, const uint16_t *, const uint8_t *, const uint16_t *, uint16_t *, int64_t,
                        int64_t, int64_t, int64_t);
static const rows_fn ROWS_FOR_M[MAX_ROWS + 1] = {0,       rows_m1, rows_m2, rows_m3, rows_m4,
                                                 rows_m5, rows_m6, rows_m7, rows_m8};

typedef struct {
    const uint16_t *x, *values;
    const uint8_t *mask;
    const uint16_t *bias;
    uint16_t *y;
    int64_t K, N;
} sparse24_args;

static void sparse24_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const sparse24_args *a = args;
    ROWS_FOR_M[m](a->x + m0 * a->K, a->values, a->mask, a->bias, a->y + m0 * a->N, a->K, a->N, n_begin, n_end);
}

/* Exported entry point. x [M, K], values [N, K / 2], bias [N] or NULL, y [M, N]: contiguous bfloat16 bit
 * patterns; mask [N, K / 8] uint8 with exactly 2 bits in each nibble (checked when the layer is built: the
 * expand reads as many values as bits are set). Runs on up to num_threads threads, on one when the stored
 * weight is smaller than min_parallel_bytes. Returns 0, or -1 on bad sizes (K must be a multiple of 8). */
int leanlm_linear_sparse24(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const uint16_t *bias,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || K % 8 != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t weight_bytes = N * (K + K / 8); /* values and mask */
    const sparse24_args args = {x, values, mask, bias, y, K, N};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, weight_bytes, min_parallel_bytes);
    leanlm_row_passes(sparse24_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* The decode loop's entry (linear_call.h): tensors values bf16 [N, K / 2], mask uint8 [N, K / 8], bias or NULL. */
int leanlm_linear_sparse24_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                                int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_sparse24(x, (const uint16_t *)c->tensors[0], (const uint8_t *)c->tensors[1],
                                  (const uint16_t *)c->tensors[2], y, M, N, K, threads, min_parallel_bytes);
}
