// Attention of a short pass (a decode step, a verification) over a long bf16 KV cache, split over
// blocks of keys across threads and merged by log-sum-exp (flash-decoding).
//
// query [H, T, D] bf16, keys / values [H_kv, S, D] bf16 (rows contiguous, any head stride: a view
// of a longer slot buffer) -> out [H, T, D] bf16. The H / H_kv query heads of a KV head and the T
// tokens of the pass are the R = G * T rows (g, t) that meet each key block once: each key and
// value is read from memory once per pass. With `causal`, token t sees keys up to S - T + t (the
// pass's own tokens are the last T keys). Scores come from AMX tiles where the CPU has them (a block
// of 16 keys against 16 query rows, float32 accumulation), else from AVX512-BF16 dot products (16 keys
// at a time, their float32 lanes summed together); the softmax and the weighted sum of the values run
// in float32 (AVX-512). Either way a key's score is computed the same way whatever the pass's width
// and however many keys follow it, so a verification pass equals the decode steps it replaces.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "tiles.h"
#include "vector_math.h"

namespace {

#if defined(__AVX512BF16__)

using cascade_vector::bf16_to_float;
using cascade_vector::exp16;
using cascade_vector::sum_each;

constexpr int64_t kChunkRows = 16;  // query rows scored together (an AMX tile's columns)
constexpr int64_t kPairInputs = 32;  // bf16 inputs of one AMX tile row or one AVX512-BF16 product
constexpr int64_t kBlockKeys = 256;  // keys per task
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct Operands {
  const at::BFloat16* keys;
  const at::BFloat16* values;
  int64_t key_stride, value_stride;  // elements between consecutive keys (values)
  int64_t dim;
  float scale;
};

constexpr int64_t kPrefetchKeys = 16;  // how far ahead of its reads a block asks for keys and values

// Ask for a bf16 row of `dim` values (whole cache lines) ahead of its use; past the cache's end the
// hint is dropped (prefetches never fault).
inline void prefetch_row(const at::BFloat16* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 32) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T0);
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

// A chunk of up to 16 query rows of one KV head, in the layouts the score paths read.
struct QueryChunk {
  const at::BFloat16* pairs;  // AMX's pair-interleaved operand [D / 2, rows, 2] (null without AMX)
  const at::BFloat16* rows;  // [rows, D]
  const float* floats;  // [rows, D]
  int64_t count;
};

// Scores of 16 keys at a time from AVX512-BF16 dot products (head size a multiple of 32): per query
// row, each key's 32-input pairs accumulate in its own float32 vector, and the 16 keys' vectors are
// summed together (sum_each). A key past k1 contributes an unused zero lane.
void vector_scores(const Operands& op, const QueryChunk& chunk, int64_t k0, int64_t k1, float* scores) {
  for (int64_t k = k0; k < k1; k += 16) {
    const int64_t count = std::min<int64_t>(16, k1 - k);
    for (int64_t j = 0; j < 16; ++j) prefetch_row(op.keys + (k + kPrefetchKeys + j) * op.key_stride, op.dim);
    for (int64_t r = 0; r < chunk.count; ++r) {
      const at::BFloat16* query = chunk.rows + r * op.dim;
      __m512 partial[16];
      for (int64_t j = 0; j < 16; ++j) {
        partial[j] = _mm512_setzero_ps();
        if (j >= count) continue;
        const at::BFloat16* key = op.keys + (k + j) * op.key_stride;
        for (int64_t d = 0; d < op.dim; d += kPairInputs) {
          partial[j] = _mm512_dpbf16_ps(partial[j], (__m512bh)_mm512_loadu_si512(query + d),
                                        (__m512bh)_mm512_loadu_si512(key + d));
        }
      }
      _mm512_mask_storeu_ps(scores + r * kBlockKeys + (k - k0), first_lanes(count), sum_each(partial));
    }
  }
}

// Scores of head sizes that are not multiples of 32 (16): float32 dot products, one key at a time.
void float_scores(const Operands& op, const QueryChunk& chunk, int64_t k0, int64_t k1, float* scores) {
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t r = 0; r < chunk.count; ++r) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t d = 0; d < op.dim; d += 16) {
        const __m512 key = bf16_to_float(_mm256_loadu_si256((const __m256i*)(op.keys + k * op.key_stride + d)));
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(chunk.floats + r * op.dim + d), key, sum);
      }
      scores[r * kBlockKeys + (k - k0)] = _mm512_reduce_add_ps(sum);
    }
  }
}

