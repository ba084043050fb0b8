// The quantized GEMM with AVX-512 BF16 (AMX builds too): decode-sized steps multiply the stored values as read
// (VDPBF16PS: W8A16, W4A16), longer ones widen each column pair into a bf16 panel for the bf16 GEMM of this CPU
// (gemm_bf16.h). The layout: gemm_quant_layout.h.
#pragma once
#include "gemm_bf16.h"
#include "gemm_quant_layout.h"

#include <array>
#include <limits>

namespace {

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


// ---- 8-bit activations (W4A8, W6A8, W8A8) ----
// A's rows quantized once per GEMM to int8 per 16 inputs (half a chunk): x ~ scale * q, scale = max |x| / 127,
// q rounded to nearest even (llama.cpp's q8_0 takes 32; 16 halves the logits' error for one more scaling a
// chunk). VPDPBUSD then multiplies 4 k of a column's weights (the unsigned operand: 0..15, int8 + 128, or
// 6-bit + 32) by the row's 4 values (signed) in one 32-bit lane, exactly; fp32 takes each half chunk's
// integer sum times the two scales, in k order. Nothing in a row's arithmetic depends on the rows beside
// it, so every step size is batch-invariant by construction.
struct Int8Acts {
  const int8_t* q;  // [m][k]
  const float* scale;  // [m][chunks][2] (NaN where the half holds a non-finite value)
  const float* sum;  // [m][chunks]: the chunk's sum of scale * q, which the minimums multiply
  const int32_t* qsum;  // [m][chunks][2]: the halves' sums of q (an offset weight's correction)
};

// 16 values -> q, their scale and their sum of q; returns scale * sum(q) (what the products see: the
// minimums' error then cancels the mean of the weights' values, as llama.cpp's q8_1).
inline float quantize_half8(__m512 v, int8_t* q, float* scale, int32_t* qsum) {
  const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));  // MAXPS may drop a NaN: asked apart
  const bool nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
  if (nan || !std::isfinite(amax) || amax == 0.0f) {  // a NaN or inf spoils its half (and so its row's outputs)
    *scale = amax == 0.0f && !nan ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    *qsum = 0;
    std::memset(q, 0, 16);
    return *scale;
  }
  *scale = amax / 127.0f;
  const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(127.0f / amax)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qi));
  *qsum = _mm512_reduce_add_epi32(qi);
  return *scale * static_cast<float>(*qsum);
}

// A [m, k] quantized once per GEMM into a buffer all threads read (inside the parallel region: the single
// thread's buffer is shared, the rows split between the threads, and the loop's barrier closes it).
inline Int8Acts quantize_rows8(const bf16* a, int64_t m, int64_t k) {
  static thread_local std::vector<int8_t> values;
  static thread_local std::vector<float> factors;
  static thread_local std::vector<int32_t> sums;
  const int64_t chunks = k / 32;
  const Int8Acts acts = made_by_one_thread<Int8Acts>([&] {
    values.resize(m * k);
    factors.resize(3 * m * chunks);
    sums.resize(2 * m * chunks);
    return Int8Acts{values.data(), factors.data(), factors.data() + 2 * m * chunks, sums.data()};
  });
#pragma omp for schedule(static)
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t f = i * chunks + c;
      int8_t* q = const_cast<int8_t*>(acts.q) + i * k + c * 32;
      float* scale = const_cast<float*>(acts.scale) + 2 * f;
      int32_t* qsum = const_cast<int32_t*>(acts.qsum) + 2 * f;
      const float first = quantize_half8(load16(a + i * k + c * 32), q, scale, qsum);
      const float second = quantize_half8(load16(a + i * k + c * 32 + 16), q + 16, scale + 1, qsum + 1);
      const_cast<float*>(acts.sum)[f] = first + second;
    }
  return acts;
}

