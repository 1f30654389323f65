// Attention of a short pass (a decode step, a verification) over a long bf16 KV cache, split over
// blocks of keys across threads and merged by log-sum-exp (flash-decoding).
//
// query [H, T, D] bf16, keys / values [H_kv, S, D] bf16 (rows contiguous, any head stride: a view
// of a longer slot buffer) -> out [H, T, D] bf16. The H / H_kv query heads of a KV head and the T
// tokens of the pass are the R = G * T rows (g, t) that meet each key block once: each key and
// value is read from memory once per pass. With `causal`, token t sees keys up to S - T + t (the
// pass's own tokens are the last T keys). decode_attention_tree takes a token tree's pass: token t
// sees every key before the tree's and, of the last M, those a [T, M] mask allows (its ancestors).
//
// On a CPU without AVX512-BF16 but with AVX2 and FMA, each block's work is attention_avx2.h's (the
// keys and values widened to float32 in registers); the split, the merge and the tree's keys are
// this file's either way. Per block of 256 keys, in bf16 products with float32 accumulation (AVX512-BF16):
// - values: each two keys' rows interleaved into (key, key + 1) pairs, in registers as the sums use
//   them where the rows fit in one group of accumulators (a decode step), else once per block into
//   scratch (heads up to 64 dimensions), or 32 dimensions at a time as the sums use them (128);
// - scores: 16 keys at a time transposed into pairs of head dimensions (pair p of key j in lane j),
//   shared by every row; a row's 16 scores are one chain of products over the even pairs and one
//   over the odd pairs against its own query pair, broadcast (passes of 16 rows or more transpose
//   two groups of 16 keys and score both against each broadcast: the same chains, fewer loads);
// - softmax in float32 in base 2 (exp2_16), the weights rounded to bf16 (as flash attention's P) and
//   summed as rounded;
// - each row's output: its weight pairs times the value pairs, 16 dimensions per accumulator.
// With AMX (head sizes 32, 64, 128) every pass takes its products from tiles, per chunk of up to
// 16 rows, in one of two ways fixed by the model (takes_tiles):
// - models whose steps have many rows per KV head (Qwen2.5's 6 and 7 query heads): the block's keys
//   and values paired once into the thread's scratch, shared by the chunks; a [rows, 32 dimensions]
//   tile of queries times 16 key pairs, a [rows, 32 keys] tile of weights times 16 value pairs;
// - the others (SmolLM2's 3): nothing paired, both operands from the cache's own rows: 16 keys'
//   rows times the chunk's query pairs (key_tile_scores), and 16 values' rows times the weights
//   spread with zeros, the even and the odd dimensions in two products (value_tiles_from_cache).
// A verification pass's arithmetic then grows little with its tokens (with AVX-512 it grows with
// the pass's rows: over 32K keys of Qwen2.5-1.5B's shape, 8 tokens cost 5-6 times one).
// A key's score and a row's weighted sum take the same operations in the same order whatever the
// pass's width and however many keys follow, so a verification pass equals the decode steps it
// replaces bit for bit. A tree pass does too: the blocks before the tree's are shared, and from the
// block the tree's keys begin in, each token reads a copy of just the keys its decode step would
// (keys that a mask merely zeroed would pair and fill blocks otherwise). While a block is read, the
// next block's rows are asked for (into L2): a thread's blocks follow each other in memory. The asks
// are spread through the work that reads the block (the next block's 16 keys once a group of 16 is
// loaded, or a few lines a step of a wide pass's scores; two value rows per step of the weighted
// sums), not issued in bursts of a block: a burst outruns the core's outstanding-miss slots, and a
// one-token pass over 32K keys of head size 128 then read its KV at 12-16 GB/s while its arithmetic
// alone ran at 32. Blocks from tiles of the
// cache's rows pace their asks by the whole block's work, its softmax and its chunks of rows
// included (NextBlockAsks), so a pass of many rows reads memory while it computes.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "products.h"
#include "tiles.h"
#include "vector_math.h"

namespace {

#if defined(CASCADE_KERNELS)

constexpr int64_t kBlockKeys = 256;  // keys per task
constexpr int64_t kMaxDim = 128;  // the largest head size taken
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct Operands {
  const at::BFloat16* keys;
  const at::BFloat16* values;
  int64_t key_stride, value_stride;  // elements between consecutive keys (values)
  float scale;
};

template <int D>
constexpr int kRowLines = (2 * D + 63) / 64;  // cache lines a bf16 row of D values spans

// Ask for a bf16 row of D values (whole cache lines) ahead of its use; past the cache's end the
// hint is dropped (prefetches never fault).
template <int D, int Hint>
inline void prefetch_row(const at::BFloat16* row) {
  for (int line = 0; line < kRowLines<D>; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * line, (_mm_hint)Hint);
  }
}

// run(std::integral_constant<int, count>) for a count in [1, Max] known only at run time (0: nothing).
template <int Max, typename Run>
inline void with_count(int64_t count, Run run) {
  if constexpr (Max > 0) {
    if (count == Max) return run(std::integral_constant<int, Max>{});
    with_count<Max - 1>(count, run);
  }
}

// How many of the block's keys [k0, k1) a row whose last visible key is `last` sees.
inline int64_t visible_keys(int32_t last, int64_t k0, int64_t k1) {
  return std::clamp<int64_t>(last + 1 - k0, 0, k1 - k0);
}

// run(first row, rows as a compile-time constant) over rows [0, rows): groups of Group, then the last
// rows % Group together, so each group's sums can stay in registers.
template <int Group, typename Run>
inline void in_row_groups(int64_t rows, Run run) {
  int64_t r = 0;
  for (; r + Group <= rows; r += Group) run(r, std::integral_constant<int, Group>{});
  with_count<Group - 1>(rows - r, [&](auto count) { run(r, count); });
}

#endif

#if defined(CASCADE_AVX512)

using cascade_vector::exp2_16;

constexpr int64_t kChunkRows = 16;  // rows of an AMX tile: the rows of a pass a tile takes at once
constexpr int64_t kPairInputs = 32;  // bf16 inputs of one AMX tile row or one 512-bit register
constexpr int64_t kGroupKeys = 16;  // keys scored together, one per float32 lane
// Query rows scored together: 8 chains of products in flight. On a 2-core Zen 5, 8 rows (16 chains)
// made passes whose keys were in cache faster (over 4K keys a SmolLM2 8-token pass 1.035x, a
// Qwen2.5-1.5B step 1.095x) but a SmolLM2 8-token pass over 32K keys from memory 1.08x slower.
constexpr int kScoreRows = 4;
// Passes of this many rows or more score two groups of keys at a time (scores_by_two_groups): on a
// 2-core Zen 5, 16-48 rows 1.02-1.11x faster, 9-12 rows 0.95-0.98x where their keys were in cache.
constexpr int64_t kTwoGroupRows = 4 * kScoreRows;

// acc + pairs . (*pair in every lane): an AVX512-BF16 product whose second operand is a bf16 pair
// broadcast from memory (GCC does not fold the broadcast into the instruction by itself).
inline __m512 dot_broadcast(__m512 acc, __m512bh pairs, const int32_t* pair) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(pairs), "m"(*pair));
  return acc;
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << std::max<int64_t>(count, 0)) - 1);
}

