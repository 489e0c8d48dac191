/*
 * exact_tiles.h: the fp32 column loops (weights as floats), instantiated once per instruction set.
 *
 * Included by exact_gemm.c with QV(name) (the variant's suffix), QTARGET (its target
 * attribute) and STEP (exact_dot.h's fma_step, or the one instruction that computes it where
 * the variant has FMA) defined; struct job, INLINE, v8 and the exact_dot.h helpers in scope.
 * Every element is one chain of STEPs in exact_dot.h's order whatever the tile, the variant or
 * the thread: the instructions change between variants, the operations never do.
 */

/* ------------------------------------------------------------- B transposed: rows . rows */

/* R rows of A x C rows of B, full K: every weight vector loaded once feeds R rows. `pf`: the
 * weight rows this thread reads next (prefetched while these are multiplied), or NULL. */
#define TILE_NT(R, C)                                                                              \
    QTARGET INLINE void QV(tile_nt_##R##x##C)(const struct job *j, int i0, int n0, const float *pf) {        \
        const float *a = j->a + (size_t)i0 * j->lda, *b = j->b + (size_t)n0 * j->ldb;             \
        v8 acc[R][C];                                                                              \
        for (int r = 0; r < R; ++r)                                                                \
            for (int c = 0; c < C; ++c)                                                            \
                acc[r][c] = (v8){0};                                                               \
        int k = 0;                                                                                 \
        for (; k + 8 <= j->k; k += 8) {                                                            \
            v8 w[C];                                                                               \
            for (int c = 0; c < C; ++c) {                                                          \
                w[c] = load8(b + c * j->ldb + k);                                                  \
                if (pf)                                                                            \
                    __builtin_prefetch(pf + c * j->ldb + k);                                       \
            }                                                                                      \
            for (int r = 0; r < R; ++r) {                                                          \
                v8 x = load8(a + r * j->lda + k);                                                  \
                for (int c = 0; c < C; ++c)                                                        \
                    acc[r][c] = STEP(acc[r][c], x, w[c]);                                      \
            }                                                                                      \
        }                                                                                          \
        if (k < j->k)                                                                              \
            for (int r = 0; r < R; ++r)                                                            \
                for (int c = 0; c < C; ++c)                                                        \
                    acc[r][c] = STEP(acc[r][c], load_tail(a + r * j->lda + k, j->k - k),       \
                                         load_tail(b + c * j->ldb + k, j->k - k));                 \
        for (int r = 0; r < R; ++r)                                                                \
            for (int c = 0; c < C; ++c) {                                                          \
                float *out = j->c + (size_t)(i0 + r) * j->ldc + n0 + c;                            \
                *out = scale_add(hsum8(acc[r][c]), j->alpha, j->beta, out);                        \
            }                                                                                      \
    }

TILE_NT(1, 1)
TILE_NT(1, 2)
TILE_NT(1, 3)
TILE_NT(2, 1)
TILE_NT(2, 2)
TILE_NT(2, 3)
TILE_NT(3, 1)
TILE_NT(3, 2)
TILE_NT(3, 3)
TILE_NT(4, 1)
TILE_NT(4, 2)
TILE_NT(4, 3)
TILE_NT(1, 8)

/* The tile of `rows` x `cols` at (i, n). */
QTARGET INLINE void QV(tile_nt)(const struct job *j, int rows, int cols, int i, int n, const float *pf) {
    switch (rows * 4 + cols) {
    case 5: QV(tile_nt_1x1)(j, i, n, pf); break;
    case 6: QV(tile_nt_1x2)(j, i, n, pf); break;
    case 7: QV(tile_nt_1x3)(j, i, n, pf); break;
    case 9: QV(tile_nt_2x1)(j, i, n, pf); break;
    case 10: QV(tile_nt_2x2)(j, i, n, pf); break;
    case 11: QV(tile_nt_2x3)(j, i, n, pf); break;
    case 13: QV(tile_nt_3x1)(j, i, n, pf); break;
    case 14: QV(tile_nt_3x2)(j, i, n, pf); break;
    case 15: QV(tile_nt_3x3)(j, i, n, pf); break;
    case 17: QV(tile_nt_4x1)(j, i, n, pf); break;
    case 18: QV(tile_nt_4x2)(j, i, n, pf); break;
    default: QV(tile_nt_4x3)(j, i, n, pf); break;
    }
}

/* Columns [n0, n1) of every row. One row: 8 weight rows in flight (memory-bound; the
 * hardware prefetcher keeps up). More rows: 3 weight rows at a time against every 4-row
 * group of A; they stay in L1 from the first group on, and the next 3 are prefetched
 * meanwhile, so memory and arithmetic overlap. */
