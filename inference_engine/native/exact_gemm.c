/*
 * exact_gemm: a row-invariant cblas_sgemm for blocks of up to 64 rows (Linux launcher only),
 * and the same products with weights read from GGUF blocks (`exact_qgemm`: F16, BF16, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
 *
 * Why a row's bits cannot depend on its block: every output C[i,n] is reduced by one fixed
 * sequence of fp32 operations that depends only on K, alpha, beta and the two input rows,
 * never on M, on i, on which micro-kernel computed it nor on which thread (exact_dot.h).
 * Threads (the caller and a small pool) claim chunks of output columns, never of K. Every
 * micro-kernel (1x8, RxC tiles) instantiates the same per-element code; tiling only decides
 * which weights are reused from registers and L1, i.e. a weight row is read from memory
 * once per call, not once per row.
 *
 * Arithmetic: explicit 8-lane GCC vectors, each step a fused multiply-add rounded once
 * (exact_dot.h's fma_step; IEEE 754 defines its result to the bit), nothing else fused
 * (built with -ffp-contract=off), so x86-64 with or without AVX2/FMA/AVX-512, and AArch64,
 * give the same bits. No -march=native (a cached build may meet another CPU): on x86-64 the
 * column loops are built twice, for AVX2 + FMA and portably (libm's fmaf lane by lane), and
 * the CPU picks one at load time, which changes the instructions, not the operations; on
 * AArch64 the NEON loops (exact_gemm_neon.h) serve unless EXACT_GEMM_PORTABLE is set.
 * tests/native/kernel_harness.cpp checks every variant's bits (scripts/check_arm64.sh).
 *
 * Cases: RowMajor, A not transposed, B transposed (MLX's x @ W.T: each output is the dot
 * product of two contiguous rows) or not (attention's weights @ values: one sequential
 * chain per element, k = 0..K-1). Calls with more rows (plain-mode prefill) and any other
 * layout go to the real sgemm unchanged, found with dlsym(RTLD_NEXT) behind LD_PRELOAD
 * (without one, this computes the two layouts for any M and aborts on the others).
 *
 * Quantized weights (`exact_qgemm`, called by the MLX extension native/exact_quant.cpp, any
 * M): each block's 32 weights are dequantized exactly as the converter did (ggml_blocks.h)
 * and fed to the same fma_step/hsum8 in the same k order as the fp32 B-transposed case, so
 * the result is bitwise x @ W.T of the served fp32 weights (exact_qtiles.h). One row:
 * dequantized in registers, 4 weight rows at a time. 2..12 rows: register tiles (4 x 2, or
 * 8 x 1 for 5..8 rows), each weight dequantized once per row group. More rows: 3 weight rows
 * dequantized into an L1 scratch, then the fp32 tiles themselves run over it. Few-row tiles
 * prefetch the next tile's weight rows as they go. On AVX-512 CPUs every call holds two columns'
 * 8-lane accumulators in one 512-bit register (run_q_avx512): 1..12 rows in register tiles, more
 * rows in 8 x 4 tiles over 4 weight rows dequantized into L1 as column pairs; the same operations
 * per element, half the instructions. The other block types take those 8 x 4 tiles for 2 rows and
 * more (dequantize_kpairs: exact_kqtiles.h's dequantization), and one row of Q5_0, Q4_K or Q6_K
 * (Gemma-3's Q4_K_M linears) dequantizes two weight rows per 512-bit register (kq_tile_1_avx512). fp32 calls of more than 32 rows run those tiles too, over 4
 * weight rows copied into the same layout (run_nt_avx512).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <float.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors never cross a non-inlined call */
#include "exact_dot.h"
#include "ggml_blocks.h"
#include "ggml_kquants.h"

#define EXACT_GEMM_MAX_ROWS 64
#define SPIN_NS 200000L    /* a worker spins this long for the next call before sleeping */
/* While the callers' waits for late workers average more than WASTE_LIMIT of their pooled
 * calls' time (an oversubscribed machine: shard workers sharing the cores, a busy host), calls
 * run alone, SOLO_CALLS at a time, each stretch ended by one pooled call that measures again.
 * The average (weight 1/16 per pooled call) ignores a lone late wake-up: the engine's own Python
 * threads preempt the worker now and then (long waits in ~0.3 % of an in-process server's calls
 * on this 2-vCPU VM). Going solo for 256 calls on each of those, as before, ran ~60 % of the
 * calls alone: 1-session decode 49 -> 59 tok/s and 8 sessions 95 -> 119 without that. */
#define WASTE_LIMIT 0.25
#define SOLO_CALLS 16
#define CHUNK_COST 400000L /* rows (at least 4) x k x columns per claimed chunk (~20 us) */

const char exact_gemm_version[] = "exact-gemm kernel 3 (max rows 64, 8-lane fused multiply-add; F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights)";