// 16 rows of 16 32-bit values -> 16 columns in place: afterwards v[p] holds value p of row j in lane j.
// Always inlined: scoring two groups of keys at a time, GCC called it, 8% of the scores' time.
__attribute__((always_inline)) inline void transpose16(__m512i (&v)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i + 1 interleaved
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // v[4a + e], per 128-bit lane L: value 4L + e of rows 4a .. 4a + 3
    v[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    v[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    v[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    v[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // 128-bit lanes 0, 2 and 1, 3 of rows 0-7 and of rows 8-15
    t[e] = _mm512_shuffle_i32x4(v[e], v[4 + e], 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(v[e], v[4 + e], 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(v[8 + e], v[12 + e], 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(v[8 + e], v[12 + e], 0xDD);
  }
  for (int e = 0; e < 4; ++e) {  // value 4L + e: 128-bit lane L of the four row groups
    v[e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0x88);
    v[8 + e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0xDD);
    v[4 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0x88);
    v[12 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0xDD);
  }
}

// The registers a group of 16 transposed keys takes: max(D / 2, 16) (a transposition of 8 pairs takes 16).
template <int D>
constexpr int kPairRegisters = std::max(D / 2, 16);

// Keys [k, k + 16) as pairs of head dimensions: pairs[p] holds dimensions 2p, 2p + 1 of key k + j in
// lane j (zeros for keys at or past k1); `pairs` has room for kPairRegisters<D> registers. With `Ask`,
// each 64 bytes loaded asks for the same 64 bytes of the key a block further on.
template <int D, bool Ask = true>
inline void transposed_keys(const Operands& op, int64_t k, int64_t k1, __m512i* pairs) {
  constexpr int kPairs = D / 2;
  const int64_t count = std::min(kGroupKeys, k1 - k);
  for (int p0 = 0; p0 < kPairs; p0 += 16) {
    const __mmask16 lanes = first_lanes(kPairs - p0);  // 8 pairs for head size 16
    // transposed where it lands: copied from a local array, the 16 rows went through memcpy (a
    // quarter of a one-token pass's time)
    __m512i(&rows)[16] = *reinterpret_cast<__m512i(*)[16]>(pairs + p0);
    for (int j = 0; j < 16; ++j) {
      rows[j] = j < count ? _mm512_maskz_loadu_epi32(lanes, op.keys + (k + j) * op.key_stride + 2 * p0)
                          : _mm512_setzero_si512();
      if constexpr (Ask) {
        _mm_prefetch(reinterpret_cast<const char*>(op.keys + (k + kBlockKeys + j) * op.key_stride + 2 * p0),
                     _MM_HINT_T1);
      }
    }
    transpose16(rows);
  }
}

// Scores of Rows query rows (pairs [Rows, D / 2]) against Groups groups of 16 transposed keys (group g
// from pairs + g * kPairRegisters<D>) -> scores[r * kBlockKeys + 16 g + j]: per row and group, the
// products over the even pairs and over the odd pairs in two chains, added last; `ask()` once a step.
// Two vector loads a cycle bound these products on a Zen 5: one group loads a query pair for each
// product, two share it (a wide pass's scores 1.3x faster in a scratch loop).
template <int D, int Rows, int Groups, typename Ask>
inline void group_scores(const int32_t* query_pairs, const __m512i* pairs, float* scores, Ask ask) {
  constexpr int kPairs = D / 2;
  __m512 even[Groups][Rows], odd[Groups][Rows];
  for (int g = 0; g < Groups; ++g) {
    for (int r = 0; r < Rows; ++r) even[g][r] = odd[g][r] = _mm512_setzero_ps();
  }
  for (int p = 0; p < kPairs; p += 2) {
    ask();
    for (int r = 0; r < Rows; ++r) {
      const int32_t* pair = query_pairs + r * kPairs + p;
      if constexpr (Groups == 1) {
        even[0][r] = dot_broadcast(even[0][r], (__m512bh)pairs[p], pair);
        odd[0][r] = dot_broadcast(odd[0][r], (__m512bh)pairs[p + 1], pair + 1);
      } else {
        const __m512bh even_pair = (__m512bh)_mm512_set1_epi32(pair[0]);
        const __m512bh odd_pair = (__m512bh)_mm512_set1_epi32(pair[1]);
        for (int g = 0; g < Groups; ++g) {
          const __m512i* group = pairs + g * kPairRegisters<D>;
          even[g][r] = _mm512_dpbf16_ps(even[g][r], (__m512bh)group[p], even_pair);
          odd[g][r] = _mm512_dpbf16_ps(odd[g][r], (__m512bh)group[p + 1], odd_pair);
        }
      }
    }
  }
  for (int g = 0; g < Groups; ++g) {
    for (int r = 0; r < Rows; ++r) {
      _mm512_storeu_ps(scores + r * kBlockKeys + g * kGroupKeys, _mm512_add_ps(even[g][r], odd[g][r]));
    }
  }
}

// Asks for line i of the keys from `first` on a block further on (key first + i / L, its line i % L, L
// = kRowLines<D> lines a key).
template <int D>
inline void ask_key_line(const Operands& op, int64_t first, int i) {
  constexpr int kLines = kRowLines<D>;
  const at::BFloat16* line = op.keys + (first + kBlockKeys + i / kLines) * op.key_stride + i % kLines * 32;
  _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
}

// Scores [rows, kBlockKeys] of keys [k0, k1), 16 at a time, against `rows` query rows (pairs [rows,
// D / 2]), unscaled. Once a group's keys are loaded, the same keys of the next block are asked for,
// all together: asked line by line as the keys loaded, a one-token SmolLM2 pass over 32K keys from
// memory took 1.13-1.21x the time (over 4K keys in cache 0.89x; 2-core Zen 5).
template <int D>
void scores_by_group(const Operands& op, const int32_t* query_pairs, int64_t rows, int64_t k0, int64_t k1,
                     float* scores) {
  constexpr int kPairs = D / 2, kLines = kGroupKeys * kRowLines<D>;
  alignas(64) __m512i pairs[kPairRegisters<D>];
  for (int64_t k = k0; k < k1; k += kGroupKeys) {
    transposed_keys<D, false>(op, k, k1, pairs);
    // GCC keeps this loop rolled; written as prefetch_row per key it unrolls into 32 asks back to back,
    // and the same pass took 1.35-1.5x the time
    for (int i = 0; i < kLines; ++i) ask_key_line<D>(op, k, i);
    float* out = scores + (k - k0);
    in_row_groups<kScoreRows>(rows, [&](int64_t r, auto count) {
      group_scores<D, decltype(count)::value, 1>(query_pairs + r * kPairs, pairs, out + r * kBlockKeys, [] {});
    });
  }
}

// scores_by_group's scores, two groups of 16 keys at a time (group_scores), for passes of at least
// kTwoGroupRows rows. The asks for the next block's 32 keys are spread over the steps of every row
// group: asked line by line as the keys loaded, an 8-token SmolLM2 pass over 32K keys took 1.07x the
// time.
template <int D>
void scores_by_two_groups(const Operands& op, const int32_t* query_pairs, int64_t rows, int64_t k0, int64_t k1,
                          float* scores) {
  constexpr int kPairs = D / 2, kLines = 2 * kGroupKeys * kRowLines<D>;
  const int64_t steps = (rows + kScoreRows - 1) / kScoreRows * (kPairs / 2);
  const int per_step = (int)((kLines + steps - 1) / steps);
  alignas(64) __m512i pairs[2 * kPairRegisters<D>];
  for (int64_t k = k0; k < k1; k += 2 * kGroupKeys) {
    const bool two = k + kGroupKeys < k1;
    transposed_keys<D, false>(op, k, k1, pairs);
    if (two) transposed_keys<D, false>(op, k + kGroupKeys, k1, pairs + kPairRegisters<D>);
    int asked = 0;
    const auto ask = [&] {
      for (int n = 0; n < per_step && asked < kLines; ++n) ask_key_line<D>(op, k, asked++);
    };
    float* out = scores + (k - k0);
    in_row_groups<kScoreRows>(rows, [&](int64_t r, auto count) {
      constexpr int kRows = decltype(count)::value;
      if (two) return group_scores<D, kRows, 2>(query_pairs + r * kPairs, pairs, out + r * kBlockKeys, ask);
      group_scores<D, kRows, 1>(query_pairs + r * kPairs, pairs, out + r * kBlockKeys, ask);
    });
  }
}

// Scores [rows, kBlockKeys] of keys [k0, k1) against `rows` query rows (pairs [rows, D / 2]), unscaled.
template <int D>
void vector_scores(const Operands& op, const int32_t* query_pairs, int64_t rows, int64_t k0, int64_t k1,
                   float* scores) {
  if (rows >= kTwoGroupRows) return scores_by_two_groups<D>(op, query_pairs, rows, k0, k1, scores);
  scores_by_group<D>(op, query_pairs, rows, k0, k1, scores);
}

// Each row's largest score among the keys it sees (scores [rows, kBlockKeys]) -> largest[r], -inf for
// a row that sees none; four chains of maxima a row (a maximum is the same in any order).
inline void row_maxima(const float* scores, const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1,
                       float* largest) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = scores + r * kBlockKeys;
    const int64_t visible = visible_keys(last_visible[r], k0, k1);
    __m512 best[4];
    for (auto& b : best) b = _mm512_set1_ps(kNegativeInfinity);
    int64_t k = 0;
    for (; k + 64 <= visible; k += 64) {
      for (int c = 0; c < 4; ++c) best[c] = _mm512_max_ps(best[c], _mm512_loadu_ps(row + k + 16 * c));
    }
    for (; k < visible; k += 16) {
      const __mmask16 lanes = first_lanes(visible - k);
      best[0] = _mm512_mask_max_ps(best[0], lanes, best[0], _mm512_maskz_loadu_ps(lanes, row + k));
    }
    const __m512 halves = _mm512_max_ps(_mm512_max_ps(best[0], best[1]), _mm512_max_ps(best[2], best[3]));
    largest[r] = _mm512_reduce_max_ps(halves);
  }
}

// Softmax weights of a block, row by row (keys in the vector lanes), rounded to bf16: a row's keys past
// its last visible one get weight 0; each 32 keys' weights, float32 as rounded, go to store(r, k, low,
// high) (keys k to k + 15, k + 16 to k + 31) -> the rows' block maxima (scaled scores; -inf for a row
// that sees no key here) and the sums of the rounded weights. A weight is 2^(s c - m c) for score s,
// the row's largest score m and c = scale x log2 e (exp2_16; the scale is positive, so the largest
// scaled score is the largest score scaled). Keys a row cannot see add exact zeros, so a row's figures
// are those of a pass that ends at its last visible key.
template <typename Store>
void block_weights(const Operands& op, const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1,
                   const float* scores, float* maximum, float* total, Store store) {
  const float base_two = op.scale * 1.44269504088896341f;  // scores -> exponents of 2
  // Every row's largest score first, then the rows' weights one after another with nothing between
  // them: an 8-token SmolLM2 pass 1.01-1.02x faster over 32K keys, 1.03x over 4K keys in cache, than
  // one row's maximum and weights after another's (2-core Zen 5).
  row_maxima(scores, last_visible, rows, k0, k1, maximum);  // unscaled until each row's weights are done
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = scores + r * kBlockKeys;
    const int64_t keys = k1 - k0, visible = visible_keys(last_visible[r], k0, k1);
    const float largest = maximum[r];
    const __m512 slope = _mm512_set1_ps(base_two), offset = _mm512_set1_ps(-largest * base_two);
    const auto rounded_weights = [&](int64_t k) {  // keys [k, k + 16) -> float32 weights, rounded to bf16
      const __mmask16 seen = first_lanes(visible - k);
      const __m512 exponent = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(seen, row + k), slope, offset);
      return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(exp2_16(seen, exponent)));
    };
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < keys; k += 32) {
      const __m512 low = rounded_weights(k), high = rounded_weights(k + 16);
      store(r, k, low, high);
      sum = _mm512_add_ps(_mm512_add_ps(sum, low), high);
    }
    maximum[r] = largest * op.scale;
    total[r] = _mm512_reduce_add_ps(sum);
  }
}

