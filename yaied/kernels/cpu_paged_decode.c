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
 * yaied.worker.attention._decode_attention. (row, kv head, partition) items are split across
 * the calling thread's OpenMP team (the engine's worker thread: torch's team). The `_step` entry
 * does a decode-only step's rotary and K/V write too, in the same parallel region.
 *
 * W-mixed's 32 rows over about 350 positions read 258 MB of K/V a step. The next pages are
 * prefetched (the page table scatters them, so the hardware prefetcher stops at every page
 * edge), and each block of positions is widened to fp32 once for all the group's query heads,
 * whose scores, softmax and sums stay in vectors (GCC vector types, so the one source builds at
 * every ISA level). That widening body is bound by its arithmetic, not by memory (a layer's K/V
 * in cache ran 1.6 of the 1.8 ms that 30 layers from memory took): with AVX512-BF16, bf16 K/V
 * of the usual head sizes take a body of its own (dot_item_bf16) whose q . k are bf16 dot
 * products on the rows as stored.
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
#define DEFINE_EXP2_NONPOSITIVE(NAME, VF, VI)                                                   \
    static inline VF NAME(VF x) {                                                               \
        VF low = (VF){0} - 125.0f;                                                              \
        x = (VF)(((VI)x & ~(x < low)) | ((VI)low & (x < low)));                                 \
        VI n = __builtin_convertvector(x, VI) - 1;                                              \
        VF f = x - __builtin_convertvector(n, VF);                                              \
        return EXP2_FRACTION(f) * (VF)((n + 127) << 23);                                        \
    }
DEFINE_EXP2_NONPOSITIVE(exp2_nonpositive_v, vf, vi)

/* Long contexts are split into partitions, each a work item of its own, whose partial results
 * are merged in partition order: at batch 1 the default model has 3 (row, kv head) pairs for 2
 * or more threads, and one pair per thread left the rest idle. A row's partitions depend on its
 * context length alone (PARTITION positions, more where that would make more than MAX_PARTS),
 * never on the batch or the threads, so a row's output is the same bits in any batch; a context
 * of at most PARTITION positions is one item, computed as before the split. */
#define PARTITION 256 /* a multiple of BLOCK */
#define MAX_PARTS 16

typedef struct {
    int64_t row, head, begin, end; /* positions [begin, end) of (row, kv head) */
    int64_t part, parts;           /* this item's index among the pair's partitions */
    int64_t rows;                  /* rows row.. row + rows - 1 share it (a drafted run) */
    int64_t partial_at;            /* where its partial results start in the partials */
} DecodeItem;

static inline int64_t partition_size(int64_t context_len) {
    int64_t wanted = (context_len + MAX_PARTS - 1) / MAX_PARTS;
    return wanted <= PARTITION ? PARTITION : (wanted + PARTITION - 1) / PARTITION * PARTITION;
}

/* How many partitions of `size` positions a context takes (a short one, or none, is one). */
static inline int64_t partition_count(int64_t context_len, int64_t size) {
    return context_len <= size ? 1 : (context_len + size - 1) / size;
}

/* How many rows from r on are one sequence's speculative run (at most `most`): each the last
 * one's context plus one position, over the same pages, split into the same partitions. Such rows
 * share their items, so each block of K/V is read and widened once for all of them; every row
 * still takes its own positions in the same order, so its bits are those it has alone. */
static int64_t run_length(const int64_t *context_lens, const int64_t *page_table,
                          int64_t max_pages, int64_t page_size, int64_t r, int64_t row_end,
                          int64_t most) {
    int64_t len = context_lens[r], size = partition_size(len);
    int64_t parts = partition_count(len, size), m = 1;
    while (m < most && r + m < row_end) {
        int64_t next = context_lens[r + m];
        if (next != len + m || partition_size(next) != size || partition_count(next, size) != parts)
            break;
        size_t bytes = (size_t)((next + page_size - 1) / page_size) * sizeof(int64_t);
        if (memcmp(page_table + r * max_pages, page_table + (r + m) * max_pages, bytes)) break;
        m++;
    }
    return m;
}

/* The step's items in (row, kv head, partition) order into the calling thread's scratch, and
 * room for the partitions' partial results (rows x group x (max, sum, head_dim outputs) floats
 * per item); returns the item count, or -1 without memory. Rows share items where `share` and
 * run_length say so, up to MAX_GROUP query heads an item. */
