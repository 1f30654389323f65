// A few activation rows times an int8 weight with AMX, AVX512-VNNI or AVX2, at the speed of memory.
//
// rows [T, I] bf16 (T <= 16) x packed int8 weight with scales [O] -> out [T, O] float32, where
//   out[t, o] = scales[o] * sum_b row_scale[t, b] * sum_{i in block b} q[t, i] * w[o, i]
// and q[t, block b] = round(rows[t, block b] / row_scale[t, b]), row_scale[t, b] = max |rows[t, block b]| / 127,
// blocks of 64 inputs (one AMX tile row): the activations are quantised per 64 inputs as llama.cpp's
// q8_0 quantises them per 32, so an outlier costs precision only in its own block.
//
// The weight (int8, one scale per output row) is packed once, when a model is quantised
// (cascade/quantise.py), in the layout of an AMX int8 product's second operand: for every block of 16
// output rows and 64 inputs, 16 rows of 64 bytes, row k holding inputs 4k..4k+3 of each of the 16
// outputs: packed[O / 16, I / 64, 16, 64]. Each 16-output block is one contiguous stream the hardware
// prefetcher follows; O and I are padded (with zeros) to multiples of 16 and 64 by the packer.
//
// Per 64 inputs, one tile product of the quantised activations [T, 64] and a weight block gives
// [T, 16] int32 sums, which are scaled by that block's activation scales into float32 accumulators.
// Without AMX, AVX512-VNNI computes the same int32 sums (exactly: the two paths' outputs are equal):
// each of the block's 16 rows meets its activation quad broadcast to the 16 output lanes; without
// AVX512-VNNI, AVX2 does the same in two 8-output halves with two instructions (quantised_rows.h). Output
// blocks are split between the threads in contiguous ranges, so each thread reads one stream in
// memory order. For one activation row the hardware prefetcher keeps ahead of it alone: asking for
// the next block line by line as well made those products slower (on the 2-core EPYC a 1-row product
// over the Qwen2.5 0.5B's output matrix read 33-36 GB/s with it, 55-60 without). A wider pass, which
// spends longer on each block, asks for the next one as fast as it reads its own (without that, the
// 0.5B's 5-token passes took ~1.3x as long). The AVX2 path, which spends about twice the instructions
// on each block, asks at each of its 16 steps through a block for the same line of the next block
// (T0), at every width: a core stalled on its own loads keeps too few lines in flight otherwise. On a
// 2-core Zen 2 this loop alone, over a cold 256 MB weight in huge pages, read 13 GB/s on one core with
// nothing asked for (or with whole blocks asked for two ahead at once), 18 this way, where a plain read
// measured 19.6 (two cores: 26 and 35 GB/s); the Qwen 0.5B's int8 decode step at 1K went 26.1 -> 20.1 ms.
// An AVX2 one-row product then reads 4 output blocks' streams side by side (step_blocks), as the bf16
// panels do: more lines in flight again, the 0.5B's step 20.1 -> 16.5 ms (its output head 4.2 -> 3.4 ms).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "products.h"
#include "quantised_rows.h"
#include "tiles.h"

namespace {

constexpr int64_t kBlockOutputs = 16;  // output rows per packed block (int32 columns of a tile)
using cascade_quantised::activation_quad;
using cascade_quantised::kBlockInputs;  // inputs per packed block (int8 bytes of a tile row)
using cascade_quantised::kMaxRows;

#if defined(CASCADE_QUANTISED_VNNI)

using cascade_tiles::TileConfig;

#if defined(__AMX_INT8__)

// Tile 0: quantised activations [T, 64] int8; 1: a weight block [16 quads, 16 x 4] int8;
// 2: the product [T, 16] int32.
void configure_tiles(int64_t num_rows) {
  TileConfig config;
  config.rows[0] = num_rows;
  config.bytes_per_row[0] = kBlockInputs;
  config.rows[1] = kBlockInputs / 4;
  config.bytes_per_row[1] = kBlockOutputs * 4;
  config.rows[2] = num_rows;
  config.bytes_per_row[2] = kBlockOutputs * 4;
  _tile_loadconfig(&config);
}

// The int32 sums [T, 16] of one 64-input block: activations [T, 64] (row stride `stride`) times a
// weight block, by one AMX tile product.
void amx_block_sums(const int8_t* quantised, int64_t stride, const int8_t* weight_block, int64_t, int32_t* sums) {
  _tile_zero(2);
  _tile_loadd(0, quantised, stride);
  _tile_loadd(1, weight_block, kBlockOutputs * 4);
  _tile_dpbssd(2, 0, 1);
  _tile_stored(2, sums, kBlockOutputs * 4);
}

#endif  // __AMX_INT8__

// The same sums by AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so each activation quad
// goes in shifted by 128 (to 1..255) and 128 x the weight's sums per output come off; every partial
// sum stays far inside int32, so the result is exact.
void vnni_block_sums(const int8_t* quantised, int64_t stride, const int8_t* weight_block, int64_t num_rows,
                     int32_t* sums) {
  const __m512i shift = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
  __m512i weight_sums = _mm512_setzero_si512();
  for (int64_t k = 0; k < kBlockInputs / 4; ++k) {
    weight_sums = _mm512_dpbusd_epi32(weight_sums, ones, _mm512_loadu_si512(weight_block + k * kBlockOutputs * 4));
  }
  const __m512i correction = _mm512_slli_epi32(weight_sums, 7);
  for (int64_t t = 0; t < num_rows; ++t) {
    const int8_t* row = quantised + t * stride;
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = 0; k < kBlockInputs / 4; ++k) {
      const __m512i quad = _mm512_set1_epi32(activation_quad(row, k));
      const __m512i shifted = _mm512_xor_si512(quad, shift);  // byte + 128, as unsigned
      acc = _mm512_dpbusd_epi32(acc, shifted, _mm512_loadu_si512(weight_block + k * kBlockOutputs * 4));
    }
    _mm512_store_si512(sums + t * kBlockOutputs, _mm512_sub_epi32(acc, correction));
  }
}

