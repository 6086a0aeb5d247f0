// Paged decode attention for bfloat16 KV caches on AVX512-BF16 CPUs.
//
// One query token per request attends to its first seq_lens[b] cached tokens, read in place from the
// paged cache through its block table (no gather). Work item = (request, KV head): its G = H / Hkv query
// heads share every K/V load. Two passes: scores (bf16 dot products, fp32 accumulate), then a softmax with
// a vectorized exp and the V-weighted sum in fp32. Output rounds to bf16 with round-to-nearest-even.
// The int8 variant reads an int8 cache with one fp32 scale per (token, KV head) (leanlm.model.kv_quant): int8
// values are exact in bf16, so K rows take the same dot products and their scale folds into the score; V's
// scale folds into the softmax weight. Half the K/V bytes of bf16 per token (plus 8 bytes of scales).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp512.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

// A decode step finds its KV blocks in DRAM (128 requests x 160 tokens of SmolLM2 are 16 MB a layer), each
// request's K and V a few short runs (6 KB a block for 16 tokens of 3 KV heads x 64 bf16). Read as they come,
// they ran at 13 GB/s where the two cores stream 50, 3x slower than the same work on a hot cache. So each
// thread claims its next request before it computes the current one, and asks for the next one's K and V
// blocks a few cache lines per row it computes: the loads overlap the arithmetic without flooding the miss
// queue (all of them at once, at the start, gained half as much).
typedef struct {
    const char* bases[4]; /* K, V (and an int8 cache's K and V scales) */
    int64_t block_bytes[4];
    int count;            /* bases in use; 0: nothing to fetch */
    const int64_t* blocks;
    int64_t num_blocks;
    int64_t base, block, offset; /* cursor */
} prefetcher;

#define PREFETCH_LINES 4 /* per row computed: the next request's lines run out about halfway through this one */

static inline void prefetch_some(prefetcher* p) {
    for (int i = 0; i < PREFETCH_LINES && p->base < p->count; i++) {
        _mm_prefetch(p->bases[p->base] + p->blocks[p->block] * p->block_bytes[p->base] + p->offset, _MM_HINT_T0);
        p->offset += 64;
        if (p->offset >= p->block_bytes[p->base]) {
            p->offset = 0;
            if (++p->block == p->num_blocks) {
                p->block = 0;
                p->base++;
            }
        }
    }
}

// The requests of a step handed out one at a time (the next unclaimed one, by an atomic counter).
static inline int64_t claim(int64_t* next) { return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); }

// Point the prefetcher at request r's blocks (nothing when r is past the last request).
static inline void next_request(prefetcher* p, int64_t r, int64_t num_reqs, const int64_t* block_tables,
                                int max_blocks, const int64_t* seq_lens, int block_size) {
    if (r >= num_reqs || seq_lens[r] <= 0) {
        p->count = 0;
        return;
    }
    p->blocks = block_tables + r * max_blocks;
    p->num_blocks = (seq_lens[r] + block_size - 1) / block_size;
    p->base = p->block = p->offset = 0;
}

// Scores of the G query heads against one key row: D/32 dot-product steps of 32 bf16 pairs each.
static inline void score_row(const __m512bh* q, int group, int chunks, const uint16_t* k, float* out) {
    __m512bh kv[MAX_HEAD_DIM / 32];
    for (int c = 0; c < chunks; c++) kv[c] = (__m512bh)_mm512_loadu_si512((const void*)(k + 32 * c));
    for (int g = 0; g < group; g++) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < chunks; c++) acc = _mm512_dpbf16_ps(acc, q[g * chunks + c], kv[c]);
        out[g] = _mm512_reduce_add_ps(acc);
    }
}

// Each of the G rows of scores [G, seq_len] becomes its softmax, in place.
static inline void softmax_rows(float* scores, int group, int64_t seq_len) {
    for (int g = 0; g < group; g++) {
        float* s = scores + g * seq_len;
        float m = -INFINITY;
        for (int64_t t = 0; t < seq_len; t++) m = s[t] > m ? s[t] : m;
        __m512 vmax = _mm512_set1_ps(m), vsum = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 16 <= seq_len; t += 16) {
            __m512 e = exp512_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmax));
            _mm512_storeu_ps(s + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (t < seq_len) {
            __mmask16 mask = (__mmask16)((1u << (seq_len - t)) - 1);
            __m512 e = exp512_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vmax));
            _mm512_mask_storeu_ps(s + t, mask, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mask, e));
        }
        float inv = 1.0f / _mm512_reduce_add_ps(vsum);
        for (int64_t t2 = 0; t2 < seq_len; t2++) s[t2] *= inv;
    }
}

