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
// Weight layout (pack_weight): W [N, K] (torch's Linear layout, out = x W^T) as [N/16][K/32][16][16][2]:
// one 1 KiB tile per (16 output columns, 32 inputs) in the VNNI pair order TDPBF16PS reads. The fused
// gate/up weight is packed with gate and up blocks alternating, so one thread holds both halves of
// 16 columns and applies the activation in the GEMM's epilogue.
#include "cpu_common.h"

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kCompiledWithAmx = true;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-3 accumulators (row block r, column block c at 2r + c), 4-5 A row blocks, 6-7 B column blocks.
// The config depends only on the rows of the two row blocks; reloaded when they change.
struct TileState {
  int rows0 = -1, rows1 = -1;
  void ensure(int r0, int r1) {
    if (r0 == rows0 && r1 == rows1) return;
    TileConfig cfg{};
    cfg.palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int i = 0; i < 8; ++i) {
      cfg.rows[i] = static_cast<uint8_t>(rows[i]);
      cfg.colsb[i] = rows[i] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
    rows0 = r0;
    rows1 = r1;
  }
  ~TileState() {
    if (rows0 >= 0) _tile_release();
  }
};

// C [m, 16 * nblocks] = A [m, k] (row stride k) x W^T, W packed; inside a parallel region: the threads
// take pairs of column blocks dynamically (omp for, with its barrier), so a thread that loses its core
// to the HTTP server for a while does not hold the other at the barrier. epi(row0, block0, two, rows,
// c0, c1) gets each finished [rows, 16] fp32 tile pair (c1 valid when `two`).
template <typename Epilogue>
void gemm(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t nblocks, TileState& ts, Epilogue&& epi) {
  const int64_t chunks = k / 32, tile = 16 * 32;  // bf16 elements per packed tile
  alignas(64) float c0[32 * 16], c1[32 * 16];
#pragma omp for schedule(dynamic, 1)
  for (int64_t pair = 0; pair < (nblocks + 1) / 2; ++pair) {
    const int64_t nb0 = 2 * pair;
    const bool two = nb0 + 1 < nblocks;
    const bf16* b0 = w + nb0 * chunks * tile;
    const bf16* b1 = b0 + chunks * tile;
    for (int64_t r = 0; r < m; r += 32) {
      const int rows0 = static_cast<int>(std::min<int64_t>(16, m - r));
      const int rows1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, m - r - 16)));
      ts.ensure(rows0, rows1);
      _tile_zero(0);  // tiles of an empty second row block are unconfigured: touching them faults
      _tile_zero(1);
      if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
      }
      const bf16* a0 = a + r * k;
      const bf16* a1 = a0 + 16 * k;
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, a0 + c * 32, k * 2);
        _tile_loadd(6, b0 + c * tile, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (rows1) {
          _tile_loadd(5, a1 + c * 32, k * 2);
          _tile_dpbf16ps(2, 5, 6);
        }
        if (two) {
          _tile_loadd(7, b1 + c * tile, 64);
          _tile_dpbf16ps(1, 4, 7);
          if (rows1) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c0, 64);
      if (rows1) _tile_stored(2, c0 + 16 * 16, 64);
      if (two) {
        _tile_stored(1, c1, 64);
        if (rows1) _tile_stored(3, c1 + 16 * 16, 64);
      }
      epi(r, nb0, two, rows0 + rows1, c0, c1);
    }
  }
}

// Epilogue: round into out [m, n] bf16.
struct StoreTiles {
  bf16* out;
  int64_t n;
  void operator()(int64_t r, int64_t nb0, bool two, int rows, const float* c0, const float* c1) const {
    for (int i = 0; i < rows; ++i) {
      store16(_mm512_load_ps(c0 + i * 16), out + (r + i) * n + nb0 * 16);
      if (two) store16(_mm512_load_ps(c1 + i * 16), out + (r + i) * n + (nb0 + 1) * 16);
    }
  }
};

// Epilogue of the gate/up GEMM (blocks alternate gate, up): out [m, n] = act(gate) * up, rounded as the
// unfused path rounds it (gate and up to bf16, act(gate) to bf16, then the product).
struct GatedTiles {
  bf16* out;
  int64_t n;
  int act;
  void operator()(int64_t r, int64_t nb0, bool, int rows, const float* c0, const float* c1) const {
    bf16* o = out + r * n + (nb0 / 2) * 16;
    for (int i = 0; i < rows; ++i, o += n) {
      const __m512 g = round16(_mm512_load_ps(c0 + i * 16), o), u = round16(_mm512_load_ps(c1 + i * 16), o);
      store16(_mm512_mul_ps(round16(activation16(g, act), o), u), o);
    }
  }
};
#else
constexpr bool kCompiledWithAmx = false;
#endif

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
  const bf16* qkv;  // packed [(Hq + 2 Hkv) D, hidden]
  const bf16* o;  // packed [hidden, Hq D]
  const bf16* gate_up;  // packed [2 I, hidden], gate and up blocks alternating
  const bf16* down;  // packed [hidden, I]
  bf16* key_cache;
  bf16* value_cache;
  const float* cos;
  const float* sin;
  int64_t window;  // 0: none
  float scale;
};