static int64_t plan_items(const int64_t *context_lens, const int64_t *page_table,
                          int64_t max_pages, int64_t page_size, int64_t row_begin,
                          int64_t row_end, int64_t kv_heads, int64_t group, int64_t head_dim,
                          int share, DecodeItem **items, float **partials) {
    /* Room as for every row alone: a shared item's partials are its rows' together, and a run
     * has fewer items than its rows would have. */
    int64_t most = share ? MAX_GROUP / group : 1, bound = 0;
    for (int64_t r = row_begin; r < row_end; r++)
        bound += kv_heads * partition_count(context_lens[r], partition_size(context_lens[r]));
    *items = thread_scratch(0, (size_t)(bound ? bound : 1) * sizeof(DecodeItem));
    size_t partial_floats = (size_t)(bound ? bound : 1) * group * (2 + head_dim);
    *partials = thread_scratch(1, partial_floats * sizeof(float));
    if (!*items || !*partials) return -1;
    DecodeItem *it = *items;
    int64_t at = 0;
    for (int64_t r = row_begin; r < row_end;) {
        int64_t m = run_length(context_lens, page_table, max_pages, page_size, r, row_end, most);
        int64_t len = context_lens[r + m - 1], size = partition_size(len);
        int64_t parts = partition_count(len, size);
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t p = 0; p < parts; p++) {
                int64_t end = parts == 1 ? len : (p + 1) * size < len ? (p + 1) * size : len;
                *it++ = (DecodeItem){r, h, p * size, end, p, parts, m, at};
                at += m * group * (2 + head_dim);
            }
        r += m;
    }
    return it - *items;
}

/* The K and V rows of positions [from, to) (those before context_len) prefetched into L2
 * (AHEAD above: why L2 and how far); a row is head_dim elements of `size` bytes. */
static inline __attribute__((always_inline)) void prefetch_rows(
    const void *k_cache, const void *v_cache, const int64_t *pages, int64_t from, int64_t to,
    int64_t context_len, int64_t page_size, int64_t page_stride, int64_t head_dim, int64_t size) {
    for (int64_t pos = from; pos < to && pos < context_len; pos++) {
        int64_t at = (pages[pos / page_size] * page_stride + (pos % page_size) * head_dim) * size;
        for (int64_t b = 0; b < head_dim * size; b += 64) {
            __builtin_prefetch((const char *)k_cache + at + b, 0, 1);
            __builtin_prefetch((const char *)v_cache + at + b, 0, 1);
        }
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* bf16 K/V where the CPU has bf16 dot products: a body of its own for head sizes that are
 * multiples of 32 up to DOT_MAX_HEAD_DIM and groups of up to DOT_MAX_GROUP heads. The widening
 * body above spent most of its time turning each K and V row into fp32 and keeping the widened
 * block (64 vectors each) in memory; here
 *
 *   - q . k is two (four) vdpbf16ps on the bf16 rows as they are: the products are exact, as
 *     the widened FMAs' were, and only the order of the fp32 sums differs. A block is 16
 *     positions, whose 16 lane vectors one transposing tree of adds (sum_lanes16) turns into
 *     the block's 16 scores, so the softmax runs 16 lanes wide;
 *   - a V row becomes fp32 by two word unpacks against zero per 32 values (a bf16 is the high
 *     half of its fp32), which leaves each vector's values in unpack order: the accumulators
 *     keep that order and the output is put back in place once, at the end.
 *
 * Probabilities stay fp32, so P V is the widening body's arithmetic. */
#define DOT_BLOCK 16
#define DOT_MAX_GROUP 8
#define DOT_MAX_HEAD_DIM 128
typedef int32_t vi16 __attribute__((vector_size(64)));

/* Lane j of the result: the sum of t[j]'s 16 lanes. Four levels of shuffles and adds leave
 * position 4 i + L in lane 4 L + i (a 4 x 4 transpose), which one permute puts back. */
static const int32_t LANE_TRANSPOSE[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
static inline __m512 sum_lanes16(const __m512 *t) {
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) /* 128-bit lanes 0-1: t[2j]'s halves summed; 2-3: t[2j + 1]'s */
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++) /* 128-bit lane L: four partial sums of t[4j + L] */
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++) /* lane L: two of t[8j + L], two of t[8j + 4 + L] */
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0xDD));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_loadu_si512(LANE_TRANSPOSE), r);
}

