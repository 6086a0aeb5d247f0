/* Every decoder layer of a Llama-family model for up to 64 decode tokens (one per request), in one native call, with
 * float32 activations on x86-64 CPUs with AVX2 and FMA (the `avx2` level): decode_layers.c's loop for CPUs without
 * AVX512. At batch 1 a SmolLM2 step on PyTorch spends about 26 ms in per-op overhead (some 40 small ops a layer) on
 * a Zen 3, against about 7 ms in its matrix products; here the layer loop, RMSNorm, rotary, the K/V write, paged
 * attention over a float32 cache, SiLU-and-multiply and the residual adds run in C, and the products call each
 * linear's own kernel (linear_call.h, the float32 entries of gemv_quant_avx2.c) through its function pointer.
 *
 * It runs dense and mixture-of-experts layers (the router, each chosen expert once over its rows on its own GEMV,
 * an ungated shared expert) over a float32 KV cache, or an int8 one (a float32 scale per token and KV head, as
 * kv_quant.py: a quarter of the bytes attention reads), where every key is read (no sliding window or sinks):
 * cpu_decode.py only builds it for such models, and it returns -32 for anything else rather than guess.
 * Numerics follow the PyTorch path's float32 ops (RMSNorm as x * rsqrt(mean(x^2) + eps) * w, rotate-half rotary
 * with separate products and sums, softmax(q k^T * scale) v); sums run in another order, so results agree to fp32
 * rounding, not bit for bit. */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h"
#include "decode_model.h"

#define MAX_ROWS 64 /* decode tokens per call (linears past their kernels' rows run in several calls: run_linear) */

/* The float32 form of linear_call.h's entry (same ABI: pointers and integers). */
typedef int (*f32_linear_fn)(const leanlm_linear_call *call, const float *x, float *y, int64_t M, int64_t N,
                             int64_t K, int threads, int64_t min_parallel_bytes);


/* Dot product of n floats (n a multiple of 8, as every head dim the loop takes is). */
ALWAYS_INLINE float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum(_mm256_add_ps(s0, s1));
}

/* y [M, N] = x [M, K] W^T + b with the linear's few-row call, in calls of at most m->max_few_rows rows (each call
 * reads the weight once: a MoE expert's few rows take one, a 32-row attention product two); permuted: [M, K]
 * scratch for an act-order input. */
static int run_linear(const decode_model *m, const decode_linear *l, const float *x, float *y, int64_t M, int threads,
                      float *permuted) {
    const int64_t K = l->in_features, N = l->out_features;
    if (l->perm != NULL) {
        for (int64_t t = 0; t < M; t++)
            for (int64_t j = 0; j < K; j++) permuted[t * K + j] = x[t * K + l->perm[j]];
        x = permuted;
    }
    const leanlm_linear_call *call = &l->few_rows;
    if (call->fn == NULL) return -11;
    const int64_t step = m->max_few_rows > 0 ? m->max_few_rows : M;
    for (int64_t r = 0; r < M; r += step) {
        const int rc = ((f32_linear_fn)call->fn)(call, x + r * K, y + r * N, M - r < step ? M - r : step, N, K, threads,
                                                 m->min_parallel_bytes);
        if (rc) return rc;
    }
    return 0;
}

/* y = w * (x * rsqrt(mean(x^2) + eps)) per row, as the PyTorch path's float32 RMSNorm. */
static void rms_norm_rows(const float *x, const float *w, float *y, int64_t M, int64_t n, double eps) {
    for (int64_t t = 0; t < M; t++) {
        const float *xr = x + t * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)n + (float)eps);
        for (int64_t i = 0; i < n; i++) y[t * n + i] = w[i] * (xr[i] * r);
    }
}

