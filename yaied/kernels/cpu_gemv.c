/* bf16 linear layer for a few rows (a decode step's batch): out = x @ w.T (+ bias).
 *
 * At one to four rows a linear layer is a pass over its weight, so its time is the weight's
 * bytes over the memory bandwidth. oneDNN's packed linear (yaied/worker/cpu_linear.py) reaches
 * about half of it at one row on the default model's shapes; this streams four weight rows at a
 * time, each 32-element chunk loaded once and multiplied into every input row with AVX512-BF16
 * dot products (fp32 accumulators, as oneDNN's), and splits the output rows across OpenMP
 * threads. Built without AVX512-BF16 it computes the same in plain C (bf16 -> fp32 FMAs); the
 * launcher uses it by default only where the instructions exist.
 *
 * Layouts (contiguous, bf16): x [rows, K], w [N, K] (nn.Linear's weight), bias [N] or NULL,
 * out [rows, N]. rows <= MAX_ROWS.
 */
#include "cpu_common.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MAX_ROWS 4
#define BLOCK 4 /* weight rows streamed together */

int gemv_native_bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Plain C: weight rows [n0, n0 + count) against every input row; k from k0 to K. */
static inline void dot_tail(const uint16_t *x, const uint16_t *w, float acc[MAX_ROWS][BLOCK],
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

#ifdef __AVX512BF16__
/* Four weight rows against `ROWS` input rows over k in [0, K - K % 32); sums into acc. */
static inline __attribute__((always_inline)) void dot_block(const uint16_t *x, const uint16_t *w,
                                                            float acc[MAX_ROWS][BLOCK], int64_t n0,
                                                            int64_t K, const int ROWS) {
    __m512 sum[MAX_ROWS][BLOCK];
    for (int m = 0; m < ROWS; m++)
        for (int j = 0; j < BLOCK; j++) sum[m][j] = _mm512_setzero_ps();
    const uint16_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    int64_t end = K - K % 32;
    for (int64_t k = 0; k < end; k += 32) {
        __m512bh a0 = (__m512bh)_mm512_loadu_si512(w0 + k);
        __m512bh a1 = (__m512bh)_mm512_loadu_si512(w1 + k);
        __m512bh a2 = (__m512bh)_mm512_loadu_si512(w2 + k);
        __m512bh a3 = (__m512bh)_mm512_loadu_si512(w3 + k);
        for (int m = 0; m < ROWS; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
            sum[m][0] = _mm512_dpbf16_ps(sum[m][0], a0, xv);
            sum[m][1] = _mm512_dpbf16_ps(sum[m][1], a1, xv);
            sum[m][2] = _mm512_dpbf16_ps(sum[m][2], a2, xv);
            sum[m][3] = _mm512_dpbf16_ps(sum[m][3], a3, xv);
        }
    }
    for (int m = 0; m < ROWS; m++)
        for (int j = 0; j < BLOCK; j++) acc[m][j] = _mm512_reduce_add_ps(sum[m][j]);
    if (end < K) dot_tail(x, w, acc, n0, BLOCK, ROWS, end, K);
}
#endif

static void linear_block(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *out, int64_t n0, int64_t count, int64_t rows, int64_t N,
                         int64_t K) {
    float acc[MAX_ROWS][BLOCK] = {{0}};
#ifdef __AVX512BF16__
    if (count == BLOCK) {
        /* Constant row counts let the compiler keep every accumulator in a register. */
        switch (rows) {
        case 1: dot_block(x, w, acc, n0, K, 1); break;
        case 2: dot_block(x, w, acc, n0, K, 2); break;
        case 3: dot_block(x, w, acc, n0, K, 3); break;
        default: dot_block(x, w, acc, n0, K, 4); break;
        }
    } else {
        dot_tail(x, w, acc, n0, count, rows, 0, K);
    }
#else
    dot_tail(x, w, acc, n0, count, rows, 0, K);
#endif
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < count; j++) {
            float v = acc[m][j] + (bias ? bf16_to_float(bias[n0 + j]) : 0.0f);
            out[m * N + n0 + j] = float_to_bf16(v);
        }
}

/* Returns -1 (and computes nothing) when rows is out of range. */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                int64_t rows, int64_t N, int64_t K, int64_t threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    int64_t blocks = (N + BLOCK - 1) / BLOCK;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * BLOCK;
        int64_t count = N - n0 < BLOCK ? N - n0 : BLOCK;
        linear_block(x, w, bias, out, n0, count, rows, N, K);
    }
    return 0;
}
