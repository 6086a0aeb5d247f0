/* Small-M 2:4 sparse weight-only quantized linear layers for x86-64 with AVX512-BF16 and AVX512-VBMI2:
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W 2:4 sparse along K (2 kept weights in every group of 4
 *   input columns) with only the kept weights' codes stored, next to Sparse24Linear's mask [N, K / 8]
 *   (4 bits per group, exactly 2 set; the 4 mask bytes of 32 columns, read as a little-endian uint32, have
 *   bit i set where column i is kept).
 *
 *   int8: codes int8 [N, K / 2], the kept codes in column order; w = q * scale[n, k / gs] (symmetric).
 *   int4: codes uint8 [N, K / 4] in chunks of 64 columns: chunk c of a row is 16 bytes, byte i holding the
 *         chunk's i-th kept code in its low nibble and its (16 + i)-th in its high nibble; w = q * scale +
 *         min with min = -(zero * scale) in fp32 and zero[n, g] the group's zero code (uint8 0-15), so a
 *         pruned weight, and a kept one with q == zero, is exactly 0.
 *   gs (group size along dense K) is a multiple of 64 dividing K, or K itself (one scale per row); K % 64 == 0.
 *
 * Per 64 dense columns a row's 32 kept codes are widened to bf16 exactly and put back at their dense
 * positions by vpexpandw (VBMI2) with the mask, then multiplied with the dense x by vdpbf16ps, as in
 * gemv_sparse24.c. int8 widens through fp32 (integers of magnitude <= 128 are exact in bf16). int4 ORs the
 * nibble into bf16 128.0 (0x4300 | q == 128 + q, as gemv_quant.c) and fills the pruned positions with 128 +
 * zero instead of 0, so every column of a group carries 128 + (its code, or zero): the group's product is
 * scale * A_g + (min - 128 scale) * S_g exactly as gemv_quant.c's int4 kernel computes it, with A_g the
 * widened dot product and S_g the sum of x over the group's 64 * (gs / 64) dense columns (shared by every row:
 * computed once per call). Pruned columns then add (zero * scale + min) * x = 0 (up to fp32 rounding).
 *
 * Batch-1 decode is bound by reading W: int8 reads 0.5 + 0.125 bytes per weight (62.5% of dense int8), int4
 * 0.25 + 0.125 (75% of dense int4's codes; both plus their scales). Threads split N as gemv_bf16.c does.
 * Built and loaded by cpu_sparse.py.
 */

/* The only VBMI2 instruction is the expand; the library is loaded only where /proc/cpuinfo shows the flag. */
#pragma GCC target("avx512vbmi2")

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
#define CHUNK 64    /* dense columns per step: 32 kept codes, 8 mask bytes */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far ahead (in code bytes) the software prefetch reads, as the other GEMVs */
#endif

/* The kept codes of one 64-column chunk as bf16 vectors of 16 (for columns 0-31, 32-63) in the low halves of
 * lo and hi. One vcvtne2ps2bf16 converts all 32 (the conversion, not the expand, bounds the int8 kernels). */
ALWAYS_INLINE void widen_i8(const int8_t *codes, __m512i *lo, __m512i *hi) {
    const __m128i a = _mm_loadu_si128((const __m128i *)codes), b = _mm_loadu_si128((const __m128i *)(codes + 16));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)),
                                                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    *lo = both;
    *hi = _mm512_castsi256_si512(_mm512_extracti64x4_epi64(both, 1));
}

ALWAYS_INLINE void widen_i4(const uint8_t *codes, __m512i *lo, __m512i *hi) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    const __m256i magic = _mm256_set1_epi16(0x4300);
    *lo = _mm512_castsi256_si512(_mm256_or_si256(_mm256_and_si256(bytes, _mm256_set1_epi16(0x000f)), magic));
    *hi = _mm512_castsi256_si512(_mm256_or_si256(_mm256_srli_epi16(bytes, 4), magic));
}

