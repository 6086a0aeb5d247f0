/* Dynamic int8 activations for int4 and int8 weights (W4A8 / W8A8-dynamic) on x86-64 with AVX512-VNNI:
 * y[M, N] = q(x) @ W^T (+ bias) for any M, where q(x) quantizes each row of x on the fly in groups of 32 inputs
 * (symmetric int8, scale amax / 127, round half to even: numerics.fake_quantize_act_int8), as llama.cpp's Q8_0 /
 * Q8_1 activations and OpenVINO's CPU plugin (DYNAMIC_QUANTIZATION_GROUP_SIZE 32) do.
 *
 * Weights, per act group a of 32 inputs (its weight group's scale s and min m repeated over the act groups it spans):
 *   int8 (bits 8): w = s * c, c signed, stored u = c + 128;  sum_k x^_k w_k = xs_a * s * (sum u*xq - 128 sum xq)
 *   int4 (bits 4): w = s * q + m, q in 0..15 stored as is;   sum_k x^_k w_k = xs_a * s * sum q*xq + m * xs_a * sum xq
 * vpdpbusd multiplies 4 unsigned bytes (the weight) by 4 signed bytes (x, broadcast from memory) into int32 lanes.
 * The int8 correction -128 * sum(xq_a) is the int32 sums' starting value; the int4 min term is one FMA with
 * r_a = xs_a * sum(xq_a). Per act group: y += float(isum) * (s * xs_a) [+ m * r_a], in group order, in float32.
 *
 * Packing (cpu_a8.pack_int8 / pack_int4) into panels of NR = 32 output columns; K is a multiple of 32.
 *   int8: panel [K / 4, 32, 4]: for input quad kq, 128 bytes, the 4 codes of column c at 4c (two zmm: c < 16, c >= 16).
 *   int4: panel [K / 8, 2, 64]: for input quads 2j, 2j+1, 128 bytes; byte 4c' + t of half h (c = 16h + c') holds
 *         q[c, 8j + t] in its low nibble and q[c, 8j + 4 + t] in its high one, so one AND and one shift + AND
 *         give the two quads' zmm without a widening pass.
 *   scales (and int4 mins): [panels, K / (32 span), 32] float32, one 32-column row per weight group of `span`
 *   act groups (per channel: span = K / 32, one row), so a step reads each scale once, as the weight holds it.
 * The micro-kernel keeps MR x 32 float sums and MR x 32 int32 group sums (MR <= 6: 24 zmm) while walking K.
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
#define MR_MAX 6
#define AG 32              /* inputs per activation group */
#define SCALE_FLOOR 1e-12f /* numerics._EPS: an all-zero group quantizes to zeros instead of NaN */


ALWAYS_INLINE __m512i round_codes(__m512 v, __m512 s) {
    /* IEEE division and round-half-even, as torch.round(x / scale); |x| <= amax keeps codes within +-127 */
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)));
}

