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
 * rows stay as they are and V is transposed instead: attend_rows_amx64). Otherwise (fp32, or a CPU
 * without it) everything is converted to fp32 while packing and multiplied in fp32.
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

/* Unaligned, aliasing vectors, loaded and stored by dereference: a memcpy into a local vector
 * was lowered by GCC 12 (at any -mtune) to two 16-byte stores and a 32-byte reload, a
 * store-forwarding stall on every load. Every loop over the register tile is unrolled in full,
 * or GCC 12 keeps the accumulator arrays on the stack. Together: a 288-token chunk of the default
 * model at avx2 on a Zen 4, 10.8 -> 1.2 ms a layer (docs/benchmarks.md). */
typedef float vfw __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vfw loadw(const float *p) { return *(const vfw *)p; }

static inline void storew(float *p, vfw v) { *(vfw *)p = v; }

/* ---- fp32 path: Kt [head_dim][KEY_BLOCK], V [KEY_BLOCK][head_dim], Q [rows][head_dim] ---- */

static void scores_f32(const float *q, const float *kt, float *s, int64_t rows, int64_t dim,
                       float scale) {
    for (int64_t m0 = 0; m0 < rows; m0 += QK_ROWS) {
        vfw acc[QK_ROWS][NV];
#pragma GCC unroll 16
        for (int r = 0; r < QK_ROWS; r++)
#pragma GCC unroll 16
            for (int c = 0; c < NV; c++) acc[r][c] = (vfw){0};
        for (int64_t d = 0; d < dim; d++) {
            vfw k[NV];
#pragma GCC unroll 16
            for (int c = 0; c < NV; c++) k[c] = loadw(kt + d * KEY_BLOCK + c * VW);
#pragma GCC unroll 16
            for (int r = 0; r < QK_ROWS; r++) {
                float x = q[(m0 + r) * dim + d];
#pragma GCC unroll 16
                for (int c = 0; c < NV; c++) acc[r][c] += x * k[c];
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < QK_ROWS; r++)
#pragma GCC unroll 16
            for (int c = 0; c < NV; c++) storew(s + (m0 + r) * KEY_BLOCK + c * VW, acc[r][c] * scale);
    }
}

/* o = o * alpha + p @ v for PV_ROWS rows at a time, PV_VECS vectors of head_dim a step. */
static void accumulate_f32(const float *p, const float *v, float *o, const float *alpha,
                           int64_t rows, int64_t dim) {
    for (int64_t m0 = 0; m0 < rows; m0 += PV_ROWS) {
        for (int64_t d0 = 0; d0 < dim; d0 += PV_VECS * VW) {
            vfw acc[PV_ROWS][PV_VECS];
#pragma GCC unroll 16
            for (int r = 0; r < PV_ROWS; r++)
#pragma GCC unroll 16
                for (int c = 0; c < PV_VECS; c++)
                    acc[r][c] = loadw(o + (m0 + r) * dim + d0 + c * VW) * alpha[m0 + r];
            for (int64_t j = 0; j < KEY_BLOCK; j++) {
                vfw value[PV_VECS];
#pragma GCC unroll 16
                for (int c = 0; c < PV_VECS; c++) value[c] = loadw(v + j * dim + d0 + c * VW);
#pragma GCC unroll 16
                for (int r = 0; r < PV_ROWS; r++) {
                    float x = p[(m0 + r) * KEY_BLOCK + j];
#pragma GCC unroll 16
                    for (int c = 0; c < PV_VECS; c++) acc[r][c] += x * value[c];
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < PV_ROWS; r++)
#pragma GCC unroll 16
                for (int c = 0; c < PV_VECS; c++)
                    storew(o + (m0 + r) * dim + d0 + c * VW, acc[r][c]);
        }
    }
}

/* ---- bf16 dot path: Kp [head_dim / 2][KEY_BLOCK] and Vp [KEY_BLOCK / 2][head_dim] pairs ---- */
#if HAVE_BF16_DOT
/* Raw scores (softmax_block_bf16 scales them). */
static void scores_bf16(const uint16_t *q, const uint32_t *kp, float *s, int64_t rows,
                        int64_t dim) {
    int64_t pairs = dim / 2;
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
            _mm512_storeu_ps(s + (m0 + r) * KEY_BLOCK, acc[r][0]);
            _mm512_storeu_ps(s + (m0 + r) * KEY_BLOCK + 16, acc[r][1]);
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

#if HAVE_AMX
/* Every tile is configured 16 rows x 64 bytes: A tiles hold 16 rows of 32 bf16, B tiles 16 rows
 * of 16 bf16 pairs, C tiles 16 x 16 fp32. Rows are padded to 16 (AMX_ROWS) on this path. */
#define AMX_ROWS 16
#define LAZY_RESCALE 8.0f /* attend_rows_amx64: factor 256 */
static const uint8_t TILE_ROWS[8] = {16, 16, 16, 16, 16, 16, 16, 16};

/* Raw S[rows][KEY_BLOCK] = Q Kp^T, 16 rows at a time: C tiles 0-1 (keys 0-15, 16-31), the Q
 * tile 2, the K tiles 4-5, each loaded once per 32 dims. */
static void scores_amx(const uint16_t *q, const uint32_t *kp, float *s, int64_t rows,
                       int64_t dim) {
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k0 = 0; k0 < dim; k0 += 32) {
            const uint32_t *kb = kp + (k0 / 2) * KEY_BLOCK;
            _tile_loadd(2, q + m0 * dim + k0, dim * 2);
            _tile_loadd(4, kb, KEY_BLOCK * 4);
            _tile_loadd(5, kb + 16, KEY_BLOCK * 4);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
        }
        _tile_stored(0, s + m0 * KEY_BLOCK, KEY_BLOCK * 4);
        _tile_stored(1, s + m0 * KEY_BLOCK + 16, KEY_BLOCK * 4);
    }
}

/* o[m] *= alpha[m] for rows [m_begin, m_end), in registers; a row whose alpha is 1 is left. */
static void rescale_rows(float *o, const float *alpha, int64_t m_begin, int64_t m_end,
                         int64_t dim) {
    for (int64_t m = m_begin; m < m_end; m++) {
        if (alpha[m] == 1.0f) continue;
        __m512 a = _mm512_set1_ps(alpha[m]);
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o + m * dim + d, _mm512_mul_ps(_mm512_loadu_ps(o + m * dim + d), a));
    }
}

