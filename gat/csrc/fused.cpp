// The paper's two-layer GAT, trained and validated for R replicas (seeds) in one native call each.
//
// gat/fused.py builds this file with the system C++ compiler and calls it through ctypes; gat/layers.py's
// torch implementation is the reference it is tested against (tests/test_fused.py). One call does, for every
// replica: both layers' forward pass under dropout, the cross-entropy loss, the backward pass of every
// parameter and torch.optim.Adam's update with coupled L2 (`gat_train_step`); or the forward pass without
// dropout and the loss and accuracy (`gat_evaluate`).
//
// Replicas share nothing but the graph: each is computed by one thread from its own parameters, Adam moments
// and random stream, in a fixed order, so a replica's result is bit-for-bit the same alone, in any batch and
// at any thread count. Dropout masks come from the replica's numpy PCG64 generator, consumed exactly as
// gat/dropout.py's ReplicaDropout.keep consumes it, so the fused and the torch kernel draw the same masks.
//
// Notation (gat/layers.py): per head k, g = W^k·dropout(h); s_t(i) = a_1·g_i + b_1, s_s(j) = a_2·g_j + b_2;
// z_ij = s_t(i) + s_s(j); e_ij = LeakyReLU(z_ij); α = softmax of e over each neighbourhood;
// out_i = Σ_j dropout(α_ij)·dropout(g_j) + c; ELU and concatenation (layer 1) or the mean of the heads (layer 2).
// Arithmetic follows torch's order of operations (no FMA contraction: -ffp-contract=off), so the two kernels
// agree to float32 rounding; sums over neighbourhoods and features run in a fixed sequential order.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <utility>
#include <type_traits>
#include <thread>
#include <vector>

#include <unistd.h>  // sysconf: the L2 cache's size (first_w_by_feature_here)

#if defined(__SSE4_1__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using index_t = int64_t;

// numpy's documented C interface of a bit generator (`BitGenerator.ctypes`): its state and next_uint64.
using NextU64 = uint64_t (*)(void*);

struct Block {  // gat.graph.Neighbourhoods: edges sorted by target, one CSR row per target
  index_t targets, sources, edges;
  const index_t* crow;     // [targets + 1]
  const index_t* source;   // [edges]
  const index_t* target_in_source;  // [targets]: the position of each target among the sources
};

struct Problem {
  // Layer 1's input: the sources' features, CSR [n0, f_in]; values as float32 or float64 (the kernel's type).
  index_t n0, f_in, nnz;
  const index_t* x_crow;
  const index_t* x_col;
  const void* x_val;
  // The same entries by column (CSC, rows ascending within a column): x_ccol [f_in + 1]; for each, its row
  // x_row [nnz], its position in the CSR arrays x_pos [nnz] and (x_cval, last) its value. ∂L/∂W gathers along them.
  const index_t* x_ccol;
  const index_t* x_row;
  const index_t* x_pos;
  Block block[2];
  index_t heads[2], hidden[2];  // H and F' of both layers (layer 2: F' = C classes, heads averaged)
  const index_t* labels;         // [block[1].targets]: the loss and accuracy are over all of them
  double negative_slope;
  // x_val[x_pos[t]] for each entry t by column, in x_val's type: ∂L/∂W reads the values in its own order instead of
  // one at random per entry. Last, so that a kernel from before it (benchmarks.kernel_ab --against) reads the rest.
  const void* x_cval;
};

struct Dropout {  // null `next`: no dropout
  NextU64 next;
  void* const* states;  // one numpy bit generator state per replica
  uint8_t threshold_top;
  uint64_t threshold_rest;
  float scale;          // float32(1 / (1 - p)), as ReplicaDropout multiplies it
};

struct Adam {
  double lr, beta1, beta2, eps, weight_decay;
  double step;          // the step number after this update (torch keeps it per parameter; all are equal)
};

// Adam as torch.optim.Adam (single-tensor, coupled weight decay) applies it, operation by operation: its constants for
// one step number, then each weight's update (apply, over n weights).
struct AdamStep {
  float weight_decay, weight, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt;
  explicit AdamStep(const Adam& a)
      : weight_decay(static_cast<float>(a.weight_decay)), weight(static_cast<float>(1.0 - a.beta1)),
        beta2(static_cast<float>(a.beta2)), one_minus_beta2(static_cast<float>(1.0 - a.beta2)),
        eps(static_cast<float>(a.eps)), step_size(static_cast<float>(-(a.lr / (1.0 - std::pow(a.beta1, a.step))))),
        bias_correction2_sqrt(static_cast<float>(std::sqrt(1.0 - std::pow(a.beta2, a.step)))) {}

  void apply(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, index_t n) const {
    for (index_t i = 0; i < n; ++i) {
      // torch's vectorised CPU kernels for add(alpha=) and lerp compute these two with a fused multiply-add.
      const float g = std::fma(weight_decay, param[i], grad[i]);
      exp_avg[i] = std::fma(weight, g - exp_avg[i], exp_avg[i]);  // lerp with a weight below 0.5
      exp_avg_sq[i] = exp_avg_sq[i] * beta2 + one_minus_beta2 * g * g;
      const float denom = std::sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps;
      param[i] = param[i] + step_size * exp_avg[i] / denom;
    }
  }
};

// Adam on the first layer's W (by feature), row by row: first_layer_weight_grad updates each row of W as soon as its
// row of ∂L/∂W is summed, while the row is in L1 and while the sparse products keep the other ports busy (Adam's
// square roots and divisions wait on one divider). Null `step`: W waits for the whole gradient, as the others do.
struct AdamRows {
  const AdamStep* step = nullptr;
  float *param = nullptr, *exp_avg = nullptr, *exp_avg_sq = nullptr;
};

// Where the time of the paper's model goes, phase by phase, when built with -DGAT_PHASE_TIMERS
// (python -m benchmarks.kernel_phases): each phase's wall time, summed over every call and thread. Without the
// define the timers compile to nothing.
enum Phase : int {
  kStepTranspose, kStepInputMasks, kStepXW, kStepScores, kStepDropout, kStepAggregate, kStepLayer2, kStepLoss,
  kStepBackLayer2, kStepBackAggregate, kStepBackScores, kStepBackXW, kStepAdam,
  kValTranspose, kValXW, kValScores, kValAggregate, kValLayer2, kPhases, kUntimed = -1
};
#ifdef GAT_PHASE_TIMERS
constexpr const char* kPhaseNames[kPhases] = {
    "step: layer 1, W transposed", "step: layer 1, input dropout masks", "step: layer 1, x·W",
    "step: layer 1, attention scores and softmax", "step: layer 1, α and g dropout",
    "step: layer 1, aggregation and ELU", "step: layer 2", "step: loss", "step: layer 2 backward",
    "step: layer 1 backward, aggregation", "step: layer 1 backward, softmax and scores", "step: layer 1 backward, ∂L/∂W",
    "step: Adam", "validation: layer 1, W transposed", "validation: layer 1, x·W",
    "validation: layer 1, half-scores", "validation: layer 1, softmax, aggregation and ELU",
    "validation: layer 2"};
std::atomic<int64_t> phase_ns[kPhases];

class PhaseTimer {  // times `phase` until next() or the end of the scope; kUntimed: nothing
 public:
  explicit PhaseTimer(int phase) : phase_(phase), start_(now()) {}
  void next(int phase) {
    const int64_t t = now();
    if (phase_ != kUntimed) phase_ns[phase_] += t - start_;
    phase_ = phase;
    start_ = t;
  }
  ~PhaseTimer() { next(kUntimed); }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int phase_;
  int64_t start_;
};
#define GAT_PHASE(timer, phase) PhaseTimer timer(phase)
#define GAT_NEXT_PHASE(timer, phase) timer.next(phase)
#else
#define GAT_PHASE(timer, phase) static_cast<void>(0)
#define GAT_NEXT_PHASE(timer, phase) static_cast<void>(0)
#endif

constexpr int kMaxFeatures = 256;  // F' of a head without a specialised build of the layer
constexpr int kGroup = 8;  // heads whose sums are accumulated side by side
constexpr int kParams = 6;  // per layer, in gat.layers.GraphAttentionLayer's order: W, a_target, a_source,
                            // b_target, b_source, bias

index_t param_numel(const Problem& p, int layer, int which) {
  const index_t H = p.heads[layer], F = p.hidden[layer];
  const index_t fin = layer == 0 ? p.f_in : p.heads[0] * p.hidden[0];
  switch (which) {
    case 0: return H * fin * F;
    case 1: case 2: case 5: return H * F;
    default: return H;
  }
}

// numpy's PCG64 (pcg_setseq_128_xsl_rr_64_random_r) inline: a step of the 128-bit LCG, then the XSL-RR output of
// the new state. A bit generator's state, as numpy lays it out (numpy/random/src/pcg64/pcg64.h), points to the two
// 128-bit integers; gat/fused.py passes PCG64 generators only.
struct Pcg64Integers {
  unsigned __int128 state, inc;
};
struct NumpyPcg64State {
  Pcg64Integers* pcg;
  int has_uint32;
  uint32_t uinteger;
};

constexpr unsigned __int128 kPcg64Multiplier =
    static_cast<unsigned __int128>(0x2360ED051FC65DA4ull) << 64 | 0x4385DF649FCCF645ull;

// One step of the LCG, or two at once: state · multiplier + increment, with (multiplier, increment) = (M, inc) for
// one step and (M², (M + 1) inc) for two. Then the XSL-RR output of the new state.
inline uint64_t pcg64_advance(unsigned __int128& state, unsigned __int128 multiplier, unsigned __int128 increment) {
  state = state * multiplier + increment;
  const uint64_t xored = static_cast<uint64_t>(state >> 64) ^ static_cast<uint64_t>(state);
  const unsigned rotation = static_cast<unsigned>(state >> 122);
  return (xored >> rotation) | (xored << ((64 - rotation) & 63));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 16 PCG64 states in two vectors' 64-bit lanes (high and low halves apart), each stepped 16 at a time by one
// multiply-add of 128-bit integers mod 2^128 built from 64-bit lane operations: s·m = lo(s)·lo(m) + 2^64 (mulhi(lo(s),
// lo(m)) + lo(s)·hi(m) + hi(s)·lo(m)), the 64 × 64 → 128 high half from four 32 × 32 → 64 products. Integers are
// exact, so lane c gives the word a scalar step would, whatever the vector width.
constexpr int kPcgLanes = 16;
struct PcgJump {  // (multiplier, increment) of 16 steps, broadcast: its halves and lo(m)'s two 32-bit halves
  __m512i m_high, m_low, m_low0, m_low1, c_high, c_low;
  PcgJump(unsigned __int128 m, unsigned __int128 c)
      : m_high(_mm512_set1_epi64(static_cast<int64_t>(m >> 64))), m_low(_mm512_set1_epi64(static_cast<int64_t>(m))),
        m_low0(_mm512_set1_epi64(static_cast<int64_t>(static_cast<uint32_t>(m)))),
        m_low1(_mm512_set1_epi64(static_cast<int64_t>(static_cast<uint32_t>(m >> 32)))),
        c_high(_mm512_set1_epi64(static_cast<int64_t>(c >> 64))), c_low(_mm512_set1_epi64(static_cast<int64_t>(c))) {}
};

// One jump of 8 states (high, low), and their 8 XSL-RR outputs.
inline __m512i pcg64_lanes_advance(__m512i& high, __m512i& low, const PcgJump& j) {
  const __m512i a = low, a1 = _mm512_srli_epi64(a, 32), low32 = _mm512_set1_epi64(0xFFFFFFFFll);
  const __m512i p00 = _mm512_mul_epu32(a, j.m_low0), p01 = _mm512_mul_epu32(a, j.m_low1);
  const __m512i p10 = _mm512_mul_epu32(a1, j.m_low0), p11 = _mm512_mul_epu32(a1, j.m_low1);
  const __m512i middle = _mm512_add_epi64(_mm512_add_epi64(_mm512_srli_epi64(p00, 32), _mm512_and_si512(p01, low32)),
                                          _mm512_and_si512(p10, low32));
  const __m512i mulhi = _mm512_add_epi64(_mm512_add_epi64(p11, _mm512_srli_epi64(p01, 32)),
                                         _mm512_add_epi64(_mm512_srli_epi64(p10, 32), _mm512_srli_epi64(middle, 32)));
  const __m512i cross = _mm512_add_epi64(_mm512_mullo_epi64(a, j.m_high), _mm512_mullo_epi64(high, j.m_low));
  low = _mm512_add_epi64(_mm512_mullo_epi64(a, j.m_low), j.c_low);
  const __mmask8 carry = _mm512_cmplt_epu64_mask(low, j.c_low);
  high = _mm512_add_epi64(_mm512_add_epi64(mulhi, cross), j.c_high);
  high = _mm512_mask_add_epi64(high, carry, high, _mm512_set1_epi64(1));
  return _mm512_rorv_epi64(_mm512_xor_si512(high, low), _mm512_srli_epi64(high, 58));  // rotation: state >> 122
}
#endif

// `count` words of the replica's stream into `out` (8 bytes each, unaligned), as `count` calls of d.next would give
// them, without a call per word: the states stay in registers, in two chains of every other state (s_i and s_{i+1},
// each 2 steps at a time), so two multiplies run side by side; with AVX-512 (DQ), long runs go 16 states at a time in
// vector lanes instead. The words and the final state are the same. The first word comes from d.next itself, and
// only if the inline step gave the same word and state do the others take it (else each is a call, as before).
// Returns whether they did.
inline bool draw_words(const Dropout& d, void* state, index_t count, uint8_t* out) {
  if (count == 0) return true;
  Pcg64Integers* pcg = static_cast<NumpyPcg64State*>(state)->pcg;
  unsigned __int128 before = pcg->state, after = before;
  const unsigned __int128 inc = pcg->inc;
  const uint64_t expected = pcg64_advance(after, kPcg64Multiplier, inc);
  const uint64_t first = d.next(state);
  std::memcpy(out, &first, 8);
  if (first != expected || pcg->state != after) {
    for (index_t w = 1; w < count; ++w) {
      const uint64_t word = d.next(state);
      std::memcpy(out + 8 * w, &word, 8);
    }
    return false;
  }
  // Word w is the output of s_{w+1}; before each step below, `before` is s_{w-1} and `after` s_w.
  index_t w = 1;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (count - w >= 2 * kPcgLanes) {
    // Words w to w + 15 one step at a time, their states s_{w+1} ... s_{w+16} into the lanes; then each jump of 16
    // steps gives the next 16 words.
    alignas(64) uint64_t high[kPcgLanes], low[kPcgLanes];
    unsigned __int128 s = after, jump_m = 1, jump_c = 0;
    for (int lane = 0; lane < kPcgLanes; ++lane) {
      const uint64_t word = pcg64_advance(s, kPcg64Multiplier, inc);
      std::memcpy(out + 8 * (w + lane), &word, 8);
      high[lane] = static_cast<uint64_t>(s >> 64);
      low[lane] = static_cast<uint64_t>(s);
      jump_m *= kPcg64Multiplier;
      jump_c = jump_c * kPcg64Multiplier + inc;
    }
    w += kPcgLanes;
    const PcgJump jump(jump_m, jump_c);
    __m512i lanes_high[2], lanes_low[2];
    for (int v = 0; v < 2; ++v) {
      lanes_high[v] = _mm512_load_si512(high + 8 * v);
      lanes_low[v] = _mm512_load_si512(low + 8 * v);
    }
    for (; w + kPcgLanes <= count; w += kPcgLanes)
      for (int v = 0; v < 2; ++v)
        _mm512_storeu_si512(out + 8 * (w + 8 * v), pcg64_lanes_advance(lanes_high[v], lanes_low[v], jump));
    _mm512_store_si512(high + 8, lanes_high[1]);
    _mm512_store_si512(low + 8, lanes_low[1]);
    before = static_cast<unsigned __int128>(high[14]) << 64 | low[14];  // lanes 14 and 15: s_{w-1} and s_w
    after = static_cast<unsigned __int128>(high[15]) << 64 | low[15];
  }
#endif
  const unsigned __int128 m2 = kPcg64Multiplier * kPcg64Multiplier, c2 = kPcg64Multiplier * inc + inc;
  for (; w + 2 <= count; w += 2) {
    const uint64_t a = pcg64_advance(before, m2, c2), b = pcg64_advance(after, m2, c2);
    std::memcpy(out + 8 * w, &a, 8);
    std::memcpy(out + 8 * w + 8, &b, 8);
  }
  if (w < count) {
    const uint64_t a = pcg64_advance(before, m2, c2);
    std::memcpy(out + 8 * w, &a, 8);
    pcg->state = before;
  } else {
    pcg->state = after;
  }
  return true;
}

// The ties' decisions, in order: one word each from the stream, whose low 24 bits against the threshold's decide
// (ReplicaDropout._kept). keep(i, kept) for each tie i; the words come inline, 64 at a time.
template <typename Keep>
inline void decide_ties(const Dropout& d, void* state, const std::vector<index_t>& ties, Keep keep) {
  constexpr size_t kAtATime = 64;
  uint64_t words[kAtATime];
  for (size_t first = 0; first < ties.size(); first += kAtATime) {
    const size_t n = std::min(kAtATime, ties.size() - first);
    draw_words(d, state, static_cast<index_t>(n), reinterpret_cast<uint8_t*>(words));
    for (size_t t = 0; t < n; ++t) keep(ties[first + t], (words[t] & 0xFFFFFFu) >= d.threshold_rest);
  }
}

// Of n ≤ 64 · kTopBlocks drawn top bytes, the kept ones (above the threshold's top byte) as one 64-bit mask per 64
// bytes (bit b of kept[m]: byte 64 m + b), and the ties (equal to it) pushed onto `ties` in order, as first + their
// position. With AVX-512, one compare of 64 bytes each: a word at a time, with a branch on its rare ties, had cost as
// much as drawing the words. No branch per block either: the blocks with a tie (about 1 in 4) are listed as they
// come, then walked.
constexpr index_t kTopBlocks = 128;
#if defined(__AVX512BW__)
// The first m (at most 64) bits set.
inline __mmask64 first_bits(index_t m) { return m >= 64 ? ~__mmask64{0} : (__mmask64{1} << m) - 1; }
#endif
inline void classify_top_bytes(const uint8_t* bytes, index_t n, uint8_t top, index_t first, uint64_t* kept,
                               std::vector<index_t>& ties) {
#if defined(__AVX512BW__)
  const __m512i tops = _mm512_set1_epi8(static_cast<char>(top));
  __mmask64 tied[kTopBlocks];
  index_t tied_block[kTopBlocks], listed = 0;
  for (index_t block = 0; 64 * block < n; ++block) {
    const __mmask64 valid = first_bits(n - 64 * block);
    const __m512i drawn = _mm512_maskz_loadu_epi8(valid, bytes + 64 * block);
    tied[listed] = _mm512_mask_cmpeq_epu8_mask(valid, drawn, tops);
    tied_block[listed] = block;
    listed += tied[listed] != 0;
    kept[block] = _mm512_mask_cmpgt_epu8_mask(valid, drawn, tops);
  }
  for (index_t i = 0; i < listed; ++i)
    for (__mmask64 t = tied[i]; t != 0; t &= t - 1) ties.push_back(first + 64 * tied_block[i] + __builtin_ctzll(t));
#else
  for (index_t block = 0; 64 * block < n; ++block) {
    const index_t m = std::min<index_t>(64, n - 64 * block);
    uint64_t bits = 0;
    for (index_t b = 0; b < m; ++b) bits |= static_cast<uint64_t>(bytes[64 * block + b] > top) << b;
    kept[block] = bits;
    for (index_t b = 0; b < m; ++b)
      if (bytes[64 * block + b] == top) ties.push_back(first + 64 * block + b);
  }
#endif
}

#if defined(__AVX512BW__)
// Bits q to q + 15 of a block's 64-bit mask: the mask of its floats q to q + 15.
inline __mmask16 sixteen(__mmask64 mask, index_t q) { return static_cast<__mmask16>(mask >> q); }
#endif

// The masks of ReplicaDropout.keep for `count` elements: an element is kept when a uniform 32-bit u is at
// least the threshold; u's top byte decides unless it ties the threshold's, and the ties then draw one
// 64-bit word each, in order, whose low 24 bits decide. The top bytes come 8 to a word, little-endian.
template <typename T>
void draw_mask(const Dropout& d, void* state, index_t count, T* mask, std::vector<index_t>& ties) {
  ties.clear();
  const T scale = static_cast<T>(d.scale);
#if defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, float>) {  // 64 bytes at a time, each 16 floats one masked move
    const __m512 scales = _mm512_set1_ps(d.scale);
    uint8_t bytes[64 * kTopBlocks];
    uint64_t kept[kTopBlocks];
    for (index_t base = 0; base < count; base += 64 * kTopBlocks) {
      const index_t n = std::min(64 * kTopBlocks, count - base);
      draw_words(d, state, (n + 7) / 8, bytes);
      classify_top_bytes(bytes, n, d.threshold_top, base, kept, ties);
      const index_t full = n / 64;
      for (index_t block = 0; block < full; ++block)
        for (index_t q = 0; q < 64; q += 16)
          _mm512_storeu_ps(mask + base + 64 * block + q, _mm512_maskz_mov_ps(sixteen(kept[block], q), scales));
      if (full * 64 < n) {  // the last block's n % 64 floats
        const __mmask64 valid = first_bits(n % 64);
        for (index_t q = 0; q < 64; q += 16)
          _mm512_mask_storeu_ps(mask + base + 64 * full + q, sixteen(valid, q),
                                _mm512_maskz_mov_ps(sixteen(kept[full], q), scales));
      }
    }
    decide_ties(d, state, ties, [&](index_t i, bool kept) { mask[i] = kept ? scale : T(0); });
    return;
  }
#endif
  constexpr uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
  const uint64_t pattern = ones * d.threshold_top;
#if defined(__AVX2__)
  const __m256i top = _mm256_set1_epi32(d.threshold_top);
  const __m256 scales = _mm256_set1_ps(d.scale);
#endif
  constexpr index_t kChunk = 256;  // words drawn at a time
  uint64_t words[kChunk];
  index_t base = 0;
  for (; base + 8 <= count; base += 8) {
    const index_t w = base / 8 % kChunk;
    if (w == 0) draw_words(d, state, std::min(kChunk, count / 8 - base / 8), reinterpret_cast<uint8_t*>(words));
    const uint64_t word = words[w];
#if defined(__AVX2__)
    if constexpr (std::is_same_v<T, float>) {  // the 8 bytes widened, compared and turned into 8 floats at once
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(word)));
      const __m256i kept = _mm256_cmpgt_epi32(bytes, top);
      _mm256_storeu_ps(mask + base, _mm256_and_ps(_mm256_castsi256_ps(kept), scales));
    } else
