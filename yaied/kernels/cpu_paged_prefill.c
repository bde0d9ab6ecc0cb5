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
 * [KEY_BLOCK / 2][head_dim] pairs along keys, P is rounded to bf16 (on AMX at head_dim 64, K's
 * rows stay as they are and V is transposed instead: attend_rows_amx64; the AMX bodies are in
 * cpu_paged_prefill_amx.h). Otherwise (fp32, or a CPU without it) everything is converted to
 * fp32 while packing and multiplied in fp32; so are bf16 pools under fp32 activations
 * (`cache.kv_cache_dtype` bfloat16 under fp32 math), widened as they are packed.
 * The torch reference is yaied.worker.attention._prefill_attention.
 */
#include "cpu_amx.h"
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

/* AMX (cpu_amx.h): built where the compiler targets it, used only once the kernel has asked
 * Linux for the tile state (paged_prefill_amx_ready). */
#if HAVE_BF16_DOT && HAVE_AMX_TILES
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define KEY_BLOCK 32
#define QUERY_BLOCK 32
#define ROW_PAD 8 /* row counts are padded to a multiple of this */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_ROWS (QUERY_BLOCK * MAX_GROUP)

/* The fp32 path's vectors and tiles: rows x vectors accumulators plus the loaded vectors fit in
 * the registers (16 with AVX2, 32 with AVX-512). 8 wide from AVX2 on, AVX-512 included: 16-wide
 * vectors (the same code with VW 16, or a 16-wide type on AVX2) compiled to registers spilled to
 * the stack every step, and ran 3 to 6 times slower (2.5 ms a layer against 7.3 and 15.4 for a
 * 512-token chunk of the default model's heads). 4 wide elsewhere (SSE, NEON). The O tile of 6
 * rows (12 accumulators; 8 rows and 16 with AVX-512, and an S tile of 6 rows) against 4 rows
 * before: a 512-token chunk at 2048 positions, 20.0 -> 14.9 ms a layer at avx2 and 18.8 -> 14.1
 * at avx512 on a Zen 5 (docs/benchmarks.md). Rows past the last whole tile take tiles of one. */
#if defined(__AVX512F__)
#define VW 8
#define QK_ROWS 6 /* rows of the S register tile */
#define PV_ROWS 8 /* rows of the O register tile */
#elif defined(__AVX2__)
#define VW 8
#define QK_ROWS 2
#define PV_ROWS 6
#else
#define VW 4
#define QK_ROWS 1
#define PV_ROWS 4
#endif
#define PV_VECS 2 /* its vectors a row (head_dim is a multiple of 16) */
#define NV (KEY_BLOCK / VW) /* vectors in a row of scores */

/* Unaligned, aliasing vectors, loaded and stored by dereference: a memcpy into a local vector
 * was lowered by GCC 12 (at any -mtune) to two 16-byte stores and a 32-byte reload, a
 * store-forwarding stall on every load. Every loop over the register tile is unrolled in full,
 * or GCC 12 keeps the accumulator arrays on the stack. Together: a 288-token chunk of the default
 * model at avx2 on a Zen 4, 10.8 -> 1.2 ms a layer (docs/benchmarks.md). */
typedef float vfw __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vfw loadw(const float *p) { return *(const vfw *)p; }

static inline void storew(float *p, vfw v) { *(vfw *)p = v; }

/* ---- fp32 path: Kt [head_dim][KEY_BLOCK], V [KEY_BLOCK][head_dim], Q [rows][head_dim] ---- */

/* S = Q Kt * scale for rows m0 .. m0 + R - 1: R x NV accumulators, unrolled in full. */
static inline __attribute__((always_inline)) void scores_rows(const float *q, const float *kt,
                                                              float *s, int64_t m0, const int R,
                                                              int64_t dim, float scale) {
    vfw acc[QK_ROWS][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) acc[r][c] = (vfw){0};
    for (int64_t d = 0; d < dim; d++) {
        vfw k[NV];
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) k[c] = loadw(kt + d * KEY_BLOCK + c * VW);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            float x = q[(m0 + r) * dim + d];
#pragma GCC unroll 16
            for (int c = 0; c < NV; c++) acc[r][c] += x * k[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) storew(s + (m0 + r) * KEY_BLOCK + c * VW, acc[r][c] * scale);
}

