// What one core's vector units do per nanosecond under the fused kernel's flags, and the kernel's own sparse product
// (the first layer's x·W, sparse_row_product) beside that floor: python -m benchmarks.vector_ports.
//
// Compiled with -I gat/csrc, so that the product timed here is the kernel's, not a copy of it.
#include "fused.cpp"

#include <chrono>
#include <random>

namespace {

using Clock = std::chrono::steady_clock;

// The fewest nanoseconds of `repeats` runs of body().
template <typename Body>
double best_ns(int repeats, Body body) {
  double best = INFINITY;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    body();
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - start).count());
  }
  return best;
}

// Instructions per nanosecond of `op` in 12 independent chains (more than any core's latency × ports), `iterations`
// rounds of 12. Twelve variables, not an array, and the empty asm keep every chain in a register and stop the
// compiler folding the rounds.
template <typename V, typename Op>
__attribute__((noinline)) double independent(Op op, int64_t iterations, int repeats) {
  const double ns = best_ns(repeats, [&] {
    const V b = V{} + 0.9999999f;
    V a0 = b + 1e-7f, a1 = b + 2e-7f, a2 = b + 3e-7f, a3 = b + 4e-7f, a4 = b + 5e-7f, a5 = b + 6e-7f,
      a6 = b + 7e-7f, a7 = b + 8e-7f, a8 = b + 9e-7f, a9 = b + 1e-6f, a10 = b + 1.1e-6f, a11 = b + 1.2e-6f;
    for (int64_t n = 0; n < iterations; ++n) {
      a0 = op(0, a0, b), a1 = op(1, a1, b), a2 = op(2, a2, b), a3 = op(3, a3, b), a4 = op(4, a4, b);
      a5 = op(5, a5, b), a6 = op(6, a6, b), a7 = op(7, a7, b), a8 = op(8, a8, b), a9 = op(9, a9, b);
      a10 = op(10, a10, b), a11 = op(11, a11, b);
      asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                   "+v"(a9), "+v"(a10), "+v"(a11));
    }
  });
  return 12.0 * static_cast<double>(iterations) / ns;
}

// Dependent adds per nanosecond: one chain, each add waiting for the last (its latency, in nanoseconds, is 1 / this).
__attribute__((noinline)) double dependent_adds(int64_t iterations, int repeats) {
  using V = Vec8<float>;
  const double ns = best_ns(repeats, [&] {
    V a = V{} + 1.0f;
    const V b = V{} + 0.9999999f;
    for (int64_t n = 0; n < iterations; ++n) {
      a = ((a + b) + b) + b;
      asm volatile("" : "+v"(a));
    }
  });
  return 3.0 * static_cast<double>(iterations) / ns;
}

template <typename V>
double rate(int kind, int64_t iterations, int repeats) {
  switch (kind) {
    case 0: return independent<V>([](int, V a, V b) { return a + b; }, iterations, repeats);
    case 1: return independent<V>([](int, V a, V b) { return a * b; }, iterations, repeats);
    default: return independent<V>([](int c, V a, V b) { return c % 2 ? a * b : a + b; }, iterations, repeats);
  }
}

// A sparse x of `rows` rows holding 9 to 27 stored features (18 on average, as Cora's 18.2) drawn from `features`
// columns, a [features, 64] W, and with `dropout` the step's input masks: each stored feature keeps each head with
// probability 0.4 (the paper's input dropout), as a byte per stored feature and the kernel's multipliers.
struct SparseCase {
  std::vector<index_t> crow{0}, col;
  std::vector<float> x;
  Buffer<float> W;
  bool dropout;
  LayerCache<float> c;

  SparseCase(int64_t rows, int64_t features, bool with_dropout, uint64_t seed);
  index_t rows() const { return static_cast<index_t>(crow.size()) - 1; }
  // The kernel's x·W into g [rows, 64].
  void product(float* g) const {
    for (index_t j = 0; j < rows(); ++j)
      sparse_row_product(crow[j], crow[j + 1], c, dropout,
                         [&](index_t e) { return SparseEntry<float>{x[e], e, W.data() + col[e] * 64}; },
                         g + j * 64);
  }
};

SparseCase::SparseCase(int64_t rows, int64_t features, bool with_dropout, uint64_t seed) : dropout(with_dropout) {
  std::mt19937_64 random(seed);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t n = 9 + static_cast<int64_t>(random() % 19);
    std::vector<index_t> row;
    for (int64_t t = 0; t < n; ++t) row.push_back(static_cast<index_t>(random() % static_cast<uint64_t>(features)));
    std::sort(row.begin(), row.end());  // a CSR row's columns ascend
    for (index_t f : row) {
      col.push_back(f);
      x.push_back(1.0f / static_cast<float>(n));  // row-normalised, as the Planetoid features
    }
    crow.push_back(static_cast<index_t>(col.size()));
  }
  W.resize(static_cast<size_t>(features) * 64);
  for (float& w : W) w = static_cast<float>(random() % 2001) / 1000.0f - 1.0f;
  if (dropout) {
    c.heads_kept.resize(x.size());
    for (uint8_t& bits : c.heads_kept) {
      bits = 0;
      for (int k = 0; k < 8; ++k) bits |= (random() % 10 < 4 ? 1u : 0u) << k;
    }
    c.multipliers.resize(256 * 8);
    for (int bits = 0; bits < 256; ++bits)
      for (int k = 0; k < 8; ++k) c.multipliers[bits * 8 + k] = (bits >> k) & 1 ? 2.5f : 0.0f;
  }
}