// block_weights' store for weights [rows, kBlockKeys] bf16.
inline auto weights_into(at::BFloat16* weights) {
  return [weights](int64_t r, int64_t k, __m512 low, __m512 high) {
    _mm512_storeu_si512(weights + r * kBlockKeys + k, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  };
}

// 32 values of a row from `source`, zeros past the head size D (16, 32, 64 or 128), in plain loads: GCC
// takes a masked load for one that may read any memory, so the sums a loop feeds from masked loads
// were stored to the stack at every key pair (a SmolLM2 step's attention ran 1.2x slower with them).
template <int D>
__attribute__((always_inline)) inline __m512i value_chunk(const at::BFloat16* source) {
  static_assert(D % 32 == 0 || D == 16, "head sizes 16, 32, 64 or 128");
  if constexpr (D == 16) return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
  return _mm512_loadu_si512(source);
}

// Keys k, k + 1 of the values as key pairs in registers: for each 32 dimensions c, the two rows
// interleaved (unpacklo, unpackhi: dimensions 8L + i and 8L + 4 + i of 128-bit lane L, each with
// both keys) into pair[2c], pair[2c + 1]; zeros stand for a key at or past k1. With `Ahead`, the
// same rows of the next block are asked for (into L2) on the way.
template <int D, bool Ahead>
__attribute__((always_inline)) inline void value_pair(const Operands& op, int64_t k, int64_t k1, __m512i* pair) {
  constexpr int kBlocks = (D + 31) / 32;
  if constexpr (Ahead) {
    for (int j = 0; j < 2; ++j) prefetch_row<D, _MM_HINT_T1>(op.values + (k + kBlockKeys + j) * op.value_stride);
  }
  const at::BFloat16* first = op.values + k * op.value_stride;
  const at::BFloat16* second = first + op.value_stride;
  const bool both = k + 1 < k1;
  for (int c = 0; c < kBlocks; ++c) {
    const __m512i a = value_chunk<D>(first + 32 * c);
    const __m512i b = both ? value_chunk<D>(second + 32 * c) : _mm512_setzero_si512();
    pair[2 * c] = _mm512_unpacklo_epi16(a, b);
    pair[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
  }
}

// Values [k0, k1) as key pairs into out[(m * blocks + c) * 2 + half] (pair m: keys k0 + 2m, k0 + 2m + 1),
// for passes whose rows take them in several groups or from tiles; with `Ahead`, the next block's
// rows are asked for on the way.
template <int D, bool Ahead>
void paired_values(const Operands& op, int64_t k0, int64_t k1, __m512i* out) {
  constexpr int kBlocks = (D + 31) / 32;
  for (int64_t k = k0; k < k1; k += 2) value_pair<D, Ahead>(op, k, k1, out + (k - k0) / 2 * 2 * kBlocks);
}

// A row's two sums of the 32 dimensions from 32c (the low and high halves of their key pairs, as
// value_pair interleaves them) -> those dimensions in order, float32, into target (the row's D).
template <int D>
inline void store_chunk(__m512 low, __m512 high, int c, float* target) {
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_mask_storeu_ps(target + 32 * c, first_lanes(D - 32 * c), _mm512_permutex2var_ps(low, first_half, high));
  _mm512_mask_storeu_ps(target + 32 * c + 16, first_lanes(D - 32 * c - 16),
                        _mm512_permutex2var_ps(low, second_half, high));
}

// A row's sums acc[2 * blocks] -> its D dimensions in order, float32, into target.
template <int D>
inline void store_dimensions(const __m512* acc, float* target) {
  for (int c = 0; c < (D + 31) / 32; ++c) store_chunk<D>(acc[2 * c], acc[2 * c + 1], c, target);
}

// out [Rows, D] = weights x values for Rows rows (weight pairs [rows, kBlockKeys / 2]): `pair(m, value)`
// puts key pair m into value[2 * blocks]; each pair meets the Rows rows at once, whose sums stay in
// registers.
template <int D, int Rows, typename Pair>
void weighted_values(const int32_t* weight_pairs, int64_t num_pairs, float* out, Pair pair) {
  constexpr int kBlocks = (D + 31) / 32;
  __m512 acc[Rows][2 * kBlocks];
  for (int r = 0; r < Rows; ++r) {
    for (int v = 0; v < 2 * kBlocks; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t m = 0; m < num_pairs; ++m) {
    __m512i value[2 * kBlocks];
    pair(m, value);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(weight_pairs[r * (kBlockKeys / 2) + m]);
      for (int v = 0; v < 2 * kBlocks; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)value[v], weight);
    }
  }
  for (int r = 0; r < Rows; ++r) store_dimensions<D>(acc[r], out + r * D);
}

// Rows of a pass that keep their sums in registers together: 16 accumulators.
template <int D>
constexpr int kValueRows = 8 / ((D + 31) / 32);

// Whether a pass whose KV heads each serve `group` query heads takes its scores and weighted sums
// from AMX tiles over keys and values paired in scratch (tile_block): for head sizes tiles take,
// where a one-token step's rows are more than the AVX-512 sums keep in registers (kValueRows), so
// the pairing serves many rows (Qwen2.5's 6 and 7 query heads per KV head). Fewer rows (SmolLM2's 3)
// take tiles of the cache's own rows instead (key_tile_block): over 8K-32K keys of SmolLM2's shape
// from memory, its steps took 0.70-0.74x and its 8-token passes 0.65-0.68x the time they took with
// AVX-512 value sums, while Qwen2.5-1.5B's 6-8-token passes took 1.05-1.07x tile_block's (its steps
// 0.9x) on a Xeon with AMX (2026-12-06).
// The choice depends on the model alone, never on the pass's width, so every pass and the steps it
// replaces take the same path and agree bit for bit.
template <int D>
bool takes_tiles(int64_t group) {
#if defined(__AMX_BF16__)
  return cascade_tiles::use_amx && D % kPairInputs == 0 && group > kValueRows<D>;
#else
  return false;
#endif
}

// out [Rows, D] for dimensions [32c, 32c + 32) = weights x values of keys [k0, k1) for Rows rows (at
// most kValueRows<32>: more spill their sums; weight pairs [Rows, kBlockKeys / 2]): per key pair the
// two keys' 64 bytes of those dimensions, interleaved as value_pair interleaves them, meet every row
// at once, so each sum takes the same products in the same order as value_pair's would. With `Ahead`,
// the same bytes of the next block's rows are asked for on the way: a block's chunks ask for each line
// of its successor once.
template <int D, int Rows, bool Ahead>
void chunk_values(const Operands& op, const int32_t* weight_pairs, int64_t k0, int64_t k1, int c, float* out) {
  static_assert(D % 32 == 0, "whole chunks of 32 dimensions");
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = k0, m = 0; k < k1; k += 2, ++m) {
    const at::BFloat16* first = op.values + k * op.value_stride + 32 * c;
    if constexpr (Ahead) {
      for (int j = 0; j < 2; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(first + (kBlockKeys + j) * op.value_stride), _MM_HINT_T1);
      }
    }
    const __m512i a = _mm512_loadu_si512(first);
    const __m512i b = k + 1 < k1 ? _mm512_loadu_si512(first + op.value_stride) : _mm512_setzero_si512();
    const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b), high = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(weight_pairs[r * (kBlockKeys / 2) + m]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], low, weight);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], high, weight);
    }
  }
  for (int r = 0; r < Rows; ++r) store_chunk<D>(acc[r][0], acc[r][1], c, out + r * D);
}

// Whether rows beyond one register group take a block's values from pairs in the thread's scratch:
// where a block's pairs fit in L1 (32 KiB: head sizes up to 64), so each group re-reads them there.
// Larger heads stream the values from the cache 32 dimensions at a time (chunk_values): over 16K-32K
// keys of Qwen2.5-1.5B's heads (128) 5-15% faster for passes of 1-8 tokens, over SmolLM2's (64)
// 5-13% slower, on a 2-core Zen 4 (probe of decode_attention alone, 4-5 interleaved rounds).
template <int D>
constexpr bool kValuesInScratch = kBlockKeys * D * 2 <= 32 * 1024;

// out [rows, D] = weights [rows, kBlockKeys] x the values of keys [k0, k1). Rows that fit in one group
// pair the values in registers as they go. More rows pair them once into `paired` (the thread's
// scratch) and read them from there, group by group, asking for two rows of the next block's values
// every `groups` steps (the asks spread over all the groups' steps); or, for heads whose pairs
// overflow L1 (kValuesInScratch), take them 32 dimensions at a time for up to kValueRows<32> rows per
// pass over the block's keys, the first rows of each chunk asking for the next block's.
template <int D>
void block_values(const Operands& op, const at::BFloat16* weights, int64_t rows, int64_t k0, int64_t k1,
                  __m512i* paired, float* out) {
  constexpr int kBlocks = (D + 31) / 32;
  const auto* weight_pairs = reinterpret_cast<const int32_t*>(weights);
  const int64_t num_pairs = (k1 - k0 + 1) / 2, pair_stride = kBlockKeys / 2;
  if (rows <= kValueRows<D>) {
    const auto direct = [&](int64_t m, __m512i* value) __attribute__((always_inline)) {
      value_pair<D, true>(op, k0 + 2 * m, k1, value);
    };
    with_count<kValueRows<D>>(rows, [&](auto count) {
      weighted_values<D, decltype(count)::value>(weight_pairs, num_pairs, out, direct);
    });
    return;
  }
  if constexpr (!kValuesInScratch<D>) {
    for (int c = 0; c < kBlocks; ++c) {
      in_row_groups<kValueRows<32>>(rows, [&](int64_t r, auto count) {
        constexpr int kRows = decltype(count)::value;
        const int32_t* row_weights = weight_pairs + r * pair_stride;
        if (r == 0) return chunk_values<D, kRows, true>(op, row_weights, k0, k1, c, out);
        chunk_values<D, kRows, false>(op, row_weights, k0, k1, c, out + r * D);
      });
    }
    return;
  }
  paired_values<D, false>(op, k0, k1, paired);
  const int64_t groups = (rows + kValueRows<D> - 1) / kValueRows<D>;
  int64_t countdown = groups, ahead = k0 + kBlockKeys;  // steps until the next ask; the next row asked for
  const auto stored = [&](int64_t m, __m512i* value) __attribute__((always_inline)) {
    if (--countdown == 0) {
      countdown = groups;
      for (int j = 0; j < 2; ++j) prefetch_row<D, _MM_HINT_T1>(op.values + (ahead + j) * op.value_stride);
      ahead += 2;
    }
    for (int v = 0; v < 2 * kBlocks; ++v) value[v] = _mm512_load_si512(paired + m * 2 * kBlocks + v);
  };
  in_row_groups<kValueRows<D>>(rows, [&](int64_t r, auto count) {
    weighted_values<D, decltype(count)::value>(weight_pairs + r * pair_stride, num_pairs, out + r * D, stored);
  });
}

// A thread's working memory for its blocks, kept from call to call and grown when a pass needs more.
struct Scratch {
  float* scores;  // [rows, kBlockKeys]
  at::BFloat16* weights;  // [rows, kBlockKeys]
  __m512i* value_pairs;  // [kBlockKeys / 2, pairs of 32 dimensions, 2]
  __m512i* key_pairs;  // [kBlockKeys / 16, D / 2] (tiles only)
  uint32_t* spread;  // [kBlockKeys / 16, 2, 16 rows, 16] (value tiles from the cache only, spread_into)
};

#if defined(__AMX_BF16__)

using cascade_tiles::kTileRows;

// Tiles for a chunk of up to 16 rows: 0-3 float32 sums [rows, 16]; 4 and 6 pair-interleaved operands
// [16 pairs, 16 columns]; 5 and 7 the rows' operands [rows, 32] (32 dimensions of queries, or weights
// of 32 keys). Two of each kind, used in turn, so a tile loads while the other one multiplies.
inline void configure_attention_tiles(int64_t rows) {
  cascade_tiles::TileConfig config;
  for (const int tile : {0, 1, 2, 3, 5, 7}) {
    config.rows[tile] = rows;
    config.bytes_per_row[tile] = 64;
  }
  config.rows[4] = config.rows[6] = kTileRows;
  config.bytes_per_row[4] = config.bytes_per_row[6] = 64;
  _tile_loadconfig(&config);
}