/* A row's scores are its own accumulators' whatever tile it falls in: the tiles change no bit. */
static void scores_f32(const float *q, const float *kt, float *s, int64_t rows, int64_t dim,
                       float scale) {
    int64_t m0 = 0;
    for (; m0 + QK_ROWS <= rows; m0 += QK_ROWS) scores_rows(q, kt, s, m0, QK_ROWS, dim, scale);
    for (; m0 < rows; m0++) scores_rows(q, kt, s, m0, 1, dim, scale);
}

/* o = o * alpha + p @ v for rows m0 .. m0 + R - 1, PV_VECS vectors of head_dim a step. */
static inline __attribute__((always_inline)) void accumulate_rows(const float *p, const float *v,
                                                                  float *o, const float *alpha,
                                                                  int64_t m0, const int R,
                                                                  int64_t dim) {
    for (int64_t d0 = 0; d0 < dim; d0 += PV_VECS * VW) {
        vfw acc[PV_ROWS][PV_VECS];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 16
            for (int c = 0; c < PV_VECS; c++)
                acc[r][c] = loadw(o + (m0 + r) * dim + d0 + c * VW) * alpha[m0 + r];
        for (int64_t j = 0; j < KEY_BLOCK; j++) {
            vfw value[PV_VECS];
#pragma GCC unroll 16
            for (int c = 0; c < PV_VECS; c++) value[c] = loadw(v + j * dim + d0 + c * VW);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                float x = p[(m0 + r) * KEY_BLOCK + j];
#pragma GCC unroll 16
                for (int c = 0; c < PV_VECS; c++) acc[r][c] += x * value[c];
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 16
            for (int c = 0; c < PV_VECS; c++) storew(o + (m0 + r) * dim + d0 + c * VW, acc[r][c]);
    }
}

static void accumulate_f32(const float *p, const float *v, float *o, const float *alpha,
                           int64_t rows, int64_t dim) {
    int64_t m0 = 0;
    for (; m0 + PV_ROWS <= rows; m0 += PV_ROWS) accumulate_rows(p, v, o, alpha, m0, PV_ROWS, dim);
    for (; m0 < rows; m0++) accumulate_rows(p, v, o, alpha, m0, 1, dim);
}

/* ---- bf16 dot path: Kp [head_dim / 2][KEY_BLOCK] and Vp [KEY_BLOCK / 2][head_dim] pairs ---- */
#if HAVE_BF16_DOT
/* The bf16 dot path's tiles: rows of S (8: 16 accumulators of 32 registers; 2 before, a
 * 512-token chunk at 2048 positions 4.90 -> 4.07 ms a layer on a Zen 5) and rows of O (4 rows
 * of 4 vectors; 8 spilled). Both divide ROW_PAD. */
#define BF16_QK_ROWS 8
#define BF16_PV_ROWS 4

/* Raw scores (softmax_block_bf16 scales them). */
static void scores_bf16(const uint16_t *q, const uint32_t *kp, float *s, int64_t rows,
                        int64_t dim) {
    int64_t pairs = dim / 2;
    for (int64_t m0 = 0; m0 < rows; m0 += BF16_QK_ROWS) {
        const uint32_t *q32 = (const uint32_t *)(q + m0 * dim);
        __m512 acc[BF16_QK_ROWS][2];
        for (int r = 0; r < BF16_QK_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * KEY_BLOCK);
            __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * KEY_BLOCK + 16);
#pragma GCC unroll 8
            for (int r = 0; r < BF16_QK_ROWS; r++) {
                __m512bh x = (__m512bh)_mm512_set1_epi32((int)q32[r * pairs + p]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, x);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, x);
            }
        }
        for (int r = 0; r < BF16_QK_ROWS; r++) {
            _mm512_storeu_ps(s + (m0 + r) * KEY_BLOCK, acc[r][0]);
            _mm512_storeu_ps(s + (m0 + r) * KEY_BLOCK + 16, acc[r][1]);
        }
    }
}

