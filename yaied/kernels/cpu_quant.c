/* Linear layers over block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K, IQ4_NL, IQ4_XS) for a few rows, and the unpacking of such weights to fp32 or bf16 for
 * matmuls of many rows.
 *
 * A decode step is a pass over the weights, so where memory is the bound its floor is the
 * weights' bytes over the bandwidth: 2.6 to 8.5 bits a weight here against 16 for bf16. The
 * weights stay in their blocks; each block is widened to fp32 in registers and multiplied into
 * the fp32 activations, its scale applied once to the block's partial sums and its offset (Q4_0's
 * -8 d, Q4_1's m, the K types' mins) through the activations' block sums (Q6_K's -32 and
 * Q3_K's -4 in the integers). So the math is fp32 over the weights' exact values, as in the
 * unpacked matmul of a prefill, up to the order of the sums: a prompt computes the same whether its prefix was cached
 * or recomputed, and greedy output agrees with the dequantized model in fp32. (Rounding the activations to int8 blocks and taking integer
 * dot products, llama.cpp's way, made this kernel about 1.5x faster at 4 bits, but the default
 * model's greedy output then parted from fp32's within a few tokens on most prompts.) The bodies,
 * by the ISA level the file is built for (yaied/kernels/cpu_isa.py):
 *
 *   avx512*      16 weights a vector: bytes widened with vpmovzxbd / vpmovsxbd, 16-wide FMAs
 *   avx2         the same 8 wide
 *   generic      each weight row unpacked into an fp32 row (L1), then a plain fp32 dot
 *
 * and at avx512_bf16, for bf16 activations (that level's bf16 math), Q4_0, Q4_1, the K types and
 * the IQ4 types meet them in bf16 dot products instead, each quant exact as a bf16
 * (fdot_*_bf16). Q5_K's and Q6_K's vector bodies are in cpu_quant_k.h, and so is the unpacking of
 * Q4_K to Q6_K; Q3_K's and Q2_K's bodies and unpacking are in cpu_quant_k3.h, IQ4_NL's and
 * IQ4_XS's in cpu_quant_iq4.h.
 *
 * Blocks (little-endian, packed; d, m, dmin are fp16):
 *   Q8_0  34 bytes / 32 weights: d, int8 q[32]                       w = d q
 *   Q4_0  18 bytes / 32: d, 16 bytes; q[i] = low nibble of byte i,
 *         q[i + 16] = its high nibble                                w = d (q - 8)
 *   Q4_1  20 bytes / 32: d, m, 16 bytes as Q4_0                      w = d q + m
 *   Q4_0 and Q4_1 grouped (yaied's own; cpu_quant.py converts GGUF's at load): the same
 *         blocks, a row's in groups of 16 (the last may be shorter), each group its blocks' d
 *         first, then (Q4_1) their m, then their 16 bytes of quants: the bodies convert a
 *         group's 16 scales at once, without a gather or byte permutes (the bf16 bodies ran
 *         1.1-1.17x faster on 1B-shaped Q4_0 layers, the same bits)
 *   Q4_K 144 bytes / 256: d, dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins, 128
 *         bytes: for each 64 weights, 32 bytes whose low nibbles are the first 32 and high
 *         nibbles the next 32                                        w = d sc_j q - dmin m_j
 *   Q5_K 176 bytes / 256: Q4_K's d, dmin and 12 bytes of scales and mins, then 32 bytes of
 *         fifth bits (bit j of byte i tops up sub-block j's weight i with 16), then Q4_K's
 *         128 bytes of nibbles                                      w = d sc_j q - dmin m_j
 *   Q6_K 210 bytes / 256: 128 bytes of low nibbles, 64 of high pairs, int8 scales[16], d last;
 *         for each 128 weights, 64 bytes whose low nibbles are weights 0-31 and 32-63 and high
 *         nibbles 64-95 and 96-127, and 32 bytes whose bit pairs 0-1, 2-3, 4-5, 6-7 top up
 *         weights i, 32 + i, 64 + i, 96 + i (cpu_quant_k.h)        w = d sc_s (q - 32)
 *   Q3_K 110 bytes / 256: 32 bytes of high bits, 64 of low pairs, 12 of sixteen 6-bit scales, d
 *         last; weight 128 h + 32 j + i has its low pair in bits 2 j, 2 j + 1 of byte
 *         32 h + i of the pairs, its high bit in bit 4 h + j of byte i; q = low + 4 high - 4
 *         (-4..3), s its 16-weight group (q3k_scale_bytes)       w = d (sc_s - 32) q
 *   Q2_K 84 bytes / 256: 16 bytes of 4-bit scales (low nibbles) and mins (high), 64 bytes of
 *         quants laid out as Q3_K's low pairs (q 0..3), d, dmin    w = d sc_s q - dmin m_s
 *   IQ4_NL 18 bytes / 32: Q4_0's block, each 4-bit q an index into the 16 int8 IQ4_VALUES
 *                                                                    w = d v[q]
 *   IQ4_XS 136 bytes / 256: d, a 16-bit word of scales' top pairs (bits 2 j, 2 j + 1 for
 *         sub-block j), 4 bytes of their low nibbles (sub-block j's in byte j / 2, the low
 *         nibble for even j), then 8 runs of 16 bytes laid out as IQ4_NL's
 *                                                                    w = d (sc_j - 32) v[q]
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
#define QK 32 /* weights per block (the K types: per sub-block) */
/* Each thread streams its own run of weight rows, and a row of a small layer is only a few
 * cache lines (Q4_0 at K = 576: 324 bytes), so the hardware prefetcher, which follows a stream
 * only after a few misses, left each row's first touch (the scales' gather) waiting on memory:
 * the default model's 3072 x 576 Q4_1 layer, streamed from memory at one row, ran 13 G
 * weights/s. The lines PREFETCH_AHEAD bytes on are asked for while these are computed: 20 G
 * weights/s (1024 to 2048 measured best; 512 too near, 4096 too far). The vector bodies ask
 * as they go, a line's worth of blocks at a time: asking for a whole row's lines at its start
 * filled the line-fill buffers, and the burst stalled (its loop held a quarter of the kernel's
 * samples); spread through the blocks, a 1B-shaped Q4_0 decode ran 1.15-1.2x faster
 * (docs/benchmarks.md). The plain-C body, which unpacks the row first, keeps the burst. */
#define PREFETCH_AHEAD 2048

/* GGUF's type numbers, and yaied's own for the grouped layouts (not GGUF types) */
enum {
    TYPE_Q4_0 = 2,
    TYPE_Q4_1 = 3,
    TYPE_Q8_0 = 8,
    TYPE_Q2_K = 10,
    TYPE_Q3_K = 11,
    TYPE_Q4_K = 12,
    TYPE_Q5_K = 13,
    TYPE_Q6_K = 14,
    TYPE_IQ4_NL = 20,
    TYPE_IQ4_XS = 23,
    TYPE_Q4_0_GROUPED = 1002,
    TYPE_Q4_1_GROUPED = 1003,
    TYPE_STACKED = 2000
};
#define SCALE_GROUP 16 /* grouped layouts: blocks a group */

static inline int is_grouped(int64_t type) {
    return type == TYPE_Q4_0_GROUPED || type == TYPE_Q4_1_GROUPED;
}
/* Q4_1's blocks, in either layout, carry an m */
static inline int has_min(int64_t type) { return type == TYPE_Q4_1 || type == TYPE_Q4_1_GROUPED; }

/* The grouped layouts (bytes a block: 18 for Q4_0, 20 for Q4_1): the group of block b starts at
 * block first = b - b % SCALE_GROUP and holds `count` blocks: their d, then Q4_1's m, then
 * their quants. Block b's d, m and quants: */
