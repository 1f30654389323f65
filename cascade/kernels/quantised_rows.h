// Activation rows quantised per 64 inputs, for the int8 and int4 weight kernels (included after
// <immintrin.h>): each block of 64 inputs becomes int8 with its own scale (largest magnitude / 127),
// as llama.cpp's q8_0 quantises them per 32, so an outlier costs precision only in its own block.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace cascade_quantised {

constexpr int64_t kBlockInputs = 64;  // inputs per quantised activation block (one AMX int8 tile row)

}  // namespace cascade_quantised

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

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

}  // namespace cascade_quantised

#endif