static void accumulate_bf16(const uint16_t *p, const uint32_t *vp, float *o, const float *alpha,
                            int64_t rows, int64_t dim) {
    for (int64_t m0 = 0; m0 < rows; m0 += BF16_PV_ROWS) {
        const uint32_t *p32 = (const uint32_t *)(p + m0 * KEY_BLOCK);
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            __m512 acc[BF16_PV_ROWS][4];
            for (int r = 0; r < BF16_PV_ROWS; r++) {
                __m512 a = _mm512_set1_ps(alpha[m0 + r]);
                for (int c = 0; c < 4; c++)
                    acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (m0 + r) * dim + d0 + 16 * c), a);
            }
            for (int64_t j = 0; j < KEY_BLOCK / 2; j++) {
                __m512bh value[4];
                for (int c = 0; c < 4; c++)
                    value[c] = (__m512bh)_mm512_loadu_si512(vp + j * dim + d0 + 16 * c);
#pragma GCC unroll 4
                for (int r = 0; r < BF16_PV_ROWS; r++) {
                    __m512bh x = (__m512bh)_mm512_set1_epi32((int)p32[r * (KEY_BLOCK / 2) + j]);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], value[c], x);
                }
            }
            for (int r = 0; r < BF16_PV_ROWS; r++)
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
    int bf16_in, bf16_dot, amx;
    int bf16_kv; /* the pools' type: bf16, or fp32; bf16_in says the activations' (q, out) */
    int64_t num_tokens, start_pos, context_len, kv_heads, group, dim, page_size, head_stride;
    int64_t key_blocks, block_bytes; /* packed bytes of one block of K (V is the same) */
    float scale;
    char *packed; /* [kv_heads][key_blocks][K block, V block] */
} Problem;

static inline float load_any(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

#if HAVE_BF16_DOT
/* 16 x 16 32-bit transpose in registers (pairs of rows, then quads, then 128-bit lanes). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* The bf16 layouts in vectors (the element-wise loop was a quarter of the kernel's time at a
 * 700-token context): K's rows, read as pairs of bf16, transposed 16 x 16 at a time; V's rows
 * interleaved two keys at a time. dim is a multiple of 64 on this path. */
static void pack_block_bf16(const Problem *pr, int64_t h, int64_t b, uint32_t *kp, uint16_t *vp) {
    static const uint16_t zeros[MAX_HEAD_DIM];
    const uint16_t *k_rows[KEY_BLOCK], *v_rows[KEY_BLOCK];
    int64_t dim = pr->dim;
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        int64_t pos = b * KEY_BLOCK + j;
        if (pos >= pr->context_len) {
            k_rows[j] = v_rows[j] = zeros;
            continue;
        }
        int64_t row = h * pr->head_stride +
                      (pr->pages[pos / pr->page_size] * pr->page_size + pos % pr->page_size) * dim;
        k_rows[j] = (const uint16_t *)pr->k_cache + row;
        v_rows[j] = (const uint16_t *)pr->v_cache + row;
    }
    for (int64_t p0 = 0; p0 < dim / 2; p0 += 16) /* K: [dim / 2][KEY_BLOCK] pairs */
        for (int64_t j0 = 0; j0 < KEY_BLOCK; j0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(k_rows[j0 + i] + 2 * p0);
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(kp + (p0 + i) * KEY_BLOCK + j0, r[i]);
        }
    /* V: [KEY_BLOCK / 2][dim][2], word d of the even key then of the odd one */
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                           40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                           32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < KEY_BLOCK; j += 2)
        for (int64_t d0 = 0; d0 < dim; d0 += 32) {
            __m512i even = _mm512_loadu_si512(v_rows[j] + d0);
            __m512i odd = _mm512_loadu_si512(v_rows[j + 1] + d0);
            uint16_t *dst = vp + ((j / 2) * dim + d0) * 2;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(even, first, odd));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(even, second, odd));
        }
}

/* 2^x for x <= 0 on 16 lanes: exp_nonpositive's polynomial (cpu_common.h), the power of two
 * applied by vscalefps. */