DEFINE_EXP2_NONPOSITIVE(exp2_nonpositive_16, __m512, vi16) /* exp2_nonpositive_v, 16 lanes */

/* Query vectors first .. first + count - 1 (count <= DOT_MAX_GROUP) of the widening body's item
 * (NAME##_one below: the same arguments, outputs and partials; `rows` rows of `group` heads,
 * vector v being row v / group's head v % group) for head_dim HD (a multiple of 32, at most
 * DOT_MAX_HEAD_DIM). Each vector sees the positions before its row's context length only: a
 * drafted run's shorter rows skip a longer row's last positions as they would alone. */
static inline __attribute__((always_inline)) void dot_heads_bf16(
    const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *pages, int64_t begin, int64_t end, const int64_t *row_lens, int64_t rows,
    uint16_t *out, int64_t out_stride, float *partial, int64_t first, int64_t count,
    const int64_t group, const int64_t HD, int64_t page_size, int64_t page_stride, float scale) {
    const int64_t halves = HD / 32, chunks = HD / 16; /* 32 bf16 in a vector; 16 fp32 */
    const float log2e = 1.44269504088896341f;
    const __m512 score_scale = _mm512_set1_ps(scale * log2e); /* scores in log2 units */
    const __m512i zero = _mm512_setzero_si512();
    __m512bh query[DOT_MAX_GROUP][DOT_MAX_HEAD_DIM / 32];
    __m512 acc[DOT_MAX_GROUP][DOT_MAX_HEAD_DIM / 16], sums[DOT_MAX_GROUP];
    float running_max[DOT_MAX_GROUP];
    int64_t ends[DOT_MAX_GROUP], valid[DOT_MAX_GROUP];
    for (int64_t g = 0; g < count; g++) {
        int64_t row = (first + g) / group, head = (first + g) % group;
        for (int64_t h = 0; h < halves; h++)
            query[g][h] = (__m512bh)_mm512_loadu_si512(q + row * q_stride + head * HD + 32 * h);
        ends[g] = end < row_lens[row] ? end : row_lens[row];
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
        sums[g] = _mm512_setzero_ps();
        running_max[g] = -INFINITY;
    }
    for (int64_t start = begin; start < end; start += DOT_BLOCK) {
        int64_t n = end - start < DOT_BLOCK ? end - start : DOT_BLOCK;
        prefetch_rows(k_cache, v_cache, pages, start + AHEAD, start + AHEAD + DOT_BLOCK,
                      row_lens[rows - 1], page_size, page_stride, HD, sizeof(uint16_t));
        const uint16_t *krow[DOT_BLOCK], *vrow[DOT_BLOCK];
        for (int64_t i = 0; i < DOT_BLOCK; i++) {
            int64_t pos = start + (i < n ? i : n - 1); /* past the end: a copy, masked */
            int64_t at = pages[pos / page_size] * page_stride + (pos % page_size) * HD;
            krow[i] = k_cache + at;
            vrow[i] = v_cache + at;
        }
        float probs[DOT_MAX_GROUP][DOT_BLOCK];
        for (int64_t g = 0; g < count; g++) {
            /* positions of this block the vector sees; none past its row's end */
            int64_t nv = ends[g] - start < DOT_BLOCK ? ends[g] - start : DOT_BLOCK;
            valid[g] = nv > 0 ? nv : 0;
            if (nv <= 0) continue;
            __mmask16 live = (__mmask16)(nv == DOT_BLOCK ? 0xFFFF : (1u << nv) - 1);
            __m512 t[DOT_BLOCK];
            for (int64_t i = 0; i < DOT_BLOCK; i++) {
                t[i] = _mm512_setzero_ps();
                for (int64_t h = 0; h < halves; h++)
                    t[i] = _mm512_dpbf16_ps(t[i], query[g][h],
                                            (__m512bh)_mm512_loadu_si512(krow[i] + 32 * h));
            }
            __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                               _mm512_mul_ps(sum_lanes16(t), score_scale));
            float block_max = _mm512_reduce_max_ps(scores);
            float new_max = block_max > running_max[g] ? block_max : running_max[g];
            if (new_max != running_max[g]) { /* seldom after the first blocks */
                float rescale = running_max[g] == -INFINITY
                                    ? 0.0f
                                    : exp_nonpositive((running_max[g] - new_max) / log2e);
                __m512 r = _mm512_set1_ps(rescale);
                sums[g] = _mm512_mul_ps(sums[g], r);
                for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], r);
                running_max[g] = new_max;
            }
            __m512 p = _mm512_maskz_mov_ps(
                live, exp2_nonpositive_16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
            sums[g] = _mm512_add_ps(sums[g], p);
            _mm512_storeu_ps(probs[g], p);
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < halves; h++) {
                __m512i v = _mm512_loadu_si512(vrow[i] + 32 * h);
                __m512 low = (__m512)_mm512_unpacklo_epi16(zero, v); /* values 8L .. 8L + 3 */
                __m512 high = (__m512)_mm512_unpackhi_epi16(zero, v); /* 8L + 4 .. 8L + 7 */
                for (int64_t g = 0; g < count; g++) {
                    if (i >= valid[g]) continue;
                    __m512 pg = _mm512_set1_ps(probs[g][i]);
                    acc[g][2 * h] = _mm512_fmadd_ps(pg, low, acc[g][2 * h]);
                    acc[g][2 * h + 1] = _mm512_fmadd_ps(pg, high, acc[g][2 * h + 1]);
                }
            }
    }
    for (int64_t g = 0; g < count; g++) {
        float denom = _mm512_reduce_add_ps(sums[g]), result[DOT_MAX_HEAD_DIM];
        for (int64_t h = 0; h < halves; h++) { /* back from unpack order */
            float low[16], high[16];
            _mm512_storeu_ps(low, acc[g][2 * h]);
            _mm512_storeu_ps(high, acc[g][2 * h + 1]);
            for (int lane = 0; lane < 4; lane++)
                for (int i = 0; i < 4; i++) {
                    result[32 * h + 8 * lane + i] = low[4 * lane + i];
                    result[32 * h + 8 * lane + 4 + i] = high[4 * lane + i];
                }
        }
        if (partial) { /* a partition: its max, sum and unnormalised output, for the merge */
            float *mine = partial + (first + g) * (2 + HD);
            mine[0] = running_max[g];
            mine[1] = denom;
            memcpy(mine + 2, result, HD * sizeof(float));
            continue;
        }
        int64_t row = (first + g) / group, head = (first + g) % group;
        uint16_t *to = out + row * out_stride + head * HD;
        for (int64_t d = 0; d < HD; d++) to[d] = float_to_bf16(result[d] / denom);
    }
}