/* o = o * alpha + P Vp: o is scaled in registers first, then each 16 x 16 block of it passes
 * through a C tile (4-7) with the P tile (0) against a V tile (1-3). */
static void accumulate_amx(const uint16_t *p, const uint32_t *vp, float *o, const float *alpha,
                           int64_t rows, int64_t dim) {
    rescale_rows(o, alpha, 0, rows, dim);
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        _tile_loadd(0, p + m0 * KEY_BLOCK, KEY_BLOCK * 2);
        for (int64_t d0 = 0; d0 < dim; d0 += 64) { /* dim is a multiple of 64 on this path */
            float *ob = o + m0 * dim + d0;
            /* three V tiles in turn, so a load need not wait for the product reading its tile */
            _tile_loadd(1, vp + d0, dim * 4);
            _tile_loadd(2, vp + d0 + 16, dim * 4);
            _tile_loadd(3, vp + d0 + 32, dim * 4);
            _tile_loadd(4, ob, dim * 4);
            _tile_loadd(5, ob + 16, dim * 4);
            _tile_loadd(6, ob + 32, dim * 4);
            _tile_loadd(7, ob + 48, dim * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, vp + d0 + 48, dim * 4);
            _tile_dpbf16ps(7, 0, 1);
            _tile_stored(4, ob, dim * 4);
            _tile_stored(5, ob + 16, dim * 4);
            _tile_stored(6, ob + 32, dim * 4);
            _tile_stored(7, ob + 48, dim * 4);
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

/* Head dim 64 on AMX (attend_rows_amx64): K's rows as they are, [KEY_BLOCK][64], and V
 * transposed, [64][KEY_BLOCK / 2] pairs of keys: word 2j of row d is key 2j's dimension d. V's
 * rows are interleaved two keys at a time, as above, and each 16 x 16 block of those pairs is
 * transposed in registers. */
static void pack_block_amx64(const Problem *pr, int64_t h, int64_t b, uint16_t *kr,
                             uint32_t *vt) {
    static const uint16_t zeros[64];
    const uint16_t *v_rows[KEY_BLOCK];
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        int64_t pos = b * KEY_BLOCK + j;
        if (pos >= pr->context_len) {
            memset(kr + j * 64, 0, 128);
            v_rows[j] = zeros;
            continue;
        }
        int64_t row = h * pr->head_stride +
                      (pr->pages[pos / pr->page_size] * pr->page_size + pos % pr->page_size) * 64;
        memcpy(kr + j * 64, (const uint16_t *)pr->k_cache + row, 128);
        v_rows[j] = (const uint16_t *)pr->v_cache + row;
    }
    /* word d of the even key then of the odd one, for d in [16c, 16c + 16) of a 32-word half */
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                         8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int c = 0; c < 4; c++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
            __m512i even = _mm512_loadu_si512(v_rows[2 * j] + (c / 2) * 32);
            __m512i odd = _mm512_loadu_si512(v_rows[2 * j + 1] + (c / 2) * 32);
            r[j] = _mm512_permutex2var_epi16(even, c % 2 ? high : low, odd);
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(vt + (16 * c + i) * 16, r[i]);
    }
}
#endif

