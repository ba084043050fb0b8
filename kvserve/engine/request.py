"""The request as the engine receives it, and the sequence state shared by the scheduler, the runner and
the engine core.

Pure Python (no torch): the scheduler and KV manager work on token counts and block ids only.
A sequence owes `num_tokens - num_computed_tokens` tokens of forward work; prefill, chunked
prefill, prefix-cache hits and decode are all the same thing seen this way.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.config import Priority  # noqa: F401  (the tier type, defined with the tier limits)
from kvserve.engine.errors import InvalidRequest
from kvserve.engine.reasoning import ThinkingControl, ThinkingTracker
from kvserve.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.structured.grammar import CompiledGrammar


@dataclass(frozen=True)
class EngineRequest:
    """One request, built once by whoever tokenized it (the service, the offline LLM, the planner's
    simulator) and passed unchanged through EngineClient.submit, the engine thread hop, Ray and the engine
    core. Everything the engine derives from it (sequences, the resolved max_tokens, timings) lives on
    its sequences.

    `arrival`: when it reached the server, on the engine's clock (time.monotonic in a server), if earlier
    than when the engine takes it: the wait for the step in flight then counts in its queue time, TTFT and
    the admission bounds. `resumed_token_ids`: output tokens already generated for it elsewhere (a stream
    moved from a failed replica; n = 1 only): computed like a recompute after preemption, counted against
    max_tokens and min_tokens, seen by penalties and the detokenizer, not output again; a seeded request's
    generator skips their draws. `prompt`: the text, when it came as text (echoed in outputs only).
    `thinking`: the model's thinking block and this request's budget (engine/reasoning.py), None: not followed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    priority: Priority = Priority.INTERACTIVE
    tenant: str = "default"
    cache_salt: str | None = None  # prefix-cache namespace; the server sets it to the tenant
    cache_retention_s: float = 0.0  # keep its prompt's cached blocks this long (prompt_cache_retention); 0: LRU
    cache_key: str | None = None  # prompt_cache_key: a fleet routes requests that share one together
    arrival: float | None = None
    resumed_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    lora: str | None = None  # the LoRA adapter's key ("name@digest", engine/worker/adapters.py); None: the base model
    # params.structured_outputs compiled for this engine's tokenizer (engine/structured/grammar.py), by whoever waited for
    # it off the engine thread (AsyncLLM.submit); None: the engine compiles it. Not sent over a process hop.
    grammar: "CompiledGrammar | None" = None
    thinking: ThinkingControl | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "resumed_token_ids", tuple(self.resumed_token_ids or ()))
        object.__setattr__(self, "priority", Priority.parse(self.priority))
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest(f"a request id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if self.thinking is not None and not isinstance(self.thinking, ThinkingControl):
            raise TypeError(f"thinking must be ThinkingControl, got {type(self.thinking).__name__}")
        if self.resumed_token_ids and self.params.n != 1:
            raise InvalidRequest("a request can be resumed only with n = 1", param="n")


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
    cache_retention_s: float = 0.0  # its blocks stay cached at least this long after they were last used
    lora: str | None = None  # its LoRA adapter's key; None: the base model
    output_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = None  # the request's, or what the context leaves when it set none
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_tier_cached_tokens: int = 0  # of those, loaded from the lower tier (host memory or disk)
    num_host_cached_tokens: int = 0  # of those, from its host-memory level
    num_preemptions: int = 0
    fork_index: int = 0  # 0 for the parent, 1..n-1 for forks
    # Chained prefix-cache hashes of its leading full blocks, as far as lookups went (the KV manager's memo).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    timings: SequenceTimings = field(default_factory=SequenceTimings)
    # Its structured-output matcher (an llguidance LLMatcher) where the request has a constraint: advanced by
    # each token it takes; the runner masks its logits from it.
    grammar: Any = field(default=None, repr=False)
    # Where that output is JSON: which digits a number may still take (engine/structured/number_precision.py).
    numbers: Any = field(default=None, repr=False)
    # Its thinking block (engine/reasoning.py), where the request has one; the constraint (grammar, numbers)
    # waits here until the block is behind it.
    thinking: ThinkingTracker | None = field(default=None, repr=False)
    _deferred: tuple[Any, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.sampling.max_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_namespace(self) -> str | None:
        """What its prefix-cache blocks are keyed by beside their tokens: the salt (tenant) and the adapter (another
        adapter's K/V for the same tokens differ)."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora}"

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

    @classmethod
    def of(cls, request: EngineRequest, seq_id: int, max_tokens: int, fork_index: int = 0) -> "Sequence":
        """Fork `fork_index` of `request` (0: the parent, which starts with the resumed tokens; its thinking
        tracker and constraint have taken them)."""
        seq = cls(seq_id=seq_id, request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                  sampling=request.params, priority=request.priority, tenant=request.tenant,
                  cache_salt=request.cache_salt, cache_retention_s=request.cache_retention_s, lora=request.lora,
                  max_tokens=max_tokens, fork_index=fork_index,
                  output_token_ids=[] if fork_index else list(request.resumed_token_ids))
        if request.thinking is not None:
            seq.thinking = ThinkingTracker(request.thinking)
        if request.grammar is not None:
            constraint = (request.grammar.matcher(), request.grammar.numbers())
            if seq.thinking is None or seq.thinking.answering:
                seq.grammar, seq.numbers = constraint
            else:
                seq._deferred = constraint
        if not all([seq._follow(token) for token in seq.output_token_ids]):
            raise InvalidRequest("the resumed tokens do not match the request's structured-output constraint",
                                 param="response_format")
        return seq

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._follow(token_id)

    def _follow(self, token_id: int) -> bool:
        """A token taken: through the thinking block while it lasts (the constraint starts once it is behind),
        then through the constraint. False where the constraint refuses it."""
        tracker = self.thinking
        if tracker is not None and not tracker.answering:
            tracker.advance(token_id)
            if tracker.answering and self._deferred is not None:
                (self.grammar, self.numbers), self._deferred = self._deferred, None
            return True
        if self.grammar is None:
            return True
        ok = self.grammar.consume_token(token_id)
        if self.numbers is not None:
            self.numbers.advance(token_id)
        return ok

    @property
    def forced_token(self) -> int | None:
        """The token this sequence must take next (its thinking budget is spent), or None."""
        return None if self.thinking is None else self.thinking.forced_token

    def draftable(self, draft: tuple[int, ...]) -> int:
        """How many of `draft`'s leading tokens may be verified as its next tokens: all of them without a
        constraint; with one, those the grammar allows, up to where a JSON number's digits close (that row's
        mask is more than the grammar's: engine/structured/number_precision.py), so every draft row's mask is its
        grammar's alone. Inside or before a thinking block, the tracker says (no draft row is forced, opens or
        closes the block)."""
        if self.thinking is not None and not self.thinking.answering:
            return self.thinking.draftable(draft)
        if self.grammar is None:
            return len(draft)
        n = self.grammar.validate_tokens(list(draft))
        if self.numbers is None:
            return n
        scan = self.numbers.copy()
        if scan.digits_closed:
            return 0
        for i in range(n):
            scan.advance(draft[i])
            if scan.digits_closed:
                return i
        return n

    @property
    def grammar_done(self) -> bool:
        """Its constraint is complete and allows nothing more (the sequence stops as at an eos)."""
        return self.grammar is not None and self.grammar.is_stopped()

    def __hash__(self) -> int:
        return self.seq_id

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, {self.priority.name})")
