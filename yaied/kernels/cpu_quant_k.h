/* The vector bodies of the K types past Q4_K (Q6_K, Q5_K), included by cpu_quant.c inside its
 * AVX2 section, after the helpers they share (vec, widen_s8, dot16, q4k_block_scales,
 * half_in_lanes...). The formats are in cpu_quant.c's header; in short, Q6_K is 210 bytes / 256
 * weights: ql[128], qh[64], int8 scales[16], fp16 d. Weight 32 j + i (j < 4, i < 32) of each 128
 * (ql's 64 bytes and qh's 32 of that half) has its low four bits in ql[i + 32 (j & 1)], the low
 * nibble for j < 2 and the high one after, and its high two bits in bits 2 j and 2 j + 1 of
 * qh[i]; w = d scales[s] (q - 32), s = the weight's 16-weight group in the super-block. Nothing
 * of Q6_K's is offset through the activations' sums: q - 32 is taken in the integers (fp32
 * bodies) or with the bf16 bias. Q5_K is further down, then the unpacking of all three K types
 * (unpack_row's bodies, from the same helpers; cpu_quant.c's unpack_k_* picks one). */

#define Q6K_BYTES 210

/* A Q6_K super-block's four cache lines (210 bytes at p may touch a fifth: the next block's
 * first prefetch covers it). */
static inline void prefetch_q6k(const uint8_t *p) {
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
    __builtin_prefetch(p + 128);
    __builtin_prefetch(p + 192);
}

/* Half h of the super-block at p (128 weights) as four vectors of 32 int8 quants less 32, in the
 * weights' order: the nibbles and the high pairs moved into place with 16-bit shifts (a byte's
 * bits that cross into its neighbour are masked off). */
static inline void q6k_quants(const uint8_t *p, int h, __m256i *part) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    const __m256i bias = _mm256_set1_epi8(32);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    part[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                              _mm256_and_si256(_mm256_slli_epi16(hb, 4), high2));
    part[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                              _mm256_and_si256(_mm256_slli_epi16(hb, 2), high2));
    part[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                              _mm256_and_si256(hb, high2));
    part[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(hb, 2), high2));
    for (int j = 0; j < 4; j++) part[j] = _mm256_sub_epi8(part[j], bias);
}

/* 32 int8 in a register to fp32, in order: 2 GROUPs of vectors (16 weights each), widened from
 * the register rather than stored and widened from the stack as widen_s8 widens a block. */
static inline void widen_s8_32(__m256i v, vec *out) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
#if defined(__AVX512F__)
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
#else
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
#endif
}

/* Its 16 scales times d (each exact in fp32: 11 by 8 significant bits) into ds[16] */
static inline void q6k_scales(const uint8_t *p, float *ds) {
#if defined(__AVX512F__)
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LOAD16(p + 192)));
    _mm512_storeu_ps(ds, _mm512_mul_ps(sc, _mm512_set1_ps(half_to_float(p + 208))));
#else
    __m256 d = _mm256_set1_ps(half_to_float(p + 208));
    for (int g = 0; g < 2; g++) {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)(p + 192 + 8 * g));
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        _mm256_storeu_ps(ds + 8 * g, _mm256_mul_ps(sc, d));
    }
#endif
}

/* fp32 activations: each 32 quants made int8 in a register (q6k_quants), widened to fp32,
 * dotted with their activations and each 16's sum scaled once by d sc_s. Two accumulators,
 * even and odd groups: sixteen scaled sums a super-block in one chain waited on each other's
 * FMA. blocks: super-blocks of 256. */
static __attribute__((noinline)) float fdot_q6_k(const uint8_t *row, const float *x,
                                                 int64_t blocks) {
    vec even = vec_zero(), odd = vec_zero(), w[2 * GROUP];
    __m256i part[4];
    float ds[16];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q6K_BYTES;
        prefetch_q6k(p + PREFETCH_AHEAD);
        q6k_scales(p, ds);
        for (int h = 0; h < 2; h++) {
            q6k_quants(p, h, part);
            for (int j = 0; j < 4; j++) {
                int s = 8 * h + 2 * j; /* the first 16's group */
                const float *xs = x + b * 256 + 16 * s;
                widen_s8_32(part[j], w);
                even = vec_fma(dot16(w, xs, vec_zero()), vec_set1(ds[s]), even);
                odd = vec_fma(dot16(w + GROUP, xs + 16, vec_zero()), vec_set1(ds[s + 1]), odd);
            }
        }
    }
    return vec_sum(vec_add(even, odd));
}

