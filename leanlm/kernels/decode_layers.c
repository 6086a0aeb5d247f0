/* Every decoder layer of a Llama-family model for a batch of decode tokens (one per request), in one native call.
 *
 * At batch 1 a SmolLM2 decode step spends about as long in PyTorch's per-op overhead (some 40 small ops per
 * layer: norms, rotary, residual adds, views, cache writes) as in its matrix products. Here the layer loop
 * runs in C: RMSNorm, rotary, the K/V write, residual adds and SiLU-and-multiply are a few microseconds of
 * scalar code, and the products and attention call the existing kernels through function pointers (their
 * libraries are loaded by Python; this file links against none of them).
 *
 * Numerics equal the PyTorch path's bit for bit: rotary and residual adds round to bfloat16 after each op
 * as torch's bf16 ops do (a product of two bf16 values is exact in fp32), the products and attention are
 * the same kernels, and that path runs few-row RMSNorm and SiLU-and-multiply on the exported functions
 * below (torch's own reductions and exp sum and round in another order).
 *
 * Each linear brings its own kernels as calls (linear_call.h): its few-row GEMV below min_gemm_rows rows, its
 * packed GEMM from there on, as the PyTorch path's layers choose; this loop knows no weight format. The element-wise work is 16-lane AVX512 and, for many
 * rows, split by rows over OpenMP threads: each row's result is the same whatever the batch or thread count. */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp512.h"
#include "decode_model.h"
#include "linear_call.h"


/* y [M, N] = x [M, K] W^T + b; permuted: [M, K] scratch for the gathered input. */
static int run_linear(const decode_model *m, const decode_linear *l, const uint16_t *x, uint16_t *y, int64_t M,
                      int threads, uint16_t *permuted) {
    if (l->perm != NULL) {
        const int64_t K = l->in_features;
        for (int64_t t = 0; t < M; t++)
            for (int64_t j = 0; j < K; j++) permuted[t * K + j] = x[t * K + l->perm[j]];
        x = permuted;
    }
    const leanlm_linear_call *call = M >= m->min_gemm_rows ? &l->many_rows : &l->few_rows;
    if (call->fn == NULL) return -11;
    return call->fn(call, x, y, M, l->out_features, l->in_features, threads, m->min_parallel_bytes);
}

/* ---------------------------------------------------------------- 16-lane helpers (AVX512F; exact)
 * Every rounding below is f32_to_bf16's (nearest-even, NaN kept quiet) done on 16 lanes with integer ops, so
 * a vector lane and a scalar gives the same bits; vcvtneps2bf16 would flush denormals, torch does not. */

ALWAYS_INLINE __m512 load16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

ALWAYS_INLINE __m512 round16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(f32x16_to_bf16_bits(f), 16));
}

ALWAYS_INLINE void store16(uint16_t *p, __m512 f, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(f32x16_to_bf16_bits(f)));
}

ALWAYS_INLINE __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* Rows per OpenMP thread below which the element-wise loops stay on one thread (a parallel region costs a
 * few microseconds; a 576-wide row of RMSNorm about one). */
#define ROWS_PER_THREAD 8

ALWAYS_INLINE int row_threads(int64_t rows, int threads) {
    const int64_t most = rows / ROWS_PER_THREAD;
    return most < 1 ? 1 : most < threads ? (int)most : threads;
}

/* y = bf16(x * rsqrt(mean(x^2) + eps) * w) per row, in fp32: the sum of squares in 16 lanes (in index order
 * within a lane), then lanes added in _mm512_reduce_add_ps's fixed order. */
static void rms_norm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = load16(x + i, tail16(n - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail16(n - i);
        store16(y + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i, m), r), load16(w + i, m)), m);
    }
}

/* RMSNorm of M bf16 rows [M, n] by a bf16 weight [n] (exported: the PyTorch path's RMSNorm on bf16 CPU rows). */
void leanlm_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t n, double eps,
                          int threads) {
#pragma omp parallel for num_threads(row_threads(M, threads)) schedule(static)
    for (int64_t t = 0; t < M; t++) rms_norm_row(x + t * n, w, y + t * n, n, (float)eps);
}