static inline int64_t group_count(int64_t first, int64_t blocks) {
    return blocks - first < SCALE_GROUP ? blocks - first : SCALE_GROUP;
}
static inline const uint8_t *grouped_scale(const uint8_t *row, int64_t b, int64_t bytes) {
    return row + (b - b % SCALE_GROUP) * bytes + 2 * (b % SCALE_GROUP);
}
static inline const uint8_t *grouped_min(const uint8_t *row, int64_t b, int64_t blocks) {
    int64_t first = b - b % SCALE_GROUP;
    return row + first * 20 + 2 * group_count(first, blocks) + 2 * (b % SCALE_GROUP);
}
static inline const uint8_t *grouped_quants(const uint8_t *row, int64_t b, int64_t blocks,
                                            int64_t bytes) {
    int64_t first = b - b % SCALE_GROUP;
    return row + first * bytes + (bytes - 16) * group_count(first, blocks) +
           16 * (b % SCALE_GROUP);
}

/* A Q4_K super-block's lines (144 bytes at p): three prefetches 64 bytes apart, and the next
 * super-block's first covers any line past p + 128 that this one touches. */
static inline void prefetch_super_block(const uint8_t *p) {
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
    __builtin_prefetch(p + 128);
}

typedef struct {
    int64_t type;
    const uint8_t *blocks;
} qweight;

/* A merged projection whose parts differ in type (a Q4_K_M file's q/k/v with a Q6_K V) is one
 * descriptor of int64s: TYPE_STACKED, the count of parts, then each part's type, table address
 * and rows, in row order; each part runs as a weight of its own into its columns of out. */
typedef struct {
    int64_t type, address, rows;
} stacked_part;
static inline int64_t stacked_count(const qweight *w) { return ((const int64_t *)w)[1]; }
static inline stacked_part stacked_at(const qweight *w, int64_t i) {
    const int64_t *raw = (const int64_t *)w + 2 + 3 * i;
    return (stacked_part){raw[0], raw[1], raw[2]};
}

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

/* Q4_K's eight 6-bit scales and eight mins, packed in 12 bytes: the first four of each in the
 * low six bits of bytes 0-3 (scales) and 4-7 (mins), the last four in the nibbles of bytes
 * 8-11 with their top two bits in the spare bits of bytes 0-7. Unpacked into the bytes of two
 * words (sub-block j's in byte j, little-endian), the 12 bytes read as three words so that four
 * of each come at once: one at a time, with branches, they were most of the Q4_K bodies' time.
 * Words rather than arrays: the vector bodies take them straight into a register. */
typedef struct {
    uint64_t scales, mins;
} q4k_packed;

static inline q4k_packed q4k_scales_mins(const uint8_t *s) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint64_t high_scales = (c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4);
    uint64_t high_mins = ((c >> 4) & 0x0F0F0F0Fu) | (((b >> 6) & 0x03030303u) << 4);
    return (q4k_packed){(a & 0x3F3F3F3Fu) | high_scales << 32, (b & 0x3F3F3F3Fu) | high_mins << 32};
}

int64_t quant_block_bytes(int64_t type) {
    switch (type) {
    case TYPE_Q8_0: return 34;
    case TYPE_Q4_0:
    case TYPE_Q4_0_GROUPED: return 18;
    case TYPE_Q4_1:
    case TYPE_Q4_1_GROUPED: return 20;
    case TYPE_IQ4_NL: return 18;
    case TYPE_IQ4_XS: return 136;
    case TYPE_Q2_K: return 84;
    case TYPE_Q3_K: return 110;
    case TYPE_Q4_K: return 144;
    case TYPE_Q5_K: return 176;
    case TYPE_Q6_K: return 210;
    default: return -1;
    }
}

int64_t quant_block_size(int64_t type) {
    switch (type) {
    case TYPE_Q2_K:
    case TYPE_Q3_K:
    case TYPE_Q4_K:
    case TYPE_Q5_K:
    case TYPE_Q6_K:
    case TYPE_IQ4_XS: return 256;
    default: return QK;
    }
}

/* Weights a sum of the activations covers for the type's offsets through them (qlinear's
 * xsum): a block's 32, Q2_K's 16 (a min per 16 weights) */
static inline int64_t sum_size(int64_t type) { return type == TYPE_Q2_K ? 16 : QK; }

/* One Q6_K super-block at p into o[256] (cpu_quant_k.h has the layout): each weight its scale
 * d sc_s (exact in fp32) times q - 32, as the torch reference computes. */
static void dequantize_q6_k(const uint8_t *p, float *o) {
    float d = half_to_float(p + 208);
    const int8_t *sc = (const int8_t *)(p + 192);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
        for (int j = 0; j < 4; j++) {
            float ds0 = d * (float)sc[8 * h + 2 * j], ds1 = d * (float)sc[8 * h + 2 * j + 1];
            for (int i = 0; i < 32; i++) {
                int low = (ql[i + 32 * (j & 1)] >> (4 * (j >> 1))) & 0xF;
                int q = (low | ((qh[i] >> (2 * j)) & 3) << 4) - 32;
                o[128 * h + 32 * j + i] = (i < 16 ? ds0 : ds1) * (float)q;
            }
        }
    }
}

/* Q3_K's sixteen 6-bit scales (before their -32), packed in the 12 bytes at s: scale j's low
 * four bits are the low nibble of byte j for j < 8, else the high nibble of byte j - 8, and its
 * top two are bits 2 (j / 4) and 2 (j / 4) + 1 of byte 8 + j % 4. Four scales a 32-bit word
 * (as q4k_scales_mins), into out[16], scale j in byte j. */
static inline void q3k_scale_bytes(const uint8_t *s, uint8_t *out) {
    uint32_t a, b, c, w[4];
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    w[0] = (a & 0x0F0F0F0Fu) | (c & 0x03030303u) << 4;
    w[1] = (b & 0x0F0F0F0Fu) | (c >> 2 & 0x03030303u) << 4;
    w[2] = (a >> 4 & 0x0F0F0F0Fu) | (c >> 4 & 0x03030303u) << 4;
    w[3] = (b >> 4 & 0x0F0F0F0Fu) | (c >> 6 & 0x03030303u) << 4;
    memcpy(out, w, 16);
}

/* One Q3_K super-block at p into o[256]: d (sc_s - 32) exact in fp32 (11 by 6 significant
 * bits), times q, as the torch reference computes. */
static void dequantize_q3_k(const uint8_t *p, float *o) {
    float d = half_to_float(p + 108);
    uint8_t sc[16];
    q3k_scale_bytes(p + 96, sc);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 32; i++) {
                int low = (p[32 + 32 * h + i] >> (2 * j)) & 3;
                int high = (p[i] >> (4 * h + j)) & 1;
                float ds = d * (float)(sc[8 * h + 2 * j + (i >= 16)] - 32);
                o[128 * h + 32 * j + i] = ds * (float)((low | high << 2) - 4);
            }
}

/* One Q2_K super-block at p into o[256]: d sc_s q exact in fp32, less dmin m_s (one rounding),
 * as the torch reference computes. */
static void dequantize_q2_k(const uint8_t *p, float *o) {
    float d = half_to_float(p + 80), dmin = half_to_float(p + 82);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 32; i++) {
                int s = 8 * h + 2 * j + (i >= 16);
                float ds = d * (float)(p[s] & 0xF), m = dmin * (float)(p[s] >> 4);
                o[128 * h + 32 * j + i] = ds * (float)((p[16 + 32 * h + i] >> (2 * j)) & 3) - m;
            }
}

