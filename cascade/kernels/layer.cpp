// A decoder layer's work around attention, for a short bf16 pass on CPU, as one call each side.
//
// A decode step of a small model is mostly host time when each layer is a chain of framework ops:
// SmolLM2's 30 layers as compiled graphs spent ~14 ms of a 27 ms step outside the weight products
// (graph guards, wrappers, small elementwise kernels). Here each side of attention is one op:
//
//   pre_attention:  x [T, C] -> RMSNorm -> qkv product (+ bias) -> rotary on queries and keys
//                   -> query [1, H, T, D], key [1, H_kv, T, D], value [1, H_kv, T, D]
//   post_attention: x, attended [1, H, T, D] -> x + o product -> RMSNorm -> gate/up product
//                   -> SiLU(gate) * up -> down product -> + residual
//   logits:         x [N, C] -> RMSNorm -> head product -> [N, V]
//
// and for a pass too long for them (a prefill chunk, whose products are PyTorch's), norm_rows and
// gated_rows run the same norms and SiLU products over its rows, split across threads: a SmolLM2
// prefill of 2,048 tokens took 0.58 s against 0.63 with PyTorch's elementwise ops on the AMX Xeon.
//
// and decoder_layers runs every layer of a pass over plain KV caches (its K/V written at consecutive
// slots, attention over every slot up to them) in one call: no Python per layer, and with
// AVX512-BF16 one parallel region for all of them (layers_in_one_region; bf16 weights, or int8 and
// 4-bit ones where this build has their kernels). A pass may hold several sequences, each with its
// own cache, which share each read of the weights (a batch).
//
// The products are cascade's kernels (products.h): bf16 weights, or int8 or 4-bit (uint8) ones packed
// by cascade.quantise where a scales tensor comes with them. Elementwise work runs in float32 and
// rounds to bf16 where the model's other passes round: after each norm, each projection, the
// rotation, the SiLU product and each residual sum (AVX-512, or AVX2 where the CPU lacks AVX512-BF16;
// see vector_math.h).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "products.h"
#include "quantised_rows.h"
#include "vector_math.h"

namespace {

using at::BFloat16;

at::Tensor product(const at::Tensor& rows, const at::Tensor& weight, const std::optional<at::Tensor>& scales) {
  if (!scales.has_value()) return cascade_kernels::rows_times_weight(rows, weight);
  return weight.scalar_type() == at::kByte ? cascade_kernels::rows_times_int4(rows, weight, *scales)
                                           : cascade_kernels::rows_times_int8(rows, weight, *scales);
}

#if defined(__AVX512BF16__)

// Lanes [0, min(left, 16)) of a 16-lane register: the elements a row has left from here.
inline __mmask16 lanes_left(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

inline __m512 load_floats(const BFloat16* source, __mmask16 lanes) {  // 16 bf16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, source)), 16));
}

inline __m512 rounded(__m512 values) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(values)); }  // to bf16 and back

inline void store_rounded(BFloat16* target, __m512 values, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(target, lanes, (__m256i)_mm512_cvtneps_pbh(values));
}

#elif defined(CASCADE_AVX2)

using cascade_vector::rounded8;
using cascade_vector::store_rounded8;
using cascade_vector::sum8;
using cascade_vector::widen8;

#endif

constexpr int64_t kRowsPerTask = 32;  // rows of an elementwise op per thread's task: a short pass's run inline

// row [C] bf16 -> row / rms(row) * gain, bf16: the squares summed in float32 lanes, then across them.
#if defined(__AVX512BF16__)
void norm_row(const BFloat16* row, const BFloat16* gain, BFloat16* target, int64_t width, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += 16) {
    const __m512 values = load_floats(row + c, lanes_left(width - c));
    squares = _mm512_fmadd_ps(values, values, squares);
  }
  const float inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / width + eps);
  for (int64_t c = 0; c < width; c += 16) {
    const __mmask16 lanes = lanes_left(width - c);
    const __m512 scaled = _mm512_mul_ps(load_floats(row + c, lanes), _mm512_set1_ps(inverse));
    store_rounded(target + c, _mm512_mul_ps(scaled, load_floats(gain + c, lanes)), lanes);
  }
}
#elif defined(CASCADE_AVX2)
void norm_row(const BFloat16* row, const BFloat16* gain, BFloat16* target, int64_t width, float eps) {
  const int64_t whole = width / 8 * 8;
  __m256 squares = _mm256_setzero_ps();
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 values = widen8(row + c);
    squares = _mm256_fmadd_ps(values, values, squares);
  }
  float sum = sum8(squares);
  for (int64_t c = whole; c < width; ++c) sum += static_cast<float>(row[c]) * static_cast<float>(row[c]);
  const float inverse = 1.0f / std::sqrt(sum / width + eps);
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 scaled = _mm256_mul_ps(widen8(row + c), _mm256_set1_ps(inverse));
    store_rounded8(target + c, _mm256_mul_ps(scaled, widen8(gain + c)));
  }
  for (int64_t c = whole; c < width; ++c) {
    target[c] = BFloat16(static_cast<float>(row[c]) * inverse * static_cast<float>(gain[c]));
  }
}
#endif

