"""Step time from the roofline: how long one engine step of a given shape takes on a given deployment.

A step computes `new` tokens for each scheduled sequence (a prefill chunk, or one decode token) on top of
the `start` tokens already in its KV cache, and samples one token for those that reach their end. Its
time is a roofline per kind of operation, summed (the GEMMs and attention run one after the other):

    seconds = host + max(GEMM FLOPs / FLOP/s, weight bytes / bandwidth)
                   + max(attention FLOPs / FLOP/s, KV bytes / bandwidth) + tensor-parallel comm
    host    = overhead + per_seq x sequences (+ prefill_overhead when a prompt chunk is in the step)

with FLOP/s = peak x flop_eff and bandwidth = datasheet x bw_eff (a measured machine has its own FLOP/s
for attention: on a CPU its kernels run far from the GEMMs' rate; and its GEMMs' rate falls for steps
of few tokens: rate x tokens / (tokens + gemm_half_rate_tokens)).

- FLOPs: 2 x (active matmul weights except the head: a mixture of experts' k routed experts and its
  shared ones, not all of them) per computed token, 2 x vocab x hidden per sampled token (the head), and
  attention's 4 x heads x head_dim per (query, key) pair, the keys a sliding layer sees capped at its window.
- Bytes: every weight once per step (a step reads the whole model whatever its batch: why decode is
  bandwidth-bound and batching pays), but of a mixture of experts' routed experts only those the step's
  tokens are expected to touch (experts_touched), plus each sequence's KV cache read once and its new
  tokens' KV written.
- Tensor parallelism: two all-reduces per layer of tokens x hidden bf16 values, a ring's
  2 (tp - 1) / tp of that over the link, plus a fixed latency per all-reduce.

Where it is approximate: within a kind, compute and memory traffic overlap perfectly (the max); small GEMMs reach the
same efficiency as large ones, attention's memory traffic is its KV read alone, and the host's own time
(scheduling, sampling, detokenizing) is the overhead and per-sequence terms. On GPUs those efficiencies
are assumptions (GPU_EFFICIENCY); on a calibrated CPU they are fitted from the real engine's steps
(planning/calibrate.py), which is why the calibrated machine's predictions are the ones to trust.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.planning.memory import WEIGHT_ONLY, dtype_bytes, kv_bytes_per_token, parameter_count
from kvserve.planning.specs import AcceleratorSpec, ModelSpec


def experts_touched(num_experts: int, experts_per_token: int, tokens: int) -> float:
    """Expected distinct experts of one MoE layer that `tokens` tokens are routed to, each to
    `experts_per_token` (k) of `num_experts` (E), uniformly and independently: E (1 - (1 - k/E)^tokens).

    Why: a step reads an expert's weights once if any of its tokens goes there, so a decode step of few
    sequences reads k experts a token (far less than the model) and a large batch or a prompt chunk reads
    nearly all E. It is k at one token, rises with tokens and approaches E. Real routers are skewed, which
    touches fewer distinct experts; uniform routing is the cautious (more bytes) end.
    """
    if tokens <= 0:
        return 0.0
    return num_experts * (1 - (1 - experts_per_token / num_experts) ** tokens)


@dataclass(frozen=True)
class Efficiency:
    """How much of the datasheet a real engine gets, and the host's share of a step."""

    flops: float = 0.6  # of dense peak, large GEMMs (published MFU of tuned engines: 0.4-0.7)
    bandwidth: float = 0.8  # of datasheet bandwidth (STREAM-like reads reach 0.8-0.9 on HBM)
    step_overhead_s: float = 0.002  # per step: launches, scheduling, sampling (CUDA graphs cut this)
    per_seq_s: float = 2e-5  # per scheduled sequence: its share of scheduling, sampling, output
    prefill_overhead_s: float = 0.0  # per step with a prompt chunk (a separate attention path, masks)
    # GEMMs of few rows run below the FLOP/s of large ones: at this many tokens in a step they reach half
    # of it (rate x tokens / (tokens + this)). 0 for GPUs (an assumption); fitted on a calibrated machine.
    gemm_half_rate_tokens: float = 0.0
    allreduce_latency_s: float = 1e-5  # per all-reduce, NVLink-class links

    def __post_init__(self):
        if not (0 < self.flops <= 1 and 0 < self.bandwidth <= 1):
            raise ValueError("efficiencies must be in (0, 1]")
        if min(self.step_overhead_s, self.per_seq_s, self.prefill_overhead_s, self.allreduce_latency_s,
               self.gemm_half_rate_tokens) < 0:
            raise ValueError("overheads must be >= 0")


