"""Price and cost of one request, pure arithmetic (no I/O).

Price (what the tenant is charged): prompt tokens not served from the prefix cache at the input price,
cached prompt tokens at the cached-input price, output tokens at the output price; all per million
tokens, times `batch_discount` in the batch tier. The worst case, reserved against a budget before a
request runs, is its whole prompt at the input price plus `max_tokens` at the output price.

Cost (what serving it cost): the engine seconds charged to it (OutputProcessor.charge: its token share
of each step it was in) times the replica's cost per hour / 3600. Margin = price - cost.
"""
from __future__ import annotations

from kvserve.config import ModelPrice

PER_TOKEN = 1e-6  # prices are per million tokens


def tier_factor(price: ModelPrice, tier: str) -> float:
    return price.batch_discount if tier == "batch" else 1.0


def request_price(price: ModelPrice, tier: str, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
    """Dollars charged for a finished request."""
    cached = min(cached_tokens, prompt_tokens)
    base = (prompt_tokens - cached) * price.input + cached * price.cached_input + output_tokens * price.output
    return base * PER_TOKEN * tier_factor(price, tier)


def worst_case_price(price: ModelPrice, tier: str, prompt_tokens: int, max_tokens: int) -> float:
    """The most a request can be charged: no cache hit, every allowed output token."""
    return request_price(price, tier, prompt_tokens, 0, max_tokens)


def request_cost(price: ModelPrice, engine_seconds: float) -> float:
    """Dollars its share of the replica's time cost."""
    return engine_seconds * price.replica_cost_per_hour / 3600.0
