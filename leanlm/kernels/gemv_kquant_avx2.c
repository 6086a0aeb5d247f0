/* Few-row GEMVs over GGUF's K-quant super-blocks for x86-64 CPUs with AVX2 and FMA, int8 activations (x quantized
 * per 32 inputs as in gemv_quant_avx2.c's W4A8, numerics.quantize_act_int8's rounding), float32 in and out:
 *
 *   int4k (Q4_K): w[n, k] = q * (sd[n, s] * sc[n, g]) + md[n, s] * mc[n, g]   (g = k / 32, s = k / 256)
 *     codes two a byte as pack_int4 lays them (k even: low nibble); sc, mc uint8 [N, K / 32] (Q4_K's 6-bit scales
 *     and mins), sd, md float32 [N, K / 256] (its d and -dmin). 4.75 bits a weight, where a float32 scale and min
 *     per 32 cost 6.
 *   int6 (Q6_K): w[n, k] = (u - 32) * (d[n, s] * sc[n, k / 16])   (u 0..63, s = k / 256)
 *     ql uint8 [N, K / 2]: per 64 codes, byte b holds u[b] & 15 (low nibble) and u[32 + b] & 15 (high);
 *     qh uint8 [N, K / 4]: per 128 codes, byte b holds u[32 i + b] >> 4 at bits 2i, 2i + 1 (i = 0..3, as Q6_K);
 *     sc int8 [N, K / 16], d float32 [N, K / 256]. 6.6 bits a weight, where int8 codes and a float32 scale per
 *     16 cost 10.
 *
 * The codes are read as stored and widened in registers. Each 32-code slice's exact integer dot product with the
 * activation codes (vpmaddubsw) is converted once and scaled by the activation group's scale and the weight group's:
 * int4k expands a super-block's 8 group scales to float once (sd * sc), then as the W4A8 pair form; int6 weights
 * its 16-code halves by their integer scales in the integer step (vpmaddwd against the scales in place of ones, as
 * llama.cpp's q6_K dot product does) and applies d once per 256 codes. So the result is cpu_a8.reference on the
 * dequantized weight to fp32 rounding. Built and loaded by cpu_kquant_avx2.py; cpu_kquant_avx2.super_scales and
 * six_bit_copy make these layouts from a layer's codes and float32 scales where they factor exactly. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "gemv_avx2.h"
#include "linear_call.h"

#define SUPER 256 /* weights per super-block */

/* -------------------------------------------------------------------------------------------------- int4k */

typedef struct {
    const int8_t *xq;  /* [M, K] codes, reordered per 64 as the W4A8 pair form reads them */
    const float *sxv;  /* [M, K / 64, 8]: each pair's activation scales, 4 lanes each */
    const float *tmin; /* [M, K / 32]: activation scale * sum of codes, per 32 */
    const uint8_t *w, *sc, *mc;
    const float *sd, *md, *bias;
    float *y;
    int64_t K, N;
} int4k_args;

/* sum_g md[s] * mc[g] * T[g] over one weight row's groups: the min term, 8 groups (a super-block) per step. */
ALWAYS_INLINE float min_dot_k(const uint8_t *mc, const float *md, const float *T, int64_t S) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mc + 8 * s))));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_broadcast_ss(md + s)), _mm256_loadu_ps(T + 8 * s), acc);
    }
    return hsum(acc);
}

ALWAYS_INLINE void tile_i4k(const int4k_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    const int64_t K = a->K, G = K / 32, S = K / SUPER;
    if (m0 == 0) {
        const int64_t ahead = n0 + (PREFETCH_BYTES + K / 2 - 1) / (K / 2);
        prefetch_rows(a->w, K / 2, ahead, NB, a->N);
        prefetch_rows(a->sc, G, ahead, NB, a->N);
        prefetch_rows(a->mc, G, ahead, NB, a->N);
        prefetch_rows(a->sd, S * 4, ahead, NB, a->N);
        prefetch_rows(a->md, S * 4, ahead, NB, a->N);
    }
    __m256 tot[4][4];
    zero_tile(tot, R, NB);
    for (int64_t s = 0; s < S; s++) {
        __m256 gsc[4]; /* the super-block's 8 group scales, sd * sc, in float */
#pragma GCC unroll 4
        for (int j = 0; j < NB; j++) {
            const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(a->sc + (n0 + j) * G + 8 * s));
            gsc[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)), _mm256_broadcast_ss(a->sd + (n0 + j) * S + s));
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            const int64_t p = 4 * s + q;
            const __m256i pick = _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1);
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) {
                __m256i lo, hi;
                pair_nibbles(a->w + (n0 + j) * (K / 2), p, &lo, &hi);
                const __m256 ws = _mm256_permutevar8x32_ps(gsc[j], pick); /* lanes 0-3: group 2q, 4-7: 2q + 1 */
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) tot[r][j] = pair_row(a->xq, a->sxv, m0 + r, K, p, lo, hi, ws, tot[r][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
        const uint8_t *mc = a->mc + (n0 + j) * G;
        const float *md = a->md + (n0 + j) * S;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a->y[(m0 + r) * a->N + n0 + j] = hsum(tot[r][j]) + min_dot_k(mc, md, a->tmin + (m0 + r) * G, S) + b;
    }
}

