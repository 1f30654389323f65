// A short pass's key blocks on a CPU with AVX2 and FMA but no AVX512-BF16 (CASCADE_AVX2, see
// vector_math.h). Included by attention.cpp inside its anonymous namespace: attention.cpp splits the
// pass into (KV head, block of kBlockKeys keys) tasks across the threads and merges each row's
// blocks in key order; this file computes one task, in float32 arithmetic, in register tiles that
// take up to 6 rows (the query heads of a KV head and the pass's tokens) at once, so each key and
// value loaded and widened from bf16 serves every row of the tile:
// - scores: a tile of rows x keys (6 x 2 .. 1 x 8), each score 8 lanes of fused multiply-adds over
//   its query's dimensions, 8 at a time, then folded by one fixed tree of additions (fold8, fold4);
// - softmax over the keys a row sees: their maximum, exp8, the weights summed in 8 lanes then sum8;
// - weighted sums: a tile of rows x dimensions (6 x 16 .. 1 x 64) over 32 keys at a time (read from
//   L1 by every tile of the block's rows), each dimension's sum taken in key order.
// While the scores are taken, the keys kKeysAhead on are asked for (into L1) and the scored keys'
// values (into L2): the block's reads overlap its arithmetic.
// A key's score and a row's sums take the same operations in the same order whatever the tile, the
// pass's width and however many keys follow (keys a row does not see are never added to its sums),
// so a verification pass equals the decode steps it replaces bit for bit, and a tree node's rows
// equal its step's (attention.cpp hands each its own keys).

#pragma once

constexpr int kTileRows = 6;  // rows of a register tile
constexpr int64_t kValueKeys = 32;  // keys whose values every tile of the rows reads while in L1
constexpr int64_t kKeysAhead = 16;  // how far ahead of the scores the keys are asked for
constexpr int64_t kLanes = 8;  // float32 lanes of a register

// Keys scored together by a tile of Rows rows: at most 12 sums and 16 registers.
template <int Rows>
constexpr int kScoreKeys = Rows >= 5 ? 2 : Rows >= 3 ? 3 : Rows == 2 ? 4 : 8;

// 8-dimension chunks a tile of Rows rows sums together (of a head's D / 8).
template <int D, int Rows>
constexpr int kValueChunks = std::min(D / 8, Rows >= 4 ? 2 : Rows >= 2 ? 4 : 8);

// A thread's working memory for its blocks, kept from call to call and grown when a pass needs more.
struct Scratch {
  float* queries;  // [rows, D] float32
  float* scores;  // [rows, kBlockKeys]: scaled scores, then the softmax weights
};

template <int D>
Scratch thread_scratch(int64_t rows) {
  thread_local std::vector<float> memory;
  const int64_t floats = rows * D + rows * kBlockKeys;
  if (static_cast<int64_t>(memory.size()) < floats) memory.resize(floats);
  return {memory.data(), memory.data() + rows * D};
}

// Nothing beyond its rows is shared by a pass's blocks here (no tiles).
template <int D>
struct PassOperands {
  PassOperands(const at::Tensor&, int64_t) {}
};

// Lane j of the result = the sum of sums[j]'s 8 lanes: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
inline __m256 fold8(const __m256* sums) {
  const __m256 pairs0 = _mm256_hadd_ps(sums[0], sums[1]), pairs1 = _mm256_hadd_ps(sums[2], sums[3]);
  const __m256 pairs2 = _mm256_hadd_ps(sums[4], sums[5]), pairs3 = _mm256_hadd_ps(sums[6], sums[7]);
  const __m256 quads0 = _mm256_hadd_ps(pairs0, pairs1), quads1 = _mm256_hadd_ps(pairs2, pairs3);
  return _mm256_add_ps(_mm256_permute2f128_ps(quads0, quads1, 0x20), _mm256_permute2f128_ps(quads0, quads1, 0x31));
}

// Lane j of the result = the sum of sums[j]'s 8 lanes, by fold8's tree.
inline __m128 fold4(const __m256* sums) {
  const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(sums[0], sums[1]), _mm256_hadd_ps(sums[2], sums[3]));
  return _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
}

