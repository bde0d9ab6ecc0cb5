/* Paged prefill (extend) attention for the CPU: the queries of one chunk, causal over the chunk's
 * whole context read from the page pool, flash-style (blocks of keys, online softmax), so neither
 * the context nor the score matrix is ever materialised.
 *
 * Layouts (all contiguous):
 *   q, out      [num_tokens, kv_heads * group, head_dim]  (head h reads kv head h / group)
 *   k/v cache   [kv_heads, num_pages, page_size, head_dim]
 *   pages       [ceil(context_len / page_size)] int64, context_len = start_pos + num_tokens
 * Query i sits at position start_pos + i and attends to keys [0, start_pos + i].
 *
 * Two phases under one OpenMP region. First each kv head's context is repacked, a block of
 * KEY_BLOCK keys at a time, into the layout the inner loops read with unit stride (paging is
 * resolved here, once per call). Then each work item, (kv head, QUERY_BLOCK query positions),
 * runs the grouped query heads of those positions as the rows of one tile against every key
 * block up to its last position: S = Q K^T, the online softmax, O += P V.
 *
 * With AVX512-BF16, bf16 inputs are multiplied by vdpbf16ps (pairs of bf16 products summed
 * into fp32): K is packed as [head_dim / 2][KEY_BLOCK] pairs along head_dim and V as
 * [KEY_BLOCK / 2][head_dim] pairs along keys, P is rounded to bf16. Otherwise (fp32, or a CPU
 * without it) everything is converted to fp32 while packing and multiplied in fp32.
 * The torch reference is yaied.worker.attention._prefill_attention.
 */
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#define KEY_BLOCK 32
#define QUERY_BLOCK 32
#define ROW_PAD 8 /* row counts are padded to a multiple of this (of QK_ROWS and PV_ROWS) */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_ROWS (QUERY_BLOCK * MAX_GROUP)

/* The fp32 path's vectors and tiles: rows x vectors accumulators plus the loaded vectors fit in
 * 16 registers. 8 wide from AVX2 on, AVX-512 included: 16-wide vectors (the same code with
 * VW 16, or a 16-wide type on AVX2) compiled to registers spilled to the stack every step, and
 * ran 3 to 6 times slower (2.5 ms a layer against 7.3 and 15.4 for a 512-token chunk of the
 * default model's heads). 4 wide elsewhere (SSE, NEON). */
#if defined(__AVX2__)
#define VW 8
#define QK_ROWS 2 /* rows of the S register tile */
#else
#define VW 4
#define QK_ROWS 1
#endif
#define PV_ROWS 4 /* rows of the O register tile */
#define PV_VECS 2 /* its vectors a row (head_dim is a multiple of 16) */
#define NV (KEY_BLOCK / VW) /* vectors in a row of scores */

typedef float vfw __attribute__((vector_size(VW * 4), aligned(4)));

