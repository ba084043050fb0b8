"""How long an engine step takes, learned from the steps the engine ran; admission's wait estimates use it.

A step's time is close to affine in its work: a fixed part (dispatch, sampling, the weight reads a decode
step makes whatever its batch), a part per decoding sequence (its KV reads, its rows of every GEMM) and a
part per prefill token. The fixed part is what a single tokens/s rate leaves out: a fused decode step of
32 sequences costs far less than 32 steps of one, so a rate measured at one batch size misjudged the others
and admission let in requests that then waited well past the bound.

Fitted by least squares over the last `window` steps (the machine's speed drifts with its neighbours),
with no cost negative (exact non-negative least squares: three unknowns, so every active set is tried
when the plain solution has a negative part) and a light ridge towards the defaults, which decides the
directions the window says nothing about (a server that has only decoded keeps the default prefill
cost). A sliding window, unlike recursive least squares with forgetting, cannot wind up: whatever ran
before, `window` steps of a new regime determine the fit. Pure Python, no torch: the scheduler stays
testable in milliseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import combinations

# Features are scaled to be of order one at typical sizes, so the fit stays well conditioned.
DECODE_SCALE = 32.0
PREFILL_SCALE = 1024.0
# Weight of the defaults, in observations' worth per coefficient.
RIDGE = 0.1
# Shortest step a prediction may claim (all parts can fit to zero on odd histories; rates divide by it).
MIN_STEP_S = 1e-4


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b for a small symmetric positive definite a (Gaussian elimination); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[pivot][c]) < 1e-12:
            return None
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def nonnegative_least_squares(a: list[list[float]], b: list[float]) -> list[float]:
    """The x >= 0 minimizing x'Ax - 2b'x (normal equations A = X'X, b = X'y): each set of free parts
    solved with the others held at zero, the cheapest kept. Exact; 2^n solves, for a handful of unknowns."""
    n = len(b)
    full = _solve(a, b)
    if full is not None and min(full) >= 0:
        return full
    best, best_cost = [0.0] * n, 0.0  # all zero costs 0
    for k in range(1, n):
        for free in combinations(range(n), k):
            sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            if sub is None or min(sub) < 0:
                continue
            theta = [0.0] * n
            for i, v in zip(free, sub):
                theta[i] = v
            cost = sum(theta[i] * a[i][j] * theta[j] for i in range(n) for j in range(n)) \
                - 2 * sum(b[i] * theta[i] for i in range(n))
            if cost < best_cost:
                best, best_cost = theta, cost
    return best


# A weight dtype as calibrations name it (planning/calibrate.py), by the torch dtype's str().
DTYPE_LABELS = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class StepTimePrior:
    """Step-time coefficients measured on this machine (planning's calibration), as data: an engine starts
    its StepTimeModel from them instead of the generic defaults, but only at the weight dtype measured."""

    fixed_s: float
    per_decode_s: float
    per_prefill_token_s: float
    weight_dtype: str  # a DTYPE_LABELS value

    def fits(self, dtype) -> bool:
        return DTYPE_LABELS.get(str(dtype)) == self.weight_dtype

    def model(self) -> "StepTimeModel":
        return StepTimeModel(self.fixed_s, self.per_decode_s, self.per_prefill_token_s)


@dataclass
class StepTimeModel:
    """seconds ~= fixed_s + per_decode_s * decodes + per_prefill_token_s * prefill_tokens."""

    fixed_s: float = 0.01
    per_decode_s: float = 1 / 500
    per_prefill_token_s: float = 1 / 4000
    window: int = 64  # steps the fit covers
    # The features' typical sizes (they scale to order one, so the fit stays well conditioned and the ridge
    # weighs each coefficient alike): decodes a step, prefill tokens a step.
    decode_scale: float = DECODE_SCALE
    prefill_scale: float = PREFILL_SCALE
    observations: int = 0
    _prior: tuple[float, float, float] = field(init=False, repr=False)
    _steps: deque = field(init=False, repr=False)
    _xtx: list[list[float]] = field(init=False, repr=False)  # sums over the window: X'X and X'y
    _xty: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._prior = (self.fixed_s, self.per_decode_s * self.decode_scale, self.per_prefill_token_s * self.prefill_scale)
        self._steps = deque(maxlen=self.window)
        self._xtx, self._xty = [[0.0] * 3 for _ in range(3)], [0.0] * 3

    def _features(self, decodes: int, prefill_tokens: int) -> tuple[float, float, float]:
        return 1.0, decodes / self.decode_scale, prefill_tokens / self.prefill_scale

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Fold in one step that ran `decodes` single-token sequences and `prefill_tokens` in `seconds`."""
        if seconds <= 0 or decodes + prefill_tokens <= 0:
            return
        if len(self._steps) == self.window:
            self._accumulate(*self._steps[0], -1.0)
        step = (self._features(decodes, prefill_tokens), seconds)
        self._steps.append(step)
        self.observations += 1
        if self.observations % self.window == 0:  # re-sum now and then: no drift from the subtractions
            self._xtx, self._xty = [[0.0] * 3 for _ in range(3)], [0.0] * 3
            for x, y in self._steps:
                self._accumulate(x, y, 1.0)
        else:
            self._accumulate(*step, 1.0)
        self._fit()

    def _accumulate(self, x: tuple[float, float, float], y: float, sign: float) -> None:
        for i in range(3):
            self._xty[i] += sign * x[i] * y
            for j in range(3):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _fit(self) -> None:
        a = [[self._xtx[i][j] + (RIDGE if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [self._xty[i] + RIDGE * self._prior[i] for i in range(3)]
        theta = _solve(a, b)
        if theta is None or min(theta) < 0:
            theta = self._nonnegative(a, b)
        self.fixed_s, self.per_decode_s, self.per_prefill_token_s = (
            theta[0], theta[1] / self.decode_scale, theta[2] / self.prefill_scale)

    @staticmethod
    def _nonnegative(a: list[list[float]], b: list[float]) -> list[float]:
        return nonnegative_least_squares(a, b)

    def predict(self, decodes: int, prefill_tokens: int = 0) -> float:
        """Seconds for one step of this shape."""
        return max(MIN_STEP_S,
                   self.fixed_s + self.per_decode_s * decodes + self.per_prefill_token_s * prefill_tokens)

    def prefill_seconds(self, tokens: int, decodes: int, budget: int) -> float:
        """Seconds to prefill `tokens` in chunks of at most `budget` tokens per step, beside `decodes`
        running sequences that decode in every one of those steps."""
        if tokens <= 0:
            return 0.0
        per_step = max(1, budget - decodes)
        steps = -(-tokens // per_step)
        return steps * self.predict(decodes) + self.per_prefill_token_s * tokens