#if defined(__AVX512BF16__)
/* bf16 activations: as fdot_q4_k_bf16, each quant exact as the bf16 128 + q (6 bits fit the 7
 * of the mantissa), the 160 (128 and Q6_K's -32) taken off through the pairs' accumulators
 * (permute_blocks), one vdpbf16ps per 32 weights in their order. Those 32 are two 16-weight
 * groups, lanes 0-7 and 8-15, so each 32's scales are one permute of the super-block's 16. */
static __attribute__((noinline)) float fdot_q6_k_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, int64_t blocks) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi16(0x0F), high2 = _mm512_set1_epi16(0x30);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q6K_BYTES;
        prefetch_q6k(p + PREFETCH_AHEAD);
        __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LOAD16(p + 192))),
                                      half_in_lanes(p + 208));
        for (int h = 0; h < 2; h++) {
            const __m256i *at = (const __m256i *)(p + 64 * h);
            __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(at));
            __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(at + 1));
            __m512i hw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 128) + h));
            /* (a & b) | c is the ternary-logic table 0xEA: each high pair with the bias, then
             * each low nibble into it */
            __m512i w[4] = {
                _mm512_ternarylogic_epi32(
                    l0, low4, _mm512_ternarylogic_epi32(_mm512_slli_epi16(hw, 4), high2, bias, 0xEA),
                    0xEA),
                _mm512_ternarylogic_epi32(
                    l1, low4, _mm512_ternarylogic_epi32(_mm512_slli_epi16(hw, 2), high2, bias, 0xEA),
                    0xEA),
                _mm512_or_si512(_mm512_srli_epi16(l0, 4),
                                _mm512_ternarylogic_epi32(hw, high2, bias, 0xEA)),
                _mm512_or_si512(_mm512_srli_epi16(l1, 4),
                                _mm512_ternarylogic_epi32(_mm512_srli_epi16(hw, 2), high2, bias,
                                                          0xEA)),
            };
            for (int j = 0; j < 4; j++) {
                int64_t chunk = 8 * b + 4 * h + j; /* the row's 32-weight run */
                __m512 t = _mm512_dpbf16_ps(_mm512_loadu_ps(pairs + chunk * (QK / 2)),
                                            (__m512bh)w[j],
                                            (__m512bh)_mm512_loadu_si512(x + chunk * QK));
                __m512i index = _mm512_add_epi32(halves, _mm512_set1_epi32(2 * (4 * h + j)));
                __m512 scale = _mm512_permutexvar_ps(index, scales);
                if (j & 1)
                    odd = _mm512_fmadd_ps(t, scale, odd);
                else
                    even = _mm512_fmadd_ps(t, scale, even);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}
#endif

/* Q5_K: Q4_K's block with 32 bytes of fifth bits after its scales (d, dmin, 12 bytes of scales
 * and mins as Q4_K's, qh[32], then Q4_K's 128 bytes of nibbles): sub-block j's weight i is
 * its nibble plus 16 times bit j of qh[i]; w = d sc_j q - dmin m_j. The bodies are Q4_K's,
 * each nibble topped up with its bit before it is widened (and the mins through the
 * activations' sub-block sums, q4k_block_scales). */
#define Q5K_BYTES 176

/* bit `bit` of each byte of v moved to bit 4 (the value 16), the rest cleared: 16-bit shifts,
 * and what crosses into a byte from its neighbour lands off bit 4 */
static inline __m256i fifth_bits(__m256i v, int bit) {
    if (bit < 4) v = _mm256_slli_epi16(v, 4 - bit);
    if (bit > 4) v = _mm256_srli_epi16(v, bit - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

static __attribute__((noinline)) float fdot_q5_k(const uint8_t *row, const float *x,
                                                 const float *xsum, int64_t blocks) {
    vec acc = vec_zero(), w[2 * GROUP];
    __m256 offsets = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    float ds[8];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q5K_BYTES;
        prefetch_super_block(p + PREFETCH_AHEAD); /* 3 lines, the fourth the next block's */
        q4k_block_scales(p, xsum + 8 * b, ds, &offsets);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
        for (int c = 0; c < 4; c++) {
            __m256i qs = _mm256_loadu_si256((const __m256i *)(p + 48 + 32 * c));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(qs, low4), fifth_bits(qh, 2 * c));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), low4),
                                         fifth_bits(qh, 2 * c + 1));
            const float *xc = x + b * 256 + 64 * c;
            widen_s8_32(lo, w);
            vec t = dot16(w + GROUP, xc + 16, dot16(w, xc, vec_zero()));
            acc = vec_fma(t, vec_set1(ds[2 * c]), acc);
            widen_s8_32(hi, w);
            t = dot16(w + GROUP, xc + 48, dot16(w, xc + 32, vec_zero()));
            acc = vec_fma(t, vec_set1(ds[2 * c + 1]), acc);
        }
    }
    return vec_sum(acc) + sum8(offsets);
}

