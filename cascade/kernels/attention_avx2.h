// A short pass's key blocks on a CPU with AVX2 and FMA but no AVX512-BF16 (CASCADE_AVX2, see
// vector_math.h). Included by attention.cpp inside its anonymous namespace: attention.cpp splits the
// pass into (KV head, block of kBlockKeys keys) tasks across the threads and merges each row's
// blocks in key order; this file computes one task, in float32 arithmetic:
// - the block's keys widened from bf16 8 at a time into the thread's scratch (L1), each row's 8
//   scores from 8 chains of fused multiply-adds over its query's dimensions, folded by one fixed
//   tree of additions (fold8);
// - softmax over the keys the row sees: their maximum, exp8, the weights summed in 8 lanes then sum8;
// - the values widened 8 keys at a time, each row's weighted sum over the keys it sees, in key order.
// A key's score and a row's sums take the same operations in the same order whatever the pass's
// width and however many keys follow, so a verification pass equals the decode steps it replaces
// bit for bit, and a tree node's rows equal its step's (attention.cpp hands each its own keys).

#pragma once

constexpr int64_t kWideKeys = 8;  // keys widened together: one per float32 lane of a row's scores

// A thread's working memory for its blocks, kept from call to call and grown when a pass needs more.
struct Scratch {
  float* queries;  // [rows, D] float32
  float* scores;  // [rows, kBlockKeys]: scaled scores, then the softmax weights
  float* wide;  // [kWideKeys, D]: 8 keys' or values' rows in float32
};

template <int D>
Scratch thread_scratch(int64_t rows) {
  thread_local std::vector<float> memory;
  const int64_t floats = rows * D + rows * kBlockKeys + kWideKeys * D;
  if (static_cast<int64_t>(memory.size()) < floats) memory.resize(floats);
  float* base = memory.data();
  return {base, base + rows * D, base + rows * D + rows * kBlockKeys};
}

// Nothing beyond its rows is shared by a pass's blocks here (no tiles).
template <int D>
struct PassOperands {
  PassOperands(const at::Tensor&, int64_t) {}
};

// Rows [count, D] bf16 at `source` (consecutive rows `stride` apart) -> wide [kWideKeys, D] float32,
// the rows past count zero.
template <int D>
inline void widen_rows(const at::BFloat16* source, int64_t stride, int64_t count, float* wide) {
  for (int64_t j = 0; j < kWideKeys; ++j) {
    for (int d = 0; d < D; d += 8) {
      const __m256 values = j < count ? cascade_vector::widen8(source + j * stride + d) : _mm256_setzero_ps();
      _mm256_storeu_ps(wide + j * D + d, values);
    }
  }
}

// Lane j of the result = the sum of sums[j]'s 8 lanes, each added in the same fixed order.
inline __m256 fold8(const __m256 (&sums)[kWideKeys]) {
  const __m256 pairs0 = _mm256_hadd_ps(sums[0], sums[1]), pairs1 = _mm256_hadd_ps(sums[2], sums[3]);
  const __m256 pairs2 = _mm256_hadd_ps(sums[4], sums[5]), pairs3 = _mm256_hadd_ps(sums[6], sums[7]);
  const __m256 quads0 = _mm256_hadd_ps(pairs0, pairs1), quads1 = _mm256_hadd_ps(pairs2, pairs3);
  return _mm256_add_ps(_mm256_permute2f128_ps(quads0, quads1, 0x20), _mm256_permute2f128_ps(quads0, quads1, 0x31));
}

// One query row [D] float32 against 8 widened keys -> their 8 unscaled scores.
template <int D>
inline __m256 eight_scores(const float* query, const float* wide) {
  __m256 sums[kWideKeys];
  for (auto& sum : sums) sum = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 q = _mm256_loadu_ps(query + d);
    for (int j = 0; j < kWideKeys; ++j) sums[j] = _mm256_fmadd_ps(q, _mm256_loadu_ps(wide + j * D + d), sums[j]);
  }
  return fold8(sums);
}

