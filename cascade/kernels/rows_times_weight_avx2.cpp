// rows_times_weight for CPUs with AVX2 and FMA but no AVX512-BF16 (CASCADE_AVX2, see vector_math.h).
//
// rows [T, I] bf16 x weight [O, I] bf16 -> out [T, O] float32, reading the weight once. There is no
// bf16 product instruction, so each 256-bit load of 16 weight values is widened in registers: the
// even values by a shift, the odd ones by a mask (each bf16 is the high half of its float32). The
// activation rows are widened once per call into the same order (per 16 inputs, the 8 even then the 8
// odd ones), so each load meets them with two fused multiply-adds. An output's sum runs over the
// inputs in order in two accumulators (even, odd), then goes through one fixed horizontal sum (sum8)
// and adds the inputs past the last multiple of 16 one by one: a product's value does not depend on
// how many rows the pass holds, so a verification pass equals the decode steps it replaces bit for bit.
// One activation row (a decode step) reads the weight row after row, in memory order (each thread's
// contiguous range of rows one stream; two chains of multiply-adds keep up with ~20 GB/s a core), and
// asks for the weight 1 KB ahead of its reads: on a 2-core Zen 2 the Qwen 1.5B's decode step at 1K
// went 110 -> 93 ms with it, the hardware prefetcher alone leaving the core stalled. Wider passes
// take two weight rows at a time for three activation rows at a time (12 sums in registers), the two
// rows staying in L1 for the next three.
//
// Panels (rows_times_panels_avx2): the same product over a weight packed once by cascade.panels as
// [O / 16, I, 16], each input's 16 output values side by side. Each input of a pass is broadcast
// against a panel's 16 values (one 256-bit load, widened into the even and the odd outputs by the
// shift and the mask, put back in order once per panel), so a pass of up to 6 activation rows holds
// 12 sums in registers and spends one load and two widenings per 12 multiply-adds, where the [O, I]
// order above spends 17 loads and 4 widenings: its passes of 3-9 rows ran at ~50 GF/s a Zen 2 core,
// panels at ~80-90. Every output's sum runs over the inputs in order in one float32 multiply-add
// chain, whatever the pass's width. A one-row product reads 4 panels at once (8 independent chains, 4
// streams). A wider pass takes 6 panels at a time, each group of up to 6 rows walking them in turn,
// groups of 2-4 rows 1.5-3 panels at once (more streams in flight), and asks for its panels' lines 3 KB
// ahead of its reads (1 KB left the cores waiting on memory): over a 17920 x 1536 matrix from memory,
// passes of 2-8 rows ran 1.13-1.25x the GF/s (4 rows ~98 against ~78), the Qwen 1.5B's passes of 2-8
// tokens at 1K took 0.90-0.95x as long. In cache the GF/s did not change (4 rows ~140, 6 ~172).

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "products.h"
#include "vector_math.h"

#if defined(CASCADE_AVX2)

namespace {

using at::BFloat16;
using cascade_vector::even_values;
using cascade_vector::odd_values;
using cascade_vector::sum8;

constexpr int64_t kBlockInputs = 16;  // bf16 inputs per 256-bit load
constexpr int64_t kActivationRows = 3;  // activation rows a block of weight rows meets at once
constexpr int64_t kPassRows = 2;  // weight rows a block of a pass wider than one row holds
constexpr int64_t kAheadInputs = 512;  // how far ahead of its reads a one-row product asks for the weight

// rows [T, I] bf16 -> [T, I / 16 * 16] float32, each 16 inputs as their 8 even values then their 8 odd ones.
at::Tensor widened_rows(const at::Tensor& rows) {
  const int64_t num_rows = rows.size(0), inner = rows.size(1), width = inner / kBlockInputs * kBlockInputs;
  at::Tensor out = at::empty({num_rows, width}, rows.options().dtype(at::kFloat));
  const auto* source = rows.data_ptr<BFloat16>();
  float* target = out.data_ptr<float>();
  for (int64_t t = 0; t < num_rows; ++t) {
    for (int64_t i = 0; i < width; i += kBlockInputs) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + t * inner + i));
      _mm256_storeu_ps(target + t * width + i, even_values(pairs));
      _mm256_storeu_ps(target + t * width + i + 8, odd_values(pairs));
    }
  }
  return out;
}