struct ModelParams {
  int64_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate, num_blocks, block_size, act;
  float eps;
  int64_t norm_unit_offset;
  const bf16* final_norm;
  double* phase_seconds;  // null, or 9 accumulators: seconds per phase (see mark() below; bench/profile.py)
};

}  // namespace

extern "C" int64_t kvserve_amx_available() {
  if (!kCompiledWithAmx) return 0;
  // Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18).
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
}

// W [n, k] bf16 -> the tile layout above; n % 16 == 0 and k % 32 == 0 (the caller checks).
extern "C" void kvserve_pack_weight_bf16(const void* weight, int64_t n, int64_t k, void* packed) {
  const uint16_t* w = static_cast<const uint16_t*>(weight);
  uint16_t* out = static_cast<uint16_t*>(packed);
  const int64_t chunks = k / 32;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < n / 16; ++nb)
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* tile = out + (nb * chunks + c) * 512;
      for (int r = 0; r < 16; ++r)
        for (int col = 0; col < 16; ++col)
          for (int p = 0; p < 2; ++p) tile[(r * 16 + col) * 2 + p] = w[(nb * 16 + col) * k + c * 32 + 2 * r + p];
    }
}

// hidden [m, H]: in, the token embeddings; out, the final norm of the last residual stream. Per token:
// positions, slot_mapping, context_lens (keys it attends to, itself included) [m] and its sequence's
// block table, block_tables [m, table_stride].
extern "C" void kvserve_forward_bf16(const ModelParams* mp, const LayerParams* layers, void* hidden_ptr,
                                            int64_t m, const int64_t* positions, const int64_t* slot_mapping,
                                            const int64_t* block_tables, int64_t table_stride,
                                            const int64_t* context_lens) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const ModelParams& p = *mp;
  const int64_t hd = p.head_dim, hidden = p.hidden, inter = p.intermediate;
  const int64_t q_width = p.q_heads * hd, qkv_width = (p.q_heads + 2 * p.kv_heads) * hd;
  const bool unit = p.norm_unit_offset != 0;
  bf16* h = static_cast<bf16*>(hidden_ptr);
  std::vector<bf16> residual(m * hidden), x(m * hidden), branch(m * hidden), qkv(m * qkv_width), attn(m * q_width),
      act(m * inter);
#pragma omp parallel
  {
    TileState ts;
    std::vector<float> scores;
    Scratch scratch;
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
        bf16* b = branch.data() + i * hidden;
        norm_row(static_cast<const bf16*>(b), b, hidden, weight, p.eps, unit);
      }
    };
    // residual += branch, out = RMSNorm(residual), row by row.
    auto add_branch_and_norm = [&](bf16* out, const bf16* weight) {
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i)
        add_norm_row(branch.data() + i * hidden, residual.data() + i * hidden, out + i * hidden, hidden, weight,
                     p.eps, unit);
    };
    for (int64_t l = 0; l < p.num_layers; ++l) {
      const LayerParams& L = layers[l];
      if (l == 0) {  // the stream starts as the embeddings
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < m; ++i) {
          std::memcpy(residual.data() + i * hidden, h + i * hidden, hidden * sizeof(bf16));
          norm_row(static_cast<const bf16*>(residual.data() + i * hidden), x.data() + i * hidden, hidden,
                   L.attn_in_norm, p.eps, unit);
        }
      } else {
        add_branch_and_norm(x.data(), L.attn_in_norm);
      }
      mark(0);
      gemm(x.data(), m, hidden, L.qkv, qkv_width / 16, ts, StoreTiles{qkv.data(), qkv_width});
      mark(1);
      const QkvStep<bf16> step{p.q_heads, p.kv_heads, hd, L.cos, L.sin, L.q_norm, L.k_norm, p.eps, unit,
                               L.key_cache, L.value_cache, p.num_blocks * p.block_size};
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < m; ++i) step.token(qkv.data() + i * qkv_width, positions[i], slot_mapping[i]);
      mark(2);
      const DecodeBatch<bf16> batch{qkv.data(), qkv_width, L.key_cache, L.value_cache, block_tables, table_stride,
                                    context_lens, attn.data(), m, p.q_heads, p.kv_heads, p.num_blocks,
                                    p.block_size, hd, L.window, L.scale};
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < batch.tasks(); ++task) batch.run(task, scores, scratch);
      mark(3);
      gemm(attn.data(), m, q_width, L.o, hidden / 16, ts, StoreTiles{branch.data(), hidden});
      norm_branch(L.attn_out_norm);
      mark(4);
      add_branch_and_norm(x.data(), L.mlp_in_norm);
      mark(5);
      gemm(x.data(), m, hidden, L.gate_up, 2 * inter / 16, ts, GatedTiles{act.data(), inter, static_cast<int>(p.act)});
      mark(6);
      gemm(act.data(), m, inter, L.down, hidden / 16, ts, StoreTiles{branch.data(), hidden});
      norm_branch(L.mlp_out_norm);
      mark(7);
    }
    add_branch_and_norm(h, p.final_norm);
    mark(8);
  }
#endif
}
