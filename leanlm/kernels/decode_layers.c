/* Every decoder layer of a Llama-family model for a batch of 1-8 decode tokens, in one native call.
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
 * below (torch's own reductions and exp sum and round in another order). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { KIND_BF16 = 0, KIND_INT8 = 1, KIND_INT4 = 2 };
enum { Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ, NUM_LINEARS };

typedef int (*linear_bf16_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                              int64_t, int, int64_t);
typedef int (*linear_int8_fn)(const uint16_t *, const int8_t *, const float *, const uint16_t *, uint16_t *, int64_t,
                              int64_t, int64_t, int, int64_t);
typedef int (*linear_int4_fn)(const uint16_t *, const uint8_t *, const float *, const float *, const uint16_t *,
                              uint16_t *, int64_t, int64_t, int64_t, int64_t, int, int64_t);
typedef int (*attention_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int64_t *, const int64_t *,
                            uint16_t *, int, int, int, int, int, int, int64_t, float, int);
typedef int (*attention_int8_fn)(const uint16_t *, const int8_t *, const int8_t *, const float *, const float *,
                                 const int64_t *, const int64_t *, uint16_t *, int, int, int, int, int, int, int64_t,
                                 float, int);

/* One linear layer y = x W^T + b in one of the kernels' formats. Every field is 8 bytes (no padding), so
 * the ctypes mirror in cpu_decode.py lays it out identically. */
typedef struct {
    int64_t kind;           /* KIND_* */
    const void *weight;     /* bf16 [N, K], int8 [N, K] or packed 4-bit codes uint8 [N, K / 2] */
    const float *scales;    /* int8: [N]; int4: [N, K / group_size]; NULL for bf16 */
    const float *mins;      /* int4: [N, K / group_size]; NULL otherwise */
    const uint16_t *bias;   /* bf16 [N] or NULL */
    const int64_t *perm;    /* int4 only, or NULL: columns stored in this input order [K] (GPTQ act-order) */
    int64_t out_features, in_features, group_size;
} decode_linear;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* bf16 [hidden] RMSNorm weights */
    decode_linear linears[NUM_LINEARS];
    void *k_cache, *v_cache; /* [num_blocks, Hkv, block_size, D]: bf16, or int8 with scales */
    float *k_scales, *v_scales; /* an int8 cache's per-(token, KV head) scales [num_blocks, Hkv, block_size]; else NULL */
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, rope_positions;
    const float *cos, *sin; /* fp32 [rope_positions, D / 2] rotary tables */
    const decode_layer *layers;
    const uint16_t *final_norm;
    linear_bf16_fn linear_bf16;
    linear_int8_fn linear_int8;
    linear_int4_fn linear_int4;
    attention_fn attention;
    attention_int8_fn attention_int8;
    int64_t min_parallel_bytes;
    double eps, scale; /* RMSNorm epsilon; attention softmax scale */
} decode_model;

ALWAYS_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* y [M, N] = x [M, K] W^T + b; permuted: [M, K] scratch for the gathered input. */
static int run_linear(const decode_model *m, const decode_linear *l, const uint16_t *x, uint16_t *y, int64_t M,
                      int threads, uint16_t *permuted) {
    if (l->perm != NULL) {
        const int64_t K = l->in_features;
        for (int64_t t = 0; t < M; t++)
            for (int64_t j = 0; j < K; j++) permuted[t * K + j] = x[t * K + l->perm[j]];
        x = permuted;
    }
    switch (l->kind) {
    case KIND_BF16:
        return m->linear_bf16(x, (const uint16_t *)l->weight, l->bias, y, M, l->out_features, l->in_features, threads,
                              m->min_parallel_bytes);
    case KIND_INT8:
        return m->linear_int8(x, (const int8_t *)l->weight, l->scales, l->bias, y, M, l->out_features, l->in_features,
                              threads, m->min_parallel_bytes);
    case KIND_INT4:
        return m->linear_int4(x, (const uint8_t *)l->weight, l->scales, l->mins, l->bias, y, M, l->out_features,
                              l->in_features, l->group_size, threads, m->min_parallel_bytes);
    default:
        return -10;
    }
}

/* y[i] = bf16(x[i] * rsqrt(mean(x^2) + eps) * w[i]) in fp32, as torch's rms_norm on bf16 input. */
void leanlm_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t n, double eps) {
    for (int64_t t = 0; t < M; t++) {
        const uint16_t *xr = x + t * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_f32(xr[i]);
            sum += v * v;
        }
        const float r = 1.0f / sqrtf(sum / (float)n + (float)eps);
        for (int64_t i = 0; i < n; i++) y[t * n + i] = f32_to_bf16(bf16_to_f32(xr[i]) * r * bf16_to_f32(w[i]));
    }
}