// x [T, C] bf16 -> x / rms(x) * weight, bf16, row by row (norm_row), rows split across threads where a
// pass has many (a prefill chunk).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty_like(x);
#if defined(__AVX512BF16__) || defined(CASCADE_AVX2)
  const auto* source = x.data_ptr<BFloat16>();
  const auto* gain = weight.data_ptr<BFloat16>();
  auto* target = out.data_ptr<BFloat16>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_row(source + t * width, gain, target + t * width, width, static_cast<float>(eps));
    }
  });
#else
  TORCH_CHECK(false, "cascade layer kernels: this build has neither AVX512-BF16 nor AVX2 with FMA");
#endif
  return out;
}

void check_pass(const at::Tensor& x, const at::Tensor& norm_weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "cascade layer kernels: a contiguous bf16 residual stream [T, C]; got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(norm_weight.scalar_type() == at::kBFloat16 && norm_weight.numel() == x.size(1),
              "cascade layer kernels: a bf16 norm weight of ", x.size(1), " values; got ", norm_weight.sizes());
}

// One head's part of a projection row, row [D] float32 (+ bias [D]) -> rounded to bf16 as the projection
// is, then (queries and keys: `rotate`) rotated by cos / sin [D] (half-split convention) -> out [D] bf16.
void head_row(const float* row, const BFloat16* bias, const BFloat16* cos, const BFloat16* sin, int64_t dim,
              bool rotate, BFloat16* out) {
  float head[512];
  for (int64_t d = 0; d < dim; ++d) {
    head[d] = static_cast<float>(BFloat16(row[d] + (bias ? static_cast<float>(bias[d]) : 0.0f)));
  }
  if (!rotate) {
    for (int64_t d = 0; d < dim; ++d) out[d] = BFloat16(head[d]);
    return;
  }
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float partner = d < half ? -head[d + half] : head[d - half];
    out[d] = BFloat16(head[d] * static_cast<float>(cos[d]) + partner * static_cast<float>(sin[d]));
  }
}

// projections [T, (H + 2 H_kv) D] float32 (+ bias) -> [H + 2 H_kv, T, D] bf16, the first H + H_kv heads
// (queries, keys) rotated by cos / sin [T, D].
at::Tensor rotate_heads(const at::Tensor& projections, const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t rotated_heads, int64_t total_heads) {
  const int64_t tokens = projections.size(0), dim = projections.size(1) / total_heads;
  at::Tensor out = at::empty({total_heads, tokens, dim}, projections.options().dtype(at::kBFloat16));
  const BFloat16* offsets = bias.has_value() ? bias->data_ptr<BFloat16>() : nullptr;
  auto* target = out.data_ptr<BFloat16>();
  for (int64_t h = 0; h < total_heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      head_row(projections.data_ptr<float>() + t * projections.size(1) + h * dim, offsets ? offsets + h * dim : nullptr,
               cos.data_ptr<BFloat16>() + t * dim, sin.data_ptr<BFloat16>() + t * dim, dim, h < rotated_heads,
               target + (h * tokens + t) * dim);
    }
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pre_attention(
    const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& qkv_weight,
    const std::optional<at::Tensor>& qkv_scales, const std::optional<at::Tensor>& qkv_bias, const at::Tensor& cos,
    const at::Tensor& sin, double eps, int64_t heads, int64_t kv_heads) {
  check_pass(x, norm_weight);
  const int64_t total_heads = heads + 2 * kv_heads;
  const at::Tensor projections = product(rms_norm(x, norm_weight, eps), qkv_weight, qkv_scales);  // [T, (H + 2 H_kv) D]
  const int64_t dim = projections.size(1) / total_heads;
  TORCH_CHECK(dim * total_heads == projections.size(1) && dim % 2 == 0 && dim <= 512,
              "pre_attention: ", projections.size(1), " projections do not split into ", total_heads,
              " heads of an even size up to 512");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == dim,
              "pre_attention: cos and sin [T, D] = [", x.size(0), ", ", dim, "]; got ", cos.sizes());
  const at::Tensor heads_out = rotate_heads(projections, qkv_bias, cos.contiguous(), sin.contiguous(),
                                            heads + kv_heads, total_heads);  // [H + 2 H_kv, T, D]
  return {heads_out.narrow(0, 0, heads).unsqueeze(0), heads_out.narrow(0, heads, kv_heads).unsqueeze(0),
          heads_out.narrow(0, heads + kv_heads, kv_heads).unsqueeze(0)};
}

