// CPU kernels: paged-attention decode and KV-cache writes, reading K/V in place through block tables,
// and the fused elementwise ops of a decoder layer (RMSNorm, rotary, gated activations).
//
// The torch path gathers every decode sequence's blocks into a dense copy per layer and then runs
// many tiny GEMMs; here each (sequence, kv head) task streams its blocks once for the scores and once
// for the values, so a decode step reads the KV cache once at memory speed. Built by
// kvserve/kernels/cpu.py with g++ -O3 -march=native -fopenmp and called through ctypes (the GIL is
// released for the call). OpenMP resolves to the libgomp torch has already loaded, so torch's thread
// pool and this one are the same threads.
//
// Layouts (row-major): query [tokens, q_heads, head_dim] with a token stride; caches
// [kv_heads, num_blocks, block_size, head_dim]; block_tables [seqs, table_stride] int64;
// context_lens [seqs] int64 (including the new token); out [seqs, q_heads, head_dim] contiguous.
#include "cpu_common.h"

#define KVSERVE_EXPORT(SUFFIX, T)                                                                                  \
  extern "C" void kvserve_decode_attention_##SUFFIX(                                                            \
      const void* query, int64_t query_token_stride, const void* key_cache, const void* value_cache,              \
      const int64_t* block_tables, int64_t table_stride, const int64_t* context_lens, void* out, int64_t num_seqs, \
      int64_t num_q_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,        \
      int64_t window, float scale) {                                                                             \
    decode_attention<T>({static_cast<const T*>(query), query_token_stride, static_cast<const T*>(key_cache),     \
                         static_cast<const T*>(value_cache), block_tables, table_stride, context_lens,           \
                         static_cast<T*>(out), num_seqs, num_q_heads, num_kv_heads, num_blocks, block_size,      \
                         head_dim, window, scale});                                                              \
  }                                                                                                              \
  extern "C" void kvserve_write_kv_##SUFFIX(const void* key, const void* value, int64_t key_token_stride,        \
                                            int64_t value_token_stride, void* key_cache, void* value_cache,      \
                                            const int64_t* slot_mapping, int64_t num_tokens,                     \
                                            int64_t num_kv_heads, int64_t num_slots, int64_t head_dim) {         \
    write_kv<T>(static_cast<const T*>(key), static_cast<const T*>(value), key_token_stride, value_token_stride,  \
                static_cast<T*>(key_cache), static_cast<T*>(value_cache), slot_mapping, num_tokens,              \
                num_kv_heads, num_slots, head_dim);                                                              \
  }

KVSERVE_EXPORT(f32, float)
KVSERVE_EXPORT(bf16, bf16)

#define KVSERVE_EXPORT_ELEMENTWISE(SUFFIX, T)                                                                    \
  extern "C" void kvserve_rms_norm_##SUFFIX(const void* x, int64_t a, int64_t b, int64_t sa, int64_t sb,         \
                                            int64_t dim, const void* weight, float eps, int64_t unit_offset,     \
                                            void* out) {                                                         \
    rms_norm<T>(static_cast<const T*>(x), a, b, sa, sb, dim, static_cast<const T*>(weight), eps, unit_offset != 0, \
                static_cast<T*>(out));                                                                           \
  }                                                                                                              \
  extern "C" void kvserve_add_rms_norm_##SUFFIX(const void* x, void* residual, int64_t rows, int64_t dim,        \
                                                const void* weight, float eps, int64_t unit_offset, void* out) { \
    add_rms_norm<T>(static_cast<const T*>(x), static_cast<T*>(residual), rows, dim, static_cast<const T*>(weight), \
                    eps, unit_offset != 0, static_cast<T*>(out));                                                \
  }                                                                                                              \
  extern "C" void kvserve_qk_rope_write_kv_##SUFFIX(                                                            \
      void* qkv, int64_t tokens, int64_t st, int64_t q_heads, int64_t kv_heads, int64_t dim,                    \
      const int64_t* positions, const float* cos_table, const float* sin_table, const void* q_norm,             \
      const void* k_norm, float norm_eps, int64_t norm_unit_offset, void* key_cache, void* value_cache,         \
      const int64_t* slot_mapping, int64_t num_slots) {                                                          \
    qk_rope_write_kv<T>({q_heads, kv_heads, dim, cos_table, sin_table, static_cast<const T*>(q_norm),          \
                         static_cast<const T*>(k_norm), norm_eps, norm_unit_offset != 0,                        \
                         static_cast<T*>(key_cache), static_cast<T*>(value_cache), num_slots},                   \
                        static_cast<T*>(qkv), tokens, st, positions, slot_mapping);                              \
  }                                                                                                              \
  extern "C" void kvserve_rotary_##SUFFIX(void* x, int64_t tokens, int64_t heads, int64_t st, int64_t dim,       \
                                          const int64_t* positions, const float* cos_table,                      \
                                          const float* sin_table) {                                              \
    rotary<T>(static_cast<T*>(x), tokens, heads, st, dim, positions, cos_table, sin_table);                     \
  }                                                                                                              \
  extern "C" void kvserve_gated_act_##SUFFIX(const void* gate_up, int64_t tokens, int64_t n, int64_t act,        \
                                             void* out) {                                                        \
    gated_act<T>(static_cast<const T*>(gate_up), tokens, n, static_cast<int>(act), static_cast<T*>(out));      \
  }

KVSERVE_EXPORT_ELEMENTWISE(f32, float)
KVSERVE_EXPORT_ELEMENTWISE(bf16, bf16)