static inline __m512 exp2_nonpositive_v(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180399e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* The AMX bodies (tiles): cpu_paged_prefill_amx.h, written for this file alone. */
#include "cpu_paged_prefill_amx.h"

/* Repack keys [b * KEY_BLOCK, +KEY_BLOCK) of kv head h; positions past the context are zero. */
static void pack_block(const Problem *pr, int64_t h, int64_t b) {
    char *k_dst = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
    char *v_dst = k_dst + pr->block_bytes;
#if HAVE_AMX
    if (pr->amx && pr->dim == 64) {
        pack_block_amx64(pr, h, b, (uint16_t *)k_dst, (uint32_t *)v_dst);
        return;
    }
#endif
#if HAVE_BF16_DOT
    if (pr->bf16_dot) {
        pack_block_bf16(pr, h, b, (uint32_t *)k_dst, (uint16_t *)v_dst);
        return;
    }
#endif
    memset(k_dst, 0, 2 * pr->block_bytes);
    int64_t dim = pr->dim;
    float *kt = (float *)k_dst, *v = (float *)v_dst;
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        int64_t pos = b * KEY_BLOCK + j;
        if (pos >= pr->context_len) break;
        int64_t row = h * pr->head_stride +
                      (pr->pages[pos / pr->page_size] * pr->page_size + pos % pr->page_size) * dim;
        for (int64_t d = 0; d < dim; d++) {
            kt[d * KEY_BLOCK + j] = load_any(pr->k_cache, row + d, pr->bf16_kv);
            v[j * dim + d] = load_any(pr->v_cache, row + d, pr->bf16_kv);
        }
    }
}

/* exp_nonpositive (cpu_common.h) on a vector: the same operations lane by lane (floor as a
 * truncation, one less where that rounded up). */
typedef int32_t viw __attribute__((vector_size(VW * 4)));
static inline vfw exp_nonpositive_w(vfw x) {
    vfw low = (vfw){0} - 87.0f;
    x = (vfw)(((viw)x & ~(x < low)) | ((viw)low & (x < low)));
    vfw t = x * 1.44269504088896341f;
    viw whole = __builtin_convertvector(t, viw);
    vfw n = __builtin_convertvector(whole, vfw);
    viw above = n > t; /* -1 where truncation rounded a negative t up */
    whole += above;
    n = __builtin_convertvector(whole, vfw);
    vfw f = t - n;
    return EXP2_FRACTION(f) * (vfw)((whole + 127) << 23);
}

/* Online softmax of one block of fp32 scores, in place: s becomes the probabilities, alpha the
 * factor that rescales each row's output. A row's KEY_BLOCK scores are NV vectors. */
static void softmax_block(const Problem *pr, float *s, int64_t rows, int64_t real_rows,
                          int64_t first_pos, int64_t key_start, float *row_max, float *row_sum,
                          float *alpha) {
    viw lane;
    for (int i = 0; i < VW; i++) lane[i] = i;
    for (int64_t m = 0; m < rows; m++) {
        int64_t pos = first_pos + (m < real_rows ? m : real_rows - 1) / pr->group;
        int64_t valid = pos - key_start + 1;
        valid = valid < 0 ? 0 : valid > KEY_BLOCK ? KEY_BLOCK : valid;
        float *row = s + m * KEY_BLOCK;
        vfw x[NV], top = (vfw){0} - INFINITY;
        viw keep[NV];
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) {
            keep[c] = lane + c * VW < (int32_t)valid;
            x[c] = loadw(row + c * VW);
            vfw live = (vfw)(((viw)x[c] & keep[c]) | ((viw)top & ~keep[c]));
            viw up = live > top;
            top = (vfw)(((viw)live & up) | ((viw)top & ~up));
        }
        float block_max = top[0];
        for (int i = 1; i < VW; i++) block_max = top[i] > block_max ? top[i] : block_max;
        float new_max = block_max > row_max[m] ? block_max : row_max[m];
        /* the maximum seldom moves after the first blocks: exp(0) is 1 exactly, skip it */
        alpha[m] = row_max[m] == -INFINITY ? 0.0f
                   : new_max == row_max[m] ? 1.0f
                                           : exp_nonpositive(row_max[m] - new_max);
        vfw sum = (vfw){0};
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) {
            vfw e = (vfw)((viw)exp_nonpositive_w(x[c] - new_max) & keep[c]);
            storew(row + c * VW, e);
            sum += e;
        }
        float total = 0.0f;
        for (int i = 0; i < VW; i++) total += sum[i];
        row_sum[m] = row_sum[m] * alpha[m] + total;
        row_max[m] = new_max;
    }
}