// residual [N] bf16 + update [N] float32 (rounded to bf16 first) -> target [N] bf16.
#if defined(__AVX512BF16__)
void add_rounded_into(const BFloat16* base, const float* delta, BFloat16* target, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = lanes_left(count - i);
    const __m512 sum = _mm512_add_ps(load_floats(base + i, lanes), rounded(_mm512_maskz_loadu_ps(lanes, delta + i)));
    store_rounded(target + i, sum, lanes);
  }
}
#elif defined(CASCADE_AVX2)
void add_rounded_into(const BFloat16* base, const float* delta, BFloat16* target, int64_t count) {
  const int64_t whole = count / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    store_rounded8(target + i, _mm256_add_ps(widen8(base + i), rounded8(_mm256_loadu_ps(delta + i))));
  }
  for (int64_t i = whole; i < count; ++i) {
    target[i] = BFloat16(static_cast<float>(base[i]) + static_cast<float>(BFloat16(delta[i])));
  }
}
#endif

// residual [T, C] bf16 + update [T, C] float32 (rounded to bf16 first) -> bf16.
at::Tensor add_rounded(const at::Tensor& residual, const at::Tensor& update) {
  at::Tensor out = at::empty_like(residual);
#if defined(__AVX512BF16__) || defined(CASCADE_AVX2)
  add_rounded_into(residual.data_ptr<BFloat16>(), update.data_ptr<float>(), out.data_ptr<BFloat16>(), residual.numel());
#else
  TORCH_CHECK(false, "cascade layer kernels: this build has neither AVX512-BF16 nor AVX2 with FMA");
#endif
  return out;
}

// gates, ups [F] (float32 projections, or bf16) -> SiLU(gate) * up [F] bf16, each rounded to bf16 first
// as a projection is.
#if defined(__AVX512BF16__)
inline __m512 rounded_floats(const float* source, __mmask16 lanes) {
  return rounded(_mm512_maskz_loadu_ps(lanes, source));
}
inline __m512 rounded_floats(const BFloat16* source, __mmask16 lanes) { return load_floats(source, lanes); }

template <typename Source>
void gated_row(const Source* gates, const Source* ups, BFloat16* target, int64_t width) {
  using cascade_vector::exp16;
  for (int64_t f = 0; f < width; f += 16) {
    const __mmask16 lanes = lanes_left(width - f);
    const __m512 gate = rounded_floats(gates + f, lanes), up = rounded_floats(ups + f, lanes);
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
    const __m512 silu = _mm512_div_ps(gate, denominator);
    store_rounded(target + f, _mm512_mul_ps(silu, up), lanes);
  }
}
#elif defined(CASCADE_AVX2)
inline __m256 rounded_floats8(const float* source) { return rounded8(_mm256_loadu_ps(source)); }
inline __m256 rounded_floats8(const BFloat16* source) { return widen8(source); }

template <typename Source>
void gated_row(const Source* gates, const Source* ups, BFloat16* target, int64_t width) {
  using cascade_vector::exp8;
  const int64_t whole = width / 8 * 8;
  for (int64_t f = 0; f < whole; f += 8) {
    const __m256 gate = rounded_floats8(gates + f), up = rounded_floats8(ups + f);
    const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate)));
    const __m256 silu = _mm256_div_ps(gate, denominator);
    store_rounded8(target + f, _mm256_mul_ps(silu, up));
  }
  for (int64_t f = whole; f < width; ++f) {
    const float gate = static_cast<float>(BFloat16(gates[f])), up = static_cast<float>(BFloat16(ups[f]));
    target[f] = BFloat16(gate / (1.0f + std::exp(-gate)) * up);
  }
}
#endif

// gate and up [T, 2F] (float32 projections, or bf16) -> SiLU(gate) * up [T, F] bf16, row by row
// (gated_row), rows split across threads where a pass has many (a prefill chunk).
at::Tensor gated(const at::Tensor& gate_up) {
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({tokens, width}, gate_up.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__) || defined(CASCADE_AVX2)
  auto* target = out.data_ptr<BFloat16>();
  const auto rows = [&](const auto* source) {
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        gated_row(source + t * 2 * width, source + t * 2 * width + width, target + t * width, width);
      }
    });
  };
  if (gate_up.scalar_type() == at::kBFloat16) {
    rows(gate_up.data_ptr<BFloat16>());
  } else {
    rows(gate_up.data_ptr<float>());
  }
#else
  TORCH_CHECK(false, "cascade layer kernels: this build has neither AVX512-BF16 nor AVX2 with FMA");
#endif
  return out;
}

// Prefill chunks' norms and SiLU products (a pass too long for pre_attention and post_attention, whose
// products are cascade's few-row kernels): the same elementwise work over many rows, split across threads.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_pass(x, weight);
  return rms_norm(x, weight, eps);
}

at::Tensor gated_rows(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() &&
                  gate_up.scalar_type() == at::kBFloat16,
              "gated_rows: a contiguous bf16 [T, 2F] gate and up projection; got ", gate_up.sizes(), " ",
              gate_up.scalar_type());
  return gated(gate_up);
}

