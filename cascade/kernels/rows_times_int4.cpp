// A few activation rows times a 4-bit weight with AVX512-VNNI or AVX2, at the speed of memory.
//
// rows [T, I] bf16 (T <= 16) x packed 4-bit weight with scales [I' / 32, 2, O] -> out [T, O] float32,
// where each group g of 32 inputs of output o holds levels w in 0..15 that stand for
// scale[o, g] * w + low[o, g] (asymmetric, as a Q4_K sub-block of llama.cpp: a draft dequantised
// from Q4_K GGUFs keeps nearly its own weights), and
//   out[t, o] = sum_b row_scale[t, b] * sum_{g in block b} (scale[o, g] * sum_{i in g} q[t, i] w[o, i]
//                                                           + low[o, g] * sum_{i in g} q[t, i])
// with the activations q quantised per 64 inputs as for the int8 weights (quantised_rows.h).
//
// Packing (cascade/quantise.py): for every block of 16 output rows and 64 inputs, 8 lines of 64
// bytes, 4 per group of 32 inputs: line j of a group holds, for each of the 16 outputs, inputs
// 4j..4j+3 of the group in its low nibbles and inputs 16+4j..16+4j+3 in its high ones:
// packed[O' / 16, I' / 64, 8, 64] uint8 (O, I padded with zeros to multiples of 16 and 64). Each
// 16-output block is one contiguous stream. The scales are float16 [groups, 2, O]: a group's 16 scales
// of a block, and its 16 lows, are each one load; each of their lines serves two blocks, and a block
// asks for the ones kAheadGroups groups ahead (past its last group, the next block's first ones). Laid
// out [O, groups, 2] they were gathered per group, which on a 2-core Zen 2 left the AVX2 product
// compute-bound (the Qwen 0.5B's 4-bit step at 1K: 21.6 ms; 16.8 with this layout). For one
// activation row the hardware prefetcher follows the weight's stream alone (asking for the next
// block's lines as well made those products 10-20% slower on a 2-core EPYC); a wider pass asks for
// them. The AVX2 path asks for its own stream's lines 1 KB ahead, as the int8 one does, and its
// one-row product reads 4 output blocks' streams side by side (step_blocks, as the int8 one-row
// product does: more lines in flight; that step 16.8 -> 14.2 ms).
// Weights are the unsigned operand of vpdpbusd and the activations the signed one, so the integer
// sums are exact with no offset to take off. Without AVX512-VNNI, AVX2 takes each 16-output block in
// two halves of 8: vpmaddubsw's int16 pair sums of one group (at most 8 x 2 x 15 x 127 in magnitude)
// add up inside int16 before vpmaddwd widens them, so its sums and its float32 arithmetic are the same as VNNI's.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "products.h"
#include "quantised_rows.h"

namespace {

using cascade_quantised::activation_quad;
using cascade_quantised::kBlockInputs;
using cascade_quantised::kMaxRows;
constexpr int64_t kBlockOutputs = 16;  // output rows per packed block (int32 lanes of a register)
constexpr int64_t kGroupInputs = 32;  // inputs per scale and low
constexpr int64_t kLineBytes = 64;
constexpr int64_t kGroupLines = kGroupInputs / 8;  // 4 lines: 16 outputs x 32 nibbles
constexpr int64_t kAheadGroups = 4;  // AVX2: how far ahead of its reads a stream asks for its weight lines

#if defined(CASCADE_QUANTISED_KERNELS)

#define CASCADE_INT4_KERNEL 1

// Each row's sums of its quantised activations per group of 32: [T, groups] (the lows' weights).
void group_sums(const int8_t* quantised, int64_t num_rows, int64_t groups, int32_t* sums) {
  for (int64_t t = 0; t < num_rows; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* group = quantised + (t * groups + g) * kGroupInputs;
      int32_t sum = 0;
      for (int64_t i = 0; i < kGroupInputs; ++i) sum += group[i];
      sums[t * groups + g] = sum;
    }
  }
}

struct Operands {
  const int8_t* quantised;  // [T, groups * 32]
  const float* row_scales;  // [groups / 2, T]
  const int32_t* row_sums;  // [T, groups]
  const uint8_t* packed;  // [O' / 16, groups / 2, 8, 64]
  const uint16_t* scales;  // [groups, 2, O] float16 bits: per group its scales, then its lows
  float* out;  // [T, O]
  int64_t num_rows, groups, outputs;
};