#endif
    {
      for (int b = 0; b < 8; ++b) mask[base + b] = static_cast<uint8_t>(word >> (8 * b)) > d.threshold_top ? scale : T(0);
    }
    const uint64_t x = word ^ pattern;
    if ((x - ones) & ~x & highs) {  // some byte equals the threshold's (1 word in 32)
      for (int b = 0; b < 8; ++b)
        if (static_cast<uint8_t>(word >> (8 * b)) == d.threshold_top) ties.push_back(base + b);
    }
  }
  if (base < count) {
    const uint64_t word = d.next(state);
    for (index_t b = 0; base + b < count; ++b) {
      const uint8_t top = static_cast<uint8_t>(word >> (8 * b));
      mask[base + b] = top > d.threshold_top ? scale : T(0);
      if (top == d.threshold_top) ties.push_back(base + b);
    }
  }
  decide_ties(d, state, ties, [&](index_t i, bool kept) { mask[i] = kept ? scale : T(0); });
}

// The keep decisions of ReplicaDropout.keep for `count` elements, one byte each (0xFF kept, 0x00 dropped), from
// the same draws as draw_mask. `out` holds count rounded up to 8 bytes.
inline void draw_kept_bytes(const Dropout& d, void* state, index_t count, uint8_t* out, std::vector<index_t>& ties) {
  ties.clear();
  const index_t words = (count + 7) / 8;
  draw_words(d, state, words, out);  // little-endian: byte b of word w is out[8 w + b]
#if defined(__AVX512BW__)
  uint64_t kept[kTopBlocks];
  for (index_t base = 0; base < count; base += 64 * kTopBlocks) {
    const index_t n = std::min(64 * kTopBlocks, count - base);
    classify_top_bytes(out + base, n, d.threshold_top, base, kept, ties);
    for (index_t block = 0; 64 * block < n; ++block)
      _mm512_mask_storeu_epi8(out + base + 64 * block, first_bits(n - 64 * block), _mm512_movm_epi8(kept[block]));
  }
#else
  constexpr uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
  const uint64_t pattern = ones * d.threshold_top;
  for (index_t w = 0; w < words; ++w) {
    uint64_t word;
    std::memcpy(&word, out + 8 * w, 8);
    const uint64_t x = word ^ pattern;
    if ((x - ones) & ~x & highs) {
      for (index_t n = 8 * w; n < std::min(8 * w + 8, count); ++n)
        if (out[n] == d.threshold_top) ties.push_back(n);
    }
  }
  const uint8_t top = d.threshold_top;
  uint8_t* __restrict bytes = out;  // the only pointer the loop writes through: it vectorises
  for (index_t n = 0; n < count; ++n) bytes[n] = bytes[n] > top ? 0xFF : 0x00;
#endif
  decide_ties(d, state, ties, [&](index_t n, bool kept) { out[n] = kept ? 0xFF : 0x00; });
}

// The keep decisions of ReplicaDropout.keep for `count` elements as bits, from the same draws as draw_mask: bit n of
// `bits` says whether element n is kept. `bits` gets count / 64 + 2 words, 0 past `count`, so that heads_of_bits may
// read a word past the last. 30 KB for the step's input dropout, where bytes took 245 KB and floats 980 KB.
inline void draw_kept_bits(const Dropout& d, void* state, index_t count, std::vector<uint64_t>& bits,
                           std::vector<index_t>& ties) {
  ties.clear();
  bits.assign(count / 64 + 2, 0);
  uint8_t bytes[64 * kTopBlocks];
  for (index_t base = 0; base < count; base += 64 * kTopBlocks) {
    const index_t n = std::min(64 * kTopBlocks, count - base);
    draw_words(d, state, (n + 7) / 8, bytes);
    classify_top_bytes(bytes, n, d.threshold_top, base, bits.data() + base / 64, ties);
  }
  decide_ties(d, state, ties, [&](index_t n, bool kept) { bits[n / 64] |= static_cast<uint64_t>(kept) << n % 64; });
}

// A draw for 8 heads, head-major [8, n] as bits (draw_kept_bits), folded into one byte per element whose bit k says
// whether head k keeps it: out[e] for e in [0, n). With AVX-512, 64 elements at a time: head k's 64 bits, from bit
// k n + e on, become 64 bytes of 0 or 1 << k, and the 8 heads' bytes are or-ed.
inline void heads_of_bits(const uint64_t* bits, index_t n, uint8_t* out) {
#if defined(__AVX512BW__)
  const auto word_at = [bits](index_t at) {  // bits at to at + 63
    const index_t w = at / 64, shift = at % 64;
    return shift == 0 ? bits[w] : bits[w] >> shift | bits[w + 1] << (64 - shift);
  };
  for (index_t e = 0; e < n; e += 64) {
    __m512i heads = _mm512_setzero_si512();
    for (int k = 0; k < 8; ++k)
      heads = _mm512_or_si512(heads,
                              _mm512_maskz_mov_epi8(word_at(k * n + e), _mm512_set1_epi8(static_cast<char>(1 << k))));
    _mm512_mask_storeu_epi8(out + e, first_bits(n - e), heads);
  }
#else
  for (index_t e = 0; e < n; ++e) {
    uint8_t heads = 0;
    for (int k = 0; k < 8; ++k) heads |= static_cast<uint8_t>((bits[(k * n + e) / 64] >> (k * n + e) % 64 & 1) << k);
    out[e] = heads;
  }
#endif
}

// The kernel's arrays start on a cache line (64 bytes). A node's 64 features (256 bytes), which the first layer
// gathers along edges and stored features, then span 4 lines, not 5: malloc's large blocks start 16 bytes past a
// page, and its others anywhere 16 bytes apart, which also made a phase's time differ by 10 % and more from one
// process to the next.
// resize(n) leaves the new elements as they are, where std::vector's would write zeros: a workspace serves the
// training step and the validation pass, whose views differ in size, so a buffer grew, and was zeroed, twice per
// epoch, only to be written whole (the per-call seed-epoch 0.973 of its time, the native loop's 0.981 with 4 seeds).
// Whatever must start at zero says so (assign, fill, `= {}`). Built with -DGAT_POISON_BUFFERS, new elements are NaN
// (integers: a third of their largest value, 85 in a byte) instead, so a read before a write fails the self-check
// (tests/test_fused_builds.py). Copies and resize(n, value) keep std::allocator_traits' own placement new.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
#ifdef GAT_POISON_BUFFERS
    if constexpr (std::is_floating_point_v<U>) {
      ::new (static_cast<void*>(p)) U(std::numeric_limits<U>::quiet_NaN());
      return;
    } else if constexpr (std::is_integral_v<U>) {
      ::new (static_cast<void*>(p)) U(std::numeric_limits<U>::max() / 3);
      return;
    }
#endif
    ::new (static_cast<void*>(p)) U;  // default-initialised: nothing written for numbers
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept { return false; }
};
template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;

// A layer's parameters (or their gradients), torch's layouts. W_by_feature: the paper's first layer keeps W (and
// ∂L/∂W) as [F_in, H·F'], the 64 weights of an input feature in one row (SeedRun's own copy; layer_forward would
// otherwise transpose torch's [H, F_in, F'] into that on every pass).
template <typename T>
struct LayerParams {
  const T *W, *a_target, *a_source, *b_target, *b_source, *bias;
  bool W_by_feature = false;
};

template <typename T>
struct LayerGrads {
  T *W, *a_target, *a_source, *b_target, *b_source, *bias;
  bool W_by_feature = false;
};

// What a layer's backward pass needs of its forward pass.
template <typename T>
struct LayerCache {
  Buffer<T> input;      // layer 1: the masked feature values [H, nnz]; layer 2: the masked input [H, S, F_in]
  // The paper's first layer (fast_first_layer) under dropout: for each stored feature one byte, whose bit k says
  // whether head k keeps it [nnz], and for each such byte the 8 heads' multipliers, 0 or the dropout scale [256, 8].
  Buffer<uint8_t> heads_kept;
  Buffer<T> multipliers;
  Buffer<T> input_mask; // layer 2 only: [H, S, F_in]
  const T* shared_input = nullptr;  // layer 2 without dropout: the input [S, F_in], for every head

  const T* head_input(index_t k, index_t size) const {
    return shared_input != nullptr ? shared_input : input.data() + k * size;
  }
  // The paper's first layer (fast_first_layer) keeps g, g_dropped and ∂L/∂g by source, [S, H·F']: a source's 8
  // heads are 4 adjacent cache lines for the gathers along the edges, not 8 scattered ones. Masks stay as drawn.
  Buffer<T> g;          // W·dropout(h) [H, S, F']
  Buffer<T> g_mask;     // [H, S, F']
  Buffer<T> g_dropped;  // [H, S, F']
  Buffer<T> z;          // scores before LeakyReLU [H, E]
  Buffer<T> alpha;      // [H, E]
  Buffer<T> alpha_mask; // [H, E]
  // The paper's first layer under dropout keeps its masks as bits, and multiplies by `multipliers`: for each edge a
  // byte whose bit k says whether head k keeps α [E]; for each head and source a byte whose bit f says whether
  // feature f of g is kept [H, S], as drawn. α dropped, by edge [E, 8], for its backward pass.
  Buffer<uint8_t> alpha_kept, g_kept;
  Buffer<T> alpha_dropped8;
  Buffer<T> pre;        // output before the activation [H, T, F']
};

template <typename T>
struct Workspace {
  LayerCache<T> cache[2];
  Buffer<T> hidden;     // layer 1's output, layer 2's input [T1, H1·F1]
  Buffer<T> logits;     // [T2, C]
  Buffer<T> grad_logits, grad_hidden, grad_out, grad_g, s_target, s_source, grad_s_target, grad_s_source,
      grad_alpha, e, grads, weights_t, weights_t2, weight_pairs, grad_weights_t, z8, alpha8, row_sums;
  std::vector<uint64_t> kept_bits;  // keep decisions in a stream's order, one bit each (draw_kept_bits)
  AdamRows adam_rows;  // train_replica's, for the first layer's backward pass
  std::vector<index_t> ties;
};

// 8 lanes of T in one vector (GCC's vector extension: AVX, else SSE, else scalar code); each lane rounds as
// the scalar operation does.
template <typename T>
struct Vec8Of {
  typedef T type __attribute__((vector_size(8 * sizeof(T))));
};
template <typename T>
using Vec8 = typename Vec8Of<T>::type;

template <typename T>
inline Vec8<T> load8(const T* p) {
  Vec8<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
inline void store8(T* p, Vec8<T> v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
inline T sum8(Vec8<T> v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// sum8 of each of 8 vectors, lane k of the result the sum of v[k]: the same pairs added in the same order
// (((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))), by adding the even and odd lanes of two vectors at once.
template <typename T>
inline Vec8<T> sum8_each(const Vec8<T> v[8]) {
  using I = typename Vec8Of<typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type>::type;
  // [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7], as _mm256_hadd_ps(a, b)
  auto pairs = [](Vec8<T> a, Vec8<T> b) {
    return __builtin_shuffle(a, b, I{0, 2, 8, 10, 4, 6, 12, 14}) + __builtin_shuffle(a, b, I{1, 3, 9, 11, 5, 7, 13, 15});
  };
  // lanes 0-3: the low halves' sums (a0+a1)+(a2+a3) of v[0..3], lanes 4-7 their high halves'; likewise for v[4..7]
  const Vec8<T> first = pairs(pairs(v[0], v[1]), pairs(v[2], v[3]));
  const Vec8<T> second = pairs(pairs(v[4], v[5]), pairs(v[6], v[7]));
  return __builtin_shuffle(first, second, I{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(first, second, I{4, 5, 6, 7, 12, 13, 14, 15});
}

// Lane k of v in every lane: one cross-lane permute with AVX2 (GCC otherwise spends two shuffles on most lanes).
template <typename T>
inline Vec8<T> lane_everywhere(Vec8<T> v, int k) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>)
    return reinterpret_cast<Vec8<T>>(_mm256_permutevar8x32_ps(reinterpret_cast<__m256>(v), _mm256_set1_epi32(k)));
#endif
  const T x = v[k];
  return Vec8<T>{x, x, x, x, x, x, x, x};  // not 0 + x, which would turn -0 into +0
}

// *x in every lane, loaded from memory (a broadcast load, which takes a load port, not the shuffle port that
// lane_everywhere's permute needs).
template <typename T>
inline Vec8<T> broadcast8(const T* x) {
  const T v = *x;
  return Vec8<T>{v, v, v, v, v, v, v, v};
}

// 16 lanes of float in one vector, where the CPU has AVX-512 (-march=x86-64-v4, or -march=native on such a CPU):
// the first layer's 64 features of a node are then 4 vectors, not 8, and a loop over them takes half the
// instructions. Each lane takes the operation it takes in 8 lanes, in the same order, so the bytes are the same at
// either width (tests/test_fused_builds.py trains the same bytes with -march=x86-64-v3 and -v4).
#if defined(__AVX512F__)
constexpr bool kWideVectors = true;
#else
constexpr bool kWideVectors = false;
#endif
typedef float Vec16f __attribute__((vector_size(16 * sizeof(float))));

inline Vec16f load16(const float* p) {
  Vec16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, Vec16f v) {
  std::memcpy(p, &v, sizeof v);
}

// Lane 2m of v in lanes 0-7 and lane 2m + 1 in lanes 8-15: the multipliers of heads 2m and 2m + 1, whose 8 features
// each are one 16-lane vector of a node's 64. One cross-lane permute (AVX-512); without it, never called.
inline Vec16f lane_pair_everywhere(Vec8<float> v, int m) {
#if defined(__AVX512F__)
  const __m512i index = _mm512_inserti64x4(_mm512_set1_epi32(2 * m), _mm256_set1_epi32(2 * m + 1), 1);
  return reinterpret_cast<Vec16f>(_mm512_permutexvar_ps(index, _mm512_castps256_ps512(reinterpret_cast<__m256>(v))));
#else
  const float low = v[2 * m], high = v[2 * m + 1];
  return Vec16f{low, low, low, low, low, low, low, low, high, high, high, high, high, high, high, high};
#endif
}

#if defined(__AVX512F__)
// For each byte of c.heads_kept (bit k: head k keeps the stored feature) and each pair m of heads, the 16-lane mask
// of the lanes whose head keeps it: lanes 0-7 for head 2m, lanes 8-15 for head 2m + 1. A mask register loads it
// from memory, a load port's work.
struct PairMasks {
  uint16_t of[256][4];
};
constexpr PairMasks make_pair_masks() {
  PairMasks masks{};
  for (int bits = 0; bits < 256; ++bits)
    for (int m = 0; m < 4; ++m)
      masks.of[bits][m] = static_cast<uint16_t>(((bits >> (2 * m)) & 1 ? 0x00FF : 0) |
                                                ((bits >> (2 * m + 1)) & 1 ? 0xFF00 : 0));
  return masks;
}
alignas(64) inline constexpr PairMasks kPairMasks = make_pair_masks();
#endif

// The 8 floats at p in both halves of a 16-lane vector (one broadcast load with AVX-512 DQ), and a 16-lane vector's
// two halves; plain copies without AVX-512.
inline Vec16f twice(const float* p) {
#if defined(__AVX512DQ__)
  return reinterpret_cast<Vec16f>(_mm512_broadcast_f32x8(_mm256_loadu_ps(p)));
#else
  Vec16f out;
  std::memcpy(&out, p, 8 * sizeof(float));
  std::memcpy(reinterpret_cast<float*>(&out) + 8, p, 8 * sizeof(float));
  return out;
#endif
}

// `low` in lanes 0-7 and `high` in lanes 8-15: halves' inverse.
inline Vec16f joined(Vec8<float> low, Vec8<float> high) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec16f>(_mm512_insertf64x4(_mm512_castpd256_pd512(reinterpret_cast<__m256d>(low)),
                                                     reinterpret_cast<__m256d>(high), 1));
#else
  Vec16f out;
  std::memcpy(&out, &low, sizeof low);
  std::memcpy(reinterpret_cast<float*>(&out) + 8, &high, sizeof high);
  return out;
#endif
}

inline void halves(Vec16f v, Vec8<float>& low, Vec8<float>& high) {
#if defined(__AVX512F__)
  const __m512 wide = reinterpret_cast<__m512>(v);
  low = reinterpret_cast<Vec8<float>>(_mm512_castps512_ps256(wide));
  high = reinterpret_cast<Vec8<float>>(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide), 1)));
#else
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const float*>(&v) + 8, sizeof high);
#endif
}

typedef int32_t Vec16i __attribute__((vector_size(16 * sizeof(int32_t))));

// The 8-lane shuffle of two vectors with indices L (0-7: lanes of a, 8-15: lanes of b), as in sum8_each and
// transpose8, done in each half of two 16-lane vectors at once.
template <int... L>
inline Vec16f in_each_half(Vec16f a, Vec16f b) {
  static_assert(sizeof...(L) == 8);
  return __builtin_shuffle(a, b, Vec16i{(L < 8 ? L : L + 8)..., (L < 8 ? L + 8 : L + 16)...});
}

// sum8_each over 16-lane vectors: pairs[m] holds head 2m's 8 values in lanes 0-7 and head 2m + 1's in lanes 8-15.
// Lane k of the result is sum8 of head k's values, the same pairs added in the same order as sum8_each: the steps
// below are sum8_each's, run in both halves at once (heads 0, 2, 4, 6 below, 1, 3, 5, 7 above), with the last
// shuffle putting the heads back in order. Half the shuffles of sum8_each on 8 vectors.
inline Vec8<float> sum8_each_pairs(const Vec16f pairs[4]) {
  auto pairwise = [](Vec16f a, Vec16f b) {  // sum8_each's `pairs` in each half
    return in_each_half<0, 2, 8, 10, 4, 6, 12, 14>(a, b) + in_each_half<1, 3, 9, 11, 5, 7, 13, 15>(a, b);
  };
  // lanes 0-7: the sums (a0+a1)+(a2+a3) of heads 0, 2, 4, 6, then their (a4+a5)+(a6+a7); lanes 8-15: heads 1, 3, 5, 7
  const Vec16f quarters = pairwise(pairwise(pairs[0], pairs[1]), pairwise(pairs[2], pairs[3]));
  // lanes 0-7: head k's first sum, lanes 8-15: its second, k = 0..7
  const Vec16f by_head = __builtin_shuffle(quarters, Vec16i{0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15});
  Vec8<float> first, second;
  halves(by_head, first, second);
  return first + second;
}