/* The IQ4 types' 16 values (llama.cpp's kvalues_iq4nl), 4-bit indices picking one each */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* An IQ4_XS super-block's eight 6-bit scales (before their -32) into out[8], scale j in byte j:
 * its low nibble is nibble j of the 32-bit word at p + 4, its top pair bits 2 j, 2 j + 1 of the
 * 16-bit word at p + 2. Both spread to a byte each in one 64-bit word (a loop over the eight
 * took a quarter of the bf16 body's time). */
static inline void iq4_xs_scale_bytes(const uint8_t *p, uint8_t *out) {
    uint32_t low32;
    memcpy(&low32, p + 4, 4);
    uint64_t low = low32, high = (uint64_t)(p[2] | p[3] << 8);
    low = (low | low << 16) & 0x0000FFFF0000FFFFull; /* a byte each 16 bits */
    low = (low | low << 8) & 0x00FF00FF00FF00FFull;
    low = (low & 0x000F000F000F000Full) | (low >> 4 & 0x000F000F000F000Full) << 8;
    high = (high | high << 24) & 0x000000FF000000FFull; /* 8 bits each 32, 4 each 16, 2 a byte */
    high = (high | high << 12) & 0x000F000F000F000Full;
    high = (high | high << 6) & 0x0303030303030303ull;
    uint64_t bytes = low | high << 4;
    memcpy(out, &bytes, 8);
}

/* One IQ4_XS super-block at p into o[256]: d (sc_j - 32) exact in fp32, times the value (exact
 * too), as gguf-py computes. */
static void dequantize_iq4_xs(const uint8_t *p, float *o) {
    float d = half_to_float(p);
    uint8_t sc[8];
    iq4_xs_scale_bytes(p, sc);
    for (int j = 0; j < 8; j++) {
        float ds = d * (float)(sc[j] - 32);
        const uint8_t *q = p + 8 + 16 * j;
        for (int i = 0; i < 16; i++) {
            o[32 * j + i] = ds * (float)IQ4_VALUES[q[i] & 0xF];
            o[32 * j + i + 16] = ds * (float)IQ4_VALUES[q[i] >> 4];
        }
    }
}

/* ---- unpacking: one weight row to fp32 ---- */
static void dequantize_row(int64_t type, const uint8_t *row, float *out, int64_t K) {
    int64_t bytes = quant_block_bytes(type);
    int grouped = is_grouped(type), with_min = has_min(type);
    for (int64_t b = 0; b < K / quant_block_size(type); b++) {
        const uint8_t *p = row + b * bytes;
        float d = half_to_float(grouped ? grouped_scale(row, b, bytes) : p);
        if (type == TYPE_Q6_K) {
            dequantize_q6_k(p, out + b * 256);
        } else if (type == TYPE_Q3_K) {
            dequantize_q3_k(p, out + b * 256);
        } else if (type == TYPE_Q2_K) {
            dequantize_q2_k(p, out + b * 256);
        } else if (type == TYPE_IQ4_XS) {
            dequantize_iq4_xs(p, out + b * 256);
        } else if (type == TYPE_IQ4_NL) {
            for (int i = 0; i < 16; i++) {
                out[b * QK + i] = d * (float)IQ4_VALUES[p[2 + i] & 0xF];
                out[b * QK + i + 16] = d * (float)IQ4_VALUES[p[2 + i] >> 4];
            }
        } else if (type == TYPE_Q8_0) {
            for (int i = 0; i < QK; i++) out[b * QK + i] = d * (float)(int8_t)p[2 + i];
        } else if (type == TYPE_Q4_0 || grouped || type == TYPE_Q4_1) {
            float m = !with_min ? -8.0f * d
                      : half_to_float(grouped ? grouped_min(row, b, K / QK) : p + 2);
            const uint8_t *q = grouped ? grouped_quants(row, b, K / QK, bytes)
                                       : p + (with_min ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                out[b * QK + i] = d * (float)(q[i] & 0xF) + m;
                out[b * QK + i + 16] = d * (float)(q[i] >> 4) + m;
            }
        } else { /* Q4_K, Q5_K (its fifth bits before the nibbles) */
            float dmin = half_to_float(p + 2);
            int five = type == TYPE_Q5_K;
            const uint8_t *q = p + (five ? 48 : 16), *qh = p + 16;
            float *o = out + b * 256;
            q4k_packed packed = q4k_scales_mins(p + 4);
            uint8_t sc[8], mn[8];
            memcpy(sc, &packed.scales, 8);
            memcpy(mn, &packed.mins, 8);
            for (int c = 0; c < 4; c++) {
                float d0 = d * sc[2 * c], n0 = dmin * mn[2 * c];
                float d1 = d * sc[2 * c + 1], n1 = dmin * mn[2 * c + 1];
                for (int i = 0; i < 32; i++) {
                    int top0 = five ? (qh[i] >> (2 * c) & 1) << 4 : 0;
                    int top1 = five ? (qh[i] >> (2 * c + 1) & 1) << 4 : 0;
                    o[64 * c + i] = d0 * (float)((q[32 * c + i] & 0xF) | top0) - n0;
                    o[64 * c + 32 + i] = d1 * (float)((q[32 * c + i] >> 4) | top1) - n1;
                }
            }
        }
    }
}


/* ---- one (input row, weight row) pair: the row unpacked to fp32, then an fp32 dot ---- */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline float vec_sum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
static inline vec vec_add(vec a, vec b) {
    for (int i = 0; i < LANES; i++) a.v[i] += b.v[i];
    return a;
}
static inline vec vec_load(const float *p) {
    vec r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline float vec_sum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v.v[i];
    return s;
}
#endif


#if defined(__AVX2__)
/* Fused unpack-and-dot per type: each block's weights widened to fp32 in registers and
 * multiplied into the input row, the block's scale applied once to its partial sums and its
 * offset (Q4_0's -8 d, Q4_1's m, Q4_K's mins) through the input block's sum. */
#define GROUP (16 / LANES) /* vectors in 16 weights */
#define LOAD16(p) _mm_loadu_si128((const __m128i *)(p))
/* 16 int8 weights at p to fp32 (each 8 bytes widened straight from memory at avx2) */
static inline void widen_s8(const uint8_t *p, vec *out) {
#if defined(__AVX512F__)
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LOAD16(p)));
#else
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
#endif
}
static inline vec dot16(const vec *w, const float *x, vec acc) {
    for (int g = 0; g < GROUP; g++) acc = vec_fma(w[g], vec_load(x + g * LANES), acc);
    return acc;
}
#if defined(__AVX512F__)
static inline vec vec_set1(float f) { return _mm512_set1_ps(f); }
static inline vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
#else
static inline vec vec_set1(float f) { return _mm256_set1_ps(f); }
static inline vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
#endif
/* 16 bytes of nibble pairs at p: each byte widened once to a 32-bit lane, both its nibbles taken
 * from there (an and, a shift), so 32 weights cost one widening shuffle per vector of lanes
 * instead of two. lo[g] holds the low nibbles of bytes [g LANES, (g + 1) LANES), hi[g] their
 * high nibbles, as fp32. */
static inline void widen_nibbles(const uint8_t *p, vec *lo, vec *hi) {
#if defined(__AVX512F__)
    __m512i wide = _mm512_cvtepu8_epi32(LOAD16(p));
    lo[0] = _mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
    hi[0] = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
#else
    for (int g = 0; g < GROUP; g++) { /* 8 bytes a half, widened straight from memory */
        __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * g)));
        lo[g] = _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(15)));
        hi[g] = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
    }
#endif
}

/* The fp16 scales (and Q4_1's mins, the next two bytes) of up to 16 blocks from `first` on, in
 * fp32, and the sum of the blocks' offsets times the activations' block sums (mins[j] xsum[j];
 * Q4_0's offset is -8 d). Converting a group of scales apart from the dot products, instead of
 * a scalar conversion and a register broadcast inside each block's step, took the Q4_0 body
 * from 16 to 20 GB/s of blocks at avx512. */
#if defined(__AVX512F__)
/* The first 4 bytes of blocks [first, first + count) (count <= 16) as 32-bit lanes: one gather,
 * or, for a row's last few blocks, scalar loads (a gather costs about as much for 2 blocks as for
 * 16, and K = 576 leaves 2 after 16). */
static inline __m512i block_words(const uint8_t *row, int64_t bytes, int64_t first, int64_t count) {
    const uint8_t *p = row + first * bytes;
    if (count <= 4) {
        int32_t w[4] = {0, 0, 0, 0};
        for (int64_t j = 0; j < count; j++) memcpy(&w[j], p + j * bytes, 4);
        return _mm512_zextsi128_si512(_mm_set_epi32(w[3], w[2], w[1], w[0]));
    }
    __mmask16 k = (__mmask16)(count == 16 ? 0xFFFF : (1u << count) - 1);
    __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i at = _mm512_mullo_epi32(iota, _mm512_set1_epi32((int)bytes));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, at, p, 1);
}