// c = R rows of A (quantized, from row `row`) times NB column blocks (block_bytes apart), each block's sums
// [R, 16] at c + j * ldc. A quad of k (4p..4p+3) is tile rows 2p and 2p + 1, 64 bytes in a row: one VPERMW
// puts each column's two pairs side by side in its 32-bit lane (4-bit values: rows 2p + 8 and 2p + 9, k
// 16 + 4p.., sit in the same bytes' high nibbles; 6-bit ones take their top two bits from the 64 bytes of
// the high plane at 64 (p % 2), bits 2 (p / 2) for the low nibbles and 4 + 2 (p / 2) for the high ones).
// Bits 20 and 22 (the K-quant forms): the same values, their factors d * sc (and -dmin * m) made in fp32.
template <int R, int NB, int Bits>
void int8_block(const Int8Acts& acts, int64_t row, int64_t k, int64_t chunks, const uint8_t* b, int64_t block_bytes,
                float* c, int64_t ldc) {
  constexpr int VB = static_cast<int>(value_bits(Bits));
  constexpr bool Super = is_super(Bits);
  const __m512i quads = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i nibble = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t vb = quant_values_bytes(Bits);
  __m512 acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < chunks; ++ch) {
    // No software prefetch here, unlike the bf16 paths: these products eat the weights faster than the
    // widening ones do, and on Zen 4 asking ahead made every shape's decode slower (docs/bench/analysis.md).
    const uint8_t* t[NB];
    const int64_t at = quant_chunk_offset(Bits, ch);
    for (int j = 0; j < NB; ++j) t[j] = b + j * block_bytes + at;
    const int8_t* x = acts.q + row * k + ch * 32;
    const auto quad = [&](int i, int p) {  // row i's values k = 4p..4p + 3 in every lane
      int32_t v;
      std::memcpy(&v, x + i * k + 4 * p, 4);
      return _mm512_set1_epi32(v);
    };
    __m512i s[NB][R];  // exact integer sums (the order of their adds does not matter)
    __m512i h[NB][R];  // k 16-31's sums (the high nibbles', for 4 and 6 bits)
    constexpr int kOffset = VB == 8 ? -128 : VB == 6 ? -32 : 0;  // the weights' unsigned offset, taken off
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < R; ++i) {
        const int32_t* qsum = acts.qsum + 2 * ((row + i) * chunks + ch);
        s[j][i] = _mm512_set1_epi32(kOffset * qsum[0]);
        h[j][i] = _mm512_set1_epi32(kOffset * qsum[1]);
      }
    if constexpr (VB == 8) {  // quads p (k 0-15) to s, 4 + p to h
      for (int p = 0; p < 4; ++p)
        for (int j = 0; j < NB; ++j) {
          const __m512i lo = _mm512_xor_si512(_mm512_permutexvar_epi16(quads, _mm512_loadu_si512(t[j] + 64 * p)), sign);
          const __m512i hi =
              _mm512_xor_si512(_mm512_permutexvar_epi16(quads, _mm512_loadu_si512(t[j] + 64 * (4 + p))), sign);
          for (int i = 0; i < R; ++i) {
            s[j][i] = _mm512_dpbusd_epi32(s[j][i], lo, quad(i, p));
            h[j][i] = _mm512_dpbusd_epi32(h[j][i], hi, quad(i, 4 + p));
          }
        }
    } else {
      const __m512i top = _mm512_set1_epi8(0x30);
      for (int p = 0; p < 4; ++p)
        for (int j = 0; j < NB; ++j) {
          const __m512i v = _mm512_permutexvar_epi16(quads, _mm512_loadu_si512(t[j] + 64 * p));
          __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
          if constexpr (VB == 6) {  // bits 2 (p / 2) and 4 + 2 (p / 2) of the high plane, to bits 4-5
            const __m512i b = _mm512_permutexvar_epi16(quads, _mm512_loadu_si512(t[j] + 256 + 64 * (p % 2)));
            const int shift = 2 * (p / 2);
            lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(b, 4 - shift), top));
            hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(b, shift), top));
          }
          for (int i = 0; i < R; ++i) {
            s[j][i] = _mm512_dpbusd_epi32(s[j][i], lo, quad(i, p));
            h[j][i] = _mm512_dpbusd_epi32(h[j][i], hi, quad(i, 4 + p));
          }
        }
    }
    for (int j = 0; j < NB; ++j) {
      const uint8_t* tail = t[j] + vb;
      __m512 scale, second;  // 6 bits: the scales of k 0-15 and 16-31; else the scales and the minimums
      if constexpr (Super) {
        const uint8_t* head = super_head(b + j * block_bytes, Bits, ch);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head)));
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tail));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 16));
        if constexpr (VB == 6) {  // int8 sub-block scales
          scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
          second = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
        } else {  // uint8 scales and minimums, the minimums' factor -dmin
          const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 32)));
          scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)));
          second = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)));
        }
      } else {
        scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)));
        second = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 32)));
      }
      for (int i = 0; i < R; ++i) {  // k 0-15 (s), then 16-31 (h), each times its two scales
        const int64_t f = (row + i) * chunks + ch;
        const __m512 sx0 = _mm512_set1_ps(acts.scale[2 * f]), sx1 = _mm512_set1_ps(acts.scale[2 * f + 1]);
        const __m512 lo = _mm512_cvtepi32_ps(s[j][i]), hi = _mm512_cvtepi32_ps(h[j][i]);
        if constexpr (VB == 6) {  // `second`: the weights' scales of k 16-31
          acc[j][i] = _mm512_fmadd_ps(hi, _mm512_mul_ps(second, sx1), _mm512_fmadd_ps(lo, _mm512_mul_ps(scale, sx0), acc[j][i]));
        } else {  // one weight scale for both halves; `second`: the minimums
          const __m512 x = _mm512_fmadd_ps(hi, sx1, _mm512_mul_ps(lo, sx0));
          acc[j][i] = _mm512_fmadd_ps(scale, x, _mm512_fmadd_ps(second, _mm512_set1_ps(acts.sum[f]), acc[j][i]));
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(c + j * ldc + i * 16, acc[j][i]);
}

template <int R, int NB, int Bits>
void int8_rows(int rows, int blocks, const Int8Acts& acts, int64_t row, int64_t k, int64_t chunks, const uint8_t* b,
               int64_t block_bytes, float* c, int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) return int8_rows<R - 1, NB, Bits>(rows, blocks, acts, row, k, chunks, b, block_bytes, c, ldc);
  }
  if constexpr (NB > 1) {
    if (blocks < NB) return int8_rows<R, NB - 1, Bits>(rows, blocks, acts, row, k, chunks, b, block_bytes, c, ldc);
  }
  int8_block<R, NB, Bits>(acts, row, k, chunks, b, block_bytes, c, ldc);
}