// The 8 × 8 matrix `rows` transposed in place: lane k of rows[f] becomes lane f of rows[k] (AVX2's unpack, shuffle
// and 128-bit permute pattern; moves only, no arithmetic).
template <typename T>
inline void transpose8(Vec8<T> rows[8]) {
  using I = typename Vec8Of<typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type>::type;
  Vec8<T> t[8], u[8];
  for (int r = 0; r < 8; r += 2) {
    t[r] = __builtin_shuffle(rows[r], rows[r + 1], I{0, 8, 1, 9, 4, 12, 5, 13});       // unpacklo
    t[r + 1] = __builtin_shuffle(rows[r], rows[r + 1], I{2, 10, 3, 11, 6, 14, 7, 15});  // unpackhi
  }
  for (int r = 0; r < 8; r += 4)
    for (int h = 0; h < 2; ++h) {
      u[r + 2 * h] = __builtin_shuffle(t[r + h], t[r + h + 2], I{0, 1, 8, 9, 4, 5, 12, 13});
      u[r + 2 * h + 1] = __builtin_shuffle(t[r + h], t[r + h + 2], I{2, 3, 10, 11, 6, 7, 14, 15});
    }
  // u[0..3]: columns 0, 1, 2, 3 of rows 0-3 in lanes 0-3 and columns 4-7 in lanes 4-7; u[4..7] likewise of rows 4-7
  for (int f = 0; f < 4; ++f) {
    rows[f] = __builtin_shuffle(u[f], u[f + 4], I{0, 1, 2, 3, 8, 9, 10, 11});
    rows[f + 4] = __builtin_shuffle(u[f], u[f + 4], I{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

// The 8 heads' half-scores of one node from its 64 features g (head k's 8 at 8 k): lane k is
// dot(g + 8 k, a + 8 k, 8) + b[k], the same products added in the same order (0, then f = 0..7, then b), the 8
// heads' sums side by side after one transpose of the products.
template <typename T>
inline Vec8<T> half_scores8(const T* g, const T* a, const T* b) {
  Vec8<T> products[8];
  for (int k = 0; k < 8; ++k) products[k] = load8(g + k * 8) * load8(a + k * 8);
  transpose8<T>(products);  // products[f]: feature f's product in each head
  Vec8<T> s = {};
  for (int f = 0; f < 8; ++f) s += products[f];
  return s + load8(b);
}

#if defined(__AVX512F__)
// transpose8 of two 8 × 8 matrices at once, one in the lanes 0-7 of `rows`, the other in lanes 8-15: transpose8's
// moves, with its indices, within each half.
inline void transpose8_halves(Vec16f rows[8]) {
  Vec16f t[8], u[8];
  for (int r = 0; r < 8; r += 2) {
    t[r] = in_each_half<0, 8, 1, 9, 4, 12, 5, 13>(rows[r], rows[r + 1]);
    t[r + 1] = in_each_half<2, 10, 3, 11, 6, 14, 7, 15>(rows[r], rows[r + 1]);
  }
  for (int r = 0; r < 8; r += 4)
    for (int h = 0; h < 2; ++h) {
      u[r + 2 * h] = in_each_half<0, 1, 8, 9, 4, 5, 12, 13>(t[r + h], t[r + h + 2]);
      u[r + 2 * h + 1] = in_each_half<2, 3, 10, 11, 6, 7, 14, 15>(t[r + h], t[r + h + 2]);
    }
  for (int f = 0; f < 4; ++f) {
    rows[f] = in_each_half<0, 1, 2, 3, 8, 9, 10, 11>(u[f], u[f + 4]);
    rows[f + 4] = in_each_half<4, 5, 6, 7, 12, 13, 14, 15>(u[f], u[f + 4]);
  }
}

// half_scores8 of two nodes at once (g_a's in lanes 0-7, g_b's in lanes 8-15), written to out[0..16): each half takes
// half_scores8's products, moves and sums, so each node's lanes are the same floats; the transposes cost half.
inline void half_scores_two(const float* g_a, const float* g_b, const float* a, const float* b, float* out) {
  Vec16f products[8];
  for (int k = 0; k < 8; ++k) {
    const __m512d both = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(g_a + k * 8))),
                                            _mm256_castps_pd(_mm256_loadu_ps(g_b + k * 8)), 1);
    products[k] = reinterpret_cast<Vec16f>(_mm512_castpd_ps(both)) * twice(a + k * 8);
  }
  transpose8_halves(products);  // products[f]: feature f's product in each head, of either node
  Vec16f s = {};
  for (int f = 0; f < 8; ++f) s += products[f];
  store16(out, s + twice(b));
}
#endif

// The first layer of the paper's model (8 heads of 8 features) has a layout of its own; see layer_forward.
template <int FC>
bool fast_first_layer(const Problem& p, int l) {
  return FC == 8 && l == 0 && p.heads[0] == 8;
}

// W [H, F_in, F'] -> [F_in, H·F'].
template <typename T>
void transpose_heads(const T* W, index_t H, index_t fin, index_t F, Buffer<T>& out) {
  out.resize(fin * H * F);
  for (index_t q = 0; q < fin; ++q)  // the output in order, from H streams of the input
    for (index_t k = 0; k < H; ++k) {
      if (F == 8) {  // one vector, not a call to memmove
        store8(out.data() + (q * H + k) * 8, load8(W + (k * fin + q) * 8));
      } else {
        std::copy(W + (k * fin + q) * F, W + (k * fin + q + 1) * F, out.data() + (q * H + k) * F);
      }
    }
}

template <typename T>
T dot(const T* a, const T* b, index_t n) {
  T s = T(0);
  for (index_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// floor of one float, or lane by lane of 8 or 16 (AVX's and AVX-512's rounding toward -inf, which is exact, as
// std::floor is; lane by lane std::floor without them).
template <typename X>
__attribute__((always_inline)) inline X floor_lanes(X v) {
  if constexpr (std::is_same_v<X, float>) {
    return std::floor(v);
  } else {
#if defined(__AVX512F__)
    if constexpr (sizeof(X) == 64)
      return reinterpret_cast<X>(
          _mm512_roundscale_ps(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
#if defined(__AVX__)
    if constexpr (sizeof(X) == 32)
      return reinterpret_cast<X>(_mm256_round_ps(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
    for (size_t k = 0; k < sizeof(X) / sizeof(float); ++k) v[k] = std::floor(v[k]);
    return v;
  }
}

// 2^n for integral n in [-126, 128] (128: infinity), one float or lane by lane: n + 127 as a float's exponent bits.
template <typename X>
__attribute__((always_inline)) inline X power_of_two(X n) {
  if constexpr (std::is_same_v<X, float>) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return scale;
  } else {
    using I = typename std::conditional<sizeof(X) == 64, Vec16i, Vec8<int32_t>>::type;
    return reinterpret_cast<X>((__builtin_convertvector(n, I) + 127) << 23);
  }
}

// exp of one float, or lane by lane of 8 or 16, the same operations either way (so a lane's bytes are the scalar's,
// and exp_inplace's: tests/test_fused.py compares them on every float): Cephes' expf polynomial (about 1 ulp, as the
// SLEEF kernels torch uses). The vectors serve loops that cannot hand exp_inplace a whole array (ELU's slope beside
// its product).
template <typename X>
__attribute__((always_inline)) inline X exp_approx(X x) {
  constexpr float lo = -87.3365447504019f, hi = 88.3762626647949f;
  const X zero = {};
  const X above = x < lo ? zero + lo : x;       // std::max(x, lo)
  const X xc = hi < above ? zero + hi : above;  // std::min(above, hi)
  const X n = floor_lanes(xc * 1.44269504088896341f + 0.5f);
  X r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  X y = zero + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  return x < lo ? zero : y * power_of_two(n);
}

// exp lane by lane, each lane as exp_inplace computes it: exp_approx for float, the C library's exp for double.
template <typename X>
__attribute__((always_inline)) inline X exp_each(X x) {
  if constexpr (sizeof(x[0]) == sizeof(double)) {
    for (size_t k = 0; k < sizeof(X) / sizeof(double); ++k) x[k] = std::exp(x[k]);
    return x;
  } else {
    return exp_approx(x);
  }
}

// ELU's slope exp(min(x, 0)), lane by lane (1 where x > 0: exp_approx(0) is 1 exactly).
template <typename X>
__attribute__((always_inline)) inline X elu_slope(X x) {
  const X zero = {};
  return exp_each(zero < x ? zero : x);  // std::min(x, 0)
}

// Taylor's series of expm1 near 0, where exp(x) - 1 would cancel: for one float, or lane by lane for 8.
template <typename X>
__attribute__((always_inline)) inline X expm1_near_zero(X x) {
  const X x2 = x * x;
  X t = X{} + 1.0f / 40320;  // the constant (in every lane): +0 + c is c
  t = t * x + 1.0f / 5040;
  t = t * x + 1.0f / 720;
  t = t * x + 1.0f / 120;
  t = t * x + 1.0f / 24;
  t = t * x + 1.0f / 6;
  t = t * x + 0.5f;
  return t * x2 + x;
}

// expm1 for x <= 0 (ELU's negative side): the series above -0.5, exp's polynomial below.
__attribute__((always_inline)) inline float expm1_approx(float x) {
  const float near = expm1_near_zero(x);
  return x > -0.5f ? near : exp_approx(x) - 1.0f;
}

// exp of a whole array, in a loop the compiler vectorises (libm's scalar calls were a third of the validation pass);
// double, for the gradient check only: the C library.
void exp_inplace(float* x, index_t n) {
  for (index_t i = 0; i < n; ++i) x[i] = exp_approx(x[i]);
}
void exp_inplace(double* x, index_t n) {
  for (index_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}
// Whether every lane of 8 or 16 floats is above -0.5: false where a lane is NaN (the lane-by-lane path takes it).
template <typename X>
__attribute__((always_inline)) inline bool above_minus_half(X v) {
#if defined(__AVX512F__)
  if constexpr (sizeof(X) == 64)
    return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), _mm512_set1_ps(-0.5f), _CMP_GT_OQ) == 0xFFFF;
#endif
  const auto near = v > -0.5f;
#if defined(__AVX__)
  if constexpr (sizeof(X) == 32) return _mm256_movemask_ps(reinterpret_cast<__m256>(near)) == 0xFF;
#endif
  bool all_near = true;
  for (size_t k = 0; k < sizeof(X) / sizeof(float); ++k) all_near = all_near && near[k];
  return all_near;
}

// ELU of 8 or 16 lanes: x > 0 ? x : expm1(x). Where every lane is above -0.5 (all but 0.3 % of the groups of 8 that 4
// seeds of Cora passed through it to their early stop, counted in an instrumented copy) each lane's expm1 is the
// series, so exp's polynomial, which the scalar expression computes in every lane before it selects, runs only for
// the groups that need it. Each lane takes the scalar expression's operations on the same values, so its bytes do not
// depend on the lanes beside it. double: the C library's expm1, lane by lane.
template <typename X>
__attribute__((always_inline)) inline X elu_lanes(X v) {
  constexpr size_t lanes = sizeof(X) / sizeof(v[0]);
  if constexpr (sizeof(v[0]) == sizeof(double)) {
    for (size_t k = 0; k < lanes; ++k) v[k] = v[k] > 0.0 ? v[k] : std::expm1(v[k]);
    return v;
  } else {
    const X zero = {};
    if (above_minus_half(v)) {
      const X negative = zero < v ? zero : v;  // std::min(v, 0.0f), -0 kept as -0
      return v > zero ? v : expm1_near_zero(negative);
    }
    for (size_t k = 0; k < lanes; ++k) v[k] = v[k] > 0.0f ? v[k] : expm1_approx(std::min(v[k], 0.0f));
    return v;
  }
}

// ELU in place, 16 values at a time where the CPU has the lanes, then 8, then one by one.
void elu_inplace(float* x, index_t n) {
  index_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(x + i, elu_lanes(load16(x + i)));
#endif
  for (; i + 8 <= n; i += 8) store8(x + i, elu_lanes(load8(x + i)));
  // The last n % 8 values (i is the largest multiple of 8 up to n): counted so, GCC sees that this loop ends.
  for (index_t j = 0; j < n % 8; ++j) x[i + j] = x[i + j] > 0.0f ? x[i + j] : expm1_approx(std::min(x[i + j], 0.0f));
}
void elu_inplace(double* x, index_t n) {
  for (index_t i = 0; i < n; ++i) x[i] = x[i] > 0.0 ? x[i] : std::expm1(x[i]);
}

// One stored feature of x as sparse_row_product reads it: its value x_e, its index e in the CSR arrays (for its
// byte of kept heads) and the row of 64 it multiplies.
template <typename T>
struct SparseEntry {
  T value;
  index_t e;
  const T* row;
};

// A sparse row times rows of 64 (8 heads of 8 features): out[8 k + f] = Σ_t x_e · m_k(e) · row_t[8 k + f]
// over the entries t in [begin, end), in order, where entry(t) gives the entry's SparseEntry; m_k(e) is head k's
// dropout multiplier of the entry (its byte in c.heads_kept), left out without dropout. The first layer's x·W (a
// node's g from the rows of W) and ∂L/∂W (a feature's from the rows of ∂L/∂g). Lane by lane the products and sums
// of scalar code, 16 lanes at a time where the CPU has them, else 8.
template <typename T, typename Entry>
inline void sparse_row_product(index_t begin, index_t end, const LayerCache<T>& c, bool dropout, Entry entry,
                               T* out) {
  using V = Vec8<T>;
  auto masked = [&](const SparseEntry<T>& x) {  // x_e · m_k
    return x.value * load8(c.multipliers.data() + c.heads_kept[x.e] * 8);
  };
  if constexpr (kWideVectors && std::is_same_v<T, float>) {
    Vec16f acc[4] = {};  // heads 2m and 2m + 1
    for (index_t t = begin; t < end; ++t) {
      const SparseEntry<T> x = entry(t);
      if (dropout) {
#if defined(__AVX512F__)  // kWideVectors: this branch is compiled only with AVX-512
        // A kept head's lanes get (x_e · scale) · w, as the 8-lane loop's product; a dropped head's get +0 where
        // that product is x_e · 0 · w = ±0, and adding either to a sum that started at +0 leaves the sum as it was
        // (for finite w; the fingerprint and the build matrix check it). No permute per pair of heads, which would
        // share the two ports of the 16-lane multiplies and adds on an Intel core (python -m benchmarks.vector_ports).
        const __m512 kept_value = _mm512_set1_ps(x.value * c.multipliers[255 * 8]);  // byte 255: every head keeps it
        const uint16_t* keeps = kPairMasks.of[c.heads_kept[x.e]];
        for (int m = 0; m < 4; ++m)
          acc[m] += reinterpret_cast<Vec16f>(
              _mm512_maskz_mul_ps(keeps[m], kept_value, reinterpret_cast<__m512>(load16(x.row + m * 16))));
#endif
      } else {
        for (int m = 0; m < 4; ++m) acc[m] += x.value * load16(x.row + m * 16);
      }
    }
    for (int m = 0; m < 4; ++m) store16(out + m * 16, acc[m]);
  } else {
    V acc[8] = {};  // head k
    for (index_t t = begin; t < end; ++t) {
      const SparseEntry<T> x = entry(t);
      if (dropout) {
        const V v = masked(x);
        for (int k = 0; k < 8; ++k) acc[k] += lane_everywhere<T>(v, k) * load8(x.row + k * 8);
      } else {
        for (int k = 0; k < 8; ++k) acc[k] += x.value * load8(x.row + k * 8);
      }
    }
    for (int k = 0; k < 8; ++k) store8(out + k * 8, acc[k]);
  }
}

// body(q, e) for the P neighbourhoods q of consecutive targets (n[q] edges each) and their edges e: first the edges
// that all P have, the P neighbourhoods in turn within each, then each one's remaining edges. Each neighbourhood's
// edges keep their order, so a sum over one runs as it would alone; the P sums' chains of dependent adds overlap.
template <int P, typename Body>
inline void interleaved_edges(const index_t (&n)[P], Body body) {
  index_t common = n[0];
  for (int q = 1; q < P; ++q) common = std::min(common, n[q]);
  for (index_t e = 0; e < common; ++e)
    for (int q = 0; q < P; ++q) body(q, e);
  for (int q = 0; q < P; ++q)
    for (index_t e = common; e < n[q]; ++e) body(q, e);
}

// A layer's targets, G consecutive ones at a time, then one at a time: visit(count, i0) with count a
// std::integral_constant of how many targets start at i0.
template <int G, typename Visit>
inline void in_groups(index_t targets, Visit visit) {
  index_t i = 0;
  for (; i + G <= targets; i += G) visit(std::integral_constant<int, G>{}, i);
  for (; i < targets; ++i) visit(std::integral_constant<int, 1>{}, i);
}

// The paper's first layer past g in a validation or test pass (no dropout, nothing kept for a backward pass): per
// target, its edges' scores, softmax and weighted sum, and the ELU, written to `output` [Tn, 64] at once. Each value
// takes the operations of first_layer_attention, its ELU included, in the same order, so the bytes are theirs;
// z, α and the pre-activations never leave the L1 cache.
template <typename T>
void first_layer_inference(const Problem& p, const LayerParams<T>& w, Workspace<T>& ws, const LayerCache<T>& c,
                           T* output) {
  using V = Vec8<T>;
  const Block& b = p.block[0];
  const index_t Tn = b.targets;
  const V zero = {}, slopes = zero + static_cast<T>(p.negative_slope);
  index_t degree = 0;
  for (index_t i = 0; i < Tn; ++i) degree = std::max(degree, b.crow[i + 1] - b.crow[i]);
  // With 16-lane vectors, two targets at a time: their chains of dependent maxima and sums overlap (the weighted
  // sums, two heads to a vector, 4 chains a target, would otherwise wait on each other's adds). With 8 lanes the two
  // targets' 16 sums would not fit in the 16 registers, so one at a time. Each target's own operations and their
  // order are the same either way, so are its bytes.
  constexpr int G = kWideVectors && std::is_same_v<T, float> ? 2 : 1;
  ws.alpha8.resize(G * degree * 8);  // G neighbourhoods' α
  GAT_PHASE(timer, kValAggregate);
  in_groups<G>(Tn, [&](auto count, index_t i0) {
    constexpr int P = decltype(count)::value;
    index_t begin[P], n[P];
    T* alpha[P];  // the P neighbourhoods' exp(e - max) (8 lanes: then α) one after the other, edge-major [n, 8] each
    for (int q = 0; q < P; ++q) {
      begin[q] = b.crow[i0 + q];
      n[q] = b.crow[i0 + q + 1] - begin[q];
      alpha[q] = q == 0 ? ws.alpha8.data() : alpha[q - 1] + n[q - 1] * 8;
    }
    V st[P], shift[P], total[P];
    for (int q = 0; q < P; ++q) {
      st[q] = load8(ws.s_target.data() + (i0 + q) * 8);
      shift[q] = zero - T(INFINITY);
      total[q] = zero;
    }
    interleaved_edges(n, [&](int q, index_t e) {
      const V ze = st[q] + load8(ws.s_source.data() + b.source[begin[q] + e] * 8);
      const V leaky = ze > zero ? ze : ze * slopes;
      store8(alpha[q] + e * 8, leaky);
      shift[q] = shift[q] < leaky ? leaky : shift[q];  // std::max's rule, lane by lane
    });
    // exp(e - max) and its sum over each neighbourhood in one pass, two edges to a 16-lane vector where the CPU has
    // them; the division by the sum waits for the weighted sum below. The same operations on the same values, in the
    // same order, as the separate passes of first_layer_attention (exp_each is exp_inplace lane by lane), so the same
    // bytes; each pass and its loop's exit cost time in neighbourhoods of 6 edges on average (Cora's validation view).
    for (int q = 0; q < P; ++q) {
      T* a = alpha[q];
      index_t e = 0;
      if constexpr (kWideVectors && std::is_same_v<T, float>) {
        const Vec16f shift2 = joined(shift[q], shift[q]);
        for (; e + 2 <= n[q]; e += 2) {
          const Vec16f pair = exp_approx(load16(a + e * 8) - shift2);
          store16(a + e * 8, pair);
          V low, high;
          halves(pair, low, high);
          total[q] += low;
          total[q] += high;
        }
      }
      for (; e < n[q]; ++e) {
        const V v = exp_each(load8(a + e * 8) - shift[q]);
        store8(a + e * 8, v);
        total[q] += v;
      }
    }
    T* out = output + i0 * 64;  // the P targets' rows [P, 64]
    if constexpr (kWideVectors && std::is_same_v<T, float>) {
      Vec16f acc[P][4] = {};  // heads 2m and 2m + 1: lanes 0-7 and 8-15
      interleaved_edges(n, [&](int q, index_t e) {
        const T* gj = c.g.data() + b.source[begin[q] + e] * 64;
        const V a = load8(alpha[q] + e * 8) / total[q];  // α
        for (int m = 0; m < 4; ++m) acc[q][m] += lane_pair_everywhere(a, m) * load16(gj + m * 16);
      });
      for (int q = 0; q < P; ++q)
        for (int m = 0; m < 4; ++m) store16(out + q * 64 + m * 16, elu_lanes(acc[q][m] + load16(w.bias + m * 16)));
    } else {
      for (int q = 0; q < P; ++q)  // α, in memory for the broadcasts below
        for (index_t e = 0; e < n[q]; ++e) store8(alpha[q] + e * 8, load8(alpha[q] + e * 8) / total[q]);
      V acc[P][8] = {};  // head k
      interleaved_edges(n, [&](int q, index_t e) {
        const T* gj = c.g.data() + b.source[begin[q] + e] * 64;
        for (int k = 0; k < 8; ++k) acc[q][k] += broadcast8(alpha[q] + e * 8 + k) * load8(gj + k * 8);
      });
      for (int q = 0; q < P; ++q)
        for (int k = 0; k < 8; ++k) store8(out + q * 64 + k * 8, elu_lanes(acc[q][k] + load8(w.bias + k * 8)));
    }
  });
}

// The attention of the paper's first layer (8 heads of 8 features), its dropout, its aggregation into c.pre and the
// ELU of that into `output` [Tn, 64], with the 8 heads as the 8 lanes of a vector in every per-edge operation:
// scores, LeakyReLU, the softmax and the weighted sum. Each lane computes what the general code computes for its
// head, operation by operation and in the same order, so the results are the same to the bit; the per-edge work
// takes an eighth of the instructions.
// z and α stay edge-major [E, 8] in ws.z8 and ws.alpha8 for the backward pass (first_layer_backward_softmax).
template <typename T>
void first_layer_attention(const Problem& p, const LayerParams<T>& w, bool training, bool dropout, const Dropout& drop,
                           void* state, Workspace<T>& ws, LayerCache<T>& c, T* output) {
  using V = Vec8<T>;
  const Block& b = p.block[0];
  const index_t S = b.sources, Tn = b.targets, E = b.edges;
  const T slope = static_cast<T>(p.negative_slope);
  GAT_PHASE(timer, training ? kStepScores : kValScores);
  // Each node's two half-scores, [S, 8] and [Tn, 8]: s(j)_k = a_k · g_kj + b_k.
  ws.s_source.resize(S * 8);
  ws.s_target.resize(Tn * 8);
  const index_t* target_row = b.target_in_source;  // g by source: head k of source j at 64 j + 8 k
  index_t j = 0, i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {  // two nodes at a time
    for (; j + 2 <= S; j += 2)
      half_scores_two(c.g.data() + j * 64, c.g.data() + (j + 1) * 64, w.a_source, w.b_source,
                      ws.s_source.data() + j * 8);
    for (; i + 2 <= Tn; i += 2)
      half_scores_two(c.g.data() + target_row[i] * 64, c.g.data() + target_row[i + 1] * 64, w.a_target, w.b_target,
                      ws.s_target.data() + i * 8);
  }
#endif
  for (; j < S; ++j) store8(ws.s_source.data() + j * 8, half_scores8(c.g.data() + j * 64, w.a_source, w.b_source));
  for (; i < Tn; ++i)
    store8(ws.s_target.data() + i * 8, half_scores8(c.g.data() + target_row[i] * 64, w.a_target, w.b_target));
  if (!training) {
    GAT_NEXT_PHASE(timer, kUntimed);  // first_layer_inference times itself
    return first_layer_inference(p, w, ws, c, output);
  }
  ws.z8.resize(E * 8);
  ws.alpha8.resize(E * 8);
  T* z = ws.z8.data();
  T* alpha = ws.alpha8.data();
  const V zero = {}, slopes = zero + slope;
  for (index_t i = 0; i < Tn; ++i) {
    const index_t begin = b.crow[i], end = b.crow[i + 1];
    const V st = load8(ws.s_target.data() + i * 8);
    V shift = zero - T(INFINITY);
    for (index_t e = begin; e < end; ++e) {
      const V ze = st + load8(ws.s_source.data() + b.source[e] * 8);
      store8(z + e * 8, ze);
      const V leaky = ze > zero ? ze : ze * slopes;
      store8(alpha + e * 8, leaky);
      shift = shift < leaky ? leaky : shift;  // std::max's rule, lane by lane
    }
    for (index_t e = begin; e < end; ++e) store8(alpha + e * 8, load8(alpha + e * 8) - shift);
  }
  exp_inplace(alpha, E * 8);
  for (index_t i = 0; i < Tn; ++i) {
    const index_t begin = b.crow[i], end = b.crow[i + 1];
    V total = zero;
    for (index_t e = begin; e < end; ++e) total += load8(alpha + e * 8);
    for (index_t e = begin; e < end; ++e) store8(alpha + e * 8, load8(alpha + e * 8) / total);
  }

  GAT_NEXT_PHASE(timer, kStepDropout);
  // Dropout on α, then on g, drawn head-major as ReplicaDropout draws them, kept as bits. A mask's 8 floats are
  // multipliers[8 · byte], the same 0 or scale that the mask as floats held; α dropped, edge-major.
  const T* a_dropped = alpha;
  c.alpha_kept.resize(dropout ? E : 0);
  c.g_kept.resize(dropout ? 8 * S : 0);
  c.g_dropped.resize(dropout ? 8 * S * 8 : 0);
  if (dropout) {
    const T* multipliers = c.multipliers.data();  // layer_forward's, from the input's dropout
    draw_kept_bits(drop, state, 8 * E, ws.kept_bits, ws.ties);
    heads_of_bits(ws.kept_bits.data(), E, c.alpha_kept.data());
    draw_kept_bits(drop, state, 8 * S * 8, ws.kept_bits, ws.ties);
    std::memcpy(c.g_kept.data(), ws.kept_bits.data(), 8 * S);  // little-endian: byte k S + j, bits 8 (k S + j) on
    for (index_t j = 0; j < S; ++j)  // the mask head-major as drawn, g by source
      for (int k = 0; k < 8; ++k) {
        const index_t at = j * 64 + k * 8;
        store8(c.g_dropped.data() + at, load8(c.g.data() + at) * load8(multipliers + 8 * c.g_kept[k * S + j]));
      }
    c.alpha_dropped8.resize(E * 8);
    for (index_t e = 0; e < E; ++e)
      store8(c.alpha_dropped8.data() + e * 8, load8(alpha + e * 8) * load8(multipliers + 8 * c.alpha_kept[e]));
    a_dropped = c.alpha_dropped8.data();
  }
  const T* g_dropped = dropout ? c.g_dropped.data() : c.g.data();

  GAT_NEXT_PHASE(timer, kStepAggregate);
  // out_i = Σ_j α_ij g_j + c, per head.
  c.pre.resize(8 * Tn * 8);
  for (index_t i = 0; i < Tn; ++i) {
    V acc[8] = {};
    for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
      const index_t j = b.source[e];
      for (int k = 0; k < 8; ++k) acc[k] += broadcast8(a_dropped + e * 8 + k) * load8(g_dropped + j * 64 + k * 8);
    }
    V pre[8];
    for (int k = 0; k < 8; ++k) {
      pre[k] = acc[k] + load8(w.bias + k * 8);
      store8(c.pre.data() + (k * Tn + i) * 8, pre[k]);  // for the backward pass's ELU slope
    }
    // The layer's output [Tn, 64]: the row's ELU now, while its sums are in registers (elu_inplace over the whole
    // output took two more passes through memory, a copy by head and the ELU).
    T* out = output + i * 64;
    if constexpr (kWideVectors && std::is_same_v<T, float>) {
      for (int m = 0; m < 4; ++m) store16(out + m * 16, elu_lanes(joined(pre[2 * m], pre[2 * m + 1])));
    } else {
      for (int k = 0; k < 8; ++k) store8(out + k * 8, elu_lanes(pre[k]));
    }
  }
}

// Layer `l` forward for one replica: `input` is the sparse x (l = 0) or the dense [S, F_in] hidden features.
// FC: the number of features per head F' when known at compile time (0: read from the problem). With it the
// per-head vectors are a few registers: each sum is accumulated there, in the same sequential order.
template <typename T, int FC>
void layer_forward(const Problem& p, int l, const LayerParams<T>& w, const T* dense_input, bool training,
                   const Dropout& drop, void* state, Workspace<T>& ws, T* output) {
  constexpr int KM = FC > 0 ? FC : kMaxFeatures;
  LayerCache<T>& c = ws.cache[l];
  const Block& b = p.block[l];
  const index_t H = p.heads[l], F = FC > 0 ? FC : p.hidden[l], S = b.sources, Tn = b.targets, E = b.edges;
  const index_t fin = l == 0 ? p.f_in : p.heads[0] * p.hidden[0];
  const bool dropout = training && drop.next != nullptr;
  const T slope = static_cast<T>(p.negative_slope);
  c.g.resize(H * S * F);  // every element is written below

  // g = W^k · dropout_k(h), a fresh input mask per head.
  if (fast_first_layer<FC>(p, l)) {
    // The paper's first layer (8 heads of 8): W transposed to [F_in, H·F'], so that each stored feature
    // reads one contiguous row of 64 weights.
    const T* x = static_cast<const T*>(p.x_val);
    const index_t nnz = p.nnz;
    GAT_PHASE(timer, training ? kStepTranspose : kValTranspose);
    if (!w.W_by_feature) transpose_heads(w.W, H, fin, F, ws.weights_t);
    const T* weights = w.W_by_feature ? w.W : ws.weights_t.data();
    GAT_NEXT_PHASE(timer, training ? kStepInputMasks : kUntimed);
    if (dropout) {
      // One draw for all heads, in the stream's order [H, nnz], folded into a byte per stored feature (bit k: head k
      // keeps it): an entry's masked values in the 8 heads are x_e times the multipliers of its byte, one vector, for
      // the product below and for ∂L/∂W. 30 KB of bytes where the masks and masked values as floats took 2 MB: the
      // rows of W that the product gathers stay in a core's L2 cache.
      draw_kept_bits(drop, state, H * nnz, ws.kept_bits, ws.ties);
      c.heads_kept.resize(nnz);
      heads_of_bits(ws.kept_bits.data(), nnz, c.heads_kept.data());
      c.multipliers.resize(256 * 8);
      for (int bits = 0; bits < 256; ++bits)
        for (int k = 0; k < 8; ++k) c.multipliers[bits * 8 + k] = (bits >> k) & 1 ? static_cast<T>(drop.scale) : T(0);
    }
    GAT_NEXT_PHASE(timer, training ? kStepXW : kValXW);
    for (index_t j = 0; j < S; ++j)
      sparse_row_product(p.x_crow[j], p.x_crow[j + 1], c, dropout,
                         [&](index_t e) { return SparseEntry<T>{x[e], e, weights + p.x_col[e] * 64}; },
                         c.g.data() + j * 64);
  } else if (l == 0) {
    const T* x = static_cast<const T*>(p.x_val);
    c.input.resize(H * p.nnz);
    if (dropout) draw_mask(drop, state, H * p.nnz, c.input.data(), ws.ties);  // one draw for all heads
    for (index_t k = 0; k < H; ++k) {
      T* values = c.input.data() + k * p.nnz;
      if (dropout) {
        for (index_t e = 0; e < p.nnz; ++e) values[e] = x[e] * values[e];
      } else {
        std::copy(x, x + p.nnz, values);
      }
    }
    if (FC > 0 && H % kGroup == 0) {
      // kGroup heads at a time, one accumulator each: independent sums keep the adders busy.
      for (index_t k0 = 0; k0 < H; k0 += kGroup) {
        for (index_t j = 0; j < S; ++j) {
          T acc[kGroup][KM] = {};
          for (index_t e = p.x_crow[j]; e < p.x_crow[j + 1]; ++e) {
            const index_t col = p.x_col[e];
            for (int k = 0; k < kGroup; ++k) {
              const T v = c.input[(k0 + k) * p.nnz + e];
              const T* row = w.W + ((k0 + k) * fin + col) * F;
              for (index_t f = 0; f < F; ++f) acc[k][f] += v * row[f];
            }
          }
          for (int k = 0; k < kGroup; ++k) std::copy(acc[k], acc[k] + F, c.g.data() + ((k0 + k) * S + j) * F);
        }
      }
    } else {
      for (index_t k = 0; k < H; ++k) {
        const T* values = c.input.data() + k * p.nnz;
        const T* Wk = w.W + k * fin * F;
        for (index_t j = 0; j < S; ++j) {
          T acc[KM] = {};
          for (index_t e = p.x_crow[j]; e < p.x_crow[j + 1]; ++e) {
            const T v = values[e];
            const T* row = Wk + p.x_col[e] * F;
            for (index_t f = 0; f < F; ++f) acc[f] += v * row[f];
          }
          std::copy(acc, acc + F, c.g.data() + (k * S + j) * F);
        }
      }
    }
  } else {
    // Without dropout every head reads the layer's input itself (kept by the caller until the backward pass).
    c.input.resize(dropout ? H * S * fin : 0);
    c.input_mask.resize(dropout ? H * S * fin : 0);
    c.shared_input = dropout ? nullptr : dense_input;
    if (dropout) draw_mask(drop, state, H * S * fin, c.input_mask.data(), ws.ties);
    for (index_t k = 0; dropout && k < H; ++k) {
      T* in = c.input.data() + k * S * fin;
      const T* mask = c.input_mask.data() + k * S * fin;
      for (index_t i = 0; i < S * fin; ++i) in[i] = dense_input[i] * mask[i];
    }
    for (index_t k = 0; k < H; ++k) {
      const T* Wk = w.W + k * fin * F;
      if (fin % 8 == 0) {
        // Each output is a dot product of W^k's column with the input row, summed in 8 lanes and then across them,
        // always in this order.
        if constexpr (kWideVectors && std::is_same_v<T, float>) {
          if (F <= 8) {
            // Two outputs per 16-lane vector: the weights of outputs 2m and 2m + 1 for each chunk of 8 inputs side
            // by side (zeros past F), times that chunk of h in both halves. Lane by lane the sums of the 8-lane loop
            // below, each half then summed across its lanes as sum8_each sums them there (sum8_each_pairs).
            ws.weight_pairs.assign(4 * fin * 2, T(0));
            for (index_t f = 0; f < F; ++f)
              for (index_t q = 0; q < fin; ++q)
                ws.weight_pairs[((f / 2) * fin + q / 8 * 8) * 2 + f % 2 * 8 + q % 8] = Wk[q * F + f];
            const index_t pairs = (F + 1) / 2;
            for (index_t j = 0; j < S; ++j) {
              const T* hj = c.head_input(k, S * fin) + j * fin;
              Vec16f acc[4] = {};
              for (index_t q = 0; q < fin; q += 8) {
                const Vec16f h = twice(hj + q);
                for (index_t m = 0; m < pairs; ++m) acc[m] += h * load16(ws.weight_pairs.data() + (m * fin + q) * 2);
              }
              const Vec8<T> sums = sum8_each_pairs(acc);  // output f's 8 lanes summed (zeros past F)
              for (index_t f = 0; f < F; ++f) c.g[(k * S + j) * F + f] = sums[f];
            }
            continue;
          }
        }
        // W^k transposed [F', F_in]: each output's weights in one contiguous row.
        ws.weights_t2.resize(F * fin);
        for (index_t q = 0; q < fin; ++q)
          for (index_t f = 0; f < F; ++f) ws.weights_t2[f * fin + q] = Wk[q * F + f];
        // Up to 8 outputs at a time, their sums side by side (independent chains of additions), then each summed
        // across its lanes by sum8_each, in sum8's order.
        for (index_t j = 0; j < S; ++j) {
          const T* hj = c.head_input(k, S * fin) + j * fin;
          for (index_t f0 = 0; f0 < F; f0 += 8) {
            const index_t count = std::min<index_t>(8, F - f0);
            Vec8<T> acc[8] = {};
            for (index_t q = 0; q < fin; q += 8) {
              const Vec8<T> h = load8(hj + q);
              for (index_t m = 0; m < count; ++m) acc[m] += h * load8(ws.weights_t2.data() + (f0 + m) * fin + q);
            }
            const Vec8<T> sums = sum8_each<T>(acc);
            for (index_t m = 0; m < count; ++m) c.g[(k * S + j) * F + f0 + m] = sums[m];
          }
        }
        continue;
      }
      for (index_t j = 0; j < S; ++j) {
        const T* hj = c.head_input(k, S * fin) + j * fin;
        T acc[KM] = {};
        for (index_t q = 0; q < fin; ++q) {
          const T v = hj[q];
          const T* row = Wk + q * F;
          for (index_t f = 0; f < F; ++f) acc[f] += v * row[f];
        }
        std::copy(acc, acc + F, c.g.data() + (k * S + j) * F);
      }
    }
  }

  const bool concat = l == 0;
  if (fast_first_layer<FC>(p, l)) {
    first_layer_attention(p, w, training, dropout, drop, state, ws, c, output);
    return;  // it wrote the output, the ELU of each row included
  } else {
    // Scores of every node, gathered to edges, and the softmax over each neighbourhood.
    ws.s_target.resize(Tn);
    ws.s_source.resize(S);
    c.z.resize(H * E);
    c.alpha.resize(H * E);
    ws.e.resize(std::max<index_t>(E, 1));
    for (index_t k = 0; k < H; ++k) {
      const T* gk = c.g.data() + k * S * F;
      const T* at = w.a_target + k * F;
      const T* as = w.a_source + k * F;
      for (index_t j = 0; j < S; ++j) ws.s_source[j] = dot(gk + j * F, as, F) + w.b_source[k];
      for (index_t i = 0; i < Tn; ++i) ws.s_target[i] = dot(gk + b.target_in_source[i] * F, at, F) + w.b_target[k];
      T* z = c.z.data() + k * E;
      T* alpha = c.alpha.data() + k * E;
      for (index_t i = 0; i < Tn; ++i) {
        const index_t begin = b.crow[i], end = b.crow[i + 1];
        T shift = -INFINITY;
        for (index_t e = begin; e < end; ++e) {
          z[e] = ws.s_target[i] + ws.s_source[b.source[e]];
          ws.e[e] = z[e] > T(0) ? z[e] : z[e] * slope;
          shift = std::max(shift, ws.e[e]);
        }
        for (index_t e = begin; e < end; ++e) alpha[e] = ws.e[e] - shift;
      }
      exp_inplace(alpha, E);
      for (index_t i = 0; i < Tn; ++i) {  // each neighbourhood's sum, spread over its edges
        const index_t begin = b.crow[i], end = b.crow[i + 1];
        T total = T(0);
        for (index_t e = begin; e < end; ++e) total += alpha[e];
        for (index_t e = begin; e < end; ++e) ws.e[e] = total;
      }
      for (index_t e = 0; e < E; ++e) alpha[e] = alpha[e] / ws.e[e];
    }

    // Dropout on α, then on g (in this order: ReplicaDropout's stream is consumed as the torch layer does).
    c.alpha_mask.resize(dropout ? H * E : 0);
    c.g_mask.resize(dropout ? H * S * F : 0);
    c.g_dropped.resize(dropout ? H * S * F : 0);
    if (dropout) {
      draw_mask(drop, state, H * E, c.alpha_mask.data(), ws.ties);
      draw_mask(drop, state, H * S * F, c.g_mask.data(), ws.ties);
      for (index_t i = 0; i < H * S * F; ++i) c.g_dropped[i] = c.g[i] * c.g_mask[i];
    }
    const T* g_dropped = dropout ? c.g_dropped.data() : c.g.data();

    // out_i = Σ_j α_ij g_j + c, then the activation and the joining of the heads.
    c.pre.resize(H * Tn * F);  // every element is written below
    if (!concat) std::fill(output, output + Tn * F, T(0));
    // ∂(α_ij dropped) once per edge: [H, E].
    const T* a_dropped = c.alpha.data();
    if (dropout) {
      ws.grad_alpha.resize(H * E);
      for (index_t i = 0; i < H * E; ++i) ws.grad_alpha[i] = c.alpha[i] * c.alpha_mask[i];
      a_dropped = ws.grad_alpha.data();
    }
    if (FC == 8 && H % kGroup == 0) {
      for (index_t k0 = 0; k0 < H; k0 += kGroup) {
        for (index_t i = 0; i < Tn; ++i) {
          Vec8<T> acc[kGroup] = {};
          for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
            const index_t j = b.source[e];
            for (int k = 0; k < kGroup; ++k)
              acc[k] += a_dropped[(k0 + k) * E + e] * load8(g_dropped + ((k0 + k) * S + j) * 8);
          }
          for (int k = 0; k < kGroup; ++k)
            store8(c.pre.data() + ((k0 + k) * Tn + i) * 8, acc[k] + load8(w.bias + (k0 + k) * 8));
        }
      }
    } else {
      for (index_t k = 0; k < H; ++k) {
        const T* gd = g_dropped + k * S * F;
        for (index_t i = 0; i < Tn; ++i) {
          T acc[KM] = {};
          for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
            const T a = a_dropped[k * E + e];
            const T* gj = gd + b.source[e] * F;
            for (index_t f = 0; f < F; ++f) acc[f] += a * gj[f];
          }
          T* out = c.pre.data() + (k * Tn + i) * F;
          for (index_t f = 0; f < F; ++f) out[f] = acc[f] + w.bias[k * F + f];
        }
      }
    }
  }
  if (concat) {  // ELU per head, heads concatenated: [T, H·F']
    for (index_t k = 0; k < H; ++k)
      for (index_t i = 0; i < Tn; ++i)
        for (index_t f = 0; f < F; ++f) output[(i * H + k) * F + f] = c.pre[(k * Tn + i) * F + f];
    elu_inplace(output, Tn * H * F);
  } else {  // the mean of the heads
    for (index_t k = 0; k < H; ++k)
      for (index_t i = 0; i < Tn * F; ++i) output[i] += c.pre[k * Tn * F + i];
    for (index_t i = 0; i < Tn * F; ++i) output[i] = output[i] / static_cast<T>(H);
  }
}

// ∂L/∂a, ∂L/∂b of head k's two half-scores, from ∂L/∂s_target [Tn] and ∂L/∂s_source [S], and their share of
// ∂L/∂g^k, added into `dg` [S, F'].
template <typename T, int FC>
void score_grads(const Block& b, index_t k, index_t F, const T* gk, const LayerParams<T>& w, const T* grad_s_target,
                 const T* grad_s_source, const LayerGrads<T>& g, T* dg) {
  constexpr int KM = FC > 0 ? FC : kMaxFeatures;
  const T* at = w.a_target + k * F;
  const T* as = w.a_source + k * F;
  T bt = T(0), bs = T(0);
  T acc_t[KM] = {}, acc_s[KM] = {};
  for (index_t i = 0; i < b.targets; ++i) {
    const T d = grad_s_target[i];
    const index_t j = b.target_in_source[i];
    bt += d;
    for (index_t f = 0; f < F; ++f) {
      acc_t[f] += d * gk[j * F + f];
      dg[j * F + f] += d * at[f];
    }
  }
  for (index_t j = 0; j < b.sources; ++j) {
    const T d = grad_s_source[j];
    bs += d;
    for (index_t f = 0; f < F; ++f) {
      acc_s[f] += d * gk[j * F + f];
      dg[j * F + f] += d * as[f];
    }
  }
  std::copy(acc_t, acc_t + F, g.a_target + k * F);
  std::copy(acc_s, acc_s + F, g.a_source + k * F);
  g.b_target[k] = bt;
  g.b_source[k] = bs;
}

// The softmax's and LeakyReLU's backward pass of the paper's first layer, its 8 heads as vector lanes (as in
// first_layer_attention): ∂L/∂e = α ∘ (∂L/∂α - Σ_segment α ∘ ∂L/∂α), then ∂L/∂z, summed into the two half-scores,
// ws.grad_s_target [Tn, 8] and ws.grad_s_source [S, 8]. Lane k computes what the general code computes for head k.
template <typename T>
void first_layer_backward_softmax(const Problem& p, Workspace<T>& ws) {
  using V = Vec8<T>;
  const Block& b = p.block[0];
  const T* alpha = ws.alpha8.data();
  const T* z = ws.z8.data();
  const T* grad_alpha = ws.grad_alpha.data();
  const V zero = {}, slopes = zero + static_cast<T>(p.negative_slope);
  std::fill(ws.grad_s_source.begin(), ws.grad_s_source.end(), T(0));
  for (index_t i = 0; i < b.targets; ++i) {
    const index_t begin = b.crow[i], end = b.crow[i + 1];
    V total = zero;
    for (index_t e = begin; e < end; ++e) total += load8(grad_alpha + e * 8) * load8(alpha + e * 8);
    V st = zero;
    for (index_t e = begin; e < end; ++e) {
      const V a = load8(alpha + e * 8);
      const V de = load8(grad_alpha + e * 8) * a - a * total;
      const V dz = load8(z + e * 8) > zero ? de : de * slopes;
      st += dz;
      T* source = ws.grad_s_source.data() + b.source[e] * 8;
      store8(source, load8(source) + dz);
    }
    store8(ws.grad_s_target.data() + i * 8, st);
  }
}

template <typename T>
void first_layer_weight_grad(const Problem& p, const LayerCache<T>& c, Workspace<T>& ws, T* grad_W, bool by_feature);

// The backward pass of the paper's first layer, its 8 heads at once along each edge and each source (g, g dropped
// and ∂L/∂g by source, [S, 64]; α and ∂L/∂α by edge, [E, 8]): ∂L/∂out through ELU and the bias; the aggregation's
// ∂L/∂α and ∂L/∂g; the softmax (first_layer_backward_softmax); the half-scores' ∂L/∂a, ∂L/∂b and their share of
// ∂L/∂g; ∂L/∂W. Head k gets the general code's operations (layer_backward and score_grads), each sum in the same
// order: the loops over the heads moved inside those over edges and sources, which changes no sum.
template <typename T>
void first_layer_backward(const Problem& p, const LayerParams<T>& w, const T* grad_output, Workspace<T>& ws,
                          const LayerGrads<T>& g) {
  using V = Vec8<T>;
  const LayerCache<T>& c = ws.cache[0];
  const Block& b = p.block[0];
  const index_t S = b.sources, Tn = b.targets, E = b.edges;
  const bool dropout = !c.alpha_kept.empty();
  const T* multipliers = c.multipliers.data();
  GAT_PHASE(timer, kStepBackAggregate);
  // ∂L/∂out [Tn, 64] through ELU: exp(min(x, 0)) for every element, one product each (layer_backward says why),
  // the slope computed beside its product: one pass over c.pre, where a pass of min, one of exp and one of products
  // each went through memory.
  ws.grad_out.resize(Tn * 64);
  T* dout = ws.grad_out.data();
  const T* pre = c.pre.data();  // [8, Tn, 8]
  if constexpr (kWideVectors && std::is_same_v<T, float>) {  // heads 2m and 2m + 1: lanes 0-7 and 8-15
    Vec16f bias[4] = {};
    for (index_t i = 0; i < Tn; ++i)
      for (int m = 0; m < 4; ++m) {
        const Vec16f x = joined(load8(pre + (2 * m * Tn + i) * 8), load8(pre + ((2 * m + 1) * Tn + i) * 8));
        const Vec16f d = load16(grad_output + i * 64 + m * 16) * elu_slope(x);
        store16(dout + i * 64 + m * 16, d);
        bias[m] += d;
      }
    for (int m = 0; m < 4; ++m) store16(g.bias + m * 16, bias[m]);
  } else {
    V bias[8] = {};
    for (index_t i = 0; i < Tn; ++i)
      for (int k = 0; k < 8; ++k) {
        const V d = load8(grad_output + i * 64 + k * 8) * elu_slope(load8(pre + (k * Tn + i) * 8));
        store8(dout + i * 64 + k * 8, d);
        bias[k] += d;
      }
    for (int k = 0; k < 8; ++k) store8(g.bias + k * 8, bias[k]);
  }

  // Aggregation: ∂L/∂α_ij = mask_ij ∂L/∂out_i · dropout(g_j); ∂L/∂g_j = mask_j Σ_i dropout(α_ij) ∂L/∂out_i.
  ws.grad_alpha.resize(E * 8);
  ws.grad_g.assign(S * 64, T(0));
  const T* a_dropped = dropout ? c.alpha_dropped8.data() : ws.alpha8.data();
  const T* gd = dropout ? c.g_dropped.data() : c.g.data();
  T* dg = ws.grad_g.data();
  for (index_t i = 0; i < Tn; ++i) {
    V dv[8];
    for (int k = 0; k < 8; ++k) dv[k] = load8(dout + i * 64 + k * 8);
    for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
      const index_t j = b.source[e];
      // The rows of g dropped and ∂L/∂g of the source 6 edges on (4 cache lines each), asked for now: this loop
      // otherwise waited on them, its sources in no order (python -m benchmarks.kernel_phases: 0.89-0.93 of the
      // phase's time with them). A hint only; no value changes.
      if (e + 6 < E) {
        const index_t ahead = b.source[e + 6];
        for (int line = 0; line < 4; ++line) {
          __builtin_prefetch(gd + ahead * 64 + line * 16);
          __builtin_prefetch(dg + ahead * 64 + line * 16, 1);
        }
      }
      V da;  // lane k: head k's dot product, its lanes summed as sum8 sums them
      if constexpr (kWideVectors && std::is_same_v<T, float>) {  // two heads a vector, half the shuffles
        Vec16f prod[4];
        for (int m = 0; m < 4; ++m) prod[m] = load16(dout + i * 64 + m * 16) * load16(gd + j * 64 + m * 16);
        da = sum8_each_pairs(prod);
      } else {
        V prod[8];
        for (int k = 0; k < 8; ++k) prod[k] = dv[k] * load8(gd + j * 64 + k * 8);
        da = sum8_each<T>(prod);
      }
      store8(ws.grad_alpha.data() + e * 8, dropout ? da * load8(multipliers + 8 * c.alpha_kept[e]) : da);
      if constexpr (kWideVectors && std::is_same_v<T, float>) {  // heads 2m and 2m + 1 at once
        const V a = load8(a_dropped + e * 8);
        T* dgj = dg + j * 64;
        for (int m = 0; m < 4; ++m)
          store16(dgj + m * 16, load16(dgj + m * 16) + lane_pair_everywhere(a, m) * load16(dout + i * 64 + m * 16));
      } else {
        for (int k = 0; k < 8; ++k)
          store8(dg + j * 64 + k * 8, load8(dg + j * 64 + k * 8) + broadcast8(a_dropped + e * 8 + k) * dv[k]);
      }
    }
  }
  if (dropout) {
    for (index_t j = 0; j < S; ++j)
      for (int k = 0; k < 8; ++k)
        store8(dg + j * 64 + k * 8, load8(dg + j * 64 + k * 8) * load8(multipliers + 8 * c.g_kept[k * S + j]));
  }

  GAT_NEXT_PHASE(timer, kStepBackScores);
  ws.grad_s_target.resize(Tn * 8);
  ws.grad_s_source.resize(S * 8);
  first_layer_backward_softmax(p, ws);
  // The half-scores s(j)_k = a_k · g_kj + b_k: lane k of each vector below is head k's scalar in score_grads.
  V grad_a_target[8] = {}, grad_a_source[8] = {}, grad_b_target = {}, grad_b_source = {};
  for (index_t i = 0; i < Tn; ++i) {
    const V d = load8(ws.grad_s_target.data() + i * 8);
    const index_t j = b.target_in_source[i];
    grad_b_target += d;
    for (int k = 0; k < 8; ++k) {
      const V dk = lane_everywhere<T>(d, k);
      grad_a_target[k] += dk * load8(c.g.data() + j * 64 + k * 8);
      store8(dg + j * 64 + k * 8, load8(dg + j * 64 + k * 8) + dk * load8(w.a_target + k * 8));
    }
  }
  for (index_t j = 0; j < S; ++j) {
    const V d = load8(ws.grad_s_source.data() + j * 8);
    grad_b_source += d;
    for (int k = 0; k < 8; ++k) {
      const V dk = lane_everywhere<T>(d, k);
      grad_a_source[k] += dk * load8(c.g.data() + j * 64 + k * 8);
      store8(dg + j * 64 + k * 8, load8(dg + j * 64 + k * 8) + dk * load8(w.a_source + k * 8));
    }
  }
  for (int k = 0; k < 8; ++k) {
    store8(g.a_target + k * 8, grad_a_target[k]);
    store8(g.a_source + k * 8, grad_a_source[k]);
    g.b_target[k] = grad_b_target[k];
    g.b_source[k] = grad_b_source[k];
  }

  GAT_NEXT_PHASE(timer, kStepBackXW);
  first_layer_weight_grad(p, c, ws, g.W, g.W_by_feature);
}

// Layer `l` backward for one replica: `grad_output` is ∂L/∂output; accumulates into `g` and, for layer 2,
// writes ∂L/∂input into `grad_input` [S, F_in].
template <typename T, int FC>
void layer_backward(const Problem& p, int l, const LayerParams<T>& w, const T* grad_output, Workspace<T>& ws,
                    const LayerGrads<T>& g, T* grad_input) {
  constexpr int KM = FC > 0 ? FC : kMaxFeatures;
  LayerCache<T>& c = ws.cache[l];
  const Block& b = p.block[l];
  const index_t H = p.heads[l], F = FC > 0 ? FC : p.hidden[l], S = b.sources, Tn = b.targets, E = b.edges;
  const index_t fin = l == 0 ? p.f_in : p.heads[0] * p.hidden[0];
  const bool dropout = !c.alpha_mask.empty();
  const T slope = static_cast<T>(p.negative_slope);
  const bool concat = l == 0;

  if (fast_first_layer<FC>(p, l)) return first_layer_backward(p, w, grad_output, ws, g);
  ws.grad_out.resize(Tn * F);
  ws.grad_g.resize(H * S * F);
  ws.grad_alpha.resize(std::max<index_t>(E, 1));
  ws.grad_s_target.resize(Tn);
  ws.grad_s_source.resize(S);
  if (grad_input != nullptr) std::fill(grad_input, grad_input + S * fin, T(0));
  for (index_t k = 0; k < H; ++k) {
    // ∂L/∂out^k: through ELU (concatenated heads) or the mean of the heads.
    T* dout = ws.grad_out.data();
    const T* pre = c.pre.data() + k * Tn * F;
    if (concat) {  // ELU's derivative, exp(min(x, 0)): the exps first, in a loop that vectorises
      ws.e.resize(std::max<index_t>(ws.e.size(), Tn * F));
      T* slope_of = ws.e.data();
      for (index_t n = 0; n < Tn * F; ++n) slope_of[n] = std::min(pre[n], T(0));
      exp_inplace(slope_of, Tn * F);
      // Where x > 0 the slope is exp(0) = 1 exactly (exp_approx(0) too), and d * 1 == d to the bit: one product
      // for every element, never `x > 0 ? d : d * slope[n]`. That conditional load is what GCC 12.2 at -O3 with
      // AVX2 and -fno-trapping-math if-converts into vmaskmovpd/ps loads within an SLP group and gets wrong
      // (wrong ∂L/∂W of the first layer in float64 at -march=x86-64-v3; the reproducer is in the README's
      // "The fused training kernel" section). Without the branch there is no masked load to get wrong.
      for (index_t i = 0; i < Tn; ++i)
        for (index_t f = 0; f < F; ++f) dout[i * F + f] = grad_output[i * H * F + k * F + f] * slope_of[i * F + f];
    } else {
      for (index_t n = 0; n < Tn * F; ++n) dout[n] = grad_output[n] / static_cast<T>(H);
    }
    {
      T acc[KM] = {};
      for (index_t i = 0; i < Tn; ++i)
        for (index_t f = 0; f < F; ++f) acc[f] += dout[i * F + f];
      std::copy(acc, acc + F, g.bias + k * F);
    }

    // Aggregation: ∂L/∂α_ij = mask_ij ∂L/∂out_i · dropout(g_j); ∂L/∂g_j = mask_j Σ_i dropout(α_ij) ∂L/∂out_i.
    const T* alpha = c.alpha.data() + k * E;
    const T* am = dropout ? c.alpha_mask.data() + k * E : nullptr;
    const T* gd = (dropout ? c.g_dropped.data() : c.g.data()) + k * S * F;
    const T* gk = c.g.data() + k * S * F;
    T* dg = ws.grad_g.data() + k * S * F;
    std::fill(dg, dg + S * F, T(0));
    for (index_t i = 0; i < Tn; ++i) {
      const T* di = dout + i * F;
      if constexpr (FC == 8) {  // 8 features: one vector each; the dot product's lanes summed pairwise
        const Vec8<T> dv = load8(di);
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
          const index_t j = b.source[e];
          const T a = am ? alpha[e] * am[e] : alpha[e];
          const Vec8<T> prod = dv * load8(gd + j * 8);
          const T da = sum8<T>(prod);
          ws.grad_alpha[e] = am ? da * am[e] : da;
          store8(dg + j * 8, load8(dg + j * 8) + a * dv);
        }
        continue;
      }
      for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
        const index_t j = b.source[e];
        const T a = am ? alpha[e] * am[e] : alpha[e];
        const T da = dot(di, gd + j * F, F);
        ws.grad_alpha[e] = am ? da * am[e] : da;
        T* dgj = dg + j * F;
        for (index_t f = 0; f < F; ++f) dgj[f] += a * di[f];
      }
    }
    if (dropout) {
      const T* gm = c.g_mask.data() + k * S * F;
      for (index_t i = 0; i < S * F; ++i) dg[i] = dg[i] * gm[i];
    }

    // Softmax: ∂L/∂e = α ∘ (∂L/∂α - Σ_segment α ∘ ∂L/∂α); LeakyReLU; then the two halves of the score.
    const T* z = c.z.data() + k * E;
    std::fill(ws.grad_s_source.begin(), ws.grad_s_source.end(), T(0));
    for (index_t i = 0; i < Tn; ++i) {
      const index_t begin = b.crow[i], end = b.crow[i + 1];
      T total = T(0);
      for (index_t e = begin; e < end; ++e) total += ws.grad_alpha[e] * alpha[e];
      T st = T(0);
      for (index_t e = begin; e < end; ++e) {
        const T de = ws.grad_alpha[e] * alpha[e] - alpha[e] * total;
        const T dz = z[e] > T(0) ? de : de * slope;
        st += dz;
        ws.grad_s_source[b.source[e]] += dz;
      }
      ws.grad_s_target[i] = st;
    }
    score_grads<T, FC>(b, k, F, gk, w, ws.grad_s_target.data(), ws.grad_s_source.data(), g, dg);

    // g = W^k · dropout_k(h): ∂L/∂W^k = dropout_k(h)^T ∂L/∂g; ∂L/∂h = mask_k ∘ (∂L/∂g W^k^T).
    T* dW = g.W + k * fin * F;
    std::fill(dW, dW + fin * F, T(0));
    if (l == 0) {
      const T* values = c.input.data() + k * p.nnz;
      for (index_t j = 0; j < S; ++j) {
        T dgj[KM];
        std::copy(dg + j * F, dg + j * F + F, dgj);
        for (index_t e = p.x_crow[j]; e < p.x_crow[j + 1]; ++e) {
          const T v = values[e];
          T* row = dW + p.x_col[e] * F;
          for (index_t f = 0; f < F; ++f) row[f] += v * dgj[f];
        }
      }
    } else if (fin % 8 == 0) {
      // The same sums as below, in the same order, 8 input features per vector: ∂L/∂W^k accumulated
      // transposed ([F', F_in]), and ∂L/∂h_j = Σ_f ∂L/∂g_jf W^k[:, f].
      const T* Wk = w.W + k * fin * F;
      const T* mask = dropout ? c.input_mask.data() + k * S * fin : nullptr;
      ws.weights_t2.resize(F * fin);
      for (index_t q = 0; q < fin; ++q)
        for (index_t f = 0; f < F; ++f) ws.weights_t2[f * fin + q] = Wk[q * F + f];
      ws.grad_weights_t.assign(F * fin, T(0));
      for (index_t j = 0; j < S; ++j) {
        const T* hj = c.head_input(k, S * fin) + j * fin;
        const T* dgj = dg + j * F;
        for (index_t f = 0; f < F; ++f) {
          T* row = ws.grad_weights_t.data() + f * fin;
          for (index_t q = 0; q < fin; q += 8) store8(row + q, load8(row + q) + load8(hj + q) * dgj[f]);
        }
        if (grad_input == nullptr) continue;
        for (index_t q = 0; q < fin; q += 8) {
          Vec8<T> d = {};
          for (index_t f = 0; f < F; ++f) d += load8(ws.weights_t2.data() + f * fin + q) * dgj[f];
          if (mask) d = d * load8(mask + j * fin + q);
          store8(grad_input + j * fin + q, load8(grad_input + j * fin + q) + d);
        }
      }
      for (index_t q = 0; q < fin; ++q)
        for (index_t f = 0; f < F; ++f) dW[q * F + f] = ws.grad_weights_t[f * fin + q];
    } else {
      const T* Wk = w.W + k * fin * F;
      const T* mask = dropout ? c.input_mask.data() + k * S * fin : nullptr;
      for (index_t j = 0; j < S; ++j) {
        const T* hj = c.head_input(k, S * fin) + j * fin;
        T dgj[KM];
        std::copy(dg + j * F, dg + j * F + F, dgj);
        for (index_t q = 0; q < fin; ++q) {
          T* row = dW + q * F;
          const T v = hj[q];
          for (index_t f = 0; f < F; ++f) row[f] += v * dgj[f];
          if (grad_input != nullptr) {
            const T d = dot(Wk + q * F, dgj, F);
            grad_input[j * fin + q] += mask ? d * mask[j * fin + q] : d;
          }
        }
      }
    }
  }
}

