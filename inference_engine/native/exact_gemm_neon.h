/*
 * exact_gemm_neon.h: exact_gemm.c's column loops for arm64 (Apple Silicon, Graviton), in NEON.
 *
 * Included by exact_gemm.c on AArch64 only, after the portable instantiation. The tiles are the
 * shared exact_tiles.h / exact_qtiles.h, so every element is the same chain of operations as on
 * x86-64; what NEON changes is only the instructions that carry them:
 * - STEP: an 8-lane accumulator is two float32x4_t, each step two vfmaq_f32 (one rounding per
 *   lane, IEEE 754's fused multiply-add, like _mm256_fmadd_ps); hsum8's tree is unchanged;
 * - WIDEN_U8 / WIDEN_S8: vmovl (8 bytes -> 8 int32 lanes, exact);
 * - HALVES: vcvt_f32_f16 (every fp16 is a float: exact, like F16C's vcvtph2ps);
 * - Q4_1_GROUP: one vfmaq_f32 for d * q + m (d * q is exact, so the one rounding of the fused
 *   form is the converter's rounding of the sum: ggml_blocks.h).
 * EXACT_GEMM_PORTABLE=1 keeps the portable loops (the reference the harness compares with).
 */
#include <arm_neon.h>

INLINE float32x4x2_t neon_halves_of(v8 v) {
    float32x4x2_t h;
    memcpy(&h, &v, sizeof h);
    return h;
}

INLINE v8 neon_join(float32x4_t lo, float32x4_t hi) {
    float32x4x2_t h = {{lo, hi}};
    v8 v;
    memcpy(&v, &h, sizeof v);
    return v;
}

INLINE v8 fma8_neon(v8 acc, v8 x, v8 w) { /* lane by lane acc + x * w, one rounding each */
    float32x4x2_t a = neon_halves_of(acc), xs = neon_halves_of(x), ws = neon_halves_of(w);
    return neon_join(vfmaq_f32(a.val[0], xs.val[0], ws.val[0]), vfmaq_f32(a.val[1], xs.val[1], ws.val[1]));
}

INLINE v8i neon_join_i(int32x4_t lo, int32x4_t hi) {
    int32x4x2_t h = {{lo, hi}};
    v8i v;
    memcpy(&v, &h, sizeof v);
    return v;
}

INLINE v8i widen_u8_neon(const uint8_t *p) {
    uint16x8_t w = vmovl_u8(vld1_u8(p));
    return neon_join_i(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(w))),
                       vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(w))));
}

INLINE v8i widen_s8_neon(const uint8_t *p) {
    int16x8_t w = vmovl_s8(vld1_s8((const int8_t *)p));
    return neon_join_i(vmovl_s16(vget_low_s16(w)), vmovl_s16(vget_high_s16(w)));
}

INLINE void halves_neon(const uint8_t *p, v8 *a, v8 *b) {
    uint16_t bits[4] = {0, 0, 0, 0};
    memcpy(bits, p, 4);
    float32x4_t f = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(bits))); /* exact: every fp16 is a float */
    float32x4_t d = vdupq_laneq_f32(f, 0), m = vdupq_laneq_f32(f, 1);
    *a = neon_join(d, d);
    *b = neon_join(m, m);
}

INLINE v8 q4_1_group_neon(v8 d, v8 m, v8i nibbles) { /* d * q exact, so fused = the converter's bits */
    v8 q = __builtin_convertvector(nibbles, v8);
    return fma8_neon(m, d, q);
}

#define QV(name) name##_neon
#define QTARGET
#define STEP fma8_neon
#define WIDEN_U8 widen_u8_neon
#define WIDEN_S8 widen_s8_neon
#define HALVES halves_neon
#define Q4_1_GROUP q4_1_group_neon
#include "exact_tiles.h"
#include "exact_qtiles.h"
#include "exact_kqtiles.h" /* F16 .. Q6_K: the portable decode code, NEON steps */
#undef QV
#undef QTARGET
#undef STEP
#undef WIDEN_U8
#undef WIDEN_S8
#undef HALVES
#undef Q4_1_GROUP

__attribute__((constructor)) static void choose_columns(void) {
    if (getenv("EXACT_GEMM_PORTABLE")) /* tests: the portable loops, for their bits */
        return;
    run_nt = run_nt_neon;
    run_nn = run_nn_neon;
    run_q = run_q_neon;
    gemm_variant = "arm64 NEON";
}
