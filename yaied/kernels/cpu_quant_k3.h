/* The vector bodies of Q3_K and Q2_K (further down), included by cpu_quant.c inside its AVX2
 * section after cpu_quant_k.h, whose helpers they share (vec, widen_s8_32, dot16, put...).
 * Q3_K is 110 bytes / 256 weights: hmask[32], qs[64], 12 bytes of sixteen 6-bit scales, fp16 d.
 * Weight 32 j + i (j < 4, i < 32) of each 128 (the half h) has its low two bits in bits 2 j and
 * 2 j + 1 of qs[32 h + i] and its high bit in bit 4 h + j of hmask[i]; q = low + 4 high - 4,
 * w = d (sc_s - 32) q for its 16-weight group s. The bodies are Q6_K's (cpu_quant_k.h): 16
 * scales a super-block, each 32 quants made int8 in a register, the -4 taken in the integers
 * (fp32 bodies) or with the bf16 bias (132 = 128 + 4), nothing through the activations' sums. */

#define Q3K_BYTES 110

/* A Q3_K super-block's lines (110 bytes at p): two prefetches 64 bytes apart; a third line that
 * the block may touch is the next block's first, which that block's first prefetch asks for. */
static inline void prefetch_q3k(const uint8_t *p) {
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
}

/* bit `from` of each byte of v at bit `to`, with 16-bit shifts (what crosses into a byte from
 * its neighbour lands off bit `to`, for the caller's mask to drop) */
static inline __m256i bit_moved(__m256i v, int from, int to) {
    if (from > to) return _mm256_srli_epi16(v, from - to);
    if (from < to) return _mm256_slli_epi16(v, to - from);
    return v;
}

/* Half h of the super-block at p (128 weights) as four vectors of 32 int8 quants (q, -4..3) in
 * the weights' order: each 32's low pairs shifted down from the half's 32 bytes of qs, its high
 * bits moved to bit 2 from hmask, both masked. */
static inline void q3k_quants(const uint8_t *p, int h, __m256i *part) {
    const __m256i low2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
    const __m256i hmask = _mm256_loadu_si256((const __m256i *)p);
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h));
    for (int j = 0; j < 4; j++) {
        __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), low2);
        __m256i high = _mm256_and_si256(bit_moved(hmask, 4 * h + j, 2), bit2);
        part[j] = _mm256_sub_epi8(_mm256_or_si256(low, high), bit2); /* - 4 */
    }
}

/* Its 16 scales d (sc_s - 32) into ds[16], each exact in fp32 (11 by 6 significant bits) */
static inline void q3k_scales(const uint8_t *p, float *ds) {
    uint8_t sc[16];
    q3k_scale_bytes(p + 96, sc);
#if defined(__AVX512F__)
    __m512i s = _mm512_sub_epi32(_mm512_cvtepu8_epi32(LOAD16(sc)), _mm512_set1_epi32(32));
    __m512 d = _mm512_set1_ps(half_to_float(p + 108));
    _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_cvtepi32_ps(s), d));
#else
    __m256 d = _mm256_set1_ps(half_to_float(p + 108));
    for (int g = 0; g < 2; g++) {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)(sc + 8 * g));
        __m256i s = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(32));
        _mm256_storeu_ps(ds + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(s), d));
    }
#endif
}

/* fp32 activations: as fdot_q6_k, each 32 quants widened from a register, dotted with their
 * activations and each 16's sum scaled once; even and odd groups in two accumulators.
 * blocks: super-blocks of 256. */
