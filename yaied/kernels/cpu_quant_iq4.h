/* The vector bodies of the non-linear 4-bit types, IQ4_NL and IQ4_XS, included by cpu_quant.c
 * inside its AVX2 section after cpu_quant_k.h (they use its widen_s8_32 and put). The formats
 * are in cpu_quant.c's header; in short, each 4-bit index picks one of 16 fixed int8 values
 * (IQ4_VALUES, llama.cpp's kvalues_iq4nl), 32 indices a run of 16 bytes laid out as Q4_0's
 * (low nibbles the first 16 weights, high nibbles the next 16):
 *
 *   IQ4_NL  18 bytes / 32: fp16 d, 16 bytes of indices           w = d v[q]
 *   IQ4_XS 136 bytes / 256: fp16 d, 8 runs of 32 with 6-bit scales (low nibbles in 4 bytes,
 *           top pairs in a 16-bit word), 128 bytes of indices     w = d (sc_j - 32) v[q]
 *
 * Every weight is exact in fp32 (d (sc_j - 32) is 11 by 6 significant bits, times a 7-bit
 * value), so the unpacking is the reference's bit for bit and the dots are fp32 over the exact
 * weights. The lookup stays in registers: the avx2 body takes the 32 values of a run in one
 * byte shuffle of the table (vpshufb, the table in both 128-bit lanes) and widens them as Q6_K's
 * int8 quants, the avx512 ones pick them in fp32 with two permutes of the table (vpermps); the
 * bf16 body takes them as bf16 words in one word permute of the table (vpermw), exact (8
 * significant bits), so nothing comes off through the activations' sums: no offset, no bias. */

#define IQ4_XS_BYTES 136

/* the table in both 128-bit lanes, for a byte shuffle */
static inline __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(LOAD16(IQ4_VALUES));
}

/* The 16 bytes of indices at q as the 32 int8 values of their weights, in order: the bytes in
 * both lanes, the upper lane's shifted down by 4 (its high nibbles), each nibble looked up. */
static inline __m256i iq4_values(const uint8_t *q, __m256i table) {
    __m256i bytes = _mm256_broadcastsi128_si256(LOAD16(q));
    __m256i nibbles = _mm256_srlv_epi32(bytes, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0));
    return _mm256_shuffle_epi8(table, _mm256_and_si256(nibbles, _mm256_set1_epi8(15)));
}

/* 32 widened values dotted with their activations at x */
static inline vec dot32(const vec *w, const float *x) {
    return dot16(w + GROUP, x + 16, dot16(w, x, vec_zero()));
}

#if defined(__AVX512F__)
/* The table as fp32 in one register, for iq4_floats */
typedef __m512 iq4_lookup;
static inline iq4_lookup iq4_lookup_table(void) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LOAD16(IQ4_VALUES)));
}

/* The 16 bytes of indices at q as their 32 values in fp32, in order (2 GROUPs of vectors): the
 * bytes widened once to 32-bit lanes, each nibble picking its fp32 value with one permute
 * (vpermps reads an index's low four bits: the low nibble needs no mask), without Q4_0's
 * conversions: 1.3x the byte shuffle's rate on a Zen 5. */
