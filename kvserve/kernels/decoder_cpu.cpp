// A step's whole decoder stack in one native call, on AMX tiles: every layer's norms, QKV/O/gate-up/down
// projections, rotary, KV writes and paged attention, inside one OpenMP parallel region with a barrier
// between phases. Each token is a row: a decode, or a prefill token attending to its own prefix through
// its row of the block table (all of a step's K/V are written before any attention reads them), so
// decode, prefill and mixed steps run the same code.
//
// Why: on the 2-core CPU machines a decode step of 32 sequences is bound by reading the weights and the
// KV cache, yet driven from Python each of its ~300 small ops per step started cold (the previous
// op had streamed megabytes through the caches), so dispatch and oneDNN's per-call set-up cost about
// as much as the memory traffic. Here the projections are plain AMX tile loops over weights packed once
// at load time (one sequential stream per thread), and nothing returns to Python until the final norm.
//
// Weight layout (pack_weight): W [N, K] (torch's Linear layout, out = x W^T) as [N/16][K/32][16][16][2]:
// one 1 KiB tile per (16 output columns, 32 inputs) in the VNNI pair order TDPBF16PS reads (an AVX2-only
// build packs each 16-column block k-major instead: kPairLayout). The fused gate/up weight is packed
// with gate and up blocks alternating, so one thread holds both halves of 16 columns and applies the
// activation in the GEMM's epilogue.
#include "cpu_common.h"

#include <array>
#include <limits>

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

struct TileChunk {  // rows [row0, row0 + rows) of the step: one sequence's prefill chunk
  int64_t row0, rows;
};

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
      const bf16* b1 = b0 + chunks * tile;
      const int rows0 = static_cast<int>(std::min<int64_t>(16, m - r));
      const int rows1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, m - r - 16)));
      ts.ensure(rows0, rows1);
      _tile_zero(0);  // tiles of an empty second row block are unconfigured: touching them faults
      _tile_zero(1);
      if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
      }
      const bf16* a0 = a + r * k;
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
        finish(std::min<int64_t>(prev_rows, done + rows_per_chunk));
      }
      finish(prev_rows);
      float* o0 = c[buf][0];
      float* o1 = c[buf][1];
      _tile_stored(0, o0, 64);
      if (rows1) _tile_stored(2, o0 + 16 * 16, 64);
      if (two) {
        _tile_stored(1, o1, 64);
        if (rows1) _tile_stored(3, o1 + 16 * 16, 64);
      }
      prev_r = r, prev_nb0 = nb0, prev_two = two, prev_rows = rows0 + rows1, done = 0;
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
};
#endif

// The packed weight layout: AMX's tile layout (also what VDPBF16PS reads) where the build has AMX or
// AVX-512 BF16; else k-major per 16-column block, [N/16][K][16], which AVX2 widens to fp32 cheapest.
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(__AVX512BF16__)
constexpr bool kPairLayout = true;
#else
constexpr bool kPairLayout = false;
#endif

// Whether this process may use AMX tiles: compiled in and granted by Linux, which hands out the tile
// state only on request (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18). Asked once.
bool amx_ready() {
  static const bool ready = kCompiledWithAmx && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

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

// What a step's prefill chunks attend with, shared by the ways their rows attend together (TileAttention,
// RowGroups): a chunk's rows are consecutive positions of one sequence, and each row's visible keys run
// from first_key(its position) to itself.
struct PrefillChunks {
  const bf16* qkv;  // [m, qkv_width]: q rows after rotary; k and v already in the cache
  int64_t qkv_width;
  const int64_t* positions;
  const int64_t* block_tables;
  int64_t table_stride;
  const TileChunk* chunks;
  const bf16* key_cache;
  const bf16* value_cache;
  int64_t q_heads, kv_heads, hd, block_size, head_stride, window;
  float scale;
  bf16* out;  // [m, q_heads * hd]

  int64_t first_key(int64_t position) const { return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0; }
};

#if defined(__AVX512BF16__)  // AMX builds have it too
constexpr bool kTileAttention = true;
// ---- prefill attention on tiles ----
// A prefill chunk's query tokens are consecutive positions of one sequence, so 16 of them can share
// each key: S = Q K^T and O = P V run as tile products, where attending row by row (DecodeBatch) reads
// the whole prefix once per token with vector dot products. Per layer, each chunk's visible keys are
// first packed once per kv head into the tile layouts below (they sit in scattered cache blocks); then
// each task takes 16 query tokens of one kv head's query group. Numerics follow the row path: fp32
// scores times scale, an exact (two-pass) softmax in fp32, probabilities rounded to bf16, fp32 sums.
//
// Packed keys, per (chunk, kv head), tile (kt, dc) of 16 keys x 32 dims: [16 dim pairs][16 keys][2]
// (the B operand of Q K^T). Packed values, tile (kc, dt) of 32 keys x 16 dims: [16 key pairs][16 dims][2]
// (the B operand of P V). Keys are counted from `kb`, the chunk's first visible key rounded down to
// 32, and padded with zeros to a multiple of 32.

// v[i] (16 x 32-bit) <- column i of the 16 x 16 matrix whose rows are v: unpacks gather each column's
// 4-row quarters per 128-bit lane, two rounds of lane shuffles put the quarters in order.
inline void transpose16x16(__m512i v[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], lane L: column 4L + j, rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i p = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), q = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i p2 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE), q2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    v[j] = _mm512_shuffle_i32x4(p, q, 0x88);
    v[4 + j] = _mm512_shuffle_i32x4(p, q, 0xDD);
    v[8 + j] = _mm512_shuffle_i32x4(p2, q2, 0x88);
    v[12 + j] = _mm512_shuffle_i32x4(p2, q2, 0xDD);
  }
}

constexpr int64_t kPackKeys = 256;  // keys per packing task

struct TileAttention : PrefillChunks {
  const int64_t* packed_offsets;  // per chunk: start of its packed K/V in `packed` (sized for window 0)
  bf16* packed;

  // The chunk's packed keys: [kb, kb + padded) with `end` real ones.
  int64_t base(const TileChunk& c) const { return first_key(positions[c.row0]) / 32 * 32; }
  static int64_t end(const int64_t* positions, const TileChunk& c) { return positions[c.row0 + c.rows - 1] + 1; }
  int64_t end(const TileChunk& c) const { return end(positions, c); }
  static int64_t padded(int64_t kb, int64_t end) { return (end - kb + 31) / 32 * 32; }
  static int64_t packed_size(int64_t end, int64_t kv_heads, int64_t hd) { return kv_heads * 2 * padded(0, end) * hd; }
  bf16* keys(int64_t chunk, int64_t head) const {
    return packed + packed_offsets[chunk] + head * 2 * padded(0, end(chunks[chunk])) * hd;
  }
  bf16* values(int64_t chunk, int64_t head) const { return keys(chunk, head) + padded(0, end(chunks[chunk])) * hd; }

  // Pack keys [seg * kPackKeys, +kPackKeys) of one chunk and kv head (those inside [kb, padded end)).
  void pack(int64_t chunk, int64_t head, int64_t seg) const {
    const TileChunk& c = chunks[chunk];
    const int64_t kb = base(c), n = end(c), stop = kb + padded(kb, n);
    const int64_t lo = std::max(kb, seg * kPackKeys), hi = std::min(stop, (seg + 1) * kPackKeys);
    const int64_t* table = block_tables + c.row0 * table_stride;
    const bf16* kh = key_cache + head * head_stride;
    const bf16* vh = value_cache + head * head_stride;
    uint32_t* kp = reinterpret_cast<uint32_t*>(keys(chunk, head));
    bf16* vp = values(chunk, head);
    const int64_t dchunks = hd / 32, dtiles = hd / 16;
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    int64_t at[32];  // keys t0 .. t0 + 31: offsets of their rows in a head's cache, -1 past the end
    auto row = [&](const bf16* head_cache, int64_t j) -> const bf16* { return at[j] < 0 ? nullptr : head_cache + at[j]; };
    for (int64_t t0 = lo; t0 < hi; t0 += 32) {
      const int64_t kc = (t0 - kb) / 32;
      for (int64_t j = 0, b = t0 / block_size, o = t0 % block_size; j < 32; ++j) {
        at[j] = t0 + j < n ? (table[b] * block_size + o) * hd : -1;
        if (++o == block_size) o = 0, ++b;
      }
      for (int64_t half = 0; half < 2; ++half) {  // keys: a 16 x 16 transpose of 32-bit dim pairs per tile
        const bf16* src[16];
        for (int64_t j = 0; j < 16; ++j) src[j] = row(kh, 16 * half + j);
        for (int64_t dc = 0; dc < dchunks; ++dc) {
          __m512i v[16];
          for (int j = 0; j < 16; ++j) v[j] = src[j] ? _mm512_loadu_si512(src[j] + dc * 32) : _mm512_setzero_si512();
          transpose16x16(v);
          uint32_t* dst = kp + ((2 * kc + half) * dchunks + dc) * 256;
          for (int r = 0; r < 16; ++r) _mm512_storeu_si512(dst + r * 16, v[r]);
        }
      }
      for (int64_t r = 0; r < 16; ++r) {  // values: rows 2r and 2r + 1 interleaved per dim
        const bf16* v0 = row(vh, 2 * r);
        const bf16* v1 = row(vh, 2 * r + 1);
        for (int64_t dt = 0; dt < dtiles; ++dt) {
          const __m256i a = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + dt * 16)) : _mm256_setzero_si256();
          const __m256i b = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + dt * 16)) : _mm256_setzero_si256();
          const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
          _mm512_storeu_si512(vp + (kc * dtiles + dt) * 512 + r * 32, _mm512_permutexvar_epi16(pairs, ab));
        }
      }
    }
  }

  // A task's query rows [i0, i0 + rows), the packed keys they see (32-key chunks [c0, c1) from kb, `width`
  // of them) and its kv head's packed keys and values; scores and probs sized for 16 rows of them.
  struct Span {
    int64_t i0, rows, kb, c0, c1, width;
    const bf16* kp;
    const bf16* vp;
  };
  Span span(int64_t chunk, int64_t head, int64_t tile, std::vector<float>& scores, std::vector<bf16>& probs) const {
    const TileChunk& c = chunks[chunk];
    const int64_t i0 = c.row0 + tile * 16, rows = std::min<int64_t>(16, c.rows - tile * 16), kb = base(c);
    const int64_t c0 = (first_key(positions[i0]) - kb) / 32, c1 = (positions[i0 + rows - 1] + 1 - kb + 31) / 32;
    scores.resize(16 * (c1 - c0) * 32);
    probs.resize(16 * (c1 - c0) * 32);
    return {i0, rows, kb, c0, c1, (c1 - c0) * 32, keys(chunk, head), values(chunk, head)};
  }

  // Query tokens [tile * 16, +16) of one chunk, every query head of kv head `head`: on AMX tiles where
  // this process has them, else with VDPBF16PS (the vector GEMM's micro kernels on the same packing).
  void run(int64_t chunk, int64_t head, int64_t tile, TileState& ts, std::vector<float>& scores,
           std::vector<bf16>& probs) const {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_ready()) return run_tiles(chunk, head, tile, ts, scores, probs);
