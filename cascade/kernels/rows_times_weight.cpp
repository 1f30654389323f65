// A few activation rows times a bf16 weight matrix at the speed of memory.
//
// rows [T, I] bf16 x weight [O, I] bf16 -> out [T, O] float32, out[t, o] = sum_i rows[t, i] * weight[o, i].
// A decode step or a verification pass multiplies 1-16 rows by every weight matrix of the model, so
// the product is bound by reading the weight once. The weight's rows are split between the threads
// in contiguous ranges (each thread streams its own part of the matrix). With AMX, 32 weight rows at
// a time meet every activation row in tiles (the main path); the rest (the last O mod 32 rows, input
// sizes that are not multiples of 32, or AMX turned off by `set_amx`, which the tests use to check
// both paths) go as blocks of four weight rows with AVX512-BF16 dot products (32 bf16 pairs per
// instruction, float32 accumulation).
//
// Built with -march=native: on a CPU without AVX512-BF16 `features()` lacks it, the Python
// side keeps PyTorch's kernels, and the op refuses to run.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "products.h"
#include "tiles.h"
#include "vector_math.h"

namespace {

void set_amx(bool on) { cascade_tiles::use_amx = on; }

constexpr int64_t kWeightRows = 4;  // weight rows per block: read once, reused by every activation row
constexpr int64_t kActivationRows = 4;  // activation rows per tile: 16 accumulators in registers
constexpr int64_t kLanes = 32;  // bf16 values per 512-bit register
constexpr int64_t kTileSums = kWeightRows * kActivationRows;  // 16: one float32 lane each
constexpr int64_t kPrefetchRows = 8;  // how far ahead of the rows it multiplies a block asks for weight rows

#if defined(__AVX512BF16__)

inline __m512bh load_bf16(const at::BFloat16* source, int64_t count) {
  if (count >= kLanes) {
    return (__m512bh)_mm512_loadu_si512(source);
  }
  const __mmask32 mask = (__mmask32)((1ull << count) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, source);  // zeros past the end add nothing
}

// out[t, o..o+R) for tiles of `tiles` activation rows starting at `row`, R = kWeightRows.
template <int64_t Tiles>
inline void block_tile(const at::BFloat16* rows, const at::BFloat16* weight, float* out,
                       int64_t row, int64_t o, int64_t inner, int64_t outputs) {
  __m512 acc[Tiles][kWeightRows];
  for (int64_t t = 0; t < Tiles; ++t) {
    for (int64_t r = 0; r < kWeightRows; ++r) acc[t][r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < inner; i += kLanes) {
    const int64_t count = inner - i;
    __m512bh w[kWeightRows];
    for (int64_t r = 0; r < kWeightRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(weight + (o + r + kPrefetchRows) * inner + i), _MM_HINT_T0);
      w[r] = load_bf16(weight + (o + r) * inner + i, count);
    }
    for (int64_t t = 0; t < Tiles; ++t) {
      const __m512bh x = load_bf16(rows + (row + t) * inner + i, count);
      for (int64_t r = 0; r < kWeightRows; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], x, w[r]);
    }
  }
  // one horizontal sum for all: lane t * R + r of `sums` is out[row + t, o + r]
  __m512 each[kTileSums];
  for (int64_t j = 0; j < kTileSums; ++j) each[j] = j < Tiles * kWeightRows ? acc[j / kWeightRows][j % kWeightRows]
                                                                           : _mm512_setzero_ps();
  alignas(64) float sums[kTileSums];
  _mm512_store_ps(sums, cascade_vector::sum_each(each));
  for (int64_t t = 0; t < Tiles; ++t) std::memcpy(out + (row + t) * outputs + o, sums + t * kWeightRows, sizeof(float) * kWeightRows);
}

// Every activation row times weight rows [o, o + kWeightRows).
inline void weight_block(const at::BFloat16* rows, const at::BFloat16* weight, float* out,
                         int64_t num_rows, int64_t o, int64_t inner, int64_t outputs) {
  int64_t row = 0;
  for (; row + kActivationRows <= num_rows; row += kActivationRows) {
    block_tile<kActivationRows>(rows, weight, out, row, o, inner, outputs);
  }
  switch (num_rows - row) {
    case 3: block_tile<3>(rows, weight, out, row, o, inner, outputs); break;
    case 2: block_tile<2>(rows, weight, out, row, o, inner, outputs); break;
    case 1: block_tile<1>(rows, weight, out, row, o, inner, outputs); break;
    default: break;
  }
}

