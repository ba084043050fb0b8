// The bf16 GEMM on vector units, for the CPUs without AMX (AVX-512 BF16, or AVX2 and FMA): micro kernels per
// instruction set and the same task split as the tile GEMM (gemm_amx.h). The packed weight layout: gemm_bf16.h.
#pragma once
#include "cpu_common.h"

namespace {

// ---- the same GEMM on vector units, for the CPUs without AMX ----
// The same tasks as the tile GEMM; each task's column pairs are multiplied by `kRows` rows of A at a
// time, the accumulators held in registers for the whole of k. AVX-512 BF16: VDPBF16PS on the tile rows
// as packed (a row of a tile is 16 columns x one bf16 pair of k), one broadcast pair of A per row.
// AVX2: weights packed k-major, each k's 16 bf16 widened to fp32 in registers, against A's rows
// converted to fp32 once per task, one FMA per accumulator and k. Both read the weights as bf16: half
// the bytes of fp32, which is what bounds a decode step.
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kVectorGemm = true;
#if defined(__AVX512BF16__)
constexpr int kRows = 8;  // 16 accumulators (8 rows x 2 column blocks) of 32 registers

// One chain per accumulator in k order whatever R: batch-invariant as it is (Inv changes nothing).
template <int R, bool Two, bool Inv = false>
void micro(const bf16* a, int64_t lda, int64_t chunks, const bf16* b0, const bf16* b1, float* c0, float* c1,
           int64_t stride) {
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const bf16* t0 = b0 + ch * stride;
    const bf16* t1 = b1 + ch * stride;
    const uint32_t* ar = reinterpret_cast<const uint32_t*>(a + ch * 32);
    for (int rr = 0; rr < 16; ++rr) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t0 + rr * 32);
      const __m512bh w1 = Two ? (__m512bh)_mm512_loadu_si512(t1 + rr * 32) : w0;
      for (int i = 0; i < R; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(ar[i * lda / 2 + rr]));
        acc0[i] = _mm512_dpbf16_ps(acc0[i], x, w0);
        if (Two) acc1[i] = _mm512_dpbf16_ps(acc1[i], x, w1);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(c0 + i * 16, acc0[i]);
    if (Two) _mm512_storeu_ps(c1 + i * 16, acc1[i]);
  }
}

struct RowBlock {  // A's rows as they are (bf16 pairs broadcast as 32-bit)
  const bf16* rows;
  void load(const bf16* a, int64_t, int64_t) { rows = a; }
};
#else
// 10 accumulators (5 rows x 16 columns), 2 weight vectors, a zero and a broadcast: 14 of 16 registers.
constexpr int kRows = 5;

// One column block: c [R, 16] = A (fp32 rows, stride lda) times the block's packed weights, stored for
// AVX2 k-major ([K][16] bf16 per block: see kPairLayout). Each k's 16 weights are widened to fp32
// (widen16: columns 0-3 and 8-11 in one vector, 4-7 and 12-15 in the other); each accumulator takes one
// FMA per k (no chain longer than the FMA latency), and the columns are put back in order once, at the
// end (store_widened16).
// Fewer than 3 rows (a decode step of one sequence) would leave too few independent sums to cover the FMA
// latency: S interleaved sets of accumulators take alternate k, added at the end. That makes a row's sum
// depend on how many rows ride with it, so the batch-invariant numerics (Inv) keep one chain in k order
// for every R and cover the latency with both column blocks in one pass instead (micro_pair).
// B as packed (bf16, widened here) or as a panel already widened to fp32 in widen16's order (quantized
// weights: gemm_quant_bits).
inline void load_b16(const bf16* p, __m256& w0, __m256& w1) { widen16(p, w0, w1); }
inline void load_b16(const float* p, __m256& w0, __m256& w1) { w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8); }

template <int R, typename B, bool Inv = false>
void micro_block(const float* a, int64_t lda, int64_t k, const B* b, float* c) {
  constexpr int S = Inv ? 1 : R == 1 ? 4 : R == 2 ? 2 : 1;  // k % 32 == 0
  __m256 lo[S * R], hi[S * R];
#pragma GCC unroll 8
  for (int i = 0; i < S * R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const int64_t kk = k0 + s;
      __m256 w0, w1;
      load_b16(b + kk * 16, w0, w1);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + i * lda + kk);
        lo[s * R + i] = _mm256_fmadd_ps(x, w0, lo[s * R + i]);
        hi[s * R + i] = _mm256_fmadd_ps(x, w1, hi[s * R + i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 1; s < S; ++s)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      lo[i] = _mm256_add_ps(lo[i], lo[s * R + i]);
      hi[i] = _mm256_add_ps(hi[i], hi[s * R + i]);
    }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) store_widened16(lo[i], hi[i], c + i * 16);
}