// out[i] = the sum of sums[i]'s 8 lanes for i < Count, each by fold8's tree.
template <int Count>
inline void fold_each(const __m256 (&sums)[Count], float* out) {
  int i = 0;
  for (; i + 8 <= Count; i += 8) _mm256_storeu_ps(out + i, fold8(sums + i));
  for (; i + 4 <= Count; i += 4) _mm_storeu_ps(out + i, fold4(sums + i));
  if constexpr (Count % 4 != 0) {
    __m256 last[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < Count % 4; ++j) last[j] = sums[i + j];
    alignas(16) float four[4];
    _mm_store_ps(four, fold4(last));
    for (int j = 0; j < Count % 4; ++j) out[i + j] = four[j];
  }
}

// Scaled scores of Rows query rows ([Rows, D] float32, D apart) against Keys keys from `key` (bf16,
// `stride` apart) -> scores[r * kBlockKeys + j].
template <int D, int Rows, int Keys>
inline void tile_scores(const float* queries, const at::BFloat16* key, int64_t stride, float scale, float* scores) {
  __m256 sums[Rows * Keys];
  for (auto& sum : sums) sum = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    __m256 keys[Keys];
    for (int j = 0; j < Keys; ++j) keys[j] = cascade_vector::widen8(key + j * stride + d);
    for (int r = 0; r < Rows; ++r) {
      const __m256 query = _mm256_loadu_ps(queries + r * D + d);
      for (int j = 0; j < Keys; ++j) sums[r * Keys + j] = _mm256_fmadd_ps(query, keys[j], sums[r * Keys + j]);
    }
  }
  float folded[Rows * Keys];
  fold_each<Rows * Keys>(sums, folded);
  for (int r = 0; r < Rows; ++r) {
    for (int j = 0; j < Keys; ++j) scores[r * kBlockKeys + j] = folded[r * Keys + j] * scale;
  }
}

// Scaled scores [rows, kBlockKeys] of keys [k0, k1) against the float32 queries [rows, D]; the first
// tile of rows asks for the keys kKeysAhead on and for its keys' values.
template <int D>
void block_scores(const Operands& op, const float* queries, int64_t rows, int64_t k0, int64_t k1, float* scores) {
  const int64_t keys = k1 - k0;
  in_row_groups<kTileRows>(rows, [&](int64_t r, auto count) {
    constexpr int kRows = decltype(count)::value, kKeys = kScoreKeys<kRows>;
    const float* tile_queries = queries + r * D;
    float* tile_out = scores + r * kBlockKeys;
    int64_t k = 0;
    for (; k + kKeys <= keys; k += kKeys) {
      const at::BFloat16* key = op.keys + (k0 + k) * op.key_stride;
      if (r == 0) {
        for (int j = 0; j < kKeys; ++j) {
          prefetch_row<D, _MM_HINT_T0>(key + (kKeysAhead + j) * op.key_stride);
          prefetch_row<D, _MM_HINT_T1>(op.values + (k0 + k + j) * op.value_stride);
        }
      }
      tile_scores<D, kRows, kKeys>(tile_queries, key, op.key_stride, op.scale, tile_out + k);
    }
    for (; k < keys; ++k) {
      tile_scores<D, kRows, 1>(tile_queries, op.keys + (k0 + k) * op.key_stride, op.key_stride, op.scale, tile_out + k);
    }
  });
}

// Lanes [0, left) of 8 set.
inline __m256 lanes_below(int64_t left) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), index));
}

// A row's softmax weights over its first `visible` scores, in place (lanes past them in the last
// group of 8 zero) -> the row's maximum (-inf when it sees no key here) and the weights' sum.
inline std::pair<float, float> row_weights(float* scores, int64_t visible) {
  if (visible == 0) return {kNegativeInfinity, 0.f};
  __m256 most = _mm256_set1_ps(kNegativeInfinity);
  for (int64_t k = 0; k < visible; k += kLanes) {
    const __m256 seen = _mm256_blendv_ps(most, _mm256_loadu_ps(scores + k), lanes_below(visible - k));
    most = _mm256_max_ps(most, seen);
  }
  const float best = cascade_vector::max8(most);
  __m256 total = _mm256_setzero_ps();
  for (int64_t k = 0; k < visible; k += kLanes) {
    const __m256 shifted = _mm256_sub_ps(_mm256_loadu_ps(scores + k), _mm256_set1_ps(best));
    const __m256 weights = _mm256_and_ps(cascade_vector::exp8(shifted), lanes_below(visible - k));
    _mm256_storeu_ps(scores + k, weights);
    total = _mm256_add_ps(total, weights);
  }
  return {best, cascade_vector::sum8(total)};
}