/* NB weight rows [n0, n0 + NB) against M rows of x. BITS 8 or 4; S [M, G] the group sums of x (int4 only).
 * Each group's dot products accumulate on their own and are scaled into the row's total at the group's end. */
ALWAYS_INLINE void tile(const uint16_t *x, const float *S, const void *codes, const uint8_t *mask,
                        const float *scales, const uint8_t *zeros, const uint16_t *bias, uint16_t *y, int64_t K,
                        int64_t N, int64_t gs, int64_t n0, const int M, const int NB, const int BITS) {
    const int64_t G = K / gs, code_row = BITS == 8 ? K / 2 : K / 4, mask_row = K / 8;
    const int64_t code_chunk = BITS == 8 ? 32 : 16;
    __m512 tot[MAX_ROWS][8];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) tot[i][j] = _mm512_setzero_ps();

    const char *ahead = (const char *)codes + n0 * code_row + PREFETCH_BYTES;
    const char *mask_ahead = (const char *)(mask + n0 * mask_row) + PREFETCH_BYTES * 8 / code_chunk;
    for (int64_t g = 0; g < G; g++) {
        __m512 acc[MAX_ROWS][8];
        __m512i fill[8];
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            fill[j] = _mm512_set1_epi16(BITS == 8 ? 0 : (short)(0x4300 | zeros[(n0 + j) * G + g]));
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) acc[i][j] = _mm512_setzero_ps();
        }
        for (int64_t k = g * gs; k < (g + 1) * gs; k += CHUNK) {
            /* One prefetch per 64 bytes the step consumes (at least one a step), walking each stream linearly. */
            _mm_prefetch(mask_ahead, _MM_HINT_T0);
            mask_ahead += 8 * NB;
#pragma GCC unroll 8
            for (int p = 0; p < (NB * code_chunk + 63) / 64; p++) _mm_prefetch(ahead + 64 * p, _MM_HINT_T0);
            ahead += NB * code_chunk;
            __m512bh wa[8], wb[8];
#pragma GCC unroll 8
            for (int j = 0; j < NB; j++) {
                uint64_t bits;
                memcpy(&bits, mask + (n0 + j) * mask_row + k / 8, sizeof bits);
                __m512i lo, hi;
                if (BITS == 8)
                    widen_i8((const int8_t *)codes + (n0 + j) * code_row + k / 2, &lo, &hi);
                else
                    widen_i4((const uint8_t *)codes + (n0 + j) * code_row + k / 4, &lo, &hi);
                wa[j] = (__m512bh)_mm512_mask_expand_epi16(fill[j], (__mmask32)bits, lo);
                wb[j] = (__m512bh)_mm512_mask_expand_epi16(fill[j], (__mmask32)(bits >> 32), hi);
            }
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                const __m512bh xa = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
                const __m512bh xb = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k + 32));
#pragma GCC unroll 8
                for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xa, wa[j]);
#pragma GCC unroll 8
                for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wb[j]);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const __m512 sv = _mm512_set1_ps(scales[(n0 + j) * G + g]);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) tot[i][j] = _mm512_fmadd_ps(acc[i][j], sv, tot[i][j]);
        }
    }

    /* int4: + sum_g (min_g - 128 scale_g) S_g, 16 groups at a time, min_g = -(zero_g * scale_g) as the layer
     * computes it. */
#pragma GCC unroll 8
    for (int j = 0; j < NB; j++) {
        for (int64_t g = 0; BITS == 4 && g < G; g += 16) {
            const __mmask16 gm = G - g >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (G - g)) - 1u);
            const __m512 s = _mm512_maskz_loadu_ps(gm, scales + (n0 + j) * G + g);
            const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, zeros + (n0 + j) * G + g)));
            const __m512 mn = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, s));
            const __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, mn);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) tot[i][j] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(gm, S + i * G + g), tot[i][j]);
        }
        const float b = bias ? bf16_to_f32(bias[n0 + j]) : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) y[i * N + n0 + j] = f32_to_bf16(_mm512_reduce_add_ps(tot[i][j]) + b);
    }
}

