// kernel_harness: the native kernels on fixed, seeded inputs, one digest per output tensor.
//
// Built (tests/kernel_harness.py, scripts/check_arm64.sh) from inference_engine/native/ with
// the server's flags (-ffp-contract=off) for x86-64 and, cross-compiled, for arm64 (run under
// qemu-aarch64). Every variant must print the very same lines after the first: the products
// (exact_gemm.c: fp32 with B transposed or not, Q4_1 and Q8_0 blocks, for every tile shape and
// K tail), exact_exp and its 8- / 4-lane forms, exact_tanh, RMSNorm, RoPE, SiLU, GELU, and
// attention rows (exact_attention_row.h) over a range of heads, widths and visible lengths.
// The variant is chosen the way the server's is: by the CPU, EXACT_GEMM_NO_AVX512=1 (AVX2+FMA)
// or EXACT_GEMM_PORTABLE=1 (the portable C loops and no 8-lane attention, exp or SiLU).
//
// Output: "variant <gemm loops> / <vector math>" then one line per tensor:
// "<name> <elements> <FNV-1a 64 of its bytes>". Inputs come from a xorshift generator turned
// into floats with integer operations only, so they are the same bits on every machine.
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "exact_attention_row.h"
#include "exact_layer_math.h"

extern "C" {
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc);
int exact_qgemm(int fmt, int m, int n, int k, const float* a, long lda, const void* q, long ldq, float* c, long ldc);
const char* exact_gemm_variant(void);
}

namespace {

struct Rng {  // xorshift64*: the same sequence everywhere
  uint64_t s;
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  float uniform() {  // in [-1, 1): a 24-bit integer scaled by a power of two (exact)
    return static_cast<float>(static_cast<int32_t>(next() >> 40) - (1 << 23)) * (1.0f / (1 << 23));
  }
  std::vector<float> floats(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v)
      x = uniform() * scale;
    return v;
  }
};

void emit(const std::string& name, const float* data, size_t n) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64 over the little-endian bytes
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n * sizeof(float); ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  std::printf("%s %zu %016" PRIx64 "\n", name.c_str(), n, h);
}

std::string tag(const char* kind, std::initializer_list<int> dims) {
  std::string s = kind;
  char sep = ' ';
  for (int d : dims) {
    s += sep == ' ' ? "-" : "x";
    s += std::to_string(d);
    sep = 'x';
  }
  return s;
}

uint16_t random_half(Rng& rng, int emin, int emax) {  // a finite fp16 with exponent field in [emin, emax]
  uint64_t r = rng.next();
  unsigned exp = static_cast<unsigned>(emin + (r >> 20) % (emax - emin + 1));
  return static_cast<uint16_t>(((r >> 40) & 1) << 15 | exp << 10 | (r & 0x3ff));
}

// ---------------------------------------------------------------------------- products

void gemm_nt(Rng& rng) {  // C = alpha * A . B^T + beta * C: every tile (rows x cols) and K tail
  const int shapes[][3] = {{1, 1, 1},   {1, 7, 13},  {1, 24, 64},  {1, 41, 100}, {2, 5, 8},    {3, 9, 9},
                           {4, 12, 40}, {5, 7, 33},  {7, 25, 64},  {8, 30, 72},  {12, 13, 17}, {13, 26, 96},
                           {31, 8, 64}, {33, 52, 64}, {40, 49, 200}, {64, 30, 576}, {70, 11, 24}};
  const float scales[][2] = {{1.0f, 0.0f}, {0.5f, 0.25f}};
  for (const auto& s : shapes)
    for (const auto& ab : scales) {
      int m = s[0], n = s[1], k = s[2];
      auto a = rng.floats(static_cast<size_t>(m) * (k + 3)), b = rng.floats(static_cast<size_t>(n) * (k + 1));
      auto c = rng.floats(static_cast<size_t>(m) * (n + 2));
      cblas_sgemm(101, 111, 112, m, n, k, ab[0], a.data(), k + 3, b.data(), k + 1, ab[1], c.data(), n + 2);
      emit(tag(ab[1] == 0.0f ? "gemm-nt" : "gemm-nt-ab", {m, n, k}), c.data(), c.size());
    }
}