/* Rotate-half RoPE in place on heads [num_heads, D] of one token, with cos/sin rounded to bf16 first (the
 * PyTorch path casts the table to the model dtype) and every op rounded to bf16 as torch's bf16 ops are. */
static void rotary(uint16_t *heads, int64_t num_heads, int64_t head_dim, const float *cos_row, const float *sin_row) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail16(half - i);
        const __m512 c = round16(_mm512_maskz_loadu_ps(m, cos_row + i)), s = round16(_mm512_maskz_loadu_ps(m, sin_row + i));
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *v = heads + h * head_dim + i;
            const __m512 x1 = load16(v, m), x2 = load16(v + half, m);
            store16(v, _mm512_sub_ps(round16(_mm512_mul_ps(x1, c)), round16(_mm512_mul_ps(x2, s))), m);
            store16(v + half, _mm512_add_ps(round16(_mm512_mul_ps(x2, c)), round16(_mm512_mul_ps(x1, s))), m);
        }
    }
}

/* x += y, both bf16, one rounding per element (torch's bf16 add). */
static void add_residual(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail16(n - i);
        store16(x + i, _mm512_add_ps(load16(x + i, m), load16(y + i, m)), m);
    }
}

/* x += y over M rows of n. */
static void add_rows(uint16_t *x, const uint16_t *y, int64_t M, int64_t n, int threads) {
#pragma omp parallel for num_threads(row_threads(M, threads)) schedule(static)
    for (int64_t t = 0; t < M; t++) add_residual(x + t * n, y + t * n, n);
}

/* out = bf16(bf16(silu(gate)) * up) for n elements, silu(g) = g / (1 + e^-g) with exp512_ps; out may be gate.
 * Exported: the PyTorch path's SiLU-and-multiply on bf16 CPU rows. */
void leanlm_silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n, int threads) {
    const int64_t chunks = (n + 15) / 16;
#pragma omp parallel for num_threads(row_threads(chunks / 64, threads)) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i = c * 16;
        const __mmask16 m = tail16(n - i);
        const __m512 g = load16(gate + i, m);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(out + i, _mm512_mul_ps(round16(silu), load16(up + i, m)), m);
    }
}

/* Argmax of bf16 values through unsigned 16-bit keys in the values' order: -0 read as +0, negatives (sign set) to
 * ~h, the rest to h | 0x8000, every NaN to 0xffff (above +inf: torch.argmax takes a NaN as the largest). */
ALWAYS_INLINE uint16_t order_key(uint16_t h) {
    if (h == 0x8000u) h = 0;
    if ((h & 0x7fffu) > 0x7f80u) return 0xffffu;
    return (h & 0x8000u) ? (uint16_t)~h : (uint16_t)(h | 0x8000u);
}

ALWAYS_INLINE __m512i order_keys32(__m512i h) {
    h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(h, _mm512_set1_epi16((short)0x8000)), _mm512_setzero_si512());
    const __mmask32 negative = _mm512_movepi16_mask(h);
    __m512i key = _mm512_mask_mov_epi16(_mm512_or_si512(h, _mm512_set1_epi16((short)0x8000)), negative,
                                        _mm512_xor_si512(h, _mm512_set1_epi16(-1)));
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(h, _mm512_set1_epi16(0x7fff)),
                                                  _mm512_set1_epi16(0x7f80));
    return _mm512_mask_mov_epi16(key, nan, _mm512_set1_epi16(-1));
}

static int64_t argmax_row(const uint16_t *x, int64_t n) {
    __m512i best = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) best = _mm512_max_epu16(best, order_keys32(_mm512_loadu_si512((const void *)(x + i))));
    uint16_t lanes[32], top = 0;
    _mm512_storeu_si512((void *)lanes, best);
    for (int l = 0; l < 32; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; i < n; i++) top = order_key(x[i]) > top ? order_key(x[i]) : top;
    const __m512i vtop = _mm512_set1_epi16((short)top);
    for (i = 0; i + 32 <= n; i += 32) {
        const __mmask32 hit = _mm512_cmpeq_epi16_mask(order_keys32(_mm512_loadu_si512((const void *)(x + i))), vtop);
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (order_key(x[i]) == top) return i;
    return 0; /* n == 0 */
}

