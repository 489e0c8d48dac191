// exact_exp.h: e^x with the same bits on every machine (IEEE +, -, * and exact scaling only).
//
// glibc's expf picks FMA code by CPU, so a softmax or a SiLU through libm could differ between
// two machines of one deployment. Here: x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite, two-part
// ln2), e^r by its degree-7 Taylor polynomial (Horner), times 2^n. Within 2 ulp of e^x.
// Inline (the attention's softmax and the MLP's SiLU call it per element); built with
// -ffp-contract=off, so every product and sum is rounded separately. On x86-64, `exp8` computes
// 8 lanes at once where the CPU has AVX2, bit for bit the scalar function.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace exact_math {

inline float pow2(int n) {  // 2^n for -126 <= n <= 127, from its bits
  uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// p * 2^n with one rounding, as ldexp (p in [0.5, 2), n in [-151, 128]): exact while the
// result is normal; below, one exact scaling, then the one rounding into the subnormals.
inline float scale2(float p, int n) {
  if (n > 127)
    return (p * pow2(127)) * pow2(n - 127);
  if (n >= -126)
    return p * pow2(n);
  return (p * pow2(n + 64)) * pow2(-64);
}

// e^r for |r| <= ln2 / 2: its degree-7 Taylor polynomial by Horner, for a float or 8 lanes (T{} + c
// is c in every lane, exactly). Always inlined: in an AVX2 function it compiles as AVX2.
template <typename T>
__attribute__((always_inline)) inline T taylor7(T r) {
  T p = T{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p;
}

}  // namespace exact_math

inline float exact_exp(float x) {
  if (x < -104.0f)
    return 0.0f;
  if (x > 89.0f)
    return INFINITY;
  if (x != x)
    return x;
  float y = x * 1.44269504f + 0.5f;  // in [-149.5, 128.9]
  int n = static_cast<int>(y);       // toward zero; floor(y) below (|y| < 2^23: exact)
  if (static_cast<float>(n) > y)
    --n;
  float fn = static_cast<float>(n);
  float r = (x - fn * 0.693145752f) - fn * 1.42860677e-06f;
  return exact_math::scale2(exact_math::taylor7(r), n);
}

#if defined(__x86_64__)
// exact_exp 8 lanes at a time where the CPU has AVX2 (the same operations per lane, so the
// same bits: the softmax's exponents, the MLP's SiLU).
#include "exact_dot.h"

#define AVX2_TARGET __attribute__((target("avx2")))

namespace exact_math {

// Whether the 8-lane variants run: where the CPU has AVX2, unless a test turned them off to
// compare them with the portable code (`set_avx2`).
inline bool& avx2_enabled() {
  static bool on = __builtin_cpu_supports("avx2");
  return on;
}

inline bool has_avx2() { return avx2_enabled(); }

inline bool set_avx2(bool on) {  // returns the previous setting; on = false: portable code only
  bool previous = avx2_enabled();
  avx2_enabled() = on && __builtin_cpu_supports("avx2");
  return previous;
}

typedef int32_t v8i __attribute__((vector_size(32)));

AVX2_TARGET inline v8 pow2_8(v8i n) {  // 2^n per lane, from its bits (lanes out of [-126, 127] are garbage)
  v8i bits = (n + 127) << 23;
  v8 f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

AVX2_TARGET inline v8 select(v8i mask, v8 a, v8 b) {  // a where mask (-1), else b
  v8i ai, bi;
  std::memcpy(&ai, &a, sizeof ai);
  std::memcpy(&bi, &b, sizeof bi);
  v8i r = (ai & mask) | (bi & ~mask);
  v8 f;
  std::memcpy(&f, &r, sizeof f);
  return f;
}

// exact_exp (exact_exp.h) in each lane: the same operations, the branches as selects.
AVX2_TARGET inline v8 exp8(v8 x) {
  v8i ok = (x >= -104.0f) & (x <= 89.0f);  // false for NaN too
  v8 xc = select(ok, x, v8{});              // keep the conversion in range
  v8 y = xc * 1.44269504f + 0.5f;
  v8i n = __builtin_convertvector(y, v8i);  // toward zero, then floor
  n = n + (__builtin_convertvector(n, v8) > y);
  v8 fn = __builtin_convertvector(n, v8);
  v8 r = (xc - fn * 0.693145752f) - fn * 1.42860677e-06f;
  v8 p = taylor7(r);
  v8 big = (p * pow2_8(v8i{} + 127)) * pow2_8(n - 127), normal = p * pow2_8(n),
     tiny = (p * pow2_8(n + 64)) * pow2_8(v8i{} - 64);  // exact_math::scale2's three cases
  v8 e = select(n > 127, big, select(n >= -126, normal, tiny));
  v8 special = select(x < -104.0f, v8{}, select(x > 89.0f, splat8(INFINITY), x));  // 0, inf, NaN
  return select(ok, e, special);
}

}  // namespace exact_math
#endif
