// Shared by the CPU kernel sources: bf16 helpers, paged decode attention, and the per-row pieces of
// a decoder layer (RMSNorm, rotary, gated activations). Everything is in an anonymous namespace: each
// source compiled into the library gets its own inlined copy.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, bf16* dst) {  // round to nearest even, as torch's float -> bfloat16
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) { dst->bits = 0x7FC0; return; }
  u += 0x7FFFu + ((u >> 16) & 1u);
  dst->bits = static_cast<uint16_t>(u >> 16);
}


#if defined(__AVX512F__)
// 16 lanes of a row as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const bf16*) {  // round to nearest even (finite values), as store()
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store16(__m512 v, float* p) { _mm512_storeu_ps(p, v); }
inline void store16(__m512 v, bf16* p) {  // the high halves of the rounded values
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round16(v, p)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// 2^t over 16 lanes: 2^n (scalef) times a polynomial for 2^f, n = round(t), f = t - n in [-0.5, 0.5].
// Degree 6: relative error ~2e-7, as good as expf for a softmax; degree 4: 4e-6, enough for
// probabilities that are rounded to bf16 next (4e-3). A finite t far below -150 gives 0.
template <int Degree>
inline __m512 exp2_16(__m512 t) {
  static_assert(Degree == 4 || Degree == 6, "fitted for degrees 4 and 6");
  static constexpr float c6[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                 5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
  static constexpr float c4[] = {9.676037097828815e-3f, 5.592203564726332e-2f, 2.4022107355830638e-1f,
                                 6.931210339915467e-1f, 1.000000075495349f};
  const float* c = Degree == 6 ? c6 : c4;
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i <= Degree; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// exp over 16 lanes (x clamped at -104, below which expf is 0 in fp32 anyway).
inline __m512 exp16(__m512 x) {
  return exp2_16<6>(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(1.44269504088896341f)));
}

// r[j] = sum of the 16 lanes of v[j]: a transposing tree of unpacks and shuffles (about 3 ops per row
// instead of a dependent horizontal reduction per row).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i, v2i+1, v2i, v2i+1] partial sums
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: rows 4i..4i+3
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same pieces over 8 lanes, for the AVX2 machines (no AVX-512): what the fused decoder's GEMM
// epilogues need (bf16 rounding, exp for the activations).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const bf16*) {  // round to nearest even (finite values), as store()
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store8(__m256 v, float* p) { _mm256_storeu_ps(p, v); }
inline void store8(__m256 v, bf16* p) {  // the high halves of the rounded values
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8(v, p)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
// 16 bf16 values widened to fp32 by interleaving zeros below them (one load, two in-lane unpacks): w0
// gets elements [0-3, 8-11], w1 [4-7, 12-15]. The AVX2 GEMM and attention multiply in that order and
// put the sums back in element order once, with store_widened16.
inline void widen16(const bf16* p, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}
// dst[0..16) = the sums of widen16's two halves, in element order (fp32, or rounded to bf16).
template <typename T>
inline void store_widened16(__m256 lo, __m256 hi, T* dst) {
  store8(_mm256_permute2f128_ps(lo, hi, 0x20), dst);
  store8(_mm256_permute2f128_ps(lo, hi, 0x31), dst + 8);
}
// exp over 8 lanes: exp2_16<6>'s polynomial; 2^n built in the exponent bits, so t is clamped to
// [-126, 127] (exp(-87.3) is already below what the softmax and activations can tell from 0).
inline __m256 exp8(__m256 x) {
  static constexpr float c[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i <= 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// act 0: SiLU; 1: GELU (tanh approximation), as activation16.
inline __m256 activation8(__m256 x, int act) {
  const __m256 one = _mm256_set1_ps(1.f);
  if (act == 0) return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 y =
      _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  const __m256 e = exp8(_mm256_add_ps(y, y));
  const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, th));
}
// r[j] = sum of the 8 lanes of v[j] (a transposing tree, as hsum16).
inline __m256 hsum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit lane: rows 0-3, 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// ---- the 8-bit KV cache (kernels/kv_quant.py): a row is dim int8 values, then each 16-group's fp16 scale ----
// Spelled as kv_quant.quantize spells it: scale = fp16(min(max|x| / 127, 65504)), q = round-half-even(x / scale).
constexpr int64_t kKvGroup = 16, kKvScaleBytes = 2;
inline int64_t kv_row_bytes(int64_t dim) { return dim + kKvScaleBytes * ((dim + kKvGroup - 1) / kKvGroup); }
// fp16 <-> fp32 for the scales (round to nearest even, as torch's .half()).
inline uint16_t kv_scale_bits(float s) {
#if defined(__F16C__)
  return _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const _Float16 h = static_cast<_Float16>(s);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
#endif
}
inline float kv_scale(const uint8_t* p) {  // the scale stored at p
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
#endif
}
template <typename T>
inline void quantize_kv_row(const T* x, int64_t dim, uint8_t* dst) {
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  for (int64_t g0 = 0; g0 < dim; g0 += kKvGroup) {
    const int64_t g1 = std::min(dim, g0 + kKvGroup);
    float amax = 0.0f;
    for (int64_t j = g0; j < g1; ++j) amax = std::max(amax, std::fabs(to_float(x[j])));
    const uint16_t bits = kv_scale_bits(std::min(amax / 127.0f, 65504.0f));
    uint8_t* at = dst + dim + kKvScaleBytes * (g0 / kKvGroup);
    std::memcpy(at, &bits, sizeof(bits));
    const float scale = kv_scale(at);
    for (int64_t j = g0; j < g1; ++j) {
      const float v = scale > 0.0f ? std::nearbyint(to_float(x[j]) / scale) : 0.0f;
      q[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
}
// A row back as bf16: q * scale in fp32, rounded to nearest even (kv_quant.dequantize).
inline void dequantize_kv_row(const uint8_t* row, int64_t dim, bf16* out) {
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  for (int64_t g0 = 0; g0 < dim; g0 += kKvGroup) {
    const int64_t g1 = std::min(dim, g0 + kKvGroup);
    const float scale = kv_scale(row + dim + kKvScaleBytes * (g0 / kKvGroup));
    int64_t j = g0;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(scale);
    for (; j + 16 <= g1; j += 16)
      store16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)))), s),
              out + j);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + 8 <= g1; j += 8)
      store8(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)))), s),
             out + j);
#endif
    for (; j < g1; ++j) store(static_cast<float>(q[j]) * scale, out + j);
  }
}
// n consecutive rows (a block's, or a buffer's) -> [n, dim] bf16.
inline void dequantize_kv_rows(const uint8_t* rows, int64_t n, int64_t dim, bf16* out) {
  for (int64_t i = 0; i < n; ++i) dequantize_kv_row(rows + i * kv_row_bytes(dim), dim, out + i * dim);
}