/* One row of x (K bf16) -> K int8 codes, and per group: its scale, r = scale * sum(codes), -128 * sum(codes). */
static void quantize_row(const uint16_t *x, int8_t *q, float *xs, float *r, int32_t *ibias, int64_t K) {
    for (int64_t a = 0; a < K / AG; a++) {
        const __m512 v0 = bf16x16_to_f32(x + a * AG), v1 = bf16x16_to_f32(x + a * AG + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float s = fmaxf(amax / 127.0f, SCALE_FLOOR);
        const __m512 vs = _mm512_set1_ps(s);
        const __m512i c0 = round_codes(v0, vs), c1 = round_codes(v1, vs);
        _mm_storeu_si128((__m128i *)(q + a * AG), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q + a * AG + 16), _mm512_cvtepi32_epi8(c1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
        xs[a] = s;
        r[a] = s * (float)sum;
        ibias[a] = -128 * sum;
    }
}

/* vpdpbusd with the x quad broadcast from memory (through inline asm: GCC spills the intrinsic's sums, see
 * gemm_w8a8.c) */
#define DP(acc, w, quad) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(quad)))

/* MR quantized rows against one panel -> MR x 32 outputs. Rows: codes xq (stride K), per-group xs, r, ibias
 * (stride G = K / 32). */
ALWAYS_INLINE void micro(const int8_t *xq, const float *xs, const float *r, const int32_t *ibias,
                         const uint8_t *panel, const float *ws, const float *wm, const float *bias, uint16_t *y,
                         int64_t K, int64_t span, int64_t ldy, __mmask32 cols, const int bits, const int MR) {
    const int64_t G = K / AG;
    __m512 out[MR_MAX][2];
    __m512i acc[MR_MAX][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) out[i][0] = out[i][1] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t a = 0; a < G; a++) {
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++)
            acc[i][0] = acc[i][1] = bits == 8 ? _mm512_set1_epi32(ibias[i * G + a]) : _mm512_setzero_si512();
        if (bits == 8) {
#pragma GCC unroll 8
            for (int t = 0; t < AG / 4; t++) {
                const uint8_t *p = panel + (a * (AG / 4) + t) * 128;
                const __m512i b0 = _mm512_loadu_si512((const void *)p), b1 = _mm512_loadu_si512((const void *)(p + 64));
#pragma GCC unroll 6
                for (int i = 0; i < MR; i++) {
                    const int32_t *quad = (const int32_t *)(xq + i * K + a * AG) + t;
                    DP(acc[i][0], b0, quad);
                    DP(acc[i][1], b1, quad);
                }
            }
        } else {
#pragma GCC unroll 4
            for (int t = 0; t < AG / 8; t++) {
                const uint8_t *p = panel + (a * (AG / 8) + t) * 128;
                const __m512i n0 = _mm512_loadu_si512((const void *)p), n1 = _mm512_loadu_si512((const void *)(p + 64));
                const __m512i lo0 = _mm512_and_si512(n0, low), lo1 = _mm512_and_si512(n1, low);
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(n0, 4), low);
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(n1, 4), low);
#pragma GCC unroll 6
                for (int i = 0; i < MR; i++) {
                    const int32_t *quad = (const int32_t *)(xq + i * K + a * AG) + 2 * t;
                    DP(acc[i][0], lo0, quad);
                    DP(acc[i][1], lo1, quad);
                    DP(acc[i][0], hi0, quad + 1);
                    DP(acc[i][1], hi1, quad + 1);
                }
            }
        }
        const int64_t g = a / span; /* the weight group of act group a */
        const __m512 ws0 = _mm512_loadu_ps(ws + g * NR), ws1 = _mm512_loadu_ps(ws + g * NR + 16);
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            const __m512 s = _mm512_set1_ps(xs[i * G + a]);
            out[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), _mm512_mul_ps(ws0, s), out[i][0]);
            out[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), _mm512_mul_ps(ws1, s), out[i][1]);
        }
        if (bits == 4) {
            const __m512 m0 = _mm512_loadu_ps(wm + g * NR), m1 = _mm512_loadu_ps(wm + g * NR + 16);
#pragma GCC unroll 6
            for (int i = 0; i < MR; i++) {
                const __m512 rr = _mm512_set1_ps(r[i * G + a]);
                out[i][0] = _mm512_fmadd_ps(m0, rr, out[i][0]);
                out[i][1] = _mm512_fmadd_ps(m1, rr, out[i][1]);
            }
        }
    }
    __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
    if (bias) {
        bias0 = _mm512_loadu_ps(bias);
        bias1 = _mm512_loadu_ps(bias + 16);
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        const __m512 y0 = _mm512_add_ps(out[i][0], bias0), y1 = _mm512_add_ps(out[i][1], bias1);
        _mm512_mask_storeu_epi16((void *)(y + i * ldy), cols, (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
    }
}

typedef void (*micro_fn)(const int8_t *, const float *, const float *, const int32_t *, const uint8_t *,
                         const float *, const float *, const float *, uint16_t *, int64_t, int64_t, int64_t,
                         __mmask32);

#define DEFINE_MICRO(BITS, MR_)                                                                                  \
    static void micro_##BITS##_##MR_(const int8_t *xq, const float *xs, const float *r, const int32_t *ib,        \
                                     const uint8_t *panel, const float *ws, const float *wm, const float *bias,  \
                                     uint16_t *y, int64_t K, int64_t span, int64_t ldy, __mmask32 cols) {        \
        micro(xq, xs, r, ib, panel, ws, wm, bias, y, K, span, ldy, cols, BITS, MR_);                             \
    }
