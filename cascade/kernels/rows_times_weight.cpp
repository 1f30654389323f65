// A few activation rows times a bf16 weight matrix at the speed of memory.
//
// rows [T, I] bf16 x weight [O, I] bf16 -> out [T, O] float32, out[t, o] = sum_i rows[t, i] * weight[o, i].
// A decode step or a verification pass multiplies 1-16 rows by every weight matrix of the model, so
// the product is bound by reading the weight once. The weight's rows are split between the threads
// in contiguous ranges (each thread streams its own part of the matrix). With AMX, 32 weight rows at
// a time meet every activation row in tiles (the main path). Otherwise (and for the last O mod 32
// rows, input sizes that are not multiples of 32, or AMX turned off by `set_amx`, which the tests use
// to check both paths) AVX512-BF16 dot products (32 bf16 pairs per instruction, float32
// accumulation) take blocks of 4 weight rows for every activation row: a block goes across its 4
// rows, and while it is multiplied the next one (the rows that follow it in memory) is asked for
// line by line, as fast as the block reads its own: without that, rows of a few hundred inputs
// streamed at half the memory's speed. A one-row product (a decode step) goes across blocks of 2
// rows: on a 2-core Zen 5 EPYC the Qwen2.5 1.5B's down projection (8,960 inputs a row) streamed at
// 38 GB/s against 32 across 4 rows (both asking for the next block into L2; 40 asking into L1), its
// other matrices 1-4% faster, SmolLM2's as fast. It can instead read blocks of 16 rows row after row,
// in memory order, so each thread's part of the weight is one stream the hardware prefetcher follows
// (`set_step_in_memory_order`, from `Tuning.step_in_memory_order`): on an earlier 2-core EPYC
// (Zen 4) that read 25.6 GB/s a thread against 19.5 going across 16 rows a line at a time; on a
// Zen 5 EPYC going across blocks streamed 1.04-1.30x faster than memory order.
//
// Built with -march=native: on a CPU without AVX512-BF16 but with AVX2 and FMA the product is
// rows_times_weight_avx2.cpp's (`features()` says "avx2"); with neither, the Python side keeps
// PyTorch's kernels and the op refuses to run.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "products.h"
#include "quantised_rows.h"
#include "tiles.h"
#include "vector_math.h"

