/*
 * ggml_blocks.h: GGUF's Q4_1 and Q8_0 blocks dequantized with exactly the converter's arithmetic.
 *
 * The fp32 model we serve was made by gguf-py (model/gguf_convert.py), in numpy fp32:
 *   Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; weight i < 16 is the low nibble of
 *         byte i, weight 16 + i its high nibble):  w = (float(d) * float(q)) + float(m)
 *   Q8_0 (34 bytes: fp16 d, 32 int8):               w = float(q) * float(d)
 * Each operation rounds to fp32 once, in that order. Here: the same operations on 8 weights
 * at a time (d * q is exact in fp32, an 11-bit by 4- or 8-bit product, so its rounding is
 * moot, and the `+ m` rounds exactly once as numpy's does), separately rounded (no FMA), so
 * every weight is bitwise the served fp32 weight.
 */
#ifndef GGML_BLOCKS_H
#define GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "exact_dot.h"

enum { GGML_Q4_1 = 3, GGML_Q8_0 = 8 }; /* ggml's type ids */
#define GGML_QK 32                     /* weights per block, both formats */
#define Q4_1_BYTES 20 /* fp16 d, fp16 m, 16 bytes of nibbles */
#define Q8_0_BYTES 34 /* fp16 d, 32 int8 */
#define Q4_1_NIBBLES 4 /* offset of the nibble bytes in a Q4_1 block */
#define Q8_0_INTS 2    /* offset of the int8s in a Q8_0 block */

typedef int32_t v8i __attribute__((vector_size(32)));

INLINE int ggml_block_bytes(int fmt) { return fmt == GGML_Q4_1 ? Q4_1_BYTES : fmt == GGML_Q8_0 ? Q8_0_BYTES : 0; }

/* IEEE fp16 -> fp32, exact for every input (numpy's astype(np.float32)); integer-only, so
 * a denormals-are-zero mode cannot touch it. */
INLINE float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = h >> 10 & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 31) /* inf / nan */
        bits = sign | 0x7f800000u | mant << 13;
    else if (exp != 0) /* normal: rebias the exponent (15 -> 127) */
        bits = sign | (exp + 112) << 23 | mant << 13;
    else if (mant == 0) /* signed zero */
        bits = sign;
    else { /* subnormal half: a normal float */
        exp = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            --exp;
        }
        bits = sign | exp << 23 | (mant & 0x3ffu) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 weights of a Q4_1 block, given its d and m (half_to_float, in every lane) and their
 * nibbles widened to int32 lanes (the caller's instructions do both; exact_qtiles.h's
 * QV(block) has the nibble order). d * q is exact in fp32 (an 11-bit by 4-bit significand
 * product, far from under- or overflow), so rounding d * q + m once, as a fused multiply-add
 * does, gives these very bits: the AVX2 variant uses one (exact_gemm.c). */
INLINE v8 q4_1_group(v8 d, v8 m, v8i nibbles) { return d * __builtin_convertvector(nibbles, v8) + m; }

/* The 32 weights of a Q8_0 block as 4 vectors, given its d (in every lane) and its int8s
 * sign-extended to int32 lanes. */
INLINE v8 q8_0_group(v8 d, v8i q) { return __builtin_convertvector(q, v8) * d; }

INLINE void q8_0_weights(v8 d, const v8i q[4], v8 w[4]) {
    for (int g = 0; g < 4; ++g)
        w[g] = q8_0_group(d, q[g]);
}

#endif