// ∂L/∂W of the paper's first layer, all heads of a stored feature at once, into `grad_W` [H, F_in, F'], or, with
// `by_feature` (SeedRun's W by input feature), [F_in, H·F'], each row then taking its Adam update (ws.adam_rows).
// Feature by feature along x's columns: each row of ∂L/∂W is summed in registers and stored once, where a
// scatter along x's rows would read and write it once per entry (and first zero and then transpose it all).
// The terms are added in the same order either way (rows ascending), so the sums are the same to the bit.
template <typename T>
void first_layer_weight_grad(const Problem& p, const LayerCache<T>& c, Workspace<T>& ws, T* grad_W, bool by_feature) {
  const index_t fin = p.f_in;
  const bool dropout = !c.alpha_kept.empty();
  const T* x_by_column = static_cast<const T*>(p.x_cval);
  const T* dg = ws.grad_g.data();  // by source, [S, H·8]: a source's 64 values in one place
  // A feature's 64 sums land in a workspace buffer, not in a local array: GCC 12 kept sparse_row_product's four
  // 16-lane sums in such an array itself (a load, an add and a store per entry, so each sum's chain of adds went
  // through memory), which it cannot do with a buffer that the gathered rows of ∂L/∂g might overlap. The same sums;
  // the phase 0.76 times as long (reports/fused-kernel-log.md, "∂L/∂W's sums in registers").
  ws.row_sums.resize(64);
  T* by_head = ws.row_sums.data();
  for (index_t q = 0; q < fin; ++q) {
    // Column q of x: its entries t, each with the gradient of its node's g.
    sparse_row_product(p.x_ccol[q], p.x_ccol[q + 1], c, dropout,
                       [&](index_t t) { return SparseEntry<T>{x_by_column[t], p.x_pos[t], dg + p.x_row[t] * 64}; },
                       by_feature ? grad_W + q * 64 : by_head);
    for (int k = 0; !by_feature && k < 8; ++k)
      std::copy(by_head + k * 8, by_head + k * 8 + 8, grad_W + (k * fin + q) * 8);
    if constexpr (std::is_same_v<T, float>) {
      const AdamRows& rows = ws.adam_rows;
      if (by_feature && rows.step != nullptr)
        rows.step->apply(rows.param + q * 64, rows.exp_avg + q * 64, rows.exp_avg_sq + q * 64, grad_W + q * 64, 64);
    }
  }
}