// Asks for the scale and low lines of the group kAheadGroups past `group` of the block of outputs
// from `first` (past the block's last group: the next block's first ones).
inline void prefetch_scales_ahead(const Operands& in, int64_t first, int64_t group) {
  const int64_t ahead = group + kAheadGroups;
  const int64_t block_first = ahead < in.groups ? first : first + kBlockOutputs;
  const uint16_t* scales = in.scales + 2 * (ahead % in.groups) * in.outputs + block_first;
  _mm_prefetch(reinterpret_cast<const char*>(scales), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + in.outputs), _MM_HINT_T0);
}

#endif

#if defined(CASCADE_QUANTISED_VNNI)

// The scales and lows of one group for the 16 outputs from `first` (outputs past O read as zero).
inline void group_scales(const Operands& in, int64_t first, __mmask16 valid, int64_t group, __m512* scale,
                         __m512* low) {
  const uint16_t* scales = in.scales + 2 * group * in.outputs + first;
  *scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, scales));
  *low = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, scales + in.outputs));
}

// Output rows [16 * block, 16 * block + 16) for every activation row.
void output_block(const Operands& in, int64_t block) {
  __m512 acc[kMaxRows];
  for (int64_t t = 0; t < in.num_rows; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t first = block * kBlockOutputs, blocks = in.groups / 2;
  const __mmask16 valid = (__mmask16)((1u << std::min<int64_t>(kBlockOutputs, in.outputs - first)) - 1);
  const int64_t stream_bytes = blocks * 2 * kGroupLines * kLineBytes;
  const uint8_t* stream = in.packed + block * stream_bytes;
  const char* next_block = reinterpret_cast<const char*>(stream + stream_bytes);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < in.groups; ++g) {
    for (int64_t line = 0; in.num_rows > 1 && line < kGroupLines; ++line) {
      _mm_prefetch(next_block + (g * kGroupLines + line) * kLineBytes, _MM_HINT_T1);
    }
    prefetch_scales_ahead(in, first, g);
    __m512i levels[8];  // quad k of the group: inputs 4k..4k+3 of each output
    for (int64_t line = 0; line < kGroupLines; ++line) {
      const __m512i bytes = _mm512_loadu_si512(stream + (g * kGroupLines + line) * kLineBytes);
      levels[line] = _mm512_and_si512(bytes, nibble);
      levels[line + kGroupLines] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    }
    __m512 scale, low;
    group_scales(in, first, valid, g, &scale, &low);
    const int64_t b = g / 2;
    for (int64_t t = 0; t < in.num_rows; ++t) {
      const int8_t* row = in.quantised + t * in.groups * kGroupInputs + g * kGroupInputs;
      __m512i sums = _mm512_setzero_si512();
      for (int64_t k = 0; k < 8; ++k) {
        sums = _mm512_dpbusd_epi32(sums, levels[k], _mm512_set1_epi32(activation_quad(row, k)));
      }
      const __m512 lows = _mm512_mul_ps(low, _mm512_set1_ps(static_cast<float>(in.row_sums[t * in.groups + g])));
      const __m512 group_sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, lows);
      acc[t] = _mm512_fmadd_ps(group_sum, _mm512_set1_ps(in.row_scales[b * in.num_rows + t]), acc[t]);
    }
  }
  for (int64_t t = 0; t < in.num_rows; ++t) _mm512_mask_storeu_ps(in.out + t * in.outputs + first, valid, acc[t]);
}

#elif defined(CASCADE_QUANTISED_AVX2)

// The scales and lows of one group for the 8 outputs from `first`, as float32 (outputs past O read as zero).
inline void group_scales(const Operands& in, int64_t first, int64_t group, __m256* scale, __m256* low) {
  const uint16_t* scales = in.scales + 2 * group * in.outputs + first;
  if (first + 8 <= in.outputs) {
    *scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    *low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + in.outputs)));
    return;
  }
  alignas(16) uint16_t tail[2][8] = {};  // the last block's outputs, zeros past O
  const int64_t count = std::max<int64_t>(in.outputs - first, 0);
  std::copy_n(scales, count, tail[0]);
  std::copy_n(scales + in.outputs, count, tail[1]);
  *scale = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail[0])));
  *low = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail[1])));
}

// acc + row_scale * (scale * sums + low * row_sum) for 8 outputs, the sums one group's int16 pair
// sums (at most 8 x 2 x 15 x 127 in magnitude, so exact in int16 in any order).
inline __m256 add_group(__m256 acc, __m256i pairs, __m256 scale, __m256 low, int32_t row_sum, float row_scale) {
  const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  const __m256 lows = _mm256_mul_ps(low, _mm256_set1_ps(static_cast<float>(row_sum)));
  return _mm256_fmadd_ps(_mm256_fmadd_ps(sums, scale, lows), _mm256_set1_ps(row_scale), acc);
}