/* Rotate-half RoPE of num_heads heads [D] in place: (x1 c - x2 s, x2 c + x1 s). */
static void rotary(float *heads, int64_t num_heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x = heads + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* gate = silu(gate) * up, silu(g) = g / (1 + exp(-g)). */
static void silu_mul(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp256_ps(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* One head's row x [D] (D a multiple of 8) into an int8 cache row with its scale, as kv_quant.quantize_kv: scale =
 * absmax / 127 (at least FLT_MIN), codes = x / scale (a true division) rounded half to even, saturated. */
static void store_int8_row(const float *x, int8_t *codes, float *scale, int64_t D) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float s = hmax(m) / 127.0f;
    if (s < FLT_MIN) s = FLT_MIN;
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, nlim), lim));
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packs_epi16(q16, q16));
    }
    *scale = s;
}

/* Token t's K and V [Hkv, D] into its slot (block * block_size + offset) of a cache [N, Hkv, bs, D]: float32, or
 * int8 with a float32 scale per (slot, head) [N, Hkv, bs] where the layer has scales. */
static void store_kv(const decode_model *m, const decode_layer *layer, const float *k, const float *v, int64_t slot) {
    const int64_t block = slot / m->block_size, offset = slot % m->block_size, D = m->head_dim;
    for (int64_t h = 0; h < m->num_kv_heads; h++) {
        const int64_t row = (block * m->num_kv_heads + h) * m->block_size + offset;
        if (layer->k_scales != NULL) {
            store_int8_row(k + h * D, (int8_t *)layer->k_cache + row * D, layer->k_scales + row, D);
            store_int8_row(v + h * D, (int8_t *)layer->v_cache + row * D, layer->v_scales + row, D);
        } else {
            memcpy((float *)layer->k_cache + row * D, k + h * D, (size_t)D * sizeof(float));
            memcpy((float *)layer->v_cache + row * D, v + h * D, (size_t)D * sizeof(float));
        }
    }
}

/* 8 int8 codes as floats. */
ALWAYS_INLINE __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 8 sums of a[0..7]'s lanes, in order: a transposing add tree (7 adds for 8 sums, not 8 horizontal sums). */
ALWAYS_INLINE __m256 hsum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [0123 low halves | 0123 high] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 values of a cache row at element `at`: float32, or int8 codes widened (I8, compile-time). */
ALWAYS_INLINE __m256 cache8(const void *rows, int64_t at, const int I8) {
    return I8 ? load8_i8((const int8_t *)rows + at) : _mm256_loadu_ps((const float *)rows + at);
}

/* out[i] = (q . k[i]) * scale for n rows of k [n, D] (D a multiple of 8), times ks[i] for int8 rows: 8 rows at a
 * time, q's slice of 8 read once per slice for all 8 rows. */
ALWAYS_INLINE void qk_rows(const float *q, const void *k, const float *ks, int64_t n, int64_t D, float scale,
                           float *out, const int I8) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
            const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qc, cache8(k, (i + r) * D + c, I8), acc[r]);
        }
        __m256 sums = hsum8(acc);
        if (I8) sums = _mm256_mul_ps(sums, _mm256_loadu_ps(ks + i));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sums, sv));
    }
    for (; i < n; i++) {
        if (!I8) {
            out[i] = dot(q, (const float *)k + i * D, D) * scale;
            continue;
        }
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), cache8(k, i * D + c, 1), acc);
        out[i] = hsum(acc) * ks[i] * scale;
    }
}

/* softmax in place over L scores; returns 1 / the sum of the exponentials (the caller scales by it). */
static float softmax_unnormalized(float *scores, int64_t L) {
    float best = -INFINITY;
    for (int64_t j = 0; j < L; j++)
        if (scores[j] > best) best = scores[j];
    __m256 sum = _mm256_setzero_ps();
    const __m256 top = _mm256_set1_ps(best);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
        const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top));
        _mm256_storeu_ps(scores + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; j < L; j++) total += (scores[j] = expf(scores[j] - best));
    return 1.0f / total;
}

/* out [D] = sum_j p[j] * inv * v_j over the first L values (paged: block after block, [bs, D] rows in each); an
 * int8 cache's rows (I8) are codes times their scale, the scale folded into the weight. */
