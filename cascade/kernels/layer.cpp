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
// slots, attention over every slot up to them) in one call: no Python per layer. A pass may hold
// several sequences, each with its own cache, which share each read of the weights (a batch).
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "products.h"
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

// projections [T, (H + 2 H_kv) D] float32 (+ bias) -> [H + 2 H_kv, T, D] bf16, the first H + H_kv heads
// (queries, keys) rotated by cos / sin [T, D] (half-split convention).
at::Tensor rotate_heads(const at::Tensor& projections, const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t rotated_heads, int64_t total_heads) {
  const int64_t tokens = projections.size(0), dim = projections.size(1) / total_heads, half = dim / 2;
  at::Tensor out = at::empty({total_heads, tokens, dim}, projections.options().dtype(at::kBFloat16));
  const float* source = projections.data_ptr<float>();
  const BFloat16* offsets = bias.has_value() ? bias->data_ptr<BFloat16>() : nullptr;
  const BFloat16* cosines = cos.data_ptr<BFloat16>();
  const BFloat16* sines = sin.data_ptr<BFloat16>();
  auto* target = out.data_ptr<BFloat16>();
  float head[512];
  for (int64_t h = 0; h < total_heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = source + t * projections.size(1) + h * dim;
      for (int64_t d = 0; d < dim; ++d) {  // rounded as the projection's output is
        head[d] = static_cast<float>(BFloat16(row[d] + (offsets ? static_cast<float>(offsets[h * dim + d]) : 0.0f)));
      }
      BFloat16* out_row = target + (h * tokens + t) * dim;
      if (h >= rotated_heads) {
        for (int64_t d = 0; d < dim; ++d) out_row[d] = BFloat16(head[d]);
        continue;
      }
      const BFloat16* c = cosines + t * dim;
      const BFloat16* s = sines + t * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float partner = d < half ? -head[d + half] : head[d - half];
        out_row[d] = BFloat16(head[d] * static_cast<float>(c[d]) + partner * static_cast<float>(s[d]));
      }
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

// residual [T, C] bf16 + update [T, C] float32 (rounded to bf16 first) -> bf16.
at::Tensor add_rounded(const at::Tensor& residual, const at::Tensor& update) {
  at::Tensor out = at::empty_like(residual);
#if defined(__AVX512BF16__)
  const auto* base = residual.data_ptr<BFloat16>();
  const float* delta = update.data_ptr<float>();
  auto* target = out.data_ptr<BFloat16>();
  const int64_t count = residual.numel();
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = lanes_left(count - i);
    const __m512 sum = _mm512_add_ps(load_floats(base + i, lanes), rounded(_mm512_maskz_loadu_ps(lanes, delta + i)));
    store_rounded(target + i, sum, lanes);
  }
#elif defined(CASCADE_AVX2)
  const auto* base = residual.data_ptr<BFloat16>();
  const float* delta = update.data_ptr<float>();
  auto* target = out.data_ptr<BFloat16>();
  const int64_t count = residual.numel(), whole = count / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    store_rounded8(target + i, _mm256_add_ps(widen8(base + i), rounded8(_mm256_loadu_ps(delta + i))));
  }
  for (int64_t i = whole; i < count; ++i) {
    target[i] = BFloat16(static_cast<float>(base[i]) + static_cast<float>(BFloat16(delta[i])));
  }
#else
  TORCH_CHECK(false, "cascade layer kernels: this build has neither AVX512-BF16 nor AVX2 with FMA");
#endif
  return out;
}

// gates, ups [F] (float32 projections, or bf16) -> SiLU(gate) * up [F] bf16, each rounded to bf16 first
// as a projection is.
#if defined(__AVX512BF16__)
inline __m512 rounded_floats(const float* source, __mmask16 lanes) { return rounded(_mm512_maskz_loadu_ps(lanes, source)); }
inline __m512 rounded_floats(const BFloat16* source, __mmask16 lanes) { return load_floats(source, lanes); }

template <typename Source>
void gated_row(const Source* gates, const Source* ups, BFloat16* target, int64_t width) {
  using cascade_vector::exp16;
  for (int64_t f = 0; f < width; f += 16) {
    const __mmask16 lanes = lanes_left(width - f);
    const __m512 gate = rounded_floats(gates + f, lanes), up = rounded_floats(ups + f, lanes);
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
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
    const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
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
                    keys[b].size(0) == keys[0].size(0) && tokens[b] >= 1 && end <= keys[b].size(3) &&
                    keys[b].is_contiguous() && values[b].is_contiguous(),
                "decoder_layers: sequence ", b, ": contiguous K/V buffers [L, 1, H_kv, slots, D] with room for slots [",
                starts[b], ", ", end, "); got ", keys[b].sizes(), " and ", values[b].sizes());
    rows += tokens[b];
  }
  TORCH_CHECK(rows == x.size(0), "decoder_layers: the sequences' tokens (", rows, ") are the pass's rows (",
              x.size(0), ")");
}

// Every decoder layer of a pass of one or more sequences, each over its own plain KV cache: the
// pass's rows are the sequences' tokens one after another (tokens[b] of sequence b). For layer l,
// pre_attention over every row (each weight read once for all the sequences); each sequence's keys
// and values written into slots [starts[b], starts[b] + tokens[b]) of its keys / values
// [L, 1, H_kv, slots, D] and its rows' attention over slots [0, starts[b] + tokens[b]), causal among
// themselves; post_attention over every row. A row's result does not depend on the other rows (the
// products' sums do not depend on how many rows a block holds), so a sequence gets the same bits in
// a batch as alone. Operands per layer: norms (input, post-attention), weights and their int8 scales
// (qkv, o, gate/up, down), the qkv bias.
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