/* Repack keys [b * KEY_BLOCK, +KEY_BLOCK) of kv head h; positions past the context are zero. */
static void pack_block(const Problem *pr, int64_t h, int64_t b) {
    char *k_dst = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
    char *v_dst = k_dst + pr->block_bytes;
#if HAVE_BF16_DOT
    if (pr->amx && pr->dim == 64) {
        pack_block_amx64(pr, h, b, (uint16_t *)k_dst, (uint32_t *)v_dst);
        return;
    }
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
            kt[d * KEY_BLOCK + j] = load_any(pr->k_cache, row + d, pr->bf16_in);
            v[j * dim + d] = load_any(pr->v_cache, row + d, pr->bf16_in);
        }
    }
}

/* Online softmax of one block of fp32 scores, in place: s becomes the probabilities, alpha the
 * factor that rescales each row's output. */
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
        for (int64_t j = 0; j < KEY_BLOCK; j++) {
            row[j] = j < valid ? exp_nonpositive(row[j] - new_max) : 0.0f;
            sum += row[j];
        }
        row_sum[m] = row_sum[m] * alpha[m] + sum;
        row_max[m] = new_max;
    }
}

#if HAVE_BF16_DOT
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

#if HAVE_AMX
/* 2^x on 16 lanes for the transposed body's probabilities, which are rounded to bf16 (8
 * significant bits): a degree-4 polynomial for 2^f (relative error 3e-6, a thousandth of that
 * rounding). The rescale factor alpha, which is not rounded, keeps exp2_nonpositive_v's degree
 * 6. Lanes with x below about -126 come out 0 or subnormal, as they should; no clamp, as the
 * lanes that could hold garbage (keys a row does not see) are masked off after. */
static inline __m512 exp2_probability_v(__m512 x) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3426623e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2242573e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4128015e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304484e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Raw S^T [KEY_BLOCK][16] of one block for the tile's 16 rows: K's rows (A, tile 6) against Q^T's
 * pairs (B, tile 7), keys 0-15 into C tile 4 and 16-31 into 5, 32 dimensions at a time. */
static inline void scores_t_amx64(const uint16_t *kr, const uint32_t *qt, float *s) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(7, qt, 64);
    _tile_loadd(6, kr, 128);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kr + 16 * 64, 128);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(7, qt + 256, 64);
    _tile_loadd(6, kr + 32, 128);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kr + 16 * 64 + 32, 128);
    _tile_dpbf16ps(5, 6, 7);
    _tile_stored(4, s, 64);
    _tile_stored(5, s + 256, 64);
}