enum { ROW_MAJOR = 101 };
enum { NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
static sgemm_fn real_sgemm;

/* ---------------------------------------------------------------------------- a call */

struct job {
    int trans_b, m, n, k;
    float alpha, beta;
    const float *a, *b;
    float *c;
    size_t lda, ldb, ldc;
    int fmt;            /* 0: fp32 B; a ggml type (ggml_types.h): B is `q`, n rows of blocks */
    const uint8_t *q;   /* quantized weights (fmt != 0) */
    size_t ldq;         /* bytes from one weight row to the next */
};

/* ----------------------------------------------- the column loops, one variant per CPU kind */

static __thread float *scratch; /* per thread: dequantized weight rows for multi-row tiles */
static __thread size_t scratch_floats;

static float *dequant_scratch(size_t floats) {
    if (scratch_floats < floats) {
        free(scratch);
        scratch = malloc(floats * sizeof *scratch);
        if (!scratch)
            abort(); /* a few KB per thread: nothing sensible is left to do */
        scratch_floats = floats;
    }
    return scratch;
}

static inline v8i widen_u8_portable(const uint8_t *p) {
    v8i v;
    for (int i = 0; i < 8; ++i)
        v[i] = p[i];
    return v;
}

static inline v8i widen_s8_portable(const uint8_t *p) {
    v8i v;
    for (int i = 0; i < 8; ++i)
        v[i] = (int8_t)p[i];
    return v;
}

static inline void halves_portable(const uint8_t *p, v8 *a, v8 *b) {
    *a = splat8(half_to_float(p));
    *b = splat8(half_to_float(p + 2));
}

/* Portable C (any CPU; an x86-64 without AVX2 + FMA, or EXACT_GEMM_PORTABLE=1 for tests): fma_step is
 * libm's fmaf lane by lane, correctly rounded, so the bits of every other variant. */
#define QV(name) name##_portable
#define QTARGET
#define STEP fma_step
#define WIDEN_U8 widen_u8_portable
#define WIDEN_S8 widen_s8_portable
#define HALVES halves_portable
#define Q4_1_GROUP q4_1_group
#include "exact_tiles.h"
#include "exact_qtiles.h"
#include "exact_kqtiles.h"
#undef QV
#undef QTARGET
#undef STEP
#undef WIDEN_U8
#undef WIDEN_S8
#undef HALVES
#undef Q4_1_GROUP

typedef void (*columns_fn)(const struct job *, int, int);
/* The variants the CPU runs: run_*_avx2 / run_q_avx512 where it has them (choose_columns). */
static columns_fn run_nt = run_nt_portable, run_nn = run_nn_portable, run_q = run_q_portable;
static const char *gemm_variant = "portable"; /* which loops choose_columns picked (exact_gemm_variant) */

#if defined(__aarch64__)
#include "exact_gemm_neon.h" /* NEON loops, chosen at load time unless EXACT_GEMM_PORTABLE */
#endif

#if defined(__x86_64__) && !defined(__AVX2__)
#include <cpuid.h>
#include <immintrin.h>
#define QTARGET __attribute__((target("avx2,f16c,fma")))

QTARGET static inline void halves_f16c(const uint8_t *p, v8 *a, v8 *b) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(pair)); /* exact: every fp16 is a float */
    *a = (v8)_mm256_broadcastss_ps(f);
    *b = (v8)_mm256_broadcastss_ps(_mm_movehdup_ps(f));
}

/* fma_step in one instruction (GCC does not vectorize the lane loop reliably inside the tiles). */
QTARGET INLINE v8 fma8_avx2(v8 acc, v8 x, v8 w) { return (v8)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc); }

#define STEP fma8_avx2
#define WIDEN_U8(p) ((v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define WIDEN_S8(p) ((v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define HALVES halves_f16c
/* q4_1_group's d * q + m as one fused multiply-add: d * q is exact (ggml_blocks.h), so one
 * rounding of d * q + m is the converter's two, bit for bit: checked against mul + add over
 * all 2^36 (fp16 d, nibble, fp16 m), where only NaN payloads differed, for a NaN d or m. One
 * instruction fewer per 8 weights; the dot products are fma_step's, as everywhere. */
#define Q4_1_GROUP(d, m, q) ((v8)_mm256_fmadd_ps((__m256)(d), _mm256_cvtepi32_ps((__m256i)(q)), (__m256)(m)))
#define QV(name) name##_avx2
#include "exact_tiles.h"
#include "exact_qtiles.h"
#include "exact_kqtiles.h"

/* One to 12 rows (decode, batches, verification) on AVX-512: the AVX2 tiles' arithmetic for two columns per instruction. Each
 * 512-bit register holds two 8-lane accumulators side by side (lanes 0..7 column c, 8..15 column
 * c + 1), each fed exactly the operations qtile_1 feeds its column's (the same dequantization,
 * fused multiply-add, blocks and groups in order, the same hsum8), so the bits
 * are the AVX2 path's; only the instruction count halves, and one-row Q4_1 products are bound by
 * it (a core whose 512-bit pipes are full width does twice the lanes per instruction). */
#define Q512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma")))
typedef float v16 __attribute__((vector_size(64)));

Q512 static inline v16 pair8(v8 lo, v8 hi) {
    return (v16)_mm512_insertf32x8(_mm512_castps256_ps512((__m256)lo), (__m256)hi, 1);
}

/* The 8 floats at p in both halves (one broadcast load, no shuffle). */
Q512 static inline v16 dup8(const float *p) {
    return (v16)_mm512_broadcast_f32x8(_mm256_loadu_ps(p));
}

Q512 static inline __m512i widen_pair(const uint8_t *p, const uint8_t *q, int is_signed) {
    __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)q));
    return is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

/* Weights 8g .. 8g + 7 of the blocks at b0 and b1 (their d and m side by side): QV(group)'s operations. */
Q512 static inline v16 group_pair(int fmt, const uint8_t *b0, const uint8_t *b1, v16 d, v16 m, int g) {
    if (fmt == GGML_Q4_1) {
        __m512i q = widen_pair(b0 + Q4_1_NIBBLES + 8 * (g & 1), b1 + Q4_1_NIBBLES + 8 * (g & 1), 0);
        q = g < 2 ? _mm512_and_si512(q, _mm512_set1_epi32(15)) : _mm512_srli_epi32(q, 4);
        return (v16)_mm512_fmadd_ps((__m512)d, _mm512_cvtepi32_ps(q), (__m512)m); /* Q4_1_GROUP */
    }
    __m512i q = widen_pair(b0 + Q8_0_INTS + 8 * g, b1 + Q8_0_INTS + 8 * g, 1);
    return (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(q), (__m512)d); /* q8_0_group */
}

