"""A discrete-event simulator: the engine's own step loop (engine/core.py's `EngineCore`, over the real
scheduler and KV cache manager) under a simulated clock.

`Simulator.run(workload)` replays arrivals into an `EngineCore` whose executor is a `ClockExecutor`: every
admission decision, chunked prefill, prefix-cache hit, preemption, tier rule, queue bound and finish is
the serving code's own. Only the forward pass is replaced: each step's `SchedulerOutput` is priced by a
step-time model (the roofline of planning/roofline.py, or a calibrated CPU's) and the clock advances by
that much; every scheduled sequence that samples gets a token, and a request ends when it has its trace's
output length (max_tokens with `ignore_eos`, as benchmarks run). Requests that arrive during a step join
at the next step, as in the engine.

Not simulated: the HTTP and tokenizing path in front of the engine (a client's TTFT adds it), the
between-layer interjection of the fused AMX decoder (it needs a step that can stop mid-way), and
stop strings or EOS (outputs run to their length).
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import Priority, SchedulerConfig, TierLimits
from kvserve.engine.core import EngineCore
from kvserve.engine.errors import CapacityExhausted, ContextLengthExceeded
from kvserve.engine.interjection import Interjection
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.groups import KVLayout
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from kvserve.planning.roofline import Work
from kvserve.planning.traces import Arrival, ClosedLoop, Workload

MAX_TIMELINE_POINTS = 2000
REFUSED_RETRY_S = 0.05
# A workload with more than this share of its requests refused at admission is not served: the planner's
# commands say so and fail rather than report figures of the few requests that ran.
MOSTLY_REFUSED = 0.5


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class TierResult:
    """One tier's outcome: what finished, what was refused, and the latency figures of the finished."""

    submitted: int = 0
    completed: int = 0
    rejected: int = 0  # refused at admission (the server's 429, or past the context or the KV pool)
    refused_because: str = ""  # the first refusal's reason
    timed_out: int = 0  # queue timeout
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        def pct(xs):
            return {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}

        return {"submitted": self.submitted, "completed": self.completed, "rejected": self.rejected,
                "refused_because": self.refused_because or None, "timed_out": self.timed_out,
                "output_tokens": self.output_tokens, "ttft_s": pct(self.ttft),
                "tpot_s": pct(self.tpot), "latency_s": pct(self.latency), "queue_s": pct(self.queue)}


@dataclass
class SimResult:
    tiers: dict[Priority, TierResult]
    duration_s: float  # first arrival to last finish
    steps: int
    busy_s: float  # simulated time in steps
    preemptions: int
    kv_timeline: list[tuple[float, float]]  # (time, fraction of KV blocks held)
    prefix_hit_rate: float
    bound_share: dict[str, float]  # share of the busy time each resource bound
    tier_hit_rate: float = 0.0  # of the prompt tokens looked up, those loaded from the disk tier

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.tiers.values())

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def refusal(self) -> str | None:
        """Why the workload counts as not served, when more than MOSTLY_REFUSED of its requests were refused
        (all of them: "in full"); None when it was served."""
        submitted = sum(t.submitted for t in self.tiers.values())
        refused = sum(t.rejected for t in self.tiers.values())
        if not submitted or refused <= MOSTLY_REFUSED * submitted:
            return None
        why = next(t.refused_because for t in self.tiers.values() if t.refused_because)
        extent = "in full" if refused == submitted else f"mostly ({refused:,} of {submitted:,})"
        return f"the workload was refused {extent}: {why}"

    def summary(self) -> dict:
        return {"duration_s": self.duration_s, "steps": self.steps, "busy_s": self.busy_s,
                "output_tokens_per_s": self.output_tokens_per_s, "preemptions": self.preemptions,
                "prefix_hit_rate": self.prefix_hit_rate, "tier_hit_rate": self.tier_hit_rate,
                "bound_share": self.bound_share,
                "kv_peak": max((u for _, u in self.kv_timeline), default=0.0),
                "tiers": {p.label: t.summary() for p, t in self.tiers.items() if t.submitted}}


class SimClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedTier:
    """The disk tier of a simulated engine (engine/kv/disk.py's part): which evicted blocks it holds, at most
    `pages` of them, least recently used out first. No bytes: the executor prices the loads."""

    def __init__(self, pages: int, load_s: Callable[[int], float] = lambda pages: 0.0):
        self.pages = pages
        self.load_s = load_s
        self._keys: dict[bytes, None] = {}  # insertion ordered: oldest first

    def contains(self, key: bytes) -> bool:
        return key in self._keys

    def get(self, key: bytes) -> bytes | None:
        if key not in self._keys:
            return None
        self._keys[key] = self._keys.pop(key)  # now the most recent
        return b""

    def put(self, key: bytes) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.pages:
            del self._keys[next(iter(self._keys))]

    def level(self, key: bytes) -> str | None:
        return "disk" if key in self._keys else None

    def level_bytes(self) -> dict[str, int]:
        return {"disk": len(self._keys)}

    def load_seconds(self, keys: list[bytes]) -> float:
        return self.load_s(len(keys))


