// Paged decode attention for bfloat16 KV caches on AVX512-BF16 CPUs.
//
// One query token per request attends to its first seq_lens[b] cached tokens, read in place from the
// paged cache through its block table (no gather), or, with bounds, to a pattern of them: the sinks, strided keys
// and a window (row_segments; leanlm/model/attention_pattern.py), never reading the blocks between. Work item =
// (request, KV head): its G = H / Hkv query heads share every K/V load. Two passes: scores (bf16 dot products, fp32 accumulate), then a softmax with
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
    int64_t num_blocks, first_block;
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
                p->block = p->first_block;
                p->base++;
            }
        }
    }
}

// The requests of a step handed out one at a time (the next unclaimed one, by an atomic counter).
static inline int64_t claim(int64_t* next) { return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); }

// Point the prefetcher at request r's blocks (nothing when r is past the last request).
// (With bounds: from the window's first block; the sinks' block is read by every step, so it stays cached.)
static inline void next_request(prefetcher* p, int64_t r, int64_t num_reqs, const int64_t* block_tables,
                                int max_blocks, const int64_t* seq_lens, const int64_t* bounds, int block_size) {
    if (r >= num_reqs || seq_lens[r] <= 0) {
        p->count = 0;
        return;
    }
    const int64_t lo = bounds != NULL && bounds[3 * r] > 0 && bounds[3 * r] < seq_lens[r] ? bounds[3 * r] : 0;
    p->first_block = lo / block_size;
    p->blocks = block_tables + r * max_blocks;
    p->num_blocks = (seq_lens[r] + block_size - 1) / block_size;
    p->base = p->offset = 0;
    p->block = p->first_block;
}

// Lane partial sums of 16 keys -> their 16 horizontal sums in one vector, lane i = key i: a transpose in four
// rounds of shuffles and adds (30 instructions, where 16 _mm512_reduce_add_ps take about 130). Each key's lanes
// are paired as _mm512_reduce_add_ps pairs them, (j, j+8), (j, j+4), (j, j+2), (j, j+1), so every sum has the
// bits one reduce per key gives. SLOT holds which key enters each input slot: the rounds leave slot s's sum in
// lane SLOT[s], and SLOT is its own inverse, so lane i ends up holding key i.
static const int SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

static inline __m512 sum16(const __m512* key) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) {
        const __m512 a = key[SLOT[2 * i]], b = key[SLOT[2 * i + 1]];
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    }
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
}

// Scores of the G query heads against n <= 16 consecutive bf16 key rows (row stride D): out[g * stride + i] =
// (q_g . k_i) * row_scale[i] * scale (row_scale NULL: `scale` alone). Each dot product is D/32 vdpbf16ps steps
// in fp32 lanes, then its horizontal sum (sum16).
static inline void score_rows(const __m512bh* q, int group, int chunks, const uint16_t* k, int n,
                              const float* row_scale, float scale, float* out, int64_t stride) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 scales = row_scale ? _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row_scale), _mm512_set1_ps(scale))
                                    : _mm512_set1_ps(scale);
    for (int g = 0; g < group; g++) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_setzero_ps();
            if (i < n)
                for (int c = 0; c < chunks; c++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], q[g * chunks + c],
                                              (__m512bh)_mm512_loadu_si512((const void*)(k + (i * chunks + c) * 32)));
        }
        _mm512_mask_storeu_ps(out + g * stride, mask, _mm512_mul_ps(sum16(acc), scales));
    }
}

// Each of the G rows of scores [G, seq_len] becomes its softmax, in place.
static inline void softmax_rows(float* scores, int group, int64_t seq_len) {
    for (int g = 0; g < group; g++) {
        float* s = scores + g * seq_len;
        __m512 lanes_max = _mm512_set1_ps(-INFINITY);  // the max is exact in any order
        int64_t t = 0;
        for (; t + 16 <= seq_len; t += 16) lanes_max = _mm512_max_ps(lanes_max, _mm512_loadu_ps(s + t));
        float m = _mm512_reduce_max_ps(lanes_max);
        for (; t < seq_len; t++) m = s[t] > m ? s[t] : m;
        __m512 vmax = _mm512_set1_ps(m), vsum = _mm512_setzero_ps();
        t = 0;
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
        const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
        const __m512 vinv = _mm512_set1_ps(inv);
        for (t = 0; t + 16 <= seq_len; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), vinv));
        for (; t < seq_len; t++) s[t] *= inv;
    }
}

