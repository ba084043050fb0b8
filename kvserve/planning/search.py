"""`kvserve plan`'s search: the cheapest fleet that carries an offered load within its SLOs.

For every accelerator, tensor-parallel degree, weight and KV dtype and `max_num_seqs`, a closed-form
steady state of one replica (below) gives its capacity under the SLOs; capacity and price give the number
of replicas and the cost, and the cheapest candidates are then checked by the simulator, which drives
the real scheduler over a Poisson trace at the per-replica load (adding replicas while it misses).

The steady state of a replica decoding `b` sequences at a time, requests of P prompt and D output tokens
arriving at rate lambda: a decode step of b sequences at the mean context P + D/2 takes s(b); a request's
prefill adds t_p to the steps it shares; so prefill takes lambda t_p of the time, a token comes every
TPOT = s(b) / (1 - lambda t_p), and by Little's law b = lambda D TPOT, which gives
lambda(b) = b / (D s(b) + b t_p). TTFT ~ half a step of waiting plus the prefill's own steps. The
largest b whose TPOT and TTFT meet the SLOs (and whose sequences fit in the KV pool and max_num_seqs)
sets the capacity, planned at `utilization` of it for headroom.

Batch-tier work has no latency SLO: it fills the interactive replicas' headroom first, then runs on
replicas of its own at their largest batch.

Redundancy: with `regions` R > 1, each region is sized to carry 1/(R-1) of the load (any one region can
fail); within a region, spare replicas are added until the chance that enough replicas are up (each up
with probability `replica_availability`, independently) reaches the availability target.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from kvserve.config import Priority, SchedulerConfig, TierLimits
from kvserve.engine.kv.groups import KVLayout
from kvserve.planning.memory import DISK_GBS, WEIGHT_ONLY, MemoryPlan, memory_plan
from kvserve.planning.roofline import GPU_EFFICIENCY, Deployment, Efficiency, StepModel, Work
from kvserve.planning.simulator import SimResult, Simulator, percentile
from kvserve.planning.specs import AcceleratorSpec, ModelSpec
from kvserve.planning.traces import LengthDist, Workload, poisson

TP_DEGREES = (1, 2, 4, 8)
MAX_NUM_SEQS = (8, 16, 32, 64, 128, 256, 512)
DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class SLO:
    """An interactive latency objective: `metric` ("ttft" | "tpot") at `percentile` within `seconds`."""

    metric: str
    percentile: float
    seconds: float

    def __post_init__(self):
        if self.metric not in ("ttft", "tpot") or not 0 < self.percentile < 100 or self.seconds <= 0:
            raise ValueError(f"an SLO is ttft or tpot, a percentile in (0, 100) and a positive time: {self}")

    def __str__(self) -> str:
        return f"{self.metric.upper()} p{self.percentile:g} <= {self.seconds * 1000:g} ms"


@dataclass(frozen=True)
class Load:
    """The offered load: requests per minute, token lengths and the share that is batch-tier work."""

    requests_per_min: float
    prompt: LengthDist
    output: LengthDist
    batch_share: float = 0.0

    def __post_init__(self):
        if self.requests_per_min <= 0 or not 0 <= self.batch_share <= 1:
            raise ValueError("the load needs a positive rate and a batch share in [0, 1]")

    def rate(self, tier: Priority) -> float:
        share = self.batch_share if tier is Priority.BATCH else 1 - self.batch_share
        return self.requests_per_min / 60 * share


@dataclass(frozen=True)
class Redundancy:
    regions: int = 1
    availability: float | None = None  # target, e.g. 0.999
    replica_availability: float = 0.99  # assumed chance a replica is up (host, GPU, software)

    def __post_init__(self):
        if self.regions < 1 or (self.availability is not None and not 0 < self.availability < 1) \
                or not 0 < self.replica_availability < 1:
            raise ValueError("regions >= 1, availabilities in (0, 1)")


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    max_num_seqs: int
    memory: MemoryPlan
    capacity_per_s: float  # interactive requests/s one replica carries within the SLOs (0: it cannot)
    batch: int  # decode batch at that capacity
    ttft_s: float
    tpot_s: float
    binds: str  # what stops a larger batch
    throughput_per_s: float  # requests/s at the replica's largest batch, ignoring latency (batch tier)
    misses: float = 1.0  # 1 when the SLOs are met; else how far the best point is above them (ratio)
    draft: int = 0  # the draft length speculative decoding runs at that batch (0: none)


@dataclass
class Plan:
    candidate: Candidate
    replicas: int  # in all, redundancy included
    interactive_replicas: int
    batch_replicas: int
    devices: int
    cost_per_hour: float
    cost_per_million: dict[str, float]  # per tier: USD per million tokens (prompt + output)
    headroom: float  # spare share of the fleet's interactive capacity at the offered load
    redundancy_notes: list[str]
    simulation: SimResult | None = None
    simulated_replicas: int | None = None
    meets_slo: bool = True
    unreachable: str = ""  # why no configuration meets the SLOs (the plan is then the closest one)
    alternatives: list[Candidate] = field(default_factory=list)


def _efficiency(acc: AcceleratorSpec) -> Efficiency:
    c = acc.calibrated
    if c is None:
        return GPU_EFFICIENCY
    f = c["fit"]
    return Efficiency(flops=1.0, bandwidth=1.0, step_overhead_s=f["step_overhead_s"], per_seq_s=f["per_seq_s"],
                      prefill_overhead_s=f.get("prefill_overhead_s", 0.0),
                      gemm_half_rate_tokens=f.get("gemm_half_rate_tokens", 0.0))


def step_model(d: Deployment) -> StepModel:
    return StepModel(d, _efficiency(d.accelerator))


def replica_memory(d: Deployment, max_num_batched_tokens: int, block_size: int = 16) -> MemoryPlan:
    c = d.accelerator.calibrated
    if c is not None:  # a measured CPU: the engine's KV pool as calibrated
        # num_blocks: pages of the engine's KV groups, built from the layers' windows the file records; older
        # files counted blocks of every layer (one group)
        layout = KVLayout.for_windows(c.get("kv_layer_windows") or [None] * d.model.num_layers)
        page = c["kv_pool_bytes"] / c["num_blocks"]
        return MemoryPlan(device_bytes=d.accelerator.memory_bytes, usable_bytes=d.accelerator.memory_bytes,
                          weight_bytes=0.0, reserve_bytes=0.0, kv_bytes=c["kv_pool_bytes"],
                          kv_bytes_per_token=page / c["block_size"] * d.model.num_layers / layout.group_size,
                          block_size=c["block_size"], num_blocks=c["num_blocks"], layout=layout, page_bytes=page)
    return memory_plan(d.model, d.accelerator, d.tp, d.weight_dtype, d.kv_dtype,
                       max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as a plan assumes it: each drafted token accepted with probability `acceptance`
    (measured by benchmarks.speculation on this project's CPUs for n-gram drafts of grounded work; on a GPU an
    assumption the plan states), drafts of up to `max_draft` tokens, the length chosen per batch size as the
    engine's controller does: the one with the least step time per token."""

    acceptance: float
    max_draft: int = 8

    def __post_init__(self):
        if not 0 <= self.acceptance < 1 or self.max_draft < 1:
            raise ValueError("speculation needs 0 <= acceptance < 1 and max_draft >= 1")

    def tokens(self, draft: int) -> float:
        """Expected tokens a verify step gives a sequence: its accepted drafts and the token after them."""
        a = self.acceptance
        return (1 - a ** (draft + 1)) / (1 - a)


