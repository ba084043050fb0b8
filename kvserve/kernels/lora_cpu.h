// LoRA adapters' deltas inside the fused decoder (models/lora.py applies the same per op): for each row of
// the step that runs with an adapter slot s, a projection's output gains (x A_s^T) B_s^T, where x is the
// projection's input row. The rows are grouped by slot so an adapter's A and B are read once per step
// whatever rows use it (Punica's shrink and expand), up to four rows share each load of A and B in
// registers, and every row's sums run in one fixed order whatever rows share its step (batch invariance);
// the base rows are not touched. Rounded where torch's bf16 ops round per op: x A^T and its product with
// B^T each to bf16, then the output plus the delta once more.
//
// A fused projection's separately trained parts (PEFT's q, k and v adapters; gate and up) stack their
// ranks in A and their B is block-diagonal: each 16 outputs sum only over their own part's ranks
// (`part_rows`), so the zeros are never read.
#pragma once
#include "cpu_common.h"

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

// One projection's adapter slots (models/lora._ModuleSlots): A [slots, capacity, in] and B^T
// [slots, capacity, out] bf16; per slot and part, the rows of A (and B^T) it uses, part_rows [slots, 3, 2]
// (begin, end); `parts` its output parts (QKV 3, gate/up 2, else 1), part_end their ends in the natural
// order, `interleaved` whether the outputs alternate 16 of each of two parts (gate/up packed so).
// a == nullptr: the model's adapters are not attached.
struct LoraModule {
  const bf16* a;
  const bf16* bt;
  const int32_t* part_rows;
  int64_t capacity;
  int64_t parts;
  int64_t part_end[3];
  int64_t interleaved;
};

// The step's adapter rows grouped by slot: group g is slot[g] with rows[start[g] .. start[g + 1]), ascending.
struct LoraGroups {
  std::vector<int32_t> slot, start, rows;

  void build(const int32_t* row_slot, int64_t m, int64_t max_loras) {
    slot.clear(), start.clear(), rows.clear();
    if (row_slot == nullptr) return;
    std::vector<int32_t> count(max_loras, 0);
    for (int64_t i = 0; i < m; ++i)
      if (row_slot[i] >= 0 && row_slot[i] < max_loras) ++count[row_slot[i]];
    for (int64_t s = 0; s < max_loras; ++s)
      if (count[s] > 0) {
        slot.push_back(static_cast<int32_t>(s));
        start.push_back(static_cast<int32_t>(rows.size()));
        for (int64_t i = 0; i < m; ++i)
          if (row_slot[i] == s) rows.push_back(static_cast<int32_t>(i));
      }
    start.push_back(static_cast<int32_t>(rows.size()));
  }
  int64_t size() const { return static_cast<int64_t>(slot.size()); }
};

inline float bf16_rounded(float x) { return round_to(x, static_cast<const bf16*>(nullptr)); }

// The vector unit the kernels below use: 16 lanes (AVX-512), 8 (AVX2) or 1.
#if defined(__AVX512F__)
using LoraVec = __m512;
constexpr int kLoraLanes = 16;
inline LoraVec lv_zero() { return _mm512_setzero_ps(); }
inline LoraVec lv_set(float x) { return _mm512_set1_ps(x); }
inline LoraVec lv_load(const bf16* p) { return load16(p); }
inline LoraVec lv_load(const float* p) { return _mm512_loadu_ps(p); }
inline LoraVec lv_fma(LoraVec a, LoraVec b, LoraVec c) { return _mm512_fmadd_ps(a, b, c); }
inline LoraVec lv_add(LoraVec a, LoraVec b) { return _mm512_add_ps(a, b); }
inline void lv_store(float* p, LoraVec v) { _mm512_storeu_ps(p, v); }
inline LoraVec lv_round(LoraVec v) { return round16(v, static_cast<const bf16*>(nullptr)); }
inline void lv_store(bf16* p, LoraVec v) { store16(v, p); }
#elif defined(__AVX2__) && defined(__FMA__)
using LoraVec = __m256;
constexpr int kLoraLanes = 8;
inline LoraVec lv_zero() { return _mm256_setzero_ps(); }
inline LoraVec lv_set(float x) { return _mm256_set1_ps(x); }
inline LoraVec lv_load(const bf16* p) { return load8(p); }
inline LoraVec lv_load(const float* p) { return _mm256_loadu_ps(p); }
inline LoraVec lv_fma(LoraVec a, LoraVec b, LoraVec c) { return _mm256_fmadd_ps(a, b, c); }
inline LoraVec lv_add(LoraVec a, LoraVec b) { return _mm256_add_ps(a, b); }
inline void lv_store(float* p, LoraVec v) { _mm256_storeu_ps(p, v); }
inline LoraVec lv_round(LoraVec v) { return round8(v, static_cast<const bf16*>(nullptr)); }
inline void lv_store(bf16* p, LoraVec v) { store8(v, p); }
#else
using LoraVec = float;
constexpr int kLoraLanes = 1;
inline LoraVec lv_zero() { return 0.0f; }
inline LoraVec lv_set(float x) { return x; }
inline LoraVec lv_load(const bf16* p) { return to_float(*p); }
inline LoraVec lv_load(const float* p) { return *p; }
inline LoraVec lv_fma(LoraVec a, LoraVec b, LoraVec c) { return a * b + c; }
inline LoraVec lv_add(LoraVec a, LoraVec b) { return a + b; }
inline void lv_store(float* p, LoraVec v) { *p = v; }
inline LoraVec lv_round(LoraVec v) { return bf16_rounded(v); }
inline void lv_store(bf16* p, LoraVec v) { store(v, p); }
#endif