ROW_PASSES(int4k, int4k_args, tile_i4k)

/* K a multiple of 256 (else -1). */
int leanlm_linear_int4k_a8_f32(const float *x, const uint8_t *w, const uint8_t *sc, const float *sd, const uint8_t *mc,
                               const float *md, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                               int num_threads, int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K <= 0 || K % SUPER != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t C = K / ACT_GROUP, P = K / 64;
    float *buf = scratch_buffer((size_t)(M * K / 4 + 2 * M * C + M * P * 8));
    if (buf == NULL) return -2;
    float *sx = buf, *tmin = sx + M * C, *sxv = tmin + M * C;
    int8_t *xq = (int8_t *)(sxv + M * P * 8);
    quantize_pairs(x, M, K, xq, sx, tmin, sxv);
    const int4k_args args = {xq, sxv, tmin, w, sc, mc, sd, md, bias, y, K, N};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K / 2, min_parallel_bytes);
    leanlm_row_passes(int4k_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* --------------------------------------------------------------------------------------------------- int6 */

/* A vpshufb pattern spreading int16 lane i of a 128-bit half over the low lane and lane i + 1 over the high one. */
ALWAYS_INLINE __m256i pick16(int i) {
    const short lo = (short)((2 * i + 1) << 8 | 2 * i), hi = (short)((2 * i + 3) << 8 | (2 * i + 2));
    return _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo));
}

typedef struct {
    const int8_t *xq;    /* [M, K] codes in their own order */
    const int16_t *x32;  /* [M, K / 2]: 32 * (x[2i] + x[2i + 1]), what vpmaddubsw of 32 and x gives */
    const float *sx;     /* [M, K / 32] */
    const uint8_t *ql, *qh;
    const int8_t *sc;
    const float *d, *bias;
    float *y;
    int64_t K, N;
} int6_args;

/* The 32 codes u (0..63) of slice t (0..3) of 128: the low nibbles from ql (low nibble: slices 0, 2; high: 1, 3),
 * the high bits from qh's bit pair t moved to bits 4-5. */
ALWAYS_INLINE __m256i six_bits(__m256i ql, __m256i qh, const int t) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i low = _mm256_and_si256(t % 2 ? _mm256_srli_epi16(ql, 4) : ql, nibble);
    const __m256i high = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2) : t == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, top));
}