def decode_draft(sm: StepModel, b: int, ctx: int, spec: Speculation | None) -> tuple[int, float, float]:
    """(draft length, step seconds, tokens a sequence gets a step) of `b` sequences decoding at context `ctx`:
    without speculation a token a step; with it, the draft length with the least seconds per token."""
    options = [0] if spec is None else range(spec.max_draft + 1)
    best = None
    for k in options:
        s = sm.seconds([Work(1 + k, ctx)] * b)
        e = 1.0 if spec is None else spec.tokens(k)
        if best is None or s / e < best[1] / best[2]:
            best = (k, s, e)
    return best


def steady_state(sm: StepModel, b: int, prompt: int, output: int, chunk: int,
                 spec: Speculation | None = None) -> tuple[float, float, float, int]:
    """(requests/s, TPOT, TTFT, draft length) of a replica decoding `b` sequences (see the module docstring;
    with speculation a decode step gives each sequence E tokens, so a request needs D / E of them)."""
    ctx = prompt + output // 2
    draft, s, per_step = decode_draft(sm, b, ctx, spec)
    decodes = [Work(1 + draft, ctx)] * b
    t_p, start = 0.0, 0
    while start < prompt:  # the prompt's chunks, each riding along a decode step
        n = min(chunk, prompt - start)
        t_p += sm.seconds([Work(n, start, start + n >= prompt)] + decodes) - s
        start += n
    lam = b / (output / per_step * s + b * t_p)
    busy = lam * t_p
    tpot = s / per_step / (1 - busy) if busy < 1 else math.inf
    ttft = s / 2 + t_p + s * math.ceil(prompt / chunk)
    return lam, tpot, ttft, draft