static inline float block_scales(const uint8_t *row, int64_t bytes, int64_t first,
                                 int64_t blocks, int mins, const float *xsum, float *d) {
    int64_t count = blocks - first < 16 ? blocks - first : 16;
    __mmask16 k = (__mmask16)(count == 16 ? 0xFFFF : (1u << count) - 1);
    __m512i g = block_words(row, bytes, first, count);
    __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    _mm512_storeu_ps(d, dv);
    if (!xsum) return 0.0f;
    __m512 mv = mins ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                     : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
    return _mm512_reduce_add_ps(_mm512_mul_ps(mv, _mm512_maskz_loadu_ps(k, xsum + first)));
}

/* block_scales for fdot_q4: the offsets' products folded into `offsets` lane by lane, so that
 * a row pays one horizontal sum at its end instead of one more per 16 blocks (at K = 576 those
 * sums were a third of the kernel's time once the rows came from the prefetches). Kept apart
 * from block_scales: one body for both, block_scales wrapping this one, made fdot_q4 12% slower
 * (bench_few_rows --weights q4_1, avx512_bf16: 25.4-25.8 -> 22.5-22.8 G weights/s). */
static inline void block_scales_into(const uint8_t *row, int64_t bytes, int64_t first,
                                     int64_t blocks, int mins, const float *xsum, float *d,
                                     __m512 *offsets) {
    int64_t count = blocks - first < 16 ? blocks - first : 16;
    __mmask16 k = (__mmask16)(count == 16 ? 0xFFFF : (1u << count) - 1);
    __m512i g = block_words(row, bytes, first, count);
    __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    _mm512_storeu_ps(d, dv);
    __m512 mv = mins ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                     : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
    *offsets = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xsum + first), *offsets);
}
#else
static inline float block_scales(const uint8_t *row, int64_t bytes, int64_t first,
                                 int64_t blocks, int mins, const float *xsum, float *d) {
    int64_t count = blocks - first < 16 ? blocks - first : 16;
    float offset = 0.0f;
    for (int64_t j = 0; j < count; j++) {
        const uint8_t *p = row + (first + j) * bytes;
        d[j] = half_to_float(p);
        if (xsum) offset += (mins ? half_to_float(p + 2) : -8.0f * d[j]) * xsum[first + j];
    }
    return offset;
}
#endif

/* One block's 16 bytes of quants at q widened and dotted with its 32 activations at xb, scaled by
 * d into acc. */
static inline vec nibbles_dot(const uint8_t *q, const float *xb, float d, vec acc) {
    vec lo[GROUP], hi[GROUP];
    widen_nibbles(q, lo, hi);
    vec t = dot16(hi, xb + 16, dot16(lo, xb, vec_zero()));
    return vec_fma(t, vec_set1(d), acc);
}

static __attribute__((noinline)) float fdot_q4(const uint8_t *row, const float *x,
                                               const float *xsum, int64_t blocks, int with_min) {
    vec acc = vec_zero();
    float offset = 0.0f, d[16];
    int64_t bytes = with_min ? 20 : 18;
    for (int64_t first = 0; first < blocks; first += 16) {
#if defined(__AVX512F__)
        block_scales_into(row, bytes, first, blocks, with_min, xsum, d, &acc);
#else
        offset += block_scales(row, bytes, first, blocks, with_min, xsum, d);
#endif
        int64_t end = blocks - first < 16 ? blocks : first + 16;
        for (int64_t b = first; b < end; b++) {
            const uint8_t *p = row + b * bytes;
            const float *xb = x + b * QK;
            __builtin_prefetch(p + PREFETCH_AHEAD);
            acc = nibbles_dot(p + (with_min ? 4 : 2), xb, d[b - first], acc);
        }
    }
    return vec_sum(acc) + offset;
}

/* fdot_q4 over the grouped layouts: a group's scales (and Q4_1's m) converted together, then the
 * same arithmetic in the same order as over GGUF's layout (the same bits). */
static __attribute__((noinline)) float fdot_q4_grouped(const uint8_t *row, const float *x,
                                                       const float *xsum, int64_t blocks,
                                                       int with_min) {
    vec acc = vec_zero();
    float offset = 0.0f, d[16];
    int64_t bytes = with_min ? 20 : 18;
    for (int64_t first = 0; first < blocks; first += SCALE_GROUP) {
        int64_t count = group_count(first, blocks);
        const uint8_t *group = row + first * bytes, *mins = group + 2 * count;
        const uint8_t *quants = group + (bytes - 16) * count;
#if defined(__AVX512F__)
        __mmask16 k = (__mmask16)((1u << count) - 1);
        __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, group));
        _mm512_storeu_ps(d, dv);
        __m512 mv = with_min ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mins))
                             : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
        acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xsum + first), acc);
#else
        float group_offset = 0.0f; /* block_scales' order */
        for (int64_t j = 0; j < count; j++) {
            d[j] = half_to_float(group + 2 * j);
            float m = with_min ? half_to_float(mins + 2 * j) : -8.0f * d[j];
            group_offset += m * xsum[first + j];
        }
        offset += group_offset;
#endif
        for (int64_t j = 0; j < count; j++) {
            __builtin_prefetch(quants + 16 * j + PREFETCH_AHEAD);
            acc = nibbles_dot(quants + 16 * j, x + (first + j) * QK, d[j], acc);
        }
    }
    return vec_sum(acc) + offset;
}

/* The super-block at p's eight scales times d into ds[8] (its sub-blocks' d sc_j), and its
 * mins' part, -dmin m_j times the activations' sub-block sums (sums[8]), into eight lanes of
 * *offsets: eight widened and converted at once. */
static inline void q4k_block_scales(const uint8_t *p, const float *sums, float *ds,
                                    __m256 *offsets) {
    q4k_packed packed = q4k_scales_mins(p + 4);
    __m128i sc = _mm_cvtsi64_si128((long long)packed.scales);
    __m128i m = _mm_cvtsi64_si128((long long)packed.mins);
    __m256 sc8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc));
    __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m));
    _mm256_storeu_ps(ds, _mm256_mul_ps(sc8, _mm256_set1_ps(half_to_float(p))));
    __m256 mins = _mm256_mul_ps(m8, _mm256_set1_ps(half_to_float(p + 2)));
    *offsets = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(sums), *offsets);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

#if defined(__AVX512BF16__)
/* bf16 activations (the bf16 math of CPUs with bf16 dot products) over Q4_0 / Q4_1: a block's
 * 32 nibbles become bf16 weights in three instructions and meet the activations in one
 * vdpbf16ps, against fdot_q4's eight instructions of widening, conversion and FMAs. The products
 * are exact (bf16 times bf16 fits fp32), so the math is still fp32 over the weights' and the
 * activations' exact values, up to the order and the rounding of the sums:
 *
 *   - the block's 16 bytes are broadcast to the four 128-bit lanes and the words of lane L shifted
 *     right by 4 L bits, so that each word's low nibble is a quant: lane 0 holds quants
 *     0, 2, .., 14 (low nibbles of the even bytes), lane 1 16, 18, .., 30 (their high nibbles),
 *     lane 2 1, 3, .., 15, lane 3 17, 19, .., 31. The activations are stored once a call in that
 *     order (PERMUTED), so that each weight meets its own activation;
 *   - a quant q becomes the bf16 bits 0x4300 | q, the value 128 + q (exact: 8 significant bits),
 *     so its and and or are one vpternlog;
 *   - the 128 (Q4_0: 136, its -8 too) comes off inside the same vdpbf16ps: its accumulator
 *     starts at -136 (x[2i] + x[2i + 1]) in lane i, the block's activations summed by pairs once
 *     a call (`pairs`), so a lane ends at (q[2i] - 8) x[2i] + (q[2i + 1] - 8) x[2i + 1] without a
 *     scalar offset per block. That cancellation costs about 7 bits of the fp32 sums, still
 *     about 7 bits below the bf16 rounding of the output (a test bounds it). Q4_1's m x-sums
 *     go into an accumulator of their own, through the block sums 16 blocks at a time (VBMI)
 *     or through the same pairs a block at a time. */