namespace {

void set_amx(bool on) { cascade_tiles::use_amx = on; }

// How a one-row product (a decode step) reads its part of the weight: row after row in blocks of 16
// (memory order, true), or across blocks of 2 rows with the next block asked for, as wider passes go
// across blocks of 4 (false). Which streams faster depends on the CPU's prefetchers: `python -m
// cascade.tune` times both, and `cascade.kernels` sets what it chose at load. The values are the
// same bits either way.
bool step_in_memory_order = false;
void set_step_in_memory_order(bool on) { step_in_memory_order = on; }

constexpr int64_t kWeightRows = 4;  // weight rows per block: read once, reused by every activation row
constexpr int64_t kActivationRows = 4;  // activation rows per tile: 16 accumulators in registers
constexpr int64_t kStepRows = 16;  // weight rows per block of a one-row product read in memory order: 16 accumulators
constexpr int64_t kStepAcrossRows = 2;  // weight rows per block of a one-row product read across
constexpr int64_t kLanes = 32;  // bf16 values per 512-bit register
constexpr int64_t kTileSums = 16;  // accumulators per tile, one float32 lane each of their horizontal sum
constexpr int64_t kFewSums = 4;  // a tile of at most this many sums adds each one's lanes by itself
constexpr int64_t kShareRows = 32;  // a thread's share of a product is whole units of this many weight rows

#if defined(__AVX512BF16__)

constexpr __mmask32 kAllLanes = ~__mmask32{0};

// Lanes [0, count) of a register (count < 32): the inputs a block's last step has left.
inline __mmask32 first_lanes(int64_t count) { return (__mmask32)((1u << count) - 1); }

inline __m512bh load_bf16(const at::BFloat16* source, __mmask32 lanes) {
  return (__m512bh)_mm512_maskz_loadu_epi16(lanes, source);  // zeros past the end add nothing
}

// The lanes of inputs [i, i + 32) that lie before `inner`. A mask chosen without a branch: with a
// branch between a plain and a masked load, GCC stored every accumulator to the stack each step.
inline __mmask32 lanes_from(int64_t i, int64_t inner) {
  return inner - i >= kLanes ? kAllLanes : first_lanes(inner - i);
}

// out[row + t, o + r] for t < Tiles activation rows and r < Rows weight rows (Tiles x Rows <= 16
// accumulators). Each sum runs over the inputs in order, then all of them go through one
// horizontal sum (sum_each), which adds every lane's values in the same order: a product's value
// does not depend on the block shape that computed it, so passes of any width agree bit for bit.
// A block of a few sums (a decode step's 2) takes each one's _mm512_reduce_add_ps instead, which
// in GCC's definition adds its lanes in sum_each's order (halves, quarters, then lanes 0 + 2 and
// 1 + 3, then those two) without folding 16 registers: SmolLM2's step went through 77,760 such blocks.
// Always inlined: compiled on its own (as GCC 12 chose for the threads' copy of the caller), it
// stored all 16 accumulators to the stack every step, and two threads multiplied at the speed of one.
// The next block's lines are asked for into L1 (_MM_HINT_T0): on a 2-core Zen 5 EPYC passes of 2, 4
// and 8 rows through the Qwen2.5 1.5B's matrices streamed 1.15x, 1.06x and 1.11x faster than into L2
// (SmolLM2's: 1.04x, 1.05x, 1.29x).
template <int64_t Tiles, int64_t Rows>
__attribute__((always_inline)) inline void block_tile(const at::BFloat16* rows, const at::BFloat16* weight,
                                                      float* out, int64_t row, int64_t o, int64_t inner,
                                                      int64_t outputs) {
  static_assert(Tiles * Rows <= kTileSums);
  __m512 acc[kTileSums];  // lane t * Rows + r of their horizontal sum is out[row + t, o + r]; the rest stay 0
  for (int64_t j = 0; j < kTileSums; ++j) acc[j] = _mm512_setzero_ps();
  // the next block of weight rows, as many 64-byte lines asked for per step as the step reads (it
  // follows this one in memory): each block's reads find its lines on their way
  const char* next_block = reinterpret_cast<const char*>(weight + (o + Rows) * inner);
  for (int64_t i = 0; i < inner; i += kLanes) {
    const __mmask32 lanes = lanes_from(i, inner);
    __m512bh w[Rows];
    for (int64_t r = 0; r < Rows; ++r) {
      _mm_prefetch(next_block + (i / kLanes * Rows + r) * 64, _MM_HINT_T0);
      w[r] = load_bf16(weight + (o + r) * inner + i, lanes);
    }
    for (int64_t t = 0; t < Tiles; ++t) {
      const __m512bh x = load_bf16(rows + (row + t) * inner + i, lanes);
      for (int64_t r = 0; r < Rows; ++r) acc[t * Rows + r] = _mm512_dpbf16_ps(acc[t * Rows + r], x, w[r]);
    }
  }
  if constexpr (Tiles * Rows <= kFewSums) {
    for (int64_t t = 0; t < Tiles; ++t) {
      for (int64_t r = 0; r < Rows; ++r) out[(row + t) * outputs + o + r] = _mm512_reduce_add_ps(acc[t * Rows + r]);
    }
    return;
  }
  alignas(64) float sums[kTileSums];
  _mm512_store_ps(sums, cascade_vector::sum_each(acc));
  for (int64_t t = 0; t < Tiles; ++t) std::memcpy(out + (row + t) * outputs + o, sums + t * Rows, sizeof(float) * Rows);
}

// out[o + r] for one activation row and weight rows r < Rows, each row read whole before the next
// (memory order). Each sum runs over the inputs in order in its own accumulator and goes through
// sum_each as block_tile's do, so the values are the same bits as block_tile<1, Rows>'s.
template <int64_t Rows>
__attribute__((always_inline)) inline void row_after_row(const at::BFloat16* row, const at::BFloat16* weight,
                                                        float* out, int64_t o, int64_t inner) {
  static_assert(Rows <= kTileSums);
  __m512 acc[kTileSums];
  for (int64_t j = 0; j < kTileSums; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r) {
    const at::BFloat16* weight_row = weight + (o + r) * inner;
    for (int64_t i = 0; i < inner; i += kLanes) {
      const __mmask32 lanes = lanes_from(i, inner);
      acc[r] = _mm512_dpbf16_ps(acc[r], load_bf16(row + i, lanes), load_bf16(weight_row + i, lanes));
    }
  }
  alignas(64) float sums[kTileSums];
  _mm512_store_ps(sums, cascade_vector::sum_each(acc));
  std::memcpy(out + o, sums, sizeof(float) * Rows);
}

// Every activation row times weight rows [o, o + kWeightRows).
inline void weight_block(const at::BFloat16* rows, const at::BFloat16* weight, float* out,
                         int64_t num_rows, int64_t o, int64_t inner, int64_t outputs) {
  int64_t row = 0;
  for (; row + kActivationRows <= num_rows; row += kActivationRows) {
    block_tile<kActivationRows, kWeightRows>(rows, weight, out, row, o, inner, outputs);
  }
  switch (num_rows - row) {
    case 3: block_tile<3, kWeightRows>(rows, weight, out, row, o, inner, outputs); break;
    case 2: block_tile<2, kWeightRows>(rows, weight, out, row, o, inner, outputs); break;
    case 1: block_tile<1, kWeightRows>(rows, weight, out, row, o, inner, outputs); break;
    default: break;
  }
}

// One weight row (the last O % kWeightRows) times every activation row.
inline void single_row(const at::BFloat16* rows, const at::BFloat16* weight, float* out,
                       int64_t num_rows, int64_t o, int64_t inner, int64_t outputs) {
  for (int64_t t = 0; t < num_rows; ++t) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < inner; i += kLanes) {
      const __mmask32 lanes = lanes_from(i, inner);
      acc = _mm512_dpbf16_ps(acc, load_bf16(rows + t * inner + i, lanes), load_bf16(weight + o * inner + i, lanes));
    }
    out[t * outputs + o] = _mm512_reduce_add_ps(acc);
  }
}

