/* Fused elementwise kernels for the CPU model forward, each one pass over its rows:
 *   add_rms_norm  residual += delta (optional), out = weight * rms_norm(residual)
 *   rotary        rotate-half rotary embedding of the q and k heads, in place
 *   silu_mul      out = silu(gate) * up, gate and up the two halves of one row
 * In torch each is 2 to 6 ops with a temporary per op; on a 512-row prefill step they cost about
 * a fifth of the step (docs/benchmarks.md), at batch 1 mostly per-op overhead.
 *
 * Math is fp32; bf16 values are rounded where the torch reference rounds them (the residual sum,
 * the normalised value before the weight), so bf16 results stay within one rounding of it. The
 * per-row bodies are in cpu_rows.h, shared with cpu_gemv.c and cpu_paged_decode.c.
 * The torch references are in yaied/kernels/cpu_fused.py. Rows are split over OpenMP threads
 * only when there are enough of them to pay for the fork.
 */
#include "cpu_rows.h"

#define PARALLEL_MIN_ELEMENTS 65536

#define DEFINE_ADD_RMS_NORM(NAME, T, SUFFIX)                                                    \
    void NAME(const T *delta, T *residual, const T *weight, T *out, int64_t rows,               \
              int64_t hidden, float eps, int64_t threads) {                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * hidden >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++)                                                      \
            add_rms_norm_row_##SUFFIX(delta ? delta + r * hidden : NULL, residual + r * hidden, \
                                      weight, out + r * hidden, hidden, eps);                   \
    }

/* x: rows of row_stride elements; each row holds `heads` heads of `dim` at its start (q then k
 * of the fused qkv projection). cos, sin: [rows, dim / 2] fp32. */
#define DEFINE_ROTARY(NAME, T, SUFFIX)                                                          \
    void NAME(T *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,               \
              const float *cos, const float *sin, int64_t threads) {                            \
        int64_t half = dim / 2;                                                                 \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * heads * dim >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++)                                                      \
            rotary_row_##SUFFIX(x + r * row_stride, heads, dim, cos + r * half, sin + r * half); \
    }

#define DEFINE_SILU_MUL(NAME, T, SUFFIX)                                                        \
    void NAME(const T *gate_up, T *out, int64_t rows, int64_t width, int64_t threads) {         \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * width >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++)                                                      \
            silu_mul_row_##SUFFIX(gate_up + r * 2 * width, out + r * width, width);             \
    }

DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16)
DEFINE_ROTARY(rotary_f32, float, f32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, f32)