static inline void iq4_floats(const uint8_t *q, iq4_lookup table, vec *w) {
    __m512i wide = _mm512_cvtepu8_epi32(LOAD16(q));
    w[0] = _mm512_permutexvar_ps(wide, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
}
#else
typedef __m256i iq4_lookup;
static inline iq4_lookup iq4_lookup_table(void) { return iq4_table(); }

/* iq4_values, widened */
static inline void iq4_floats(const uint8_t *q, iq4_lookup table, vec *w) {
    widen_s8_32(iq4_values(q, table), w);
}
#endif

/* fp32 activations over IQ4_NL: each block's 32 values looked up in fp32, their dot scaled by d
 * once; the scales 16 blocks at a time as Q8_0's (the same 2-byte d first, 18 bytes a block as
 * Q4_0's); even and odd blocks in two accumulators (one: 0.8x at avx512). blocks: of 32. */
static __attribute__((noinline)) float fdot_iq4_nl(const uint8_t *row, const float *x,
                                                   int64_t blocks) {
    const iq4_lookup table = iq4_lookup_table();
    vec even = vec_zero(), odd = vec_zero(), w[2 * GROUP], v[2 * GROUP];
    float d[16];
    for (int64_t first = 0; first < blocks; first += 16) {
        block_scales(row, 18, first, blocks, 0, NULL, d);
        int64_t end = blocks - first < 16 ? blocks : first + 16, b = first;
        for (; b + 1 < end; b += 2) {
            const uint8_t *p = row + b * 18;
            __builtin_prefetch(p + PREFETCH_AHEAD);
            iq4_floats(p + 2, table, w);
            iq4_floats(p + 20, table, v);
            even = vec_fma(dot32(w, x + b * QK), vec_set1(d[b - first]), even);
            odd = vec_fma(dot32(v, x + b * QK + QK), vec_set1(d[b + 1 - first]), odd);
        }
        if (b < end) {
            iq4_floats(row + b * 18 + 2, table, w);
            even = vec_fma(dot32(w, x + b * QK), vec_set1(d[b - first]), even);
        }
    }
    return vec_sum(vec_add(even, odd));
}

/* The super-block at p's eight d (sc_j - 32) into ds[8], each exact in fp32 */
static inline void iq4_xs_scales(const uint8_t *p, float *ds) {
    uint8_t sc[8];
    iq4_xs_scale_bytes(p, sc);
    __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
    s = _mm256_sub_epi32(s, _mm256_set1_epi32(32));
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(half_to_float(p))));
}

/* three lines: 136 bytes at p touch a fourth only where the next block starts */
static inline void prefetch_iq4_xs(const uint8_t *p) {
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
    __builtin_prefetch(p + 128);
}

/* fp32 activations over IQ4_XS: fdot_iq4_nl's run of 32 for each sub-block, scaled by its
 * d (sc_j - 32); even and odd sub-blocks in two accumulators. blocks: super-blocks of 256. */
static __attribute__((noinline)) float fdot_iq4_xs(const uint8_t *row, const float *x,
                                                   int64_t blocks) {
    const iq4_lookup table = iq4_lookup_table();
    vec even = vec_zero(), odd = vec_zero(), w[2 * GROUP];
    float ds[8];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * IQ4_XS_BYTES;
        prefetch_iq4_xs(p + PREFETCH_AHEAD);
        iq4_xs_scales(p, ds);
        for (int j = 0; j < 8; j += 2) {
            iq4_floats(p + 8 + 16 * j, table, w);
            even = vec_fma(dot32(w, x + b * 256 + 32 * j), vec_set1(ds[j]), even);
            iq4_floats(p + 24 + 16 * j, table, w);
            odd = vec_fma(dot32(w, x + b * 256 + 32 * j + 32), vec_set1(ds[j + 1]), odd);
        }
    }
    return vec_sum(vec_add(even, odd));
}

#if defined(__AVX512BF16__)
/* IQ4_VALUES as bf16 bits, twice: vpermw reads an index's low five bits, and the fifth is a
 * neighbour nibble's bit that nibbles_bf16's shifts leave there, so entries 16-31 repeat 0-15
 * instead of a mask taking it off. */
static const uint16_t IQ4_BF16[32] = {
    0xC2FE, 0xC2D0, 0xC2A6, 0xC282, 0xC244, 0xC20C, 0xC1B0, 0xC120,
    0x3F80, 0x4150, 0x41C8, 0x4218, 0x4254, 0x428A, 0x42B2, 0x42E2,
    0xC2FE, 0xC2D0, 0xC2A6, 0xC282, 0xC244, 0xC20C, 0xC1B0, 0xC120,
    0x3F80, 0x4150, 0x41C8, 0x4218, 0x4254, 0x428A, 0x42B2, 0x42E2};

