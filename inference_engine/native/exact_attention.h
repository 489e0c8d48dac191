// exact_attention.h: one MLX node for a layer's attention over the rows of many sessions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlx/mlx.h"

namespace exact_attention {

// Per segment (one session's consecutive rows): its first row's global position, its rows,
// and its cache layout (sinks, window, ring slots: execution/kv_cache.py CacheGeometry).
struct Segments {
  std::vector<int> starts, rows, sinks, windows, rings;
};

// A float array of up to 4 dimensions by its strides (elements).
struct View {
  const float* data;
  int64_t s0, s1, s2, s3;
  float at(int i, int j, int l) const { return data[i * s0 + j * s1 + l * s2]; }
  float at4(int i, int j, int l, int m) const { return data[i * s0 + j * s1 + l * s2 + m * s3]; }
};

// Runs fn(ctx, first, last) over items [0, n) on some threads (exact-gemm's exact_parallel_for).
using ParallelFor = void (*)(void (*fn)(void*, int, int), void* ctx, int n);

// Where the rows' (row, KV head) items run when there are enough of them: `fn`, or (nullptr,
// the default) threads started per call; returns the previous one. Which thread computes an
// item never changes its bits.
ParallelFor set_parallel_for(ParallelFor fn);

// What the node does when it runs: each segment's K/V rows (k, v: (n_kv, R, D)) written into
// its storage (storage[2s], storage[2s + 1]: (n_kv, sink + ring, D) each), then every row's
// attention from q (R, n_kv, rep, D) into out (R, n_kv, rep, D), row-major.
void write_and_attend(const Segments& seg, const std::vector<float*>& storage, View q, View k, View v, int rows,
                      int n_kv, int rep, int d, float* out);

// Throws std::invalid_argument("<who>: ...") unless `seg` describes `rows` rows in segments of
// at least one row, each with its K and V storage in `caches` (n_kv, sink + ring, d) float32
// and a ring that holds its window and rows.
void check_segments(const Segments& seg, const std::vector<mlx::core::array>& caches, int rows, int n_kv, int d,
                    const std::string& who);

// attend(q (R, n_kv, rep, D), k (n_kv, R, D), v (n_kv, R, D), caches [K_0, V_0, K_1, V_1, ...]
// each (n_kv, sink + ring, D) float32 materialized storage, segments) -> attn (R, n_kv, rep, D).
// When it runs, the node first writes each segment's rows into its caches in place (at
// their slots), then computes every row's attention.
mlx::core::array attend(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                     const std::vector<mlx::core::array>& caches, const Segments& segments);

}  // namespace exact_attention