#endif
    run_vectors(chunk, head, tile, scores, probs);
  }

  void run_vectors(int64_t chunk, int64_t head, int64_t tile, std::vector<float>& scores,
                   std::vector<bf16>& probs) const {
    const auto [i0, rows, kb, c0, c1, width, kp, vp] = span(chunk, head, tile, scores, probs);
    const int64_t group = q_heads / kv_heads, dchunks = hd / 32, dtiles = hd / 16;
    alignas(64) float sums[2][kRows * 16];
    for (int64_t g = 0; g < group; ++g) {
      const int64_t qh = head * group + g;
      const bf16* q = qkv + i0 * qkv_width + qh * hd;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {  // S = Q K^T, 32 keys (two key tiles) at a time
        const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
        for (int64_t kc = c0; kc < c1; ++kc) {
          const bf16* b0 = kp + 2 * kc * dchunks * 512;
          micro_rows<kRows>(nr, q + r0 * qkv_width, qkv_width, dchunks, b0, b0 + dchunks * 512, true, sums[0],
                            sums[1], 512);
          for (int i = 0; i < nr; ++i) {
            float* dst = scores.data() + (r0 + i) * width + (kc - c0) * 32;
            std::memcpy(dst, sums[0] + i * 16, 16 * sizeof(float));
            std::memcpy(dst + 16, sums[1] + i * 16, 16 * sizeof(float));
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) softmax_masked(scores.data() + i * width, probs.data() + i * width, width,
                                                        first_key(positions[i0 + i]) - kb - c0 * 32,
                                                        positions[i0 + i] - kb - c0 * 32);
      for (int64_t dt = 0; dt < dtiles; dt += 2)  // O = P V, 32 dims at a time (hd % 32 == 0)
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          const bf16* b0 = vp + (c0 * dtiles + dt) * 512;
          micro_rows<kRows>(nr, probs.data() + r0 * width, width, c1 - c0, b0, b0 + 512, true, sums[0], sums[1],
                            dtiles * 512);
          for (int i = 0; i < nr; ++i) {
            bf16* o = out + (i0 + r0 + i) * q_heads * hd + qh * hd + dt * 16;
            store_rounded16(sums[0] + i * 16, o);
            store_rounded16(sums[1] + i * 16, o + 16);
          }
        }
    }
  }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  void run_tiles(int64_t chunk, int64_t head, int64_t tile, TileState& ts, std::vector<float>& scores,
                 std::vector<bf16>& probs) const {
    const auto [i0, rows, kb, c0, c1, width, kp, vp] = span(chunk, head, tile, scores, probs);
    const int64_t group = q_heads / kv_heads, dchunks = hd / 32, dtiles = hd / 16;
    const int r = static_cast<int>(rows);
    alignas(64) float acc[4 * 16 * 16];
    for (int64_t g = 0; g < group; ++g) {
      const int64_t qh = head * group + g;
      const bf16* q = qkv + i0 * qkv_width + qh * hd;
      ts.ensure(r, r);
      for (int64_t kc = c0; kc < c1; kc += 2) {  // S = Q K^T, 64 keys at a time: four independent sums
        const bool four = kc + 1 < c1;
        zero_sums(four);
        const bf16* kt = kp + 2 * kc * dchunks * 512;  // key tiles 2kc .. 2kc + 3, dchunks tiles each
        for (int64_t dc = 0; dc < dchunks; ++dc) {
          _tile_loadd(4, q + dc * 32, qkv_width * 2);
          add_products(kt + dc * 512, dchunks * 512, four);
        }
        store_sums(scores.data() + (kc - c0) * 32, width * 4, 16, four);
      }
      for (int64_t i = 0; i < rows; ++i) softmax_masked(scores.data() + i * width, probs.data() + i * width, width,
                                                        first_key(positions[i0 + i]) - kb - c0 * 32,
                                                        positions[i0 + i] - kb - c0 * 32);
      for (int64_t dt0 = 0; dt0 < dtiles; dt0 += 4) {  // O = P V, 16 x 64 dims at a time (hd % 32: 2 or 4 tiles)
        const bool four = dt0 + 2 < dtiles;
        zero_sums(four);
        for (int64_t kc = c0; kc < c1; ++kc) {
          _tile_loadd(4, probs.data() + (kc - c0) * 32, width * 2);
          add_products(vp + (kc * dtiles + dt0) * 512, 512, four);
        }
        store_sums(acc, 64, 256, four);
        for (int64_t i = 0; i < rows; ++i) {
          bf16* o = out + (i0 + i) * q_heads * hd + qh * hd + dt0 * 16;
          for (int j = 0; j < (four ? 4 : 2); ++j) store16(_mm512_load_ps(acc + j * 256 + i * 16), o + j * 16);
        }
      }
    }
  }

#endif

  // One row of scores (unscaled, `width` keys) -> probabilities in bf16 over keys [lo, hi], zero elsewhere.
  // Only the 32-key pairs of vectors that overlap [lo, hi] are read; of those, only vectors not wholly
  // inside it build a lane mask.
  void softmax_masked(float* s, bf16* p, int64_t width, int64_t lo, int64_t hi) const {
    const int64_t plo = lo / 32 * 32, phi = std::min<int64_t>(width, (hi + 32) / 32 * 32);
    auto lanes = [&](int64_t j) -> __mmask16 {
      if (j >= lo && j + 15 <= hi) return 0xFFFF;
      const int64_t a = std::max<int64_t>(lo - j, 0), b = std::min<int64_t>(hi - j, 15);
      return a > b ? 0 : static_cast<__mmask16>(((1u << (b + 1)) - 1) & ~((1u << a) - 1));
    };
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = ninf;
    for (int64_t j = plo; j < phi; j += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, lanes(j), s + j));
    // exp(scale * (s - max)) = 2^(s * scale log2 e - max * scale log2 e)
    const float scale2 = scale * 1.44269504088896341f;
    const __m512 vscale = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(-scale2 * _mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = plo; j < phi; j += 16) {
      const __m512 e = _mm512_maskz_mov_ps(lanes(j), exp2_16<4>(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vscale, shift)));
      _mm512_storeu_ps(s + j, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t j = 0; j < plo; j += 32) _mm512_storeu_si512(p + j, zero);
    for (int64_t j = plo; j < phi; j += 32) {  // width % 32 == 0; VCVTNE2PS2BF16 rounds to nearest even
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + j + 16), inv),
                                                _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
      _mm512_storeu_si512(p + j, (__m512i)pair);
    }
    for (int64_t j = phi; j < width; j += 32) _mm512_storeu_si512(p + j, zero);
  }
};
#else
constexpr bool kTileAttention = false;
#endif

// ---- prefill attention in row groups (AVX2; AVX-512 BF16 under the batch-invariant numerics) ----
// A task is a group of consecutive query rows of one prefill chunk with every query head of one kv head,
// up to kGroupQueries query vectors, that share each key and value row, where attending row by row reads
// the whole prefix once per token and kv head. Each query sums as a decode's does, so each row gets the bits
// it would get attending alone. AVX2 (no bf16 arithmetic; the fast numerics too): rows widened to fp32 once
// for the group (attend_widened), each row keeping its own causal end and window. AVX-512 BF16: the
// packed-key tiles (TileAttention) reduce q.k and p.v in another order than a decode, so under the
// batch-invariant numerics chunks take these groups instead (attend_bf16_rows: attend_bf16_dp's sums); a
// group whose rows start at different keys (a sliding window passed) attends row by row.
struct RowGroups : PrefillChunks {
  static constexpr int64_t kGroupQueries = kTileAttention ? 16 : 12;
  static int64_t rows_per_task(int64_t q_heads, int64_t kv_heads) {
    return std::max<int64_t>(1, kGroupQueries / (q_heads / kv_heads));
  }
  // Whether this build's groups serve head_dim hd (else the chunk's rows attend alone).
  static bool serves(int64_t hd) {
#if defined(__AVX512BF16__)
    return bf16_dp_head_dim(hd);
#else
    return kWidenedAttention && widened_head_dim(hd);
#endif
  }

  void run(int64_t chunk, int64_t head, int64_t group_index, std::vector<float>& scores, Scratch& scratch) const {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)  // kWidenedAttention
    const TileChunk& c = chunks[chunk];
    const int64_t group = q_heads / kv_heads, per_task = rows_per_task(q_heads, kv_heads);
    const int64_t i0 = c.row0 + group_index * per_task, rows = std::min(per_task, c.row0 + c.rows - i0);
    const int64_t start = first_key(positions[i0]), len = positions[i0 + rows - 1] + 1, n = len - start;
    const int64_t count = rows * group;
    scores.resize(count * n);
    scratch.q.resize(count * hd);
    scratch.queries.resize(count);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = i0 + r, qh = head * group + g, j = r * group + g;
        const bf16* q = qkv + row * qkv_width + qh * hd;
        float* qf = scratch.q.data() + j * hd;
        for (int64_t d = 0; d < hd; ++d) qf[d] = to_float(q[d]) * scale;
        scratch.queries[j] = {qf, scores.data() + j * n, first_key(positions[row]) - start, positions[row] + 1 - start,
                              out + row * q_heads * hd + qh * hd};
      }
    const Task<bf16> task{nullptr, nullptr, scale, group, hd, key_cache + head * head_stride,
                          value_cache + head * head_stride, block_tables + i0 * table_stride, block_size, start, len,
                          scores.data(), nullptr};
    attend_widened(task, scratch.queries.data(), count, hd);