at::Tensor post_attention(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& o_weight,
                          const std::optional<at::Tensor>& o_scales, const at::Tensor& norm_weight,
                          const at::Tensor& gate_up_weight, const std::optional<at::Tensor>& gate_up_scales,
                          const at::Tensor& down_weight, const std::optional<at::Tensor>& down_scales, double eps) {
  check_pass(x, norm_weight);
  TORCH_CHECK(attended.dim() == 4 && attended.size(0) == 1 && attended.size(2) == x.size(0),
              "post_attention: attention output [1, H, T, D] for T = ", x.size(0), "; got ", attended.sizes());
  const at::Tensor rows = attended[0].transpose(0, 1).reshape({x.size(0), -1}).contiguous();  // [T, H D]
  const at::Tensor mixed = add_rounded(x, product(rows, o_weight, o_scales));  // [T, C]
  const at::Tensor gate_up = product(rms_norm(mixed, norm_weight, eps), gate_up_weight, gate_up_scales);
  return add_rounded(mixed, product(gated(gate_up), down_weight, down_scales));
}

at::Tensor logits(const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& head_weight,
                  const std::optional<at::Tensor>& head_scales, double eps) {
  check_pass(x, norm_weight);
  return product(rms_norm(x, norm_weight, eps), head_weight, head_scales).to(at::kBFloat16);
}

// rows [first, first + count) of each head of rows [H_kv, N, D] (contiguous) -> slots [start, start + count)
// of buffer [H_kv, slots, D] (rows contiguous): a copy per head, without the set-up of a tensor copy
// (a few microseconds each, twice per layer).
void write_slots(const at::Tensor& rows, int64_t first, int64_t count, const at::Tensor& buffer, int64_t start) {
  const int64_t heads = rows.size(0), dim = rows.size(2);
  const auto* source = rows.data_ptr<BFloat16>() + first * dim;
  auto* target = buffer.data_ptr<BFloat16>() + start * buffer.stride(1);
  for (int64_t h = 0; h < heads; ++h) {
    std::copy_n(source + h * rows.size(1) * dim, count * dim, target + h * buffer.stride(0));
  }
}

void check_caches(const at::Tensor& x, at::TensorList keys, at::TensorList values, at::IntArrayRef starts,
                  at::IntArrayRef tokens) {
  const auto sequences = static_cast<int64_t>(keys.size());
  TORCH_CHECK(sequences >= 1 && static_cast<int64_t>(values.size()) == sequences &&
                  static_cast<int64_t>(starts.size()) == sequences && static_cast<int64_t>(tokens.size()) == sequences,
              "decoder_layers: keys, values, starts and tokens for each of the pass's sequences; got ", keys.size(),
              ", ", values.size(), ", ", starts.size(), " and ", tokens.size());
  int64_t rows = 0;
  for (int64_t b = 0; b < sequences; ++b) {
    const int64_t end = starts[b] + tokens[b];
    TORCH_CHECK(keys[b].dim() == 5 && keys[b].size(1) == 1 && keys[b].sizes() == values[b].sizes() &&
                    keys[b].size(0) >= 1 && keys[b].size(0) == keys[0].size(0) && keys[b].size(2) == keys[0].size(2) &&
                    keys[b].size(4) == keys[0].size(4) && starts[b] >= 0 && tokens[b] >= 1 && end <= keys[b].size(3) &&
                    keys[b].is_contiguous() && values[b].is_contiguous() && keys[b].scalar_type() == at::kBFloat16 &&
                    values[b].scalar_type() == at::kBFloat16,
                "decoder_layers: sequence ", b, ": contiguous bf16 K/V buffers [L, 1, H_kv, slots, D] (L, H_kv and D ",
                "those of the first sequence) with room for slots [", starts[b], ", ", end, "); got ", keys[b].sizes(),
                " ", keys[b].scalar_type(), " and ", values[b].sizes(), " ", values[b].scalar_type());
    rows += tokens[b];
  }
  TORCH_CHECK(rows == x.size(0), "decoder_layers: the sequences' tokens (", rows, ") are the pass's rows (",
              x.size(0), ")");
}

#if defined(__AVX512BF16__)

// The output rows of a weight [O, I] bf16, or packed by cascade.quantise with its scales (int8: [O];
// 4-bit: [I' / 32, 2, O]).
int64_t outputs_of(const at::Tensor& weight, const std::optional<at::Tensor>& scales) {
  if (!scales.has_value()) return weight.size(0);
  return weight.scalar_type() == at::kByte ? scales->size(2) : scales->numel();
}

// The buffers of a pass run by layers_in_one_region: the team's, and each thread's own (its residual
// stream, the stream after attention, a norm's output and the attention's rows [T, H D]), which every
// thread computes whole, to the same values, instead of waiting for one another.
struct RegionBuffers {
  at::Tensor projections, mixed_update, gate_up, gated, down_update;  // [T, (H + 2 H_kv) D], [T, C], [T, 2F], ...
  std::vector<at::Tensor> queries, attended;  // per sequence [H, T_b, D]
  at::Tensor streams, mixed, normed, attended_rows;  // per thread [threads, T, C] (the last [threads, T, H D])

