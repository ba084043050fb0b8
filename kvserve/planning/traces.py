"""Arrival traces for the simulator: Poisson, bursty, recorded (JSONL), and the W1-W5 shapes.

A trace is a list of `Arrival`s sorted by time. Closed-loop shapes (W1, W2, W4: a fixed concurrency, the
next request sent when one finishes) are not a list of times: they are `ClosedLoop`s, which the
simulator turns into arrivals as requests finish, like the benchmark client does.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import Priority


@dataclass(frozen=True)
class Arrival:
    time: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int
    priority: Priority = Priority.INTERACTIVE
    tenant: str = "default"
    prefix_id: int | None = None  # requests with the same prefix_id share their first prefix_tokens tokens
    prefix_tokens: int = 0

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.time < 0:
            raise ValueError(f"an arrival needs a prompt, an output and a time >= 0: {self}")
        if self.prefix_tokens > self.prompt_tokens:
            raise ValueError("prefix_tokens exceeds prompt_tokens")


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: a fixed mean, or uniform within +-spread of it (vLLM's random dataset's range ratio)."""

    mean: int
    spread: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if not self.spread:
            return self.mean
        lo, hi = max(1, round(self.mean * (1 - self.spread))), max(1, round(self.mean * (1 + self.spread)))
        return rng.randint(lo, hi)


def poisson(rate_per_s: float, duration_s: float, prompt: LengthDist, output: LengthDist,
            priority: Priority = Priority.INTERACTIVE, seed: int = 0, start: float = 0.0,
            tenants: int = 1) -> list[Arrival]:
    """Open-loop arrivals with exponential gaps at `rate_per_s` for `duration_s`."""
    rng, t, out = random.Random(seed), start, []
    if rate_per_s <= 0:
        return out
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= start + duration_s:
            return out
        out.append(Arrival(t, prompt.sample(rng), output.sample(rng), priority, f"t{rng.randrange(tenants)}"))


def bursty(rate_per_s: float, duration_s: float, prompt: LengthDist, output: LengthDist, burst: float = 4.0,
           period_s: float = 10.0, duty: float = 0.2, priority: Priority = Priority.INTERACTIVE,
           seed: int = 0) -> list[Arrival]:
    """On/off arrivals with the same mean rate: `burst` x the rate for `duty` of each period, the rest
    of the period at the rate that keeps the mean."""
    if not 0 < duty < 1 or burst * duty > 1:
        raise ValueError("bursty needs 0 < duty < 1 and burst x duty <= 1")
    low = rate_per_s * (1 - burst * duty) / (1 - duty)
    out: list[Arrival] = []
    t, k = 0.0, 0
    while t < duration_s:
        on = min(period_s * duty, duration_s - t)
        out += poisson(rate_per_s * burst, on, prompt, output, priority, seed + 2 * k, start=t)
        off = min(period_s * (1 - duty), duration_s - t - on)
        if off > 0:
            out += poisson(low, off, prompt, output, priority, seed + 2 * k + 1, start=t + on)
        t, k = t + period_s, k + 1
    return out


def constant(rate_per_s: float, duration_s: float, prompt: LengthDist, output: LengthDist,
             priority: Priority = Priority.INTERACTIVE, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    n = int(duration_s * rate_per_s)
    return [Arrival(i / rate_per_s, prompt.sample(rng), output.sample(rng), priority) for i in range(n)]


def recorded(path: str | Path) -> list[Arrival]:
    """A JSONL trace: one object per line with `time` (s), `prompt_tokens`, `output_tokens` and optionally
    `priority` ("interactive" | "batch"), `tenant`, `prefix_id`, `prefix_tokens`."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prio = Priority[str(row.get("priority", "interactive")).upper()]
            out.append(Arrival(float(row["time"]), int(row["prompt_tokens"]), int(row["output_tokens"]), prio,
                               str(row.get("tenant", "default")), row.get("prefix_id"),
                               int(row.get("prefix_tokens", 0))))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{n}: not a trace line ({e})") from None
    return sorted(out, key=lambda a: a.time)


@dataclass(frozen=True)
class ClosedLoop:
    """`num_requests` requests sent `concurrency` at a time, each sent when one before it finishes."""

    num_requests: int
    concurrency: int
    prompt: LengthDist
    output: LengthDist
    priority: Priority = Priority.INTERACTIVE
    shared_prefix_tokens: int = 0  # W4: every prompt starts with the same prefix
    duration_s: float | None = None  # keep sending until then instead of stopping at num_requests (a flood)
    seed: int = 0

    def request(self, i: int, rng: random.Random, now: float) -> Arrival:
        prompt = self.prompt.sample(rng) + self.shared_prefix_tokens
        return Arrival(now, prompt, self.output.sample(rng), self.priority,
                       prefix_id=0 if self.shared_prefix_tokens else None, prefix_tokens=self.shared_prefix_tokens)


@dataclass(frozen=True)
class Workload:
    """What the simulator replays: open-loop arrivals plus any closed-loop streams."""

    name: str
    arrivals: list[Arrival] = field(default_factory=list)
    loops: list[ClosedLoop] = field(default_factory=list)


def shape(name: str, scale: float = 1.0) -> Workload:
    """The benchmark suite's workloads (shared/WORKLOADS.md), for comparing the simulator with a measurement.
    `scale` multiplies W5's rate (its rate is 3x what W1 sustains on the machine, known only after W1)."""
    fixed = LengthDist
    if name == "W1":
        return Workload(name, loops=[ClosedLoop(64, 32, fixed(256), fixed(128))])
    if name == "W2":
        return Workload(name, loops=[ClosedLoop(8, 1, fixed(256), fixed(128))])
    if name == "W3":
        flood = ClosedLoop(1 << 30, 16, fixed(256), fixed(256), Priority.BATCH, duration_s=60.0)
        return Workload(name, constant(1.0, 60.0, fixed(64), fixed(64)), [flood])
    if name == "W3-alone":
        return Workload(name, constant(1.0, 60.0, fixed(64), fixed(64)))
    if name == "W4":
        return Workload(name, loops=[ClosedLoop(32, 4, fixed(64), fixed(64), shared_prefix_tokens=512)])
    if name == "W5":
        return Workload(name, poisson(scale, 60.0, fixed(256), fixed(128)))
    raise ValueError(f"unknown workload {name!r}; known: W1, W2, W3, W3-alone, W4, W5")