#elif defined(__AVX512BF16__)
    const TileChunk& c = chunks[chunk];
    const int64_t group = q_heads / kv_heads, per_task = rows_per_task(q_heads, kv_heads);
    const int64_t i0 = c.row0 + group_index * per_task, rows = std::min(per_task, c.row0 + c.rows - i0);
    const int64_t start = first_key(positions[i0]), len = positions[i0 + rows - 1] + 1;
    const bf16* kh = key_cache + head * head_stride;
    const bf16* vh = value_cache + head * head_stride;
    if (first_key(positions[i0 + rows - 1]) != start) {  // a window passed inside the group: row by row
      for (int64_t row = i0; row < i0 + rows; ++row) {
        const int64_t from = first_key(positions[row]), to = positions[row] + 1;
        scores.resize(group * (to - from));
        attend(Task<bf16>{nullptr, qkv + row * qkv_width + head * group * hd, scale, group, hd, kh, vh,
                          block_tables + row * table_stride, block_size, from, to, scores.data(),
                          out + row * q_heads * hd + head * group * hd},
               scratch);
      }
      return;
    }
    const int64_t n = len - start, n2 = (n + 1) & ~int64_t(1), count = rows * group;
    scores.resize(count * n);
    scratch.probs.resize(count * n2);
    static thread_local std::vector<RowQuery> queries;
    queries.resize(count);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = i0 + r, qh = head * group + g, j = r * group + g;
        queries[j] = {qkv + row * qkv_width + qh * hd, positions[row] + 1 - start, scores.data() + j * n,
                      scratch.probs.data() + j * n2, out + row * q_heads * hd + qh * hd};
      }
    attend_bf16_rows(Task<bf16>{nullptr, nullptr, scale, group, hd, kh, vh, block_tables + i0 * table_stride,
                                block_size, start, len, nullptr, nullptr},
                     queries.data(), count, scratch.rows);
#else
    (void)chunk, (void)head, (void)group_index, (void)scores, (void)scratch;
#endif
  }
};

// C [m, 16 * nblocks] = A [m, k] (row stride k) x W^T, W packed (see the top), inside a parallel region,
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

// ---- quantized weights ----
// A quantized weight keeps, per (16-column block, 32-deep chunk), the chunk's values q, then the 16 columns'
// fp16 scales s and fp16 minimums m: w = s * q + m. Int8: one signed byte a value (512 B); int4: 0..15, two
// a byte (256 B). A chunk is one group of 32 k, so Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the sub-blocks of
// Q4_K and Q5_K map onto it exactly. The order of the values is the build's (kvserve_pack_quant):
// - AVX-512 BF16 and AMX builds: the element order of the bf16 tile layout ([16 k pairs][16 columns][2];
//   int4: element j in the low nibble of byte j, element j + 256 in its high nibble). Decode-sized steps
//   multiply the values as read with VDPBF16PS (W8A16, W4A16); longer ones first widen a column pair's
//   weights into a bf16 panel that stays in L2, then run the bf16 GEMM of this CPU on it.
// - AVX2 builds: quads of k for integer pair products ([2 halves of 8 columns][quads][8 columns][4 k];
//   int4: 4 quad rows a half, k = 4p + t in the low nibble and 16 + 4p + t in the high one), each half's
//   scales and minimums in kSumOrder. Every step multiplies integers (see QuantActs).
struct QWeight {
  const void* data;
  int64_t bits;  // 0: bf16 in pack_weight's layout; 4 or 8: the layout above
  const void* tail;  // null, or the column blocks from `tail_from` on, in another kind (QKV: V in 8 bits)
  int64_t tail_bits;
  int64_t tail_from;
};
constexpr int64_t kQuantTail = 64;  // 16 fp16 scales, then 16 fp16 minimums
inline int64_t quant_values_bytes(int64_t bits) { return bits == 8 ? 512 : 256; }
inline int64_t quant_chunk_bytes(int64_t bits) { return quant_values_bytes(bits) + kQuantTail; }
// Where a chunk's value for (column, k) sits: byte, and the high nibble (int4); and where column c's scale
// and minimum sit among the tail's 16.
struct QuantPlace {
  int64_t byte;
  bool high;
};
// The AVX2 integer sums of a half come out in this column order (VPHADDD of two 4-column pair sums).
constexpr int kSumOrder[8] = {0, 1, 4, 5, 2, 3, 6, 7};
inline QuantPlace quant_place(int col, int kk, int64_t bits) {
  if (kPairLayout) {
    const int64_t e = (kk / 2 * 16 + col) * 2 + kk % 2;
    return bits == 8 ? QuantPlace{e, false} : QuantPlace{e % 256, e >= 256};
  }
  const int half = col / 8, c = col % 8, t = kk % 4;
  if (bits == 8) return {half * 256 + (kk / 4) * 32 + c * 4 + t, false};
  return {half * 128 + (kk % 16 / 4) * 32 + c * 4 + t, kk >= 16};
}
inline int quant_tail_slot(int col) {
  if (kPairLayout) return col;
  const int half = col / 8;
  int slot = 0;
  while (kSumOrder[slot] != col % 8) ++slot;
  return half * 8 + slot;
}

// One column block's weights widened into a panel for the GEMM of this build (bf16 tiles, or AVX2's fp32).
template <int Bits>
void widen_block(const uint8_t* b, int64_t chunks, bf16* out);
template <int Bits>
void widen_block(const uint8_t* b, int64_t chunks, float* out);
// Column pair nb0's blocks (the second only when `two`) into `panel`, one after the other.
template <int Bits, typename T>
void widen_pair(const uint8_t* w, int64_t nb0, bool two, int64_t block_bytes, int64_t chunks, T* panel) {
  widen_block<Bits>(w + nb0 * block_bytes, chunks, panel);
  if (two) widen_block<Bits>(w + (nb0 + 1) * block_bytes, chunks, panel + chunks * 512);
}

#if defined(__AVX512BF16__)
// Each row's sums over each 32-deep chunk of A (fp32), which the minimums multiply.
struct QuantRows {
  std::vector<float> sums;
  void load(const bf16* a, int64_t m, int64_t k) {
    const int64_t chunks = k / 32;
    sums.resize(m * chunks);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < chunks; ++c) {
        float s = 0.0f;
        for (int j = 0; j < 32; ++j) s += to_float(a[i * k + c * 32 + j]);
        sums[i * chunks + c] = s;
      }
  }
};

constexpr int kQuantRows = 4;  // rows a direct pass holds: kQuantChains partial sums and a total each
constexpr int64_t kQuantDirectRows = 8;  // up to this many rows, multiply as read; above, widen to a panel

// Tile row (16 columns x a k pair) of int8 values as bf16 (exact: |q| <= 128).
inline __m512bh q8_row(const uint8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return (__m512bh)_mm512_cvtne2ps_pbh(hi, lo);
}
// Tile rows p (low nibbles) and p + 8 (high) of int4 values as the bf16 of 128 + q: 0x4300 | q, no
// conversion (the 128 is taken off with the chunk's sum of A).
inline void q4_rows(const uint8_t* q, __m512bh& lo, __m512bh& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512i bias = _mm512_set1_epi16(0x4300);
  lo = (__m512bh)_mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x0F), bias, 0xEA);  // (a & b) | c
  hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
}

// c [R, 16] = R rows of A (bf16, stride lda) times one quantized column block. Each row sums a chunk in
// kQuantChains interleaved accumulators (VDPBF16PS's latency is several of its issue slots: one chain a row
// waited on it), the same for every R, so a row's result does not depend on how many rows ride with it.
constexpr int kQuantChains = 4;  // the sum below adds four
// Chunks ahead that a pass asks for: a block's chunks are one short stream (20 KiB for k = 2048 at 4 bits),
// which the hardware prefetcher has barely picked up before it ends (steps of a few rows gain; one row does not).
constexpr int64_t kQuantPrefetchChunks = 8;
template <int R, int Bits>
void quant_block(const bf16* a, int64_t lda, const float* sums, int64_t chunks, const uint8_t* b, float* c) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t cb = quant_chunk_bytes(Bits);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* t = b + ch * cb;
    for (int64_t l = 0; l < cb; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(t + kQuantPrefetchChunks * cb + l), _MM_HINT_T0);
    const uint32_t* ar = reinterpret_cast<const uint32_t*>(a + ch * 32);
    __m512 part[kQuantChains][R];
    for (int j = 0; j < kQuantChains; ++j)
      for (int i = 0; i < R; ++i) part[j][i] = _mm512_setzero_ps();
    auto dot = [&](int chain, int pair, __m512bh w) {
      for (int i = 0; i < R; ++i)
        part[chain][i] = _mm512_dpbf16_ps(part[chain][i],
                                          (__m512bh)_mm512_set1_epi32(static_cast<int>(ar[i * lda / 2 + pair])), w);
    };
    if constexpr (Bits == 8) {
      for (int rr = 0; rr < 16; rr += 4) {  // the chain of each product is known when compiled
        dot(0, rr, q8_row(t + rr * 32));
        dot(1, rr + 1, q8_row(t + (rr + 1) * 32));
        dot(2, rr + 2, q8_row(t + (rr + 2) * 32));
        dot(3, rr + 3, q8_row(t + (rr + 3) * 32));
      }
    } else {
      for (int p = 0; p < 8; p += 2) {
        __m512bh lo, hi;
        q4_rows(t + p * 32, lo, hi);
        dot(0, p, lo);
        dot(1, p + 8, hi);
        q4_rows(t + (p + 1) * 32, lo, hi);
        dot(2, p + 1, lo);
        dot(3, p + 9, hi);
      }
    }
    __m512 s[R];
    for (int i = 0; i < R; ++i)
      s[i] = _mm512_add_ps(_mm512_add_ps(part[0][i], part[1][i]), _mm512_add_ps(part[2][i], part[3][i]));
    const uint8_t* tail = t + quant_values_bytes(Bits);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 32)));
    for (int i = 0; i < R; ++i) {
      const __m512 sx = _mm512_set1_ps(sums[i * chunks + ch]);
      const __m512 dot = Bits == 4 ? _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), sx, s[i]) : s[i];
      acc[i] = _mm512_fmadd_ps(scale, dot, _mm512_fmadd_ps(minimum, sx, acc[i]));
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(c + i * 16, acc[i]);
}

