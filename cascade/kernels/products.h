// The products and attention of cascade's CPU kernels, for the other kernels that call them directly.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace cascade_kernels {

// rows [T, I] bf16 (T <= 16) x weight [O, I] bf16 -> [T, O] float32 (rows_times_weight.cpp).
at::Tensor rows_times_weight(const at::Tensor& rows, const at::Tensor& weight);

// The same product on a CPU with AVX2 and FMA but no AVX512-BF16 (rows_times_weight_avx2.cpp).
at::Tensor rows_times_weight_avx2(const at::Tensor& rows, const at::Tensor& weight);

// rows [T, I] bf16 x a weight packed in panels [O / 16, I, 16] bf16 by cascade.panels -> [T, O] float32, on a
// CPU with AVX2 and FMA but no AVX512-BF16 (rows_times_weight_avx2.cpp).
at::Tensor rows_times_panels_avx2(const at::Tensor& rows, const at::Tensor& panels);

// rows [T, I] bf16 (T <= 16) x an int8 weight packed by cascade.quantise, scales [O] -> [T, O]
// float32 (rows_times_int8.cpp).
at::Tensor rows_times_int8(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales);

// rows [T, I] bf16 (T <= 16) x a 4-bit weight packed by cascade.quantise, scales and lows per 32
// inputs [I' / 32, 2, O] float16 -> [T, O] float32 (rows_times_int4.cpp).
at::Tensor rows_times_int4(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales);

// query [H, T, D] over keys and values [H_kv, S, D] (rows contiguous) -> [H, T, D] bf16; causal: the
// pass's T tokens are the last T keys and read one another causally (attention.cpp).
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale,
                            bool causal);

// decode_attention of several sequences' queries [H, T_b, D], each over its own keys and values
// [H_kv, S_b, D], causal among its own tokens -> each one's [H, T_b, D], the same bits as alone: every
// sequence's key blocks run on the threads in one parallel region (attention.cpp).
std::vector<at::Tensor> decode_attention_sequences(const std::vector<at::Tensor>& queries, at::TensorList keys,
                                                   at::TensorList values, double scale);

}  // namespace cascade_kernels
