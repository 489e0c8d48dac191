// exact_attention_avx2.h: one (row, KV head)'s attention in 8-lane AVX2 registers.
//
// The same arithmetic as exact_attention.cpp's portable code, element for element, so the
// same bits (tests/test_exact_attention.py compares the two, `set_avx2`): each score is exact_dot.h's dot (lane j sums k = j,
// j + 8, ... in order, then hsum8), e = exact_exp(s - max) lane by lane, a sum in position
// order, one division per weight, and each output lane sums w_t * v_t from 0 in position
// order. What AVX2 changes is only how many of those operations one instruction carries: a
// 64-float value row is 8 registers (SSE needs 16 and spills), and the softmax's exponent runs
// 8 positions at a time. Built with -ffp-contract=off: no fused multiply-add.
#pragma once

#if defined(__x86_64__)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exact_dot.h"
#include "exact_exp.h"

namespace exact_attention::avx2 {

using exact_math::exp8;

// Scores of H (<= 4) query heads (q: H rows of d) against the keys at rows t and t + 1 of
// `visible`, into s[i * n + t]: the key rows are read once for all heads.
template <int H>
AVX2_TARGET inline void score_pair(const float* q, int d, const float* kh, const int* visible, int t, int n,
                                   float* s) {
  const float* k0 = kh + static_cast<int64_t>(visible[t]) * d;
  const float* k1 = kh + static_cast<int64_t>(visible[t + 1]) * d;
  v8 a0[H], a1[H];
#pragma GCC unroll 4
  for (int i = 0; i < H; ++i)
    a0[i] = a1[i] = v8{};
  int full = d / 8 * 8;
  for (int l = 0; l < full; l += 8) {
    v8 x0 = load8(k0 + l), x1 = load8(k1 + l);
#pragma GCC unroll 4
    for (int i = 0; i < H; ++i) {
      v8 qi = load8(q + static_cast<int64_t>(i) * d + l);
      a0[i] = dot_step(a0[i], qi, x0);
      a1[i] = dot_step(a1[i], qi, x1);
    }
  }
  if (full < d) {
    v8 x0 = load_tail(k0 + full, d - full), x1 = load_tail(k1 + full, d - full);
#pragma GCC unroll 4
    for (int i = 0; i < H; ++i) {
      v8 qi = load_tail(q + static_cast<int64_t>(i) * d + full, d - full);
      a0[i] = dot_step(a0[i], qi, x0);
      a1[i] = dot_step(a1[i], qi, x1);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < H; ++i) {
    s[static_cast<size_t>(i) * n + t] = hsum8(a0[i]);
    s[static_cast<size_t>(i) * n + t + 1] = hsum8(a1[i]);
  }
}

template <int H>
AVX2_TARGET void scores(const float* q, int d, const float* kh, const int* visible, int n, float* s) {
  int t = 0;
  for (; t + 2 <= n; t += 2)
    score_pair<H>(q, d, kh, visible, t, n, s);
  if (t < n) {  // the last key alone: its pair partner is itself, written twice with the same bits
    const int last[2] = {visible[t], visible[t]};
    float pair[2 * H];
    score_pair<H>(q, d, kh, last, 0, 2, pair);
    for (int i = 0; i < H; ++i)
      s[static_cast<size_t>(i) * n + t] = pair[2 * i];
  }
}

// o[0..64) = sum over t < n, in order, of w[t] * v_t[l] (from 0), 8 registers.
AVX2_TARGET inline void weighted_sum64(const float* w, const float* v, const int* visible, int n, int d, float* o) {
  v8 a[8];
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c)
    a[c] = v8{};
  for (int t = 0; t < n; ++t) {
    const float* vt = v + static_cast<int64_t>(visible[t]) * d;
    v8 wt = splat8(w[t]);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
      a[c] = a[c] + wt * load8(vt + 8 * c);
  }
  std::memcpy(o, a, sizeof a);
}

// One (row, KV head): q holds its `rep` query heads (rep rows of d), kh / vh its keys and
// values, visible the slots it sees in position order; out receives rep rows of d.
AVX2_TARGET void attend(const int* visible, int n, const float* q, int rep, int d, const float* kh,
                        const float* vh, float* out, std::vector<float>& w) {
  w.resize(static_cast<size_t>(rep) * n + 8);
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
    for (; t + 8 <= n; t += 8) {
      v8 e = exp8(load8(wi + t) - top);
      std::memcpy(wi + t, &e, sizeof e);
    }
    for (; t < n; ++t)
      wi[t] = exact_exp(wi[t] - top);
    float sum = 0.0f;
    for (t = 0; t < n; ++t)
      sum += wi[t];
    for (t = 0; t + 8 <= n; t += 8) {
      v8 e = load8(wi + t) / sum;
      std::memcpy(wi + t, &e, sizeof e);
    }
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

inline bool supported() {
  return exact_math::has_avx2();
}

}  // namespace exact_attention::avx2
#endif
