/* W8A8 linear layer for x86-64 with AVX512-VNNI: y[M, N] = (q(x) * s_x) @ (Wq * s_w)^T (+ bias), any M.
 *
 * SmoothQuant / ZeroQuant-style int8: the weight holds int8 codes with one scale per output column; each row
 * of x is quantized on the fly to int8 with one scale per row (symmetric, amax / 127, round half to even,
 * exactly quantize_per_token_int8). The product is an exact int32 sum, then y = float(acc) * s_x * s_w + b,
 * each op rounded in that order (torch's `_int_mm(...).float() * xs * scales + bias`), then bf16.
 *
 * vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products into an int32 lane. Its
 * broadcastable operand is the signed one, so x stays signed (a row's 4 codes broadcast from memory) and the
 * weight is stored unsigned, u = w + 128; the sum then carries 128 * sum(q(x)) too, subtracted per row.
 * Products fit int16 (255 * 127), sums int32 for any K below 66 000.
 *
 * W is packed once (cpu_gemm.pack_w8a8) into panels of NR = 32 output columns: panel p holds, for each quad
 * of input columns (4kq .. 4kq + 3), the 32 quads (u[32p + c, 4kq .. 4kq + 3]) for c = 0..31: two zmm of
 * unsigned bytes. K is padded to a multiple of 4 (weight code 0, x code 0) and N to a multiple of 32.
 * The micro-kernel keeps MR x 32 int32 sums in 2 * MR zmm (MR <= 12) across all of K, as gemm_bf16.c does;
 * threads own contiguous ranges of panels.
 */

#pragma GCC target("avx512vnni")

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "linear_call.h"

#define NR 32
#define MR_MAX 12

#define SCALE_FLOOR 1e-12f /* numerics._EPS: an all-zero row quantizes to zeros instead of NaN */

/* One row of x (K bf16) -> Kq int8 codes (zero-padded), its scale and the sum of its codes. */
static void quantize_row(const uint16_t *x, int8_t *q, float *scale, int32_t *sum, int64_t K, int64_t Kq) {
    __m512 amax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_f32(x + k)));
    float m = _mm512_reduce_max_ps(amax);
    for (; k < K; k++) m = fmaxf(m, fabsf(bf16_to_f32(x[k])));
    const float s = fmaxf(m / 127.0f, SCALE_FLOOR);
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    __m512i total = _mm512_setzero_si512();
    int32_t tail = 0;
    for (k = 0; k + 16 <= K; k += 16) {
        /* IEEE division and round-half-even, as torch.round(x / scale) */
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(bf16x16_to_f32(x + k), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
        total = _mm512_add_epi32(total, c);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(c));
    }
    for (; k < K; k++) {
        const float v = fminf(fmaxf(nearbyintf(bf16_to_f32(x[k]) / s), -127.0f), 127.0f);
        q[k] = (int8_t)v;
        tail += (int32_t)v;
    }
    for (; k < Kq; k++) q[k] = 0;
    *scale = s;
    *sum = _mm512_reduce_add_epi32(total) + tail;
}

/* MR quantized rows (row stride Kq bytes) against one packed panel -> MR x 32 outputs. */
ALWAYS_INLINE void micro(const int8_t *xq, const float *xs, const int32_t *xsum, const uint8_t *panel,
                         const float *ws, const float *bias, uint16_t *y, int64_t Kq, int64_t ldy, __mmask32 cols,
                         const int MR) {
    __m512i acc[MR_MAX][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    const int64_t quads = Kq / 4;
    const int32_t *xp = (const int32_t *)xq; /* row i, quad kq at xp[i * quads + kq] */
    for (int64_t kq = 0; kq < quads; kq++) {
        const __m512i b0 = _mm512_loadu_si512((const void *)(panel + kq * 4 * NR));
        const __m512i b1 = _mm512_loadu_si512((const void *)(panel + kq * 4 * NR + 64));
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            /* the broadcast x quad as vpdpbusd's memory operand (GCC 12 keeps the intrinsic's sums in
             * registers only through inline asm: with _mm512_dpbusd_epi32 it copies and spills them) */
            const int32_t *a = xp + i * quads + kq;
            __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[i][0]) : "v"(b0), "m"(*a));
            __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[i][1]) : "v"(b1), "m"(*a));
        }
    }
    const __m512 ws0 = _mm512_loadu_ps(ws), ws1 = _mm512_loadu_ps(ws + 16);
    __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
    if (bias) {
        bias0 = _mm512_loadu_ps(bias);
        bias1 = _mm512_loadu_ps(bias + 16);
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        const __m512i offset = _mm512_set1_epi32(128 * xsum[i]);
        const __m512 s = _mm512_set1_ps(xs[i]);
        __m512 y0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][0], offset)), s), ws0);
        __m512 y1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][1], offset)), s), ws1);
        if (bias) {
            y0 = _mm512_add_ps(y0, bias0);
            y1 = _mm512_add_ps(y1, bias1);
        }
        _mm512_mask_storeu_epi16((void *)(y + i * ldy), cols, (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
    }
}