#if HAVE_BF16_DOT
/* The bf16 paths' online softmax, vectorised (the scalar loop was two thirds of the kernel's
 * time once the products ran on AMX). A row's 32 raw scores are two vectors, the keys past the
 * query's position masked off; the running maximum is kept in units of log2 (scores times
 * scale * log2 e), so one multiply scales and one exp2 exponentiates. The probabilities go to p
 * as bf16, and each row's running sum stays a vector of 16 partial sums of the rounded
 * probabilities (the values the products use) until the end. */
static void softmax_block_bf16(const Problem *pr, const float *s, uint16_t *p, int64_t m_begin,
                               int64_t m_end, int64_t real_rows, int64_t first_pos,
                               int64_t key_start, float *row_max, float *sums, float *alpha) {
    const float log2e = 1.44269504088896341f;
    __m512 unit = _mm512_set1_ps(pr->scale * log2e), low = _mm512_set1_ps(-INFINITY);
    for (int64_t m = m_begin; m < m_end; m++) {
        int64_t pos = first_pos + (m < real_rows ? m : real_rows - 1) / pr->group;
        int64_t valid = pos - key_start + 1;
        valid = valid < 0 ? 0 : valid > KEY_BLOCK ? KEY_BLOCK : valid;
        uint32_t keep = valid == KEY_BLOCK ? 0xFFFFFFFFu : (1u << valid) - 1;
        __mmask16 lo = (__mmask16)keep, hi = (__mmask16)(keep >> 16);
        __m512 x0 = _mm512_maskz_mul_ps(lo, _mm512_loadu_ps(s + m * KEY_BLOCK), unit);
        __m512 x1 = _mm512_maskz_mul_ps(hi, _mm512_loadu_ps(s + m * KEY_BLOCK + 16), unit);
        float block_max = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_mask_mov_ps(low, lo, x0), _mm512_mask_mov_ps(low, hi, x1)));
        float new_max = block_max > row_max[m] ? block_max : row_max[m];
        /* the maximum seldom moves after the first blocks: exp(0) is 1 exactly, skip it */
        alpha[m] = row_max[m] == -INFINITY ? 0.0f
                   : new_max == row_max[m] ? 1.0f
                                           : exp_nonpositive((row_max[m] - new_max) / log2e);
        __m512 top = _mm512_set1_ps(new_max);
        __m512 e0 = _mm512_maskz_mov_ps(lo, exp2_nonpositive_v(_mm512_sub_ps(x0, top)));
        __m512 e1 = _mm512_maskz_mov_ps(hi, exp2_nonpositive_v(_mm512_sub_ps(x1, top)));
        __m256i b0 = (__m256i)_mm512_cvtneps_pbh(e0), b1 = (__m256i)_mm512_cvtneps_pbh(e1);
        __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b0), 16));
        __m512 r1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b1), 16));
        __m512 sum = _mm512_loadu_ps(sums + m * 16);
        sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(alpha[m]), _mm512_add_ps(r0, r1));
        _mm512_storeu_ps(sums + m * 16, sum);
        _mm256_storeu_si256((__m256i *)(p + m * KEY_BLOCK), b0);
        _mm256_storeu_si256((__m256i *)(p + m * KEY_BLOCK + 16), b1);
        row_max[m] = new_max;
    }
}
#endif

