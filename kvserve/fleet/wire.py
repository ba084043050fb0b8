"""What crosses between a gateway and an engine replica, and how the gateway rebuilds a request's outputs.

A replica sends each RequestOutput slimmed to its deltas (`slim`): the cumulative text, token ids and
logprobs would make a long stream cost quadratic bytes. The gateway's `OutputAccumulator` rebuilds the
cumulative fields, so its consumers see what an in-process engine gives. Because the accumulator lives
in the gateway, a stream that moves to another replica (migration) simply goes on accumulating: the new
replica was given the tokens already sent and outputs only the rest. Times are the gateway's own clock
(replicas may run on other machines), so TTFT includes the hops.

Messages of a replica's `generate` stream, in order:
  ("accepted", replica_id, version)    the engine admitted the request
  ("refused", replica_id, wire_error)  the engine refused it (a typed error: engine/errors.to_wire)
  ("outputs", [RequestOutput, ...])    slim outputs, in order; the last one of the request is finished
  ("failed", wire_error)               the replica's engine failed under the request: migrate it
Pure Python: no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

ACCEPTED, REFUSED, OUTPUTS, FAILED = "accepted", "refused", "outputs", "failed"


def slim(out: RequestOutput) -> RequestOutput:
    """`out` without the prompt and the cumulative fields (the deltas and finish state stay)."""
    return replace(out, prompt=None, prompt_token_ids=[],
                   outputs=[replace(o, text="", token_ids=[], logprobs=None if o.logprobs is None else [])
                            for o in out.outputs])


@dataclass
class OutputAccumulator:
    """One request's outputs as the gateway has received them, over however many replicas served it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival: float  # the gateway's monotonic clock at submit
    model: str = ""

    def __post_init__(self):
        self.outputs: dict[int, CompletionOutput] = {}
        self.num_cached_tokens: int | None = None
        self.queue_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished = False
        self.num_preemptions = 0
        self._engine_s_before = 0.0  # engine time on replicas this request has left
        self._engine_s = 0.0  # on the replica serving it now (its outputs carry the running total)

    @property
    def sent_token_ids(self) -> list[int]:
        """The tokens output so far (n = 1: what a resumed request is given)."""
        return self.outputs[0].token_ids if 0 in self.outputs else []

    def add(self, out: RequestOutput, now: float) -> RequestOutput:
        """Fold a slim output in; the full RequestOutput (cumulative fields, this output's deltas)."""
        merged = []
        for o in out.outputs:
            cur = self.outputs.get(o.index)
            if cur is None:
                cur = self.outputs[o.index] = CompletionOutput(index=o.index,
                                                               logprobs=None if o.logprobs is None else [])
            cur.text += o.delta_text
            cur.token_ids.extend(o.delta_token_ids)
            if o.delta_logprobs and cur.logprobs is not None:
                cur.logprobs.extend(o.delta_logprobs)
            cur.finish_reason, cur.stop_reason = o.finish_reason, o.stop_reason
            if o.delta_token_ids:
                self.first_token_time = self.first_token_time or now
                self.last_token_time = now
            merged.append(replace(cur, delta_text=o.delta_text, delta_token_ids=o.delta_token_ids,
                                  delta_logprobs=o.delta_logprobs))
        if self.num_cached_tokens is None:  # the first replica's prompt-cache hit (the one that billed the prompt)
            self.num_cached_tokens = out.num_cached_tokens
        if self.queue_time is None and out.metrics is not None:
            self.queue_time = out.metrics.queue_time
        if out.metrics is not None:
            self.num_preemptions = max(self.num_preemptions, out.metrics.num_preemptions)
        self._engine_s = out.engine_seconds
        self.finished = out.finished
        return self._output(merged, now if out.finished else None)

    def replica_lost(self) -> None:
        """The request moves to another replica: what the last one charged stays charged."""
        self._engine_s_before += self._engine_s
        self._engine_s = 0.0

    def final(self, finish_reason: str, now: float) -> RequestOutput:
        """The request's last output when it ends at the gateway (aborted, or failed with no replica left)."""
        merged = []
        for cur in self.outputs.values() or [CompletionOutput(index=0)]:
            cur.finish_reason = cur.finish_reason or finish_reason
            merged.append(replace(cur, delta_text="", delta_token_ids=[], delta_logprobs=None))
        self.finished = True
        return self._output(merged, now)

    def _output(self, outputs: list[CompletionOutput], finished_time: float | None) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=self.arrival, first_token_time=self.first_token_time,
                                 last_token_time=self.last_token_time, finished_time=finished_time,
                                 queue_time=self.queue_time, num_preemptions=self.num_preemptions)
        if self.queue_time is not None:
            metrics.first_scheduled_time = self.arrival + self.queue_time
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, num_cached_tokens=self.num_cached_tokens or 0,
                             metrics=metrics, model=self.model, engine_seconds=self._engine_s_before + self._engine_s)
