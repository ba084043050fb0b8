"""EngineClient: what the completion service needs of one model's engine, wherever the engine runs.

The service (kvserve/service) tokenizes, routes and accounts; it reaches an engine only through this
protocol. `AsyncLLM` (an engine thread in this process) is one implementation; a replica on another
process or machine is another. Nothing here imports torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from kvserve.engine.errors import ModelFailed, ModelWarming, ServerDraining

if TYPE_CHECKING:
    from kvserve.engine.outputs import RequestOutput
    from kvserve.engine.request import EngineRequest
    from kvserve.engine.stats import SchedulerStats
    from kvserve.models.tokenizer import Tokenizer


class EngineStatus(str, enum.Enum):
    UNLOADED = "unloaded"  # a model loaded by demand, not loaded now (service/residency.py)
    SLEEPING = "sleeping"  # loaded, its weights and KV memory freed (sleep mode): a request wakes it
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class EngineHealth:
    status: EngineStatus
    last_step_at: float | None
    busy_seconds: float  # wall time spent inside step() since start
    started_at: float
    error: str | None = None
    load_seconds: float | None = None


class RequestStream(Protocol):
    """One submitted request's RequestOutputs (with deltas) until the finished one. Closing it before
    then aborts the request."""

    request_id: str

    def __aiter__(self) -> AsyncIterator["RequestOutput"]: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    model_id: str
    status: EngineStatus
    error: str | None  # why it failed, when status is FAILED
    num_inflight: int  # requests submitted and not finished
    stats: "SchedulerStats | None"  # the scheduler's latest snapshot (queues, KV use, prefix hits)

    @property
    def tokenizer(self) -> "Tokenizer | None": ...  # None until the model file has been read

    @property
    def max_model_len(self) -> int | None: ...  # the context in tokens, prompt and output together

    @property
    def weights(self) -> str | None: ...  # what the model computes from (LLMEngine.weights); None until loaded

    @property
    def numerics(self) -> str | None: ...  # the numerics in force (LLMEngine.numerics); None until loaded

    @property
    def activations(self) -> str | None: ...  # what quantized matrices multiply (LLMEngine.activations)

    def start(self) -> "EngineClient": ...

    def drain(self) -> None: ...  # stop admitting; running requests go on

    def stop(self, timeout: float = 10.0) -> None: ...

    def health(self) -> EngineHealth: ...

    def is_stalled(self, timeout: float) -> bool: ...

    async def submit(self, request: "EngineRequest") -> RequestStream:
        """Queue a request; admission and context errors raise here, before any output. Its
        `resumed_token_ids`: output tokens already sent from another engine (a migrated stream)."""
        ...

    def abort(self, request_id: str) -> None: ...


def check_available(client: EngineClient) -> None:
    """The typed error for an engine that cannot take a request now (the one availability check)."""
    status = client.status
    if status in (EngineStatus.READY, EngineStatus.SLEEPING):  # (a sleeping engine wakes for the request)
        return
    if status in (EngineStatus.WARMING, EngineStatus.UNLOADED):
        raise ModelWarming(f"model {client.model_id} is still loading; retry shortly")
    if status in (EngineStatus.DRAINING, EngineStatus.STOPPED):
        raise ServerDraining(f"model {client.model_id} is draining for shutdown")
    raise ModelFailed(f"model {client.model_id} failed: {client.error}")
