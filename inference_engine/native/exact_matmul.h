// exact_matmul.h: x @ W.T for fp32 W as an MLX primitive, computed by the exact-gemm library.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"

namespace exact_matmul {

template <typename T>
struct Strided {  // an input as the dispatched task sees it: its data, shape and strides
  const T* data;
  bool contiguous;
  std::vector<int64_t> shape, strides;

  static Strided of(const mlx::core::array& a) {
    std::vector<int64_t> shape(a.shape().begin(), a.shape().end()), strides(a.strides().begin(), a.strides().end());
    return {a.data<T>(), a.flags().row_contiguous && a.data_size() == a.size(), shape, strides};
  }

  const T* packed(std::vector<T>& buf) const {  // row-major elements: the data itself, or a copy in `buf`
    if (contiguous)
      return data;
    size_t total = 1;
    for (auto e : shape)
      total *= static_cast<size_t>(e);
    buf.resize(total);
    std::vector<int64_t> index(shape.size(), 0);
    for (size_t i = 0; i < total; ++i) {
      int64_t at = 0;
      for (size_t d = 0; d < shape.size(); ++d)
        at += index[d] * strides[d];
      buf[i] = data[at];
      for (size_t d = shape.size(); d-- > 0;) {
        if (++index[d] < shape[d])
          break;
        index[d] = 0;
      }
    }
    return buf.data();
  }
};


// exact_sgemm_nt of the exact-gemm library: C (m, n) = A (m, k) . B^T for any m; 0, or -1 if refused.
using Gemm = int (*)(int m, int n, int k, const float* a, long lda, const float* b, long ldb, float* c, long ldc);

void bind(Gemm gemm);  // compute with `gemm` from now on (exact_quant.cpp's bind_kernel)
bool is_bound();

// y (m, n) = x (m, k) @ w (n, k).T through the bound kernel; false if unbound or refused.
bool rows(int m, int n, int k, const float* x, const float* w, long ldw, float* y);

// x (..., K) float32 @ w (N, K) float32 .T -> (..., N), a node on MLX's default (CPU) stream.
mlx::core::array matmul(const mlx::core::array& x, const mlx::core::array& w);

}  // namespace exact_matmul