#if defined(__AVX512BF16__)
/* fifth_bits over words (each a zero-extended byte), with the bf16 bias 0x4300 set:
 * (shifted & 16) | 0x4300 is the ternary-logic table 0xEA */
static inline __m512i fifth_bits_bf16(__m512i words, int bit) {
    if (bit < 4) words = _mm512_slli_epi16(words, 4 - bit);
    if (bit > 4) words = _mm512_srli_epi16(words, bit - 4);
    return _mm512_ternarylogic_epi32(words, _mm512_set1_epi16(16), _mm512_set1_epi16(0x4300),
                                     0xEA);
}

/* Q4_K: each 32 bytes of quants hold two sub-blocks, the low nibbles one, the high the next,
 * both in order: the bytes widened to words once, each half made bf16 (128 + q) by one or two
 * instructions, one vdpbf16ps a sub-block, whose accumulator starts at -128 x the pair sums.
 * Each sub-block's scale d sc_j applies to its sums; the mins, dmin m_j, go through the
 * activations' sub-block sums, eight lanes at a time. blocks: super-blocks of 256. Q5_K (five)
 * the same, each quant 128 + q for q < 32, still exact in bf16: its fifth bits set with the
 * bias. Inlined into each type's body with five a constant. */
static inline __attribute__((always_inline)) float qk_bf16(const uint8_t *row, const uint16_t *x,
                                                           const float *pairs,
                                                           const float *sums, int64_t blocks,
                                                           int five) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    __m256 offsets = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
    const int64_t bytes = five ? Q5K_BYTES : 144, quants = five ? 48 : 16;
    float ds[8];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * bytes;
        prefetch_super_block(p + PREFETCH_AHEAD);
        q4k_block_scales(p, sums + 8 * b, ds, &offsets);
        __asm__ volatile("" ::: "memory"); /* each d sc_j a broadcast load, not a permute */
        __m512i qh = five ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 16)))
                          : _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m256i *q = (const __m256i *)(p + quants + 32 * c);
            __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q));
            __m512i lo_top = five ? fifth_bits_bf16(qh, 2 * c) : bias;
            __m512i hi_top = five ? fifth_bits_bf16(qh, 2 * c + 1) : bias;
            __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, low4, lo_top, 0xEA);
            __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), hi_top);
            int64_t j = 8 * b + 2 * c; /* the low nibbles' sub-block */
            __m512 t0 = _mm512_dpbf16_ps(_mm512_loadu_ps(pairs + j * (QK / 2)), lo,
                                         (__m512bh)_mm512_loadu_si512(x + j * QK));
            __m512 t1 = _mm512_dpbf16_ps(_mm512_loadu_ps(pairs + (j + 1) * (QK / 2)), hi,
                                         (__m512bh)_mm512_loadu_si512(x + (j + 1) * QK));
            even = _mm512_fmadd_ps(t0, _mm512_set1_ps(ds[2 * c]), even);
            odd = _mm512_fmadd_ps(t1, _mm512_set1_ps(ds[2 * c + 1]), odd);
        }
    }
    __m512 both = _mm512_add_ps(even, odd);
    return _mm512_reduce_add_ps(_mm512_add_ps(both, _mm512_zextps256_ps512(offsets)));
}

static __attribute__((noinline)) float fdot_q4_k_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, const float *sums,
                                                      int64_t blocks) {
    return qk_bf16(row, x, pairs, sums, blocks, 0);
}

static __attribute__((noinline)) float fdot_q5_k_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, const float *sums,
                                                      int64_t blocks) {
    return qk_bf16(row, x, pairs, sums, blocks, 1);
}
#endif

/* ---- the K types unpacked (unpack_row, and at avx512_bf16 dequantize_bf16) ----
 * The same weights as dequantize_row's plain loops, bit for bit: d sc_j, dmin m_j and Q6_K's
 * d sc_s are exact in fp32 (at most 11 by 8 significant bits), and so is each quant times
 * its scale, so the one rounding of a fused multiply-add is the plain loop's rounding of
 * d sc_j q - dmin m_j; Q6_K's weights are a plain product, as there. Each 32 quants are widened
 * from registers, as the dot products widen them. A body writes fp32 rows (o32), or, at
 * avx512_bf16, bf16 rows (o16, not NULL) rounded as store_bf16 rounds, straight from the
 * registers: through an fp32 row and store_bf16, a bf16 tile took 1.7-2.8x the fp32 one's time
 * (unpack_k_f32, unpack_k_bf16: each body compiled once per output, the choice a constant). */

