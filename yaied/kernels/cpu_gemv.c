/* Linear layer over bf16 weights for a few rows (a decode step's batch, up to 8): out = x @ w.T (+ bias).
 *
 * At a few rows a linear layer is a pass over its weight, so its time is the weight's
 * bytes over the memory bandwidth. This streams a group of weight rows at a time, each chunk of
 * K loaded once and multiplied into every input row, and splits the groups across OpenMP
 * threads. Weights are always bf16 (half the bytes of fp32); the activations are either bf16
 * (`_bf16` entries: bf16 models) or fp32 (`_f32` entries: fp32 math over bf16 weights, the
 * default on CPUs without bf16 dot products). The bodies, by the ISA level the file is built
 * for (yaied/kernels/cpu_isa.py):
 *
 *   avx512_bf16  bf16 activations: AVX512-BF16 dot products (32 elements an instruction), or
 *                on a CPU with AMX tiles the AMX body at the end of this file, for every row
 *                count; fp32 activations: as avx512
 *   avx512       weights widened to fp32 in registers (a shift), 16-wide FMAs
 *   avx2         the same 8 wide (AVX2 + FMA)
 *   generic      plain C over 8-element arrays, which the compiler vectorises where it can
 *
 * Every (input row, weight row) pair has its own accumulator, filled in the same order whatever
 * the number of rows, so a row's result is the same bits alone and in any batch at one level.
 *
 * Layouts (contiguous): x [rows, K], bias [N] or NULL (the activations' type), out [rows, N],
 * rows <= MAX_ROWS; w bf16 in the streaming layout (cpu_gemv.py's pack_weight): nn.Linear's
 * [N, K] weight padded to [N8, K32] (multiples of GROUP and CHUNK) and stored as
 * [N8 / GROUP, K32 / CHUNK, GROUP, CHUNK], so that GROUP rows' first 64 bytes come first, then
 * their next 64 bytes, and so on, and a group's weights are one sequential read. Read row by
 * row, 8 rows of 1,152 bytes side by side, the default model's linears streamed at 17-20 GB/s
 * at one input row where this layout reads 24-27 and a plain sequential read 31-34 (2 threads of
 * a Zen 4; docs/benchmarks.md): streams that short end before the hardware prefetchers follow.
 *
 * `few_rows_linear_*` also runs the layer's elementwise neighbours, so that a decoder layer at
 * batch 1 makes one call where it made two or three: the residual add and RMSNorm before the
 * linear (q/k/v and gate/up projections), SiLU-and-multiply after it (gate/up), with the bodies
 * of cpu_fused.c's kernels (cpu_rows.h) and so the same results.
 */
#include "cpu_amx.h"
#include "cpu_rows.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8
#define AMX_MAX_ROWS 64 /* the AMX body's rows (few_rows_linear_bf16 takes them where it runs) */
#define MAX_BLOCK 8
#define GROUP 8  /* weight rows interleaved in the streaming layout (MAX_BLOCK divides it) */
#define CHUNK 32 /* elements of a row per interleave step: 64 bytes, one cache line */

static inline int64_t padded_k(int64_t K) { return (K + CHUNK - 1) / CHUNK * CHUNK; }

/* Where a block is the whole group (one input row; two at AVX-512), its weights are one
 * sequential read, and the hardware prefetchers alone keep too few lines in flight for it: the
 * loads wait behind the FMAs, and the default model's linears read 11-13 GB/s at avx2 and
 * avx512 (one row, 2 threads of an Emerald Rapids). Asking for the group's lines 8 chunk steps
 * (4 KiB) ahead into L1, once a chunk step, reads them at 15-20 GB/s (docs/benchmarks.md, the
 * twentieth session; into L2 instead, 7% slower). Past a group's end the lines asked for are
 * the next group's, this thread's next under the static schedule; a prefetch never faults. */
#define PREFETCH_CHUNKS 8
static inline void prefetch_group_ahead(const uint16_t *line) {
    for (int i = 0; i < GROUP; i++)
        __builtin_prefetch(line + (PREFETCH_CHUNKS * GROUP + i) * CHUNK, 0, 3);
}

