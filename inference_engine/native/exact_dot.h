/*
 * exact_dot.h: the whole per-element arithmetic of the exact-gemm kernel, in one place.
 *
 * Every output element is one dot product reduced in a fixed order: lane j of an 8-lane
 * accumulator sums a[k]*w[k] for k = j, j+8, ... in increasing k, each product and each sum
 * rounded separately (no FMA: built with -ffp-contract=off), a zero-padded last step for
 * K % 8, then the lanes are added in one fixed tree. exact_gemm.c computes fp32 weights
 * with these functions and the quantized weights (ggml_blocks.h, dequantized exactly as the
 * converter does) with the very same ones, so a quantized product equals the fp32 product
 * of the dequantized weights by construction, not by testing alone.
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

INLINE float hsum8(v8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

INLINE float scale_add(float s, float alpha, float beta, const float *c) {
    if (alpha != 1.0f)
        s = alpha * s;
    return beta == 0.0f ? s : s + beta * *c; /* beta == 0: C may be fresh memory (NaN), never read */
}

#endif
