/* Linear layers over block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q4_K) for a few rows, and
 * the unpacking of such weights to fp32 or bf16 for matmuls of many rows.
 *
 * A decode step is a pass over the weights, so its floor is the weights' bytes over the memory
 * bandwidth: 4.5 to 8.5 bits a weight here against 16 for bf16. The weights stay in their blocks;
 * each call quantizes its few activation rows to int8 in blocks of 32 (one fp32 scale a block,
 * as Q8_0 does), and every (input row, weight row) pair is a sum over blocks of an integer dot
 * product times the two scales. The bodies, by the ISA level the file is built for
 * (yaied/kernels/cpu_isa.py):
 *
 *   avx512*      the avx2 body with VNNI's dpbusd for the u8 x s8 dot where the CPU has it
 *   avx2         32 weights a block in one register: maddubs (u8 x s8 -> s16 pairs) then madd to
 *                s32, converted and scaled into 8 fp32 lanes, summed once a row
 *   generic      plain C over the block's 32 integers, which the compiler vectorises
 *
 * Blocks (little-endian, packed; d, m, dmin are fp16):
 *   Q8_0  34 bytes / 32 weights: d, int8 q[32]                       w = d q
 *   Q4_0  18 bytes / 32: d, 16 bytes; q[i] = low nibble of byte i,
 *         q[i + 16] = its high nibble                                w = d (q - 8)
 *   Q4_1  20 bytes / 32: d, m, 16 bytes as Q4_0                      w = d q + m
 *   Q4_K 144 bytes / 256: d, dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins, 128
 *         bytes: for each 64 weights, 32 bytes whose low nibbles are the first 32 and high
 *         nibbles the next 32                                        w = d sc_j q - dmin m_j
 *
 * A weight is passed as a `qweight` descriptor (its type and its block table [N, row bytes]),
 * so that one entry serves every type and the decode loop (cpu_decode_loop.c) calls it as it
 * calls cpu_gemv.c's few_rows_linear_*: the same signature, the descriptor where the bf16
 * weight was. Every (input row, weight row) pair is computed by the same code whatever the
 * number of rows, so a row's result is the same bits alone and in any batch at one level.
 */
#include "cpu_rows.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8
#define QK 32 /* weights per block (Q4_K: per sub-block) */

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12 };

typedef struct {
    int64_t type;
    const uint8_t *blocks;
} qweight;

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* The j-th of Q4_K's eight 6-bit scales and mins, packed in 12 bytes: the first four of each in
 * the low six bits of bytes 0-3 (scales) and 4-7 (mins), the last four in the nibbles of bytes
 * 8-11 with their top two bits in the spare bits of bytes 0-7. */
static inline void q4k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

int64_t quant_block_bytes(int64_t type) {
    switch (type) {
    case TYPE_Q8_0: return 34;
    case TYPE_Q4_0: return 18;
    case TYPE_Q4_1: return 20;
    case TYPE_Q4_K: return 144;
    default: return -1;
    }
}

int64_t quant_block_size(int64_t type) { return type == TYPE_Q4_K ? 256 : QK; }