class ClockExecutor:
    """The executor of a simulated engine: a step computes nothing, it advances the clock by its priced time
    (`step_cost(work)`: `.seconds`, `.bound`; `block_copy_s(blocks, across_host)` for block moves) and every
    sequence that samples gets token 0 (outputs run to their length: the requests ignore EOS)."""

    def __init__(self, clock: SimClock, step_cost: Callable, block_copy_s: Callable[[int, bool], float],
                 tier: SimulatedTier | None = None):
        self.clock, self.step_cost, self.block_copy_s = clock, step_cost, block_copy_s
        self.tier = tier
        self.steps = 0
        self.busy = 0.0
        self.bound_time: dict[str, float] = {}  # simulated seconds each resource bound, over steps with work

    @staticmethod
    def works(out: SchedulerOutput) -> list[Work]:
        """The step's work as the step-time models price it."""
        return [Work(s.num_new_tokens, s.start, s.sample) for s in out.scheduled]

    def execute(self, out: SchedulerOutput, interjection: Interjection | None = None) -> RunnerOutput:
        if self.tier is not None:  # offloads are written off the step's thread: they cost the step nothing
            for _, key in out.blocks_to_offload:
                self.tier.put(key)
        cost = self.step_cost(self.works(out))
        seconds = cost.seconds + self._moves_s(out)
        self.clock.now += seconds
        if seconds > 0 or out.scheduled:
            self.steps += 1
            self.busy += seconds
        if out.scheduled:
            self.bound_time[cost.bound] = self.bound_time.get(cost.bound, 0.0) + seconds
        tokens = {s.seq.seq_id: [0] for s in out.scheduled if s.sample}
        for children in out.forks.values():
            tokens.update((c.seq_id, [0]) for c in children)
        return RunnerOutput(tokens, seconds=seconds)

    def _moves_s(self, out: SchedulerOutput) -> float:
        swaps = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        seconds = self.block_copy_s(swaps, True) if swaps else 0.0
        if out.blocks_to_copy:
            seconds += self.block_copy_s(len(out.blocks_to_copy), False)
        if out.blocks_to_load:  # pages read back from the disk tier, before the forward
            seconds += self.tier.load_s(len(out.blocks_to_load))
        return seconds