// A chunk's minimums as the widened weights add them: m for 8-bit values, m - 128 s for 4-bit ones, which are
// multiplied as 128 + q (what widen_dot gets from q4_rows without a conversion; one rounding, in fp32).
template <int Bits>
inline __m512 widen_offset(__m512 s16, __m512 m16) {
  return Bits == 4 ? _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s16, m16) : m16;
}

// One column block's weights as bf16 in the tile layout: w = s * q + m in fp32 (for 4-bit values
// s * (128 + q) + (m - 128 s): widen_offset), rounded to nearest even.
template <int Bits>
void widen_block(const uint8_t* b, int64_t chunks, bf16* out) {
  const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
  const int64_t cb = quant_chunk_bytes(Bits);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* t = b + ch * cb;
    const uint8_t* tail = t + quant_values_bytes(Bits);
    const __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)));
    const __m512 m16 = widen_offset<Bits>(
        s16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 32))));
    const __m512 s_lo = _mm512_permutexvar_ps(pairs_lo, s16), s_hi = _mm512_permutexvar_ps(pairs_hi, s16);
    const __m512 m_lo = _mm512_permutexvar_ps(pairs_lo, m16), m_hi = _mm512_permutexvar_ps(pairs_hi, m16);
    bf16* o = out + ch * 512;
    auto emit = [&](__m512i q_lo, __m512i q_hi, bf16* dst) {  // one tile row: 32 values as int32 halves
      const __m512 w_lo = _mm512_fmadd_ps(s_lo, _mm512_cvtepi32_ps(q_lo), m_lo);
      const __m512 w_hi = _mm512_fmadd_ps(s_hi, _mm512_cvtepi32_ps(q_hi), m_hi);
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    };
    if constexpr (Bits == 8) {
      for (int rr = 0; rr < 16; ++rr) {
        const __m128i* q = reinterpret_cast<const __m128i*>(t + rr * 32);
        emit(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)), _mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)), o + rr * 32);
      }
    } else {
      const __m512i nibble = _mm512_set1_epi32(0x0F), offset = _mm512_set1_epi32(128);
      for (int p = 0; p < 8; ++p) {
        const __m128i* q = reinterpret_cast<const __m128i*>(t + p * 32);
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(q)), b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(q + 1));
        emit(_mm512_add_epi32(_mm512_and_si512(b0, nibble), offset),
             _mm512_add_epi32(_mm512_and_si512(b1, nibble), offset), o + p * 32);
        emit(_mm512_add_epi32(_mm512_srli_epi32(b0, 4), offset), _mm512_add_epi32(_mm512_srli_epi32(b1, 4), offset),
             o + (p + 8) * 32);
      }
    }
  }
}

template <int R, int Bits>
void quant_rows(int rows, const bf16* a, int64_t lda, const float* sums, int64_t chunks, const uint8_t* b, float* c) {
  if constexpr (R > 1) {
    if (rows < R) return quant_rows<R - 1, Bits>(rows, a, lda, sums, chunks, b, c);
  }
  quant_block<R, Bits>(a, lda, sums, chunks, b, c);
}

// The panel's arithmetic without the panel, for decode-sized steps under the batch-invariant numerics: each
// tile row of NB column blocks' weights is widened to bf16 as widen_block writes it, in registers, and
// multiplied at once, one chain per output in k order: the bits the vector micro kernel gives on the panel
// (gemm_pair), which longer steps take. The chain is VDPBF16PS's latency a tile row, so a single row of 4-bit
// weights takes four column blocks (four chains) to keep the units busy.
// 4-bit rows come from q4_rows (bf16 of 128 + q, no conversion) and go to fp32 by interleaving with zeros,
// which takes each 128-bit lane's pairs in another order: the scales, minimums and so the sums follow that
// order of columns (kShuffled), which is put back at the end. c: NB blocks of [R, 16], kQuantDirectRows * 16
// apart.
template <int R, int NB, int Bits>
void widen_dot(const bf16* a, int64_t lda, int64_t chunks, const uint8_t* b, int64_t block_bytes, float* c) {
  // 8-bit: each fp32 lane's column in emit's order (the tile row's element pairs). 4-bit: the columns of the
  // low and high interleaves' lanes, and the column each sum lane then holds.
  const __m512i pairs_lo = Bits == 4 ? _mm512_set_epi32(13, 13, 12, 12, 9, 9, 8, 8, 5, 5, 4, 4, 1, 1, 0, 0)
                                     : _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pairs_hi = Bits == 4 ? _mm512_set_epi32(15, 15, 14, 14, 11, 11, 10, 10, 7, 7, 6, 6, 3, 3, 2, 2)
                                     : _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
  const __m512i kShuffled = _mm512_set_epi32(15, 14, 7, 6, 13, 12, 5, 4, 11, 10, 3, 2, 9, 8, 1, 0);
  const int64_t cb = quant_chunk_bytes(Bits);
  __m512 acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  struct Factors { __m512 s_lo, s_hi, m_lo, m_hi; };
  const auto factors = [&](const uint8_t* t) {
    const uint8_t* tail = t + quant_values_bytes(Bits);
    const __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)));
    const __m512 m16 = widen_offset<Bits>(
        s16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 32))));
    return Factors{_mm512_permutexvar_ps(pairs_lo, s16), _mm512_permutexvar_ps(pairs_hi, s16),
                   _mm512_permutexvar_ps(pairs_lo, m16), _mm512_permutexvar_ps(pairs_hi, m16)};
  };
  // A tile row's 32 values (fp32 halves) as widen_block's emit rounds them: s * q + m in fp32, then bf16.
  const auto emit = [](const Factors& f, __m512 q_lo, __m512 q_hi) {
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(f.s_hi, q_hi, f.m_hi), _mm512_fmadd_ps(f.s_lo, q_lo, f.m_lo));
  };
  const auto weights = [&](const uint8_t* t, const Factors& f, int rr) {  // int8: tile row rr
    const __m128i* q = reinterpret_cast<const __m128i*>(t + rr * 32);
    return emit(f, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  };
  const auto halves = [&](const Factors& f, __m512bh x) {  // int4: a q4_rows row, 128 + q in each bf16
    const __m512i zero = _mm512_setzero_si512();
    return emit(f, (__m512)_mm512_unpacklo_epi16(zero, (__m512i)x), (__m512)_mm512_unpackhi_epi16(zero, (__m512i)x));
  };
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* t[NB];
    Factors f[NB];
    for (int j = 0; j < NB; ++j) {
      t[j] = b + j * block_bytes + ch * cb;
      for (int64_t l = 0; l < cb; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(t[j] + kQuantPrefetchChunks * cb + l), _MM_HINT_T0);
      f[j] = factors(t[j]);
    }
    const uint32_t* ar = reinterpret_cast<const uint32_t*>(a + ch * 32);
    const auto multiply = [&](int rr, const __m512bh* w) {
      for (int i = 0; i < R; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(ar[i * lda / 2 + rr]));
        for (int j = 0; j < NB; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], x, w[j]);
      }
    };
    if constexpr (Bits == 8) {
      for (int rr = 0; rr < 16; ++rr) {
        __m512bh w[NB];
        for (int j = 0; j < NB; ++j) w[j] = weights(t[j], f[j], rr);
        multiply(rr, w);
      }
    } else {  // tile rows p and p + 8 share their bytes: read once, row p + 8 kept until its turn
      __m512bh later[8][NB];
      for (int p = 0; p < 8; ++p) {
        __m512bh w[NB];
        for (int j = 0; j < NB; ++j) {
          __m512bh lo;
          q4_rows(t[j] + p * 32, lo, later[p][j]);
          w[j] = halves(f[j], lo);
        }
        multiply(p, w);
      }
      for (int p = 0; p < 8; ++p) {
        __m512bh w[NB];
        for (int j = 0; j < NB; ++j) w[j] = halves(f[j], later[p][j]);
        multiply(p + 8, w);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < R; ++i)
      _mm512_storeu_ps(c + j * kQuantDirectRows * 16 + i * 16,
                       Bits == 4 ? _mm512_permutexvar_ps(kShuffled, acc[j][i]) : acc[j][i]);
}

template <int R, int Bits>
void widen_dot_rows(int rows, int blocks, const bf16* a, int64_t lda, int64_t chunks, const uint8_t* b,
                    int64_t block_bytes, float* c) {
  if constexpr (R > 1) {
    if (rows < R) return widen_dot_rows<R - 1, Bits>(rows, blocks, a, lda, chunks, b, block_bytes, c);
  }
  switch (blocks) {
    case 4: return widen_dot<R, 4, Bits>(a, lda, chunks, b, block_bytes, c);
    case 3: return widen_dot<R, 3, Bits>(a, lda, chunks, b, block_bytes, c);
    case 2: return widen_dot<R, 2, Bits>(a, lda, chunks, b, block_bytes, c);
    default: return widen_dot<R, 1, Bits>(a, lda, chunks, b, block_bytes, c);
  }
}

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
      const int rows0 = static_cast<int>(std::min<int64_t>(16, m - r));
      const int rows1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, m - r - 16)));
      ts.ensure(rows0, rows1);
      _tile_zero(0);
      _tile_zero(1);
      if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
      }
      const bf16* a0 = a + r * k;
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
      }
      _tile_stored(0, c[0], 64);
      if (rows1) _tile_stored(2, c[0] + 16 * 16, 64);
      if (two) {
        _tile_stored(1, c[1], 64);
        if (rows1) _tile_stored(3, c[1] + 16 * 16, 64);
      }
      epi(r, nb0, two, 0, rows0 + rows1, c[0], c[1]);
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