GPU_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class Work:
    """One scheduled sequence's share of a step."""

    new: int  # tokens computed
    start: int  # tokens already cached before them
    sample: bool = True


@dataclass(frozen=True)
class StepParts:
    linear_flops: float  # GEMMs (the layers' weights and the head)
    weight_bytes: float
    attention_flops: float
    kv_bytes: float  # KV read and written
    tokens: int
    seqs: int
    sampled: int  # sequences that sample a token (tokens delivered)
    has_prefill: bool


@dataclass(frozen=True)
class StepCost:
    seconds: float
    compute_s: float
    memory_s: float
    comm_s: float
    host_s: float

    @property
    def bound(self) -> str:
        """What binds this step: compute, bandwidth (weights and KV reads), or the host."""
        parts = {"compute": self.compute_s, "bandwidth": self.memory_s, "host": self.host_s,
                 "interconnect": self.comm_s}
        return max(parts, key=parts.get)


@dataclass(frozen=True)
class Deployment:
    """One replica: a model on `tp` devices with its weight and KV dtypes, serving up to `max_model_len`
    tokens a request (None: the model's own context length)."""

    model: ModelSpec
    accelerator: AcceleratorSpec
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    max_model_len: int | None = None

    def __post_init__(self):
        dtype_bytes(self.weight_dtype), dtype_bytes(self.kv_dtype)
        if self.tp < 1:
            raise ValueError("tp must be >= 1")
        if self.kv_dtype in WEIGHT_ONLY:
            raise ValueError(f"{self.kv_dtype} is a weight format, not a KV cache dtype")
        n, ctx = self.max_model_len, self.model.max_position_embeddings
        if n is not None and (not isinstance(n, int) or not 0 < n <= ctx):
            raise ValueError(f"max_model_len must be a whole number of tokens from 1 to {self.model.name}'s context "
                             f"length ({ctx:,}), not {n!r}")

    @property
    def context_length(self) -> int:
        """Prompt and output tokens one request may hold together: what the replica's scheduler refuses past."""
        return self.model.max_position_embeddings if self.max_model_len is None else self.max_model_len

    @property
    def label(self) -> str:
        return (f"{self.accelerator.name} x{self.tp} {self.weight_dtype} weights, {self.kv_dtype} KV")


