// AVX-512 helpers shared by cascade's CPU kernels (included after <immintrin.h>).
#pragma once

#include <immintrin.h>

#if defined(__AVX512F__)

namespace cascade_vector {

// e^x for 16 floats: 2^(x log2 e) split into 2^n (scalef) and 2^f, f in [-0.5, 0.5], by a degree-6
// polynomial (relative error ~2e-7); -inf gives 0.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-1e30f), _CMP_LT_OQ), out, _mm512_setzero_ps());
}

// Lane j of the result = the sum of v[j]'s 16 lanes: four rounds of folding pairs of vectors together,
// then a fixed permutation. Each lane's sum is added in the same order whatever the other vectors hold.
inline __m512 sum_each(const __m512 (&v)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit quarters q0 + q2, q1 + q3 of v[i] (low half) and v[i + 8]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarter j: 4 partial sums of v[i], v[i + 8], v[i + 4], v[i + 12]
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[i], halves[i + 4], 0x88),
                                _mm512_shuffle_f32x4(halves[i], halves[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    eighths[i] = _mm512_add_ps(_mm512_unpacklo_ps(quarters[i], quarters[i + 2]),
                               _mm512_unpackhi_ps(quarters[i], quarters[i + 2]));
  }
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x44),
                                    _mm512_shuffle_ps(eighths[0], eighths[1], 0xEE));
  // lane L holds the sum of v[order[L]]; the order is its own inverse
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), sums);
}

}  // namespace cascade_vector

#endif