/* out[t] = the index of the largest value of bf16 row t of x [M, n], the first on ties, as torch.argmax gives
 * it (which, on bf16 CPU tensors, runs 5x slower than on float32: 10 ms for 128 x 49152). Exported for the
 * sampler's greedy rows. */
void leanlm_argmax_bf16(const uint16_t *x, int64_t *out, int64_t M, int64_t n, int threads) {
#pragma omp parallel for num_threads(row_threads(M, threads)) schedule(static)
    for (int64_t t = 0; t < M; t++) out[t] = argmax_row(x + t * n, n);
}

/* One head's row x [D] into an int8 cache row with its scale, as kv_quant.quantize_kv: scale = absmax / 127
 * (at least FLT_MIN), codes round half to even and saturate. */
static void store_int8_row(const uint16_t *x, int8_t *codes, float *scale, int64_t D) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < D; i++) absmax = fmaxf(absmax, fabsf(bf16_to_f32(x[i])));
    float s = absmax / 127.0f;
    if (s < FLT_MIN) s = FLT_MIN;
    for (int64_t i = 0; i < D; i++) {
        const float q = rintf(bf16_to_f32(x[i]) / s);
        codes[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
    *scale = s;
}

/* Token t's K and V [Hkv, D] into its cache slot (block * block_size + offset) of every KV head. */
static void store_kv(const decode_model *m, const decode_layer *layer, const uint16_t *k, const uint16_t *v,
                     int64_t slot) {
    const int64_t block = slot / m->block_size, offset = slot % m->block_size, D = m->head_dim;
    for (int64_t h = 0; h < m->num_kv_heads; h++) {
        const int64_t row = (block * m->num_kv_heads + h) * m->block_size + offset;
        if (layer->k_scales != NULL) {
            store_int8_row(k + h * D, (int8_t *)layer->k_cache + row * D, layer->k_scales + row, D);
            store_int8_row(v + h * D, (int8_t *)layer->v_cache + row * D, layer->v_scales + row, D);
        } else {
            memcpy((uint16_t *)layer->k_cache + row * D, k + h * D, (size_t)D * sizeof(uint16_t));
            memcpy((uint16_t *)layer->v_cache + row * D, v + h * D, (size_t)D * sizeof(uint16_t));
        }
    }
}

/* ---------------------------------------------------------------- mixture of experts
 * The PyTorch path routes bf16 CPU rows with leanlm_moe_route_bf16 too, and its grouped dispatch sums the same way
 * (each expert's rows weighted in fp32, rounded, then added to the token's bf16 sum in ascending expert order), so
 * both paths agree bit for bit. */


/* Top-k experts and weights of M bf16 rows h [M, hidden] under a bf16 router [E, hidden]: logits are fp32 dot
 * products rounded to bf16 (a bf16 linear's output), softmax in fp32; experts [M, k] in ascending index order with
 * their weights [M, k] (scoring 0: the probability; 1: renormalised over the k; 2: one). Ties go to the lower
 * index. Returns 0, or -30 for more than MOE_MAX_EXPERTS experts. */
int leanlm_moe_route_bf16(const uint16_t *h, const uint16_t *router, int64_t M, int64_t hidden, int64_t E, int64_t k,
                          int64_t scoring, int64_t *experts, float *weights) {
    if (E > MOE_MAX_EXPERTS || k > E || k < 1) return -30;
    float p[MOE_MAX_EXPERTS];
    unsigned char taken[MOE_MAX_EXPERTS];
    for (int64_t t = 0; t < M; t++) {
        const uint16_t *x = h + t * hidden;
        for (int64_t e = 0; e < E; e++) {
            const uint16_t *w = router + e * hidden;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < hidden; i += 16) {
                const __mmask16 m = tail16(hidden - i);
                acc = _mm512_fmadd_ps(load16(x + i, m), load16(w + i, m), acc);
            }
            p[e] = bf16_to_f32(f32_to_bf16(_mm512_reduce_add_ps(acc)));
        }
        moe_pick(p, taken, E, k, scoring, experts + t * k, weights + t * k);
    }
    return 0;
}