  RegionBuffers(const at::Tensor& x, int64_t projected, int64_t hidden, at::IntArrayRef tokens, int64_t heads,
                int64_t dim, int64_t threads) {
    const int64_t rows = x.size(0), width = x.size(1);
    const auto floats = x.options().dtype(at::kFloat);
    projections = at::empty({rows, projected}, floats);
    mixed_update = at::empty({rows, width}, floats);
    gate_up = at::empty({rows, 2 * hidden}, floats);
    gated = at::empty({rows, hidden}, x.options());
    down_update = at::empty({rows, width}, floats);
    for (const int64_t count : tokens) {
      queries.push_back(at::empty({heads, count, dim}, x.options()));
      attended.push_back(at::empty({heads, count, dim}, x.options()));
    }
    streams = at::empty({threads, rows, width}, x.options());
    mixed = at::empty_like(streams);
    normed = at::empty_like(streams);
    attended_rows = at::empty({threads, rows, heads * dim}, x.options());
  }
};

// rows [T, C] -> target [T, C], each row over its root mean square times gain (norm_row).
void norm_all(const at::Tensor& rows, const at::Tensor& gain, const at::Tensor& target, double eps) {
  const int64_t width = rows.size(1);
  for (int64_t t = 0; t < rows.size(0); ++t) {
    norm_row(rows.data_ptr<BFloat16>() + t * width, gain.data_ptr<BFloat16>(), target.data_ptr<BFloat16>() + t * width,
             width, static_cast<float>(eps));
  }
}

// This thread's heads of the qkv projections [T, (H + 2 H_kv) D] for layer l: each (head, row) rounded
// (+ bias) and, queries and keys, rotated (head_row); queries into their sequence's [H, T_b, D], keys
// and values into their sequence's cache slots.
void place_heads(const RegionBuffers& pass, const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                 const at::Tensor& sin, at::TensorList keys, at::TensorList values, at::IntArrayRef starts,
                 at::IntArrayRef tokens, int64_t layer, int64_t heads, int64_t kv_heads, int64_t thread,
                 int64_t threads) {
  const int64_t total_heads = heads + 2 * kv_heads, dim = pass.queries[0].size(2);
  const auto [first, last] = cascade_kernels::thread_range(total_heads, thread, threads);
  for (int64_t h = first; h < last; ++h) {
    const BFloat16* offsets = bias.has_value() ? bias->data_ptr<BFloat16>() + h * dim : nullptr;
    for (int64_t b = 0, row = 0; b < static_cast<int64_t>(tokens.size()); row += tokens[b], ++b) {
      for (int64_t t = 0; t < tokens[b]; ++t) {
        BFloat16* target;
        if (h < heads) {
          target = pass.queries[b].data_ptr<BFloat16>() + (h * tokens[b] + t) * dim;
        } else {
          const at::Tensor& cache = h < heads + kv_heads ? keys[b] : values[b];  // [L, 1, H_kv, slots, D]
          const int64_t head = (h - heads) % kv_heads;
          target = cache.data_ptr<BFloat16>() + layer * cache.stride(0) + head * cache.stride(2) +
                   (starts[b] + t) * cache.stride(3);
        }
        head_row(pass.projections.data_ptr<float>() + (row + t) * pass.projections.size(1) + h * dim, offsets,
                 cos.data_ptr<BFloat16>() + (row + t) * dim, sin.data_ptr<BFloat16>() + (row + t) * dim, dim,
                 h < heads + kv_heads, target);
      }
    }
  }
}

// Each sequence's attention output [H, T_b, D] -> the pass's rows [T, H D], sequence after sequence.
void attention_rows(const std::vector<at::Tensor>& attended, const at::Tensor& rows) {
  const int64_t heads = attended[0].size(0), dim = attended[0].size(2);
  BFloat16* target = rows.data_ptr<BFloat16>();
  for (const at::Tensor& sequence : attended) {
    const int64_t tokens = sequence.size(1);
    for (int64_t t = 0; t < tokens; ++t, target += heads * dim) {
      for (int64_t h = 0; h < heads; ++h) {
        std::copy_n(sequence.data_ptr<BFloat16>() + (h * tokens + t) * dim, dim, target + h * dim);
      }
    }
  }
}

// This thread's columns (whole 16s) of SiLU(gate) * up for every row of gate_up [T, 2F] -> gated [T, F].
void gated_share(const at::Tensor& gate_up, const at::Tensor& gated, int64_t thread, int64_t threads) {
  const int64_t width = gated.size(1);
  const auto [first, last] = cascade_kernels::thread_range((width + 15) / 16, thread, threads);
  if (first * 16 >= width) return;
  for (int64_t t = 0; t < gated.size(0); ++t) {
    const float* gates = gate_up.data_ptr<float>() + t * 2 * width;
    gated_row(gates + first * 16, gates + width + first * 16, gated.data_ptr<BFloat16>() + t * width + first * 16,
              std::min(width, last * 16) - first * 16);
  }
}

