// exact_layer_math.h: a block's per-row arithmetic besides the products and the attention
// (RMSNorm, RoPE, SiLU, GELU with exact_tanh), free of MLX.
//
// exact_layer.cpp's node runs these; the kernel harness (tests/native/kernel_harness.cpp) calls
// them directly, so they are checked bitwise on x86-64 (AVX2 and portable) and on arm64 under
// qemu (NEON and portable). Built with -ffp-contract=off: every product and sum rounded separately.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "exact_dot.h"
#include "exact_exp.h"
#include "exact_exp_neon.h"

namespace exact_layer {

inline void rms_norm(const float* x, const float* w, float eps, int n, float* y) {
  int full = n / 8 * 8;
  v8 acc = {0};
  for (int l = 0; l < full; l += 8)
    acc = dot_step(acc, load8(x + l), load8(x + l));
  if (full < n)
    acc = dot_step(acc, load_tail(x + full, n - full), load_tail(x + full, n - full));
  float r = 1.0f / std::sqrt(hsum8(acc) / static_cast<float>(n) + eps);
  for (int l = 0; l < n; ++l)
    y[l] = (x[l] * r) * w[l];
}

// The row's rotation at `position`: cos and sin of position * inv_freq[i], in double, rounded
// to float (once per row: every head of the row turns by the same angles).
inline void angles(const std::vector<float>& inv_freq, float position, float* c, float* s) {
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    float theta = position * inv_freq[i];
    c[i] = static_cast<float>(std::cos(static_cast<double>(theta)));
    s[i] = static_cast<float>(std::sin(static_cast<double>(theta)));
  }
}

inline void rope(float* x, int dims, bool traditional, const float* cos, const float* sin) {
  int half = dims / 2;
  for (int i = 0; i < half; ++i) {
    float c = cos[i], s = sin[i];
    float* a = traditional ? x + 2 * i : x + i;
    float* b = traditional ? x + 2 * i + 1 : x + i + half;
    float x1 = *a, x2 = *b;
    *a = x1 * c - x2 * s;
    *b = x1 * s + x2 * c;
  }
}

// GELU, tanh form: (0.5 * g) * (1 + tanh(c * (g + 0.044715 * g^3))) * u, with our own tanh from
// exact_exp (1 - 2 / (exp(2t) + 1), t clamped to [-10, 10] where tanh rounds to +-1 in float):
// IEEE operations only, so every CPU gives the same bits.
inline float exact_tanh(float t) {
  t = t > 10.0f ? 10.0f : (t < -10.0f ? -10.0f : t);
  return 1.0f - 2.0f / (exact_exp(2.0f * t) + 1.0f);
}

inline void gelu(const float* g, const float* u, int n, float* act) {
  for (int l = 0; l < n; ++l) {
    float x = g[l];
    float inner = 0.7978845608f * (x + (0.044715f * x) * (x * x));
    act[l] = ((0.5f * x) * (1.0f + exact_tanh(inner))) * u[l];
  }
}

// act = g * (1 / (1 + exact_exp(-g))) * u, element by element; with AVX2 the first n / 8 * 8
// elements 8 at a time (the same operations per lane), the rest one by one.
#if defined(__x86_64__)
AVX2_TARGET inline int silu_avx2(const float* g, const float* u, int n, float* act) {
  int l = 0;
  for (; l + 8 <= n; l += 8) {
    v8 gl = load8(g + l);
    v8 a = (gl * (1.0f / (1.0f + exact_math::exp8(-gl)))) * load8(u + l);
    std::memcpy(act + l, &a, sizeof a);
  }
  return l;
}
#elif defined(__aarch64__)
inline int silu_neon(const float* g, const float* u, int n, float* act) {  // the same operations, 4 lanes at a time
  int l = 0;
  const float32x4_t one = vdupq_n_f32(1.0f);
  for (; l + 4 <= n; l += 4) {
    float32x4_t gl = vld1q_f32(g + l);
    float32x4_t sig = vdivq_f32(one, vaddq_f32(one, exact_math::neon::exp4(vnegq_f32(gl))));
    vst1q_f32(act + l, vmulq_f32(vmulq_f32(gl, sig), vld1q_f32(u + l)));
  }
  return l;
}
#endif

inline void silu(const float* g, const float* u, int n, float* act) {
  int l = 0;
#if defined(__x86_64__)
  if (exact_math::has_avx2())
    l = silu_avx2(g, u, n, act);
#elif defined(__aarch64__)
  if (exact_math::neon::enabled())
    l = silu_neon(g, u, n, act);
#endif
  for (; l < n; ++l)
    act[l] = (g[l] * (1.0f / (1.0f + exact_exp(-g[l])))) * u[l];
}

}  // namespace exact_layer