static const int8_t PERMUTED[QK] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                    1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
/* Q4_K's 32 quants of a sub-block are the low (or high) nibbles of 32 bytes in order, and so are
 * Q5_K's, Q6_K's, Q3_K's and Q2_K's 32, so their activations keep theirs (not IQ4_XS's) */
static const int8_t IN_ORDER[QK] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

/* out[b QK + i] = x[b QK + order[i]] for each block b, pairs[b QK / 2 + i] =
 * -bias (out[b QK + 2 i] + out[b QK + 2 i + 1]) in fp32 (exact unless the pair's magnitudes
 * are far apart, and then one fp32 rounding of the pair), and sums[b] the block's sum. The
 * bias: 136 for Q4_0 (128 and its -8), 160 for Q6_K (128 and its -32), 132 for Q3_K (128 and its
 * -4), else 128. */
static void permute_blocks(const uint16_t *x, uint16_t *out, float *pairs, float *sums, int64_t K,
                           int64_t type) {
    /* IQ4_XS's runs of 32 are laid out as IQ4_NL's (Q4_0's) */
    const int8_t *order =
        quant_block_size(type) == 256 && type != TYPE_IQ4_XS ? IN_ORDER : PERMUTED;
    float bias = type == TYPE_Q4_0 || type == TYPE_Q4_0_GROUPED ? 136.0f
                 : type == TYPE_Q6_K                             ? 160.0f
                 : type == TYPE_Q3_K                             ? 132.0f
                                                                 : 128.0f;
    for (int64_t b = 0; b < K / QK; b++) {
        float sum = 0.0f;
        for (int i = 0; i < QK; i += 2) {
            uint16_t v0 = x[b * QK + order[i]], v1 = x[b * QK + order[i + 1]];
            out[b * QK + i] = v0;
            out[b * QK + i + 1] = v1;
            float pair = bf16_to_float(v0) + bf16_to_float(v1);
            pairs[(b * QK + i) / 2] = -bias * pair;
            sum += pair;
        }
        sums[b] = sum;
    }
}

static inline __m512bh nibbles_bf16(const uint8_t *p) {
    __m512i bytes = _mm512_broadcast_i32x4(LOAD16(p));
    __m512i shifts = _mm512_set_epi64(0x000C000C000C000CLL, 0x000C000C000C000CLL,
                                      0x0008000800080008LL, 0x0008000800080008LL,
                                      0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    __m512i quants = _mm512_srlv_epi16(bytes, shifts);
    /* (quants & 15) | 0x4300: the ternary-logic table of (a & b) | c is 0xEA */
    return (__m512bh)_mm512_ternarylogic_epi32(quants, _mm512_set1_epi16(15),
                                               _mm512_set1_epi16(0x4300), 0xEA);
}

/* the fp16 at p in all 16 lanes: one broadcast load and one conversion */
static inline __m512 half_in_lanes(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
}

/* Block b's 32 weights (less their bias, 16 bytes of quants) times the activations, in 16
 * lanes, scaled by d into acc. */
static inline void quants_dot_bf16(const uint8_t *quants, const uint16_t *x, const float *pairs,
                                   int64_t b, __m512 d, __m512 *acc) {
    __m512 t = _mm512_dpbf16_ps(_mm512_loadu_ps(pairs + b * (QK / 2)), nibbles_bf16(quants),
                                (__m512bh)_mm512_loadu_si512(x + b * QK));
    *acc = _mm512_fmadd_ps(t, d, *acc);
}

/* quants_dot_bf16 for block b of a row in GGUF's layout */
static inline void block_dot_bf16(const uint8_t *row, const uint16_t *x, const float *pairs,
                                  int64_t b, int with_min, __m512 d, __m512 *acc) {
    const uint8_t *p = row + b * (with_min ? 20 : 18);
    quants_dot_bf16(p + (with_min ? 4 : 2), x, pairs, b, d, acc);
}

#if defined(__AVX512VBMI__) /* not every CPU of the level has byte permutes (Cooper Lake) */
/* Q4_1's d and m of 16 blocks from the row's 320 bytes in 5 loads and 3 byte permutes, instead
 * of a gather (slow on Zen 4) or a broadcast and a conversion for each (with the m's product,
 * half of the body's instructions): byte o of the result is byte Q4_1_SCALE_BYTE(o) of the 16
 * blocks, the 16 fp16 d first, then the 16 m. vpermi2b reads 128 bytes, so each byte comes from
 * loads 0-1, 2-3 or 4 (its offset >> 7), at index offset & 127. */
#define Q4_1_SCALE_BYTE(o) ((((o) & 31) >> 1) * 20 + ((o) & 1) + ((o) >> 5) * 2)
#define SCALE_INDEX_4(o)                                                                        \
    Q4_1_SCALE_BYTE(o) & 127, Q4_1_SCALE_BYTE((o) + 1) & 127, Q4_1_SCALE_BYTE((o) + 2) & 127,  \
        Q4_1_SCALE_BYTE((o) + 3) & 127
#define SCALE_INDEX_16(o)                                                                       \
    SCALE_INDEX_4(o), SCALE_INDEX_4((o) + 4), SCALE_INDEX_4((o) + 8), SCALE_INDEX_4((o) + 12)
#define SCALE_IN(o, r) ((uint64_t)((Q4_1_SCALE_BYTE(o) >> 7) == (r)) << (o))
#define SCALE_MASK_4(o, r)                                                                      \
    (SCALE_IN(o, r) | SCALE_IN((o) + 1, r) | SCALE_IN((o) + 2, r) | SCALE_IN((o) + 3, r))
#define SCALE_MASK_16(o, r)                                                                     \
    (SCALE_MASK_4(o, r) | SCALE_MASK_4((o) + 4, r) | SCALE_MASK_4((o) + 8, r) |                \
     SCALE_MASK_4((o) + 12, r))
#define SCALE_MASK(r)                                                                           \
    (SCALE_MASK_16(0, r) | SCALE_MASK_16(16, r) | SCALE_MASK_16(32, r) | SCALE_MASK_16(48, r))
static const uint8_t Q4_1_SCALE_INDEX[64] = {SCALE_INDEX_16(0), SCALE_INDEX_16(16),
                                             SCALE_INDEX_16(32), SCALE_INDEX_16(48)};

/* d of the 16 Q4_1 blocks at p into d[16], their m times the block sums into *mins */
static inline void q4_1_group_scales(const uint8_t *p, const float *sums, float *d, __m512 *mins) {
    __m512i index = _mm512_loadu_si512(Q4_1_SCALE_INDEX);
    __m512i bytes = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), index,
                                             _mm512_loadu_si512(p + 64));
    bytes = _mm512_mask_mov_epi8(bytes, SCALE_MASK(1),
                                 _mm512_permutex2var_epi8(_mm512_loadu_si512(p + 128), index,
                                                          _mm512_loadu_si512(p + 192)));
    bytes = _mm512_mask_mov_epi8(bytes, SCALE_MASK(2),
                                 _mm512_permutexvar_epi8(index, _mm512_loadu_si512(p + 256)));
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_castsi512_si256(bytes)));
    *mins = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(bytes, 1)),
                            _mm512_loadu_ps(sums), *mins);
}
#endif

/* Block b's m times its activations' sum into mins, through the pairs: (-m / 128) pairs, the
 * division by a power of two exact. */
static inline void min_through_pairs(__m512 m, const float *pairs, int64_t b, __m512 *mins) {
    *mins = _mm512_fmadd_ps(_mm512_mul_ps(m, _mm512_set1_ps(-1.0f / 128)),
                            _mm512_loadu_ps(pairs + b * (QK / 2)), *mins);
}

/* Block b with its own scales: d broadcast from the block, Q4_1's m through the pairs. */
static inline void block_dot_bf16_alone(const uint8_t *row, const uint16_t *x, const float *pairs,
                                        int64_t b, int with_min, __m512 *acc, __m512 *mins) {
    const uint8_t *p = row + b * (with_min ? 20 : 18);
    block_dot_bf16(row, x, pairs, b, with_min, half_in_lanes(p), acc);
    if (with_min) min_through_pairs(half_in_lanes(p + 2), pairs, b, mins);
}

