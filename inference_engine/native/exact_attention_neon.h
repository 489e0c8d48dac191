// exact_attention_neon.h: one (row, KV head)'s attention in NEON registers, for arm64.
//
// The same arithmetic as exact_attention_row.h's portable code and exact_attention_avx2.h,
// element for element, so the same bits: each score is exact_dot.h's 8-lane dot (held as two
// float32x4_t, lo = lanes 0..3, hi = 4..7; lane j sums k = j, j + 8, ... in order, each
// product and sum rounded separately: vmulq then vaddq, never vfmaq; then hsum8's tree),
// e = exact_exp(s - max) four lanes at a time (exact_exp_neon.h), a sum in position order, one
// division per weight, and each output lane sums w_t * v_t from 0 in position order. NEON's 32
// registers hold a 64-float value row (16 accumulators) and four heads' scores per key row.
#pragma once

#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exact_exp_neon.h"

namespace exact_attention::neon {

// Scores of H (<= 4) query heads (q: H rows of d) against every visible key, into s[i * n + t]:
// each key row is read once for all H heads.
template <int H>
inline void scores(const float* q, int d, const float* kh, const int* visible, int n, float* s) {
  const int full = d / 8 * 8;
  float qt[H][8] = {}, kt[8];  // the zero-padded last step (load_tail)
  for (int i = 0; i < H; ++i)
    std::memcpy(qt[i], q + static_cast<int64_t>(i) * d + full, sizeof(float) * (d - full));
  for (int t = 0; t < n; ++t) {
    const float* k = kh + static_cast<int64_t>(visible[t]) * d;
    float32x4_t lo[H], hi[H];
    for (int i = 0; i < H; ++i)
      lo[i] = hi[i] = vdupq_n_f32(0.0f);
    for (int l = 0; l < full; l += 8) {
      float32x4_t k0 = vld1q_f32(k + l), k1 = vld1q_f32(k + l + 4);
      for (int i = 0; i < H; ++i) {
        const float* qi = q + static_cast<int64_t>(i) * d + l;
        lo[i] = vaddq_f32(lo[i], vmulq_f32(vld1q_f32(qi), k0));
        hi[i] = vaddq_f32(hi[i], vmulq_f32(vld1q_f32(qi + 4), k1));
      }
    }
    if (full < d) {
      std::memset(kt, 0, sizeof kt);
      std::memcpy(kt, k + full, sizeof(float) * (d - full));
      float32x4_t k0 = vld1q_f32(kt), k1 = vld1q_f32(kt + 4);
      for (int i = 0; i < H; ++i) {
        lo[i] = vaddq_f32(lo[i], vmulq_f32(vld1q_f32(qt[i]), k0));
        hi[i] = vaddq_f32(hi[i], vmulq_f32(vld1q_f32(qt[i] + 4), k1));
      }
    }
    for (int i = 0; i < H; ++i) {
      float32x4_t p = vaddq_f32(lo[i], hi[i]);  // lanes (v0 + v4), (v1 + v5), (v2 + v6), (v3 + v7)
      s[static_cast<size_t>(i) * n + t] =
          (vgetq_lane_f32(p, 0) + vgetq_lane_f32(p, 2)) + (vgetq_lane_f32(p, 1) + vgetq_lane_f32(p, 3));
    }
  }
}

// o[0..64) = sum over t < n, in order, of w[t] * v_t[l] (from 0), 16 registers.
inline void weighted_sum64(const float* w, const float* v, const int* visible, int n, int d, float* o) {
  float32x4_t a[16];
  for (int c = 0; c < 16; ++c)
    a[c] = vdupq_n_f32(0.0f);
  for (int t = 0; t < n; ++t) {
    const float* vt = v + static_cast<int64_t>(visible[t]) * d;
    float32x4_t wt = vdupq_n_f32(w[t]);
    for (int c = 0; c < 16; ++c)
      a[c] = vaddq_f32(a[c], vmulq_f32(wt, vld1q_f32(vt + 4 * c)));
  }
  for (int c = 0; c < 16; ++c)
    vst1q_f32(o + 4 * c, a[c]);
}

// One (row, KV head): q holds its `rep` query heads (rep rows of d), kh / vh its keys and
// values, visible the slots it sees in position order; out receives rep rows of d.
inline void attend(const int* visible, int n, const float* q, int rep, int d, const float* kh, const float* vh,
                   float* out, std::vector<float>& w) {
  w.resize(static_cast<size_t>(rep) * n);
  for (int i = 0; i < rep; i += 4) {
    const float* qi = q + static_cast<int64_t>(i) * d;
    float* s = w.data() + static_cast<size_t>(i) * n;
    switch (rep - i < 4 ? rep - i : 4) {
      case 1: scores<1>(qi, d, kh, visible, n, s); break;
      case 2: scores<2>(qi, d, kh, visible, n, s); break;
      case 3: scores<3>(qi, d, kh, visible, n, s); break;
      default: scores<4>(qi, d, kh, visible, n, s); break;
    }
  }
  for (int i = 0; i < rep; ++i) {
    float* wi = w.data() + static_cast<size_t>(i) * n;
    float top = -INFINITY;
    for (int t = 0; t < n; ++t)
      top = std::max(top, wi[t]);
    int t = 0;
    for (; t + 4 <= n; t += 4)
      vst1q_f32(wi + t, exact_math::neon::exp4(vsubq_f32(vld1q_f32(wi + t), vdupq_n_f32(top))));
    for (; t < n; ++t)
      wi[t] = exact_exp(wi[t] - top);
    float sum = 0.0f;
    for (t = 0; t < n; ++t)
      sum += wi[t];
    float32x4_t total = vdupq_n_f32(sum);
    for (t = 0; t + 4 <= n; t += 4)
      vst1q_f32(wi + t, vdivq_f32(vld1q_f32(wi + t), total));
    for (; t < n; ++t)
      wi[t] = wi[t] / sum;
    float* o = out + static_cast<int64_t>(i) * d;
    int l = 0;
    for (; l + 64 <= d; l += 64)
      weighted_sum64(wi, vh + l, visible, n, d, o + l);
    for (; l < d; ++l) {
      float acc = 0.0f;
      for (int t2 = 0; t2 < n; ++t2)
        acc = acc + wi[t2] * vh[static_cast<int64_t>(visible[t2]) * d + l];
      o[l] = acc;
    }
  }
}

inline bool supported() { return exact_math::neon::enabled(); }

}  // namespace exact_attention::neon
#endif