/* y [n, hidden] = one SwiGLU MLP (gate, up, down) of rows x [n, hidden]; gate, up: [n, I] scratch. */
static int run_mlp(const decode_model *m, const decode_linear *mlp, const uint16_t *x, uint16_t *y, int64_t n,
                   uint16_t *gate, uint16_t *up, uint16_t *permuted, int threads) {
    int rc;
    if ((rc = run_linear(m, mlp + 0, x, gate, n, threads, permuted)) ||
        (rc = run_linear(m, mlp + 1, x, up, n, threads, permuted)))
        return rc;
    leanlm_silu_mul_bf16(gate, up, gate, n * mlp[0].out_features, threads);
    return run_linear(m, mlp + 2, gate, y, n, threads, permuted);
}

/* Work space of a MoE layer for M rows of top-k (leanlm_decode_layers allocates it once per call): each expert's rows,
 * outputs and intermediates at its place in the assignments grouped by expert, so experts can run side by side. */
typedef struct {
    int64_t *experts, *members; /* [M * k]: routed experts; assignment indices grouped by expert */
    float *weights;             /* [M * k] */
    uint16_t *rows, *y;         /* [M * k, hidden] */
    uint16_t *gate, *up;        /* [M * k, intermediate] */
    uint16_t *permuted;         /* [M * k, max(hidden, intermediate)] */
} moe_work;

/* out [M, hidden] = the MoE MLP of normed rows h [M, hidden]. Each chosen expert runs once over its rows; the experts
 * run side by side on the threads (a small expert's GEMV is too short to split), then their weighted rows are added
 * to each token in ascending expert order, the PyTorch path's order. */
static int moe_mlp(const decode_model *m, const decode_moe *moe, const uint16_t *h, uint16_t *out, int64_t M,
                   const moe_work *w, int threads) {
    const int64_t hid = m->hidden, k = moe->top_k, E = moe->num_experts, I = m->intermediate;
    const int64_t K = hid > I ? hid : I;
    int rc = leanlm_moe_route_bf16(h, moe->router, M, hid, E, k, moe->scoring, w->experts, w->weights);
    if (rc) return rc;
    int64_t offs[MOE_MAX_EXPERTS + 1], used[MOE_MAX_EXPERTS], num_used = 0;
    memset(offs, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < M * k; a++) offs[w->experts[a] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        if (offs[e + 1]) used[num_used++] = e;
        moe->counts[e] += offs[e + 1];
        offs[e + 1] += offs[e];
    }
    moe->counts[E] += M;
    moe->counts[E + 1] += num_used;
    int64_t fill[MOE_MAX_EXPERTS];
    memcpy(fill, offs, (size_t)E * sizeof(int64_t));
    for (int64_t a = 0; a < M * k; a++) w->members[fill[w->experts[a]]++] = a; /* stable: tokens in order */
    const int outer = num_used < threads ? (int)num_used : threads, inner = threads / (outer ? outer : 1);
    int failed = 0;
#pragma omp parallel for num_threads(outer) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t u = 0; u < num_used; u++) {
        const int64_t e = used[u], base = offs[e], n = offs[e + 1] - base;
        uint16_t *rows = w->rows + base * hid;
        for (int64_t i = 0; i < n; i++)
            memcpy(rows + i * hid, h + (w->members[base + i] / k) * hid, (size_t)hid * sizeof(uint16_t));
        failed |= run_mlp(m, moe->experts + 3 * e, rows, w->y + base * hid, n, w->gate + base * I, w->up + base * I,
                          w->permuted + base * K, inner) != 0;
    }
    if (failed) return -32;
    memset(out, 0, (size_t)(M * hid) * sizeof(uint16_t));
    for (int64_t u = 0; u < num_used; u++) {
        const int64_t e = used[u];
        for (int64_t i = offs[e]; i < offs[e + 1]; i++) {
            uint16_t *o = out + (w->members[i] / k) * hid;
            const uint16_t *yi = w->y + i * hid;
            const __m512 wt = _mm512_set1_ps(w->weights[w->members[i]]);
            for (int64_t c = 0; c < hid; c += 16) {
                const __mmask16 mk = tail16(hid - c);
                store16(o + c, _mm512_add_ps(load16(o + c, mk), round16(_mm512_mul_ps(load16(yi + c, mk), wt))), mk);
            }
        }
    }
    if (moe->shared != NULL) {
        if ((rc = run_mlp(m, moe->shared, h, w->y, M, w->gate, w->up, w->permuted, threads))) return rc;
        add_rows(out, w->y, M, hid, threads);
    }
    return 0;
}

