// A step's whole decoder stack in one native call, on AMX tiles: every layer's norms, QKV/O/gate-up/down
// projections, rotary, KV writes and paged attention, inside one OpenMP parallel region with a barrier
// between phases. Each token is a row: a decode, or a prefill token attending to its own prefix through
// its row of the block table (all of a step's K/V are written before any attention reads them), so
// decode, prefill and mixed steps run the same code.
//
// Why: on the 2-core CPU machines a decode step of 32 sequences is bound by reading the weights and the
// KV cache, yet driven from Python each of its ~300 small ops per step started cold (the previous
// op had streamed megabytes through the caches), so dispatch and oneDNN's per-call set-up cost about
// as much as the memory traffic. Here the projections are plain AMX tile loops over weights packed once
// at load time (one sequential stream per thread), and nothing returns to Python until the final norm.
//
// The pieces: the GEMMs (gemm.h: bf16 on AMX tiles or vector units, quantized weights per instruction set),
// prefill attention (attention_prefill.h), decode attention and the per-row norms, rotary and activations
// (cpu_common.h, shared with paged_attention_cpu.cpp). The C entry point: decoder_cpu.cpp.
#pragma once
#include "attention_prefill.h"
#include "cpu_common.h"
#include "gemm.h"
#include "lora_cpu.h"

#include <array>

#include <omp.h>

namespace {

// Epilogue of the gate/up GEMM (blocks alternate gate, up): out [m, n] = act(gate) * up (see gated16). With
// LoRA deltas (lora_cpu.h: [m, 2n] fp32, rows whose row_slot >= 0), a row's gate and up are first rounded to
// bf16 and its deltas added, as the per-op path adds them to the projection's bf16 output; `interleaved`:
// the deltas' columns alternate 16 gate and 16 up as the GEMM's blocks do, else all gates then all ups.
struct GatedTiles {
  bf16* out;
  int64_t n;
  int act;
  const float* delta = nullptr;
  const int32_t* row_slot = nullptr;
  bool interleaved = false;
  void operator()(int64_t r, int64_t nb0, bool, int i0, int i1, const float* c0, const float* c1) const {
    bf16* o = out + (r + i0) * n + (nb0 / 2) * 16;
    for (int i = i0; i < i1; ++i, o += n) {
      if (delta == nullptr || row_slot[r + i] < 0) {
        gated16(c0 + i * 16, c1 + i * 16, o, act);
        continue;
      }
      const float* d = delta + (r + i) * 2 * n;
      const float* dg = d + (interleaved ? nb0 * 16 : (nb0 / 2) * 16);
      const float* du = d + (interleaved ? (nb0 + 1) * 16 : n + (nb0 / 2) * 16);
      float g[16], u[16];
      for (int j = 0; j < 16; j += kLoraLanes) {
        lv_store(g + j, lv_round(lv_add(lv_round(lv_load(c0 + i * 16 + j)), lv_load(dg + j))));
        lv_store(u + j, lv_round(lv_add(lv_round(lv_load(c1 + i * 16 + j)), lv_load(du + j))));
      }
      gated16(g, u, o, act);
    }
  }
};

// Epilogue of the QKV GEMM with a bias (Qwen2): out [m, n] = the sums + bias, rounded to bf16 once, as a bf16
// linear with a bias rounds (the bias is added in fp32, row by row: a row's bits do not depend on the others).
struct BiasedTiles {
  bf16* out;
  int64_t n;
  const bf16* bias;  // [n]
  void operator()(int64_t r, int64_t nb0, bool two, int i0, int i1, const float* c0, const float* c1) const {
    float b[2][16], sum[16];
    for (int half = 0; half < (two ? 2 : 1); ++half)
      for (int j = 0; j < 16; ++j) b[half][j] = to_float(bias[(nb0 + half) * 16 + j]);
    for (int i = i0; i < i1; ++i)
      for (int half = 0; half < (two ? 2 : 1); ++half) {
        const float* c = (half ? c1 : c0) + i * 16;
        for (int j = 0; j < 16; ++j) sum[j] = c[j] + b[half][j];
        store_rounded16(sum, out + (r + i) * n + (nb0 + half) * 16);
      }
  }
};

// One decoder layer's weights and cache, by role (null: the model has no such norm). Llama:
// attn_in = input_layernorm, mlp_in = post_attention_layernorm. Gemma 3: attn_in = input_layernorm,
// attn_out = post_attention_layernorm, mlp_in = pre_feedforward_layernorm, mlp_out = post_feedforward_layernorm.
struct LayerParams {
  const bf16* attn_in_norm;
  const bf16* attn_out_norm;
  const bf16* mlp_in_norm;
  const bf16* mlp_out_norm;
  const bf16* q_norm;
  const bf16* k_norm;
  QWeight qkv;  // packed [(Hq + 2 Hkv) D, hidden]
  QWeight o;  // packed [hidden, Hq D]
  QWeight gate_up;  // packed [2 I, hidden], gate and up blocks alternating
  QWeight down;  // packed [hidden, I]
  bf16* key_cache;  // with ModelParams::kv_int8, uint8 rows: head_dim int8 values, an fp16 scale per 16 (kv_row_bytes)
  bf16* value_cache;
  const float* cos;
  const float* sin;
  int64_t window;  // 0: none
  float scale;
  int64_t kv_group;  // its KV group (engine/kv/groups.py): which [m] slots and [m, table_stride] tables it uses
  const bf16* qkv_bias;  // [(Hq + 2 Hkv) D] (Qwen2), or null
  // A mixture of experts (num_experts > 0), in place of gate_up and down: the router [E, hidden] in fp32 and
  // each expert's packed gate/up and down (arrays of E; models/moe.py).
  const float* router;
  const QWeight* expert_gate_up;
  const QWeight* expert_down;
  int64_t num_experts;
  // LoRA adapters' slots per projection (lora_cpu.h; a == nullptr: none attached).
  LoraModule lora_qkv, lora_o, lora_gate_up, lora_down;
};

// A token's router logits for experts [e0, e1): fp32 dot products of its row with the router's rows. (The
// step's (token, expert range) tasks share the router's reads across threads, whatever the token count.)
inline void router_logits(const bf16* x, int64_t hidden, const float* router, int64_t e0, int64_t e1, float* logits,
                          float* xf) {
  for (int64_t h = 0; h < hidden; ++h) xf[h] = to_float(x[h]);
  for (int64_t e = e0; e < e1; ++e) {
    const float* w = router + e * hidden;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t h = 0; h < hidden; ++h) dot += xf[h] * w[h];
    logits[e] = dot;
  }
}