// The 16 outputs from `first` of one row (acc: outputs 0-7, 8-15) into out, those past O left out.
inline void store_block(const Operands& in, const __m256 acc[2], float* out, int64_t first) {
  alignas(32) float sums[kBlockOutputs];
  _mm256_store_ps(sums, acc[0]);
  _mm256_store_ps(sums + 8, acc[1]);
  std::memcpy(out + first, sums, std::min<int64_t>(kBlockOutputs, in.outputs - first) * sizeof(float));
}

// Output rows [16 * block, 16 * block + 16) for every activation row, as two halves of 8.
void output_block(const Operands& in, int64_t block) {
  __m256 acc[kMaxRows][2];
  for (int64_t t = 0; t < in.num_rows; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const int64_t first = block * kBlockOutputs, blocks = in.groups / 2;
  const int64_t stream_bytes = blocks * 2 * kGroupLines * kLineBytes;
  const uint8_t* stream = in.packed + block * stream_bytes;
  const char* next_block = reinterpret_cast<const char*>(stream + stream_bytes);
  const char* ahead = reinterpret_cast<const char*>(stream + kAheadGroups * kGroupLines * kLineBytes);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < in.groups; ++g) {
    for (int64_t line = 0; in.num_rows > 1 && line < kGroupLines; ++line) {
      _mm_prefetch(next_block + (g * kGroupLines + line) * kLineBytes, _MM_HINT_T1);
    }
    prefetch_scales_ahead(in, first, g);
    const int64_t b = g / 2;
    for (int half = 0; half < 2; ++half) {
      __m256i levels[8];  // quad k of the group: inputs 4k..4k+3 of this half's 8 outputs
      for (int64_t line = 0; line < kGroupLines; ++line) {
        if (half == 0) _mm_prefetch(ahead + (g * kGroupLines + line) * kLineBytes, _MM_HINT_T0);
        const __m256i bytes = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(stream + (g * kGroupLines + line) * kLineBytes + half * 32));
        levels[line] = _mm256_and_si256(bytes, nibble);
        levels[line + kGroupLines] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      }
      __m256 scale, low;
      group_scales(in, first + half * 8, g, &scale, &low);
      for (int64_t t = 0; t < in.num_rows; ++t) {
        const int8_t* row = in.quantised + t * in.groups * kGroupInputs + g * kGroupInputs;
        __m256i pairs = _mm256_setzero_si256();
        for (int64_t k = 0; k < 8; ++k) {
          const __m256i quad = _mm256_set1_epi32(activation_quad(row, k));
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(levels[k], quad));
        }
        acc[t][half] = add_group(acc[t][half], pairs, scale, low, in.row_sums[t * in.groups + g],
                                 in.row_scales[b * in.num_rows + t]);
      }
    }
  }
  for (int64_t t = 0; t < in.num_rows; ++t) store_block(in, acc[t], in.out + t * in.outputs, first);
}

constexpr int64_t kStepStreams = 4;  // output blocks a one-row product reads side by side

// Output rows [16 * block, 16 * (block + 4)) for one activation row: the 4 blocks' streams read side
// by side (more lines in flight, as the int8 one-row product does), each block's pair sums and float32
// steps those of output_block.
void step_blocks(const Operands& in, int64_t block) {
  __m256 acc[kStepStreams][2];
  for (auto& halves : acc) halves[0] = halves[1] = _mm256_setzero_ps();
  const int64_t stream_bytes = in.groups * kGroupLines * kLineBytes;
  const uint8_t* streams = in.packed + block * stream_bytes;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < in.groups; ++g) {
    for (int s = 0; s < kStepStreams; ++s) prefetch_scales_ahead(in, (block + s) * kBlockOutputs, g);
    __m256i pairs[kStepStreams][2];  // per stream: outputs 0-7, 8-15
    for (auto& halves : pairs) halves[0] = halves[1] = _mm256_setzero_si256();
    const int8_t* quads = in.quantised + g * kGroupInputs;  // the group's activations
    for (int64_t line = 0; line < kGroupLines; ++line) {  // its low nibbles: quad `line`, its high ones: line + 4
      const __m256i low_quad = _mm256_set1_epi32(activation_quad(quads, line));
      const __m256i high_quad = _mm256_set1_epi32(activation_quad(quads, line + kGroupLines));
      for (int s = 0; s < kStepStreams; ++s) {
        for (int half = 0; half < 2; ++half) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              streams + s * stream_bytes + (g * kGroupLines + line) * kLineBytes + half * 32));
          const __m256i lows = _mm256_maddubs_epi16(_mm256_and_si256(bytes, nibble), low_quad);
          const __m256i highs = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), high_quad);
          pairs[s][half] = _mm256_add_epi16(pairs[s][half], _mm256_add_epi16(lows, highs));
        }
      }
    }
    for (int s = 0; s < kStepStreams; ++s) {
      for (int half = 0; half < 2; ++half) {
        __m256 scale, low;
        group_scales(in, (block + s) * kBlockOutputs + half * 8, g, &scale, &low);
        acc[s][half] = add_group(acc[s][half], pairs[s][half], scale, low, in.row_sums[g], in.row_scales[g / 2]);
      }
    }
  }
  for (int s = 0; s < kStepStreams; ++s) store_block(in, acc[s], in.out, (block + s) * kBlockOutputs);
}