// Steps of up to kQuantDirectRows rows multiply the values as read (quant_block); longer ones widen each
// column pair into a bf16 panel for the GEMM of this CPU. The two round differently (the panel rounds each
// weight to bf16 first), so under the batch-invariant numerics every step gets the panel's bits: long ones
// from the panel, short ones from widen_dot (the same products in registers) where the GEMM runs on vectors;
// on AMX the tile products differ from vector ones, so there every step takes the panel.
template <int Bits, typename Epilogue>
void gemm_quant_bits(const bf16* a, int64_t m, int64_t k, const uint8_t* w, int64_t nblocks, TileState& ts,
                     Epilogue& epi) {
  const int64_t chunks = k / 32, block_bytes = chunks * quant_chunk_bytes(Bits);
  const int64_t pairs = (nblocks + 1) / 2;
  if (ts.invariant && m <= kQuantDirectRows && !amx_ready()) {
    // One row of 4-bit weights: four column blocks a task (widen_dot's chains); else a pair (8-bit weights are
    // twice the bytes, and two streams of them keep a row busy).
    const int64_t per_task = m == 1 && Bits == 4 ? 4 : 2, tasks = (nblocks + per_task - 1) / per_task;
    alignas(64) float c[4][kQuantDirectRows * 16];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t nb0 = task * per_task;
      const int blocks = static_cast<int>(std::min(per_task, nblocks - nb0));
      widen_dot_rows<kQuantDirectRows, Bits>(static_cast<int>(m), blocks, a, k, chunks, w + nb0 * block_bytes,
                                             block_bytes, c[0]);
      for (int j = 0; j < blocks; j += 2) epi(0, nb0 + j, j + 1 < blocks, 0, static_cast<int>(m), c[j], c[j + 1]);
    }
    return;
  }
  if (m <= kQuantDirectRows && !ts.invariant) {
    QuantRows rows;
    rows.load(a, m, k);  // quant_block takes the minimums (and int4's offset) off A's chunk sums
    alignas(64) float c[2][kQuantDirectRows * 16];
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t nb0 = 2 * pair;
      const bool two = nb0 + 1 < nblocks;
      for (int half = 0; half < (two ? 2 : 1); ++half)
        for (int64_t r = 0; r < m; r += kQuantRows)
          quant_rows<kQuantRows, Bits>(static_cast<int>(std::min<int64_t>(kQuantRows, m - r)), a + r * k, k,
                                       rows.sums.data() + r * chunks, chunks, w + (nb0 + half) * block_bytes,
                                       c[half] + r * 16);
      epi(0, nb0, two, 0, static_cast<int>(m), c[0], c[1]);
    }
    return;
  }
  static thread_local std::vector<bf16> panel;
  panel.resize(2 * chunks * 512);
#pragma omp for schedule(dynamic, 1)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t nb0 = 2 * pair;
    const bool two = nb0 + 1 < nblocks;
    widen_pair<Bits>(w, nb0, two, block_bytes, chunks, panel.data());
    gemm_pair(a, m, k, panel.data(), two, nb0, ts, epi);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kQuantRows = 2;  // rows a pass holds: 4 integer sums of 4 columns' pairs each

// A's rows as 16-bit integers per 32-deep chunk: x = scale * q with a power of two scale, |q| <= 2^15, so
// every value within 2^7 of the chunk's largest (bf16 has 8 significant bits) is exact and the others are
// off by at most 2^-16 of the largest. Then VPMADDWD multiplies int16 pairs exactly, and fp32 takes the
// chunk's integer sum times the two scales: decode steps multiply the file's own values at the
// activations' precision, as the bf16 path does, and run on the integer ports at twice the fp32 FMA rate.
struct QuantActs {
  const int16_t* q;  // [m][k]
  const float* scale;  // [m][chunks]: x = scale * q (NaN where the chunk has a non-finite value)
  const float* sum;  // [m][chunks]: the chunk's sum of x (fp32), which the minimums multiply
};

inline void quantize_chunk(const bf16* x, int16_t* q, float* scale, float* sum) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = load8(x + 8 * j);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                            _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m256 total = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
  alignas(32) float lanes[2][8];
  _mm256_store_ps(lanes[0], mx);
  _mm256_store_ps(lanes[1], total);
  float amax = 0.0f, s = 0.0f;
  for (int j = 0; j < 8; ++j) {
    amax = std::max(amax, lanes[0][j]);
    s += lanes[1][j];
  }
  *sum = s;
  int e = 0;
  std::frexp(amax, &e);  // amax < 2^e
  if (!std::isfinite(s) || amax == 0.0f || e < -100) {  // a NaN or inf in the chunk makes its sum one
    *scale = std::isfinite(s) ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, 32 * sizeof(int16_t));
    return;
  }
  *scale = std::ldexp(1.0f, e - 15);
  const __m256 inv = _mm256_set1_ps(std::ldexp(1.0f, 15 - e));  // exact: a power of two
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest even, |.| <= 2^15
  // VPACKSSDW saturates 2^15 to 2^15 - 1 and packs per 128-bit lane; the permutes put the lanes in order.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8));
}

// A [m, k] quantized once per GEMM into a buffer all threads read (inside the parallel region: the single
// thread's buffer is shared, the rows split between the threads, and a barrier closes it).
inline QuantActs quantize_rows(const bf16* a, int64_t m, int64_t k) {
  static thread_local std::vector<int16_t> values;
  static thread_local std::vector<float> factors;
  const int64_t chunks = k / 32;
  QuantActs acts{};
#pragma omp single copyprivate(acts)
  {
    values.resize(m * k);
    factors.resize(2 * m * chunks);
    acts = QuantActs{values.data(), factors.data(), factors.data() + m * chunks};
  }
#pragma omp for schedule(static)
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      quantize_chunk(a + i * k + c * 32, const_cast<int16_t*>(acts.q) + i * k + c * 32,
                     const_cast<float*>(acts.scale) + i * chunks + c, const_cast<float*>(acts.sum) + i * chunks + c);
  return acts;
}

inline __m256i broadcast_quad(const int16_t* q) {  // 4 int16 (one quad of k) in every 64-bit lane
  int64_t v;
  std::memcpy(&v, q, 8);
  return _mm256_set1_epi64x(v);
}

// c [R, 16] = R rows of A (quantized, from row `row`) times one quantized column block, read once, in order.
// Per chunk and half of 8 columns: the values widened to int16 (4 columns x 4 k a register), VPMADDWD
// against the row's quad of k broadcast, 32-bit sums of k pairs; then VPHADDD finishes each column's
// integer sum (in kSumOrder, as the tail's scales and minimums are stored) and fp32 takes
// scale_w * scale_x * sum + minimum * sum(x).
template <int R, int Bits>
void int_block(const QuantActs& acts, int64_t row, int64_t k, int64_t chunks, const uint8_t* b, float* c) {
  const int64_t cb = quant_chunk_bytes(Bits), vb = quant_values_bytes(Bits);
  alignas(32) float acc[R][16] = {};  // in kSumOrder per half
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* t = b + ch * cb;
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * cb), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * cb + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * cb + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * cb + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * cb + 256), _MM_HINT_T0);
    if constexpr (Bits == 8) {
      for (int e = 320; e < 576; e += 64) _mm_prefetch(reinterpret_cast<const char*>(t + 4 * cb + e), _MM_HINT_T0);
    }
    const int16_t* x = acts.q + row * k + ch * 32;
    __m256i s[R][2][2];  // [row][half][columns 0-3, 4-7 of the half]: pair sums
    for (int i = 0; i < R; ++i) s[i][0][0] = s[i][0][1] = s[i][1][0] = s[i][1][1] = _mm256_setzero_si256();
    if constexpr (Bits == 4) {
      const __m256i nibble = _mm256_set1_epi16(0x0F);
      for (int p = 0; p < 4; ++p) {
        __m256i xl[R], xh[R];
        for (int i = 0; i < R; ++i) xl[i] = broadcast_quad(x + i * k + 4 * p), xh[i] = broadcast_quad(x + i * k + 16 + 4 * p);
        for (int half = 0; half < 2; ++half) {
          const uint8_t* v = t + half * 128 + 32 * p;
          const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
          const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16)));
          const __m256i lo0 = _mm256_and_si256(w0, nibble), hi0 = _mm256_srli_epi16(w0, 4);
          const __m256i lo1 = _mm256_and_si256(w1, nibble), hi1 = _mm256_srli_epi16(w1, 4);
          for (int i = 0; i < R; ++i) {
            s[i][half][0] = _mm256_add_epi32(s[i][half][0], _mm256_add_epi32(_mm256_madd_epi16(lo0, xl[i]),
                                                                             _mm256_madd_epi16(hi0, xh[i])));
            s[i][half][1] = _mm256_add_epi32(s[i][half][1], _mm256_add_epi32(_mm256_madd_epi16(lo1, xl[i]),
                                                                             _mm256_madd_epi16(hi1, xh[i])));
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m256i xq[R];
        for (int i = 0; i < R; ++i) xq[i] = broadcast_quad(x + i * k + 4 * j);
        for (int half = 0; half < 2; ++half) {
          const uint8_t* v = t + half * 256 + 32 * j;
          const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
          const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16)));
          for (int i = 0; i < R; ++i) {
            s[i][half][0] = _mm256_add_epi32(s[i][half][0], _mm256_madd_epi16(w0, xq[i]));
            s[i][half][1] = _mm256_add_epi32(s[i][half][1], _mm256_madd_epi16(w1, xq[i]));
          }
        }
      }
    }
    const __m128i* tail = reinterpret_cast<const __m128i*>(t + vb);
    for (int half = 0; half < 2; ++half) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(tail + half));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(tail + 2 + half));
      for (int i = 0; i < R; ++i) {
        const int64_t f = (row + i) * chunks + ch;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(s[i][half][0], s[i][half][1]));
        float* a = acc[i] + half * 8;
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(acts.scale[f])), dot,
                                           _mm256_fmadd_ps(minimum, _mm256_set1_ps(acts.sum[f]), _mm256_load_ps(a))));
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int half = 0; half < 2; ++half)  // kSumOrder back to column order (64-bit lanes 0, 2, 1, 3)
      _mm256_storeu_ps(c + i * 16 + half * 8,
                       _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_load_ps(acc[i] + half * 8)), 0xD8)));
}

template <int R, int Bits>
void int_rows(int rows, const QuantActs& acts, int64_t row, int64_t k, int64_t chunks, const uint8_t* b, float* c) {
  if constexpr (R > 1) {
    if (rows < R) return int_rows<R - 1, Bits>(rows, acts, row, k, chunks, b, c);
  }
  int_block<R, Bits>(acts, row, k, chunks, b, c);
}

