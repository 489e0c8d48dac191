// exact_layer.h: a whole llama-family transformer block as one MLX node (CPU).
#pragma once

#include <vector>

#include "exact_attention.h"
#include "mlx/mlx.h"

namespace exact_layer {

// x (m, k) @ W.T into y (m, n): W fp32 rows (fmt 0) through the process's cblas_sgemm, or GGUF
// blocks (fmt 3 / 8) through exact_qgemm. Returns false if the kernel refused.
using Linear = bool (*)(int fmt, int m, int n, int k, const float* x, const void* w, long ldw, float* y);

struct Shape {  // static facts of a block
  int n_heads, n_kv, head_dim, hidden, inter;
  int rope_dims, rope_traditional;
  int fmt[4];  // qkv, o_proj, gate_up, down_proj: 0 fp32, else a ggml type exact_qgemm reads (ggml_types.h)
  float eps_in, eps_post, scale, rope_base, rope_scale;
  // What a model family adds (model/families/), each 0 or 1; their weights follow the six in this order:
  int qkv_bias = 0;        // a bias (q|k|v width) added to the q/k/v product (Qwen2)
  int qk_norm = 0;         // q and k heads RMS-normed before RoPE: q_norm, k_norm (head_dim each)
  int sandwich = 0;        // attention and MLP outputs RMS-normed before the residual: two (hidden)
  int gelu = 0;            // the MLP gate is GELU (tanh form, our own tanh) instead of SiLU
  int inv_freq_table = 0;  // RoPE's inverse frequencies given (rope_dims / 2; Llama 3 scaling), not from the base

  int extra_weights() const { return qkv_bias + 2 * qk_norm + 2 * sandwich + inv_freq_table; }
  bool operator==(const Shape&) const = default;
};

// block(h (1, R, hidden), [norm_in, qkv, o, norm_post, gate_up, down], caches [K_0, V_0, ...],
// shape, segments, linear) -> h' (1, R, hidden); the caches receive the rows in place.
mlx::core::array block(const mlx::core::array& h, const std::vector<mlx::core::array>& weights,
                       const std::vector<mlx::core::array>& caches, const Shape& shape,
                       const exact_attention::Segments& segments, Linear linear);

}  // namespace exact_layer