// Thread `thread` of `threads`' share of rows [T, I] times a weight, bf16 or packed by cascade.quantise
// (int8, or 4-bit: uint8) with its scales, into out [T, O].
void product_share(const at::Tensor& rows, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                   const at::Tensor& out, int64_t thread, int64_t threads) {
  if (!scales.has_value()) return cascade_kernels::rows_times_weight_share(rows, weight, out, thread, threads);
#if defined(CASCADE_QUANTISED_KERNELS)
  if (weight.scalar_type() == at::kByte) {
    return cascade_kernels::rows_times_int4_share(rows, weight, *scales, out, thread, threads);
  }
  cascade_kernels::rows_times_int8_share(rows, weight, *scales, out, thread, threads);
#else
  TORCH_INTERNAL_ASSERT(false, "decoder_layers: quantised weights in one region of a build without their kernels");
#endif
}

// decoder_layers' work in one parallel region: each product split among the threads (product_share),
// the heads' rounding, rotation and cache writes too, then the attention's key blocks and merges
// (SequencesAttention), with a barrier wherever a step reads what all threads wrote; norms and
// residual sums, on a few rows, each thread computes whole. A pass pays one fork and join, not six a
// layer: on a 2-core Zen 5 EPYC, old and new alternated call by call in one process, a SmolLM2 step's
// layers took 1.02-1.06x less time (1K, 8K), an 8-token pass's 1.05-1.11x, an int8 draft's step
// 1.06-1.12x. The attention is set up once for every layer, before the region: set up by one thread
// per layer while the other waited (4-5 us and a barrier a layer), SmolLM2's step took 1.03x (8K keys)
// to 1.07x (64 keys) the time, a 4- or 8-token pass 1.02-1.05x. The values are the same bits as the
// per-op path's.
at::Tensor layers_in_one_region(const at::Tensor& x, at::TensorList norms, at::TensorList weights,
                                const c10::List<std::optional<at::Tensor>>& scales,
                                const c10::List<std::optional<at::Tensor>>& biases, at::TensorList keys,
                                at::TensorList values, at::IntArrayRef starts, at::IntArrayRef tokens,
                                const at::Tensor& cos, const at::Tensor& sin, double eps, int64_t heads,
                                int64_t kv_heads, double scale) {
  const int64_t layers = keys[0].size(0), dim = keys[0].size(4), threads = at::get_num_threads();
  const RegionBuffers pass(x, (heads + 2 * kv_heads) * dim, outputs_of(weights[2], scales.get(2)) / 2, tokens, heads,
                           dim, threads);
  std::vector<at::Tensor> every_layer_keys, every_layer_values;  // [b]: [L, H_kv, S_b, D]
  for (size_t b = 0; b < keys.size(); ++b) {
    every_layer_keys.push_back(keys[b].select(1, 0).narrow(2, 0, starts[b] + tokens[b]));
    every_layer_values.push_back(values[b].select(1, 0).narrow(2, 0, starts[b] + tokens[b]));
  }
  const std::unique_ptr<cascade_kernels::SequencesAttention> attention =
      cascade_kernels::sequences_attention(pass.queries, every_layer_keys, every_layer_values, scale, pass.attended,
                                           threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
    const at::Tensor stream = pass.streams[me], mixed = pass.mixed[me], normed = pass.normed[me];
    const at::Tensor attended_rows = pass.attended_rows[me];
    std::copy_n(x.data_ptr<BFloat16>(), x.numel(), stream.data_ptr<BFloat16>());
    for (int64_t l = 0; l < layers; ++l) {
      norm_all(stream, norms[2 * l], normed, eps);
      product_share(normed, weights[4 * l], scales.get(4 * l), pass.projections, me, team);
#pragma omp barrier
      place_heads(pass, biases.get(l), cos, sin, keys, values, starts, tokens, l, heads, kv_heads, me, team);
#pragma omp barrier
      attention->key_blocks(me, team, l);
#pragma omp barrier
      attention->merge(me, team);
#pragma omp barrier
      attention_rows(pass.attended, attended_rows);
      product_share(attended_rows, weights[4 * l + 1], scales.get(4 * l + 1), pass.mixed_update, me, team);
#pragma omp barrier
      add_rounded_into(stream.data_ptr<BFloat16>(), pass.mixed_update.data_ptr<float>(), mixed.data_ptr<BFloat16>(),
                       mixed.numel());
      norm_all(mixed, norms[2 * l + 1], normed, eps);
      product_share(normed, weights[4 * l + 2], scales.get(4 * l + 2), pass.gate_up, me, team);
#pragma omp barrier
      gated_share(pass.gate_up, pass.gated, me, team);
#pragma omp barrier
      product_share(pass.gated, weights[4 * l + 3], scales.get(4 * l + 3), pass.down_update, me, team);
#pragma omp barrier
      add_rounded_into(mixed.data_ptr<BFloat16>(), pass.down_update.data_ptr<float>(), stream.data_ptr<BFloat16>(),
                       stream.numel());
    }
  }
  return pass.streams[0];
}

