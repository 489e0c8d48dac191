// exact_exp_neon.h: exact_exp (exact_exp.h) four lanes at a time in NEON, for arm64.
//
// The same operations per lane as the scalar function and x86-64's exp8, in the same order,
// each rounded separately (no vfmaq: exact_exp has no fused step), the branches as selects:
// so the same bits. vcvtq_s32_f32 truncates toward zero like static_cast<int>; the floor's
// correction, the Cody-Waite reduction, the Horner polynomial and the three scalings of
// exact_math::scale2 follow exact_exp.h line by line.
#pragma once

#if defined(__aarch64__)
#include <arm_neon.h>

#include <cmath>

#include "exact_exp.h"

namespace exact_math::neon {

// Whether the NEON variants of the softmax, SiLU and attention loops run: on by default, off
// where a test compares them with the portable code (`set_enabled`).
inline bool& enabled() {
  static bool on = true;
  return on;
}

inline bool set_enabled(bool on) {  // returns the previous setting
  bool previous = enabled();
  enabled() = on;
  return previous;
}

inline float32x4_t pow2_4(int32x4_t n) {  // 2^n per lane from its bits (lanes out of [-126, 127] are garbage)
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23));
}

inline float32x4_t horner(float32x4_t p, float32x4_t r, float c) {  // p * r + c, two roundings
  return vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(c));
}

inline float32x4_t exp4(float32x4_t x) {
  uint32x4_t ok = vandq_u32(vcgeq_f32(x, vdupq_n_f32(-104.0f)), vcleq_f32(x, vdupq_n_f32(89.0f)));  // false for NaN
  float32x4_t xc = vbslq_f32(ok, x, vdupq_n_f32(0.0f));  // keep the conversion in range
  float32x4_t y = vaddq_f32(vmulq_f32(xc, vdupq_n_f32(1.44269504f)), vdupq_n_f32(0.5f));
  int32x4_t n = vcvtq_s32_f32(y);  // toward zero, then floor
  n = vaddq_s32(n, vreinterpretq_s32_u32(vcgtq_f32(vcvtq_f32_s32(n), y)));
  float32x4_t fn = vcvtq_f32_s32(n);
  float32x4_t r = vsubq_f32(vsubq_f32(xc, vmulq_f32(fn, vdupq_n_f32(0.693145752f))),
                            vmulq_f32(fn, vdupq_n_f32(1.42860677e-06f)));
  float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);  // taylor7's Horner steps
  p = horner(p, r, 1.0f / 720.0f);
  p = horner(p, r, 1.0f / 120.0f);
  p = horner(p, r, 1.0f / 24.0f);
  p = horner(p, r, 1.0f / 6.0f);
  p = horner(p, r, 0.5f);
  p = horner(p, r, 1.0f);
  p = horner(p, r, 1.0f);
  float32x4_t big = vmulq_f32(vmulq_f32(p, pow2_4(vdupq_n_s32(127))), pow2_4(vsubq_s32(n, vdupq_n_s32(127))));
  float32x4_t normal = vmulq_f32(p, pow2_4(n));
  float32x4_t tiny = vmulq_f32(vmulq_f32(p, pow2_4(vaddq_s32(n, vdupq_n_s32(64)))), pow2_4(vdupq_n_s32(-64)));
  float32x4_t e = vbslq_f32(vcgtq_s32(n, vdupq_n_s32(127)), big,
                            vbslq_f32(vcgeq_s32(n, vdupq_n_s32(-126)), normal, tiny));
  float32x4_t special = vbslq_f32(vcltq_f32(x, vdupq_n_f32(-104.0f)), vdupq_n_f32(0.0f),
                                  vbslq_f32(vcgtq_f32(x, vdupq_n_f32(89.0f)), vdupq_n_f32(INFINITY), x));
  return vbslq_f32(ok, e, special);
}

}  // namespace exact_math::neon
#endif