void gemm_nn(Rng& rng) {  // C = A . B (attention's weights @ values): one chain over k per element
  const int shapes[][3] = {{1, 1, 1}, {1, 8, 5}, {1, 17, 33}, {2, 16, 7}, {3, 40, 12}, {4, 9, 64}, {5, 24, 3}, {9, 33, 20}};
  for (const auto& s : shapes) {
    int m = s[0], n = s[1], k = s[2];
    auto a = rng.floats(static_cast<size_t>(m) * k), b = rng.floats(static_cast<size_t>(k) * (n + 1));
    auto c = rng.floats(static_cast<size_t>(m) * n);
    cblas_sgemm(101, 111, 111, m, n, k, 1.0f, a.data(), k, b.data(), n + 1, 0.0f, c.data(), n);
    emit(tag("gemm-nn", {m, n, k}), c.data(), c.size());
    cblas_sgemm(101, 111, 111, m, n, k, 0.75f, a.data(), k, b.data(), n + 1, 0.5f, c.data(), n);
    emit(tag("gemm-nn-ab", {m, n, k}), c.data(), c.size());
  }
}

std::vector<uint8_t> random_blocks(Rng& rng, int fmt, int n, int k) {
  const int bytes = fmt == 3 ? 20 : 34, blocks = k / 32;
  std::vector<uint8_t> q(static_cast<size_t>(n) * blocks * bytes);
  for (size_t b = 0; b < q.size() / bytes; ++b) {
    uint8_t* blk = q.data() + b * bytes;
    uint16_t d = random_half(rng, 1, 14), m = random_half(rng, 1, 14);  // normal and subnormal-free scales
    if (b % 7 == 3)
      d = static_cast<uint16_t>(rng.next() & 0x3ff);  // a subnormal d
    std::memcpy(blk, &d, 2);
    if (fmt == 3)
      std::memcpy(blk + 2, &m, 2);
    for (int i = (fmt == 3 ? 4 : 2); i < bytes; ++i)
      blk[i] = static_cast<uint8_t>(rng.next() >> 56);
  }
  return q;
}

void qgemm(Rng& rng) {  // x @ W.T with W in GGUF blocks: one row, register tiles, L1 scratch tiles
  const int rows[] = {1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 17, 33, 40};
  const int shapes[][2] = {{1, 32}, {2, 64}, {3, 96}, {4, 32}, {5, 64}, {7, 576}, {9, 96}, {26, 64}};
  for (int fmt : {3, 8})
    for (int m : rows)
      for (const auto& s : shapes) {
        int n = s[0], k = s[1];
        if (m > 13 && k == 576)
          continue;  // big prefill shapes add time, not paths
        auto q = random_blocks(rng, fmt, n, k);
        auto a = rng.floats(static_cast<size_t>(m) * k);
        std::vector<float> c(static_cast<size_t>(m) * n, NAN);
        long ldq = static_cast<long>(q.size() / n);
        if (exact_qgemm(fmt, m, n, k, a.data(), k, q.data(), ldq, c.data(), n) != 0) {
          std::fprintf(stderr, "exact_qgemm refused fmt %d %dx%dx%d\n", fmt, m, n, k);
          std::exit(2);
        }
        emit(tag(fmt == 3 ? "q4_1" : "q8_0", {m, n, k}), c.data(), c.size());
      }
}

// The GGUF block types beyond Q4_1 / Q8_0 (native/ggml_types.h ids): every byte random but the
// fp16 scales (finite, one subnormal d in seven) and the F16 / BF16 weights (finite: NaN bits are
// not the same on every CPU, and no model holds them).
struct BlockType {
  const char* name;
  int fmt, weights, bytes;
  int halves[2];  // byte offsets of the block's fp16 scales (-1: none)
};
const BlockType kBlockTypes[] = {
    {"q4_0", 2, 32, 18, {0, -1}},   {"q5_0", 6, 32, 22, {0, -1}},   {"q5_1", 7, 32, 24, {0, 2}},
    {"q4_k", 12, 256, 144, {0, 2}}, {"q5_k", 13, 256, 176, {0, 2}}, {"q6_k", 14, 256, 210, {208, -1}},
    {"f16", 1, 32, 64, {-1, -1}},   {"bf16", 30, 32, 64, {-1, -1}},
};