ALWAYS_INLINE void weigh_values_of(const decode_model *m, const decode_layer *layer, const int64_t *blocks, int64_t L,
                                   int64_t kv_head, const float *p, float inv, float *out, const int I8) {
    const int64_t D = m->head_dim, bs = m->block_size, Hkv = m->num_kv_heads;
    const void *vc = layer->v_cache;
    const float *vs = layer->v_scales;
    if (D == 64) { /* the usual head: the output in 8 registers, not loaded and stored per key */
        __m256 acc[8];
        for (int d = 0; d < 8; d++) acc[d] = _mm256_setzero_ps();
        for (int64_t b = 0; b * bs < L; b++) {
            const int64_t row0 = (blocks[b] * Hkv + kv_head) * bs, n = L - b * bs < bs ? L - b * bs : bs;
            for (int64_t o = 0; o < n; o++) {
                const __m256 w = _mm256_set1_ps(I8 ? p[b * bs + o] * inv * vs[row0 + o] : p[b * bs + o] * inv);
                for (int d = 0; d < 8; d++) acc[d] = _mm256_fmadd_ps(w, cache8(vc, (row0 + o) * D + 8 * d, I8), acc[d]);
            }
        }
        for (int d = 0; d < 8; d++) _mm256_storeu_ps(out + 8 * d, acc[d]);
        return;
    }
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_setzero_ps());
    for (int64_t b = 0; b * bs < L; b++) {
        const int64_t row0 = (blocks[b] * Hkv + kv_head) * bs, n = L - b * bs < bs ? L - b * bs : bs;
        for (int64_t o = 0; o < n; o++) {
            const int64_t row = row0 + o;
            const __m256 w = _mm256_set1_ps(I8 ? p[b * bs + o] * inv * vs[row] : p[b * bs + o] * inv);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(out + d, _mm256_fmadd_ps(w, cache8(vc, row * D + d, I8), _mm256_loadu_ps(out + d)));
        }
    }
}

static void weigh_values(const decode_model *m, const decode_layer *layer, const int64_t *blocks, int64_t L,
                         int64_t kv_head, const float *p, float inv, float *out) {
    if (layer->v_scales != NULL) weigh_values_of(m, layer, blocks, L, kv_head, p, inv, out, 1);
    else weigh_values_of(m, layer, blocks, L, kv_head, p, inv, out, 0);
}

/* The G query heads of one token that share KV head kv_head, over its first L keys (paged): out [G, D] =
 * softmax(q k^T * scale) v per head. A block's keys are read for all G heads while in L1, and walked block by block
 * (no division per key). scores: [G, L]. */
static void attend_group(const decode_model *m, const decode_layer *layer, const float *q, const int64_t *blocks,
                         int64_t L, int64_t kv_head, int64_t G, float *out, float *scores) {
    const int64_t D = m->head_dim, bs = m->block_size, Hkv = m->num_kv_heads;
    for (int64_t b = 0; b * bs < L; b++) {
        const int64_t row0 = (blocks[b] * Hkv + kv_head) * bs, n = L - b * bs < bs ? L - b * bs : bs;
        for (int64_t g = 0; g < G; g++) {
            float *out = scores + g * L + b * bs;
            if (layer->k_scales != NULL)
                qk_rows(q + g * D, (const int8_t *)layer->k_cache + row0 * D, layer->k_scales + row0, n, D,
                        (float)m->scale, out, 1);
            else
                qk_rows(q + g * D, (const float *)layer->k_cache + row0 * D, NULL, n, D, (float)m->scale, out, 0);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = softmax_unnormalized(scores + g * L, L);
        weigh_values(m, layer, blocks, L, kv_head, scores + g * L, inv, out + g * D);
    }
}

/* Every (token, KV head) pair with its query heads, split over threads when there is enough of it (a parallel
 * region costs microseconds). */
static int attention(const decode_model *m, const decode_layer *layer, const float *q, const int64_t *block_tables,
                     const int64_t *seq_lens, int64_t max_blocks, int64_t max_seq_len, float *attn, int64_t M,
                     int threads) {
    const int64_t H = m->num_heads, Hkv = m->num_kv_heads, group = H / Hkv, D = m->head_dim;
    int64_t work = 0;
    for (int64_t t = 0; t < M; t++) work += seq_lens[t];
    const int team = work * H * D >= 65536 && threads > 1 ? threads : 1;
    const size_t per_thread = (size_t)group * (size_t)(max_seq_len > 0 ? max_seq_len : 1);
    float *scores = malloc((size_t)team * per_thread * sizeof(float));
    if (scores == NULL) return -31;
    for (int64_t t = 0; t < M; t++)
        if (seq_lens[t] < 1 || seq_lens[t] > max_seq_len || seq_lens[t] > max_blocks * m->block_size) {
            free(scores);
            return -21;
        }
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t p = 0; p < M * Hkv; p++) {
        const int64_t t = p / Hkv, kvh = p % Hkv;
        float *mine = scores + (size_t)omp_get_thread_num() * per_thread;
        const int64_t first = t * H + kvh * group; /* query heads kvh * group .. + group - 1 of token t */
        attend_group(m, layer, q + first * D, block_tables + t * max_blocks, seq_lens[t], kvh, group,
                     attn + first * D, mine);
    }
    free(scores);
    return 0;
}