/* One work item: query positions [i0, i1) of the chunk, the group heads of kv head h. */
static void attend_item(const Problem *pr, int64_t h, int64_t i0, int64_t i1) {
    int64_t dim = pr->dim, group = pr->group, heads = pr->kv_heads * group;
    int64_t real_rows = (i1 - i0) * group;
    int64_t pad = pr->amx ? 16 : ROW_PAD;
    int64_t rows = (real_rows + pad - 1) / pad * pad;
    int elem = pr->bf16_dot ? 2 : 4;
    char *q = thread_scratch(0, (size_t)rows * dim * elem);
    /* scores; the transposed AMX body keeps S^T, P^T, Q^T and O^T of one tile in it */
    float *s = thread_scratch(1, (size_t)(rows < 96 ? 96 : rows) * KEY_BLOCK * sizeof(float));
    float *o = thread_scratch(2, (size_t)rows * dim * sizeof(float));
    float *stats = thread_scratch(3, (size_t)rows * 3 * sizeof(float));
    /* bf16 paths: the probabilities, and each row's 16 partial sums */
    uint16_t *p = thread_scratch(4, (size_t)rows * KEY_BLOCK * sizeof(uint16_t));
    float *sums = thread_scratch(5, (size_t)rows * 16 * sizeof(float));
    if (!q || !s || !o || !stats || !p || !sums) return;
    float *row_max = stats, *row_sum = stats + rows, *alpha = stats + 2 * rows;
    memset(q, 0, (size_t)rows * dim * elem);
    memset(o, 0, (size_t)rows * dim * sizeof(float));
    memset(sums, 0, (size_t)rows * 16 * sizeof(float));
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
#if HAVE_AMX
    if (pr->amx && dim == 64)
        attend_rows_amx64(pr, h, (const uint16_t *)q, s, o, row_sum, rows, real_rows, first_pos);
    else
#endif
    for (int64_t b = 0; b * KEY_BLOCK <= last_pos; b++) {
        const char *kb = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
        const char *vb = kb + pr->block_bytes;
#if HAVE_BF16_DOT
        if (pr->bf16_dot) {
#if HAVE_AMX
            if (pr->amx)
                scores_amx((const uint16_t *)q, (const uint32_t *)kb, s, rows, dim);
            else
#endif
                scores_bf16((const uint16_t *)q, (const uint32_t *)kb, s, rows, dim);
            softmax_block_bf16(pr, s, p, 0, rows, real_rows, first_pos, b * KEY_BLOCK, row_max,
                               sums, alpha);
#if HAVE_AMX
            if (pr->amx)
                accumulate_amx(p, (const uint32_t *)vb, o, alpha, rows, dim);
            else
#endif
                accumulate_bf16(p, (const uint32_t *)vb, o, alpha, rows, dim);
            continue;
        }
#endif
        scores_f32((const float *)q, (const float *)kb, s, rows, dim, pr->scale);
        softmax_block(pr, s, rows, real_rows, first_pos, b * KEY_BLOCK, row_max, row_sum, alpha);
        accumulate_f32(s, (const float *)vb, o, alpha, rows, dim);
    }
#if HAVE_BF16_DOT
    if (pr->bf16_dot && !(pr->amx && dim == 64))
        for (int64_t m = 0; m < real_rows; m++)
            row_sum[m] = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + m * 16));
#endif
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

/* A fork-join costs microseconds, and far more when another process holds a core: paged_prefill
 * runs a chunk of fewer flops than this (4 dim heads tokens (start + tokens / 2)) on the calling
 * thread alone, and the engine hands such chunks to paged_prefill_chunks together (cpu_prefill.py,
 * CpuPrefillKernel.runs_alone). */
#define ONE_THREAD_FLOPS 2e6
double paged_prefill_one_thread_flops(void) { return ONE_THREAD_FLOPS; }

