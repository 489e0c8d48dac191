/*
 * exact_dot.h: the whole per-element arithmetic of the exact kernels, in one place.
 *
 * Every output element is one dot product reduced in a fixed order: lane j of an 8-lane
 * accumulator sums a[k]*w[k] for k = j, j+8, ... in increasing k, a zero-padded last step for
 * K % 8, then the lanes are added in one fixed tree (hsum8). Two step functions:
 * - fma_step, the exact-gemm kernel's (every matmul of the model): each product and sum
 *   rounded once, IEEE 754's fused multiply-add, whose result is defined to the bit, so every
 *   CPU gives the same bits: built for FMA (exact_gemm.c's avx2+fma and AVX-512 variants,
 *   AArch64) it is one vfmadd / fmla per 8 lanes; elsewhere libm's correctly rounded fmaf
 *   lane by lane (slow, never different). A fused step is one instruction where the two
 *   roundings took two, and a few-row block of q4_1 rows is bound by those instructions.
 * - dot_step, attention's scores and RMSNorm's sum of squares (exact_attention, exact_layer):
 *   the product and the sum rounded separately, as their portable paths do.
 * Everything is built with -ffp-contract=off: no multiply and add is ever fused implicitly.
 * exact_gemm.c computes fp32 weights with these functions and the quantized weights
 * (ggml_blocks.h, dequantized exactly as the converter does) with the very same ones, so a
 * quantized product equals the fp32 product of the dequantized weights by construction, not
 * by testing alone.
 */
#ifndef EXACT_DOT_H
#define EXACT_DOT_H

#include <float.h>
#include <string.h>

#if FLT_EVAL_METHOD != 0
#error "exact_gemm needs fp32 arithmetic without excess precision"
#endif

#define INLINE static inline __attribute__((always_inline))

typedef float v8 __attribute__((vector_size(32)));

INLINE v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE v8 load_tail(const float *p, int n) { /* n < 8 floats, zero-padded */
    v8 v = {0};
    for (int j = 0; j < n; ++j)
        v[j] = p[j];
    return v;
}

INLINE v8 splat8(float s) { return (v8){s, s, s, s, s, s, s, s}; }

INLINE v8 dot_step(v8 acc, v8 x, v8 w) { return acc + x * w; } /* two roundings, never fused */

#if defined(__aarch64__)
#include <arm_neon.h>
INLINE v8 fma_step(v8 acc, v8 x, v8 w) { /* one rounding: two NEON fmla (GCC leaves the lane loop scalar) */
    float32x4_t a[2], xs[2], ws[2];
    memcpy(a, &acc, sizeof a);
    memcpy(xs, &x, sizeof xs);
    memcpy(ws, &w, sizeof ws);
    a[0] = vfmaq_f32(a[0], xs[0], ws[0]);
    a[1] = vfmaq_f32(a[1], xs[1], ws[1]);
    memcpy(&acc, a, sizeof a);
    return acc;
}
#else
INLINE v8 fma_step(v8 acc, v8 x, v8 w) { /* one rounding: lane by lane (x86-64's variants use their own instruction) */
    v8 r;
    for (int l = 0; l < 8; ++l)
        r[l] = __builtin_fmaf(x[l], w[l], acc[l]);
    return r;
}
#endif

INLINE float hsum8(v8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

INLINE float scale_add(float s, float alpha, float beta, const float *c) {
    if (alpha != 1.0f)
        s = alpha * s;
    return beta == 0.0f ? s : s + beta * *c; /* beta == 0: C may be fresh memory (NaN), never read */
}

#endif