std::vector<uint8_t> random_typed_blocks(Rng& rng, const BlockType& t, int n, int k) {
  std::vector<uint8_t> q(static_cast<size_t>(n) * (k / t.weights) * t.bytes);
  for (size_t b = 0; b < q.size() / t.bytes; ++b) {
    uint8_t* blk = q.data() + b * t.bytes;
    for (int i = 0; i < t.bytes; ++i)
      blk[i] = static_cast<uint8_t>(rng.next() >> 56);
    for (int j = 0; j < 32 && (t.fmt == 1 || t.fmt == 30); ++j) {  // F16 / BF16 weights
      uint16_t w = random_half(rng, 1, 30);
      if (t.fmt == 30) {  // the top half of a finite fp32
        float f = rng.uniform() * 8.0f;
        uint32_t u;
        std::memcpy(&u, &f, 4);
        w = static_cast<uint16_t>(u >> 16);
      }
      std::memcpy(blk + 2 * j, &w, 2);
    }
    for (int h : t.halves)
      if (h >= 0) {
        uint16_t d = b % 7 == 3 && h == t.halves[0] ? static_cast<uint16_t>(rng.next() & 0x3ff) : random_half(rng, 1, 14);
        std::memcpy(blk + h, &d, 2);
      }
  }
  return q;
}

void typed_qgemm(Rng& rng) {  // every other block type the server reads: one row, tiles, scratch tiles
  const int rows[] = {1, 2, 3, 5, 8, 13, 17, 33};
  const int shapes[][2] = {{1, 256}, {3, 256}, {5, 512}, {9, 256}};
  for (const auto& t : kBlockTypes)
    for (int m : rows)
      for (const auto& s : shapes) {
        int n = s[0], k = s[1];
        auto q = random_typed_blocks(rng, t, n, k);
        auto a = rng.floats(static_cast<size_t>(m) * k);
        std::vector<float> c(static_cast<size_t>(m) * n, NAN);
        long ldq = static_cast<long>(q.size() / n);
        if (exact_qgemm(t.fmt, m, n, k, a.data(), k, q.data(), ldq, c.data(), n) != 0) {
          std::fprintf(stderr, "exact_qgemm refused %s %dx%dx%d\n", t.name, m, n, k);
          std::exit(2);
        }
        emit(tag(t.name, {m, n, k}), c.data(), c.size());
      }
}

// -------------------------------------------------------------------- elementwise math

std::vector<float> exp_inputs() {  // a sweep of [-110, 95] (subnormal and overflowing results), specials
  std::vector<float> x;
  for (int i = -110 * 64; i <= 95 * 64; ++i)
    x.push_back(static_cast<float>(i) / 64.0f + static_cast<float>(i % 7) * 1e-3f);
  for (float v : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-30f, -1e-30f, 88.72f, 89.0f, -103.97f, -104.0f})
    x.push_back(v);
  while (x.size() % 8)
    x.push_back(0.5f);
  return x;
}

#if defined(__x86_64__)
// exp8 over 8 floats, in an AVX2 function: a v8 may cross only calls between AVX2 code (the ABI).
AVX2_TARGET void exp8_at(const float* x, float* y) {
  v8 e = exact_math::exp8(load8(x));
  std::memcpy(y, &e, sizeof e);
}
#endif