static __attribute__((noinline)) float fdot_q3_k(const uint8_t *row, const float *x,
                                                 int64_t blocks) {
    vec even = vec_zero(), odd = vec_zero(), w[2 * GROUP];
    __m256i part[4];
    float ds[16];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q3K_BYTES;
        prefetch_q3k(p + PREFETCH_AHEAD);
        q3k_scales(p, ds);
        for (int h = 0; h < 2; h++) {
            q3k_quants(p, h, part);
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
/* bit `from` of each word of v at bit `to` (words: zero-extended bytes, nothing crosses) */
static inline __m512i bit_moved_words(__m512i v, int from, int to) {
    if (from > to) return _mm512_srli_epi16(v, from - to);
    if (from < to) return _mm512_slli_epi16(v, to - from);
    return v;
}

/* bf16 activations: as fdot_q6_k_bf16, each quant exact as the bf16 128 + (q + 4) (3 bits), the
 * 132 taken off through the pairs' accumulators (permute_blocks), one vdpbf16ps per 32 weights
 * in their order, each 32's two scales one permute of the super-block's 16. */
static __attribute__((noinline)) float fdot_q3_k_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, int64_t blocks) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    const __m512i low2 = _mm512_set1_epi16(3), bit2 = _mm512_set1_epi16(4);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    uint8_t sc[16];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q3K_BYTES;
        prefetch_q3k(p + PREFETCH_AHEAD);
        q3k_scale_bytes(p + 96, sc);
        __m512i s = _mm512_sub_epi32(_mm512_cvtepu8_epi32(LOAD16(sc)), _mm512_set1_epi32(32));
        __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(s), half_in_lanes(p + 108));
        __m512i hw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
        for (int h = 0; h < 2; h++) {
            __m512i qw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32) + h));
            for (int j = 0; j < 4; j++) {
                /* (a & b) | c is the ternary-logic table 0xEA: the high bit with the bias, then
                 * the low pair into it */
                __m512i top = _mm512_ternarylogic_epi32(bit_moved_words(hw, 4 * h + j, 2), bit2,
                                                        bias, 0xEA);
                __m512i w = _mm512_ternarylogic_epi32(_mm512_srli_epi16(qw, 2 * j), low2, top,
                                                      0xEA);
                int64_t chunk = 8 * b + 4 * h + j; /* the row's 32-weight run */
                __m512 t = _mm512_dpbf16_ps(_mm512_loadu_ps(pairs + chunk * (QK / 2)), (__m512bh)w,
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

/* Unpacked (unpack_k_*), as q6_k_unpacked: each weight d (sc_s - 32) times q, one exact product */
static inline __attribute__((always_inline)) void q3_k_unpacked(const uint8_t *row, float *o32,
                                                                uint16_t *o16, int64_t blocks) {
    float ds[16];
    __m256i part[4];
    vec w[2 * GROUP];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q3K_BYTES;
        q3k_scales(p, ds);
        for (int h = 0; h < 2; h++) {
            q3k_quants(p, h, part);
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

/* ---- Q2_K: 84 bytes / 256 weights: 16 bytes of 4-bit scales (low nibbles) and mins (high
 * nibbles), one of each per 16 weights, then 64 bytes of quants laid out as Q3_K's low pairs
 * (q 0..3, no high bit), then fp16 d and dmin; w = d sc_s q - dmin m_s. Q3_K's bodies without the
 * high bits, with Q4_K's offsets: the mins through the activations' sums of each 16 weights
 * (qlinear's xsum for this type, sum_size), or at avx512_bf16 through the pairs. ---- */
#define Q2K_BYTES 84

/* two lines, as prefetch_q3k: 84 bytes touch a third only where the next block starts */
static inline void prefetch_q2k(const uint8_t *p) {
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
}

/* Half h of the super-block at p as four vectors of 32 quants (0..3) in the weights' order */
static inline void q2k_quants(const uint8_t *p, int h, __m256i *part) {
    const __m256i low2 = _mm256_set1_epi8(3);
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * h));
    for (int j = 0; j < 4; j++) part[j] = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), low2);
}

/* Its 16 d sc_s into ds[16] and 16 -dmin m_s into mins[16], each exact in fp32 */
static inline void q2k_scales(const uint8_t *p, float *ds, float *mins) {
    const __m128i low4 = _mm_set1_epi8(15), bytes = LOAD16(p);
    __m128i sc = _mm_and_si128(bytes, low4), m = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    float d = half_to_float(p + 80), dmin = -half_to_float(p + 82); /* the negation exact */
#if defined(__AVX512F__)
    _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)),
                                       _mm512_set1_ps(d)));
    _mm512_storeu_ps(mins, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)),
                                         _mm512_set1_ps(dmin)));
#else
    for (int g = 0; g < 2; g++) {
        __m128i sc8 = g ? _mm_unpackhi_epi64(sc, sc) : sc, m8 = g ? _mm_unpackhi_epi64(m, m) : m;
        __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8));
        __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8));
        _mm256_storeu_ps(ds + 8 * g, _mm256_mul_ps(scf, _mm256_set1_ps(d)));
        _mm256_storeu_ps(mins + 8 * g, _mm256_mul_ps(mf, _mm256_set1_ps(dmin)));
    }
#endif
}

/* fp32 activations: fdot_q3_k's loop over Q2_K's quants, and each super-block's 16 mins times
 * the activations' 16-weight sums (sums[16 b + s]) into a third accumulator. */
