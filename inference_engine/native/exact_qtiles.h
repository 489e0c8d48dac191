/*
 * exact_qtiles.h: the quantized-weight column loop, instantiated once per instruction set.
 *
 * Included by exact_gemm.c after exact_tiles.h, with QV(name) (the variant's suffix), QTARGET
 * (its target attribute), STEP (exact_dot.h's fma_step, or its one instruction), WIDEN_U8 /
 * WIDEN_S8 (8 bytes -> 8 int32 lanes), HALVES(p, &a, &b) (the fp16 at p and p + 2 as floats in
 * every lane of a and b) and Q4_1_GROUP(d, m, q) (ggml_blocks.h's
 * q4_1_group, or one fused multiply-add giving its very bits) defined. Only these differ between
 * variants (GCC's vector extensions scalarize the moves; AVX2 gets vpmovzxbd/vpmovsxbd and
 * F16C's vcvtph2ps); they are exact either way (every fp16 is a float), and every other
 * floating-point operation is the shared code of ggml_blocks.h and exact_dot.h (STEP: fma_step).
 */

/* Software prefetch of the next tile's weight rows (the `cols` rows after this tile's, which
 * are contiguous with them), swept at the pace this tile is read: at block b, `lines` cache
 * lines from b * cols * bytes on. A tile's rows are short (360 to 960 bytes), too short for
 * the hardware prefetcher to ramp up on each; with this sweep the next tile is in cache when
 * it starts (measured single-thread, M = 1: 27 -> 16 ms per step's products, the Q8_0 head
 * 10.5 -> 3.5 ms). It reads nothing the arithmetic uses: the bits cannot change. Past the last
 * tile it names addresses beyond the weights; a prefetch never faults (x86 and ARM alike). */
QTARGET INLINE void QV(prefetch_next)(const uint8_t *w, int cols, size_t ldq, int b, int bytes, int lines) {
    const uint8_t *p = w + (size_t)cols * ldq + (size_t)b * cols * bytes;
    for (int l = 0; l < lines; ++l) /* lines: a constant after inlining */
        __builtin_prefetch(p + 64 * l);
}

/* One GGUF block's 32 weights as 4 vectors, dequantized as the converter did. */
QTARGET INLINE void QV(block)(int fmt, const uint8_t *blk, v8 w[4]) {
    v8 d, m;
    HALVES(blk, &d, &m); /* Q8_0: m is the first two int8s, unused */
    if (fmt == GGML_Q4_1) { /* weight i < 16: low nibble of byte i; 16 + i: its high nibble */
        v8i lo = WIDEN_U8(blk + Q4_1_NIBBLES), hi = WIDEN_U8(blk + Q4_1_NIBBLES + 8);
        w[0] = Q4_1_GROUP(d, m, lo & 15);
        w[1] = Q4_1_GROUP(d, m, hi & 15);
        w[2] = Q4_1_GROUP(d, m, lo >> 4);
        w[3] = Q4_1_GROUP(d, m, hi >> 4);
    } else {
        const uint8_t *q = blk + Q8_0_INTS;
        v8i ints[4] = {WIDEN_S8(q), WIDEN_S8(q + 8), WIDEN_S8(q + 16), WIDEN_S8(q + 24)};
        q8_0_weights(d, ints, w);
    }
}

/* Weights 8g .. 8g + 7 (g < 4) of the block at blk, given its d and m (HALVES): the very
 * operations QV(block) does for its w[g], so the same bits. */
QTARGET INLINE v8 QV(group)(int fmt, const uint8_t *blk, v8 d, v8 m, int g) {
    if (fmt == GGML_Q4_1) {
        v8i q = WIDEN_U8(blk + Q4_1_NIBBLES + 8 * (g & 1)); /* g 0, 2: bytes 0..7; g 1, 3: 8..15 */
        return Q4_1_GROUP(d, m, g < 2 ? q & 15 : q >> 4);
    }
    return q8_0_group(d, WIDEN_S8(blk + Q8_0_INTS + 8 * g));
}

