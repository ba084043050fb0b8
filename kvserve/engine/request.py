"""Request and sequence state shared by the scheduler, the runner and the engine.

Pure Python (no torch): the scheduler and KV manager work on token counts and block ids only.
A sequence owes `num_tokens - num_computed_tokens` tokens of forward work; prefill, chunked
prefill, prefix-cache hits and decode are all the same thing seen this way.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.config import Priority  # noqa: F401  (the tier type, defined with the tier limits)
from kvserve.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_QUEUE_TIMEOUT = "queue_timeout"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class SequenceTimings:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(eq=False)
class Sequence:
    """One stream of tokens with its own KV blocks. A request with n > 1 owns n sequences (forks)."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    tenant: str = "default"
    cache_salt: str | None = None  # prefix-cache namespace; the server sets it to the tenant
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    fork_index: int = 0  # 0 for the parent, 1..n-1 for forks
    timings: SequenceTimings = field(default_factory=SequenceTimings)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt tokens (or recomputing after a recompute preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __hash__(self) -> int:
        return self.seq_id

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, {self.priority.name})")
