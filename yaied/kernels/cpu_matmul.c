/* Linear layers of many rows under fp32 math: out = x @ w.T (+ bias), the weight's fp32 values
 * in a panel layout.
 *
 * Under fp32 math over bf16 weights (CPUs without bf16 dot products), a step of more rows than
 * the few-row kernel takes (a prefill chunk, a decode step of 9 or more streams) is a matmul at
 * the FMA rate. oneDNN's packed fp32 matmul reaches that rate at hundreds of rows, but at 32 rows
 * its two threads split the default model's narrow layers (576 and 960 outputs) unevenly: 190-210
 * GFLOPS where this kernel runs them at 250 (avx2, 2 threads of a Zen 5; docs/benchmarks.md).
 *
 * The weight [N, K] is kept as panels of WIDTH = 2 vectors of output columns, [N / WIDTH, K,
 * WIDTH] (cpu_matmul.py's pack_panels, zero-padded past N): at each k a panel's WIDTH values are
 * two vector loads. A tile of TILE_ROWS input rows against one panel keeps 2 x TILE_ROWS sums
 * in registers (12 of AVX2's 16) and, per k, broadcasts each row's x[k] into two FMAs, so that
 * a k step is 2 loads of the weight, TILE_ROWS broadcasts and 2 x TILE_ROWS FMAs (the 4 x 24
 * tile, with its weights read by the FMAs from memory, took 16 loads per 12 FMAs and ran at
 * 190). Threads take panels; a panel's first tile asks for the next panel's lines, one a k step
 * (without it the default model's LM head, 113 MB of panels, ran at 195 instead of 245).
 *
 * Every output is its own sum over k = 0, 1, ..., K - 1 in order, then + bias, whatever the
 * tile, the number of rows and the blocks of k (a block's sums go on from the last block's,
 * stored exactly in fp32): a row's result is the same bits alone and in any batch.
 *
 * Layouts (contiguous): x [rows, K], bias [N] or NULL, out [rows, N], fp32.
 *
 * `panel_rows_linear_f32` is the same with the layer's elementwise neighbours, in the few-row
 * kernel's signature (cpu_gemv.c's few_rows_linear_f32), so that the decode loop
 * (cpu_decode_loop.c) runs a decode step of more rows than that kernel takes over the panels.
 */