// The products of the inputs past the last multiple of 16, one by one in order.
inline float tail_sum(const BFloat16* row, const BFloat16* weight_row, int64_t from, int64_t inner) {
  float sum = 0.f;
  for (int64_t i = from; i < inner; ++i) sum += static_cast<float>(row[i]) * static_cast<float>(weight_row[i]);
  return sum;
}

struct Operands {
  const BFloat16* rows;  // [T, I]
  const float* widened;  // [T, width] (widened_rows)
  const BFloat16* weight;  // [O, I]
  float* out;  // [T, O]
  int64_t inner, width, outputs;
};

// out[row + t, o + r] for t < Acts activation rows and r < Rows weight rows (2 x Acts x Rows <= 12
// accumulators, the activations read as operands of the multiply-adds).
template <int Acts, int Rows>
__attribute__((always_inline)) inline void tile(const Operands& op, int64_t row, int64_t o) {
  __m256 even[Acts][Rows], odd[Acts][Rows];
  for (int t = 0; t < Acts; ++t) {
    for (int r = 0; r < Rows; ++r) even[t][r] = odd[t][r] = _mm256_setzero_ps();
  }
  const BFloat16* weight_rows = op.weight + o * op.inner;
  const float* x = op.widened + row * op.width;
  for (int64_t i = 0; i < op.width; i += kBlockInputs) {
    __m256 w_even[Rows], w_odd[Rows];
    for (int r = 0; r < Rows; ++r) {
      if constexpr (Rows > 1) {  // the next block's rows, as fast as this block reads its own
        _mm_prefetch(reinterpret_cast<const char*>(weight_rows + (Rows + r) * op.inner + i), _MM_HINT_T0);
      } else if constexpr (Acts == 1) {
        _mm_prefetch(reinterpret_cast<const char*>(weight_rows + kAheadInputs + i), _MM_HINT_T0);
      }
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight_rows + r * op.inner + i));
      w_even[r] = even_values(pairs);
      w_odd[r] = odd_values(pairs);
    }
    for (int t = 0; t < Acts; ++t) {
      for (int r = 0; r < Rows; ++r) {
        even[t][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * op.width + i), w_even[r], even[t][r]);
        odd[t][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * op.width + i + 8), w_odd[r], odd[t][r]);
      }
    }
  }
  for (int t = 0; t < Acts; ++t) {
    for (int r = 0; r < Rows; ++r) {
      const float tail = tail_sum(op.rows + (row + t) * op.inner, weight_rows + r * op.inner, op.width, op.inner);
      op.out[(row + t) * op.outputs + o + r] = sum8(_mm256_add_ps(even[t][r], odd[t][r])) + tail;
    }
  }
}

// Weight rows [o, o + Rows) times every activation row, 3 at a time, then the 1 or 2 left.
template <int Rows>
inline void weight_rows(const Operands& op, int64_t num_rows, int64_t o) {
  int64_t row = 0;
  for (; row + kActivationRows <= num_rows; row += kActivationRows) tile<kActivationRows, Rows>(op, row, o);
  if (num_rows - row == 2) tile<2, Rows>(op, row, o);
  if (num_rows - row == 1) tile<1, Rows>(op, row, o);
}

constexpr int64_t kPanelOutputs = 16;  // outputs per panel: 8 float32 lanes from each half of 16 bf16
constexpr int64_t kPanelActs = 6;  // activation rows a panel meets at once: 12 sums in registers
constexpr int64_t kStepPanels = 4;  // panels a one-row product reads at once: 8 sums in registers
constexpr int64_t kPanelAheadBytes = 3072;  // how far ahead a wider pass asks for its panel's lines
constexpr int64_t kChunkPanels = 6;  // panels a wider pass's row groups take in turn (288 KB at 1536 inputs)

