/* The AMX bodies of cpu_paged_prefill.c, which includes this header after its shared parts
 * (Problem, transpose16, exp2_nonpositive_v) and before pack_block and attend_item, the callers.
 * Two bodies:
 *   - any head dim that is a multiple of 64: scores_amx and accumulate_amx, called per key block by
 *     attend_item with the bf16-dot path's packing and softmax;
 *   - head dim 64 (SmolLM2's, Llama 3.2 1B's): attend_rows_amx64, transposed (each query tile
 *     the columns of every product), over pack_block_amx64's layout.
 * Not a header for other files: its functions are static and read cpu_paged_prefill.c's
 * definitions. */
#ifndef YAIED_CPU_PAGED_PREFILL_AMX_H
#define YAIED_CPU_PAGED_PREFILL_AMX_H

#if HAVE_AMX
/* Every tile is configured 16 rows x 64 bytes: A tiles hold 16 rows of 32 bf16, B tiles 16 rows
 * of 16 bf16 pairs, C tiles 16 x 16 fp32. Rows are padded to 16 (AMX_ROWS) on this path. */
#define AMX_ROWS 16
#define LAZY_RESCALE 8.0f /* attend_rows_amx64: factor 256 */
static const uint8_t TILE_ROWS[8] = {16, 16, 16, 16, 16, 16, 16, 16};

/* Raw S[rows][KEY_BLOCK] = Q Kp^T, 16 rows at a time: C tiles 0-1 (keys 0-15, 16-31), the Q
 * tile 2, the K tiles 4-5, each loaded once per 32 dims. */
static void scores_amx(const uint16_t *q, const uint32_t *kp, float *s, int64_t rows,
                       int64_t dim) {
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k0 = 0; k0 < dim; k0 += 32) {
            const uint32_t *kb = kp + (k0 / 2) * KEY_BLOCK;
            _tile_loadd(2, q + m0 * dim + k0, dim * 2);
            _tile_loadd(4, kb, KEY_BLOCK * 4);
            _tile_loadd(5, kb + 16, KEY_BLOCK * 4);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
        }
        _tile_stored(0, s + m0 * KEY_BLOCK, KEY_BLOCK * 4);
        _tile_stored(1, s + m0 * KEY_BLOCK + 16, KEY_BLOCK * 4);
    }
}

/* o[m] *= alpha[m] for rows [m_begin, m_end), in registers; a row whose alpha is 1 is left. */
static void rescale_rows(float *o, const float *alpha, int64_t m_begin, int64_t m_end,
                         int64_t dim) {
    for (int64_t m = m_begin; m < m_end; m++) {
        if (alpha[m] == 1.0f) continue;
        __m512 a = _mm512_set1_ps(alpha[m]);
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o + m * dim + d, _mm512_mul_ps(_mm512_loadu_ps(o + m * dim + d), a));
    }
}

/* o = o * alpha + P Vp: o is scaled in registers first, then each 16 x 16 block of it passes
 * through a C tile (4-7) with the P tile (0) against a V tile (1-3). */
static void accumulate_amx(const uint16_t *p, const uint32_t *vp, float *o, const float *alpha,
                           int64_t rows, int64_t dim) {
    rescale_rows(o, alpha, 0, rows, dim);
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        _tile_loadd(0, p + m0 * KEY_BLOCK, KEY_BLOCK * 2);
        for (int64_t d0 = 0; d0 < dim; d0 += 64) { /* dim is a multiple of 64 on this path */
            float *ob = o + m0 * dim + d0;
            /* three V tiles in turn, so a load need not wait for the product reading its tile */
            _tile_loadd(1, vp + d0, dim * 4);
            _tile_loadd(2, vp + d0 + 16, dim * 4);
            _tile_loadd(3, vp + d0 + 32, dim * 4);
            _tile_loadd(4, ob, dim * 4);
            _tile_loadd(5, ob + 16, dim * 4);
            _tile_loadd(6, ob + 32, dim * 4);
            _tile_loadd(7, ob + 48, dim * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, vp + d0 + 48, dim * 4);
            _tile_dpbf16ps(7, 0, 1);
            _tile_stored(4, ob, dim * 4);
            _tile_stored(5, ob + 16, dim * 4);
            _tile_stored(6, ob + 32, dim * 4);
            _tile_stored(7, ob + 48, dim * 4);
        }
    }
}