// Layers with F' = 8 (the paper's hidden layer) or the class counts of the Planetoid datasets get a build of
// their own (registers for the per-head vectors); others take the general one.
template <typename T, typename... Args>
void layer_forward_any(const Problem& p, int l, Args&&... args) {
  switch (p.hidden[l]) {
    case 8: return layer_forward<T, 8>(p, l, args...);
    case 7: return layer_forward<T, 7>(p, l, args...);
    case 6: return layer_forward<T, 6>(p, l, args...);
    case 3: return layer_forward<T, 3>(p, l, args...);
    default: return layer_forward<T, 0>(p, l, args...);
  }
}

template <typename T, typename... Args>
void layer_backward_any(const Problem& p, int l, Args&&... args) {
  switch (p.hidden[l]) {
    case 8: return layer_backward<T, 8>(p, l, args...);
    case 7: return layer_backward<T, 7>(p, l, args...);
    case 6: return layer_backward<T, 6>(p, l, args...);
    case 3: return layer_backward<T, 3>(p, l, args...);
    default: return layer_backward<T, 0>(p, l, args...);
  }
}

// Mean cross-entropy and accuracy over the last block's targets; optionally ∂loss/∂logits.
template <typename T>
void loss_and_accuracy(const Problem& p, const T* logits, T* loss, double* accuracy, T* grad) {
  const index_t M = p.block[1].targets, C = p.hidden[1];
  T total = T(0);
  index_t correct = 0;
  for (index_t i = 0; i < M; ++i) {
    const T* x = logits + i * C;
    index_t best = 0;
    for (index_t c = 1; c < C; ++c) best = x[c] > x[best] ? c : best;
    correct += best == p.labels[i];
    T sum = T(0);
    for (index_t c = 0; c < C; ++c) sum += std::exp(x[c] - x[best]);
    const T log_sum = std::log(sum) + x[best];
    total += log_sum - x[p.labels[i]];
    if (grad != nullptr) {
      for (index_t c = 0; c < C; ++c) {
        const T probability = std::exp(x[c] - log_sum);
        grad[i * C + c] = ((c == p.labels[i]) ? probability - T(1) : probability) / static_cast<T>(M);
      }
    }
  }
  *loss = total / static_cast<T>(M);
  *accuracy = static_cast<double>(correct) / static_cast<double>(M);
}

