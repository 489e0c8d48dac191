// exact_quant: an MLX primitive computing x @ W.T with W read from GGUF blocks (ggml_types.h's types).
//
// Why an MLX extension (a custom primitive with a CPU implementation): the product must sit
// inside MLX's lazy graph, under mx.compile, evaluated on MLX's CPU stream like any matmul,
// with no copy of the fp32 weights anywhere. The arithmetic itself is not here: eval_cpu
// calls `exact_qgemm` of the exact-gemm library (native/exact_gemm.c), the same shared object
// whose `exact_sgemm_nt` computes the fp32 products (exact_matmul.cpp's primitive), so both
// share one dot-product code (exact_dot.h) and one thread pool. `bind_kernel(path)` dlopen()s
// that library explicitly (a preloaded copy is the same one; none is needed); nothing is looked
// up behind the caller's back, and an unbound module refuses to compute.
//
// Python: bind_kernel(path) -> None; is_bound() -> bool;
//         qmatmul(x, blocks, fmt) -> x @ dequant(blocks).T;
//         matmul(x, w) -> x @ w.T for fp32 w (exact_matmul.cpp);
//         attend(...): a layer's attention for many sessions (exact_attention.cpp; needs no kernel);
//         set_avx2(on) -> previous: the 8-lane variants of attention and SiLU on or off (tests);
//         set_attention_pool(on) -> previous: attention's items on the kernel's pool, or on
//           threads started per call (tests: both give the same bits);
//         block(...): a whole transformer block for many sessions (exact_layer.cpp; needs the kernel)
//   x: float32 (..., K); blocks: uint8 (N, K / block weights * block bytes), row n = output feature n;
//   fmt: ggml type id (ggml_types.h: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). Returns float32 (..., N).

#include <dlfcn.h>

#include <sstream>
#include <vector>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "exact_attention.h"
#include "exact_exp.h"
#include "exact_exp_neon.h"
#include "exact_layer.h"
#include "exact_matmul.h"
#include "ggml_types.h"

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using qgemm_fn = int (*)(int fmt, int m, int n, int k, const float* a, long lda, const void* q, long ldq,
                         float* c, long ldc);
qgemm_fn kernel = nullptr;  // exact_qgemm of the bound exact-gemm library
exact_attention::ParallelFor pool = nullptr;  // its exact_parallel_for
// exact_layer's products: fp32 rows through exact_sgemm_nt (exact_matmul.cpp's kernel), GGUF
// blocks through exact_qgemm (bitwise the former on the dequantized W).
bool linear(int fmt, int m, int n, int k, const float* x, const void* w, long ldw, float* y) {
  if (fmt == 0)
    return exact_matmul::rows(m, n, k, x, static_cast<const float*>(w), k, y);
  return kernel(fmt, m, n, k, x, k, w, ldw, y, n) == 0;
}

using exact_matmul::Strided;  // an input as the dispatched task sees it (exact_matmul.h)