/* M decode tokens, one per request, through every layer and the final norm.
 * x [M, hidden] bf16: the embeddings in, the residual stream after the last layer out; out [M, hidden]: the
 * final norm of it. positions, slots, seq_lens [M]; block_tables [M, max_blocks] int64. scratch: bf16,
 * at least M * (hidden + 2 * num_heads * D + 2 * num_kv_heads * D + 2 * intermediate + the widest linear
 * input, + hidden when a layer is MoE) elements.
 * Returns 0, a negative kernel status, or -20 for a position outside the rotary table. */
static int run_layers(const decode_model *m, uint16_t *x, uint16_t *out, int64_t M, const int64_t *positions,
                      const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens, int64_t max_blocks,
                      int64_t max_seq_len, uint16_t *scratch, int threads, const moe_work *work,
                      const int64_t *layer_bounds, const int64_t *sink_positions, uint16_t *q_sink) {
    const int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, hid = m->hidden, I = m->intermediate;
    uint16_t *h = scratch;          /* [M, hidden]: normed input, then o_proj / down_proj output */
    uint16_t *q = h + M * hid;      /* [M, H, D] */
    uint16_t *k = q + M * H * D;    /* [M, Hkv, D] */
    uint16_t *v = k + M * Hkv * D;  /* [M, Hkv, D] */
    uint16_t *attn = v + M * Hkv * D; /* [M, H, D] */
    uint16_t *gate = attn + M * H * D; /* [M, I] */
    uint16_t *up = gate + M * I;    /* [M, I] */
    uint16_t *acc = up + M * I;     /* [M, hidden]: a MoE layer's output (only a model with MoE layers has it) */
    uint16_t *permuted = acc + (work->experts != NULL ? M * hid : 0); /* [M, K] of a permuted linear */
    for (int64_t t = 0; t < M; t++)
        if (positions[t] < 0 || positions[t] >= m->rope_positions ||
            (sink_positions && (sink_positions[t] < 0 || sink_positions[t] >= m->rope_positions)))
            return -20;
    for (int64_t li = 0; li < m->num_layers; li++) {
        const decode_layer *layer = m->layers + li;
        const decode_linear *lin = layer->linears;
        int rc;
        leanlm_rms_norm_bf16(x, layer->input_norm, h, M, hid, m->eps, threads);
        if ((rc = run_linear(m, lin + Q_PROJ, h, q, M, threads, permuted)) ||
            (rc = run_linear(m, lin + K_PROJ, h, k, M, threads, permuted)) ||
            (rc = run_linear(m, lin + V_PROJ, h, v, M, threads, permuted)))
            return rc;
#pragma omp parallel for num_threads(row_threads(M, threads)) schedule(static)
        for (int64_t t = 0; t < M; t++) {
            const float *c = m->cos + positions[t] * (D / 2), *s = m->sin + positions[t] * (D / 2);
            if (q_sink != NULL) { /* the query the sinks are scored with: rotated at their re-based position */
                memcpy(q_sink + t * H * D, q + t * H * D, (size_t)(H * D) * sizeof(uint16_t));
                rotary(q_sink + t * H * D, H, D, m->cos + sink_positions[t] * (D / 2), m->sin + sink_positions[t] * (D / 2));
            }
            rotary(q + t * H * D, H, D, c, s);
            rotary(k + t * Hkv * D, Hkv, D, c, s);
            store_kv(m, layer, k + t * Hkv * D, v + t * Hkv * D, slots[t]);
        }
        const int64_t *bounds = layer_bounds != NULL ? layer_bounds + li * M * 3 : NULL;
        if (layer->k_scales != NULL)
            rc = m->attention_int8(q, layer->k_cache, layer->v_cache, layer->k_scales, layer->v_scales, block_tables,
                                   seq_lens, attn, (int)M, (int)H, (int)Hkv, (int)D, (int)m->block_size,
                                   (int)max_blocks, max_seq_len, (float)m->scale, threads, bounds, q_sink);
        else
            rc = m->attention(q, layer->k_cache, layer->v_cache, block_tables, seq_lens, attn, (int)M, (int)H, (int)Hkv,
                              (int)D, (int)m->block_size, (int)max_blocks, max_seq_len, (float)m->scale, threads,
                              bounds, q_sink);
        if (rc) return rc;
        if ((rc = run_linear(m, lin + O_PROJ, attn, h, M, threads, permuted))) return rc;
        add_rows(x, h, M, hid, threads);
        leanlm_rms_norm_bf16(x, layer->post_norm, h, M, hid, m->eps, threads);
        if (layer->moe.router != NULL) {
            if ((rc = moe_mlp(m, &layer->moe, h, acc, M, work, threads))) return rc;
            add_rows(x, acc, M, hid, threads);
            continue;
        }
        if ((rc = run_linear(m, lin + GATE_PROJ, h, gate, M, threads, permuted)) ||
            (rc = run_linear(m, lin + UP_PROJ, h, up, M, threads, permuted)))
            return rc;
        leanlm_silu_mul_bf16(gate, up, gate, M * I, threads);
        if ((rc = run_linear(m, lin + DOWN_PROJ, gate, h, M, threads, permuted))) return rc;
        add_rows(x, h, M, hid, threads);
    }
    leanlm_rms_norm_bf16(x, m->final_norm, out, M, hid, m->eps, threads);
    return 0;
}