/* An item's heads in passes: past head size 64 a head's query and accumulators are 12 vectors
 * or more, and more than four heads at once spilled them (7 heads of 128 ran no faster than the
 * widening body); four at a time, each pass re-reading the item's K/V from L2, 7 and 8 heads of
 * 128 ran 1.08-1.23x faster. At 64 one pass (passes were 0.94x there). A head's numbers do not
 * depend on the others, so the passes change no bit. */
static inline __attribute__((always_inline)) void dot_item_bf16(
    const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *pages, int64_t begin, int64_t end, const int64_t *row_lens, int64_t rows,
    uint16_t *out, int64_t out_stride, float *partial, const int64_t group, const int64_t HD,
    int64_t page_size, int64_t page_stride, float scale) {
    const int64_t per_pass = HD <= 64 ? DOT_MAX_GROUP : 4, vectors = rows * group;
    for (int64_t v = 0; v < vectors; v += per_pass)
        dot_heads_bf16(q, q_stride, k_cache, v_cache, pages, begin, end, row_lens, rows, out,
                       out_stride, partial, v, vectors - v < per_pass ? vectors - v : per_pass,
                       group, HD, page_size, page_stride, scale);
}

/* Returns whether the dot body took the item: head sizes that are multiples of 32 up to
 * DOT_MAX_HEAD_DIM (arrays sized for more kept GCC from holding the accumulators in registers:
 * 3-4% slower), groups up to DOT_MAX_GROUP. With the usual page size (16: a position's page is
 * then a shift, not a division) head sizes 64 and 128 have copies of their own, and the common
 * groups copies with the group constant too (the group at run time is 5-7% slower); a copy
 * per combination took the file's build from 3 to 14 s at this level, these seven 4.4 s. */
#define DOT_ITEM(G, HD, PAGE, STRIDE)                                                             \
    dot_item_bf16(q, q_stride, k_cache, v_cache, pages, begin, end, row_lens, rows, out,           \
                  out_stride, partial, G, HD, PAGE, STRIDE, scale)