/* Row n of the streaming layout: its element k is at AT(row, k). */
static inline const uint16_t *weight_row(const uint16_t *w, int64_t n, int64_t K) {
    return w + (n / GROUP) * GROUP * padded_k(K) + (n % GROUP) * CHUNK;
}
#define AT(row, k) ((row) + ((k) / CHUNK) * (GROUP * CHUNK) + (k) % CHUNK)

/* ---- one vector of fp32 lanes, per level ---- */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vec load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vec load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vec load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
#define LANES 8
typedef struct {
    float v[LANES];
} vec;
static inline vec vec_zero(void) { return (vec){{0}}; }
static inline vec vec_fma(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c.v[i] += a.v[i] * b.v[i];
    return c;
}
static inline float vec_sum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v.v[i];
    return s;
}
static inline vec load_f32(const float *p) {
    vec r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline vec load_bf16(const uint16_t *p) {
    vec r;
    for (int i = 0; i < LANES; i++) r.v[i] = bf16_to_float(p[i]);
    return r;
}
#endif

#define LOAD_ACT_f32(p) load_f32(p)
#define LOAD_ACT_bf16(p) load_bf16(p)

/* The end of a block: each pair's lanes summed, the elements past the last full vector, the
 * bias, the store. Not inlined, so that one compiled copy serves every (rows, block) size: with
 * -fassociative-math the compiler may order a reduction differently in each copy it makes, and
 * a row's bits must not depend on how many rows came with it. */
#define DEFINE_FINISH(T, SUFFIX)                                                                \
    static __attribute__((noinline)) void finish_##SUFFIX(                                      \
        vec sum[MAX_ROWS][MAX_BLOCK], const T *x, const uint16_t *wr, const T *bias, T *out,    \
        int64_t n0, int64_t N, int64_t K, int64_t end, int rows, int block) {                   \
        for (int m = 0; m < rows; m++)                                                          \
            for (int j = 0; j < block; j++) {                                                   \
                float v = vec_sum(sum[m][j]);                                                   \
                for (int64_t k = end; k < K; k++)                                               \
                    v += bf16_to_float(*AT(wr + j * CHUNK, k)) *                                \
                         ROW_LOAD_##SUFFIX(x[m * K + k]);                                       \
                if (bias) v += ROW_LOAD_##SUFFIX(bias[n0 + j]);                                 \
                out[m * N + n0 + j] = ROW_STORE_##SUFFIX(v);                                    \
            }                                                                                   \
    }

/* A block of weight rows (BLOCK rows at wr, CHUNK apart) over elements [k0, k1) of K against
 * ROWS input rows of type T, into sum; sizes are literals at every call site (the DEFINE_ROWS
 * functions), so the accumulators stay in registers. A chunk's address is worked out once per
 * chunk: per vector step, its six integer instructions took the FMAs' ports (without them, 4
 * rows at avx2 ran 1.2-1.3x and 8 rows 1.2x faster). */
