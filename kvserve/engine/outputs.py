"""What the engine returns per request (vLLM's RequestOutput / CompletionOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, token text, logprob)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "queue_timeout"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[Logprob] | None = None
    # Streaming: what this output gained since the previous RequestOutput for the request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    queue_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_tier_cached_tokens: int = 0  # of num_cached_tokens, loaded from the lower tier (host memory or disk)
    num_host_cached_tokens: int = 0  # of those, from host memory (the rest from the disk)
    metrics: RequestMetrics | None = None
    model: str = ""
    engine_seconds: float = 0.0  # engine time charged to it so far (OutputProcessor.charge)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