/* A run's 32 values as bf16 words in nibbles_bf16's order (the activations PERMUTED to meet
 * them): the 16 bytes in the four 128-bit lanes, shifted by 0, 4, 8, 12, one word permute. */
static inline __m512bh iq4_bf16(const uint8_t *q, __m512i table) {
    __m512i bytes = _mm512_broadcast_i32x4(LOAD16(q));
    __m512i shifts = _mm512_set_epi64(0x000C000C000C000CLL, 0x000C000C000C000CLL,
                                      0x0008000800080008LL, 0x0008000800080008LL,
                                      0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, shifts), table);
}

/* Run `chunk` of the row (its indices at q) with its scale into acc: one vdpbf16ps from zero */
static inline void iq4_run_bf16(const uint8_t *q, const uint16_t *x, int64_t chunk, __m512i table,
                                __m512 scale, __m512 *acc) {
    __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), iq4_bf16(q, table),
                                (__m512bh)_mm512_loadu_si512(x + chunk * QK));
    *acc = _mm512_fmadd_ps(t, scale, *acc);
}

/* bf16 activations over IQ4_NL: even and odd blocks in two accumulators (as q4_bf16) */
static __attribute__((noinline)) float fdot_iq4_nl_bf16(const uint8_t *row, const uint16_t *x,
                                                        int64_t blocks) {
    const __m512i table = _mm512_loadu_si512(IQ4_BF16);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const uint8_t *p = row + b * 18;
        __builtin_prefetch(p + PREFETCH_AHEAD);
        iq4_run_bf16(p + 2, x, b, table, half_in_lanes(p), &even);
        iq4_run_bf16(p + 20, x, b + 1, table, half_in_lanes(p + 18), &odd);
    }
    if (b < blocks) iq4_run_bf16(row + b * 18 + 2, x, b, table, half_in_lanes(row + b * 18), &even);
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}

/* bf16 activations over IQ4_XS: each sub-block a run, its scale one permute of the eight */
static __attribute__((noinline)) float fdot_iq4_xs_bf16(const uint8_t *row, const uint16_t *x,
                                                        int64_t blocks) {
    const __m512i table = _mm512_loadu_si512(IQ4_BF16);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    float ds[8];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * IQ4_XS_BYTES;
        prefetch_iq4_xs(p + PREFETCH_AHEAD);
        iq4_xs_scales(p, ds);
        for (int j = 0; j < 8; j += 2) {
            iq4_run_bf16(p + 8 + 16 * j, x, 8 * b + j, table, _mm512_set1_ps(ds[j]), &even);
            iq4_run_bf16(p + 24 + 16 * j, x, 8 * b + j + 1, table, _mm512_set1_ps(ds[j + 1]),
                         &odd);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}
#endif

/* ---- unpacked: each value times its scale, one exact product (unpack_row, unpack_k_*) ---- */

/* One IQ4_NL block at p to weights [0, 32) of o */
static inline void iq4_nl_unpacked(const uint8_t *p, float *o, iq4_lookup table) {
    vec w[2 * GROUP];
    iq4_floats(p + 2, table, w);
    float d = half_to_float(p);
    for (int g = 0; g < 2 * GROUP; g++) vec_store(o + g * LANES, vec_mul(w[g], vec_set1(d)));
}

static inline __attribute__((always_inline)) void iq4_xs_unpacked(const uint8_t *row, float *o32,
                                                                  uint16_t *o16, int64_t blocks) {
    const iq4_lookup table = iq4_lookup_table();
    vec w[2 * GROUP];
    float ds[8];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * IQ4_XS_BYTES;
        iq4_xs_scales(p, ds);
        for (int j = 0; j < 8; j++) {
            iq4_floats(p + 8 + 16 * j, table, w);
            for (int g = 0; g < 2 * GROUP; g++)
                put(o32, o16, b * 256 + 32 * j + g * LANES, vec_mul(w[g], vec_set1(ds[j])));
        }
    }
}