static inline __attribute__((always_inline)) void attend_one(const uint16_t* q_heads, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* blocks, int64_t seq_len, uint16_t* out_heads, int group, int num_kv_heads,
                       int kv_head, int head_dim, int block_size, float scale, float* scores /* [G, seq_len] */,
                       prefetcher* ahead) {
    const int chunks = head_dim / 32;
    __m512bh q[MAX_GROUP * (MAX_HEAD_DIM / 32)];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++)
            q[g * chunks + c] = (__m512bh)_mm512_loadu_si512((const void*)(q_heads + g * head_dim + 32 * c));

    // Blocks are [Hkv, block_size, D]: this head's rows of a block are one contiguous run of block_size * D.
    const int64_t row_stride = head_dim;
    const int64_t head_stride = (int64_t)block_size * head_dim;
    const int64_t block_stride = head_stride * num_kv_heads;
    float row[MAX_GROUP];
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const uint16_t* k = k_cache + blocks[start / block_size] * block_stride + kv_head * head_stride;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        for (int64_t i = 0; i < n; i++, k += row_stride) {
            score_row(q, group, chunks, k, row);
            prefetch_some(ahead);
            for (int g = 0; g < group; g++) scores[g * seq_len + start + i] = row[g] * scale;
        }
    }
    softmax_rows(scores, group, seq_len);
    // out_g = sum_t p[g, t] * v_t, fp32 accumulators: D/16 registers per head
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
    const int lanes = head_dim / 16;
    for (int g = 0; g < group; g++)
        for (int l = 0; l < lanes; l++) acc[g][l] = _mm512_setzero_ps();
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const uint16_t* v = v_cache + blocks[start / block_size] * block_stride + kv_head * head_stride;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        for (int64_t i = 0; i < n; i++, v += row_stride) {
            const int64_t t = start + i;
            prefetch_some(ahead);
            for (int l = 0; l < lanes; l++) {
                __m512 vf = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(v + 16 * l)));
                for (int g = 0; g < group; g++)
                    acc[g][l] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * seq_len + t]), vf, acc[g][l]);
            }
        }
    }
    for (int g = 0; g < group; g++)
        for (int l = 0; l < lanes; l++)
            _mm256_storeu_si256((__m256i*)(out_heads + g * head_dim + 16 * l), (__m256i)_mm512_cvtneps_pbh(acc[g][l]));
}

// Scores of the G query heads against one int8 key row: the row widened to bf16 (exact), then as score_row.
static inline void score_row_i8(const __m512bh* q, int group, int chunks, const int8_t* k, float* out) {
    __m512bh kv[MAX_HEAD_DIM / 32];
    for (int c = 0; c < chunks; c++) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(k + 32 * c))));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(k + 32 * c + 16))));
        kv[c] = _mm512_cvtne2ps_pbh(hi, lo);  // element i of the pair is lo[i], element 16 + i is hi[i]
    }
    for (int g = 0; g < group; g++) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < chunks; c++) acc = _mm512_dpbf16_ps(acc, q[g * chunks + c], kv[c]);
        out[g] = _mm512_reduce_add_ps(acc);
    }
}

// attend_one over an int8 cache [N, Hkv, bs, D] with scales [N, Hkv, bs]: k = k_i8 * k_scale, v = v_i8 * v_scale.
static inline __attribute__((always_inline)) void attend_one_i8(
        const uint16_t* q_heads, const int8_t* k_cache, const int8_t* v_cache, const float* k_scales,
        const float* v_scales, const int64_t* blocks, int64_t seq_len, uint16_t* out_heads, int group,
        int num_kv_heads, int kv_head, int head_dim, int block_size, float scale, float* scores /* [G, seq_len] */,
        prefetcher* ahead) {
    const int chunks = head_dim / 32;
    __m512bh q[MAX_GROUP * (MAX_HEAD_DIM / 32)];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++)
            q[g * chunks + c] = (__m512bh)_mm512_loadu_si512((const void*)(q_heads + g * head_dim + 32 * c));
    const int64_t head_stride = (int64_t)block_size * head_dim;
    const int64_t block_stride = head_stride * num_kv_heads;
    const int64_t scale_block_stride = (int64_t)block_size * num_kv_heads;
    float row[MAX_GROUP];
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = blocks[start / block_size];
        const int8_t* k = k_cache + block * block_stride + kv_head * head_stride;
        const float* ks = k_scales + block * scale_block_stride + (int64_t)kv_head * block_size;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;

        for (int64_t i = 0; i < n; i++, k += head_dim) {
            score_row_i8(q, group, chunks, k, row);
            prefetch_some(ahead);
            const float row_scale = ks[i] * scale;
            for (int g = 0; g < group; g++) scores[g * seq_len + start + i] = row[g] * row_scale;
        }
    }
    softmax_rows(scores, group, seq_len);
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
    const int lanes = head_dim / 16;
    for (int g = 0; g < group; g++)
        for (int l = 0; l < lanes; l++) acc[g][l] = _mm512_setzero_ps();
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = blocks[start / block_size];
        const int8_t* v = v_cache + block * block_stride + kv_head * head_stride;
        const float* vs = v_scales + block * scale_block_stride + (int64_t)kv_head * block_size;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        for (int64_t i = 0; i < n; i++, v += head_dim) {
            const int64_t t = start + i;
            prefetch_some(ahead);
            __m512 w[MAX_GROUP];  // softmax weight times this row's V scale
            for (int g = 0; g < group; g++) w[g] = _mm512_set1_ps(scores[g * seq_len + t] * vs[i]);
            for (int l = 0; l < lanes; l++) {
                __m512 vf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(v + 16 * l))));
                for (int g = 0; g < group; g++) acc[g][l] = _mm512_fmadd_ps(w[g], vf, acc[g][l]);
            }
        }
    }
    for (int g = 0; g < group; g++)
        for (int l = 0; l < lanes; l++)
            _mm256_storeu_si256((__m256i*)(out_heads + g * head_dim + 16 * l), (__m256i)_mm512_cvtneps_pbh(acc[g][l]));
}