// The keys one query reads, as up to three runs of positions (start, start + step, ... below end): the sinks
// [0, min(sinks, lo)), read with the sink query; with stride > 0, every stride-th key between them and the window
// whose distance to the query is a multiple of stride (Sparse Transformer); the window [lo, seq_len). No bounds, or
// lo <= 0: every key, in one run. Scores are laid out in this order, `count` per query head.
typedef struct {
    int64_t start, end, step;
} segment;

static inline int row_segments(int64_t seq_len, const int64_t* bounds /* lo, sinks, stride; or NULL */, segment* seg,
                               int64_t* count) {
    if (bounds == NULL || bounds[0] <= 0) {
        seg[0] = (segment){0, seq_len, 1};
        *count = seq_len;
        return 1;
    }
    const int64_t lo = bounds[0] < seq_len ? bounds[0] : seq_len;
    const int64_t sinks = bounds[1] < lo ? bounds[1] : lo, stride = bounds[2];
    int n = 0;
    seg[n++] = (segment){0, sinks, 1};  // always first (maybe empty): the only run read with the sink query
    if (stride > 0 && sinks < lo) {
        const int64_t p = seq_len - 1, first = p - ((p - sinks) / stride) * stride;  // the least j >= sinks, p - j = k * stride
        if (first < lo) seg[n++] = (segment){first, lo, stride};
    }
    seg[n++] = (segment){lo, seq_len, 1};
    *count = 0;
    for (int i = 0; i < n; i++)
        if (seg[i].end > seg[i].start) *count += (seg[i].end - seg[i].start + seg[i].step - 1) / seg[i].step;
    return n;
}

// Keys from position t of a run that sit next to each other in one block (strided runs: one).
static inline int64_t run_length(const segment* s, int64_t t, int block_size) {
    if (s->step != 1) return 1;
    const int64_t in_block = block_size - t % block_size;
    return s->end - t < in_block ? s->end - t : in_block;
}

// out_g = sum_t p[g, t] * v_t for the heads g0 .. g0 + GB - 1, each sum over the runs' keys in order. GB and LANES
// (D / 16) are literals where this is inlined, so the GB x LANES fp32 accumulators stay in registers (indexed by a
// runtime group they lived on the stack, a load and a store around every FMA). INT8: v is an int8 cache with one
// scale per row (v_scales), folded into the softmax weight.
static inline __attribute__((always_inline)) void v_heads(const float* scores, int64_t count, const segment* segs,
                                                          int nsegs, const void* v_cache, const float* v_scales,
                                                          const int64_t* blocks, int64_t block_stride,
                                                          int64_t head_offset, int64_t scale_block_stride,
                                                          int64_t scale_offset, int block_size, uint16_t* out_heads,
                                                          int g0, const int GB, const int LANES, const int INT8,
                                                          prefetcher* ahead) {
    __m512 acc[4][MAX_HEAD_DIM / 16];
    for (int g = 0; g < GB; g++)
        for (int l = 0; l < LANES; l++) acc[g][l] = _mm512_setzero_ps();
    int64_t idx = 0;  // score index of the next key
    for (int si = 0; si < nsegs; si++) {
        const segment* sg = segs + si;
        for (int64_t t = sg->start; t < sg->end;) {
            const int64_t n = run_length(sg, t, block_size), off = t % block_size;
            const int64_t block = blocks[t / block_size], at = block * block_stride + head_offset + off * LANES * 16;
            const float* vs = INT8 ? v_scales + block * scale_block_stride + scale_offset + off : NULL;
            for (int64_t i = 0; i < n; i++, idx++) {
                if (g0 == 0) prefetch_some(ahead);
                __m512 w[4];
                for (int g = 0; g < GB; g++) {
                    const float p = scores[(g0 + g) * count + idx];
                    w[g] = _mm512_set1_ps(INT8 ? p * vs[i] : p);
                }
                for (int l = 0; l < LANES; l++) {
                    const int64_t e = at + i * LANES * 16 + 16 * l;
                    const __m512 vf =
                        INT8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)v_cache + e))))
                             : _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)((const uint16_t*)v_cache + e)));
                    for (int g = 0; g < GB; g++) acc[g][l] = _mm512_fmadd_ps(w[g], vf, acc[g][l]);
                }
            }
            t += sg->step == 1 ? n : sg->step;
        }
    }
    for (int g = 0; g < GB; g++)
        for (int l = 0; l < LANES; l++)
            _mm256_storeu_si256((__m256i*)(out_heads + (g0 + g) * LANES * 16 + 16 * l),
                                (__m256i)_mm512_cvtneps_pbh(acc[g][l]));
}