/* ---------------------------------------------------------------- mixture of experts
 * As decode_layers.c's, in float32: the routing is route()'s in moe.py (logits x W^T in fp32, softmax in fp32, the k
 * largest probabilities, weighted by the scoring), and each expert's weighted rows are added to a zeroed sum in
 * ascending expert order, as the PyTorch dispatch's index_add_ does. Sums run in another order than torch's, so the
 * two paths agree to fp32 rounding, not bit for bit. */

/* Top-k experts and weights of M rows h [M, hidden] under a float32 router [E, hidden]: experts [M, k] in ascending
 * index order with their weights [M, k] (scoring 0: the probability; 1: renormalised over the k; 2: one). Ties go to
 * the lower index. Returns 0, or -30 for more than MOE_MAX_EXPERTS experts or k outside [1, E]. */
int leanlm_moe_route_f32(const float *h, const float *router, int64_t M, int64_t hidden, int64_t E, int64_t k,
                         int64_t scoring, int64_t *experts, float *weights) {
    if (E > MOE_MAX_EXPERTS || k > E || k < 1 || hidden % 8 != 0) return -30;
    float p[MOE_MAX_EXPERTS];
    unsigned char taken[MOE_MAX_EXPERTS];
    for (int64_t t = 0; t < M; t++) {
        const float *x = h + t * hidden;
        for (int64_t e = 0; e < E; e++) p[e] = dot(x, router + e * hidden, hidden);
        moe_pick(p, taken, E, k, scoring, experts + t * k, weights + t * k);
    }
    return 0;
}

/* y [n, hidden] = one SwiGLU MLP (gate, up, down) of rows x [n, hidden]; gate, up: [n, I] scratch. */
static int run_mlp(const decode_model *m, const decode_linear *mlp, const float *x, float *y, int64_t n, float *gate,
                   float *up, float *permuted, int threads) {
    int rc;
    if ((rc = run_linear(m, mlp + 0, x, gate, n, threads, permuted)) ||
        (rc = run_linear(m, mlp + 1, x, up, n, threads, permuted)))
        return rc;
    silu_mul(gate, up, n * mlp[0].out_features);
    return run_linear(m, mlp + 2, gate, y, n, threads, permuted);
}

/* The grouped product over experts: rows [A, hidden] sorted by expert (expert e's at [offs[e], offs[e + 1])), each
 * used expert's SwiGLU MLP (experts [E * 3]: gate, up, down) once over its rows into y [A, hidden]; gate, up
 * [A, intermediate] and permuted [A, max(hidden, intermediate)] scratch at the same places. The experts run side by
 * side on the threads (a small expert's GEMV is too short to split). Returns 0 or -32 when a kernel failed. */