#endif  // __AVX512BF16__

#if defined(__AMX_BF16__)

// AMX: a 16 x 32 tile of the weight (16 rows, 32 inputs) times 32 inputs of every activation row,
// accumulated into a 16 x T float32 tile. The weight tile is loaded straight from the matrix; the
// activations are repacked once per call into AMX's pair-interleaved layout: [I / 2, T] pairs.
using cascade_tiles::configure_tiles;
using cascade_tiles::kTileInputs;
using cascade_tiles::kTileRows;
using cascade_tiles::pair_interleave;
constexpr int64_t kTileBlocks = 2;  // weight tiles in flight (independent accumulators)

// Weight rows [o, o + 32) times every activation row.
inline void amx_block(const at::BFloat16* pairs, const at::BFloat16* weight, float* out, float* scratch,
                      int64_t num_rows, int64_t o, int64_t inner, int64_t outputs) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t stride = inner * 2;
  for (int64_t i = 0; i < inner; i += kTileInputs) {
    _tile_loadd(4, pairs + i * num_rows, num_rows * 4);
    _tile_loadd(2, weight + o * inner + i, stride);
    _tile_loadd(3, weight + (o + kTileRows) * inner + i, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  _tile_stored(0, scratch, num_rows * 4);
  _tile_stored(1, scratch + kTileRows * num_rows, num_rows * 4);
  for (int64_t r = 0; r < kTileBlocks * kTileRows; ++r) {
    for (int64_t t = 0; t < num_rows; ++t) out[t * outputs + o + r] = scratch[r * num_rows + t];
  }
}

bool amx_applies(int64_t num_rows, int64_t inner) {
  return num_rows <= 16 && inner % kTileInputs == 0;
}

#endif

#if defined(__AVX512BF16__)

// Weight rows [first, last) times every activation row, on the calling thread: with AMX those below
// the last whole 32 in tiles, then (a one-row product) blocks of 16 in memory order or of 2 across,
// (wider) blocks of 4, and single rows for what is left. `first` is a multiple of 32 and `last` one
// or the weight's end, so every output row takes the path it takes in a product of all the rows.
void weight_rows(const at::Tensor& rows, const at::BFloat16* weight, float* out, int64_t outputs, int64_t first,
                 int64_t last) {
  const int64_t num_rows = rows.size(0), inner = rows.size(1);
  const auto* rows_data = rows.data_ptr<at::BFloat16>();
  int64_t o = first;
#if defined(__AMX_BF16__)
  const int64_t tiled_end = std::min(last, outputs - outputs % (kTileBlocks * kTileRows));
  if (cascade_tiles::use_amx && amx_applies(num_rows, inner) && o < tiled_end) {
    const at::Tensor pairs = pair_interleave(rows);
    configure_tiles(num_rows);
    float scratch[kTileBlocks * kTileRows * 16];
    for (; o < tiled_end; o += kTileBlocks * kTileRows) {
      amx_block(pairs.data_ptr<at::BFloat16>(), weight, out, scratch, num_rows, o, inner, outputs);
    }
    _tile_release();
  }
#endif
  if (num_rows == 1 && step_in_memory_order) {
    for (; o + kStepRows <= last; o += kStepRows) row_after_row<kStepRows>(rows_data, weight, out, o, inner);
  } else if (num_rows == 1) {
    for (; o + kStepAcrossRows <= last; o += kStepAcrossRows) {
      block_tile<1, kStepAcrossRows>(rows_data, weight, out, 0, o, inner, outputs);
    }
  }
  for (; o + kWeightRows <= last; o += kWeightRows) weight_block(rows_data, weight, out, num_rows, o, inner, outputs);
  for (; o < last; ++o) single_row(rows_data, weight, out, num_rows, o, inner, outputs);
}

#endif

}  // namespace

