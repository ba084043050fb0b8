// Quantized weights (4 and 8 bits, a scale and a minimum per 32 inputs): the layout this build packs them in,
// shared by the GEMM of each instruction set (gemm_quant_avx512.h, gemm_quant_avx2.h) and the packing and
// row-lookup entry points (decoder_cpu.cpp).
#pragma once
#include "gemm_bf16.h"

namespace {

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
// 6 bits (AVX-512 BF16 and AMX builds; only 8-bit activations multiply them, gemm_quant_int8): Q6_K's
// 16-value sub-blocks, w = s * q with q in -32..31 stored as q + 32: the int4 layout's 256 bytes of low
// nibbles, then 128 bytes of the top two bits (element e's in bits 2 (e / 128) of byte e % 128), then the
// 16 columns' fp16 scales of k 0-15 and those of k 16-31 (no minimums).
// The K-quant forms (bits | kSuperBits: 20 for Q4_K, 22 for Q6_K; pair layout builds, 8-bit activations only)
// hold a file's factors as it does, so a decode reads the file's bytes: per super-block of 256 k (8 chunks) a
// head of the 16 columns' fp16 factors (4 bits: d, then -dmin; 6 bits: d), then its 8 chunks, each the
// values (as the 4- or 6-bit form above) and a 32-byte tail of integer sub-block factors, w = d * sc * q +
// (-dmin) * m: 4 bits, 16 uint8 sc then 16 uint8 m (Q4_K's 6-bit ones); 6 bits, the 16 int8 sc of k 0-15,
// then those of k 16-31 (Q6_K's). K must be a multiple of 256.
struct QWeight {
  const void* data;
  int64_t bits;  // 0: bf16 in pack_weight's layout; 4, 6 or 8: the layout above; 20 or 22: a K-quant form
  const void* tail;  // null, or the column blocks from `tail_from` on, in another kind (QKV: V in 8 bits)
  int64_t tail_bits;
  int64_t tail_from;
};
constexpr int64_t kSuperBits = 16;  // the flag of the K-quant forms
constexpr int64_t kSuperChunks = 8;  // chunks a super-block
inline constexpr bool is_super(int64_t bits) { return (bits & kSuperBits) != 0; }
inline constexpr int64_t value_bits(int64_t bits) { return bits & ~kSuperBits; }  // 4, 6 or 8
// A chunk's tail: 16 fp16 scales, then 16 fp16 minimums (6 bits: 16 more scales); a K-quant form's: 32 bytes
// of integer factors.
inline int64_t quant_tail_bytes(int64_t bits) { return is_super(bits) ? 32 : 64; }
inline int64_t quant_values_bytes(int64_t bits) {
  return value_bits(bits) == 8 ? 512 : value_bits(bits) == 6 ? 384 : 256;
}
// Where element e's top two bits sit in a 6-bit chunk: byte, and the shift.
inline int64_t six_bit_byte(int64_t e) { return 256 + e % 128; }
inline int six_bit_shift(int64_t e) { return static_cast<int>(2 * (e / 128)); }
inline int64_t quant_chunk_bytes(int64_t bits) { return quant_values_bytes(bits) + quant_tail_bytes(bits); }
// A K-quant form's head: the 16 columns' fp16 d, and with 4 bits their -dmin.
inline int64_t super_head_bytes(int64_t bits) { return value_bits(bits) == 4 ? 64 : 32; }
inline int64_t super_stride(int64_t bits) { return super_head_bytes(bits) + kSuperChunks * quant_chunk_bytes(bits); }
// Where chunk `ch` of a column block starts, and a column block's bytes.
inline int64_t quant_chunk_offset(int64_t bits, int64_t ch) {
  if (!is_super(bits)) return ch * quant_chunk_bytes(bits);
  return ch / kSuperChunks * super_stride(bits) + super_head_bytes(bits) + ch % kSuperChunks * quant_chunk_bytes(bits);
}
inline int64_t quant_block_bytes(int64_t bits, int64_t chunks) {
  return is_super(bits) ? chunks / kSuperChunks * super_stride(bits) : chunks * quant_chunk_bytes(bits);
}
// The head of the super-block that holds chunk `ch` of the column block at `block`.
inline const uint8_t* super_head(const uint8_t* block, int64_t bits, int64_t ch) {
  return block + ch / kSuperChunks * super_stride(bits);
}
// Where a chunk's value for (column, k) sits: byte, and the high nibble (int4); and where column c's scale
// and minimum sit among the tail's 16.
struct QuantPlace {
  int64_t byte;
  bool high;
};
// The AVX2 integer sums of a half come out in this column order (VPHADDD of two 4-column pair sums).
constexpr int kSumOrder[8] = {0, 1, 4, 5, 2, 3, 6, 7};
// Element index of (column, k) in the pair layout's order.
inline int64_t pair_element(int col, int kk) { return (kk / 2 * 16 + col) * 2 + kk % 2; }
inline QuantPlace quant_place(int col, int kk, int64_t bits) {
  if (kPairLayout) {
    const int64_t e = pair_element(col, kk);
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

// Inside the parallel region: a value one thread makes and every thread gets (scratch the GEMM's threads
// share, sized once per call: OpenMP's single, whose copyprivate hands it out at the closing barrier).
template <typename T, typename Make>
T made_by_one_thread(Make make) {
  T out{};
#pragma omp single copyprivate(out)
  out = make();
  return out;
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

}  // namespace
