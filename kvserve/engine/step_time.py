"""How long an engine step takes, learned from the steps the engine ran; admission's wait estimates use it.

A step's time is close to affine in its work: a fixed part (dispatch, sampling, the weight reads a decode
step makes whatever its batch), a part per decoding sequence (its KV reads, its rows of every GEMM) and a
part per prefill token. The fixed part is what a single tokens/s rate leaves out: a fused decode step of
1 sequence took 14 ms and one of 32 took 41 ms, so a rate measured at one batch size misjudged the others
and admission let in requests that then waited twice the bound (W5 in BENCHMARKS.md, session s8).

Fitted by recursive least squares with exponential forgetting (the machine's speed drifts with its
neighbours): each observation costs a few dozen float operations and no history is kept. Pure Python,
no torch, so the scheduler stays testable in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Features are scaled to be of order one at typical sizes, so the fit stays well conditioned.
DECODE_SCALE = 32.0
PREFILL_SCALE = 1024.0
# Prior variance of each (scaled) coefficient, in s^2: weak, so the first few steps dominate the prior.
PRIOR_VARIANCE = 1.0
# Cap on the covariance's trace: steps that all look alike (say only decodes of 64) give no information on
# the other directions, and forgetting would otherwise inflate their variance without bound.
MAX_TRACE = 1e3


@dataclass
class StepTimeModel:
    """seconds ~= fixed_s + per_decode_s * decodes + per_prefill_token_s * prefill_tokens."""

    fixed_s: float = 0.01
    per_decode_s: float = 1 / 500
    per_prefill_token_s: float = 1 / 4000
    forgetting: float = 0.98  # weight of the past per step: about the last 50 steps count
    observations: int = 0
    _theta: list[float] = field(init=False, repr=False)
    _cov: list[list[float]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._theta = [self.fixed_s, self.per_decode_s * DECODE_SCALE, self.per_prefill_token_s * PREFILL_SCALE]
        self._cov = [[PRIOR_VARIANCE if i == j else 0.0 for j in range(3)] for i in range(3)]

    @staticmethod
    def _features(decodes: int, prefill_tokens: int) -> tuple[float, float, float]:
        return 1.0, decodes / DECODE_SCALE, prefill_tokens / PREFILL_SCALE

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Fold in one step that ran `decodes` single-token sequences and `prefill_tokens` in `seconds`."""
        if seconds <= 0 or decodes + prefill_tokens <= 0:
            return
        x, th, cov, lam = self._features(decodes, prefill_tokens), self._theta, self._cov, self.forgetting
        px = [sum(cov[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - sum(th[i] * x[i] for i in range(3))
        for i in range(3):  # projected onto costs >= 0: no part of a step makes it faster
            th[i] = max(0.0, th[i] + gain[i] * err)
        inflate = 1 / lam if sum(cov[i][i] for i in range(3)) < MAX_TRACE else 1.0
        for i in range(3):
            for j in range(3):
                cov[i][j] = (cov[i][j] - gain[i] * px[j]) * inflate
        self.observations += 1
        self.fixed_s, self.per_decode_s, self.per_prefill_token_s = th[0], th[1] / DECODE_SCALE, th[2] / PREFILL_SCALE

    def predict(self, decodes: int, prefill_tokens: int = 0) -> float:
        """Seconds for one step of this shape."""
        return self.fixed_s + self.per_decode_s * decodes + self.per_prefill_token_s * prefill_tokens

    def prefill_seconds(self, tokens: int, decodes: int, budget: int) -> float:
        """Seconds to prefill `tokens` in chunks of at most `budget` tokens per step, beside `decodes`
        running sequences that decode in every one of those steps."""
        if tokens <= 0:
            return 0.0
        per_step = max(1, budget - decodes)
        steps = -(-tokens // per_step)
        return steps * self.predict(decodes) + self.per_prefill_token_s * tokens
