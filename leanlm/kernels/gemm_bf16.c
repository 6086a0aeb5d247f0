/* Many-row bfloat16 linear layer for x86-64 with AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),
 * for the 9-512 rows of a batched decode or a mixed prefill+decode step.
 *
 * W is packed once (cpu_gemm.py) into panels of NR = 32 output columns: panel p holds, for each pair of input
 * columns (2kk, 2kk+1), the 32 pairs (W[32p + c, 2kk], W[32p + c, 2kk + 1]) for c = 0..31, i.e. two zmm
 * registers of bf16 pairs. That is the operand vdpbf16ps wants: one instruction multiplies a broadcast pair of
 * x by 16 weight pairs and adds both products into 16 fp32 sums, so the micro-kernel does no shuffles and no
 * horizontal reductions. N is padded with zero columns to a multiple of 32 and K to an even count.
 *
 * The micro-kernel keeps an MR x 32 block of y in 2 * MR zmm accumulators (MR <= 12: 24 accumulators, 2
 * weight registers, the x pair comes from memory as an embedded broadcast) across all of K, then adds the
 * bias, rounds to bf16 (nearest-even) and stores. Threads own contiguous ranges of panels, so every weight
 * byte is read by one thread; within a panel the block walks down the rows of x, so the panel (K * 128
 * bytes) is read from memory once and from L2 for the other row blocks.
 */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "linear_call.h"

#define NR 32
#define MR_MAX 12

/* MR rows of x (row stride K elements, K even) against one packed panel of Kp / 2 pair-rows. */
ALWAYS_INLINE void micro(const uint16_t *x, const uint16_t *panel, const float *bias, uint16_t *y, int64_t K,
                         int64_t ldy, __mmask32 cols, const int MR) {
    __m512 acc[MR_MAX][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    const uint32_t *xp = (const uint32_t *)x; /* x's rows as bf16 pairs: row i, pair kk at xp[i * pairs + kk] */
    for (int64_t kk = 0; kk < pairs; kk++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(panel + kk * 2 * NR));
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(panel + kk * 2 * NR + NR));
        _mm_prefetch((const char *)(panel + (kk + 8) * 2 * NR), _MM_HINT_T0);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[i * pairs + kk]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
    if (bias) {
        bias0 = _mm512_loadu_ps(bias);
        bias1 = _mm512_loadu_ps(bias + 16);
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        /* vcvtne2ps2bf16 rounds to nearest-even: low 16 columns from the second operand */
        const __m512bh out = _mm512_cvtne2ps_pbh(_mm512_add_ps(acc[i][1], bias1), _mm512_add_ps(acc[i][0], bias0));
        _mm512_mask_storeu_epi16((void *)(y + i * ldy), cols, (__m512i)out);
    }
}

#define DEFINE_MICRO(MR_)                                                                                  \
    static void micro_##MR_(const uint16_t *x, const uint16_t *panel, const float *bias, uint16_t *y,       \
                            int64_t K, int64_t ldy, __mmask32 cols) {                                      \
        micro(x, panel, bias, y, K, ldy, cols, MR_);                                                       \
    }
DEFINE_MICRO(1)
DEFINE_MICRO(2)
DEFINE_MICRO(3)
DEFINE_MICRO(4)
DEFINE_MICRO(5)
DEFINE_MICRO(6)
DEFINE_MICRO(7)
DEFINE_MICRO(8)
DEFINE_MICRO(9)
DEFINE_MICRO(10)
DEFINE_MICRO(11)
DEFINE_MICRO(12)

typedef void (*micro_fn)(const uint16_t *, const uint16_t *, const float *, uint16_t *, int64_t, int64_t,
                         __mmask32);
static const micro_fn MICRO[MR_MAX + 1] = {0,        micro_1, micro_2, micro_3,  micro_4,  micro_5, micro_6,
                                           micro_7,  micro_8, micro_9, micro_10, micro_11, micro_12};

/* The row blocks of x against one bf16 panel: y[:, n0 : n0 + width]. */
static void panel_rows(const uint16_t *x, const uint16_t *panel, const float *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t Kp, int64_t n0) {
    const int64_t width = N - n0 < NR ? N - n0 : NR;
    const __mmask32 cols = width == NR ? (__mmask32)0xffffffffu : (__mmask32)((1u << width) - 1u);
    const float *b = bias ? bias + n0 : 0;
    for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
        MICRO[mr](x + m0 * Kp, panel, b, y + m0 * N + n0, Kp, N, cols);
    }
}

/* Exported entry point. x [M, Kp] bf16 (Kp = K rounded up to even; the caller pads an odd K), packed
 * [ceil(N / 32), Kp / 2, 32, 2] bf16, bias [ceil(N / 32) * 32] float32 or NULL, y [M, N] bf16 (row stride
 * N). Runs on up to num_threads threads. Returns 0, or -1 on bad sizes. */
int leanlm_gemm_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t M,
                     int64_t N, int64_t Kp, int num_threads) {
    if (M < 0 || N < 0 || Kp < 0 || (Kp & 1)) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t panels = (N + NR - 1) / NR;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > panels) threads = (int)panels;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        const int64_t p_begin = panels * tid / nthr, p_end = panels * (tid + 1) / nthr;
        for (int64_t p = p_begin; p < p_end; p++) panel_rows(x, packed + p * Kp * NR, bias, y, M, N, Kp, p * NR);
    }
    return 0;
}

/* ------------------------------------------------------------------------- weight-only int4 and int8 */