inline float lv_sum(LoraVec v) {
  float lanes[kLoraLanes];
  lv_store(lanes, v);
  float s = 0.0f;
  for (int u = 0; u < kLoraLanes; ++u) s += lanes[u];
  return s;
}

constexpr int kLoraRows = 4;  // rows sharing each load of A or B^T
constexpr int64_t kShrinkRows = 16, kExpandCols = 64, kLoraBlock = 16;

// out[r] = a . xs[r] for R rows (fp32) and one bf16 row of A: two accumulators a row over 2 vectors at a time,
// then one vector at a time, then the scalar tail. A row's operations are the same for any R.
template <int R>
inline void lora_dots(const bf16* a, const float* const* xs, int64_t n, float* out) {
  LoraVec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = lv_zero();
  int64_t k = 0;
  for (; k + 2 * kLoraLanes <= n; k += 2 * kLoraLanes) {
    const LoraVec a0 = lv_load(a + k), a1 = lv_load(a + k + kLoraLanes);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = lv_fma(a0, lv_load(xs[r] + k), acc[r][0]);
      acc[r][1] = lv_fma(a1, lv_load(xs[r] + k + kLoraLanes), acc[r][1]);
    }
  }
  for (; k + kLoraLanes <= n; k += kLoraLanes) {
    const LoraVec a0 = lv_load(a + k);
    for (int r = 0; r < R; ++r) acc[r][0] = lv_fma(a0, lv_load(xs[r] + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    float s = lv_sum(lv_add(acc[r][0], acc[r][1]));
    for (int64_t kk = k; kk < n; ++kk) s += to_float(a[kk]) * xs[r][kk];
    out[r] = s;
  }
}

// d[r][0..16) = bf16(sum over j in [j0, j1) of ts[r][j] * bt[j * stride + 0..16)), for R rows; j in order.
template <int R>
inline void lora_block(const bf16* bt, int64_t stride, const float* const* ts, int64_t j0, int64_t j1,
                       float (*d)[kLoraBlock]) {
  constexpr int V = kLoraBlock / kLoraLanes;
  LoraVec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = lv_zero();
  for (int64_t j = j0; j < j1; ++j) {
    LoraVec b[V];
    for (int v = 0; v < V; ++v) b[v] = lv_load(bt + j * stride + v * kLoraLanes);
    for (int r = 0; r < R; ++r) {
      const LoraVec t = lv_set(ts[r][j]);
      for (int v = 0; v < V; ++v) acc[r][v] = lv_fma(b[v], t, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) lv_store(d[r] + v * kLoraLanes, lv_round(acc[r][v]));
}

// Calls f(std::integral_constant<int, R>, first) for the group's rows in runs of R = kLoraRows (the last shorter).
template <typename F>
inline void lora_row_runs(int64_t count, const F& f) {
  int64_t k = 0;
  for (; k + kLoraRows <= count; k += kLoraRows) f(std::integral_constant<int, kLoraRows>{}, k);
  switch (count - k) {
    case 3: f(std::integral_constant<int, 3>{}, k); break;
    case 2: f(std::integral_constant<int, 2>{}, k); break;
    case 1: f(std::integral_constant<int, 1>{}, k); break;
    default: break;
  }
}

// The part of output block b (16 outputs).
inline int64_t lora_part(const LoraModule& mod, int64_t b) {
  if (mod.interleaved) return b % 2;
  int64_t p = 0;
  while (p + 1 < mod.parts && b * kLoraBlock >= mod.part_end[p]) ++p;
  return p;
}

// Shrink: t[i, j] = bf16(A_s[j] . x_i) for every adapter row i (slot s), tasks (group, 16 rows of A): a thread
// reads its rows of A once for all the group's rows. A worksharing loop without a closing barrier (`nowait`): the
// caller's next worksharing loop (the projection's GEMM, or a barrier) orders it before lora_expand reads t.
// x [m, in]; xf: the thread's scratch.
inline void lora_shrink(const LoraModule& mod, const LoraGroups& groups, const bf16* x, int64_t in, float* t,
                        std::vector<float>& xf) {
  if (mod.a == nullptr || groups.size() == 0) return;
  const int64_t cap = mod.capacity, chunks = (cap + kShrinkRows - 1) / kShrinkRows;
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t task = 0; task < groups.size() * chunks; ++task) {
    const int64_t g = task / chunks, s = groups.slot[g];
    int64_t rank = 0;  // the rows of A the slot uses: its parts' last
    for (int64_t p = 0; p < mod.parts; ++p) rank = std::max<int64_t>(rank, mod.part_rows[(s * 3 + p) * 2 + 1]);
    const int64_t j0 = (task % chunks) * kShrinkRows, j1 = std::min(rank, j0 + kShrinkRows);
    if (j0 >= j1) continue;
    const bf16* a = mod.a + s * cap * in;
    if (static_cast<int64_t>(xf.size()) < kLoraRows * in) xf.resize(kLoraRows * in);
    const int32_t* rows = groups.rows.data() + groups.start[g];
    lora_row_runs(groups.start[g + 1] - groups.start[g], [&](auto rows_, int64_t first) {
      constexpr int R = decltype(rows_)::value;
      const float* xs[R];
      for (int r = 0; r < R; ++r) {
        float* dst = xf.data() + r * in;
        const bf16* src = x + rows[first + r] * in;
        for (int64_t h = 0; h < in; ++h) dst[h] = to_float(src[h]);
        xs[r] = dst;
      }
      float out[R];
      for (int64_t j = j0; j < j1; ++j) {
        lora_dots<R>(a + j * in, xs, in, out);
        for (int r = 0; r < R; ++r) t[rows[first + r] * cap + j] = bf16_rounded(out[r]);
      }
    });
  }
}

// Expand: d[i, o] = bf16(sum_j t[i, j] B^T_s[j, o]) over j of o's part (in order), handed to
// sink(i, o0, d) 16 outputs [o0, o0 + 16) at a time; tasks (group, 64 outputs). A worksharing loop with its closing barrier;
// call it after lora_shrink and a barrier.
template <typename Sink>
inline void lora_expand(const LoraModule& mod, const LoraGroups& groups, int64_t out, const float* t,
                        const Sink& sink) {
  if (mod.a == nullptr || groups.size() == 0) return;
  const int64_t cap = mod.capacity, chunks = (out + kExpandCols - 1) / kExpandCols;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < groups.size() * chunks; ++task) {
    const int64_t g = task / chunks, s = groups.slot[g];
    const bf16* bt = mod.bt + s * cap * out;
    const int32_t* rows = groups.rows.data() + groups.start[g];
    const int64_t o_first = (task % chunks) * kExpandCols, o_last = std::min(out, o_first + kExpandCols);
    for (int64_t o0 = o_first; o0 < o_last; o0 += kLoraBlock) {
      const int32_t* span = mod.part_rows + (s * 3 + lora_part(mod, o0 / kLoraBlock)) * 2;
      if (span[0] >= span[1]) continue;  // the adapter leaves this part be
      lora_row_runs(groups.start[g + 1] - groups.start[g], [&](auto rows_, int64_t first) {
      constexpr int R = decltype(rows_)::value;
        const float* ts[R];
        for (int r = 0; r < R; ++r) ts[r] = t + rows[first + r] * cap;
        float d[R][kLoraBlock];
        lora_block<R>(bt + o0, out, ts, span[0], span[1], d);
        for (int r = 0; r < R; ++r) sink(rows[first + r], o0, d[r]);
      });
    }
  }
}

// out[i, o] = bf16(out[i, o] + d): a projection whose bf16 output is stored before its delta is added.
struct LoraAddInto {
  bf16* out;
  int64_t n;
  void operator()(int64_t i, int64_t o0, const float* d) const {
    bf16* row = out + i * n + o0;
    for (int64_t o = 0; o < kLoraBlock; o += kLoraLanes) lv_store(row + o, lv_add(lv_load(row + o), lv_load(d + o)));
  }
};

// delta[i, o] = d: the gate/up projection's deltas, added in its GEMM's epilogue (GatedTiles) before the
// activation. Rows are zeroed first where a part is left be (lora_zero_rows).
struct LoraKeep {
  float* delta;
  int64_t n;
  void operator()(int64_t i, int64_t o0, const float* d) const { std::copy(d, d + kLoraBlock, delta + i * n + o0); }
};

// delta[i, :] = 0 for every adapter row (a worksharing loop with its barrier): outputs of a part an adapter
// leaves be get no sink call.
inline void lora_zero_rows(const LoraGroups& groups, float* delta, int64_t n) {
#pragma omp for schedule(static)
  for (int64_t k = 0; k < static_cast<int64_t>(groups.rows.size()); ++k)
    std::fill(delta + groups.rows[k] * n, delta + (groups.rows[k] + 1) * n, 0.0f);
}

}  // namespace