// out [Rows, D] (D apart) += for each row, in key order over keys [ka, kb), weights[r * kBlockKeys +
// j] x value j (bf16 `value` at key ka, `stride` apart), for Chunks x 8 dimensions from d0.
template <int D, int Rows, int Chunks>
inline void tile_values(const float* weights, const at::BFloat16* value, int64_t stride, int64_t ka, int64_t kb,
                        int d0, float* out) {
  __m256 sums[Rows][Chunks];
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Chunks; ++c) sums[r][c] = _mm256_loadu_ps(out + r * D + d0 + 8 * c);
  }
  for (int64_t j = ka; j < kb; ++j) {
    const at::BFloat16* row = value + (j - ka) * stride + d0;
    if constexpr (Rows < Chunks) {  // the rows' weights held, each chunk of the value used as loaded
      __m256 weight[Rows];
      for (int r = 0; r < Rows; ++r) weight[r] = _mm256_broadcast_ss(weights + r * kBlockKeys + j);
      for (int c = 0; c < Chunks; ++c) {
        const __m256 chunk = cascade_vector::widen8(row + 8 * c);
        for (int r = 0; r < Rows; ++r) sums[r][c] = _mm256_fmadd_ps(weight[r], chunk, sums[r][c]);
      }
    } else {  // the value's chunks held, each row's weight used as loaded
      __m256 chunk[Chunks];
      for (int c = 0; c < Chunks; ++c) chunk[c] = cascade_vector::widen8(row + 8 * c);
      for (int r = 0; r < Rows; ++r) {
        const __m256 weight = _mm256_broadcast_ss(weights + r * kBlockKeys + j);
        for (int c = 0; c < Chunks; ++c) sums[r][c] = _mm256_fmadd_ps(weight, chunk[c], sums[r][c]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Chunks; ++c) _mm256_storeu_ps(out + r * D + d0 + 8 * c, sums[r][c]);
  }
}

// A tile of Rows rows' sums over keys [ka, kb) (block-relative), row r adding only the keys it sees
// (below visible[r]): the keys all of them see together, then each row's further keys on its own.
template <int D, int Rows>
void tile_rows_values(const Operands& op, int64_t k0, const float* weights, const int64_t* visible, int64_t ka,
                      int64_t kb, float* out) {
  constexpr int kChunks = kValueChunks<D, Rows>;
  const int64_t shared = std::clamp(*std::min_element(visible, visible + Rows), ka, kb);
  for (int d0 = 0; d0 < D; d0 += 8 * kChunks) {
    if (shared > ka) {
      const at::BFloat16* values = op.values + (k0 + ka) * op.value_stride;
      tile_values<D, Rows, kChunks>(weights, values, op.value_stride, ka, shared, d0, out);
    }
    for (int r = 0; r < Rows; ++r) {
      const int64_t end = std::min(visible[r], kb);
      if (end <= shared) continue;
      tile_values<D, 1, kChunks>(weights + r * kBlockKeys, op.values + (k0 + shared) * op.value_stride,
                                 op.value_stride, shared, end, d0, out + r * D);
    }
  }
}

// One (KV head, key block) task: rows `queries` [rows, D] over keys [k0, k1), row r seeing keys up to
// last_visible[r] -> its partial sums [rows, D], maxima and totals [rows] (attention.cpp's merge_row).
template <int D>
void block_task(const Operands& op, const PassOperands<D>&, const at::BFloat16* queries, int64_t,
                const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1, const Scratch& scratch,
                float* partial, float* maxima, float* totals) {
  for (int64_t i = 0; i < rows * D; i += 8) _mm256_storeu_ps(scratch.queries + i, cascade_vector::widen8(queries + i));
  block_scores<D>(op, scratch.queries, rows, k0, k1, scratch.scores);
  std::vector<int64_t> visible(rows);
  int64_t most_visible = 0;
  for (int64_t r = 0; r < rows; ++r) {
    visible[r] = visible_keys(last_visible[r], k0, k1);
    most_visible = std::max(most_visible, visible[r]);
    std::tie(maxima[r], totals[r]) = row_weights(scratch.scores + r * kBlockKeys, visible[r]);
  }
  std::fill(partial, partial + rows * D, 0.f);
  for (int64_t ka = 0; ka < most_visible; ka += kValueKeys) {
    const int64_t kb = std::min(ka + kValueKeys, most_visible);
    in_row_groups<kTileRows>(rows, [&](int64_t r, auto count) {
      tile_rows_values<D, decltype(count)::value>(op, k0, scratch.scores + r * kBlockKeys, visible.data() + r, ka, kb,
                                                  partial + r * D);
    });
  }
}