// q, out: [B, H, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [B, max_blocks].
// Returns 0, or -1 when the shape is outside what the kernel supports (the caller falls back).
int paged_decode_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_reqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                int64_t max_seq_len, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || num_heads % num_kv_heads) return -1;
    const int64_t block_bytes = (int64_t)num_kv_heads * block_size * head_dim * (int64_t)sizeof(uint16_t);
    int64_t next = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)group * (size_t)(max_seq_len > 0 ? max_seq_len : 1));
        // A request's KV heads go to one thread in a row: its K/V rows (all heads interleaved) come from
        // DRAM once, then from L2 for the other heads.
        for (int64_t b = claim(&next), after; b < num_reqs; b = after) {
            after = claim(&next);
            prefetcher ahead = {{(const char*)k_cache, (const char*)v_cache}, {block_bytes, block_bytes}, 2};
            next_request(&ahead, after, num_reqs, block_tables, max_blocks, seq_lens, block_size);
            const int64_t* blocks = block_tables + b * max_blocks;
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t offset = (b * num_heads + (int64_t)h * group) * head_dim;
                // Literal head dims let the compiler unroll the D loops and keep accumulators in registers.
                if (head_dim == 64)
                    attend_one(q + offset, k_cache, v_cache, blocks, seq_lens[b], out + offset, group, num_kv_heads,
                               h, 64, block_size, scale, scores, &ahead);
                else if (head_dim == 128)
                    attend_one(q + offset, k_cache, v_cache, blocks, seq_lens[b], out + offset, group, num_kv_heads,
                               h, 128, block_size, scale, scores, &ahead);
                else
                    attend_one(q + offset, k_cache, v_cache, blocks, seq_lens[b], out + offset, group, num_kv_heads,
                               h, head_dim, block_size, scale, scores, &ahead);
            }
        }
        free(scores);
    }
    return 0;
}

// As paged_decode_attention_bf16 over an int8 cache; k_scales, v_scales: [num_blocks, Hkv, block_size] fp32.
int paged_decode_attention_int8kv(const uint16_t* q, const int8_t* k_cache, const int8_t* v_cache,
                                  const float* k_scales, const float* v_scales, const int64_t* block_tables,
                                  const int64_t* seq_lens, uint16_t* out, int num_reqs, int num_heads,
                                  int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                  int64_t max_seq_len, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || num_heads % num_kv_heads) return -1;
    const int64_t block_bytes = (int64_t)num_kv_heads * block_size * head_dim;
    const int64_t scale_bytes = (int64_t)num_kv_heads * block_size * (int64_t)sizeof(float);
    int64_t next = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)group * (size_t)(max_seq_len > 0 ? max_seq_len : 1));
        for (int64_t b = claim(&next), after; b < num_reqs; b = after) {
            after = claim(&next);
            prefetcher ahead = {{(const char*)k_cache, (const char*)v_cache, (const char*)k_scales,
                                 (const char*)v_scales},
                                {block_bytes, block_bytes, scale_bytes, scale_bytes},
                                4};
            next_request(&ahead, after, num_reqs, block_tables, max_blocks, seq_lens, block_size);
            const int64_t* blocks = block_tables + b * max_blocks;
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t offset = (b * num_heads + (int64_t)h * group) * head_dim;
                if (head_dim == 64)
                    attend_one_i8(q + offset, k_cache, v_cache, k_scales, v_scales, blocks, seq_lens[b],
                                  out + offset, group, num_kv_heads, h, 64, block_size, scale, scores, &ahead);
                else if (head_dim == 128)
                    attend_one_i8(q + offset, k_cache, v_cache, k_scales, v_scales, blocks, seq_lens[b],
                                  out + offset, group, num_kv_heads, h, 128, block_size, scale, scores, &ahead);
                else
                    attend_one_i8(q + offset, k_cache, v_cache, k_scales, v_scales, blocks, seq_lens[b],
                                  out + offset, group, num_kv_heads, h, head_dim, block_size, scale, scores, &ahead);
            }
        }
        free(scores);
    }
    return 0;
}