#define DEFINE_MICRO(MR_)                                                                                      \
    static void micro_##MR_(const int8_t *xq, const float *xs, const int32_t *xsum, const uint8_t *panel,      \
                            const float *ws, const float *bias, uint16_t *y, int64_t Kq, int64_t ldy,          \
                            __mmask32 cols) {                                                                  \
        micro(xq, xs, xsum, panel, ws, bias, y, Kq, ldy, cols, MR_);                                           \
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

typedef void (*micro_fn)(const int8_t *, const float *, const int32_t *, const uint8_t *, const float *,
                         const float *, uint16_t *, int64_t, int64_t, __mmask32);
static const micro_fn MICRO[MR_MAX + 1] = {0,        micro_1, micro_2, micro_3,  micro_4,  micro_5, micro_6,
                                           micro_7,  micro_8, micro_9, micro_10, micro_11, micro_12};

/* Exported entry point. x [M, K] bf16 (row stride K), packed [ceil(N / 32), Kq / 4, 32, 4] uint8 (Kq = K
 * rounded up to a multiple of 4), scales and bias (or NULL) [ceil(N / 32) * 32] float32, y [M, N] bf16.
 * Runs on up to num_threads threads. Returns 0, -1 on bad sizes, -2 when the row buffer cannot be allocated. */
int leanlm_gemm_w8a8(const uint16_t *x, const uint8_t *packed, const float *scales, const float *bias, uint16_t *y,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 0 || N < 0 || K <= 0 || K >= 65536) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t Kq = (K + 3) / 4 * 4, panels = (N + NR - 1) / NR;
    /* one buffer: the codes [M, Kq], then the row scales [M] and code sums [M] */
    char *buffer = (char *)malloc((size_t)(M * Kq + M * (int64_t)(sizeof(float) + sizeof(int32_t))));
    if (buffer == NULL) return -2;
    int8_t *xq = (int8_t *)buffer;
    float *xs = (float *)(buffer + M * Kq);
    int32_t *xsum = (int32_t *)(xs + M);
    const int threads = num_threads < 1 ? 1 : num_threads;
    const int row_threads = M < threads ? (int)M : threads;
#pragma omp parallel for num_threads(row_threads) if (row_threads > 1 && M * K >= 16384)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, xq + m * Kq, xs + m, xsum + m, K, Kq);
    const int panel_threads = panels < threads ? (int)panels : threads;
#pragma omp parallel num_threads(panel_threads) if (panel_threads > 1)
    {
        const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        const int64_t p_begin = panels * tid / nthr, p_end = panels * (tid + 1) / nthr;
        for (int64_t p = p_begin; p < p_end; p++) {
            const int64_t n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
            const __mmask32 cols = width == NR ? (__mmask32)0xffffffffu : (__mmask32)((1u << width) - 1u);
            for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                const int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
                MICRO[mr](xq + m0 * Kq, xs + m0, xsum + m0, packed + p * Kq * NR, scales + n0,
                          bias ? bias + n0 : 0, y + m0 * N + n0, Kq, N, cols);
            }
        }
    }
    free(buffer);
    return 0;
}

/* The decode loop's entry (linear_call.h), at every row count: tensors the packed codes, their padded scales,
 * float32 bias or NULL. */
int leanlm_gemm_w8a8_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                          int64_t K, int threads, int64_t min_parallel_bytes) {
    (void)min_parallel_bytes;
    return leanlm_gemm_w8a8(x, (const uint8_t *)c->tensors[0], (const float *)c->tensors[1],
                            (const float *)c->tensors[2], y, M, N, K, threads);
}