/* M decode tokens, one per request, through every layer and the final norm (see run_layers); MoE layers' routing
 * arrays are allocated here, once per call. Returns 0, a negative kernel status, -20 for a position outside the
 * rotary table, -30 for a router the loop cannot take, -31 when memory runs out. */
/* layer_bounds: NULL (every layer reads every key), or [num_layers, M, 3] int64 (lo, sinks, stride) per layer and
 * row, as the attention kernel takes them; sink_positions: NULL, or [M] positions the sinks' query is rotated at. */
int leanlm_decode_layers(const decode_model *m, uint16_t *x, uint16_t *out, int64_t M, const int64_t *positions,
                         const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens, int64_t max_blocks,
                         int64_t max_seq_len, uint16_t *scratch, int threads, const int64_t *layer_bounds,
                         const int64_t *sink_positions) {
    int64_t k = 0;
    for (int64_t li = 0; li < m->num_layers; li++)
        if (m->layers[li].moe.router != NULL && m->layers[li].moe.top_k > k) k = m->layers[li].moe.top_k;
    moe_work work = {0};
    void *block = NULL;
    if (k) {
        const int64_t a = M * k, hid = m->hidden, I = m->intermediate, K = hid > I ? hid : I;
        const size_t ints = (size_t)a * (2 * sizeof(int64_t) + sizeof(float));
        if ((block = malloc(ints + (size_t)a * (2 * hid + 2 * I + K) * sizeof(uint16_t))) == NULL) return -31;
        work.experts = block;
        work.members = work.experts + a;
        work.weights = (float *)(work.members + a);
        work.rows = (uint16_t *)((char *)block + ints);
        work.y = work.rows + a * hid;
        work.gate = work.y + a * hid;
        work.up = work.gate + a * I;
        work.permuted = work.up + a * I;
    }
    uint16_t *q_sink = NULL;
    if (sink_positions != NULL &&
        (q_sink = malloc((size_t)(M * m->num_heads * m->head_dim) * sizeof(uint16_t))) == NULL) {
        free(block);
        return -31;
    }
    const int rc = run_layers(m, x, out, M, positions, slots, block_tables, seq_lens, max_blocks, max_seq_len, scratch,
                              threads, &work, layer_bounds, sink_positions, q_sink);
    free(q_sink);
    free(block);
    return rc;
}
