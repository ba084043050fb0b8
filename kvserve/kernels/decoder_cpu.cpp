// The fused decoder's C entry points, which kvserve/kernels/cpu.py binds through ctypes: what this build
// compiled in and may use, weight packing (bf16 and quantized), the packed GEMM on its own (the LM head and
// the per-op path), the 8-bit KV rows, and a step's whole decoder stack (decoder_step.h). Compiled into one
// library with paged_attention_cpu.cpp; the headers beside this file hold the kernels:
//   cpu_common.h         bf16 helpers, decode attention, norms, rotary, activations (shared with the per-op kernels)
//   gemm_amx.h           the bf16 GEMM on AMX tiles
//   gemm_vector.h        the bf16 GEMM on vector units (AVX-512 BF16, AVX2)
//   gemm_bf16.h          the packed bf16 layout and the bf16 GEMM's dispatch
//   gemm_quant_layout.h  the quantized weights' layout
//   gemm_quant_avx512.h  the quantized GEMM with AVX-512 BF16 (and AMX)
//   gemm_quant_avx2.h    the quantized GEMM with AVX2 (integer products)
//   gemm.h               the GEMM on a weight of any kind, and its store epilogue
//   attention_prefill.h  prefill chunks attending together (tiles, row groups)
//   lora_cpu.h           LoRA adapters' deltas, rows grouped by adapter
//   decoder_step.h       the decoder stack: layers, phases, barriers
#include "cpu_common.h"
#include "decoder_step.h"
#include "gemm.h"

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
#if defined(__AVX512VNNI__)
  bits |= 16;
#endif
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

// 1: weights are packed in the tile layout (gemm_bf16.h); 0: k-major ([N/16][K][16], the AVX2 GEMM's).
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
// two a byte, [n, k / 2] (element 2j in the low nibble of byte j). 6 bits (pair layout builds): q int8
// -32..31 [n, k], scales per (row, 16 columns), no minimums.
extern "C" void kvserve_pack_quant(const void* values, const void* scales, const void* minimums, int64_t n, int64_t k,
                                   int64_t bits, void* packed) {
  const uint8_t* q = static_cast<const uint8_t*>(values);
  const uint16_t* s = static_cast<const uint16_t*>(scales);
  const uint16_t* mn = static_cast<const uint16_t*>(minimums);
  uint8_t* out = static_cast<uint8_t*>(packed);
  const int64_t chunks = k / 32, cb = quant_chunk_bytes(bits), vb = quant_values_bytes(bits);
  auto value = [&](int64_t row, int64_t col) -> uint8_t {
    if (bits == 8) return q[row * k + col];
    if (bits == 6) return static_cast<uint8_t>(static_cast<int8_t>(q[row * k + col]) + 32);
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
          const QuantPlace place = quant_place(col, kk, bits == 6 ? 4 : bits);
          t[place.byte] |= static_cast<uint8_t>(place.high ? (v & 0x0F) << 4 : v & (bits == 8 ? 0xFF : 0x0F));
          if (bits == 6) {
            const int64_t e = pair_element(col, kk);
            t[six_bit_byte(e)] |= static_cast<uint8_t>((v >> 4) << six_bit_shift(e));
          }
        }
      uint16_t* tail = reinterpret_cast<uint16_t*>(t + vb);
      if (bits == 6) {  // two scales a column: k 0-15, then 16-31
        for (int col = 0; col < 16; ++col)
          for (int half = 0; half < 2; ++half) tail[half * 16 + col] = s[(nb * 16 + col) * 2 * chunks + 2 * c + half];
        continue;
      }
      for (int col = 0; col < 16; ++col) {
        tail[quant_tail_slot(col)] = s[(nb * 16 + col) * chunks + c];
        tail[16 + quant_tail_slot(col)] = mn[(nb * 16 + col) * chunks + c];
      }
    }
}