/* Rotate-half RoPE in place on heads [num_heads, D] of one token, with cos/sin rounded to bf16 first (the
 * PyTorch path casts the table to the model dtype) and every op rounded to bf16 as torch's bf16 ops are. */
static void rotary(uint16_t *heads, int64_t num_heads, int64_t head_dim, const float *cos_row, const float *sin_row) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        uint16_t *v = heads + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float c = round_bf16(cos_row[i]), s = round_bf16(sin_row[i]);
            const float x1 = bf16_to_f32(v[i]), x2 = bf16_to_f32(v[i + half]);
            v[i] = f32_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
            v[i + half] = f32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
        }
    }
}

/* x += y, both bf16, one rounding per element (torch's bf16 add). */
static void add_residual(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

/* out = bf16(bf16(silu(gate)) * up), as F.silu(gate) * up on bf16 tensors; out may be gate. */
void leanlm_silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = bf16_to_f32(gate[i]);
        out[i] = f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_f32(up[i]));
    }
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

/* M decode tokens, one per request, through every layer and the final norm.
 * x [M, hidden] bf16: the embeddings in, the residual stream after the last layer out; out [M, hidden]: the
 * final norm of it. positions, slots, seq_lens [M]; block_tables [M, max_blocks] int64. scratch: bf16,
 * at least M * (hidden + 2 * num_heads * D + 2 * num_kv_heads * D + 2 * intermediate + the widest linear
 * input) elements.
 * Returns 0, a negative kernel status, or -20 for a position outside the rotary table. */
int leanlm_decode_layers(const decode_model *m, uint16_t *x, uint16_t *out, int64_t M, const int64_t *positions,
                         const int64_t *slots, const int64_t *block_tables, const int64_t *seq_lens, int64_t max_blocks,
                         int64_t max_seq_len, uint16_t *scratch, int threads) {
    const int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, hid = m->hidden, I = m->intermediate;
    uint16_t *h = scratch;          /* [M, hidden]: normed input, then o_proj / down_proj output */
    uint16_t *q = h + M * hid;      /* [M, H, D] */
    uint16_t *k = q + M * H * D;    /* [M, Hkv, D] */
    uint16_t *v = k + M * Hkv * D;  /* [M, Hkv, D] */
    uint16_t *attn = v + M * Hkv * D; /* [M, H, D] */
    uint16_t *gate = attn + M * H * D; /* [M, I] */
    uint16_t *up = gate + M * I;    /* [M, I] */
    uint16_t *permuted = up + M * I; /* [M, K] of a permuted linear */
    for (int64_t t = 0; t < M; t++)
        if (positions[t] < 0 || positions[t] >= m->rope_positions) return -20;
    for (int64_t li = 0; li < m->num_layers; li++) {
        const decode_layer *layer = m->layers + li;
        const decode_linear *lin = layer->linears;
        int rc;
        leanlm_rms_norm_bf16(x, layer->input_norm, h, M, hid, m->eps);
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
        if (layer->k_scales != NULL)
            rc = m->attention_int8(q, layer->k_cache, layer->v_cache, layer->k_scales, layer->v_scales, block_tables,
                                   seq_lens, attn, (int)M, (int)H, (int)Hkv, (int)D, (int)m->block_size,
                                   (int)max_blocks, max_seq_len, (float)m->scale, threads);
        else
            rc = m->attention(q, layer->k_cache, layer->v_cache, block_tables, seq_lens, attn, (int)M, (int)H, (int)Hkv,
                              (int)D, (int)m->block_size, (int)max_blocks, max_seq_len, (float)m->scale, threads);
        if (rc) return rc;
        if ((rc = run_linear(m, lin + O_PROJ, attn, h, M, threads, permuted))) return rc;
        add_residual(x, h, M * hid);
        leanlm_rms_norm_bf16(x, layer->post_norm, h, M, hid, m->eps);
        if ((rc = run_linear(m, lin + GATE_PROJ, h, gate, M, threads, permuted)) ||
            (rc = run_linear(m, lin + UP_PROJ, h, up, M, threads, permuted)))
            return rc;
        leanlm_silu_mul_bf16(gate, up, gate, M * I);
        if ((rc = run_linear(m, lin + DOWN_PROJ, gate, h, M, threads, permuted))) return rc;
        add_residual(x, h, M * hid);
    }
    leanlm_rms_norm_bf16(x, m->final_norm, out, M, hid, m->eps);
    return 0;
}
