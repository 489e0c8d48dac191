// exact_layer: a whole transformer block (llama, mistral, qwen2, qwen3, gemma3), every session's rows, as one MLX node.
//
// Why: on the CPU a decode step's cost beyond the products is MLX building and dispatching
// ~40 graph nodes per block (RMSNorm and RoPE fall back to a dozen ops each here, slices,
// reshapes, the MLP's elementwise tail), on the same two cores the products need. As one node
// per block the graph of a forward is ~35 nodes, whatever the number of sessions.
//
// What it computes, per row, in this order (each step on that row's values only, so a row's
// bits cannot depend on its block or companions; products by the probed row-invariant kernel):
//   x = rms_norm(h, w_in): sum of squares in exact_dot.h's fixed order, / hidden, + eps,
//       1 / sqrt, then (h * r) * w;
//   q|k|v = x @ Wqkv.T; RoPE on q and k at the row's global position (angles from
//       inv_freq = base^(-2i/dims) and cos/sin in double, rounded to float; then
//       x1*c - x2*s and x1*s + x2*c); q *= scale;
//   attention over the row's session cache (exact_attention.cpp, which also stores k, v);
//   h1 = h + attn @ Wo.T; g|u = rms_norm(h1, w_post) @ Wgu.T;
//   h' = h1 + (g * (1 / (1 + exact_exp(-g))) * u) @ Wdown.T.
// A family's additions (Shape's flags): a q/k/v bias added after the product; q and k heads
// RMS-normed (the same rms_norm, over head_dim) before RoPE; RoPE's inverse frequencies from a
// given table; the attention and MLP outputs RMS-normed before their residual adds (Gemma's
// sandwich); GELU (tanh form, exact_tanh) instead of SiLU. `1 + w` norms come as effective weights.
// Built with -ffp-contract=off: every product and sum rounded separately.

#include "exact_layer.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "exact_layer_math.h"
#include "ggml_types.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace exact_layer {
namespace {

struct Job {  // what the dispatched task computes with (a copy: the node may be gone by then)
  Shape shape;
  exact_attention::Segments seg;
  Linear linear;
  std::vector<float> inv_freq;

  void product(int which, int m, int n, int k, const float* x, const void* w, long ldw, float* y) const {
    if (!linear(shape.fmt[which], m, n, k, x, w, ldw, y))
      throw std::runtime_error("exact_layer: the product kernel refused its arguments");
  }