#define DEFINE_RANGE(T, SUFFIX)                                                                 \
    static inline __attribute__((always_inline)) void range_##SUFFIX(                           \
        const T *x, const uint16_t *wr, vec sum[MAX_ROWS][MAX_BLOCK], int64_t k0, int64_t k1,   \
        int64_t K, const int ROWS, const int BLOCK) {                                           \
        for (int64_t c = k0; c < k1; c += CHUNK) { /* k0 is a chunk's first element */        \
            const uint16_t *line = AT(wr, c);                                                   \
            if (BLOCK == GROUP) prefetch_group_ahead(line);                                     \
            int64_t stop = k1 - c < CHUNK ? k1 - c : CHUNK;                                     \
            for (int64_t i = 0; i < stop; i += LANES) {                                         \
                vec xv[MAX_ROWS];                                                               \
                for (int m = 0; m < ROWS; m++) xv[m] = LOAD_ACT_##SUFFIX(x + m * K + c + i);    \
                for (int j = 0; j < BLOCK; j++) {                                               \
                    vec a = load_bf16(line + j * CHUNK + i);                                    \
                    for (int m = 0; m < ROWS; m++) sum[m][j] = vec_fma(a, xv[m], sum[m][j]);    \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

DEFINE_FINISH(float, f32)
DEFINE_FINISH(uint16_t, bf16)
DEFINE_RANGE(float, f32)
DEFINE_RANGE(uint16_t, bf16)
#define STEP_f32 LANES
#define STEP_bf16 LANES

#if defined(__AVX512BF16__)
/* bf16 activations with AVX512-BF16: pairs of products summed in one instruction, 32 elements
 * of K (one chunk) a step. At one input row each line goes in two 256-bit halves, lanes 0-7
 * and 8-15 of the 512-bit sums (the same products in the same order): 25-26 against 21 GB/s
 * over the default model's linears on a Zen 4. Replaces range_bf16 at this level. */
static inline __attribute__((always_inline)) void range_dot(
    const uint16_t *x, const uint16_t *wr, __m512 sum[MAX_ROWS][MAX_BLOCK], int64_t k0,
    int64_t k1, int64_t K, const int ROWS, const int BLOCK) {
    if (ROWS == 1) {
        __m256 lo[MAX_BLOCK], hi[MAX_BLOCK];
        for (int j = 0; j < BLOCK; j++) {
            lo[j] = _mm512_castps512_ps256(sum[0][j]);
            hi[j] = _mm512_extractf32x8_ps(sum[0][j], 1);
        }
        for (int64_t k = k0; k < k1; k += CHUNK) {
            const uint16_t *line = AT(wr, k);
            if (BLOCK == GROUP) prefetch_group_ahead(line);
            __m256bh x0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(x + k));
            __m256bh x1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(x + k + 16));
            for (int j = 0; j < BLOCK; j++) {
                const __m256i *a = (const __m256i *)(line + j * CHUNK);
                lo[j] = _mm256_dpbf16_ps(lo[j], (__m256bh)_mm256_loadu_si256(a), x0);
                hi[j] = _mm256_dpbf16_ps(hi[j], (__m256bh)_mm256_loadu_si256(a + 1), x1);
            }
        }
        for (int j = 0; j < BLOCK; j++)
            sum[0][j] = _mm512_insertf32x8(_mm512_castps256_ps512(lo[j]), hi[j], 1);
        return;
    }
    for (int64_t k = k0; k < k1; k += CHUNK) {
        __m512bh xv[MAX_ROWS];
        const uint16_t *line = AT(wr, k);
        if (BLOCK == GROUP) prefetch_group_ahead(line);
        for (int m = 0; m < ROWS; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int j = 0; j < BLOCK; j++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(line + j * CHUNK);
            for (int m = 0; m < ROWS; m++) sum[m][j] = _mm512_dpbf16_ps(sum[m][j], a, xv[m]);
        }
    }
}
#define RANGE_bf16 range_dot
#undef STEP_bf16
#define STEP_bf16 CHUNK
#else
#define RANGE_bf16 range_bf16
#endif
#define RANGE_f32 range_f32

/* Weight rows [n0, n0 + SPAN) in blocks of BLOCK: a whole group (SPAN = GROUP) or one row.
 * Where a block is narrower than the group (several input rows), the group's blocks take turns
 * over ranges of RANGE_CHUNKS chunks, so that the group is still read once, in order, while a
 * range stays in the L1 cache (each block going over all of K in turn read one line in
 * GROUP / BLOCK per pass, a stride the prefetchers followed poorly: 8 rows at avx2 ran at half
 * the bandwidth of the row-by-row layout), and each block asks for its share of the next
 * range's lines (past the group's last range, the next group's) into L2, not L1: an L1
 * prefetch holds one of the few L1 miss buffers until its line comes (2-4 rows read 12-19 GB/s
 * that way, 18-25 to L2, on a Zen 4; 8 rows at AVX512-BF16 14-15 -> 18-20 GB/s). In between,
 * a block's sums wait in `saved`; a range runs on a local copy, which the compiler keeps in
 * registers (it cannot keep `saved` there: vector types may alias anything). Every pair's sum
 * still takes its products in the same order. */
#define RANGE_CHUNKS 8
#define DEFINE_SPAN(T, SUFFIX)                                                                  \
    static inline __attribute__((always_inline)) void span_##SUFFIX(                            \
        const T *x, const uint16_t *w, const T *bias, T *out, int64_t n0, int64_t N, int64_t K, \
        const int ROWS, const int BLOCK, const int SPAN) {                                      \
        const uint16_t *wr = weight_row(w, n0, K); /* rows n0 + j at wr + j * CHUNK */          \
        const int BLOCKS = SPAN / BLOCK;                                                        \
        int64_t end = K - K % STEP_##SUFFIX;                                                    \
        int64_t range = BLOCKS == 1 ? end : RANGE_CHUNKS * CHUNK;                               \
        vec saved[GROUP * MAX_ROWS]; /* block b's sum (m, j) at (b * ROWS + m) * BLOCK + j */  \
        vec sum[MAX_ROWS][MAX_BLOCK];                                                           \
        for (int i = 0; i < SPAN * ROWS; i++) saved[i] = vec_zero();                            \
        for (int64_t k0 = 0; k0 < end; k0 += range) {                                           \
            int64_t k1 = k0 + range < end ? k0 + range : end;                                   \
            for (int b = 0; b < BLOCKS; b++) {                                                  \
                vec *mine = saved + b * ROWS * BLOCK;                                           \
                if (BLOCKS > 1)                                                                 \
                    for (int i = 0; i < RANGE_CHUNKS * BLOCK; i++)                              \
                        __builtin_prefetch(AT(wr, k0) +                                         \
                                           (RANGE_CHUNKS * (GROUP + b * BLOCK) + i) * CHUNK,    \
                                           0, 1);                                               \
                for (int m = 0; m < ROWS; m++)                                                  \
                    for (int j = 0; j < BLOCK; j++) sum[m][j] = mine[m * BLOCK + j];            \
                RANGE_##SUFFIX(x, wr + b * BLOCK * CHUNK, sum, k0, k1, K, ROWS, BLOCK);         \
                for (int m = 0; m < ROWS; m++)                                                  \
                    for (int j = 0; j < BLOCK; j++) mine[m * BLOCK + j] = sum[m][j];            \
            }                                                                                   \
        }                                                                                       \
        for (int b = 0; b < BLOCKS; b++) {                                                      \
            for (int m = 0; m < ROWS; m++)                                                      \
                for (int j = 0; j < BLOCK; j++) sum[m][j] = saved[(b * ROWS + m) * BLOCK + j];  \
            finish_##SUFFIX(sum, x, wr + b * BLOCK * CHUNK, bias, out, n0 + b * BLOCK, N, K,    \
                            end, ROWS, BLOCK);                                                  \
        }                                                                                       \
    }

