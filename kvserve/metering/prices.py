"""Price and cost of one request, pure arithmetic (no I/O).

Price (what the tenant is charged): prompt tokens not served from the prefix cache at the input price,
cached prompt tokens at the cached-input price, output tokens at the output price; all per million
tokens, times `batch_discount` in the batch tier. The worst case, reserved against a budget before a
request runs, is its whole prompt at the input price plus `max_tokens` at the output price.

Cost (what serving it cost): the engine seconds charged to it (OutputProcessor.charge: its token share
of each step it was in) times the replica's cost per hour / 3600. Margin = price - cost.

Break-even (what a token must be priced at for the replica to pay for itself): its engine seconds at the
replica's cost, divided by the share of the hour the replica is busy, since the tokens it serves also pay
for the time it idles.
"""
from __future__ import annotations

import math

from kvserve.config import ModelPrice

PER_TOKEN = 1e-6  # prices are per million tokens
DEFAULT_UTILIZATION = 0.5  # the busy share of a replica's hour a break-even price assumes
DEFAULT_MARGIN = 1.0  # list prices at twice break-even: the batch tier, at batch_discount 0.5, still breaks even
CACHED_INPUT_SHARE = 0.25  # a prompt token served from the prefix cache costs no engine time; listed at a quarter


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


def break_even_price(price: ModelPrice, engine_s_per_token: float,
                     utilization: float = DEFAULT_UTILIZATION) -> float:
    """Dollars per million tokens that pay for `engine_s_per_token` on a replica costing
    `price.replica_cost_per_hour`, busy `utilization` (0-1] of the time."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization is the busy share of the hour, in (0, 1], not {utilization!r}")
    if not engine_s_per_token >= 0:
        raise ValueError(f"engine seconds per token must be >= 0, not {engine_s_per_token!r}")
    return request_cost(price, engine_s_per_token) / utilization / PER_TOKEN


def list_price(break_even: float, margin: float) -> float:
    """`break_even` plus `margin` (1.0: 100% over it), rounded up to two significant digits: a price that
    reads cleanly and never falls below the margin asked for."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, not {margin!r}")
    target = break_even * (1 + margin)
    if target <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(target)) - 1)
    return round(math.ceil(round(target / step, 9)) * step, 12)