// A weight [n, k] (n % 16 == 0, k % 256 == 0) in a K-quant form (bits 20: Q4_K's, 22: Q6_K's; see QWeight) ->
// this build's layout. values as kvserve_pack_quant's at 4 or 6 bits; subs: the sub-block factors, uint8 sc
// [n, k / 32] (20) or int8 sc [n, k / 16] (22); mins: uint8 m [n, k / 32] (20; else unused); heads: fp16
// [n, k / 256, 2], each super-block's d and -dmin (22: d and a value unused).
extern "C" void kvserve_pack_quant_super(const void* values, const void* subs, const void* mins, const void* heads,
                                         int64_t n, int64_t k, int64_t bits, void* packed) {
  const int64_t vbits = value_bits(bits), chunks = k / 32, cb = quant_chunk_bytes(bits), vb = quant_values_bytes(bits);
  const int64_t block_bytes = quant_block_bytes(bits, chunks), hb = super_head_bytes(bits);
  const uint8_t* sub = static_cast<const uint8_t*>(subs);
  const uint8_t* mn = static_cast<const uint8_t*>(mins);
  const uint16_t* hd = static_cast<const uint16_t*>(heads);
  uint8_t* out = static_cast<uint8_t*>(packed);
  // the values as the plain form packs them, one chunk of one column block at a time
  std::vector<uint8_t> plain(n / 16 * chunks * quant_chunk_bytes(vbits));
  std::vector<uint16_t> no_scales(n * k / 16, 0);
  kvserve_pack_quant(values, no_scales.data(), no_scales.data(), n, k, vbits, plain.data());
  const int64_t pcb = quant_chunk_bytes(vbits);
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < n / 16; ++nb)
    for (int64_t c = 0; c < chunks; ++c) {
      uint8_t* block = out + nb * block_bytes;
      if (c % kSuperChunks == 0) {
        uint16_t* head = reinterpret_cast<uint16_t*>(block + c / kSuperChunks * super_stride(bits));
        for (int col = 0; col < 16; ++col)
          for (int64_t h = 0; h < hb / 32; ++h) head[h * 16 + col] = hd[((nb * 16 + col) * (k / 256) + c / 8) * 2 + h];
      }
      uint8_t* t = block + quant_chunk_offset(bits, c);
      std::memcpy(t, plain.data() + (nb * chunks + c) * pcb, vb);
      uint8_t* tail = t + vb;
      for (int col = 0; col < 16; ++col) {
        const int64_t row = nb * 16 + col;
        if (vbits == 6) {  // k 0-15's scale, then 16-31's
          tail[col] = sub[row * 2 * chunks + 2 * c];
          tail[16 + col] = sub[row * 2 * chunks + 2 * c + 1];
        } else {
          tail[col] = sub[row * chunks + c];
          tail[16 + col] = mn[row * chunks + c];
        }
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
  const int64_t chunks = k / 32, vb = quant_values_bytes(bits), block_bytes = quant_block_bytes(bits, chunks);
  const int64_t vbits = value_bits(bits);
  const bool six = vbits == 6;
#pragma omp parallel for schedule(static) if (count * k > (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = std::min(std::max<int64_t>(ids[i], 0), n - 1);  // the caller checks the range
    const int col = static_cast<int>(id % 16);
    const int slot = quant_tail_slot(col);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* block = p + (id / 16) * block_bytes;
      const uint8_t* t = block + quant_chunk_offset(bits, c);
      // 6 bits: the scales of k 0-15 and 16-31, no minimum; else one scale and a minimum.
      float s0, s1, m;
      if (is_super(bits)) {  // the head's factors times the tail's integers, in fp32 (exact)
        const uint16_t* head = reinterpret_cast<const uint16_t*>(super_head(block, bits, c));
        const float d = half_to_float(head[col]);
        if (six) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(t + vb);
          s0 = d * sc[col], s1 = d * sc[16 + col], m = 0.0f;
        } else {
          s0 = s1 = d * t[vb + col];
          m = half_to_float(head[16 + col]) * t[vb + 16 + col];
        }
      } else {
        const uint16_t* tail = reinterpret_cast<const uint16_t*>(t + vb);
        s0 = half_to_float(tail[slot]), s1 = six ? half_to_float(tail[16 + slot]) : s0;
        m = six ? 0.0f : half_to_float(tail[16 + slot]);
      }
      for (int kk = 0; kk < 32; ++kk) {
        const QuantPlace place = quant_place(col, kk, six ? 4 : vbits);
        const uint8_t byte = t[place.byte];
        int q = vbits == 8 ? static_cast<int8_t>(byte) : place.high ? byte >> 4 : byte & 0x0F;
        if (six) {
          const int64_t e = pair_element(col, kk);
          q = (q | ((t[six_bit_byte(e)] >> six_bit_shift(e)) & 3) << 4) - 32;
        }
        store((kk < 16 ? s0 : s1) * static_cast<float>(q) + m, o + i * k + c * 32 + kk);
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
  return n / 16 * quant_block_bytes(bits, k / 32);
}

// out [m, n] = x [m, k] bf16 times W^T, W packed by kvserve_pack_quant (bits 4 or 8) or
// kvserve_pack_weight_bf16 (bits 0): bf16, or (out_f32) fp32 holding each value rounded to bf16 as torch's
// bf16 linear rounds it (the LM head, whose logits the sampler reads in fp32).
extern "C" void kvserve_linear_quant(const void* x, int64_t m, int64_t k, const void* packed, int64_t bits, int64_t n,
                                     void* out, int64_t out_f32, int64_t invariant, int64_t int8_acts) {
#pragma omp parallel
  {
    TileState ts;
    ts.invariant = invariant != 0;
    ts.int8_acts = int8_acts != 0;
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
//
// lora_slots [m] int32 (or null: no adapter in the step): each row's LoRA slot, -1 for the base model; the
// layers' LoraModule fields hold the slots' weights (lora_cpu.h).
extern "C" int64_t kvserve_forward_bf16(const ModelParams* mp, const LayerParams* layers, void* hidden_ptr,
                                        int64_t m, const int64_t* positions, const int64_t* slot_mapping,
                                        const int64_t* block_tables, int64_t table_stride,
                                        const int64_t* context_lens, const int64_t* tile_chunks,
                                        int64_t num_tile_chunks, int64_t first_layer, void* state,
                                        const int32_t* stop, const int64_t* shadow_blocks, int64_t num_shadow,
                                        const int64_t* shadow_tables, const int32_t* lora_slots) {
  return decoder_forward(mp, layers, hidden_ptr, m, positions, slot_mapping, block_tables, table_stride, context_lens,
                         tile_chunks, num_tile_chunks, first_layer, state, stop, shadow_blocks, num_shadow,
                         shadow_tables, lora_slots);
}
