/* Linear layer over bf16 weights for a few rows (a decode step's batch, up to 8): out = x @ w.T (+ bias).
 *
 * At a few rows a linear layer is a pass over its weight, so its time is the weight's
 * bytes over the memory bandwidth. This streams a block of weight rows at a time, each chunk of
 * K loaded once and multiplied into every input row, and splits the output rows across OpenMP
 * threads. Weights are always bf16 (half the bytes of fp32); the activations are either bf16
 * (`_bf16` entries: bf16 models) or fp32 (`_f32` entries: fp32 math over bf16 weights, the
 * default on CPUs without bf16 dot products). The bodies, by the ISA level the file is built
 * for (yaied/kernels/cpu_isa.py):
 *
 *   avx512_bf16  bf16 activations: AVX512-BF16 dot products (32 elements an instruction);
 *                fp32 activations: as avx512
 *   avx512       weights widened to fp32 in registers (a shift), 16-wide FMAs
 *   avx2         the same 8 wide (AVX2 + FMA)
 *   generic      plain C over 8-element arrays, which the compiler vectorises where it can
 *
 * Every (input row, weight row) pair has its own accumulator, filled in the same order whatever
 * the number of rows, so a row's result is the same bits alone and in any batch at one level.
 *
 * Layouts (contiguous): x [rows, K], w [N, K] bf16 (nn.Linear's weight), bias [N] or NULL
 * (the activations' type), out [rows, N]. rows <= MAX_ROWS.
 *
 * `few_rows_linear_*` also runs the layer's elementwise neighbours, so that a decoder layer at
 * batch 1 makes one call where it made two or three: the residual add and RMSNorm before the
 * linear (q/k/v and gate/up projections), SiLU-and-multiply after it (gate/up), with the bodies
 * of cpu_fused.c's kernels (cpu_rows.h) and so the same results.
 */
#include "cpu_rows.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8
#define MAX_BLOCK 8

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
                    v += bf16_to_float(wr[j * K + k]) * ROW_LOAD_##SUFFIX(x[m * K + k]);        \
                if (bias) v += ROW_LOAD_##SUFFIX(bias[n0 + j]);                                 \
                out[m * N + n0 + j] = ROW_STORE_##SUFFIX(v);                                    \
            }                                                                                   \
    }

/* Weight rows [n0, n0 + BLOCK) against ROWS input rows of type T; sizes are literals at every
 * call site (the DEFINE_ROWS functions), so the accumulators stay in registers. */
#define DEFINE_BLOCK(T, SUFFIX)                                                                 \
    DEFINE_FINISH(T, SUFFIX)                                                                    \
    static inline __attribute__((always_inline)) void block_##SUFFIX(                           \
        const T *x, const uint16_t *w, const T *bias, T *out, int64_t n0, int64_t N, int64_t K, \
        const int ROWS, const int BLOCK) {                                                      \
        const uint16_t *wr = w + n0 * K;                                                        \
        int64_t end = K - K % LANES;                                                            \
        vec sum[MAX_ROWS][MAX_BLOCK];                                                           \
        for (int m = 0; m < ROWS; m++)                                                          \
            for (int j = 0; j < BLOCK; j++) sum[m][j] = vec_zero();                             \
        for (int64_t k = 0; k < end; k += LANES) {                                              \
            vec xv[MAX_ROWS];                                                                   \
            for (int m = 0; m < ROWS; m++) xv[m] = LOAD_ACT_##SUFFIX(x + m * K + k);            \
            if (k % 32 == 0) /* a cache line of each row of the next block, a block ahead */    \
                for (int j = 0; j < BLOCK; j++) __builtin_prefetch(wr + (BLOCK + j) * K + k);   \
            for (int j = 0; j < BLOCK; j++) {                                                   \
                vec a = load_bf16(wr + j * K + k);                                              \
                for (int m = 0; m < ROWS; m++) sum[m][j] = vec_fma(a, xv[m], sum[m][j]);        \
            }                                                                                   \
        }                                                                                       \
        finish_##SUFFIX(sum, x, wr, bias, out, n0, N, K, end, ROWS, BLOCK);                     \
    }

DEFINE_BLOCK(float, f32)
DEFINE_BLOCK(uint16_t, bf16)

#if defined(__AVX512BF16__)
/* bf16 activations with AVX512-BF16: pairs of products summed in one instruction, 32 elements
 * of K a step. Measured on the default model's head (49152 x 576) at one row, 8 weight rows a
 * block streamed about 10% faster than 4. Replaces block_bf16 at this level. */
