"""Per-request records and the benchmark figures computed from them, with vLLM's definitions.

`vllm bench serve` (vllm/benchmarks/serve.py, `calculate_metrics`) defines, and we follow:

* TTFT: time from sending the request to the first streamed chunk that carries a choice.
* E2E latency: time from sending the request to the last chunk that carries a choice.
* TPOT (per request): (e2e - ttft) / (output_tokens - 1), only for requests with more than one
  output token; the figure is over requests.
* ITL: every gap between two consecutive choice chunks, pooled over all requests.
* Output tokens of a request: `usage.completion_tokens` when the server streamed usage, else a
  count from the stream (vLLM re-tokenizes the text; we count the chunks that carried text).
* Throughputs: totals over the benchmark duration (first request sent to last one finished):
  requests/s = completed / duration, output tok/s = sum(output tokens) / duration, total tok/s
  adds the prompt tokens of the completed requests (`usage.prompt_tokens` when the server sent it,
  as vLLM's client does, else the length our tokenizer gave the prompt).
* Goodput: requests meeting every SLO (here a TTFT bound, ttft <= slo as vLLM) / duration.
* Percentiles: numpy's linear interpolation, in milliseconds; mean/median/std as numpy.

Failed requests count nowhere but in `failed` and `error_counts` (keyed by HTTP status, or
`stream_error` for an error event inside a 200 stream, or `exception:<Name>` for a transport
error); cancelled requests (a background tier cut off when a timed run ends) only in `cancelled`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds (perf_counter deltas)."""

    tier: str = "default"
    index: int = 0  # index of the prompt within its tier
    prompt_len: int = 0  # prompt tokens as our tokenizer counts them (what we intended to send)
    max_tokens: int = 0
    start: float = 0.0  # seconds after the benchmark started
    success: bool = False
    cancelled: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str = ""
    error_kind: str = ""  # "429", "503", "stream_error", "exception:ReadTimeout", "no_tokens", ...
    ttft: float = 0.0
    latency: float = 0.0  # e2e: to the last choice chunk
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # choice chunks received
    text_chunks: int = 0  # choice chunks with non-empty text
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    generated_chars: int = 0

    @property
    def input_tokens(self) -> int:
        return int(self.usage_prompt_tokens) if self.usage_prompt_tokens is not None else self.prompt_len

    @property
    def output_tokens(self) -> int:
        if self.usage_completion_tokens:
            return int(self.usage_completion_tokens)
        return self.text_chunks

    def to_json(self, with_itl: bool = False) -> dict:
        d = asdict(self)
        if not with_itl:
            d.pop("itl")
        d["output_tokens"] = self.output_tokens
        return d


def _ms_stats(values: Sequence[float], name: str, percentiles: Iterable[float]) -> dict:
    """vLLM's mean/median/std/pXX of a list of seconds, in ms; an empty list gives zeros (np.mean(0))."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(arr)), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(np.std(arr))}
    for p in percentiles:
        out[f"p{_pname(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(records: Sequence[RequestRecord], duration: float, *, goodput_ttft_ms: float | None = None,
                    percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict:
    """The figures of one set of requests (a whole run, or one tier of it) over `duration` seconds."""
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success and not r.cancelled]
    cancelled = [r for r in records if r.cancelled]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    total_input = sum(r.input_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    dur = duration if duration > 0 else float("nan")
    m = {
        "duration": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": len(cancelled),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        # Every token streamed to the client, also by requests cancelled mid-stream (a background tier cut
        # off at the end): the work the server did in the window, not quantised by which requests finished.
        "streamed_output_throughput": (total_output + sum(r.chunks for r in cancelled)) / dur,
    }
    if goodput_ttft_ms is not None:
        good = sum(1 for t in ttfts if t * 1000.0 <= goodput_ttft_ms)
        m["goodput_ttft_ms"] = goodput_ttft_ms
        m["good_requests"] = good
        m["request_goodput"] = good / dur
    else:
        m["request_goodput"] = None
    counts = Counter(r.error_kind or "error" for r in failed)
    m["error_counts"] = dict(sorted(counts.items()))
    m["error_share"] = {k: v / len(records) for k, v in m["error_counts"].items()} if records else {}
    m["usage_reported"] = sum(1 for r in ok if r.usage_completion_tokens is not None)
    cached = [r.usage_cached_tokens for r in ok if r.usage_cached_tokens is not None]
    m["cached_prompt_tokens"] = sum(cached) if cached else None
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_ms_stats(values, name, percentiles))
    return m


def percentile_keys(percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> list[str]:
    return [_pname(p) for p in percentiles]


def format_table(m: dict, title: str = "Serving Benchmark Result",
                 percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> str:
    """A text block in the shape `vllm bench serve` prints."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(f"{label:<40}" + (fmt.format(value) if isinstance(value, (int, float)) else str(value)))

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    if m.get("cancelled"):
        row("Cancelled at end (background tier):", m["cancelled"], "{:<10}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m.get("request_goodput") is not None:
        row(f"Request goodput (req/s, TTFT<={m['goodput_ttft_ms']:g}ms):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{label:-^{w}}")
        upper = name.upper()
        row(f"Mean {upper} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{_pname(p)} {upper} (ms):", m[f"p{_pname(p)}_{name}_ms"])
    if m.get("error_counts"):
        lines.append(f"{'Errors':-^{w}}")
        for k, v in m["error_counts"].items():
            share = m.get("error_share", {}).get(k)
            row(f"{k}:", f"{v}" + (f" ({share:.1%} of requests)" if share is not None else ""))
    lines.append("=" * w)
    return "\n".join(lines)
