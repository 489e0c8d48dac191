/*
 * row_gemv: a cblas_sgemm interposer for small row counts (Linux launcher only).
 *
 * MLX computes every product with cblas_sgemm. For a decode step (one row) OpenBLAS's
 * sgemm streams the weights at less than half the bandwidth its sgemv reaches, and for a
 * few rows it gives each row bits that depend on how many rows share the call. Here every
 * row of a call with at most ROW_GEMV_MAX_ROWS rows (and an untransposed A) is one sgemv:
 * a row's bits cannot depend on its block, and the weights stream at sgemv speed. Larger
 * calls (plain-mode prefill) go to the real sgemm unchanged.
 *
 * Loaded through LD_PRELOAD before OpenBLAS (inference_engine/blas.py); the real symbols
 * are found with dlsym(RTLD_NEXT, ...).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#define ROW_GEMV_MAX_ROWS 16

enum { ROW_MAJOR = 101 };
enum { NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

/* Version tag the launcher checks to know this interposer is mapped. */
const char row_gemv_version[] = "row_gemv 1 (max rows 16)";

__attribute__((constructor)) static void find_real_blas(void) {
    real_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    if (!real_sgemm) /* loaded without a BLAS after it: nothing to forward to */
        find_real_blas();
    if (order == ROW_MAJOR && trans_a == NO_TRANS && m <= ROW_GEMV_MAX_ROWS && real_sgemv) {
        for (int i = 0; i < m; ++i) {
            const float *row = a + (size_t)i * lda;
            float *out = c + (size_t)i * ldc;
            if (beta == 0.0f) /* the output may be fresh memory: never let garbage (NaN) leak in */
                memset(out, 0, sizeof(float) * (size_t)n);
            if (trans_b == TRANS) /* B is (n, k): out = B row */
                real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, row, 1, beta, out, 1);
            else /* B is (k, n): out = B^T row */
                real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, row, 1, beta, out, 1);
        }
        return;
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