/* Head dim 64 on AMX (attend_rows_amx64): K's rows as they are, [KEY_BLOCK][64], and V
 * transposed, [64][KEY_BLOCK / 2] pairs of keys: word 2j of row d is key 2j's dimension d. V's
 * rows are interleaved two keys at a time, as above, and each 16 x 16 block of those pairs is
 * transposed in registers. */
static void pack_block_amx64(const Problem *pr, int64_t h, int64_t b, uint16_t *kr,
                             uint32_t *vt) {
    static const uint16_t zeros[64];
    const uint16_t *v_rows[KEY_BLOCK];
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        int64_t pos = b * KEY_BLOCK + j;
        if (pos >= pr->context_len) {
            memset(kr + j * 64, 0, 128);
            v_rows[j] = zeros;
            continue;
        }
        int64_t row = h * pr->head_stride +
                      (pr->pages[pos / pr->page_size] * pr->page_size + pos % pr->page_size) * 64;
        memcpy(kr + j * 64, (const uint16_t *)pr->k_cache + row, 128);
        v_rows[j] = (const uint16_t *)pr->v_cache + row;
    }
    /* word d of the even key then of the odd one, for d in [16c, 16c + 16) of a 32-word half */
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                         8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int c = 0; c < 4; c++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
            __m512i even = _mm512_loadu_si512(v_rows[2 * j] + (c / 2) * 32);
            __m512i odd = _mm512_loadu_si512(v_rows[2 * j + 1] + (c / 2) * 32);
            r[j] = _mm512_permutex2var_epi16(even, c % 2 ? high : low, odd);
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(vt + (16 * c + i) * 16, r[i]);
    }
}

/* 2^x on 16 lanes for the transposed body's probabilities, which are rounded to bf16 (8
 * significant bits): a degree-4 polynomial for 2^f (relative error 3e-6, a thousandth of that
 * rounding). The rescale factor alpha, which is not rounded, keeps exp2_nonpositive_v's degree
 * 6. f = x - floor(x) is one vreduceps, and vscalefps floors its exponent operand itself, so x
 * goes in whole: the bits of floor, subtract and scale by floor, one instruction fewer (3-5% of
 * the kernel at turn 8's shape). Lanes with x below about -126 come out 0 or subnormal, as they
 * should; no clamp, as the lanes that could hold garbage (keys a row does not see) are masked
 * off after. */
static inline __m512 exp2_probability_v(__m512 x) {
    __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.3426623e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2242573e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4128015e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304484e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

/* Raw S^T [KEY_BLOCK][16] of one block for the tile's 16 rows: K's rows (A, tile 6) against Q^T's
 * pairs (B, tile 7), keys 0-15 into C tile 4 and 16-31 into 5, 32 dimensions at a time. */
static inline void scores_t_amx64(const uint16_t *kr, const uint32_t *qt, float *s) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(7, qt, 64);
    _tile_loadd(6, kr, 128);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kr + 16 * 64, 128);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(7, qt + 256, 64);
    _tile_loadd(6, kr + 32, 128);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kr + 16 * 64 + 32, 128);
    _tile_dpbf16ps(5, 6, 7);
    _tile_stored(4, s, 64);
    _tile_stored(5, s + 256, 64);
}

