"""Memory arithmetic: parameters, weight bytes, KV bytes per token, and what is left for the KV pool.

Pure Python. Conventions (the same as vLLM's and our engine's):
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element.
- The pool is counted as the engine counts it (engine/kv/groups.py, whose rule this module imports rather
  than restates): layers form KV groups by attention kind, a page is one block of one group, and a
  sliding-window group holds only the blocks its window still reaches. A model of one kind (Llama) has one
  group of every layer, so a page is the classic block of every layer. A sequence is counted at its peak
  while decoding: all its tokens written, the last one being computed (a prefill chunk briefly holds a
  little more of a sliding group's blocks; only a few sequences prefill at once).
- Weights are every parameter at its dtype: a mixture of experts holds all its experts, though a token uses
  only k of them (ParameterCount.active; what a step reads of them is the roofline's business).
- Tensor parallelism splits every weight matrix and the KV heads over `tp` devices; KV heads fewer than
  `tp` are replicated (each device holds at least one).
- Per device, `gpu_memory_utilization` of the memory is the engine's; of that, the weights' shard and a
  runtime reserve (CUDA context and libraries, the activations of a step of `max_num_batched_tokens`)
  come first and the KV pool takes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import sliding_layer
from kvserve.engine.kv.groups import KVLayout
from kvserve.planning.specs import AcceleratorSpec, ModelSpec

# int8 / int4: weights only, in the format whose quality data/quantization.toml measured (models/quant.py):
# the values plus an fp16 scale and minimum per 32 weights; read at their bytes, widened for bf16 GEMMs.
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.125, "int4": 0.625}
WEIGHT_ONLY = ("int8", "int4")  # not KV cache dtypes
DENSE = ("fp32", "bf16", "fp16")  # unquantized: the rest (fp8, int8, int4) carry a quality assumption
GIB = 1 << 30
RUNTIME_RESERVE_BYTES = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces (vLLM's profile shows ~1-2 GiB)
ACTIVATION_FACTOR = 4  # live activation buffers per token of a step, in units of max(hidden, MLP shard)
HOST_GBS = 25.0  # host memory to device: about what a PCIe 5.0 x16 link sustains (64 GB/s peak); assumed
DISK_GBS = 3.0  # disk to host: one NVMe drive's sequential read; assumed
LOGIT_ROWS = 512  # logits are computed for the sampled sequences only (at most max_num_seqs of them)


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ParameterCount:
    """A model's weights. A mixture of experts' memory holds every expert (`total`), while a token is multiplied
    by only its k routed experts and the shared ones (`active`); a dense model's two are equal."""

    total: int  # every weight: what memory holds
    active: int  # weights one token uses: total less the routed experts it is not sent to (the published
    # "active" figure: embeddings, norms and head included)
    embedding: int  # the input embedding table (read by lookup, not multiplied)
    head: int  # the LM head's matmul weights (vocab x hidden, tied or not): multiplied per sampled token
    layer_matmul: int  # the layers' weights one token is multiplied by: attention, MLPs, router, its experts
    expert: int  # one routed expert's weights over all MoE layers (0: dense): what a step reads per expert
    # it touches (roofline.experts_touched)


def parameter_count(m: ModelSpec) -> ParameterCount:
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.attention_bias else 0)
    norms = 2 * h
    moe_layers = m.num_moe_layers
    dense_layers = m.num_layers - moe_layers
    mlp = 3 * m.intermediate_size * h  # gate, up, down (SwiGLU / GeGLU)
    expert = 3 * m.expert_intermediate_size * h
    router = h * m.num_experts
    moe_total = expert * (m.num_experts + m.num_shared_experts) + router
    moe_active = expert * (m.experts_per_token + m.num_shared_experts) + router
    embedding = head = m.vocab_size * h
    total = (m.num_layers * (attention + norms) + dense_layers * mlp + moe_layers * moe_total + embedding
             + (0 if m.tie_word_embeddings else head) + h)
    return ParameterCount(
        total=total, active=total - moe_layers * expert * (m.num_experts - m.experts_per_token),
        embedding=embedding, head=head,
        layer_matmul=m.num_layers * attention + dense_layers * mlp + moe_layers * moe_active,
        expert=moe_layers * expert)


def weight_bytes(m: ModelSpec, weight_dtype: str) -> float:
    return parameter_count(m).total * dtype_bytes(weight_dtype)


def kv_heads_per_device(m: ModelSpec, tp: int) -> float:
    return max(1.0, m.num_kv_heads / tp)


def kv_bytes_per_token_layer(m: ModelSpec, kv_dtype: str, tp: int = 1) -> float:
    """KV bytes one token holds in one layer on one device."""
    return 2 * kv_heads_per_device(m, tp) * m.head_dim * dtype_bytes(kv_dtype)