static __attribute__((noinline)) float fdot_q2_k(const uint8_t *row, const float *x,
                                                 const float *sums, int64_t blocks) {
    vec even = vec_zero(), odd = vec_zero(), offsets = vec_zero(), w[2 * GROUP];
    __m256i part[4];
    float ds[16], mins[16];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q2K_BYTES;
        prefetch_q2k(p + PREFETCH_AHEAD);
        q2k_scales(p, ds, mins);
        for (int g = 0; g < 16 / LANES; g++)
            offsets = vec_fma(vec_load(mins + g * LANES), vec_load(sums + 16 * b + g * LANES),
                              offsets);
        for (int h = 0; h < 2; h++) {
            q2k_quants(p, h, part);
            for (int j = 0; j < 4; j++) {
                int s = 8 * h + 2 * j; /* the first 16's group */
                const float *xs = x + b * 256 + 16 * s;
                widen_s8_32(part[j], w);
                even = vec_fma(dot16(w, xs, vec_zero()), vec_set1(ds[s]), even);
                odd = vec_fma(dot16(w + GROUP, xs + 16, vec_zero()), vec_set1(ds[s + 1]), odd);
            }
        }
    }
    return vec_sum(vec_add(vec_add(even, odd), offsets));
}

#if defined(__AVX512BF16__)
/* bf16 activations: each quant the bf16 128 + q, the 128 off through the pairs (permute_blocks'
 * bias), each 32's two scales one permute of the 16 as in fdot_q3_k_bf16; the mins through the
 * same pairs, lane i of a 32 holding -128 (x[2 i] + x[2 i + 1]): dmin m_s / 128 times those is
 * -dmin m_s times the pair's sum, the division by a power of two exact (min_through_pairs). */
static __attribute__((noinline)) float fdot_q2_k_bf16(const uint8_t *row, const uint16_t *x,
                                                      const float *pairs, int64_t blocks) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    const __m512i low2 = _mm512_set1_epi16(3), bias = _mm512_set1_epi16(0x4300);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q2K_BYTES;
        prefetch_q2k(p + PREFETCH_AHEAD);
        __m512i bytes = _mm512_cvtepu8_epi32(LOAD16(p));
        __m512i sc = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
        __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), half_in_lanes(p + 80));
        __m512 dmin = _mm512_mul_ps(half_in_lanes(p + 82), _mm512_set1_ps(1.0f / 128));
        __m512 lows = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), dmin);
        for (int h = 0; h < 2; h++) {
            __m512i qw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 16) + h));
            for (int j = 0; j < 4; j++) {
                /* (a & b) | c, the ternary-logic table 0xEA: each low pair with the bias */
                __m512i w = _mm512_ternarylogic_epi32(_mm512_srli_epi16(qw, 2 * j), low2, bias,
                                                      0xEA);
                int64_t chunk = 8 * b + 4 * h + j; /* the row's 32-weight run */
                __m512 pair = _mm512_loadu_ps(pairs + chunk * (QK / 2));
                __m512 t = _mm512_dpbf16_ps(pair, (__m512bh)w,
                                            (__m512bh)_mm512_loadu_si512(x + chunk * QK));
                __m512i index = _mm512_add_epi32(halves, _mm512_set1_epi32(2 * (4 * h + j)));
                mins = _mm512_fmadd_ps(_mm512_permutexvar_ps(index, lows), pair, mins);
                if (j & 1)
                    odd = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(index, scales), odd);
                else
                    even = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(index, scales), even);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even, odd), mins));
}
#endif

/* Unpacked: d sc_s q (exact) plus -dmin m_s in one fused multiply-add, the plain loop's one
 * rounding */
static inline __attribute__((always_inline)) void q2_k_unpacked(const uint8_t *row, float *o32,
                                                                uint16_t *o16, int64_t blocks) {
    float ds[16], mins[16];
    __m256i part[4];
    vec w[2 * GROUP];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = row + b * Q2K_BYTES;
        q2k_scales(p, ds, mins);
        for (int h = 0; h < 2; h++) {
            q2k_quants(p, h, part);
            for (int j = 0; j < 4; j++) {
                int s = 8 * h + 2 * j; /* the first 16's scale and min */
                int64_t at = b * 256 + 128 * h + 32 * j;
                widen_s8_32(part[j], w);
                for (int g = 0; g < GROUP; g++) {
                    put(o32, o16, at + g * LANES,
                        vec_fma(w[g], vec_set1(ds[s]), vec_set1(mins[s])));
                    put(o32, o16, at + 16 + g * LANES,
                        vec_fma(w[GROUP + g], vec_set1(ds[s + 1]), vec_set1(mins[s + 1])));
                }
            }
        }
    }
}
