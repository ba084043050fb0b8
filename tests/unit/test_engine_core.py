"""EngineCore, the one step loop, over executors that compute nothing: a scripted one under a fake clock (the
engine's own scheduling, chunked prefill, continuous batching, stop and finish handling, timings, with no
model), and the planner's simulator against a real engine on the same trace."""
from __future__ import annotations

from kvserve.config import Priority, SchedulerConfig, TierLimits, engine_config_from_kwargs
from kvserve.engine.core import EngineCore
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler_output import RunnerOutput
from kvserve.models.model_info import read_model_info
from kvserve.planning.roofline import StepCost
from kvserve.planning.simulator import SimClock, Simulator
from kvserve.planning.traces import Arrival, Workload

EOS = 2  # the tiny model's tokenizer is SmolLM2's: <|im_end|>


class ScriptedExecutor:
    """Each step takes 5 ms plus 1 ms per scheduled token on the fake clock, and gives each sampled sequence
    the token its request's script has for that output position."""

    def __init__(self, clock: SimClock, scripts: dict[str, list[int]]):
        self.clock, self.scripts = clock, scripts
        self.batches: list[list[tuple[str, int]]] = []

    def execute(self, out, interjection=None) -> RunnerOutput:
        self.batches.append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
        self.clock.now += 0.005 + 0.001 * out.num_batched_tokens
        return RunnerOutput({s.seq.seq_id: [self.scripts[s.seq.request_id][s.seq.num_output_tokens]]
                             for s in out.scheduled if s.sample})


def test_the_core_runs_on_a_scripted_executor_under_a_fake_clock(tiny_llama_gguf):
    info = read_model_info(tiny_llama_gguf)
    clock = SimClock()
    executor = ScriptedExecutor(clock, {"a": [100, 101, 102, 103], "b": [200, 201, EOS, 203],
                                        "c": [300, 301, 302, 303]})
    core = EngineCore(SchedulerConfig(max_num_batched_tokens=16), KVCacheManager(32), executor, max_model_len=2048,
                      model_id="sim", tokenizer=info.tokenizer, eos_token_ids=frozenset(info.tokenizer.eos_token_ids),
                      clock=clock)
    finals = {}

    def step():
        for ro in core.step():
            if ro.finished:
                finals[ro.request_id] = ro

    greedy = dict(temperature=0)
    core.add_request(EngineRequest("a", range(1000, 1020), SamplingParams(max_tokens=3, ignore_eos=True, **greedy)))
    step()  # a's prompt is 20 tokens, the budget 16: a chunk
    core.add_request(EngineRequest("b", range(2000, 2005), SamplingParams(max_tokens=8, **greedy)))
    core.add_request(EngineRequest("c", range(3000, 3003), SamplingParams(max_tokens=8, stop_token_ids=[302], **greedy)))
    while core.has_unfinished_requests():
        step()

    assert executor.batches == [
        [("a", 16)],
        [("a", 4), ("b", 5), ("c", 3)],  # a's last chunk, b's and c's prompts: one step
        [("a", 1), ("b", 1), ("c", 1)],  # continuous batching: decodes
        [("a", 1), ("b", 1), ("c", 1)],  # a ends on length, b on eos, c on a stop token
    ]
    a, b, c = finals["a"].outputs[0], finals["b"].outputs[0], finals["c"].outputs[0]
    assert (a.token_ids, a.finish_reason, a.stop_reason) == ([100, 101, 102], "length", None)
    assert (b.token_ids, b.finish_reason, b.stop_reason) == ([200, 201, EOS], "stop", None)
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([300, 301, 302], "stop", 302)
    # Every timestamp is the fake clock's: steps of 21, 17, 8 and 8 ms.
    m = finals["a"].metrics
    assert m.arrival_time == 0.0 and abs(m.first_token_time - 0.038) < 1e-9 and abs(m.finished_time - 0.054) < 1e-9
    mb = finals["b"].metrics
    assert abs(mb.arrival_time - 0.021) < 1e-9 and abs(mb.ttft - 0.017) < 1e-9
    assert core.kv.usage().used_device_blocks == 0


def _step_cost(work):
    """8 ms a step, 0.5 ms a token, 20 us per token of context read."""
    seconds = 0.008 + sum(0.0005 * w.new + 2e-5 * (w.start + w.new) for w in work) if work else 0.0
    return StepCost(seconds, 0.0, 0.0, 0.0, 0.0)


