// The products and attention of cascade's CPU kernels, for the other kernels that call them directly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

namespace cascade_kernels {

// Thread `thread` of `threads`' part [begin, end) of `count` items: contiguous, as at::parallel_for splits
// them (empty for threads past the last item).
inline std::pair<int64_t, int64_t> thread_range(int64_t count, int64_t thread, int64_t threads) {
  const int64_t per_thread = (count + threads - 1) / threads;
  const int64_t begin = std::min(count, thread * per_thread);
  return {begin, std::min(count, begin + per_thread)};
}

// share(thread, threads) for each of `threads` threads in one at::parallel_for: how an op runs the
// thread shares that decoder_layers calls from inside its own parallel region.
template <typename Share>
void on_threads(int64_t threads, const Share& share) {
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) share(thread, threads);
  });
}

// rows [T, I] bf16 (T <= 16) x weight [O, I] bf16 -> [T, O] float32 (rows_times_weight.cpp).
at::Tensor rows_times_weight(const at::Tensor& rows, const at::Tensor& weight);

// Thread `thread` of `threads`' share of that product (AVX512-BF16 builds), rows contiguous, into out [T, O]:
// whole units of 32 weight rows, each thread's one range, the same bits as the whole product's.
void rows_times_weight_share(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& out, int64_t thread,
                             int64_t threads);

// The same product on a CPU with AVX2 and FMA but no AVX512-BF16 (rows_times_weight_avx2.cpp).
at::Tensor rows_times_weight_avx2(const at::Tensor& rows, const at::Tensor& weight);

// rows [T, I] bf16 x a weight packed in panels [O / 16, I, 16] bf16 by cascade.panels -> [T, O] float32, on a
// CPU with AVX2 and FMA but no AVX512-BF16 (rows_times_weight_avx2.cpp).
at::Tensor rows_times_panels_avx2(const at::Tensor& rows, const at::Tensor& panels);

// rows [T, I] bf16 (T <= 16) x an int8 weight packed by cascade.quantise, scales [O] -> [T, O]
// float32 (rows_times_int8.cpp).
at::Tensor rows_times_int8(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales);

// Thread `thread` of `threads`' share of that product (its 16-output blocks), rows contiguous, into out [T, O].
void rows_times_int8_share(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& out, int64_t thread, int64_t threads);

// rows [T, I] bf16 (T <= 16) x a 4-bit weight packed by cascade.quantise, scales and lows per 32
// inputs [I' / 32, 2, O] float16 -> [T, O] float32 (rows_times_int4.cpp).
at::Tensor rows_times_int4(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales);

// Thread `thread` of `threads`' share of that product (its 16-output blocks), rows contiguous, into out [T, O].
void rows_times_int4_share(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& out, int64_t thread, int64_t threads);

// query [H, T, D] over keys and values [H_kv, S, D] (rows contiguous) -> [H, T, D] bf16; causal: the
// pass's T tokens are the last T keys and read one another causally (attention.cpp).
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale,
                            bool causal);

// decode_attention of several sequences' queries [H, T_b, D], each over its own keys and values
// [H_kv, S_b, D], causal among its own tokens -> each one's [H, T_b, D], the same bits as alone: every
// sequence's key blocks run on the threads in one parallel region (attention.cpp).
std::vector<at::Tensor> decode_attention_sequences(const std::vector<at::Tensor>& queries, at::TensorList keys,
                                                   at::TensorList values, double scale);

// decode_attention_sequences' work for threads that already run in one parallel region, over any of a
// pass's layers: built once, then for layer l each thread runs its share of every sequence's key blocks
// and, once all have, its share of the rows' merges into outs[b] [H, T_b, D] (attention.cpp).
class SequencesAttention {
 public:
  virtual ~SequencesAttention() = default;
  virtual void key_blocks(int64_t thread, int64_t threads, int64_t layer) const = 0;
  virtual void merge(int64_t thread, int64_t threads) const = 0;
};

// queries[b] [H, T_b, D] (contiguous; read as each layer's attention runs) over keys[b] / values[b]
// [L, H_kv, S_b, D] (every layer's), causal among each sequence's tokens, into outs[b] [H, T_b, D]
// (contiguous), run by at most `threads` threads; the lists and tensors outlive the result.
std::unique_ptr<SequencesAttention> sequences_attention(const std::vector<at::Tensor>& queries, at::TensorList keys,
                                                        at::TensorList values, double scale,
                                                        const std::vector<at::Tensor>& outs, int64_t threads);

}  // namespace cascade_kernels