/* Quantized panels hold codes in the bf16 panel's order, pair-row kk = 64 codes (column c, k parity j at
 * 2c + j): int8 as 64 signed bytes; int4 as 32 bytes, code i in the low nibble of byte i and code i + 32 in
 * the high one. scales / mins [panels, groups, 64] float32 repeat each column's value twice, matching those
 * 64 positions, for groups of `group_size` input columns (even). A panel is widened once into a per-thread
 * bf16 panel, w = q * scale + min in fp32 (see widen), then round-to-nearest-even to bf16: the values cpu_qgemv's
 * dequantize kernels give, and the bf16 micro-kernel runs on it. */

/* 16 codes (as int32) -> 16 fp32 weights, q * scale rounded and then + min rounded (not fused: the order
 * of cpu_qgemv's dequantize kernels and of the layers' torch reference; with fp16 scales, as in GGUF, the
 * product is exact anyway). */
ALWAYS_INLINE __m512 widen(__m512i q, const float *scale, const float *min) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(scale)), _mm512_loadu_ps(min));
}

ALWAYS_INLINE void store_pairs(uint16_t *dst, __m512 a, __m512 b, __m512 c, __m512 d) {
    _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    _mm512_storeu_si512((void *)(dst + 32), (__m512i)_mm512_cvtne2ps_pbh(d, c));
}

static void widen_panel(const uint8_t *codes, const float *scales, const float *mins, uint16_t *out, int64_t Kp,
                        int64_t group_size, int bits) {
    const int64_t groups = Kp / group_size;
    for (int64_t g = 0; g < groups; g++) {
        const float *s = scales + g * 64, *m = mins + g * 64;
        for (int64_t kk = g * group_size / 2; kk < (g + 1) * group_size / 2; kk++) {
            uint16_t *dst = out + kk * 2 * NR;
            if (bits == 4) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(codes + kk * 32));
                const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0f));
                store_pairs(dst, widen(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)), s, m),
                            widen(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)), s + 16, m + 16),
                            widen(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)), s + 32, m + 32),
                            widen(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)), s + 48, m + 48));
            } else {
                const int8_t *q = (const int8_t *)codes + kk * 64;
                store_pairs(dst, widen(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)), s, m),
                            widen(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))), s + 16, m + 16),
                            widen(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32))), s + 32, m + 32),
                            widen(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 48))), s + 48, m + 48));
            }
        }
    }
}

/* Exported entry point. x [M, Kp] bf16, codes [ceil(N / 32), Kp / 2, 64 * bits / 8] bytes, scales and mins
 * [ceil(N / 32), Kp / group_size, 64] float32, bias as leanlm_gemm_bf16, y [M, N] bf16. bits is 4 or 8.
 * Returns 0, -1 on bad sizes, -2 when a thread's panel buffer cannot be allocated. */
int leanlm_gemm_quant(const uint16_t *x, const uint8_t *codes, const float *scales, const float *mins,
                      const float *bias, uint16_t *y, int64_t M, int64_t N, int64_t Kp, int64_t group_size, int bits,
                      int num_threads) {
    if (M < 0 || N < 0 || Kp < 0 || (Kp & 1) || group_size < 2 || (group_size & 1) || Kp % group_size ||
        (bits != 4 && bits != 8))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t panels = (N + NR - 1) / NR, groups = Kp / group_size;
    const int64_t panel_code_bytes = Kp / 2 * 64 * bits / 8;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > panels) threads = (int)panels;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        const int64_t p_begin = panels * tid / nthr, p_end = panels * (tid + 1) / nthr;
        uint16_t *wide = (uint16_t *)aligned_alloc(64, (size_t)(Kp * NR * sizeof(uint16_t) + 63) / 64 * 64);
        if (wide == NULL) {
            failed = 1;
        } else {
            for (int64_t p = p_begin; p < p_end; p++) {
                widen_panel(codes + p * panel_code_bytes, scales + p * groups * 64, mins + p * groups * 64, wide,
                            Kp, group_size, bits);
                panel_rows(x, wide, bias, y, M, N, Kp, p * NR);
            }
            free(wide);
        }
    }
    return failed ? -2 : 0;
}

/* The machine's vdpbf16ps peak: `iters` rounds of 24 independent dot-product chains on each of num_threads
 * threads, in registers only. Returns the FLOP done (64 per instruction: 32 products, 32 additions); the
 * caller times the call. `seed` keeps the compiler from folding the chains away. */
double leanlm_bf16_dot_peak(int64_t iters, int num_threads, float seed) {
    double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        __m512 acc[24];
        for (int i = 0; i < 24; i++) acc[i] = _mm512_set1_ps(seed * (float)i);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
        for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
            for (int i = 0; i < 24; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        }
        __m512 s = acc[0];
        for (int i = 1; i < 24; i++) s = _mm512_add_ps(s, acc[i]);
        total += (double)_mm512_reduce_add_ps(s) * 0.0 + (double)iters * 24.0 * 64.0;
    }
    return total;
}

/* The decode loop's entries (linear_call.h); the GEMMs split their own work (min_parallel_bytes unused). bf16:
 * tensors packed panels, float32 bias or NULL. quant: code panels, scales, mins (NULL for 8 bits), float32 bias;
 * ints the group size and the bits. */
int leanlm_gemm_bf16_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                          int64_t K, int threads, int64_t min_parallel_bytes) {
    (void)min_parallel_bytes;
    return leanlm_gemm_bf16(x, (const uint16_t *)c->tensors[0], (const float *)c->tensors[1], y, M, N, K, threads);
}

int leanlm_gemm_quant_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                           int64_t K, int threads, int64_t min_parallel_bytes) {
    (void)min_parallel_bytes;
    return leanlm_gemm_quant(x, (const uint8_t *)c->tensors[0], (const float *)c->tensors[1],
                             (const float *)c->tensors[2], (const float *)c->tensors[3], y, M, N, K, c->ints[0],
                             (int)c->ints[1], threads);
}
