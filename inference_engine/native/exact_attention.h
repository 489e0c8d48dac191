// exact_attention.h: one MLX node for a layer's attention over the rows of many sessions.
#pragma once

#include <vector>

#include "mlx/mlx.h"

namespace exact_attention {

// Per segment (one session's consecutive rows): its first row's global position, its rows,
// and its cache layout (sinks, window, ring slots: verifier/kv_cache.py CacheGeometry).
struct Segments {
  std::vector<int> starts, rows, sinks, windows, rings;
};

// attend(q (R, n_kv, rep, D), k (n_kv, R, D), v (n_kv, R, D), caches [K_0, V_0, K_1, V_1, ...]
// each (n_kv, sink + ring, D) float32 materialized storage, segments) -> attn (R, n_kv, rep, D).
// When it runs, the node first writes each segment's rows into its caches in place (at
// their slots), then computes every row's attention.
mlx::core::array attend(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                     const std::vector<mlx::core::array>& caches, const Segments& segments);

}  // namespace exact_attention