DEFINE_SPAN(float, f32)
DEFINE_SPAN(uint16_t, bf16)

/* Weight rows per block for a number of input rows: ROWS x BLOCK accumulators plus ROWS inputs
 * stay within the registers (32 with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__)
#define BLOCK_1 8
#define BLOCK_2 8
#define BLOCK_3 4
#define BLOCK_4 4
#define BLOCK_5_TO_7 2
#define BLOCK_8 2
#else
#define BLOCK_1 8
#define BLOCK_2 4
#define BLOCK_3 2
#define BLOCK_4 2
#define BLOCK_5_TO_7 2 /* the inputs are read from memory by the FMAs, so 14 sums fit */
#define BLOCK_8 1
#endif

/* One function per (activation type, input rows), with the sizes as literals inside the
 * parallel loop: OpenMP outlines a loop body before constants are propagated into it, so a
 * shared loop with the sizes as arguments compiled to a generic, half as fast one. Whole groups
 * first, then the last N % GROUP weight rows one at a time (the same accumulation per pair). */
#define DEFINE_ROWS(T, SUFFIX, ROWS, BLOCK)                                                     \
    static void rows_##SUFFIX##_##ROWS(const T *x, const uint16_t *w, const T *bias, T *out,    \
                                       int64_t N, int64_t K, int64_t threads) {                 \
        int64_t stop = N - N % GROUP;                                                           \
        _Pragma("omp parallel num_threads(threads)")                                           \
        {                                                                                       \
            _Pragma("omp for schedule(static) nowait")                                         \
            for (int64_t n0 = 0; n0 < stop; n0 += GROUP)                                        \
                span_##SUFFIX(x, w, bias, out, n0, N, K, ROWS, BLOCK, GROUP);                   \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t n = stop; n < N; n++)                                                  \
                span_##SUFFIX(x, w, bias, out, n, N, K, ROWS, 1, 1);                            \
        }                                                                                       \
    }

