// Vector helpers shared by cascade's CPU kernels (included after <immintrin.h>), and which of the
// kernels' two instruction sets this build takes (-march=native):
// - CASCADE_AVX512: AVX512-BF16 (bf16 pair products; Zen 4, Sapphire Rapids and later);
// - CASCADE_AVX2: AVX2 with FMA and no AVX512-BF16 (Zen 1-3, Haswell to Alder Lake): bf16 widened to
//   float32 by a shift or a mask, float32 fused multiply-adds.
// CASCADE_KERNELS: either; without it every op refuses to run and Python keeps PyTorch's kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

#if defined(__AVX512BF16__)
#define CASCADE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CASCADE_AVX2 1
#endif
#if defined(CASCADE_AVX512) || defined(CASCADE_AVX2)
#define CASCADE_KERNELS 1
#endif

namespace cascade_vector {

// The polynomial with `coefficients` (highest degree first) at f by Horner's rule, on any vector type
// given its multiply-add and broadcast.
template <typename Vector, typename MulAdd, typename Broadcast>
inline Vector horner(Vector f, std::initializer_list<float> coefficients, MulAdd multiply_add, Broadcast broadcast) {
  const float* c = coefficients.begin();
  Vector p = broadcast(*c);
  for (++c; c != coefficients.end(); ++c) p = multiply_add(p, f, broadcast(*c));
  return p;
}

// e^f for f in [-ln 2 / 2, ln 2 / 2] (relative error ~2e-7): the degree-6 Taylor polynomial.
template <typename Vector, typename MulAdd, typename Broadcast>
inline Vector exp_polynomial(Vector f, MulAdd multiply_add, Broadcast broadcast) {
  return horner(f, {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}, multiply_add, broadcast);
}

}  // namespace cascade_vector

#if defined(__AVX512F__)

namespace cascade_vector {

// exp_polynomial's and horner's operations on 16 floats.
inline __m512 multiply_add16(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 broadcast16(float c) { return _mm512_set1_ps(c); }

// 2^t for 16 floats, 0 in lanes outside `lanes`: 2^n (scalef) times 2^f, f = t - n in [-0.5, 0.5], by
// the degree-5 Taylor polynomial of e^(f ln 2) (relative error ~3e-6, a thousandth of a bf16 rounding
// step). A softmax takes its weights this way, its scores scaled to base 2 and their maximum taken
// off in one multiply-add: 11 operations a vector where exp16 of scaled, shifted scores takes 16.
inline __m512 exp2_16(__mmask16 lanes, __m512 t) {
  constexpr double kLn2 = 0.69314718055994531;
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  const __m512 p = horner(
      f,
      {float(kLn2 * kLn2 * kLn2 * kLn2 * kLn2 / 120), float(kLn2 * kLn2 * kLn2 * kLn2 / 24),
       float(kLn2 * kLn2 * kLn2 / 6), float(kLn2 * kLn2 / 2), float(kLn2), 1.f},
      multiply_add16, broadcast16);
  return _mm512_maskz_scalef_ps(lanes, p, n);
}

// e^x for 16 floats: 2^(x log2 e) split into 2^n (scalef) and 2^f, f in [-0.5, 0.5], by a degree-6
// polynomial (relative error ~2e-7); -inf gives 0.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  const __m512 p = exp_polynomial(f, multiply_add16, broadcast16);
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

#if defined(CASCADE_AVX2)

namespace cascade_vector {

// 8 bf16 values (16 bytes) -> float32, exactly: each value's bits become a float's high half.
inline __m256 widen8(const void* source) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 16 bf16 values loaded as 8 pairs -> the even ones (0, 2, .., 14) and the odd ones, as float32.
inline __m256 even_values(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_values(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// float32 -> the nearest bf16 (ties to even) as the high halves of 8 float32 lanes, low halves zero:
// the value a bf16 rounding keeps, still a float. NaN stays NaN (quiet).
inline __m256i bf16_bits(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i nearest = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i kept = _mm256_and_si256(nearest, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(kept, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
}
inline __m256 rounded8(__m256 values) { return _mm256_castsi256_ps(bf16_bits(values)); }

// 8 float32 -> 8 bf16 (16 bytes) at target, rounded to nearest even.
inline void store_rounded8(void* target, __m256 values) {
  const __m256i halves = _mm256_srli_epi32(bf16_bits(values), 16);  // [0, b0, 0, b1, ...] per 128-bit lane
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extractf128_si256(halves, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(target), packed);
}

// The sum of 8 lanes, always added in the same order: the halves, then pairs, then the last two.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// e^x for 8 floats, as exp16 computes it but for 2^n built in the exponent bits. Below -87.3 (and -inf)
// gives 0; above 88.7 the result saturates at ~3.4e38.
inline __m256 exp8(__m256 x) {
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 t = _mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));  // f ln 2
  const __m256 p = exp_polynomial(f, [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); },
                                  [](float c) { return _mm256_set1_ps(c); });
  // n in [-126, 128]: 2^n as exponent bits, n = 128 as 2^127 * 2
  const __m256i n_int = _mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(127.f)));
  const __m256 power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n_int, _mm256_set1_epi32(127)), 23));
  const __m256 above = _mm256_cmp_ps(n, _mm256_set1_ps(127.f), _CMP_GT_OQ);
  const __m256 carry = _mm256_blendv_ps(_mm256_set1_ps(1.f), _mm256_set1_ps(2.f), above);
  const __m256 out = _mm256_mul_ps(_mm256_mul_ps(p, power), carry);
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
}

}  // namespace cascade_vector

#endif