class Simulator:
    """One engine replica under a step-time model. `step_cost(work)` returns a StepCost-like object
    (`.seconds`, `.bound`) for a list of `Work`; `block_copy_s(blocks, across_host)` prices block moves.
    `num_blocks` counts pages of `layout`'s KV groups (default one group of every layer), as the engine's pool.
    `tier_pages`: a disk tier of that many pages behind the pool (evicted prefix blocks go there; a hit loads
    them back at `tier_load_s(pages)` seconds)."""

    def __init__(self, step_cost: Callable, num_blocks: int, block_size: int = 16,
                 scheduler: SchedulerConfig | None = None, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, block_copy_s: Callable[[int, bool], float] | None = None,
                 vocab_size: int = 32000, seed: int = 0, horizon_s: float = float("inf"),
                 layout: KVLayout | None = None, tier_pages: int = 0,
                 tier_load_s: Callable[[int], float] | None = None):
        self.clock = SimClock()
        tier_load_s = tier_load_s or (lambda pages: 0.0)
        self.tier = SimulatedTier(tier_pages, tier_load_s) if tier_pages else None
        self.executor = ClockExecutor(self.clock, step_cost, block_copy_s or (lambda blocks, across_host: 0.0),
                                      self.tier)
        # Default: the engine's, without the TTFT admission bound (as search.engine_scheduler: plans refuse nothing).
        config = scheduler or SchedulerConfig(interactive=TierLimits())
        self.kv = KVCacheManager(num_blocks, num_host_blocks, block_size, enable_prefix_caching, layout,
                                 tier=self.tier, clock=self.clock)
        self.core = EngineCore(config, self.kv, self.executor, max_model_len=config.max_model_len, model_id="sim",
                               clock=self.clock, stream_outputs=False)
        self.scheduler = self.core.scheduler
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        self.horizon = horizon_s  # stop simulating here (requests still running are left out of the figures)
        self._ids = itertools.count()
        self._prefixes: dict[int, list[int]] = {}
        self._live: dict[str, tuple[Arrival, ClosedLoop | None]] = {}

    def _tokens(self, a: Arrival) -> list[int]:
        prefix: list[int] = []
        if a.prefix_id is not None and a.prefix_tokens:
            prefix = self._prefixes.setdefault(a.prefix_id, [self.rng.randrange(self.vocab)
                                                             for _ in range(a.prefix_tokens)])
        return prefix + [self.rng.randrange(self.vocab) for _ in range(a.prompt_tokens - len(prefix))]

    def run(self, workload: Workload, measure_from: float = 0.0) -> SimResult:
        """Replay `workload`. Latency figures count the requests that arrive at `measure_from` or later (a
        warm-up before it fills the batch); counts and throughput count every request."""
        clock, core, executor = self.clock, self.core, self.executor
        tiers = {p: TierResult() for p in Priority}
        pending: list[tuple[float, int, Arrival, ClosedLoop | None]] = [(a.time, i, a, None)
                                                                      for i, a in enumerate(workload.arrivals)]
        heapq.heapify(pending)
        order = itertools.count(len(pending))
        loop_state = {id(lp): [0, random.Random(lp.seed + k)] for k, lp in enumerate(workload.loops)}

        def send_next(lp: ClosedLoop, now: float) -> None:
            state = loop_state[id(lp)]
            if state[0] >= lp.num_requests or (lp.duration_s is not None and now >= lp.duration_s):
                return
            state[0] += 1
            heapq.heappush(pending, (now, next(order), lp.request(state[0], state[1], now), lp))

        for lp in workload.loops:
            for _ in range(lp.concurrency):
                send_next(lp, 0.0)
        first_arrival = pending[0][0] if pending else 0.0
        last_finish, timeline = first_arrival, []

        def end(ro: RequestOutput) -> None:
            nonlocal last_finish
            a, lp = self._live.pop(ro.request_id)
            tier, m, out = tiers[a.priority], ro.metrics, ro.outputs[0]
            if out.finish_reason == "length":
                tier.completed += 1
                tier.output_tokens += len(out.token_ids)
                if a.time >= measure_from:
                    tier.ttft.append(m.first_token_time - m.arrival_time)
                    tier.latency.append(clock.now - m.arrival_time)
                    tier.queue.append((m.first_scheduled_time or m.arrival_time) - m.arrival_time)
                    if len(out.token_ids) > 1:
                        tier.tpot.append((m.last_token_time - m.first_token_time) / (len(out.token_ids) - 1))
            else:
                tier.timed_out += 1
            last_finish = clock.now
            if lp is not None:
                send_next(lp, clock.now)

        while True:
            while pending and pending[0][0] <= clock.now:
                _, _, a, lp = heapq.heappop(pending)
                self._submit(a, lp, tiers, send_next)
            if not core.has_unfinished_requests():
                if not pending or pending[0][0] >= self.horizon:
                    break
                clock.now = pending[0][0]
                continue
            if clock.now >= self.horizon:
                break
            steps_before = executor.steps
            for ro in core.step():
                end(ro)
            if executor.steps == steps_before:
                # nothing could run (every sequence waits on a bound): wait for the next arrival
                if not pending:
                    break
                clock.now = max(clock.now, pending[0][0])
                continue
            timeline.append((clock.now, self.kv.usage().device_usage))
        if len(timeline) > MAX_TIMELINE_POINTS:
            stride = len(timeline) / MAX_TIMELINE_POINTS
            timeline = [timeline[int(i * stride)] for i in range(MAX_TIMELINE_POINTS)]
        usage = self.kv.usage()
        busy = executor.busy
        return SimResult(tiers=tiers, duration_s=last_finish - first_arrival, steps=executor.steps, busy_s=busy,
                         preemptions=self.scheduler.stats().num_preemptions, kv_timeline=timeline,
                         prefix_hit_rate=usage.prefix_hit_rate,
                         tier_hit_rate=usage.tier_hit_tokens / usage.prefix_query_tokens if usage.prefix_query_tokens
                         else 0.0,
                         bound_share={k: v / busy for k, v in executor.bound_time.items()} if busy else {})

    def _submit(self, a: Arrival, lp: ClosedLoop | None, tiers: dict, send_next) -> None:
        tiers[a.priority].submitted += 1
        request = EngineRequest(f"sim-{next(self._ids)}", self._tokens(a),
                                SamplingParams(max_tokens=a.output_tokens, ignore_eos=True), a.priority,
                                a.tenant, cache_salt=a.tenant, arrival=a.time)
        try:
            self.core.add_request(request)
        except (CapacityExhausted, ContextLengthExceeded) as e:
            tiers[a.priority].rejected += 1
            tiers[a.priority].refused_because = tiers[a.priority].refused_because or str(e)
            if lp is not None:  # a refused client sends its next request a moment later
                send_next(lp, self.clock.now + REFUSED_RETRY_S)
            return
        self._live[request.request_id] = (a, lp)