// One weight row (the last O % kWeightRows) times every activation row.
inline void single_row(const at::BFloat16* rows, const at::BFloat16* weight, float* out,
                       int64_t num_rows, int64_t o, int64_t inner, int64_t outputs) {
  for (int64_t t = 0; t < num_rows; ++t) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < inner; i += kLanes) {
      const int64_t count = inner - i;
      acc = _mm512_dpbf16_ps(acc, load_bf16(rows + t * inner + i, count), load_bf16(weight + o * inner + i, count));
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

void amx_product(const at::Tensor& rows, const at::BFloat16* weight, float* out, int64_t outputs) {
  const int64_t num_rows = rows.size(0), inner = rows.size(1);
  const at::Tensor pairs = pair_interleave(rows);
  const auto* pairs_data = pairs.data_ptr<at::BFloat16>();
  const int64_t rows_per_block = kTileBlocks * kTileRows;
  const int64_t blocks = outputs / rows_per_block;
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, blocks, (blocks + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    configure_tiles(num_rows);
    float scratch[kTileBlocks * kTileRows * 16];
    for (int64_t block = begin; block < end; ++block) {
      amx_block(pairs_data, weight, out, scratch, num_rows, block * rows_per_block, inner, outputs);
    }
    _tile_release();
  });
}

#endif

}  // namespace

namespace cascade_kernels {

at::Tensor rows_times_weight(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 2, "rows_times_weight: rows [T, I] and weight [O, I]; got ",
              rows.sizes(), " and ", weight.sizes());
  TORCH_CHECK(rows.size(1) == weight.size(1), "rows_times_weight: rows have ", rows.size(1),
              " columns, the weight ", weight.size(1));
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "rows_times_weight: bfloat16 rows and weight; got ", rows.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "rows_times_weight: the weight must be contiguous");
#if defined(__AVX512BF16__)
  const at::Tensor packed = rows.contiguous();
  const int64_t num_rows = packed.size(0), inner = packed.size(1), outputs = weight.size(0);
  at::Tensor out = at::empty({num_rows, outputs}, packed.options().dtype(at::kFloat));
  const auto* rows_data = packed.data_ptr<at::BFloat16>();
  const auto* weight_data = weight.data_ptr<at::BFloat16>();
  float* out_data = out.data_ptr<float>();
  int64_t done = 0;  // weight rows already multiplied
#if defined(__AMX_BF16__)
  if (cascade_tiles::use_amx && amx_applies(num_rows, inner)) {
    amx_product(packed, weight_data, out_data, outputs);
    done = outputs - outputs % (kTileBlocks * kTileRows);
  }
#endif
  const int64_t blocks = (outputs - done) / kWeightRows;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (blocks + threads - 1) / threads);  // one range per thread
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      weight_block(rows_data, weight_data, out_data, num_rows, done + block * kWeightRows, inner, outputs);
    }
  });
  for (int64_t o = done + blocks * kWeightRows; o < outputs; ++o) {
    single_row(rows_data, weight_data, out_data, num_rows, o, inner, outputs);
  }
  return out;
#else
  TORCH_CHECK(false, "rows_times_weight: this build has no AVX512-BF16 (see features())");
  return {};
#endif
}

}  // namespace cascade_kernels

namespace {

// The instruction sets this build compiled its kernels for (-march=native): "avx512_bf16" (the weight
// product, the layer ops and attention), "amx_bf16" (tiles for both), "avx512_vnni" and "amx_int8" (the
// int8 product).
std::vector<std::string> features() {
  std::vector<std::string> compiled;
#if defined(__AVX512BF16__)
  compiled.push_back("avx512_bf16");
#endif
#if defined(__AMX_BF16__)
  compiled.push_back("amx_bf16");
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  compiled.push_back("avx512_vnni");
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
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) { m.impl("rows_times_weight", &cascade_kernels::rows_times_weight); }