// Keys [k0, k1) as pairs of head dimensions, 16 keys at a time, into key_pairs [groups, D / 2]
// (transposed_keys: register p of group g holds pair p of keys k0 + 16 g + j in lane j).
template <int D>
void paired_keys(const Operands& op, int64_t k0, int64_t k1, __m512i* key_pairs) {
  static_assert(D >= 32, "a transposition fills 16 registers");
  for (int64_t k = k0; k < k1; k += kGroupKeys) {
    transposed_keys<D>(op, k, k1, key_pairs + (k - k0) / kGroupKeys * (D / 2));
  }
}

// Scores [rows, kBlockKeys] of `rows` query rows [rows, D] against a block's `num_keys` paired keys
// (paired_keys), unscaled: per 16 keys one tile [rows, 16], a row's score the sum over its
// dimensions in order as a step's is.
template <int D>
void tile_scores(const at::BFloat16* queries, const __m512i* key_pairs, int64_t num_keys, float* scores) {
  static_assert(D % (2 * kPairInputs) == 0 || D == kPairInputs);
  for (int64_t g = 0; g * kGroupKeys < num_keys; ++g) {
    const __m512i* pairs = key_pairs + g * (D / 2);
    _tile_zero(0);
    for (int64_t d = 0; d < D; d += 2 * kPairInputs) {  // 64 dimensions: two tiles of each operand in turn
      _tile_loadd(5, queries + d, D * 2);
      _tile_loadd(4, pairs + d / 2, 64);
      if (d + kPairInputs < D) {
        _tile_loadd(7, queries + d + kPairInputs, D * 2);
        _tile_loadd(6, pairs + d / 2 + 16, 64);
      }
      _tile_dpbf16ps(0, 5, 4);
      if (d + kPairInputs < D) _tile_dpbf16ps(0, 7, 6);
    }
    _tile_stored(0, scores + g * kGroupKeys, kBlockKeys * 4);
  }
}

// Sums `first`, ..., `first + Count - 1` of each row (of the 2 x blocks a row's D dimensions take, see
// store_dimensions) into sums[v] [rows, 16]: per 32 keys a tile of the rows' weights [rows, 32 keys]
// times, for each sum, 16 pairs of keys of its 16 dimensions.
template <int Count>
void value_tiles(const at::BFloat16* weights, const __m512i* value_pairs, int64_t groups, int first, int sums_per_pair,
                 float (*sums)[kTileRows * 16]) {
  const int64_t stride = sums_per_pair * 64;  // bytes from a key pair's registers to the next pair's
  _tile_zero(0);
  if constexpr (Count > 1) _tile_zero(1);
  if constexpr (Count > 2) _tile_zero(2);
  if constexpr (Count > 3) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {  // the value operands in tiles 4 and 6 in turn
    _tile_loadd(5, weights + g * 2 * kGroupKeys, kBlockKeys * 2);
    const __m512i* pairs = value_pairs + g * kGroupKeys * sums_per_pair + first;
    _tile_loadd(4, pairs, stride);
    if constexpr (Count > 1) _tile_loadd(6, pairs + 1, stride);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (Count > 2) _tile_loadd(4, pairs + 2, stride);
    if constexpr (Count > 1) _tile_dpbf16ps(1, 5, 6);
    if constexpr (Count > 3) _tile_loadd(6, pairs + 3, stride);
    if constexpr (Count > 2) _tile_dpbf16ps(2, 5, 4);
    if constexpr (Count > 3) _tile_dpbf16ps(3, 5, 6);
  }
  _tile_stored(0, sums[first], 64);
  if constexpr (Count > 1) _tile_stored(1, sums[first + 1], 64);
  if constexpr (Count > 2) _tile_stored(2, sums[first + 2], 64);
  if constexpr (Count > 3) _tile_stored(3, sums[first + 3], 64);
}

// out [rows, D] = weights [rows, kBlockKeys] x a block's `num_pairs` paired values (paired_values),
// the pairs past them up to a multiple of 16 zero; the sums of four tiles at a time.
template <int D>
void tile_values(const at::BFloat16* weights, const __m512i* value_pairs, int64_t rows, int64_t num_pairs, float* out) {
  constexpr int kSums = 2 * ((D + 31) / 32);
  alignas(64) float sums[kSums][kTileRows * 16];
  const int64_t groups = (num_pairs + kGroupKeys - 1) / kGroupKeys;
  for (int first = 0; first < kSums; first += 4) {
    if (kSums - first >= 4) {
      value_tiles<4>(weights, value_pairs, groups, first, kSums, sums);
    } else {
      value_tiles<2>(weights, value_pairs, groups, first, kSums, sums);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc[kSums];
    for (int v = 0; v < kSums; ++v) acc[v] = _mm512_load_ps(sums[v] + r * 16);
    store_dimensions<D>(acc, out + r * D);
  }
}

// Keys or values [k, k + 16) of `rows` (`stride` elements apart) as a tile operand -> (first row,
// stride): the cache's own rows, or where the cache ends before k + 16 (at k1) a copy in `padded`
// whose rows past the end are zeros, so a product never depends on how many rows follow.
template <int D>
inline std::pair<const at::BFloat16*, int64_t> group_rows(const at::BFloat16* rows, int64_t stride, int64_t k,
                                                          int64_t k1, at::BFloat16* padded) {
  const int64_t count = std::min(kGroupKeys, k1 - k);
  if (count == kGroupKeys) return {rows + k * stride, stride};
  for (int64_t j = 0; j < count; ++j) std::copy_n(rows + (k + j) * stride, D, padded + j * D);
  std::fill(padded + count * D, padded + kTileRows * D, at::BFloat16(0.f));
  return {padded, D};
}

// The next block's keys, then its values, asked for (into L2) a few lines at a time as a block's
// work goes on: each call ask(work) asks for the share of the lines its `work` is of the block's
// (`total_work`, in the callers' units), so the asks keep pace with the work however many rows the
// pass has. Issued together, the asks of a block outran the core's outstanding misses and then
// waited on memory while the rest of the block's work left it idle: an 8-token pass of SmolLM2's
// shape over 32K keys cost its step's time plus all of its own arithmetic.
template <int D>
class NextBlockAsks {
 public:
  NextBlockAsks(const Operands& op, int64_t k0, int64_t total_work)
      : keys_(op.keys + (k0 + kBlockKeys) * op.key_stride),
        values_(op.values + (k0 + kBlockKeys) * op.value_stride),
        key_stride_(op.key_stride),
        value_stride_(op.value_stride),
        rows_per_work_(((2 * kBlockKeys) << kFraction) / total_work + 1) {}  // asks multiply, never divide

  void ask(int64_t work) {
    done_ += work;
    const int64_t end = std::min(2 * kBlockKeys, (done_ * rows_per_work_) >> kFraction);
    int64_t row = row_;
    for (; row < std::min(end, kBlockKeys); ++row) prefetch_row<D, _MM_HINT_T1>(keys_ + row * key_stride_);
    for (; row < end; ++row) prefetch_row<D, _MM_HINT_T1>(values_ + (row - kBlockKeys) * value_stride_);
    row_ = row;
  }

 private:
  static constexpr int kFraction = 20;  // bits of rows_per_work_ below the point
  const at::BFloat16 *keys_, *values_;
  int64_t key_stride_, value_stride_, rows_per_work_, done_ = 0, row_ = 0;  // rows asked for: keys, then values
};

// Work of the parts of a key tile block, in NextBlockAsks' units: a group of 16 keys' score or value
// products, and one row's softmax weights of 32 keys (about a quarter of it).
constexpr int64_t kGroupWork = 4, kWeightsWork = 1;

// Tiles for key tile scores of a chunk of `rows` rows: 0 and 1 float32 sums [16 keys, rows], for
// groups of 16 keys in turn; 2, 3 and 6, 7 the keys' rows [16 keys, 32 dimensions] of those groups
// (two slices of 32 dimensions each); 4 and 5 the query pairs [16 pairs, rows] of the slices.
inline void configure_key_tiles(int64_t rows) {
  cascade_tiles::TileConfig config;
  for (const int tile : {0, 1, 4, 5}) {
    config.rows[tile] = kTileRows;
    config.bytes_per_row[tile] = rows * 4;
  }
  for (const int tile : {2, 3, 6, 7}) {
    config.rows[tile] = kTileRows;
    config.bytes_per_row[tile] = 64;
  }
  _tile_loadconfig(&config);
}

// One group's scores from its keys' rows (`source`, `stride` elements apart), slice by slice of 32
// dimensions in order: into sum 0 from key tiles 2 and 3, or (Odd) into sum 1 from key tiles 6 and 7
// (tile numbers are immediates). The query pairs of slices 0 and 1 stay in tiles 4 and 5 (Resident),
// else each slice's are loaded as it is taken.
template <int D, bool Odd, bool Resident>
inline void key_group_products(const at::BFloat16* source, int64_t stride, const at::BFloat16* query_pairs,
                               int64_t rows) {
  if constexpr (Odd) _tile_zero(1);
  if constexpr (!Odd) _tile_zero(0);
  for (int64_t d = 0; d < D; d += 2 * kPairInputs) {
    if constexpr (Odd) _tile_loadd(6, source + d, stride * 2);
    if constexpr (!Odd) _tile_loadd(2, source + d, stride * 2);
    if constexpr (!Resident) _tile_loadd(4, query_pairs + d * rows, rows * 4);
    if constexpr (Odd) _tile_dpbf16ps(1, 6, 4);
    if constexpr (!Odd) _tile_dpbf16ps(0, 2, 4);
    if (d + kPairInputs < D) {
      if constexpr (Odd) _tile_loadd(7, source + d + kPairInputs, stride * 2);
      if constexpr (!Odd) _tile_loadd(3, source + d + kPairInputs, stride * 2);
      if constexpr (!Resident) _tile_loadd(5, query_pairs + (d + kPairInputs) * rows, rows * 4);
      if constexpr (Odd) _tile_dpbf16ps(1, 7, 5);
      if constexpr (!Odd) _tile_dpbf16ps(0, 3, 5);
    }
  }
}

// Scores [rows, kBlockKeys] of keys [k0, k1) against `rows` query rows (query_pairs [D / 2, rows, 2]),
// unscaled, from tiles of 16 keys read straight from the cache ([16 keys, rows]); groups of keys take
// two sets of tiles in turn, so one group's keys load while the other's products run, and the
// queries of heads up to 64 dimensions stay in their tiles. The block's tiles are stored first, then
// gathered into the rows, so no load waits on a tile store just made; the last few keys are copied
// into a zero-padded tile first, so a key's score never depends on how many keys follow it. Each
// group asks for its share of the next block (`next`). For models whose steps' rows stay few (not
// takes_tiles).
template <int D>
void key_tile_scores(const Operands& op, const at::BFloat16* query_pairs, int64_t rows, int64_t k0, int64_t k1,
                     NextBlockAsks<D>& next, float* scores) {
  constexpr bool kResident = D <= 2 * kPairInputs;
  alignas(64) at::BFloat16 padded[kTileRows * D];  // the last keys
  alignas(64) float tiles[kBlockKeys / kGroupKeys][kTileRows * 16];  // per group [16 keys, 16 lanes: rows]
  const int64_t groups = (k1 - k0 + kGroupKeys - 1) / kGroupKeys;
  configure_key_tiles(rows);
  if (kResident) {
    _tile_loadd(4, query_pairs, rows * 4);
    if (D > kPairInputs) _tile_loadd(5, query_pairs + kPairInputs * rows, rows * 4);
  }
  for (int64_t g = 0; g < groups; ++g) {
    next.ask(kGroupWork);
    const auto [source, stride] = group_rows<D>(op.keys, op.key_stride, k0 + g * kGroupKeys, k1, padded);
    if (g % 2 == 0) {
      key_group_products<D, false, kResident>(source, stride, query_pairs, rows);
      _tile_stored(0, tiles[g], 64);
    } else {
      key_group_products<D, true, kResident>(source, stride, query_pairs, rows);
      _tile_stored(1, tiles[g], 64);
    }
  }
  const __m512i keys = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));  // key j's float in lane j: 16 j
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 row = _mm512_i32gather_ps(_mm512_add_epi32(keys, _mm512_set1_epi32(r)), tiles[g], 4);
      _mm512_storeu_ps(scores + r * kBlockKeys + g * kGroupKeys, row);
    }
  }
}

