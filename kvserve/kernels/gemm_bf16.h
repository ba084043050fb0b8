// The GEMM on bf16 weights packed once at load time, inside the decoder's parallel region: on AMX tiles
// (gemm_amx.h) where this process has them, else on the vector units (gemm_vector.h).
//
// Weight layout (pack_weight): W [N, K] (torch's Linear layout, out = x W^T) as [N/16][K/32][16][16][2]:
// one 1 KiB tile per (16 output columns, 32 inputs) in the VNNI pair order TDPBF16PS reads (an AVX2-only
// build packs each 16-column block k-major instead: kPairLayout). The fused gate/up weight is packed
// with gate and up blocks alternating, so one thread holds both halves of 16 columns and applies the
// activation in the GEMM's epilogue.
#pragma once
#include "cpu_common.h"
#include "gemm_amx.h"
#include "gemm_vector.h"

namespace {

// The packed weight layout: AMX's tile layout (also what VDPBF16PS reads) where the build has AMX or
// AVX-512 BF16; else k-major per 16-column block, [N/16][K][16], which AVX2 widens to fp32 cheapest.
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(__AVX512BF16__)
constexpr bool kPairLayout = true;
#else
constexpr bool kPairLayout = false;
#endif

// C [m, 16 * nblocks] = A [m, k] (row stride k) x W^T, W packed (see above), inside a parallel region,
// on AMX tiles where this process has them, else on the vector units. epi(row0, block0, two, i0, i1,
// c0, c1) gets rows [i0, i1) of each finished [rows, 16] fp32 block pair (c1 valid when `two`).
//
// Batch-invariant numerics (ts.invariant): every output element is one sum in an order fixed by k alone,
// whatever m, the row's place in the step or the thread count: AMX tiles and VDPBF16PS accumulate that
// way as they are; AVX2's few-row kernels split k over interleaved sums unless told not to (micro_block).
template <typename Epilogue>
void gemm(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t nblocks, TileState& ts, Epilogue&& epi) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready()) return gemm_tiles(a, m, k, w, nblocks, ts, epi);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (ts.invariant) gemm_vectors<true>(a, m, k, w, nblocks, epi);
  else gemm_vectors<false>(a, m, k, w, nblocks, epi);
#endif
}

#if defined(__AVX512BF16__)  // for the quantized GEMM's panels (gemm_quant_avx512.h)
// C [m, 32] for one column pair of bf16 weights (b0, then b1 when `two`), every row: AMX tiles where this
// process has them, else the vector micro kernels.
template <typename Epilogue>
void gemm_pair(const bf16* a, int64_t m, int64_t k, const bf16* b0, bool two, int64_t nb0, TileState& ts,
               Epilogue& epi) {
  const int64_t chunks = k / 32, tile = 16 * 32;
  const bf16* b1 = b0 + chunks * tile;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready()) {
    alignas(64) float c[2][32 * 16];
    for (int64_t r = 0; r < m; r += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, m - r));
      tile_pair(a + r * k, k, rows, b0, b1, two, ts, c[0], c[1], [](bool) {});
      epi(r, nb0, two, 0, rows, c[0], c[1]);
    }
    return;
  }
#endif
  alignas(64) float c[2][kRows * 16];
  RowBlock block;
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t r = rb * m / row_blocks;
    const int rows = static_cast<int>((rb + 1) * m / row_blocks - r);
    block.load(a + r * k, rows, k);
    micro_rows<kRows>(rows, block.rows, k, chunks, b0, b1, two, c[0], c[1]);
    epi(r, nb0, two, 0, rows, c[0], c[1]);
  }
}
#endif

}  // namespace
