"""Rate-limit arithmetic, pure: requests and tokens per minute per tenant, in fixed one-minute windows.

Admission counts the request and its worst-case tokens (prompt + max_tokens x n) into the tenant's current
window, or refuses (429 rate_limit_exceeded, Retry-After = the time to the window's end); the finish
settles the tokens to the real count (if the window is still current). The store keeps the windows, so
the limit holds across gateways (store/rate_limits.py). A fixed window lets up to twice the limit through
across a window boundary; the one-transaction check per request is what that buys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

WINDOW_S = 60.0
# Rate limits shared by regions (metering/escrow.py) are leased per window under these keys (a budget's key is
# its model id, and model ids do not start with '#').
SHARED_KEYS = {"#rpm": "rpm", "#tpm": "tpm"}


def window_start(now: float) -> float:
    return math.floor(now / WINDOW_S) * WINDOW_S


@dataclass(frozen=True)
class RateState:
    """A tenant's limits and its current window after a check (for the x-ratelimit-* headers)."""

    rpm: int | None
    tpm: int | None
    requests: int  # counted in this window, this request included when admitted
    tokens: int
    reset_s: float  # until the window ends
    # With regions sharing the limits: what this region may count in the window (its floor and leases).
    window_start: float = 0.0
    allot_requests: float | None = None
    allot_tokens: float | None = None

    def allows(self, tokens: int) -> bool:
        return self.allows_within(tokens, self.allot_requests, self.allot_tokens)

    def allows_globally(self, tokens: int) -> bool:
        return self.allows_within(tokens, None, None)

    def allows_within(self, tokens: int, requests_cap: float | None, tokens_cap: float | None) -> bool:
        rpm = self.rpm if requests_cap is None or self.rpm is None else min(self.rpm, requests_cap)
        tpm = self.tpm if tokens_cap is None or self.tpm is None else min(self.tpm, tokens_cap)
        return (rpm is None or self.requests + 1 <= rpm + 1e-9) and (tpm is None or self.tokens + tokens <= tpm + 1e-9)

    def needs(self, tokens: int) -> dict[str, float]:
        """What this region lacks of its allotments to count one more request of `tokens` (by SHARED_KEYS key)."""
        out = {}
        if self.rpm is not None and self.allot_requests is not None and self.requests + 1 > self.allot_requests:
            out["#rpm"] = self.requests + 1 - self.allot_requests
        if self.tpm is not None and self.allot_tokens is not None and self.tokens + tokens > self.allot_tokens:
            out["#tpm"] = self.tokens + tokens - self.allot_tokens
        return out

    def headers(self) -> dict[str, str]:
        reset = _duration(self.reset_s)
        h = {}
        if self.rpm is not None:
            h.update({"x-ratelimit-limit-requests": str(self.rpm),
                      "x-ratelimit-remaining-requests": str(max(0, self.rpm - self.requests)),
                      "x-ratelimit-reset-requests": reset})
        if self.tpm is not None:
            h.update({"x-ratelimit-limit-tokens": str(self.tpm),
                      "x-ratelimit-remaining-tokens": str(max(0, self.tpm - self.tokens)),
                      "x-ratelimit-reset-tokens": reset})
        return h


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "150ms"."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"