inline __m256 odd_values_by_shifts(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(pairs, 16), 16));
}

struct PanelOperands {
  const float* rows;  // [T, I] float32
  const BFloat16* panels;  // [P, I, 16]: at [p, i, j] the weight of output 16 p + j for input i
  float* out;  // [T, 16 P]
  int64_t inner, outputs;
};

// A panel's 16 sums of one row, held as its even and its odd outputs, put back in order into out.
inline void store_panel(const PanelOperands& op, int64_t row, int64_t panel, __m256 even, __m256 odd) {
  float* out = op.out + row * op.outputs + panel * kPanelOutputs;
  const __m256 low = _mm256_unpacklo_ps(even, odd);  // outputs 0-3 and 8-11
  const __m256 high = _mm256_unpackhi_ps(even, odd);  // outputs 4-7 and 12-15
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(low, high, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(low, high, 0x31));
}

// Input i of `Rows` activation rows (x, op.inner apart) against a panel's line of 16 values: each of the
// rows' 16 sums (held as the even and the odd outputs) takes its next multiply-add.
template <int Rows, bool NoMask>
__attribute__((always_inline)) inline void line_sums(const PanelOperands& op, const BFloat16* line, const float* x,
                                                     int64_t i, __m256 (&even)[Rows], __m256 (&odd)[Rows]) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  const __m256 w_even = even_values(pairs), w_odd = NoMask ? odd_values_by_shifts(pairs) : odd_values(pairs);
  for (int t = 0; t < Rows; ++t) {
    const __m256 input = _mm256_broadcast_ss(x + t * op.inner + i);
    even[t] = _mm256_fmadd_ps(input, w_even, even[t]);
    odd[t] = _mm256_fmadd_ps(input, w_odd, odd[t]);
  }
}

