"""Memory arithmetic: parameters, weight bytes, KV bytes per token, and what is left for the KV pool.

Pure Python. Conventions (the same as vLLM's and our engine's):
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element. Our KV manager
  allocates every layer's blocks for every token, sliding-window layers included, so that is what a
  block costs here; `kv_bytes_at_context` gives the smaller figure an engine that frees blocks behind a
  sliding window would need (Gemma 3), for the report.
- Tensor parallelism splits every weight matrix and the KV heads over `tp` devices; KV heads fewer than
  `tp` are replicated (each device holds at least one).
- Per device, `gpu_memory_utilization` of the memory is the engine's; of that, the weights' shard and a
  runtime reserve (CUDA context and libraries, the activations of a step of `max_num_batched_tokens`)
  come first and the KV pool takes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planning.specs import AcceleratorSpec, ModelSpec

# int8 / int4: weights only, in the format whose quality data/quantization.toml measured (models/quant.py):
# the values plus an fp16 scale and minimum per 32 weights; read at their bytes, widened for bf16 GEMMs.
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.125, "int4": 0.625}
WEIGHT_ONLY = ("int8", "int4")  # not KV cache dtypes
DENSE = ("fp32", "bf16", "fp16")  # unquantized: the rest (fp8, int8, int4) carry a quality assumption
GIB = 1 << 30
RUNTIME_RESERVE_BYTES = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces (vLLM's profile shows ~1-2 GiB)
ACTIVATION_FACTOR = 4  # live activation buffers per token of a step, in units of max(hidden, MLP shard)
LOGIT_ROWS = 512  # logits are computed for the sampled sequences only (at most max_num_seqs of them)


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ParameterCount:
    total: int  # every weight
    active: int  # weights a token's forward pass multiplies by (MoE: only its experts), lm head included
    embedding: int  # the input embedding table (read by lookup, not multiplied)


def parameter_count(m: ModelSpec) -> ParameterCount:
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.attention_bias else 0)
    expert = 3 * m.intermediate_size * h  # gate, up, down (SwiGLU / GeGLU)
    router = h * m.num_experts if m.num_experts > 1 else 0
    norms = 2 * h
    layer_total = attention + expert * m.num_experts + router + norms
    layer_active = attention + expert * m.experts_per_token + router
    embedding = m.vocab_size * h
    head = 0 if m.tie_word_embeddings else m.vocab_size * h
    total = m.num_layers * layer_total + embedding + head + h
    return ParameterCount(total=total, active=m.num_layers * layer_active + m.vocab_size * h, embedding=embedding)


def weight_bytes(m: ModelSpec, weight_dtype: str) -> float:
    return parameter_count(m).total * dtype_bytes(weight_dtype)


def kv_heads_per_device(m: ModelSpec, tp: int) -> float:
    return max(1.0, m.num_kv_heads / tp)


def kv_bytes_per_token(m: ModelSpec, kv_dtype: str, tp: int = 1) -> float:
    """KV bytes one token holds on one device (all layers)."""
    return 2 * m.num_layers * kv_heads_per_device(m, tp) * m.head_dim * dtype_bytes(kv_dtype)


def kv_bytes_at_context(m: ModelSpec, tokens: int, kv_dtype: str) -> float:
    """KV bytes of one sequence of `tokens` over all devices when sliding layers keep only their window."""
    per_layer_token = 2 * m.num_kv_heads * m.head_dim * dtype_bytes(kv_dtype)
    sliding = m.num_sliding_layers
    window = min(tokens, m.sliding_window or tokens)
    return per_layer_token * ((m.num_layers - sliding) * tokens + sliding * window)


@dataclass(frozen=True)
class MemoryPlan:
    """One replica (tp devices): where each device's memory goes, and what the KV pool holds."""

    device_bytes: int
    usable_bytes: float  # device_bytes x gpu_memory_utilization
    weight_bytes: float  # per device
    reserve_bytes: float  # per device: runtime + activations
    kv_bytes: float  # per device, the KV pool
    kv_bytes_per_token: float  # per device
    block_size: int
    num_blocks: int  # the replica's pool (every device holds its heads' share of each block)

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_sequences(self, context_len: int) -> int:
        """Sequences of `context_len` tokens that fit in the pool at once."""
        return self.num_blocks // -(-context_len // self.block_size)


def memory_plan(m: ModelSpec, acc: AcceleratorSpec, tp: int = 1, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 8192,
                block_size: int = 16, runtime_reserve_bytes: float = RUNTIME_RESERVE_BYTES) -> MemoryPlan:
    if tp < 1:
        raise ValueError("tp must be >= 1")
    usable = acc.memory_bytes * gpu_memory_utilization
    weights = weight_bytes(m, weight_dtype) / tp
    widest = max(m.hidden_size, m.intermediate_size * m.experts_per_token / tp)
    activations = (ACTIVATION_FACTOR * max_num_batched_tokens * widest * 2  # bf16 activations of a full step
                   + LOGIT_ROWS * m.vocab_size / tp * 4)  # float32 logits, one row per sampled sequence
    reserve = runtime_reserve_bytes + activations
    kv = max(0.0, usable - weights - reserve)
    per_token = kv_bytes_per_token(m, kv_dtype, tp)
    blocks = int(kv // (per_token * block_size))
    return MemoryPlan(device_bytes=acc.memory_bytes, usable_bytes=usable, weight_bytes=weights,
                      reserve_bytes=reserve, kv_bytes=kv, kv_bytes_per_token=per_token, block_size=block_size,
                      num_blocks=blocks)
