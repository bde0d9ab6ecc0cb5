/* bf16 linear layer for a few rows (a decode step's batch): out = x @ w.T (+ bias).
 *
 * At one to four rows a linear layer is a pass over its weight, so its time is the weight's
 * bytes over the memory bandwidth. oneDNN's packed linear (yaied/worker/cpu_linear.py) reaches
 * about half of it at one row on the default model's shapes; this streams eight weight rows at
 * a time (four from three input rows on), each 32-element chunk loaded once and multiplied into
 * every input row with AVX512-BF16 dot products (fp32 accumulators, as oneDNN's), and splits the
 * output rows across OpenMP threads. Built without AVX512-BF16 it computes the same in plain C (bf16 -> fp32 FMAs); the
 * launcher uses it by default only where the instructions exist.
 *
 * Layouts (contiguous, bf16): x [rows, K], w [N, K] (nn.Linear's weight), bias [N] or NULL,
 * out [rows, N]. rows <= MAX_ROWS.
 *
 * `few_rows_linear` also runs the layer's elementwise neighbours, so that a decoder layer at
 * batch 1 makes one call where it made two or three: the residual add and RMSNorm before the
 * linear (q/k/v and gate/up projections), SiLU-and-multiply after it (gate/up), with the bodies
 * of cpu_fused.c's kernels (cpu_rows.h) and so the same results.
 */
#include "cpu_rows.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MAX_ROWS 4
#define MAX_BLOCK 8 /* weight rows streamed together: 8 for one or two input rows, else 4 */

int gemv_native_bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Plain C: weight rows [n0, n0 + count) against every input row; k from k0 to K. */
static inline void dot_tail(const uint16_t *x, const uint16_t *w, float acc[MAX_ROWS][MAX_BLOCK],
                            int64_t n0, int64_t count, int64_t rows, int64_t k0, int64_t K) {
    for (int64_t j = 0; j < count; j++) {
        const uint16_t *wr = w + (n0 + j) * K;
        for (int64_t m = 0; m < rows; m++) {
            const uint16_t *xr = x + m * K;
            float s = 0.0f;
            for (int64_t k = k0; k < K; k++) s += bf16_to_float(wr[k]) * bf16_to_float(xr[k]);
            acc[m][j] += s;
        }
    }
}

static inline void store_rows(const float acc[MAX_ROWS][MAX_BLOCK], const uint16_t *bias,
                              uint16_t *out, int64_t n0, int64_t count, int64_t rows, int64_t N) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < count; j++) {
            float v = acc[m][j] + (bias ? bf16_to_float(bias[n0 + j]) : 0.0f);
            out[m * N + n0 + j] = float_to_bf16(v);
        }
}

/* Output rows [n0, N) block by block in plain C (the tail, or everything without AVX512-BF16). */
static void linear_plain(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *out, int64_t n0, int64_t rows, int64_t N, int64_t K,
                         int64_t threads) {
    int64_t blocks = (N - n0 + MAX_BLOCK - 1) / MAX_BLOCK;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(blocks > 1)")
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = n0 + b * MAX_BLOCK;
        int64_t count = N - start < MAX_BLOCK ? N - start : MAX_BLOCK;
        float acc[MAX_ROWS][MAX_BLOCK] = {{0}};
        dot_tail(x, w, acc, start, count, rows, 0, K);
        store_rows(acc, bias, out, start, count, rows, N);
    }
}

#ifdef __AVX512BF16__
/* Output rows [n0, n0 + BLOCK) against ROWS input rows. Measured on the default model's head
 * (49152 x 576) at one row, 8 weight rows a block streamed about 10% faster than 4; ROWS x BLOCK
 * accumulators stay within the 32 vector registers. */
static inline __attribute__((always_inline)) void linear_block(
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
        for (int j = 0; j < BLOCK; j++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(wr + j * K + k);
            for (int m = 0; m < ROWS; m++) sum[m][j] = _mm512_dpbf16_ps(sum[m][j], a, xv[m]);
        }
    }
    for (int m = 0; m < ROWS; m++)
        for (int j = 0; j < BLOCK; j++) {
            float v = _mm512_reduce_add_ps(sum[m][j]);
            for (int64_t k = end; k < K; k++)
                v += bf16_to_float(wr[j * K + k]) * bf16_to_float(x[m * K + k]);
            if (bias) v += bf16_to_float(bias[n0 + j]);
            out[m * N + n0 + j] = float_to_bf16(v);
        }
}

/* One function per (input rows, block) pair, with the sizes as literals inside the parallel
 * loop: OpenMP outlines a loop body before constants are propagated into it, so a shared loop
 * with the sizes as arguments compiled to a generic, half as fast one. Covers output rows
 * [0, N - N % BLOCK). */
#define DEFINE_LINEAR_ROWS(ROWS, BLOCK)                                                         \
    static void linear_rows_##ROWS(const uint16_t *x, const uint16_t *w, const uint16_t *bias,  \
                                   uint16_t *out, int64_t N, int64_t K, int64_t threads) {      \
        int64_t stop = N - N % BLOCK;                                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                      \
        for (int64_t n0 = 0; n0 < stop; n0 += BLOCK)                                            \
            linear_block(x, w, bias, out, n0, N, K, ROWS, BLOCK);                               \
    }

DEFINE_LINEAR_ROWS(1, 8)
DEFINE_LINEAR_ROWS(2, 8)
DEFINE_LINEAR_ROWS(3, 4)
DEFINE_LINEAR_ROWS(4, 4)
#endif

/* Returns -1 (and computes nothing) when rows is out of range. */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                int64_t rows, int64_t N, int64_t K, int64_t threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    int64_t done = 0;
#ifdef __AVX512BF16__
    int64_t block = rows <= 2 ? 8 : 4;
    switch (rows) {
    case 1: linear_rows_1(x, w, bias, out, N, K, threads); break;
    case 2: linear_rows_2(x, w, bias, out, N, K, threads); break;
    case 3: linear_rows_3(x, w, bias, out, N, K, threads); break;
    default: linear_rows_4(x, w, bias, out, N, K, threads); break;
    }
    done = N - N % block;
#endif
    if (done < N) linear_plain(x, w, bias, out, done, rows, N, K, threads);
    return 0;
}

/* The linear with its neighbours: with norm_weight, the input is weight * rms_norm(residual +=
 * delta) (delta may be NULL; x is ignored), else x; with silu, out [rows, N / 2] is
 * silu(gate) * up of the linear's two halves, else the linear's [rows, N]. Returns -1 when rows
 * is out of range, -2 when scratch memory cannot be had. */
int few_rows_linear(const uint16_t *delta, uint16_t *residual, const uint16_t *norm_weight,
                    float eps, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                    uint16_t *out, int64_t rows, int64_t N, int64_t K, int64_t silu,
                    int64_t threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    if (norm_weight) {
        uint16_t *normed = thread_scratch(0, (size_t)(rows * K) * sizeof(uint16_t));
        if (!normed) return -2;
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm_row_bf16(delta ? delta + r * K : NULL, residual + r * K, norm_weight,
                                  normed + r * K, K, eps);
        x = normed;
    }
    uint16_t *linear_out = out;
    if (silu) {
        linear_out = thread_scratch(1, (size_t)(rows * N) * sizeof(uint16_t));
        if (!linear_out) return -2;
    }
    linear_bf16(x, w, bias, linear_out, rows, N, K, threads);
    if (silu)
        for (int64_t r = 0; r < rows; r++)
            silu_mul_row_bf16(linear_out + r * N, out + r * (N / 2), N / 2);
    return 0;
}