/* `rows` (<= 4; up to 8 when `cols` is 1) rows of A from i0 x `cols` (<= 2) quantized weight
 * rows from n0, full K: each group of 8 weights is dequantized once, in a register, and feeds
 * every row. acc[r][c] still takes lane j: k = j, j+8, ... increasing, from zero, then hsum8:
 * tile_nt's element on the dequantized rows, bit for bit (alpha 1, beta 0, as run_q_fmt's fp32
 * tiles had). */
QTARGET INLINE void QV(qtile_m)(const struct job *j, int i0, int rows, int n0, int cols, int fmt) {
    enum { R = 8, C = 2 }; /* at most 8 accumulators are live: rows x cols <= 8 */
    const int bytes = ggml_block_bytes(fmt), blocks = j->k / GGML_QK;
    const uint8_t *w = j->q + (size_t)n0 * j->ldq;
    const float *a = j->a + (size_t)i0 * j->lda;
    v8 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
            acc[r][c] = (v8){0};
    for (int b = 0; b < blocks; ++b) {
        const uint8_t *blk[C];
        v8 d[C], m[C];
#pragma GCC unroll 4
        for (int c = 0; c < cols; ++c) { /* rows, cols: constants after inlining */
            blk[c] = w + c * j->ldq + (size_t)b * bytes;
            HALVES(blk[c], &d[c], &m[c]);
        }
        if (i0 == 0) /* the first row group fetches the next tile's weights (qtile_1's sweep) */
            QV(prefetch_next)(w, cols, j->ldq, b, bytes, 2);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
            v8 wv[C];
#pragma GCC unroll 4
            for (int c = 0; c < cols; ++c)
                wv[c] = QV(group)(fmt, blk[c], d[c], m[c], g);
#pragma GCC unroll 8
            for (int r = 0; r < rows; ++r) {
                v8 x = load8(a + r * j->lda + GGML_QK * b + 8 * g);
#pragma GCC unroll 4
                for (int c = 0; c < cols; ++c)
                    acc[r][c] = STEP(acc[r][c], x, wv[c]);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
            j->c[(size_t)(i0 + r) * j->ldc + n0 + c] = hsum8(acc[r][c]);
}

/* The tile of `rows` x `cols` at (i, n): up to 4 x 2, or 5..8 x 1; each shape its own inlined copy. */
QTARGET INLINE void QV(qtile)(const struct job *j, int rows, int cols, int i, int n, int fmt) {
    switch (rows * 4 + cols) {
    case 5: QV(qtile_m)(j, i, 1, n, 1, fmt); break;
    case 6: QV(qtile_m)(j, i, 1, n, 2, fmt); break;
    case 9: QV(qtile_m)(j, i, 2, n, 1, fmt); break;
    case 10: QV(qtile_m)(j, i, 2, n, 2, fmt); break;
    case 13: QV(qtile_m)(j, i, 3, n, 1, fmt); break;
    case 14: QV(qtile_m)(j, i, 3, n, 2, fmt); break;
    case 17: QV(qtile_m)(j, i, 4, n, 1, fmt); break;
    case 21: QV(qtile_m)(j, i, 5, n, 1, fmt); break;
    case 25: QV(qtile_m)(j, i, 6, n, 1, fmt); break;
    case 29: QV(qtile_m)(j, i, 7, n, 1, fmt); break;
    case 33: QV(qtile_m)(j, i, 8, n, 1, fmt); break;
    case 18: QV(qtile_m)(j, i, 4, n, 2, fmt); break;
    default: abort(); /* no such tile: computing another shape would leave rows unwritten */
    }
}

/* One row of A x `cols` (<= 4) quantized weight rows, full K, each block dequantized in registers and
 * multiplied in the fp32 tiles' order (lane j: k = j, j+8, ... increasing). */
QTARGET INLINE void QV(qtile_1)(const struct job *j, int n0, int cols, int fmt) {
    enum { C = 4 };
    const int bytes = ggml_block_bytes(fmt), blocks = j->k / GGML_QK;
    const uint8_t *w = j->q + (size_t)n0 * j->ldq;
    v8 acc[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
        acc[c] = (v8){0};
    for (int b = 0; b < blocks; ++b) {
        const float *a = j->a + GGML_QK * b;
        v8 x[4] = {load8(a), load8(a + 8), load8(a + 16), load8(a + 24)};
        QV(prefetch_next)(w, cols, j->ldq, b, bytes, 3);
#pragma GCC unroll 4
        for (int c = 0; c < cols; ++c) { /* cols: a constant after inlining */
            v8 wv[4];
            QV(block)(fmt, w + c * j->ldq + (size_t)b * bytes, wv);
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)
                acc[c] = STEP(acc[c], x[g], wv[g]);
        }
    }
    for (int c = 0; c < cols; ++c)
        j->c[n0 + c] = hsum8(acc[c]); /* alpha 1, beta 0: scale_add would be the identity */
}

/* Rows [n0, n1) of W dequantized into `out` (n1 - n0 rows of k floats). */
QTARGET INLINE void QV(dequantize_rows)(const struct job *j, int n0, int n1, float *out, int fmt) {
    const int bytes = ggml_block_bytes(fmt), blocks = j->k / GGML_QK;
    for (int n = n0; n < n1; ++n)
        for (int b = 0; b < blocks; ++b) {
            v8 wv[4];
            QV(block)(fmt, j->q + (size_t)n * j->ldq + (size_t)b * bytes, wv);
            memcpy(out + (size_t)(n - n0) * j->k + GGML_QK * b, wv, sizeof wv);
        }
}

/* Columns [n0, n1) of every row, for one format (a constant after inlining). */
QTARGET INLINE void QV(run_q_fmt)(const struct job *j, int n0, int n1, int fmt) {
    int n = n0;
    if (j->m == 1) {
        for (; n + 4 <= n1; n += 4)
            QV(qtile_1)(j, n, 4, fmt);
        for (; n < n1; ++n)
            QV(qtile_1)(j, n, 1, fmt);
        return;
    }
    if (j->m <= 12) {
        /* Few rows: tiles of 8 accumulators in registers, each weight dequantized once per
         * row group, never stored: 5..8 rows as one 8 x 1 group (each weight dequantized once;
         * M = 6, 8: ~10-15 % faster than two 4 x 2 groups), the rest in 4 x 2 tiles (8
         * accumulators + 2 weight vectors and their d, m fit AVX2's 16 registers; 3 columns
         * spill, measured slower). */
        for (; n < n1; n += 2) {
            int cols = n1 - n < 2 ? n1 - n : 2, i = 0;
            if (j->m >= 5)
                for (int c = 0; c < cols; ++c)
                    QV(qtile)(j, j->m < 8 ? j->m : 8, 1, 0, n + c, fmt);
            for (i = j->m >= 5 ? 8 : 0; i < j->m; i += 4)
                QV(qtile)(j, j->m - i < 4 ? j->m - i : 4, cols, i, n, fmt);
        }
        return;
    }
    /* Many rows: dequantizing per 4-row group would cost more than storing the rows once. */
    float *rows = dequant_scratch(3 * (size_t)j->k);
    for (; n < n1; n += 3) {
        int cols = n1 - n < 3 ? n1 - n : 3;
        QV(dequantize_rows)(j, n, n + cols, rows, fmt);
        /* The fp32 case's own tiles over the dequantized rows: the same per-element code. */
        struct job f = {1, j->m, cols, j->k, 1.0f, 0.0f, j->a, rows, j->c + n, j->lda, (size_t)j->k, j->ldc, 0, NULL, 0};
        for (int i = 0; i < j->m; i += 4)
            QV(tile_nt)(&f, j->m - i < 4 ? j->m - i : 4, cols, i, 0, NULL);
    }
}

QTARGET static void QV(run_q_any)(const struct job *j, int n0, int n1); /* every other type: exact_kqtiles.h */

QTARGET static void QV(run_q)(const struct job *j, int n0, int n1) {
    if (j->fmt == GGML_Q4_1)
        QV(run_q_fmt)(j, n0, n1, GGML_Q4_1);
    else if (j->fmt == GGML_Q8_0)
        QV(run_q_fmt)(j, n0, n1, GGML_Q8_0);
    else
        QV(run_q_any)(j, n0, n1);
}