#if defined(__AMX_BF16__)

using cascade_tiles::kTileRows;

// Scores from AMX tiles of 16 keys (a tile [16 keys, rows], transposed into the rows); the last few
// keys of the cache are copied into a zero-padded tile first, so a key's score never depends on how
// many keys follow it.
void tile_scores(const Operands& op, const QueryChunk& chunk, int64_t k0, int64_t k1, float* scores) {
  const int64_t rows = chunk.count;
  alignas(64) at::BFloat16 padded[kTileRows * 128] = {};  // the last keys, head size <= 128
  alignas(64) float tile[kTileRows * kTileRows];  // [keys, rows]
  for (int64_t k = k0; k < k1; k += kTileRows) {
    const int64_t count = std::min(kTileRows, k1 - k);
    const at::BFloat16* source = op.keys + k * op.key_stride;
    int64_t stride = op.key_stride;
    if (count < kTileRows) {
      for (int64_t j = 0; j < count; ++j) std::copy_n(op.keys + (k + j) * op.key_stride, op.dim, padded + j * op.dim);
      source = padded;
      stride = op.dim;
    }
    _tile_zero(0);
    for (int64_t d = 0; d < op.dim; d += kPairInputs) {
      _tile_loadd(2, source + d, stride * 2);
      _tile_loadd(4, chunk.pairs + d * rows, rows * 4);
      _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, tile, rows * 4);
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t r = 0; r < rows; ++r) scores[r * kBlockKeys + (k - k0) + j] = tile[j * rows + r];
    }
  }
}

#endif  // __AMX_BF16__

// The AMX operand of each chunk of up to 16 query rows, [H_kv, D / 2, rows, 2]; none where the
// scores come from AVX-512 (no AMX in this build, AMX turned off, or a head size tiles do not take).
std::vector<at::Tensor> tile_operands(const at::Tensor& grouped, int64_t dim) {
  std::vector<at::Tensor> pairs;
#if defined(__AMX_BF16__)
  if (!cascade_tiles::use_amx || dim % kPairInputs != 0) return pairs;
  const int64_t kv_heads = grouped.size(0), rows = grouped.size(1);
  for (int64_t c0 = 0; c0 < rows; c0 += kChunkRows) {
    const at::Tensor chunk = grouped.narrow(1, c0, std::min(kChunkRows, rows - c0));
    pairs.push_back(chunk.reshape({kv_heads, chunk.size(1), dim / 2, 2}).transpose(1, 2).contiguous());
  }
#endif
  return pairs;
}

// Set the tiles up for `rows` query rows -> rows (only called with AMX operands).
int64_t configure_tiles(int64_t rows) {
#if defined(__AMX_BF16__)
  cascade_tiles::configure_tiles(rows);
#endif
  return rows;
}

void release_tiles() {
#if defined(__AMX_BF16__)
  _tile_release();
#endif
}

// Scores [rows, kBlockKeys] of keys [k0, k1) against a chunk of query rows into `scores`, unscaled.
void block_scores(const Operands& op, const QueryChunk& chunk, int64_t k0, int64_t k1, float* scores) {
  if (op.dim % kPairInputs != 0) return float_scores(op, chunk, k0, k1, scores);
#if defined(__AMX_BF16__)
  if (chunk.pairs != nullptr) return tile_scores(op, chunk, k0, k1, scores);
#endif
  vector_scores(op, chunk, k0, k1, scores);
}

// Softmax weights of a block in place, row by row (keys in the vector lanes): a row's keys past its
// last visible one get weight 0 -> the rows' block maxima (scaled scores; -inf for a row that sees
// no key here) and sums of weights. Keys a row cannot see add exact zeros, so a row's figures are
// those of a pass that ends at its last visible key.
void block_weights(const Operands& op, const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1,
                   float* scores, float* maximum, float* total) {
  const __m512 scale = _mm512_set1_ps(op.scale);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * kBlockKeys;
    const int64_t keys = k1 - k0, visible = std::clamp<int64_t>(last_visible[r] + 1 - k0, 0, keys);
    __m512 best = _mm512_set1_ps(kNegativeInfinity);
    for (int64_t k = 0; k < visible; k += 16) {
      const __mmask16 lanes = first_lanes(visible - k);
      const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + k), scale);
      _mm512_mask_storeu_ps(row + k, lanes, scaled);
      best = _mm512_mask_max_ps(best, lanes, best, scaled);
    }
    const float largest = _mm512_reduce_max_ps(best);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < keys; k += 16) {
      const __mmask16 seen = first_lanes(std::max<int64_t>(visible - k, 0));
      const __m512 weight = _mm512_maskz_mov_ps(
          seen, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, row + k), _mm512_set1_ps(largest))));
      _mm512_mask_storeu_ps(row + k, first_lanes(keys - k), weight);
      sum = _mm512_add_ps(sum, weight);
    }
    maximum[r] = largest;
    total[r] = _mm512_reduce_add_ps(sum);
  }
}