/* CALL(R) for R = rows (1..8): each row count its own inlined copy of the tile. */
#define BY_ROWS(rows, CALL)                                                                                   \
    switch (rows) {                                                                                           \
    case 1: CALL(1); break;                                                                                   \
    case 2: CALL(2); break;                                                                                   \
    case 3: CALL(3); break;                                                                                   \
    case 4: CALL(4); break;                                                                                   \
    case 5: CALL(5); break;                                                                                   \
    case 6: CALL(6); break;                                                                                   \
    case 7: CALL(7); break;                                                                                   \
    default: CALL(8); break;                                                                                  \
    }

/* One step of 8 k for `rows` (<= 8) rows: row r's 8 floats at x + r * lda, in both halves, times the
 * two column pairs w0, w1; fma_step's one rounding for each of the 4 columns. */
Q512 static inline __attribute__((always_inline)) void pairs_step(v16 acc[8][2], int rows, const float *x, size_t lda,
                                                                    v16 w0, v16 w1) {
    for (int r = 0; r < rows; ++r) {
        v16 xr = dup8(x + r * lda);
        acc[r][0] = (v16)_mm512_fmadd_ps((__m512)xr, (__m512)w0, (__m512)acc[r][0]);
        acc[r][1] = (v16)_mm512_fmadd_ps((__m512)xr, (__m512)w1, (__m512)acc[r][1]);
    }
}

/* Each register's two 8-lane accumulators (columns n0 + 2p, n0 + 2p + 1), hsum8 of each, into C. */
Q512 static inline __attribute__((always_inline)) void store_pairs(const struct job *j, v16 acc[8][2], int i0, int rows,
                                                                     int n0) {
    for (int r = 0; r < rows; ++r)
        for (int p = 0; p < 2; ++p) {
            v8 lo, hi;
            memcpy(&lo, &acc[r][p], sizeof lo);
            memcpy(&hi, (const float *)&acc[r][p] + 8, sizeof hi);
            j->c[(size_t)(i0 + r) * j->ldc + n0 + 2 * p] = hsum8(lo);
            j->c[(size_t)(i0 + r) * j->ldc + n0 + 2 * p + 1] = hsum8(hi);
        }
}

/* `rows` (<= 8) rows of A from i0 x 4 quantized weight rows from n0 (two column pairs), full K:
 * qtile_1's (one row) or qtile_m's operations for every (row, column), two columns per
 * instruction (16 accumulators, 2 weight pairs and a row's x fit the 32 registers). */
Q512 static inline __attribute__((always_inline)) void qtile_rx4_avx512(const struct job *j, int i0, int rows, int n0,
                                                                          int fmt) {
    const int bytes = ggml_block_bytes(fmt), blocks = j->k / GGML_QK;
    const uint8_t *w = j->q + (size_t)n0 * j->ldq;
    const float *a = j->a + (size_t)i0 * j->lda;
    v16 acc[8][2];
    for (int r = 0; r < 8; ++r)
        acc[r][0] = acc[r][1] = (v16){0};
    for (int b = 0; b < blocks; ++b) {
        const uint8_t *blk[4];
        v16 d[2], m[2];
        for (int p = 0; p < 2; ++p) {
            v8 d0, m0, d1, m1;
            blk[2 * p] = w + (size_t)(2 * p) * j->ldq + (size_t)b * bytes;
            blk[2 * p + 1] = blk[2 * p] + j->ldq;
            halves_f16c(blk[2 * p], &d0, &m0);
            halves_f16c(blk[2 * p + 1], &d1, &m1);
            d[p] = pair8(d0, d1);
            m[p] = pair8(m0, m1);
        }
        if (i0 == 0) /* the first row group fetches the next tile's weights (qtile_1's sweep) */
            prefetch_next_avx2(w, 4, j->ldq, b, bytes, rows == 1 ? 3 : 2);
        for (int g = 0; g < 4; ++g) {
            v16 w0 = group_pair(fmt, blk[0], blk[1], d[0], m[0], g), w1 = group_pair(fmt, blk[2], blk[3], d[1], m[1], g);
            pairs_step(acc, rows, a + GGML_QK * b + 8 * g, j->lda, w0, w1);
        }
    }
    store_pairs(j, acc, i0, rows, n0);
}

/* The tile of `rows` rows at (i0, n0): each row count and format its own inlined copy. */
Q512 static inline __attribute__((always_inline)) void qtile_rows_fmt_avx512(const struct job *j, int i0, int rows,
                                                                               int n0, int fmt) {
#define QTILE(R) qtile_rx4_avx512(j, i0, R, n0, fmt)
    BY_ROWS(rows, QTILE)
#undef QTILE
}

Q512 static void qtile_rows_avx512(const struct job *j, int i0, int rows, int n0) {
    if (j->fmt == GGML_Q4_1)
        qtile_rows_fmt_avx512(j, i0, rows, n0, GGML_Q4_1);
    else
        qtile_rows_fmt_avx512(j, i0, rows, n0, GGML_Q8_0);
}