/* bf16 activations take the AMX body (below) for every row count where the process has the
 * tiles and it is on (gemv_use_amx), else the dot-product body: one body for a row alone and in
 * any batch, so a row's bits still do not depend on its neighbours. */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                int64_t rows, int64_t N, int64_t K, int64_t threads);
int amx_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                    int64_t rows, int64_t N, int64_t K, int64_t threads);
int gemv_amx_rows(void);
static int linear_or_amx_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                              uint16_t *out, int64_t rows, int64_t N, int64_t K, int64_t threads) {
    if (amx_linear_bf16(x, w, bias, out, rows, N, K, threads) == 0) return 0;
    return linear_bf16(x, w, bias, out, rows, N, K, threads); /* -1 past MAX_ROWS */
}
#define LINEAR_f32 linear_f32
#define LINEAR_bf16 linear_or_amx_bf16
/* Rows few_rows_linear_* takes: bf16 up to AMX_MAX_ROWS where the AMX body runs (a decode step
 * of up to 32 streams then runs in one decode-loop call too), else MAX_ROWS. */
#define ROWS_LIMIT_f32 MAX_ROWS
#define ROWS_LIMIT_bf16 (gemv_amx_rows() > MAX_ROWS ? gemv_amx_rows() : MAX_ROWS)

