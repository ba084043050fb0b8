"""Typed configuration: one dataclass per concern, composed into EngineConfig.

Engine argument names follow vLLM's where one exists (block_size, max_num_seqs, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum


class PreemptionMode(str, Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"
    AUTO = "auto"  # swap when host swap space allows, else recompute


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters, read from GGUF metadata or a HF config.json."""

    architecture: str  # "llama" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    # Gemma 3 specifics; None/defaults for Llama.
    rope_local_theta: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None  # every Nth layer is global (Gemma 3: 6)
    query_pre_attn_scalar: float | None = None
    rope_scaling: dict | None = None
    name: str = ""

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None or self.sliding_window_pattern is None:
            return False
        return (layer + 1) % self.sliding_window_pattern != 0

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V elements per token over all layers (multiply by bytes per element)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the device KV pool; None: derive from num blocks or default
    num_gpu_blocks_override: int | None = None
    swap_space: int = 1 << 30  # bytes of host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # "auto" = model dtype


@dataclass
class TierLimits:
    """Admission bounds for one priority tier."""

    max_waiting: int = 1024
    max_queued_prompt_tokens: int = 1 << 20
    max_queue_wait_s: float = 60.0  # estimated wait above which new requests are refused
    queue_timeout_s: float = 600.0  # a request still waiting after this is finished with QueueTimeout


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    interactive: TierLimits = field(default_factory=TierLimits)
    batch: TierLimits = field(default_factory=lambda: TierLimits(max_waiting=4096, max_queue_wait_s=3600.0,
                                                                 queue_timeout_s=7200.0))
    batch_decode_quantum: int = 64  # batch seqs yield after this many decode steps when interactive work waits


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KI": 1024, "KIB": 1024, "M": 10**6, "MB": 10**6,
          "MI": 1 << 20, "MIB": 1 << 20, "G": 10**9, "GB": 10**9, "GI": 1 << 30, "GIB": 1 << 30,
          "T": 10**12, "TB": 10**12, "TI": 1 << 40, "TIB": 1 << 40}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB' -> 2147483648; ints pass through."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"cannot parse a byte size from {value!r} (use e.g. 512MiB, 2GiB or a number of bytes)")
    number, unit = m.groups()
    return int(float(number) * _UNITS[(unit or "").upper()])


def engine_config_from_kwargs(model: str, **kwargs) -> EngineConfig:
    """Flat vLLM-style keyword arguments (block_size=..., max_num_seqs=...) -> nested EngineConfig."""
    from dataclasses import fields

    cache, sched, top = {}, {}, {}
    cache_names = {f.name for f in fields(CacheConfig)}
    sched_names = {f.name for f in fields(SchedulerConfig)}
    top_names = {f.name for f in fields(EngineConfig)} - {"model", "cache", "scheduler"}
    for key, value in kwargs.items():
        if key in cache_names:
            if key in ("kv_cache_memory", "swap_space") and value is not None:
                value = parse_bytes(value)
            cache[key] = value
        elif key in sched_names:
            if key == "preemption_mode":
                value = PreemptionMode(value)
            sched[key] = value
        elif key in top_names:
            top[key] = value
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(model=model, cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **top)