void elementwise(Rng& rng) {
  auto x = exp_inputs();
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    y[i] = exact_exp(x[i]);
  emit("exp-scalar", y.data(), y.size());
  for (size_t i = 0; i < x.size(); i += 8) {  // the lanes the softmax and SiLU use on this CPU
#if defined(__x86_64__)
    if (exact_math::has_avx2()) {
      exp8_at(x.data() + i, y.data() + i);
      continue;
    }
#elif defined(__aarch64__)
    if (exact_math::neon::enabled()) {
      vst1q_f32(y.data() + i, exact_math::neon::exp4(vld1q_f32(x.data() + i)));
      vst1q_f32(y.data() + i + 4, exact_math::neon::exp4(vld1q_f32(x.data() + i + 4)));
      continue;
    }
#endif
    for (int l = 0; l < 8; ++l)
      y[i + l] = exact_exp(x[i + l]);
  }
  emit("exp-lanes", y.data(), y.size());
  for (size_t i = 0; i < x.size(); ++i)
    y[i] = exact_layer::exact_tanh(x[i] / 8.0f);
  emit("tanh", y.data(), y.size());

  for (int n : {7, 64, 576, 1536}) {
    auto g = rng.floats(n, 12.0f), u = rng.floats(n), w = rng.floats(n);
    std::vector<float> out(n);
    exact_layer::silu(g.data(), u.data(), n, out.data());
    emit(tag("silu", {n}), out.data(), n);
    exact_layer::gelu(g.data(), u.data(), n, out.data());
    emit(tag("gelu", {n}), out.data(), n);
    exact_layer::rms_norm(g.data(), w.data(), 1e-5f, n, out.data());
    emit(tag("rms_norm", {n}), out.data(), n);
  }
  for (int dims : {32, 64}) {
    std::vector<float> inv_freq;
    for (int i = 0; i < dims / 2; ++i)
      inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / dims)));
    for (int traditional : {0, 1})
      for (int position : {0, 1, 17, 2047, 8191}) {
        auto v = rng.floats(dims);
        std::vector<float> c(dims / 2), s(dims / 2);
        exact_layer::angles(inv_freq, static_cast<float>(position), c.data(), s.data());
        exact_layer::rope(v.data(), dims, traditional != 0, c.data(), s.data());
        emit(tag("rope", {dims, traditional, position}), v.data(), v.size());
      }
  }
}

// ---------------------------------------------------------------------------- attention

void attention(Rng& rng) {  // attend_row over a ring cache: heads per KV head, widths, visible lengths
  const int cases[][5] = {  // rep, d, sink, window, position
      {1, 8, 0, 64, 0},     {1, 13, 0, 64, 6},   {2, 64, 4, 16, 40},   {3, 64, 0, 128, 8},
      {4, 64, 2, 30, 100},  {5, 96, 0, 64, 16},  {9, 64, 1, 256, 199}, {3, 128, 4, 32, 70},
      {1, 72, 0, 512, 300}, {2, 40, 0, 8, 3}};
  const int n_kv = 2;
  for (const auto& c : cases) {
    int rep = c[0], d = c[1], sink = c[2], window = c[3], position = c[4];
    int ring = window + 1;
    int slots = sink + ring;
    auto keys = rng.floats(static_cast<size_t>(n_kv) * slots * d, 2.0f);
    auto values = rng.floats(static_cast<size_t>(n_kv) * slots * d);
    auto q = rng.floats(static_cast<size_t>(rep) * d, 2.0f);
    std::vector<float> out(static_cast<size_t>(rep) * d);
    std::vector<int> visible;
    std::vector<float> w;
    exact_attention::Row row{position, 0, sink, window, ring};
    exact_attention::attend_row(row, 1, q.data(), rep, d, keys.data(), values.data(), slots, out.data(), visible, w);
    emit(tag("attention", {rep, d, sink, window, position}), out.data(), out.size());
  }
}

}  // namespace

int main() {
  bool portable = std::getenv("EXACT_GEMM_PORTABLE") != nullptr;
  const char* math = "portable";
#if defined(__x86_64__)
  exact_math::set_avx2(!portable);
  if (exact_math::has_avx2())
    math = "x86-64 AVX2";
#elif defined(__aarch64__)
  exact_math::neon::set_enabled(!portable);
  if (exact_math::neon::enabled())
    math = "arm64 NEON";
#endif
  std::printf("variant %s / %s\n", exact_gemm_variant(), math);
  Rng rng{0x9E3779B97F4A7C15ull};
  gemm_nt(rng);
  gemm_nn(rng);
  qgemm(rng);
  elementwise(rng);
  attention(rng);
  typed_qgemm(rng);  // last: the tensors above keep the inputs they had before it was added
  return 0;
}
