/* Small-M unstructured-sparse bfloat16 linear layer for x86-64 with AVX512-BF16 and AVX512-VBMI2:
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W stored as BitmaskSparseLinear's format (compressed-tensors'
 *   "sparse-bitmask"): values [nnz] bf16, every nonzero row-major; mask [N, K / 8] uint8, bit i of byte b set
 *   where column 8b + i holds a value; row_offsets [N] int64, where each row's values start.
 *
 * The 4 mask bytes of 32 dense columns, read as a little-endian uint32, have bit i set where column i holds a
 * value, and those popcount(bits) values lie next to each other in `values`: vpexpandw (VBMI2) with that mask
 * puts them at their dense positions with zeros between, the row's value pointer moves on by the popcount, and
 * vdpbf16ps multiplies with the dense x slice as gemv_bf16.c does. Batch-1 decode is bound by reading W, and
 * this reads 2 bytes per nonzero + 1/8 byte per weight (at 70% zeros, 36% of dense bf16). The widened W is
 * exactly the dense weight, and every fp32 sum runs in gemv_bf16.c's order (32 columns per vdpbf16ps, the same
 * lanes, the same K tail, the same reduction), so y equals cpu_gemv on the dense weight bit for bit. Threads
 * split N as there. Built and loaded by cpu_bitmask.py.
 *
 * The values are read by the masked expand-load (vpexpandw zmm{k}, m512), which touches only the values it
 * expands, so no load runs past the end of `values` (no padding needed). It measured 5-10% faster here (AMD
 * EPYC, Zen 4) than a full 64-byte load followed by the register expand, which would also need guarding.
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
ALWAYS_INLINE uint32_t mask_bits(const uint8_t *row_mask, int64_t k, int64_t columns) {
    uint32_t bits = 0;
    memcpy(&bits, row_mask + k / 8, (size_t)(columns / 8));
    return bits;
}

/* 32 dense weights: the popcount(bits) values at vp put where `bits` has its set bits, zeros elsewhere. */
ALWAYS_INLINE __m512bh widen(const uint16_t *vp, uint32_t bits) {
    return (__m512bh)_mm512_maskz_expandloadu_epi16((__mmask32)bits, vp);
}

/* NB weight rows [n0, n0 + NB) against M rows of x; M and NB are compile-time constants at every call site
 * (unrolled loops, acc[][] in registers: M * NB <= 16 accumulators). */
ALWAYS_INLINE void tile(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const int64_t *row_offsets,
                        const uint16_t *bias, uint16_t *y, int64_t K, int64_t N, int64_t n0, const int M,
                        const int NB) {
    __m512 acc[MAX_ROWS][8];
    const uint16_t *vp[8]; /* each row's next unread value */
    const uint8_t *mr[8];
    const int64_t mask_bytes = K / 8;
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        vp[j] = values + row_offsets[n0 + j];
        mr[j] = mask + (n0 + j) * mask_bytes;
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();

    /* Software prefetch ahead of both streams: each row's values PREFETCH_BYTES past its pointer (the tile's
     * rows are contiguous in values, so together they cover the stream ahead; past the end is harmless), the
     * mask at NB * 8 bytes per step (NB <= 8: at most a line, so one prefetch a step keeps ahead). */
    const char *mask_ahead = (const char *)(mask + n0 * mask_bytes) + PREFETCH_BYTES / 8;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64, mask_ahead += 8 * NB) {
        __m512bh lo[8], hi[8];
        _mm_prefetch(mask_ahead, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            _mm_prefetch((const char *)vp[j] + PREFETCH_BYTES, _MM_HINT_T0);
            uint64_t bits;
            memcpy(&bits, mr[j] + k / 8, sizeof bits);
            const uint32_t low = (uint32_t)bits, high = (uint32_t)(bits >> 32);
            lo[j] = widen(vp[j], low);
            hi[j] = widen(vp[j] + __builtin_popcount(low), high);
            vp[j] += __builtin_popcountll(bits);
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
     * gemv_bf16.c's tail, and the expand leaves zeros past the end. */
    for (; k < K; k += 32) {
        const int64_t columns = K - k < 32 ? K - k : 32;
        const __mmask32 xmask = (__mmask32)(columns == 32 ? 0xffffffffu : (1u << columns) - 1u);
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const uint32_t bits = mask_bits(mr[j], k, columns);
            wv[j] = widen(vp[j], bits);
            vp[j] += __builtin_popcount(bits);
        }
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
ALWAYS_INLINE void rows(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const int64_t *row_offsets,
                        const uint16_t *bias, uint16_t *y, int64_t K, int64_t N, int64_t n_begin, int64_t n_end,
                        const int M, const int NB) {
    /* Nothing is in flight at the start of the range: request its first PREFETCH_BYTES (and masks) at once
     * (the range holds at most 2K value bytes per row; prefetching past the end of values is harmless). */
    const char *start = (const char *)(values + row_offsets[n_begin]);
    const char *mask_start = (const char *)(mask + n_begin * (K / 8));
    const int64_t range_bytes = (n_end - n_begin) * 2 * K;
    const int64_t warm = range_bytes < PREFETCH_BYTES ? range_bytes : PREFETCH_BYTES;
    for (int64_t off = 0; off < warm; off += 64) _mm_prefetch(start + off, _MM_HINT_T0);
    for (int64_t off = 0; off < warm / 16; off += 64) _mm_prefetch(mask_start + off, _MM_HINT_T0);

    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) tile(x, values, mask, row_offsets, bias, y, K, N, n, M, NB);
    for (; n < n_end; n++) tile(x, values, mask, row_offsets, bias, y, K, N, n, M, 1);
}

/* One instantiation per M; NB keeps M * NB <= 16 accumulators (plus 2 * NB widened slices) in registers. */
#define DEFINE_ROWS(M_, NB_)                                                                                     \
    static void rows_m##M_(const uint16_t *x, const uint16_t *values, const uint8_t *mask,                        \
                           const int64_t *row_offsets, const uint16_t *bias, uint16_t *y, int64_t K, int64_t N,   \
                           int64_t n_begin, int64_t n_end) {                                        \
        rows(x, values, mask, row_offsets, bias, y, K, N, n_begin, n_end, M_, NB_);                        \
    }
