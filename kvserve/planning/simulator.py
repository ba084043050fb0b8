"""A discrete-event simulator that drives the real scheduler and KV cache manager under a fake clock.

`Simulator.run(workload)` replays arrivals into `engine/scheduler.py`'s `Scheduler` over
`engine/kv_cache.py`'s `KVCacheManager` (imported, not copied): every admission decision, chunked
prefill, prefix-cache hit, preemption, tier rule and queue bound is the serving code's own. Only the
forward pass is replaced: each step's `SchedulerOutput` is priced by a step-time model (the roofline of
planning/roofline.py, or a calibrated CPU's) and the clock advances by that much; every scheduled
sequence that samples gets a token, and a sequence ends when it has its trace's output length (as
`ignore_eos` benchmarks do). Requests that arrive during a step join at the next step, as in the engine.

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
from kvserve.engine.errors import CapacityExhausted, ContextLengthExceeded
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Sequence, SequenceStatus, SequenceTimings
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduler_output import SchedulerOutput
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
                "prefix_hit_rate": self.prefix_hit_rate, "bound_share": self.bound_share,
                "kv_peak": max((u for _, u in self.kv_timeline), default=0.0),
                "tiers": {p.label: t.summary() for p, t in self.tiers.items() if t.submitted}}


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulator:
    """One engine replica under a step-time model. `step_cost(work)` returns a StepCost-like object
    (`.seconds`, `.bound`) for a list of `Work`; `block_copy_s(blocks, across_host)` prices block moves."""

    def __init__(self, step_cost: Callable, num_blocks: int, block_size: int = 16,
                 scheduler: SchedulerConfig | None = None, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, block_copy_s: Callable[[int, bool], float] | None = None,
                 vocab_size: int = 32000, seed: int = 0, horizon_s: float = float("inf")):
        self.step_cost = step_cost
        self.block_copy_s = block_copy_s or (lambda blocks, across_host: 0.0)
        self.clock = _Clock()
        self.kv = KVCacheManager(num_blocks, num_host_blocks, block_size, enable_prefix_caching)
        # Default: the engine's, without the TTFT admission bound (as search.engine_scheduler: plans refuse nothing).
        self.scheduler = Scheduler(scheduler or SchedulerConfig(interactive=TierLimits()), self.kv, clock=self.clock)
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        self.horizon = horizon_s  # stop simulating here (requests still running are left out of the figures)
        self._ids = itertools.count()
        self._prefixes: dict[int, list[int]] = {}
        self._live: dict[int, tuple[Sequence, Arrival, ClosedLoop | None]] = {}

    def _tokens(self, a: Arrival) -> list[int]:
        prefix: list[int] = []
        if a.prefix_id is not None and a.prefix_tokens:
            prefix = self._prefixes.setdefault(a.prefix_id, [self.rng.randrange(self.vocab)
                                                             for _ in range(a.prefix_tokens)])
        return prefix + [self.rng.randrange(self.vocab) for _ in range(a.prompt_tokens - len(prefix))]

    def run(self, workload: Workload, measure_from: float = 0.0) -> SimResult:
        """Replay `workload`. Latency figures count the requests that arrive at `measure_from` or later (a
        warm-up before it fills the batch); counts and throughput count every request."""
        clock, sched = self.clock, self.scheduler
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
        last_finish, steps, busy, timeline = first_arrival, 0, 0.0, []
        bound_time: dict[str, float] = {}

        def end(seq: Sequence, a: Arrival, lp: ClosedLoop | None, status: SequenceStatus) -> None:
            nonlocal last_finish
            tier = tiers[a.priority]
            t = seq.timings
            if status is SequenceStatus.FINISHED_LENGTH:
                tier.completed += 1
                tier.output_tokens += seq.num_output_tokens
            if status is SequenceStatus.FINISHED_LENGTH and a.time >= measure_from:
                tier.ttft.append(t.first_token - t.arrival)
                tier.latency.append(clock.now - t.arrival)
                tier.queue.append((t.first_scheduled or t.arrival) - t.arrival)
                if seq.num_output_tokens > 1:
                    tier.tpot.append((t.last_token - t.first_token) / (seq.num_output_tokens - 1))
            elif status is not SequenceStatus.FINISHED_LENGTH:
                tier.timed_out += 1
            last_finish = clock.now
            self._live.pop(seq.seq_id, None)
            if lp is not None:
                send_next(lp, clock.now)

        while True:
            while pending and pending[0][0] <= clock.now:
                _, _, a, lp = heapq.heappop(pending)
                self._submit(a, lp, tiers, send_next)
            if not sched.has_unfinished():
                if not pending or pending[0][0] >= self.horizon:
                    break
                clock.now = pending[0][0]
                continue
            if clock.now >= self.horizon:
                break
            out = sched.schedule()
            for seq in out.finished:
                _, a, lp = self._live[seq.seq_id]
                end(seq, a, lp, seq.status)
            cost = self.step_cost([Work(s.num_new_tokens, s.start, s.sample) for s in out.scheduled])
            seconds = cost.seconds + self._moves_s(out)
            if seconds <= 0 and not out.scheduled:
                # nothing could run (every sequence waits on a bound): wait for the next arrival
                if not pending:
                    break
                clock.now = max(clock.now, pending[0][0])
                continue
            clock.now += seconds
            busy += seconds
            steps += 1
            if out.scheduled:
                bound_time[cost.bound] = bound_time.get(cost.bound, 0.0) + seconds
            sched.update_from_output(out, {s.seq.seq_id: 0 for s in out.scheduled if s.sample})
            for s in out.scheduled:
                seq = s.seq
                if seq.status is SequenceStatus.RUNNING and \
                        seq.num_output_tokens >= self._live[seq.seq_id][1].output_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                    _, a, lp = self._live[seq.seq_id]
                    end(seq, a, lp, SequenceStatus.FINISHED_LENGTH)
            timeline.append((clock.now, self.kv.usage().device_usage))
        if len(timeline) > MAX_TIMELINE_POINTS:
            stride = len(timeline) / MAX_TIMELINE_POINTS
            timeline = [timeline[int(i * stride)] for i in range(MAX_TIMELINE_POINTS)]
        usage = self.kv.usage()
        return SimResult(tiers=tiers, duration_s=last_finish - first_arrival, steps=steps, busy_s=busy,
                         preemptions=sched.stats().num_preemptions, kv_timeline=timeline,
                         prefix_hit_rate=usage.prefix_hit_rate,
                         bound_share={k: v / busy for k, v in bound_time.items()} if busy else {})

    def _submit(self, a: Arrival, lp: ClosedLoop | None, tiers: dict, send_next) -> None:
        tiers[a.priority].submitted += 1
        seq = Sequence(seq_id=next(self._ids), request_id=f"sim-{next(self._ids)}", prompt_token_ids=self._tokens(a),
                       sampling=SamplingParams(max_tokens=a.output_tokens, ignore_eos=True), priority=a.priority,
                       tenant=a.tenant, cache_salt=a.tenant, timings=SequenceTimings(arrival=a.time))
        try:
            self.scheduler.add_request([seq])
        except (CapacityExhausted, ContextLengthExceeded) as e:
            tiers[a.priority].rejected += 1
            tiers[a.priority].refused_because = tiers[a.priority].refused_because or str(e)
            if lp is not None:  # a refused client sends its next request a moment later
                send_next(lp, self.clock.now + REFUSED_RETRY_S)
            return
        self._live[seq.seq_id] = (seq, a, lp)

    def _moves_s(self, out: SchedulerOutput) -> float:
        swaps = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        seconds = self.block_copy_s(swaps, True) if swaps else 0.0
        if out.blocks_to_copy:
            seconds += self.block_copy_s(len(out.blocks_to_copy), False)
        return seconds