// block_weights' store for a chunk of `rows` rows whose weights of 16 keys are the first operands of
// two tile products against 16 value rows read straight from the cache (a row of 32 dimensions per
// key, as pairs of dimensions): the even operand pairs each weight with a zero, [rows, 16 keys x
// (w, 0)], so its products sum the even dimensions; the odd one, [rows, 16 keys x (0, w)], the odd
// dimensions -> spread [groups of 16 keys, 2, rows, 16 x 32 bits]. A weight rounded to bf16 is the
// high half of its float32's bits, the low half zero: (0, w) is those bits, (w, 0) them shifted down.
template <int D>
inline auto spread_into(uint32_t* spread, int64_t rows, NextBlockAsks<D>& next) {
  return [spread, rows, &next](int64_t r, int64_t k, __m512 low, __m512 high) {
    next.ask(kWeightsWork);
    for (const auto& [g, weights] : {std::pair{k / kGroupKeys, low}, std::pair{k / kGroupKeys + 1, high}}) {
      const __m512i odd = _mm512_castps_si512(weights);
      _mm512_store_si512(spread + (g * 2 * rows + r) * 16, _mm512_srli_epi32(odd, 16));
      _mm512_store_si512(spread + ((g * 2 + 1) * rows + r) * 16, odd);
    }
  };
}

// out [rows, D] = weights x the values of keys [k0, k1) for one chunk of up to 16 rows, from tiles whose
// value operands are the cache's own rows (no pairing into scratch): per 16 keys and 32 dimensions,
// tile 4 or 6 holds the 16 keys' rows, and the spread weights (spread_into) in tiles 5 and 7 take
// its even and odd dimensions into sums 0-3 (64 dimensions at a time). The last keys of the cache are
// copied into a zero-padded tile first, so a sum never depends on how many keys follow. Each group
// asks for its share of the next block (`next`).
template <int D>
void value_tiles_from_cache(const Operands& op, const uint32_t* spread, int64_t rows, int64_t k0, int64_t k1,
                            NextBlockAsks<D>& next, float* out) {
  constexpr int kChunks = D / kPairInputs;  // 32 dimensions each
  alignas(64) at::BFloat16 padded[kTileRows * D];
  alignas(64) float sums[4][kTileRows * 16];  // even and odd sums of two chunks of 32 dimensions, [rows, 16]
  const int64_t groups = (k1 - k0 + kGroupKeys - 1) / kGroupKeys;
  // dimension 2n of 32 from the even sums' lane n, 2n + 1 from the odd sums': the first 16, the last 16
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  for (int c0 = 0; c0 < kChunks; c0 += 2) {
    const int chunks = std::min(2, kChunks - c0);
    _tile_zero(0);  // sums 0-3: the even and odd dimensions of chunk c0, then of c0 + 1
    _tile_zero(1);
    if (chunks > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t g = 0; g < groups; ++g) {
      next.ask(kGroupWork);
      const auto [source, stride] = group_rows<D>(op.values, op.value_stride, k0 + g * kGroupKeys, k1, padded);
      _tile_loadd(5, spread + g * 2 * rows * 16, 64);
      _tile_loadd(7, spread + (g * 2 + 1) * rows * 16, 64);
      _tile_loadd(4, source + c0 * kPairInputs, stride * 2);
      if (chunks > 1) _tile_loadd(6, source + (c0 + 1) * kPairInputs, stride * 2);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 7, 4);
      if (chunks > 1) {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 7, 6);
      }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (chunks > 1) {
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < chunks; ++c) {
        const __m512 even = _mm512_load_ps(sums[2 * c] + r * 16), odd = _mm512_load_ps(sums[2 * c + 1] + r * 16);
        float* target = out + r * D + (c0 + c) * kPairInputs;
        _mm512_storeu_ps(target, _mm512_permutex2var_ps(even, low, odd));
        _mm512_storeu_ps(target + 16, _mm512_permutex2var_ps(even, high, odd));
      }
    }
  }
}

// Tiles for Chunks (2 or 3) chunks of rows taken at once, chunk c of counts[c] rows: c its float32
// sums [rows, 16], 3 + c its operand [rows, 32] (32 dimensions of queries, or weights of 32 keys); 6
// and 7 the pair-interleaved operand the chunks share [16 pairs, 16 columns], in turn.
inline void configure_shared_tiles(const int64_t* counts, int chunks) {
  cascade_tiles::TileConfig config;
  for (int c = 0; c < chunks; ++c) {
    config.rows[c] = config.rows[3 + c] = counts[c];
    config.bytes_per_row[c] = config.bytes_per_row[3 + c] = 64;
  }
  config.rows[6] = config.rows[7] = kTileRows;
  config.bytes_per_row[6] = config.bytes_per_row[7] = 64;
  _tile_loadconfig(&config);
}

// Sums c += chunk c's operand at operands + c * chunk_stride (rows `stride` bytes apart) x the shared
// operand in tile Shared, for chunks c < Chunks: the shared tile is loaded once for all of them.
template <int Chunks, int Shared>
inline void shared_products(const at::BFloat16* operands, int64_t chunk_stride, int64_t stride) {
  static_assert(Shared == 6 || Shared == 7, "tile numbers are immediates");
  _tile_loadd(3, operands, stride);
  if constexpr (Shared == 6) _tile_dpbf16ps(0, 3, 6);
  if constexpr (Shared == 7) _tile_dpbf16ps(0, 3, 7);
  _tile_loadd(4, operands + chunk_stride, stride);
  if constexpr (Shared == 6) _tile_dpbf16ps(1, 4, 6);
  if constexpr (Shared == 7) _tile_dpbf16ps(1, 4, 7);
  if constexpr (Chunks > 2) {
    _tile_loadd(5, operands + 2 * chunk_stride, stride);
    if constexpr (Shared == 6) _tile_dpbf16ps(2, 5, 6);
    if constexpr (Shared == 7) _tile_dpbf16ps(2, 5, 7);
  }
}

// tile_scores for Chunks chunks of 16 rows (the last may have fewer) at once: each tile of key pairs
// read once for all of them. Each score takes the same tile products in the same order as
// tile_scores', so the same bits.
template <int D, int Chunks>
void shared_tile_scores(const at::BFloat16* queries, const __m512i* key_pairs, int64_t num_keys, float* scores) {
  for (int64_t g = 0; g * kGroupKeys < num_keys; ++g) {
    const __m512i* pairs = key_pairs + g * (D / 2);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (Chunks > 2) _tile_zero(2);
    for (int64_t d = 0; d < D; d += 2 * kPairInputs) {
      _tile_loadd(6, pairs + d / 2, 64);
      shared_products<Chunks, 6>(queries + d, kChunkRows * D, D * 2);
      if (d + kPairInputs < D) {
        _tile_loadd(7, pairs + d / 2 + 16, 64);
        shared_products<Chunks, 7>(queries + d + kPairInputs, kChunkRows * D, D * 2);
      }
    }
    _tile_stored(0, scores + g * kGroupKeys, kBlockKeys * 4);
    _tile_stored(1, scores + kChunkRows * kBlockKeys + g * kGroupKeys, kBlockKeys * 4);
    if constexpr (Chunks > 2) _tile_stored(2, scores + 2 * kChunkRows * kBlockKeys + g * kGroupKeys, kBlockKeys * 4);
  }
}

// tile_values for Chunks chunks of 16 rows (the last may have fewer) at once, one sum of 16
// dimensions at a time: each tile of value pairs read once for all of them, into out [rows, D]. Each
// sum takes the same tile products in the same order as tile_values', so the same bits.
template <int D, int Chunks>
void shared_tile_values(const at::BFloat16* weights, const __m512i* value_pairs, int64_t rows, int64_t num_pairs,
                        float* out) {
  constexpr int kSums = 2 * ((D + 31) / 32);
  alignas(64) float sums[Chunks][kSums][kTileRows * 16];
  const int64_t groups = (num_pairs + kGroupKeys - 1) / kGroupKeys, weight_stride = kChunkRows * kBlockKeys;
  for (int v = 0; v < kSums; ++v) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (Chunks > 2) _tile_zero(2);
    for (int64_t g = 0; g < groups; g += 2) {  // the value operands in tiles 6 and 7 in turn
      _tile_loadd(6, value_pairs + g * kGroupKeys * kSums + v, kSums * 64);
      shared_products<Chunks, 6>(weights + g * 2 * kGroupKeys, weight_stride, kBlockKeys * 2);
      if (g + 1 < groups) {
        _tile_loadd(7, value_pairs + (g + 1) * kGroupKeys * kSums + v, kSums * 64);
        shared_products<Chunks, 7>(weights + (g + 1) * 2 * kGroupKeys, weight_stride, kBlockKeys * 2);
      }
    }
    _tile_stored(0, sums[0][v], 64);
    _tile_stored(1, sums[1][v], 64);
    if constexpr (Chunks > 2) _tile_stored(2, sums[2][v], 64);
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc[kSums];
    for (int v = 0; v < kSums; ++v) acc[v] = _mm512_load_ps(sums[r / kChunkRows][v] + r % kChunkRows * 16);
    store_dimensions<D>(acc, out + r * D);
  }
}

