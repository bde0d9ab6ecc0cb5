/* Paged decode attention for the CPU: one query token per row, reading K/V straight from the
 * page pool (no gather copy), one pass over the context with an online softmax.
 *
 * Layouts (all contiguous):
 *   q, out       [rows, kv_heads * group, head_dim]     (head h reads kv head h / group)
 *   k/v cache    [kv_heads, num_pages, page_size, head_dim]
 *   page_table   [rows, max_pages] int64
 *   context_lens [rows] int64: row r attends to positions [0, context_lens[r])
 *
 * Built by yaied/kernels/cpu_decode.py with the system C compiler; the torch reference is
 * yaied.worker.attention._decode_attention. (row, kv head) pairs are split across the calling
 * thread's OpenMP team (the engine's worker thread: torch's team). The `_step` entry does a
 * decode-only step's rotary and K/V write too, in the same parallel region.
 *
 * The pass is bound by memory: W-mixed's 32 rows over about 350 positions read 258 MB of K/V a
 * step. Two things keep it near the machine's bandwidth: the next pages are prefetched (the page
 * table scatters them, so the hardware prefetcher stops at every page edge), and each block of
 * positions is widened to fp32 once for all the group's query heads, whose scores, softmax and
 * sums stay in vectors (GCC vector types, so the one source builds at every ISA level).
 */
#include "cpu_rows.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
/* GCC vector types: one source serves every ISA level. A block is one vector's lanes of positions
 * (8 where AVX2 or AVX-512 is there: 16 lanes measured no faster with AVX-512; else 4, one SSE or
 * NEON register), so the scores of one query head for a block are one vector. */
#if defined(__AVX2__)
#define BLOCK 8
#else
#define BLOCK 4
#endif
/* Positions prefetched ahead: pages are scattered, so the hardware cannot guess. Into L2, not
 * L1 (locality 1): an L1 prefetch holds one of the core's few L1 miss buffers until its line
 * comes, so the lines in flight were few; to L2, W-mixed's K/V pass (32 rows x 330 positions,
 * 30 layers, from memory) went from 13 to 17.6 GB/s in fp32 and 9.4 to 14.1 in bf16 on a Zen 4
 * (8 to 24 positions ahead the same; no prefetch at all was slower still). */
