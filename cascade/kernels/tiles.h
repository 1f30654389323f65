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

// rows [R, I] -> pairs [I / 2, R] (each element two consecutive inputs of one row): the layout of
// the second operand of an AMX bf16 product.
inline at::Tensor pair_interleave(const at::Tensor& rows) {
  return rows.view({rows.size(0), rows.size(1) / 2, 2}).transpose(0, 1).contiguous();
}

}  // namespace cascade_tiles

#endif