#define DEFINE_TYPE(T, SUFFIX)                                                                  \
    DEFINE_ROWS(T, SUFFIX, 1, BLOCK_1)                                                          \
    DEFINE_ROWS(T, SUFFIX, 2, BLOCK_2)                                                          \
    DEFINE_ROWS(T, SUFFIX, 3, BLOCK_3)                                                          \
    DEFINE_ROWS(T, SUFFIX, 4, BLOCK_4)                                                          \
    DEFINE_ROWS(T, SUFFIX, 5, BLOCK_5_TO_7)                                                     \
    DEFINE_ROWS(T, SUFFIX, 6, BLOCK_5_TO_7)                                                     \
    DEFINE_ROWS(T, SUFFIX, 7, BLOCK_5_TO_7)                                                     \
    DEFINE_ROWS(T, SUFFIX, 8, BLOCK_8)                                                          \
                                                                                                \
    /* Returns -1 (and computes nothing) when rows is out of range. */                          \
    int linear_##SUFFIX(const T *x, const uint16_t *w, const T *bias, T *out, int64_t rows,     \
                        int64_t N, int64_t K, int64_t threads) {                                \
        switch (rows) {                                                                         \
        case 1: rows_##SUFFIX##_1(x, w, bias, out, N, K, threads); return 0;                    \
        case 2: rows_##SUFFIX##_2(x, w, bias, out, N, K, threads); return 0;                    \
        case 3: rows_##SUFFIX##_3(x, w, bias, out, N, K, threads); return 0;                    \
        case 4: rows_##SUFFIX##_4(x, w, bias, out, N, K, threads); return 0;                    \
        case 5: rows_##SUFFIX##_5(x, w, bias, out, N, K, threads); return 0;                    \
        case 6: rows_##SUFFIX##_6(x, w, bias, out, N, K, threads); return 0;                    \
        case 7: rows_##SUFFIX##_7(x, w, bias, out, N, K, threads); return 0;                    \
        case 8: rows_##SUFFIX##_8(x, w, bias, out, N, K, threads); return 0;                    \
        default: return -1;                                                                     \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* The linear with its neighbours: with norm_weight, the input is weight * rms_norm(residual \
     * += delta) (delta may be NULL; x is ignored), else x; with silu, out [rows, N / 2] is      \
     * silu(gate) * up of the linear's two halves, else the linear's [rows, N]. Returns -1 when  \
     * rows is out of range, -2 when scratch memory cannot be had. */                           \
    int few_rows_linear_##SUFFIX(const T *delta, T *residual, const T *norm_weight, float eps,  \
                                 const T *x, const uint16_t *w, const T *bias, T *out,          \
                                 int64_t rows, int64_t N, int64_t K, int64_t silu,              \
                                 int64_t threads) {                                             \
        if (rows < 1 || rows > ROWS_LIMIT_##SUFFIX) return -1;                                  \
        if (norm_weight) {                                                                      \
            T *normed = thread_scratch(0, (size_t)(rows * K) * sizeof(T));                      \
            if (!normed) return -2;                                                             \
            for (int64_t r = 0; r < rows; r++)                                                  \
                add_rms_norm_row_##SUFFIX(delta ? delta + r * K : NULL, residual + r * K,       \
                                          norm_weight, normed + r * K, K, eps);                 \
            x = normed;                                                                         \
        }                                                                                       \
        T *linear_out = out;                                                                    \
        if (silu) {                                                                             \
            linear_out = thread_scratch(1, (size_t)(rows * N) * sizeof(T));                     \
            if (!linear_out) return -2;                                                         \
        }                                                                                       \
        int status = LINEAR_##SUFFIX(x, w, bias, linear_out, rows, N, K, threads);              \
        if (status) return status;                                                              \
        if (silu)                                                                               \
            for (int64_t r = 0; r < rows; r++)                                                  \
                silu_mul_row_##SUFFIX(linear_out + r * N, out + r * (N / 2), N / 2);            \
        return 0;                                                                               \
    }

DEFINE_TYPE(float, f32)
DEFINE_TYPE(uint16_t, bf16)

/* ---- AMX: bf16 linear layers of 1 to AMX_MAX_ROWS rows over the same weights ----
 *
 * A decode step of up to 32 streams is still about one pass over the weights, but oneDNN's AMX
 * matmul streams them at well under the bandwidth at 9-32 rows, and the dot-product bodies above
 * grow with the rows (at 8 rows 1.5-1.9x their one-row time; docs/benchmarks.md). On the tiles
 * a pass costs about the same at 1 and at 32 rows, and at one row it matches the dot products
 * (18.1 against 18.3 GB/s over the default model's layers, once the dot products asked for
 * their lines ahead; it had been the faster, 17.0-17.7 against 20.6-20.8 ms before that).
 * So few_rows_linear_bf16 takes this body for every row count where it runs (a row's bits then
 * still do not depend on its batch), and forward takes it for 9-32 rows (BoundLinear.amx).
 * This reads the streaming layout with the tiles:
 * one GROUP x CHUNK block of weight rows is an A tile (8 rows of 64 bytes, 64 apart), the input
 * rows re-laid as B tiles (16 input rows x 16 pairs of K, the layout AMX multiplies in), so a C
 * tile holds out^T for 8 weight rows x 16 input rows. A thread takes pairs of groups (a
 * contiguous stretch of the weight), keeps 2 groups x 2 input blocks of sums in the C tiles
 * over all of K, and asks for the weight a few chunks ahead into L1 (into L2, as before, a
 * one-row pass ran 4% slower). Each output is its row's
 * own sum whatever the other rows are (fp32, rounded once after the bias), but not in the
 * order of the dot-product bodies: a row's bits differ from its few-row result, as oneDNN's do.
 * Built where the compiler targets AMX (-march=native on a CPU with it); used once the process
 * has the tile state (gemv_amx_ready). */
#if HAVE_AMX_TILES && defined(__AVX512BF16__)
#define HAVE_GEMV_AMX 1
#else
#define HAVE_GEMV_AMX 0
#endif

#define AMX_PREFETCH_CHUNKS 8

#if HAVE_GEMV_AMX
static int gemv_amx_permitted; /* gemv_amx_ready's answer: 1 yes, -1 no, 0 not asked */
static int gemv_amx_off; /* gemv_use_amx(0): the dot-product body for every row count */

/* The input rows as B tiles: per block of 16 input rows and chunk of K, 16 rows (pairs of K) of
 * width[b % 2] input rows' pairs (the block's rows, at most 16); x's pairs are 32-bit words, so
 * this is a transpose of words, with zeros past the rows and past K. Block b starts at word
 * b chunks 256 whatever its width. */
static void amx_lay_out_inputs(const uint16_t *x, uint32_t *tiles, int64_t rows, int64_t K,
                               int64_t blocks, int64_t chunks, const int64_t width[2]) {
    const uint32_t *pairs = (const uint32_t *)x;
    int64_t row_pairs = K / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t w = width[b % 2];
            uint32_t *tile = tiles + b * chunks * 256 + c * 16 * w;
            for (int64_t i = 0; i < w; i++) {
                int64_t m = b * 16 + i;
                for (int p = 0; p < 16; p++) {
                    int64_t q = c * 16 + p;
                    tile[p * w + i] = m < rows && q < row_pairs ? pairs[m * row_pairs + q] : 0;
                }
            }
        }
}

