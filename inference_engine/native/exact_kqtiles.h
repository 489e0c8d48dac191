/*
 * exact_kqtiles.h: products over rows of F16, BF16, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks,
 * instantiated once per instruction set like exact_qtiles.h (QV, QTARGET, STEP, WIDEN_U8 and
 * HALVES defined; exact_tiles.h's tile_nt and dequant_scratch in scope). HALVES(p, &a, &b) reads
 * the two fp16 at p and p + 2 into every lane of a and b (exactly: every fp16 is a float); where
 * a block has one fp16 scale the other lane set is simply unused.
 *
 * Each group of 32 weights is dequantized with gguf-py's arithmetic (ggml_kquants.h) into 4
 * vectors and fed to the fp32 kernel's per-element code: lane j of an accumulator takes k = j,
 * j + 8, ... increasing through STEP (fma_step), then hsum8. So every output is bitwise the
 * fp32 product of gguf-py's dequantized weights, and no output depends on M, on its row's place
 * or on the thread (exact_dot.h). One row: 4 weight rows at a time, dequantized in registers.
 * More rows: 3 weight rows dequantized into an L1 scratch, then the fp32 tiles run over it.
 */

/* Weights 32b .. 32b + 31 of the weight row at `row` (type fmt) as 4 vectors, as gguf-py dequantizes them. */
QTARGET INLINE void QV(kq_block)(int fmt, const uint8_t *row, int b, v8 w[4]) {
    switch (fmt) {
    case GGML_TYPE_F16:
    case GGML_TYPE_BF16: {
        const uint8_t *p = row + (size_t)64 * b;
        for (int g = 0; g < 4; ++g)
            w[g] = fmt == GGML_TYPE_F16 ? f16x8(widen_u16(p + 16 * g)) : bf16x8(widen_u16(p + 16 * g));
        return;
    }
    case GGML_TYPE_Q4_0: { /* weight i < 16: low nibble of byte i; 16 + i: its high nibble */
        const uint8_t *p = row + (size_t)18 * b;
        v8 d, unused;
        HALVES(p, &d, &unused);
        v8i lo = WIDEN_U8(p + 2), hi = WIDEN_U8(p + 10);
        w[0] = scaled_group(d, (lo & 15) - 8);
        w[1] = scaled_group(d, (hi & 15) - 8);
        w[2] = scaled_group(d, (lo >> 4) - 8);
        w[3] = scaled_group(d, (hi >> 4) - 8);
        return;
    }
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1: { /* Q4_0's nibbles (Q4_1's with m), bit i of the 32-bit qh on top of weight i */
        int affine = fmt == GGML_TYPE_Q5_1;
        const uint8_t *p = row + (size_t)(affine ? 24 : 22) * b, *qh = p + (affine ? 4 : 2), *qs = qh + 4;
        v8 d, m; /* Q5_0: m is qh's first bytes, unused */
        HALVES(p, &d, &m);
        v8i lo = WIDEN_U8(qs), hi = WIDEN_U8(qs + 8);
        v8i q[4] = {lo & 15, hi & 15, lo >> 4, hi >> 4};
        for (int g = 0; g < 4; ++g) {
            v8i v = q[g] | bits8(qh, 8 * g) << 4;
            w[g] = affine ? affine_group(d, m, v) : scaled_group(d, v - 16);
        }
        return;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: { /* sub-block j of super-block b / 8: nibbles 32 (j / 2) .., low for even j */
        int five = fmt == GGML_TYPE_Q5_K, j = b & 7, sc, mn;
        const uint8_t *p = row + (size_t)(five ? 176 : 144) * (b >> 3);
        const uint8_t *qs = p + (five ? 48 : 16) + 32 * (j >> 1), *qh = p + 16;
        k_scale_min(p + 4, j, &sc, &mn);
        v8 d, dmin;
        HALVES(p, &d, &dmin);
        v8 dd = d * splat8((float)sc), dm = dmin * splat8((float)mn); /* gguf-py's d * sc, dmin * mn */
        for (int g = 0; g < 4; ++g) {
            v8i q = WIDEN_U8(qs + 8 * g) >> (4 * (j & 1)) & 15;
            if (five) /* bit j of qh[i] on top of weight i */
                q |= (WIDEN_U8(qh + 8 * g) >> j & 1) << 4;
            w[g] = kmin_group(dd, dm, q);
        }
        return;
    }
    default: { /* GGML_TYPE_Q6_K: sub-block j = 4h + r of super-block b / 8 */
        int j = b & 7, h = j >> 2, r = j & 3;
        const uint8_t *p = row + (size_t)210 * (b >> 3);
        const uint8_t *ql = p + 64 * h + 32 * (r & 1), *qh = p + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(p + 192) + 2 * j; /* one per 16 weights */
        v8 unused, d;
        HALVES(p + 206, &unused, &d); /* d is the block's last two bytes */
        v8 dl[2] = {d * splat8((float)scales[0]), d * splat8((float)scales[1])}; /* gguf-py's d * sc */
        for (int g = 0; g < 4; ++g) {
            v8i q = (WIDEN_U8(ql + 8 * g) >> (4 * (r >> 1)) & 15) | (WIDEN_U8(qh + 8 * g) >> (2 * r) & 3) << 4;
            w[g] = scaled_group(dl[g >> 1], q - 32);
        }
        return;
    }
    }
}

/* One row of A x `cols` (<= 4) weight rows from n0, full K, each group of 32 dequantized in registers. */
QTARGET INLINE void QV(kq_tile_1)(const struct job *j, int n0, int cols, int fmt) {
    enum { C = 4 };
    const int blocks = j->k / 32;
    const uint8_t *w = j->q + (size_t)n0 * j->ldq;
    v8 acc[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
        acc[c] = (v8){0};
    for (int b = 0; b < blocks; ++b) {
        const float *a = j->a + 32 * b;
        v8 x[4] = {load8(a), load8(a + 8), load8(a + 16), load8(a + 24)};
#pragma GCC unroll 4
        for (int c = 0; c < cols; ++c) { /* cols: a constant after inlining */
            v8 wv[4];
            QV(kq_block)(fmt, w + c * j->ldq, b, wv);
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)
                acc[c] = STEP(acc[c], x[g], wv[g]);
        }
    }
    for (int c = 0; c < cols; ++c)
        j->c[n0 + c] = hsum8(acc[c]);
}

/* Columns [n0, n1) of every row for one format (a constant after inlining). */
QTARGET INLINE void QV(run_kq_fmt)(const struct job *j, int n0, int n1, int fmt) {
    int n = n0;
    if (j->m == 1) {
        for (; n + 4 <= n1; n += 4)
            QV(kq_tile_1)(j, n, 4, fmt);
        for (; n < n1; ++n)
            QV(kq_tile_1)(j, n, 1, fmt);
        return;
    }
    float *rows = dequant_scratch(3 * (size_t)j->k);
    for (; n < n1; n += 3) {
        int cols = n1 - n < 3 ? n1 - n : 3;
        for (int c = 0; c < cols; ++c)
            for (int b = 0; b < j->k / 32; ++b) {
                v8 wv[4];
                QV(kq_block)(fmt, j->q + (size_t)(n + c) * j->ldq, b, wv);
                memcpy(rows + (size_t)c * j->k + 32 * b, wv, sizeof wv);
            }
        /* The fp32 case's own tiles over the dequantized rows: the same per-element code. */
        struct job f = {1, j->m, cols, j->k, 1.0f, 0.0f, j->a, rows, j->c + n, j->lda, (size_t)j->k, j->ldc, 0, NULL, 0};
        for (int i = 0; i < j->m; i += 4)
            QV(tile_nt)(&f, j->m - i < 4 ? j->m - i : 4, cols, i, 0, NULL);
    }
}

QTARGET static void QV(run_q_any)(const struct job *j, int n0, int n1) {
    switch (j->fmt) {
    case GGML_TYPE_F16: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_F16); break;
    case GGML_TYPE_BF16: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_BF16); break;
    case GGML_TYPE_Q4_0: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_Q4_0); break;
    case GGML_TYPE_Q5_0: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_Q5_0); break;
    case GGML_TYPE_Q5_1: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_Q5_1); break;
    case GGML_TYPE_Q4_K: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_Q4_K); break;
    case GGML_TYPE_Q5_K: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_Q5_K); break;
    default: QV(run_kq_fmt)(j, n0, n1, GGML_TYPE_Q6_K); break;
    }
}
