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
 */
#include <omp.h>

#include "cpu_rows.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define BLOCK 16 /* scores computed a block of positions at a time */

/* Partial results of one (row, kv head) pair over a span of its context, for each of the
 * `group` query heads: the running max, the softmax denominator and the unnormalised output. */
typedef struct {
    float max[MAX_GROUP], denom[MAX_GROUP], acc[MAX_GROUP][MAX_HEAD_DIM];
} Partial;

/* Rows x kv heads below this many per thread split their context across the team instead
 * (flash-decoding): one stream with 3 kv heads on 2 threads left one thread a head idle. */
#define SPLIT_MIN_POSITIONS 128 /* no split of contexts shorter than this per part */

/* Fold partial b into a (same row, kv head, query heads). */
static inline void merge_partial(Partial *a, const Partial *b, int64_t group, int64_t head_dim) {
    for (int64_t g = 0; g < group; g++) {
        float m = a->max[g] > b->max[g] ? a->max[g] : b->max[g];
        if (m == -INFINITY) continue; /* both empty */
        float sa = exp_nonpositive(a->max[g] - m), sb = exp_nonpositive(b->max[g] - m);
        for (int64_t d = 0; d < head_dim; d++) a->acc[g][d] = a->acc[g][d] * sa + b->acc[g][d] * sb;
        a->denom[g] = a->denom[g] * sa + b->denom[g] * sb;
        a->max[g] = m;
    }
}

