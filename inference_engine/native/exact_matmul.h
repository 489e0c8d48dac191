// exact_matmul.h: x @ W.T for fp32 W as an MLX primitive, computed by the exact-gemm library.
#pragma once

#include "mlx/mlx.h"

namespace exact_matmul {

// exact_sgemm_nt of the exact-gemm library: C (m, n) = A (m, k) . B^T for any m; 0, or -1 if refused.
using Gemm = int (*)(int m, int n, int k, const float* a, long lda, const float* b, long ldb, float* c, long ldc);

void bind(Gemm gemm);  // compute with `gemm` from now on (exact_quant.cpp's bind_kernel)
bool is_bound();

// y (m, n) = x (m, k) @ w (n, k).T through the bound kernel; false if unbound or refused.
bool rows(int m, int n, int k, const float* x, const float* w, long ldw, float* y);

// x (..., K) float32 @ w (N, K) float32 .T -> (..., N), a node on MLX's default (CPU) stream.
mlx::core::array matmul(const mlx::core::array& x, const mlx::core::array& w);

}  // namespace exact_matmul