def test_the_simulator_and_the_engine_make_the_same_schedule(tiny_llama_gguf):
    """The planner's simulator is EngineCore over a clock executor: the same trace through it and through an
    engine running the model, both on a clock that each step's priced time advances, gives the same
    schedule step by step (chunked prefill, a pool small enough to preempt, both tiers)."""
    arrivals = [Arrival(0.0, 40, 12), Arrival(0.0, 70, 6, priority=Priority.BATCH), Arrival(0.01, 25, 20),
                Arrival(0.03, 90, 8, priority=Priority.BATCH), Arrival(0.05, 12, 30), Arrival(0.2, 60, 5)]
    sched = SchedulerConfig(max_model_len=256, max_num_batched_tokens=64,
                            interactive=TierLimits.unbounded(), batch=TierLimits.unbounded())
    num_blocks, block_size = 14, 16

    from dataclasses import replace

    from kvserve.engine.worker.llm_engine import LLMEngine

    clock = SimClock()
    config = engine_config_from_kwargs(str(tiny_llama_gguf), dtype="float32", num_gpu_blocks_override=num_blocks,
                                       block_size=block_size, enable_prefix_caching=False)
    engine = LLMEngine(replace(config, scheduler=sched), clock=clock)
    # swapping on both sides (the engine's host pool, from its swap_space)
    sim = Simulator(_step_cost, num_blocks, block_size, sched, enable_prefix_caching=False,
                    num_host_blocks=engine.core.kv.num_host_blocks)
    sim_steps: list[list[tuple[str, int, bool]]] = []
    sim_execute = sim.executor.execute

    def record_sim(out, interjection=None):
        sim_steps.append([(s.seq.request_id, s.num_new_tokens, s.sample) for s in out.scheduled])
        return sim_execute(out, interjection)

    sim.executor.execute = record_sim
    result = sim.run(Workload("mixed", arrivals))
    assert sum(t.completed for t in result.tiers.values()) == len(arrivals) and result.preemptions > 0
    assert engine.core.kv.num_host_blocks > 0

    engine_steps: list[list[tuple[str, int, bool]]] = []
    run_model = engine.runner.execute

    def clocked(out, interjection=None):
        engine_steps.append([(s.seq.request_id, s.num_new_tokens, s.sample) for s in out.scheduled])
        result = run_model(out, interjection)
        clock.now += _step_cost(sim.executor.works(out)).seconds
        return result

    engine.runner.execute = clocked
    pending = list(enumerate(arrivals))
    while pending or engine.core.has_unfinished_requests():
        while pending and pending[0][1].time <= clock.now:
            i, a = pending.pop(0)
            params = SamplingParams(max_tokens=a.output_tokens, ignore_eos=True, temperature=0)
            engine.core.add_request(EngineRequest(f"sim-{i}", range(100, 100 + a.prompt_tokens), params, a.priority,
                                             a.tenant, cache_salt=a.tenant, arrival=a.time))
        if not engine.core.has_unfinished_requests():
            clock.now = pending[0][1].time
            continue
        engine.core.step()
    assert engine_steps == sim_steps


def test_a_request_is_one_frozen_validated_value():
    """EngineRequest and SamplingParams are frozen: no layer changes a request another holds (the engine's
    derived max_tokens lives on the sequence), and a bad one is refused where it is built."""
    import dataclasses

    import pytest

    from kvserve.config import InvalidPriority
    from kvserve.engine.errors import InvalidRequest

    params = SamplingParams(max_tokens=None, stop="END")
    request = EngineRequest("r", [5, 6, 7], params, "batch", "acme", cache_salt="acme")
    assert request.prompt_token_ids == (5, 6, 7) and request.priority is Priority.BATCH and params.stop == ("END",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.params = SamplingParams()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]
    with pytest.raises(InvalidRequest, match="n = 1"):
        EngineRequest("r", [5], SamplingParams(n=2), resumed_token_ids=[9])
    with pytest.raises(InvalidRequest):
        EngineRequest("", [5])
    with pytest.raises(InvalidPriority):
        EngineRequest("r", [5], priority="urgent")

    clock = SimClock()
    core = EngineCore(SchedulerConfig(max_model_len=64), KVCacheManager(16), ScriptedExecutor(clock, {"r": [1] * 64}),
                      max_model_len=64, model_id="m", clock=clock, stream_outputs=False)
    core.add_request(request)
    seq = core.outputs.requests["r"].seqs[0].seq
    assert seq.max_tokens == 64 - 3 and request.params.max_tokens is None  # what the context leaves, on the sequence
    while core.has_unfinished_requests():
        finished = core.step()
    assert [len(o.outputs[0].token_ids) for o in finished] == [61]


class VerifyingExecutor(ScriptedExecutor):
    """Verifies drafts against the script: a draft's leading tokens the script has are accepted, then the script's
    next token is sampled after them."""

    def execute(self, out, interjection=None) -> RunnerOutput:
        self.batches.append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                script, at = self.scripts[s.seq.request_id], s.seq.num_output_tokens
                n = 0
                while n < len(s.draft_token_ids) and s.draft_token_ids[n] == script[at + n]:
                    n += 1
                sampled[s.seq.seq_id] = script[at:at + n + 1]
        return RunnerOutput(sampled)


def test_a_verified_drafts_tokens_are_appended_once_each_and_a_stop_inside_it_drops_the_rest(monkeypatch):
    """Scheduler.update_from_output appends each token of a verified draft once, the stop check between them: the
    stop token inside the draft ends the sequence there, its slots are freed, nothing is taken back."""
    from kvserve.engine.request import Sequence

    appended = []
    append = Sequence.append_token
    monkeypatch.setattr(Sequence, "append_token", lambda seq, token: (appended.append(token), append(seq, token)))
    clock = SimClock()
    pattern = [50, 51, 52, 53]
    executor = VerifyingExecutor(clock, {"a": [50, 51, 52, 53, 50, 51, 52, 53]})
    kv = KVCacheManager(32)
    core = EngineCore(SchedulerConfig(speculative_decoding=True, speculative_controller=False,
                                      num_speculative_tokens=4), kv, executor, max_model_len=2048, model_id="sim",
                      clock=clock)
    core.add_request(EngineRequest("a", pattern * 3, SamplingParams(max_tokens=8, stop_token_ids=[52], temperature=0)))
    finals = []
    while core.has_unfinished_requests():
        finals += [ro for ro in core.step() if ro.finished]
    assert executor.batches == [[("a", 12)], [("a", 5)]]  # the prompt, then a decode with 4 drafts
    out = finals[0].outputs[0]
    assert out.token_ids == [50, 51, 52] and out.finish_reason == "stop" and out.stop_reason == 52
    assert appended == [50, 51, 52]  # each once, none past the stop
    kv.check_integrity()
    assert kv.usage().used_device_blocks == 0