// A token's experts (models/moe.route) from its logits (overwritten): their softmax, its top k (ties to the
// lower expert), renormalised over the k where `normalize`; written in ascending expert order, the order the
// token's weighted outputs are summed in.
inline void route_row(float* logits, int64_t experts, int64_t k, bool normalize, int32_t* ids, float* weights) {
  float top = -INFINITY;
  for (int64_t e = 0; e < experts; ++e) top = std::max(top, logits[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < experts; ++e) sum += (logits[e] = std::exp(logits[e] - top));
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)
      if (logits[e] >= 0.0f && (best < 0 || logits[e] > logits[best])) best = e;
    ids[j] = static_cast<int32_t>(best);
    weights[j] = logits[best] / sum;
    chosen += weights[j];
    logits[best] = -1.0f;  // taken
  }
  for (int64_t j = 0; j < k && normalize; ++j) weights[j] /= chosen;
  for (int64_t a = 1; a < k; ++a)  // ascending expert order (insertion sort of k <= a few)
    for (int64_t b = a; b > 0 && ids[b] < ids[b - 1]; --b) {
      std::swap(ids[b], ids[b - 1]);
      std::swap(weights[b], weights[b - 1]);
    }
}

struct ModelParams {
  int64_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate, num_blocks, block_size, act;
  float eps;
  int64_t norm_unit_offset;
  const bf16* final_norm;
  double* phase_seconds;  // null, or 9 accumulators: seconds per phase (see mark() below; bench/profile.py)
  int64_t kv_int8;  // the caches hold 8-bit rows (cpu_common.h, quantize_kv_row)
  int64_t invariant;  // batch-invariant numerics (gemm, gemm_quant_bits); tile chunks are then passed only where
                    // their rows attend as a row alone does (AVX2's row groups: NativeDecoder)
  int64_t int8_acts;  // quantized matrices multiply activations quantized to 8 bits (gemm_quant_int8)
  int64_t experts_per_token, expert_inter, norm_topk;  // a mixture of experts' (LayerParams::num_experts)
  int64_t max_loras;  // the LoRA slots (a row's slot is below it)
};