DEFINE_ROWS(1, 8)
DEFINE_ROWS(2, 4)
DEFINE_ROWS(3, 4)
DEFINE_ROWS(4, 4)
DEFINE_ROWS(5, 2)
DEFINE_ROWS(6, 2)
DEFINE_ROWS(7, 2)
DEFINE_ROWS(8, 2)

typedef void (*rows_fn)(const uint16_t *, const uint16_t *, const uint8_t *, const int64_t *, const uint16_t *,
                        uint16_t *, int64_t, int64_t, int64_t, int64_t);
static const rows_fn ROWS_FOR_M[MAX_ROWS + 1] = {0,       rows_m1, rows_m2, rows_m3, rows_m4,
                                                 rows_m5, rows_m6, rows_m7, rows_m8};

typedef struct {
    const uint16_t *x, *values;
    const uint8_t *mask;
    const int64_t *row_offsets;
    const uint16_t *bias;
    uint16_t *y;
    int64_t K, N;
} bitmask_args;

static void bitmask_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const bitmask_args *a = args;
    ROWS_FOR_M[m](a->x + m0 * a->K, a->values, a->mask, a->row_offsets, a->bias, a->y + m0 * a->N, a->K, a->N,
                  n_begin, n_end);
}

/* Exported entry point. x [M, K], values [nnz], bias [N] or NULL, y [M, N]: contiguous bfloat16 bit patterns;
 * mask [N, K / 8] uint8 and row_offsets [N] int64, row n's values starting at values + row_offsets[n] and
 * numbering the set bits of its mask row (checked when the layer is built: the kernel trusts them). Runs on up
 * to num_threads threads, on one when the stored weight is smaller than min_parallel_bytes. Returns 0, or -1 on
 * bad sizes (K must be a multiple of 8). */
int leanlm_linear_bitmask(const uint16_t *x, const uint16_t *values, const uint8_t *mask, const int64_t *row_offsets,
                          const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads,
                          int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K < 0 || K % 8 != 0) return -1;
    if (M == 0 || N == 0) return 0;
    /* values (the last row's start bounds them from below), mask and row offsets */
    const int64_t weight_bytes = 2 * row_offsets[N - 1] + N * (K / 8 + 8);
    const bitmask_args args = {x, values, mask, row_offsets, bias, y, K, N};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, weight_bytes, min_parallel_bytes);
    leanlm_row_passes(bitmask_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* The decode loop's entry (linear_call.h): tensors values bf16 [nnz], mask uint8 [N, K / 8], row_offsets int64
 * [N], bias bf16 [N] or NULL. */
int leanlm_linear_bitmask_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                               int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_bitmask(x, (const uint16_t *)c->tensors[0], (const uint8_t *)c->tensors[1],
                                 (const int64_t *)c->tensors[2], (const uint16_t *)c->tensors[3], y, M, N, K, threads,
                                 min_parallel_bytes);
}
