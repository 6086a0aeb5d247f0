/* The model the native decode loops read (decode_layers.c: bf16 activations on AVX512; decode_layers_f32.c: float32
 * activations on AVX2): every field is 8 bytes, no padding, so the ctypes mirror in cpu_decode.py lays it out
 * identically. Activation and norm pointers are bf16 (uint16_t) in the one loop and float in the other. */
#ifndef LEANLM_DECODE_MODEL_H
#define LEANLM_DECODE_MODEL_H

#include <float.h>
#include <math.h>

#include <stdint.h>

#include "linear_call.h"

enum { Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ, NUM_LINEARS };

typedef int (*attention_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int64_t *, const int64_t *,
                            uint16_t *, int, int, int, int, int, int, int64_t, float, int, const int64_t *,
                            const uint16_t *);
typedef int (*attention_int8_fn)(const uint16_t *, const int8_t *, const int8_t *, const float *, const float *,
                                 const int64_t *, const int64_t *, uint16_t *, int, int, int, int, int, int, int64_t,
                                 float, int, const int64_t *, const uint16_t *);

/* One linear layer y = x W^T + b: its kernels as calls (linear_call.h), each reading the layer's own tensors.
 * Every field is 8 bytes (no padding), so the ctypes mirror in native_linear.py lays it out identically. */
typedef struct {
    int64_t out_features, in_features;
    const int64_t *perm;           /* NULL, or the input is gathered as x[:, perm] first [K] (GPTQ act-order) */
    leanlm_linear_call few_rows;   /* fewer than min_gemm_rows rows */
    leanlm_linear_call many_rows;  /* min_gemm_rows rows and more; fn NULL where the loop takes at most 8 */
} decode_linear;

/* A mixture-of-experts MLP (leanlm/model/moe.py): router NULL in a dense layer. */
typedef struct {
    const uint16_t *router;         /* bf16 [E, hidden] */
    int64_t num_experts, top_k, scoring; /* scoring: 0 softmax, 1 softmax renormalised over the k, 2 ones */
    const decode_linear *experts;   /* [E * 3]: each expert's gate, up, down */
    const decode_linear *shared;    /* [3]: an ungated shared expert, or NULL */
    int64_t *counts;                /* [E + 2], added to: assignments per expert, tokens, experts run */
} decode_moe;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* bf16 [hidden] RMSNorm weights */
    decode_linear linears[NUM_LINEARS]; /* a MoE layer's gate/up/down slots are unused */
    void *k_cache, *v_cache; /* [num_blocks, Hkv, block_size, D]: bf16, or int8 with scales */
    float *k_scales, *v_scales; /* an int8 cache's per-(token, KV head) scales [num_blocks, Hkv, block_size]; else NULL */
    decode_moe moe;
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, rope_positions;
    const float *cos, *sin; /* fp32 [rope_positions, D / 2] rotary tables */
    const decode_layer *layers;
    const uint16_t *final_norm;
    attention_fn attention;
    attention_int8_fn attention_int8;
    int64_t min_gemm_rows; /* from this many rows on, the packed GEMM */
    int64_t min_parallel_bytes;
    double eps, scale; /* RMSNorm epsilon; attention softmax scale */
    int64_t max_few_rows; /* the float32 loop: rows per few-row call, more split into such calls (0: no split) */
} decode_model;

#define MOE_MAX_EXPERTS 1024

/* One row's routing from its router logits p [E] (overwritten with exp(p - max)): the k best experts in ascending
 * index order with their weights (scoring 0: the probability; 1: renormalised over the k; 2: one). Ties go to the
 * lower index. Both decode loops route through it, so their choices differ only by the logits' rounding. */
static inline void moe_pick(float *p, unsigned char *taken, int64_t E, int64_t k, int64_t scoring, int64_t *experts,
                            float *weights) {
    float top = -FLT_MAX, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        top = p[e] > top ? p[e] : top;
        taken[e] = 0;
    }
    for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - top));
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        chosen += p[best] / sum;
    }
    for (int64_t e = 0, j = 0; e < E; e++) {
        if (!taken[e]) continue;
        const float prob = p[e] / sum;
        experts[j] = e;
        weights[j] = scoring == 2 ? 1.0f : scoring == 1 ? prob / chosen : prob;
        j++;
    }
}

#endif