// Fails unless a weight of a layer is one product_share takes with `outputs` rows of `inputs` values:
// a contiguous bf16 matrix, or one packed by cascade.quantise in 16-output, 64-input blocks whose
// scales are as the quantised kernels read them.
void check_weight(const at::Tensor& weight, const std::optional<at::Tensor>& scales, int64_t outputs, int64_t inputs,
                  int64_t layer, const char* name) {
  TORCH_CHECK(weight.is_contiguous() && outputs_of(weight, scales) == outputs,
              "decoder_layers: layer ", layer, ": a contiguous ", name, " weight of ", outputs, " rows");
  if (!scales.has_value()) {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.sizes() == at::IntArrayRef({outputs, inputs}),
                "decoder_layers: layer ", layer, ": a bf16 ", name, " weight [", outputs, ", ", inputs, "]; got ",
                weight.sizes(), " ", weight.scalar_type());
    return;
  }
  const bool int4 = weight.scalar_type() == at::kByte;
  const int64_t blocks = (inputs + 63) / 64;
  const std::vector<int64_t> packed{(outputs + 15) / 16, blocks, int4 ? 8 : 16, 64};  // [O' / 16, I' / 64, 8|16, 64]
  TORCH_CHECK((int4 || weight.scalar_type() == at::kChar) && weight.sizes() == at::IntArrayRef(packed) &&
                  scales->is_contiguous() &&
                  scales->scalar_type() == (int4 ? at::kHalf : at::kFloat) &&
                  (int4 ? scales->sizes() == at::IntArrayRef({2 * blocks, 2, outputs}) : scales->dim() == 1),
              "decoder_layers: layer ", layer, ": a ", name, " weight packed by cascade.quantise for ", outputs,
              " rows of ", inputs, " inputs; got ", weight.sizes(), " ", weight.scalar_type(), " and scales ",
              scales->sizes());
}

// Fails unless layers_in_one_region can run a pass of x [T, C] through these layers: the operands the
// per-op path's pre_attention, attention and post_attention check, all before the region begins.
void check_region_operands(const at::Tensor& x, at::TensorList norms, at::TensorList weights,
                           const c10::List<std::optional<at::Tensor>>& scales,
                           const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& keys,
                           const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  const int64_t width = x.size(1), dim = keys.size(4), total = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128,
              "decoder_layers: KV heads of size 16, 32, 64 or 128; got ", dim);
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({x.size(0), dim}) && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "decoder_layers: bf16 cos and sin [T, D] = [", x.size(0), ", ", dim, "]; got ", cos.sizes());
  bool quantised = false;
  for (size_t i = 0; i < scales.size(); ++i) quantised = quantised || scales.get(i).has_value();
  using cascade_quantised::kMaxRows;
  TORCH_CHECK(!quantised || x.size(0) <= kMaxRows, "decoder_layers: a pass of at most ", kMaxRows,
              " rows through quantised weights; got ", x.size(0));
  const int64_t hidden = outputs_of(weights[2], scales.get(2)) / 2;
  for (int64_t l = 0; l < keys.size(0); ++l) {
    check_pass(x, norms[2 * l]);
    check_pass(x, norms[2 * l + 1]);
    check_weight(weights[4 * l], scales.get(4 * l), total, width, l, "qkv");
    check_weight(weights[4 * l + 1], scales.get(4 * l + 1), width, heads * dim, l, "o");
    check_weight(weights[4 * l + 2], scales.get(4 * l + 2), 2 * hidden, width, l, "gate/up");
    check_weight(weights[4 * l + 3], scales.get(4 * l + 3), width, hidden, l, "down");
    const std::optional<at::Tensor> bias = biases.get(l);
    TORCH_CHECK(!bias.has_value() || (bias->numel() == total && bias->scalar_type() == at::kBFloat16),
                "decoder_layers: layer ", l, ": a bf16 qkv bias of ", total, " values");
  }
}

// Whether layers_in_one_region takes these weights: bf16, or quantised where this build has the
// quantised kernels.
bool one_region_applies(const c10::List<std::optional<at::Tensor>>& scales) {
#if defined(CASCADE_QUANTISED_KERNELS)
  return true;
#else
  for (size_t i = 0; i < scales.size(); ++i) {
    if (scales.get(i).has_value()) return false;
  }
  return true;
#endif
}

#endif