QTARGET static void QV(run_nt)(const struct job *j, int n0, int n1) {
    int n = n0;
    if (j->m == 1) {
        for (; n + 8 <= n1; n += 8)
            QV(tile_nt_1x8)(j, 0, n, NULL);
        for (; n < n1; n += 3)
            QV(tile_nt)(j, 1, n1 - n < 3 ? n1 - n : 3, 0, n, NULL);
        return;
    }
    for (; n < n1; n += 3) {
        int cols = n1 - n < 3 ? n1 - n : 3;
        const float *pf = n + 6 <= n1 ? j->b + (size_t)(n + 3) * j->ldb : NULL;
        for (int i = 0; i < j->m; i += 4)
            QV(tile_nt)(j, j->m - i < 4 ? j->m - i : 4, cols, i, n, pf);
    }
}

/* ------------------------------------------------------------ B not transposed: row x cols */

/* R rows of A x 8*C columns of B: one sequential chain over k per element. */
#define TILE_NN(R, C)                                                                              \
    QTARGET INLINE void QV(tile_nn_##R##x##C)(const struct job *j, int i0, int n0) {                          \
        const float *a = j->a + (size_t)i0 * j->lda, *b = j->b + n0;                              \
        v8 acc[R][C];                                                                              \
        for (int r = 0; r < R; ++r)                                                                \
            for (int c = 0; c < C; ++c)                                                            \
                acc[r][c] = (v8){0};                                                               \
        for (int k = 0; k < j->k; ++k) {                                                           \
            v8 w[C];                                                                               \
            for (int c = 0; c < C; ++c)                                                            \
                w[c] = load8(b + (size_t)k * j->ldb + 8 * c);                                      \
            for (int r = 0; r < R; ++r) {                                                          \
                float s = a[r * j->lda + k];                                                   \
                v8 x = {s, s, s, s, s, s, s, s};                                                \
                for (int c = 0; c < C; ++c)                                                        \
                    acc[r][c] = STEP(acc[r][c], x, w[c]);                                      \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; ++r)                                                                \
            for (int c = 0; c < C; ++c)                                                            \
                for (int l = 0; l < 8; ++l) {                                                      \
                    float *out = j->c + (size_t)(i0 + r) * j->ldc + n0 + 8 * c + l;                \
                    *out = scale_add(acc[r][c][l], j->alpha, j->beta, out);                        \
                }                                                                                  \
    }

TILE_NN(1, 1)
TILE_NN(1, 2)
TILE_NN(2, 1)
TILE_NN(2, 2)
TILE_NN(3, 1)
TILE_NN(3, 2)
TILE_NN(4, 1)
TILE_NN(4, 2)

QTARGET INLINE void QV(tile_nn)(const struct job *j, int rows, int vecs, int i, int n) {
    switch (rows * 2 + vecs) {
    case 3: QV(tile_nn_1x1)(j, i, n); break;
    case 4: QV(tile_nn_1x2)(j, i, n); break;
    case 5: QV(tile_nn_2x1)(j, i, n); break;
    case 6: QV(tile_nn_2x2)(j, i, n); break;
    case 7: QV(tile_nn_3x1)(j, i, n); break;
    case 8: QV(tile_nn_3x2)(j, i, n); break;
    case 9: QV(tile_nn_4x1)(j, i, n); break;
    default: QV(tile_nn_4x2)(j, i, n); break;
    }
}

/* One column of one row: the same chain as a vector lane, in scalar code. */
QTARGET INLINE void QV(column_nn)(const struct job *j, int i, int n) {
    float s = 0.0f;
    for (int k = 0; k < j->k; ++k)
        s = __builtin_fmaf(j->a[(size_t)i * j->lda + k], j->b[(size_t)k * j->ldb + n], s);
    float *out = j->c + (size_t)i * j->ldc + n;
    *out = scale_add(s, j->alpha, j->beta, out);
}

QTARGET static void QV(run_nn)(const struct job *j, int n0, int n1) {
    int n = n0;
    for (; n + 8 <= n1; n += 8 * (n + 16 <= n1 ? 2 : 1))
        for (int i = 0; i < j->m; i += 4)
            QV(tile_nn)(j, j->m - i < 4 ? j->m - i : 4, n + 16 <= n1 ? 2 : 1, i, n);
    for (; n < n1; ++n)
        for (int i = 0; i < j->m; ++i)
            QV(column_nn)(j, i, n);
}

#undef TILE_NT
#undef TILE_NN