/* Weight rows n0 .. n0 + 3 dequantized (QV(block)'s operations) into `out` as two column pairs:
 * pair p's 8-weight group s (k = 8s .. 8s + 7) at out + (p * k / 8 + s) * 16, column 2p in lanes
 * 0..7 and column 2p + 1 in lanes 8..15, so one 512-bit load feeds a tile two columns. */
Q512 static inline __attribute__((always_inline)) void dequantize_pairs(const struct job *j, int n0, float *out,
                                                                          int fmt) {
    const int bytes = ggml_block_bytes(fmt), blocks = j->k / GGML_QK;
    for (int p = 0; p < 2; ++p)
        for (int b = 0; b < blocks; ++b) {
            const uint8_t *blk = j->q + (size_t)(n0 + 2 * p) * j->ldq + (size_t)b * bytes;
            v8 w0[4], w1[4];
            block_avx2(fmt, blk, w0);
            block_avx2(fmt, blk + j->ldq, w1);
            float *o = out + ((size_t)p * blocks * 4 + (size_t)b * 4) * 16;
            for (int g = 0; g < 4; ++g) {
                memcpy(o + 16 * g, &w0[g], sizeof w0[g]);
                memcpy(o + 16 * g + 8, &w1[g], sizeof w1[g]);
            }
        }
}

/* `rows` (<= 8) rows of A from i0 x the 4 dequantized columns at `pairs` (dequantize_pairs), full
 * K: tile_nt's operations on those weights (lane j of a column: k = j, j + 8, ... increasing, a
 * fused multiply-add, then hsum8), two columns per instruction. */
Q512 static inline __attribute__((always_inline)) void ptile_avx512(const struct job *j, const float *pairs, int i0,
                                                                      int rows, int n0) {
    const int groups = j->k / 8;
    const float *a = j->a + (size_t)i0 * j->lda;
    v16 acc[8][2];
    for (int r = 0; r < 8; ++r)
        acc[r][0] = acc[r][1] = (v16){0};
    for (int s = 0; s < groups; ++s) {
        v16 w0, w1;
        memcpy(&w0, pairs + (size_t)s * 16, sizeof w0);
        memcpy(&w1, pairs + (size_t)(groups + s) * 16, sizeof w1);
        pairs_step(acc, rows, a + 8 * s, j->lda, w0, w1);
    }
    store_pairs(j, acc, i0, rows, n0);
}

Q512 static void ptile_rows_avx512(const struct job *j, const float *pairs, int i0, int rows, int n0) {
#define PTILE(R) ptile_avx512(j, pairs, i0, R, n0)
    BY_ROWS(rows, PTILE)
#undef PTILE
}

Q512 static void dequantize_pairs_avx512(const struct job *j, int n0, float *out) {
    if (j->fmt == GGML_Q4_1)
        dequantize_pairs(j, n0, out, GGML_Q4_1);
    else
        dequantize_pairs(j, n0, out, GGML_Q8_0);
}

/* One row on AVX-512 for Q5_0, Q4_K and Q6_K (Gemma-3's Q4_K_M linears): exact_kqtiles.h's
 * QV(kq_block) for two weight rows at once, row r0's 8 weights in lanes 0..7 and r1's in 8..15,
 * every lane the same integer steps and the same IEEE multiplies and subtractions (d * sc, then
 * (d * sc) * q - dmin * mn, or d * float(q - 16)) as the 8-lane code, so the same weights. */
typedef int32_t v16i __attribute__((vector_size(64)));

Q512 static inline v16i widen_u8_pair(const uint8_t *p, const uint8_t *q) { return (v16i)widen_pair(p, q, 0); }

Q512 static inline v16 halves_pair(const uint8_t *p0, const uint8_t *p1, v16 *second) {
    v8 a0, b0, a1, b1;
    halves_f16c(p0, &a0, &b0);
    halves_f16c(p1, &a1, &b1);
    *second = pair8(b0, b1);
    return pair8(a0, a1);
}

Q512 static inline v16 splat_pair(float lo, float hi) {
    return (v16){lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi};
}