static int run_experts(const decode_model *m, const decode_linear *experts, const int64_t *used, int64_t num_used,
                       const int64_t *offs, const float *rows, float *y, float *gate, float *up, float *permuted,
                       int threads) {
    const int64_t hid = m->hidden, I = m->intermediate, K = hid > I ? hid : I;
    const int outer = num_used < threads ? (int)num_used : threads, inner = threads / (outer ? outer : 1);
    int failed = 0;
#pragma omp parallel for num_threads(outer) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t u = 0; u < num_used; u++) {
        const int64_t e = used[u], base = offs[e], n = offs[e + 1] - base;
        failed |= run_mlp(m, experts + 3 * e, rows + base * hid, y + base * hid, n, gate + base * I, up + base * I,
                          permuted + base * K, inner) != 0;
    }
    return failed ? -32 : 0;
}

/* The PyTorch path's grouped dispatch on float32 CPU rows (moe.py, GroupedExperts), one call for every expert of a
 * layer, as llama.cpp's mul_mat_id: rows x [A, hidden] sorted by expert with per-expert offsets [E + 1], y [A, hidden]
 * each row through its expert's SwiGLU MLP on the expert's own few-row kernels (experts [E * 3]: gate, up, down; at
 * most the kernels' row limit per expert: the caller checks). Returns 0, -31 when memory runs out, -32 when a kernel
 * failed, -30 for more than MOE_MAX_EXPERTS experts. */
int leanlm_moe_experts_f32(const decode_linear *experts, int64_t E, const float *x, const int64_t *offsets, float *y,
                           int64_t hidden, int64_t intermediate, int64_t min_parallel_bytes, int threads) {
    if (E < 1 || E > MOE_MAX_EXPERTS) return -30;
    int64_t used[MOE_MAX_EXPERTS], num_used = 0;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) used[num_used++] = e;
    const int64_t A = offsets[E], K = hidden > intermediate ? hidden : intermediate;
    float *work = malloc((size_t)(A ? A : 1) * (size_t)(2 * intermediate + K) * sizeof(float));
    if (work == NULL) return -31;
    decode_model m;
    memset(&m, 0, sizeof(m));
    m.hidden = hidden, m.intermediate = intermediate, m.min_parallel_bytes = min_parallel_bytes;
    const int rc = run_experts(&m, experts, used, num_used, offsets, x, y, work, work + A * intermediate,
                               work + 2 * A * intermediate, threads);
    free(work);
    return rc;
}

/* Work space of the MoE layers for M rows of top-k, allocated once per call: each expert's rows, outputs and
 * intermediates at its place in the assignments grouped by expert, so experts can run side by side. */
typedef struct {
    int64_t *experts, *members; /* [M * k]: routed experts; assignment indices grouped by expert */
    float *weights;             /* [M * k] */
    float *rows, *y;            /* [M * k, hidden] */
    float *gate, *up;           /* [M * k, intermediate] */
    float *permuted;            /* [M * k, max(hidden, intermediate)] */
} moe_work;

/* out [M, hidden] = the MoE MLP of normed rows h [M, hidden]. Each chosen expert runs once over its rows (the grouped
 * product: rows sorted by expert, per-expert offsets), the experts side by side on the threads (a small expert's
 * GEMV is too short to split); then the weighted rows go to each token in ascending expert order. */
