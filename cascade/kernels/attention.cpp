// Attention of a short pass (a decode step, a verification) over a long bf16 KV cache, split over
// blocks of keys across threads and merged by log-sum-exp (flash-decoding).
//
// query [H, T, D] bf16, keys / values [H_kv, S, D] bf16 (rows contiguous, any head stride: a view
// of a longer slot buffer) -> out [H, T, D] bf16. The H / H_kv query heads of a KV head and the T
// tokens of the pass are the R = G * T rows (g, t) that meet each key block once: each key and
// value is read from memory once per pass. With `causal`, token t sees keys up to S - T + t (the
// pass's own tokens are the last T keys). Scores come from AMX tiles (a block of 16 keys against
// 16 query rows, float32 accumulation); the softmax and the weighted sum of the values run in
// float32 (AVX-512).

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

#if defined(__AMX_BF16__)

using cascade_vector::bf16_to_float;
using cascade_vector::exp16;

using cascade_tiles::kTileInputs;
using cascade_tiles::kTileRows;

constexpr int64_t kBlockKeys = 256;  // keys per task
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct Operands {
  const at::BFloat16* keys;
  const at::BFloat16* values;
  int64_t key_stride, value_stride;  // elements between consecutive keys (values)
  int64_t dim;
  float scale;
};

// Scores [keys, rows] of keys [k0, k1) against a chunk of `rows` query rows (pairs: the chunk's
// rows pair-interleaved, [D / 2, rows]) into `scores`, unscaled. With head sizes that are multiples
// of 32 every key goes through AMX, tiles of 16 keys; the last few keys of the cache are copied into a
// zero-padded tile first, so a key's score never depends on how many keys follow it (a verification
// pass scores each key as the decode step before it did, bit for bit). Other head sizes go through
// AVX-512 dot products of the chunk's float rows.
void block_scores(const Operands& op, const at::BFloat16* pairs, const float* query_rows, int64_t rows,
                  int64_t k0, int64_t k1, float* scores) {
  if (op.dim % kTileInputs != 0) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t r = 0; r < rows; ++r) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t d = 0; d < op.dim; d += 16) {
          const __m512 key = bf16_to_float(_mm256_loadu_si256((const __m256i*)(op.keys + k * op.key_stride + d)));
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(query_rows + r * op.dim + d), key, sum);
        }
        scores[(k - k0) * rows + r] = _mm512_reduce_add_ps(sum);
      }
    }
    return;
  }
  alignas(64) at::BFloat16 padded[kTileRows * 128] = {};  // the last keys, head size <= 128
  alignas(64) float tail_scores[kTileRows * kTileRows];
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
    for (int64_t d = 0; d < op.dim; d += kTileInputs) {
      _tile_loadd(2, source + d, stride * 2);
      _tile_loadd(4, pairs + d * rows, rows * 4);
      _tile_dpbf16ps(0, 2, 4);
    }
    if (count == kTileRows) {
      _tile_stored(0, scores + (k - k0) * rows, rows * 4);
    } else {
      _tile_stored(0, tail_scores, rows * 4);
      std::copy_n(tail_scores, count * rows, scores + (k - k0) * rows);
    }
  }
}

// Softmax weights of a block in place (per row, over its visible keys; rows are the vector lanes)
// -> the rows' block maximum (scaled scores) and sum of weights.
void block_weights(const Operands& op, const int32_t* last_visible, int64_t rows, int64_t k0, int64_t k1,
                   float* scores, float* maximum, float* total) {
  const __mmask16 lanes = (__mmask16)((1u << rows) - 1);
  const __m512i limits = _mm512_maskz_loadu_epi32(lanes, last_visible);
  const __m512 scale = _mm512_set1_ps(op.scale);
  __m512 best = _mm512_set1_ps(kNegativeInfinity);
  const int64_t seen_by_all = std::min<int64_t>(k1, *std::min_element(last_visible, last_visible + rows) + 1);
  for (int64_t k = k0; k < seen_by_all; ++k) {
    float* row = scores + (k - k0) * rows;
    const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row), scale);
    _mm512_mask_storeu_ps(row, lanes, scaled);
    best = _mm512_max_ps(best, scaled);  // lanes past `rows` hold 0 and are never stored
  }
  for (int64_t k = std::max(k0, seen_by_all); k < k1; ++k) {
    const __mmask16 visible = _mm512_mask_cmpge_epi32_mask(lanes, limits, _mm512_set1_epi32((int32_t)k));
    float* row = scores + (k - k0) * rows;
    const __m512 scaled = _mm512_maskz_mul_ps(visible, _mm512_maskz_loadu_ps(lanes, row), scale);
    const __m512 masked = _mm512_mask_blend_ps(visible, _mm512_set1_ps(kNegativeInfinity), scaled);
    _mm512_mask_storeu_ps(row, lanes, masked);
    best = _mm512_max_ps(best, masked);
  }
  const __m512 safe_best = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(best, _mm512_set1_ps(-1e30f), _CMP_LT_OQ), best,
                                                _mm512_setzero_ps());  // a row that sees no key here
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    float* row = scores + (k - k0) * rows;
    const __m512 weight = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row), safe_best));
    _mm512_mask_storeu_ps(row, lanes, weight);
    sum = _mm512_add_ps(sum, weight);
  }
  _mm512_mask_storeu_ps(maximum, lanes, best);
  _mm512_mask_storeu_ps(total, lanes, sum);
}