namespace cascade_kernels {

#if defined(__AVX512BF16__)

void rows_times_weight_share(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& out, int64_t thread,
                             int64_t threads) {
  const int64_t outputs = weight.size(0);
  const auto [first_unit, end_unit] = thread_range((outputs + kShareRows - 1) / kShareRows, thread, threads);
  const int64_t first = first_unit * kShareRows, last = std::min(outputs, end_unit * kShareRows);
  if (first < last) weight_rows(rows, weight.data_ptr<at::BFloat16>(), out.data_ptr<float>(), outputs, first, last);
}

#endif

at::Tensor rows_times_weight(const at::Tensor& rows, const at::Tensor& weight) {
  const bool panels = weight.dim() == 3;
  TORCH_CHECK(rows.dim() == 2 && (weight.dim() == 2 || (panels && weight.size(2) == 16)),
              "rows_times_weight: rows [T, I] and weight [O, I] (or panels [O / 16, I, 16]); got ", rows.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(rows.size(1) == weight.size(1), "rows_times_weight: rows have ", rows.size(1),
              " columns, the weight ", weight.size(1));
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "rows_times_weight: bfloat16 rows and weight; got ", rows.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "rows_times_weight: the weight must be contiguous");
#if defined(__AVX512BF16__)
  TORCH_CHECK(!panels, "rows_times_weight: weights in panels are for AVX2 builds; this one has AVX512-BF16");
  const at::Tensor packed = rows.contiguous();
  at::Tensor out = at::empty({packed.size(0), weight.size(0)}, packed.options().dtype(at::kFloat));
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (weight.size(0) + 63) / 64);  // 64 rows or more each
  on_threads(threads, [&](int64_t thread, int64_t team) {
    rows_times_weight_share(packed, weight, out, thread, team);
  });
  return out;
#elif defined(CASCADE_AVX2)
  return panels ? rows_times_panels_avx2(rows, weight) : rows_times_weight_avx2(rows, weight);
#else
  TORCH_CHECK(false, "rows_times_weight: this build has neither AVX512-BF16 nor AVX2 with FMA (see features())");
  return {};
#endif
}

}  // namespace cascade_kernels

namespace {

// The instruction sets this build compiled its kernels for (-march=native): "avx512_bf16" (the weight
// product, the layer ops and attention), or else "avx2" (the same ops in float32 arithmetic),
// "amx_bf16" (tiles for both), "avx512_vnni" and "amx_int8" (the int8 and 4-bit products), or else
// "quantised_avx2" (those products by AVX2, FMA and F16C; quantised_rows.h).
std::vector<std::string> features() {
  std::vector<std::string> compiled;
#if defined(__AVX512BF16__)
  compiled.push_back("avx512_bf16");
#elif defined(CASCADE_AVX2)
  compiled.push_back("avx2");
#endif
#if defined(__AMX_BF16__)
  compiled.push_back("amx_bf16");
#endif
#if defined(CASCADE_QUANTISED_VNNI)
  compiled.push_back("avx512_vnni");
#elif defined(CASCADE_QUANTISED_AVX2)
  compiled.push_back("quantised_avx2");
#endif
#if defined(__AMX_INT8__) && defined(__AVX512BW__)
  compiled.push_back("amx_int8");
#endif
  return compiled;
}

}  // namespace

TORCH_LIBRARY(cascade_kernels, m) {
  m.def("rows_times_weight(Tensor rows, Tensor weight) -> Tensor");
  m.def("features() -> str[]", &features);
  m.def("set_amx(bool on) -> ()", &set_amx);
  m.def("set_step_in_memory_order(bool on) -> ()", &set_step_in_memory_order);
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) { m.impl("rows_times_weight", &cascade_kernels::rows_times_weight); }