// One head's 8-bit cache rows (quantize_kv_row) through a block table.
struct Int8Rows {
  const uint8_t* head;
  const int64_t* table;
  int64_t block_size, row_bytes;
  // f(t - start, row) for every key t in [start, len), in order. The blocks are scattered, so the
  // stride prefetcher stops at each block's end: entering a block asks for the next one's lines.
  template <typename F>
  void for_each(int64_t start, int64_t len, F&& f) const {
    const int64_t block_bytes = block_size * row_bytes;
    for (int64_t b = start / block_size; b * block_size < len; ++b) {
      if ((b + 1) * block_size < len) {
        const char* next = reinterpret_cast<const char*>(head + table[b + 1] * block_bytes);
        for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      }
      const int64_t t0 = std::max(start, b * block_size), t1 = std::min(len, (b + 1) * block_size);
      const uint8_t* row = head + (table[b] * block_size + (t0 - b * block_size)) * row_bytes;
      for (int64_t t = t0; t < t1; ++t, row += row_bytes) f(t - start, row);
    }
  }
};

// One (sequence, kv head) task: the group's query rows against the visible keys [start, len) of one head,
// through the block table; writes out [group, hd]. `q` is filled by attend_any (fp32, pre-scaled) for
// the paths that want it; the AVX512-BF16 path reads q_raw as stored.
// Keys are visited block by block (no per-key division); `scores` holds group * (len - start) floats.
template <typename T>
struct Task {
  const float* q;  // [group, hd], fp32 * scale; null until attend_any converts q_raw
  const T* q_raw;  // the same rows as stored (unscaled), group rows hd apart
  float scale;
  int64_t group, hd;
  const T* k_head;
  const T* v_head;
  const int64_t* table;
  int64_t block_size, start, len;
  float* scores;
  T* out;

  int64_t n() const { return len - start; }
#if defined(__AVX2__)
  // The cache is mostly in DRAM and its blocks are scattered, so the hardware's stride prefetch stops at
  // each block's end. A cursor `ahead` keys in front of a pass over the keys: step() asks for that key's
  // row (into L1) and its value row (into L2, for the p.v pass), then moves on by one key.
  struct Lookahead {
    const Task* task;
    int64_t b, o;
    void step() {
      if (b * task->block_size + o < task->len) {
        const int64_t row = (task->table[b] * task->block_size + o) * task->hd;
        const char* k = reinterpret_cast<const char*>(task->k_head + row);
        const char* v = reinterpret_cast<const char*>(task->v_head + row);
        for (int64_t off = 0; off < static_cast<int64_t>(task->hd * sizeof(T)); off += 64) {
          _mm_prefetch(k + off, _MM_HINT_T0);
          _mm_prefetch(v + off, _MM_HINT_T1);
        }
      }
      if (++o == task->block_size) o = 0, ++b;
    }
  };
  Lookahead lookahead(int64_t ahead) const {
    return {this, (start + ahead) / block_size, (start + ahead) % block_size};
  }
#endif
  // f(t, row pointer) for every visible key of the given cache head, in order.
  template <typename F>
  void for_each_key(const T* head, F&& f) const {
    for (int64_t b = start / block_size; b * block_size < len; ++b) {
      const int64_t t0 = std::max(start, b * block_size), t1 = std::min(len, (b + 1) * block_size);
      const T* row = head + (table[b] * block_size + (t0 - b * block_size)) * hd;
      for (int64_t t = t0; t < t1; ++t, row += hd) f(t - start, row);
    }
  }
};

void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * n;
    float mx = -INFINITY, sum = 0.f;
    int64_t i0 = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i0 + 16 <= n; i0 += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sg + i0));
    mx = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; i0 + 8 <= n; i0 += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + i0));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) mx = std::max(mx, v);
#endif
    for (int64_t i = i0; i < n; ++i) mx = std::max(mx, sg[i]);
    i0 = 0;
#if defined(__AVX512F__)
    __m512 vsum = _mm512_setzero_ps();
    const __m512 vmx = _mm512_set1_ps(mx);
    for (; i0 + 16 <= n; i0 += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i0), vmx));
      _mm512_storeu_ps(sg + i0, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    for (; i0 + 8 <= n; i0 += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i0), vmx));
      _mm256_storeu_ps(sg + i0, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    alignas(32) float parts[8];
    _mm256_store_ps(parts, vsum);
    for (float v : parts) sum += v;
#endif
    for (int64_t i = i0; i < n; ++i) { sg[i] = std::exp(sg[i] - mx); sum += sg[i]; }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
}

// Portable version (any head_dim, any ISA).
template <typename T>
void attend_generic(const Task<T>& task, std::vector<float>& acc) {
  const int64_t n = task.n(), hd = task.hd;
  for (int64_t g = 0; g < task.group; ++g) {
    const float* qg = task.q + g * hd;
    float* sg = task.scores + g * n;
    task.for_each_key(task.k_head, [&](int64_t i, const T* k) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < hd; ++d) dot += qg[d] * to_float(k[d]);
      sg[i] = dot;
    });
  }
  softmax_rows(task.scores, task.group, n);
  acc.assign(task.group * hd, 0.f);
  task.for_each_key(task.v_head, [&](int64_t i, const T* v) {
    for (int64_t g = 0; g < task.group; ++g) {
      const float p = task.scores[g * n + i];
      float* ag = acc.data() + g * hd;
      for (int64_t d = 0; d < hd; ++d) ag[d] += p * to_float(v[d]);
    }
  });
  for (int64_t j = 0; j < task.group * hd; ++j) store(acc[j], task.out + j);
}

