"""Serving metrics: Prometheus exposition (vLLM's names under `kvserve:`), a sliding window, and a short
history of each model's load sampled every few seconds (service/load_history.py, for the dashboard).

Request and step samples are recorded from the engine threads (AsyncLLM's on_finish / on_step
hooks): prometheus_client metrics are thread-safe and the window is guarded by a lock. Gauges that
describe the present (running, waiting, KV usage, prefix-cache counters) are read at scrape time
by a custom collector, so they are never stale.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.service.load_history import LoadHistory, LoadPoint
from kvserve.service.router import percentile

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class RequestSample:
    at: float  # monotonic time the request finished
    model: str
    tier: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StepSample:
    at: float
    model: str
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    preempted: int


@dataclass(frozen=True)
class LiveModelStats:
    """The present state of one model, read at scrape / query time."""

    model: str
    running: int
    waiting: dict  # tier -> count
    kv_usage: float  # fraction of device blocks held
    prefix_queries: int  # cumulative tokens looked up
    prefix_hits: int  # cumulative tokens served from the cache
    estimated_ttft_s: dict = field(default_factory=dict)  # tier -> admission's TTFT estimate for a short prompt
    prefix_disk_hits: int = 0  # of prefix_hits, tokens loaded from the KV cache's disk tier
    prefix_host_hits: int = 0  # of prefix_hits, tokens loaded from its host-memory tier (CUDA)
    kv_disk_bytes: int = 0  # what the disk tier holds
    kv_host_bytes: int = 0  # what the host-memory tier holds
    drafts: dict = field(default_factory=dict)  # drafter name -> DrafterStats (speculative decoding, since start)
    draft_length: float = 0.0  # the controller's current mean draft length
    grammar: object = None  # structured outputs: the compiler's GrammarStats (engine/structured/grammar.py), or None


class ServingWindow:
    """The last `window_s` seconds of finished requests and engine steps, per model."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self._requests: deque[RequestSample] = deque()
        self._steps: deque[StepSample] = deque()
        self._lock = threading.Lock()
        self._cache: dict = {}

    def add_request(self, sample: RequestSample) -> None:
        with self._lock:
            self._requests.append(sample)
            self._prune(self.clock())
            self._cache.clear()

    def add_step(self, sample: StepSample) -> None:
        with self._lock:
            self._steps.append(sample)
            self._prune(self.clock())

    def _prune(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._requests and self._requests[0].at < cutoff:
            self._requests.popleft()
        while self._steps and self._steps[0].at < cutoff:
            self._steps.popleft()

    def snapshot(self, model: str | None = None) -> tuple[list[RequestSample], list[StepSample]]:
        with self._lock:
            self._prune(self.clock())
            reqs = [r for r in self._requests if model is None or r.model == model]
            steps = [s for s in self._steps if model is None or s.model == model]
        return reqs, steps

    def ttft_p50_ms(self, model: str, tier: str | None = None) -> float | None:
        """Median TTFT over the window (cached until the window changes: read on every response)."""
        key = ("ttft50", model, tier)
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[1] < 1.0:
                return hit[0]
        reqs, _ = self.snapshot(model)
        vals = sorted(r.ttft_s for r in reqs if r.ttft_s is not None and (tier is None or r.tier == tier))
        p = percentile(vals, 50)
        value = None if p is None else p * 1000
        with self._lock:
            self._cache[key] = (value, now)
        return value

    def queue_p50_ms(self, model: str, tier: str | None = None) -> float | None:
        reqs, _ = self.snapshot(model)
        vals = sorted(r.queue_s for r in reqs if r.queue_s is not None and (tier is None or r.tier == tier))
        p = percentile(vals, 50)
        return None if p is None else p * 1000

    def summary(self, model: str, live: LiveModelStats | None) -> dict:
        """The body of GET /v1/metrics/serving for one model."""
        reqs, steps = self.snapshot(model)
        now = self.clock()
        span = max(1e-9, min(self.window_s, now - self.started))

        def pct(attr: str, q: float) -> float | None:
            vals = sorted(getattr(r, attr) for r in reqs if getattr(r, attr) is not None)
            p = percentile(vals, q)
            return None if p is None else round(p * 1000, 3)

        prompt = sum(r.prompt_tokens for r in reqs)
        cached = sum(r.cached_tokens for r in reqs)
        busy = sum(s.duration_s for s in steps)
        return {
            "model": model,
            "window_s": self.window_s,
            "requests": len(reqs),
            "ttft_p50_ms": pct("ttft_s", 50),
            "ttft_p99_ms": pct("ttft_s", 99),
            "tpot_p50_ms": pct("tpot_s", 50),
            "tpot_p99_ms": pct("tpot_s", 99),
            "e2e_p50_ms": pct("e2e_s", 50),
            "e2e_p99_ms": pct("e2e_s", 99),
            "queue_time_p50_ms": pct("queue_s", 50),
            "queue_depth": dict(live.waiting) if live else {"interactive": 0, "batch": 0},
            "running": live.running if live else 0,
            "kv_cache_used_pct": round(100 * live.kv_usage, 3) if live else 0.0,
            "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            # Since start, from the engine's counters: tokens looked up, and the hits by where they were found.
            "prefix_cache_lookups": {"tokens": live.prefix_queries,
                                     "hit_memory": live.prefix_hits - live.prefix_disk_hits - live.prefix_host_hits,
                                     "hit_host": live.prefix_host_hits,
                                     "hit_disk": live.prefix_disk_hits} if live else {},
            "kv_disk_bytes": live.kv_disk_bytes if live else 0,
            "kv_host_bytes": live.kv_host_bytes if live else 0,
            # Speculative decoding since start, per drafter, and the controller's current mean draft length.
            "speculation": {"drafters": {name: {"proposed": d.proposed, "accepted": d.accepted, "drafts": d.drafts,
                                                "mean_accepted_length": round(d.accepted / d.drafts, 4) if d.drafts
                                                else 0.0} for name, d in live.drafts.items()},
                            "draft_length": round(live.draft_length, 3)} if live else {},
            # Structured outputs since start: the compiled-grammar cache and the compiler's refusals and time.
            "structured_outputs": {"cache_hits": live.grammar.hits, "cache_misses": live.grammar.misses,
                                   "refused": live.grammar.refused, "timeouts": live.grammar.timeouts,
                                   "compile_seconds": round(live.grammar.compile_seconds, 4)}
            if live and live.grammar is not None else {},
            "preemptions": sum(s.preempted for s in steps),
            "engine_util": round(min(1.0, busy / span), 4),
            "tokens_per_s": round(sum(s.decode_tokens for s in steps) / span, 3),  # decode (generated) tokens
            "prefill_tokens_per_s": round(sum(s.prefill_tokens for s in steps) / span, 3),
        }


class _LiveCollector:
    """Scrape-time gauges and cumulative prefix-cache counters, read from the engines."""

    def __init__(self, read: Callable[[], Iterable[LiveModelStats]]):
        self.read = read

    def describe(self):
        return []

    def collect(self):
        running = GaugeMetricFamily("kvserve:num_requests_running", "Requests in the running batch",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily("kvserve:num_requests_waiting", "Requests waiting to be scheduled",
                                    labels=["model_name", "tier"])
        kv = GaugeMetricFamily("kvserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                               labels=["model_name"])
        hits = CounterMetricFamily("kvserve:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   labels=["model_name"])
        queries = CounterMetricFamily("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=["model_name"])
        disk_hits = CounterMetricFamily("kvserve:prefix_cache_disk_hits",
                                        "Prompt tokens of the prefix-cache hits loaded from the KV cache's disk tier "
                                        "(the rest of kvserve:prefix_cache_hits were in memory)", labels=["model_name"])
        disk_bytes = GaugeMetricFamily("kvserve:kv_disk_bytes", "Bytes the KV cache's disk tier holds",
                                       labels=["model_name"])
        host_hits = CounterMetricFamily("kvserve:prefix_cache_host_hits",
                                        "Prompt tokens of the prefix-cache hits loaded from the KV cache's host-memory "
                                        "tier (CUDA)", labels=["model_name"])
        host_bytes = GaugeMetricFamily("kvserve:kv_host_bytes", "Bytes the KV cache's host-memory tier holds",
                                       labels=["model_name"])
        proposed = CounterMetricFamily("kvserve:spec_draft_tokens", "Tokens drafted for speculative decoding",
                                       labels=["model_name", "drafter"])
        accepted = CounterMetricFamily("kvserve:spec_accepted_tokens",
                                       "Drafted tokens the target model accepted", labels=["model_name", "drafter"])
        drafts = CounterMetricFamily("kvserve:spec_drafts", "Drafts verified (accepted tokens / drafts: the mean "
                                     "accepted length)", labels=["model_name", "drafter"])
        draft_length = GaugeMetricFamily("kvserve:spec_draft_length", "The speculation controller's mean draft "
                                         "length over the decodes it last drafted for", labels=["model_name"])
        g_hits = CounterMetricFamily("kvserve:grammar_cache_hits", "Structured-output constraints found compiled in "
                                     "the grammar cache", labels=["model_name"])
        g_misses = CounterMetricFamily("kvserve:grammar_cache_misses", "Structured-output constraints compiled (or "
                                       "joined to a compile in flight)", labels=["model_name"])
        g_refused = CounterMetricFamily("kvserve:grammar_refused", "Structured-output constraints refused (invalid, "
                                        "over a limit, or past the compile budget)", labels=["model_name"])
        g_seconds = CounterMetricFamily("kvserve:grammar_compile_seconds", "Seconds spent compiling structured-output "
                                        "constraints (off the engine thread)", labels=["model_name"])
        ttft = GaugeMetricFamily("kvserve:estimated_ttft_seconds",
                                 "Admission's estimate of the time to first token of a short request arriving now "
                                 "(queue wait plus its prefill, from the step-time model): a signal to shed load on",
                                 labels=["model_name", "tier"])
        for s in self.read():
            running.add_metric([s.model], s.running)
            for tier, n in s.waiting.items():
                waiting.add_metric([s.model, tier], n)
            kv.add_metric([s.model], s.kv_usage)
            hits.add_metric([s.model], s.prefix_hits)
            queries.add_metric([s.model], s.prefix_queries)
            disk_hits.add_metric([s.model], s.prefix_disk_hits)
            disk_bytes.add_metric([s.model], s.kv_disk_bytes)
            host_hits.add_metric([s.model], s.prefix_host_hits)
            host_bytes.add_metric([s.model], s.kv_host_bytes)
            for name, d in s.drafts.items():
                proposed.add_metric([s.model, name], d.proposed)
                accepted.add_metric([s.model, name], d.accepted)
                drafts.add_metric([s.model, name], d.drafts)
            draft_length.add_metric([s.model], s.draft_length)
            if s.grammar is not None:
                g_hits.add_metric([s.model], s.grammar.hits)
                g_misses.add_metric([s.model], s.grammar.misses)
                g_refused.add_metric([s.model], s.grammar.refused)
                g_seconds.add_metric([s.model], s.grammar.compile_seconds)
            for tier, seconds in s.estimated_ttft_s.items():
                ttft.add_metric([s.model, tier], seconds)
        yield from (running, waiting, kv, hits, queries, disk_hits, disk_bytes, host_hits, host_bytes, proposed, accepted,
                    drafts, draft_length, g_hits, g_misses, g_refused, g_seconds, ttft)


class ServerMetrics:
    """Prometheus metrics on the app's own registry, plus the sliding window and the load history."""

    def __init__(self, window_s: float = 60.0, live: Callable[[], Iterable[LiveModelStats]] | None = None,
                 load_samples: int = 720):
        self.registry = CollectorRegistry(auto_describe=True)
        self.window = ServingWindow(window_s)
        self.live = live
        self.load = LoadHistory(load_samples)
        labels = ["model_name", "tier"]
        r = self.registry
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvserve:time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvserve:request_queue_time_seconds", "Time waiting before first schedule", labels,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Generated tokens of finished requests",
                                         labels, registry=r)
        self.requests = Counter("kvserve:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.lora_requests = Counter("kvserve:lora_requests", "Finished requests that ran with a LoRA adapter, "
                                     "per adapter (the base model's are kvserve:request_success's rest)",
                                     ["model_name", "adapter"], registry=r)
        self.preemptions = Counter("kvserve:num_preemptions", "Sequences preempted", ["model_name"], registry=r)
        self.rejections = Counter("kvserve:admission_rejections", "Requests refused at admission",
                                  labels + ["reason"], registry=r)
        billing = ["tenant", "model_name", "tier"]
        self.spend = Counter("kvserve:spend_usd", "Dollars charged to tenants for finished requests (the usage rows' "
                             "price)", billing, registry=r)
        self.cost = Counter("kvserve:cost_usd", "Dollars of engine time spent on finished requests (the usage rows' "
                            "cost)", billing, registry=r)
        if live is not None:
            r.register(_LiveCollector(live))

    def observe_finished(self, model: str, tier: str, out, adapter: str | None = None) -> None:
        """From on_finish (engine thread): one RequestOutput that just finished or was aborted (`adapter`: the
        LoRA adapter it ran with, None for the base model)."""
        m = out.metrics
        ttft = m.ttft if m else None
        e2e = m.e2e if m else None
        queue = m.queue_time if m else None
        tpot = None
        first = out.outputs[0] if out.outputs else None
        if m and m.first_token_time is not None and m.last_token_time is not None and first and len(first.token_ids) > 1:
            tpot = (m.last_token_time - m.first_token_time) / (len(first.token_ids) - 1)
        completion = out.num_completion_tokens
        lab = (model, tier)
        if ttft is not None:
            self.ttft.labels(*lab).observe(ttft)
        if tpot is not None:
            self.tpot.labels(*lab).observe(tpot)
        if e2e is not None:
            self.e2e.labels(*lab).observe(e2e)
        if queue is not None:
            self.queue.labels(*lab).observe(queue)
        self.prompt_tokens.labels(*lab).inc(out.num_prompt_tokens)
        self.generation_tokens.labels(*lab).inc(completion)
        reason = first.finish_reason if first else None
        self.requests.labels(model, tier, reason or "unknown").inc()
        if adapter is not None:
            self.lora_requests.labels(model, adapter).inc()
        self.window.add_request(RequestSample(self.window.clock(), model, tier, ttft, tpot, e2e, queue,
                                              out.num_prompt_tokens, min(out.num_cached_tokens, out.num_prompt_tokens),
                                              completion))

    def observe_step(self, model: str, step) -> None:
        """From on_step (engine thread): one engine step's StepStats."""
        if step is None:
            return
        preempted = getattr(step, "num_preempted", 0) or 0
        if preempted:
            self.preemptions.labels(model).inc(preempted)
        self.window.add_step(StepSample(self.window.clock(), model, getattr(step, "duration", 0.0),
                                        getattr(step, "num_prefill_tokens", 0), getattr(step, "num_decode_tokens", 0),
                                        preempted))

    def observe_usage(self, tenant: str, model: str, tier: str, price: float, cost: float) -> None:
        """From on_finish (engine thread), with the request's usage row: its price and cost."""
        self.spend.labels(tenant, model, tier).inc(price)
        self.cost.labels(tenant, model, tier).inc(cost)

    def sample_load(self, at: float) -> None:
        """One load point per model, read from the engines now (the server calls this every few seconds)."""
        for s in self.live() if self.live is not None else ():
            self.load.add(s.model, LoadPoint(at, s.kv_usage, s.running, dict(s.waiting)))

    def reject(self, model: str, tier: str, reason: str) -> None:
        self.rejections.labels(model, tier, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