// v_heads over all G heads, up to 4 at a time (2 for D = 128, 1 beyond: at most 16 accumulators).
static inline __attribute__((always_inline)) void v_pass(const float* scores, int64_t count, const segment* segs,
                                                         int nsegs, const void* v_cache, const float* v_scales,
                                                         const int64_t* blocks, int64_t block_stride,
                                                         int64_t head_offset, int64_t scale_block_stride,
                                                         int64_t scale_offset, int block_size, uint16_t* out_heads,
                                                         int group, const int LANES, const int INT8, prefetcher* ahead) {
    const int most = LANES <= 4 ? 4 : LANES <= 8 ? 2 : 1;
    for (int g0 = 0; g0 < group; g0 += most) {
        const int gb = group - g0 < most ? group - g0 : most;
#define V_HEADS(GB_)                                                                                                 \
    v_heads(scores, count, segs, nsegs, v_cache, v_scales, blocks, block_stride, head_offset, scale_block_stride,     \
            scale_offset, block_size, out_heads, g0, GB_, LANES, INT8, ahead)
        if (gb == 4) V_HEADS(4);
        else if (gb == 3) V_HEADS(3);
        else if (gb == 2) V_HEADS(2);
        else V_HEADS(1);
#undef V_HEADS
    }
}

// n <= 16 int8 key rows widened to bf16 (exact: int8 values are bf16 values), for score_rows.
static inline void widen_rows_i8(const int8_t* k, int n, int head_dim, uint16_t* out) {
    for (int64_t e = 0; e < (int64_t)n * head_dim; e += 32) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(k + e))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(k + e + 16))));
        _mm512_storeu_si512((void*)(out + e), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // lo: elements e..e+15
    }
}

static inline void load_query(const uint16_t* heads, int group, int chunks, int head_dim, __m512bh* q) {
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++)
            q[g * chunks + c] = (__m512bh)_mm512_loadu_si512((const void*)(heads + g * head_dim + 32 * c));
}

// One (request, KV head): the G query heads over the runs' keys of a bf16 cache [N, Hkv, bs, D], or (INT8) an int8
// one with scales [N, Hkv, bs]: k = k_i8 * k_scale, v = v_i8 * v_scale. The first run (the sinks) is scored with
// qs_heads, the query rotated at the sinks' re-based position, where given.
static inline __attribute__((always_inline)) void attend_one(
        const uint16_t* q_heads, const uint16_t* qs_heads, const void* k_cache, const void* v_cache,
        const float* k_scales, const float* v_scales, const int64_t* blocks, const segment* segs, int nsegs,
        int64_t count, uint16_t* out_heads, int group, int num_kv_heads, int kv_head, int head_dim, int block_size,
        float scale, float* scores /* [G, count] */, prefetcher* ahead, const int INT8) {
    const int chunks = head_dim / 32;
    __m512bh q[MAX_GROUP * (MAX_HEAD_DIM / 32)], qs[MAX_GROUP * (MAX_HEAD_DIM / 32)];
    load_query(q_heads, group, chunks, head_dim, q);
    const int sink_query = qs_heads != NULL && segs[0].end > segs[0].start && nsegs > 1;
    if (sink_query) load_query(qs_heads, group, chunks, head_dim, qs);
    // Blocks are [Hkv, block_size, D]: this head's rows of a block are one contiguous run of block_size * D.
    const int64_t head_stride = (int64_t)block_size * head_dim;
    const int64_t block_stride = head_stride * num_kv_heads;
    const int64_t scale_block_stride = (int64_t)block_size * num_kv_heads;
    uint16_t wide[INT8 ? 16 * MAX_HEAD_DIM : 1];
    int64_t idx = 0;
    for (int si = 0; si < nsegs; si++) {
        const segment* sg = segs + si;
        const __m512bh* qv = si == 0 && sink_query ? qs : q;
        for (int64_t t = sg->start; t < sg->end;) {
            const int64_t n = run_length(sg, t, block_size), off = t % block_size, block = blocks[t / block_size];
            const int64_t row0 = block * block_stride + kv_head * head_stride + off * head_dim;
            const float* ks = INT8 ? k_scales + block * scale_block_stride + (int64_t)kv_head * block_size + off : NULL;
            for (int64_t i = 0; i < n; i += 16) {
                const int m = n - i < 16 ? (int)(n - i) : 16;
                for (int r = 0; r < m; r++) prefetch_some(ahead);
                if (INT8) {
                    widen_rows_i8((const int8_t*)k_cache + row0 + i * head_dim, m, head_dim, wide);
                    score_rows(qv, group, chunks, wide, m, ks + i, scale, scores + idx + i, count);
                } else {
                    score_rows(qv, group, chunks, (const uint16_t*)k_cache + row0 + i * head_dim, m, NULL, scale,
                               scores + idx + i, count);
                }
            }
            idx += n;
            t += sg->step == 1 ? n : sg->step;
        }
    }
    softmax_rows(scores, group, count);
    v_pass(scores, count, segs, nsegs, v_cache, v_scales, blocks, block_stride, kv_head * head_stride,
           scale_block_stride, (int64_t)kv_head * block_size, block_size, out_heads, group, head_dim / 16, INT8, ahead);
}

