// The GEMM on a weight of any kind (QWeight: bf16, 8, 6 or 4 bits, a K-quant form, or one kind with a tail of another), and the
// epilogue that stores its sums: what the decoder step (decoder_step.h) and kvserve_linear_quant call.
#pragma once
#include "gemm_bf16.h"
#include "gemm_quant_avx2.h"
#include "gemm_quant_avx512.h"
#include "gemm_quant_layout.h"

namespace {

// gemm() on a weight of any kind (see QWeight): its tail, if any, with its own kind, after the rest.
template <typename Epilogue>
void gemm_one(const bf16* a, int64_t m, int64_t k, const void* w, int64_t bits, int64_t nblocks, TileState& ts,
              Epilogue& epi) {
#if defined(__AVX512BF16__)
  if (bits == 6) return gemm_quant_int8<6>(a, m, k, static_cast<const uint8_t*>(w), nblocks, epi);
  if (bits == (4 | kSuperBits)) return gemm_quant_int8<4 | kSuperBits>(a, m, k, static_cast<const uint8_t*>(w), nblocks, epi);
  if (bits == (6 | kSuperBits)) return gemm_quant_int8<6 | kSuperBits>(a, m, k, static_cast<const uint8_t*>(w), nblocks, epi);
#endif
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

// A mixture's experts: a GEMM per group g over rows [start[g], start[g + 1]) of `a` with weight w[g] and the
// epilogue epi_for(g). Where every group is decode-sized and multiplies 8-bit activations with weights of one
// kind, one pass runs them all (gemm_quant_int8_grouped); else one GEMM a group. Either way, the same bits.
template <typename EpiFor>
void gemm_grouped(const bf16* a, int64_t k, int64_t groups, const int64_t* start, const QWeight* w, int64_t nblocks,
                  TileState& ts, EpiFor&& epi_for) {
#if defined(__AVX512BF16__)
  bool one_pass = ts.int8_acts;
  for (int64_t g = 0; g < groups && one_pass; ++g)
    one_pass = start[g + 1] - start[g] <= kQuantDirectRows && w[g].tail == nullptr && w[g].bits == w[0].bits;
  if (one_pass) {
    switch (w[0].bits) {
      case 4: return gemm_quant_int8_grouped<4>(a, k, groups, start, w, nblocks, epi_for);
      case 6: return gemm_quant_int8_grouped<6>(a, k, groups, start, w, nblocks, epi_for);
      case 8: return gemm_quant_int8_grouped<8>(a, k, groups, start, w, nblocks, epi_for);
      case 4 | kSuperBits: return gemm_quant_int8_grouped<4 | kSuperBits>(a, k, groups, start, w, nblocks, epi_for);
      case 6 | kSuperBits: return gemm_quant_int8_grouped<6 | kSuperBits>(a, k, groups, start, w, nblocks, epi_for);
      default: break;  // bf16 weights: a GEMM a group
    }
  }
#endif
  for (int64_t g = 0; g < groups; ++g)
    if (start[g + 1] > start[g]) gemm(a + start[g] * k, start[g + 1] - start[g], k, w[g], nblocks, ts, epi_for(g));
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

}  // namespace