def evaluate(d: Deployment, max_num_seqs: int, load: Load, slos: list[SLO], chunk: int,
             utilization: float, spec: Speculation | None = None) -> Candidate:
    mem = replica_memory(d, chunk)
    sm = step_model(d)
    p, o = load.prompt.mean, load.output.mean
    kv_seqs = mem.max_sequences(p + o) if mem.fits else 0
    top = min(max_num_seqs, kv_seqs)
    ttft_slo = min((s.seconds for s in slos if s.metric == "ttft"), default=math.inf)
    tpot_slo = min((s.seconds for s in slos if s.metric == "tpot"), default=math.inf)
    if top < 1:
        return Candidate(d, max_num_seqs, mem, 0.0, 0, math.inf, math.inf, "memory (the weights leave no room for KV)",
                         0.0, math.inf)
    best: tuple | None = None
    closest = (math.inf, 1, math.inf, math.inf)
    failed = ""  # the SLO the first batch past the best one missed
    b = 1
    while b <= top:
        lam, tpot, ttft, draft = steady_state(sm, b, p, o, chunk, spec)
        miss = max(tpot / tpot_slo, ttft / ttft_slo)
        if miss <= 1:
            best = (lam, b, ttft, tpot, draft)
        elif best is None:
            if miss < closest[0]:
                closest = (miss, b, ttft, tpot)
        else:
            failed = "TPOT" if tpot > tpot_slo else "TTFT"
            break
        if b == top:
            break
        b = min(top, b + 1 if b < 16 else b + b // 16)  # finer steps where they matter, always ending at top
    throughput = steady_state(sm, top, p, o, chunk, spec)[0]
    if best is None:
        which = "TPOT" if closest[3] > tpot_slo else "TTFT"
        bound = sm.decode_step(1, p + o // 2).bound
        return Candidate(d, max_num_seqs, mem, 0.0, closest[1], closest[2], closest[3],
                         f"{which} even at batch {closest[1]} ({bound}-bound)", throughput, closest[0])
    lam, b, ttft, tpot, draft = best
    if not failed:
        binds = "KV memory" if kv_seqs <= max_num_seqs else "max_num_seqs"
    else:
        binds = f"the {failed} SLO ({sm.decode_step(b, p + o // 2).bound}-bound steps)"
    return Candidate(d, max_num_seqs, mem, lam * utilization, b, ttft, tpot, binds, throughput, draft=draft)


def redundancy(replicas: int, r: Redundancy) -> tuple[int, list[str]]:
    """Replicas with spares for the availability target and the regions; with the arithmetic as text."""
    notes: list[str] = []
    if r.regions > 1:
        per_region = math.ceil(replicas / (r.regions - 1))
        notes.append(f"{r.regions} regions, each sized for 1/{r.regions - 1} of the load so that any one can "
                     f"fail: ceil({replicas} / {r.regions - 1}) = {per_region} replicas per region")
    else:
        per_region = replicas
    if r.availability is not None:
        need, a = per_region, r.replica_availability
        spares = 0
        while _at_least(need, need + spares, a) < r.availability:
            spares += 1
        notes.append(f"availability {r.availability:.4%}: with each replica up {a:.2%} of the time "
                     f"(independently), P(at least {need} of {need + spares} up) = "
                     f"{_at_least(need, need + spares, a):.5%}: {spares} spare(s) per region")
        per_region += spares
    return per_region * r.regions, notes


def _at_least(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def candidates(model: ModelSpec, accelerators: list[AcceleratorSpec], dtypes=DTYPES,
               max_model_len: int | None = None) -> list[Deployment]:
    """Every deployment of `dtypes` for weights and KV (int8 / int4 for weights only; KV bf16 if no other)."""
    out = []
    kv_dtypes = [d for d in dtypes if d not in WEIGHT_ONLY] or ["bf16"]
    for acc in accelerators:
        if acc.calibrated is not None:  # a measured machine runs as it was measured
            out.append(Deployment(model, acc, 1, acc.calibrated["weight_dtype"], acc.calibrated["kv_dtype"],
                                  max_model_len))
            continue
        for tp in TP_DEGREES:
            if tp > acc.max_per_node or model.num_heads % tp:
                continue
            for wd in dtypes:
                for kd in kv_dtypes:
                    out.append(Deployment(model, acc, tp, wd, kd, max_model_len))
    return out


def _size(c: Candidate, load: Load, red: Redundancy, interactive: int | None = None
          ) -> tuple[int, int, int, list[str], float]:
    """(replicas in all, interactive replicas, batch-only replicas, redundancy notes, headroom); the
    interactive count from the candidate's capacity unless given."""
    inter_rate, batch_rate = load.rate(Priority.INTERACTIVE), load.rate(Priority.BATCH)
    inter = interactive if interactive is not None else \
        math.ceil(inter_rate / c.capacity_per_s - 1e-9) if inter_rate else 0
    # Batch work rides in the interactive replicas up to their capacity within the SLOs (its decodes
    # share their steps, so beyond that the interactive TPOT would suffer), then gets replicas of its
    # own run flat out.
    spare = max(0.0, inter * c.capacity_per_s / UTILIZATION - inter_rate)
    batch = math.ceil(max(0.0, batch_rate - spare) / c.throughput_per_s - 1e-9) if batch_rate else 0
    total, notes = redundancy(max(1, inter + batch), red)
    headroom = 1 - (inter_rate + min(batch_rate, spare)) / (inter * c.capacity_per_s / UTILIZATION) if inter else 1.0
    return total, inter, batch, notes, headroom


UTILIZATION = 0.85  # plan replicas at this share of their modelled capacity
MIN_SIMULATED_REQUESTS = 50  # a plan's check simulates at least this many arrivals (within MAX_SIMULATED_S)
MAX_SIMULATED_S = 3600.0


@dataclass
class PlanResult:
    best: Plan
    per_accelerator: list[Plan]  # the cheapest plan on each accelerator, cheapest first
    searched: int  # configurations evaluated
    seconds: float
    speculation: Speculation | None = None  # what the steady states assumed of it


def _configs(d: Deployment, max_num_batched_tokens: int) -> tuple[int, tuple[int, ...]]:
    c = d.accelerator.calibrated
    if c is None:
        return max_num_batched_tokens, MAX_NUM_SEQS
    chunk = min(max_num_batched_tokens, c["max_num_batched_tokens"])
    return chunk, tuple(s for s in MAX_NUM_SEQS if s <= max(c["max_num_seqs"], 256))


def plan(model: ModelSpec, accelerators: list[AcceleratorSpec], load: Load, slos: list[SLO],
         red: Redundancy = Redundancy(), dtypes=DTYPES, max_num_batched_tokens: int = 8192,
         simulate: bool = True, sim_seconds: float = 30.0, seed: int = 0,
         max_model_len: int | None = None, speculation: Speculation | None = None) -> PlanResult:
    """The cheapest plan on each accelerator (simulated when `simulate`), and the cheapest of those; each
    replica serves `max_model_len` tokens a request (None: the model's context length). With `speculation`
    the steady state assumes it and the simulator's check is skipped (its executor drafts nothing). A load whose mean
    request (prompt + output) is past that context, so that more than half its requests would be refused
    (lengths are symmetric about their means), is a ValueError: no fleet serves it."""
    context = Deployment(model, accelerators[0], max_model_len=max_model_len).context_length if accelerators else 0
    if load.prompt.mean + load.output.mean > context:
        raise ValueError(f"the load would be refused mostly: its mean request ({load.prompt.mean:,} prompt + "
                         f"{load.output.mean:,} output tokens) is past the {context:,}-token context of "
                         f"{model.name} replicas (--max-model-len; the model's own is "
                         f"{model.max_position_embeddings:,})")
    t0 = time.perf_counter()
    plans, searched = [], 0
    for acc in accelerators:
        evaluated = []
        for d in candidates(model, [acc], dtypes, max_model_len):
            chunk, seqs = _configs(d, max_num_batched_tokens)
            evaluated += [evaluate(d, s, load, slos, chunk, UTILIZATION, speculation) for s in seqs]
        searched += len(evaluated)
        p = _best(evaluated, load, slos, red)
        if simulate and p.meets_slo and speculation is None:
            p = _verify(p, load, red, slos, _configs(p.candidate.deployment, max_num_batched_tokens)[0], sim_seconds,
                        seed)
        plans.append(p)
    plans.sort(key=lambda p: (not p.meets_slo, p.cost_per_hour if p.meets_slo else p.candidate.misses))
    return PlanResult(plans[0], plans, searched, time.perf_counter() - t0, speculation)


def _best(evaluated: list[Candidate], load: Load, slos: list[SLO], red: Redundancy) -> Plan:
    feasible = [c for c in evaluated if c.capacity_per_s > 0 and c.throughput_per_s > 0]

    def price(c: Candidate) -> float:
        return _size(c, load, red)[0] * c.deployment.tp * c.deployment.accelerator.price_per_hour

    if not feasible:
        closest = min(evaluated, key=lambda c: c.misses)
        p = _finish(replace(closest, capacity_per_s=max(closest.throughput_per_s, 1e-9) * UTILIZATION), load, red, [])
        p.meets_slo = False
        p.unreachable = (f"no configuration on {closest.deployment.accelerator.name} meets "
                         f"{', '.join(map(str, slos))}: the closest, {closest.deployment.label} with max_num_seqs "
                         f"{closest.max_num_seqs}, is {closest.misses:.2f}x over, bound by {closest.binds}")
        return p
    ranked = sorted(feasible, key=lambda c: (price(c), -c.capacity_per_s))
    return _finish(ranked[0], load, red, ranked[1:6])


def _finish(c: Candidate, load: Load, red: Redundancy, alternatives: list[Candidate],
            interactive: int | None = None) -> Plan:
    total, inter, batch, notes, headroom = _size(c, load, red, interactive)
    d = c.deployment
    cost = total * d.tp * d.accelerator.price_per_hour
    tokens = load.prompt.mean + load.output.mean
    inter_rate, batch_rate = load.rate(Priority.INTERACTIVE), load.rate(Priority.BATCH)
    # Each tier pays for the replicas it uses: batch-only replicas are the batch tier's; interactive
    # replicas are split by the requests they carry (batch riders included); spares in proportion.
    riders = max(0.0, batch_rate - batch * c.throughput_per_s)
    inter_share = inter_rate / (inter_rate + riders) if inter_rate + riders else 0.0
    used = inter + batch
    shares = {Priority.INTERACTIVE: inter * inter_share / used if used else 0.0,
              Priority.BATCH: (inter * (1 - inter_share) + batch) / used if used else 0.0}
    per_tier = {tier.label: cost * shares[tier] / (rate * 3600 * tokens) * 1e6
                for tier, rate in ((Priority.INTERACTIVE, inter_rate), (Priority.BATCH, batch_rate)) if rate}
    return Plan(c, total, inter, batch, total * d.tp, cost, per_tier, headroom, notes, alternatives=alternatives)


def _verify(p: Plan, load: Load, red: Redundancy, slos: list[SLO], chunk: int, seconds: float, seed: int) -> Plan:
    """Check the plan with the simulator: one replica at its share of the load, judged on the requests that
    arrive after a warm-up of about one request's lifetime (before it the batch is still filling and
    latencies look better than they will be); replicas are added while the SLOs are missed."""
    c = p.candidate
    rate = load.rate(Priority.INTERACTIVE)
    if rate <= 0:  # batch-tier work only: no latency SLO to check
        return p
    tpot = min((s.seconds for s in slos if s.metric == "tpot"), default=0.05)
    warm_up = min(max(load.output.mean * tpot, 5.0), MAX_SIMULATED_S / 2)
    n = max(1, p.interactive_replicas)
    for _ in range(4):
        r = rate / n
        span = min(max(seconds, MIN_SIMULATED_REQUESTS / r), MAX_SIMULATED_S)  # enough requests to judge by
        result = simulate_replica(c.deployment, c.max_num_seqs, c.memory, r, load, warm_up + span, chunk, seed,
                                  measure_from=warm_up)
        t = result.tiers[Priority.INTERACTIVE]
        ok = t.completed > 0 and all(_observed(t, s) <= s.seconds for s in slos)
        if ok:
            break
        n += max(1, math.ceil(n * 0.1))
    out = _finish(c, load, red, p.alternatives, interactive=n) if n != p.interactive_replicas else p
    out.meets_slo = ok
    out.simulation, out.simulated_replicas = result, n
    return out


def _observed(t, slo: SLO) -> float:
    values = t.ttft if slo.metric == "ttft" else t.tpot
    v = percentile(values, slo.percentile)
    return math.inf if v is None else v


def engine_scheduler(d: Deployment) -> SchedulerConfig:
    """The scheduler settings a replica runs with: the deployment's context length, a calibrated machine's own
    sizes, else the engine defaults; no TTFT admission bound, as a plan sizes replicas so that nothing is
    refused (a bound would hide overload)."""
    c = d.accelerator.calibrated
    sizes = {} if c is None else dict(max_num_seqs=c["max_num_seqs"],
                                      max_num_batched_tokens=c["max_num_batched_tokens"])
    return SchedulerConfig(**sizes, max_model_len=d.context_length, interactive=TierLimits())


def replica_simulator(d: Deployment, cfg: SchedulerConfig, seed: int = 0, disk_bytes: float = 0.0,
                      disk_bandwidth: float = DISK_GBS * 1e9) -> Simulator:
    """A simulator of one replica of `d` running the real scheduler with `cfg`; with `disk_bytes`, a disk tier of
    that size behind its prefix cache, its pages read back at `disk_bandwidth` bytes/s (an assumption)."""
    mem = replica_memory(d, cfg.max_num_batched_tokens)
    sm = step_model(d)
    return Simulator(sm.cost, mem.num_blocks, mem.block_size, cfg, vocab_size=d.model.vocab_size, seed=seed,
                     block_copy_s=lambda n, host: sm.kv_copy_seconds(n * mem.page_bytes, host), layout=mem.layout,
                     tier_pages=int(disk_bytes // mem.page_bytes),
                     tier_load_s=lambda n: n * mem.page_bytes / disk_bandwidth)


def simulate_replica(d: Deployment, max_num_seqs: int, mem: MemoryPlan, rate: float, load: Load,
                     seconds: float, chunk: int, seed: int = 0, measure_from: float = 0.0) -> SimResult:
    """One replica at `rate` interactive requests/s of the load's shape (Poisson), no admission bounds."""
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
                          max_model_len=d.context_length,
                          interactive=TierLimits.unbounded(), batch=TierLimits.unbounded())
    trace = poisson(rate, seconds, load.prompt, load.output, seed=seed)
    return replica_simulator(d, cfg, seed).run(Workload("poisson", trace), measure_from=measure_from)