// One column block's weights widened to fp32 (w = s * q + m: the file's weights, not rounded to bf16) in the
// order the AVX2 micro kernel multiplies (widen16's: per k, columns 0-3 and 8-11, then 4-7 and 12-15).
// A chunk's 32 bytes of one half and quad row are 8 columns x 4 k; shuffled k-major, each k's 8 bytes
// widen to 8 lanes.
template <int Bits>
void widen_block(const uint8_t* b, int64_t chunks, float* out) {
  const __m256i k_major = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i dword_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  const int64_t cb = quant_chunk_bytes(Bits), vb = quant_values_bytes(Bits);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* t = b + ch * cb;
    const __m128i* tail = reinterpret_cast<const __m128i*>(t + vb);
    float* o = out + ch * 512;
    for (int half = 0; half < 2; ++half) {
      const auto in_order = [](__m256 v) {  // kSumOrder -> column order
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
      };
      const __m256 scale = in_order(_mm256_cvtph_ps(_mm_loadu_si128(tail + half)));
      const __m256 minimum = in_order(_mm256_cvtph_ps(_mm_loadu_si128(tail + 2 + half)));
      auto emit = [&](__m256i q, int kk) {  // 8 columns of k = kk
        const __m256 w = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(q), minimum);
        _mm_storeu_ps(o + kk * 16 + half * 4, _mm256_castps256_ps128(w));
        _mm_storeu_ps(o + kk * 16 + 8 + half * 4, _mm256_extractf128_ps(w, 1));
      };
      for (int row = 0; row < (Bits == 8 ? 8 : 4); ++row) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + half * (vb / 2) + 32 * row));
        const __m256i v = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(raw, k_major), dword_order);
        const __m128i lanes[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
        for (int kt = 0; kt < 4; ++kt) {
          const __m128i bytes = kt % 2 ? _mm_srli_si128(lanes[kt / 2], 8) : lanes[kt / 2];
          if constexpr (Bits == 8) {
            emit(_mm256_cvtepi8_epi32(bytes), 4 * row + kt);
          } else {
            const __m256i q = _mm256_cvtepu8_epi32(bytes);
            emit(_mm256_and_si256(q, nibble), 4 * row + kt);
            emit(_mm256_srli_epi32(q, 4), 16 + 4 * row + kt);
          }
        }
      }
    }
  }
}

// Steps of up to this many rows multiply integers (the weights' bytes bound them); longer ones are bound
// by arithmetic, where VPMADDWD is no faster than fp32 FMAs: they widen a column pair to an fp32 panel in
// L2 and run the vector GEMM on it.
constexpr int64_t kIntRows = 16;

template <int Bits, typename Epilogue>
void gemm_quant_panel(const bf16* a, int64_t m, int64_t k, const uint8_t* w, int64_t nblocks, Epilogue& epi) {
  const int64_t chunks = k / 32, block_bytes = chunks * quant_chunk_bytes(Bits);
  const int64_t pairs = (nblocks + 1) / 2;
  static thread_local std::vector<float> panel;
  panel.resize(2 * chunks * 512);
  alignas(64) float c[2][kRows * 16];
  RowBlock block;
  // Rows in passes of at most 2 MiB of fp32 A, each widened once per thread and pass (not once per pair and
  // row block); a pass widens every column pair's panel again, which is cheap beside its rows' products.
  const int64_t pass_rows = std::max<int64_t>(kRows, (512 << 10) / k);
  for (int64_t p0 = 0; p0 < m; p0 += pass_rows) {
    const int64_t pm = std::min(pass_rows, m - p0);
    block.load(a + p0 * k, pm, k);
    const int64_t row_blocks = (pm + kRows - 1) / kRows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t nb0 = 2 * pair;
      const bool two = nb0 + 1 < nblocks;
      widen_pair<Bits>(w, nb0, two, block_bytes, chunks, panel.data());
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const int64_t r = rb * pm / row_blocks;
        const int rows = static_cast<int>((rb + 1) * pm / row_blocks - r);
        micro_rows<kRows>(rows, block.rows + r * k, k, chunks, panel.data(), panel.data() + chunks * 512, two, c[0],
                          c[1]);
        epi(p0 + r, nb0, two, 0, rows, c[0], c[1]);
      }
    }
  }
}

template <int Bits, typename Epilogue>
void gemm_quant_bits(const bf16* a, int64_t m, int64_t k, const uint8_t* w, int64_t nblocks, TileState& ts,
                     Epilogue& epi) {
  // The integer path's sums are exact per chunk, so a row's result never depends on the rows beside it; the
  // fp32 panel rounds otherwise, so the batch-invariant numerics keep every step on integers.
  if (m > kIntRows && !ts.invariant) return gemm_quant_panel<Bits>(a, m, k, w, nblocks, epi);
  const int64_t chunks = k / 32, block_bytes = chunks * quant_chunk_bytes(Bits);
  const int64_t pairs = (nblocks + 1) / 2;
  const QuantActs acts = quantize_rows(a, m, k);
  // As gemm_vectors: a task's column pairs (at most 256 KiB of weights) stay in L2 while every row block
  // passes over them; rows split evenly into blocks of at most kQuantRows.
  const int64_t group = m <= 32 ? 1 : std::max<int64_t>(1, std::min<int64_t>(pairs / 8, (256 << 10) / (2 * block_bytes)));
  const int64_t row_blocks = (m + kQuantRows - 1) / kQuantRows;
  alignas(64) float c[2][kQuantRows * 16];
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < (pairs + group - 1) / group; ++task)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t r = rb * m / row_blocks;
      const int rows = static_cast<int>((rb + 1) * m / row_blocks - r);
      for (int64_t pair = task * group; pair < std::min(pairs, (task + 1) * group); ++pair) {
        const int64_t nb0 = 2 * pair;
        const bool two = nb0 + 1 < nblocks;
        for (int half = 0; half < (two ? 2 : 1); ++half)
          int_rows<kQuantRows, Bits>(rows, acts, r, k, chunks, w + (nb0 + half) * block_bytes, c[half]);
        epi(r, nb0, two, 0, rows, c[0], c[1]);
      }
    }
}
#endif

// gemm() on a weight of any kind (see QWeight): its tail, if any, with its own kind, after the rest.
template <typename Epilogue>
void gemm_one(const bf16* a, int64_t m, int64_t k, const void* w, int64_t bits, int64_t nblocks, TileState& ts,
              Epilogue& epi) {
#if defined(__AVX2__) && defined(__FMA__)
  if (bits == 8) return gemm_quant_bits<8>(a, m, k, static_cast<const uint8_t*>(w), nblocks, ts, epi);
  if (bits == 4) return gemm_quant_bits<4>(a, m, k, static_cast<const uint8_t*>(w), nblocks, ts, epi);
#endif
  gemm(a, m, k, static_cast<const bf16*>(w), nblocks, ts, epi);
}

template <typename Epilogue>
void gemm(const bf16* a, int64_t m, int64_t k, const QWeight& w, int64_t nblocks, TileState& ts, Epilogue&& epi) {
  if (w.tail == nullptr) return gemm_one(a, m, k, w.data, w.bits, nblocks, ts, epi);
  gemm_one(a, m, k, w.data, w.bits, w.tail_from, ts, epi);
  auto shifted = [&](int64_t r, int64_t nb0, bool two, int i0, int i1, const float* c0, const float* c1) {
    epi(r, nb0 + w.tail_from, two, i0, i1, c0, c1);
  };
  gemm_one(a, m, k, w.tail, w.tail_bits, nblocks - w.tail_from, ts, shifted);
}

// Epilogue: out [m, n] = the sums, rounded to bf16 (Out: bf16, or float widened back from bf16).
template <typename Out>
struct StoreTiles {
  Out* out;
  int64_t n;
  void operator()(int64_t r, int64_t nb0, bool two, int i0, int i1, const float* c0, const float* c1) const {
    for (int i = i0; i < i1; ++i) {
      store_rounded16(c0 + i * 16, out + (r + i) * n + nb0 * 16);
      if (two) store_rounded16(c1 + i * 16, out + (r + i) * n + (nb0 + 1) * 16);
    }
  }
};

// Epilogue of the gate/up GEMM (blocks alternate gate, up): out [m, n] = act(gate) * up (see gated16).
struct GatedTiles {
  bf16* out;
  int64_t n;
  int act;
  void operator()(int64_t r, int64_t nb0, bool, int i0, int i1, const float* c0, const float* c1) const {
    bf16* o = out + (r + i0) * n + (nb0 / 2) * 16;
    for (int i = i0; i < i1; ++i, o += n) gated16(c0 + i * 16, c1 + i * 16, o, act);
  }
};

// One decoder layer's weights and cache, by role (null: the model has no such norm). Llama:
// attn_in = input_layernorm, mlp_in = post_attention_layernorm. Gemma 3: attn_in = input_layernorm,
// attn_out = post_attention_layernorm, mlp_in = pre_feedforward_layernorm, mlp_out = post_feedforward_layernorm.
struct LayerParams {
  const bf16* attn_in_norm;
  const bf16* attn_out_norm;
  const bf16* mlp_in_norm;
  const bf16* mlp_out_norm;
  const bf16* q_norm;
  const bf16* k_norm;
  QWeight qkv;  // packed [(Hq + 2 Hkv) D, hidden]
  QWeight o;  // packed [hidden, Hq D]
  QWeight gate_up;  // packed [2 I, hidden], gate and up blocks alternating
  QWeight down;  // packed [hidden, I]
  bf16* key_cache;  // with ModelParams::kv_int8, uint8 rows: head_dim int8 values, an fp16 scale per 16 (kv_row_bytes)
  bf16* value_cache;
  const float* cos;
  const float* sin;
  int64_t window;  // 0: none
  float scale;
  int64_t kv_group;  // its KV group (engine/kv/groups.py): which [m] slots and [m, table_stride] tables it uses
};

struct ModelParams {
  int64_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate, num_blocks, block_size, act;
  float eps;
  int64_t norm_unit_offset;
  const bf16* final_norm;
  double* phase_seconds;  // null, or 9 accumulators: seconds per phase (see mark() below; bench/profile.py)
  int64_t kv_int8;  // the caches hold 8-bit rows (cpu_common.h, quantize_kv_row)
  int64_t invariant;  // batch-invariant numerics (gemm, gemm_quant_bits); tile chunks are then passed only where
                    // their rows attend as a row alone does (AVX2's row groups: NativeDecoder)
};

}  // namespace

// The instruction sets this build was compiled for (KVSERVE_CPU_ISA lowers them): bit 0 AVX2, 1 AVX-512F,
// 2 AVX-512 BF16, 3 AMX tiles with bf16.
extern "C" int64_t kvserve_compiled_isa() {
  int64_t bits = 0;
#if defined(__AVX2__)
  bits |= 1;
#endif
#if defined(__AVX512F__)
  bits |= 2;
#endif
#if defined(__AVX512BF16__)
  bits |= 4;
#endif
  if (kCompiledWithAmx) bits |= 8;
  return bits;
}