// The block's values [k0, k1) as float32 rows [keys, D], read once for every query row.
void block_values_float(const Operands& op, int64_t k0, int64_t k1, float* out) {
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t d = 0; d < op.dim; d += 16) {
      const auto* source = (const __m256i*)(op.values + k * op.value_stride + d);
      _mm512_storeu_ps(out + (k - k0) * op.dim + d, bf16_to_float(_mm256_loadu_si256(source)));
    }
  }
}

// out [D] = sum over the block's keys of weight[k * rows] x values [k, D], D = 16 Chunks, the sum
// held in registers.
template <int Chunks>
void weighted_values(const float* weight, int64_t rows, const float* values, int64_t keys, float* out) {
  __m512 acc[Chunks];
  for (int c = 0; c < Chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < keys; ++k) {
    const __m512 w = _mm512_set1_ps(weight[k * rows]);
    for (int c = 0; c < Chunks; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(values + k * Chunks * 16 + c * 16), acc[c]);
  }
  for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(out + c * 16, acc[c]);
}

// out [rows, D] = weights [keys, rows]^T x values (float [keys, D]).
void block_values(const Operands& op, const float* weights, int64_t rows, const float* values, int64_t keys,
                  float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    switch (op.dim / 16) {
      case 1: weighted_values<1>(weights + r, rows, values, keys, out + r * op.dim); break;
      case 2: weighted_values<2>(weights + r, rows, values, keys, out + r * op.dim); break;
      case 4: weighted_values<4>(weights + r, rows, values, keys, out + r * op.dim); break;
      case 8: weighted_values<8>(weights + r, rows, values, keys, out + r * op.dim); break;
      default: break;  // refused by decode_attention
    }
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

#endif  // __AMX_BF16__

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
#if defined(__AMX_BF16__)
  const at::Tensor grouped = query.contiguous().view({kv_heads, rows, dim});  // row g * T + t of KV head k
  const at::Tensor float_rows = grouped.to(at::kFloat);
  std::vector<at::Tensor> pairs;  // per chunk of up to 16 rows: [H_kv, D / 2, rows, 2]
  for (int64_t c0 = 0; c0 < rows; c0 += kTileRows) {
    const at::Tensor chunk = grouped.narrow(1, c0, std::min(kTileRows, rows - c0));
    pairs.push_back(chunk.reshape({kv_heads, chunk.size(1), dim / 2, 2}).transpose(1, 2).contiguous());
  }
  std::vector<int32_t> last_visible(rows);
  for (int64_t r = 0; r < rows; ++r) last_visible[r] = causal ? num_keys - tokens + r % tokens : num_keys - 1;
  const int64_t blocks = (num_keys + kBlockKeys - 1) / kBlockKeys;
  at::Tensor partial = at::empty({kv_heads, blocks, rows, dim}, float_rows.options());
  at::Tensor maxima = at::empty({kv_heads, blocks, rows}, float_rows.options());
  at::Tensor totals = at::empty({kv_heads, blocks, rows}, float_rows.options());
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kBlockKeys * kTileRows), block_floats(kBlockKeys * dim);
    int64_t configured = 0;  // rows the tiles are set up for
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / blocks, block = task % blocks;
      const int64_t k0 = block * kBlockKeys, k1 = std::min(num_keys, k0 + kBlockKeys);
      const Operands op{keys.data_ptr<at::BFloat16>() + head * keys.stride(0),
                        values.data_ptr<at::BFloat16>() + head * values.stride(0), keys.stride(1), values.stride(1),
                        dim, (float)scale};
      block_values_float(op, k0, k1, block_floats.data());
      for (size_t chunk = 0; chunk < pairs.size(); ++chunk) {  // K/V of the block stay in cache across chunks
        const int64_t c0 = chunk * kTileRows, count = pairs[chunk].size(2);
        if (count != configured) {
          cascade_tiles::configure_tiles(count);
          configured = count;
        }
        block_scores(op, pairs[chunk].data_ptr<at::BFloat16>() + head * dim * count,
                     float_rows.data_ptr<float>() + (head * rows + c0) * dim, count, k0, k1, scores.data());
        block_weights(op, last_visible.data() + c0, count, k0, k1, scores.data(),
                      maxima.data_ptr<float>() + task * rows + c0, totals.data_ptr<float>() + task * rows + c0);
        block_values(op, scores.data(), count, block_floats.data(), k1 - k0,
                     partial.data_ptr<float>() + (task * rows + c0) * dim);
      }
    }
    _tile_release();
  });
  at::Tensor merged = at::empty({kv_heads, rows, dim}, float_rows.options());
  for (int64_t head = 0; head < kv_heads; ++head) {
    merge_blocks(partial.data_ptr<float>() + head * blocks * rows * dim, maxima.data_ptr<float>() + head * blocks * rows,
                 totals.data_ptr<float>() + head * blocks * rows, blocks, rows, dim,
                 merged.data_ptr<float>() + head * rows * dim);
  }
  out.copy_(merged.view({heads, tokens, dim}));
#else
  TORCH_CHECK(false, "decode_attention: this build has no AMX (see features())");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cascade_kernels, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, float scale, bool causal) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) { m.impl("decode_attention", &decode_attention); }