Q512 static inline __attribute__((always_inline)) void kq_pair_block(int fmt, const uint8_t *r0, const uint8_t *r1,
                                                                       int b, v16 w[4]) {
    const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7};
    if (fmt == GGML_TYPE_Q5_0) { /* d, 32 high bits, 16 bytes of nibbles */
        const uint8_t *p0 = r0 + (size_t)22 * b, *p1 = r1 + (size_t)22 * b;
        v16 unused, d = halves_pair(p0, p1, &unused);
        uint32_t h0, h1;
        memcpy(&h0, p0 + 2, sizeof h0);
        memcpy(&h1, p1 + 2, sizeof h1);
        v16i qh = {(int32_t)h0, (int32_t)h0, (int32_t)h0, (int32_t)h0, (int32_t)h0, (int32_t)h0, (int32_t)h0,
                   (int32_t)h0, (int32_t)h1, (int32_t)h1, (int32_t)h1, (int32_t)h1, (int32_t)h1, (int32_t)h1,
                   (int32_t)h1, (int32_t)h1};
        v16i lo = widen_u8_pair(p0 + 6, p1 + 6), hi = widen_u8_pair(p0 + 14, p1 + 14);
        v16i q[4] = {lo & 15, hi & 15, lo >> 4, hi >> 4};
        for (int g = 0; g < 4; ++g) {
            v16i v = q[g] | ((v16i)_mm512_srlv_epi32((__m512i)qh, (__m512i)(lanes + 8 * g)) & 1) << 4;
            w[g] = d * __builtin_convertvector(v - 16, v16); /* scaled_group */
        }
        return;
    }
    if (fmt == GGML_TYPE_Q4_K) { /* sub-block j of super-block b / 8 */
        int j = b & 7, sc0, mn0, sc1, mn1;
        const uint8_t *p0 = r0 + (size_t)144 * (b >> 3), *p1 = r1 + (size_t)144 * (b >> 3);
        const size_t qs = 16 + 32 * (j >> 1);
        k_scale_min(p0 + 4, j, &sc0, &mn0);
        k_scale_min(p1 + 4, j, &sc1, &mn1);
        v16 dmin, d = halves_pair(p0, p1, &dmin);
        v16 dd = d * splat_pair((float)sc0, (float)sc1), dm = dmin * splat_pair((float)mn0, (float)mn1);
        for (int g = 0; g < 4; ++g) {
            v16i q = widen_u8_pair(p0 + qs + 8 * g, p1 + qs + 8 * g) >> (4 * (j & 1)) & 15;
            w[g] = dd * __builtin_convertvector(q, v16) - dm; /* kmin_group */
        }
        return;
    }
    /* GGML_TYPE_Q6_K: sub-block j = 4h + r of super-block b / 8 */
    int j = b & 7, h = j >> 2, r = j & 3;
    const uint8_t *p0 = r0 + (size_t)210 * (b >> 3), *p1 = r1 + (size_t)210 * (b >> 3);
    const size_t ql = 64 * h + 32 * (r & 1), qh = 128 + 32 * h;
    const int8_t *s0 = (const int8_t *)(p0 + 192) + 2 * j, *s1 = (const int8_t *)(p1 + 192) + 2 * j;
    v16 d, unused = halves_pair(p0 + 206, p1 + 206, &d); /* d is the block's last two bytes */
    (void)unused;
    v16 dl[2] = {d * splat_pair((float)s0[0], (float)s1[0]), d * splat_pair((float)s0[1], (float)s1[1])};
    for (int g = 0; g < 4; ++g) {
        v16i q = (widen_u8_pair(p0 + ql + 8 * g, p1 + ql + 8 * g) >> (4 * (r >> 1)) & 15) |
                 (widen_u8_pair(p0 + qh + 8 * g, p1 + qh + 8 * g) >> (2 * r) & 3) << 4;
        w[g] = dl[g >> 1] * __builtin_convertvector(q - 32, v16); /* scaled_group */
    }
}

/* One row of A x 4 weight rows from n0 (two column pairs), full K: kq_tile_1's operations for each
 * column (lane j: k = 32b + 8g + j increasing, fma_step, then hsum8), two columns per instruction;
 * the next tile's rows are prefetched at the pace this one is read. */
Q512 static inline __attribute__((always_inline)) void kq_tile_1_avx512(const struct job *j, int n0, int fmt) {
    const int blocks = j->k / 32;
    const uint8_t *w = j->q + (size_t)n0 * j->ldq;
    const size_t sweep = 4 * j->ldq / (size_t)blocks + 1; /* bytes of the next tile per sub-block */
    v16 acc[2] = {{0}, {0}};
    for (int b = 0; b < blocks; ++b) {
        const uint8_t *next = w + 4 * j->ldq + (size_t)b * sweep;
        __builtin_prefetch(next);
        __builtin_prefetch(next + 64);
        const float *a = j->a + 32 * b;
        for (int p = 0; p < 2; ++p) {
            v16 wv[4];
            kq_pair_block(fmt, w + (size_t)(2 * p) * j->ldq, w + (size_t)(2 * p + 1) * j->ldq, b, wv);
            for (int g = 0; g < 4; ++g)
                acc[p] = (v16)_mm512_fmadd_ps((__m512)dup8(a + 8 * g), (__m512)wv[g], (__m512)acc[p]);
        }
    }
    for (int p = 0; p < 2; ++p) {
        v8 lo, hi;
        memcpy(&lo, &acc[p], sizeof lo);
        memcpy(&hi, (const float *)&acc[p] + 8, sizeof hi);
        j->c[n0 + 2 * p] = hsum8(lo);
        j->c[n0 + 2 * p + 1] = hsum8(hi);
    }
}

/* Columns from n in tiles of 4 while 4 are left; returns the first column not computed. */
Q512 static int kq_row_columns_avx512(const struct job *j, int n, int n1) {
    switch (j->fmt) {
    case GGML_TYPE_Q5_0: for (; n + 4 <= n1; n += 4) kq_tile_1_avx512(j, n, GGML_TYPE_Q5_0); break;
    case GGML_TYPE_Q4_K: for (; n + 4 <= n1; n += 4) kq_tile_1_avx512(j, n, GGML_TYPE_Q4_K); break;
    case GGML_TYPE_Q6_K: for (; n + 4 <= n1; n += 4) kq_tile_1_avx512(j, n, GGML_TYPE_Q6_K); break;
    default: break; /* the others: AVX2's kq_tile_1 */
    }
    return n;
}

/* dequantize_pairs for the other types: each row's 32-weight groups as exact_kqtiles.h's
 * QV(kq_block) gives them to its fp32 tiles (gguf-py's roundings), in the same pair layout. */
Q512 static inline __attribute__((always_inline)) void dequantize_kpairs(const struct job *j, int n0, float *out,
                                                                           int fmt) {
    const int blocks = j->k / 32;
    for (int p = 0; p < 2; ++p) {
        const uint8_t *row = j->q + (size_t)(n0 + 2 * p) * j->ldq;
        for (int b = 0; b < blocks; ++b) {
            v8 w0[4], w1[4];
            kq_block_avx2(fmt, row, b, w0);
            kq_block_avx2(fmt, row + j->ldq, b, w1);
            float *o = out + ((size_t)p * blocks * 4 + (size_t)b * 4) * 16;
            for (int g = 0; g < 4; ++g) {
                memcpy(o + 16 * g, &w0[g], sizeof w0[g]);
                memcpy(o + 16 * g + 8, &w1[g], sizeof w1[g]);
            }
        }
    }
}

