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

/* Eight dot products of length dim (a multiple of 8) at once: out[j] = q . key[j]. Each pair
 * accumulates in 8 lanes, then one transpose-and-add tree sums the eight vectors' lanes (7 adds
 * and 14 shuffles where eight separate horizontal sums took 48 steps). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
typedef int v8i __attribute__((vector_size(32)));

static inline v8 loadv8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8 dots8(const float *q, const float (*key)[MAX_HEAD_DIM], int64_t dim) {
    v8 a[8];
    for (int j = 0; j < 8; j++) a[j] = (v8){0};
    for (int64_t d = 0; d < dim; d += 8) {
        v8 qv = loadv8(q + d);
        for (int j = 0; j < 8; j++) a[j] += qv * loadv8(key[j] + d);
    }
    v8 x = SHUF(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
    v8 y = SHUF(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
    v8 z = SHUF(a[4], a[5], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a[4], a[5], 1, 9, 3, 11, 5, 13, 7, 15);
    v8 w = SHUF(a[6], a[7], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a[6], a[7], 1, 9, 3, 11, 5, 13, 7, 15);
    /* x: [a0 01, a1 01, a0 23, a1 23, a0 45, a1 45, a0 67, a1 67] (lane pairs summed) */
    v8 u = SHUF(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 v = SHUF(z, w, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(z, w, 2, 3, 10, 11, 6, 7, 14, 15);
    /* u: [a0..a3 over lanes 0-3, a0..a3 over lanes 4-7] */
    return SHUF(u, v, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u, v, 4, 5, 6, 7, 12, 13, 14, 15);
}

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
            for (int64_t i = n; i < BLOCK && i % 8; i++) /* the last block's padding */          \
                for (int64_t d = 0; d < head_dim; d++) key[i][d] = 0.0f;                         \
            if (head_dim % 8 == 0)                                                               \
                for (int64_t g = 0; g < group; g++)                                              \
                    for (int64_t i0 = 0; i0 < n; i0 += 8) {                                      \
                        v8 s8 = dots8(query[g], key + i0, head_dim);                             \
                        memcpy(scores[g] + i0, &s8, sizeof s8);                                  \
                    }                                                                            \
            else                                                                                 \
                for (int64_t g = 0; g < group; g++)                                              \
                    for (int64_t i = 0; i < n; i++) {                                            \
                        float s = 0.0f;                                                          \
                        for (int64_t d = 0; d < head_dim; d++) s += query[g][d] * key[i][d];     \
                        scores[g][i] = s;                                                        \
                    }                                                                            \
            for (int64_t g = 0; g < group; g++) {                                                \
                float block_max = -INFINITY;                                                     \
                for (int64_t i = 0; i < n; i++)                                                  \
                    block_max = scores[g][i] > block_max ? scores[g][i] : block_max;             \
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