static int dot_body_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int64_t *pages, int64_t begin, int64_t end,
                         const int64_t *row_lens, int64_t rows, uint16_t *out, int64_t out_stride,
                         float *partial, int64_t group, int64_t head_dim, int64_t page_size,
                         int64_t page_stride, float scale) {
    if (head_dim % 32 || head_dim > DOT_MAX_HEAD_DIM || group > DOT_MAX_GROUP) return 0;
    int usual = page_size == 16 && (head_dim == 64 || head_dim == 128);
    if (usual && group == 3 && head_dim == 64)
        DOT_ITEM(3, 64, 16, 16 * 64);
    else if (usual && group == 4 && head_dim == 64)
        DOT_ITEM(4, 64, 16, 16 * 64);
    else if (usual && group == 4 && head_dim == 128)
        DOT_ITEM(4, 128, 16, 16 * 128);
    else if (usual && group == 8 && head_dim == 128)
        DOT_ITEM(8, 128, 16, 16 * 128);
    else if (usual && head_dim == 64)
        DOT_ITEM(group, 64, 16, 16 * 64);
    else if (usual)
        DOT_ITEM(group, 128, 16, 16 * 128);
    else /* other sizes at run time */
        DOT_ITEM(group, head_dim, page_size, page_stride);
    return 1;
}
#else
#define dot_body_bf16 NO_DOT_BODY
#endif

/* fp32 activations have no dot body (over fp32 or bf16 pools): their items go to the widening
 * body below. */
#define NO_DOT_BODY(...) 0

/* One (row, kv head) pair: `group` query heads against one kv head's context. A block's K and V
 * rows are widened to fp32 once and serve every query head of the group; each head's scores are
 * one vector, its softmax sum BLOCK partial sums, its output head_dim / BLOCK vectors.
 * T is the activations' type (q, out, the step's qkv rows), C the pools' (K/V as stored, read by
 * LOADV_C, written through STORE_C), DOT the body tried first (dot_body_bf16 where both are
 * bf16; it takes a drafted run's rows as the widening body does), SHARE whether such rows share
 * items (run_length). */