Q512 static void dequantize_kpairs_avx512(const struct job *j, int n0, float *out) {
    switch (j->fmt) {
    case GGML_TYPE_F16: dequantize_kpairs(j, n0, out, GGML_TYPE_F16); break;
    case GGML_TYPE_BF16: dequantize_kpairs(j, n0, out, GGML_TYPE_BF16); break;
    case GGML_TYPE_Q4_0: dequantize_kpairs(j, n0, out, GGML_TYPE_Q4_0); break;
    case GGML_TYPE_Q5_0: dequantize_kpairs(j, n0, out, GGML_TYPE_Q5_0); break;
    case GGML_TYPE_Q5_1: dequantize_kpairs(j, n0, out, GGML_TYPE_Q5_1); break;
    case GGML_TYPE_Q4_K: dequantize_kpairs(j, n0, out, GGML_TYPE_Q4_K); break;
    case GGML_TYPE_Q5_K: dequantize_kpairs(j, n0, out, GGML_TYPE_Q5_K); break;
    default: dequantize_kpairs(j, n0, out, GGML_TYPE_Q6_K); break;
    }
}

/* Columns from n in groups of 4 while 4 are left: `fill` puts 4 weight rows into L1 as column pairs
 * (dequantize_pairs' layout), then every 8-row group of A runs ptile over them. Returns the first
 * column not computed. */
Q512 static int pair_columns(const struct job *j, int n, int n1, void (*fill)(const struct job *, int, float *)) {
    float *pairs = dequant_scratch(4 * (size_t)j->k);
    for (; n + 4 <= n1; n += 4) {
        fill(j, n, pairs);
        for (int i = 0; i < j->m; i += 8)
            ptile_rows_avx512(j, pairs, i, j->m - i < 8 ? j->m - i : 8, n);
    }
    return n;
}

/* fp32 weight rows n0 .. n0 + 3 copied into `out` in dequantize_pairs' layout (two column pairs). */
Q512 static void pack_pairs(const struct job *j, int n0, float *out) {
    const int groups = j->k / 8;
    for (int p = 0; p < 2; ++p) {
        const float *w0 = j->b + (size_t)(n0 + 2 * p) * j->ldb, *w1 = w0 + j->ldb;
        float *o = out + (size_t)p * groups * 16;
        for (int s = 0; s < groups; ++s) {
            memcpy(o + 16 * s, w0 + 8 * s, 8 * sizeof *o);
            memcpy(o + 16 * s + 8, w1 + 8 * s, 8 * sizeof *o);
        }
    }
}

/* fp32 weights (B transposed) on AVX-512: calls of more than 32 rows with K a multiple of 8, alpha 1
 * and beta 0 (MLX's prefill products) copy 4 weight rows at a time into L1 as column pairs and run
 * ptile's 8 x 4 tiles over them: tile_nt's operations per element (lane j: k = j, j + 8, ...
 * increasing, one fused multiply-add each, then hsum8), two columns per instruction. Anything else
 * takes the AVX2 loop (the copy does not pay off below ~32 rows: step equivalent at 16 / 32 / 64
 * rows, AVX2 -> this, 29-35 -> 37-39 / 55-60 -> 56-68 / 119-131 -> 105-115 ms). */
Q512 static void run_nt_avx512(const struct job *j, int n0, int n1) {
    int n = n0;
    if (j->m > 32 && j->k % 8 == 0 && j->alpha == 1.0f && j->beta == 0.0f)
        n = pair_columns(j, n, n1, pack_pairs);
    if (n < n1)
        run_nt_avx2(j, n, n1);
}

Q512 static void run_q_avx512(const struct job *j, int n0, int n1) {
    int n = n0;
    if (j->fmt != GGML_Q4_1 && j->fmt != GGML_Q8_0) { /* the other types (exact_kqtiles.h's dequantization) */
        if (j->m > 1) /* 4 weight rows dequantized once into L1 as column pairs, then every 8-row group */
            n = pair_columns(j, n, n1, dequantize_kpairs_avx512);
        else /* one row: two columns per instruction, dequantized in registers (Q5_0, Q4_K, Q6_K) */
            n = kq_row_columns_avx512(j, n, n1);
        if (n < n1)
            run_q_avx2(j, n, n1); /* one row (registers, AVX2's kq_tile_1), or the last columns */
        return;
    }
    if (j->m <= 12) /* decode, batched decode, verification: row groups of up to 8 */
        for (; n + 4 <= n1; n += 4)
            for (int i = 0; i < j->m; i += 8)
                qtile_rows_avx512(j, i, j->m - i < 8 ? j->m - i : 8, n);
    else /* more rows (prefill): 4 weight rows dequantized once into L1, then every 8-row group */
        n = pair_columns(j, n, n1, dequantize_pairs_avx512);
    if (n < n1)
        run_q_avx2(j, n, n1); /* the last columns */
}

/* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

__attribute__((constructor)) static void choose_columns(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !has_f16c() || !__builtin_cpu_supports("fma") ||
        getenv("EXACT_GEMM_PORTABLE")) /* tests: the path of a CPU without them, for its bits */
        return;
    run_nt = run_nt_avx2;
    run_nn = run_nn_avx2;
    run_q = run_q_avx2;
    gemm_variant = "x86-64 AVX2+FMA";
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && !getenv("EXACT_GEMM_NO_AVX512")) {
        run_q = run_q_avx512;
        run_nt = run_nt_avx512;
        gemm_variant = "x86-64 AVX-512";
    }
}
#endif