static int moe_mlp(const decode_model *m, const decode_moe *moe, const float *h, float *out, int64_t M,
                   const moe_work *w, int threads) {
    const int64_t hid = m->hidden, k = moe->top_k, E = moe->num_experts;
    int rc = leanlm_moe_route_f32(h, (const float *)moe->router, M, hid, E, k, moe->scoring, w->experts, w->weights);
    if (rc) return rc;
    int64_t offs[MOE_MAX_EXPERTS + 1], used[MOE_MAX_EXPERTS], fill[MOE_MAX_EXPERTS], num_used = 0;
    memset(offs, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < M * k; a++) offs[w->experts[a] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        if (offs[e + 1]) used[num_used++] = e;
        moe->counts[e] += offs[e + 1];
        offs[e + 1] += offs[e];
    }
    moe->counts[E] += M;
    moe->counts[E + 1] += num_used;
    memcpy(fill, offs, (size_t)E * sizeof(int64_t));
    for (int64_t a = 0; a < M * k; a++) w->members[fill[w->experts[a]]++] = a; /* stable: tokens in order */
    for (int64_t a = 0; a < M * k; a++) memcpy(w->rows + a * hid, h + (w->members[a] / k) * hid, (size_t)hid * sizeof(float));
    if ((rc = run_experts(m, moe->experts, used, num_used, offs, w->rows, w->y, w->gate, w->up, w->permuted, threads)))
        return rc;
    memset(out, 0, (size_t)(M * hid) * sizeof(float));
    for (int64_t u = 0; u < num_used; u++) {
        const int64_t e = used[u];
        for (int64_t i = offs[e]; i < offs[e + 1]; i++) {
            float *o = out + (w->members[i] / k) * hid;
            const float *yi = w->y + i * hid;
            const __m256 wt = _mm256_set1_ps(w->weights[w->members[i]]);
            for (int64_t c = 0; c < hid; c += 8)
                _mm256_storeu_ps(o + c, _mm256_add_ps(_mm256_loadu_ps(o + c), _mm256_mul_ps(_mm256_loadu_ps(yi + c), wt)));
        }
    }
    if (moe->shared != NULL) {
        if ((rc = run_mlp(m, moe->shared, h, w->y, M, w->gate, w->up, w->permuted, threads))) return rc;
        add_rows(out, w->y, M * hid);
    }
    return 0;
}

/* The MoE work space for M rows at the largest top-k of any layer (experts NULL, nothing allocated, when no layer is
 * MoE); *block is what to free. Returns 0, or -31 when memory runs out. */
static int moe_work_alloc(const decode_model *m, int64_t M, moe_work *work, void **block) {
    int64_t k = 0;
    for (int64_t li = 0; li < m->num_layers; li++)
        if (m->layers[li].moe.router != NULL && m->layers[li].moe.top_k > k) k = m->layers[li].moe.top_k;
    memset(work, 0, sizeof(*work));
    *block = NULL;
    if (!k) return 0;
    const int64_t a = M * k, hid = m->hidden, I = m->intermediate, K = hid > I ? hid : I;
    const size_t ints = (size_t)a * (2 * sizeof(int64_t) + sizeof(float));
    if ((*block = malloc(ints + (size_t)a * (2 * hid + 2 * I + K) * sizeof(float))) == NULL) return -31;
    work->experts = *block;
    work->members = work->experts + a;
    work->weights = (float *)(work->members + a);
    work->rows = (float *)((char *)*block + ints);
    work->y = work->rows + a * hid;
    work->gate = work->y + a * hid;
    work->up = work->gate + a * I;
    work->permuted = work->up + a * I;
    return 0;
}