  void run(const float* h, const std::vector<const void*>& wv, const std::vector<long>& ldw,
           const std::vector<float*>& storage, int rows, float* out) const;
};

class ExactLayer : public mx::UnaryPrimitive {
 public:
  ExactLayer(mx::Stream stream, Shape shape, exact_attention::Segments seg, Linear linear)
      : mx::UnaryPrimitive(stream), job_{shape, std::move(seg), linear, {}} {
    int half = shape.rope_dims / 2;
    for (int i = 0; i < half; ++i)
      job_.inv_freq.push_back(static_cast<float>(
          std::pow(static_cast<double>(shape.rope_base), -2.0 * i / static_cast<double>(shape.rope_dims))));
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const mx::array& a = inputs[i];
      if (!a.flags().row_contiguous || a.data_size() != a.size())
        throw std::runtime_error("exact_layer: input " + std::to_string(i) + " is not row-contiguous");
      encoder.set_input_array(a);
    }
    output.set_data(mx::allocator::malloc(output.nbytes()));
    encoder.set_output_array(output);
    std::vector<const void*> w;
    std::vector<long> ldw;
    size_t n_weights = 6 + static_cast<size_t>(job_.shape.extra_weights());
    for (size_t i = 1; i < 1 + n_weights; ++i) {
      w.push_back(inputs[i].data<void>());
      ldw.push_back(inputs[i].ndim() == 2 ? static_cast<long>(inputs[i].shape(1)) : 0);
    }
    std::vector<float*> storage;
    for (size_t c = 1 + n_weights; c < inputs.size(); ++c)
      storage.push_back(const_cast<float*>(inputs[c].data<float>()));
    int rows = static_cast<int>(inputs[0].size() / job_.shape.hidden);
    encoder.dispatch([job = job_, h = inputs[0].data<float>(), w, ldw, storage, rows, out = output.data<float>()]() {
      job.run(h, w, ldw, storage, rows, out);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ExactLayer has a CPU implementation only");
  }

  const char* name() const override { return "ExactLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const Job& o = static_cast<const ExactLayer&>(other).job_;
    const auto& a = job_.seg;
    const auto& b = o.seg;
    return job_.shape == o.shape && job_.linear == o.linear && a.starts == b.starts && a.rows == b.rows &&
           a.sinks == b.sinks && a.windows == b.windows && a.rings == b.rings;
  }

 private:
  Job job_;
};

void Job::run(const float* h, const std::vector<const void*>& wv, const std::vector<long>& ldw,
              const std::vector<float*>& storage, int rows, float* out) const {
    const Shape& s = shape;
    int d = s.head_dim, width = (s.n_heads + 2 * s.n_kv) * d, rep = s.n_heads / s.n_kv;
    // weights: 0 norm_in, 1 qkv, 2 o, 3 norm_post, 4 gate_up, 5 down (products index the fmt array)
    const void* mats[4] = {wv[1], wv[2], wv[4], wv[5]};
    long lds[4] = {ldw[1], ldw[2], ldw[4], ldw[5]};
    const float* norm_in = static_cast<const float*>(wv[0]);
    const float* norm_post = static_cast<const float*>(wv[3]);
    size_t e = 6;  // the family's extra weights, in Shape's order
    const float* bias = s.qkv_bias ? static_cast<const float*>(wv[e++]) : nullptr;
    const float* q_norm = s.qk_norm ? static_cast<const float*>(wv[e++]) : nullptr;
    const float* k_norm = s.qk_norm ? static_cast<const float*>(wv[e++]) : nullptr;
    const float* attn_norm = s.sandwich ? static_cast<const float*>(wv[e++]) : nullptr;
    const float* mlp_norm = s.sandwich ? static_cast<const float*>(wv[e++]) : nullptr;
    std::vector<float> table;
    if (s.inv_freq_table) {
      const float* f = static_cast<const float*>(wv[e++]);
      table.assign(f, f + s.rope_dims / 2);
    }
    const std::vector<float>& freqs = s.inv_freq_table ? table : inv_freq;
    std::vector<float> x(static_cast<size_t>(rows) * s.hidden), qkv(static_cast<size_t>(rows) * width);
    std::vector<float> attn(static_cast<size_t>(rows) * s.n_heads * d);
    for (int r = 0; r < rows; ++r)
      rms_norm(h + static_cast<size_t>(r) * s.hidden, norm_in, s.eps_in, s.hidden, x.data() + static_cast<size_t>(r) * s.hidden);
    product(0, rows, width, s.hidden, x.data(), mats[0], lds[0], qkv.data());
    if (bias != nullptr)
      for (int i = 0; i < rows; ++i)
        for (int l = 0; l < width; ++l)
          qkv[static_cast<size_t>(i) * width + l] = qkv[static_cast<size_t>(i) * width + l] + bias[l];
    int r = 0;
    std::vector<float> cos(freqs.size()), sin(freqs.size());
    for (size_t g = 0; g < seg.starts.size(); ++g)
      for (int j = 0; j < seg.rows[g]; ++j, ++r) {
        float position = static_cast<float>(seg.starts[g] + j) * s.rope_scale;
        float* row = qkv.data() + static_cast<size_t>(r) * width;
        if (q_norm != nullptr)  // per head, in place (the norm reads a head whole before writing it)
          for (int head = 0; head < s.n_heads + s.n_kv; ++head) {
            float* x = row + static_cast<size_t>(head) * d;
            rms_norm(x, head < s.n_heads ? q_norm : k_norm, s.eps_in, d, x);
          }
        angles(freqs, position, cos.data(), sin.data());
        for (int head = 0; head < s.n_heads + s.n_kv; ++head)
          rope(row + static_cast<size_t>(head) * d, s.rope_dims, s.rope_traditional, cos.data(), sin.data());
        for (int l = 0; l < s.n_heads * d; ++l)
          row[l] = row[l] * s.scale;
      }
    const float* base = qkv.data();
    exact_attention::View q{base, width, static_cast<int64_t>(rep) * d, d, 1};
    exact_attention::View k{base + static_cast<size_t>(s.n_heads) * d, d, width, 1, 0};
    exact_attention::View v{base + static_cast<size_t>(s.n_heads + s.n_kv) * d, d, width, 1, 0};
    exact_attention::write_and_attend(seg, storage, q, k, v, rows, s.n_kv, rep, d, attn.data());
    std::vector<float> y(static_cast<size_t>(rows) * s.hidden);
    product(1, rows, s.hidden, s.n_heads * d, attn.data(), mats[1], lds[1], y.data());
    if (attn_norm != nullptr)
      for (int i = 0; i < rows; ++i) {
        float* yi = y.data() + static_cast<size_t>(i) * s.hidden;
        rms_norm(yi, attn_norm, s.eps_in, s.hidden, yi);
      }
    for (size_t i = 0; i < y.size(); ++i)
      out[i] = h[i] + y[i];  // h1, kept in the output
    for (int i = 0; i < rows; ++i)
      rms_norm(out + static_cast<size_t>(i) * s.hidden, norm_post, s.eps_post, s.hidden, x.data() + static_cast<size_t>(i) * s.hidden);
    std::vector<float> gu(static_cast<size_t>(rows) * 2 * s.inter), act(static_cast<size_t>(rows) * s.inter);
    product(2, rows, 2 * s.inter, s.hidden, x.data(), mats[2], lds[2], gu.data());
    for (int i = 0; i < rows; ++i) {
      const float* g = gu.data() + static_cast<size_t>(i) * 2 * s.inter;
      (s.gelu ? gelu : silu)(g, g + s.inter, s.inter, act.data() + static_cast<size_t>(i) * s.inter);
    }
    product(3, rows, s.hidden, s.inter, act.data(), mats[3], lds[3], y.data());
    if (mlp_norm != nullptr)
      for (int i = 0; i < rows; ++i) {
        float* yi = y.data() + static_cast<size_t>(i) * s.hidden;
        rms_norm(yi, mlp_norm, s.eps_in, s.hidden, yi);
      }
    for (size_t i = 0; i < y.size(); ++i)
      out[i] = out[i] + y[i];
}

void check(bool ok, const std::string& what) {
  if (!ok)
    throw std::invalid_argument("exact_layer: " + what);
}

}  // namespace

mx::array block(const mx::array& h, const std::vector<mx::array>& weights, const std::vector<mx::array>& caches,
                const Shape& s, const exact_attention::Segments& seg, Linear linear) {
  check(linear != nullptr, "no product kernel bound");
  check(weights.size() == 6 + static_cast<size_t>(s.extra_weights()),
        "six weight arrays (norm_in, qkv, o, norm_post, gate_up, down), then the family's extras");
  size_t e = 6;
  int width = (s.n_heads + 2 * s.n_kv) * s.head_dim;
  auto extra = [&](bool on, size_t n, const char* what) {
    if (on) {
      check(weights[e].dtype() == mx::float32 && weights[e].size() == n, what);
      ++e;
    }
  };
  extra(s.qkv_bias, static_cast<size_t>(width), "the q/k/v bias must be (q|k|v width) float32");
  extra(s.qk_norm, static_cast<size_t>(s.head_dim), "the q norm must be (head_dim) float32");
  extra(s.qk_norm, static_cast<size_t>(s.head_dim), "the k norm must be (head_dim) float32");
  extra(s.sandwich, static_cast<size_t>(s.hidden), "the attention output norm must be (hidden) float32");
  extra(s.sandwich, static_cast<size_t>(s.hidden), "the MLP output norm must be (hidden) float32");
  extra(s.inv_freq_table, static_cast<size_t>(s.rope_dims / 2), "the RoPE table must be (rope_dims / 2) float32");
  check(h.dtype() == mx::float32 && h.ndim() == 3 && h.shape(0) == 1 && h.shape(2) == s.hidden, "h must be (1, R, hidden) float32");
  check(s.n_kv > 0 && s.n_heads % s.n_kv == 0 && s.head_dim > 0 && s.rope_dims <= s.head_dim && s.rope_dims % 2 == 0,
        "bad head shape");
  check(weights[0].size() == static_cast<size_t>(s.hidden) && weights[3].size() == static_cast<size_t>(s.hidden),
        "norm weights must have hidden elements");
  int outs[4] = {(s.n_heads + 2 * s.n_kv) * s.head_dim, s.hidden, 2 * s.inter, s.hidden};
  int ins[4] = {s.hidden, s.n_heads * s.head_dim, s.hidden, s.inter};
  int at[4] = {1, 2, 4, 5};
  for (int i = 0; i < 4; ++i) {
    const mx::array& w = weights[at[i]];
    int fmt = s.fmt[i];
    check(w.ndim() == 2 && w.shape(0) == outs[i], "a weight has the wrong number of rows");
    if (fmt == 0)
      check(w.dtype() == mx::float32 && w.shape(1) == ins[i], "an fp32 weight must be (out, in) float32");
    else
      check(w.dtype() == mx::uint8 && ggml_row_bytes(fmt, ins[i]) > 0 && w.shape(1) == ggml_row_bytes(fmt, ins[i]),
            "a block weight must be (out, row bytes of in) uint8 of a type exact_qgemm reads (ggml_types.h)");
  }
  exact_attention::check_segments(seg, caches, h.shape(1), s.n_kv, s.head_dim, "exact_layer");
  std::vector<mx::array> inputs{h};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  inputs.insert(inputs.end(), caches.begin(), caches.end());
  return mx::array(h.shape(), mx::float32, std::make_shared<ExactLayer>(mx::to_stream({}), s, seg, linear), inputs);
}

}  // namespace exact_layer