// The vector width of attend_vectors: 16 lanes with AVX-512, 8 with AVX2.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int n = 16;
  template <typename T> static V load(const T* p) { return load16(p); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V hsum(const V* v) { return hsum16(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using V = __m256;
  static constexpr int n = 8;
  template <typename T> static V load(const T* p) { return load8(p); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V hsum(const V* v) { return hsum8(v); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// head_dim = Lanes::n * C, accumulators held in registers (query rows one at a time, at most 8 vectors
// live); q.k scores reduced Lanes::n keys at a time by a transposing tree.
template <typename T, int C>
void attend_vectors(const Task<T>& task) {
  using L = Lanes;
  constexpr int N = L::n;
  const int64_t n = task.n();
  constexpr int64_t hd = N * C;
  for (int64_t g = 0; g < task.group; ++g) {
    typename L::V qv[C];
    for (int c = 0; c < C; ++c) qv[c] = L::loadf(task.q + g * hd + N * c);
    float* sg = task.scores + g * n;
    typename L::V part[N];  // per-key partial sums
    task.for_each_key(task.k_head, [&](int64_t i, const T* k) {
      typename L::V a = L::mul(qv[0], L::load(k));
      for (int c = 1; c < C; ++c) a = L::fmadd(qv[c], L::load(k + N * c), a);
      part[i % N] = a;
      if (i % N == N - 1) L::store(sg + i - (N - 1), L::hsum(part));
    });
    if (const int64_t rem = n % N) {
      for (int64_t j = rem; j < N; ++j) part[j] = L::zero();
      alignas(64) float tail[N];
      L::store(tail, L::hsum(part));
      std::memcpy(sg + n - rem, tail, rem * sizeof(float));
    }
  }
  softmax_rows(task.scores, task.group, n);
  constexpr int W = C < 8 ? C : 8;
  alignas(64) float tmp[N * W];
  for (int64_t g = 0; g < task.group; ++g) {
    const float* pg = task.scores + g * n;
    for (int c0 = 0; c0 < C; c0 += W) {
      typename L::V acc[W];
      for (int c = 0; c < W; ++c) acc[c] = L::zero();
      task.for_each_key(task.v_head, [&](int64_t i, const T* v) {
        const typename L::V p = L::set1(pg[i]);
        for (int c = 0; c < W; ++c) acc[c] = L::fmadd(p, L::load(v + N * (c0 + c)), acc[c]);
      });
      for (int c = 0; c < W; ++c) L::store(tmp + N * c, acc[c]);
      T* dst = task.out + g * hd + N * c0;
      for (int j = 0; j < N * W; ++j) store(tmp[j], dst + j);
    }
  }
}
#endif

#if (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))) && defined(__F16C__)
inline Lanes::V load_q8(const uint8_t* p) {  // Lanes::n int8 values as fp32
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}

// K consecutive fp16 scales at p as fp32 (four at a time where K allows).
template <int K>
inline void load_kv_scales(const uint8_t* p, float* out) {
  int i = 0;
  for (; i + 4 <= K; i += 4) _mm_storeu_ps(out + i, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kKvScaleBytes * i))));
  for (; i < K; ++i) out[i] = kv_scale(p + kKvScaleBytes * i);
}

// Attention straight from 8-bit rows for G query heads of one kv head, head_dim = Lanes::n * C (a
// multiple of 16): each key or value row is widened to fp32 and scaled by its groups' scales once, in
// registers, for all G heads (a multiply a vector, then the heads' multiply-adds as on a float row). The
// int8 values are read once, where a dequantized copy would be written and read again.
// q: [G, hd] fp32, pre-scaled; scores: G * (len - start); out: [G, hd].
template <int C, int G>
void attend_int8(const float* q, const Int8Rows& keys, const Int8Rows& values, int64_t start, int64_t len,
                 float* scores, bf16* out) {
  using L = Lanes;
  constexpr int N = L::n, per_group = static_cast<int>(kKvGroup) / N;
  constexpr int64_t hd = N * C;
  static_assert(C % per_group == 0, "head_dim must be a multiple of the scale groups");
  const int64_t n = len - start;
  {
    alignas(64) float part[G][N][N];  // per head, per key of the current N: the lanes of its q.k
    keys.for_each(start, len, [&](int64_t i, const uint8_t* row) {
      float sc[C / per_group];
      load_kv_scales<C / per_group>(row + hd, sc);
      typename L::V a[G];
      for (int g = 0; g < G; ++g) a[g] = L::zero();
      for (int c = 0; c < C; ++c) {
        const typename L::V k = L::mul(load_q8(row + N * c), L::set1(sc[c / per_group]));  // once for the G heads
        for (int g = 0; g < G; ++g) a[g] = L::fmadd(L::loadf(q + g * hd + N * c), k, a[g]);
      }
      for (int g = 0; g < G; ++g) L::store(part[g][i % N], a[g]);
      if (i % N == N - 1)
        for (int g = 0; g < G; ++g) {
          typename L::V v[N];
          for (int j = 0; j < N; ++j) v[j] = L::loadf(part[g][j]);
          L::store(scores + g * n + i - (N - 1), L::hsum(v));
        }
    });
    if (const int64_t rem = n % N)
      for (int g = 0; g < G; ++g) {
        typename L::V v[N];
        for (int j = 0; j < N; ++j) v[j] = j < rem ? L::loadf(part[g][j]) : L::zero();
        alignas(64) float tail[N];
        L::store(tail, L::hsum(v));
        std::memcpy(scores + g * n + n - rem, tail, rem * sizeof(float));
      }
  }
  softmax_rows(scores, G, n);
  constexpr int W = C * G <= 16 ? C : std::max(per_group, 16 / G / per_group * per_group);  // G * W accumulators
  alignas(64) float tmp[N * W];
  for (int c0 = 0; c0 < C; c0 += W) {
    typename L::V acc[G][W];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) acc[g][c] = L::zero();
    values.for_each(start, len, [&](int64_t i, const uint8_t* row) {
      float sc[W / per_group];
      load_kv_scales<W / per_group>(row + hd + kKvScaleBytes * (c0 / per_group), sc);
      typename L::V p[G];
      for (int g = 0; g < G; ++g) p[g] = L::set1(scores[g * n + i]);
      for (int c = 0; c < W; ++c) {
        const typename L::V v = L::mul(load_q8(row + N * (c0 + c)), L::set1(sc[c / per_group]));
        for (int g = 0; g < G; ++g) acc[g][c] = L::fmadd(p[g], v, acc[g][c]);
      }
    });
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < W; ++c) L::store(tmp + N * c, acc[g][c]);
      bf16* dst = out + g * hd + N * c0;
      for (int j = 0; j < N * W; ++j) store(tmp[j], dst + j);
    }
  }
}
// Every head of a kv head's group in one pass where the registers allow, else one head a pass.
template <int C>
void attend_int8(const float* q, int64_t group, const Int8Rows& keys, const Int8Rows& values, int64_t start,
                 int64_t len, float* scores, bf16* out) {
  constexpr int64_t hd = Lanes::n * C;
  const int64_t n = len - start;
  switch (group) {
    case 1: return attend_int8<C, 1>(q, keys, values, start, len, scores, out);
    case 2: return attend_int8<C, 2>(q, keys, values, start, len, scores, out);
    case 3: return attend_int8<C, 3>(q, keys, values, start, len, scores, out);
    case 4: return attend_int8<C, 4>(q, keys, values, start, len, scores, out);
    default:
      for (int64_t g = 0; g < group; ++g)
        attend_int8<C, 1>(q + g * hd, keys, values, start, len, scores + g * n, out + g * hd);
  }
}
constexpr bool kInt8Attention = true;
#else
constexpr bool kInt8Attention = false;
#endif

