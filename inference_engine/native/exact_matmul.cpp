// exact_matmul: an MLX primitive computing x @ W.T for fp32 W with the exact-gemm library.
//
// Why: every exact product must be the exact-gemm kernel's (rows bitwise independent of their
// block, the same bits on every CPU), whatever BLAS MLX links or the process preloads. MLX's own
// matmul calls whatever cblas_sgemm the process resolves (the reference BLAS, OpenBLAS, or the
// launcher's LD_PRELOAD interposer), so fp32 products are a node of their own, like the GGUF
// blocks' (exact_quant.cpp): eval_cpu calls `exact_sgemm_nt` of the library bind_kernel
// dlopen()ed, on MLX's CPU stream. No LD_PRELOAD, no re-exec, the same on Linux and macOS.
// Built with -ffp-contract=off like the rest; the arithmetic is all in exact_gemm.c.

#include "exact_matmul.h"

#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace exact_matmul {
namespace {

Gemm kernel = nullptr;  // exact_sgemm_nt of the bound exact-gemm library

class ExactMatmul : public mx::UnaryPrimitive {
 public:
  explicit ExactMatmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int k = static_cast<int>(x.shape(-1)), n = static_cast<int>(w.shape(0));
    int m = static_cast<int>(x.size() / (k ? k : 1));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([m, n, k, x = Strided<float>::of(x), w = Strided<float>::of(w), c = out.data<float>()]() {
      std::vector<float> xbuf, wbuf;
      if (!rows(m, n, k, x.packed(xbuf), w.packed(wbuf), k, c))
        throw std::runtime_error("exact_sgemm_nt refused its arguments");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ExactMatmul has a CPU implementation only (exact products run on MLX's CPU stream)");
  }

  const char* name() const override { return "ExactMatmul"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

}  // namespace

void bind(Gemm gemm) { kernel = gemm; }

bool is_bound() { return kernel != nullptr; }

bool rows(int m, int n, int k, const float* x, const float* w, long ldw, float* y) {
  return kernel != nullptr && kernel(m, n, k, x, k, w, ldw, y, n) == 0;
}

mx::array matmul(const mx::array& x, const mx::array& w) {
  if (kernel == nullptr)
    throw std::runtime_error("exact_matmul: no kernel bound; call bind_kernel(path of the exact-gemm library) first");
  if (x.dtype() != mx::float32 || x.ndim() < 1 || w.dtype() != mx::float32 || w.ndim() != 2)
    throw std::invalid_argument("exact_matmul: x must be float32 (..., K) and w float32 (N, K)");
  if (x.shape(-1) != w.shape(1)) {
    std::ostringstream msg;
    msg << "exact_matmul: x has " << x.shape(-1) << " features but w has " << w.shape(1) << " columns";
    throw std::invalid_argument(msg.str());
  }
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<ExactMatmul>(mx::to_stream(mx::Device(mx::Device::cpu))), {x, w});
}

}  // namespace exact_matmul
