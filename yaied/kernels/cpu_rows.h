/* One row of the residual add + RMSNorm, of rotary and of SiLU-and-multiply, for bf16 and fp32:
 * the bodies of cpu_fused.c's kernels, of cpu_gemv.c's few-row entries that run them before or
 * after a linear layer, and of the decode kernel's step entry (rotary). Math is fp32; bf16 values are rounded where the torch reference rounds them
 * (the residual sum, the normalised value before the weight). Header-only, like cpu_common.h. */
#ifndef YAIED_CPU_ROWS_H
#define YAIED_CPU_ROWS_H

#include "cpu_common.h"

#define ROW_LOAD_f32(x) (x)
#define ROW_STORE_f32(x) (x)
#define ROW_ROUND_f32(x) (x)
#define ROW_LOAD_bf16(x) bf16_to_float(x)
#define ROW_STORE_bf16(x) float_to_bf16(x)
#define ROW_ROUND_bf16(x) bf16_to_float(float_to_bf16(x))

/* residual += delta (when not NULL); out = weight * rms_norm(residual). */
#define DEFINE_ROW_OPS(T, SUFFIX)                                                               \
    static inline void add_rms_norm_row_##SUFFIX(const T *delta, T *x, const T *weight, T *y,   \
                                                 int64_t hidden, float eps) {                   \
        float sum_sq = 0.0f;                                                                    \
        if (delta) {                                                                            \
            for (int64_t i = 0; i < hidden; i++) {                                              \
                float v = ROW_ROUND_##SUFFIX(ROW_LOAD_##SUFFIX(x[i]) + ROW_LOAD_##SUFFIX(delta[i])); \
                x[i] = ROW_STORE_##SUFFIX(v);                                                   \
                sum_sq += v * v;                                                                \
            }                                                                                   \
        } else {                                                                                \
            for (int64_t i = 0; i < hidden; i++)                                                \
                sum_sq += ROW_LOAD_##SUFFIX(x[i]) * ROW_LOAD_##SUFFIX(x[i]);                    \
        }                                                                                       \
        float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);                                 \
        for (int64_t i = 0; i < hidden; i++)                                                    \
            y[i] = ROW_STORE_##SUFFIX(ROW_LOAD_##SUFFIX(weight[i]) *                            \
                                      ROW_ROUND_##SUFFIX(ROW_LOAD_##SUFFIX(x[i]) * inv));       \
    }                                                                                           \
                                                                                                \
    /* Rotate-half rotary embedding of `heads` heads of `dim` at the start of a row, in place;  \
     * cos, sin: the row's [dim / 2] fp32 tables. */                                            \
    static inline void rotary_row_##SUFFIX(T *row, int64_t heads, int64_t dim, const float *c,  \
                                           const float *s) {                                    \
        int64_t half = dim / 2;                                                                 \
        for (int64_t h = 0; h < heads; h++) {                                                   \
            T *v = row + h * dim;                                                               \
            for (int64_t i = 0; i < half; i++) {                                                \
                float a = ROW_LOAD_##SUFFIX(v[i]), b = ROW_LOAD_##SUFFIX(v[i + half]);          \
                v[i] = ROW_STORE_##SUFFIX(a * c[i] - b * s[i]);                                 \
                v[i + half] = ROW_STORE_##SUFFIX(b * c[i] + a * s[i]);                          \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* out = silu(gate) * up, gate and up the two halves of the row; silu(g) = g * sigmoid(g),  \
     * sigmoid from exp(-|g|) so that the exp never overflows. */                              \
    static inline void silu_mul_row_##SUFFIX(const T *gate, T *y, int64_t width) {              \
        const T *up = gate + width;                                                             \
        for (int64_t i = 0; i < width; i++) {                                                   \
            float g = ROW_LOAD_##SUFFIX(gate[i]);                                               \
            float e = exp_nonpositive(g < 0.0f ? g : -g);                                       \
            float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);                                 \
            y[i] = ROW_STORE_##SUFFIX(g * sigmoid * ROW_LOAD_##SUFFIX(up[i]));                  \
        }                                                                                       \
    }

DEFINE_ROW_OPS(uint16_t, bf16)
DEFINE_ROW_OPS(float, f32)

#endif