#if defined(__AVX512BF16__)
// One query's view of a task's keys (attend_bf16_dp's heads, attend_bf16_rows' rows and heads).
struct RowQuery {
  const bf16* q;  // [hd] as stored
  int64_t n;      // its keys: the task's first n
  float* scores;  // [n]
  uint16_t* probs;  // [n rounded up to even] bf16
  bf16* out;      // [hd]
};

// p.v for Q queries at once, each over its own first n keys in pairs (an odd last key paired with itself at
// probability 0): each pair of value rows is loaded and interleaved once for all of them.
template <int C, int Q>
void weigh_values_rows(const bf16* v_head, const int64_t* rows, const RowQuery* qs) {
  constexpr int64_t hd = 32 * C;
  int64_t n = 0;
  for (int q = 0; q < Q; ++q) n = std::max(n, qs[q].n);
  __m512 acc[Q][2 * C];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < 2 * C; ++c) acc[q][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    const bf16* v0 = v_head + rows[i];
    const bf16* v1 = v_head + rows[i + 1];
    __m512bh lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      // per 128-bit lane: (v0[d], v1[d]) pairs for d = 8L..8L+3 (lo) and 8L+4..8L+7 (hi)
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int q = 0; q < Q; ++q) {
      if (i >= qs[q].n) continue;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(reinterpret_cast<const uint32_t*>(qs[q].probs)[i / 2]));
      if (i + 1 == qs[q].n) {  // its last key, odd: paired with itself
        for (int c = 0; c < C; ++c) {
          const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
          acc[q][2 * c] = _mm512_dpbf16_ps(acc[q][2 * c], p, (__m512bh)_mm512_unpacklo_epi16(a, a));
          acc[q][2 * c + 1] = _mm512_dpbf16_ps(acc[q][2 * c + 1], p, (__m512bh)_mm512_unpackhi_epi16(a, a));
        }
        continue;
      }
      for (int c = 0; c < C; ++c) {
        acc[q][2 * c] = _mm512_dpbf16_ps(acc[q][2 * c], p, lo[c]);
        acc[q][2 * c + 1] = _mm512_dpbf16_ps(acc[q][2 * c + 1], p, hi[c]);
      }
    }
  }
  for (int q = 0; q < Q; ++q) {
    bf16* dst = qs[q].out;
    for (int c = 0; c < C; ++c) {  // back to dimension order: [lo.L0 hi.L0 lo.L1 hi.L1], [lo.L2 hi.L2 lo.L3 hi.L3]
      const __m512 l = acc[q][2 * c], h = acc[q][2 * c + 1];
      const __m512 x = _mm512_shuffle_f32x4(l, h, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 y = _mm512_shuffle_f32x4(l, h, _MM_SHUFFLE(3, 2, 3, 2));
      store16(_mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(3, 1, 2, 0)), dst + 32 * c);
      store16(_mm512_shuffle_f32x4(y, y, _MM_SHUFFLE(3, 1, 2, 0)), dst + 32 * c + 16);
    }
  }
}

// Queries a pass over the values holds: 2 * C sums each.
template <int C>
void weigh_values_all(const bf16* v_head, const int64_t* rows, const RowQuery* qs, int64_t count) {
  constexpr int kQ = C <= 2 ? 4 : C <= 4 ? 2 : 1;
  for (int64_t j = 0; j < count;) {
    switch (std::min<int64_t>(kQ, count - j)) {
      case 4: if constexpr (kQ >= 4) { weigh_values_rows<C, 4>(v_head, rows, qs + j), j += 4; break; } [[fallthrough]];
      case 3: if constexpr (kQ >= 3) { weigh_values_rows<C, 3>(v_head, rows, qs + j), j += 3; break; } [[fallthrough]];
      case 2: if constexpr (kQ >= 2) { weigh_values_rows<C, 2>(v_head, rows, qs + j), j += 2; break; } [[fallthrough]];
      default: weigh_values_rows<C, 1>(v_head, rows, qs + j), j += 1; break;
    }
  }
}

// bfloat16 with AVX512-BF16: q.k and p.v as bf16 pair dot products (VDPBF16PS) on the rows as stored,
// no conversions; p is rounded to bf16 as the torch path rounds it. head_dim = 32 * C.
// `count` query vectors over one range of keys (the task's), query j over the first qs[j].n of them: a
// decode's query heads (attend_bf16_dp), or a prefill chunk's consecutive rows with the heads of one kv head
// (RowGroups, under the batch-invariant numerics). Each query's sums are the same whatever queries share the
// pass, so a prefill row gets the bits it would get attending alone as a decode. Each 16 keys are read once
// for all queries, and each pair of value rows is loaded and interleaved once for up to four of them.
// The cache rows are scattered 2 KiB blocks, mostly in DRAM: the first query's pass over the keys asks
// for the key lines three blocks ahead and for the value lines (into L2) that p.v reads later.
template <int C>
void attend_bf16_rows(const Task<bf16>& task, RowQuery* qs, int64_t count, std::vector<int64_t>& rows) {
  const int64_t n = task.n();
  constexpr int64_t hd = 32 * C, ahead = 48;
  rows.resize(n + 1);
  task.for_each_key(task.k_head, [&](int64_t i, const bf16* k) { rows[i] = k - task.k_head; });
  rows[n] = rows[n - 1];  // the partner of an odd last key (weighted 0)
  const auto prefetch = [&](int64_t i) {
    for (int64_t off = 0; off < hd * 2; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(task.k_head + rows[i]) + off, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(task.v_head + rows[i]) + off, _MM_HINT_T1);
    }
  };
  for (int64_t i = 0; i < std::min(n, ahead); ++i) prefetch(i);
  const __m512 scale = _mm512_set1_ps(task.scale);
  for (int64_t b = 0; b < n; b += 16) {  // q.k: one chain a key, hsum16 per 16 keys
    for (int64_t j = 0; j < count; ++j) {
      const RowQuery& q = qs[j];
      if (q.n <= b) continue;
      const int64_t e = std::min<int64_t>(16, q.n - b);
      __m512bh qv[C];
      for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q.q + 32 * c);
      __m512 part[16];
      for (int64_t t = 0; t < e; ++t) {
        if (j == 0 && b + t + ahead < n) prefetch(b + t + ahead);
        const bf16* k = task.k_head + rows[b + t];
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        part[t] = a;
      }
      for (int64_t t = e; t < 16; ++t) part[t] = _mm512_setzero_ps();
      _mm512_mask_storeu_ps(q.scores + b, static_cast<__mmask16>((1u << e) - 1), _mm512_mul_ps(hsum16(part), scale));
    }
  }
  for (int64_t j = 0; j < count; ++j) {  // an exact softmax in fp32, then bf16 probabilities
    const RowQuery& q = qs[j];
    softmax_rows(q.scores, 1, q.n);
    bf16* pg = reinterpret_cast<bf16*>(q.probs);
    int64_t i = 0;
    for (; i + 16 <= q.n; i += 16) store16(_mm512_loadu_ps(q.scores + i), pg + i);
    for (; i < q.n; ++i) store(q.scores[i], pg + i);
    if (q.n & 1) q.probs[q.n] = 0;
  }
  weigh_values_all<C>(task.v_head, rows.data(), qs, count);
}