template <typename T>
LayerParams<T> layer_params(const Problem& p, int l, void* const* params, index_t r, bool W_by_feature = false) {
  const T* v[kParams];
  for (int i = 0; i < kParams; ++i) v[i] = static_cast<const T*>(params[l * kParams + i]) + r * param_numel(p, l, i);
  return {v[0], v[1], v[2], v[3], v[4], v[5], W_by_feature && l == 0};
}

template <typename T>
LayerGrads<T> layer_grads(const Problem& p, int l, T* base, bool W_by_feature = false) {
  T* v[kParams];
  for (int i = 0; i < kParams; ++i) {
    v[i] = base;
    base += param_numel(p, l, i);
  }
  return {v[0], v[1], v[2], v[3], v[4], v[5], W_by_feature && l == 0};
}

index_t replica_numel(const Problem& p) {
  index_t n = 0;
  for (int l = 0; l < 2; ++l)
    for (int i = 0; i < kParams; ++i) n += param_numel(p, l, i);
  return n;
}

template <typename T>
void forward(const Problem& p, void* const* params, index_t r, bool training, const Dropout& drop, void* state,
             Workspace<T>& ws, bool W_by_feature = false) {
  const index_t T1 = p.block[0].targets, hidden = p.heads[0] * p.hidden[0];
  ws.hidden.resize(T1 * hidden);
  ws.logits.resize(p.block[1].targets * p.hidden[1]);
  layer_forward_any<T>(p, 0, layer_params<T>(p, 0, params, r, W_by_feature), nullptr, training, drop, state, ws,
                       ws.hidden.data());
  GAT_PHASE(timer, training ? kStepLayer2 : kValLayer2);
  layer_forward_any<T>(p, 1, layer_params<T>(p, 1, params, r), ws.hidden.data(), training, drop, state, ws,
                   ws.logits.data());
}

template <typename T>
void train_replica(const Problem& p, index_t r, void* const* params, void* const* exp_avg, void* const* exp_avg_sq,
                   const Adam* adam, const Dropout& drop, T* loss, double* accuracy, T* logits_out,
                   void* const* grads_out, Workspace<T>& ws, bool W_by_feature = false) {
  void* state = drop.next != nullptr ? drop.states[r] : nullptr;
  forward<T>(p, params, r, true, drop, state, ws, W_by_feature);
  GAT_PHASE(timer, kStepLoss);
  const index_t M = p.block[1].targets, C = p.hidden[1];
  ws.grad_logits.resize(M * C);
  loss_and_accuracy<T>(p, ws.logits.data(), loss + r, accuracy + r, ws.grad_logits.data());
  if (logits_out != nullptr) std::copy(ws.logits.begin(), ws.logits.end(), logits_out + r * M * C);

  const index_t numel = replica_numel(p);
  ws.grads.resize(numel);  // every gradient is written whole by the backward passes
  const LayerGrads<T> g0 = layer_grads<T>(p, 0, ws.grads.data(), W_by_feature);
  const LayerGrads<T> g1 = layer_grads<T>(p, 1, g0.bias + param_numel(p, 0, 5));
  ws.grad_hidden.resize(p.block[0].targets * p.heads[0] * p.hidden[0]);
  GAT_NEXT_PHASE(timer, kStepBackLayer2);
  layer_backward_any<T>(p, 1, layer_params<T>(p, 1, params, r), ws.grad_logits.data(), ws, g1, ws.grad_hidden.data());
  GAT_NEXT_PHASE(timer, kUntimed);  // layer 1's backward pass times its own phases
  std::optional<AdamStep> adam_step;
  if (adam != nullptr) adam_step.emplace(*adam);
  // With W by feature (the native loop's), W's rows take their Adam update in ∂L/∂W's loop (AdamRows).
  // Set on every call, so that no call sees another's (a step that threw leaves its rows behind).
  const bool w_by_rows = std::is_same_v<T, float> && adam_step && g0.W_by_feature;
  const index_t n0 = param_numel(p, 0, 0);
  ws.adam_rows = w_by_rows ? AdamRows{&*adam_step, static_cast<float*>(params[0]) + r * n0,
                                      static_cast<float*>(exp_avg[0]) + r * n0,
                                      static_cast<float*>(exp_avg_sq[0]) + r * n0}
                           : AdamRows{};
  layer_backward_any<T>(p, 0, layer_params<T>(p, 0, params, r, W_by_feature), ws.grad_hidden.data(), ws, g0, nullptr);
  ws.adam_rows = {};
  GAT_NEXT_PHASE(timer, kStepAdam);

  const T* grad = ws.grads.data();
  for (int l = 0; l < 2; ++l) {
    for (int i = 0; i < kParams; ++i) {
      const index_t n = param_numel(p, l, i);
      const int which = l * kParams + i;
      if (grads_out != nullptr) std::copy(grad, grad + n, static_cast<T*>(grads_out[which]) + r * n);
      if constexpr (sizeof(T) == sizeof(float)) {
        if (adam_step && !(w_by_rows && which == 0)) {
          adam_step->apply(static_cast<float*>(params[which]) + r * n, static_cast<float*>(exp_avg[which]) + r * n,
                           static_cast<float*>(exp_avg_sq[which]) + r * n, grad, n);
        }
      }
      grad += n;
    }
  }
}

// Runs body(r) for r in [0, R) on up to `threads` threads; replica r always runs whole on one thread.
template <typename Body>
int for_replicas(index_t R, int threads, Body body) {
  threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, R)));
  std::vector<int> failed(threads, 0);
  auto run = [&](int t) {
    try {
      for (index_t r = t; r < R; r += threads) body(r);
    } catch (const std::exception&) {
      failed[t] = 1;
    }
  };
  if (threads == 1) {
    run(0);
  } else {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(run, t);
    run(0);
    for (auto& thread : pool) thread.join();
  }
  return *std::max_element(failed.begin(), failed.end());
}

template <typename T>
Workspace<T>& workspace() {
  thread_local Workspace<T> ws;  // kept between calls of the calling thread: no page faults on every step
  return ws;
}

template <typename T>
int train_step(const Problem* p, index_t R, void* const* params, void* const* exp_avg, void* const* exp_avg_sq,
               const Adam* adam, const Dropout* drop, T* loss, double* accuracy, T* logits_out,
               void* const* grads_out, int threads) {
  return for_replicas(R, threads, [&](index_t r) {
    train_replica<T>(*p, r, params, exp_avg, exp_avg_sq, adam, *drop, loss, accuracy, logits_out, grads_out,
                     workspace<T>());
  });
}

template <typename T>
int evaluate(const Problem* p, index_t R, void* const* params, T* loss, double* accuracy, T* logits_out,
             int threads) {
  const Dropout none{nullptr, nullptr, 0, 0, 1.0f};
  return for_replicas(R, threads, [&](index_t r) {
    Workspace<T>& ws = workspace<T>();
    forward<T>(*p, params, r, false, none, nullptr, ws);
    loss_and_accuracy<T>(*p, ws.logits.data(), loss + r, accuracy + r, nullptr);
    if (logits_out != nullptr) {
      const index_t n = p->block[1].targets * p->hidden[1];
      std::copy(ws.logits.begin(), ws.logits.end(), logits_out + r * n);
    }
  });
}


// ---------------------------------------------------------------------------------------------------------------
// Seeds as vector lanes: the epochs of a batch of seeds in one native loop (gat_lanes_*).
//
// Every seed runs the same operations on the same graph, so a vector of L floats holds one value of L seeds
// ("lanes"), and every operation above, written for one replica, is here one vector operation for L of them:
// each lane does exactly one seed's arithmetic, in exactly the order of the per-replica code (the sums below
// follow it term by term, including its sum8 trees), so a seed's bytes do not depend on L, on its lane, on its
// batch-mates or on the CPU. The graph (sparse features, edge lists, softmax segments) is read once per L seeds.
//
// A lane group also keeps its seeds' Adam moments, early stopping and checkpoints: one call (gat_lanes_tick) runs
// one epoch of every lane (training step, validation pass, early stopping), and a lane whose seed stopped takes
// the batch's next seed, at its own epoch 1, so that the lanes stay full until the batch runs out.
// Parameters live in the group lane-interleaved [numel][L], W of the second layer as [H][F'][F_in] (a dot product
// along contiguous memory); activations head-major, [H][nodes][F'], as in the per-replica code.

template <int L>
struct LaneTypes;
#define GAT_LANE_TYPES(N)                                        \
  template <>                                                    \
  struct LaneTypes<N> {                                          \
    typedef float V __attribute__((vector_size(4 * N)));         \
    typedef int32_t I __attribute__((vector_size(4 * N)));       \
  };
GAT_LANE_TYPES(4)
GAT_LANE_TYPES(8)
GAT_LANE_TYPES(16)
#undef GAT_LANE_TYPES

template <int L>
struct Lanes {
  using V = typename LaneTypes<L>::V;  // one float of each of L seeds
  using I = typename LaneTypes<L>::I;

  // 0 or the dropout scale in each lane, from a mask stored as one byte per lane (0x00 dropped, 0xFF kept): the
  // bytes sign-extended to all ones or zeros, and the scale's bits kept where they are ones. GCC 12 turns
  // __builtin_convertvector's byte widening into 16 scalar moves, which made it the most expensive step of the
  // layer; the vector instructions that widen bytes do it in one.
  static V kept(const uint8_t* mask, V scale) {
    I all_ones;
#if defined(__AVX512F__)
    if constexpr (L == 16) {
      all_ones = __builtin_bit_cast(I, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mask))));
    } else
#endif
#if defined(__AVX2__)
    if constexpr (L == 8) {
      all_ones = __builtin_bit_cast(I, _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask))));
    } else
#endif
#if defined(__SSE4_1__)
    if constexpr (L == 4) {
      int32_t word;
      std::memcpy(&word, mask, 4);
      all_ones = __builtin_bit_cast(I, _mm_cvtepi8_epi32(_mm_cvtsi32_si128(word)));
    } else
#endif
    {
      for (int lane = 0; lane < L; ++lane) all_ones[lane] = static_cast<int8_t>(mask[lane]);
    }
    return __builtin_bit_cast(V, __builtin_bit_cast(I, scale) & all_ones);
  }
  static V splat(float x) { return V{} + x; }
  static V sum8(const V* p) { return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])); }
};

// Per-replica layout (gat.layers, torch) <-> lane layout: the position in the group of element `t` of parameter
// `which` of layer `l`.
inline index_t lane_position(const Problem& p, int l, int which, index_t t) {
  if (which != 0 || l == 0) return t;  // W of the first layer keeps torch's [H, F_in, F'] in the lanes
  const index_t F = p.hidden[1], fin = p.heads[0] * p.hidden[0];
  const index_t k = t / (fin * F), q = (t / F) % fin, f = t % F;  // torch: W [H, F_in, F']
  return (k * F + f) * fin + q;
}

// gat.training.EarlyStopping for one seed: its best validation figures so far and the epochs since one improved.
struct SeedStopping {
  int64_t epoch = 0;  // epochs trained
  int64_t wait = 0;
  double best_acc = 0.0, best_loss = INFINITY;
};

// Where a tick writes each replica's figures of the epoch it just trained (gat_lanes_tick's arguments).
struct EpochOutputs {
  float* train_loss;
  double* train_acc;
  float* val_loss;
  double* val_acc;
  int64_t* epoch_of;  // the epoch each replica trained in this call, 0 for those that did not
};

template <int L>
struct LaneGroup {
  using V = typename Lanes<L>::V;
  struct Activations {  // one problem's forward pass (the training or the validation view)
    std::vector<V> input1;                       // layer 2's input under dropout [H, S, F_in]
    std::vector<V> g[2], g_dropped[2];           // [S, H, F']
    std::vector<V> z[2], alpha[2], a_dropped[2]; // [E, H]
    std::vector<V> pre[2];                       // [T, H, F']
    std::vector<V> hidden, logits;               // [T1, H·F'], [T2, C]
    std::vector<uint8_t> mask_x, mask_input1, mask_alpha[2], mask_g[2];  // stream order [n][L]
    std::vector<V> s_target, s_source;           // [T, H], [S, H]
  };

  const Problem* train_p;
  const Problem* val_p;
  index_t numel;
  index_t offsets[2][kParams];
  std::vector<V> param, exp_avg, exp_avg_sq, grad;
  int replica[L];       // the replica in each lane, or -1
  SeedStopping stopping[L];  // of the lane's replica (idle lanes: at epoch 0, for Adam's step)
  Activations train_acts, val_acts;
  // The backward pass.
  std::vector<V> grad_logits, grad_hidden, grad_out, grad_g, grad_alpha, grad_s_target, grad_s_source, slope_of;
  // Masks: each lane's draw, then interleaved.
  std::vector<uint8_t> lane_bytes;
  std::vector<index_t> ties;
  float loss_train[L], loss_val[L];
  double acc_train[L], acc_val[L];

  LaneGroup(const Problem* t, const Problem* v) : train_p(t), val_p(v) {
    numel = 0;
    for (int l = 0; l < 2; ++l)
      for (int i = 0; i < kParams; ++i) {
        offsets[l][i] = numel;
        numel += param_numel(*t, l, i);
      }
    param.assign(numel, V{});
    exp_avg.assign(numel, V{});
    exp_avg_sq.assign(numel, V{});
    grad.assign(numel, V{});
    for (int lane = 0; lane < L; ++lane) replica[lane] = -1;  // idle lanes: zeros, at epoch 0, compute finite
                                                                // numbers no one reads
  }

  V* P(int l, int which) { return param.data() + offsets[l][which]; }
  V* G(int l, int which) { return grad.data() + offsets[l][which]; }

  void load(int lane, int r, void* const* init) {
    for (int l = 0; l < 2; ++l)
      for (int i = 0; i < kParams; ++i) {
        const index_t n = param_numel(*train_p, l, i);
        const float* src = static_cast<const float*>(init[l * kParams + i]) + r * n;
        V* dst = P(l, i);
        V* m = exp_avg.data() + offsets[l][i];
        V* v = exp_avg_sq.data() + offsets[l][i];
        for (index_t t = 0; t < n; ++t) {
          const index_t at = lane_position(*train_p, l, i, t);
          dst[at][lane] = src[t];
          m[at][lane] = 0.0f;
          v[at][lane] = 0.0f;
        }
      }
    replica[lane] = r;
    stopping[lane] = SeedStopping{};
  }

  void save(int lane, void* const* checkpoint) {
    const int r = replica[lane];
    for (int l = 0; l < 2; ++l)
      for (int i = 0; i < kParams; ++i) {
        const index_t n = param_numel(*train_p, l, i);
        float* dst = static_cast<float*>(checkpoint[l * kParams + i]) + r * n;
        const V* src = P(l, i);
        for (index_t t = 0; t < n; ++t) dst[t] = src[lane_position(*train_p, l, i, t)][lane];
      }
  }

  // Each active lane's masks for `count` elements of its stream, interleaved into `out` [count][L]; an idle lane
  // keeps everything and draws nothing.
  void draw(const Dropout& d, index_t count, std::vector<uint8_t>& out) {
    const index_t row = (count + 7) / 8 * 8;
    lane_bytes.resize(row * L);
    out.resize(count * L);
    for (int lane = 0; lane < L; ++lane) {
      uint8_t* mine = lane_bytes.data() + lane * row;
      if (replica[lane] >= 0) {
        draw_kept_bytes(d, d.states[replica[lane]], count, mine, ties);
      } else {
        std::fill(mine, mine + row, uint8_t(0xFF));
      }
    }
    constexpr index_t block = 64;
    uint8_t* __restrict interleaved = out.data();  // bytes alias anything: plain pointers, or every store reloads them
    const uint8_t* __restrict drawn = lane_bytes.data();
    for (index_t n0 = 0; n0 < count; n0 += block) {
      const index_t n1 = std::min(count, n0 + block);
      for (int lane = 0; lane < L; ++lane) {
        const uint8_t* mine = drawn + lane * row;
        for (index_t n = n0; n < n1; ++n) interleaved[n * L + lane] = mine[n];
      }
    }
  }

  // g = W·dropout(x) of the first layer for features [f0, f0 + FW) of head k: FW accumulators in registers, and
  // the slice of W that the pass gathers rows of, [F_in, FW] of L lanes, small enough to stay in a core's L2 cache.
  template <int FW>
  void first_product(const Problem& p, const uint8_t* mask, V scale, V* g, index_t k, index_t f0) {
    const index_t S = p.block[0].sources, nnz = p.nnz, fin = p.f_in, F = p.hidden[0];
    const float* x = static_cast<const float*>(p.x_val);
    const V* W = P(0, 0) + k * fin * F + f0;
    V* gk = g + k * S * F + f0;
    for (index_t j = 0; j < S; ++j) {
      V acc[FW] = {};
      for (index_t e = p.x_crow[j]; e < p.x_crow[j + 1]; ++e) {
        const V* row = W + p.x_col[e] * F;
        const V v = mask ? x[e] * Lanes<L>::kept(mask + (k * nnz + e) * L, scale) : Lanes<L>::splat(x[e]);
        for (int f = 0; f < FW; ++f) acc[f] += v * row[f];
      }
      for (int f = 0; f < FW; ++f) gk[j * F + f] = acc[f];
    }
  }