// out[row + t, 16 (panel + q) + j] for t < Acts activation rows, q < Panels panels, j < 16: each sum one
// multiply-add chain over the inputs in order (2 x Acts x Panels <= 12 accumulators).
template <int Acts, int Panels>
__attribute__((always_inline)) inline void panel_tile(const PanelOperands& op, int64_t row, int64_t panel) {
  __m256 even[Panels][Acts], odd[Panels][Acts];  // outputs 0, 2, .., 14 and 1, 3, .., 15 of each panel
  for (int q = 0; q < Panels; ++q) {
    for (int t = 0; t < Acts; ++t) even[q][t] = odd[q][t] = _mm256_setzero_ps();
  }
  const BFloat16* first = op.panels + panel * op.inner * kPanelOutputs;
  const float* x = op.rows + row * op.inner;
  // 12 sums over two panels leave no register for odd_values' mask (one sum went to the stack, a
  // 3-row product ran 1.2x as long): the odd values by two shifts instead
  constexpr bool kNoMask = Acts * Panels >= 6 && Panels > 1;
  for (int64_t i = 0; i < op.inner; ++i) {
    for (int q = 0; q < Panels; ++q) {
      const BFloat16* line = first + (q * op.inner + i) * kPanelOutputs;
      if constexpr (Acts > 1) {  // a line holds 2 inputs' values
        if ((i & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(line) + kPanelAheadBytes, _MM_HINT_T0);
      }
      line_sums<Acts, kNoMask>(op, line, x, i, even[q], odd[q]);
    }
  }
  for (int q = 0; q < Panels; ++q) {
    for (int t = 0; t < Acts; ++t) store_panel(op, row + t, panel + q, even[q][t], odd[q][t]);
  }
}

// Rows [row_a, row_a + RowsA) of panel_a and [row_b, row_b + RowsB) of panel_b in one walk over the
// inputs (2 x (RowsA + RowsB) <= 12 sums): a pass of 4 rows takes 3 panels in two such tiles, two
// streams each (one panel at a time from memory: ~86 GF/s, these ~98).
template <int RowsA, int RowsB>
__attribute__((always_inline)) inline void panel_pair_tile(const PanelOperands& op, int64_t row_a, int64_t panel_a,
                                                           int64_t row_b, int64_t panel_b) {
  __m256 even_a[RowsA], odd_a[RowsA], even_b[RowsB], odd_b[RowsB];
  for (int t = 0; t < RowsA; ++t) even_a[t] = odd_a[t] = _mm256_setzero_ps();
  for (int t = 0; t < RowsB; ++t) even_b[t] = odd_b[t] = _mm256_setzero_ps();
  const BFloat16* values_a = op.panels + panel_a * op.inner * kPanelOutputs;
  const BFloat16* values_b = op.panels + panel_b * op.inner * kPanelOutputs;
  const float* x_a = op.rows + row_a * op.inner;
  const float* x_b = op.rows + row_b * op.inner;
  asm("" : "+r"(x_b));  // B's inputs read apart from A's (not kept in registers across both: a sum would spill)
  for (int64_t i = 0; i < op.inner; ++i) {
    const BFloat16* line_a = values_a + i * kPanelOutputs;
    const BFloat16* line_b = values_b + i * kPanelOutputs;
    if ((i & 1) == 0) {  // a line holds 2 inputs' values
      _mm_prefetch(reinterpret_cast<const char*>(line_a) + kPanelAheadBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(line_b) + kPanelAheadBytes, _MM_HINT_T0);
    }
    line_sums<RowsA, true>(op, line_a, x_a, i, even_a, odd_a);
    line_sums<RowsB, true>(op, line_b, x_b, i, even_b, odd_b);
  }
  for (int t = 0; t < RowsA; ++t) store_panel(op, row_a + t, panel_a, even_a[t], odd_a[t]);
  for (int t = 0; t < RowsB; ++t) store_panel(op, row_b + t, panel_b, even_b[t], odd_b[t]);
}

// One panel times `count` activation rows from `row` (1 <= count <= 6). Inlined where it is called: out of
// line, GCC also stored every sum to the stack at each input, and passes of 5-6 rows took 1.4-1.6x as long.
__attribute__((always_inline)) inline void panel_rows(const PanelOperands& op, int64_t row, int64_t count,
                                                      int64_t panel) {
  switch (count) {
    case 6: return panel_tile<6, 1>(op, row, panel);
    case 5: return panel_tile<5, 1>(op, row, panel);
    case 4: return panel_tile<4, 1>(op, row, panel);
    case 3: return panel_tile<3, 1>(op, row, panel);
    case 2: return panel_tile<2, 1>(op, row, panel);
    default: return panel_tile<1, 1>(op, row, panel);
  }
}

// kChunkPanels panels from `panel` times `count` activation rows from `row` (2 <= count <= 6), in tiles of
// 10-12 sums: 2 rows 3 panels at a time, 3 rows 2, 4 rows 1.5 (panel_pair_tile), 5-6 rows 1.
inline void chunk_rows(const PanelOperands& op, int64_t row, int64_t count, int64_t panel) {
  static_assert(kChunkPanels % 6 == 0, "a chunk holds whole tiles of 1.5, 2 and 3 panels");
  for (int64_t q = panel; q < panel + kChunkPanels;) {
    switch (count) {
      case 2: panel_tile<2, 3>(op, row, q), q += 3; break;
      case 3: panel_tile<3, 2>(op, row, q), q += 2; break;
      case 4:
        panel_pair_tile<4, 2>(op, row, q, row, q + 1);
        panel_pair_tile<2, 4>(op, row + 2, q + 1, row, q + 2), q += 3;
        break;
      default: panel_rows(op, row, count, q), q += 1;
    }
  }
}

// f(row, count) for each group of a pass's rows: as few groups of at most 6 as there can be, of sizes
// as even as they can be (7 rows: 4 and 3).
template <typename F>
inline void for_each_row_group(int64_t num_rows, F f) {
  const int64_t groups = (num_rows + kPanelActs - 1) / kPanelActs;
  for (int64_t group = 0, row = 0; group < groups; ++group) {
    const int64_t left = groups - group, count = (num_rows - row + left - 1) / left;
    f(row, count);
    row += count;
  }
}

// Panels [begin, end) times every activation row: one row 4 panels at a time; more rows kChunkPanels
// panels at a time, which each group of rows walks in turn (the first from memory, the rest from L2),
// and the panels left one at a time.
void panel_range(const PanelOperands& op, int64_t num_rows, int64_t begin, int64_t end) {
  int64_t panel = begin;
  if (num_rows == 1) {
    for (; panel + kStepPanels <= end; panel += kStepPanels) panel_tile<1, kStepPanels>(op, 0, panel);
  } else {
    for (; panel + kChunkPanels <= end; panel += kChunkPanels) {
      for_each_row_group(num_rows, [&](int64_t row, int64_t count) { chunk_rows(op, row, count, panel); });
    }
  }
  for (; panel < end; ++panel) {
    for_each_row_group(num_rows, [&](int64_t row, int64_t count) { panel_rows(op, row, count, panel); });
  }
}

// rows [T, I] bf16 -> float32 [T, I], exactly (each value's bits the high half of a float), by hand: a
// tensor conversion's set-up took a few microseconds, a share of a small product's time.
at::Tensor widened_in_order(const at::Tensor& rows) {
  const at::Tensor source = rows.contiguous();
  at::Tensor out = at::empty(source.sizes(), source.options().dtype(at::kFloat));
  const auto* from = source.data_ptr<BFloat16>();
  float* to = out.data_ptr<float>();
  const int64_t count = source.numel(), whole = count / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) _mm256_storeu_ps(to + i, cascade_vector::widen8(from + i));
  for (int64_t i = whole; i < count; ++i) to[i] = static_cast<float>(from[i]);
  return out;
}

}  // namespace

