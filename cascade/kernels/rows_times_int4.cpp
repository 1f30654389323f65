// A few activation rows times a 4-bit weight with AVX512-VNNI or AVX2, at the speed of memory.
//
// rows [T, I] bf16 (T <= 16) x packed 4-bit weight with scales [O, I' / 32, 2] -> out [T, O] float32,
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
// 16-output block is one contiguous stream; its scales ([16, I' / 32, 2] float16, contiguous) are
// gathered group by group, the next block's asked for a line per group. For one activation row the
// hardware prefetcher follows the weight's stream alone (asking for the next block's lines as well
// made those products 10-20% slower on the 2-core EPYC); a wider pass asks for them. The AVX2 path
// also asks for its own stream's lines 1 KB ahead, as the int8 one does (one row, the Qwen 0.5B's
// products: 20.3 -> 19.0 ms a step; it spends more instructions on a byte than the int8 path).
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
constexpr int64_t kBlockOutputs = 16;  // output rows per packed block (int32 lanes of a register)
constexpr int64_t kGroupInputs = 32;  // inputs per scale and low
constexpr int64_t kLineBytes = 64;
constexpr int64_t kGroupLines = kGroupInputs / 8;  // 4 lines: 16 outputs x 32 nibbles
constexpr int64_t kMaxRows = 16;
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
  const uint16_t* scales;  // [O, groups, 2] float16 bits
  float* out;  // [T, O]
  int64_t num_rows, groups, outputs;
};

#endif

#if defined(CASCADE_QUANTISED_VNNI)

// The 16 outputs' (scale, low) of one group from scales [O, groups, 2] (rows past O read as zero).
inline void group_scales(const Operands& in, int64_t first, __mmask16 valid, int64_t group, __m512* scale,
                         __m512* low) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(in.groups)));
  const void* base = in.scales + (first * in.groups + group) * 2;
  const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, rows, base, 4);
  *scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
  *low = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
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
  const char* next_scales = reinterpret_cast<const char*>(in.scales + (first + kBlockOutputs) * in.groups * 2);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < in.groups; ++g) {
    for (int64_t line = 0; in.num_rows > 1 && line < kGroupLines; ++line) {
      _mm_prefetch(next_block + (g * kGroupLines + line) * kLineBytes, _MM_HINT_T1);
    }
    _mm_prefetch(next_scales + g * kLineBytes, _MM_HINT_T1);  // 16 rows x groups x 4 bytes: a line per group
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

// The (scale, low) of outputs [first, first + 8) of one group, as float32 (rows past O read as zero).
inline void group_scales(const Operands& in, int64_t first, int64_t group, __m256* scale, __m256* low) {
  const int64_t valid = std::clamp<int64_t>(in.outputs - first, 0, 8);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lanes);
  const __m256i rows = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(static_cast<int>(in.groups)));
  const int* base = reinterpret_cast<const int*>(in.scales + (first * in.groups + group) * 2);
  const __m256i pairs = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), base, rows, mask, 4);
  const __m256i halves = _mm256_packus_epi32(_mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF)),
                                             _mm256_srli_epi32(pairs, 16));  // per 128 bits: 4 scales, 4 lows
  const __m256i ordered = _mm256_permute4x64_epi64(halves, 0xD8);  // 8 scales, 8 lows
  *scale = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
  *low = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
}

// Output rows [16 * block, 16 * block + 16) for every activation row, as two halves of 8.
void output_block(const Operands& in, int64_t block) {
  __m256 acc[kMaxRows][2];
  for (int64_t t = 0; t < in.num_rows; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const int64_t first = block * kBlockOutputs, blocks = in.groups / 2;
  const int64_t stream_bytes = blocks * 2 * kGroupLines * kLineBytes;
  const uint8_t* stream = in.packed + block * stream_bytes;
  const char* next_block = reinterpret_cast<const char*>(stream + stream_bytes);
  const char* next_scales = reinterpret_cast<const char*>(in.scales + (first + kBlockOutputs) * in.groups * 2);
  const char* ahead = reinterpret_cast<const char*>(stream + kAheadGroups * kGroupLines * kLineBytes);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < in.groups; ++g) {
    for (int64_t line = 0; in.num_rows > 1 && line < kGroupLines; ++line) {
      _mm_prefetch(next_block + (g * kGroupLines + line) * kLineBytes, _MM_HINT_T1);
    }
    _mm_prefetch(next_scales + g * kLineBytes, _MM_HINT_T1);
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
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        const __m256 lows = _mm256_mul_ps(low, _mm256_set1_ps(static_cast<float>(in.row_sums[t * in.groups + g])));
        const __m256 group_sum = _mm256_fmadd_ps(sums, scale, lows);
        acc[t][half] = _mm256_fmadd_ps(group_sum, _mm256_set1_ps(in.row_scales[b * in.num_rows + t]), acc[t][half]);
      }
    }
  }
  const int64_t count = std::min<int64_t>(kBlockOutputs, in.outputs - first);
  for (int64_t t = 0; t < in.num_rows; ++t) {
    alignas(32) float sums[kBlockOutputs];
    _mm256_store_ps(sums, acc[t][0]);
    _mm256_store_ps(sums + 8, acc[t][1]);
    std::memcpy(in.out + t * in.outputs + first, sums, count * sizeof(float));
  }
}

#endif

}  // namespace

namespace cascade_kernels {

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
                  scales.size(1) == 2 * blocks && scales.size(2) == 2,
              "rows_times_int4: float16 scales and lows [O, ", 2 * blocks, ", 2]; got ", scales.sizes(), " ",
              scales.scalar_type());
  const int64_t outputs = scales.size(0);
  TORCH_CHECK(outputs > 0 && (outputs + kBlockOutputs - 1) / kBlockOutputs == packed.size(0), "rows_times_int4: ",
              outputs, " output rows of scales do not fit a packed weight of ", packed.size(0), " 16-row blocks");
#if defined(CASCADE_INT4_KERNEL)
  const at::Tensor source = rows.contiguous();
  const int64_t num_rows = source.size(0), groups = 2 * blocks;
  at::Tensor quantised = at::empty({num_rows, blocks * kBlockInputs}, source.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({blocks, num_rows}, source.options().dtype(at::kFloat));
  cascade_quantised::quantise_rows(source.data_ptr<at::BFloat16>(), num_rows, inner, blocks,
                                   quantised.data_ptr<int8_t>(), row_scales.data_ptr<float>());
  at::Tensor row_sums = at::empty({num_rows, groups}, source.options().dtype(at::kInt));
  group_sums(quantised.data_ptr<int8_t>(), num_rows, groups, row_sums.data_ptr<int32_t>());
  at::Tensor out = at::empty({num_rows, outputs}, source.options().dtype(at::kFloat));
  const Operands operands{quantised.data_ptr<int8_t>(),
                          row_scales.data_ptr<float>(),
                          row_sums.data_ptr<int32_t>(),
                          packed.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                          out.data_ptr<float>(),
                          num_rows,
                          groups,
                          outputs};
  const int64_t output_blocks = packed.size(0), threads = at::get_num_threads();
  at::parallel_for(0, output_blocks, (output_blocks + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) output_block(operands, block);
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