// A decode (or a row attending alone): the task's query heads, each over all of the task's keys.
template <int C>
void attend_bf16_dp(const Task<bf16>& task, std::vector<int64_t>& rows, std::vector<uint16_t>& probs) {
  constexpr int64_t hd = 32 * C;
  const int64_t n = task.n(), n2 = (n + 1) & ~int64_t(1);
  probs.resize(task.group * n2);
  static thread_local std::vector<RowQuery> heads;
  heads.resize(task.group);
  for (int64_t g = 0; g < task.group; ++g)
    heads[g] = {task.q_raw + g * hd, n, task.scores + g * n, probs.data() + g * n2, task.out + g * hd};
  attend_bf16_rows<C>(task, heads.data(), task.group, rows);
}

// The head dims attend_bf16_dp serves (other ones attend through attend_any, row by row).
inline bool bf16_dp_head_dim(int64_t hd) { return hd == 64 || hd == 128 || hd == 256; }
inline void attend_bf16_rows(const Task<bf16>& task, RowQuery* qs, int64_t count, std::vector<int64_t>& rows) {
  switch (task.hd) {
    case 64: return attend_bf16_rows<2>(task, qs, count, rows);
    case 128: return attend_bf16_rows<4>(task, qs, count, rows);
    default: return attend_bf16_rows<8>(task, qs, count, rows);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kWidenedAttention = true;
// bfloat16 on AVX2 (no bf16 arithmetic): the cost of attention is widening the cached rows to fp32, so
// each key and value row is widened once for several query vectors (the query heads of a kv head; in a
// prefill chunk also consecutive rows of one sequence), 16 dims at a time (widen16): q is laid out in
// widen16's order once, and p.v's sums are put back in dimension order at the end. Numerics as attend_vectors: fp32 q (pre-scaled) and sums, an exact softmax in fp32.
struct WidenedQuery {
  const float* q;  // [hd] fp32, pre-scaled
  float* scores;   // [n] for the task's keys; this query's own are [lo, hi) (causal end, sliding window)
  int64_t lo, hi;
  bf16* out;  // [hd]
};

// Scores of P queries against every key of the task.
template <int C, int P>
void widened_scores(const Task<bf16>& task, const WidenedQuery* qs) {
  // One sum per query and key, whatever P: a query's score must not depend on how many queries share the
  // pass (a decode's group of heads, or a prefill row group), so that every row gets the same bits. A key's
  // chain is short (hd / 8 FMAs) and the next key's is independent, so the split bought little.
  constexpr bool kSplit = false;
  alignas(32) float qw[P][2 * C][8];
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j) {
        const float* q = qs[p].q + 16 * c;
        qw[p][2 * c][j] = q[j], qw[p][2 * c][4 + j] = q[8 + j];
        qw[p][2 * c + 1][j] = q[4 + j], qw[p][2 * c + 1][4 + j] = q[12 + j];
      }
  __m256 part[P][8];  // per-key sums, reduced 8 keys at a time
  auto ahead = task.lookahead(32);
  task.for_each_key(task.k_head, [&](int64_t i, const bf16* k) {
    ahead.step();
    __m256 lo[P], hi[P];
    for (int p = 0; p < P; ++p) lo[p] = hi[p] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      __m256 w0, w1;
      widen16(k + 16 * c, w0, w1);
      for (int p = 0; p < P; ++p) {
        lo[p] = _mm256_fmadd_ps(_mm256_load_ps(qw[p][2 * c]), w0, lo[p]);
        if constexpr (kSplit) hi[p] = _mm256_fmadd_ps(_mm256_load_ps(qw[p][2 * c + 1]), w1, hi[p]);
        else lo[p] = _mm256_fmadd_ps(_mm256_load_ps(qw[p][2 * c + 1]), w1, lo[p]);
      }
    }
    for (int p = 0; p < P; ++p) part[p][i & 7] = kSplit ? _mm256_add_ps(lo[p], hi[p]) : lo[p];
    if ((i & 7) == 7)
      for (int p = 0; p < P; ++p) _mm256_storeu_ps(qs[p].scores + i - 7, hsum8(part[p]));
  });
  const int64_t n = task.n();
  if (const int64_t rem = n & 7)
    for (int p = 0; p < P; ++p) {
      for (int64_t j = rem; j < 8; ++j) part[p][j] = _mm256_setzero_ps();
      alignas(32) float tail[8];
      _mm256_store_ps(tail, hsum8(part[p]));
      std::memcpy(qs[p].scores + n - rem, tail, rem * sizeof(float));
    }
}

// out = probabilities x values for Q queries (their scores already probabilities, 0 outside [lo, hi)).
template <int C, int Q>
void widened_values(const Task<bf16>& task, const WidenedQuery* qs) {
  constexpr int W = Q == 1 ? 4 : Q == 4 ? 1 : 2;  // 16-dim chunks per pass over the values: 2 x Q x W sums
  for (int c0 = 0; c0 < C; c0 += W) {
    __m256 acc[Q][2 * W];
    for (int q = 0; q < Q; ++q)
      for (int c = 0; c < 2 * W; ++c) acc[q][c] = _mm256_setzero_ps();
    task.for_each_key(task.v_head, [&](int64_t i, const bf16* v) {
      __m256 p[Q];
      for (int q = 0; q < Q; ++q) p[q] = _mm256_broadcast_ss(qs[q].scores + i);
      for (int c = 0; c < W; ++c) {
        __m256 w0, w1;
        widen16(v + 16 * (c0 + c), w0, w1);
        for (int q = 0; q < Q; ++q) {
          acc[q][2 * c] = _mm256_fmadd_ps(p[q], w0, acc[q][2 * c]);
          acc[q][2 * c + 1] = _mm256_fmadd_ps(p[q], w1, acc[q][2 * c + 1]);
        }
      }
    });
    for (int q = 0; q < Q; ++q)
      for (int c = 0; c < W; ++c) store_widened16(acc[q][2 * c], acc[q][2 * c + 1], qs[q].out + 16 * (c0 + c));
  }
}