// Every decoder layer of a pass of one or more sequences, each over its own plain KV cache: the
// pass's rows are the sequences' tokens one after another (tokens[b] of sequence b). For layer l,
// pre_attention over every row (each weight read once for all the sequences); each sequence's keys
// and values written into slots [starts[b], starts[b] + tokens[b]) of its keys / values
// [L, 1, H_kv, slots, D] and its rows' attention over slots [0, starts[b] + tokens[b]), causal among
// themselves; post_attention over every row. A row's result does not depend on the other rows (the
// products' sums do not depend on how many rows a block holds), so a sequence gets the same bits in
// a batch as alone. Operands per layer: norms (input, post-attention), weights and their int8 or
// 4-bit scales (qkv, o, gate/up, down), the qkv bias.
at::Tensor decoder_layers(const at::Tensor& x, at::TensorList norms, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& scales,
                          const c10::List<std::optional<at::Tensor>>& biases, at::TensorList keys,
                          at::TensorList values, at::IntArrayRef starts, at::IntArrayRef tokens, const at::Tensor& cos,
                          const at::Tensor& sin, double eps, int64_t heads, int64_t kv_heads, double scale) {
  check_caches(x, keys, values, starts, tokens);
  const int64_t layers = keys[0].size(0), sequences = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(scales.size()) == 4 * layers && static_cast<int64_t>(biases.size()) == layers,
              "decoder_layers: per layer 2 norms, 4 weights, 4 scales and 1 bias for ", layers, " layers; got ",
              norms.size(), ", ", weights.size(), ", ", scales.size(), " and ", biases.size());
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0 && keys[0].size(2) == kv_heads,
              "decoder_layers: ", heads, " query heads, a multiple of the caches' KV heads (", keys[0].size(2),
              "); got kv_heads ", kv_heads);
#if defined(__AVX512BF16__)
  if (one_region_applies(scales)) {
    check_region_operands(x, norms, weights, scales, biases, keys[0], cos, sin, heads, kv_heads);
    return layers_in_one_region(x, norms, weights, scales, biases, keys, values, starts, tokens, cos.contiguous(),
                                sin.contiguous(), eps, heads, kv_heads, scale);
  }
#endif
  at::Tensor stream = x;
  std::vector<at::Tensor> queries(sequences), layer_keys(sequences), layer_values(sequences);
  for (int64_t l = 0; l < layers; ++l) {
    const auto [query, key, value] = pre_attention(stream, norms[2 * l], weights[4 * l], scales.get(4 * l),
                                                   biases.get(l), cos, sin, eps, heads, kv_heads);
    for (int64_t b = 0, row = 0; b < sequences; row += tokens[b], ++b) {
      const at::Tensor slot_keys = keys[b][l][0], slot_values = values[b][l][0];  // [H_kv, slots, D]
      write_slots(key[0], row, tokens[b], slot_keys, starts[b]);
      write_slots(value[0], row, tokens[b], slot_values, starts[b]);
      queries[b] = query[0].narrow(1, row, tokens[b]);  // [H, T_b, D]
      layer_keys[b] = slot_keys.narrow(1, 0, starts[b] + tokens[b]);
      layer_values[b] = slot_values.narrow(1, 0, starts[b] + tokens[b]);
    }
    const std::vector<at::Tensor> attended =
        cascade_kernels::decode_attention_sequences(queries, layer_keys, layer_values, scale);  // [H, T_b, D] each
    const at::Tensor rows = sequences == 1 ? attended[0] : at::cat(attended, 1);  // [H, N, D]
    stream = post_attention(stream, rows.unsqueeze(0), weights[4 * l + 1], scales.get(4 * l + 1), norms[2 * l + 1],
                            weights[4 * l + 2], scales.get(4 * l + 2), weights[4 * l + 3], scales.get(4 * l + 3), eps);
  }
  return stream;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cascade_kernels, m) {
  m.def("pre_attention(Tensor x, Tensor norm_weight, Tensor qkv_weight, Tensor? qkv_scales, Tensor? qkv_bias, "
        "Tensor cos, Tensor sin, float eps, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("post_attention(Tensor x, Tensor attended, Tensor o_weight, Tensor? o_scales, Tensor norm_weight, "
        "Tensor gate_up_weight, Tensor? gate_up_scales, Tensor down_weight, Tensor? down_scales, float eps) -> Tensor");
  m.def("logits(Tensor x, Tensor norm_weight, Tensor head_weight, Tensor? head_scales, float eps) -> Tensor");
  m.def("norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("gated_rows(Tensor gate_up) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] norms, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
        "Tensor(a!)[] keys, Tensor(b!)[] values, int[] starts, int[] tokens, Tensor cos, Tensor sin, float eps, "
        "int heads, int kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_kernels, CPU, m) {
  m.impl("pre_attention", &pre_attention);
  m.impl("post_attention", &post_attention);
  m.impl("logits", &logits);
  m.impl("norm_rows", &norm_rows);
  m.impl("gated_rows", &gated_rows);
  m.impl("decoder_layers", &decoder_layers);
}