/* O^T (C tiles 0-3, 16 dimensions each) += V^T (A, tile 6) P^T (B, tile 7) of one block. */
static inline void accumulate_t_amx64(const uint32_t *pt, const uint32_t *vt) {
    _tile_loadd(7, pt, 64);
    _tile_loadd(6, vt, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, vt + 256, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(6, vt + 512, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, vt + 768, 64);
    _tile_dpbf16ps(3, 6, 7);
}

/* Head dim 64 (SmolLM2's, Llama 3.2 1B's) on AMX, transposed: a tile of 16 query rows is the
 * columns of every product, S^T = K Q^T and O^T += V^T P^T, so each vector of a score tile is
 * one key's scores across the 16 rows. The online softmax is then element-wise across vectors:
 * no horizontal maximum or sum and no per-row scalar work; P^T's bf16 pairs of keys are the B
 * tile as they come out of the conversion. O^T stays in C tiles 0-3 over all the tile's key
 * blocks and goes through memory only where a row's reference maximum moved (see
 * LAZY_RESCALE below: rare after the first blocks). Scores and probabilities pass between the tiles and the vectors through memory, and a
 * load right after the store it reads waits for that store to drain: so block b + 1's scores are
 * computed before block b's softmax, and block b's products run after block b + 1's softmax,
 * each from its own buffer; O's arithmetic keeps its order (O times block b's alpha, then plus
 * block b's products). The tile stops at the last block its own rows see; a row's keys past its
 * position get probability 0 and change none of its bits, so a row's result does not depend on
 * the rows beside it. */
static void attend_rows_amx64(const Problem *pr, int64_t h, const uint16_t *q, float *scratch,
                              float *o, float *row_sum, int64_t rows, int64_t real_rows,
                              int64_t first_pos) {
    const __m512 unit = _mm512_set1_ps(pr->scale * 1.44269504088896341f);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
    /* words 0-15 are the even key's 16 rows, 16-31 the odd key's: interleave them in pairs */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bf16 1.0 */
    float *s_bufs = scratch;                 /* S^T [2][KEY_BLOCK][16], by block parity */
    uint32_t *p_bufs = (uint32_t *)(s_bufs + 1024); /* P^T [2][KEY_BLOCK / 2][16] pairs */
    uint32_t *qt = p_bufs + 512;             /* Q^T [2][16][16] pairs, dims 0-31 and 32-63 */
    float *ot = (float *)(qt + 512);         /* O^T [64][16] */
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        int32_t row_pos[AMX_ROWS];
        for (int m = 0; m < AMX_ROWS; m++) {
            int64_t row = m0 + m < real_rows ? m0 + m : real_rows - 1;
            row_pos[m] = (int32_t)(first_pos + row / pr->group);
        }
        const __m512i pos = _mm512_loadu_si512(row_pos);
        int64_t low_pos = row_pos[0], blocks = row_pos[AMX_ROWS - 1] / KEY_BLOCK + 1;
        for (int half = 0; half < 2; half++) {
            __m512i r[16];
            for (int m = 0; m < 16; m++) r[m] = _mm512_loadu_si512(q + (m0 + m) * 64 + half * 32);
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(qt + (half * 16 + i) * 16, r[i]);
        }
        __m512 row_max = minus_inf, sum = _mm512_setzero_ps();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        scores_t_amx64((const uint16_t *)(pr->packed + h * pr->key_blocks * 2 * pr->block_bytes),
                       qt, s_bufs);
        for (int64_t b = 0; b < blocks; b++) {
            const char *kb = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
            if (b + 1 < blocks)
                scores_t_amx64((const uint16_t *)(kb + 2 * pr->block_bytes), qt,
                               s_bufs + ((b + 1) & 1) * 512);
            const float *s = s_bufs + (b & 1) * 512;
            uint32_t *pt = p_bufs + (b & 1) * 256;
            /* keys [key0, key0 + KEY_BLOCK); a row sees those at or before its position */
            int64_t key0 = b * KEY_BLOCK;
            int all_seen = key0 + KEY_BLOCK - 1 <= low_pos;
            /* the maximum of the raw scores: scaling by a positive unit keeps the order */
            __m512 block_max = minus_inf;
            for (int k = 0; k < KEY_BLOCK; k++) {
                __m512 x = _mm512_load_ps(s + k * 16);
                __mmask16 seen = all_seen ? 0xFFFF
                                          : _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(
                                                                             (int)(key0 + k)));
                block_max = _mm512_mask_max_ps(block_max, seen, block_max, x);
            }
            /* A row keeps its reference maximum until a score passes it by more than
             * LAZY_RESCALE (log2 units): its probabilities may then reach 2^LAZY_RESCALE, which
             * fp32 sums and bf16 hold as precisely as any other, and O is rescaled far less
             * often (a tile rescales when any of its 16 rows moves, on noisy scores nearly
             * every block). The result is the same to rounding: one reference for the row's
             * probabilities and its sum. exp(0) is 1 exactly; a row's first block finds O zero
             * (alpha 0). */
            __mmask16 started = _mm512_cmp_ps_mask(row_max, minus_inf, _CMP_NEQ_OQ);
            __m512 scaled_max = _mm512_mul_ps(block_max, unit);
            __mmask16 grows = ~started | _mm512_cmp_ps_mask(
                scaled_max, _mm512_add_ps(row_max, _mm512_set1_ps(LAZY_RESCALE)), _CMP_GT_OQ);
            __m512 new_max = _mm512_mask_max_ps(row_max, grows, row_max, scaled_max);
            __m512 alpha =
                _mm512_maskz_mov_ps(started, exp2_nonpositive_v(_mm512_sub_ps(row_max, new_max)));
            __m512 block_sum = _mm512_setzero_ps();
            for (int j = 0; j < KEY_BLOCK / 2; j++) {
                int64_t k = 2 * j;
                __m512 x0 = _mm512_fmsub_ps(_mm512_load_ps(s + k * 16), unit, new_max);
                __m512 x1 = _mm512_fmsub_ps(_mm512_load_ps(s + (k + 1) * 16), unit, new_max);
                __mmask16 seen0 = 0xFFFF, seen1 = 0xFFFF;
                if (!all_seen) {
                    seen0 = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)(key0 + k)));
                    seen1 = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)(key0 + k + 1)));
                }
                __m512 e0 = _mm512_maskz_mov_ps(seen0, exp2_probability_v(x0));
                __m512 e1 = _mm512_maskz_mov_ps(seen1, exp2_probability_v(x1));
                __m512i pair = _mm512_permutexvar_epi16(
                    pairs, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                _mm512_store_si512(pt + j * 16, pair);
                /* the sums add the rounded probabilities, the values the products use: a pair
                 * dotted with (1, 1) */
                block_sum = _mm512_dpbf16_ps(block_sum, (__m512bh)pair, ones);
            }
            sum = _mm512_fmadd_ps(sum, alpha, block_sum);
            row_max = new_max;
            if (b == 0) continue; /* O is zero */
            accumulate_t_amx64(p_bufs + ((b - 1) & 1) * 256,
                               (const uint32_t *)(kb - pr->block_bytes));
            if (_mm512_cmp_ps_mask(alpha, one, _CMP_NEQ_UQ)) {
                _tile_stored(0, ot, 64);
                _tile_stored(1, ot + 256, 64);
                _tile_stored(2, ot + 512, 64);
                _tile_stored(3, ot + 768, 64);
                for (int d = 0; d < 64; d++)
                    _mm512_store_ps(ot + d * 16, _mm512_mul_ps(_mm512_load_ps(ot + d * 16), alpha));
                _tile_loadd(0, ot, 64);
                _tile_loadd(1, ot + 256, 64);
                _tile_loadd(2, ot + 512, 64);
                _tile_loadd(3, ot + 768, 64);
            }
        }
        const char *last = pr->packed + (h * pr->key_blocks + blocks - 1) * 2 * pr->block_bytes;
        accumulate_t_amx64(p_bufs + ((blocks - 1) & 1) * 256,
                           (const uint32_t *)(last + pr->block_bytes));
        _tile_stored(0, ot, 64);
        _tile_stored(1, ot + 256, 64);
        _tile_stored(2, ot + 512, 64);
        _tile_stored(3, ot + 768, 64);
        /* back to rows: O[m][d] for the shared epilogue */
        for (int c = 0; c < 4; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(ot + (16 * c + i) * 16);
            transpose16(r);
            for (int m = 0; m < 16; m++) _mm512_storeu_si512(o + (m0 + m) * 64 + 16 * c, r[m]);
        }
        _mm512_storeu_ps(row_sum + m0, sum);
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
                  void *out, int64_t bf16_in, int64_t allow_bf16_dot, int64_t num_tokens,
                  int64_t start_pos, int64_t kv_heads, int64_t group, int64_t dim,
                  int64_t num_pages, int64_t page_size, float scale, int64_t threads,
                  int64_t allow_amx) {
    if (group > MAX_GROUP || dim > MAX_HEAD_DIM || dim % 16 || num_tokens < 1) return -1;
    Problem pr = {q, k_cache, v_cache, pages, out, (int)bf16_in, 0, 0, num_tokens, start_pos,
                  start_pos + num_tokens, kv_heads, group, dim, page_size,
                  num_pages * page_size * dim, 0, 0, scale, NULL};
    pr.bf16_dot = HAVE_BF16_DOT && bf16_in && allow_bf16_dot && dim % 64 == 0;
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
                         int64_t bf16_in, int64_t allow_bf16_dot, int64_t kv_heads, int64_t group,
                         int64_t dim, int64_t num_pages, int64_t page_size, float scale,
                         int64_t threads, int64_t allow_amx) {
    if (group > MAX_GROUP || dim > MAX_HEAD_DIM || dim % 16) return -1;
    if (num_chunks < 1) return 0;
    int bf16_dot = HAVE_BF16_DOT && bf16_in && allow_bf16_dot && dim % 64 == 0;
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
                          (char *)out + first * row_bytes, (int)bf16_in, bf16_dot, amx, n, start,
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
