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
// (execution/kv_cache.py), and whoever wants to keep a state across a forward copies it
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

#include "exact_attention_row.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace exact_attention {

namespace {

View view3(const mx::array& a) {
  return {a.data<float>(), a.strides(0), a.strides(1), a.strides(2), 0};
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