  // ∂L/∂W of the same slice, by x's columns (rows ascending: the order of the per-replica sums).
  template <int FW>
  void first_weight_grad(const Problem& p, const uint8_t* mask, V scale, const V* dg, index_t k, index_t f0) {
    const index_t S = p.block[0].sources, nnz = p.nnz, fin = p.f_in, F = p.hidden[0];
    const float* x_by_column = static_cast<const float*>(p.x_cval);
    V* dW = G(0, 0) + k * fin * F + f0;
    const V* dgk = dg + k * S * F + f0;
    for (index_t q = 0; q < fin; ++q) {
      V acc[FW] = {};
      for (index_t t = p.x_ccol[q]; t < p.x_ccol[q + 1]; ++t) {
        const index_t e = p.x_pos[t];
        const V* dgj = dgk + p.x_row[t] * F;
        const float xe = x_by_column[t];
        const V v = mask ? xe * Lanes<L>::kept(mask + (k * nnz + e) * L, scale) : Lanes<L>::splat(xe);
        for (int f = 0; f < FW; ++f) acc[f] += v * dgj[f];
      }
      for (int f = 0; f < FW; ++f) dW[q * F + f] = acc[f];
    }
  }

  // The first layer's product (or weight gradient), FW features at a time where F' allows, else one by one.
  template <bool Backward>
  void first_layer_pass(const Problem& p, const uint8_t* mask, V scale, V* g_or_dg) {
    const index_t H = p.heads[0], F = p.hidden[0];
    constexpr int FW = 8;
    for (index_t k = 0; k < H; ++k) {
      if (F % FW == 0) {
        for (index_t f0 = 0; f0 < F; f0 += FW) {
          if constexpr (Backward) first_weight_grad<FW>(p, mask, scale, g_or_dg, k, f0);
          else first_product<FW>(p, mask, scale, g_or_dg, k, f0);
        }
      } else {
        for (index_t f0 = 0; f0 < F; ++f0) {
          if constexpr (Backward) first_weight_grad<1>(p, mask, scale, g_or_dg, k, f0);
          else first_product<1>(p, mask, scale, g_or_dg, k, f0);
        }
      }
    }
  }

  // Layer l's forward pass of every lane (per-replica: layer_forward).
  // FC: F' when known at compile time (0: read from the problem), as layer_forward's.
  template <int FC>
  void layer_forward(const Problem& p, int l, bool dropout, const Dropout& d, Activations& a, const V* input,
                     V* output) {
    constexpr int KM = FC > 0 ? FC : kMaxFeatures;
    const Block& b = p.block[l];
    const index_t H = p.heads[l], F = FC > 0 ? FC : p.hidden[l], S = b.sources, Tn = b.targets, E = b.edges;
    const index_t fin = l == 0 ? p.f_in : p.heads[0] * p.hidden[0];
    const V scale = Lanes<L>::splat(d.scale), zero = {}, slope = Lanes<L>::splat(static_cast<float>(p.negative_slope));
    std::vector<V>& g = a.g[l];
    g.resize(S * H * F);
    if (l == 0) {
      if (dropout) draw(d, H * p.nnz, a.mask_x);
      first_layer_pass<false>(p, dropout ? a.mask_x.data() : nullptr, scale, g.data());
    } else {
      const V* in = input;
      if (dropout) {
        draw(d, H * S * fin, a.mask_input1);
        a.input1.resize(H * S * fin);
        for (index_t k = 0; k < H; ++k)
          for (index_t n = 0; n < S * fin; ++n)
            a.input1[k * S * fin + n] = input[n] * Lanes<L>::kept(a.mask_input1.data() + (k * S * fin + n) * L, scale);
      }
      const V* W = P(1, 0);
      for (index_t k = 0; k < H; ++k) {
        const V* hk = dropout ? a.input1.data() + k * S * fin : in;
        for (index_t j = 0; j < S; ++j) {
          const V* hj = hk + j * fin;
          for (index_t f = 0; f < F; ++f) {
            const V* wf = W + (k * F + f) * fin;
            if (fin % 8 == 0) {  // 8 partial sums, then the sum8 tree
              V part[8] = {};
              for (index_t q = 0; q < fin; q += 8)
                for (int r = 0; r < 8; ++r) part[r] += hj[q + r] * wf[q + r];
              g[(k * S + j) * F + f] = Lanes<L>::sum8(part);
            } else {
              V acc = {};
              for (index_t q = 0; q < fin; ++q) acc += hj[q] * wf[q];
              g[(k * S + j) * F + f] = acc;
            }
          }
        }
      }
    }

    // Scores, LeakyReLU and the softmax over each neighbourhood.
    const V* a_t = P(l, 1);
    const V* a_s = P(l, 2);
    const V* b_t = P(l, 3);
    const V* b_s = P(l, 4);
    a.s_source.resize(S * H);
    a.s_target.resize(Tn * H);
    for (index_t j = 0; j < S; ++j)
      for (index_t k = 0; k < H; ++k) {
        V s = {};
        for (index_t f = 0; f < F; ++f) s += g[(k * S + j) * F + f] * a_s[k * F + f];
        a.s_source[k * S + j] = s + b_s[k];
      }
    for (index_t i = 0; i < Tn; ++i)
      for (index_t k = 0; k < H; ++k) {
        V s = {};
        for (index_t f = 0; f < F; ++f) s += g[(k * S + b.target_in_source[i]) * F + f] * a_t[k * F + f];
        a.s_target[k * Tn + i] = s + b_t[k];
      }
    std::vector<V>& z = a.z[l];
    std::vector<V>& alpha = a.alpha[l];
    z.resize(E * H);
    alpha.resize(E * H);
    for (index_t i = 0; i < Tn; ++i)
      for (index_t k = 0; k < H; ++k) {
        V shift = zero - INFINITY;
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
          const V ze = a.s_target[k * Tn + i] + a.s_source[k * S + b.source[e]];
          z[k * E + e] = ze;
          const V leaky = ze > zero ? ze : ze * slope;
          alpha[k * E + e] = leaky;
          shift = shift < leaky ? leaky : shift;
        }
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) alpha[k * E + e] = alpha[k * E + e] - shift;
      }
    exp_inplace(reinterpret_cast<float*>(alpha.data()), E * H * L);
    for (index_t i = 0; i < Tn; ++i)
      for (index_t k = 0; k < H; ++k) {
        V total = {};
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) total += alpha[k * E + e];
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) alpha[k * E + e] = alpha[k * E + e] / total;
      }

    // Dropout on α, then on g (the stream's order), and the aggregation.
    const V* ad = alpha.data();
    const V* gd = g.data();
    if (dropout) {
      draw(d, H * E, a.mask_alpha[l]);
      draw(d, H * S * F, a.mask_g[l]);
      a.a_dropped[l].resize(E * H);
      a.g_dropped[l].resize(S * H * F);
      for (index_t e = 0; e < E; ++e)
        for (index_t k = 0; k < H; ++k)
          a.a_dropped[l][k * E + e] = alpha[k * E + e] * Lanes<L>::kept(a.mask_alpha[l].data() + (k * E + e) * L, scale);
      for (index_t j = 0; j < S; ++j)
        for (index_t k = 0; k < H; ++k)
          for (index_t f = 0; f < F; ++f)
            a.g_dropped[l][(k * S + j) * F + f] =
                g[(k * S + j) * F + f] * Lanes<L>::kept(a.mask_g[l].data() + ((k * S + j) * F + f) * L, scale);
      ad = a.a_dropped[l].data();
      gd = a.g_dropped[l].data();
    }
    const V* bias = P(l, 5);
    std::vector<V>& pre = a.pre[l];
    pre.resize(Tn * H * F);
    for (index_t i = 0; i < Tn; ++i)
      for (index_t k = 0; k < H; ++k) {
        V acc[KM] = {};
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
          const V w = ad[k * E + e];
          const V* gj = gd + (k * S + b.source[e]) * F;
          for (index_t f = 0; f < F; ++f) acc[f] += w * gj[f];
        }
        for (index_t f = 0; f < F; ++f) pre[(k * Tn + i) * F + f] = acc[f] + bias[k * F + f];
      }
    if (l == 0) {  // ELU, heads concatenated: [T, H·F'] is pre's own layout
      for (index_t k = 0; k < H; ++k)
        for (index_t i = 0; i < Tn; ++i)
          for (index_t f = 0; f < F; ++f) output[(i * H + k) * F + f] = pre[(k * Tn + i) * F + f];
      elu_inplace(reinterpret_cast<float*>(output), Tn * H * F * L);
    } else {  // the mean of the heads
      for (index_t i = 0; i < Tn; ++i)
        for (index_t f = 0; f < F; ++f) {
          V sum = zero;
          for (index_t k = 0; k < H; ++k) sum += pre[(k * Tn + i) * F + f];
          output[i * F + f] = sum / static_cast<float>(H);
        }
    }
  }

  template <typename... Args>
  void layer_forward_any(const Problem& p, int l, Args&&... args) {
    switch (p.hidden[l]) {
      case 8: return layer_forward<8>(p, l, args...);
      case 7: return layer_forward<7>(p, l, args...);
      case 6: return layer_forward<6>(p, l, args...);
      case 3: return layer_forward<3>(p, l, args...);
      default: return layer_forward<0>(p, l, args...);
    }
  }

  template <typename... Args>
  void layer_backward_any(const Problem& p, int l, Args&&... args) {
    switch (p.hidden[l]) {
      case 8: return layer_backward<8>(p, l, args...);
      case 7: return layer_backward<7>(p, l, args...);
      case 6: return layer_backward<6>(p, l, args...);
      case 3: return layer_backward<3>(p, l, args...);
      default: return layer_backward<0>(p, l, args...);
    }
  }

  void forward(const Problem& p, bool dropout, const Dropout& d, Activations& a) {
    a.hidden.resize(p.block[0].targets * p.heads[0] * p.hidden[0]);
    a.logits.resize(p.block[1].targets * p.hidden[1]);
    layer_forward_any(p, 0, dropout, d, a, nullptr, a.hidden.data());
    layer_forward_any(p, 1, dropout, d, a, a.hidden.data(), a.logits.data());
  }

  // Mean cross-entropy and accuracy of each lane (per-replica: loss_and_accuracy, with libm's exp and log).
  void loss_and_accuracy(const Problem& p, const Activations& a, float* loss, double* accuracy, V* grad) {
    const index_t M = p.block[1].targets, C = p.hidden[1];
    std::vector<float> x(C);
    for (int lane = 0; lane < L; ++lane) {
      float total = 0.0f;
      index_t correct = 0;
      for (index_t i = 0; i < M; ++i) {
        for (index_t c = 0; c < C; ++c) x[c] = a.logits[i * C + c][lane];
        index_t best = 0;
        for (index_t c = 1; c < C; ++c) best = x[c] > x[best] ? c : best;
        correct += best == p.labels[i];
        float sum = 0.0f;
        for (index_t c = 0; c < C; ++c) sum += std::exp(x[c] - x[best]);
        const float log_sum = std::log(sum) + x[best];
        total += log_sum - x[p.labels[i]];
        if (grad != nullptr) {
          for (index_t c = 0; c < C; ++c) {
            const float probability = std::exp(x[c] - log_sum);
            grad[i * C + c][lane] = ((c == p.labels[i]) ? probability - 1.0f : probability) / static_cast<float>(M);
          }
        }
      }
      loss[lane] = total / static_cast<float>(M);
      accuracy[lane] = static_cast<double>(correct) / static_cast<double>(M);
    }
  }

  // Layer l's backward pass of every lane (per-replica: layer_backward and score_grads).
  template <int FC>
  void layer_backward(const Problem& p, int l, bool dropout, const Dropout& d, const Activations& a,
                      const V* grad_output, V* grad_input) {
    const Block& b = p.block[l];
    const index_t H = p.heads[l], F = FC > 0 ? FC : p.hidden[l], S = b.sources, Tn = b.targets, E = b.edges;
    const index_t fin = l == 0 ? p.f_in : p.heads[0] * p.hidden[0];
    const V scale = Lanes<L>::splat(d.scale), zero = {};
    const V slope = Lanes<L>::splat(static_cast<float>(p.negative_slope));
    const std::vector<V>& pre = a.pre[l];
    const std::vector<V>& alpha = a.alpha[l];
    const std::vector<V>& z = a.z[l];
    const std::vector<V>& g = a.g[l];
    const V* gd = dropout ? a.g_dropped[l].data() : g.data();
    grad_out.resize(Tn * F);
    grad_g.assign(S * H * F, zero);
    grad_alpha.resize(E * H);
    grad_s_target.resize(Tn * H);
    grad_s_source.assign(S * H, zero);
    if (l == 0) {  // ELU's derivative, exp(min(x, 0)), for every element at once
      slope_of.resize(Tn * H * F);
      for (index_t n = 0; n < Tn * H * F; ++n) {
        const V x = pre[n];
        slope_of[n] = zero < x ? zero : x;  // std::min(x, 0)
      }
      exp_inplace(reinterpret_cast<float*>(slope_of.data()), Tn * H * F * L);
    }
    V* dbias = G(l, 5);
    for (index_t k = 0; k < H; ++k) {
      V* dout = grad_out.data();
      if (l == 0) {
        for (index_t i = 0; i < Tn; ++i)
          for (index_t f = 0; f < F; ++f) dout[i * F + f] = grad_output[(i * H + k) * F + f] * slope_of[(k * Tn + i) * F + f];
      } else {
        for (index_t n = 0; n < Tn * F; ++n) dout[n] = grad_output[n] / static_cast<float>(H);
      }
      for (index_t f = 0; f < F; ++f) {
        V acc = zero;
        for (index_t i = 0; i < Tn; ++i) acc += dout[i * F + f];
        dbias[k * F + f] = acc;
      }
      // Aggregation.
      for (index_t i = 0; i < Tn; ++i) {
        const V* di = dout + i * F;
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
          const index_t j = b.source[e];
          const V am = dropout ? Lanes<L>::kept(a.mask_alpha[l].data() + (k * E + e) * L, scale) : zero;
          const V w = dropout ? alpha[k * E + e] * am : alpha[k * E + e];
          const V* gj = gd + (k * S + j) * F;
          V da;
          if (F == 8) {
            V prod[8];
            for (int f = 0; f < 8; ++f) prod[f] = di[f] * gj[f];
            da = Lanes<L>::sum8(prod);
          } else {
            da = zero;
            for (index_t f = 0; f < F; ++f) da += di[f] * gj[f];
          }
          grad_alpha[k * E + e] = dropout ? da * am : da;
          V* dgj = grad_g.data() + (k * S + j) * F;
          for (index_t f = 0; f < F; ++f) dgj[f] += w * di[f];
        }
      }
      if (dropout) {
        for (index_t j = 0; j < S; ++j)
          for (index_t f = 0; f < F; ++f)
            grad_g[(k * S + j) * F + f] =
                grad_g[(k * S + j) * F + f] * Lanes<L>::kept(a.mask_g[l].data() + ((k * S + j) * F + f) * L, scale);
      }
      // Softmax and LeakyReLU.
      for (index_t i = 0; i < Tn; ++i) {
        V total = zero;
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) total += grad_alpha[k * E + e] * alpha[k * E + e];
        V st = zero;
        for (index_t e = b.crow[i]; e < b.crow[i + 1]; ++e) {
          const V al = alpha[k * E + e];
          const V de = grad_alpha[k * E + e] * al - al * total;
          const V dz = z[k * E + e] > zero ? de : de * slope;
          st += dz;
          grad_s_source[k * S + b.source[e]] += dz;
        }
        grad_s_target[k * Tn + i] = st;
      }
      // The two half-scores: ∂L/∂a, ∂L/∂b, and their share of ∂L/∂g.
      const V* at = P(l, 1) + k * F;
      const V* as = P(l, 2) + k * F;
      V* dat = G(l, 1) + k * F;
      V* das = G(l, 2) + k * F;
      V bt = zero, bs = zero;
      for (index_t f = 0; f < F; ++f) dat[f] = das[f] = zero;
      for (index_t i = 0; i < Tn; ++i) {
        const V dd = grad_s_target[k * Tn + i];
        const index_t j = b.target_in_source[i];
        bt += dd;
        for (index_t f = 0; f < F; ++f) {
          dat[f] += dd * g[(k * S + j) * F + f];
          grad_g[(k * S + j) * F + f] += dd * at[f];
        }
      }
      for (index_t j = 0; j < S; ++j) {
        const V dd = grad_s_source[k * S + j];
        bs += dd;
        for (index_t f = 0; f < F; ++f) {
          das[f] += dd * g[(k * S + j) * F + f];
          grad_g[(k * S + j) * F + f] += dd * as[f];
        }
      }
      G(l, 3)[k] = bt;
      G(l, 4)[k] = bs;
    }

    // ∂L/∂W, and for layer 2 ∂L/∂h.
    if (l == 0) {
      first_layer_pass<true>(p, dropout ? a.mask_x.data() : nullptr, scale, grad_g.data());
      return;
    }
    const V* W = P(1, 0);
    V* dW = G(1, 0);
    std::fill(dW, dW + H * F * fin, zero);
    std::fill(grad_input, grad_input + S * fin, zero);
    for (index_t k = 0; k < H; ++k) {
      const V* hk = dropout ? a.input1.data() + k * S * fin : a.hidden.data();
      for (index_t j = 0; j < S; ++j) {
        const V* hj = hk + j * fin;
        const V* dgj = grad_g.data() + (k * S + j) * F;
        for (index_t f = 0; f < F; ++f) {
          V* row = dW + (k * F + f) * fin;
          for (index_t q = 0; q < fin; ++q) row[q] += hj[q] * dgj[f];
        }
        for (index_t q = 0; q < fin; ++q) {
          V dh = zero;
          for (index_t f = 0; f < F; ++f) dh += W[(k * F + f) * fin + q] * dgj[f];
          if (dropout) dh = dh * Lanes<L>::kept(a.mask_input1.data() + ((k * S + j) * fin + q) * L, scale);
          grad_input[j * fin + q] += dh;
        }
      }
    }
  }

  // Adam as AdamStep::apply, each lane at its own step.
  void adam(double lr, double beta1, double beta2, double eps, double weight_decay_) {
    const float weight_decay = static_cast<float>(weight_decay_);
    const float weight = static_cast<float>(1.0 - beta1), b2 = static_cast<float>(beta2);
    const float one_minus_beta2 = static_cast<float>(1.0 - beta2), e = static_cast<float>(eps);
    alignas(64) float step_size[L], bias_correction2_sqrt[L];
    for (int lane = 0; lane < L; ++lane) {
      const double step = static_cast<double>(stopping[lane].epoch + 1);
      step_size[lane] = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
      bias_correction2_sqrt[lane] = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
    }
    float* p = reinterpret_cast<float*>(param.data());
    float* m = reinterpret_cast<float*>(exp_avg.data());
    float* v = reinterpret_cast<float*>(exp_avg_sq.data());
    const float* gr = reinterpret_cast<const float*>(grad.data());
    for (index_t n = 0; n < numel; ++n)
      for (int lane = 0; lane < L; ++lane) {
        const index_t i = n * L + lane;
        const float g = std::fma(weight_decay, p[i], gr[i]);
        m[i] = std::fma(weight, g - m[i], m[i]);
        v[i] = v[i] * b2 + one_minus_beta2 * g * g;
        const float denom = std::sqrt(v[i]) / bias_correction2_sqrt[lane] + e;
        p[i] = p[i] + step_size[lane] * m[i] / denom;
      }
  }

  // One training step of every lane (idle lanes compute on, and are ignored).
  void train_step(const Dropout& d, double lr, double beta1, double beta2, double eps, double weight_decay) {
    const Problem& p = *train_p;
    const bool dropout = d.next != nullptr;
    forward(p, dropout, d, train_acts);
    grad_logits.resize(p.block[1].targets * p.hidden[1]);
    loss_and_accuracy(p, train_acts, loss_train, acc_train, grad_logits.data());
    grad_hidden.resize(p.block[0].targets * p.heads[0] * p.hidden[0]);
    layer_backward_any(p, 1, dropout, d, train_acts, grad_logits.data(), grad_hidden.data());
    layer_backward_any(p, 0, dropout, d, train_acts, grad_hidden.data(), nullptr);
    adam(lr, beta1, beta2, eps, weight_decay);
  }

  // The validation pass of every lane, after its training step.
  void validate() {
    const Dropout none{nullptr, nullptr, 0, 0, 1.0f};
    forward(*val_p, false, none, val_acts);
    loss_and_accuracy(*val_p, val_acts, loss_val, acc_val, nullptr);
  }
};

