// Activations quantized for integer products: each row's 32-deep chunks as int16 with a power of two scale,
// shared by the integer GEMMs of AVX2 (VPMADDWD, gemm_quant_avx2.h) and AVX-512 VNNI (VPDPWSSD,
// gemm_quant_avx512.h).
#pragma once
#include "cpu_common.h"

#include <limits>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// A's rows as 16-bit integers per 32-deep chunk: x = scale * q with a power of two scale, |q| <= 2^15, so
// every value within 2^7 of the chunk's largest (bf16 has 8 significant bits) is exact and the others are
// off by at most 2^-16 of the largest. Then VPMADDWD (VPDPWSSD) multiplies int16 pairs exactly, and fp32 takes
// the chunk's integer sum times the two scales: steps multiply the file's own values at the activations'
// precision, as the bf16 path does, on the integer ports, and a chunk's sum is exact whatever order or
// number of partial sums a kernel uses, so a row's result never depends on the rows beside it.
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
#endif

}  // namespace