// `count` queries against the task's keys (hd = 16 * C): up to 12 a pass over the keys, 4 over the values.
template <int C>
void attend_widened(const Task<bf16>& task, const WidenedQuery* qs, int64_t count) {
  for (int64_t p = 0; p < count;) {
    const int64_t left = count - p;
    if (left >= 12) widened_scores<C, 12>(task, qs + p), p += 12;
    else if (left >= 8) widened_scores<C, 8>(task, qs + p), p += 8;
    else if (left >= 6) widened_scores<C, 6>(task, qs + p), p += 6;
    else if (left >= 4) widened_scores<C, 4>(task, qs + p), p += 4;
    else if (left == 3) widened_scores<C, 3>(task, qs + p), p += 3;
    else if (left == 2) widened_scores<C, 2>(task, qs + p), p += 2;
    else widened_scores<C, 1>(task, qs + p), p += 1;
  }
  const int64_t n = task.n();
  for (int64_t p = 0; p < count; ++p) {
    float* s = qs[p].scores;
    softmax_rows(s + qs[p].lo, 1, qs[p].hi - qs[p].lo);
    std::fill(s, s + qs[p].lo, 0.f);
    std::fill(s + qs[p].hi, s + n, 0.f);
  }
  for (int64_t p = 0; p < count;) {
    switch (std::min<int64_t>(4, count - p)) {
      case 4: widened_values<C, 4>(task, qs + p), p += 4; break;
      case 3: widened_values<C, 3>(task, qs + p), p += 3; break;
      case 2: widened_values<C, 2>(task, qs + p), p += 2; break;
      default: widened_values<C, 1>(task, qs + p), p += 1; break;
    }
  }
}

// The head dims the widened path serves.
inline bool widened_head_dim(int64_t hd) { return hd == 64 || hd == 128 || hd == 256; }
inline bool attend_widened(const Task<bf16>& task, const WidenedQuery* qs, int64_t count, int64_t hd) {
  switch (hd) {
    case 64: attend_widened<4>(task, qs, count); return true;
    case 128: attend_widened<8>(task, qs, count); return true;
    case 256: attend_widened<16>(task, qs, count); return true;
    default: return false;
  }
}
#else
constexpr bool kWidenedAttention = false;
struct WidenedQuery {};
inline bool widened_head_dim(int64_t) { return false; }
#endif

struct Scratch {
  std::vector<float> q, acc;
  std::vector<WidenedQuery> queries;
  std::vector<int64_t> rows;
  std::vector<uint16_t> probs;
  std::vector<bf16> keys, values;  // an 8-bit cache's rows of one task, dequantized (DecodeBatch)
};

inline void attend(const Task<bf16>& task, Scratch& scratch);
inline void attend(const Task<float>& task, Scratch& scratch);

template <typename T>
void attend_any(const Task<T>& raw, Scratch& scratch) {
  Task<T> task = raw;
  scratch.q.resize(task.group * task.hd);
  for (int64_t j = 0; j < task.group * task.hd; ++j) scratch.q[j] = to_float(task.q_raw[j]) * task.scale;
  task.q = scratch.q.data();
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, bf16>) {  // the group's heads share each widened row
    const int64_t n = task.n();
    scratch.queries.resize(task.group);
    for (int64_t g = 0; g < task.group; ++g)
      scratch.queries[g] = {task.q + g * task.hd, task.scores + g * n, 0, n, task.out + g * task.hd};
    if (attend_widened(task, scratch.queries.data(), task.group, task.hd)) return;
  }
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  switch (task.hd) {
    case 64: return attend_vectors<T, 64 / Lanes::n>(task);
    case 128: return attend_vectors<T, 128 / Lanes::n>(task);
    case 256: return attend_vectors<T, 256 / Lanes::n>(task);
    default: break;
  }
#endif
  attend_generic(task, scratch.acc);
}

inline void attend(const Task<float>& task, Scratch& scratch) { attend_any(task, scratch); }
inline void attend(const Task<bf16>& task, Scratch& scratch) {
#if defined(__AVX512BF16__)
  switch (task.hd) {
    case 64: return attend_bf16_dp<2>(task, scratch.rows, scratch.probs);
    case 128: return attend_bf16_dp<4>(task, scratch.rows, scratch.probs);
    case 256: return attend_bf16_dp<8>(task, scratch.rows, scratch.probs);
    default: break;
  }
#endif
  attend_any(task, scratch);
}

// A batch of single-token decodes over the paged cache; run(task) attends one (sequence, kv head) task.
template <typename T>
struct DecodeBatch {
  const T* query;  // [seqs, q_heads, hd] with a token stride
  int64_t query_token_stride;
  const T* key_cache;
  const T* value_cache;  // [kv_heads, num_blocks, block_size, hd]
  const int64_t* block_tables;
  int64_t table_stride;
  const int64_t* context_lens;
  T* out;  // [seqs, q_heads, hd] contiguous
  int64_t num_seqs, num_q_heads, num_kv_heads, num_blocks, block_size, hd, window;
  float scale;
  bool kv_int8 = false;  // the caches hold 8-bit rows (quantize_kv_row): each task dequantizes its own

  int64_t tasks() const { return num_seqs * num_kv_heads; }
  // An 8-bit cache's task: attend_int8 where head_dim allows (64, 128, 256); for any other, the visible rows
  // into one contiguous block of the thread's scratch (it stays in cache for the q.k and p.v passes), then
  // the bf16 kernels.
  void run_int8(int64_t s, int64_t h, int64_t group, int64_t start, int64_t len, std::vector<float>& scores,
                Scratch& scratch) const {
    const int64_t row = kv_row_bytes(hd), head_bytes = num_blocks * block_size * row;
    const int64_t* table = block_tables + s * table_stride;
    const Int8Rows keys{reinterpret_cast<const uint8_t*>(key_cache) + h * head_bytes, table, block_size, row};
    const Int8Rows values{reinterpret_cast<const uint8_t*>(value_cache) + h * head_bytes, table, block_size, row};
    const T* q = query + s * query_token_stride + h * group * hd;
    bf16* o = reinterpret_cast<bf16*>(out + (s * num_q_heads + h * group) * hd);
    if constexpr (kInt8Attention) {
      if (hd == 64 || hd == 128 || hd == 256) {
        scratch.q.resize(group * hd);
        for (int64_t j = 0; j < group * hd; ++j) scratch.q[j] = to_float(q[j]) * scale;
        constexpr int N = Lanes::n;
        switch (hd) {
          case 64: return attend_int8<64 / N>(scratch.q.data(), group, keys, values, start, len, scores.data(), o);
          case 128: return attend_int8<128 / N>(scratch.q.data(), group, keys, values, start, len, scores.data(), o);
          default: return attend_int8<256 / N>(scratch.q.data(), group, keys, values, start, len, scores.data(), o);
        }
      }
    }
    const int64_t n = len - start;
    scratch.keys.resize(n * hd);
    scratch.values.resize(n * hd);
    keys.for_each(start, len, [&](int64_t i, const uint8_t* r) { dequantize_kv_row(r, hd, scratch.keys.data() + i * hd); });
    values.for_each(start, len,
                    [&](int64_t i, const uint8_t* r) { dequantize_kv_row(r, hd, scratch.values.data() + i * hd); });
    static const int64_t first_block = 0;
    attend(Task<bf16>{nullptr, q, scale, group, hd, scratch.keys.data(), scratch.values.data(), &first_block, n, 0, n,
                      scores.data(), o},
           scratch);
  }
  void run(int64_t task, std::vector<float>& scores, Scratch& scratch) const {
    const int64_t s = task / num_kv_heads, h = task % num_kv_heads, group = num_q_heads / num_kv_heads;
    const int64_t len = context_lens[s];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    scores.resize(group * (len - start));
    if constexpr (std::is_same_v<T, bf16>) {
      if (kv_int8) return run_int8(s, h, group, start, len, scores, scratch);
    }
    const int64_t head_stride = num_blocks * block_size * hd;
    attend(Task<T>{nullptr, query + s * query_token_stride + h * group * hd, scale, group, hd,
                   key_cache + h * head_stride, value_cache + h * head_stride, block_tables + s * table_stride,
                   block_size, start, len, scores.data(), out + (s * num_q_heads + h * group) * hd},
           scratch);
  }
};

