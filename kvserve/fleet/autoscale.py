"""How many engine replicas a model's pool wants, from the engines' own signals (not request counts).

Request-count autoscaling fits LLM work poorly (one request may be 10 tokens or 10,000; ray-llm #133). Each
replica reports (EngineReplica.record_autoscaling_stats) its waiting prompt tokens, its KV-cache use and
its estimated TTFT for a new interactive request. The pool's pressure is the largest of
  waiting prompt tokens / (target_queued_tokens x replicas)   work queued beyond what the pool absorbs
  mean KV-cache use / target_kv_usage                          memory about to force preemptions
  largest estimated TTFT / ttft_slo_s                          the interactive tier's latency promise
Pressure above 1 wants ceil(replicas x pressure) replicas; below `downscale_below` it wants one fewer;
in between, as many as now (a dead band, so the pool does not flap). `desired_replicas` is pure; Ray Serve
applies min/max_replicas and the up/down delays (ModelFleet) to what it returns (`LLMSignalPolicy`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

METRICS = ("queued_prompt_tokens", "kv_usage", "est_ttft_s")


@dataclass(frozen=True)
class ScalingTargets:
    target_queued_tokens: int = 2048
    target_kv_usage: float = 0.8
    ttft_slo_s: float = 0.5
    downscale_below: float = 0.3

    def __post_init__(self):
        if self.target_queued_tokens < 1 or not 0 < self.target_kv_usage <= 1 or self.ttft_slo_s <= 0:
            raise ValueError("target_queued_tokens >= 1, target_kv_usage in (0, 1], ttft_slo_s > 0")
        if not 0 <= self.downscale_below < 1:
            raise ValueError("downscale_below must be in [0, 1)")


def pressure(signals: list[dict], targets: ScalingTargets) -> float:
    """The pool's pressure (see the module docstring) from each running replica's signals."""
    if not signals:
        return 0.0
    n = len(signals)
    queued = sum(s.get("queued_prompt_tokens", 0.0) for s in signals) / (targets.target_queued_tokens * n)
    kv = sum(s.get("kv_usage", 0.0) for s in signals) / n / targets.target_kv_usage
    ttft = max(s.get("est_ttft_s", 0.0) for s in signals) / targets.ttft_slo_s
    return max(queued, kv, ttft)


def desired_replicas(current: int, signals: list[dict], targets: ScalingTargets) -> int:
    if current == 0:
        return 1
    p = pressure(signals, targets)
    if p > 1.0:
        return math.ceil(current * p)
    if p < targets.downscale_below:
        return current - 1
    return current


class LLMSignalPolicy:
    """Ray Serve's custom autoscaling policy hook: (AutoscalingContext) -> (replicas, policy state)."""

    def __init__(self, **targets):
        self.targets = ScalingTargets(**targets)

    def __call__(self, ctx):
        metrics = ctx.aggregated_metrics or {}
        replicas = set().union(*(metrics.get(m, {}).keys() for m in METRICS)) if metrics else set()
        signals = [{m: metrics.get(m, {}).get(r, 0.0) for m in METRICS} for r in replicas]
        return desired_replicas(ctx.current_num_replicas, signals, self.targets), ctx.policy_state