extern "C" int64_t kvserve_amx_available() { return amx_ready() ? 1 : 0; }

// Whether the fused decoder and the packed GEMM run here: on AMX tiles, or on the vector units (AVX2
// and FMA at least).
extern "C" int64_t kvserve_fused_available() { return amx_ready() || kVectorGemm ? 1 : 0; }

// Whether a prefill chunk's rows attend together (the caller passes the chunks then): on packed keys
// (TileAttention: AMX tiles, or VDPBF16PS without them), or in row groups (RowGroups: AVX2, and AVX-512 BF16
// under the batch-invariant numerics, whose queries sum as each would attending alone).
extern "C" int64_t kvserve_tile_attention() { return kTileAttention || kWidenedAttention ? 1 : 0; }

// 1: weights are packed in the tile layout above; 0: k-major ([N/16][K][16], the AVX2 GEMM's).
extern "C" int64_t kvserve_pair_layout() { return kPairLayout ? 1 : 0; }

// W [n, k] bf16 -> this build's packed layout; n % 16 == 0 and k % 32 == 0 (the caller checks).
extern "C" void kvserve_pack_weight_bf16(const void* weight, int64_t n, int64_t k, void* packed) {
  const uint16_t* w = static_cast<const uint16_t*>(weight);
  uint16_t* out = static_cast<uint16_t*>(packed);
  const int64_t chunks = k / 32;
  if (!kPairLayout) {
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; ++nb)
      for (int64_t kk = 0; kk < k; ++kk)
        for (int col = 0; col < 16; ++col) out[(nb * k + kk) * 16 + col] = w[(nb * 16 + col) * k + kk];
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < n / 16; ++nb)
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* tile = out + (nb * chunks + c) * 512;
      for (int r = 0; r < 16; ++r)
        for (int col = 0; col < 16; ++col)
          for (int p = 0; p < 2; ++p) tile[(r * 16 + col) * 2 + p] = w[(nb * 16 + col) * k + c * 32 + 2 * r + p];
    }
}

// A weight [n, k] (n % 16 == 0, k % 32 == 0) as values q, fp16 scales and fp16 minimums per (row, 32
// columns), w = s * q + m, -> this build's quantized layout (QWeight). Int8: q int8 [n, k]. Int4: q 0..15,
// two a byte, [n, k / 2] (element 2j in the low nibble of byte j).
extern "C" void kvserve_pack_quant(const void* values, const void* scales, const void* minimums, int64_t n, int64_t k,
                                   int64_t bits, void* packed) {
  const uint8_t* q = static_cast<const uint8_t*>(values);
  const uint16_t* s = static_cast<const uint16_t*>(scales);
  const uint16_t* mn = static_cast<const uint16_t*>(minimums);
  uint8_t* out = static_cast<uint8_t*>(packed);
  const int64_t chunks = k / 32, cb = quant_chunk_bytes(bits), vb = quant_values_bytes(bits);
  auto value = [&](int64_t row, int64_t col) -> uint8_t {
    if (bits == 8) return q[row * k + col];
    const uint8_t byte = q[row * (k / 2) + col / 2];
    return col % 2 ? byte >> 4 : byte & 0x0F;
  };
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < n / 16; ++nb)
    for (int64_t c = 0; c < chunks; ++c) {
      uint8_t* t = out + (nb * chunks + c) * cb;
      std::memset(t, 0, vb);
      for (int col = 0; col < 16; ++col)
        for (int kk = 0; kk < 32; ++kk) {
          const uint8_t v = value(nb * 16 + col, c * 32 + kk);
          const QuantPlace place = quant_place(col, kk, bits);
          t[place.byte] |= static_cast<uint8_t>(place.high ? v << 4 : v);
        }
      uint16_t* tail = reinterpret_cast<uint16_t*>(t + vb);
      for (int col = 0; col < 16; ++col) {
        tail[quant_tail_slot(col)] = s[(nb * 16 + col) * chunks + c];
        tail[16 + quant_tail_slot(col)] = mn[(nb * 16 + col) * chunks + c];
      }
    }
}

// fp16 bits -> float, exactly (subnormals included), without F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t u;
  if (exponent == 0) {
    const float f = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -f : f;
  }
  u = sign | (exponent == 31 ? 0x7F800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows ids [count] of a quantized [n, k] weight packed by kvserve_pack_quant -> out [count, k] bf16: w =
// s * q + m rounded to nearest even, as the dense copy holds them (the embedding lookup of a tied,
// quantized LM head: one copy serves both).
extern "C" void kvserve_quant_rows(const void* packed, int64_t bits, int64_t n, int64_t k, const int64_t* ids,
                                   int64_t count, void* out) {
  const uint8_t* p = static_cast<const uint8_t*>(packed);
  bf16* o = static_cast<bf16*>(out);
  const int64_t chunks = k / 32, cb = quant_chunk_bytes(bits), vb = quant_values_bytes(bits);
#pragma omp parallel for schedule(static) if (count * k > (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = std::min(std::max<int64_t>(ids[i], 0), n - 1);  // the caller checks the range
    const int col = static_cast<int>(id % 16);
    const int slot = quant_tail_slot(col);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* t = p + ((id / 16) * chunks + c) * cb;
      const uint16_t* tail = reinterpret_cast<const uint16_t*>(t + vb);
      const float s = half_to_float(tail[slot]), m = half_to_float(tail[16 + slot]);
      for (int kk = 0; kk < 32; ++kk) {
        const QuantPlace place = quant_place(col, kk, bits);
        const uint8_t byte = t[place.byte];
        const int q = bits == 8 ? static_cast<int8_t>(byte) : place.high ? byte >> 4 : byte & 0x0F;
        store(s * static_cast<float>(q) + m, o + i * k + c * 32 + kk);
      }
    }
  }
}

// Rows up to which a quantized GEMM multiplies the values as read (above: a bf16 panel first).
extern "C" int64_t kvserve_quant_direct_rows() {
#if defined(__AVX512BF16__)
  return kQuantDirectRows;
#elif defined(__AVX2__) && defined(__FMA__)
  return kIntRows;
#else
  return 0;
#endif
}

// Bytes of a quantized [n, k] weight in this build's layout.
extern "C" int64_t kvserve_quant_bytes(int64_t n, int64_t k, int64_t bits) {
  return n / 16 * (k / 32) * quant_chunk_bytes(bits);
}

// out [m, n] = x [m, k] bf16 times W^T, W packed by kvserve_pack_quant (bits 4 or 8) or
// kvserve_pack_weight_bf16 (bits 0): bf16, or (out_f32) fp32 holding each value rounded to bf16 as torch's
// bf16 linear rounds it (the LM head, whose logits the sampler reads in fp32).
extern "C" void kvserve_linear_quant(const void* x, int64_t m, int64_t k, const void* packed, int64_t bits, int64_t n,
                                     void* out, int64_t out_f32, int64_t invariant) {
#pragma omp parallel
  {
    TileState ts;
    ts.invariant = invariant != 0;
    const QWeight w{packed, bits};
    if (out_f32) gemm(static_cast<const bf16*>(x), m, k, w, n / 16, ts, StoreTiles<float>{static_cast<float*>(out), n});
    else gemm(static_cast<const bf16*>(x), m, k, w, n / 16, ts, StoreTiles<bf16>{static_cast<bf16*>(out), n});
  }
}

// bf16 rows [n, dim] -> 8-bit cache rows [n, kv_row_bytes(dim)] (quantize_kv_row), and back (dequantize_kv_rows):
// the fused decoder's spelling of kernels/kv_quant.py, which the tests hold against it.
extern "C" void kvserve_quantize_kv_rows(const void* x, int64_t n, int64_t dim, void* out) {
  for (int64_t i = 0; i < n; ++i)
    quantize_kv_row(static_cast<const bf16*>(x) + i * dim, dim, static_cast<uint8_t*>(out) + i * kv_row_bytes(dim));
}
extern "C" void kvserve_dequantize_kv_rows(const void* rows, int64_t n, int64_t dim, void* out) {
  dequantize_kv_rows(static_cast<const uint8_t*>(rows), n, dim, static_cast<bf16*>(out));
}