static __attribute__((noinline)) void finish_dot(__m512 sum[MAX_ROWS][MAX_BLOCK],
                                                 const uint16_t *x, const uint16_t *wr,
                                                 const uint16_t *bias, uint16_t *out, int64_t n0,
                                                 int64_t N, int64_t K, int64_t end, int rows,
                                                 int block) {
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < block; j++) {
            float v = _mm512_reduce_add_ps(sum[m][j]);
            for (int64_t k = end; k < K; k++)
                v += bf16_to_float(wr[j * K + k]) * bf16_to_float(x[m * K + k]);
            if (bias) v += bf16_to_float(bias[n0 + j]);
            out[m * N + n0 + j] = float_to_bf16(v);
        }
}

static inline __attribute__((always_inline)) void block_dot_bf16(
    const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t n0,
    int64_t N, int64_t K, const int ROWS, const int BLOCK) {
    const uint16_t *wr = w + n0 * K;
    int64_t end = K - K % 32;
    __m512 sum[MAX_ROWS][MAX_BLOCK];
    for (int m = 0; m < ROWS; m++)
        for (int j = 0; j < BLOCK; j++) sum[m][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < end; k += 32) {
        __m512bh xv[MAX_ROWS];
        for (int m = 0; m < ROWS; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int j = 0; j < BLOCK; j++) __builtin_prefetch(wr + (BLOCK + j) * K + k);
        for (int j = 0; j < BLOCK; j++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(wr + j * K + k);
            for (int m = 0; m < ROWS; m++) sum[m][j] = _mm512_dpbf16_ps(sum[m][j], a, xv[m]);
        }
    }
    finish_dot(sum, x, wr, bias, out, n0, N, K, end, ROWS, BLOCK);
}
#define BF16_BLOCK block_dot_bf16
#else
#define BF16_BLOCK block_bf16
#endif

/* Weight rows per block for a number of input rows: ROWS x BLOCK accumulators plus ROWS inputs
 * stay within the registers (32 with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__)
#define BLOCK_1 8
#define BLOCK_2 8
#define BLOCK_3 4
#define BLOCK_4 4
#define BLOCK_5_TO_8 2
#else
#define BLOCK_1 8
#define BLOCK_2 4
#define BLOCK_3 2
#define BLOCK_4 2
#define BLOCK_5_TO_8 1
#endif

/* One function per (activation type, input rows), with the sizes as literals inside the
 * parallel loop: OpenMP outlines a loop body before constants are propagated into it, so a
 * shared loop with the sizes as arguments compiled to a generic, half as fast one. Full blocks
 * first, then the last N % BLOCK weight rows one at a time (the same accumulation per pair). */
#define DEFINE_ROWS(T, SUFFIX, BODY, ROWS, BLOCK)                                               \
    static void rows_##SUFFIX##_##ROWS(const T *x, const uint16_t *w, const T *bias, T *out,    \
                                       int64_t N, int64_t K, int64_t threads) {                 \
        int64_t stop = N - N % BLOCK;                                                           \
        _Pragma("omp parallel num_threads(threads)")                                           \
        {                                                                                       \
            _Pragma("omp for schedule(static) nowait")                                         \
            for (int64_t n0 = 0; n0 < stop; n0 += BLOCK)                                        \
                BODY(x, w, bias, out, n0, N, K, ROWS, BLOCK);                                   \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t n = stop; n < N; n++) BODY(x, w, bias, out, n, N, K, ROWS, 1);         \
        }                                                                                       \
    }

#define DEFINE_TYPE(T, SUFFIX, BODY)                                                            \
    DEFINE_ROWS(T, SUFFIX, BODY, 1, BLOCK_1)                                                    \
    DEFINE_ROWS(T, SUFFIX, BODY, 2, BLOCK_2)                                                    \
    DEFINE_ROWS(T, SUFFIX, BODY, 3, BLOCK_3)                                                    \
    DEFINE_ROWS(T, SUFFIX, BODY, 4, BLOCK_4)                                                    \
    DEFINE_ROWS(T, SUFFIX, BODY, 5, BLOCK_5_TO_8)                                               \
    DEFINE_ROWS(T, SUFFIX, BODY, 6, BLOCK_5_TO_8)                                               \
    DEFINE_ROWS(T, SUFFIX, BODY, 7, BLOCK_5_TO_8)                                               \
    DEFINE_ROWS(T, SUFFIX, BODY, 8, BLOCK_5_TO_8)                                               \
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
        if (rows < 1 || rows > MAX_ROWS) return -1;                                             \
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
        linear_##SUFFIX(x, w, bias, linear_out, rows, N, K, threads);                           \
        if (silu)                                                                               \
            for (int64_t r = 0; r < rows; r++)                                                  \
                silu_mul_row_##SUFFIX(linear_out + r * N, out + r * (N / 2), N / 2);            \
        return 0;                                                                               \
    }

DEFINE_TYPE(float, f32, block_f32)
DEFINE_TYPE(uint16_t, bf16, BF16_BLOCK)