namespace cascade_kernels {

at::Tensor rows_times_panels_avx2(const at::Tensor& rows, const at::Tensor& panels) {
  const at::Tensor widened = widened_in_order(rows);  // [T, I], exact
  const int64_t num_rows = widened.size(0), inner = widened.size(1), count = panels.size(0);
  at::Tensor out = at::empty({num_rows, count * kPanelOutputs}, widened.options());
  const PanelOperands op{widened.data_ptr<float>(), panels.data_ptr<BFloat16>(), out.data_ptr<float>(), inner,
                         count * kPanelOutputs};
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(kStepPanels, (count + threads - 1) / threads);  // a range per thread
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { panel_range(op, num_rows, begin, end); });
  return out;
}

at::Tensor rows_times_weight_avx2(const at::Tensor& rows, const at::Tensor& weight) {
  const at::Tensor packed = rows.contiguous();
  const int64_t num_rows = packed.size(0), inner = packed.size(1), outputs = weight.size(0);
  at::Tensor out = at::empty({num_rows, outputs}, packed.options().dtype(at::kFloat));
  const at::Tensor widened = widened_rows(packed);
  const Operands op{packed.data_ptr<BFloat16>(), widened.data_ptr<float>(), weight.data_ptr<BFloat16>(),
                    out.data_ptr<float>(), inner, widened.size(1), outputs};
  const int64_t block_rows = num_rows == 1 ? 1 : kPassRows, blocks = outputs / block_rows;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (blocks + threads - 1) / threads);  // a range of rows per thread
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      if (num_rows == 1) {
        tile<1, 1>(op, 0, block);
      } else {
        weight_rows<kPassRows>(op, num_rows, block * kPassRows);
      }
    }
  });
  if (blocks * block_rows < outputs) weight_rows<1>(op, num_rows, outputs - 1);
  return out;
}

}  // namespace cascade_kernels

#endif  // CASCADE_AVX2
