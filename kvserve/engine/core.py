"""EngineCore: the one step loop, schedule -> execute -> update -> outputs, with no torch in it.

The executor is whatever turns a SchedulerOutput into a RunnerOutput (sampled token ids, logprobs, its
time): the ModelRunner that runs the model (LLMEngine assembles it), or the planner's clock executor whose
steps only advance a simulated clock. Both run this same code, so a simulated schedule is the engine's.

Forks for n > 1 are planned here when the parent's prompt is done: the executor samples the parent's last
prompt position n times (each fork with its own generator), and the children share the prompt's blocks
(copy-on-write on the last one).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Protocol

from kvserve.config import SchedulerConfig
from kvserve.engine.errors import InvalidRequest
from kvserve.engine.interjection import Interjection
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.output_processor import OutputProcessor, RequestState
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import EngineRequest, Priority, Sequence
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from kvserve.engine.step_time import StepTimeModel

if TYPE_CHECKING:
    from kvserve.engine.structured.grammar import GrammarCompiler


class Executor(Protocol):
    def execute(self, out: SchedulerOutput, interjection: Interjection | None = None) -> RunnerOutput: ...


@dataclass
class StepStats:
    """What one engine step did; the server's metrics read these."""

    started: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int


class EngineCore:
    """Requests in, RequestOutputs out, one step at a time, over an executor and a KV pool.

    `tokenizer` None: no text is made (the simulator's requests run to their length). `stream_outputs`
    False: a step returns only the outputs of requests that finished (offline runs, the simulator).
    Every timestamp comes from `clock`; `step_time` is the admission estimates' prior (a calibration).
    `grammars`: the compiler of structured-output constraints (None: requests with one are refused)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, executor: Executor, *, max_model_len: int,
                 model_id: str, tokenizer=None, eos_token_ids: frozenset[int] = frozenset(),
                 clock: Callable[[], float], step_time: StepTimeModel | None = None, stream_outputs: bool = True,
                 grammars: GrammarCompiler | None = None):
        self.kv = kv
        self.executor = executor
        self.grammars = grammars  # structured outputs: compiles what a request did not bring compiled
        self.clock = clock
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(config, kv, clock=clock, step_time=step_time)
        self.outputs = OutputProcessor(tokenizer, set(eos_token_ids), max_model_len, self.scheduler, clock, model_id,
                                       stream_outputs=stream_outputs)
        self._seq_ids = itertools.count()
        self.interjection: Interjection | None = None  # set by AsyncLLM: see step()
        self._interjected_s = 0.0  # time spent in interjections, to keep it out of their suspended steps' charge
        self.last_step: StepStats | None = None

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> str:
        """Queue a request. Raises ContextLengthExceeded / CapacityExhausted at once when refused."""
        if request.request_id in self.outputs.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.params.structured_outputs is not None and request.grammar is None:
            if self.grammars is None:
                raise InvalidRequest("this engine has no tokenizer to constrain outputs with",
                                     param="response_format")
            request = replace(request, grammar=self.grammars.compile(request.params.structured_outputs))
        ids = request.prompt_token_ids
        # What the context leaves when the request set no limit (admission refuses a prompt that fills it).
        max_tokens = request.params.max_tokens or max(1, self.max_model_len - len(ids))
        seq = Sequence.of(request, next(self._seq_ids), max_tokens)
        now = self.clock()
        seq.timings.arrival = now if request.arrival is None else min(request.arrival, now)
        self.scheduler.add_request([seq])  # admission control may raise here
        state = RequestState(request, arrival=seq.timings.arrival)
        self.outputs.add(state)
        self.outputs.track(state, seq)
        return request.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason 'abort')."""
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: every scheduled sequence advances; returns outputs of requests that changed.

        With `interjection` set (AsyncLLM does), a step that holds batch work may stop between decoder
        layers when its flag is raised, run `interjection.run` (which calls `interject`), and go on."""
        started = self.clock()
        self.outputs.begin_step()
        out = self.scheduler.schedule()
        interjection = self.interjection if self.interjection is not None and any(
            ss.seq.priority is Priority.BATCH for ss in out.scheduled) else None
        return self._run_step(out, started, interjection)

    def interject(self) -> list[RequestOutput] | None:
        """A step of waiting interactive prompts only, run while the step in flight is suspended between
        layers (Scheduler.schedule_interjection); None when there was nothing to run. Its outputs are the
        new requests' first tokens; the suspended step's come when it ends."""
        started = self.clock()
        out = self.scheduler.schedule_interjection()
        if not out.scheduled:
            return None
        outputs = self._run_step(out, started, None)
        self._interjected_s += self.last_step.duration  # not the suspended step's own time
        return outputs

    def _run_step(self, out: SchedulerOutput, started: float, interjection: Interjection | None) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        interjected_before = self._interjected_s
        for seq in out.finished:  # queue timeouts decided by the scheduler
            ss = self.outputs.seq_states.get(seq.seq_id)
            if ss is not None:
                self.outputs.finish(ss, seq.status, touched)
        self._plan_forks(out)
        result = self.executor.execute(out, interjection)
        if out.scheduled:
            self._update(out, result, touched)
        num_prefill = sum(s.num_new_tokens for s in out.scheduled if s.seq.is_prefill or s.num_new_tokens > 1)
        duration = self.clock() - started
        self.last_step = StepStats(started, duration, len(out.scheduled), num_prefill,
                                   out.num_batched_tokens - num_prefill, len(out.preempted))
        self.outputs.charge(out.scheduled, duration - (self._interjected_s - interjected_before))
        return self.outputs.end_step(touched)

    def _plan_forks(self, out: SchedulerOutput) -> None:
        """The forks of each request with n > 1 whose parent samples for the first time this step."""
        for s in out.scheduled:
            if not s.sample:
                continue
            state = self.outputs.requests[s.seq.request_id]
            n = state.params.n
            if n > 1 and not state.forked:
                state.forked = True
                children = [Sequence.of(state.request, next(self._seq_ids), s.seq.max_tokens, k) for k in range(1, n)]
                for child in children:
                    self.outputs.track(state, child)
                out.forks[s.seq.seq_id] = children

    def _update(self, out: SchedulerOutput, result: RunnerOutput, touched: dict) -> None:
        """The scheduler takes each sampled token (Scheduler.update_from_output); here each one meets the
        stop checks, and a parent's forks start before its first token can finish it (a stop, eos or
        max_tokens=1 would free the blocks they are to share)."""
        tokens, logprobs = result.token_ids, result.logprobs
        seq_states = self.outputs.seq_states
        now = self.clock()

        def process(seq: Sequence, i: int, token: int) -> None:
            lps = logprobs.get(seq.seq_id)
            self.outputs.process_token(seq_states[seq.seq_id], token, lps[i] if lps else None, touched)

        def on_token(seq: Sequence, i: int, token: int) -> None:
            children = out.forks.get(seq.seq_id, ()) if i == 0 else ()
            for child in children:  # each with its own first token, sampled beside the parent's
                child.append_token(tokens[child.seq_id][0])
                child.timings.first_token = child.timings.last_token = now
                child.timings.token_times.append(now)
                self.scheduler.fork(seq, child)
            process(seq, i, token)
            for child in children:
                process(child, 0, tokens[child.seq_id][0])

        self.scheduler.update_from_output(out, tokens, on_token)