// The body of kvserve_forward_bf16 (decoder_cpu.cpp, which says what each argument holds).
inline int64_t decoder_forward(const ModelParams* mp, const LayerParams* layers, void* hidden_ptr, int64_t m,
                               const int64_t* positions, const int64_t* slot_mapping, const int64_t* block_tables,
                               int64_t table_stride, const int64_t* context_lens, const int64_t* tile_chunks,
                               int64_t num_tile_chunks, int64_t first_layer, void* state, const int32_t* stop,
                               const int64_t* shadow_blocks, int64_t num_shadow, const int64_t* shadow_tables,
                               const int32_t* lora_slots) {
  int64_t stopped_at = -1;
  if (!kTileAttention && !kWidenedAttention) num_tile_chunks = 0;  // every row attends alone (none are passed)
  const ModelParams& p = *mp;
  const int64_t hd = p.head_dim, hidden = p.hidden, inter = p.intermediate;
  const int64_t q_width = p.q_heads * hd, qkv_width = (p.q_heads + 2 * p.kv_heads) * hd;
  const bool unit = p.norm_unit_offset != 0;
  bf16* h = static_cast<bf16*>(hidden_ptr);
  std::vector<bf16> own_state(state == nullptr ? 2 * m * hidden : 0), x(m * hidden), qkv(m * qkv_width),
      attn(m * q_width), act(m * inter);
  // A mixture's buffers: each token's experts and weights, the step's rows grouped by expert (`order`: the
  // (token, choice) slot of each grouped row; `where`: the grouped row of each slot), and their activations.
  int64_t max_experts = 0;
  for (int64_t l = first_layer; l < p.num_layers; ++l) max_experts = std::max(max_experts, layers[l].num_experts);
  const int64_t top_k = max_experts > 0 ? p.experts_per_token : 0, routed = m * top_k, einter = p.expert_inter;
  std::vector<int32_t> route_ids(routed), order(routed), where(routed);
  std::vector<float> route_weights(routed), route_logits(m * max_experts);
  std::vector<int64_t> expert_start(max_experts + 1);
  std::vector<bf16> routed_x(routed * hidden), routed_act(routed * einter), routed_out(routed * hidden);
  // LoRA: the step's adapter rows by slot, x A^T per row, and the gate/up deltas (lora_cpu.h).
  LoraGroups lora;
  lora.build(lora_slots, m, p.max_loras);
  int64_t lora_cap = 0;
  for (int64_t l = first_layer; l < p.num_layers && lora.size() > 0; ++l)
    for (const LoraModule* mod : {&layers[l].lora_qkv, &layers[l].lora_o, &layers[l].lora_gate_up, &layers[l].lora_down})
      if (mod->a != nullptr) lora_cap = std::max(lora_cap, mod->capacity);
  std::vector<float> lora_t(lora_cap > 0 ? m * lora_cap : 0), lora_gate_up(lora_cap > 0 ? m * 2 * inter : 0);
  bf16* const residual = state == nullptr ? own_state.data() : static_cast<bf16*>(state);  // the stream
  bf16* const branch = residual + m * hidden;  // the last attention or MLP output
  if (state == nullptr) stop = nullptr;
  // The step's attention work: packing tasks (chunk, kv head, key segment), tile tasks (chunk, kv head,
  // 16 query rows), then one task per (row attending alone, kv head).
  const TileChunk* chunks = reinterpret_cast<const TileChunk*>(tile_chunks);
  std::vector<int64_t> packed_offsets(num_tile_chunks + 1, 0), untiled;
  std::vector<bool> tiled(m, false);
  std::vector<std::array<int64_t, 3>> pack_tasks, tile_tasks;
  // Under the batch-invariant numerics chunks attend in row groups (their rows' decode bits), else on this
  // build's shared pass: packed-key tiles with bf16 arithmetic, row groups on AVX2.
  const bool grouped = !kTileAttention || p.invariant != 0;
#if defined(__AVX512BF16__)  // tile attention (kTileAttention)
  for (int64_t c = 0; c < num_tile_chunks && !grouped; ++c) {
    const int64_t end = TileAttention::end(positions, chunks[c]);
    packed_offsets[c + 1] = packed_offsets[c] + TileAttention::packed_size(end, p.kv_heads, hd);
    for (int64_t kh = 0; kh < p.kv_heads; ++kh) {
      for (int64_t seg = 0; seg * kPackKeys < end; ++seg) pack_tasks.push_back({c, kh, seg});
      for (int64_t t = 0; t * 16 < chunks[c].rows; ++t) tile_tasks.push_back({c, kh, t});
    }
    std::fill(tiled.begin() + chunks[c].row0, tiled.begin() + chunks[c].row0 + chunks[c].rows, true);
  }
#endif
  if (grouped && RowGroups::serves(hd)) {  // else every row attends alone
    const int64_t per_task = RowGroups::rows_per_task(p.q_heads, p.kv_heads);
    for (int64_t c = 0; c < num_tile_chunks; ++c) {
      for (int64_t kh = 0; kh < p.kv_heads; ++kh)
        for (int64_t t = 0; t * per_task < chunks[c].rows; ++t) tile_tasks.push_back({c, kh, t});
      std::fill(tiled.begin() + chunks[c].row0, tiled.begin() + chunks[c].row0 + chunks[c].rows, true);
    }
  }
  for (int64_t i = 0; i < m; ++i)
    if (!tiled[i]) untiled.push_back(i);
  std::vector<bf16> packed(packed_offsets[num_tile_chunks]);
  // An 8-bit cache: rows attending alone dequantize their own keys and values (DecodeBatch); the blocks
  // the tiled chunks read (shadow_blocks, which their rows of shadow_tables index) are dequantized into a
  // bf16 copy once a layer, after the step's own rows are written, and packed or grouped from there.
  const bool kv_int8 = p.kv_int8 != 0;
  const int64_t shadow_head = kv_int8 ? num_shadow * p.block_size * hd : 0;
  static thread_local std::vector<bf16> shadow_keys, shadow_values;
  if (kv_int8 && static_cast<int64_t>(shadow_keys.size()) < p.kv_heads * shadow_head) {
    shadow_keys.resize(p.kv_heads * shadow_head);
    shadow_values.resize(p.kv_heads * shadow_head);
  }
  bf16* const shadow_k = shadow_keys.data();
  bf16* const shadow_v = shadow_values.data();
  const int64_t num_tile_tasks = static_cast<int64_t>(tile_tasks.size());
  const int64_t num_attention_tasks = num_tile_tasks + static_cast<int64_t>(untiled.size()) * p.kv_heads;
#pragma omp parallel
  {
    TileState ts;
    ts.invariant = p.invariant != 0;
    ts.int8_acts = p.int8_acts != 0;
    std::vector<float> scores;
    std::vector<bf16> probs;
    Scratch scratch;
    std::vector<float> row_f32(max_experts > 0 ? hidden : 0), lora_x;
    // Profiling: the master adds each phase's wall time as it leaves the phase's closing barrier.
    const bool clock = p.phase_seconds != nullptr && omp_get_thread_num() == 0;
    double last = clock ? omp_get_wtime() : 0.0;
    auto mark = [&](int phase) {
      if (!clock) return;
      const double now = omp_get_wtime();
      p.phase_seconds[phase] += now - last;
      last = now;
    };
    // Gemma's post-norms of a branch, in place (a worksharing loop of this parallel region; none for Llama).
    auto norm_branch = [&](const bf16* weight) {
      if (weight == nullptr) return;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i) {
        bf16* b = branch + i * hidden;
        norm_row(static_cast<const bf16*>(b), b, hidden, weight, p.eps, unit);
      }
    };
    // residual += branch, out = RMSNorm(residual), row by row.
    auto add_branch_and_norm = [&](bf16* out, const bf16* weight) {
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i)
        add_norm_row(branch + i * hidden, residual + i * hidden, out + i * hidden, hidden, weight,
                     p.eps, unit);
    };
    for (int64_t l = first_layer; l < p.num_layers; ++l) {
      if (stopped_at >= 0) break;  // the flag, seen during the previous layer (at least one layer per call)
      const LayerParams& L = layers[l];
      if (l == 0) {  // the stream starts as the embeddings
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < m; ++i) {
          std::memcpy(residual + i * hidden, h + i * hidden, hidden * sizeof(bf16));
          norm_row(static_cast<const bf16*>(residual + i * hidden), x.data() + i * hidden, hidden,
                   L.attn_in_norm, p.eps, unit);
        }
      } else {
        add_branch_and_norm(x.data(), L.attn_in_norm);
      }
      mark(0);
        // LoRA (lora_cpu.h): each adapted projection's shrink runs beside its GEMM (no barrier between them), the
      // expand adds the deltas once the GEMM's barrier has passed; gate/up's deltas come before its GEMM, whose
      // epilogue adds them ahead of the activation.
      lora_shrink(L.lora_qkv, lora, x.data(), hidden, lora_t.data(), lora_x);
      if (L.qkv_bias != nullptr)
        gemm(x.data(), m, hidden, L.qkv, qkv_width / 16, ts, BiasedTiles{qkv.data(), qkv_width, L.qkv_bias});
      else
        gemm(x.data(), m, hidden, L.qkv, qkv_width / 16, ts, StoreTiles<bf16>{qkv.data(), qkv_width});
      lora_expand(L.lora_qkv, lora, qkv_width, lora_t.data(), LoraAddInto{qkv.data(), qkv_width});
      mark(1);
      const QkvStep<bf16> step{p.q_heads, p.kv_heads, hd, L.cos, L.sin, L.q_norm, L.k_norm, p.eps, unit,
                               L.key_cache, L.value_cache, p.num_blocks * p.block_size, kv_int8};
      const int64_t* const slots = slot_mapping + L.kv_group * m;
      const int64_t* const tables = block_tables + L.kv_group * m * table_stride;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i) step.token(qkv.data() + i * qkv_width, positions[i], slots[i]);
      bf16* keys = L.key_cache;
      bf16* values = L.value_cache;
      const int64_t* chunk_tables = tables;
      int64_t blocks = p.num_blocks;
      if (kv_int8 && num_shadow > 0) {
        const int64_t row = kv_row_bytes(hd), head_bytes = p.num_blocks * p.block_size * row;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < p.kv_heads * num_shadow; ++task) {
          const int64_t head = task / num_shadow, b = task % num_shadow;
          const int64_t from = head * head_bytes + shadow_blocks[b] * p.block_size * row;
          const int64_t to = head * shadow_head + b * p.block_size * hd;
          dequantize_kv_rows(reinterpret_cast<const uint8_t*>(L.key_cache) + from, p.block_size, hd, shadow_k + to);
          dequantize_kv_rows(reinterpret_cast<const uint8_t*>(L.value_cache) + from, p.block_size, hd, shadow_v + to);
        }
        keys = shadow_k, values = shadow_v, chunk_tables = shadow_tables + L.kv_group * m * table_stride;
        blocks = num_shadow;
      }
      mark(2);
      const DecodeBatch<bf16> batch{qkv.data(), qkv_width, L.key_cache, L.value_cache, tables, table_stride,
                                    context_lens, attn.data(), m, p.q_heads, p.kv_heads, p.num_blocks,
                                    p.block_size, hd, L.window, L.scale, kv_int8};
      const PrefillChunks prefill{qkv.data(), qkv_width, positions, chunk_tables, table_stride, chunks, keys,
                                  values, p.q_heads, p.kv_heads, hd, p.block_size,
                                  blocks * p.block_size * hd, L.window, L.scale, attn.data()};
