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
#include "cpu_rows.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define BLOCK 16 /* scores computed a block of positions at a time */

/* One (row, kv head) pair: `group` query heads against one kv head's context. */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, SUFFIX)                                                     \
    static inline __attribute__((always_inline)) void NAME##_one(const T *q, const T *k_cache, const T *v_cache, const int64_t *pages, \
                           int64_t context_len, T *out, int64_t group, int64_t head_dim,         \
                           int64_t page_size, int64_t page_stride, float scale) {                \
        float query[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                      \
        float running_max[MAX_GROUP], denom[MAX_GROUP], scores[MAX_GROUP][BLOCK];                \
        float key[BLOCK][MAX_HEAD_DIM];                                                          \
        for (int64_t g = 0; g < group; g++) {                                                    \
            for (int64_t d = 0; d < head_dim; d++) {                                             \
                query[g][d] = LOAD(q[g * head_dim + d]) * scale;                                 \
                acc[g][d] = 0.0f;                                                                \
            }                                                                                    \
            running_max[g] = -INFINITY;                                                          \
            denom[g] = 0.0f;                                                                     \
        }                                                                                        \
        for (int64_t start = 0; start < context_len; start += BLOCK) {                           \
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
        for (int64_t g = 0; g < group; g++)                                                      \
            for (int64_t d = 0; d < head_dim; d++)                                               \
                out[g * head_dim + d] = STORE(acc[g][d] / denom[g]);                             \
    }                                                                                            \
                                                                                                 \
    /* Rows [row_begin, row_end); q and out rows `q_stride` and `out_stride` elements apart. */ \
    static void NAME##_rows(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,   \
                            const int64_t *page_table, const int64_t *context_lens, T *out,      \
                            int64_t out_stride, int64_t row_begin, int64_t row_end,              \
                            int64_t kv_heads, int64_t group, int64_t head_dim,                   \
                            int64_t num_pages, int64_t page_size, int64_t max_pages,             \
                            float scale) {                                                       \
        int64_t page_stride = page_size * head_dim;                                              \
        int64_t head_stride = num_pages * page_stride;                                           \
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                     \
        for (int64_t r = row_begin; r < row_end; r++) {                                          \
            for (int64_t h = 0; h < kv_heads; h++) {                                             \
                const T *qh = q + r * q_stride + h * group * head_dim;                           \
                T *oh = out + r * out_stride + h * group * head_dim;                             \
                const int64_t *pages = page_table + r * max_pages;                               \
                const T *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;        \
                /* Constant head sizes let the compiler unroll and vectorise fully. */           \
                if (head_dim == 64 && page_size == 16)                                           \
                    NAME##_one(qh, kh, vh, pages, context_lens[r], oh, group, 64, 16, 16 * 64,   \
                               scale);                                                           \
                else if (head_dim == 128 && page_size == 16)                                     \
                    NAME##_one(qh, kh, vh, pages, context_lens[r], oh, group, 128, 16,           \
                               16 * 128, scale);                                                 \
                else                                                                             \
                    NAME##_one(qh, kh, vh, pages, context_lens[r], oh, group, head_dim,          \
                               page_size, page_stride, scale);                                   \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *page_table,          \
             const int64_t *context_lens, T *out, int64_t row_begin, int64_t row_end,            \
             int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,               \
             int64_t page_size, int64_t max_pages, float scale) {                                \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                             \
        int64_t row_stride = kv_heads * group * head_dim;                                        \
        _Pragma("omp parallel")                                                                  \
        NAME##_rows(q, row_stride, k_cache, v_cache, page_table, context_lens, out, row_stride,  \
                    row_begin, row_end, kv_heads, group, head_dim, num_pages, page_size,         \
                    max_pages, scale);                                                           \
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
                        scale);                                                                  \
        }                                                                                        \
        return 0;                                                                                \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16, bf16)
DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32, STORE_F32, f32)