// Both column blocks in one pass, one chain per accumulator (4R of them): what micro_block<R, B, true> sums,
// for the few rows whose own chains would not cover the FMA latency.
template <int R, typename B>
void micro_pair(const float* a, int64_t lda, int64_t k, const B* b0, const B* b1, float* c0, float* c1) {
  __m256 lo[2][R], hi[2][R];
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < R; ++i) lo[j][i] = hi[j][i] = _mm256_setzero_ps();
  const B* b[2] = {b0, b1};
  for (int64_t kk = 0; kk < k; ++kk) {
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {  // block 0's k, then block 1's: one chain per element either way
      __m256 w0, w1;
      load_b16(b[j] + kk * 16, w0, w1);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + i * lda + kk);
        lo[j][i] = _mm256_fmadd_ps(x, w0, lo[j][i]);
        hi[j][i] = _mm256_fmadd_ps(x, w1, hi[j][i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    store_widened16(lo[0][i], hi[0][i], c0 + i * 16);
    store_widened16(lo[1][i], hi[1][i], c1 + i * 16);
  }
}

template <int R, bool Two, bool Inv = false, typename B>
void micro(const float* a, int64_t lda, int64_t chunks, const B* b0, const B* b1, float* c0, float* c1,
           int64_t) {  // k-major blocks: chunks are consecutive
  if constexpr (Inv && Two && R <= 3) return micro_pair<R>(a, lda, chunks * 32, b0, b1, c0, c1);
  micro_block<R, B, Inv>(a, lda, chunks * 32, b0, c0);
  if (Two) micro_block<R, B, Inv>(a, lda, chunks * 32, b1, c1);
}

struct RowBlock {  // A's rows widened to fp32 (per thread, once per task and row block)
  std::vector<float> buffer;
  const float* rows = nullptr;
  void load(const bf16* a, int64_t count, int64_t k) {
    buffer.resize(count * k);
    for (int64_t j = 0; j + 8 <= count * k; j += 8) _mm256_storeu_ps(buffer.data() + j, load8(a + j));
    rows = buffer.data();
  }
};
#endif

template <int R, bool Inv = false, typename A, typename B>
void micro_rows(int rows, A a, int64_t lda, int64_t chunks, const B* b0, const B* b1, bool two, float* c0,
                float* c1, int64_t stride = 512) {  // stride: elements from one 32-deep chunk of B to the next
  if constexpr (R > 1) {
    if (rows < R) return micro_rows<R - 1, Inv>(rows, a, lda, chunks, b0, b1, two, c0, c1, stride);
  }
  if (two) micro<R, true, Inv>(a, lda, chunks, b0, b1, c0, c1, stride);
  else micro<R, false, Inv>(a, lda, chunks, b0, b1, c0, c1, stride);
}

template <bool Inv, typename Epilogue>
void gemm_vectors(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t nblocks, Epilogue&& epi) {
  const int64_t chunks = k / 32, tile = 16 * 32;
  const int64_t pairs = (nblocks + 1) / 2;
  // A group's weights (2 x 16 columns x k bf16 per pair) are reused by every row block: at most 256 KiB
  // of them, so they stay in L2.
  const int64_t group = m <= 32 ? 1 : std::max<int64_t>(1, std::min<int64_t>(pairs / 8, (256 << 10) / (64 * k)));
  // Rows split evenly into blocks of at most kRows (32 rows of 5: 5,5,5,5,4,4,4, not six 5s and a 2): a
  // short block has too few accumulators to cover the FMA latency.
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  // A decode batch's A (at most 256 KiB as fp32) is prepared once per thread for all of its tasks, not
  // once per task; a longer prefill's per task and row block.
  const bool whole = m * k <= (64 << 10);
  alignas(64) float c[2][kRows * 16];
  RowBlock block;
  if (whole) block.load(a, m, k);
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < (pairs + group - 1) / group; ++task)
    for (int64_t b = 0; b < row_blocks; ++b) {
      const int64_t r = b * m / row_blocks;
      const int rows = static_cast<int>((b + 1) * m / row_blocks - r);
      if (!whole) block.load(a + r * k, rows, k);
      const auto rows_a = whole ? block.rows + r * k : block.rows;
      for (int64_t pair = task * group; pair < std::min(pairs, (task + 1) * group); ++pair) {
        const int64_t nb0 = 2 * pair;
        const bool two = nb0 + 1 < nblocks;
        const bf16* b0 = w + nb0 * chunks * tile;
        micro_rows<kRows, Inv>(rows, rows_a, k, chunks, b0, b0 + chunks * tile, two, c[0], c[1]);
        epi(r, nb0, two, 0, rows, c[0], c[1]);
      }
    }
}
#else
constexpr bool kVectorGemm = false;
#endif

}  // namespace
