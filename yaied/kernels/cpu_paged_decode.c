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
 * yaied.worker.attention._decode_attention. No OpenMP: the engine's torch thread pool owns the
 * cores; rows are split across calls by the launcher when that pays.
 */
#include "cpu_common.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define BLOCK 16 /* scores computed a block of positions at a time */

/* One (row, kv head) pair: `group` query heads against one kv head's context. */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                       \
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
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *page_table,          \
             const int64_t *context_lens, T *out, int64_t row_begin, int64_t row_end,            \
             int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,               \
             int64_t page_size, int64_t max_pages, float scale) {                                \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                             \
        int64_t page_stride = page_size * head_dim;                                              \
        int64_t head_stride = num_pages * page_stride;                                           \
        int64_t row_stride = kv_heads * group * head_dim;                                        \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                           \
        for (int64_t r = row_begin; r < row_end; r++) {                                          \
            for (int64_t h = 0; h < kv_heads; h++) {                                             \
                int64_t offset = r * row_stride + h * group * head_dim;                          \
                const int64_t *pages = page_table + r * max_pages;                               \
                /* Constant head sizes let the compiler unroll and vectorise fully. */           \
                if (head_dim == 64 && page_size == 16)                                           \
                    NAME##_one(q + offset, k_cache + h * head_stride, v_cache + h * head_stride, \
                               pages, context_lens[r], out + offset, group, 64, 16, 16 * 64,     \
                               scale);                                                           \
                else if (head_dim == 128 && page_size == 16)                                     \
                    NAME##_one(q + offset, k_cache + h * head_stride, v_cache + h * head_stride, \
                               pages, context_lens[r], out + offset, group, 128, 16, 16 * 128,   \
                               scale);                                                           \
                else                                                                             \
                    NAME##_one(q + offset, k_cache + h * head_stride, v_cache + h * head_stride, \
                               pages, context_lens[r], out + offset, group, head_dim,            \
                               page_size, page_stride, scale);                                   \
            }                                                                                    \
        }                                                                                        \
        return 0;                                                                                \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32, STORE_F32)