class StepModel:
    """Seconds per step for one deployment; the simulator and the planner's estimates both call it."""

    def __init__(self, d: Deployment, eff: Efficiency = GPU_EFFICIENCY):
        m, acc = d.model, d.accelerator
        self.deployment, self.eff = d, eff
        params = parameter_count(m)
        wb = dtype_bytes(d.weight_dtype)
        self._head = params.head
        self._body_per_token = params.layer_matmul  # matmul weights of the layers a token is multiplied by
        self._expert_bytes = params.expert * wb / d.tp  # one routed expert over the MoE layers (0: dense)
        self._num_experts, self._k = m.num_experts, m.experts_per_token
        dense = params.total - params.embedding - params.expert * m.num_experts
        self._dense_bytes = dense * wb / d.tp  # read once per step whatever the batch
        self._kv_token_bytes = kv_bytes_per_token(m, d.kv_dtype, d.tp)
        self._attn = 4 * m.num_heads * m.head_dim / d.tp  # FLOPs per (query, key) pair per layer
        self._layers, self._sliding, self._window = m.num_layers, m.num_sliding_layers, m.sliding_window
        fp8_compute = d.weight_dtype == "fp8" and acc.fp8_flops is not None
        self._flops = acc.flops(fp8_compute) * eff.flops
        self._attn_flops = (acc.attention_flops or acc.flops(fp8_compute)) * eff.flops
        self._bandwidth = acc.memory_bandwidth * eff.bandwidth
        self._tp, self._hidden = d.tp, m.hidden_size
        self._link = acc.interconnect_bandwidth or acc.memory_bandwidth / 10

    def _pairs(self, new: int, start: int) -> float:
        """(query, key) pairs of `new` queries after `start` cached keys, summed over layers."""
        full = new * start + new * (new + 1) / 2
        if not self._sliding:
            return self._layers * full
        w = self._window
        capped = sum(min(start + i + 1, w) for i in range(new)) if new < 64 else \
            new * min(start + (new + 1) / 2, w)
        return (self._layers - self._sliding) * full + self._sliding * capped

    def parts(self, work: Iterable[Work]) -> StepParts:
        """What a step moves and computes, before any speed is applied."""
        tokens = sampled = seqs = prefills = 0
        pairs = kv_read = 0.0
        for w in work:
            seqs += 1
            tokens += w.new
            sampled += w.sample
            prefills += w.new > 1
            pairs += self._pairs(w.new, w.start)
            kv_read += w.start + w.new
        experts = experts_touched(self._num_experts, self._k, tokens) if self._expert_bytes else 0.0
        return StepParts(
            linear_flops=(2 * self._body_per_token * tokens + 2 * self._head * sampled) / self._tp,
            weight_bytes=(self._dense_bytes + self._expert_bytes * experts) if seqs else 0.0,
            attention_flops=self._attn * pairs, kv_bytes=kv_read * self._kv_token_bytes,
            tokens=tokens, seqs=seqs, sampled=sampled, has_prefill=prefills > 0)

    def cost(self, work: Iterable[Work]) -> StepCost:
        p = self.parts(work)
        if not p.seqs:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        eff = self.eff
        gemm_rate = self._flops * p.tokens / (p.tokens + eff.gemm_half_rate_tokens)
        gemm_c, gemm_m = p.linear_flops / gemm_rate, p.weight_bytes / self._bandwidth
        attn_c, attn_m = p.attention_flops / self._attn_flops, p.kv_bytes / self._bandwidth
        compute_s = (gemm_c if gemm_c >= gemm_m else 0.0) + (attn_c if attn_c >= attn_m else 0.0)
        memory_s = (gemm_m if gemm_m > gemm_c else 0.0) + (attn_m if attn_m > attn_c else 0.0)
        comm_s = 0.0
        if self._tp > 1:
            msg = p.tokens * self._hidden * 2
            comm_s = 2 * self._layers * (2 * (self._tp - 1) / self._tp * msg / self._link + eff.allreduce_latency_s)
        host_s = eff.step_overhead_s + eff.per_seq_s * p.seqs + eff.prefill_overhead_s * p.has_prefill
        return StepCost(host_s + compute_s + memory_s + comm_s, compute_s, memory_s, comm_s, host_s)

    def seconds(self, work: Iterable[Work]) -> float:
        return self.cost(work).seconds

    def decode_step(self, batch: int, context: int) -> StepCost:
        """A step of `batch` sequences decoding one token each at `context` tokens."""
        return self.cost([Work(1, context - 1)] * batch)

    def prefill(self, prompt: int, chunk: int) -> float:
        """Seconds to prefill one `prompt`-token prompt alone in chunks of `chunk` tokens."""
        total, start = 0.0, 0
        while start < prompt:
            n = min(chunk, prompt - start)
            total += self.seconds([Work(n, start, sample=start + n >= prompt)])
            start += n
        return total

    def block_copy_seconds(self, blocks: int, block_size: int, across_host: bool) -> float:
        """Moving `blocks` KV blocks of every layer (see kv_copy_seconds)."""
        return self.kv_copy_seconds(blocks * block_size * self._kv_token_bytes, across_host)

    def kv_copy_seconds(self, nbytes: float, across_host: bool) -> float:
        """Moving `nbytes` of KV per device: within the device (copy-on-write) or to/from host memory (swap)."""
        return nbytes / (self._link if across_host else self._bandwidth / 2)