DEFINE_MICRO(8, 1)
DEFINE_MICRO(8, 2)
DEFINE_MICRO(8, 3)
DEFINE_MICRO(8, 4)
DEFINE_MICRO(8, 5)
DEFINE_MICRO(8, 6)
DEFINE_MICRO(4, 1)
DEFINE_MICRO(4, 2)
DEFINE_MICRO(4, 3)
DEFINE_MICRO(4, 4)
DEFINE_MICRO(4, 5)
DEFINE_MICRO(4, 6)
static const micro_fn MICRO8[MR_MAX + 1] = {0, micro_8_1, micro_8_2, micro_8_3, micro_8_4, micro_8_5, micro_8_6};
static const micro_fn MICRO4[MR_MAX + 1] = {0, micro_4_1, micro_4_2, micro_4_3, micro_4_4, micro_4_5, micro_4_6};

/* Exported entry point. x [M, K] bf16 (row stride K; K a multiple of 32, below 65536), packed panels (layout
 * above), scales and (bits 4) mins [ceil(N / 32), K / (32 span), 32] float32, bias (or NULL) [ceil(N / 32) * 32]
 * float32, y [M, N] bf16; span: act groups per weight scale. Runs on up to num_threads threads. Returns 0, -1 on
 * bad sizes, bits or span, -2 when the row buffer cannot be allocated. */
int leanlm_gemm_a8(const uint16_t *x, const uint8_t *packed, const float *scales, const float *mins,
                   const float *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int bits, int64_t span,
                   int num_threads) {
    if (M < 0 || N < 0 || K <= 0 || K % AG || K >= 65536 || (bits != 4 && bits != 8) || (bits == 4 && !mins) ||
        span < 1 || (K / AG) % span)
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / AG, panels = (N + NR - 1) / NR, panel_bytes = bits == 8 ? K * NR : K * NR / 2;
    /* one buffer: the codes [M, K], then per row and group the scales, r and -128 * sum [M, G] */
    char *buffer = (char *)malloc((size_t)(M * K + M * G * (int64_t)(2 * sizeof(float) + sizeof(int32_t))));
    if (buffer == NULL) return -2;
    int8_t *xq = (int8_t *)buffer;
    float *xs = (float *)(buffer + M * K), *r = xs + M * G;
    int32_t *ibias = (int32_t *)(r + M * G);
    const int threads = num_threads < 1 ? 1 : num_threads;
    const int row_threads = M < threads ? (int)M : threads;
#pragma omp parallel for num_threads(row_threads) if (row_threads > 1 && M * K >= 16384)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, xq + m * K, xs + m * G, r + m * G, ibias + m * G, K);
    const micro_fn *table = bits == 8 ? MICRO8 : MICRO4;
    const int panel_threads = panels < threads ? (int)panels : threads;
#pragma omp parallel num_threads(panel_threads) if (panel_threads > 1)
    {
        const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        const int64_t p_begin = panels * tid / nthr, p_end = panels * (tid + 1) / nthr;
        for (int64_t p = p_begin; p < p_end; p++) {
            const int64_t n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
            const __mmask32 cols = width == NR ? (__mmask32)0xffffffffu : (__mmask32)((1u << width) - 1u);
            const int64_t scale_rows = G / span;
            const float *ws = scales + p * scale_rows * NR, *wm = mins ? mins + p * scale_rows * NR : 0;
            for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                const int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
                table[mr](xq + m0 * K, xs + m0 * G, r + m0 * G, ibias + m0 * G, packed + p * panel_bytes, ws, wm,
                          bias ? bias + n0 : 0, y + m0 * N + n0, K, span, N, cols);
            }
        }
    }
    free(buffer);
    return 0;
}

/* The decode loop's entry (linear_call.h), at every row count: tensors the panels, scales, mins (int4) or NULL,
 * float32 bias or NULL; ints[0] the weight bits (4 or 8), ints[1] the span (act groups per weight scale). */
int leanlm_gemm_a8_call(const leanlm_linear_call *c, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                        int64_t K, int threads, int64_t min_parallel_bytes) {
    (void)min_parallel_bytes;
    return leanlm_gemm_a8(x, (const uint8_t *)c->tensors[0], (const float *)c->tensors[1],
                          (const float *)c->tensors[2], (const float *)c->tensors[3], y, M, N, K, (int)c->ints[0],
                          c->ints[1], threads);
}