/* 1 where this build has the AMX path and the process may use the tiles (asked once). */
int paged_prefill_amx_ready(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Returns 0, or -1 for shapes it does not take (the launcher checks them first). */
int paged_prefill(const void *q, const void *k_cache, const void *v_cache, const int64_t *pages,
                  void *out, int64_t bf16_in, int64_t bf16_kv, int64_t allow_bf16_dot,
                  int64_t num_tokens,
                  int64_t start_pos, int64_t kv_heads, int64_t group, int64_t dim,
                  int64_t num_pages, int64_t page_size, float scale, int64_t threads,
                  int64_t allow_amx) {
    if (group > MAX_GROUP || dim > MAX_HEAD_DIM || dim % 16 || num_tokens < 1) return -1;
    Problem pr = {q, k_cache, v_cache, pages, out, (int)bf16_in, 0, 0, (int)bf16_kv, num_tokens,
                  start_pos, start_pos + num_tokens, kv_heads, group, dim, page_size,
                  num_pages * page_size * dim, 0, 0, scale, NULL};
    pr.bf16_dot = HAVE_BF16_DOT && bf16_in && bf16_kv && allow_bf16_dot && dim % 64 == 0;
    pr.amx = pr.bf16_dot && allow_amx && paged_prefill_amx_ready();
    pr.key_blocks = (pr.context_len + KEY_BLOCK - 1) / KEY_BLOCK;
    pr.block_bytes = KEY_BLOCK * dim * (pr.bf16_dot ? 2 : 4);
    pr.packed = thread_scratch(7, (size_t)kv_heads * pr.key_blocks * 2 * pr.block_bytes);
    if (!pr.packed) return -1;
    int64_t query_blocks = (num_tokens + QUERY_BLOCK - 1) / QUERY_BLOCK;
    int64_t items = kv_heads * query_blocks;
    double flops = 4.0 * dim * kv_heads * group * num_tokens * (start_pos + num_tokens / 2.0);
    if (flops < ONE_THREAD_FLOPS) threads = 1;
    if (threads > items) threads = items;
#pragma omp parallel num_threads(threads)
    {
#if HAVE_AMX
        TileConfig saved;
        if (pr.amx) tiles_enter(&saved, TILE_ROWS);
#endif
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
#if HAVE_AMX
        if (pr.amx) tiles_leave(&saved);
#endif
    }
    return 0;
}

/* Many chunks in one call: engine.batch_invariant runs every decode as a one-token chunk, and a
 * call a chunk and layer cost more than the chunk's work. Each chunk runs on one thread, its K/V
 * packed in that thread's scratch, through the functions paged_prefill runs: the same bits.
 * q and out hold every row ([rows, kv_heads * group, dim]); chunks is [num_chunks][4]: the
 * chunk's first row, its rows, its first position and where its page table starts in pages.
 * Returns 0, or -1 for shapes it does not take or scratch it cannot get. */
int paged_prefill_chunks(const void *q, const void *k_cache, const void *v_cache,
                         const int64_t *pages, const int64_t *chunks, void *out, int64_t num_chunks,
                         int64_t bf16_in, int64_t bf16_kv, int64_t allow_bf16_dot,
                         int64_t kv_heads, int64_t group,
                         int64_t dim, int64_t num_pages, int64_t page_size, float scale,
                         int64_t threads, int64_t allow_amx) {
    if (group > MAX_GROUP || dim > MAX_HEAD_DIM || dim % 16) return -1;
    if (num_chunks < 1) return 0;
    int bf16_dot = HAVE_BF16_DOT && bf16_in && bf16_kv && allow_bf16_dot && dim % 64 == 0;
    int amx = bf16_dot && allow_amx && paged_prefill_amx_ready();
    size_t row_bytes = (size_t)(kv_heads * group * dim) * (bf16_in ? 2 : 4);
    int failed = 0;
    if (threads > num_chunks) threads = num_chunks;
#pragma omp parallel num_threads(threads)
    {
#if HAVE_AMX
        TileConfig saved;
        if (amx) tiles_enter(&saved, TILE_ROWS);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; c++) {
            const int64_t *info = chunks + 4 * c;
            int64_t first = info[0], n = info[1], start = info[2];
            Problem pr = {(const char *)q + first * row_bytes, k_cache, v_cache, pages + info[3],
                          (char *)out + first * row_bytes, (int)bf16_in, bf16_dot, amx,
                          (int)bf16_kv, n, start,
                          start + n, kv_heads, group, dim, page_size, num_pages * page_size * dim,
                          0, 0, scale, NULL};
            pr.key_blocks = (pr.context_len + KEY_BLOCK - 1) / KEY_BLOCK;
            pr.block_bytes = KEY_BLOCK * dim * (pr.bf16_dot ? 2 : 4);
            pr.packed = n < 1 ? NULL
                              : thread_scratch(7, (size_t)kv_heads * pr.key_blocks * 2 *
                                                      pr.block_bytes);
            if (!pr.packed) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t t = 0; t < kv_heads * pr.key_blocks; t++)
                pack_block(&pr, t / pr.key_blocks, t % pr.key_blocks);
            int64_t query_blocks = (n + QUERY_BLOCK - 1) / QUERY_BLOCK;
            for (int64_t t = 0; t < kv_heads * query_blocks; t++) {
                int64_t qb = query_blocks - 1 - t / kv_heads;
                int64_t i1 = (qb + 1) * QUERY_BLOCK;
                attend_item(&pr, t % kv_heads, qb * QUERY_BLOCK, i1 < n ? i1 : n);
            }
        }
#if HAVE_AMX
        if (amx) tiles_leave(&saved);
#endif
    }
    return failed ? -1 : 0;
}