template <typename T>
void decode_attention(const DecodeBatch<T>& batch) {
#pragma omp parallel
  {
    std::vector<float> scores;
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch.tasks(); ++task) batch.run(task, scores, scratch);
  }
}

// key/value [tokens, kv_heads, head_dim] with a token stride (heads contiguous) -> cache slots.
template <typename T>
void write_kv(const T* key, const T* value, int64_t key_token_stride, int64_t value_token_stride, T* key_cache,
              T* value_cache, const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
              int64_t num_slots, int64_t head_dim) {
  const size_t row = head_dim * sizeof(T);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::memcpy(key_cache + (h * num_slots + slot) * head_dim, key + t * key_token_stride + h * head_dim, row);
      std::memcpy(value_cache + (h * num_slots + slot) * head_dim, value + t * value_token_stride + h * head_dim, row);
    }
  }
}


// ---- fused elementwise ops of a decoder layer (one pass each instead of 3-8 torch ops) ----

inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const bf16*) { bf16 b; store(x, &b); return to_float(b); }

// One row of RMSNorm: Llama: weight * dtype(x * r), rounded as torch rounds it; Gemma (unit_offset):
// dtype(x * r * (1 + weight)), the reference's float32 scaling. `o` may alias `xr` (in place).
template <typename T>
inline void norm_row(const T* xr, T* o, int64_t dim, const T* weight, float eps, bool unit_offset) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) { const float v = to_float(xr[i]); ss += v * v; }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  int64_t i0 = 0;
#if defined(__AVX512F__)
  const __m512 vr = _mm512_set1_ps(r), one = _mm512_set1_ps(1.f);
  for (; i0 + 16 <= dim; i0 += 16) {
    const __m512 h = _mm512_mul_ps(load16(xr + i0), vr), w = load16(weight + i0);
    store16(unit_offset ? _mm512_mul_ps(h, _mm512_add_ps(one, w)) : _mm512_mul_ps(w, round16(h, o)), o + i0);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vr = _mm256_set1_ps(r), one = _mm256_set1_ps(1.f);
  for (; i0 + 8 <= dim; i0 += 8) {
    const __m256 h = _mm256_mul_ps(load8(xr + i0), vr), w = load8(weight + i0);
    store8(unit_offset ? _mm256_mul_ps(h, _mm256_add_ps(one, w)) : _mm256_mul_ps(w, round8(h, o)), o + i0);
  }
#endif
  for (int64_t i = i0; i < dim; ++i) {
    const float h = to_float(xr[i]) * r, w = to_float(weight[i]);
    store(unit_offset ? h * (1.f + w) : w * round_to(h, o), o + i);
  }
}

// RMSNorm over rows of width `dim` of a [a, b, dim] view (strides sa, sb; rows contiguous), into a
// contiguous [a * b, dim] output.
template <typename T>
void rms_norm(const T* x, int64_t a, int64_t b, int64_t sa, int64_t sb, int64_t dim, const T* weight, float eps,
              bool unit_offset, T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < a * b; ++row)
    norm_row(x + (row / b) * sa + (row % b) * sb, out + row * dim, dim, weight, eps, unit_offset);
}

// The residual stream's add fused with the next norm: residual = dtype(x + residual) in place (one
// rounding, as torch's add), out = RMSNorm(residual). x, residual and out are contiguous [rows, dim].
template <typename T>
inline void add_norm_row(const T* xr, T* rr, T* o, int64_t dim, const T* weight, float eps, bool unit_offset) {
  int64_t i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 16 <= dim; i0 += 16) store16(_mm512_add_ps(load16(xr + i0), load16(rr + i0)), rr + i0);
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i0 + 8 <= dim; i0 += 8) store8(_mm256_add_ps(load8(xr + i0), load8(rr + i0)), rr + i0);
#endif
  for (int64_t i = i0; i < dim; ++i) store(to_float(xr[i]) + to_float(rr[i]), rr + i);
  norm_row(static_cast<const T*>(rr), o, dim, weight, eps, unit_offset);
}

template <typename T>
void add_rms_norm(const T* x, T* residual, int64_t rows, int64_t dim, const T* weight, float eps, bool unit_offset,
                  T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row)
    add_norm_row(x + row * dim, residual + row * dim, out + row * dim, dim, weight, eps, unit_offset);
}

// Rotate-half rotary of one head's row in place, by one position's fp32 cos/sin rows; fp32 math, one rounding.
template <typename T>
inline void rotate_row(T* v, int64_t dim, const float* c, const float* sn) {
  const int64_t half = dim / 2;
  int64_t i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 16 <= half; i0 += 16) {
    const __m512 x1 = load16(v + i0), x2 = load16(v + i0 + half);
    store16(_mm512_fmsub_ps(x1, _mm512_loadu_ps(c + i0), _mm512_mul_ps(x2, _mm512_loadu_ps(sn + i0))), v + i0);
    store16(_mm512_fmadd_ps(x2, _mm512_loadu_ps(c + i0 + half), _mm512_mul_ps(x1, _mm512_loadu_ps(sn + i0 + half))),
            v + i0 + half);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i0 + 8 <= half; i0 += 8) {
    const __m256 x1 = load8(v + i0), x2 = load8(v + i0 + half);
    store8(_mm256_fmsub_ps(x1, _mm256_loadu_ps(c + i0), _mm256_mul_ps(x2, _mm256_loadu_ps(sn + i0))), v + i0);
    store8(_mm256_fmadd_ps(x2, _mm256_loadu_ps(c + i0 + half), _mm256_mul_ps(x1, _mm256_loadu_ps(sn + i0 + half))),
           v + i0 + half);
  }