// hidden [m, H]: in, the token embeddings; out, the final norm of the last residual stream. Per token:
// positions, context_lens (keys it attends to, itself included) [m]; per KV group and token (a layer reads
// its LayerParams::kv_group's): slot_mapping [groups, m] and its sequence's block table, block_tables
// [groups, m, table_stride] (shadow_tables likewise). tile_chunks [num_tile_chunks, 2]: (first row, rows) of the
// prefill chunks attended on tiles (TileAttention; head_dim % 32 == 0); every other row attends alone.
//
// Suspension (the engine's interjections): with a `stop` flag, each layer reads the flag (before its down
// projection); if it is set, the call returns at the top of the next layer, and returns that layer.
// `state` [2, m, H] then holds the residual stream and the last branch, and a call with first_layer =
// the returned layer goes on from there (hidden is written only at the end). Without a flag (or state)
// it runs every layer. Returns num_layers when the stack is done.
extern "C" int64_t kvserve_forward_bf16(const ModelParams* mp, const LayerParams* layers, void* hidden_ptr,
                                               int64_t m, const int64_t* positions, const int64_t* slot_mapping,
                                               const int64_t* block_tables, int64_t table_stride,
                                               const int64_t* context_lens, const int64_t* tile_chunks,
                                               int64_t num_tile_chunks, int64_t first_layer, void* state,
                                               const int32_t* stop, const int64_t* shadow_blocks,
                                               int64_t num_shadow, const int64_t* shadow_tables) {
  int64_t stopped_at = -1;
  if (!kTileAttention && !kWidenedAttention) num_tile_chunks = 0;  // every row attends alone (none are passed)
  const ModelParams& p = *mp;
  const int64_t hd = p.head_dim, hidden = p.hidden, inter = p.intermediate;
  const int64_t q_width = p.q_heads * hd, qkv_width = (p.q_heads + 2 * p.kv_heads) * hd;
  const bool unit = p.norm_unit_offset != 0;
  bf16* h = static_cast<bf16*>(hidden_ptr);
  std::vector<bf16> own_state(state == nullptr ? 2 * m * hidden : 0), x(m * hidden), qkv(m * qkv_width),
      attn(m * q_width), act(m * inter);
  bf16* const residual = state == nullptr ? own_state.data() : static_cast<bf16*>(state);  // the stream
  bf16* const branch = residual + m * hidden;  // the last attention or MLP output
  if (state == nullptr) stop = nullptr;
  // The step's attention work: packing tasks (chunk, kv head, key segment), tile tasks (chunk, kv head,
  // 16 query rows), then one task per (row attending alone, kv head).
  const TileChunk* chunks = reinterpret_cast<const TileChunk*>(tile_chunks);
  std::vector<int64_t> packed_offsets(num_tile_chunks + 1, 0), untiled;
  std::vector<bool> tiled(m, false);
  std::vector<std::array<int64_t, 3>> pack_tasks, tile_tasks;
  // Under the batch-invariant numerics chunks attend in row groups (their rows' decode bits), else on this
  // build's shared pass: packed-key tiles with bf16 arithmetic, row groups on AVX2.
  const bool grouped = !kTileAttention || p.invariant != 0;
#if defined(__AVX512BF16__)  // tile attention (kTileAttention)
  for (int64_t c = 0; c < num_tile_chunks && !grouped; ++c) {
    const int64_t end = TileAttention::end(positions, chunks[c]);
    packed_offsets[c + 1] = packed_offsets[c] + TileAttention::packed_size(end, p.kv_heads, hd);
    for (int64_t kh = 0; kh < p.kv_heads; ++kh) {
      for (int64_t seg = 0; seg * kPackKeys < end; ++seg) pack_tasks.push_back({c, kh, seg});
      for (int64_t t = 0; t * 16 < chunks[c].rows; ++t) tile_tasks.push_back({c, kh, t});
    }
    std::fill(tiled.begin() + chunks[c].row0, tiled.begin() + chunks[c].row0 + chunks[c].rows, true);
  }
#endif
  if (grouped && RowGroups::serves(hd)) {  // else every row attends alone
    const int64_t per_task = RowGroups::rows_per_task(p.q_heads, p.kv_heads);
    for (int64_t c = 0; c < num_tile_chunks; ++c) {
      for (int64_t kh = 0; kh < p.kv_heads; ++kh)
        for (int64_t t = 0; t * per_task < chunks[c].rows; ++t) tile_tasks.push_back({c, kh, t});
      std::fill(tiled.begin() + chunks[c].row0, tiled.begin() + chunks[c].row0 + chunks[c].rows, true);
    }
  }
  for (int64_t i = 0; i < m; ++i)
    if (!tiled[i]) untiled.push_back(i);
  std::vector<bf16> packed(packed_offsets[num_tile_chunks]);
  // An 8-bit cache: rows attending alone dequantize their own keys and values (DecodeBatch); the blocks
  // the tiled chunks read (shadow_blocks, which their rows of shadow_tables index) are dequantized into a
  // bf16 copy once a layer, after the step's own rows are written, and packed or grouped from there.
  const bool kv_int8 = p.kv_int8 != 0;
  const int64_t shadow_head = kv_int8 ? num_shadow * p.block_size * hd : 0;
  static thread_local std::vector<bf16> shadow_keys, shadow_values;
  if (kv_int8 && static_cast<int64_t>(shadow_keys.size()) < p.kv_heads * shadow_head) {
    shadow_keys.resize(p.kv_heads * shadow_head);
    shadow_values.resize(p.kv_heads * shadow_head);
  }
  bf16* const shadow_k = shadow_keys.data();
  bf16* const shadow_v = shadow_values.data();
  const int64_t num_tile_tasks = static_cast<int64_t>(tile_tasks.size());
  const int64_t num_attention_tasks = num_tile_tasks + static_cast<int64_t>(untiled.size()) * p.kv_heads;
#pragma omp parallel
  {
    TileState ts;
    ts.invariant = p.invariant != 0;
    std::vector<float> scores;
    std::vector<bf16> probs;
    Scratch scratch;
    // Profiling: the master adds each phase's wall time as it leaves the phase's closing barrier.
    const bool clock = p.phase_seconds != nullptr && omp_get_thread_num() == 0;
    double last = clock ? omp_get_wtime() : 0.0;
    auto mark = [&](int phase) {
      if (!clock) return;
      const double now = omp_get_wtime();
      p.phase_seconds[phase] += now - last;
      last = now;
    };
    // Gemma's post-norms of a branch, in place (a worksharing loop of this parallel region; none for Llama).
    auto norm_branch = [&](const bf16* weight) {
      if (weight == nullptr) return;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i) {
        bf16* b = branch + i * hidden;
        norm_row(static_cast<const bf16*>(b), b, hidden, weight, p.eps, unit);
      }
    };
    // residual += branch, out = RMSNorm(residual), row by row.
    auto add_branch_and_norm = [&](bf16* out, const bf16* weight) {
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i)
        add_norm_row(branch + i * hidden, residual + i * hidden, out + i * hidden, hidden, weight,
                     p.eps, unit);
    };
    for (int64_t l = first_layer; l < p.num_layers; ++l) {
      if (stopped_at >= 0) break;  // the flag, seen during the previous layer (at least one layer per call)
      const LayerParams& L = layers[l];
      if (l == 0) {  // the stream starts as the embeddings
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < m; ++i) {
          std::memcpy(residual + i * hidden, h + i * hidden, hidden * sizeof(bf16));
          norm_row(static_cast<const bf16*>(residual + i * hidden), x.data() + i * hidden, hidden,
                   L.attn_in_norm, p.eps, unit);
        }
      } else {
        add_branch_and_norm(x.data(), L.attn_in_norm);
      }
      mark(0);
      gemm(x.data(), m, hidden, L.qkv, qkv_width / 16, ts, StoreTiles<bf16>{qkv.data(), qkv_width});
      mark(1);
      const QkvStep<bf16> step{p.q_heads, p.kv_heads, hd, L.cos, L.sin, L.q_norm, L.k_norm, p.eps, unit,
                               L.key_cache, L.value_cache, p.num_blocks * p.block_size, kv_int8};
      const int64_t* const slots = slot_mapping + L.kv_group * m;
      const int64_t* const tables = block_tables + L.kv_group * m * table_stride;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i) step.token(qkv.data() + i * qkv_width, positions[i], slots[i]);
      bf16* keys = L.key_cache;
      bf16* values = L.value_cache;
      const int64_t* chunk_tables = tables;
      int64_t blocks = p.num_blocks;
      if (kv_int8 && num_shadow > 0) {
        const int64_t row = kv_row_bytes(hd), head_bytes = p.num_blocks * p.block_size * row;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < p.kv_heads * num_shadow; ++task) {
          const int64_t head = task / num_shadow, b = task % num_shadow;
          const int64_t from = head * head_bytes + shadow_blocks[b] * p.block_size * row;
          const int64_t to = head * shadow_head + b * p.block_size * hd;
          dequantize_kv_rows(reinterpret_cast<const uint8_t*>(L.key_cache) + from, p.block_size, hd, shadow_k + to);
          dequantize_kv_rows(reinterpret_cast<const uint8_t*>(L.value_cache) + from, p.block_size, hd, shadow_v + to);
        }
        keys = shadow_k, values = shadow_v, chunk_tables = shadow_tables + L.kv_group * m * table_stride;
        blocks = num_shadow;
      }
      mark(2);
      const DecodeBatch<bf16> batch{qkv.data(), qkv_width, L.key_cache, L.value_cache, tables, table_stride,
                                    context_lens, attn.data(), m, p.q_heads, p.kv_heads, p.num_blocks,
                                    p.block_size, hd, L.window, L.scale, kv_int8};
      const PrefillChunks prefill{qkv.data(), qkv_width, positions, chunk_tables, table_stride, chunks, keys,
                                  values, p.q_heads, p.kv_heads, hd, p.block_size,
                                  blocks * p.block_size * hd, L.window, L.scale, attn.data()};
#if defined(__AVX512BF16__)  // tile attention (kTileAttention)
      const TileAttention tiles{prefill, packed_offsets.data(), packed.data()};
      if (!pack_tasks.empty()) {
#pragma omp for schedule(dynamic, 1)
        for (size_t task = 0; task < pack_tasks.size(); ++task)
          tiles.pack(pack_tasks[task][0], pack_tasks[task][1], pack_tasks[task][2]);
      }
#endif
      const RowGroups groups{prefill};
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < num_attention_tasks; ++task) {
        if (task < num_tile_tasks) {
#if defined(__AVX512BF16__)  // tile attention (kTileAttention)
          if (!grouped) {
            tiles.run(tile_tasks[task][0], tile_tasks[task][1], tile_tasks[task][2], ts, scores, probs);
            continue;
          }
#endif
          groups.run(tile_tasks[task][0], tile_tasks[task][1], tile_tasks[task][2], scores, scratch);
        } else {
          const int64_t k = task - num_tile_tasks;
          batch.run(untiled[k / p.kv_heads] * p.kv_heads + k % p.kv_heads, scores, scratch);
        }
      }
      mark(3);
      gemm(attn.data(), m, q_width, L.o, hidden / 16, ts, StoreTiles<bf16>{branch, hidden});
      norm_branch(L.attn_out_norm);
      mark(4);
      add_branch_and_norm(x.data(), L.mlp_in_norm);
      mark(5);
      gemm(x.data(), m, hidden, L.gate_up, 2 * inter / 16, ts, GatedTiles{act.data(), inter, static_cast<int>(p.act)});
      mark(6);
      // The master reads the flag before the layer's last GEMM; that GEMM's closing barrier publishes
      // stopped_at to every thread before the next layer's top (no barrier of its own).
      if (stop != nullptr && l + 1 < p.num_layers && omp_get_thread_num() == 0 &&
          __atomic_load_n(stop, __ATOMIC_ACQUIRE) != 0)
        stopped_at = l + 1;
      gemm(act.data(), m, inter, L.down, hidden / 16, ts, StoreTiles<bf16>{branch, hidden});
      norm_branch(L.mlp_out_norm);
      mark(7);
    }
    if (stopped_at < 0) {
      add_branch_and_norm(h, p.final_norm);
      mark(8);
    }
  }
  return stopped_at >= 0 ? stopped_at : mp->num_layers;
}