/* Weight rows [n_begin, n_end) for M rows of x: tiles of NB rows, then single rows for the remainder. */
ALWAYS_INLINE void rows(const uint16_t *x, const float *S, const void *codes, const uint8_t *mask,
                        const float *scales, const uint8_t *zeros, const uint16_t *bias, uint16_t *y, int64_t K,
                        int64_t N, int64_t gs, int64_t n_begin, int64_t n_end, const int M, const int NB,
                        const int BITS) {
    /* Nothing is in flight at the start of the range: request its first PREFETCH_BYTES of codes at once. */
    const int64_t code_row = BITS == 8 ? K / 2 : K / 4;
    const char *start = (const char *)codes + n_begin * code_row;
    const int64_t range = (n_end - n_begin) * code_row, warm = range < PREFETCH_BYTES ? range : PREFETCH_BYTES;
    for (int64_t off = 0; off < warm; off += 64) _mm_prefetch(start + off, _MM_HINT_T0);
    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) tile(x, S, codes, mask, scales, zeros, bias, y, K, N, gs, n, M, NB, BITS);
    for (; n < n_end; n++) tile(x, S, codes, mask, scales, zeros, bias, y, K, N, gs, n, M, 1, BITS);
}

/* One instantiation per (M, BITS); NB keeps 2 * M * NB <= 16 accumulators (acc and tot) in registers. */
#define DEFINE_ROWS(M_, NB_, BITS_)                                                                             \
    static void rows_m##M_##_b##BITS_(const uint16_t *x, const float *S, const void *codes, const uint8_t *mask, \
                                      const float *scales, const uint8_t *zeros, const uint16_t *bias,          \
                                      uint16_t *y, int64_t K, int64_t N, int64_t gs, int64_t n_begin,           \
                                      int64_t n_end) {                                                          \
        rows(x, S, codes, mask, scales, zeros, bias, y, K, N, gs, n_begin, n_end, M_, NB_, BITS_);              \
    }
#define DEFINE_ROWS_BOTH(M_, NB_) DEFINE_ROWS(M_, NB_, 8) DEFINE_ROWS(M_, NB_, 4)
DEFINE_ROWS_BOTH(1, 8)
DEFINE_ROWS_BOTH(2, 4)
DEFINE_ROWS_BOTH(3, 2)
DEFINE_ROWS_BOTH(4, 2)
DEFINE_ROWS_BOTH(5, 1)
DEFINE_ROWS_BOTH(6, 1)
DEFINE_ROWS_BOTH(7, 1)
DEFINE_ROWS_BOTH(8, 1)

typedef void (*rows_fn)(const uint16_t *, const float *, const void *, const uint8_t *, const float *,
                        const uint8_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t);
static const rows_fn ROWS_I8[MAX_ROWS + 1] = {0,          rows_m1_b8, rows_m2_b8, rows_m3_b8, rows_m4_b8,
                                              rows_m5_b8, rows_m6_b8, rows_m7_b8, rows_m8_b8};
static const rows_fn ROWS_I4[MAX_ROWS + 1] = {0,          rows_m1_b4, rows_m2_b4, rows_m3_b4, rows_m4_b4,
                                              rows_m5_b4, rows_m6_b4, rows_m7_b4, rows_m8_b4};

/* S[i, g] = the fp32 sum of x row i over group g (gs a multiple of 64). */
static void group_sums(const uint16_t *x, float *S, int64_t m, int64_t K, int64_t gs) {
    const int64_t G = K / gs;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < G; g++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 16)
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                             _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i * K + k))),
                                             16)));
            S[i * G + g] = _mm512_reduce_add_ps(sum);
        }
}

/* One pass: S holds this pass's group sums (int4), fn the instantiation for its row count. */
typedef struct {
    rows_fn fn;
    const uint16_t *x;
    const float *S;
    const void *codes;
    const uint8_t *mask;
    const float *scales;
    const uint8_t *zeros;
    const uint16_t *bias;
    uint16_t *y;
    int64_t K, N, gs;
} pass_args;