/* ---- unpacking: one weight row to fp32 ---- */
static void dequantize_row(int64_t type, const uint8_t *row, float *out, int64_t K) {
    int64_t bytes = quant_block_bytes(type);
    for (int64_t b = 0; b < K / quant_block_size(type); b++) {
        const uint8_t *p = row + b * bytes;
        float d = half_to_float(p);
        if (type == TYPE_Q8_0) {
            for (int i = 0; i < QK; i++) out[b * QK + i] = d * (float)(int8_t)p[2 + i];
        } else if (type == TYPE_Q4_0 || type == TYPE_Q4_1) {
            float m = type == TYPE_Q4_1 ? half_to_float(p + 2) : -8.0f * d;
            const uint8_t *q = p + (type == TYPE_Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                out[b * QK + i] = d * (float)(q[i] & 0xF) + m;
                out[b * QK + i + 16] = d * (float)(q[i] >> 4) + m;
            }
        } else { /* Q4_K */
            float dmin = half_to_float(p + 2);
            const uint8_t *scales = p + 4, *q = p + 16;
            float *o = out + b * 256;
            for (int c = 0; c < 4; c++) {
                int sc0, m0, sc1, m1;
                q4k_scale_min(scales, 2 * c, &sc0, &m0);
                q4k_scale_min(scales, 2 * c + 1, &sc1, &m1);
                float d0 = d * sc0, n0 = dmin * m0, d1 = d * sc1, n1 = dmin * m1;
                for (int i = 0; i < 32; i++) {
                    o[64 * c + i] = d0 * (float)(q[32 * c + i] & 0xF) - n0;
                    o[64 * c + 32 + i] = d1 * (float)(q[32 * c + i] >> 4) - n1;
                }
            }
        }
    }
}

/* The block table [N, row bytes] unpacked to out [N, K] (fp32 or bf16). Returns -1 for a type
 * this file does not know, -2 without scratch memory. */
int dequantize_f32(int64_t type, const uint8_t *blocks, float *out, int64_t N, int64_t K,
                   int64_t threads) {
    if (quant_block_bytes(type) < 0) return -1;
    int64_t row_bytes = K / quant_block_size(type) * quant_block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) dequantize_row(type, blocks + n * row_bytes, out + n * K, K);
    return 0;
}

int dequantize_bf16(int64_t type, const uint8_t *blocks, uint16_t *out, int64_t N, int64_t K,
                    int64_t threads) {
    if (quant_block_bytes(type) < 0) return -1;
    int64_t row_bytes = K / quant_block_size(type) * quant_block_bytes(type);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *row = thread_scratch(7, (size_t)K * sizeof(float));
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!row) continue;
            dequantize_row(type, blocks + n * row_bytes, row, K);
            for (int64_t k = 0; k < K; k++) out[n * K + k] = float_to_bf16(row[k]);
        }
    }
    return failed ? -2 : 0;
}

/* ---- the activations: int8 blocks of 32, a scale and the scaled sum of each block ---- */
typedef struct {
    const int8_t *q; /* [K] */
    const float *d;  /* [K / 32] the block's scale */
    const float *s;  /* [K / 32] d * the sum of the block's q (for the mins of Q4_1 and Q4_K) */
} qrow;

