// Prefill attention for the rows of a prefill chunk that attend together: on packed keys (TileAttention: AMX
// tiles, or VDPBF16PS without them) or in row groups that share each key and value row (RowGroups). Rows that
// attend alone (decodes, and the rest) go through cpu_common.h's DecodeBatch, as the per-op kernels do.
#pragma once
#include "cpu_common.h"
#include "gemm_bf16.h"

namespace {

struct TileChunk {  // rows [row0, row0 + rows) of the step: one sequence's prefill chunk
  int64_t row0, rows;
};

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

}  // namespace