#include "cpu_rows.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm512_set1_ps(v); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm256_set1_ps(v); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
#else
#define LANES 8
typedef struct {
    float v[LANES];
} vec;
static inline vec vec_zero(void) { return (vec){{0}}; }
static inline vec vec_set1(float s) {
    vec r;
    for (int i = 0; i < LANES; i++) r.v[i] = s;
    return r;
}
static inline vec vec_fma(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c.v[i] += a.v[i] * b.v[i];
    return c;
}
static inline vec vec_add(vec a, vec b) {
    for (int i = 0; i < LANES; i++) a.v[i] += b.v[i];
    return a;
}
static inline vec vec_load(const float *p) {
    vec r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void vec_store(float *p, vec v) { memcpy(p, v.v, sizeof v.v); }
#endif

#define WIDTH (2 * LANES)
#define TILE_ROWS 6
/* Rows of x per pass over the panels: x's block stays in the L2 or L3 cache while every panel
 * goes over it (a pass reads each panel once). */
#define ROW_BLOCK 512

/* Lines of a panel per block of k: 128 KiB of them (1024 at AVX-512, 2048 below), which stay
 * in the L2 cache while a block of rows goes over them. A whole panel of a wide K does not (a
 * 1B-shaped down projection's, K = 8192, is 1 MiB at AVX-512): at 32 rows it ran at 307-313
 * GFLOPS unblocked, 354-414 in blocks (avx512, 2 threads of a Zen 5; docs/benchmarks.md). */
#define K_BLOCK (128 * 1024 / (WIDTH * (int64_t)sizeof(float)))

int matmul_panel_width(void) { return WIDTH; }

/* One input row of a tile: its broadcast x[k] into the panel's two vectors. The sums are named
 * variables, not an array: GCC kept an array of vectors in memory, a store per FMA. */
#define TILE_ROW(r)                                                                                \
    if (ROWS > r) {                                                                                \
        vec s = vec_set1(x[r * K + k]);                                                            \
        lo##r = vec_fma(s, w0, lo##r);                                                             \
        hi##r = vec_fma(s, w1, hi##r);                                                             \
    }
#define TILE_LOAD(r)                                                                               \
    if (ROWS > r) {                                                                                \
        lo##r = vec_load(dst + r * stride);                                                        \
        hi##r = vec_load(dst + r * stride + LANES);                                                \
    }
#define TILE_STORE(r)                                                                              \
    if (ROWS > r) {                                                                                \
        vec_store(dst + r * stride, last ? vec_add(lo##r, b0) : lo##r);                            \
        vec_store(dst + r * stride + LANES, last ? vec_add(hi##r, b1) : hi##r);                    \
    }

/* ROWS (1..TILE_ROWS, a literal at every call) rows of x (row stride x_stride) against kn
 * lines of a panel, into dst [ROWS, stride]: the sums start at zero for a panel's first block of
 * k (`first`), else from what dst holds (the earlier blocks' sums, exact in fp32), and get the
 * bias (bias0: the panel's WIDTH values, zeros where there is none) after its last (`last`).
 * With `ahead`, asks for the lines there (the next block's) as it goes. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride,
                                                      int64_t kn, const float *panel,
                                                      const float *bias0, const float *ahead,
                                                      float *dst, int64_t stride, const int ROWS,
                                                      int first, int last) {
    vec lo0 = vec_zero(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0;
    vec lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
    if (!first) {
        TILE_LOAD(0)
        TILE_LOAD(1)
        TILE_LOAD(2)
        TILE_LOAD(3)
        TILE_LOAD(4)
        TILE_LOAD(5)
    }
    const int64_t K = x_stride;
    for (int64_t k = 0; k < kn; k++) {
        const float *line = panel + k * WIDTH;
        if (ahead)
            for (int i = 0; i < WIDTH; i += 16) __builtin_prefetch(ahead + k * WIDTH + i, 0, 3);
        vec w0 = vec_load(line), w1 = vec_load(line + LANES);
        TILE_ROW(0)
        TILE_ROW(1)
        TILE_ROW(2)
        TILE_ROW(3)
        TILE_ROW(4)
        TILE_ROW(5)
    }
    vec b0 = vec_zero(), b1 = b0;
    if (last) b0 = vec_load(bias0), b1 = vec_load(bias0 + LANES);
    TILE_STORE(0)
    TILE_STORE(1)
    TILE_STORE(2)
    TILE_STORE(3)
    TILE_STORE(4)
    TILE_STORE(5)
}

/* One function per row count, each with its literal: the prefetching copy for a block's first
 * tile, the plain one for the rest. */
#define DEFINE_TILE(ROWS)                                                                          \
    static void tile_##ROWS(const float *x, int64_t x_stride, int64_t kn, const float *panel,      \
                            const float *bias0, const float *ahead, float *dst, int64_t stride,   \
                            int first, int last) {                                                 \
        if (ahead)                                                                                 \
            tile(x, x_stride, kn, panel, bias0, ahead, dst, stride, ROWS, first, last);            \
        else                                                                                       \
            tile(x, x_stride, kn, panel, bias0, NULL, dst, stride, ROWS, first, last);             \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

typedef void (*tile_fn)(const float *, int64_t, int64_t, const float *, const float *,
                        const float *, float *, int64_t, int, int);
static const tile_fn TILES[TILE_ROWS + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* Rows [m0, m1) against panel p: whole panels straight into out, a block of k at a time (the
 * block's lines stay in the L2 cache while every tile of rows goes over them), the last partial
 * one (N not a multiple of WIDTH) through a tile-sized buffer, all of k at once. */
static void panel_rows(const float *x, const float *panels, const float *bias, float *out,
                       int64_t m0, int64_t m1, int64_t p, int64_t panel_count, int64_t N,
                       int64_t K) {
    const float *panel = panels + p * K * WIDTH;
    const float *next = p + 1 < panel_count ? panel + K * WIDTH : NULL;
    int64_t n0 = p * WIDTH, width = N - n0 < WIDTH ? N - n0 : WIDTH;
    float bias0[WIDTH] = {0};
    if (bias) memcpy(bias0, bias + n0, (size_t)width * sizeof(float));
    /* Tiles of nearly equal rows (32 rows: 6, 6, 5, 5, 5, 5): a tile of one or two rows keeps
     * too few sums to hide the FMAs' latency (32 rows as 6 x 5 + 2 ran at 230 GFLOPS, 36 as
     * 6 x 6 at 250). */
    int64_t tiles = (m1 - m0 + TILE_ROWS - 1) / TILE_ROWS;
    int64_t base = (m1 - m0) / tiles, longer = (m1 - m0) % tiles; /* tiles of base + 1 first */
    int64_t blocks = width == WIDTH ? (K + K_BLOCK - 1) / K_BLOCK : 1;
    for (int64_t b = 0; b < blocks; b++) {
        /* Blocks of nearly equal length; a block's first tile asks for the next block's lines
         * (after the last block: the next panel's first, the same length) */
        int64_t k0 = K * b / blocks, k1 = K * (b + 1) / blocks;
        const float *ahead = b + 1 < blocks ? panel + k1 * WIDTH : next;
        int first = b == 0, last = b + 1 == blocks;
        for (int64_t t = 0, m = m0; t < tiles; t++) {
            int64_t rows = base + (t < longer);
            const float *tile_ahead = t == 0 ? ahead : NULL;
            if (width == WIDTH) {
                TILES[rows](x + m * K + k0, K, k1 - k0, panel + k0 * WIDTH, bias0, tile_ahead,
                            out + m * N + n0, N, first, last);
            } else {
                float part[TILE_ROWS * WIDTH];
                TILES[rows](x + m * K, K, K, panel, bias0, tile_ahead, part, WIDTH, 1, 1);
                for (int64_t r = 0; r < rows; r++)
                    memcpy(out + (m + r) * N + n0, part + r * WIDTH,
                           (size_t)width * sizeof(float));
            }
            m += rows;
        }
    }
}

/* out [rows, N] = x [rows, K] @ w.T + bias, w as panels [ceil(N / WIDTH), K, WIDTH]. Returns
 * -1 for sizes out of range. */
int panel_linear_f32(const float *x, const float *panels, const float *bias, float *out,
                     int64_t rows, int64_t N, int64_t K, int64_t threads) {
    if (rows < 1 || N < 1 || K < 1) return -1;
    int64_t panel_count = (N + WIDTH - 1) / WIDTH;
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int64_t m1 = rows - m0 < ROW_BLOCK ? rows : m0 + ROW_BLOCK;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panel_count; p++)
            panel_rows(x, panels, bias, out, m0, m1, p, panel_count, N, K);
    }
    return 0;
}

/* cpu_gemv.c's few_rows_linear_f32 over panels, for any number of rows: with norm_weight, the
 * input is weight * rms_norm(residual += delta) (delta may be NULL; x is ignored), else x; with
 * silu, out [rows, N / 2] is silu(gate) * up of the linear's two halves, else the linear's
 * [rows, N]. Returns -1 for sizes out of range, -2 when scratch memory cannot be had. */
int panel_rows_linear_f32(const float *delta, float *residual, const float *norm_weight, float eps,
                          const float *x, const float *panels, const float *bias, float *out,
                          int64_t rows, int64_t N, int64_t K, int64_t silu, int64_t threads) {
    if (rows < 1 || N < 1 || K < 1 || (silu && N % 2)) return -1;
    if (norm_weight) {
        float *normed = thread_scratch(0, (size_t)(rows * K) * sizeof(float));
        if (!normed) return -2;
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm_row_f32(delta ? delta + r * K : NULL, residual + r * K, norm_weight,
                                 normed + r * K, K, eps);
        x = normed;
    }
    float *linear_out = out;
    if (silu) {
        linear_out = thread_scratch(1, (size_t)(rows * N) * sizeof(float));
        if (!linear_out) return -2;
    }
    int status = panel_linear_f32(x, panels, bias, linear_out, rows, N, K, threads);
    if (status) return status;
    if (silu)
        for (int64_t r = 0; r < rows; r++)
            silu_mul_row_f32(linear_out + r * N, out + r * (N / 2), N / 2);
    return 0;
}