/* ------------------------------------------------------------------------- the thread pool */

/* A pooled call is cut into chunks of whole 24-column groups, which the caller and the
 * workers claim one at a time. Which thread computes a column never changes its bits, so
 * the claiming may be as dynamic as it likes: a worker that is descheduled (a busy
 * machine) or asleep simply gets fewer chunks, and the caller never waits for work that
 * nobody has started. */
static void run_columns(const struct job *j, int n0, int n1) {
    (j->fmt ? run_q : j->trans_b ? run_nt : run_nn)(j, n0, n1);
}

#define TICKET(gen, next, count) ((uint64_t)(gen) << 32 | (uint64_t)(next) << 16 | (uint64_t)(count))
#define GEN(t) ((uint32_t)((t) >> 32))

static struct {
    pthread_mutex_t call;       /* one pooled call at a time; a concurrent caller runs inline */
    pthread_mutex_t sleep_lock; /* with `wake`: idle workers sleep here */
    pthread_cond_t wake;
    pthread_once_t once;
    int threads;                /* caller included */
    int chunk;                  /* columns (items) per chunk of the current call */
    int items;                  /* its columns (items) */
    void (*fn)(void *, int, int); /* exact_parallel_for's function over items [first, last), or NULL: `job` */
    void *ctx;
    int solo;                   /* calls the caller computes alone before trying the workers again */
    double waste;               /* the recent pooled calls' mean fraction spent waiting for workers */
    struct job job;             /* the current call */
    atomic_int sleepers;        /* workers asleep (or about to be) */
    /* Written while the others compute: lines of their own, away from `job`. */
    _Alignas(64) _Atomic uint64_t ticket; /* call generation << 32 | next chunk << 16 | chunks */
    _Alignas(64) atomic_int done;         /* chunks of the current call finished */
    char pad[60];
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .sleep_lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .once = PTHREAD_ONCE_INIT};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claim and compute chunks of call `gen` until none is left. A claim succeeds only while
 * the ticket still belongs to `gen`, and a call is not over (its job not replaced) until
 * every claimed chunk is done, so a late worker can never compute a stale job. */
static void work(uint32_t gen) {
    uint64_t t = atomic_load(&pool.ticket);
    for (;;) {
        int next = (int)(t >> 16 & 0xffff), count = (int)(t & 0xffff);
        if (GEN(t) != gen || next >= count)
            return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + (1u << 16)))
            continue; /* t now holds the current ticket */
        struct job j = pool.job; /* a private copy: the tiles read it in their loops */
        int n0 = next * pool.chunk, n1 = n0 + pool.chunk < pool.items ? n0 + pool.chunk : pool.items;
        if (pool.fn)
            pool.fn(pool.ctx, n0, n1);
        else
            run_columns(&j, n0, n1);
        atomic_fetch_add(&pool.done, 1);
        t = atomic_load(&pool.ticket);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = GEN(atomic_load(&pool.ticket));
    for (;;) {
        uint32_t gen;
        long start = now_ns();
        for (int spins = 1; (gen = GEN(atomic_load(&pool.ticket))) == seen; ++spins) {
            cpu_relax();
            if (spins % 256 == 0 && now_ns() - start > SPIN_NS)
                break;
        }
        if (gen == seen) { /* idle: sleep until a call wakes us (a missed wake-up only costs help) */
            pthread_mutex_lock(&pool.sleep_lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((gen = GEN(atomic_load(&pool.ticket))) == seen)
                pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.sleep_lock);
        }
        seen = gen;
        work(gen);
    }
    return NULL;
}

static int thread_count(void) {
    const char *env = getenv("EXACT_GEMM_NUM_THREADS");
    if (env && atoi(env) >= 1)
        return atoi(env) > 64 ? 64 : atoi(env);
    cpu_set_t set;
    int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 64 ? 64 : n;
}

