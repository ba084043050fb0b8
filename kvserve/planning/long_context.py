"""Long contexts: what one sequence's KV costs at N tokens, and how many such sequences each tier holds.

A layer can keep its keys and values three ways, each counted here in pages as the engine counts them
(planning/memory.py, engine/kv/groups.py), for a sequence decoding at N tokens:
- full attention: every layer keeps every token (what exact attention needs where the model has no window);
- the model's native window (Gemma 3): its sliding layers keep only what their window reaches;
- a StreamingLLM window (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
  arXiv:2309.17453): the layers that would attend to everything keep the first `sinks` tokens (in their own
  block) and the last W. The engine is to offer it as an opt-in; it changes what the model attends to, so it
  answers "what would it take to hold N tokens", not "the same outputs for less memory".

Tiers: the device pool of one replica (memory.memory_plan at the fewest devices that hold the weights, or a
given tp), host memory and disk, the latter two holding one copy of a sequence's KV (every KV head once).
Bringing a sequence back to the device costs its bytes over the tier's bandwidth; disk goes through host
memory, so it moves at the slower of the two. Those bandwidths are assumptions, not measurements.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.engine.kv.groups import KVLayout
from kvserve.planning.memory import (DISK_GBS, GIB, HOST_GBS, WEIGHT_ONLY, dtype_bytes, kv_bytes_per_token_layer,
                                     kv_layout, layer_windows, memory_plan)
from kvserve.planning.search import TP_DEGREES
from kvserve.planning.specs import AcceleratorSpec, ModelSpec



@dataclass(frozen=True)
class KVPolicy:
    """Which tokens' keys and values each layer keeps."""

    name: str
    layout: KVLayout
    sinks: tuple[int, ...] = ()  # per group: leading tokens kept besides its window (StreamingLLM); (): none

    def __post_init__(self):
        if self.sinks and (len(self.sinks) != self.layout.num_groups or min(self.sinks) < 0):
            raise ValueError("sinks: one non-negative count per KV group")

    def pages(self, tokens: int, block_size: int) -> int:
        """Pages one sequence holds while decoding at `tokens`: the groups' windows, plus the sink blocks a
        group has passed (those inside its window are counted once)."""
        held = self.layout.pages_held(tokens, block_size, new_tokens=1)
        for group, sinks in zip(self.layout.groups, self.sinks):
            held += min(-(-sinks // block_size), group.first_needed_block(tokens - 1, block_size))
        return held

    def sequence_bytes(self, m: ModelSpec, tokens: int, kv_dtype: str, block_size: int) -> float:
        """One copy of a sequence's KV (every KV head once) at `tokens`."""
        return self.pages(tokens, block_size) * self.layout.page_bytes(block_size,
                                                                       kv_bytes_per_token_layer(m, kv_dtype))


def policies(m: ModelSpec, window: int | None = None, sinks: int = 0) -> list[KVPolicy]:
    """Full attention; the model's native window if it has one; sinks + `window` on the layers that would
    attend to everything (a native window narrower than `window` keeps its own), if `window`."""
    if (window is not None and window <= 0) or sinks < 0:
        raise ValueError("the window must be positive and sinks non-negative")
    native = layer_windows(m)
    out = [KVPolicy("full attention", KVLayout.for_windows([None] * m.num_layers))]
    if m.sliding_window is not None:
        out.append(KVPolicy(f"native window {m.sliding_window:,}", kv_layout(m)))
    if window:
        layout = KVLayout.for_windows([window if w is None else min(w, window) for w in native])
        per_group = tuple(sinks if any(native[layer] is None for layer in g.layers) else 0 for g in layout.groups)
        out.append(KVPolicy(f"sinks {sinks} + window {window:,} (StreamingLLM, opt-in)", layout,
                            per_group if any(per_group) else ()))
    return out


@dataclass(frozen=True)
class Tiers:
    """What sits behind the device: host memory and disk given to KV, and how fast each reaches the device."""

    host_bytes: float = 1024 * GIB
    disk_bytes: float = 8000 * GIB
    host_bandwidth: float = HOST_GBS * 1e9  # bytes/s, host memory to device
    disk_bandwidth: float = DISK_GBS * 1e9  # bytes/s, disk to host memory

    def __post_init__(self):
        if self.host_bytes < 0 or self.disk_bytes < 0 or self.host_bandwidth <= 0 or self.disk_bandwidth <= 0:
            raise ValueError("tier sizes must be non-negative and bandwidths positive")


@dataclass(frozen=True)
class TierFit:
    """How many sequences one tier holds, and what bringing one to the device costs."""

    tier: str  # "device", "host" or "disk"
    where: str  # what holds them: "h200 x2 (fewest for the weights)", "1,024 GiB"
    capacity_bytes: float  # what the tier gives KV (device: the replica's pool, over its tp devices)
    sequences: int
    load_s: float | None = None  # one sequence's KV to the device from here (None: it is there)
    bandwidth: float | None = None  # bytes/s that load_s assumes


@dataclass(frozen=True)
class ContextRow:
    """One KV dtype under one policy."""

    kv_dtype: str
    policy: str
    pages_per_sequence: int
    page_bytes: float  # every KV head once
    bytes_per_sequence: float
    tiers: tuple[TierFit, ...]


@dataclass(frozen=True)
class LongContextReport:
    model: str
    tokens: int
    block_size: int
    weight_dtype: str
    rows: tuple[ContextRow, ...]
    tiers: Tiers
    notes: tuple[str, ...]


def device_fits(m: ModelSpec, acc: AcceleratorSpec, policy: KVPolicy, tokens: int, kv_dtype: str,
                weight_dtype: str = "bf16", tp: int | None = None, block_size: int = 16) -> list[TierFit]:
    """One replica's pool at `tp`; by default at the fewest devices of a node that leave room for KV after
    the weights and, when that holds no sequence, also at the fewest that hold one."""
    need = policy.pages(tokens, block_size)

    def fit(t: int, label: str = "") -> TierFit:
        plan = memory_plan(m, acc, t, weight_dtype, kv_dtype, block_size=block_size, layout=policy.layout)
        return TierFit("device", f"{acc.name} x{t}{label}", plan.kv_bytes * t, plan.usable_pages // need)

    if tp is not None:
        return [fit(tp)]
    fits = [fit(t) for t in TP_DEGREES if t <= acc.max_per_node and m.num_heads % t == 0]
    roomy = [f for f in fits if f.capacity_bytes > 0]
    if not roomy:
        return [TierFit("device", f"{acc.name}: the weights leave no room for KV on a node", 0.0, 0)]
    first = replace(roomy[0], where=roomy[0].where + " (fewest for the weights)")
    if first.sequences:
        return [first]
    holding = next((f for f in roomy if f.sequences), None)
    return [first, replace(holding, where=holding.where + " (fewest to hold one)") if holding else
            TierFit("device", f"{acc.name}: no tp within a node holds one", 0.0, 0)]


def long_context(m: ModelSpec, tokens: int, accelerators: list[AcceleratorSpec], kv_dtypes=("bf16", "fp8"),
                 window: int | None = 4096, sinks: int = 4, tiers: Tiers = Tiers(), tp: int | None = None,
                 weight_dtype: str = "bf16", block_size: int = 16) -> LongContextReport:
    """KV per sequence at `tokens` under each policy and KV dtype, and what each tier holds of it."""
    if tokens < 1 or block_size < 1 or (tp is not None and tp < 1):
        raise ValueError("tokens, block_size and tp must be positive")
    for d in kv_dtypes:
        dtype_bytes(d)
        if d in WEIGHT_ONLY:
            raise ValueError(f"{d} is a weight format, not a KV cache dtype")
    rows = []
    for kv_dtype in kv_dtypes:
        for policy in policies(m, window, sinks):
            seq = policy.sequence_bytes(m, tokens, kv_dtype, block_size)
            fits = [f for acc in accelerators
                    for f in device_fits(m, acc, policy, tokens, kv_dtype, weight_dtype, tp, block_size)]
            disk_bw = min(tiers.disk_bandwidth, tiers.host_bandwidth)
            fits += [TierFit("host", f"host memory, {tiers.host_bytes / GIB:,.0f} GiB", tiers.host_bytes,
                             int(tiers.host_bytes // seq), seq / tiers.host_bandwidth, tiers.host_bandwidth),
                     TierFit("disk", f"disk, {tiers.disk_bytes / GIB:,.0f} GiB", tiers.disk_bytes,
                             int(tiers.disk_bytes // seq), seq / disk_bw, disk_bw)]
            pages = policy.pages(tokens, block_size)
            rows.append(ContextRow(kv_dtype, policy.name, pages, seq / pages, seq, tuple(fits)))
    notes = []
    if tokens > m.max_position_embeddings:
        notes.append(f"{tokens:,} tokens is past {m.name}'s trained context ({m.max_position_embeddings:,}): the "
                     f"memory arithmetic holds, the quality of its outputs there is not claimed")
    notes.append("device: one replica's KV pool, its tp devices together, after the weights and the runtime "
                 "reserve at 90% of device memory (planning/memory.py)")
    if window:
        notes.append("StreamingLLM (sinks + window) is an opt-in: attention past the window is dropped, so outputs "
                     "differ from full attention's")
    notes.append(f"bandwidths are assumptions, not measurements: host to device {tiers.host_bandwidth / 1e9:g} GB/s, "
                 f"disk to host {tiers.disk_bandwidth / 1e9:g} GB/s (disk reaches the device through host memory)")
    if any(d not in ("fp32", "bf16", "fp16") for d in kv_dtypes):
        notes.append("an fp8 KV cache halves the bytes; its effect on quality at this length is not measured here")
    return LongContextReport(m.name, tokens, block_size, weight_dtype, tuple(rows), tiers, tuple(notes))
