"""Typed configuration: one dataclass per concern, composed into EngineConfig.

Engine argument names follow vLLM's where one exists (block_size, max_num_seqs, ...).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "default_models.toml"  # the packaged models file


def kvserve_home(configured: str | os.PathLike[str] | None = None) -> Path:
    """The data directory: `configured` ([server] home) if given, else ``$KVSERVE_HOME`` if set and non-empty,
    else ``~/.kvserve``. Not created here."""
    env = os.environ.get("KVSERVE_HOME", "").strip()
    chosen = configured or env
    return Path(chosen).expanduser() if chosen else Path.home() / ".kvserve"


class PreemptionMode(str, Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"
    AUTO = "auto"  # swap when host swap space allows, else recompute


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message names the key, the value and what is allowed."""


class InvalidPriority(ValueError):
    """A tier label that is neither 'interactive' nor 'batch' (a request's priority): the server maps it to a 400."""

    param = "priority"


def _check(owner: str, key: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}.{key} = {value!r} is not allowed: {allowed}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate(obj, rules: dict[str, tuple]) -> None:
    """Each rule: key -> (predicate, what is allowed). Checked on construction, so a bad value fails at start."""
    owner = type(obj).__name__
    for key, (ok, allowed) in rules.items():
        value = getattr(obj, key)
        _check(owner, key, value, ok(value), allowed)