def kv_bytes_per_token(m: ModelSpec, kv_dtype: str, tp: int = 1) -> float:
    """KV bytes one token holds on one device (all layers)."""
    return m.num_layers * kv_bytes_per_token_layer(m, kv_dtype, tp)


def layer_windows(m: ModelSpec) -> list[int | None]:
    """Each layer's attention window (None: full attention). With a pattern, every pattern-th layer is
    global (Gemma 3, as ModelConfig.is_sliding); a window without one slides every layer (Mistral v0.1)."""
    w, p = m.sliding_window, m.sliding_window_pattern
    return [w if sliding_layer(layer, w, p) else None for layer in range(m.num_layers)]


def kv_layout(m: ModelSpec, split: bool = True) -> KVLayout:
    """The engine's KV groups for this model (`split=False`: one group, every layer holding every token)."""
    return KVLayout.for_windows(layer_windows(m), split)


def kv_bytes_at_context(m: ModelSpec, tokens: int, kv_dtype: str, block_size: int = 16,
                        layout: KVLayout | None = None) -> float:
    """KV bytes of one sequence decoding at `tokens`, over all devices: the pages the engine holds for it
    (`layout`, default the model's groups) at their size."""
    layout = layout or kv_layout(m)
    return layout.pages_held(tokens, block_size, new_tokens=1) * \
        layout.page_bytes(block_size, kv_bytes_per_token_layer(m, kv_dtype))


@dataclass(frozen=True)
class MemoryPlan:
    """One replica (tp devices): where each device's memory goes, and what the KV pool holds."""

    device_bytes: int
    usable_bytes: float  # device_bytes x gpu_memory_utilization
    weight_bytes: float  # per device
    reserve_bytes: float  # per device: runtime + activations
    kv_bytes: float  # per device, the KV pool
    kv_bytes_per_token: float  # per device, all layers
    block_size: int
    num_blocks: int  # the replica's pool in pages, reserved ones included (every device holds its heads' share)
    layout: KVLayout  # the model's KV groups: what a page holds and how many a sequence needs
    page_bytes: float  # per device: one block of one group

    @property
    def usable_pages(self) -> int:
        """Pages sequences can hold (the pool less NULL_PAGE where a group slides)."""
        return max(0, self.num_blocks - self.layout.reserved_pages)

    @property
    def fits(self) -> bool:
        return self.usable_pages > 0

    @property
    def kv_tokens(self) -> int:
        """Tokens the pool holds when every group keeps every block (short sequences), as the engine's
        KVCacheManager.token_capacity."""
        return self.usable_pages // self.layout.num_groups * self.block_size

    def pages_per_sequence(self, context_len: int) -> int:
        """Pages one sequence holds while decoding at `context_len` (see the module docstring)."""
        return self.layout.pages_held(context_len, self.block_size, new_tokens=1)

    def max_sequences(self, context_len: int) -> int:
        """Sequences of `context_len` tokens that fit in the pool at once."""
        return self.usable_pages // self.pages_per_sequence(context_len)


def memory_plan(m: ModelSpec, acc: AcceleratorSpec, tp: int = 1, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 8192,
                block_size: int = 16, runtime_reserve_bytes: float = RUNTIME_RESERVE_BYTES,
                layout: KVLayout | None = None) -> MemoryPlan:
    """`layout`: the KV groups the pool serves (default the model's own, as the engine builds them)."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    layout = layout or kv_layout(m)
    usable = acc.memory_bytes * gpu_memory_utilization
    weights = weight_bytes(m, weight_dtype) / tp
    mlp_widths = [m.expert_intermediate_size * (m.experts_per_token + m.num_shared_experts)] if m.is_moe else []
    if m.num_moe_layers < m.num_layers:
        mlp_widths.append(m.intermediate_size)
    widest = max(m.hidden_size, max(mlp_widths) / tp)
    activations = (ACTIVATION_FACTOR * max_num_batched_tokens * widest * 2  # bf16 activations of a full step
                   + LOGIT_ROWS * m.vocab_size / tp * 4)  # float32 logits, one row per sampled sequence
    reserve = runtime_reserve_bytes + activations
    kv = max(0.0, usable - weights - reserve)
    page = layout.page_bytes(block_size, kv_bytes_per_token_layer(m, kv_dtype, tp))
    return MemoryPlan(device_bytes=acc.memory_bytes, usable_bytes=usable, weight_bytes=weights,
                      reserve_bytes=reserve, kv_bytes=kv, kv_bytes_per_token=kv_bytes_per_token(m, kv_dtype, tp),
                      block_size=block_size, num_blocks=int(kv // page), layout=layout, page_bytes=page)
