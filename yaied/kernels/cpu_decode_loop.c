/* Every decoder layer of a Llama-family model for a decode step of a few rows, in one call.
 *
 * At batch 1 a layer is five kernel calls (q/k/v with its norm, attention with rotary and the
 * K/V write, o, gate/up with its norm and SiLU, down), and calling them from Python one by one
 * cost about 1.5 ms of a 9.5 ms step on the default model. This runs the same calls in a loop in
 * C. It links to neither kernel: the caller passes the few-row linear (cpu_gemv.c's
 * few_rows_linear_*) and the decode step (cpu_paged_decode.c's paged_decode_*_step) as function
 * pointers, so the results are those kernels' bits.
 *
 * x [rows, hidden] is the residual stream without the last layer's output, updated in place;
 * delta [rows, hidden] receives that output (the caller folds it into the final norm). Linear
 * weights are bf16; everything else is bf16 (`decode_layers_bf16`) or fp32 (`_f32`), but the KV
 * pools, bf16 under fp32 math too where `cache.kv_cache_dtype` says so (`_f32_kv_bf16`). The file has
 * no ISA-specific code of its own: the kernels it calls are built for the selected level.
 */
#include "cpu_common.h"

/* The loop for activations (and norms, biases) of type T and KV pools of type C over bf16 linear
 * weights (or quantized ones: `linear` is then cpu_quant.c's entry and each weight its `qweight`
 * descriptor): `_bf16` for bf16 models, `_f32` for fp32 math over bf16 weights. */
#define DEFINE_LOOP(T, C, SUFFIX)                                                                  \
    typedef int (*few_rows_linear_##SUFFIX##_fn)(                                               \
        const T *delta, T *residual, const T *norm_weight, float eps, const T *x,               \
        const uint16_t *w, const T *bias, T *out, int64_t rows, int64_t N, int64_t K,           \
        int64_t silu, int64_t threads);                                                         \
                                                                                                \
    typedef int (*decode_step_##SUFFIX##_fn)(                                                   \
        T *qkv, int64_t q_stride, const float *cos, const float *sin, C *k_cache, C *v_cache,   \
        const int64_t *slots, const int64_t *page_table, const int64_t *context_lens, T *out,   \
        int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_pages,     \
        int64_t page_size, int64_t max_pages, float scale);                                     \
                                                                                                \
    /* One layer's tensors; biases may be NULL. */                                              \
    typedef struct {                                                                            \
        const T *input_norm, *post_norm;                                                        \
        const uint16_t *qkv_w;                                                                  \
        const T *qkv_b;                                                                         \
        const uint16_t *o_w;                                                                    \
        const T *o_b;                                                                           \
        const uint16_t *gate_up_w;                                                              \
        const T *gate_up_b;                                                                     \
        const uint16_t *down_w;                                                                 \
        const T *down_b;                                                                        \
        C *k_cache, *v_cache;                                                                   \
    } Layer_##SUFFIX;                                                                           \
                                                                                                \
    /* Returns 0, or the first failing kernel's status (-2: no scratch memory). */              \
    int decode_layers_##SUFFIX(                                                                 \
        few_rows_linear_##SUFFIX##_fn linear, decode_step_##SUFFIX##_fn step,                   \
        const Layer_##SUFFIX *layers, int64_t num_layers, T *x, T *delta, int64_t rows,         \
        int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads,                  \
        int64_t head_dim, float eps, const float *cos, const float *sin, const int64_t *slots,  \
        const int64_t *page_table, const int64_t *context_lens, int64_t num_pages,              \
        int64_t page_size, int64_t max_pages, float scale, int64_t threads) {                   \
        int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, attn_width = heads * head_dim;   \
        size_t row_elements = (size_t)(qkv_width + attn_width + hidden + intermediate);         \
        T *qkv = thread_scratch(2, (size_t)rows * row_elements * sizeof(T));                    \
        if (!qkv) return -2;                                                                    \
        T *attn = qkv + rows * qkv_width, *o = attn + rows * attn_width;                        \
        T *act = o + rows * hidden;                                                             \
        const T *previous = NULL; /* the first layer has no earlier output to add */            \
        int status = 0;                                                                         \
        for (int64_t l = 0; l < num_layers && status == 0; l++) {                               \
            const Layer_##SUFFIX *L = layers + l;                                               \
            status = linear(previous, x, L->input_norm, eps, NULL, L->qkv_w, L->qkv_b, qkv,     \
                            rows, qkv_width, hidden, 0, threads);                               \
            if (status == 0)                                                                    \
                status = step(qkv, qkv_width, cos, sin, L->k_cache, L->v_cache, slots,          \
                              page_table, context_lens, attn, rows, kv_heads, heads / kv_heads, \
                              head_dim, num_pages, page_size, max_pages, scale);                \
            if (status == 0)                                                                    \
                status = linear(NULL, NULL, NULL, 0.0f, attn, L->o_w, L->o_b, o, rows, hidden,  \
                                attn_width, 0, threads);                                        \
            if (status == 0)                                                                    \
                status = linear(o, x, L->post_norm, eps, NULL, L->gate_up_w, L->gate_up_b, act, \
                                rows, 2 * intermediate, hidden, 1, threads);                    \
            if (status == 0)                                                                    \
                status = linear(NULL, NULL, NULL, 0.0f, act, L->down_w, L->down_b, delta, rows, \
                                hidden, intermediate, 0, threads);                              \
            previous = delta;                                                                   \
        }                                                                                       \
        return status;                                                                          \
    }

DEFINE_LOOP(uint16_t, uint16_t, bf16)
DEFINE_LOOP(float, float, f32)
DEFINE_LOOP(float, uint16_t, f32_kv_bf16) /* fp32 math over bf16 KV pools (cache.kv_cache_dtype) */