static inline vfw loadw(const float *p) {
    vfw v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storew(float *p, vfw v) { memcpy(p, &v, sizeof v); }

/* ---- fp32 path: Kt [head_dim][KEY_BLOCK], V [KEY_BLOCK][head_dim], Q [rows][head_dim] ---- */

static void scores_f32(const float *q, const float *kt, float *s, int64_t rows, int64_t dim,
                       float scale) {
    for (int64_t m0 = 0; m0 < rows; m0 += QK_ROWS) {
        vfw acc[QK_ROWS][NV];
        for (int r = 0; r < QK_ROWS; r++)
            for (int c = 0; c < NV; c++) acc[r][c] = (vfw){0};
        for (int64_t d = 0; d < dim; d++) {
            vfw k[NV];
            for (int c = 0; c < NV; c++) k[c] = loadw(kt + d * KEY_BLOCK + c * VW);
#pragma GCC unroll 8
            for (int r = 0; r < QK_ROWS; r++) {
                float x = q[(m0 + r) * dim + d];
                for (int c = 0; c < NV; c++) acc[r][c] += x * k[c];
            }
        }
        for (int r = 0; r < QK_ROWS; r++)
            for (int c = 0; c < NV; c++) storew(s + (m0 + r) * KEY_BLOCK + c * VW, acc[r][c] * scale);
    }
}

/* o = o * alpha + p @ v for PV_ROWS rows at a time, PV_VECS vectors of head_dim a step. */
static void accumulate_f32(const float *p, const float *v, float *o, const float *alpha,
                           int64_t rows, int64_t dim) {
    for (int64_t m0 = 0; m0 < rows; m0 += PV_ROWS) {
        for (int64_t d0 = 0; d0 < dim; d0 += PV_VECS * VW) {
            vfw acc[PV_ROWS][PV_VECS];
            for (int r = 0; r < PV_ROWS; r++)
                for (int c = 0; c < PV_VECS; c++)
                    acc[r][c] = loadw(o + (m0 + r) * dim + d0 + c * VW) * alpha[m0 + r];
            for (int64_t j = 0; j < KEY_BLOCK; j++) {
                vfw value[PV_VECS];
                for (int c = 0; c < PV_VECS; c++) value[c] = loadw(v + j * dim + d0 + c * VW);
#pragma GCC unroll 8
                for (int r = 0; r < PV_ROWS; r++) {
                    float x = p[(m0 + r) * KEY_BLOCK + j];
                    for (int c = 0; c < PV_VECS; c++) acc[r][c] += x * value[c];
                }
            }
            for (int r = 0; r < PV_ROWS; r++)
                for (int c = 0; c < PV_VECS; c++)
                    storew(o + (m0 + r) * dim + d0 + c * VW, acc[r][c]);
        }
    }
}

/* ---- bf16 dot path: Kp [head_dim / 2][KEY_BLOCK] and Vp [KEY_BLOCK / 2][head_dim] pairs ---- */
#if HAVE_BF16_DOT
static void scores_bf16(const uint16_t *q, const uint32_t *kp, float *s, int64_t rows,
                        int64_t dim, float scale) {
    int64_t pairs = dim / 2;
    __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t m0 = 0; m0 < rows; m0 += QK_ROWS) {
        const uint32_t *q32 = (const uint32_t *)(q + m0 * dim);
        __m512 acc[QK_ROWS][2];
        for (int r = 0; r < QK_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * KEY_BLOCK);
            __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * KEY_BLOCK + 16);
#pragma GCC unroll 8
            for (int r = 0; r < QK_ROWS; r++) {
                __m512bh x = (__m512bh)_mm512_set1_epi32((int)q32[r * pairs + p]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, x);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, x);
            }
        }
        for (int r = 0; r < QK_ROWS; r++) {
            _mm512_storeu_ps(s + (m0 + r) * KEY_BLOCK, _mm512_mul_ps(acc[r][0], scale_v));
            _mm512_storeu_ps(s + (m0 + r) * KEY_BLOCK + 16, _mm512_mul_ps(acc[r][1], scale_v));
        }
    }
}

static void accumulate_bf16(const uint16_t *p, const uint32_t *vp, float *o, const float *alpha,
                            int64_t rows, int64_t dim) {
    for (int64_t m0 = 0; m0 < rows; m0 += PV_ROWS) {
        const uint32_t *p32 = (const uint32_t *)(p + m0 * KEY_BLOCK);
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            __m512 acc[PV_ROWS][4];
            for (int r = 0; r < PV_ROWS; r++) {
                __m512 a = _mm512_set1_ps(alpha[m0 + r]);
                for (int c = 0; c < 4; c++)
                    acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (m0 + r) * dim + d0 + 16 * c), a);
            }
            for (int64_t j = 0; j < KEY_BLOCK / 2; j++) {
                __m512bh value[4];
                for (int c = 0; c < 4; c++)
                    value[c] = (__m512bh)_mm512_loadu_si512(vp + j * dim + d0 + 16 * c);
#pragma GCC unroll 4
                for (int r = 0; r < PV_ROWS; r++) {
                    __m512bh x = (__m512bh)_mm512_set1_epi32((int)p32[r * (KEY_BLOCK / 2) + j]);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], value[c], x);
                }
            }
            for (int r = 0; r < PV_ROWS; r++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + (m0 + r) * dim + d0 + 16 * c, acc[r][c]);
        }
    }
}
#endif

/* ---- the shared parts ---- */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *pages;
    void *out;
    int bf16_in, bf16_dot;
    int64_t num_tokens, start_pos, context_len, kv_heads, group, dim, page_size, head_stride;
    int64_t key_blocks, block_bytes; /* packed bytes of one block of K (V is the same) */
    float scale;
    char *packed; /* [kv_heads][key_blocks][K block, V block] */
} Problem;