ALWAYS_INLINE void tile_i6(const int6_args *a, int64_t m0, int64_t n0, const int R, const int NB) {
    const int64_t K = a->K, S = K / SUPER, C = K / ACT_GROUP;
    if (m0 == 0) {
        const int64_t ahead = n0 + (PREFETCH_BYTES + K / 2 - 1) / (K / 2);
        prefetch_rows(a->ql, K / 2, ahead, NB, a->N);
        prefetch_rows(a->qh, K / 4, ahead, NB, a->N);
        prefetch_rows(a->sc, K / 16, ahead, NB, a->N);
        prefetch_rows(a->d, S * 4, ahead, NB, a->N);
    }
    __m256 tot[4][4];
    zero_tile(tot, R, NB);
    for (int64_t s = 0; s < S; s++) {
        __m256 acc[4][4];
        zero_tile(acc, R, NB);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* 128 codes: ql 64 bytes, qh 32 */
            const int64_t k0 = SUPER * s + 128 * h;
            __m256i scv[4]; /* the half's 8 sub-block scales as int16, in both lanes */
#pragma GCC unroll 4
            for (int j = 0; j < NB; j++) {
                const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(a->sc + (n0 + j) * (K / 16) + k0 / 16));
                scv[j] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8));
            }
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) { /* slice t: codes k0 + 32 t .. + 31, one activation group */
                const int64_t k = k0 + 32 * t;
#pragma GCC unroll 4
                for (int j = 0; j < NB; j++) {
                    const __m256i ql = _mm256_loadu_si256((const __m256i *)(a->ql + (n0 + j) * (K / 2) + k0 / 2 + 32 * (t / 2)));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(a->qh + (n0 + j) * (K / 4) + k0 / 4));
                    const __m256i u = six_bits(ql, qh, t);
                    const __m256i c = _mm256_shuffle_epi8(scv[j], pick16(2 * t)); /* the slice's two sub-blocks */
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) { /* x from L1, not held in registers (see pair_row) */
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->xq + (m0 + r) * K + k));
                        const __m256i xc = _mm256_loadu_si256((const __m256i *)(a->x32 + (m0 + r) * (K / 2) + k / 2));
                        const __m256 sxv = _mm256_broadcast_ss(a->sx + (m0 + r) * C + k / ACT_GROUP);
                        /* sum (u - 32) x = u . x - 32 . x: int16 lanes within +-2 * 32 * 127; times a scale of at
                         * most 128 and summed in pairs: int32 */
                        const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(u, xv), xc);
                        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, c));
                        acc[r][j] = _mm256_fmadd_ps(f, sxv, acc[r][j]);
                    }
                }
            }
        }
        scale_into(tot, acc, a->d, n0, S, s, R, NB);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; j++) {
        const float b = a->bias ? a->bias[n0 + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) a->y[(m0 + r) * a->N + n0 + j] = hsum(tot[r][j]) + b;
    }
}

ROW_PASSES(int6, int6_args, tile_i6)

/* K a multiple of 256 (else -1). */
int leanlm_linear_int6_a8_f32(const float *x, const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *d,
                              const float *bias, float *y, int64_t M, int64_t N, int64_t K, int num_threads,
                              int64_t min_parallel_bytes) {
    if (M < 0 || N < 0 || K <= 0 || K % SUPER != 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t C = K / ACT_GROUP;
    float *buf = scratch_buffer((size_t)(2 * M * C + M * K / 4 + M * K / 2));
    if (buf == NULL) return -2;
    float *sx = buf, *tsum = sx + M * C;
    int16_t *x32 = (int16_t *)(tsum + M * C);
    int8_t *xq = (int8_t *)(x32 + M * K / 2);
    for (int64_t i = 0; i < M; i++) {
        quantize_row(x + i * K, K, 0, xq + i * K, sx + i * C, tsum + i * C);
        for (int64_t k = 0; k < K; k += 2) x32[i * (K / 2) + k / 2] = (int16_t)(32 * (xq[i * K + k] + xq[i * K + k + 1]));
    }
    const int6_args args = {xq, x32, sx, ql, qh, sc, d, bias, y, K, N};
    const int threads = leanlm_pass_threads(num_threads, N, BLOCK_N, N * K * 3 / 4, min_parallel_bytes);
    leanlm_row_passes(int6_pass, &args, M, N, BLOCK_N, threads);
    return 0;
}

/* ---------------------------------------------------------------------------- the decode loop's entries
 * linear_call.h's uniform entry with float32 x and y: int4k tensors (codes, sc, sd, mc, md, bias); int6 tensors
 * (ql, qh, sc, d, bias). */

int leanlm_linear_int4k_a8_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N,
                                    int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int4k_a8_f32(x, (const uint8_t *)c->tensors[0], (const uint8_t *)c->tensors[1],
                                      (const float *)c->tensors[2], (const uint8_t *)c->tensors[3],
                                      (const float *)c->tensors[4], (const float *)c->tensors[5], y, M, N, K, threads,
                                      min_parallel_bytes);
}

int leanlm_linear_int6_a8_f32_call(const leanlm_linear_call *c, const float *x, float *y, int64_t M, int64_t N,
                                   int64_t K, int threads, int64_t min_parallel_bytes) {
    return leanlm_linear_int6_a8_f32(x, (const uint8_t *)c->tensors[0], (const uint8_t *)c->tensors[1],
                                     (const int8_t *)c->tensors[2], (const float *)c->tensors[3],
                                     (const float *)c->tensors[4], y, M, N, K, threads, min_parallel_bytes);
}