/* Two accumulators, even and odd blocks: with one, each block waited on the last one's FMA
 * (in L2, one thread: 24 -> 35-40 G weights/s; fdot_q4's widening gains nothing from two).
 * with_min a constant in each caller, so that the blocks' loop has no branch. Q4_1 takes its
 * scales 16 blocks at a time (q4_1_group_scales: 1.1-1.3x), Q4_0 in GGUF's layout a block at a
 * time (permuted groups gained 0-5% there). The engine keeps both grouped, whose scales come 16
 * at a time without permutes (q4_grouped_bf16). */
static inline __attribute__((always_inline)) float q4_bf16(const uint8_t *row, const uint16_t *x,
                                                           const float *pairs, const float *sums,
                                                           int64_t blocks, int with_min) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    int64_t b = 0;
#if defined(__AVX512VBMI__)
    float d[16];
    for (; with_min && b + 16 <= blocks; b += 16) {
        q4_1_group_scales(row + b * 20, sums + b, d, &mins);
        __asm__ volatile("" ::: "memory"); /* each block's d a broadcast load, not a permute */
        for (int j = 0; j < 16; j += 2) {
            __builtin_prefetch(row + (b + j) * 20 + PREFETCH_AHEAD);
            block_dot_bf16(row, x, pairs, b + j, with_min, _mm512_set1_ps(d[j]), &even);
            block_dot_bf16(row, x, pairs, b + j + 1, with_min, _mm512_set1_ps(d[j + 1]), &odd);
        }
    }
#else
    (void)sums;
#endif
    for (; b + 1 < blocks; b += 2) {
        __builtin_prefetch(row + b * (with_min ? 20 : 18) + PREFETCH_AHEAD);
        block_dot_bf16_alone(row, x, pairs, b, with_min, &even, &mins);
        block_dot_bf16_alone(row, x, pairs, b + 1, with_min, &odd, &mins);
    }
    if (b < blocks) block_dot_bf16_alone(row, x, pairs, b, with_min, &even, &mins);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even, odd), mins));
}

static __attribute__((noinline)) float fdot_q4_0_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, const float *sums,
                                                      int64_t blocks) {
    return q4_bf16(row, x, pairs, sums, blocks, 0);
}

/* Block first + j of a group (its quants at quants + 16 j, its d in d[j]) into acc; with
 * `alone`, its m (m[j]) through the pairs into mins, as block_dot_bf16_alone adds it. */
static inline void grouped_block_bf16(const uint8_t *quants, const uint16_t *x, const float *pairs,
                                      int64_t first, int64_t j, const float *d, int alone,
                                      const float *m, __m512 *acc, __m512 *mins) {
    quants_dot_bf16(quants + 16 * j, x, pairs, first + j, _mm512_set1_ps(d[j]), acc);
    if (alone) min_through_pairs(_mm512_set1_ps(m[j]), pairs, first + j, mins);
}

/* q4_bf16 over the grouped layouts: a group's 16 scales in one conversion (Q4_1's m too), each
 * block's d then a broadcast load: the same products and sums in the same order as over GGUF's
 * layout, so the same bits (Q4_1: as q4_bf16 computes with byte permutes; a CPU of this level
 * without them, which takes every Q4_1 block alone there, gets the grouped sums here). 1.1-1.17x
 * faster on 1B-shaped Q4_0 layers than a scale converted a block; Q4_1 runs as fast as with the
 * permutes here (their gather was already cheap) and needs none. */
static inline __attribute__((always_inline)) float q4_grouped_bf16(const uint8_t *row,
                                                                   const uint16_t *x,
                                                                   const float *pairs,
                                                                   const float *sums,
                                                                   int64_t blocks, int with_min) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    float d[16], m[16];
    int64_t bytes = with_min ? 20 : 18;
    for (int64_t first = 0; first < blocks; first += SCALE_GROUP) {
        int64_t count = group_count(first, blocks);
        const uint8_t *group = row + first * bytes, *quants = group + (bytes - 16) * count;
        __mmask16 k = (__mmask16)((1u << count) - 1);
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, group)));
        if (with_min) {
            __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, group + 2 * count));
            /* a whole group's m through the block sums (q4_1_group_scales), a shorter one's a
             * block at a time through the pairs (block_dot_bf16_alone) */
            if (count == SCALE_GROUP)
                mins = _mm512_fmadd_ps(mv, _mm512_loadu_ps(sums + first), mins);
            else
                _mm512_storeu_ps(m, mv);
        }
        __asm__ volatile("" ::: "memory"); /* each block's d a broadcast load, not a permute */
        /* a group's blocks alternate between the accumulators as q4_bf16's do: every group but
         * the last has an even count */
        int alone = with_min && count < SCALE_GROUP;
        int64_t j = 0;
        for (; j + 1 < count; j += 2) {
            __builtin_prefetch(quants + 16 * j + PREFETCH_AHEAD);
            grouped_block_bf16(quants, x, pairs, first, j, d, alone, m, &even, &mins);
            grouped_block_bf16(quants, x, pairs, first, j + 1, d, alone, m, &odd, &mins);
        }
        if (j < count) grouped_block_bf16(quants, x, pairs, first, j, d, alone, m, &even, &mins);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even, odd), mins));
}

/* q4_grouped_bf16 compiled once per type, with_min a constant in each */
static __attribute__((noinline)) float fdot_q4_0_grouped_bf16(const uint8_t *row,
                                                              const uint16_t *x,
                                                              const float *pairs,
                                                              const float *sums, int64_t blocks) {
    return q4_grouped_bf16(row, x, pairs, sums, blocks, 0);
}

static __attribute__((noinline)) float fdot_q4_1_grouped_bf16(const uint8_t *row,
                                                              const uint16_t *x,
                                                              const float *pairs,
                                                              const float *sums, int64_t blocks) {
    return q4_grouped_bf16(row, x, pairs, sums, blocks, 1);
}

static __attribute__((noinline)) float fdot_q4_1_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, const float *sums,
                                                      int64_t blocks) {
    return q4_bf16(row, x, pairs, sums, blocks, 1);
}
#endif

static __attribute__((noinline)) float fdot_q8_0(const uint8_t *row, const float *x,
                                                 const float *xsum, int64_t blocks) {
    (void)xsum;
    vec acc = vec_zero(), w[GROUP];
    float d[16];
    for (int64_t first = 0; first < blocks; first += 16) {
        block_scales(row, 34, first, blocks, 0, NULL, d);
        int64_t end = blocks - first < 16 ? blocks : first + 16;
        for (int64_t b = first; b < end; b++) {
            const uint8_t *p = row + b * 34;
            const float *xb = x + b * QK;
            __builtin_prefetch(p + PREFETCH_AHEAD);
            widen_s8(p + 2, w);
            vec t = dot16(w, xb, vec_zero());
            widen_s8(p + 18, w);
            t = dot16(w, xb + 16, t);
            acc = vec_fma(t, vec_set1(d[b - first]), acc);
        }
    }
    return vec_sum(acc);
}

static __attribute__((noinline)) float fdot_q4_k(const uint8_t *row, const float *x,
                                                 const float *xsum, int64_t blocks) {
    vec acc = vec_zero();
    __m256 offsets = _mm256_setzero_ps();
    float ds[8];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * 144;
        prefetch_super_block(p + PREFETCH_AHEAD);
        q4k_block_scales(p, xsum + 8 * b, ds, &offsets);
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = p + 16 + 32 * c;
            const float *xc = x + b * 256 + 64 * c;
            vec lo0[GROUP], hi0[GROUP], lo1[GROUP], hi1[GROUP];
            widen_nibbles(q, lo0, hi0);
            widen_nibbles(q + 16, lo1, hi1);
            vec t = dot16(lo1, xc + 16, dot16(lo0, xc, vec_zero()));
            acc = vec_fma(t, vec_set1(ds[2 * c]), acc);
            t = dot16(hi1, xc + 48, dot16(hi0, xc + 32, vec_zero()));
            acc = vec_fma(t, vec_set1(ds[2 * c + 1]), acc);
        }
    }
    return vec_sum(acc) + sum8(offsets);
}