/* C tile sums [8 weight rows][16 input rows] -> out rows m0.., columns n0.., bias added. */
static void amx_store(const float sums[8][16], const uint16_t *bias, uint16_t *out, int64_t m0,
                      int64_t n0, int64_t rows, int64_t N) {
    uint16_t rounded[8][16];
    for (int i = 0; i < 8; i++) {
        __m512 v = _mm512_loadu_ps(sums[i]);
        if (bias && n0 + i < N) v = _mm512_add_ps(v, _mm512_set1_ps(bf16_to_float(bias[n0 + i])));
        _mm256_storeu_si256((__m256i *)rounded[i], (__m256i)_mm512_cvtneps_pbh(v));
    }
    int64_t width = N - n0 < 8 ? N - n0 : 8, height = rows - m0 < 16 ? rows - m0 : 16;
    for (int64_t j = 0; j < height; j++)
        for (int64_t i = 0; i < width; i++) out[(m0 + j) * N + n0 + i] = rounded[i][j];
}

static inline void amx_prefetch(const uint16_t *chunk) {
    for (int line = 0; line < GROUP * CHUNK * 2 / 64; line++)
        _mm_prefetch((const char *)chunk + line * 64, _MM_HINT_T0);
}
#endif

/* 1 where this build has the AMX body and the process may use the tiles (asked once). */
int gemv_amx_ready(void) {
#if HAVE_GEMV_AMX
    gemv_amx_permitted = amx_permitted() ? 1 : -1;
    return gemv_amx_permitted == 1;
#else
    return 0;
#endif
}

/* The rows the AMX body takes now: AMX_MAX_ROWS, or 0 where it does not run. */
int gemv_amx_rows(void) {
#if HAVE_GEMV_AMX
    return gemv_amx_permitted == 1 && !gemv_amx_off ? AMX_MAX_ROWS : 0;
#else
    return 0;
#endif
}

/* Whether the AMX body runs (1, the default) or the dot-product body does (0): for tests of the
 * latter on a CPU with the tiles. Returns whether the AMX body is now used. */
int gemv_use_amx(int64_t on) {
#if HAVE_GEMV_AMX
    gemv_amx_off = !on;
    return gemv_amx_permitted == 1 && !gemv_amx_off;
#else
    (void)on;
    return 0;
#endif
}

/* out [rows, N] = x [rows, K] @ w.T (+ bias), bf16, w in the streaming layout. Returns -1 where
 * this build or process has no AMX, rows is outside 1..AMX_MAX_ROWS or K is odd, -2 when
 * scratch memory cannot be had. */
