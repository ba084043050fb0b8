// The bf16 GEMM on AMX tiles (Sapphire Rapids and later): the tile state, the tile loop, the whole-GEMM task
// split (gemm_tiles) and the fixed-tile helpers the prefill attention's tiles use (attention_prefill.h).
// Whether this process may use them at all: amx_ready(). The packed weight layout: gemm_bf16.h.
#pragma once
#include "cpu_common.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kCompiledWithAmx = true;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-3 accumulators (row block r, column block c at 2r + c), 4-5 A row blocks, 6-7 B column blocks.
// The config depends only on the rows of the two row blocks; reloaded when they change.
struct TileState {
  bool invariant = false;  // batch-invariant numerics (see gemm): a row's sums never depend on the rows beside it
  bool int8_acts = false;  // quantized weights multiply activations quantized to 8 bits (gemm_quant_int8)
  int rows0 = -1, rows1 = -1;
  void ensure(int r0, int r1) {
    if (r0 == rows0 && r1 == rows1) return;
    TileConfig cfg{};
    cfg.palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int i = 0; i < 8; ++i) {
      cfg.rows[i] = static_cast<uint8_t>(rows[i]);
      cfg.colsb[i] = rows[i] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
    rows0 = r0;
    rows1 = r1;
  }
  ~TileState() {
    if (rows0 >= 0) _tile_release();
  }
};

// The tile loop of both GEMMs (gemm_tiles, and gemm_pair on a quantized weight's panel): rows [0, rows) of A
// (rows <= 32, row stride k: two row blocks of at most 16) times column block b0 and, when `two`, b1, stored to
// c0 and c1 as [rows, 16] fp32 each. overlap(last) runs after each 32-deep chunk's tile products are issued
// (last false) and once more before the stores (last true): vector work, such as the previous block's epilogue,
// that then runs while AMX multiplies.
template <typename Overlap>
inline void tile_pair(const bf16* a0, int64_t k, int rows, const bf16* b0, const bf16* b1, bool two, TileState& ts,
                      float* c0, float* c1, Overlap&& overlap) {
  const int64_t chunks = k / 32, tile = 16 * 32;  // bf16 elements per packed tile
  const int rows0 = std::min(16, rows), rows1 = rows - rows0;
  ts.ensure(rows0, rows1);
  _tile_zero(0);  // tiles of an empty second row block are unconfigured: touching them faults
  _tile_zero(1);
  if (rows1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const bf16* a1 = a0 + 16 * k;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    _tile_loadd(4, a0 + ch * 32, k * 2);
    _tile_loadd(6, b0 + ch * tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (rows1) {
      _tile_loadd(5, a1 + ch * 32, k * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (two) {
      _tile_loadd(7, b1 + ch * tile, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (rows1) _tile_dpbf16ps(3, 5, 7);
    }
    overlap(false);
  }
  overlap(true);
  _tile_stored(0, c0, 64);
  if (rows1) _tile_stored(2, c0 + 16 * 16, 64);
  if (two) {
    _tile_stored(1, c1, 64);
    if (rows1) _tile_stored(3, c1 + 16 * 16, 64);
  }
}

// C [m, 16 * nblocks] = A [m, k] (row stride k) x W^T, W packed; inside a parallel region: the threads
// take pairs of column blocks dynamically (omp for, with its barrier), so a thread that loses its core
// to the HTTP server for a while does not hold the other at the barrier. epi(row0, block0, two, i0, i1,
// c0, c1) gets rows [i0, i1) of each finished [rows, 16] fp32 tile pair (c1 valid when `two`).
template <typename Epilogue>
void gemm_tiles(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t nblocks, TileState& ts,
                Epilogue&& epi) {
  const int64_t chunks = k / 32, tile = 16 * 32;  // bf16 elements per packed tile
  // Two buffers: a block's epilogue runs a few rows at a time between the next block's tile products,
  // so the vector units round and store while AMX multiplies. Run after the products instead, it left
  // AMX idle for as long again on short k (a gate/up block has 18 chunks: 72 products, 32 rows of SiLU).
  alignas(64) float c[2][2][32 * 16];
  // Tasks are groups of column pairs, each group's 32-row blocks of A used for all its pairs in turn (the
  // group's weights stay in L2). Measured neutral to slightly faster on 1024-row steps in one A/B; A's
  // loads did not bound these GEMMs (A pinned in L1 changed nothing). Groups shrink with the number of
  // pairs so that both threads keep several tasks each.
  const int64_t pairs = (nblocks + 1) / 2;
  const int64_t group = m <= 32 ? 1 : std::max<int64_t>(1, std::min<int64_t>(8, pairs / 8));
  const int64_t rows_per_chunk = (32 + chunks - 1) / chunks;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < (pairs + group - 1) / group; ++task) {
    // The previous block's epilogue, done rows [done, rows) so far.
    int64_t prev_r = 0, prev_nb0 = 0;
    bool prev_two = false;
    int prev_rows = 0, done = 0, buf = 0;
    auto finish = [&](int upto) {  // upto >= done always
      if (done == upto) return;
      epi(prev_r, prev_nb0, prev_two, done, upto, c[buf ^ 1][0], c[buf ^ 1][1]);
      done = upto;
    };
    for (int64_t r = 0; r < m; r += 32)
    for (int64_t pair = task * group; pair < std::min(pairs, (task + 1) * group); ++pair) {
      const int64_t nb0 = 2 * pair;
      const bool two = nb0 + 1 < nblocks;
      const bf16* b0 = w + nb0 * chunks * tile;
      const int rows = static_cast<int>(std::min<int64_t>(32, m - r));
      tile_pair(a + r * k, k, rows, b0, b0 + chunks * tile, two, ts, c[buf][0], c[buf][1], [&](bool last) {
        finish(last ? prev_rows : std::min<int64_t>(prev_rows, done + rows_per_chunk));
      });
      prev_r = r, prev_nb0 = nb0, prev_two = two, prev_rows = rows, done = 0;
      buf ^= 1;
    }
    finish(prev_rows);
  }
}

// Tiles 0-3 as two or four fp32 sums of A (tile 4) times B tiles b, b + step, ... (rows of 64 bytes), with
// B alternating between tiles 6 and 7. Tile numbers are immediates, hence the fixed layout.
inline void zero_sums(bool four) {
  _tile_zero(0);
  _tile_zero(1);
  if (four) {
    _tile_zero(2);
    _tile_zero(3);
  }
}
inline void add_products(const bf16* b, int64_t step, bool four) {
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, b + step, 64);
  _tile_dpbf16ps(1, 4, 7);
  if (four) {
    _tile_loadd(6, b + 2 * step, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, b + 3 * step, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
}
// Sum t to dst + t * offset (floats), rows `stride` bytes apart.
inline void store_sums(float* dst, int64_t stride, int64_t offset, bool four) {
  _tile_stored(0, dst, stride);
  _tile_stored(1, dst + offset, stride);
  if (four) {
    _tile_stored(2, dst + 2 * offset, stride);
    _tile_stored(3, dst + 3 * offset, stride);
  }
}

#else
constexpr bool kCompiledWithAmx = false;
struct TileState {
  bool invariant = false;  // batch-invariant numerics (see gemm): a row's sums never depend on the rows beside it
  bool int8_acts = false;  // quantized weights multiply activations quantized to 8 bits (gemm_quant_int8)
};
#endif

// Whether this process may use AMX tiles: compiled in and granted by Linux, which hands out the tile
// state only on request (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18). Asked once.
bool amx_ready() {
  static const bool ready = kCompiledWithAmx && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

}  // namespace
