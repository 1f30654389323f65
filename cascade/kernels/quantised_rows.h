// Activation rows quantised per 64 inputs, for the int8 and int4 weight kernels (included after
// <immintrin.h>): each block of 64 inputs becomes int8 with its own scale (largest magnitude / 127),
// as llama.cpp's q8_0 quantises them per 32, so an outlier costs precision only in its own block.
// Which instructions the quantised kernels take (-march=native):
// - CASCADE_QUANTISED_VNNI: AVX512-VNNI (byte quad products into int32; Ice Lake, Zen 4 and later);
// - CASCADE_QUANTISED_AVX2: F16C and vector_math.h's CASCADE_AVX2 (AVX2 and FMA) without it (Zen 1-3,
//   Haswell to Alder Lake): the same int32 sums from vpmaddubsw and vpmaddwd, the same float32
//   arithmetic on two 8-lane halves.
// Both take the same operations in the same order for each output (not compared across machines;
// each is tested against the float64 arithmetic it stands for).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_math.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CASCADE_QUANTISED_VNNI 1
#elif defined(CASCADE_AVX2) && defined(__F16C__)
#define CASCADE_QUANTISED_AVX2 1
#endif
#if defined(CASCADE_QUANTISED_VNNI) || defined(CASCADE_QUANTISED_AVX2)
#define CASCADE_QUANTISED_KERNELS 1
#endif

namespace cascade_quantised {

constexpr int64_t kBlockInputs = 64;  // inputs per quantised activation block (one AMX int8 tile row)
constexpr int64_t kMaxRows = 16;  // the most activation rows an int8 or 4-bit product takes

// Quantised activations 4k..4k+3 of a row as one int32, to broadcast against a weight quad's lanes.
inline int32_t activation_quad(const int8_t* row, int64_t k) {
  int32_t quad;
  std::memcpy(&quad, row + 4 * k, 4);
  return quad;
}

}  // namespace cascade_quantised

#if defined(CASCADE_QUANTISED_VNNI)

namespace cascade_quantised {

// One row's 64-input block (count valid inputs, the rest zero) -> 64 int8 and its scale.
inline float quantise_block(const at::BFloat16* source, int64_t count, int8_t* target) {
  __m512 values[4];
  __m512 largest = _mm512_setzero_ps();
  for (int part = 0; part < 4; ++part) {
    const int64_t valid = std::clamp<int64_t>(count - part * 16, 0, 16);
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, source + part * 16);
    values[part] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bf16 -> float
    largest = _mm512_max_ps(largest, _mm512_abs_ps(values[part]));
  }
  const float scale = _mm512_reduce_max_ps(largest) / 127.0f;
  const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
  for (int part = 0; part < 4; ++part) {
    const __m512i rounded = _mm512_cvt_roundps_epi32(_mm512_mul_ps(values[part], inverse),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(target + part * 16), _mm512_cvtsepi32_epi8(rounded));
  }
  return scale;
}

}  // namespace cascade_quantised

#elif defined(CASCADE_QUANTISED_AVX2)

namespace cascade_quantised {

// As above, with eight 8-lane vectors; a block shorter than 64 inputs is read from a zero-padded copy.
inline float quantise_block(const at::BFloat16* source, int64_t count, int8_t* target) {
  alignas(32) at::BFloat16 padded[kBlockInputs];
  if (count < kBlockInputs) {
    std::memset(padded, 0, sizeof(padded));
    std::memcpy(padded, source, std::max<int64_t>(count, 0) * sizeof(at::BFloat16));
    source = padded;
  }
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 values[8];
  __m256 largest = _mm256_setzero_ps();
  for (int part = 0; part < 8; ++part) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + part * 8));
    values[part] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));  // bf16 -> float
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, values[part]));
  }
  const float scale = cascade_vector::max8(largest) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
  for (int part = 0; part < 8; part += 2) {  // nearest, ties to even (the default rounding), saturated
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(values[part], inverse));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(values[part + 1], inverse));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);  // 16 int16 in order
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(target + part * 8), bytes);
  }
  return scale;
}

}  // namespace cascade_quantised

#endif

#if defined(CASCADE_QUANTISED_KERNELS)

namespace cascade_quantised {

// rows [T, I] -> quantised [T, blocks * 64] int8 and row_scales [blocks, T].
inline void quantise_rows(const at::BFloat16* rows, int64_t num_rows, int64_t inner, int64_t blocks,
                          int8_t* quantised, float* row_scales) {
  for (int64_t t = 0; t < num_rows; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      row_scales[b * num_rows + t] = quantise_block(rows + t * inner + b * kBlockInputs, inner - b * kBlockInputs,
                                                    quantised + (t * blocks + b) * kBlockInputs);
    }
  }
}

// A thread's activation rows, quantised (quantise_rows) into buffers it keeps from call to call:
// values [T, blocks * 64], scales [blocks, T]. Each thread of a product quantises the rows itself, so
// a thread's share needs nothing from the others.
struct QuantisedRows {
  const int8_t* values;
  const float* scales;
};

inline QuantisedRows quantised_in_thread(const at::BFloat16* rows, int64_t num_rows, int64_t inner, int64_t blocks) {
  thread_local std::vector<int8_t> values;
  thread_local std::vector<float> scales;
  values.resize(num_rows * blocks * kBlockInputs);
  scales.resize(blocks * num_rows);
  quantise_rows(rows, num_rows, inner, blocks, values.data(), scales.data());
  return {values.data(), scales.data()};
}

// 16 float32 sums, one per output of a packed block: one AVX-512 register, or two AVX2 ones that do
// the same arithmetic lane for lane.
struct Floats16 {
#if defined(CASCADE_QUANTISED_VNNI)
  __m512 sums = _mm512_setzero_ps();

  // sums += float(block_sums[16]) * scale
  void add_scaled(const int32_t* block_sums, float scale) {
    sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(block_sums)), _mm512_set1_ps(scale), sums);
  }

  // out[j] = sums[j] * scales[j] for the first count outputs
  void store_times(float* out, const float* scales, int64_t count) const {
    const __mmask16 valid = (__mmask16)((1u << count) - 1);
    _mm512_mask_storeu_ps(out, valid, _mm512_mul_ps(sums, _mm512_maskz_loadu_ps(valid, scales)));
  }
#else
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();

  void add_scaled(const int32_t* block_sums, float scale) {
    const __m256 factor = _mm256_set1_ps(scale);
    low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(block_sums))),
                          factor, low);
    high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(block_sums + 8))),
                           factor, high);
  }

  void store_times(float* out, const float* scales, int64_t count) const {
    alignas(32) float factors[16] = {}, products[16];
    std::memcpy(factors, scales, count * sizeof(float));
    _mm256_store_ps(products, _mm256_mul_ps(low, _mm256_load_ps(factors)));
    _mm256_store_ps(products + 8, _mm256_mul_ps(high, _mm256_load_ps(factors + 8)));
    std::memcpy(out, products, count * sizeof(float));
  }
#endif
};

}  // namespace cascade_quantised

#endif  // CASCADE_QUANTISED_KERNELS