static inline float load_any(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

/* Repack keys [b * KEY_BLOCK, +KEY_BLOCK) of kv head h; positions past the context are zero. */
static void pack_block(const Problem *pr, int64_t h, int64_t b) {
    char *k_dst = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
    char *v_dst = k_dst + pr->block_bytes;
    memset(k_dst, 0, 2 * pr->block_bytes);
    int64_t dim = pr->dim;
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        int64_t pos = b * KEY_BLOCK + j;
        if (pos >= pr->context_len) break;
        int64_t row = h * pr->head_stride +
                      (pr->pages[pos / pr->page_size] * pr->page_size + pos % pr->page_size) * dim;
        if (pr->bf16_dot) {
            const uint32_t *k32 = (const uint32_t *)((const uint16_t *)pr->k_cache + row);
            const uint16_t *v16 = (const uint16_t *)pr->v_cache + row;
            uint32_t *kp = (uint32_t *)k_dst;
            uint16_t *vp = (uint16_t *)v_dst; /* pair (j / 2) of column d: [j/2][d][j%2] */
            for (int64_t p = 0; p < dim / 2; p++) kp[p * KEY_BLOCK + j] = k32[p];
            for (int64_t d = 0; d < dim; d++) vp[((j / 2) * dim + d) * 2 + j % 2] = v16[d];
        } else {
            float *kt = (float *)k_dst, *v = (float *)v_dst;
            for (int64_t d = 0; d < dim; d++) {
                kt[d * KEY_BLOCK + j] = load_any(pr->k_cache, row + d, pr->bf16_in);
                v[j * dim + d] = load_any(pr->v_cache, row + d, pr->bf16_in);
            }
        }
    }
}

/* Online softmax of one block of scores, in place: s becomes the probabilities (fp32, or bf16
 * packed at the start of the same rows), alpha the factor that rescales each row's output. */
static void softmax_block(const Problem *pr, float *s, int64_t rows, int64_t real_rows,
                          int64_t first_pos, int64_t key_start, float *row_max, float *row_sum,
                          float *alpha) {
    for (int64_t m = 0; m < rows; m++) {
        int64_t pos = first_pos + (m < real_rows ? m : real_rows - 1) / pr->group;
        int64_t valid = pos - key_start + 1;
        valid = valid < 0 ? 0 : valid > KEY_BLOCK ? KEY_BLOCK : valid;
        float *row = s + m * KEY_BLOCK;
        float block_max = -INFINITY;
        for (int64_t j = 0; j < valid; j++) block_max = row[j] > block_max ? row[j] : block_max;
        float new_max = block_max > row_max[m] ? block_max : row_max[m];
        alpha[m] = row_max[m] == -INFINITY ? 0.0f : exp_nonpositive(row_max[m] - new_max);
        float sum = 0.0f;
        if (pr->bf16_dot) {
            uint16_t *p = (uint16_t *)row;
            for (int64_t j = 0; j < KEY_BLOCK; j++) {
                uint16_t x = j < valid ? float_to_bf16(exp_nonpositive(row[j] - new_max)) : 0;
                sum += bf16_to_float(x);
                p[j] = x; /* p[j] overwrites bytes of row[j / 2], already read */
            }
        } else {
            for (int64_t j = 0; j < KEY_BLOCK; j++) {
                row[j] = j < valid ? exp_nonpositive(row[j] - new_max) : 0.0f;
                sum += row[j];
            }
        }
        row_sum[m] = row_sum[m] * alpha[m] + sum;
        row_max[m] = new_max;
    }
}

static void compact_probabilities(float *s, int64_t rows) {
    /* bf16 probabilities sit in the first half of each fp32 row: move them together. */
    for (int64_t m = 1; m < rows; m++)
        memmove((uint16_t *)s + m * KEY_BLOCK, s + m * KEY_BLOCK, KEY_BLOCK * sizeof(uint16_t));
}

