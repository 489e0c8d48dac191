// exact_attention_row.h: one (row, KV head)'s attention arithmetic, free of MLX.
//
// exact_attention.cpp's node computes every row with attend_row; the kernel harness
// (tests/native/kernel_harness.cpp) calls it directly, so the same code is checked bitwise on
// x86-64 (AVX2 and portable) and on arm64 under qemu (NEON and portable). Why its bits cannot
// depend on the row's companions, block or thread: exact_attention.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exact_attention_avx2.h"
#include "exact_attention_neon.h"
#include "exact_dot.h"
#include "exact_exp.h"

namespace exact_attention {

typedef float v4 __attribute__((vector_size(16)));

inline v4 load4(const float* p) {
  v4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exact_dot.h's 8-lane dot (lane j sums k = j, j + 8, ... in order; then hsum8's tree), held
// as two 4-lane halves so the accumulators stay in registers on SSE and NEON alike (GCC
// spills a generic 8-lane vector there): lo = lanes 0..3, hi = lanes 4..7; the same bits.
inline float dot8(const float* x, const float* y, int d) {
  v4 lo = {0, 0, 0, 0}, hi = {0, 0, 0, 0};
  int full = d / 8 * 8;
#pragma GCC unroll 8
  for (int l = 0; l < full; l += 8) {
    lo = lo + load4(x + l) * load4(y + l);
    hi = hi + load4(x + l + 4) * load4(y + l + 4);
  }
  if (full < d) {  // the zero-padded last step of load_tail
    float xs[8] = {0}, ys[8] = {0};
    std::memcpy(xs, x + full, sizeof(float) * (d - full));
    std::memcpy(ys, y + full, sizeof(float) * (d - full));
    lo = lo + load4(xs) * load4(ys);
    hi = hi + load4(xs + 4) * load4(ys + 4);
  }
  return ((lo[0] + hi[0]) + (lo[2] + hi[2])) + ((lo[1] + hi[1]) + (lo[3] + hi[3]));
}

// o[0..32) = sum over t < n, in order, of w[t] * v[rows[t] * d + l] (each product and sum
// rounded), starting from 0: eight 4-lane accumulators kept in registers (unrolled: as a loop
// GCC keeps them in memory, a store and reload on every t).
inline void weighted_sum32(const float* w, const float* v, const int* rows, int n, int d, float* o) {
  v4 a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int t = 0; t < n; ++t) {
    const float* vt = v + static_cast<int64_t>(rows[t]) * d;
    v4 wt = {w[t], w[t], w[t], w[t]};
    a0 = a0 + wt * load4(vt);
    a1 = a1 + wt * load4(vt + 4);
    a2 = a2 + wt * load4(vt + 8);
    a3 = a3 + wt * load4(vt + 12);
    a4 = a4 + wt * load4(vt + 16);
    a5 = a5 + wt * load4(vt + 20);
    a6 = a6 + wt * load4(vt + 24);
    a7 = a7 + wt * load4(vt + 28);
  }
  v4 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  std::memcpy(o, acc, sizeof acc);
}

struct Row {  // one query row: where it is and what it sees
  int position, cache, sink, window, ring;  // cache: index of its segment's K (2 * segment)
  int slot(int p) const { return p < sink ? p : sink + (p - sink) % ring; }
};

// Scores, softmax and weighted sum of one (row, KV head) for its `rep` query heads (q: rep
// rows of d). `w` holds the rep heads' scores side by side: each key row is read once for all.
inline void attend_row(const Row& row, int h, const float* q, int rep, int d, const float* keys, const float* values,
                int slots, float* out, std::vector<int>& visible, std::vector<float>& w) {
  visible.clear();
  for (int p = 0; p < std::min(row.sink, row.position + 1); ++p)
    visible.push_back(row.slot(p));
  for (int p = std::max(row.sink, row.position - row.window); p <= row.position; ++p)
    visible.push_back(row.slot(p));
  const float* kh = keys + static_cast<int64_t>(h) * slots * d;
  const float* vh = values + static_cast<int64_t>(h) * slots * d;
  int n = static_cast<int>(visible.size());
#if defined(__x86_64__)
  if (avx2::supported())  // the same operations, 8 lanes to an instruction
    return avx2::attend(visible.data(), n, q, rep, d, kh, vh, out, w);
#elif defined(__aarch64__)
  if (neon::supported())  // the same operations, 4 lanes to an instruction
    return neon::attend(visible.data(), n, q, rep, d, kh, vh, out, w);
#endif
  w.resize(static_cast<size_t>(rep) * n);
  for (int t = 0; t < n; ++t) {
    const float* kt = kh + static_cast<int64_t>(visible[t]) * d;
    for (int i = 0; i < rep; ++i)
      w[static_cast<size_t>(i) * n + t] = dot8(q + static_cast<int64_t>(i) * d, kt, d);
  }
  for (int i = 0; i < rep; ++i) {
    float* wi = w.data() + static_cast<size_t>(i) * n;
    float top = -INFINITY;
    for (int t = 0; t < n; ++t)
      top = std::max(top, wi[t]);
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) {
      wi[t] = exact_exp(wi[t] - top);
      sum += wi[t];
    }
    for (int t = 0; t < n; ++t)
      wi[t] = wi[t] / sum;
    float* o = out + static_cast<int64_t>(i) * d;
    // o[l] = sum over t, in position order, of w_t * v_t[l] (from 0): 32 l at a time in registers
    int l = 0;
    for (; l + 32 <= d; l += 32)
      weighted_sum32(wi, vh + l, visible.data(), n, d, o + l);
    for (; l < d; ++l) {
      float acc = 0.0f;
      for (int t = 0; t < n; ++t)
        acc = acc + wi[t] * vh[static_cast<int64_t>(visible[t]) * d + l];
      o[l] = acc;
    }
  }
}

}  // namespace exact_attention