#define AHEAD 16
typedef float vf __attribute__((vector_size(BLOCK * 4)));
typedef int32_t vi __attribute__((vector_size(BLOCK * 4)));
typedef uint16_t vbf __attribute__((vector_size(BLOCK * 2)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf load_bf16(const uint16_t *p) {
    vbf h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
}

/* BLOCK dot products' lane vectors to one vector of their sums (lane i: a[i]'s sum): a
 * transposing tree of BLOCK - 1 adds where BLOCK horizontal sums take BLOCK log2(BLOCK). */
static inline vf sum_lanes(const vf *a) {
#if BLOCK == 8
    vf x[4], y[2];
    for (int j = 0; j < 4; j++)
        x[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF(a[2 * j], a[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    /* x[j] lanes (2m, 2m + 1): a[2j], a[2j + 1] over lanes 2m and 2m + 1 */
    for (int j = 0; j < 2; j++)
        y[j] = SHUF(x[2 * j], x[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF(x[2 * j], x[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    /* y[j] lanes 0-3: a[4j..4j+3] over lanes 0-3; lanes 4-7: the same over lanes 4-7 */
    return SHUF(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
    vf x[2];
    for (int j = 0; j < 2; j++)
        x[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 4, 2, 6) + SHUF(a[2 * j], a[2 * j + 1], 1, 5, 3, 7);
    /* x[j] lanes (2m, 2m + 1): a[2j], a[2j + 1] over lanes 2m and 2m + 1 */
    return SHUF(x[0], x[1], 0, 1, 4, 5) + SHUF(x[0], x[1], 2, 3, 6, 7);
#endif
}

static inline float max_lanes(vf x) {
    float m = x[0];
    for (int i = 1; i < BLOCK; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* 2^x for -125 <= x <= 0 on a vector: exp_nonpositive's polynomial (cpu_common.h) for 2^f on
 * (0, 1], with x = n + f and n = trunc(x) - 1 (truncation is the floor's ceiling for x < 0). */
static inline vf exp2_nonpositive_v(vf x) {
    vf low = (vf){0} - 125.0f;
    x = (vf)(((vi)x & ~(x < low)) | ((vi)low & (x < low)));
    vi n = __builtin_convertvector(x, vi) - 1;
    vf f = x - __builtin_convertvector(n, vf);
    return EXP2_FRACTION(f) * (vf)((n + 127) << 23);
}

/* One (row, kv head) pair: `group` query heads against one kv head's context. A block's K and V
 * rows are widened to fp32 once and serve every query head of the group; each head's scores are
 * one vector, its softmax sum BLOCK partial sums, its output head_dim / BLOCK vectors. */
#define DEFINE_KERNEL(NAME, T, LOAD, LOADV, STORE, SUFFIX)                                         \
    static inline void NAME##_widen(const T *src, vf *dst, int64_t head_dim) {                     \
        int64_t c = 0;                                                                             \
        for (; c + BLOCK <= head_dim; c += BLOCK) dst[c / BLOCK] = LOADV(src + c);                 \
        if (c < head_dim) { /* a head size that is no multiple of BLOCK: zeros past its end */     \
            float tail[BLOCK] = {0};                                                               \
            for (int64_t d = c; d < head_dim; d++) tail[d - c] = LOAD(src[d]);                     \
            memcpy(dst + c / BLOCK, tail, sizeof tail);                                            \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void NAME##_one(                                 \
        const T *q, const T *k_cache, const T *v_cache, const int64_t *pages,                   \
                           int64_t context_len, T *out, int64_t group, int64_t head_dim,           \
                           int64_t page_size, int64_t page_stride, float scale) {                  \
        const int64_t chunks = (head_dim + BLOCK - 1) / BLOCK;                                     \
        const float log2e = 1.44269504088896341f;                                                  \
        vf query[MAX_GROUP][chunks], acc[MAX_GROUP][chunks], key[BLOCK][chunks],                   \
            value[BLOCK][chunks], sums[MAX_GROUP];                                                 \
        float running_max[MAX_GROUP], probs[MAX_GROUP][BLOCK];                                     \
        for (int64_t g = 0; g < group; g++) {                                                      \
            NAME##_widen(q + g * head_dim, query[g], head_dim);                                    \
            for (int64_t c = 0; c < chunks; c++) {                                                 \
                query[g][c] *= scale * log2e; /* scores in log2 units: exp2 exponentiates */       \
                acc[g][c] = (vf){0};                                                               \
            }                                                                                      \
            running_max[g] = -INFINITY;                                                            \
            sums[g] = (vf){0};                                                                     \
        }                                                                                          \
        for (int64_t start = 0; start < context_len; start += BLOCK) {                             \
            int64_t n = context_len - start < BLOCK ? context_len - start : BLOCK;                 \
            for (int64_t pos = start + AHEAD; pos < start + AHEAD + BLOCK && pos < context_len;    \
                 pos++) {                                                                          \
                int64_t at = pages[pos / page_size] * page_stride + (pos % page_size) * head_dim;  \
                for (int64_t b = 0; b < head_dim * (int64_t)sizeof(T); b += 64) {                  \
                    __builtin_prefetch((const char *)(k_cache + at) + b, 0, 1);                    \
                    __builtin_prefetch((const char *)(v_cache + at) + b, 0, 1);                    \
                }                                                                                  \
            }                                                                                      \
            for (int64_t i = 0; i < BLOCK; i++) {                                                  \
                int64_t pos = start + (i < n ? i : n - 1); /* past the end: a copy, masked */      \
                int64_t at = pages[pos / page_size] * page_stride + (pos % page_size) * head_dim;  \
                NAME##_widen(k_cache + at, key[i], head_dim);                                      \
                NAME##_widen(v_cache + at, value[i], head_dim);                                    \
            }                                                                                      \
            for (int64_t g = 0; g < group; g++) {                                                  \
                vf dots[BLOCK];                                                                    \
                for (int64_t i = 0; i < BLOCK; i++) {                                              \
                    vf d = query[g][0] * key[i][0];                                                \
                    for (int64_t c = 1; c < chunks; c++) d += query[g][c] * key[i][c];             \
                    dots[i] = d;                                                                   \
                }                                                                                  \
                vf scores = sum_lanes(dots);                                                       \
                if (n < BLOCK)                                                                     \
                    for (int64_t i = n; i < BLOCK; i++) scores[i] = -INFINITY;                     \
                float block_max = max_lanes(scores);                                               \
                float new_max = block_max > running_max[g] ? block_max : running_max[g];           \
                if (new_max != running_max[g]) { /* seldom after the first blocks */               \
                    float rescale = running_max[g] == -INFINITY                                    \
                                        ? 0.0f                                                     \
                                        : exp_nonpositive((running_max[g] - new_max) / log2e);     \
                    sums[g] *= rescale;                                                            \
                    for (int64_t c = 0; c < chunks; c++) acc[g][c] *= rescale;                     \
                    running_max[g] = new_max;                                                      \
                }                                                                                  \
                vf p = exp2_nonpositive_v(scores - new_max);                                       \
                if (n < BLOCK)                                                                     \
                    for (int64_t i = n; i < BLOCK; i++) p[i] = 0.0f;                               \
                sums[g] += p;                                                                      \
                memcpy(probs[g], &p, sizeof p);                                                    \
            }                                                                                      \
            for (int64_t g = 0; g < group; g++)                                                    \
                for (int64_t i = 0; i < n; i++) {                                                  \
                    float p = probs[g][i];                                                         \
                    for (int64_t c = 0; c < chunks; c++) acc[g][c] += p * value[i][c];             \
                }                                                                                  \
        }                                                                                          \
        for (int64_t g = 0; g < group; g++) {                                                      \
            float denom = 0.0f;                                                                    \
            for (int i = 0; i < BLOCK; i++) denom += sums[g][i];                                   \
            float result[MAX_HEAD_DIM + BLOCK];                                                    \
            for (int64_t c = 0; c < chunks; c++) {                                                 \
                vf o = acc[g][c] / denom;                                                          \
                memcpy(result + BLOCK * c, &o, sizeof o);                                          \
            }                                                                                      \
            for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = STORE(result[d]);       \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Rows [row_begin, row_end); q and out rows `q_stride` and `out_stride` elements apart. */    \
    static void NAME##_rows(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,      \
                            const int64_t *page_table, const int64_t *context_lens, T *out,        \
                            int64_t out_stride, int64_t row_begin, int64_t row_end,                \
                            int64_t kv_heads, int64_t group, int64_t head_dim,                     \
                            int64_t num_pages, int64_t page_size, int64_t max_pages,               \
                            float scale) {                                                         \
        int64_t page_stride = page_size * head_dim;                                                \
        int64_t head_stride = num_pages * page_stride;                                             \
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                        \
        for (int64_t r = row_begin; r < row_end; r++) {                                            \
            for (int64_t h = 0; h < kv_heads; h++) {                                               \
                const T *qh = q + r * q_stride + h * group * head_dim;                             \
                T *oh = out + r * out_stride + h * group * head_dim;                               \
                const int64_t *pages = page_table + r * max_pages;                                 \
                const T *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;          \
                /* Constant head sizes let the compiler unroll and vectorise fully. */             \
                if (head_dim == 64 && page_size == 16)                                             \
                    NAME##_one(qh, kh, vh, pages, context_lens[r], oh, group, 64, 16, 16 * 64,     \
                               scale);                                                             \
                else if (head_dim == 128 && page_size == 16)                                       \
                    NAME##_one(qh, kh, vh, pages, context_lens[r], oh, group, 128, 16,             \
                               16 * 128, scale);                                                   \
                else                                                                               \
                    NAME##_one(qh, kh, vh, pages, context_lens[r], oh, group, head_dim,            \
                               page_size, page_stride, scale);                                     \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *page_table,            \
             const int64_t *context_lens, T *out, int64_t row_begin, int64_t row_end,              \
             int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,                 \
             int64_t page_size, int64_t max_pages, float scale) {                                  \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                               \
        int64_t row_stride = kv_heads * group * head_dim;                                          \
        _Pragma("omp parallel")                                                                    \
        NAME##_rows(q, row_stride, k_cache, v_cache, page_table, context_lens, out, row_stride,    \
                    row_begin, row_end, kv_heads, group, head_dim, num_pages, page_size,           \
                    max_pages, scale);                                                             \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    /* A decode-only step of one layer from its fused qkv rows [rows, (heads + 2 kv_heads) *       \
     * head_dim] (q_stride elements apart): rotate q and k in place (rotate-half; cos, sin         \
     * [rows, head_dim / 2] fp32), write k and v to the pools at slots[r], then attend as above    \
     * into out [rows, heads * head_dim]. One call where the general path takes five. */           \
    int NAME##_step(T *qkv, int64_t q_stride, const float *cos, const float *sin, T *k_cache,      \
                    T *v_cache, const int64_t *slots, const int64_t *page_table,                   \
                    const int64_t *context_lens, T *out, int64_t rows, int64_t kv_heads,           \
                    int64_t group, int64_t head_dim, int64_t num_pages, int64_t page_size,         \
                    int64_t max_pages, float scale) {                                              \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                               \
        int64_t heads = kv_heads * group, half = head_dim / 2;                                     \
        int64_t head_stride = num_pages * page_size * head_dim;                                    \
        _Pragma("omp parallel")                                                                    \
        {                                                                                          \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t r = 0; r < rows; r++) {                                                   \
                T *row = qkv + r * q_stride;                                                       \
                rotary_row_##SUFFIX(row, heads + kv_heads, head_dim, cos + r * half,               \
                                    sin + r * half);                                               \
                for (int64_t h = 0; h < kv_heads; h++) {                                           \
                    int64_t at = h * head_stride + slots[r] * head_dim;                            \
                    memcpy(k_cache + at, row + (heads + h) * head_dim, head_dim * sizeof(T));      \
                    memcpy(v_cache + at, row + (heads + kv_heads + h) * head_dim,                  \
                           head_dim * sizeof(T));                                                  \
                }                                                                                  \
            } /* the implicit barrier: every row's K/V is written before any row attends */        \
            NAME##_rows(qkv, q_stride, k_cache, v_cache, page_table, context_lens, out, heads * head_dim, \
                        0, rows, kv_heads, group, head_dim, num_pages, page_size, max_pages,       \
                        scale);                                                                    \
        }                                                                                          \
        return 0;                                                                                  \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_float, load_bf16, float_to_bf16, bf16)
DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32, load_f32, STORE_F32, f32)