/* One (row, kv head) pair: `group` query heads against one kv head's positions [begin, end). */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, SUFFIX)                                                     \
    static inline __attribute__((always_inline)) void NAME##_part(const T *q, const T *k_cache, const T *v_cache, const int64_t *pages, \
                           int64_t begin, int64_t context_len, Partial *part, int64_t group,     \
                           int64_t head_dim, int64_t page_size, int64_t page_stride, float scale) { \
        float query[MAX_GROUP][MAX_HEAD_DIM];                                                    \
        float (*acc)[MAX_HEAD_DIM] = part->acc;                                                  \
        float *running_max = part->max, *denom = part->denom, scores[MAX_GROUP][BLOCK];          \
        float key[BLOCK][MAX_HEAD_DIM];                                                          \
        for (int64_t g = 0; g < group; g++) {                                                    \
            for (int64_t d = 0; d < head_dim; d++) {                                             \
                query[g][d] = LOAD(q[g * head_dim + d]) * scale;                                 \
                acc[g][d] = 0.0f;                                                                \
            }                                                                                    \
            running_max[g] = -INFINITY;                                                          \
            denom[g] = 0.0f;                                                                     \
        }                                                                                        \
        for (int64_t start = begin; start < context_len; start += BLOCK) {                       \
            int64_t n = context_len - start < BLOCK ? context_len - start : BLOCK;               \
            for (int64_t i = 0; i < n; i++) {                                                    \
                int64_t pos = start + i;                                                         \
                const T *k = k_cache + pages[pos / page_size] * page_stride +                    \
                             (pos % page_size) * head_dim;                                       \
                for (int64_t d = 0; d < head_dim; d++) key[i][d] = LOAD(k[d]);                   \
            }                                                                                    \
            for (int64_t g = 0; g < group; g++) {                                                \
                float block_max = -INFINITY;                                                     \
                for (int64_t i = 0; i < n; i++) {                                                \
                    float s = 0.0f;                                                              \
                    for (int64_t d = 0; d < head_dim; d++) s += query[g][d] * key[i][d];         \
                    scores[g][i] = s;                                                            \
                    block_max = s > block_max ? s : block_max;                                   \
                }                                                                                \
                float new_max = block_max > running_max[g] ? block_max : running_max[g];         \
                float rescale = exp_nonpositive(running_max[g] - new_max);                       \
                denom[g] *= rescale;                                                             \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= rescale;                     \
                float sum = 0.0f;                                                                \
                for (int64_t i = 0; i < n; i++) {                                                \
                    scores[g][i] = exp_nonpositive(scores[g][i] - new_max);                      \
                    sum += scores[g][i];                                                         \
                }                                                                                \
                denom[g] += sum;                                                                 \
                running_max[g] = new_max;                                                        \
            }                                                                                    \
            for (int64_t i = 0; i < n; i++) {                                                    \
                int64_t pos = start + i;                                                         \
                const T *v = v_cache + pages[pos / page_size] * page_stride +                    \
                             (pos % page_size) * head_dim;                                       \
                float value[MAX_HEAD_DIM];                                                       \
                for (int64_t d = 0; d < head_dim; d++) value[d] = LOAD(v[d]);                    \
                for (int64_t g = 0; g < group; g++) {                                            \
                    float p = scores[g][i];                                                      \
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * value[d];            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    static inline void NAME##_finish(const Partial *part, T *out, int64_t group,                 \
                                     int64_t head_dim) {                                         \
        for (int64_t g = 0; g < group; g++)                                                      \
            for (int64_t d = 0; d < head_dim; d++)                                               \
                out[g * head_dim + d] = STORE(part->acc[g][d] / part->denom[g]);                 \
    }                                                                                            \
                                                                                                 \
    /* Positions [begin, end) of one (row, kv head) pair; sizes as constants where they are the \
     * common ones, so that the compiler unrolls and vectorises fully. */                       \
    static void NAME##_span(const T *q, const T *k_cache, const T *v_cache, const int64_t *pages, \
                            int64_t begin, int64_t end, Partial *part, int64_t group,            \
                            int64_t head_dim, int64_t page_size, float scale) {                  \
        if (head_dim == 64 && page_size == 16)                                                   \
            NAME##_part(q, k_cache, v_cache, pages, begin, end, part, group, 64, 16, 16 * 64,     \
                        scale);                                                                  \
        else if (head_dim == 128 && page_size == 16)                                             \
            NAME##_part(q, k_cache, v_cache, pages, begin, end, part, group, 128, 16, 16 * 128,   \
                        scale);                                                                  \
        else                                                                                     \
            NAME##_part(q, k_cache, v_cache, pages, begin, end, part, group, head_dim,           \
                        page_size, page_size * head_dim, scale);                                 \
    }                                                                                            \
                                                                                                 \
    /* Rows [row_begin, row_end); q and out rows `q_stride` and `out_stride` elements apart.  \
     * Called inside a parallel region; `parts` (splits Partials per (row, kv head) pair,       \
     * shared by the team) is used when splits > 1. */                                          \
    static void NAME##_rows(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,   \
                            const int64_t *page_table, const int64_t *context_lens, T *out,      \
                            int64_t out_stride, int64_t row_begin, int64_t row_end,              \
                            int64_t kv_heads, int64_t group, int64_t head_dim,                   \
                            int64_t num_pages, int64_t page_size, int64_t max_pages,             \
                            float scale, Partial *parts, int64_t splits) {                       \
        int64_t head_stride = num_pages * page_size * head_dim;                                  \
        int64_t pairs = (row_end - row_begin) * kv_heads;                                        \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int64_t unit = 0; unit < pairs * splits; unit++) {                                  \
            int64_t pair = unit / splits, split = unit % splits;                                 \
            int64_t r = row_begin + pair / kv_heads, h = pair % kv_heads;                        \
            int64_t len = context_lens[r];                                                       \
            /* Split boundaries on whole blocks of positions. */                                 \
            int64_t per = (len + splits * BLOCK - 1) / (splits * BLOCK) * BLOCK;                 \
            int64_t begin = split * per < len ? split * per : len;                               \
            int64_t end = begin + per < len ? begin + per : len;                                 \
            Partial local, *part = splits > 1 ? parts + unit : &local;                           \
            NAME##_span(q + r * q_stride + h * group * head_dim, k_cache + h * head_stride,      \
                        v_cache + h * head_stride, page_table + r * max_pages, begin, end, part, \
                        group, head_dim, page_size, scale);                                      \
            if (splits == 1) NAME##_finish(part, out + r * out_stride + h * group * head_dim,    \
                                           group, head_dim);                                     \
        } /* the implicit barrier: every part is done before they are merged */                  \
        if (splits == 1) return;                                                                 \
        _Pragma("omp for schedule(static)")                                                     \
        for (int64_t pair = 0; pair < pairs; pair++) {                                           \
            int64_t r = row_begin + pair / kv_heads, h = pair % kv_heads;                        \
            Partial *first = parts + pair * splits;                                              \
            for (int64_t split = 1; split < splits; split++)                                     \
                merge_partial(first, first + split, group, head_dim);                            \
            NAME##_finish(first, out + r * out_stride + h * group * head_dim, group, head_dim);  \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* How many parts each (row, kv head) pair's context is cut into, and their scratch: more   \
     * than one only when the pairs are too few to keep the team busy. NULL scratch: no split. */ \
    static int64_t NAME##_splits(const int64_t *context_lens, int64_t rows, int64_t kv_heads,   \
                                 Partial **parts) {                                              \
        int64_t threads = omp_get_max_threads(), pairs = rows * kv_heads, shortest = INT64_MAX;  \
        *parts = NULL;                                                                           \
        if (threads < 2 || pairs >= 2 * threads) return 1;                                       \
        for (int64_t r = 0; r < rows; r++)                                                       \
            shortest = context_lens[r] < shortest ? context_lens[r] : shortest;                  \
        int64_t splits = (2 * threads + pairs - 1) / pairs;                                      \
        if (shortest / splits < SPLIT_MIN_POSITIONS) return 1;                                   \
        *parts = thread_scratch(0, (size_t)(pairs * splits) * sizeof(Partial));                  \
        return *parts ? splits : 1;                                                              \
    }                                                                                            \
                                                                                                 \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *page_table,          \
             const int64_t *context_lens, T *out, int64_t row_begin, int64_t row_end,            \
             int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,               \
             int64_t page_size, int64_t max_pages, float scale) {                                \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                             \
        int64_t row_stride = kv_heads * group * head_dim;                                        \
        Partial *parts;                                                                          \
        int64_t splits = NAME##_splits(context_lens + row_begin, row_end - row_begin, kv_heads,  \
                                       &parts);                                                  \
        _Pragma("omp parallel")                                                                  \
        NAME##_rows(q, row_stride, k_cache, v_cache, page_table, context_lens, out, row_stride,  \
                    row_begin, row_end, kv_heads, group, head_dim, num_pages, page_size,         \
                    max_pages, scale, parts, splits);                                            \
        return 0;                                                                                \
    }                                                                                            \
                                                                                                 \
    /* A decode-only step of one layer from its fused qkv rows [rows, (heads + 2 kv_heads) *     \
     * head_dim] (q_stride elements apart): rotate q and k in place (rotate-half; cos, sin      \
     * [rows, head_dim / 2] fp32), write k and v to the pools at slots[r], then attend as above  \
     * into out [rows, heads * head_dim]. One call where the general path takes five. */         \
    int NAME##_step(T *qkv, int64_t q_stride, const float *cos, const float *sin, T *k_cache,   \
                    T *v_cache, const int64_t *slots, const int64_t *page_table,                 \
                    const int64_t *context_lens, T *out, int64_t rows, int64_t kv_heads,         \
                    int64_t group, int64_t head_dim, int64_t num_pages, int64_t page_size,       \
                    int64_t max_pages, float scale) {                                            \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                             \
        int64_t heads = kv_heads * group, half = head_dim / 2;                                   \
        int64_t head_stride = num_pages * page_size * head_dim;                                  \
        Partial *parts;                                                                          \
        int64_t splits = NAME##_splits(context_lens, rows, kv_heads, &parts);                    \
        _Pragma("omp parallel")                                                                  \
        {                                                                                        \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t r = 0; r < rows; r++) {                                                 \
                T *row = qkv + r * q_stride;                                                     \
                rotary_row_##SUFFIX(row, heads + kv_heads, head_dim, cos + r * half,             \
                                    sin + r * half);                                             \
                for (int64_t h = 0; h < kv_heads; h++) {                                         \
                    int64_t at = h * head_stride + slots[r] * head_dim;                          \
                    memcpy(k_cache + at, row + (heads + h) * head_dim, head_dim * sizeof(T));    \
                    memcpy(v_cache + at, row + (heads + kv_heads + h) * head_dim,                \
                           head_dim * sizeof(T));                                                \
                }                                                                                \
            } /* the implicit barrier: every row's K/V is written before any row attends */     \
            NAME##_rows(qkv, q_stride, k_cache, v_cache, page_table, context_lens, out, heads * head_dim, \
                        0, rows, kv_heads, group, head_dim, num_pages, page_size, max_pages,     \
                        scale, parts, splits);                                                   \
        }                                                                                        \
        return 0;                                                                                \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16, bf16)
DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32, STORE_F32, f32)
