/*
 * ggml_kquants.h: the arithmetic of gguf-py's dequantization for F16, BF16, Q4_0, Q5_0, Q5_1,
 * Q4_K, Q5_K and Q6_K, 8 weights at a time (exact_kqtiles.h reads the bytes and calls these).
 *
 * What gguf-py (gguf/quants.py, numpy fp32) computes per weight, each operation rounded once,
 * in this order (the rule ggml_blocks.h keeps for Q4_1 / Q8_0):
 *   F16   fp16 -> fp32 (exact)                 BF16  bits << 16 (exact)
 *   Q4_0  d * float(q - 8)                     Q5_0  d * float(q - 16)
 *   Q5_1  (d * float(q)) + m
 *   Q4_K, Q5_K  (d * float(sc)) * float(q) - (dmin * float(mn)): sc, mn the sub-block's 6-bit scale and min
 *   Q6_K  (d * float(sc)) * float(q - 32): sc the 16-weight sub-block's int8 scale
 * d, m, dmin are fp16 converted exactly. Built with -ffp-contract=off, nothing here is fused, so
 * every weight is bitwise gguf-py's, whatever the instruction set the including tile is built for.
 * Only integer and IEEE fp32 vector operations: GCC's vector extensions give the portable path
 * (EXACT_GEMM_PORTABLE=1) and the AVX2 one from this same code; an arm64 port follows it as is.
 */
#ifndef GGML_KQUANTS_H
#define GGML_KQUANTS_H

#include <stdint.h>
#include <string.h>

#include "exact_dot.h"
#include "ggml_types.h"

typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

/* 8 fp16 (zero-extended to int32 lanes) as fp32, exactly (numpy's astype(np.float32)): normal
 * values rebias the exponent, subnormals are mant * 2^-24 (an exact product of a normal float
 * and a power of two, so a flush-to-zero mode cannot touch it), inf/nan keep their payload. */
INLINE v8 f16x8(v8i h) {
    v8i sign = (h & 0x8000) << 16, e = h >> 10 & 0x1f, mant = h & 0x3ff;
    v8i normal = sign | (e + 112) << 23 | mant << 13;
    v8i special = sign | 0x7f800000 | mant << 13;
    v8 tiny_f = __builtin_convertvector(mant, v8) * splat8(0x1p-24f);
    v8i tiny;
    memcpy(&tiny, &tiny_f, sizeof tiny);
    tiny |= sign;
    v8i is_special = e == 31, is_tiny = e == 0; /* -1 where true */
    v8i bits = (is_special & special) | (is_tiny & tiny) | (~(is_special | is_tiny) & normal);
    v8 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 bf16 (zero-extended) as fp32: the high half of the float's bits. */
INLINE v8 bf16x8(v8i h) {
    v8i bits = h << 16;
    v8 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 little-endian 16-bit values at p, zero-extended to int32 lanes. */
INLINE v8i widen_u16(const uint8_t *p) {
    v8u16 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, v8i);
}

/* The scales below come in every lane (the tiles' HALVES, or a product of two such vectors). */

/* d * float(q): Q4_0, Q5_0 (q already offset), and Q6_K's (d * sc) * float(q). */
INLINE v8 scaled_group(v8 d, v8i q) { return d * __builtin_convertvector(q, v8); }

/* (d * float(q)) + m: Q5_1 (Q4_1's arithmetic, two roundings). */
INLINE v8 affine_group(v8 d, v8 m, v8i q) { return d * __builtin_convertvector(q, v8) + m; }

/* (dd * float(q)) - dm: Q4_K and Q5_K, dd = d * sc and dm = dmin * mn already rounded. */
INLINE v8 kmin_group(v8 dd, v8 dm, v8i q) { return dd * __builtin_convertvector(q, v8) - dm; }

/* Sub-block j's (0..7) 6-bit scale and min of a Q4_K / Q5_K super-block (gguf-py's get_scale_min). */
INLINE void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | (s[j - 4] >> 2 & 0x30);
        *mn = (s[j + 4] >> 4) | (s[j] >> 2 & 0x30);
    }
}

/* Bits i .. i + 7 of the 32-bit little-endian word at p, one per lane (Q5_0 / Q5_1's fifth bits). */
INLINE v8i bits8(const uint8_t *p, int i) {
    uint32_t qh;
    memcpy(&qh, p, sizeof qh);
    v8i lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    return ((v8i){0} + (int32_t)(qh >> i)) >> lanes & 1; /* i <= 24: the shifted word fits 8 more bits */
}

#endif