// Every (request, KV head) of a step: requests claimed one at a time, the next one's blocks prefetched meanwhile.
static inline __attribute__((always_inline)) int attend_all(
        const uint16_t* q, const uint16_t* q_sink, const void* k_cache, const void* v_cache, const float* k_scales,
        const float* v_scales, const int64_t* block_tables, const int64_t* seq_lens, const int64_t* bounds,
        uint16_t* out, int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
        int64_t max_seq_len, float scale, int num_threads, const int INT8) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || num_heads % num_kv_heads) return -1;
    const int64_t elem = INT8 ? 1 : (int64_t)sizeof(uint16_t);
    const int64_t block_bytes = (int64_t)num_kv_heads * block_size * head_dim * elem;
    const int64_t scale_bytes = (int64_t)num_kv_heads * block_size * (int64_t)sizeof(float);
    int64_t next = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)group * (size_t)(max_seq_len > 0 ? max_seq_len : 1));
        // A request's KV heads go to one thread in a row: its K/V rows (all heads interleaved) come from
        // DRAM once, then from L2 for the other heads.
        for (int64_t b = claim(&next), after; b < num_reqs; b = after) {
            after = claim(&next);
            prefetcher ahead = {{(const char*)k_cache, (const char*)v_cache, (const char*)k_scales,
                                 (const char*)v_scales},
                                {block_bytes, block_bytes, scale_bytes, scale_bytes},
                                INT8 ? 4 : 2};
            next_request(&ahead, after, num_reqs, block_tables, max_blocks, seq_lens, bounds, block_size);
            const int64_t* blocks = block_tables + b * max_blocks;
            segment segs[3];
            int64_t count;
            const int nsegs = row_segments(seq_lens[b], bounds ? bounds + 3 * b : NULL, segs, &count);
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t offset = (b * num_heads + (int64_t)h * group) * head_dim;
                const uint16_t* qs = q_sink ? q_sink + offset : NULL;
                // Literal head dims let the compiler unroll the D loops and keep accumulators in registers.
#define ATTEND(D_)                                                                                                   \
    attend_one(q + offset, qs, k_cache, v_cache, k_scales, v_scales, blocks, segs, nsegs, count, out + offset, group, \
               num_kv_heads, h, D_, block_size, scale, scores, &ahead, INT8)
                if (head_dim == 64) ATTEND(64);
                else if (head_dim == 128) ATTEND(128);
                else ATTEND(head_dim);
#undef ATTEND
            }
        }
        free(scores);
    }
    return 0;
}

// q, out: [B, H, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [B, max_blocks]. bounds: NULL
// (every key), or [B, 3] int64 (lo, sinks, stride) per request; q_sink: NULL, or [B, H, D], the query the sinks are
// scored with. Returns 0, or -1 when the shape is outside what the kernel supports (the caller falls back).
int paged_decode_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_reqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                int64_t max_seq_len, float scale, int num_threads, const int64_t* bounds,
                                const uint16_t* q_sink) {
    return attend_all(q, q_sink, k_cache, v_cache, NULL, NULL, block_tables, seq_lens, bounds, out, num_reqs,
                      num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_seq_len, scale, num_threads, 0);
}

// As paged_decode_attention_bf16 over an int8 cache; k_scales, v_scales: [num_blocks, Hkv, block_size] fp32.
int paged_decode_attention_int8kv(const uint16_t* q, const int8_t* k_cache, const int8_t* v_cache,
                                  const float* k_scales, const float* v_scales, const int64_t* block_tables,
                                  const int64_t* seq_lens, uint16_t* out, int num_reqs, int num_heads,
                                  int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                  int64_t max_seq_len, float scale, int num_threads, const int64_t* bounds,
                                  const uint16_t* q_sink) {
    return attend_all(q, q_sink, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, bounds, out, num_reqs,
                      num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_seq_len, scale, num_threads, 1);
}