/* One work item: query positions [i0, i1) of the chunk, the group heads of kv head h. */
static void attend_item(const Problem *pr, int64_t h, int64_t i0, int64_t i1) {
    int64_t dim = pr->dim, group = pr->group, heads = pr->kv_heads * group;
    int64_t real_rows = (i1 - i0) * group;
    int64_t rows = (real_rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
    int elem = pr->bf16_dot ? 2 : 4;
    char *q = thread_scratch(0, (size_t)rows * dim * elem);
    float *s = thread_scratch(1, (size_t)rows * KEY_BLOCK * sizeof(float));
    float *o = thread_scratch(2, (size_t)rows * dim * sizeof(float));
    float *stats = thread_scratch(3, (size_t)rows * 3 * sizeof(float));
    if (!q || !s || !o || !stats) return;
    float *row_max = stats, *row_sum = stats + rows, *alpha = stats + 2 * rows;
    memset(q, 0, (size_t)rows * dim * elem);
    memset(o, 0, (size_t)rows * dim * sizeof(float));
    for (int64_t m = 0; m < rows; m++) row_max[m] = -INFINITY, row_sum[m] = 0.0f;
    for (int64_t m = 0; m < real_rows; m++) {
        int64_t src = ((i0 + m / group) * heads + h * group + m % group) * dim;
        if (pr->bf16_dot)
            memcpy(q + m * dim * 2, (const uint16_t *)pr->q + src, dim * 2);
        else
            for (int64_t d = 0; d < dim; d++)
                ((float *)q)[m * dim + d] = load_any(pr->q, src + d, pr->bf16_in);
    }
    int64_t first_pos = pr->start_pos + i0, last_pos = pr->start_pos + i1 - 1;
    for (int64_t b = 0; b * KEY_BLOCK <= last_pos; b++) {
        const char *kb = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
        const char *vb = kb + pr->block_bytes;
#if HAVE_BF16_DOT
        if (pr->bf16_dot) {
            scores_bf16((const uint16_t *)q, (const uint32_t *)kb, s, rows, dim, pr->scale);
            softmax_block(pr, s, rows, real_rows, first_pos, b * KEY_BLOCK, row_max, row_sum, alpha);
            compact_probabilities(s, rows);
            accumulate_bf16((const uint16_t *)s, (const uint32_t *)vb, o, alpha, rows, dim);
            continue;
        }
#endif
        scores_f32((const float *)q, (const float *)kb, s, rows, dim, pr->scale);
        softmax_block(pr, s, rows, real_rows, first_pos, b * KEY_BLOCK, row_max, row_sum, alpha);
        accumulate_f32(s, (const float *)vb, o, alpha, rows, dim);
    }
    for (int64_t m = 0; m < real_rows; m++) {
        int64_t dst = ((i0 + m / group) * heads + h * group + m % group) * dim;
        float inv = 1.0f / row_sum[m];
        for (int64_t d = 0; d < dim; d++) {
            float x = o[m * dim + d] * inv;
            if (pr->bf16_in)
                ((uint16_t *)pr->out)[dst + d] = float_to_bf16(x);
            else
                ((float *)pr->out)[dst + d] = x;
        }
    }
}

int paged_prefill_has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Returns 0, or -1 for shapes it does not take (the launcher checks them first). */
int paged_prefill(const void *q, const void *k_cache, const void *v_cache, const int64_t *pages,
                  void *out, int64_t bf16_in, int64_t allow_bf16_dot, int64_t num_tokens,
                  int64_t start_pos, int64_t kv_heads, int64_t group, int64_t dim,
                  int64_t num_pages, int64_t page_size, float scale, int64_t threads) {
    if (group > MAX_GROUP || dim > MAX_HEAD_DIM || dim % 16 || num_tokens < 1) return -1;
    Problem pr = {q, k_cache, v_cache, pages, out, (int)bf16_in, 0, num_tokens, start_pos,
                  start_pos + num_tokens, kv_heads, group, dim, page_size,
                  num_pages * page_size * dim, 0, 0, scale, NULL};
    pr.bf16_dot = HAVE_BF16_DOT && bf16_in && allow_bf16_dot && dim % 64 == 0;
    pr.key_blocks = (pr.context_len + KEY_BLOCK - 1) / KEY_BLOCK;
    pr.block_bytes = KEY_BLOCK * dim * (pr.bf16_dot ? 2 : 4);
    pr.packed = thread_scratch(7, (size_t)kv_heads * pr.key_blocks * 2 * pr.block_bytes);
    if (!pr.packed) return -1;
    int64_t query_blocks = (num_tokens + QUERY_BLOCK - 1) / QUERY_BLOCK;
    int64_t items = kv_heads * query_blocks;
    /* A fork-join costs microseconds, and far more when another process holds a core: small
     * chunks run on the calling thread alone. */
    double flops = 4.0 * dim * kv_heads * group * num_tokens * (start_pos + num_tokens / 2.0);
    if (flops < 2e6) threads = 1;
    if (threads > items) threads = items;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < kv_heads * pr.key_blocks; t++)
            pack_block(&pr, t / pr.key_blocks, t % pr.key_blocks);
        /* Last query blocks first: they see the most keys, so the tail of the schedule is short. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            int64_t qb = query_blocks - 1 - t / kv_heads;
            int64_t i1 = (qb + 1) * QUERY_BLOCK;
            attend_item(&pr, t % kv_heads, qb * QUERY_BLOCK, i1 < num_tokens ? i1 : num_tokens);
        }
    }
    return 0;
}
