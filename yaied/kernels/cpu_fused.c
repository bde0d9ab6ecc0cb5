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

/* ---- greedy sampling's argmax ----
 *
 * out[r] = the index of row r's largest value, the first where it repeats, a NaN counting as
 * the largest (the first NaN), as torch.argmax has it; logits fp32 [rows, n]. torch's argmax
 * took 85-90 us for one row of the default model's 49152 logits (its amax 15 us) and 1.4 ms for
 * 32 rows: 1% of a quantized batch-1 decode step. Two passes over the row (the maximum, then
 * its first index), a few microseconds from L2. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define ARGMAX_LANES 16
#elif defined(__AVX2__)
#include <immintrin.h>
#define ARGMAX_LANES 8
#else
#define ARGMAX_LANES 1
#endif

/* The row's largest value; *nan set where the row holds a NaN (the value is then meaningless) */
static float row_max(const float *x, int64_t n, int *nan) {
    int64_t i = 0;
    float m = -INFINITY;
    int unordered = 0;
#if ARGMAX_LANES == 16
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
    }
    unordered = bad != 0;
    m = _mm512_reduce_max_ps(vm);
#elif ARGMAX_LANES == 8
    __m256 vm = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    unordered = _mm256_movemask_ps(bad) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) unordered = 1;
        m = x[i] > m ? x[i] : m;
    }
    *nan = unordered;
    return m;
}

static int64_t row_argmax(const float *x, int64_t n) {
    int nan;
    float m = row_max(x, n, &nan);
    int64_t i = 0;
    if (nan) {
        while (x[i] == x[i]) i++;
        return i;
    }
#if ARGMAX_LANES == 16
    __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif ARGMAX_LANES == 8
    __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the row's values (n >= 1) */
}

void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if(rows * n >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * n, n);
}

/* Structured outputs' token masks: in each listed row of fp32 logits, every token whose bit in
 * that row of the bitmask is 0 becomes -inf (xgrammar's layout: bit t % 32 of int32 word t / 32,
 * a row of ceil(vocab / 32) words). A word of 0, 32 banned tokens, is a run of stores (most of a
 * row under a JSON grammar); a word of all ones is skipped. xgrammar's own CPU kernel took about
 * 0.25 ms a row of the default model's 49,152 logits (5 ms a step for 20 constrained rows). */
void apply_token_bitmask_f32(float *logits, int64_t stride, const int32_t *mask,
                             int64_t mask_stride, const int64_t *rows, int64_t num_rows,
                             int64_t vocab) {
    const float banned = -INFINITY;
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * stride;
        const uint32_t *words = (const uint32_t *)mask + rows[i] * mask_stride;
        for (int64_t base = 0; base < vocab; base += 32) {
            uint32_t word = words[base / 32];
            int64_t n = vocab - base < 32 ? vocab - base : 32;
            if (word == 0xFFFFFFFFu) continue;
            if (word == 0) {
                for (int64_t j = 0; j < n; j++) x[base + j] = banned;
                continue;
            }
            for (int64_t j = 0; j < n; j++)
                if (!((word >> j) & 1u)) x[base + j] = banned;
        }
    }
}