#elif defined(CASCADE_QUANTISED_AVX2)

// The same sums by AVX2, 8 outputs per register: vpmaddubsw multiplies unsigned by signed bytes into
// saturating int16 pair sums, so each weight byte goes in as its magnitude and each activation byte
// takes the weight's sign (vpsignb); a pair's sum is at most 2 x 127 x 127 (weights and activations
// lie in -127..127), inside int16, and vpmaddwd adds the pairs into int32: exact, as VNNI's.
// The int32 sums of 8 outputs' weight quads (32 bytes) with an activation quad broadcast to every lane.
inline __m256i quad_sums(__m256i activations, const int8_t* weights) {
  const __m256i values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(values), _mm256_sign_epi8(activations, values));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

void avx2_block_sums(const int8_t* quantised, int64_t stride, const int8_t* weight_block, int64_t num_rows,
                     int32_t* sums) {
  const char* next_block = reinterpret_cast<const char*>(weight_block + kBlockInputs * kBlockOutputs);
  for (int64_t t = 0; t < num_rows; ++t) {
    const int8_t* row = quantised + t * stride;
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // outputs 0-7, 8-15
    for (int64_t k = 0; k < kBlockInputs / 4; ++k) {
      if (t == 0) _mm_prefetch(next_block + k * kBlockOutputs * 4, _MM_HINT_T0);  // line k of the next block
      const __m256i activations = _mm256_set1_epi32(activation_quad(row, k));
      for (int half = 0; half < 2; ++half) {
        const int8_t* weights = weight_block + k * kBlockOutputs * 4 + half * 32;
        acc[half] = _mm256_add_epi32(acc[half], quad_sums(activations, weights));
      }
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + t * kBlockOutputs), acc[0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + t * kBlockOutputs + 8), acc[1]);
  }
}

#endif

#if defined(CASCADE_QUANTISED_KERNELS)

#define CASCADE_INT8_KERNEL 1

using BlockSums = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int32_t*);

// Output rows [16 * block, 16 * block + 16) for every activation row.
void output_block(BlockSums block_sums, const int8_t* quantised, const float* row_scales, const int8_t* weight,
                  const float* scales, float* out, int64_t num_rows, int64_t blocks, int64_t outputs, int64_t block) {
  cascade_quantised::Floats16 acc[kMaxRows];
  alignas(64) int32_t sums[kMaxRows * kBlockOutputs];
  const int64_t block_bytes = kBlockInputs * kBlockOutputs;  // 16 lines: one packed 64-input block
  const int8_t* stream = weight + block * blocks * block_bytes;
#if !defined(CASCADE_QUANTISED_AVX2)
  const char* next_block = reinterpret_cast<const char*>(stream + blocks * block_bytes);  // the next 16 outputs
#endif
  for (int64_t b = 0; b < blocks; ++b) {
#if !defined(CASCADE_QUANTISED_AVX2)
    for (int64_t line = 0; num_rows > 1 && line < block_bytes; line += 64) {
      _mm_prefetch(next_block + b * block_bytes + line, _MM_HINT_T1);
    }
#endif
    block_sums(quantised + b * kBlockInputs, blocks * kBlockInputs, stream + b * kBlockInputs * kBlockOutputs,
               num_rows, sums);
    for (int64_t t = 0; t < num_rows; ++t) {
      acc[t].add_scaled(sums + t * kBlockOutputs, row_scales[b * num_rows + t]);
    }
  }
  const int64_t first = block * kBlockOutputs, count = std::min<int64_t>(kBlockOutputs, outputs - first);
  for (int64_t t = 0; t < num_rows; ++t) acc[t].store_times(out + t * outputs + first, scales + first, count);
}

#endif

#if defined(CASCADE_QUANTISED_AVX2)

constexpr int64_t kStepStreams = 4;  // output blocks a one-row product reads side by side (AVX2)