POSITIVE_INT = (lambda v: _is_int(v) and v > 0, "an integer > 0")
OPTIONAL_POSITIVE_INT = (lambda v: v is None or (_is_int(v) and v > 0), "an integer > 0, or unset")
NONNEG_INT = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE_NUMBER = (lambda v: _is_number(v) and v > 0, "a number > 0 (inf allowed where it means no bound)")
NONNEG_NUMBER = (lambda v: _is_number(v) and v >= 0, "a number >= 0")
FRACTION = (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
BOOL = (lambda v: isinstance(v, bool), "true or false")


def sliding_layer(layer: int, window: int | None, pattern: int | None) -> bool:
    """Whether a layer attends through its model's sliding window: with a pattern every pattern-th layer is
    global (Gemma 3: 6), without one every layer slides (Mistral v0.1); no window, none does. The one rule
    for the engine (ModelConfig) and the planner (planning/memory.py's ModelSpec)."""
    if window is None:
        return False
    return not pattern or (layer + 1) % pattern != 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters, read from GGUF metadata or a HF config.json."""

    architecture: str  # one of models/model_info.SUPPORTED_ARCHITECTURES
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
    # The Llama layout's variants: a bias on the Q, K and V projections (Qwen2), an RMSNorm over each head of
    # q and k before RoPE (Qwen3; Gemma 3 has its own, offset from 1).
    attention_bias: bool = False
    qk_norm: bool = False
    # RoPE on the first `rotary_dim` dims of each head only, the rest passed through (Phi-4-mini's partial rotary);
    # None: every dim.
    rotary_dim: int | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): each token's MLP is the weighted sum of `experts_per_token` of
    # `num_experts` gated MLPs `moe_intermediate_size` wide, chosen by a float32 softmax router (the weights of
    # the chosen renormalised to sum to 1 where `norm_topk_prob`). 0 experts: a dense model. `dense_layers`:
    # the layers that keep a dense MLP (`intermediate_size` wide) in a mixture model (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    # The opt-in sinks + window policy (StreamingLLM) on the layers without a native window: each query attends
    # to the first `attention_sinks` tokens and the last `policy_window` (EngineConfig.attention_policy).
    policy_window: int | None = None
    attention_sinks: int = 0

    def __post_init__(self):
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token must be in 1..{self.num_experts}, got {self.experts_per_token}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("a mixture of experts needs moe_intermediate_size > 0")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts (else the dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        """A native sliding-window layer (see sliding_layer)."""
        return sliding_layer(layer, self.sliding_window, self.sliding_window_pattern)

    def with_attention_window(self, sinks_window: tuple[int, int] | None) -> "ModelConfig":
        """This config under the sinks + window policy (sinks, window), or as it is for None."""
        if sinks_window is None:
            return self
        return replace(self, attention_sinks=sinks_window[0], policy_window=sinks_window[1])

    def layer_window(self, layer: int) -> int | None:
        """The keys a query of this layer attends to, itself included (None: all earlier ones): its native
        window, else the sinks + window policy's."""
        return self.sliding_window if self.is_sliding(layer) else self.policy_window

    def layer_sinks(self, layer: int) -> int:
        """Leading tokens a query of this layer attends to beside its window (the policy's layers only)."""
        return 0 if self.is_sliding(layer) or self.policy_window is None else self.attention_sinks

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (None: full attention), as the KV groups see them."""
        return [self.layer_window(layer) for layer in range(self.num_layers)]

    @property
    def layer_sink_counts(self) -> list[int]:
        return [self.layer_sinks(layer) for layer in range(self.num_layers)]

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V elements per token over all layers (multiply by bytes per element)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block (the unit of allocation, prefix caching and swaps)
    kv_cache_memory: int | None = None  # bytes for the device KV pool; None: derive from num blocks or default
    num_gpu_blocks_override: int | None = None  # KV blocks in the pool, whatever kv_cache_memory says
    swap_space: int = 1 << 30  # bytes of host memory for swapped-out blocks
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix computed before (hashed per tenant)
    # "auto": the model's dtype; "int8": int8 rows with a scale each (kernels/kv_quant.py), about half the bytes;
    # "fp8": e4m3 values at scale 1 (models/fp8.py), half of bf16's bytes; not on the fused CPU decoder
    kv_cache_dtype: str = "auto"
    # KV groups per attention kind (engine/kv/groups.py): sliding-window layers hold only their window's
    # blocks. False: every layer holds every token's block (the classic paged cache; for comparison).
    kv_groups: bool = True
    # The disk tier of the prefix cache (engine/kv/disk.py): evicted prefix blocks are written under this
    # directory (per model file, dtype, block size and layout) and read back on a hit, across restarts and by
    # replicas sharing the directory; at most kv_disk_bytes of it. None: no disk tier.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 8 << 30  # the disk tier's size at most (oldest pages out first)
    # On a graceful shutdown (SIGTERM, LLM.close) the pool's cached prefix blocks that the disk tier lacks are
    # written to it, most recently used first, for at most this many seconds, so a restart finds them. 0: none.
    kv_disk_flush_seconds: float = 10.0
    # Write each prefix block to the disk tier once it is full and cached (the step copies the page out, the
    # tier's writer thread writes it), not only when the pool evicts it or the engine shuts down: a crash then
    # loses only the pages still queued, at the cost of writing every block once.
    kv_disk_write_through: bool = False
    # The host-memory tier (engine/kv/host.py), for CUDA: evicted prefix blocks are kept in this many bytes of
    # host memory before they go to the disk tier (when there is one). 0: none. On a CPU the pool is host
    # memory already: give the pool the memory instead.
    kv_host_bytes: int = 0
    # The prefix cache's share per tenant (engine/kv/eviction.py): eviction takes from the tenant with the most
    # cached blocks per weight (1 unless named here); a tenant's pinned blocks (system prompts) stay while
    # another tenant has blocks over its pin.
    kv_tenant_weights: dict = field(default_factory=dict)
    kv_pinned_blocks: dict = field(default_factory=dict)  # tenant -> blocks of its cache eviction leaves alone

    def __post_init__(self):
        _validate(self, dict(block_size=POSITIVE_INT, kv_cache_memory=OPTIONAL_POSITIVE_INT,
                             num_gpu_blocks_override=OPTIONAL_POSITIVE_INT, swap_space=NONNEG_INT,
                             enable_prefix_caching=BOOL, kv_groups=BOOL, kv_disk_bytes=POSITIVE_INT,
                             kv_disk_flush_seconds=NONNEG_NUMBER, kv_disk_write_through=BOOL,
                             kv_host_bytes=NONNEG_INT,
                             kv_disk_dir=(lambda v: v is None or (isinstance(v, str) and v != ""),
                                          "a directory path, or unset"),
                             kv_tenant_weights=(lambda v: isinstance(v, dict) and all(
                                 isinstance(k, str) and _is_number(w) and w > 0 for k, w in v.items()),
                                 "a table of tenant = weight > 0"),
                             kv_pinned_blocks=(lambda v: isinstance(v, dict) and all(
                                 isinstance(k, str) and _is_int(n) and n >= 0 for k, n in v.items()),
                                 "a table of tenant = blocks >= 0"),
                             kv_cache_dtype=(lambda v: v in KV_CACHE_DTYPES, f"one of {', '.join(KV_CACHE_DTYPES)}")))


class Priority(IntEnum):
    """A request's tier, the one type for it: lower value runs first. Interactive work may preempt batch
    work, never the reverse. On the wire and in config files it is its `label`."""

    INTERACTIVE = 0
    BATCH = 1

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: "str | Priority | None") -> "Priority":
        if value is None:
            return cls.INTERACTIVE
        if isinstance(value, Priority):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise InvalidPriority(f"priority must be 'interactive' or 'batch', got {value!r}") from None


TIER_NAMES = tuple(p.label for p in Priority)
NUMERICS = ("batch_invariant", "fast")  # EngineConfig.numerics
ACTIVATIONS = ("auto", "bf16", "int8")  # EngineConfig.activations
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")
ATTENTION_POLICIES = ("full", "sinks_window")
WEIGHT_MODES = ("auto", "bf16", "int8", "int4", "fp8")  # EngineConfig.weights (models/quant.weight_bits)
# CacheConfig.kv_cache_dtype: a float one (of DTYPES) must be the model's dtype
KV_CACHE_DTYPES = ("auto", "int8", "fp8") + DTYPES


# The interactive tier's promise: an admitted request's first token within this at p99, under any load
# (overload is refused with 429 and Retry-After instead of queued past it; RELIABILITY.md, the soak).
INTERACTIVE_TTFT_SLO_S = 1.0
# The shipped admission bound that keeps it: a request whose estimated time to first token (the step-time
# model's, learned from this machine's steps) is longer is refused. Half the SLO: the other half is for what
# the engine cannot see (HTTP, tokenizing, delivery, the GIL shared with the server) and the estimate's
# spread under a mixed flood (RELIABILITY.md, the soak).
INTERACTIVE_MAX_TTFT_S = 0.5


@dataclass(frozen=True)
class TierLimits:
    """Admission bounds for one priority tier."""

    max_waiting: int = 1024  # requests waiting in the tier's queue at most
    max_queued_prompt_tokens: int = 1 << 20  # prompt tokens waiting in the tier's queue at most
    max_queue_wait_s: float = 60.0  # estimated wait above which new requests are refused
    # Estimated time to first token above which new requests are refused: a TTFT SLO (inf: none). Unlike
    # max_queue_wait_s it counts the request's own prefill, so long prompts are refused sooner.
    max_ttft_s: float = float("inf")
    queue_timeout_s: float = 600.0  # a request still waiting after this is finished with QueueTimeout

    def __post_init__(self):
        _validate(self, dict(max_waiting=POSITIVE_INT, max_queued_prompt_tokens=POSITIVE_INT,
                             max_queue_wait_s=POSITIVE_NUMBER, max_ttft_s=POSITIVE_NUMBER,
                             queue_timeout_s=POSITIVE_NUMBER))

    @classmethod
    def unbounded(cls) -> "TierLimits":
        inf = float("inf")
        return cls(max_waiting=1 << 62, max_queued_prompt_tokens=1 << 62, max_queue_wait_s=inf, max_ttft_s=inf,
                   queue_timeout_s=inf)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once at most
    max_num_batched_tokens: int = 2048  # tokens one step computes at most (prefill chunks and decodes)
    max_model_len: int = 4096  # prompt plus output tokens of a sequence at most (and the model's own limit)
    enable_chunked_prefill: bool = True  # a long prompt is prefilled in chunks, between other sequences' decodes
    # When the KV pool runs out, a sequence is preempted: its blocks swapped to host memory (swap_space) or
    # dropped and recomputed later; auto swaps where the swap space allows.
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    max_loras: int = 4  # LoRA adapters one step runs at most (the device's adapter slots): others' requests wait
    # Admission bounds of the interactive tier and of the batch tier (TierLimits; each table's keys replace its
    # tier's defaults).
    interactive: TierLimits = field(default_factory=lambda: TierLimits(max_ttft_s=INTERACTIVE_MAX_TTFT_S))
    batch: TierLimits = field(default_factory=lambda: TierLimits(max_waiting=4096, max_queue_wait_s=3600.0,
                                                                 queue_timeout_s=7200.0))  # (see interactive)
    batch_decode_quantum: int = 64  # batch seqs yield after this many decode steps when interactive work waits
    # While interactive sequences run or wait, batch-tier prefill chunks get at most this many tokens per
    # step in all: a step's length is what interactive work waits for, at every token (TTFT and TPOT).
    interactive_batch_prefill_tokens: int = 256
    # An interactive prompt starts in a step without batch work (batch decodes and prefills sit it out),
    # so its first token waits for its own prefill, not for the flood's. Never two such steps in a row
    # (the batch tier keeps at least every other step), and only with room in the KV pool for the prompt
    # plus a block per held batch sequence (Scheduler._interactive_prefill_alone).
    interactive_prefill_alone: bool = True
    # An interactive prompt that arrives while a step with batch work runs may suspend that step between
    # decoder layers and run first, alone (Scheduler.schedule_interjection): its first token waits about
    # a layer, not the rest of the flood's step. At most once per step, with the same room rule; only
    # where a step can stop between layers (the fused CPU decoder).
    interactive_interjection: bool = True
    # Speculative decoding (engine/speculation/): decodes draft up to num_speculative_tokens tokens (n-gram
    # prompt lookup, then the tenant's recent outputs), lengths chosen per step by the controller, verified
    # exactly in one chunk. Off by default until its benchmarks show it never slows a loaded server here.
    speculative_decoding: bool = False
    num_speculative_tokens: int = 8  # drafted tokens per sequence and step at most
    # False: every proposal is drafted whole, whatever the load (a static draft length, as other engines have it).
    speculative_controller: bool = True

    def __post_init__(self):
        _validate(self, dict(
            max_num_seqs=POSITIVE_INT, max_num_batched_tokens=POSITIVE_INT, max_model_len=POSITIVE_INT,
            enable_chunked_prefill=BOOL, preemption_mode=(lambda v: isinstance(v, PreemptionMode),
                                                          "one of " + ", ".join(m.value for m in PreemptionMode)),
            interactive=(lambda v: isinstance(v, TierLimits), "a table of TierLimits fields"),
            batch=(lambda v: isinstance(v, TierLimits), "a table of TierLimits fields"),
            batch_decode_quantum=NONNEG_INT, interactive_batch_prefill_tokens=NONNEG_INT,
            interactive_prefill_alone=BOOL, interactive_interjection=BOOL, speculative_decoding=BOOL,
            num_speculative_tokens=POSITIVE_INT, speculative_controller=BOOL, max_loras=POSITIVE_INT))


@dataclass(frozen=True)
class LoRAAdapterSpec:
    """A `[[models.adapters]]` entry: a LoRA adapter of the model, served as the model `name` (or
    "<model>:<name>"). `path`: a PEFT directory (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA
    file; `pinned`: never unloaded to make room for another; `price`: its own prices, else the model's."""

    name: str  # the model name requests give to run on this adapter
    path: str  # a PEFT directory (adapter_config.json, adapter_model.safetensors) or a GGUF LoRA file
    pinned: bool = False  # never unloaded from host memory to make room for another adapter
    # its requests' prices and cost ([models.price]'s keys, e.g. price = {output = 0.12}); None: the model's
    price: "ModelPrice | None" = None

    def __post_init__(self):
        if isinstance(self.price, dict):
            object.__setattr__(self, "price", _table(ModelPrice, self.price, f"[[models.adapters]] price ({self.name})"))
        _validate(self, dict(name=(lambda v: isinstance(v, str) and v != "" and ":" not in v and v != "auto",
                                   "a non-empty name without ':', other than 'auto'"),
                             path=(lambda v: isinstance(v, str) and v != "", "a PEFT directory or a GGUF LoRA file"),
                             pinned=BOOL,
                             price=(lambda v: v is None or isinstance(v, ModelPrice), "a table of [models.price] keys")))


@dataclass(frozen=True)
class StructuredLimits:
    """Bounds on what one request's output constraint may ask, checked before anything is compiled
    (engine/structured/params.py) and while it compiles (engine/structured/grammar.py); EngineConfig's
    structured_* keys set the first two and the time budget."""

    max_schema_bytes: int = 64 * 1024  # a JSON schema, as compact JSON
    max_schema_depth: int = 32  # nested objects and arrays in the schema document
    max_pattern_bytes: int = 16 * 1024  # a regex or a grammar
    max_choices: int = 1024
    compile_timeout_s: float = 5.0  # a grammar still compiling after this is refused (400)

    def __post_init__(self):
        _validate(self, dict(max_schema_bytes=POSITIVE_INT, max_schema_depth=POSITIVE_INT,
                             max_pattern_bytes=POSITIVE_INT, max_choices=POSITIVE_INT,
                             compile_timeout_s=POSITIVE_NUMBER))


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "auto" | "float32" | "bfloat16" | "float16": the compute dtype; auto is bfloat16 where the fused CPU decoder
    # serves the model (and the CPU has native bf16), else float32
    dtype: str = "auto"
    device: str = "auto"  # "auto" (CUDA when present, else the CPU) | "cpu" | "cuda" | "cuda:N"
    seed: int = 0  # the engine's torch seed (a request's own `seed` makes its sampling reproducible)
    # "auto" | "bf16" | "int8" | "int4" | "fp8": the form the matrices are computed from (models/quant.py; auto keeps
    # a GGUF's class: 4-bit types at 4 bits, other quantized types at 8, float files dense; fp8: the projections
    # as e4m3 with a scale per output row through torch._scaled_mm, on GPUs with compute capability 8.9 or later,
    # or on the CPU to check the path (models/fp8.py))
    weights: str = "auto"
    onednn_weights: bool = True  # CPU + bfloat16: projections use weights pre-reordered into oneDNN's blocked layout
    native_decoder: bool = True  # CPU + bfloat16 + AMX or AVX2: steps run as one native call (models/native_decoder.py)
    # "batch_invariant": a token's logits are the same bits however its step was made up (batch size, prefill
    # or decode, chunking, cache hits, preemption, migration); "fast": kernels may pick by shape. Where the
    # path cannot give it (float32, CUDA) the engine runs "fast" and says so (models/backend.plan).
    numerics: str = "batch_invariant"
    # What quantized matrices multiply: "int8" (each step's activations quantized to 8 bits per 16 inputs,
    # integer dot products, batch-invariant at every step size), "bf16", or "auto": int8 where the CPU kind
    # measured faster with it (AVX-512 VNNI without AMX), else bf16 (models/backend.resolve_activations).
    activations: str = "auto"
    # "full": every layer attends as the model was trained. "sinks_window" (opt-in, StreamingLLM): layers
    # without a native window attend to the first attention_sinks tokens and the last attention_window ones and
    # hold only those blocks, for long contexts in less memory at a measured cost in quality (BENCHMARKS.md);
    # served op by op (the fused decoder has no sinks), responses say so (x-kvserve-kv-policy).
    attention_policy: str = "full"
    # CUDA: decode-only steps replay graphs captured per batch-size bucket (engine/worker/cuda_graphs.py). Off
    # until a device check on a real card has shown replays equal to eager forwards; no effect off CUDA.
    cuda_graphs: bool = False
    # Ranks the model is split over (models/parallel.py, engine/worker/tensor_parallel.py): N processes, one GPU each
    # on CUDA (gloo on the CPU, for checking the path), each holding a 1/N slice of the weights and KV heads.
    # Above 1: dense weights, no host or disk KV tier, no fused CPU decoder.
    tensor_parallel_size: int = 1
    # LoRA adapters (models/lora.py, engine/lora.py, docs/lora.md): on with enable_lora or any configured adapter.
    # A step runs at most max_loras adapters (the device's slots), of rank at most max_lora_rank; host memory holds
    # at most max_cpu_loras, the least recently used unloaded first (pinned ones and ones in use never).
    enable_lora: bool = False
    max_lora_rank: int = 64  # the largest adapter rank served (the device slots are this wide)
    max_cpu_loras: int = 16  # adapters resident in host memory at most (see enable_lora)
    lora_adapters: tuple[LoRAAdapterSpec, ...] = ()  # [[models.adapters]] (`adapters` in the entry), read at start
    attention_sinks: int = 4  # sinks_window: leading tokens every such layer keeps attending to
    attention_window: int = 2048  # sinks_window: the latest tokens every such layer attends to
    # Structured outputs (engine/structured/params.py, engine/structured/grammar.py): a constraint still compiling after this many seconds is refused
    # (400), as is a JSON schema above this many bytes or nesting levels.
    structured_compile_timeout_s: float = 5.0
    structured_max_schema_bytes: int = 64 * 1024  # (see structured_compile_timeout_s)
    structured_max_schema_depth: int = 32  # (see structured_compile_timeout_s)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def structured_limits(self) -> StructuredLimits:
        return StructuredLimits(max_schema_bytes=self.structured_max_schema_bytes,
                                max_schema_depth=self.structured_max_schema_depth,
                                compile_timeout_s=self.structured_compile_timeout_s)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters)

    @property
    def sinks_window(self) -> tuple[int, int] | None:
        """(sinks, window) of the sinks + window policy; None for full attention."""
        return None if self.attention_policy == "full" else (self.attention_sinks, self.attention_window)

    @property
    def kv_policy_label(self) -> str:
        """What responses say served them (x-kvserve-kv-policy): "full" (the model's own attention, native
        windows included) or "sinks=S,window=W"."""
        if self.attention_policy == "full":
            return "full"
        return f"sinks={self.attention_sinks},window={self.attention_window}"

    def __post_init__(self):
        _validate(self, dict(
            model=(lambda v: isinstance(v, str) and v != "", "a catalog id, a .gguf path or a checkpoint directory"),
            dtype=(lambda v: v in ("auto",) + DTYPES or not isinstance(v, str), f"one of auto, {', '.join(DTYPES)}"),
            numerics=(lambda v: v in NUMERICS, f"one of {', '.join(NUMERICS)}"),
            activations=(lambda v: v in ACTIVATIONS, f"one of {', '.join(ACTIVATIONS)}"),
            device=(lambda v: v in ("auto", "cpu") or (isinstance(v, str) and v.startswith("cuda")),
                    "auto, cpu, cuda or cuda:N"),
            seed=NONNEG_INT, onednn_weights=BOOL, native_decoder=BOOL, cuda_graphs=BOOL,
            tensor_parallel_size=POSITIVE_INT,
            attention_policy=(lambda v: v in ATTENTION_POLICIES, f"one of {', '.join(ATTENTION_POLICIES)}"),
            attention_sinks=NONNEG_INT, attention_window=POSITIVE_INT,
            structured_compile_timeout_s=(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and v > 0, "a positive number of seconds"),
            structured_max_schema_bytes=POSITIVE_INT, structured_max_schema_depth=POSITIVE_INT,
            weights=(lambda v: v in WEIGHT_MODES, f"one of {', '.join(WEIGHT_MODES)}"),
            enable_lora=BOOL, max_lora_rank=POSITIVE_INT, max_cpu_loras=POSITIVE_INT,
            lora_adapters=(lambda v: isinstance(v, tuple) and all(isinstance(a, LoRAAdapterSpec) for a in v),
                           "a list of [[models.adapters]] tables (name, path, pinned)")))
        names = [a.name for a in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora adapters: a name given twice in {names}")
        if self.lora_enabled and self.tensor_parallel_size > 1:
            raise ConfigError("LoRA adapters are not served under tensor_parallel_size > 1")
        if self.max_cpu_loras < max(self.scheduler.max_loras, sum(a.pinned for a in self.lora_adapters) + 1):
            raise ConfigError(f"max_cpu_loras = {self.max_cpu_loras}: at least max_loras ({self.scheduler.max_loras}) and one "
                              "more than the pinned adapters")
        if self.tensor_parallel_size > 1 and (self.cache.kv_disk_dir is not None or self.cache.kv_host_bytes):
            raise ConfigError("tensor_parallel_size > 1 takes no host or disk KV tier (kv_host_bytes, kv_disk_dir): "
                              "a rank's page holds its own KV heads only")


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
    """Flat vLLM-style keyword arguments (block_size=..., max_num_seqs=...) -> nested EngineConfig.
    ConfigError (naming the argument, its value and what is allowed) for anything else."""
    from dataclasses import fields

    cache, sched, top = {}, {}, {}
    cache_names = {f.name for f in fields(CacheConfig)}
    sched_names = {f.name for f in fields(SchedulerConfig)}
    top_names = {f.name for f in fields(EngineConfig)} - {"model", "cache", "scheduler"}
    for key, value in kwargs.items():
        if key in cache_names:
            if key in ("kv_cache_memory", "swap_space", "kv_disk_bytes", "kv_host_bytes") and value is not None:
                try:
                    value = parse_bytes(value)
                except (ValueError, TypeError):
                    raise ConfigError(f"{key} = {value!r} is not allowed: a byte size such as 512MiB or 2GiB, "
                                      "or a number of bytes") from None
            cache[key] = value
        elif key in sched_names:
            if key == "preemption_mode":
                modes = ", ".join(m.value for m in PreemptionMode)
                try:
                    value = PreemptionMode(value)
                except ValueError:
                    raise ConfigError(f"preemption_mode = {value!r} is not allowed: one of {modes}") from None
            elif key in TIER_NAMES and isinstance(value, dict):  # a TOML table: fields over the tier's defaults
                unknown = set(value) - {f.name for f in fields(TierLimits)}
                if unknown:
                    raise ConfigError(f"{key}: unknown keys {sorted(unknown)}; allowed: "
                                      f"{', '.join(f.name for f in fields(TierLimits))}")
                value = replace(getattr(SchedulerConfig(), key), **value)
            sched[key] = value
        elif key in ("adapters", "lora_adapters"):  # [[models.adapters]] tables
            if not isinstance(value, (list, tuple)) or not all(isinstance(a, (dict, LoRAAdapterSpec)) for a in value):
                raise ConfigError(f"{key} = {value!r} is not allowed: a list of tables with name, path, pinned, price")
            try:
                top["lora_adapters"] = tuple(a if isinstance(a, LoRAAdapterSpec) else LoRAAdapterSpec(**a)
                                             for a in value)
            except TypeError as e:
                raise ConfigError(f"[[models.adapters]]: {e}; allowed keys: name, path, pinned, price") from None
        elif key in top_names:
            top[key] = value
        else:
            allowed = sorted(cache_names | sched_names | top_names)
            raise ConfigError(f"unknown engine argument {key!r}; allowed: {', '.join(allowed)}")
    return EngineConfig(model=model, cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **top)


# ---- prices ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPrice:
    """A `[models.price]` table: list prices in dollars per million tokens (interactive tier; the batch tier
    pays `batch_discount` times them), and what one replica of the model costs to run per hour (its GPU or
    CPU share: the cost side of each request, from the engine time it used)."""

    input: float = 0.02  # dollars per million prompt tokens
    cached_input: float = 0.005  # ... per million prompt tokens served from the prefix cache
    output: float = 0.08  # ... per million output tokens
    batch_discount: float = 0.5  # the batch tier pays this times the list prices
    replica_cost_per_hour: float = 0.10  # dollars an hour one replica costs to run (the cost side of usage)

    def __post_init__(self):
        _validate(self, dict(input=NONNEG_NUMBER, cached_input=NONNEG_NUMBER, output=NONNEG_NUMBER,
                             batch_discount=FRACTION, replica_cost_per_hour=NONNEG_NUMBER))


# ---- the fleet -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFleet:
    """A `[models.fleet]` table: the model's pool of engine replicas in the fleet (`kvserve serve --fleet`).

    `replicas` fixes the pool's size; `min_replicas` < `max_replicas` turns on autoscaling between them on
    the engines' own signals (fleet/autoscale.py). Each replica reserves `cpus` CPUs and `gpus` GPUs; a replica
    of N tensor-parallel ranks reserves a placement group of N bundles on one node, each of `cpus` CPUs and one
    GPU (gpus = N) or none (gpus = 0)."""

    replicas: int = 1  # the pool's size (its initial size when autoscaling)
    min_replicas: int | None = None  # autoscaling's lower bound (unset: replicas)
    max_replicas: int | None = None  # autoscaling's upper bound (unset: no autoscaling)
    cpus: float = 1.0  # CPUs each replica reserves in Ray
    gpus: float = 0.0  # GPUs each replica reserves in Ray
    upscale_delay_s: float = 10.0  # the autoscaler wants more replicas this long before it adds one
    downscale_delay_s: float = 120.0  # ...and fewer this long before it removes one
    target_queued_tokens: int = 2048  # per replica: waiting prompt tokens the autoscaler aims at
    target_kv_usage: float = 0.8  # per replica: KV-cache use above which it adds a replica

    def __post_init__(self):
        _validate(self, dict(replicas=NONNEG_INT, min_replicas=(lambda v: v is None or (_is_int(v) and v >= 0),
                                                                 "an integer >= 0, or unset"),
                             max_replicas=OPTIONAL_POSITIVE_INT, cpus=NONNEG_NUMBER, gpus=NONNEG_NUMBER,
                             upscale_delay_s=NONNEG_NUMBER, downscale_delay_s=NONNEG_NUMBER,
                             target_queued_tokens=POSITIVE_INT, target_kv_usage=FRACTION))
        lo, hi = self.bounds
        _check("ModelFleet", "min_replicas", self.min_replicas, lo <= hi, f"at most max_replicas ({hi})")

    @property
    def autoscaling(self) -> bool:
        lo, hi = self.bounds
        return lo < hi

    @property
    def bounds(self) -> tuple[int, int]:
        lo = self.min_replicas if self.min_replicas is not None else self.replicas
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
        return lo, hi


@dataclass(frozen=True)
class FleetConfig:
    """The `[fleet]` table: the gateway, routing, migration, health and rollout of `kvserve serve --fleet`."""

    gateway_replicas: int = 1  # gateway (HTTP ingress) replicas
    gateway_cpus: float = 0.5  # CPUs each gateway reserves in Ray
    gateway_resources: dict = field(default_factory=dict)  # custom Ray resources, to pin gateways to ingress nodes
    migration_limit: int = 3  # times one request may move to another replica before it fails
    route_timeout_s: float = 30.0  # a request that no replica accepts in this time fails (never a hung stream)
    health_check_period_s: float = 5.0  # Serve checks each replica's engine this often
    health_check_timeout_s: float = 30.0  # a check that does not answer in this time fails too
    drain_timeout_s: float = 60.0  # a stopping replica (update, downscale) finishes its streams for at most this long
    stats_period_s: float = 0.5  # how often each replica's load reaches the gateways' routers
    affinity_blocks: int = 8  # full KV blocks of a prompt that key its replica affinity (fleet/routing.py)
    load_bound: float = 1.25  # a replica takes at most this times its fair share of the requests in flight
    ray_namespace: str = "kvserve"  # the Ray namespace of the fleet's deployments and its record of the config

    def __post_init__(self):
        _validate(self, dict(gateway_replicas=POSITIVE_INT, gateway_cpus=NONNEG_NUMBER, migration_limit=NONNEG_INT,
                             gateway_resources=(lambda v: isinstance(v, dict) and all(
                                 isinstance(k, str) and _is_number(x) and x > 0 for k, x in v.items()),
                                                "a table of resource name -> amount > 0"),
                             route_timeout_s=POSITIVE_NUMBER, health_check_period_s=POSITIVE_NUMBER,
                             health_check_timeout_s=POSITIVE_NUMBER, drain_timeout_s=NONNEG_NUMBER,
                             stats_period_s=POSITIVE_NUMBER, affinity_blocks=POSITIVE_INT,
                             load_bound=(lambda v: _is_number(v) and v >= 1, "a number >= 1")))


def _table(cls, data: dict, where: str):
    """A frozen config dataclass from a TOML table; unknown keys are refused by name."""
    names = set(cls.__dataclass_fields__)
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown {where} keys: {sorted(unknown)}; allowed: {', '.join(sorted(names))}")
    return cls(**data)


# ---- regions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionPolicy:
    """How a region fails over to its peers and comes back to them (service/region_routing.py)."""

    probe_period_s: float = 0.5  # how often each peer is probed (GET <peer>/v1/region/status)
    probe_timeout_s: float = 1.0  # a probe not answered within this failed
    fail_after: int = 3  # failed probes in a row that make a peer DOWN
    stale_after_s: float = 3.0  # ...or this long without a successful probe
    recover_after_s: float = 10.0  # healthy this long, every probe answered, before a peer takes traffic again
    overload: float = 1.0  # a peer at or above this load (1.0: its admission bounds full) takes no forwards
    load_weight_ms: float = 200.0  # round-trip milliseconds one unit of load is worth when ranking peers

    def __post_init__(self):
        if min(self.probe_period_s, self.probe_timeout_s, self.stale_after_s, self.overload) <= 0:
            raise ValueError("probe_period_s, probe_timeout_s, stale_after_s and overload must be > 0")
        if self.fail_after < 1 or self.recover_after_s < 0 or self.load_weight_ms < 0:
            raise ValueError("fail_after must be >= 1, recover_after_s and load_weight_ms >= 0")

    @property
    def detection_bound_s(self) -> float:
        """The longest a dead peer can still look UP."""
        return min(self.fail_after * self.probe_period_s + self.probe_timeout_s, self.stale_after_s)


@dataclass(frozen=True)
class EscrowPolicy:
    """How regions share one budget (metering/escrow.py): each region's own floor, the leases it asks the ledger
    region for, and how often it gives back what it holds unused (`[regions.escrow]`)."""

    floor_fraction: float = 0.1  # of the amount, each region's own for the period
    lease_fraction: float = 0.5  # a lease asks for this share of the pool...
    min_lease_fraction: float = 0.02  # ...and at least this share of the amount (or the pool, if less)
    refill_below_fraction: float = 0.02  # a region asks for more when it can still spend less than this share
    release_period_s: float = 5.0  # how often a region gives back lease it did not need

    def __post_init__(self):
        for name in ("floor_fraction", "lease_fraction", "min_lease_fraction", "refill_below_fraction"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"escrow {name} must be within [0, 1], got {v!r}")
        if self.lease_fraction == 0 and self.min_lease_fraction == 0:
            raise ValueError("escrow leases need lease_fraction or min_lease_fraction above 0")
        if self.release_period_s <= 0:
            raise ValueError("escrow release_period_s must be > 0")


@dataclass(frozen=True)
class RegionPeer:
    """Another region's gateway, as this region reaches it (and, where one file lists every region, the Ray
    cluster a fleet of that region runs on: `kvserve serve --fleet --region NAME` joins it)."""

    name: str  # the region's name, as `local`, `ledger` and `--region` give it
    url: str  # its base URL (the address clients of that region use)
    ray_address: str = ""  # the Ray cluster of the region's fleet; "": a local Ray instance started for it

    def __post_init__(self):
        if not self.name or not str(self.url).startswith(("http://", "https://")):
            raise ConfigError(f"a region peer needs a name and an http(s) URL, got {self.name!r} {self.url!r}")


@dataclass(frozen=True)
class RegionsConfig:
    """The `[regions]` table: this server's region, its peer regions' gateways, and how it fails over to them
    (`[regions.policy]`: service/region_routing.py RegionPolicy). Without `local` and a peer, no regions."""

    local: str = ""  # this server's region (or `kvserve serve --region NAME`)
    peers: tuple[RegionPeer, ...] = ()  # the other regions ([[regions.peers]])
    policy: RegionPolicy = field(default_factory=RegionPolicy)
    forward_timeout_s: float = 30.0  # a forwarded request's connect and first-byte time at most
    # Budgets shared by the regions: the region whose store keeps the ledger of leases ("": each region's
    # budgets are its own), the escrow's policy, and the environment variable holding an admin token of
    # every region's store, with which regions call each other's ledger endpoints.
    ledger: str = ""
    escrow: EscrowPolicy = field(default_factory=EscrowPolicy)
    token_env: str = "KVSERVE_REGION_TOKEN"  # (see ledger)
    ray_address: str = ""  # this region's Ray cluster (its entry's in a file that lists every region)

    def __post_init__(self):
        names = [p.name for p in self.peers]
        if self.local in names or len(set(names)) != len(names):
            raise ConfigError("[regions] peers must have distinct names, none of them the local region's")
        if self.peers and not self.local:
            raise ConfigError("[regions] with peers needs `local`, this region's name")
        if self.ledger and self.ledger not in (self.local, *names):
            raise ConfigError(f"[regions] ledger {self.ledger!r} is neither this region nor one of its peers")
        _validate(self, dict(forward_timeout_s=POSITIVE_NUMBER))

    @property
    def names(self) -> list[str]:
        """Every region, this one first."""
        return [self.local, *(p.name for p in self.peers)]

    @property
    def enabled(self) -> bool:
        return bool(self.local and self.peers)

    @classmethod
    def from_table(cls, data: dict, region: str | None = None) -> "RegionsConfig":
        """`region` (`kvserve serve --region NAME`): this server's region, one of those the table lists; one
        file can then list every region, each server dropping its own from its peers."""
        data = dict(data)
        try:
            policy = _table(RegionPolicy, data.pop("policy", {}), "[regions.policy]")
            escrow = _table(EscrowPolicy, data.pop("escrow", {}), "[regions.escrow]")
            peers = tuple(_table(RegionPeer, p, "[[regions.peers]]") for p in data.pop("peers", []))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[regions]: {e}") from None
        if region is not None:
            if region not in [p.name for p in peers]:
                raise ConfigError(f"--region {region}: the [regions] table lists no region of that name (it lists "
                                  f"{', '.join(p.name for p in peers) or 'none'})")
            data["local"] = region
        own = next((p for p in peers if p.name == data.get("local")), None)
        if own is not None and own.ray_address and "ray_address" not in data:
            data["ray_address"] = own.ray_address
        peers = tuple(p for p in peers if p.name != data.get("local"))
        return _table(cls, {**data, "peers": peers, "policy": policy, "escrow": escrow}, "[regions]")


# ---- the batch API ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchConfig:
    """The `[batch]` table: file limits and how much of the engines batch lines may take at once."""

    max_file_lines: int = 50_000  # lines of an input file at most
    max_file_bytes: int = 200 * 1024 * 1024  # bytes of an uploaded file at most
    max_inflight: int = 16  # lines in flight in this server, over all batches (shared round-robin by tenant)
    max_inflight_per_batch: int = 8  # lines of one batch in flight at most
    lease_s: float = 15.0  # a line's runner holds it this long, renewed while it runs; then another may take it
    poll_s: float = 0.25  # how often the runner looks for new lines, cancellations and expiry

    def __post_init__(self):
        _validate(self, dict(max_file_lines=POSITIVE_INT, max_file_bytes=POSITIVE_INT, max_inflight=POSITIVE_INT,
                             max_inflight_per_batch=POSITIVE_INT, lease_s=POSITIVE_NUMBER, poll_s=POSITIVE_NUMBER))


# ---- the server ------------------------------------------------------------------------------


REASONING_PARSERS = ("auto", "think", "none")
TOOL_CALL_PARSERS = ("auto", "hermes", "mistral", "llama3_json")  # service/tool_formats.py has one of each


@dataclass(frozen=True)
class ServedModel:
    """One `[[models]]` entry of the server TOML: where the weights are and the engine arguments (checked
    when the entry is built: a bad one fails at start, naming the model, the key and the value)."""

    id: str  # the name requests give as `model` (not "auto")
    source: str  # a .gguf path, a Hugging Face checkpoint directory, a catalog id or pkg:<package>[/<file>]
    role: str = ""  # "fast" | "capable" | "" (model="auto" routing)
    description: str = ""  # free text for the file's readers (what the weights are)
    engine_args: dict = field(default_factory=dict)  # vLLM-style flat args; `interactive`/`batch` tables are TierLimits
    version: str = "1"  # a label for this model's weights/config; responses carry it (x-kvserve-model-version)
    # Whether the model thinks in <think>...</think> blocks, which chat responses return apart as
    # reasoning_content (docs/reasoning.md): "auto" (its chat template writes <think> and its tokenizer spells
    # both tags), "think" (it does, whatever the template says) or "none" (its output is all answer).
    reasoning_parser: str = "auto"
    # The format the model writes tool calls in (docs/structured-outputs.md): "hermes" (<tool_call> blocks:
    # Qwen, NousResearch), "mistral" ([TOOL_CALLS] and a JSON list), "llama3_json" (Llama 3.1/3.2's JSON with
    # "parameters"), or "auto": the one its chat template writes, else hermes.
    tool_call_parser: str = "auto"
    # "eager": loaded when the server starts, and kept; "on_demand": loaded by its first request, and unloaded while
    # idle when another model needs its memory ([server] model_memory)
    load: str = "eager"
    fleet: ModelFleet = field(default_factory=ModelFleet)
    price: ModelPrice = field(default_factory=ModelPrice)

    def __post_init__(self):
        _validate(self, dict(id=(lambda v: isinstance(v, str) and v != "" and v != "auto",
                                 "a non-empty name other than 'auto'"),
                             reasoning_parser=(lambda v: v in REASONING_PARSERS, ", ".join(REASONING_PARSERS)),
                             tool_call_parser=(lambda v: v in TOOL_CALL_PARSERS, ", ".join(TOOL_CALL_PARSERS)),
                             version=(lambda v: isinstance(v, str) and v != "", "a non-empty string"),
                             source=(lambda v: isinstance(v, str) and v != "", "a path, a catalog id or pkg:..."),
                             role=(lambda v: v in ("", "fast", "capable"), "fast, capable or empty"),
                             load=(lambda v: v in ("eager", "on_demand"), "eager or on_demand")))
        try:
            tp = self.engine_config().tensor_parallel_size
        except ConfigError as e:
            raise ConfigError(f"models[{self.id}]: {e}") from None
        if tp > 1 and self.fleet.gpus and self.fleet.gpus != tp:
            raise ConfigError(f"models[{self.id}]: [models.fleet] gpus = {self.fleet.gpus} with tensor_parallel_size "
                              f"= {tp}: a replica's ranks take one GPU each (gpus = {tp}, or 0 on CPUs)")
        if tp > 1 and not (self.fleet.cpus or self.fleet.gpus):
            raise ConfigError(f"models[{self.id}]: tensor_parallel_size = {tp} places each rank in a bundle of its "
                              "own ([models.fleet] cpus each, and one GPU with gpus): cpus = 0 and gpus = 0 leave "
                              "the bundles empty")

    def engine_config(self) -> EngineConfig:
        return engine_config_from_kwargs(self.id, **self.engine_args)


@dataclass(frozen=True)
class AutoRoutingConfig:
    """model="auto": batch -> fast; short prompts -> fast; else capable while its queue is short and it is ready."""

    short_prompt_chars: int = 256  # a prompt shorter than this many characters goes to the fast model
    capable_max_queue_depth: int = 4  # a longer one goes to the capable model while its queue is shorter

    def __post_init__(self):
        _validate(self, dict(short_prompt_chars=NONNEG_INT, capable_max_queue_depth=NONNEG_INT))


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the address the server listens on
    port: int = 8000  # its port
    config_path: str | None = None  # the TOML this was read from (None: the packaged default models)
    models: list[ServedModel] = field(default_factory=list)
    home: str | None = None  # data directory; None: $KVSERVE_HOME or ~/.kvserve
    # the store, an SQLite file or a postgresql:// URL; None: $KVSERVE_DB, else <home>/kvserve.db
    db_path: str | None = None
    stall_timeout_s: float = 30.0  # /health is 503 when work is pending and no step finished for this long
    shutdown_timeout_s: float = 30.0  # SIGTERM: grace period for running requests
    # Per tier, the time to first token aimed at: a recent p50 above it makes x-kvserve-load "high" (the fleet's
    # autoscaler takes the interactive one as its TTFT target)
    ttft_target_ms: dict = field(default_factory=lambda: {"interactive": 500.0, "batch": 10_000.0})
    max_body_bytes: int = 1 << 20  # a request body above this is refused (413)
    # Models loaded by demand (`load = "on_demand"`, service/residency.py): the bytes the served models' weights and
    # KV pools may hold together (None: no bound); the least recently used idle one is unloaded to make room
    model_memory: int | None = None
    load_wait_s: float = 30.0  # a request for a model not loaded waits this long for its load, then 503 model_warming
    default_max_tokens: int = 1024  # when a request sets no max_tokens (also capped by the remaining context)
    metrics_window_s: float = 60.0  # the window of recent requests and steps /v1/metrics/serving and load read
    load_sample_interval_s: float = 5.0  # how often the server samples KV use and queues for the dashboard
    load_history_samples: int = 720  # samples kept per model (720 x 5 s: the last hour)
    auth_cache_ttl_s: float = 5.0  # a token revoked by another process (the CLI) is refused within this time
    load_high_fraction: float = 0.5  # x-kvserve-load "high" at this fraction of a tier's queue bound
    load_shedding_fraction: float = 0.9  # "shedding" at this fraction
    # prompt_cache_retention: the longest TTL a tenant may ask for (seconds; a tenant named in
    # prompt_cache_retention_limits has its own), beyond which the request is refused (400)
    prompt_cache_max_retention_s: float = 86_400.0
    prompt_cache_retention_limits: dict = field(default_factory=dict)  # tenant -> its own longest TTL (seconds)
    auto: AutoRoutingConfig = field(default_factory=AutoRoutingConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    regions: RegionsConfig = field(default_factory=RegionsConfig)
    log_level: str = "info"  # critical, error, warning, info, debug or trace

    def retention_limit_s(self, tenant: str) -> float:
        """The longest prompt_cache_retention this tenant may ask for."""
        return float(self.prompt_cache_retention_limits.get(tenant, self.prompt_cache_max_retention_s))

    def __post_init__(self):
        ids = [m.id for m in self.models]
        _validate(self, dict(
            port=(lambda v: _is_int(v) and 0 <= v < 65536, "an integer in [0, 65535]"),
            models=(lambda v: len(set(ids)) == len(ids), "models with distinct ids"),
            stall_timeout_s=POSITIVE_NUMBER, shutdown_timeout_s=NONNEG_NUMBER,
            ttft_target_ms=(lambda v: isinstance(v, dict) and set(v) <= set(TIER_NAMES)
                            and all(_is_number(x) and x > 0 for x in v.values()),
                            "a table of interactive/batch -> milliseconds > 0"),
            max_body_bytes=POSITIVE_INT, default_max_tokens=POSITIVE_INT, metrics_window_s=POSITIVE_NUMBER,
            model_memory=(lambda v: v is None or (_is_int(v) and v > 0), "a byte size such as 24GiB, or unset"),
            load_wait_s=NONNEG_NUMBER,
            load_sample_interval_s=POSITIVE_NUMBER, load_history_samples=POSITIVE_INT,
            auth_cache_ttl_s=NONNEG_NUMBER, load_high_fraction=FRACTION, load_shedding_fraction=FRACTION,
            prompt_cache_max_retention_s=NONNEG_NUMBER,
            prompt_cache_retention_limits=(lambda v: isinstance(v, dict) and all(
                isinstance(k, str) and _is_number(x) and x >= 0 for k, x in v.items()), "a table of tenant = seconds"),
            log_level=(lambda v: v in ("critical", "error", "warning", "info", "debug", "trace"),
                       "critical, error, warning, info, debug or trace")))

    @classmethod
    def from_toml(cls, path: str | None = None, **overrides) -> "ServerConfig":
        """Read `[server]` and `[[models]]` from a TOML file (default: the packaged models file).

        Keys of a `[[models]]` entry other than id/source/role/description/install are engine
        arguments for that model (max_num_seqs, kv_cache_memory, max_model_len, ...), and its
        `interactive` / `batch` tables are the tier admission limits (TierLimits fields).
        """
        import tomllib

        data = tomllib.loads(Path(path or DEFAULT_CONFIG).read_text())
        server = dict(data.get("server", {}))
        auto = server.pop("auto", {})
        for key in ("max_body_bytes", "model_memory"):
            if key in server and isinstance(server[key], str):
                server[key] = parse_bytes(server[key])
        models_data = data.get("models")
        if not models_data and path is not None:
            models_data = tomllib.loads(Path(DEFAULT_CONFIG).read_text()).get("models", [])
        known = {"id", "source", "role", "description", "install", "version", "reasoning_parser", "tool_call_parser",
                 "load", "fleet", "price"}
        models = []
        for i, m in enumerate(models_data or []):
            missing = [k for k in ("id", "source") if k not in m]
            if missing:
                raise ConfigError(f"[[models]] entry {i} in {path or DEFAULT_CONFIG} has no {' or '.join(missing)}")
            models.append(ServedModel(id=m["id"], source=m["source"], role=m.get("role", ""),
                                      description=m.get("description", ""), version=str(m.get("version", "1")),
                                      reasoning_parser=m.get("reasoning_parser", "auto"),
                                      tool_call_parser=m.get("tool_call_parser", "auto"),
                                      load=m.get("load", "eager"),
                                      fleet=_table(ModelFleet, m.get("fleet", {}), f"[models.fleet] ({m['id']})"),
                                      price=_table(ModelPrice, m.get("price", {}), f"[models.price] ({m['id']})"),
                                      engine_args={k: v for k, v in m.items() if k not in known}))
        fleet = _table(FleetConfig, data.get("fleet", {}), "[fleet]")
        batch = _table(BatchConfig, data.get("batch", {}), "[batch]")
        regions = RegionsConfig.from_table(data.get("regions", {}), overrides.pop("region", None))
        unknown_tables = set(data) - {"server", "models", "fleet", "batch", "regions"}
        if unknown_tables:
            raise ConfigError(f"unknown tables in {path}: {sorted(unknown_tables)}; allowed: server, models, fleet, "
                              "batch, regions")
        names = {f for f in cls.__dataclass_fields__} - {"models", "auto", "config_path", "fleet", "batch", "regions"}
        unknown = set(server) - names
        if unknown:
            raise ConfigError(f"unknown [server] keys in {path}: {sorted(unknown)}; allowed: {', '.join(sorted(names))}")
        server.update({k: v for k, v in overrides.items() if v is not None})
        return cls(config_path=str(path) if path else None, models=models, auto=_table(AutoRoutingConfig, auto, "[server.auto]"),
                   fleet=fleet, batch=batch, regions=regions, **server)
