// exact_attention: a layer's sink-window attention for the rows of many sessions, one MLX node.
//
// Why: as MLX ops, each session in a batch adds ~20 graph nodes per layer (its K/V writes,
// slices of its cache, two small matmuls, the softmax), and on the CPU building and
// dispatching those nodes, not the arithmetic, is what a batched decode step costs. Here a
// layer's attention is one node whatever the number of sessions: it writes every session's
// new K/V rows into that session's cache storage and computes every row's attention.
//
// The storage is written in place: a cache's K and V arrays are inputs of the node, and the
// rows land in their buffers when it runs (an MLX node cannot donate an input to one of
// several outputs, and a copy of every session's slab per layer would cost more than the
// graph it saves). So the storage is a buffer, not a value: the cache owns it alone
// (verifier/kv_cache.py), and whoever wants to keep a state across a forward copies it
// (`Executor.snapshot`).
//
// Why the bits of a row cannot depend on its companions, its block or the thread split: the
// row at global position p attends to the positions `CacheGeometry.visible_positions(p)`
// (the sinks, then p - window .. p), visited in that order, whatever slot the ring put them
// in; its scores are exact_dot.h's fixed-order dot products over D; the softmax takes their
// max, `exact_exp(s - max)` (no libm), a sum in position order, one division per weight; the output is the
// weighted sum of the values in position order, each product and sum rounded separately
// (built with -ffp-contract=off). Each (row, KV head) is computed by one thread from those
// inputs only, and every write of the block lands before any row reads.

#include "exact_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "exact_attention_avx2.h"
#include "exact_dot.h"
#include "exact_exp.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace exact_attention {

