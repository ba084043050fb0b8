"""Usage reports in the shape of OpenAI's usage API (pure: the store aggregates, this shapes).

A page of time buckets [start_time, end_time), each with one result per group (tenant, model, tier, adapter,
as asked; a result's adapter is None for the base model, or when not grouped by it): requests, input tokens
(and of them cached), output tokens, the amount charged, the cost of the engine time, the engine seconds.
Every bucket of the range is present, empty ones too, as OpenAI's are.
"""
from __future__ import annotations

import csv
import io
from typing import Any

from kvserve.config import ModelPrice
from kvserve.metering.prices import DEFAULT_UTILIZATION, break_even_price

GROUPS = ("tenant", "model", "tier", "adapter")  # what a result may be grouped by (store/usage.py REPORT_GROUPS)
BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
DEFAULT_LIMIT = {"1m": 60, "1h": 24, "1d": 7}
MAX_LIMIT = {"1m": 1440, "1h": 168, "1d": 31}


def page(rows: list[dict[str, Any]], start: float, end: float, width: str, group_by: list[str],
         limit: int) -> dict[str, Any]:
    """The OpenAI-shaped page for the store's bucket rows (UsageLedger.buckets) over [start, end)."""
    w = BUCKET_WIDTHS[width]
    n = max(0, min(limit, -(-int(end - start) // w)))
    by_bucket: dict[int, list[dict]] = {}
    for r in rows:
        by_bucket.setdefault(r["bucket"], []).append(r)
    data = []
    for i in range(n):
        b0 = start + i * w
        results = [dict({"object": "organization.usage.completions.result",
                         "input_tokens": r["input_tokens"], "input_cached_tokens": r["input_cached_tokens"],
                         "input_disk_cached_tokens": r["input_disk_cached_tokens"],
                         "input_host_cached_tokens": r["input_host_cached_tokens"],
                         "output_tokens": r["output_tokens"], "num_model_requests": r["requests"],
                         "amount": {"value": round(r["amount"], 9), "currency": "usd"},
                         "cost": {"value": round(r["cost"], 9), "currency": "usd"},
                         "engine_seconds": round(r["engine_seconds"], 6)},
                        **{g: (r[g] if g in group_by else None) for g in GROUPS})
                   for r in by_bucket.get(i, [])]
        data.append({"object": "bucket", "start_time": int(b0), "end_time": int(min(b0 + w, end)), "results": results})
    more = start + n * w < end
    return {"object": "page", "data": data, "has_more": more, "next_page": str(int(start + n * w)) if more else None}


_SUMMED = ("input_tokens", "input_cached_tokens", "input_disk_cached_tokens", "input_host_cached_tokens",
           "output_tokens", "num_model_requests", "engine_seconds")


def merge(pages: list[dict[str, Any]]) -> dict[str, Any]:
    """Pages of the same buckets from several regions (each region's usage rows are its own) as one: per
    bucket, one result per group with every count and amount summed."""
    merged = {**pages[0], "data": []}
    for buckets in zip(*(p["data"] for p in pages)):
        groups: dict[tuple, dict] = {}
        for r in (r for b in buckets for r in b["results"]):
            key = tuple(r.get(g) for g in GROUPS)  # a peer of an older kvserve has no adapter in its results
            if key not in groups:
                groups[key] = {**r, "amount": dict(r["amount"]), "cost": dict(r["cost"])}
                continue
            g = groups[key]
            for f in _SUMMED:
                g[f] += r[f]
            for f in ("amount", "cost"):
                g[f]["value"] = round(g[f]["value"] + r[f]["value"], 9)
        merged["data"].append({**buckets[0], "results": list(groups.values())})
    return merged


CHART_MIN_BUCKETS = 6  # a chart of a fresh server still reads as a stretch of time
CHART_MAX_BUCKETS = 168  # a week of hours; a longer history is drawn in days (at most MAX_LIMIT's 31)


def chart_buckets(first_usage: float | None, now: float) -> tuple[str, float, int]:
    """(width, start, count) of the buckets a chart of the usage from `first_usage` to `now` draws: the
    finest width whose aligned buckets cover that span within CHART_MAX_BUCKETS (minutes for the first
    hours, hours for the first week, then days), so a young ledger is not a row of empty day bars."""
    first = now if first_usage is None else min(first_usage, now)
    for name in BUCKET_WIDTHS:
        w = BUCKET_WIDTHS[name]
        n = max(CHART_MIN_BUCKETS, int(now // w - first // w) + 1)
        if n <= min(CHART_MAX_BUCKETS, MAX_LIMIT[name]):
            return name, (now // w - n + 1) * w, n
    n = MAX_LIMIT["1d"]
    return "1d", (now // BUCKET_WIDTHS["1d"] - n + 1) * BUCKET_WIDTHS["1d"], n


def served_break_even(price: ModelPrice, usage_page: dict[str, Any], model: str) -> dict[str, Any]:
    """The break-even price per million output tokens of `model` at the mix a usage page served: all its
    engine seconds (prompts' included) over its output tokens, at prices.DEFAULT_UTILIZATION; None before
    it has produced a token."""
    rows = [r for b in usage_page["data"] for r in b["results"] if r["model"] == model]
    out = sum(r["output_tokens"] for r in rows)
    engine_s = sum(r["engine_seconds"] for r in rows)
    value = break_even_price(price, engine_s / out) if out else None
    return {"break_even_output": value, "break_even_utilization": DEFAULT_UTILIZATION}


COLUMNS = ("start_time", "end_time", "tenant", "model", "tier", "adapter", "num_model_requests", "input_tokens",
           "input_cached_tokens", "input_disk_cached_tokens", "input_host_cached_tokens", "output_tokens",
           "amount_usd", "cost_usd", "engine_seconds")


def flat(p: dict[str, Any]) -> list[tuple]:
    """One row per (bucket, group): what the CSV export and `kvserve usage` print."""
    out = []
    for b in p["data"]:
        for r in b["results"]:
            out.append((b["start_time"], b["end_time"], r["tenant"], r["model"], r["tier"], r.get("adapter"),
                        r["num_model_requests"], r["input_tokens"], r["input_cached_tokens"],
                        r["input_disk_cached_tokens"], r["input_host_cached_tokens"], r["output_tokens"],
                        r["amount"]["value"], r["cost"]["value"], r["engine_seconds"]))
    return out


def to_csv(p: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    w.writerows(flat(p))
    return buf.getvalue()