// Lanes [0, left) of 8 set.
inline __m256 lanes_below(int64_t left) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), index));
}

// A row's softmax weights over its first `visible` scores, in place (lanes past them in the last
// group of 8 zero) -> the row's maximum (-inf when it sees no key here) and the weights' sum.
inline std::pair<float, float> row_weights(float* scores, int64_t visible) {
  float best = kNegativeInfinity;
  for (int64_t k = 0; k < visible; ++k) best = std::max(best, scores[k]);
  if (visible == 0) return {best, 0.f};
  __m256 total = _mm256_setzero_ps();
  for (int64_t k = 0; k < visible; k += kWideKeys) {
    const __m256 shifted = _mm256_sub_ps(_mm256_loadu_ps(scores + k), _mm256_set1_ps(best));
    const __m256 weights = _mm256_and_ps(cascade_vector::exp8(shifted), lanes_below(visible - k));
    _mm256_storeu_ps(scores + k, weights);
    total = _mm256_add_ps(total, weights);
  }
  return {best, cascade_vector::sum8(total)};
}

// out [D] += weights[j] x wide row j for j < count, in order (out's 8-lane chunks in registers 8 at a time).
template <int D>
inline void add_weighted(const float* weights, const float* wide, int64_t count, float* out) {
  constexpr int kChunks = D / 8 < 8 ? D / 8 : 8;
  for (int d0 = 0; d0 < D; d0 += 8 * kChunks) {
    __m256 acc[kChunks];
    for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_loadu_ps(out + d0 + 8 * c);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 weight = _mm256_set1_ps(weights[j]);
      for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(wide + j * D + d0 + 8 * c), acc[c]);
    }
    for (int c = 0; c < kChunks; ++c) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
  }
}

// One (KV head, key block) task: rows `queries` [rows, D] over keys [k0, k1), row r seeing keys up to
// last_visible[r] -> its partial sums [rows, D], maxima and totals [rows] (attention.cpp's merge_row).
template <int D>
void block_task(const Operands& op, const PassOperands<D>&, const at::BFloat16* queries, int64_t,
                const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1, const Scratch& scratch,
                float* partial, float* maxima, float* totals) {
  const int64_t keys = k1 - k0;
  for (int64_t i = 0; i < rows * D; i += 8) _mm256_storeu_ps(scratch.queries + i, cascade_vector::widen8(queries + i));
  const __m256 scale = _mm256_set1_ps(op.scale);
  for (int64_t k = 0; k < keys; k += kWideKeys) {
    widen_rows<D>(op.keys + (k0 + k) * op.key_stride, op.key_stride, std::min(kWideKeys, keys - k), scratch.wide);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 scores = _mm256_mul_ps(eight_scores<D>(scratch.queries + r * D, scratch.wide), scale);
      _mm256_storeu_ps(scratch.scores + r * kBlockKeys + k, scores);
    }
  }
  std::vector<int64_t> visible(rows);
  int64_t most_visible = 0;
  for (int64_t r = 0; r < rows; ++r) {
    visible[r] = std::clamp<int64_t>(last_visible[r] + 1 - k0, 0, keys);
    most_visible = std::max(most_visible, visible[r]);
    std::tie(maxima[r], totals[r]) = row_weights(scratch.scores + r * kBlockKeys, visible[r]);
  }
  std::fill(partial, partial + rows * D, 0.f);
  for (int64_t k = 0; k < most_visible; k += kWideKeys) {
    widen_rows<D>(op.values + (k0 + k) * op.value_stride, op.value_stride, std::min(kWideKeys, keys - k), scratch.wide);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t count = std::min(kWideKeys, visible[r] - k);
      if (count > 0) add_weighted<D>(scratch.scores + r * kBlockKeys + k, scratch.wide, count, partial + r * D);
    }
  }
}