// A block's results from tiles, for rows `grouped` [rows, D] of one KV head over keys [k0, k1): the
// keys and values paired once into the thread's scratch, then per chunk of up to 16 rows its scores,
// softmax weights (block_weights) and weighted sums; a pass of more rows takes its chunks two or
// three at a time, each tile of pairs read once for all of them (the same products, so the same
// bits: over 32K keys of Qwen2.5-1.5B's shape, passes of 4-8 tokens took 0.77-0.94x the time of one
// chunk after another). Sums are `partial` [rows, D], maxima and totals [rows].
template <int D>
void tile_block(const Operands& op, const at::BFloat16* grouped, const int32_t* last_visible, int64_t rows, int64_t k0,
                int64_t k1, const Scratch& scratch, float* partial, float* maxima, float* totals) {
  constexpr int kSums = 2 * ((D + 31) / 32);
  const int64_t num_pairs = (k1 - k0 + 1) / 2, padded = (num_pairs + kGroupKeys - 1) / kGroupKeys * kGroupKeys;
  paired_keys<D>(op, k0, k1, scratch.key_pairs);
  paired_values<D, true>(op, k0, k1, scratch.value_pairs);
  std::fill(scratch.value_pairs + num_pairs * kSums, scratch.value_pairs + padded * kSums, _mm512_setzero_si512());
  for (int64_t c0 = 0; c0 < rows;) {  // one chunk of rows alone, else two or three together
    const int64_t chunks = std::min<int64_t>(3, (rows - c0 + kChunkRows - 1) / kChunkRows);
    const int64_t count = std::min(chunks * kChunkRows, rows - c0);
    float* chunk_scores = scratch.scores + c0 * kBlockKeys;
    at::BFloat16* chunk_weights = scratch.weights + c0 * kBlockKeys;
    if (chunks == 1) {
      configure_attention_tiles(count);
      tile_scores<D>(grouped + c0 * D, scratch.key_pairs, k1 - k0, chunk_scores);
    } else {
      const int64_t counts[3] = {kChunkRows, std::min(kChunkRows, count - kChunkRows),
                                 std::max<int64_t>(0, count - 2 * kChunkRows)};
      configure_shared_tiles(counts, chunks);
      if (chunks == 2) shared_tile_scores<D, 2>(grouped + c0 * D, scratch.key_pairs, k1 - k0, chunk_scores);
      if (chunks == 3) shared_tile_scores<D, 3>(grouped + c0 * D, scratch.key_pairs, k1 - k0, chunk_scores);
    }
    block_weights(op, last_visible + c0, count, k0, k1, chunk_scores, maxima + c0, totals + c0,
                  weights_into(chunk_weights));
    if (chunks == 1) tile_values<D>(chunk_weights, scratch.value_pairs, count, num_pairs, partial + c0 * D);
    if (chunks == 2) shared_tile_values<D, 2>(chunk_weights, scratch.value_pairs, count, num_pairs, partial + c0 * D);
    if (chunks == 3) shared_tile_values<D, 3>(chunk_weights, scratch.value_pairs, count, num_pairs, partial + c0 * D);
    c0 += count;
  }
  _tile_release();
}

#endif  // __AMX_BF16__

// The operand of key_tile_scores for each chunk of up to 16 query rows, [H_kv, D / 2, rows, 2]; none
// where the scores come from AVX-512 or the pass takes tiles throughout (takes_tiles).
std::vector<at::Tensor> key_tile_operands(const at::Tensor& grouped, int64_t dim, bool tiles) {
  std::vector<at::Tensor> pairs;
#if defined(__AMX_BF16__)
  if (tiles || !cascade_tiles::use_amx || dim % kPairInputs != 0) return pairs;
  const int64_t rows = grouped.size(1);
  for (int64_t c0 = 0; c0 < rows; c0 += kChunkRows) {
    pairs.push_back(cascade_tiles::pair_interleave(grouped.narrow(1, c0, std::min(kChunkRows, rows - c0))));
  }
#endif
  return pairs;
}

#if defined(__AMX_BF16__)

// A block's results for a model whose step's rows stay few (not takes_tiles), for rows of KV head
// `head` over keys [k0, k1): per chunk of up to 16 rows, its scores from key tiles (operands
// `query_pairs`, key_tile_operands), its softmax weights, and its weighted sums from tiles of the
// cache's value rows. Sums are `partial` [rows, D], maxima and totals [rows].
template <int D>
void key_tile_block(const Operands& op, const std::vector<at::Tensor>& query_pairs, int64_t head,
                    const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1, const Scratch& scratch,
                    float* partial, float* maxima, float* totals) {
  const int64_t groups = (k1 - k0 + kGroupKeys - 1) / kGroupKeys, chunks = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t value_passes = (D + 2 * kPairInputs - 1) / (2 * kPairInputs), weight_stores = (k1 - k0 + 31) / 32;
  const int64_t work = chunks * groups * (1 + value_passes) * kGroupWork + rows * weight_stores * kWeightsWork;
  NextBlockAsks<D> next(op, k0, work);
  for (int64_t c0 = 0; c0 < rows; c0 += kChunkRows) {
    const int64_t count = std::min(kChunkRows, rows - c0);
    const at::BFloat16* chunk_pairs = query_pairs[c0 / kChunkRows].data_ptr<at::BFloat16>() + head * D * count;
    key_tile_scores<D>(op, chunk_pairs, count, k0, k1, next, scratch.scores);
    block_weights(op, last_visible + c0, count, k0, k1, scratch.scores, maxima + c0, totals + c0,
                  spread_into<D>(scratch.spread, count, next));
    configure_attention_tiles(count);
    value_tiles_from_cache<D>(op, scratch.spread, count, k0, k1, next, partial + c0 * D);
  }
  _tile_release();
}

#endif  // __AMX_BF16__

