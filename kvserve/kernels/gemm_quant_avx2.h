// The quantized GEMM with AVX2 and FMA (no AVX-512 BF16): integer pair products (VPMADDWD) on activations
// quantized per 32 inputs for steps of up to kIntRows rows, an fp32 panel for the vector GEMM (gemm_vector.h)
// above. The layout: gemm_quant_layout.h.
#pragma once
#include "gemm_bf16.h"
#include "gemm_quant_layout.h"

#include <limits>

namespace {

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
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
  const QuantActs acts = made_by_one_thread<QuantActs>([&] {
    values.resize(m * k);
    factors.resize(2 * m * chunks);
    return QuantActs{values.data(), factors.data(), factors.data() + m * chunks};
  });
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

}  // namespace