/* vector v to weights [at, at + LANES) of the output */
static inline void put(float *o32, uint16_t *o16, int64_t at, vec v) {
#if defined(__AVX512BF16__)
    if (o16) {
        _mm256_storeu_si256((__m256i *)(o16 + at), (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#else
    (void)o16;
#endif
    vec_store(o32 + at, v);
}

/* 32 widened quants (2 GROUP vectors) times scale plus offset to weights [at, at + 32) */
static inline void put_32(float *o32, uint16_t *o16, int64_t at, const vec *w, float scale,
                          float offset) {
    for (int g = 0; g < 2 * GROUP; g++)
        put(o32, o16, at + g * LANES, vec_fma(w[g], vec_set1(scale), vec_set1(offset)));
}

/* Q4_K and Q5_K's eight d sc_j and eight -dmin m_j of the super-block at p */
static inline void q4k_unpack_scales(const uint8_t *p, float *ds, float *offsets) {
    q4k_packed packed = q4k_scales_mins(p + 4);
    __m128i sc = _mm_cvtsi64_si128((long long)packed.scales);
    __m128i m = _mm_cvtsi64_si128((long long)packed.mins);
    __m256 sc8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc));
    __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m));
    _mm256_storeu_ps(ds, _mm256_mul_ps(sc8, _mm256_set1_ps(half_to_float(p))));
    /* -(dmin m): the negation exact, x + (-y) is x - y */
    _mm256_storeu_ps(offsets, _mm256_mul_ps(m8, _mm256_set1_ps(-half_to_float(p + 2))));
}

static inline __attribute__((always_inline)) void q4_k_unpacked(const uint8_t *row, float *o32,
                                                                uint16_t *o16, int64_t blocks) {
    float ds[8], offsets[8];
    vec lo[2 * GROUP], hi[2 * GROUP];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * 144;
        q4k_unpack_scales(p, ds, offsets);
        for (int c = 0; c < 4; c++) { /* 32 bytes: sub-block 2c in the low nibbles, 2c + 1 high */
            const uint8_t *q = p + 16 + 32 * c;
            widen_nibbles(q, lo, hi);
            widen_nibbles(q + 16, lo + GROUP, hi + GROUP);
            int64_t at = b * 256 + 64 * c;
            put_32(o32, o16, at, lo, ds[2 * c], offsets[2 * c]);
            put_32(o32, o16, at + 32, hi, ds[2 * c + 1], offsets[2 * c + 1]);
        }
    }
}

static inline __attribute__((always_inline)) void q5_k_unpacked(const uint8_t *row, float *o32,
                                                                uint16_t *o16, int64_t blocks) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    float ds[8], offsets[8];
    vec w[2 * GROUP];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q5K_BYTES;
        q4k_unpack_scales(p, ds, offsets);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
        for (int c = 0; c < 4; c++) { /* as fdot_q5_k tops up each nibble with its bit */
            __m256i qs = _mm256_loadu_si256((const __m256i *)(p + 48 + 32 * c));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(qs, low4), fifth_bits(qh, 2 * c));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), low4),
                                         fifth_bits(qh, 2 * c + 1));
            int64_t at = b * 256 + 64 * c;
            widen_s8_32(lo, w);
            put_32(o32, o16, at, w, ds[2 * c], offsets[2 * c]);
            widen_s8_32(hi, w);
            put_32(o32, o16, at + 32, w, ds[2 * c + 1], offsets[2 * c + 1]);
        }
    }
}

static inline __attribute__((always_inline)) void q6_k_unpacked(const uint8_t *row, float *o32,
                                                                uint16_t *o16, int64_t blocks) {
    float ds[16];
    __m256i part[4];
    vec w[2 * GROUP];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q6K_BYTES;
        q6k_scales(p, ds);
        for (int h = 0; h < 2; h++) {
            q6k_quants(p, h, part); /* q - 32, in the weights' order */
            for (int j = 0; j < 4; j++) {
                int s = 8 * h + 2 * j; /* the first 16's scale */
                int64_t at = b * 256 + 128 * h + 32 * j;
                widen_s8_32(part[j], w);
                for (int g = 0; g < GROUP; g++) {
                    put(o32, o16, at + g * LANES, vec_mul(w[g], vec_set1(ds[s])));
                    put(o32, o16, at + 16 + g * LANES, vec_mul(w[GROUP + g], vec_set1(ds[s + 1])));
                }
            }
        }
    }
}