// A thread's working memory for a pass of `rows` rows per KV head.
template <int D>
Scratch thread_scratch(int64_t rows) {
  thread_local std::unique_ptr<char, decltype(&std::free)> memory{nullptr, &std::free};
  thread_local int64_t held = 0;
  const int64_t score_bytes = rows * kBlockKeys * 4, weight_bytes = rows * kBlockKeys * 2;
  const int64_t value_bytes = kBlockKeys * ((D + 31) / 32) * 64, key_bytes = kBlockKeys * std::max(D, 32) * 2;
  const int64_t spread_bytes = kBlockKeys / kGroupKeys * 2 * kChunkRows * 64;
  const int64_t bytes = score_bytes + weight_bytes + value_bytes + key_bytes + spread_bytes;  // multiples of 64
  if (bytes > held) {
    memory.reset(static_cast<char*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(memory != nullptr, "decode_attention: no memory for ", bytes, " bytes of working space");
    held = bytes;
  }
  char* base = memory.get();
  return {reinterpret_cast<float*>(base), reinterpret_cast<at::BFloat16*>(base + score_bytes),
          reinterpret_cast<__m512i*>(base + score_bytes + weight_bytes),
          reinterpret_cast<__m512i*>(base + score_bytes + weight_bytes + value_bytes),
          reinterpret_cast<uint32_t*>(base + score_bytes + weight_bytes + value_bytes + key_bytes)};
}

// What a pass's key blocks share beyond its rows: whether they take tiles (takes_tiles) and the
// operands of key tile scores (key_tile_operands).
template <int D>
struct PassOperands {
  bool tiles;
  std::vector<at::Tensor> query_pairs;

  PassOperands(const at::Tensor& grouped, int64_t group)
      : tiles(takes_tiles<D>(group)), query_pairs(key_tile_operands(grouped, D, tiles)) {}
};

// One (KV head, key block) task: rows `queries` [rows, D] of KV head `head` over keys [k0, k1), row r
// seeing keys up to last_visible[r] -> its partial sums [rows, D], maxima and totals [rows].
template <int D>
void block_task(const Operands& op, const PassOperands<D>& pass, const at::BFloat16* queries, int64_t head,
                const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1, const Scratch& scratch,
                float* partial, float* maxima, float* totals) {
#if defined(__AMX_BF16__)
  if constexpr (D % kPairInputs == 0) {  // tiles take 32 dimensions at a time
    if (pass.tiles) return tile_block<D>(op, queries, last_visible, rows, k0, k1, scratch, partial, maxima, totals);
    if (!pass.query_pairs.empty()) {
      return key_tile_block<D>(op, pass.query_pairs, head, last_visible, rows, k0, k1, scratch, partial, maxima,
                               totals);
    }
  }
#endif
  vector_scores<D>(op, reinterpret_cast<const int32_t*>(queries), rows, k0, k1, scratch.scores);
  block_weights(op, last_visible, rows, k0, k1, scratch.scores, maxima, totals, weights_into(scratch.weights));
  block_values<D>(op, scratch.weights, rows, k0, k1, scratch.value_pairs, partial);
}

#endif  // CASCADE_AVX512

#if defined(CASCADE_AVX2)
#include "attention_avx2.h"
#endif

#if defined(CASCADE_KERNELS)

// One row's output from its blocks in key order: `block(b)` -> (partial sums [D], maximum, total) of
// block b; rounded to bf16 into out [D].
template <typename Block>
void merge_row(int64_t blocks, int64_t dim, Block block, at::BFloat16* out) {
  float sum[kMaxDim];
  float best = kNegativeInfinity;
  for (int64_t b = 0; b < blocks; ++b) best = std::max(best, std::get<1>(block(b)));
  float total = 0.f;
  std::fill(sum, sum + dim, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto [partial, m, block_total] = block(b);
    if (m == kNegativeInfinity) continue;  // the row sees no key of this block
    const float factor = std::exp(m - best);
    total += factor * block_total;
    for (int64_t d = 0; d < dim; ++d) sum[d] += factor * partial[d];
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = at::BFloat16(sum[d] / total);
}

// What a pass's (KV head, key block) tasks leave for merging, task = head * blocks + block: partial
// sums [tasks, R, D], maxima and totals [tasks, R].
struct BlockResults {
  at::Tensor storage;
  float* partial;
  float* maxima;
  float* totals;
  int64_t blocks, rows, dim;

  std::tuple<const float*, float, float> at(int64_t head, int64_t block, int64_t row) const {
    const int64_t task = head * blocks + block;
    return {partial + (task * rows + row) * dim, maxima[task * rows + row], totals[task * rows + row]};
  }
};

// The last key each of `rows` rows (token t = r % tokens of a pass of `tokens` tokens) sees of
// `num_keys`: every key, or (causal) those up to its own, the pass's tokens being the last keys.
std::vector<int32_t> last_visible_keys(int64_t rows, int64_t tokens, int64_t num_keys, bool causal) {
  std::vector<int32_t> last_visible(rows);
  for (int64_t r = 0; r < rows; ++r) last_visible[r] = causal ? num_keys - tokens + r % tokens : num_keys - 1;
  return last_visible;
}

// A pass's (KV head, key block) tasks, task = head * blocks + block: rows `grouped` [H_kv, R, D] over
// the keys / values [H_kv, S, D] of any one of layers [L, H_kv, S, D], row r seeing keys up to
// last_visible[r]; each task's partial sums, maximum and total go to its own part of `results`, so the
// tasks may run on any threads in any order. The rows are read when a task runs (`grouped` is a view of
// buffers a pass refills layer by layer), and so are what they share (`operands`, from them).
template <int D>
struct KeyBlocks {
  at::Tensor grouped, keys, values;  // [H_kv, R, D], [L, H_kv, S, D], [L, H_kv, S, D]
  float scale;
  std::vector<int32_t> last_visible;
  int64_t group;  // query heads per KV head
  BlockResults results;
  int64_t tasks;

  KeyBlocks(const at::Tensor& grouped_, const at::Tensor& keys_, const at::Tensor& values_, float scale_,
            std::vector<int32_t> last_visible_, int64_t group_)
      : grouped(grouped_), keys(keys_), values(values_), scale(scale_), last_visible(std::move(last_visible_)),
        group(group_) {
    const int64_t kv_heads = grouped.size(0), rows = grouped.size(1), num_keys = keys.size(2);
    const int64_t blocks = (num_keys + kBlockKeys - 1) / kBlockKeys;
    tasks = kv_heads * blocks;
    const at::Tensor storage = at::empty({tasks * rows * (D + 2)}, grouped.options().dtype(at::kFloat));
    float* partial = storage.data_ptr<float>();
    results = {storage, partial, partial + tasks * rows * D, partial + tasks * rows * (D + 1), blocks, rows, D};
  }

  PassOperands<D> operands() const { return PassOperands<D>(grouped, group); }

  void run(int64_t task, int64_t layer, const PassOperands<D>& pass, const Scratch& scratch) const {
    const int64_t rows = results.rows, head = task / results.blocks, block = task % results.blocks;
    const int64_t k0 = block * kBlockKeys, k1 = std::min(keys.size(2), k0 + kBlockKeys);
    const at::BFloat16* queries = grouped.data_ptr<at::BFloat16>() + head * rows * D;  // [rows, D]
    const Operands op{keys.data_ptr<at::BFloat16>() + layer * keys.stride(0) + head * keys.stride(1),
                      values.data_ptr<at::BFloat16>() + layer * values.stride(0) + head * values.stride(1),
                      keys.stride(2), values.stride(2), scale};
    float *maxima = results.maxima + task * rows, *totals = results.totals + task * rows;
    float* partial = results.partial + task * rows * D;
    block_task<D>(op, pass, queries, head, last_visible.data(), rows, k0, k1, scratch, partial, maxima, totals);
  }
};

// Every (KV head, key block) task of rows `grouped` [H_kv, R, D] over keys / values [H_kv, S, D] on the
// threads; row r sees keys up to last_visible[r].
template <int D>
BlockResults key_blocks(const at::Tensor& grouped, const at::Tensor& keys, const at::Tensor& values, float scale,
                        const std::vector<int32_t>& last_visible, int64_t group) {
  const KeyBlocks<D> job(grouped, keys.unsqueeze(0), values.unsqueeze(0), scale, last_visible, group);
  const PassOperands<D> pass = job.operands();
  at::parallel_for(0, job.tasks, 1, [&](int64_t begin, int64_t end) {
    const Scratch scratch = thread_scratch<D>(job.results.rows);
    for (int64_t task = begin; task < end; ++task) job.run(task, 0, pass, scratch);
  });
  return job.results;
}

// Each row's output [D] of `results`, merged from its blocks, into out [H_kv, R, D]: rows split over the
// threads (a 6-token pass of the Qwen 1.5B over 32K keys merges 72 rows of 128 blocks a layer; on one
// thread that was ~5% of its attention), each row's blocks in key order as before, so the same bits.
void merge_rows(const BlockResults& results, int64_t kv_heads, at::BFloat16* out) {
  at::parallel_for(0, kv_heads * results.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t head = i / results.rows, r = i % results.rows;
      merge_row(results.blocks, results.dim, [&](int64_t b) { return results.at(head, b, r); },
                out + i * results.dim);
    }
  });
}

// The pass's attention for head size D into `out` [H_kv, R, D] (R = group x tokens): its key blocks,
// then each row's merged.
template <int D>
void attend(const at::Tensor& grouped, const at::Tensor& keys, const at::Tensor& values, float scale,
            const std::vector<int32_t>& last_visible, int64_t group, at::BFloat16* out) {
  merge_rows(key_blocks<D>(grouped, keys, values, scale, last_visible, group), grouped.size(0), out);
}

// The positions of the keys a decode step of a tree pass's token reads from key `first_key` on: the
// cache's keys from there up to the tail, then the tail keys `visible` [M] lets it read, in order -> [L].
at::Tensor step_positions(int64_t first_key, int64_t tail_start, const at::Tensor& visible) {
  const at::Tensor tail = visible.nonzero().squeeze(1) + tail_start;
  return at::cat({at::arange(first_key, tail_start, tail.options()), tail});
}

// A pass whose last M keys are read by mask (a token tree's nodes): token t's rows read keys
// [0, S - M) and the tail keys tail_mask[t] [M] allows, and get exactly what a decode step of that
// token gets, whose cache holds just those keys in that order. The key blocks before the one holding
// key S - M are the same in both and shared by every row; from that block on each token's rows read
// a copy of the keys its step would (their sums pair keys and fill blocks as that step's do).
template <int D>
void attend_masked_tail(const at::Tensor& grouped, const at::Tensor& keys, const at::Tensor& values, float scale,
                        const at::Tensor& tail_mask, at::BFloat16* out) {
  const int64_t kv_heads = grouped.size(0), rows = grouped.size(1), tokens = tail_mask.size(0);
  const int64_t group = rows / tokens, tail_start = keys.size(1) - tail_mask.size(1);
  const int64_t shared_keys = tail_start / kBlockKeys * kBlockKeys;
  const BlockResults shared = key_blocks<D>(grouped, keys.narrow(1, 0, shared_keys), values.narrow(1, 0, shared_keys),
                                            scale, std::vector<int32_t>(rows, shared_keys - 1), group);
  const at::Tensor by_token = grouped.view({kv_heads, group, tokens, D});
  for (int64_t t = 0; t < tokens; ++t) {
    const at::Tensor positions = step_positions(shared_keys, tail_start, tail_mask[t]);  // [L]
    const at::Tensor query = by_token.select(2, t).contiguous();  // [H_kv, G, D]
    const BlockResults own = key_blocks<D>(query, keys.index_select(1, positions), values.index_select(1, positions),
                                           scale, std::vector<int32_t>(group, positions.size(0) - 1), group);
    for (int64_t head = 0; head < kv_heads; ++head) {
      for (int64_t g = 0; g < group; ++g) {
        const auto block = [&](int64_t b) {
          return b < shared.blocks ? shared.at(head, b, g * tokens + t) : own.at(head, b - shared.blocks, g);
        };
        merge_row(shared.blocks + own.blocks, D, block, out + (head * rows + g * tokens + t) * D);
      }
    }
  }
}

// A pass of `tokens` tokens: rows [H_kv, R, D] over keys / values [H_kv, S, D], every row reading
// every key, or causally, or (with `tail_mask` [T, M]) by that mask over the last M keys.
template <int D>
void attend_pass(const at::Tensor& grouped, const at::Tensor& keys, const at::Tensor& values, float scale,
                 int64_t tokens, bool causal, const std::optional<at::Tensor>& tail_mask, at::BFloat16* out) {
  if (tail_mask.has_value()) return attend_masked_tail<D>(grouped, keys, values, scale, *tail_mask, out);
  attend<D>(grouped, keys, values, scale, last_visible_keys(grouped.size(1), tokens, keys.size(1), causal),
            grouped.size(1) / tokens, out);
}

// query [H, T, D] -> its rows [H_kv, G T, D] by KV head: head k * G + g, token t is row g * T + t (the
// order of out [H, T, D] too).
at::Tensor grouped_rows(const at::Tensor& query, int64_t kv_heads) {
  return query.contiguous().view({kv_heads, query.size(0) / kv_heads * query.size(1), query.size(2)});
}

// The threads' tasks [0, N): each thread takes its contiguous share from the front, then, its own done,
// the others' from the back, until none is left. A share is (next, end) in one word, each task taken
// by one compare-and-swap. Two threads' shares of the same work end apart by their cores' moment-to-
// moment speeds: SmolLM2's 30 layers of one-token attention over 32K keys on a 2-core Zen 5 left each
// thread waiting ~0.5 ms a step at the barrier after them, in 256-key tasks of ~40 us.
class SharedTasks {
 public:
  explicit SharedTasks(int64_t threads) : shares_(threads) {}

  // Runs run(task) for the tasks this thread takes (`thread` of `threads`, at most those built for).
  template <typename Run>
  void take(int64_t tasks, int64_t thread, int64_t threads, Run run) {
    const auto [begin, end] = cascade_kernels::thread_range(tasks, thread, threads);
    shares_[thread].word.store(pack(begin, end), std::memory_order_relaxed);
    for (int64_t task; (task = take_one(shares_[thread].word, true)) >= 0;) run(task);
    for (int64_t other = 1; other < threads; ++other) {
      auto& share = shares_[(thread + other) % threads].word;  // before its owner resets it: left empty
      for (int64_t task; (task = take_one(share, false)) >= 0;) run(task);
    }
  }

