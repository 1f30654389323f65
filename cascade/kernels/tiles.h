// AMX tile set-up shared by cascade's CPU kernels (included after <immintrin.h>).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace cascade_tiles {

// Whether kernels built with AMX use it (``set_amx``: the tests turn it off to check the AVX-512 paths
// on machines that have both).
inline bool use_amx = true;

// The 64-byte block _tile_loadconfig reads: palette 1, each tile's rows and bytes per row.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace cascade_tiles

#if defined(__AMX_BF16__)

namespace cascade_tiles {

constexpr int64_t kTileRows = 16;  // rows of a tile
constexpr int64_t kTileInputs = 32;  // bf16 values in a tile row (64 bytes)

// Tiles 0-1: accumulators [16, columns] float32; 2-3: row-major operands [16, 32] bf16 read from
// memory; 4: the pair-interleaved operand [16 pairs, columns].
inline void configure_tiles(int64_t columns) {
  TileConfig config;
  for (int tile = 0; tile < 2; ++tile) {
    config.rows[tile] = kTileRows;
    config.bytes_per_row[tile] = columns * 4;
    config.rows[tile + 2] = kTileRows;
    config.bytes_per_row[tile + 2] = kTileInputs * 2;
  }
  config.rows[4] = kTileInputs / 2;
  config.bytes_per_row[4] = columns * 4;
  _tile_loadconfig(&config);
}

// rows [R, I] -> pairs [I / 2, R, 2] (each element two consecutive inputs of one row): the layout of
// the second operand of an AMX bf16 product; rows [B, R, I] -> [B, I / 2, R, 2], each of the B in
// turn. Copied element by element (rows' last dimension contiguous, any other strides): an ATen
// transposed copy of a pass's few rows took 16-28 us, ~5 ms of an 8-token SmolLM2 pass.
inline at::Tensor pair_interleave(const at::Tensor& rows) {
  const at::Tensor batched = rows.dim() == 2 ? rows.unsqueeze(0) : rows;
  TORCH_CHECK(batched.dim() == 3 && batched.stride(2) == 1 && batched.size(2) % 2 == 0,
              "pair_interleave: rows [R, I] or [B, R, I] with an even, contiguous last dimension; got ", rows.sizes());
  const int64_t batches = batched.size(0), num_rows = batched.size(1), pairs = batched.size(2) / 2;
  at::Tensor out = at::empty({batches, pairs, num_rows, 2}, rows.options());
  const auto* in = batched.data_ptr<at::BFloat16>();
  auto* to = out.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t r = 0; r < num_rows; ++r) {
      const at::BFloat16* row = in + b * batched.stride(0) + r * batched.stride(1);
      at::BFloat16* column = to + (b * pairs * num_rows + r) * 2;
      for (int64_t p = 0; p < pairs; ++p) {
        column[p * num_rows * 2] = row[2 * p];
        column[p * num_rows * 2 + 1] = row[2 * p + 1];
      }
    }
  }
  return rows.dim() == 2 ? out.squeeze(0) : out;
}

}  // namespace cascade_tiles

#endif