#if defined(__AVX512BF16__)  // tile attention (kTileAttention)
      const TileAttention tiles{prefill, packed_offsets.data(), packed.data()};
      if (!pack_tasks.empty()) {
#pragma omp for schedule(dynamic, 1)
        for (size_t task = 0; task < pack_tasks.size(); ++task)
          tiles.pack(pack_tasks[task][0], pack_tasks[task][1], pack_tasks[task][2]);
      }
#endif
      const RowGroups groups{prefill};
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < num_attention_tasks; ++task) {
        if (task < num_tile_tasks) {
#if defined(__AVX512BF16__)  // tile attention (kTileAttention)
          if (!grouped) {
            tiles.run(tile_tasks[task][0], tile_tasks[task][1], tile_tasks[task][2], ts, scores, probs);
            continue;
          }
#endif
          groups.run(tile_tasks[task][0], tile_tasks[task][1], tile_tasks[task][2], scores, scratch);
        } else {
          const int64_t k = task - num_tile_tasks;
          batch.run(untiled[k / p.kv_heads] * p.kv_heads + k % p.kv_heads, scores, scratch);
        }
      }
      mark(3);
      lora_shrink(L.lora_o, lora, attn.data(), q_width, lora_t.data(), lora_x);
      gemm(attn.data(), m, q_width, L.o, hidden / 16, ts, StoreTiles<bf16>{branch, hidden});
      lora_expand(L.lora_o, lora, hidden, lora_t.data(), LoraAddInto{branch, hidden});
      norm_branch(L.attn_out_norm);
      mark(4);
      add_branch_and_norm(x.data(), L.mlp_in_norm);
      mark(5);
      // The master reads the flag before the layer's last GEMMs; their closing barrier publishes
      // stopped_at to every thread before the next layer's top (no barrier of its own).
      auto read_stop = [&] {
        if (stop != nullptr && l + 1 < p.num_layers && omp_get_thread_num() == 0 &&
            __atomic_load_n(stop, __ATOMIC_ACQUIRE) != 0)
          stopped_at = l + 1;
      };
      if (L.num_experts == 0) {
        const bool adapted = L.lora_gate_up.a != nullptr && lora.size() > 0;
        if (adapted) {  // (the zeroing loop's barrier orders the shrink before the expand)
          lora_shrink(L.lora_gate_up, lora, x.data(), hidden, lora_t.data(), lora_x);
          lora_zero_rows(lora, lora_gate_up.data(), 2 * inter);
          lora_expand(L.lora_gate_up, lora, 2 * inter, lora_t.data(), LoraKeep{lora_gate_up.data(), 2 * inter});
        }
        gemm(x.data(), m, hidden, L.gate_up, 2 * inter / 16, ts,
             GatedTiles{act.data(), inter, static_cast<int>(p.act), adapted ? lora_gate_up.data() : nullptr,
                        lora_slots, L.lora_gate_up.interleaved != 0});
        mark(6);
        read_stop();
        lora_shrink(L.lora_down, lora, act.data(), inter, lora_t.data(), lora_x);
        gemm(act.data(), m, inter, L.down, hidden / 16, ts, StoreTiles<bf16>{branch, hidden});
        lora_expand(L.lora_down, lora, hidden, lora_t.data(), LoraAddInto{branch, hidden});
      } else {
        // Route each token, group the step's (token, choice) slots by expert (tokens in order within an
        // expert), then run each chosen expert once over its rows: a step reads only the experts it chose.
        const int64_t E = L.num_experts, per_task = 16, tasks = (E + per_task - 1) / per_task;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < m * tasks; ++t) {
          const int64_t i = t / tasks, e0 = (t % tasks) * per_task;
          router_logits(x.data() + i * hidden, hidden, L.router, e0, std::min(E, e0 + per_task),
                        route_logits.data() + i * E, row_f32.data());
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < m; ++i)
          route_row(route_logits.data() + i * E, E, top_k, p.norm_topk != 0, route_ids.data() + i * top_k,
                    route_weights.data() + i * top_k);