 private:
  struct alignas(64) Share {
    std::atomic<uint64_t> word{0};  // next << 32 | end
  };

  static uint64_t pack(int64_t next, int64_t end) { return static_cast<uint64_t>(next) << 32 | end; }

  // The front (or back) task of a share, or -1 where none is left.
  static int64_t take_one(std::atomic<uint64_t>& word, bool front) {
    uint64_t seen = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t next = static_cast<int64_t>(seen >> 32), end = static_cast<int64_t>(seen & 0xFFFFFFFFu);
      if (next >= end) return -1;
      const uint64_t left = front ? pack(next + 1, end) : pack(next, end - 1);
      if (word.compare_exchange_weak(seen, left, std::memory_order_relaxed)) return front ? next : end - 1;
    }
  }

  std::vector<Share> shares_;
};

// Each sequence's pass (queries[b] [H, T_b, D] over keys[b] / values[b] [H_kv, S_b, D] of one of the
// layers [L, H_kv, S_b, D], causal among its tokens) into outs[b]: the key blocks of every sequence split
// among the threads (a batch's passes share the region, and its threads' work evens out across the
// sequences), then the rows' merges. Built once for a pass's layers: each layer's attention is then
// its threads' work alone, without one thread setting it up while the others wait.
template <int D>
class SequencesAttentionOf final : public cascade_kernels::SequencesAttention {
 public:
  SequencesAttentionOf(const std::vector<at::Tensor>& queries, at::TensorList keys, at::TensorList values, float scale,
                       const std::vector<at::Tensor>& outs, int64_t threads)
      : outs_(outs), tasks_(threads) {
    jobs_.reserve(queries.size());
    for (size_t b = 0; b < queries.size(); ++b) {
      const int64_t tokens = queries[b].size(1);
      const at::Tensor grouped = grouped_rows(queries[b], keys[b].size(1));  // [H_kv, R_b, D]: a view
      jobs_.emplace_back(grouped, keys[b], values[b], scale,
                         last_visible_keys(grouped.size(1), tokens, keys[b].size(2), true), grouped.size(1) / tokens);
      first_task_.push_back(first_task_.back() + jobs_.back().tasks);
      first_row_.push_back(first_row_.back() + grouped.size(0) * grouped.size(1));
      rows_ = std::max(rows_, grouped.size(1));
    }
  }

  void key_blocks(int64_t thread, int64_t threads, int64_t layer) const override {
    const Scratch scratch = thread_scratch<D>(rows_);
    std::vector<PassOperands<D>> passes;  // each sequence's, from this layer's queries
    for (const KeyBlocks<D>& job : jobs_) passes.push_back(job.operands());
    tasks_.take(first_task_.back(), thread, threads, [&](int64_t task) {
      const int64_t b = sequence_of(first_task_, task);
      jobs_[b].run(task - first_task_[b], layer, passes[b], scratch);
    });
  }

  void merge(int64_t thread, int64_t threads) const override {
    const auto [begin, end] = cascade_kernels::thread_range(first_row_.back(), thread, threads);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = sequence_of(first_row_, i), row = i - first_row_[b];
      const BlockResults& results = jobs_[b].results;
      merge_row(results.blocks, D, [&](int64_t k) { return results.at(row / results.rows, k, row % results.rows); },
                outs_[b].data_ptr<at::BFloat16>() + row * D);
    }
  }

 private:
  // The sequence whose range of `firsts` (its first item, then the next sequence's) holds item i.
  static int64_t sequence_of(const std::vector<int64_t>& firsts, int64_t i) {
    return std::upper_bound(firsts.begin(), firsts.end(), i) - firsts.begin() - 1;
  }

  std::vector<at::Tensor> outs_;
  std::vector<KeyBlocks<D>> jobs_;
  mutable SharedTasks tasks_;
  std::vector<int64_t> first_task_{0}, first_row_{0};  // each sequence's first task and first merged row
  int64_t rows_ = 0;  // the most rows a KV head has in any sequence
};

#endif  // CASCADE_KERNELS

// Fails unless query [H, T, D] may attend over keys / values [H_kv, S, D] (and tail_mask [T, M]).
void check_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                     const std::optional<at::Tensor>& tail_mask) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3,
              "decode_attention: query [H, T, D], keys and values [H_kv, S, D]; got ", query.sizes(), ", ",
              keys.sizes(), ", ", values.sizes());
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(0), num_keys = keys.size(1);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(2) == dim && heads % kv_heads == 0,
              "decode_attention: keys and values [H_kv, S, D] with D = ", dim, " and H = ", heads,
              " a multiple of H_kv; got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16, "decode_attention: bfloat16 query, keys and values");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && (dim == 16 || dim == 32 || dim == 64 || dim == 128),
              "decode_attention: rows of keys and values contiguous, head size 16, 32, 64 or 128; got ", dim);
  TORCH_CHECK(num_keys >= tokens, "decode_attention: fewer keys (", num_keys, ") than tokens (", tokens, ")");
  TORCH_CHECK(!tail_mask.has_value() ||
                  (tail_mask->scalar_type() == at::kBool && tail_mask->dim() == 2 && tail_mask->size(0) == tokens &&
                   tail_mask->size(1) >= tokens && tail_mask->size(1) <= num_keys),
              "decode_attention_tree: a bool tail mask [T, M] with T = ", tokens, " <= M <= ", num_keys, "; got ",
              tail_mask.has_value() ? tail_mask->sizes() : at::IntArrayRef{});
}

// Calls run(std::integral_constant<int, D>) for head size `dim` (16, 32, 64 or 128).
template <typename Run>
void with_head_size(int64_t dim, Run run) {
  switch (dim) {
    case 16: return run(std::integral_constant<int, 16>{});
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    default: return run(std::integral_constant<int, 128>{});
  }
}

// query [H, T, D] over keys / values [H_kv, S, D] -> [H, T, D] (see attend_pass).
at::Tensor attention_pass(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale,
                          bool causal, const std::optional<at::Tensor>& tail_mask) {
  check_attention(query, keys, values, tail_mask);
  at::Tensor out = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(CASCADE_KERNELS)
  const at::Tensor grouped = grouped_rows(query, keys.size(0));
  const std::optional<at::Tensor> mask = tail_mask.has_value() ? std::optional(tail_mask->contiguous()) : std::nullopt;
  with_head_size(query.size(2), [&](auto dim) {
    attend_pass<decltype(dim)::value>(grouped, keys, values, (float)scale, query.size(1), causal, mask,
                                      out.data_ptr<at::BFloat16>());
  });
#else
  TORCH_CHECK(false, "decode_attention: this build has neither AVX512-BF16 nor AVX2 with FMA (see features())");
#endif
  return out;
}

}  // namespace

namespace cascade_kernels {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale,
                            bool causal) {
  return attention_pass(query, keys, values, scale, causal, std::nullopt);
}

std::unique_ptr<SequencesAttention> sequences_attention(const std::vector<at::Tensor>& queries, at::TensorList keys,
                                                        at::TensorList values, double scale,
                                                        const std::vector<at::Tensor>& outs, int64_t threads) {
  TORCH_CHECK(!queries.empty() && keys.size() == queries.size() && values.size() == queries.size() &&
                  outs.size() == queries.size(),
              "decode_attention: keys, values and outputs for each of ", queries.size(), " sequences; got ",
              keys.size(), ", ", values.size(), " and ", outs.size());
  for (size_t b = 0; b < queries.size(); ++b) {
    TORCH_CHECK(keys[b].dim() == 4 && keys[b].sizes() == values[b].sizes() && keys[b].size(0) == keys[0].size(0),
                "decode_attention: every layer's keys and values [L, H_kv, S, D], L that of the first sequence; got ",
                keys[b].sizes(), " and ", values[b].sizes());
    check_attention(queries[b], keys[b][0], values[b][0], std::nullopt);
    TORCH_CHECK(queries[b].size(2) == queries[0].size(2), "decode_attention: one head size for every sequence");
    TORCH_CHECK(queries[b].is_contiguous() && outs[b].is_contiguous() && outs[b].sizes() == queries[b].sizes(),
                "decode_attention: a contiguous query and an output of its shape ", queries[b].sizes());
  }
  std::unique_ptr<SequencesAttention> attention;
#if defined(CASCADE_KERNELS)
  with_head_size(queries[0].size(2), [&](auto dim) {
    attention = std::make_unique<SequencesAttentionOf<decltype(dim)::value>>(queries, keys, values, (float)scale, outs,
                                                                            threads);
  });
#else
  TORCH_CHECK(false, "decode_attention: this build has neither AVX512-BF16 nor AVX2 with FMA (see features())");
#endif
  return attention;
}

std::vector<at::Tensor> decode_attention_sequences(const std::vector<at::Tensor>& queries, at::TensorList keys,
                                                   at::TensorList values, double scale) {
  std::vector<at::Tensor> contiguous, outs, one_layer_keys, one_layer_values;  // sequences_attention checks them
  for (const at::Tensor& query : queries) {
    contiguous.push_back(query.contiguous());
    outs.push_back(at::empty_like(contiguous.back()));
  }
  for (const at::Tensor& layer_keys : keys) one_layer_keys.push_back(layer_keys.unsqueeze(0));
  for (const at::Tensor& layer_values : values) one_layer_values.push_back(layer_values.unsqueeze(0));
  const std::unique_ptr<SequencesAttention> attention =
      sequences_attention(contiguous, one_layer_keys, one_layer_values, scale, outs, at::get_num_threads());
  on_threads(at::get_num_threads(), [&](int64_t thread, int64_t team) { attention->key_blocks(thread, team, 0); });
  on_threads(at::get_num_threads(), [&](int64_t thread, int64_t team) { attention->merge(thread, team); });
  return outs;
}

}  // namespace cascade_kernels

namespace {

// A token tree's pass: query [H, T, D] (the pass's tokens, the last T keys) over keys / values
// [H_kv, S, D], token t reading keys [0, S - M) and the last M keys tail_mask [T, M] (bool) allows ->
// [H, T, D], each token's rows equal to a decode step's over just the keys it reads.
at::Tensor decode_attention_tree(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                 double scale, const at::Tensor& tail_mask) {
  return attention_pass(query, keys, values, scale, false, tail_mask);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cascade_kernels, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, float scale, bool causal) -> Tensor");
  m.def("decode_attention_tree(Tensor query, Tensor keys, Tensor values, float scale, Tensor tail_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) {
  m.impl("decode_attention", &cascade_kernels::decode_attention);
  m.impl("decode_attention_tree", &decode_attention_tree);
}