class ExactQuantMatmul : public mx::UnaryPrimitive {
 public:
  ExactQuantMatmul(mx::Stream stream, int fmt) : mx::UnaryPrimitive(stream), fmt_(fmt) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int k = static_cast<int>(x.shape(-1)), n = static_cast<int>(w.shape(0));
    int m = static_cast<int>(x.size() / (k ? k : 1));
    long ldq = static_cast<long>(w.shape(1));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    // Strided inputs (a transposed or sliced activation) are packed here rather than by a
    // Contiguous node per product in the graph: one node fewer per linear on every step.
    encoder.dispatch([fmt = fmt_, m, n, k, ldq, x = Strided<float>::of(x), q = Strided<uint8_t>::of(w),
                      c = out.data<float>()]() {
      std::vector<float> xbuf;
      std::vector<uint8_t> qbuf;
      if (kernel(fmt, m, n, k, x.packed(xbuf), k, q.packed(qbuf), ldq, c, n) != 0)
        throw std::runtime_error("exact_qgemm refused its arguments");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ExactQuantMatmul has a CPU implementation only");
  }

  const char* name() const override { return "ExactQuantMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return fmt_ == static_cast<const ExactQuantMatmul&>(other).fmt_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int fmt_;  // ggml type id of the blocks
};

mx::array qmatmul(const mx::array& x, const mx::array& blocks, int fmt) {
  if (kernel == nullptr)
    throw std::runtime_error("exact_quant: no kernel bound; call bind_kernel(path of the exact-gemm library) first");
  if (ggml_type_bytes(fmt) == 0)
    throw std::invalid_argument("exact_quant: fmt must be a ggml type id the kernel reads (1 F16, 2 Q4_0, 3 Q4_1, "
                                "6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 30 BF16), got " + std::to_string(fmt));
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("exact_quant: x must be float32 with at least one dimension");
  if (blocks.dtype() != mx::uint8 || blocks.ndim() != 2)
    throw std::invalid_argument("exact_quant: blocks must be a 2-D uint8 array (out features, block bytes)");
  auto k = x.shape(-1);
  if (ggml_row_bytes(fmt, k) < 0 || blocks.shape(1) != ggml_row_bytes(fmt, k)) {
    std::ostringstream msg;
    msg << "exact_quant: x has " << k << " features but the blocks hold " << blocks.shape(1) << " bytes per row ("
        << ggml_type_bytes(fmt) << " per " << ggml_type_weights(fmt) << " features)";
    throw std::invalid_argument(msg.str());
  }
  mx::Shape shape = x.shape();
  shape.back() = blocks.shape(0);
  auto s = mx::to_stream({});
  return mx::array(shape, mx::float32, std::make_shared<ExactQuantMatmul>(s, fmt),
                   {x, blocks});
}

void bind_kernel(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // the preloaded copy if `path` is preloaded
  if (lib == nullptr)
    throw std::runtime_error("exact_quant: cannot load " + path + ": " + dlerror());
  auto fn = reinterpret_cast<qgemm_fn>(dlsym(lib, "exact_qgemm"));
  if (fn == nullptr)
    throw std::runtime_error("exact_quant: " + path + " has no exact_qgemm (an older exact-gemm build?)");
  auto gemm = reinterpret_cast<exact_matmul::Gemm>(dlsym(lib, "exact_sgemm_nt"));
  if (gemm == nullptr)
    throw std::runtime_error("exact_quant: " + path + " has no exact_sgemm_nt (an older exact-gemm build?)");
  kernel = fn;
  exact_matmul::bind(gemm);
  // Attention's items on the same pool (nullptr from a library without it: threads per call).
  pool = reinterpret_cast<exact_attention::ParallelFor>(dlsym(lib, "exact_parallel_for"));
  exact_attention::set_parallel_for(pool);
}

mx::array block(const mx::array& h, const std::vector<mx::array>& weights, const std::vector<mx::array>& caches,
                std::vector<int> ints, std::vector<float> floats, exact_attention::Segments seg) {
  if (kernel == nullptr || !exact_matmul::is_bound())
    throw std::runtime_error("exact_quant: no kernel bound; call bind_kernel(path of the exact-gemm library) first");
  if ((ints.size() != 11 && ints.size() != 16) || floats.size() != 5)
    throw std::invalid_argument("exact_layer: 11 ints (n_heads, n_kv, head_dim, hidden, inter, rope_dims, "
                                "rope_traditional, 4 formats) [+ 5 family flags: qkv_bias, qk_norm, sandwich, gelu, "
                                "inv_freq_table] and 5 floats (eps_in, eps_post, scale, rope_base, rope_scale)");
  exact_layer::Shape s{ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], {ints[7], ints[8], ints[9], ints[10]},
                       floats[0], floats[1], floats[2], floats[3], floats[4]};
  if (ints.size() == 16) {
    int* flags[5] = {&s.qkv_bias, &s.qk_norm, &s.sandwich, &s.gelu, &s.inv_freq_table};
    for (int i = 0; i < 5; ++i) {
      if (ints[11 + i] != 0 && ints[11 + i] != 1)
        throw std::invalid_argument("exact_layer: the family flags are 0 or 1");
      *flags[i] = ints[11 + i];
    }
  }
  return exact_layer::block(h, weights, caches, s, seg, &linear);
}

}  // namespace