constexpr int kInt8Rows = 4;  // rows a long step's pass holds over a column pair: 16 integer and 8 fp32 sums

// Every step on 8-bit activations. Decode-sized steps (up to kQuantDirectRows rows) take up to four column
// blocks a task, each read once; longer ones take a group of column pairs that stays in L2 while every
// block of kInt8Rows rows passes over it.
template <int Bits, typename Epilogue>
void gemm_quant_int8(const bf16* a, int64_t m, int64_t k, const uint8_t* w, int64_t nblocks, Epilogue& epi) {
  const int64_t chunks = k / 32, block_bytes = quant_block_bytes(Bits, chunks);
  const Int8Acts acts = quantize_rows8(a, m, k);
  alignas(64) float c[4][kQuantDirectRows * 16];
  if (m <= kQuantDirectRows) {
    const int64_t per_task = m == 1 ? 4 : 2, tasks = (nblocks + per_task - 1) / per_task;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t nb0 = task * per_task;
      const int blocks = static_cast<int>(std::min(per_task, nblocks - nb0));
      int8_rows<kQuantDirectRows, 4, Bits>(static_cast<int>(m), blocks, acts, 0, k, chunks, w + nb0 * block_bytes,
                                           block_bytes, c[0], kQuantDirectRows * 16);
      for (int j = 0; j < blocks; j += 2) epi(0, nb0 + j, j + 1 < blocks, 0, static_cast<int>(m), c[j], c[j + 1]);
    }
    return;
  }
  const int64_t pairs = (nblocks + 1) / 2;
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(pairs / 8, (256 << 10) / (2 * block_bytes)));
  const int64_t row_blocks = (m + kInt8Rows - 1) / kInt8Rows;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < (pairs + group - 1) / group; ++task)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t r = rb * m / row_blocks;
      const int rows = static_cast<int>((rb + 1) * m / row_blocks - r);
      for (int64_t pair = task * group; pair < std::min(pairs, (task + 1) * group); ++pair) {
        const int64_t nb0 = 2 * pair;
        const bool two = nb0 + 1 < nblocks;
        int8_rows<kInt8Rows, 2, Bits>(rows, two ? 2 : 1, acts, r, k, chunks, w + nb0 * block_bytes, block_bytes,
                                      c[0], kQuantDirectRows * 16);
        epi(r, nb0, two, 0, rows, c[0], c[1]);
      }
    }
}

// A mixture's experts on 8-bit activations, each a decode-sized GEMM (up to kQuantDirectRows rows) over its
// rows [start[g], start[g + 1]) of `a` and its weight w[g] (all of kind Bits, no tail): every row quantized in
// one pass, and one worksharing loop over every expert's tasks, so a step of many small GEMMs waits at one
// barrier, not at three per expert. The same products as gemm_quant_int8's (the same bits).
template <int Bits, typename EpiFor>
void gemm_quant_int8_grouped(const bf16* a, int64_t k, int64_t groups, const int64_t* start, const QWeight* w,
                             int64_t nblocks, EpiFor& epi_for) {
  const int64_t chunks = k / 32, block_bytes = quant_block_bytes(Bits, chunks);
  const Int8Acts acts = quantize_rows8(a, start[groups], k);
  static thread_local std::vector<std::array<int64_t, 2>> tasks;  // (group, first block): each thread's the same
  tasks.clear();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = start[g + 1] - start[g], per_task = rows == 1 ? 4 : 2;
    for (int64_t nb0 = 0; rows > 0 && nb0 < nblocks; nb0 += per_task) tasks.push_back({g, nb0});
  }
  alignas(64) float c[4][kQuantDirectRows * 16];
#pragma omp for schedule(dynamic, 1)
  for (size_t t = 0; t < tasks.size(); ++t) {
    const int64_t g = tasks[t][0], nb0 = tasks[t][1], rows = start[g + 1] - start[g];
    const int blocks = static_cast<int>(std::min<int64_t>(rows == 1 ? 4 : 2, nblocks - nb0));
    int8_rows<kQuantDirectRows, 4, Bits>(static_cast<int>(rows), blocks, acts, start[g], k, chunks,
                                         static_cast<const uint8_t*>(w[g].data) + nb0 * block_bytes, block_bytes,
                                         c[0], kQuantDirectRows * 16);
    auto epi = epi_for(g);
    for (int j = 0; j < blocks; j += 2) epi(0, nb0 + j, j + 1 < blocks, 0, static_cast<int>(rows), c[j], c[j + 1]);
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
  if (ts.int8_acts) return gemm_quant_int8<Bits>(a, m, k, w, nblocks, epi);
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
#endif  // __AVX512BF16__

}  // namespace