#endif

}  // namespace

namespace cascade_kernels {

#if defined(CASCADE_INT4_KERNEL)

void rows_times_int4_share(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& out, int64_t thread, int64_t threads) {
  const auto [begin, end] = thread_range(packed.size(0), thread, threads);  // 16-output blocks
  if (begin >= end) return;
  const int64_t num_rows = rows.size(0), groups = 2 * packed.size(1);
  const auto quantised = cascade_quantised::quantised_in_thread(rows.data_ptr<at::BFloat16>(), num_rows, rows.size(1),
                                                                packed.size(1));
  thread_local std::vector<int32_t> row_sums;
  row_sums.resize(num_rows * groups);
  group_sums(quantised.values, num_rows, groups, row_sums.data());
  const Operands operands{quantised.values,
                          quantised.scales,
                          row_sums.data(),
                          packed.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                          out.data_ptr<float>(),
                          num_rows,
                          groups,
                          scales.size(2)};
  int64_t block = begin;
#if defined(CASCADE_QUANTISED_AVX2)
  for (; num_rows == 1 && block + kStepStreams <= end; block += kStepStreams) step_blocks(operands, block);
#endif
  for (; block < end; ++block) output_block(operands, block);
}

#endif

at::Tensor rows_times_int4(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) >= 1 && rows.size(0) <= kMaxRows,
              "rows_times_int4: rows [T, I] with 1 <= T <= 16; got ", rows.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16, "rows_times_int4: bfloat16 rows; got ", rows.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 2 * kGroupLines && packed.size(3) == kLineBytes,
              "rows_times_int4: a packed 4-bit weight [O / 16, I / 64, 8, 64] uint8; got ", packed.sizes(), " ",
              packed.scalar_type());
  const int64_t blocks = packed.size(1), inner = rows.size(1);
  TORCH_CHECK((inner + kBlockInputs - 1) / kBlockInputs == blocks, "rows_times_int4: rows have ", inner,
              " columns, the packed weight ", blocks * kBlockInputs, " (padded)");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(0) == 2 * blocks && scales.size(1) == 2,
              "rows_times_int4: float16 scales and lows [", 2 * blocks, ", 2, O]; got ", scales.sizes(), " ",
              scales.scalar_type());
  const int64_t outputs = scales.size(2);
  TORCH_CHECK(outputs > 0 && (outputs + kBlockOutputs - 1) / kBlockOutputs == packed.size(0), "rows_times_int4: ",
              outputs, " output rows of scales do not fit a packed weight of ", packed.size(0), " 16-row blocks");
#if defined(CASCADE_INT4_KERNEL)
  const at::Tensor source = rows.contiguous();
  at::Tensor out = at::empty({source.size(0), outputs}, source.options().dtype(at::kFloat));
  on_threads(at::get_num_threads(), [&](int64_t thread, int64_t team) {
    rows_times_int4_share(source, packed, scales, out, thread, team);
  });
  return out;
#else
  TORCH_CHECK(false, "rows_times_int4: this build has neither AVX512-VNNI nor AVX2 with FMA and F16C (see features())");
  return {};
#endif
}

}  // namespace cascade_kernels

TORCH_LIBRARY_FRAGMENT(cascade_kernels, m) {
  m.def("rows_times_int4(Tensor rows, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) { m.impl("rows_times_int4", &cascade_kernels::rows_times_int4); }