static void quant_pass(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end) {
    const pass_args *a = args;
    (void)m;
    a->fn(a->x + m0 * a->K, a->S, a->codes, a->mask, a->scales, a->zeros, a->bias, a->y + m0 * a->N, a->K, a->N,
          a->gs, n_begin, n_end);
}

static int run(const uint16_t *x, const void *codes, const uint8_t *mask, const float *scales, const uint8_t *zeros,
               const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads,
               int64_t min_parallel_bytes, const int BITS) {
    if (M < 0 || N < 0 || K < 0 || K % CHUNK != 0 || gs <= 0 || gs % CHUNK != 0 || K % gs != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / gs;
    const int64_t weight_bytes = N * ((BITS == 8 ? K / 2 : K / 4) + K / 8);
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, weight_bytes, min_parallel_bytes);
    float *S = NULL;
    if (BITS == 4 && (S = malloc((size_t)(MAX_ROWS * G) * sizeof(float))) == NULL) return -2;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t m = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        if (BITS == 4) group_sums(x + m0 * K, S, m, K, gs);
        const rows_fn fn = (BITS == 8 ? ROWS_I8 : ROWS_I4)[m];
        const pass_args args = {fn, x, S, codes, mask, scales, zeros, bias, y, K, N, gs};
        leanlm_split_pass(quant_pass, &args, m0, m, N, BLOCK_N, threads);
    }
    free(S);
    return 0;
}

/* x [M, K] bf16, codes int8 [N, K / 2], mask uint8 [N, K / 8] (exactly 2 bits per nibble: the expand reads as
 * many codes as bits are set, checked when the layer is built), scales fp32 [N, K / gs], bias [N] bf16 or
 * NULL, y [M, N] bf16; all contiguous. Returns 0, or -1 on bad sizes. */
int leanlm_linear_sparse24_int8(const uint16_t *x, const int8_t *codes, const uint8_t *mask, const float *scales,
                                const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t gs,
                                int num_threads, int64_t min_parallel_bytes) {
    return run(x, codes, mask, scales, NULL, bias, y, M, N, K, gs, num_threads, min_parallel_bytes, 8);
}

/* As leanlm_linear_sparse24_int8 with codes uint8 [N, K / 4] (the chunk layout above) and zeros uint8
 * [N, K / gs] (each 0-15). Returns 0, -1 on bad sizes, -2 when out of memory. */
int leanlm_linear_sparse24_int4(const uint16_t *x, const uint8_t *codes, const uint8_t *mask, const float *scales,
                                const uint8_t *zeros, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                                int64_t K, int64_t gs, int num_threads, int64_t min_parallel_bytes) {
    return run(x, codes, mask, scales, zeros, bias, y, M, N, K, gs, num_threads, min_parallel_bytes, 4);
}

/* The decode loop's entries (linear_call.h). int8: tensors codes int8 [N, K / 2], mask, scales, bias; int4:
 * codes uint8 [N, K / 4], mask, scales, zeros, bias; ints[0] the group size (K: one per channel). */
int leanlm_linear_sparse24_int8_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M,
                                     int64_t N, int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_sparse24_int8(x, (const int8_t *)c->tensors[0], (const uint8_t *)c->tensors[1],
                                       (const float *)c->tensors[2], (const uint16_t *)c->tensors[3], y, M, N, K,
                                       c->ints[0], threads, min_parallel_bytes);
}

int leanlm_linear_sparse24_int4_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M,
                                     int64_t N, int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_sparse24_int4(x, (const uint8_t *)c->tensors[0], (const uint8_t *)c->tensors[1],
                                       (const float *)c->tensors[2], (const uint8_t *)c->tensors[3],
                                       (const uint16_t *)c->tensors[4], y, M, N, K, c->ints[0], threads,
                                       min_parallel_bytes);
}