// The block's values [k0, k1) as float32 rows [keys, D], read once for every query row.
void block_values_float(const Operands& op, int64_t k0, int64_t k1, float* out) {
  for (int64_t k = k0; k < k1; ++k) {
    prefetch_row(op.values + (k + kPrefetchKeys) * op.value_stride, op.dim);
    for (int64_t d = 0; d < op.dim; d += 16) {
      const auto* source = (const __m256i*)(op.values + k * op.value_stride + d);
      _mm512_storeu_ps(out + (k - k0) * op.dim + d, bf16_to_float(_mm256_loadu_si256(source)));
    }
  }
}

// out [Rows, D] = weights [Rows, kBlockKeys] x values [keys, D] for D = 16 Chunks: each key's value row
// is loaded once for the Rows rows, whose sums are held in registers (one chain per row and chunk).
template <int Chunks, int Rows>
void weighted_values(const float* weights, const float* values, int64_t keys, float* out) {
  __m512 acc[Rows][Chunks];
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Chunks; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < keys; ++k) {
    __m512 value[Chunks];
    for (int c = 0; c < Chunks; ++c) value[c] = _mm512_loadu_ps(values + k * Chunks * 16 + c * 16);
    for (int r = 0; r < Rows; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r * kBlockKeys + k]);
      for (int c = 0; c < Chunks; ++c) acc[r][c] = _mm512_fmadd_ps(w, value[c], acc[r][c]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(out + r * Chunks * 16 + c * 16, acc[r][c]);
  }
}

// out [rows, D] = weights [rows, kBlockKeys] x values (float [keys, D]), rows in groups that keep
// 16 accumulators in registers.
template <int Chunks>
void grouped_values(const float* weights, int64_t rows, const float* values, int64_t keys, float* out) {
  constexpr int kGroup = Chunks >= 8 ? 2 : 4;
  const int64_t dim = Chunks * 16;
  int64_t r = 0;
  for (; r + kGroup <= rows; r += kGroup) {
    weighted_values<Chunks, kGroup>(weights + r * kBlockKeys, values, keys, out + r * dim);
  }
  switch (rows - r) {
    case 3: weighted_values<Chunks, 3>(weights + r * kBlockKeys, values, keys, out + r * dim); break;
    case 2: weighted_values<Chunks, 2>(weights + r * kBlockKeys, values, keys, out + r * dim); break;
    case 1: weighted_values<Chunks, 1>(weights + r * kBlockKeys, values, keys, out + r * dim); break;
    default: break;
  }
}

void block_values(const Operands& op, const float* weights, int64_t rows, const float* values, int64_t keys,
                  float* out) {
  switch (op.dim / 16) {
    case 1: grouped_values<1>(weights, rows, values, keys, out); break;
    case 2: grouped_values<2>(weights, rows, values, keys, out); break;
    case 4: grouped_values<4>(weights, rows, values, keys, out); break;
    case 8: grouped_values<8>(weights, rows, values, keys, out); break;
    default: break;  // refused by decode_attention
  }
}

// Combine a KV head's blocks: partial sums [blocks, R, D], maxima and totals [blocks, R] -> out rows.
void merge_blocks(const float* partial, const float* maxima, const float* totals, int64_t blocks, int64_t rows,
                  int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float best = kNegativeInfinity;
    for (int64_t b = 0; b < blocks; ++b) best = std::max(best, maxima[b * rows + r]);
    float total = 0.f;
    std::fill(out + r * dim, out + (r + 1) * dim, 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float m = maxima[b * rows + r];
      if (m == kNegativeInfinity) continue;  // the row sees no key of this block
      const float factor = std::exp(m - best);
      total += factor * totals[b * rows + r];
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] += factor * partial[(b * rows + r) * dim + d];
    }
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] /= total;
  }
}