#pragma omp single
        {
          std::fill(expert_start.begin(), expert_start.begin() + E + 1, 0);
          for (int64_t s = 0; s < routed; ++s) ++expert_start[route_ids[s] + 1];
          for (int64_t e = 0; e < E; ++e) expert_start[e + 1] += expert_start[e];
          std::vector<int64_t> fill(expert_start.begin(), expert_start.begin() + E);
          for (int64_t s = 0; s < routed; ++s) {
            const int64_t g = fill[route_ids[s]]++;
            order[g] = static_cast<int32_t>(s);
            where[s] = static_cast<int32_t>(g);
          }
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < routed; ++g)
          std::memcpy(routed_x.data() + g * hidden, x.data() + (order[g] / top_k) * hidden, hidden * sizeof(bf16));
        const int64_t* const starts = expert_start.data();
        gemm_grouped(routed_x.data(), hidden, E, starts, L.expert_gate_up, 2 * einter / 16, ts, [&](int64_t e) {
          return GatedTiles{routed_act.data() + starts[e] * einter, einter, static_cast<int>(p.act)};
        });
        mark(6);
        read_stop();
        gemm_grouped(routed_act.data(), einter, E, starts, L.expert_down, hidden / 16, ts, [&](int64_t e) {
          return StoreTiles<bf16>{routed_out.data() + starts[e] * hidden, hidden};
        });
        // Each token's weighted expert outputs, summed in fp32 in ascending expert order, rounded once.
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < m; ++i) {
          float* acc = row_f32.data();
          std::fill(acc, acc + hidden, 0.0f);
          for (int64_t j = 0; j < top_k; ++j) {
            const float w = route_weights[i * top_k + j];
            const bf16* y = routed_out.data() + where[i * top_k + j] * hidden;
            for (int64_t h = 0; h < hidden; ++h) acc[h] += to_float(y[h]) * w;
          }
          for (int64_t h = 0; h < hidden; h += 16) store_rounded16(acc + h, branch + i * hidden + h);
        }
      }
      norm_branch(L.mlp_out_norm);
      mark(7);
    }
    if (stopped_at < 0) {
      add_branch_and_norm(h, p.final_norm);
      mark(8);
    }
  }
  return stopped_at >= 0 ? stopped_at : mp->num_layers;
}

}  // namespace