namespace {

View view3(const mx::array& a) {
  return {a.data<float>(), a.strides(0), a.strides(1), a.strides(2), 0};
}

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
void attend_row(const Row& row, int h, const float* q, int rep, int d, const float* keys, const float* values,
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

ParallelFor parallel_for = nullptr;  // set_parallel_for

}  // namespace

ParallelFor set_parallel_for(ParallelFor fn) { return std::exchange(parallel_for, fn); }

void write_and_attend(const Segments& seg, const std::vector<float*>& storage, View q, View k, View v, int rows,
                      int n_kv, int rep, int d, float* out) {
  std::vector<Row> table;
  for (size_t s = 0; s < seg.starts.size(); ++s) {
    int slots = seg.sinks[s] + seg.rings[s];
    for (int j = 0; j < seg.rows[s]; ++j) {  // the segment's new rows at their slots
      Row row{seg.starts[s] + j, static_cast<int>(2 * s), seg.sinks[s], seg.windows[s], seg.rings[s]};
      int r = static_cast<int>(table.size()), slot = row.slot(row.position);
      for (int h = 0; h < n_kv; ++h)
        for (int l = 0; l < d; ++l) {
          storage[2 * s][(static_cast<int64_t>(h) * slots + slot) * d + l] = k.at(h, r, l);
          storage[2 * s + 1][(static_cast<int64_t>(h) * slots + slot) * d + l] = v.at(h, r, l);
        }
      table.push_back(row);
    }
  }
  auto work = [&](int first, int last) {  // (row, head) items [first, last)
    // Scratch kept per thread: the pool hands out one item per claim, so per-call vectors
    // would be allocated for every (row, KV head) of every layer. Every element read is
    // written first (visible is cleared, w sized, qbuf filled), so nothing carries over.
    thread_local std::vector<int> visible;
    thread_local std::vector<float> w, qbuf;
    qbuf.resize(static_cast<size_t>(rep) * d);
    for (int item = first; item < last; ++item) {
      int r = item / n_kv, h = item % n_kv;
      const Row& row = table[r];
      for (int i = 0; i < rep; ++i)  // the row's query heads, contiguous
        for (int l = 0; l < d; ++l)
          qbuf[static_cast<size_t>(i) * d + l] = q.at4(r, h, i, l);
      attend_row(row, h, qbuf.data(), rep, d, storage[row.cache], storage[row.cache + 1],
                 row.sink + row.ring, out + (static_cast<int64_t>(r) * n_kv + h) * rep * d, visible, w);
    }
  };
  int items = rows * n_kv;
  int64_t cost = 0;  // multiply-adds of the scores (the weighted sums as many again)
  for (const Row& row : table) {
    int64_t keys = std::min(row.sink, row.position + 1) + row.position - std::max(row.sink, row.position - row.window) + 1;
    cost += keys * n_kv * rep * d;
  }
  if (cost < (1 << 16) || items < 2) {  // ~20 us: not worth waking anyone
    work(0, items);
    return;
  }
  if (parallel_for != nullptr) {  // the exact-gemm pool's threads, awake between the products
    parallel_for([](void* f, int first, int last) { (*static_cast<decltype(work)*>(f))(first, last); }, &work, items);
    return;
  }
  int threads = std::min<int>(items, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t)
    pool.emplace_back(work, items * t / threads, items * (t + 1) / threads);
  work(0, items / threads);
  for (auto& th : pool)
    th.join();
}

namespace {

class ExactAttention : public mx::UnaryPrimitive {
 public:
  ExactAttention(mx::Stream stream, Segments segments) : mx::UnaryPrimitive(stream), seg_(std::move(segments)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs)
      encoder.set_input_array(a);
    output.set_data(mx::allocator::malloc(output.nbytes()));
    encoder.set_output_array(output);
    std::vector<float*> storage;  // each session's K and V storage, written in place
    for (size_t c = 3; c < inputs.size(); ++c) {
      const mx::array& cache = inputs[c];
      if (!cache.flags().row_contiguous || cache.data_size() != cache.size())
        throw std::runtime_error("exact_attention: a cache's storage must be materialized (row-contiguous, owned)");
      storage.push_back(const_cast<float*>(cache.data<float>()));
    }
    const mx::array& q = inputs[0];
    int rows = q.shape(0), n_kv = q.shape(1), rep = q.shape(2), d = q.shape(3);
    View qv{q.data<float>(), q.strides(0), q.strides(1), q.strides(2), q.strides(3)};
    encoder.dispatch([seg = seg_, storage, k = view3(inputs[1]), v = view3(inputs[2]), qv, rows, n_kv, rep, d,
                      out = output.data<float>()]() { write_and_attend(seg, storage, qv, k, v, rows, n_kv, rep, d, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ExactAttention has a CPU implementation only");
  }

  const char* name() const override { return "ExactAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const Segments& o = static_cast<const ExactAttention&>(other).seg_;
    return seg_.starts == o.starts && seg_.rows == o.rows && seg_.sinks == o.sinks && seg_.windows == o.windows &&
           seg_.rings == o.rings;
  }

 private:
  Segments seg_;
};

void check(bool ok, const std::string& what) {
  if (!ok)
    throw std::invalid_argument("exact_attention: " + what);
}

}  // namespace

void check_segments(const Segments& seg, const std::vector<mx::array>& caches, int rows, int n_kv, int d,
                    const std::string& who) {
  auto check = [&who](bool ok, const std::string& what) {
    if (!ok)
      throw std::invalid_argument(who + ": " + what);
  };
  size_t n = seg.starts.size();
  check(n > 0 && seg.rows.size() == n && seg.sinks.size() == n && seg.windows.size() == n && seg.rings.size() == n,
        "one start, row count, sink, window and ring per segment");
  check(caches.size() == 2 * n, "two caches (K, V) per segment");
  int total = 0;
  for (size_t s = 0; s < n; ++s) {
    check(seg.rows[s] >= 1 && seg.starts[s] >= 0 && seg.sinks[s] >= 0 && seg.windows[s] >= 0, "bad segment");
    check(seg.rings[s] >= seg.windows[s] + seg.rows[s], "a ring must hold the window and the segment's rows");
    total += seg.rows[s];
    for (int c = 0; c < 2; ++c)
      check(caches[2 * s + c].dtype() == mx::float32 &&
                caches[2 * s + c].shape() == mx::Shape({n_kv, seg.sinks[s] + seg.rings[s], d}),
            "a cache is not (n_kv, slots, D) float32");
  }
  check(total == rows, "the segments' rows must add up to the rows computed");
}

mx::array attend(const mx::array& q, const mx::array& k, const mx::array& v, const std::vector<mx::array>& caches,
                 const Segments& seg) {
  check(q.ndim() == 4 && k.ndim() == 3 && v.ndim() == 3, "q (R, n_kv, rep, D), k and v (n_kv, R, D)");
  int rows = q.shape(0), n_kv = q.shape(1), d = q.shape(3);
  check(k.shape() == mx::Shape({n_kv, rows, d}) && v.shape() == k.shape(), "k and v must be (n_kv, R, D) of q's sizes");
  check(q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32, "q, k and v must be float32");
  check_segments(seg, caches, rows, n_kv, d, "exact_attention");
  std::vector<mx::array> inputs{q, k, v};
  for (const auto& c : caches)
    inputs.push_back(c);
  return mx::array(q.shape(), mx::float32, std::make_shared<ExactAttention>(mx::to_stream({}), seg), inputs);
}

}  // namespace exact_attention