#if defined(__AVX512F__)
// x·W under dropout through lists of what is kept, one per pair of heads: a stored feature whose two heads of a pair
// are both dropped (36 % of them at the paper's rates) adds +0 to the pair's 16 sums, which leaves them as they are,
// so the pair's list skips it and the sums keep their bytes. A record carries what the product needs of its stored
// feature (where its row of W starts for the pair, x_e · scale, the pair's lane mask), so that the product reads
// nothing else; the lists are built again for each step, since its masks are new.
struct KeptPairs {
  struct Record {
    int32_t offset;  // of the pair's 16 weights in W
    float value;     // x_e · scale
    uint32_t lanes;  // which of the 16 lanes keep it
  };
  std::vector<Record> records[4];
  std::vector<index_t> crow[4];  // row j's records of pair m: records[m][crow[m][j], crow[m][j + 1])

  explicit KeptPairs(const SparseCase& s) {
    for (int m = 0; m < 4; ++m) {
      records[m].resize(s.x.size());
      crow[m].resize(s.crow.size());
    }
  }
  // Branch-free: each stored feature is written into every pair's list, and the list's end moves past it only
  // where the pair keeps it.
  void build(const SparseCase& s) {
    index_t end[4] = {};
    const float scale = s.c.multipliers[255 * 8];
    for (index_t j = 0; j < s.rows(); ++j) {
      for (int m = 0; m < 4; ++m) crow[m][j] = end[m];
      for (index_t e = s.crow[j]; e < s.crow[j + 1]; ++e) {
        const uint8_t bits = s.c.heads_kept[e];
        for (int m = 0; m < 4; ++m) {
          records[m][end[m]] = {static_cast<int32_t>(s.col[e] * 64 + m * 16), s.x[e] * scale, kPairMasks.of[bits][m]};
          end[m] += ((bits >> (2 * m)) & 3) != 0;
        }
      }
    }
    for (int m = 0; m < 4; ++m) crow[m][s.rows()] = end[m];
  }
  // Each row's 4 lists in turn within their common length (as interleaved_edges), then each one's rest.
  void product(const SparseCase& s, float* g) const {
    for (index_t j = 0; j < s.rows(); ++j) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      index_t n[4];
      const Record* list[4];
      for (int m = 0; m < 4; ++m) {
        list[m] = records[m].data() + crow[m][j];
        n[m] = crow[m][j + 1] - crow[m][j];
      }
      interleaved_edges(n, [&](int m, index_t t) {
        const Record& r = list[m][t];
        acc[m] = _mm512_add_ps(acc[m], _mm512_maskz_mul_ps(static_cast<__mmask16>(r.lanes), _mm512_set1_ps(r.value),
                                                           _mm512_loadu_ps(s.W.data() + r.offset)));
      });
      for (int m = 0; m < 4; ++m) _mm512_storeu_ps(g + j * 64 + m * 16, acc[m]);
    }
  }
};
#endif

}  // namespace

extern "C" {

// Instructions per nanosecond: rates[0..2] 8-lane adds, multiplies, and both alternating; rates[3..5] the same with
// 16 lanes (0 without AVX-512); rates[6] dependent 8-lane adds.
void vp_rates(int64_t iterations, int repeats, double* rates) {
  for (int kind = 0; kind < 3; ++kind) {
    rates[kind] = rate<Vec8<float>>(kind, iterations, repeats);
#if defined(__AVX512F__)
    rates[3 + kind] = rate<Vec16f>(kind, iterations, repeats);
#else
    rates[3 + kind] = 0;
#endif
  }
  rates[6] = dependent_adds(iterations, repeats);
}

// Nanoseconds per stored feature of the kernel's sparse_row_product over SparseCase(rows, features, dropout): each
// stored feature gathers its row of W, as the first layer's x·W does; with `dropout` as in a training step, else as
// in a validation pass.
double vp_sparse_product(int64_t rows, int64_t features, int dropout, int repeats, uint64_t seed) {
  const SparseCase s(rows, features, dropout != 0, seed);
  Buffer<float> g(static_cast<size_t>(rows) * 64);
  const double ns = best_ns(repeats, [&] {
    s.product(g.data());
    asm volatile("" : : "r"(g.data()) : "memory");
  });
  return ns / static_cast<double>(s.col.size());
}

// The step's x·W (SparseCase with dropout) through KeptPairs: out[0] nanoseconds per stored feature of building the
// lists, out[1] of the product over them, out[2] the share of (stored feature, pair of heads) kept, out[3] 1 if g has
// the kernel's bytes, else 0. Without AVX-512 (no lane masks): all 0.
void vp_kept_pairs_product(int64_t rows, int64_t features, int repeats, uint64_t seed, double* out) {
  std::fill(out, out + 4, 0.0);
#if defined(__AVX512F__)
  const SparseCase s(rows, features, true, seed);
  KeptPairs kept(s);
  Buffer<float> g(static_cast<size_t>(rows) * 64), expected(g.size());
  const double entries = static_cast<double>(s.col.size());
  out[0] = best_ns(repeats, [&] {
    kept.build(s);
    asm volatile("" : : "r"(kept.records[0].data()) : "memory");
  }) / entries;
  out[1] = best_ns(repeats, [&] {
    kept.product(s, g.data());
    asm volatile("" : : "r"(g.data()) : "memory");
  }) / entries;
  index_t pairs = 0;
  for (int m = 0; m < 4; ++m) pairs += kept.crow[m][s.rows()];
  out[2] = static_cast<double>(pairs) / (4 * entries);
  s.product(expected.data());
  out[3] = std::memcmp(g.data(), expected.data(), g.size() * sizeof(float)) == 0 ? 1.0 : 0.0;
#else
  (void)rows, (void)features, (void)repeats, (void)seed;
#endif
}

}  // extern "C"