int amx_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                    int64_t rows, int64_t N, int64_t K, int64_t threads) {
#if HAVE_GEMV_AMX
    if (gemv_amx_permitted != 1 || gemv_amx_off || rows < 1 || rows > AMX_MAX_ROWS || K % 2)
        return -1;
    int64_t chunks = padded_k(K) / CHUNK, blocks = (rows + 15) / 16;
    int64_t groups = (N + GROUP - 1) / GROUP, pairs = (groups + 1) / 2;
    /* A block of fewer than 16 rows is B and C tiles of that many columns: a B tile of 16
     * columns was 1 KiB of mostly zeros read per chunk beside 1 KiB of weights (one row over the
     * default model's layers: 13.4 -> 15.3 GB/s; 1-8 rows 1.1-1.16x; docs/benchmarks.md). Even
     * blocks use tiles 2, 4, 6 and odd ones 3, 5, 7, so each parity has one width: the last
     * block's where there are at most two. A product's sums do not depend on the columns beside
     * it, so a row's bits stay those of any batch. */
    const int64_t width[2] = {blocks == 1 ? rows : 16, blocks == 2 ? rows - 16 : 16};
    /* slot 2: few_rows_linear_bf16 holds its normed input in 0 and its output in 1 */
    uint32_t *tiles = thread_scratch(2, (size_t)(blocks * chunks * 256) * sizeof(uint32_t));
    if (!tiles) return -2;
    amx_lay_out_inputs(x, tiles, rows, K, blocks, chunks, width);
    const int64_t block_words = chunks * 256, group_elements = chunks * GROUP * CHUNK;
    const uint16_t even = (uint16_t)(4 * width[0]), odd = (uint16_t)(4 * width[1]);
#pragma omp parallel num_threads(threads)
    {
        static const uint8_t rows_of[8] = {GROUP, GROUP, 16, 16, GROUP, GROUP, GROUP, GROUP};
        const uint16_t bytes_of[8] = {64, 64, even, odd, even, odd, even, odd};
        TileConfig saved; /* A: 0-1, B: 2-3, C: 4-7 */
        tiles_enter_shaped(&saved, rows_of, bytes_of);
        float sums[4][8][16];
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++) {
            int64_t g0 = 2 * pair;
            int two_groups = g0 + 1 < groups;
            const uint16_t *a0 = w + g0 * group_elements, *a1 = a0 + group_elements;
            for (int64_t b = 0; b < blocks; b += 2) {
                int two_blocks = b + 1 < blocks, first = b == 0;
                const uint32_t *b0 = tiles + b * block_words, *b1 = b0 + block_words;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                for (int64_t c = 0; c < chunks; c++) {
                    const int64_t at = c * GROUP * CHUNK;
                    const int64_t ahead = at + AMX_PREFETCH_CHUNKS * GROUP * CHUNK;
                    /* past a group's end, a1's prefetch reaches the next pair (this thread's
                     * next, under the static schedule); a prefetch never faults */
                    if (first) {
                        amx_prefetch(a0 + ahead);
                        if (two_groups) amx_prefetch(a1 + ahead);
                    }
                    _tile_loadd(0, a0 + at, CHUNK * 2);
                    _tile_loadd(2, b0 + c * 16 * width[0], even);
                    _tile_dpbf16ps(4, 0, 2);
                    if (two_blocks) {
                        _tile_loadd(3, b1 + c * 16 * width[1], odd);
                        _tile_dpbf16ps(5, 0, 3);
                    }
                    if (two_groups) {
                        _tile_loadd(1, a1 + at, CHUNK * 2);
                        _tile_dpbf16ps(6, 1, 2);
                        if (two_blocks) _tile_dpbf16ps(7, 1, 3);
                    }
                }
                _tile_stored(4, sums[0], 64);
                _tile_stored(5, sums[1], 64);
                _tile_stored(6, sums[2], 64);
                _tile_stored(7, sums[3], 64);
                for (int t = 0; t < 4; t++) {
                    if ((t & 1 && !two_blocks) || (t & 2 && !two_groups)) continue;
                    int64_t m0 = (b + (t & 1)) * 16, n0 = (g0 + t / 2) * GROUP;
                    amx_store(sums[t], bias, out, m0, n0, rows, N);
                }
            }
        }
        tiles_leave(&saved);
    }
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)out, (void)rows, (void)N, (void)K, (void)threads;
    return -1;
#endif
}