static void quantize_activations(const float *x, int8_t *q, float *d, float *s, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int r = (int)nearbyintf(v[i] * inv);
            q[b * QK + i] = (int8_t)r;
            sum += r;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

/* ---- one (input row, weight row) pair: a sum over the row's blocks ---- */
#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 lanes of 4-product sums */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
static inline __m256i dot_s8s8(__m256i a, __m256i b) {
    return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
static inline __m256i nibbles16(const uint8_t *p) { /* 16 bytes -> 32 weights, lows first */
    __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0xF);
    __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define XBLOCK(b) _mm256_loadu_si256((const __m256i *)(x.q + (b) * QK))
#define SCALED(isum, scale, acc) _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(scale), acc)

static float dot_q8_0(const uint8_t *w, qrow x, int64_t blocks) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 34;
        __m256i q = _mm256_loadu_si256((const __m256i *)(p + 2));
        acc = SCALED(dot_s8s8(q, XBLOCK(b)), half_to_float(p) * x.d[b], acc);
    }
    return hsum(acc);
}
static float dot_q4_0(const uint8_t *w, qrow x, int64_t blocks) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 18;
        __m256i q = _mm256_sub_epi8(nibbles16(p + 2), _mm256_set1_epi8(8));
        acc = SCALED(dot_s8s8(q, XBLOCK(b)), half_to_float(p) * x.d[b], acc);
    }
    return hsum(acc);
}
static float dot_q4_1(const uint8_t *w, qrow x, int64_t blocks) {
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 20;
        acc = SCALED(dot_u8s8(nibbles16(p + 4), XBLOCK(b)), half_to_float(p) * x.d[b], acc);
        mins += half_to_float(p + 2) * x.s[b];
    }
    return hsum(acc) + mins;
}
static float dot_q4_k(const uint8_t *w, qrow x, int64_t blocks) {
    __m256 acc = _mm256_setzero_ps();
    __m256i mask = _mm256_set1_epi8(0xF);
    float mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 144, *scales = p + 4;
        float d = half_to_float(p), dmin = half_to_float(p + 2), min_sum = 0.0f;
        for (int c = 0; c < 4; c++) {
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
            __m256i lo = _mm256_and_si256(bytes, mask);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
            int64_t j = 8 * b + 2 * c;
            int sc0, m0, sc1, m1;
            q4k_scale_min(scales, 2 * c, &sc0, &m0);
            q4k_scale_min(scales, 2 * c + 1, &sc1, &m1);
            acc = SCALED(dot_u8s8(lo, XBLOCK(j)), d * (float)sc0 * x.d[j], acc);
            acc = SCALED(dot_u8s8(hi, XBLOCK(j + 1)), d * (float)sc1 * x.d[j + 1], acc);
            min_sum += (float)m0 * x.s[j] + (float)m1 * x.s[j + 1];
        }
        mins += dmin * min_sum;
    }
    return hsum(acc) - mins;
}
#else
static inline int32_t idot(const int8_t *a, const int8_t *b) {
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) sum += (int32_t)a[i] * (int32_t)b[i];
    return sum;
}
static inline void unpack_nibbles(const uint8_t *p, int8_t *q, int offset) {
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)((p[i] & 0xF) - offset);
        q[i + 16] = (int8_t)((p[i] >> 4) - offset);
    }
}
static float dot_q8_0(const uint8_t *w, qrow x, int64_t blocks) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 34;
        acc += (float)idot((const int8_t *)(p + 2), x.q + b * QK) * half_to_float(p) * x.d[b];
    }
    return acc;
}
static float dot_q4_0(const uint8_t *w, qrow x, int64_t blocks) {
    float acc = 0.0f;
    int8_t q[QK];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 18;
        unpack_nibbles(p + 2, q, 8);
        acc += (float)idot(q, x.q + b * QK) * half_to_float(p) * x.d[b];
    }
    return acc;
}
static float dot_q4_1(const uint8_t *w, qrow x, int64_t blocks) {
    float acc = 0.0f, mins = 0.0f;
    int8_t q[QK];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 20;
        unpack_nibbles(p + 4, q, 0);
        acc += (float)idot(q, x.q + b * QK) * half_to_float(p) * x.d[b];
        mins += half_to_float(p + 2) * x.s[b];
    }
    return acc + mins;
}
static float dot_q4_k(const uint8_t *w, qrow x, int64_t blocks) {
    float acc = 0.0f, mins = 0.0f;
    int8_t lo[QK], hi[QK];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * 144, *scales = p + 4;
        float d = half_to_float(p), dmin = half_to_float(p + 2), min_sum = 0.0f;
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = p + 16 + 32 * c;
            for (int i = 0; i < QK; i++) {
                lo[i] = (int8_t)(q[i] & 0xF);
                hi[i] = (int8_t)(q[i] >> 4);
            }
            int64_t j = 8 * b + 2 * c;
            int sc0, m0, sc1, m1;
            q4k_scale_min(scales, 2 * c, &sc0, &m0);
            q4k_scale_min(scales, 2 * c + 1, &sc1, &m1);
            acc += (float)idot(lo, x.q + j * QK) * d * (float)sc0 * x.d[j];
            acc += (float)idot(hi, x.q + (j + 1) * QK) * d * (float)sc1 * x.d[j + 1];
            min_sum += (float)m0 * x.s[j] + (float)m1 * x.s[j + 1];
        }
        mins += dmin * min_sum;
    }
    return acc - mins;
}
#endif

