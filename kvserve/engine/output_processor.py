"""What each sampled token does to its request, in plain Python (no torch): the request and sequence
state the engine keeps for outputs, incremental detokenizing, logprob entries, stop and finish
decisions, aborts, and the RequestOutputs of a step. EngineCore hands each sampled token here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.engine.request import EngineRequest, Sequence, SequenceStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.stops import stop_status, stop_token


@dataclass
class SeqState:
    seq: Sequence
    detok: "IncrementalDetokenizer | _NoText"
    output: CompletionOutput


class RequestState:
    """One admitted request: the request as it came, its sequences' states, and what it was charged."""

    def __init__(self, request: EngineRequest, arrival: float):
        self.request = request
        self.arrival = arrival  # on the engine's clock: the request's, or when the engine took it
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.seqs: list[SeqState] = []
        self.forked = False
        self.finished = False
        self.engine_seconds = 0.0  # its share of the engine steps it was in (OutputProcessor.charge)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def output(self, model: str) -> RequestOutput:
        parent = self.seqs[0].seq
        t = parent.timings
        finished_time = None
        if self.finished:
            finished_time = max((s.seq.timings.finished or 0.0) for s in self.seqs) or None
        metrics = RequestMetrics(arrival_time=self.arrival, first_scheduled_time=t.first_scheduled,
                                 first_token_time=t.first_token, last_token_time=t.last_token,
                                 finished_time=finished_time,
                                 queue_time=t.queue_time,
                                 num_preemptions=sum(s.seq.num_preemptions for s in self.seqs))
        # Shallow copies: the engine rebinds (never mutates) delta fields, so a snapshot handed to
        # another thread stays valid while the engine moves on.
        return RequestOutput(request_id=self.request_id, prompt=self.request.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[replace(s.output) for s in self.seqs], finished=self.finished,
                             num_cached_tokens=parent.num_cached_tokens,
                             num_tier_cached_tokens=parent.num_tier_cached_tokens,
                             num_host_cached_tokens=parent.num_host_cached_tokens, metrics=metrics, model=model,
                             engine_seconds=self.engine_seconds)


class _NoText:
    """The detokenizer of an engine without a tokenizer (the planner's simulator): no text, no stop strings."""

    stopped = False
    stop_reason = None

    def add_token(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, scheduler: Scheduler,
                 clock: Callable[[], float], model_id: str, stream_outputs: bool = True):
        self.tokenizer = tokenizer
        self.stream_outputs = stream_outputs
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.clock = clock
        self.model_id = model_id
        self.requests: dict[str, RequestState] = {}
        self.seq_states: dict[int, SeqState] = {}
        self._dirty: list[RequestState] = []  # requests whose deltas the next step clears

    def add(self, state: RequestState) -> None:
        """A request the scheduler admitted (EngineCore.add_request checked its id is free)."""
        self.requests[state.request_id] = state

    def track(self, state: RequestState, seq: Sequence) -> SeqState:
        p = state.params
        detok = _NoText() if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, state.prompt_token_ids + list(state.request.resumed_token_ids),
            skip_special_tokens=p.skip_special_tokens, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output)
        ss = SeqState(seq, detok, CompletionOutput(index=seq.fork_index,
                                                   logprobs=[] if p.logprobs is not None else None))
        state.seqs.append(ss)
        self.seq_states[seq.seq_id] = ss
        return ss

    def charge(self, scheduled, seconds: float) -> None:
        """Split one step's measured time over its sequences by their share of the step's tokens (a prefill
        chunk of 300 tokens is charged 300 times a decode token). Per request the shares add up, and over
        a run they add up to the engine's busy time. Approximate where cost is not linear in tokens:
        attention grows with context, so a decode token deep in a long context costs more than its share,
        and a small decode batch is dominated by reading the weights, which any token share splits evenly."""
        total = sum(s.num_new_tokens for s in scheduled)
        if total <= 0 or seconds <= 0:
            return
        per_token = seconds / total
        requests = self.requests
        for s in scheduled:
            state = requests.get(s.seq.request_id)
            if state is not None:
                state.engine_seconds += s.num_new_tokens * per_token

    def begin_step(self) -> None:
        """Clear the deltas the previous step handed out."""
        for state in self._dirty:
            for ss in state.seqs:
                ss.output.delta_text, ss.output.delta_token_ids, ss.output.delta_logprobs = "", [], None
        self._dirty = []

    def process_token(self, ss: SeqState, token: int, lp, touched: dict) -> None:
        """A sampled token (already appended to the sequence by the scheduler): text, logprobs, stops."""
        seq, out, params = ss.seq, ss.output, ss.seq.sampling
        state = self.requests[seq.request_id]
        touched[state.request_id] = state
        if out.finish_reason is not None:
            return
        # As vLLM: an eos / stop_token_ids token that ends the sequence stays in token_ids but its text
        # is left out of the output unless include_stop_str_in_output.
        skip_text = not params.include_stop_str_in_output and stop_token(seq, token, self.eos_token_ids)[0]
        delta = "" if skip_text else ss.detok.add_token(token)
        out.token_ids.append(token)
        out.delta_token_ids = out.delta_token_ids + [token]
        if lp is not None and out.logprobs is not None:
            entry = Logprob(token, self.tokenizer.id_to_token(token), lp.logprob, lp.rank,
                            [(t, self.tokenizer.id_to_token(t), v) for t, v in lp.top])
            out.logprobs.append(entry)
            out.delta_logprobs = (out.delta_logprobs or []) + [entry]
        status, stop_reason = stop_status(seq, token, self.eos_token_ids, ss.detok, self.max_model_len)
        if status is not None:
            out.stop_reason = stop_reason
            if not ss.detok.stopped:
                delta += ss.detok.flush()
        out.text += delta
        out.delta_text += delta
        if status is not None:
            self.finish(ss, status, touched)

    def finish(self, ss: SeqState, status: SequenceStatus, touched: dict) -> None:
        seq = ss.seq
        if not seq.is_finished:
            self.scheduler.finish(seq, status)
        seq.timings.finished = seq.timings.finished or self.clock()
        ss.output.finish_reason = status.finish_reason
        state = self.requests.get(seq.request_id)
        if state is not None:
            touched[state.request_id] = state

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its final output (finish_reason 'abort'), or None."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        for ss in state.seqs:
            self.seq_states.pop(ss.seq.seq_id, None)
            if ss.output.finish_reason is None:
                ss.output.finish_reason = SequenceStatus.FINISHED_ABORTED.finish_reason
                ss.seq.timings.finished = self.clock()
            ss.output.delta_text, ss.output.delta_token_ids = "", []
        state.finished = True
        return state.output(self.model_id)

    def end_step(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """The outputs of the requests this step touched; finished ones leave. A request with n > 1 is
        finished when all its forks are (or its parent finished before forking)."""
        results = []
        for state in touched.values():
            state.finished = all(ss.output.finish_reason is not None for ss in state.seqs) and (
                state.forked or state.params.n == 1 or state.seqs[0].output.finish_reason is not None)
            if state.finished or self.stream_outputs:
                results.append(state.output(self.model_id))
            if state.finished:
                self.requests.pop(state.request_id, None)
                for ss in state.seqs:
                    self.seq_states.pop(ss.seq.seq_id, None)
        self._dirty.extend(touched.values())  # an interjection's, then its suspended step's
        return results
