"""SamplingParams: what a request asks of the sampler and the stop checker (vLLM's field names).

Frozen: one request's params pass unchanged from the service through every hop to the sampler, so no
layer copies them defensively; what the engine derives per request (the resolved max_tokens) lives on
its sequence. `dataclasses.replace` makes a changed copy, validated again."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.engine.structured.params import StructuredOutputsParams

# Bounds past which a parameter broke the sampler's tensors (and with them the engine, for every request):
# token ids and top_k are int32 on the device; a repetition penalty of 0 in float32 divides by zero.
MAX_TOKEN_ID = 2**31 - 1
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the server maps it to a 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculation: bool = True  # False: never drafted for (where the server speculates: engine/speculation/)
    # What the output must match (a JSON schema, a regex, a choice, a grammar): engine/structured/params.py
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"{param} {msg}", param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.n > 128:
            raise bad("n", f"must be at most 128, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOKEN_ID:
            raise bad("top_k", f"must be -1 (off), 0 (off) or in [1, {MAX_TOKEN_ID}], got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be in [{low}, {high}], got {self.repetition_penalty}")
        if any(not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids in [0, {MAX_TOKEN_ID}]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise bad("stop", "strings must be non-empty")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be StructuredOutputsParams")
            if self.min_tokens:  # a complete output may have only eos left to take, which min_tokens forbids
                raise bad("min_tokens", "must be 0 with a structured-output constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