static void start_pool(void) {
    pool.threads = thread_count();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* workers never take the process's signals */
    for (int i = 1; i < pool.threads; ++i) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker, NULL) != 0) {
            pool.threads = i;
            break;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

static void after_fork_in_child(void) { /* the workers did not survive the fork: start afresh */
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.once = (pthread_once_t)PTHREAD_ONCE_INIT;
    atomic_store(&pool.sleepers, 0);
}

static int shared(int n, int chunk, const struct job *j, void (*fn)(void *, int, int), void *ctx);

static void run(const struct job *j) {
    /* Small products (attention's per-head matmuls) are not worth sharing. */
    if ((double)j->m * j->n * j->k < 65536.0 || j->n < 48) {
        run_columns(j, 0, j->n);
        return;
    }
    pthread_once(&pool.once, start_pool);
    /* At least 4 chunks per thread (balance), each at most ~CHUNK_COST (few rows cost their
     * weight bytes, more rows their multiply-adds): a worker that loses its core mid-chunk
     * keeps the caller waiting for at most that much work (the caller yields meanwhile).
     * Whole tiles: 8 columns for one row, 24 (the 1x8 and xC tiles) otherwise. */
    long cols = CHUNK_COST / ((long)(j->m > 4 ? j->m : 4) * (j->k ? j->k : 1));
    long share = (j->n + 4L * pool.threads - 1) / (4L * pool.threads);
    long unit = j->m == 1 ? 8 : 24;
    cols = cols < share ? cols : share;
    if (!shared(j->n, (int)((cols + unit - 1) / unit * unit), j, NULL, NULL))
        run_columns(j, 0, j->n); /* another thread holds the pool, or the workers are late: same bits */
}

/* Items [0, n) in chunks of `chunk`, claimed by the caller and the workers: fn(ctx, ...) over
 * them, or `j`'s columns when fn is NULL. Returns 0, having computed nothing, when the pool
 * is another thread's or its workers kept losing their cores lately (the caller then does all). */
static int shared(int n, int chunk, const struct job *j, void (*fn)(void *, int, int), void *ctx) {
    pthread_once(&pool.once, start_pool);
    if (pool.threads == 1 || pthread_mutex_trylock(&pool.call) != 0)
        return 0;
    if (pool.solo > 0) { /* the workers lost their cores lately: do not wait on them */
        --pool.solo;
        pthread_mutex_unlock(&pool.call);
        return 0;
    }
    long start = now_ns();
    int count = (n + chunk - 1) / chunk;
    if (j)
        pool.job = *j;
    pool.items = n;
    pool.chunk = chunk;
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.done, 0);
    uint32_t gen = GEN(atomic_load(&pool.ticket)) + 1;
    atomic_store(&pool.ticket, TICKET(gen, 0, count)); /* publishes the call */
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
    work(gen);
    long own = now_ns();
    for (int spins = 1; atomic_load(&pool.done) < count; ++spins) /* chunks a worker still computes */
        if (spins % 1024 == 0)
            sched_yield();
        else
            cpu_relax();
    long end = now_ns();
    pool.waste += ((double)(end - own) / (double)(end - start > 0 ? end - start : 1) - pool.waste) / 16;
    if (pool.waste > WASTE_LIMIT)
        pool.solo = SOLO_CALLS; /* the workers keep losing their cores: a busy machine */
    pthread_mutex_unlock(&pool.call);
    return 1;
}

/* fn(ctx, first, last) over items [0, n), one item per claim, on this pool (the native
 * attention's (row, KV head) items between the products: the same threads, already awake).
 * Every item must be computed the same way whichever thread takes it. */
void exact_parallel_for(void (*fn)(void *, int, int), void *ctx, int n) {
    if (n > 1 && shared(n, 1 + (n - 1) / 0x8000, NULL, fn, ctx)) /* chunks: 16 bits of the ticket */
        return;
    if (n > 0)
        fn(ctx, 0, n);
}

/* ------------------------------------------------------------------------------- the entry */

/* Which column loops this process runs ("x86-64 AVX-512", "x86-64 AVX2+FMA", "arm64 NEON",
 * "portable"): the kernel harness prints it beside its digests. The bits never depend on it. */
const char *exact_gemm_variant(void) { return gemm_variant; }

__attribute__((constructor)) static void find_real_blas(void) {
    real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    int ours = order == ROW_MAJOR && trans_a == NO_TRANS && (trans_b == TRANS || trans_b == NO_TRANS);
    if (ours && (m <= EXACT_GEMM_MAX_ROWS || !real_sgemm)) {
        if (m <= 0 || n <= 0)
            return;
        struct job j = {trans_b == TRANS, m, n, k < 0 ? 0 : k, alpha, beta, a, b, c,
                        (size_t)lda, (size_t)ldb, (size_t)ldc};
        run(&j);
        return;
    }
    if (!real_sgemm) { /* preloaded without a BLAS after it, and a layout it does not compute */
        static const char msg[] = "exact_gemm: no cblas_sgemm to forward this call to\n";
        write(2, msg, sizeof msg - 1);
        abort();
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* C (m x n, row stride ldc) = A (m x k, row stride lda) . B^T, B given as n fp32 rows of k, ldb
 * apart, for any m: the B-transposed case of cblas_sgemm above, never forwarded to another BLAS
 * (the MLX extension's fp32 entry, native/exact_matmul.cpp: exact products need no LD_PRELOAD).
 * Returns 0, or -1 (nothing written) when a stride is too small. */
int exact_sgemm_nt(int m, int n, int k, const float *a, long lda, const float *b, long ldb, float *c, long ldc) {
    if (k < 0 || lda < k || ldb < k || ldc < n)
        return -1;
    if (m <= 0 || n <= 0)
        return 0;
    struct job j = {1, m, n, k, 1.0f, 0.0f, a, b, c, (size_t)lda, (size_t)ldb, (size_t)ldc};
    run(&j);
    return 0;
}

/* C (m x n, row stride ldc) = A (m x k, row stride lda) . W^T, W given as n rows of GGUF blocks
 * of type `fmt` (ggml_types.h: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), ldq
 * bytes apart: bitwise the fp32 cblas_sgemm above on gguf-py's dequantized W, for any m (the MLX
 * extension's entry). Returns 0, or -1 (nothing written) for another type, k not whole blocks
 * (32 weights, 256 for K-quants) or ldq too small. */
int exact_qgemm(int fmt, int m, int n, int k, const float *a, long lda, const void *q, long ldq, float *c, long ldc) {
    long row = ggml_row_bytes(fmt, k);
    if (row < 0 || ldq < row || lda < k || ldc < n)
        return -1;
    if (m <= 0 || n <= 0)
        return 0;
    if (k == 0) {
        for (int i = 0; i < m; ++i)
            memset(c + (size_t)i * ldc, 0, (size_t)n * sizeof *c);
        return 0;
    }
    struct job j = {1, m, n, k, 1.0f, 0.0f, a, NULL, c, (size_t)lda, 0, (size_t)ldc, fmt, q, (size_t)ldq};
    run(&j);
    return 0;
}