// Output rows [16 * block, 16 * (block + 4)) for one activation row: the 4 blocks' streams read side
// by side, each block's sums as avx2_block_sums forms them (the same integers, the same float32 steps).
void step_blocks(const int8_t* quantised, const float* row_scales, const int8_t* weight, const float* scales,
                 float* out, int64_t blocks, int64_t outputs, int64_t block) {
  cascade_quantised::Floats16 acc[kStepStreams];
  alignas(32) int32_t sums[kStepStreams * kBlockOutputs];
  const int64_t block_bytes = kBlockInputs * kBlockOutputs, stream_bytes = blocks * block_bytes;
  const int8_t* first = weight + block * stream_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sum[kStepStreams][2];  // per stream: outputs 0-7, 8-15
    for (auto& halves : sum) halves[0] = halves[1] = _mm256_setzero_si256();
    for (int64_t k = 0; k < kBlockInputs / 4; ++k) {
      const __m256i activations = _mm256_set1_epi32(activation_quad(quantised + b * kBlockInputs, k));
      for (int s = 0; s < kStepStreams; ++s) {
        const int8_t* line = first + s * stream_bytes + b * block_bytes + k * kBlockOutputs * 4;
        for (int half = 0; half < 2; ++half) {
          sum[s][half] = _mm256_add_epi32(sum[s][half], quad_sums(activations, line + half * 32));
        }
      }
    }
    for (int s = 0; s < kStepStreams; ++s) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + s * kBlockOutputs), sum[s][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + s * kBlockOutputs + 8), sum[s][1]);
      acc[s].add_scaled(sums + s * kBlockOutputs, row_scales[b]);
    }
  }
  for (int s = 0; s < kStepStreams; ++s) {
    const int64_t first_output = (block + s) * kBlockOutputs;
    const int64_t count = std::min<int64_t>(kBlockOutputs, outputs - first_output);
    acc[s].store_times(out + first_output, scales + first_output, count);
  }
}

#endif

}  // namespace

namespace cascade_kernels {

#if defined(CASCADE_INT8_KERNEL)

void rows_times_int8_share(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& out, int64_t thread, int64_t threads) {
  const auto [begin, end] = thread_range(packed.size(0), thread, threads);  // 16-output blocks
  if (begin >= end) return;
  const int64_t num_rows = rows.size(0), blocks = packed.size(1), outputs = scales.numel();
  const auto quantised = cascade_quantised::quantised_in_thread(rows.data_ptr<at::BFloat16>(), num_rows, rows.size(1),
                                                                blocks);
#if defined(CASCADE_QUANTISED_VNNI)
  BlockSums block_sums = vnni_block_sums;
#else
  BlockSums block_sums = avx2_block_sums;
#endif
#if defined(__AMX_INT8__)
  if (cascade_tiles::use_amx) {
    configure_tiles(num_rows);
    block_sums = amx_block_sums;
  }
#endif
  int64_t block = begin;
#if defined(CASCADE_QUANTISED_AVX2)
  for (; num_rows == 1 && block + kStepStreams <= end; block += kStepStreams) {
    step_blocks(quantised.values, quantised.scales, packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                out.data_ptr<float>(), blocks, outputs, block);
  }
#endif
  for (; block < end; ++block) {
    output_block(block_sums, quantised.values, quantised.scales, packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                 out.data_ptr<float>(), num_rows, blocks, outputs, block);
  }
#if defined(__AMX_INT8__)
  if (cascade_tiles::use_amx) _tile_release();
#endif
}

#endif

at::Tensor rows_times_int8(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) >= 1 && rows.size(0) <= kMaxRows,
              "rows_times_int8: rows [T, I] with 1 <= T <= 16; got ", rows.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16, "rows_times_int8: bfloat16 rows; got ", rows.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kBlockInputs / 4 && packed.size(3) == kBlockOutputs * 4,
              "rows_times_int8: a packed int8 weight [O / 16, I / 64, 16, 64]; got ", packed.sizes(), " ",
              packed.scalar_type());
  const int64_t blocks = packed.size(1), inner = rows.size(1);
  TORCH_CHECK((inner + kBlockInputs - 1) / kBlockInputs == blocks, "rows_times_int8: rows have ", inner,
              " columns, the packed weight ", blocks * kBlockInputs, " (padded)");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "rows_times_int8: float32 scales [O]; got ", scales.sizes(), " ", scales.scalar_type());
  const int64_t outputs = scales.numel();
  TORCH_CHECK(outputs > 0 && (outputs + kBlockOutputs - 1) / kBlockOutputs == packed.size(0), "rows_times_int8: ",
              outputs, " scales (output rows) do not fit a packed weight of ", packed.size(0), " 16-row blocks");
#if defined(CASCADE_INT8_KERNEL)
  const at::Tensor source = rows.contiguous();
  at::Tensor out = at::empty({source.size(0), outputs}, source.options().dtype(at::kFloat));
  on_threads(at::get_num_threads(), [&](int64_t thread, int64_t team) {
    rows_times_int8_share(source, packed, scales, out, thread, team);
  });
  return out;
#else
  TORCH_CHECK(false, "rows_times_int8: this build has neither AVX512-VNNI nor AVX2 with FMA and F16C (see features())");
  return {};
#endif
}

}  // namespace cascade_kernels

TORCH_LIBRARY_FRAGMENT(cascade_kernels, m) {
  m.def("rows_times_int8(Tensor rows, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) { m.impl("rows_times_int8", &cascade_kernels::rows_times_int8); }