#endif  // __AVX512BF16__

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale,
                            bool causal) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3,
              "decode_attention: query [H, T, D], keys and values [H_kv, S, D]; got ", query.sizes(), ", ",
              keys.sizes(), ", ", values.sizes());
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(0), num_keys = keys.size(1);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(2) == dim && heads % kv_heads == 0,
              "decode_attention: keys and values [H_kv, S, D] with D = ", dim, " and H = ", heads,
              " a multiple of H_kv; got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16, "decode_attention: bfloat16 query, keys and values");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && (dim == 16 || dim == 32 || dim == 64 || dim == 128),
              "decode_attention: rows of keys and values contiguous, head size 16, 32, 64 or 128; got ", dim);
  const int64_t group = heads / kv_heads, rows = group * tokens;
  TORCH_CHECK(num_keys >= tokens, "decode_attention: fewer keys (", num_keys, ") than tokens (", tokens, ")");
  at::Tensor out = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__AVX512BF16__)
  const at::Tensor grouped = query.contiguous().view({kv_heads, rows, dim});  // row g * T + t of KV head k
  const at::Tensor float_rows = grouped.to(at::kFloat);
  const std::vector<at::Tensor> pairs = tile_operands(grouped, dim);
  std::vector<int32_t> last_visible(rows);
  for (int64_t r = 0; r < rows; ++r) last_visible[r] = causal ? num_keys - tokens + r % tokens : num_keys - 1;
  const int64_t blocks = (num_keys + kBlockKeys - 1) / kBlockKeys;
  at::Tensor partial = at::empty({kv_heads, blocks, rows, dim}, float_rows.options());
  at::Tensor maxima = at::empty({kv_heads, blocks, rows}, float_rows.options());
  at::Tensor totals = at::empty({kv_heads, blocks, rows}, float_rows.options());
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kBlockKeys * kChunkRows), block_floats(kBlockKeys * dim);
    int64_t configured = 0;  // rows the tiles are set up for
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / blocks, block = task % blocks;
      const int64_t k0 = block * kBlockKeys, k1 = std::min(num_keys, k0 + kBlockKeys);
      const Operands op{keys.data_ptr<at::BFloat16>() + head * keys.stride(0),
                        values.data_ptr<at::BFloat16>() + head * values.stride(0), keys.stride(1), values.stride(1),
                        dim, (float)scale};
      block_values_float(op, k0, k1, block_floats.data());
      for (int64_t c0 = 0; c0 < rows; c0 += kChunkRows) {  // K/V of the block stay in cache across chunks
        const int64_t count = std::min(kChunkRows, rows - c0);
        const QueryChunk chunk{pairs.empty() ? nullptr : pairs[c0 / kChunkRows].data_ptr<at::BFloat16>() + head * dim * count,
                               grouped.data_ptr<at::BFloat16>() + (head * rows + c0) * dim,
                               float_rows.data_ptr<float>() + (head * rows + c0) * dim, count};
        if (chunk.pairs != nullptr && count != configured) configured = configure_tiles(count);
        block_scores(op, chunk, k0, k1, scores.data());
        block_weights(op, last_visible.data() + c0, count, k0, k1, scores.data(),
                      maxima.data_ptr<float>() + task * rows + c0, totals.data_ptr<float>() + task * rows + c0);
        block_values(op, scores.data(), count, block_floats.data(), k1 - k0,
                     partial.data_ptr<float>() + (task * rows + c0) * dim);
      }
    }
    if (configured != 0) release_tiles();
  });
  at::Tensor merged = at::empty({kv_heads, rows, dim}, float_rows.options());
  for (int64_t head = 0; head < kv_heads; ++head) {
    merge_blocks(partial.data_ptr<float>() + head * blocks * rows * dim, maxima.data_ptr<float>() + head * blocks * rows,
                 totals.data_ptr<float>() + head * blocks * rows, blocks, rows, dim,
                 merged.data_ptr<float>() + head * rows * dim);
  }
  out.copy_(merged.view({heads, tokens, dim}));
#else
  TORCH_CHECK(false, "decode_attention: this build has no AVX512-BF16 (see features())");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cascade_kernels, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, float scale, bool causal) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) { m.impl("decode_attention", &decode_attention); }