/* O^T (C tiles 0-3, 16 dimensions each) += V^T (A, tile 6) P^T (B, tile 7) of one block. */
static inline void accumulate_t_amx64(const uint32_t *pt, const uint32_t *vt) {
    _tile_loadd(7, pt, 64);
    _tile_loadd(6, vt, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, vt + 256, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(6, vt + 512, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, vt + 768, 64);
    _tile_dpbf16ps(3, 6, 7);
}

/* Head dim 64 (SmolLM2's, Llama 3.2 1B's) on AMX, transposed: a tile of 16 query rows is the
 * columns of every product, S^T = K Q^T and O^T += V^T P^T, so each vector of a score tile is
 * one key's scores across the 16 rows. The online softmax is then element-wise across vectors:
 * no horizontal maximum or sum and no per-row scalar work; P^T's bf16 pairs of keys are the B
 * tile as they come out of the conversion. O^T stays in C tiles 0-3 over all the tile's key
 * blocks and goes through memory only where a row's reference maximum moved (see
 * LAZY_RESCALE below: rare after the first blocks). Scores and probabilities pass between the tiles and the vectors through memory, and a
 * load right after the store it reads waits for that store to drain: so block b + 1's scores are
 * computed before block b's softmax, and block b's products run after block b + 1's softmax,
 * each from its own buffer; O's arithmetic keeps its order (O times block b's alpha, then plus
 * block b's products). The tile stops at the last block its own rows see; a row's keys past its
 * position get probability 0 and change none of its bits, so a row's result does not depend on
 * the rows beside it. */
static void attend_rows_amx64(const Problem *pr, int64_t h, const uint16_t *q, float *scratch,
                              float *o, float *row_sum, int64_t rows, int64_t real_rows,
                              int64_t first_pos) {
    const __m512 unit = _mm512_set1_ps(pr->scale * 1.44269504088896341f);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
    /* words 0-15 are the even key's 16 rows, 16-31 the odd key's: interleave them in pairs */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bf16 1.0 */
    float *s_bufs = scratch;                 /* S^T [2][KEY_BLOCK][16], by block parity */
    uint32_t *p_bufs = (uint32_t *)(s_bufs + 1024); /* P^T [2][KEY_BLOCK / 2][16] pairs */
    uint32_t *qt = p_bufs + 512;             /* Q^T [2][16][16] pairs, dims 0-31 and 32-63 */
    float *ot = (float *)(qt + 512);         /* O^T [64][16] */
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        int32_t row_pos[AMX_ROWS];
        for (int m = 0; m < AMX_ROWS; m++) {
            int64_t row = m0 + m < real_rows ? m0 + m : real_rows - 1;
            row_pos[m] = (int32_t)(first_pos + row / pr->group);
        }
        const __m512i pos = _mm512_loadu_si512(row_pos);
        int64_t low_pos = row_pos[0], blocks = row_pos[AMX_ROWS - 1] / KEY_BLOCK + 1;
        for (int half = 0; half < 2; half++) {
            __m512i r[16];
            for (int m = 0; m < 16; m++) r[m] = _mm512_loadu_si512(q + (m0 + m) * 64 + half * 32);
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(qt + (half * 16 + i) * 16, r[i]);
        }
        __m512 row_max = minus_inf, sum = _mm512_setzero_ps();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        scores_t_amx64((const uint16_t *)(pr->packed + h * pr->key_blocks * 2 * pr->block_bytes),
                       qt, s_bufs);
        for (int64_t b = 0; b < blocks; b++) {
            const char *kb = pr->packed + (h * pr->key_blocks + b) * 2 * pr->block_bytes;
            if (b + 1 < blocks)
                scores_t_amx64((const uint16_t *)(kb + 2 * pr->block_bytes), qt,
                               s_bufs + ((b + 1) & 1) * 512);
            const float *s = s_bufs + (b & 1) * 512;
            uint32_t *pt = p_bufs + (b & 1) * 256;
            /* keys [key0, key0 + KEY_BLOCK); a row sees those at or before its position */
            int64_t key0 = b * KEY_BLOCK;
            int all_seen = key0 + KEY_BLOCK - 1 <= low_pos;
            /* the maximum of the raw scores: scaling by a positive unit keeps the order */
            __m512 block_max = minus_inf;
            for (int k = 0; k < KEY_BLOCK; k++) {
                __m512 x = _mm512_load_ps(s + k * 16);
                __mmask16 seen = all_seen ? 0xFFFF
                                          : _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(
                                                                             (int)(key0 + k)));
                block_max = _mm512_mask_max_ps(block_max, seen, block_max, x);
            }
            /* A row keeps its reference maximum until a score passes it by more than
             * LAZY_RESCALE (log2 units): its probabilities may then reach 2^LAZY_RESCALE, which
             * fp32 sums and bf16 hold as precisely as any other, and O is rescaled far less
             * often (a tile rescales when any of its 16 rows moves, on noisy scores nearly
             * every block). The result is the same to rounding: one reference for the row's
             * probabilities and its sum. exp(0) is 1 exactly; a row's first block finds O zero
             * (alpha 0). */
            __mmask16 started = _mm512_cmp_ps_mask(row_max, minus_inf, _CMP_NEQ_OQ);
            __m512 scaled_max = _mm512_mul_ps(block_max, unit);
            __mmask16 grows = ~started | _mm512_cmp_ps_mask(
                scaled_max, _mm512_add_ps(row_max, _mm512_set1_ps(LAZY_RESCALE)), _CMP_GT_OQ);
            __m512 new_max = _mm512_mask_max_ps(row_max, grows, row_max, scaled_max);
            __m512 alpha =
                _mm512_maskz_mov_ps(started, exp2_nonpositive_v(_mm512_sub_ps(row_max, new_max)));
            __m512 block_sum = _mm512_setzero_ps();
            for (int j = 0; j < KEY_BLOCK / 2; j++) {
                int64_t k = 2 * j;
                __m512 x0 = _mm512_fmsub_ps(_mm512_load_ps(s + k * 16), unit, new_max);
                __m512 x1 = _mm512_fmsub_ps(_mm512_load_ps(s + (k + 1) * 16), unit, new_max);
                __mmask16 seen0 = 0xFFFF, seen1 = 0xFFFF;
                if (!all_seen) {
                    seen0 = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)(key0 + k)));
                    seen1 = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)(key0 + k + 1)));
                }
                __m512 e0 = _mm512_maskz_mov_ps(seen0, exp2_probability_v(x0));
                __m512 e1 = _mm512_maskz_mov_ps(seen1, exp2_probability_v(x1));
                __m512i pair = _mm512_permutexvar_epi16(
                    pairs, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                _mm512_store_si512(pt + j * 16, pair);
                /* the sums add the rounded probabilities, the values the products use: a pair
                 * dotted with (1, 1) */
                block_sum = _mm512_dpbf16_ps(block_sum, (__m512bh)pair, ones);
            }
            sum = _mm512_fmadd_ps(sum, alpha, block_sum);
            row_max = new_max;
            if (b == 0) continue; /* O is zero */
            accumulate_t_amx64(p_bufs + ((b - 1) & 1) * 256,
                               (const uint32_t *)(kb - pr->block_bytes));
            if (_mm512_cmp_ps_mask(alpha, one, _CMP_NEQ_UQ)) {
                _tile_stored(0, ot, 64);
                _tile_stored(1, ot + 256, 64);
                _tile_stored(2, ot + 512, 64);
                _tile_stored(3, ot + 768, 64);
                for (int d = 0; d < 64; d++)
                    _mm512_store_ps(ot + d * 16, _mm512_mul_ps(_mm512_load_ps(ot + d * 16), alpha));
                _tile_loadd(0, ot, 64);
                _tile_loadd(1, ot + 256, 64);
                _tile_loadd(2, ot + 512, 64);
                _tile_loadd(3, ot + 768, 64);
            }
        }
        const char *last = pr->packed + (h * pr->key_blocks + blocks - 1) * 2 * pr->block_bytes;
        accumulate_t_amx64(p_bufs + ((blocks - 1) & 1) * 256,
                           (const uint32_t *)(last + pr->block_bytes));
        _tile_stored(0, ot, 64);
        _tile_stored(1, ot + 256, 64);
        _tile_stored(2, ot + 512, 64);
        _tile_stored(3, ot + 768, 64);
        /* back to rows: O[m][d] for the shared epilogue */
        for (int c = 0; c < 4; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(ot + (16 * c + i) * 16);
            transpose16(r);
            for (int m = 0; m < 16; m++) _mm512_storeu_si512(o + (m0 + m) * 64 + 16 * c, r[m]);
        }
        _mm512_storeu_ps(row_sum + m0, sum);
    }
}
#endif

#endif