#include "cpu_quant_k.h"
#include "cpu_quant_k3.h"
#include "cpu_quant_iq4.h"

/* A row of K weights of a K type to fp32 (the bodies in cpu_quant_k.h, cpu_quant_k3.h) */
static __attribute__((noinline)) void unpack_k_f32(int64_t type, const uint8_t *row, float *out,
                                                   int64_t K) {
    if (type == TYPE_Q4_K) q4_k_unpacked(row, out, NULL, K / 256);
    else if (type == TYPE_Q5_K) q5_k_unpacked(row, out, NULL, K / 256);
    else if (type == TYPE_Q3_K) q3_k_unpacked(row, out, NULL, K / 256);
    else if (type == TYPE_Q2_K) q2_k_unpacked(row, out, NULL, K / 256);
    else if (type == TYPE_IQ4_XS) iq4_xs_unpacked(row, out, NULL, K / 256);
    else q6_k_unpacked(row, out, NULL, K / 256);
}

#if defined(__AVX512BF16__)
/* ... and to bf16 */
static __attribute__((noinline)) void unpack_k_bf16(int64_t type, const uint8_t *row,
                                                    uint16_t *out, int64_t K) {
    if (type == TYPE_Q4_K) q4_k_unpacked(row, NULL, out, K / 256);
    else if (type == TYPE_Q5_K) q5_k_unpacked(row, NULL, out, K / 256);
    else if (type == TYPE_Q3_K) q3_k_unpacked(row, NULL, out, K / 256);
    else if (type == TYPE_Q2_K) q2_k_unpacked(row, NULL, out, K / 256);
    else if (type == TYPE_IQ4_XS) iq4_xs_unpacked(row, NULL, out, K / 256);
    else q6_k_unpacked(row, NULL, out, K / 256);
}
#endif

static inline float pair_dot(int64_t type, const uint8_t *row, const float *x, const float *xsum,
                             float *scratch, int64_t K) {
    (void)scratch;
    switch (type) {
    case TYPE_Q8_0: return fdot_q8_0(row, x, xsum, K / QK);
    case TYPE_Q4_0: return fdot_q4(row, x, xsum, K / QK, 0);
    case TYPE_Q4_0_GROUPED: return fdot_q4_grouped(row, x, xsum, K / QK, 0);
    case TYPE_Q4_1: return fdot_q4(row, x, xsum, K / QK, 1);
    case TYPE_Q4_1_GROUPED: return fdot_q4_grouped(row, x, xsum, K / QK, 1);
    case TYPE_Q5_K: return fdot_q5_k(row, x, xsum, K / 256);
    case TYPE_Q6_K: return fdot_q6_k(row, x, K / 256);
    case TYPE_Q3_K: return fdot_q3_k(row, x, K / 256);
    case TYPE_Q2_K: return fdot_q2_k(row, x, xsum, K / 256);
    case TYPE_IQ4_NL: return fdot_iq4_nl(row, x, K / QK);
    case TYPE_IQ4_XS: return fdot_iq4_xs(row, x, K / 256);
    default: return fdot_q4_k(row, x, xsum, K / 256);
    }
}
#else
/* Plain C: the row unpacked into the thread's fp32 row, then an fp32 dot. */
/* sum a[k] b[k], four accumulators (K is a multiple of 32). Not inlined: one compiled copy for
 * every pair, so that a row's bits do not depend on how many rows came with it. */
static __attribute__((noinline)) float dot_f32(const float *a, const float *b, int64_t K) {
    vec s0 = vec_zero(), s1 = vec_zero(), s2 = vec_zero(), s3 = vec_zero();
    int64_t k = 0;
    for (; k + 4 * LANES <= K; k += 4 * LANES) {
        s0 = vec_fma(vec_load(a + k), vec_load(b + k), s0);
        s1 = vec_fma(vec_load(a + k + LANES), vec_load(b + k + LANES), s1);
        s2 = vec_fma(vec_load(a + k + 2 * LANES), vec_load(b + k + 2 * LANES), s2);
        s3 = vec_fma(vec_load(a + k + 3 * LANES), vec_load(b + k + 3 * LANES), s3);
    }
    for (; k + LANES <= K; k += LANES) s0 = vec_fma(vec_load(a + k), vec_load(b + k), s0);
    float sum = vec_sum(vec_add(vec_add(s0, s1), vec_add(s2, s3)));
    for (; k < K; k++) sum += a[k] * b[k];
    return sum;
}
static inline float pair_dot(int64_t type, const uint8_t *row, const float *x, const float *xsum,
                             float *scratch, int64_t K) {
    (void)xsum;
    dequantize_row(type, row, scratch, K);
    return dot_f32(scratch, x, K);
}
#endif

/* Whether a bf16 body (fdot_q*_bf16) takes this weight's pairs with bf16 activations. */
static inline int bf16_dot_type(int64_t type) {
#if defined(__AVX512BF16__)
    return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_IQ4_NL ||
           quant_block_size(type) == 256 || is_grouped(type);
#else
    (void)type;
    return 0;
#endif
}

/* Whether every part of the weight (one, or a stack's) takes bf16 activations in a bf16 body */
static int bf16_dot_weight(const qweight *w) {
    if (w->type != TYPE_STACKED) return bf16_dot_type(w->type);
    for (int64_t i = 0; i < stacked_count(w); i++)
        if (!bf16_dot_type(stacked_at(w, i).type)) return 0;
    return 1;
}

/* out [rows, N] (rows `stride` apart) = x @ w.T + bias, x fp32 [rows, K] (rows <= MAX_ROWS), in
 * fp32 over the weights' exact values (as the unpacked matmul computes, up to the order of the
 * sums); or, for the types of bf16_dot_type, with x_bf16 [rows, K] in place of x (NULL). */
static int qlinear(const float *x, const uint16_t *x_bf16, const qweight *w, const float *bias,
                   float *out, int64_t rows, int64_t N, int64_t stride, int64_t K,
                   int64_t threads) {
    if (quant_block_bytes(w->type) < 0) return -3;
    int64_t row_bytes = K / quant_block_size(w->type) * quant_block_bytes(w->type);
    int64_t blocks = K / QK, size = sum_size(w->type), runs = K / size;
    /* the activations' sums [rows, runs] (each of `size` weights); for x_bf16, the blocks' sums
     * [rows, blocks] after pairs [rows, K / 2] (permute_blocks) */
    size_t floats = (size_t)(rows * runs + (x_bf16 ? rows * K / 2 : 0));
    float *xsum = thread_scratch(5, floats * sizeof(float));
    if (!xsum) return -2;
    uint16_t *permuted = NULL;
#if defined(__AVX512BF16__)
    float *pairs = xsum;
    if (x_bf16) {
        permuted = thread_scratch(2, (size_t)(rows * K) * sizeof(uint16_t));
        if (!permuted) return -2;
        for (int64_t m = 0; m < rows; m++)
            permute_blocks(x_bf16 + m * K, permuted + m * K, pairs + m * K / 2,
                           pairs + rows * K / 2 + m * blocks, K, w->type);
    }
#endif
    for (int64_t m = 0; !permuted && m < rows; m++)
        for (int64_t b = 0; b < runs; b++) {
            float s = 0.0f;
            for (int64_t i = 0; i < size; i++) s += x[m * K + b * size + i];
            xsum[m * runs + b] = s;
        }
    const uint8_t *table = w->blocks;
    int64_t type = w->type;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = thread_scratch(6, (size_t)K * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!scratch) continue;
            const uint8_t *row = table + n * row_bytes;
#if !defined(__AVX2__) /* the vector bodies ask for their lines as they go */
            for (int64_t at = 0; at < row_bytes; at += 64) /* a hint: past the table is fine */
                __builtin_prefetch(row + PREFETCH_AHEAD + at);
#endif
            float b = bias ? bias[n] : 0.0f;
            for (int64_t m = 0; m < rows; m++) {
#if defined(__AVX512BF16__)
                if (permuted) {
                    const uint16_t *xp = permuted + m * K;
                    const float *pm = pairs + m * K / 2, *sums = pairs + rows * K / 2 + m * blocks;
                    float dot;
                    switch (type) {
                    case TYPE_Q4_0_GROUPED:
                        dot = fdot_q4_0_grouped_bf16(row, xp, pm, sums, blocks);
                        break;
                    case TYPE_Q4_1_GROUPED:
                        dot = fdot_q4_1_grouped_bf16(row, xp, pm, sums, blocks);
                        break;
                    case TYPE_Q4_K: dot = fdot_q4_k_bf16(row, xp, pm, sums, K / 256); break;
                    case TYPE_Q5_K: dot = fdot_q5_k_bf16(row, xp, pm, sums, K / 256); break;
                    case TYPE_Q6_K: dot = fdot_q6_k_bf16(row, xp, pm, K / 256); break;
                    case TYPE_Q3_K: dot = fdot_q3_k_bf16(row, xp, pm, K / 256); break;
                    case TYPE_Q2_K: dot = fdot_q2_k_bf16(row, xp, pm, K / 256); break;
                    case TYPE_IQ4_NL: dot = fdot_iq4_nl_bf16(row, xp, blocks); break;
                    case TYPE_IQ4_XS: dot = fdot_iq4_xs_bf16(row, xp, K / 256); break;
                    case TYPE_Q4_1: dot = fdot_q4_1_bf16(row, xp, pm, sums, blocks); break;
                    default: dot = fdot_q4_0_bf16(row, xp, pm, sums, blocks);
                    }
                    out[m * stride + n] = dot + b;
                    continue;
                }
#endif
                out[m * stride + n] =
                    pair_dot(type, row, x + m * K, xsum + m * runs, scratch, K) + b;
            }
        }
    }
    return failed ? -2 : 0;
}