// What gat.fused.SeedLanes hands over: the two views, R replicas' initial parameters (read when a lane takes a
// replica) and checkpoints (written at each save), their dropout streams, Adam, early stopping, and where the
// results go.
struct LaneRunSpec {
  const Problem* train;
  const Problem* val;
  int64_t replicas;
  void* const* init;        // 12 pointers to [R, ...] float32, the parameters' order
  void* const* checkpoint;  // 12 pointers to [R, ...] float32, written when a replica saves
  Dropout drop;
  double lr, beta1, beta2, eps, weight_decay;
  int64_t max_epochs, patience;
  int64_t* epochs;          // [R]: epochs trained when patience ran out (or max_epochs)
  int64_t* best_epoch;      // [R]: the checkpoint's epoch (0: none saved)
  double* best_acc;         // [R]: the checkpoint's validation accuracy and loss
  double* best_loss;
};

// The end of replica r's epoch, in the lanes and in SeedRun alike: its figures written out, and
// gat.training.EarlyStopping's rule applied: save() when both validation figures improve, a stop when neither has
// for `patience` epochs or at max_epochs. Returns whether the replica stops.
template <typename Save>
bool end_of_epoch(const LaneRunSpec& s, const EpochOutputs& out, int r, SeedStopping& st, float train_loss,
                  double train_acc, float val_loss, double val_acc, Save save) {
  const int64_t epoch = ++st.epoch;
  out.train_loss[r] = train_loss;
  out.train_acc[r] = train_acc;
  out.val_loss[r] = val_loss;
  out.val_acc[r] = val_acc;
  out.epoch_of[r] = epoch;
  const bool better_acc = val_acc >= st.best_acc, better_loss = val_loss <= st.best_loss;
  if (better_acc && better_loss) {
    save();
    s.best_acc[r] = val_acc;
    s.best_loss[r] = val_loss;
    s.best_epoch[r] = epoch;
  }
  st.best_acc = std::max(st.best_acc, val_acc);
  st.best_loss = std::min(st.best_loss, static_cast<double>(val_loss));
  st.wait = better_acc || better_loss ? 0 : st.wait + 1;
  if (st.wait >= s.patience || epoch >= s.max_epochs) {
    s.epochs[r] = epoch;
    return true;
  }
  return false;
}

// Adds the nanoseconds from its construction to the end of its scope to `total` (two clock reads, about 40 ns).
class ScopeClock {
 public:
  explicit ScopeClock(std::atomic<int64_t>& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~ScopeClock() {
    total_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::atomic<int64_t>& total_;
  std::chrono::steady_clock::time_point start_;
};

struct LaneRunBase {
  virtual ~LaneRunBase() = default;
  virtual int64_t tick(float*, double*, float*, double*, int64_t*) = 0;
  // The time the ticks spent in validation passes so far, summed over threads (each replica's pass, or each lane
  // group's). The pass runs inside tick(), so this is how benchmarks.implementations times the validation pass that
  // `reproduce` runs apart from the training step.
  std::atomic<int64_t> validation_ns{0};
};

template <int L>
struct LaneRun : LaneRunBase {
  LaneRunSpec spec;
  std::vector<std::unique_ptr<LaneGroup<L>>> groups;
  int64_t next_replica = 0;

  LaneRun(const LaneRunSpec& s, int threads) : spec(s) {
    const int64_t wanted = std::max<int64_t>(1, std::min<int64_t>(threads, (s.replicas + L - 1) / L));
    for (int64_t i = 0; i < wanted; ++i) groups.emplace_back(new LaneGroup<L>(s.train, s.val));
  }

  // One epoch of every lane that holds a replica, after idle lanes took the next replicas. Writes each replica's
  // metrics of this epoch, and its epoch number (0: it did not train in this call). Returns how many replicas
  // trained in it (0: all have stopped).
  int64_t tick(float* train_loss, double* train_acc, float* val_loss, double* val_acc, int64_t* epoch_of) override {
    const EpochOutputs out{train_loss, train_acc, val_loss, val_acc, epoch_of};
    std::fill(epoch_of, epoch_of + spec.replicas, int64_t(0));
    std::vector<LaneGroup<L>*> busy;
    for (auto& group : groups) {
      for (int lane = 0; lane < L; ++lane)
        if (group->replica[lane] < 0 && next_replica < spec.replicas) group->load(lane, next_replica++, spec.init);
      bool any = false;
      for (int lane = 0; lane < L; ++lane) any |= group->replica[lane] >= 0;
      if (any) busy.push_back(group.get());
    }
    if (busy.empty()) return 0;
    const LaneRunSpec& s = spec;
    auto run = [this, &s](LaneGroup<L>* group) {
      group->train_step(s.drop, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay);
      ScopeClock clock(validation_ns);
      group->validate();
    };
    if (busy.size() == 1) {
      run(busy[0]);
    } else {
      std::vector<std::thread> pool;
      for (size_t i = 1; i < busy.size(); ++i) pool.emplace_back(run, busy[i]);
      run(busy[0]);
      for (auto& thread : pool) thread.join();
    }
    int64_t trained = 0;
    for (LaneGroup<L>* group : busy)
      for (int lane = 0; lane < L; ++lane) {
        const int r = group->replica[lane];
        if (r < 0) continue;
        ++trained;
        if (end_of_epoch(s, out, r, group->stopping[lane], group->loss_train[lane], group->acc_train[lane],
                         group->loss_val[lane], group->acc_val[lane], [&] { group->save(lane, s.checkpoint); }))
          group->replica[lane] = -1;
      }
    return trained;
  }
};

// Whether SeedRun keeps the paper's first W by input feature on this CPU: with an L2 cache of at least
// kFirstWByFeatureL2 bytes per core. The bytes are the same either way; the speed is not. The Intel Xeon (2 MB of L2)
// ran the native epoch in 0.92 (4 seeds) and 0.93 (16) of the time by feature; the AMD EPYC (1 MB) in 0.83-0.93 of it
// with W transposed into the workspace in every pass (python -m benchmarks.kernel_ab --native, each on its own CPU;
// reports/fused-kernel-log.md, "The first W's layout by the L2 cache"). The likely reason: by feature, each seed's
// own W must still be in L2 when x·W gathers its rows, and with 1 MB the other seeds' traffic has pushed it out,
// while the transposed copy in the workspace was written just before. An L2 of unknown size: transposed.
constexpr long kFirstWByFeatureL2 = 3 * 512 * 1024;  // between the two machines' 1 and 2 MB
bool first_w_by_feature_here() {
  static const bool by_feature = sysconf(_SC_LEVEL2_CACHE_SIZE) >= kFirstWByFeatureL2;
  return by_feature;
}

// The per-seed kernel (train_replica, the 8 heads as the 8 lanes) in the same native loop: every replica of the batch
// trains from the first call, one epoch per call, each on one thread with its own workspace, and leaves the loop when
// it stops. Parameters and Adam moments keep torch's layout [R, ...], except, where first_w_by_feature_here() says
// so, the paper's first W, kept by input feature (LayerParams::W_by_feature: no transpose in each pass, and W's Adam
// update row by row inside ∂L/∂W; Adam works element by element, so the layout changes no value). Either way a
// replica computes here exactly what gat.fused.FusedTrainer computes for it between Python's calls.
struct SeedRun : LaneRunBase {
  LaneRunSpec spec;
  bool W_by_feature;  // the paper's first layer (8 heads of 8): its W by input feature, [R, F_in, 64]
  std::vector<Buffer<float>> param, exp_avg, exp_avg_sq;  // kParams per layer, each [R, ...]
  std::vector<void*> param_of, exp_avg_of, exp_avg_sq_of;
  std::vector<SeedStopping> stopping;  // [R]
  std::vector<int> active;             // the replicas still training, ascending
  std::vector<float> loss_train, loss_val;
  std::vector<double> acc_train, acc_val;
  std::vector<std::unique_ptr<Workspace<float>>> workspaces;  // one per thread, kept between calls

  SeedRun(const LaneRunSpec& s, bool first_w_by_feature, int threads)
      : spec(s), W_by_feature(first_w_by_feature && s.train->heads[0] == 8 && s.train->hidden[0] == 8),
        stopping(s.replicas),
        loss_train(s.replicas), loss_val(s.replicas), acc_train(s.replicas), acc_val(s.replicas) {
    for (int l = 0; l < 2; ++l)
      for (int i = 0; i < kParams; ++i) {
        const index_t n = param_numel(*s.train, l, i) * s.replicas;
        const float* init = static_cast<const float*>(s.init[l * kParams + i]);
        param.emplace_back(init, init + n);
        exp_avg.emplace_back(n, 0.0f);
        exp_avg_sq.emplace_back(n, 0.0f);
      }
    const index_t fin = s.train->f_in, numel = param_numel(*s.train, 0, 0);
    Buffer<float> by_feature;
    for (int64_t r = 0; W_by_feature && r < s.replicas; ++r) {  // [H, F_in, 8] -> [F_in, H·8], replica by replica
      transpose_heads(param[0].data() + r * numel, 8, fin, 8, by_feature);
      std::copy(by_feature.begin(), by_feature.end(), param[0].begin() + r * numel);
    }
    for (int w = 0; w < 2 * kParams; ++w) {
      param_of.push_back(param[w].data());
      exp_avg_of.push_back(exp_avg[w].data());
      exp_avg_sq_of.push_back(exp_avg_sq[w].data());
    }
    for (int r = 0; r < s.replicas; ++r) active.push_back(r);
    const int64_t used = std::max<int64_t>(1, std::min<int64_t>(threads, s.replicas));
    for (int64_t t = 0; t < used; ++t) workspaces.emplace_back(new Workspace<float>());
  }

  // Replica r's training step under dropout, with Adam at its own step number.
  void step(int r, Workspace<float>& ws) {
    const Adam adam{spec.lr, spec.beta1, spec.beta2, spec.eps, spec.weight_decay,
                    static_cast<double>(stopping[r].epoch + 1)};
    train_replica<float>(*spec.train, r, param_of.data(), exp_avg_of.data(), exp_avg_sq_of.data(), &adam, spec.drop,
                         loss_train.data(), acc_train.data(), nullptr, nullptr, ws, W_by_feature);
  }

  // Replica r's validation pass.
  void validate(int r, Workspace<float>& ws) {
    const Dropout none{nullptr, nullptr, 0, 0, 1.0f};
    forward<float>(*spec.val, param_of.data(), r, false, none, nullptr, ws, W_by_feature);
    loss_and_accuracy<float>(*spec.val, ws.logits.data(), loss_val.data() + r, acc_val.data() + r, nullptr);
  }

  void save(int r) {
    for (int w = 0; w < 2 * kParams; ++w) {
      const index_t n = param_numel(*spec.train, w / kParams, w % kParams);
      const float* from = param[w].data() + r * n;
      float* to = static_cast<float*>(spec.checkpoint[w]) + r * n;
      if (w == 0 && W_by_feature) {  // [F_in, H·8] back to torch's [H, F_in, 8]
        const index_t fin = spec.train->f_in;
        for (index_t q = 0; q < fin; ++q)
          for (int k = 0; k < 8; ++k) std::copy(from + q * 64 + k * 8, from + q * 64 + k * 8 + 8, to + (k * fin + q) * 8);
      } else {
        std::copy(from, from + n, to);
      }
    }
  }

  int64_t tick(float* train_loss, double* train_acc, float* val_loss, double* val_acc, int64_t* epoch_of) override {
    const EpochOutputs out{train_loss, train_acc, val_loss, val_acc, epoch_of};
    std::fill(epoch_of, epoch_of + spec.replicas, int64_t(0));
    if (active.empty()) return 0;
    // The training steps first, then the validation passes, as FusedTrainer's calls: each view's indices stay in
    // cache for all the replicas (alternating the two views made an epoch measurably slower). The threads take the
    // active replicas in turn; which thread trains a replica changes nothing in its bytes.
    std::atomic<bool> failed{false};
    const size_t threads = std::min(workspaces.size(), active.size());
    auto over_active = [&](auto body) {
      std::atomic<size_t> next{0};
      auto work = [&](Workspace<float>* ws) {
        try {
          for (size_t n = next++; n < active.size(); n = next++) body(active[n], *ws);
        } catch (const std::exception&) {
          failed = true;
        }
      };
      std::vector<std::thread> pool;
      for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, workspaces[t].get());
      work(workspaces[0].get());
      for (auto& thread : pool) thread.join();
    };
    over_active([this](int r, Workspace<float>& ws) { step(r, ws); });
    over_active([this](int r, Workspace<float>& ws) {
      ScopeClock clock(validation_ns);
      validate(r, ws);
    });
    if (failed) throw std::runtime_error("a replica's epoch failed");
    const int64_t trained = static_cast<int64_t>(active.size());
    std::vector<int> going_on;
    for (int r : active)
      if (!end_of_epoch(spec, out, r, stopping[r], loss_train[r], acc_train[r], loss_val[r], acc_val[r],
                        [&] { save(r); }))
        going_on.push_back(r);
    active.swap(going_on);
    return trained;
  }
};

}  // namespace

extern "C" {

#ifdef GAT_PHASE_TIMERS
// The phase timers (benchmarks.kernel_phases): how many, their names, their nanoseconds so far, and a reset.
int gat_phase_count() { return kPhases; }
const char* gat_phase_name(int phase) { return kPhaseNames[phase]; }
int64_t gat_phase_ns(int phase) { return phase_ns[phase].load(); }
void gat_phase_reset() {
  for (auto& ns : phase_ns) ns = 0;
}
#endif

// The layout of the structures above, for gat/fused.py to check its ctypes mirrors against.
int64_t gat_abi_sizes(int which) {
  switch (which) {
    case 0: return sizeof(Problem);
    case 1: return sizeof(Dropout);
    case 2: return sizeof(Adam);
    case 3: return sizeof(LaneRunSpec);
    default: return -1;
  }
}

// `count` words of replica r's stream into `out`, as the masks draw them (tests/test_fused.py checks them against
// numpy's); 1 if they came from the inline PCG64 step, 0 if from numpy's next_uint64 call by call.
int gat_draw_words(const Dropout* drop, int64_t r, int64_t count, uint64_t* out) {
  return draw_words(*drop, drop->states[r], count, reinterpret_cast<uint8_t*>(out)) ? 1 : 0;
}

// How many of the floats whose bits are first, first + 1, ..., first + count - 1 (count a multiple of 16) get other
// bytes from exp_approx in vector lanes, 16 or 8, than from exp_inplace (tests/test_fused.py: every float).
int64_t gat_exp_lanes_mismatches(uint32_t first, int64_t count) {
  constexpr int kBlock = 4096;
  alignas(64) uint32_t bits[kBlock], want[kBlock], wide[kBlock], narrow[kBlock];
  int64_t wrong = 0;
  for (int64_t at = 0; at < count; at += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, count - at));
    for (int k = 0; k < n; ++k) bits[k] = first + static_cast<uint32_t>(at + k);
    std::memcpy(want, bits, n * sizeof(float));
    exp_inplace(reinterpret_cast<float*>(want), n);
    for (int k = 0; k < n; k += 16) {
      store16(reinterpret_cast<float*>(wide + k), exp_approx(load16(reinterpret_cast<const float*>(bits + k))));
      for (int h = 0; h < 16; h += 8)
        store8(reinterpret_cast<float*>(narrow + k + h), exp_approx(load8(reinterpret_cast<const float*>(bits + k + h))));
    }
    for (int k = 0; k < n; ++k) wrong += (wide[k] != want[k]) + (narrow[k] != want[k]);
  }
  return wrong;
}

// The masks of `count` elements from replica r's stream, as the kernel draws them (tests/test_fused.py checks them
// against gat/dropout.py's), into `out`: kind 0 as floats, 0 or the scale [count]; 1 as bytes, 0xFF kept and 0
// dropped [count rounded up to 8]; 2 as bits (draw_kept_bits) [count / 64 + 2 words]; 3, for 8 heads of `count`
// elements each (8 count drawn), as a byte per element whose bit k is head k's (heads_of_bits) [count]. Returns 0,
// or 1 for an unknown kind.
int gat_draw_mask(const Dropout* drop, int64_t r, int64_t count, int kind, void* out) {
  std::vector<index_t> ties;
  std::vector<uint64_t> bits;
  void* state = drop->states[r];
  switch (kind) {
    case 0: draw_mask(*drop, state, count, static_cast<float*>(out), ties); return 0;
    case 1: draw_kept_bytes(*drop, state, count, static_cast<uint8_t*>(out), ties); return 0;
    case 2:
      draw_kept_bits(*drop, state, count, bits, ties);
      std::copy(bits.begin(), bits.end(), static_cast<uint64_t*>(out));
      return 0;
    case 3:
      draw_kept_bits(*drop, state, 8 * count, bits, ties);
      heads_of_bits(bits.data(), count, static_cast<uint8_t*>(out));
      return 0;
    default: return 1;
  }
}

// One training step of R replicas: float32 parameters updated in place by Adam (when `adam` is not null);
// loss [R] and accuracy [R] before the step, under dropout. `logits_out` [R, T2, C] and `grads_out`
// (12 pointers to [R, ...] buffers, the parameters' order) are for tests, and may be null. Returns 0, or 1 on failure.
int gat_train_step_f32(const Problem* p, int64_t R, void* const* params, void* const* exp_avg,
                       void* const* exp_avg_sq, const Adam* adam, const Dropout* drop, float* loss,
                       double* accuracy, float* logits_out, void* const* grads_out, int threads) {
  return train_step<float>(p, R, params, exp_avg, exp_avg_sq, adam, drop, loss, accuracy, logits_out, grads_out,
                           threads);
}

// The same forward and backward pass in float64 (no optimiser step), for the double-precision gradient check.
int gat_train_step_f64(const Problem* p, int64_t R, void* const* params, const Dropout* drop, double* loss,
                       double* accuracy, double* logits_out, void* const* grads_out, int threads) {
  return train_step<double>(p, R, params, nullptr, nullptr, nullptr, drop, loss, accuracy, logits_out, grads_out,
                            threads);
}

// The forward pass without dropout, and the loss and accuracy over the last block's targets.
int gat_evaluate_f32(const Problem* p, int64_t R, void* const* params, float* loss, double* accuracy,
                     float* logits_out, int threads) {
  return evaluate<float>(p, R, params, loss, accuracy, logits_out, threads);
}

int gat_evaluate_f64(const Problem* p, int64_t R, void* const* params, double* loss, double* accuracy,
                     double* logits_out, int threads) {
  return evaluate<double>(p, R, params, loss, accuracy, logits_out, threads);
}

// A native run of `spec->replicas` replicas: seeds as lanes in groups of `lanes` (4, 8 or 16) lanes, one group per
// thread (up to `threads`), or with `lanes` 1 the per-seed kernel, replicas shared among the threads (SeedRun).
// Returns null on failure.
void* gat_lanes_new(const LaneRunSpec* spec, int lanes, int threads) {
  try {
    switch (lanes) {
      case 1: return new SeedRun(*spec, first_w_by_feature_here(), threads);
      case 4: return new LaneRun<4>(*spec, threads);
      case 8: return new LaneRun<8>(*spec, threads);
      case 16: return new LaneRun<16>(*spec, threads);
      default: return nullptr;
    }
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The per-seed native run (gat_lanes_new's `lanes` 1) with the first W's layout chosen by the caller: by input
// feature (1) or transposed in every pass (0); gat_lanes_new chooses it by this CPU's L2 cache. Null on failure.
void* gat_seeds_new(const LaneRunSpec* spec, int first_w_by_feature, int threads) {
  try {
    return new SeedRun(*spec, first_w_by_feature != 0, threads);
  } catch (const std::exception&) {
    return nullptr;
  }
}

// Whether the per-seed native run keeps the first W by input feature on this CPU (first_w_by_feature_here).
int gat_first_w_by_feature() { return first_w_by_feature_here() ? 1 : 0; }

// One epoch of every replica in a lane (see LaneRun::tick); -1 on failure.
int64_t gat_lanes_tick(void* run, float* train_loss, double* train_acc, float* val_loss, double* val_acc,
                       int64_t* epoch_of) {
  try {
    return static_cast<LaneRunBase*>(run)->tick(train_loss, train_acc, val_loss, val_acc, epoch_of);
  } catch (const std::exception&) {
    return -1;
  }
}

// Nanoseconds the run's ticks spent in validation passes so far, summed over threads (LaneRunBase::validation_ns).
int64_t gat_lanes_validation_ns(void* run) { return static_cast<LaneRunBase*>(run)->validation_ns.load(); }

void gat_lanes_free(void* run) { delete static_cast<LaneRunBase*>(run); }

}  // extern "C"