#define DEFINE_KERNEL(NAME, T, LOAD, LOADV, STORE, SUFFIX, C, LOADV_C, STORE_C, DOT, SHARE)      \
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
    /* A K or V row of the pools in fp32 vectors (zeros past a head size the vectors overrun). */ \
    static inline void NAME##_widen_kv(const C *src, vf *dst, int64_t head_dim) {                  \
        int64_t c = 0;                                                                             \
        for (; c + BLOCK <= head_dim; c += BLOCK) dst[c / BLOCK] = LOADV_C(src + c);               \
        if (c < head_dim) {                                                                        \
            C tail[BLOCK] = {0};                                                                   \
            memcpy(tail, src + c, (size_t)(head_dim - c) * sizeof(C));                             \
            dst[c / BLOCK] = LOADV_C(tail);                                                        \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* A new K or V row into the pools, rounded to their type where it is narrower. */            \
    static inline void NAME##_store_kv(C *dst, const T *src, int64_t head_dim) {                   \
        if (sizeof(C) == sizeof(T)) {                                                              \
            memcpy(dst, src, head_dim * sizeof(T));                                                \
            return;                                                                                \
        }                                                                                          \
        for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE_C(LOAD(src[d]));                     \
    }                                                                                              \
                                                                                                   \
    /* `rows` consecutive rows (q and out rows q_stride and out_stride elements apart; 1, or a     \
     * drafted run), `group` query heads each: query vector v is row v / group's head v % group,   \
     * and attends to positions [begin, min(end, its row's context length)). */                    \
    static inline __attribute__((always_inline)) void NAME##_one(                                  \
        const T *q, int64_t q_stride, const C *k_cache, const C *v_cache, const int64_t *pages,    \
        int64_t begin, int64_t end, const int64_t *row_lens, int64_t rows, T *out,                 \
        int64_t out_stride, float *partial, int64_t group, int64_t head_dim, int64_t page_size,    \
        int64_t page_stride, float scale) {                                                        \
        const int64_t chunks = (head_dim + BLOCK - 1) / BLOCK;                                     \
        const int64_t vectors = rows * group;                                                      \
        const float log2e = 1.44269504088896341f;                                                  \
        vf query[MAX_GROUP][chunks], acc[MAX_GROUP][chunks], key[BLOCK][chunks],                   \
            value[BLOCK][chunks], sums[MAX_GROUP];                                                 \
        float running_max[MAX_GROUP], probs[MAX_GROUP][BLOCK];                                     \
        int64_t ends[MAX_GROUP], valid[MAX_GROUP];                                                 \
        for (int64_t g = 0; g < vectors; g++) {                                                    \
            NAME##_widen(q + (g / group) * q_stride + (g % group) * head_dim, query[g], head_dim); \
            for (int64_t c = 0; c < chunks; c++) {                                                 \
                query[g][c] *= scale * log2e; /* scores in log2 units: exp2 exponentiates */       \
                acc[g][c] = (vf){0};                                                               \
            }                                                                                      \
            running_max[g] = -INFINITY;                                                            \
            sums[g] = (vf){0};                                                                     \
            ends[g] = end < row_lens[g / group] ? end : row_lens[g / group];                       \
        }                                                                                          \
        for (int64_t start = begin; start < end; start += BLOCK) {                                 \
            int64_t n = end - start < BLOCK ? end - start : BLOCK;                                 \
            prefetch_rows(k_cache, v_cache, pages, start + AHEAD, start + AHEAD + BLOCK,           \
                          row_lens[rows - 1], page_size, page_stride, head_dim, sizeof(C));        \
            for (int64_t i = 0; i < BLOCK; i++) {                                                  \
                int64_t pos = start + (i < n ? i : n - 1); /* past the end: a copy, masked */      \
                int64_t at = pages[pos / page_size] * page_stride + (pos % page_size) * head_dim;  \
                NAME##_widen_kv(k_cache + at, key[i], head_dim);                                   \
                NAME##_widen_kv(v_cache + at, value[i], head_dim);                                 \
            }                                                                                      \
            for (int64_t g = 0; g < vectors; g++) {                                                \
                /* positions of this block the vector sees; none past its row's end */             \
                int64_t nv = ends[g] - start < BLOCK ? ends[g] - start : BLOCK;                    \
                valid[g] = nv > 0 ? nv : 0;                                                        \
                if (nv <= 0) continue;                                                             \
                vf dots[BLOCK];                                                                    \
                for (int64_t i = 0; i < BLOCK; i++) {                                              \
                    vf d = query[g][0] * key[i][0];                                                \
                    for (int64_t c = 1; c < chunks; c++) d += query[g][c] * key[i][c];             \
                    dots[i] = d;                                                                   \
                }                                                                                  \
                vf scores = sum_lanes(dots);                                                       \
                if (nv < BLOCK)                                                                    \
                    for (int64_t i = nv; i < BLOCK; i++) scores[i] = -INFINITY;                    \
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
                if (nv < BLOCK)                                                                    \
                    for (int64_t i = nv; i < BLOCK; i++) p[i] = 0.0f;                              \
                sums[g] += p;                                                                      \
                memcpy(probs[g], &p, sizeof p);                                                    \
            }                                                                                      \
            for (int64_t g = 0; g < vectors; g++)                                                  \
                for (int64_t i = 0; i < valid[g]; i++) {                                           \
                    float p = probs[g][i];                                                         \
                    for (int64_t c = 0; c < chunks; c++) acc[g][c] += p * value[i][c];             \
                }                                                                                  \
        }                                                                                          \
        for (int64_t g = 0; g < vectors; g++) {                                                    \
            float denom = 0.0f;                                                                    \
            for (int i = 0; i < BLOCK; i++) denom += sums[g][i];                                   \
            if (partial) { /* a partition: its max, sum and unnormalised output, for the merge */  \
                float *mine = partial + g * (2 + head_dim);                                        \
                mine[0] = running_max[g];                                                          \
                mine[1] = denom;                                                                   \
                for (int64_t c = 0; c < chunks; c++) {                                             \
                    float lanes[BLOCK];                                                            \
                    memcpy(lanes, &acc[g][c], sizeof lanes);                                       \
                    for (int64_t i = 0; i < BLOCK && c * BLOCK + i < head_dim; i++)                \
                        mine[2 + c * BLOCK + i] = lanes[i];                                        \
                }                                                                                  \
                continue;                                                                          \
            }                                                                                      \
            float result[MAX_HEAD_DIM + BLOCK];                                                    \
            for (int64_t c = 0; c < chunks; c++) {                                                 \
                vf o = acc[g][c] / denom;                                                          \
                memcpy(result + BLOCK * c, &o, sizeof o);                                          \
            }                                                                                      \
            T *to = out + (g / group) * out_stride + (g % group) * head_dim;                       \
            for (int64_t d = 0; d < head_dim; d++) to[d] = STORE(result[d]);                       \
        }                                                                                          \
    }                                                                                              \
    /* A (row, kv head) pair's partitions merged in their order into out (see DecodeItem); its     \
     * partitions' results `stride` floats apart. */                                               \
    static void NAME##_merge(const float *partials, int64_t parts, int64_t stride, T *out,         \
                             int64_t group, int64_t head_dim) {                                    \
        const float ln2 = 0.69314718055994531f; /* maxima are in log2 units */                     \
        for (int64_t g = 0; g < group; g++) {                                                      \
            const float *first = partials + g * (2 + head_dim);                                    \
            float top = first[0], total = 0.0f, result[MAX_HEAD_DIM] = {0};                        \
            for (int64_t p = 1; p < parts; p++)                                                    \
                top = first[p * stride] > top ? first[p * stride] : top;                           \
            for (int64_t p = 0; p < parts; p++) {                                                  \
                const float *part = first + p * stride;                                            \
                float weight = exp_nonpositive((part[0] - top) * ln2);                             \
                total += weight * part[1];                                                         \
                for (int64_t d = 0; d < head_dim; d++) result[d] += weight * part[2 + d];          \
            }                                                                                      \
            for (int64_t d = 0; d < head_dim; d++)                                                 \
                out[g * head_dim + d] = STORE(result[d] / total);                                  \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* The planned items (plan_items), then the merge of split pairs; q and out rows `q_stride`    \
     * and `out_stride` elements apart. Called inside a parallel region. */                        \
    static void NAME##_rows(const T *q, int64_t q_stride, const C *k_cache, const C *v_cache,      \
                            const int64_t *page_table, const int64_t *context_lens, T *out,        \
                            int64_t out_stride, const DecodeItem *items, int64_t count,            \
                            float *partials, int64_t group, int64_t head_dim, int64_t num_pages,   \
                            int64_t page_size, int64_t max_pages, float scale) {                   \
        int64_t page_stride = page_size * head_dim;                                                \
        int64_t head_stride = num_pages * page_stride;                                             \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int64_t i = 0; i < count; i++) {                                                      \
            const DecodeItem *it = items + i;                                                      \
            int64_t r = it->row, h = it->head, m = it->rows;                                       \
            const T *qh = q + r * q_stride + h * group * head_dim;                                 \
            T *oh = out + r * out_stride + h * group * head_dim;                                   \
            const int64_t *pages = page_table + r * max_pages, *lens = context_lens + r;           \
            const C *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;              \
            float *partial = it->parts > 1 ? partials + it->partial_at : NULL;                     \
            if (DOT(qh, q_stride, kh, vh, pages, it->begin, it->end, lens, m, oh, out_stride,      \
                    partial, group, head_dim, page_size, page_stride, scale))                      \
                continue;                                                                          \
            /* Constant head sizes let the compiler unroll and vectorise fully. */                 \
            if (head_dim == 64 && page_size == 16)                                                 \
                NAME##_one(qh, q_stride, kh, vh, pages, it->begin, it->end, lens, m, oh,           \
                           out_stride, partial, group, 64, 16, 16 * 64, scale);                    \
            else if (head_dim == 128 && page_size == 16)                                           \
                NAME##_one(qh, q_stride, kh, vh, pages, it->begin, it->end, lens, m, oh,           \
                           out_stride, partial, group, 128, 16, 16 * 128, scale);                  \
            else                                                                                   \
                NAME##_one(qh, q_stride, kh, vh, pages, it->begin, it->end, lens, m, oh,           \
                           out_stride, partial, group, head_dim, page_size, page_stride, scale);   \
        } /* the implicit barrier: every partition is done before any merge */                     \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t i = 0; i < count; i++) {                                                      \
            const DecodeItem *it = items + i;                                                      \
            if (it->part != 0 || it->parts < 2) continue;                                          \
            int64_t stride = it->rows * group * (2 + head_dim); /* one partition's floats */       \
            for (int64_t j = 0; j < it->rows; j++)                                                 \
                NAME##_merge(partials + it->partial_at + j * group * (2 + head_dim), it->parts,    \
                             stride, out + (it->row + j) * out_stride + it->head * group * head_dim, \
                             group, head_dim);                                                     \
        }                                                                                          \
    }                                                                                              \
    /* Returns 0, -1 for sizes past MAX_GROUP or MAX_HEAD_DIM, -2 without scratch memory. */      \
    int NAME(const T *q, const C *k_cache, const C *v_cache, const int64_t *page_table,            \
             const int64_t *context_lens, T *out, int64_t row_begin, int64_t row_end,              \
             int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,                 \
             int64_t page_size, int64_t max_pages, float scale) {                                  \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                               \
        int64_t row_stride = kv_heads * group * head_dim;                                          \
        DecodeItem *items;                                                                         \
        float *partials;                                                                           \
        int64_t count = plan_items(context_lens, page_table, max_pages, page_size, row_begin,      \
                                   row_end, kv_heads, group, head_dim, SHARE, &items, &partials);  \
        if (count < 0) return -2;                                                                  \
        _Pragma("omp parallel")                                                                    \
        NAME##_rows(q, row_stride, k_cache, v_cache, page_table, context_lens, out, row_stride,    \
                    items, count, partials, group, head_dim, num_pages, page_size, max_pages,      \
                    scale);                                                                        \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    /* A decode-only step of one layer from its fused qkv rows [rows, (heads + 2 kv_heads) *       \
     * head_dim] (q_stride elements apart): rotate q and k in place (rotate-half; cos, sin         \
     * [rows, head_dim / 2] fp32), write k and v to the pools at slots[r], then attend as above    \
     * into out [rows, heads * head_dim]. One call where the general path takes five. */           \
    int NAME##_step(T *qkv, int64_t q_stride, const float *cos, const float *sin, C *k_cache,      \
                    C *v_cache, const int64_t *slots, const int64_t *page_table,                   \
                    const int64_t *context_lens, T *out, int64_t rows, int64_t kv_heads,           \
                    int64_t group, int64_t head_dim, int64_t num_pages, int64_t page_size,         \
                    int64_t max_pages, float scale) {                                              \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                               \
        int64_t heads = kv_heads * group, half = head_dim / 2;                                     \
        int64_t head_stride = num_pages * page_size * head_dim;                                    \
        DecodeItem *items;                                                                         \
        float *partials;                                                                           \
        int64_t count = plan_items(context_lens, page_table, max_pages, page_size, 0, rows,        \
                                   kv_heads, group, head_dim, SHARE, &items, &partials);           \
        if (count < 0) return -2;                                                                  \
        _Pragma("omp parallel")                                                                    \
        {                                                                                          \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t r = 0; r < rows; r++) {                                                   \
                T *row = qkv + r * q_stride;                                                       \
                rotary_row_##SUFFIX(row, heads + kv_heads, head_dim, cos + r * half,               \
                                    sin + r * half);                                               \
                for (int64_t h = 0; h < kv_heads; h++) {                                           \
                    int64_t at = h * head_stride + slots[r] * head_dim;                            \
                    NAME##_store_kv(k_cache + at, row + (heads + h) * head_dim, head_dim);         \
                    NAME##_store_kv(v_cache + at, row + (heads + kv_heads + h) * head_dim,         \
                                    head_dim);                                                     \
                }                                                                                  \
            } /* the implicit barrier: every row's K/V is written before any row attends */        \
            NAME##_rows(qkv, q_stride, k_cache, v_cache, page_table, context_lens, out,            \
                        heads * head_dim, items, count, partials, group, head_dim, num_pages,      \
                        page_size, max_pages, scale);                                              \
        }                                                                                          \
        return 0;                                                                                  \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_float, load_bf16, float_to_bf16, bf16, uint16_t,
              load_bf16, float_to_bf16, dot_body_bf16, 1)
DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32, load_f32, STORE_F32, f32, float, load_f32,
              STORE_F32, NO_DOT_BODY, 1)
/* fp32 math over bf16 pools (`cache.kv_cache_dtype` bfloat16 under fp32 math): half the bytes a
 * step reads and the pool holds; each new K/V row is rounded once, as it is written. */
DEFINE_KERNEL(paged_decode_f32_kv_bf16, float, LOAD_F32, load_f32, STORE_F32, f32, uint16_t,
              load_bf16, float_to_bf16, NO_DOT_BODY, 1)