/* M decode tokens through every layer and the final norm (see leanlm_decode_layers_f32); work: the MoE layers'. */
static int run_layers(const decode_model *m, float *x, float *out, int64_t M, const int64_t *positions,
                      const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens, int64_t max_blocks,
                      int64_t max_seq_len, float *scratch, int threads, const moe_work *work) {
    const int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, hid = m->hidden, I = m->intermediate;
    float *h = scratch;              /* [M, hidden]: normed input, then o_proj / down_proj output */
    float *q = h + M * hid;          /* [M, H, D] */
    float *k = q + M * H * D;        /* [M, Hkv, D] */
    float *v = k + M * Hkv * D;      /* [M, Hkv, D] */
    float *attn = v + M * Hkv * D;   /* [M, H, D] */
    float *gate = attn + M * H * D;  /* [M, I] */
    float *up = gate + M * I;        /* [M, I] */
    float *acc = up + M * I;         /* [M, hidden]: a MoE layer's output (only a model with MoE layers has it) */
    float *permuted = acc + (work->experts != NULL ? M * hid : 0); /* [M, K] of a permuted linear */
    for (int64_t li = 0; li < m->num_layers; li++) {
        const decode_layer *layer = m->layers + li;
        const decode_linear *lin = layer->linears;
        int rc;
        rms_norm_rows(x, (const float *)layer->input_norm, h, M, hid, m->eps);
        if ((rc = run_linear(m, lin + Q_PROJ, h, q, M, threads, permuted)) ||
            (rc = run_linear(m, lin + K_PROJ, h, k, M, threads, permuted)) ||
            (rc = run_linear(m, lin + V_PROJ, h, v, M, threads, permuted)))
            return rc;
        for (int64_t t = 0; t < M; t++) {
            const float *c = m->cos + positions[t] * (D / 2), *s = m->sin + positions[t] * (D / 2);
            rotary(q + t * H * D, H, D, c, s);
            rotary(k + t * Hkv * D, Hkv, D, c, s);
            store_kv(m, layer, k + t * Hkv * D, v + t * Hkv * D, slots[t]);
        }
        if ((rc = attention(m, layer, q, block_tables, seq_lens, max_blocks, max_seq_len, attn, M, threads)))
            return rc;
        if ((rc = run_linear(m, lin + O_PROJ, attn, h, M, threads, permuted))) return rc;
        add_rows(x, h, M * hid);
        rms_norm_rows(x, (const float *)layer->post_norm, h, M, hid, m->eps);
        if (layer->moe.router != NULL) {
            if ((rc = moe_mlp(m, &layer->moe, h, acc, M, work, threads))) return rc;
            add_rows(x, acc, M * hid);
            continue;
        }
        if ((rc = run_linear(m, lin + GATE_PROJ, h, gate, M, threads, permuted)) ||
            (rc = run_linear(m, lin + UP_PROJ, h, up, M, threads, permuted)))
            return rc;
        silu_mul(gate, up, M * I);
        if ((rc = run_linear(m, lin + DOWN_PROJ, gate, h, M, threads, permuted))) return rc;
        add_rows(x, h, M * hid);
    }
    rms_norm_rows(x, (const float *)m->final_norm, out, M, hid, m->eps);
    return 0;
}

/* M decode tokens through every layer and the final norm. x [M, hidden] float32 embeddings (overwritten with the
 * residual stream), out [M, hidden] the final-normed hidden; positions, slots, seq_lens [M]; block_tables
 * [M, max_blocks] int64. scratch: float32, M * (hidden + 2 * H * D + 2 * Hkv * D + 2 * intermediate + the widest
 * linear input, + hidden when a layer is MoE) elements; MoE layers' routing and expert rows are allocated here, once
 * per call. layer_bounds and sink_positions must be NULL (every key read). Returns 0, a negative kernel status, -20
 * for a position outside the rotary table, -21 for a bad sequence length, -30 for a router the loop cannot take,
 * -31 when memory runs out, -32 for a request this loop does not run (sliding windows or sinks). */
int leanlm_decode_layers_f32(const decode_model *m, float *x, float *out, int64_t M, const int64_t *positions,
                             const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens,
                             int64_t max_blocks, int64_t max_seq_len, float *scratch, int threads,
                             const int64_t *layer_bounds, const int64_t *sink_positions) {
    if (M < 1 || M > MAX_ROWS || layer_bounds != NULL || sink_positions != NULL || m->head_dim % 8 != 0) return -32;
    for (int64_t t = 0; t < M; t++)
        if (positions[t] < 0 || positions[t] >= m->rope_positions) return -20;
    moe_work work;
    void *block;
    int rc = moe_work_alloc(m, M, &work, &block);
    if (rc) return rc;
    rc = run_layers(m, x, out, M, positions, slots, block_tables, seq_lens, max_blocks, max_seq_len, scratch, threads,
                    &work);
    free(block);
    return rc;
}