#endif
  for (int64_t i = i0; i < half; ++i) {
    const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
    store(x1 * c[i] - x2 * sn[i], v + i);
    store(x2 * c[i + half] + x1 * sn[i + half], v + i + half);
  }
}

// Rotary in place on x [tokens, heads, dim] (token stride st, heads contiguous), cos/sin fp32 tables
// [max_positions, dim] looked up by position.
template <typename T>
void rotary(T* x, int64_t tokens, int64_t heads, int64_t st, int64_t dim, const int64_t* positions,
            const float* cos_table, const float* sin_table) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rotate_row(x + t * st + h * dim, dim, cos_table + positions[t] * dim, sin_table + positions[t] * dim);
}

// Everything between the QKV projection and attention, in one pass over the new tokens: on qkv
// [tokens, q_heads + 2 kv_heads, dim] (token stride st, heads contiguous) optionally RMSNorm each q
// and k head (Gemma's QK norm; null weights skip it), rotate q and k in place, and copy k and v into
// their cache slots (slot < 0: not written). Attention then reads q (and, for prefill, k/v) from qkv.
template <typename T>
struct QkvStep {
  int64_t q_heads, kv_heads, dim;
  const float* cos_table;
  const float* sin_table;
  const T* q_norm;  // null: no QK norm
  const T* k_norm;
  float norm_eps;
  bool norm_unit_offset;
  T* key_cache;  // an 8-bit cache's rows (kv_int8) are kv_row_bytes(dim) bytes, at this address as bytes
  T* value_cache;
  int64_t num_slots;
  bool kv_int8 = false;

  void token(T* tok, int64_t position, int64_t slot) const {
    const float* c = cos_table + position * dim;
    const float* sn = sin_table + position * dim;
    for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
      T* v = tok + h * dim;
      const T* w = h < q_heads ? q_norm : k_norm;
      if (w != nullptr) norm_row(static_cast<const T*>(v), v, dim, w, norm_eps, norm_unit_offset);
      rotate_row(v, dim, c, sn);
    }
    if (slot < 0) return;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* k = tok + (q_heads + h) * dim;
      const T* v = tok + (q_heads + kv_heads + h) * dim;
      if (kv_int8) {
        const int64_t at = (h * num_slots + slot) * kv_row_bytes(dim);
        quantize_kv_row(k, dim, reinterpret_cast<uint8_t*>(key_cache) + at);
        quantize_kv_row(v, dim, reinterpret_cast<uint8_t*>(value_cache) + at);
      } else {
        std::memcpy(key_cache + (h * num_slots + slot) * dim, k, dim * sizeof(T));
        std::memcpy(value_cache + (h * num_slots + slot) * dim, v, dim * sizeof(T));
      }
    }
  }
};

template <typename T>
void qk_rope_write_kv(const QkvStep<T>& step, T* qkv, int64_t tokens, int64_t st, const int64_t* positions,
                      const int64_t* slot_mapping) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) step.token(qkv + t * st, positions[t], slot_mapping[t]);
}

#if defined(__AVX512F__)
// act 0: SiLU, x * sigmoid(x); 1: GELU (tanh approximation), 0.5 x (1 + tanh(y)) with tanh(y) = 1 - 2 / (exp(2y) + 1).
inline __m512 activation16(__m512 x, int act) {
  const __m512 one = _mm512_set1_ps(1.f);
  if (act == 0) return _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  const __m512 e = exp16(_mm512_add_ps(y, y));
  const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, th));
}
#endif

// out [tokens, n] = act(gate) * up from gate_up [tokens, 2n]; act 0 = SiLU, 1 = GELU (tanh approximation).
template <typename T>
void gated_act(const T* gate_up, int64_t tokens, int64_t n, int act, T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = gate_up + t * 2 * n;
    const T* u = g + n;
    T* o = out + t * n;
    int64_t i0 = 0;
#if defined(__AVX512F__)
    for (; i0 + 16 <= n; i0 += 16) store16(_mm512_mul_ps(round16(activation16(load16(g + i0), act), o), load16(u + i0)), o + i0);
#endif
    for (int64_t i = i0; i < n; ++i) {
      const float x = to_float(g[i]);
      float a;
      if (act == 0) {
        a = x / (1.f + std::exp(-x));
      } else {
        const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        a = 0.5f * x * (1.f + std::tanh(y));
      }
      store(round_to(a, o) * to_float(u[i]), o + i);
    }
  }
}

// A GEMM's finished 16 output columns of one row (fp32 sums): rounded to bf16 as torch's bf16 matmul
// rounds its output, stored as bf16 or widened back to fp32 (torch's bf16 linear, then .float()).
inline void store_rounded16(const float* src, bf16* dst) {
#if defined(__AVX512F__)
  store16(_mm512_loadu_ps(src), dst);
#elif defined(__AVX2__) && defined(__FMA__)
  store8(_mm256_loadu_ps(src), dst);
  store8(_mm256_loadu_ps(src + 8), dst + 8);
#else
  for (int j = 0; j < 16; ++j) store(src[j], dst + j);
#endif
}
inline void store_rounded16(const float* src, float* dst) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(dst, round16(_mm512_loadu_ps(src), static_cast<const bf16*>(nullptr)));
#elif defined(__AVX2__) && defined(__FMA__)
  for (int h = 0; h < 16; h += 8)
    _mm256_storeu_ps(dst + h, round8(_mm256_loadu_ps(src + h), static_cast<const bf16*>(nullptr)));
#else
  for (int j = 0; j < 16; ++j) dst[j] = round_to(src[j], static_cast<const bf16*>(nullptr));
#endif
}

// 16 columns of the gated activation from the gate and up GEMM sums: act(gate) * up, rounded as the
// unfused path rounds it (gate and up to bf16, act(gate) to bf16, then the product).
inline void gated16(const float* g, const float* u, bf16* o, int act) {
#if defined(__AVX512F__)
  const __m512 gv = round16(_mm512_loadu_ps(g), o), uv = round16(_mm512_loadu_ps(u), o);
  store16(_mm512_mul_ps(round16(activation16(gv, act), o), uv), o);
#elif defined(__AVX2__) && defined(__FMA__)
  for (int h = 0; h < 16; h += 8) {
    const __m256 gv = round8(_mm256_loadu_ps(g + h), o), uv = round8(_mm256_loadu_ps(u + h), o);
    store8(_mm256_mul_ps(round8(activation8(gv, act), o), uv), o + h);
  }
#else
  for (int j = 0; j < 16; ++j) {
    const float x = round_to(g[j], o);
    const float a = act == 0 ? x / (1.f + std::exp(-x))
                             : 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    store(round_to(a, o) * round_to(u[j], o), o + j);
  }
#endif
}

}  // namespace