typedef float (*dot_fn)(const uint8_t *, qrow, int64_t);

static dot_fn dot_for(int64_t type) {
    switch (type) {
    case TYPE_Q8_0: return dot_q8_0;
    case TYPE_Q4_0: return dot_q4_0;
    case TYPE_Q4_1: return dot_q4_1;
    case TYPE_Q4_K: return dot_q4_k;
    default: return NULL;
    }
}

/* out [rows, N] = x @ w.T + bias for fp32 activations already in x (rows <= MAX_ROWS). */
#define DEFINE_LINEAR(T, SUFFIX)                                                                \
    static int qlinear_##SUFFIX(const T *x, const qweight *w, const T *bias, T *out,            \
                                int64_t rows, int64_t N, int64_t K, int64_t threads) {          \
        dot_fn dot = dot_for(w->type);                                                          \
        if (!dot) return -3;                                                                    \
        int64_t blocks = K / QK, wblocks = K / quant_block_size(w->type);                      \
        int64_t row_bytes = wblocks * quant_block_bytes(w->type);                               \
        int8_t *xq = thread_scratch(2, (size_t)(rows * K));                                     \
        float *xd = thread_scratch(3, (size_t)(rows * blocks) * sizeof(float));                 \
        float *xs = thread_scratch(4, (size_t)(rows * blocks) * sizeof(float));                 \
        float *xf = thread_scratch(5, (size_t)K * sizeof(float));                               \
        if (!xq || !xd || !xs || !xf) return -2;                                                \
        qrow xr[MAX_ROWS];                                                                      \
        for (int64_t m = 0; m < rows; m++) {                                                    \
            for (int64_t k = 0; k < K; k++) xf[k] = ROW_LOAD_##SUFFIX(x[m * K + k]);            \
            quantize_activations(xf, xq + m * K, xd + m * blocks, xs + m * blocks, K);          \
            xr[m] = (qrow){xq + m * K, xd + m * blocks, xs + m * blocks};                       \
        }                                                                                       \
        const uint8_t *table = w->blocks;                                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                      \
        for (int64_t n = 0; n < N; n++) {                                                       \
            const uint8_t *row = table + n * row_bytes;                                         \
            if (n + 1 < N) __builtin_prefetch(row + row_bytes);                                 \
            float b = bias ? ROW_LOAD_##SUFFIX(bias[n]) : 0.0f;                                 \
            for (int64_t m = 0; m < rows; m++)                                                  \
                out[m * N + n] = ROW_STORE_##SUFFIX(dot(row, xr[m], wblocks) + b);              \
        }                                                                                       \
        return 0;                                                                               \
    }                                                                                           \
                                                                                                \
    /* cpu_gemv.c's few_rows_linear_* over a quantized weight: with norm_weight, the input is   \
     * weight * rms_norm(residual += delta) (delta may be NULL; x is ignored), else x; with     \
     * silu, out [rows, N / 2] is silu(gate) * up of the linear's two halves. Returns -1 when   \
     * rows is out of range, -2 without scratch memory, -3 for a type without a kernel. */      \
    int few_rows_qlinear_##SUFFIX(const T *delta, T *residual, const T *norm_weight, float eps, \
                                  const T *x, const qweight *w, const T *bias, T *out,          \
                                  int64_t rows, int64_t N, int64_t K, int64_t silu,             \
                                  int64_t threads) {                                            \
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
        int status = qlinear_##SUFFIX(x, w, bias, linear_out, rows, N, K, threads);             \
        if (status) return status;                                                              \
        if (silu)                                                                               \
            for (int64_t r = 0; r < rows; r++)                                                  \
                silu_mul_row_##SUFFIX(linear_out + r * N, out + r * (N / 2), N / 2);            \
        return 0;                                                                               \
    }

DEFINE_LINEAR(float, f32)
DEFINE_LINEAR(uint16_t, bf16)