NB_MODULE(_exact_quant, m) {
  nb::module_::import_("mlx.core");  // mx.array's bindings, shared through nanobind's domain
  m.doc() = "x @ W.T with W in GGUF blocks, bitwise the exact-gemm fp32 product of gguf-py's dequantization";
  m.def("bind_kernel", &bind_kernel, nb::arg("path"), "Compute with exact_qgemm of this exact-gemm library.");
  m.def("is_bound", []() { return kernel != nullptr; });
  m.def(
      "set_avx2",
      [](bool on) {
#if defined(__x86_64__)
        return exact_math::set_avx2(on);
#elif defined(__aarch64__)
        return exact_math::neon::set_enabled(on);  // arm64: the NEON variants (exact_exp_neon.h)
#else
        (void)on;
        return false;
#endif
      },
      nb::arg("on"),
      "Whether attention and SiLU run their 8-lane AVX2 variants (where the CPU has AVX2; NEON on arm64); returns the previous "
      "setting. For tests comparing them with the portable code: both give the same bits.");
  m.def(
      "set_attention_pool",
      [](bool on) { return exact_attention::set_parallel_for(on ? pool : nullptr) != nullptr; },
      nb::arg("on"),
      "Whether attention's (row, KV head) items run on the bound exact-gemm library's thread pool (the default) "
      "or on threads started per call; returns the previous setting. For tests: both give the same bits.");
  m.def("matmul", &exact_matmul::matmul, nb::arg("x"), nb::arg("w"),
        "x (..., K) float32 @ w.T, w float32 (N, K): float32 (..., N), by the bound exact-gemm kernel (any rows)");
  m.def("qmatmul", &qmatmul, nb::arg("x"), nb::arg("blocks"), nb::arg("fmt"),
        "x (..., K) float32 @ dequant(blocks).T, blocks uint8 (N, row bytes of K weights): float32 (..., N)");
  m.def(
      "block",
      [](const mx::array& h, const std::vector<mx::array>& weights, const std::vector<mx::array>& caches,
         std::vector<int> ints, std::vector<float> floats, std::vector<int> starts, std::vector<int> rows,
         std::vector<int> sinks, std::vector<int> windows, std::vector<int> rings) {
        return block(h, weights, caches, ints, floats, {starts, rows, sinks, windows, rings});
      },
      nb::arg("h"), nb::arg("weights"), nb::arg("caches"), nb::arg("ints"), nb::arg("floats"), nb::arg("starts"),
      nb::arg("rows"), nb::arg("sinks"), nb::arg("windows"), nb::arg("rings"),
      "A whole transformer block for the rows of many sessions (native/exact_layer.cpp): h' (1, R, hidden); "
      "the caches' storage receives the rows in place when it runs");
  m.def(
      "attend",
      [](const mx::array& q, const mx::array& k, const mx::array& v, const std::vector<mx::array>& caches,
         std::vector<int> starts, std::vector<int> rows, std::vector<int> sinks, std::vector<int> windows,
         std::vector<int> rings) {
        return exact_attention::attend(q, k, v, caches, {starts, rows, sinks, windows, rings});
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("caches"), nb::arg("starts"), nb::arg("rows"),
      nb::arg("sinks"), nb::arg("windows"), nb::arg("rings"),
      "A layer's sink-window attention for the rows of many sessions (native/exact_attention.cpp): "
      "attn (R, n_kv, rep, D); the caches' storage receives the rows in place when it runs");
}