/* qlinear over a weight or a stack of parts (each its own columns of out, its own bias). A stack
 * whose rows do not add up to N, or that holds a stack, is refused (-3). */
static int qlinear_parts(const float *x, const uint16_t *x_bf16, const qweight *w,
                         const float *bias, float *out, int64_t rows, int64_t N, int64_t K,
                         int64_t threads) {
    if (w->type != TYPE_STACKED) return qlinear(x, x_bf16, w, bias, out, rows, N, N, K, threads);
    int64_t first = 0;
    for (int64_t i = 0; i < stacked_count(w); i++) {
        stacked_part part = stacked_at(w, i);
        if (part.type == TYPE_STACKED || part.rows < 1 || first + part.rows > N) return -3;
        qweight one = {part.type, (const uint8_t *)(intptr_t)part.address};
        int status = qlinear(x, x_bf16, &one, bias ? bias + first : NULL, out + first, rows,
                             part.rows, N, K, threads);
        if (status) return status;
        first += part.rows;
    }
    return first == N ? 0 : -3;
}

/* The activations' type T at the edges: bf16 rows are widened into fp32 scratch first, and the
 * fp32 result rounded back. */
#define DEFINE_LINEAR(T, SUFFIX)                                                                \
    static int qlinear_##SUFFIX(const T *x, const qweight *w, const T *bias, T *out,            \
                                int64_t rows, int64_t N, int64_t K, int64_t threads) {          \
        if (sizeof(T) == sizeof(float))                                                         \
            return qlinear_parts((const float *)x, NULL, w, (const float *)bias, (float *)out,  \
                                 rows, N, K, threads);                                          \
        int bf16_dot = bf16_dot_weight(w);                                                      \
        float *xf = bf16_dot ? NULL : thread_scratch(2, (size_t)(rows * K) * sizeof(float));    \
        float *of = thread_scratch(3, (size_t)(rows * N) * sizeof(float));                      \
        float *bf = bias ? thread_scratch(4, (size_t)N * sizeof(float)) : NULL;                 \
        if ((!bf16_dot && !xf) || !of || (bias && !bf)) return -2;                              \
        for (int64_t i = 0; !bf16_dot && i < rows * K; i++) xf[i] = ROW_LOAD_##SUFFIX(x[i]);    \
        for (int64_t i = 0; bias && i < N; i++) bf[i] = ROW_LOAD_##SUFFIX(bias[i]);             \
        int status = qlinear_parts(xf, bf16_dot ? (const uint16_t *)x : NULL, w, bf, of, rows,  \
                                   N, K, threads);                                              \
        for (int64_t i = 0; i < rows * N; i++) out[i] = ROW_STORE_##SUFFIX(of[i]);              \
        return status;                                                                          \
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

/* ---- unpacking for matmuls of many rows ---- */
#if defined(__AVX2__)
/* One row, each block widened and scaled in registers as in the dot products (the K types'
 * bodies are in cpu_quant_k.h). */
static void unpack_row(int64_t type, const uint8_t *row, float *out, int64_t K) {
    if (quant_block_size(type) == 256) {
        unpack_k_f32(type, row, out, K);
        return;
    }
    int64_t bytes = quant_block_bytes(type);
    int grouped = is_grouped(type), with_min = has_min(type);
    vec w[GROUP];
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *p = row + b * bytes;
        float d = half_to_float(grouped ? grouped_scale(row, b, bytes) : p), m = 0.0f;
        float *o = out + b * QK;
        if (type == TYPE_IQ4_NL) {
            iq4_nl_unpacked(p, o, iq4_lookup_table());
            continue;
        }
        if (type == TYPE_Q8_0) {
            widen_s8(p + 2, w);
            for (int g = 0; g < GROUP; g++) vec_store(o + g * LANES, vec_fma(w[g], vec_set1(d), vec_zero()));
            widen_s8(p + 18, w);
            for (int g = 0; g < GROUP; g++)
                vec_store(o + 16 + g * LANES, vec_fma(w[g], vec_set1(d), vec_zero()));
            continue;
        }
        m = !with_min ? -8.0f * d : half_to_float(grouped ? grouped_min(row, b, K / QK) : p + 2);
        vec lo[GROUP], hi[GROUP];
        widen_nibbles(grouped ? grouped_quants(row, b, K / QK, bytes) : p + (with_min ? 4 : 2),
                      lo, hi);
        for (int g = 0; g < GROUP; g++) {
            vec_store(o + g * LANES, vec_fma(lo[g], vec_set1(d), vec_set1(m)));
            vec_store(o + 16 + g * LANES, vec_fma(hi[g], vec_set1(d), vec_set1(m)));
        }
    }
}
#else
static void unpack_row(int64_t type, const uint8_t *row, float *out, int64_t K) {
    dequantize_row(type, row, out, K);
}
#endif

/* fp32 to bf16, round to nearest even (as float_to_bf16). */
static inline void store_bf16(const float *in, uint16_t *out, int64_t K) {
    int64_t k = 0;
#if defined(__AVX512BF16__)
    for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i *)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + k)));
#endif
    for (; k < K; k++) out[k] = float_to_bf16(in[k]);
}

/* The block table [N, row bytes] unpacked to out [N, K] (fp32 or bf16). Returns -1 for a type
 * this file does not know, -2 without scratch memory. */
int dequantize_f32(int64_t type, const uint8_t *blocks, float *out, int64_t N, int64_t K,
                   int64_t threads) {
    if (quant_block_bytes(type) < 0) return -1;
    int64_t row_bytes = K / quant_block_size(type) * quant_block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) unpack_row(type, blocks + n * row_bytes, out + n * K, K);
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
#if defined(__AVX512BF16__) /* the K types straight to bf16 (cpu_quant_k.h) */
            if (quant_block_size(type) == 256) {
                unpack_k_bf16(type, blocks + n * row_bytes, out + n * K, K);
                continue;
            }
#endif
            if (!row) continue;
            unpack_row(type, blocks + n * row_bytes, row, K);
            store_bf16(row, out + n * K, K);
        }
    }
    return failed ? -2 : 0;
}
