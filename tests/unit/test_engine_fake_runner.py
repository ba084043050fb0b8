"""LLMEngine with an injected runner that computes nothing and a fake clock: the engine's own logic
(scheduling, chunked prefill, continuous batching, sampling, stop and finish handling, timings) with no
model, as a simulator drives it."""
from __future__ import annotations

import torch

from kvserve.config import engine_config_from_kwargs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sampling import SamplingParams
from kvserve.models.model_info import read_model_info

EOS = 2  # the tiny model's tokenizer is SmolLM2's: <|im_end|>


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedRunner:
    """Each step takes 5 ms plus 1 ms per scheduled token on the fake clock, and its logits pick, for each
    sampled sequence, the token its request's script gives for that output position."""

    def __init__(self, clock: FakeClock, vocab: int, scripts: dict[str, list[int]]):
        self.clock, self.vocab, self.scripts = clock, vocab, scripts
        self.batches: list[list[tuple[str, int]]] = []

    def execute(self, out, interjection=None):
        self.batches.append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
        self.clock.now += 0.005 + 0.001 * out.num_batched_tokens
        sampled = [s for s in out.scheduled if s.sample]
        if not sampled:
            return None
        logits = torch.full((len(sampled), self.vocab), -20.0)
        for row, s in enumerate(sampled):
            logits[row, self.scripts[s.seq.request_id][s.seq.num_output_tokens]] = 20.0
        return logits


def test_the_engine_runs_on_a_fake_runner_under_a_fake_clock(tiny_llama_gguf):
    info = read_model_info(tiny_llama_gguf)
    clock = FakeClock()
    runner = ScriptedRunner(clock, info.config.vocab_size, {"a": [100, 101, 102, 103], "b": [200, 201, EOS, 203],
                                                            "c": [300, 301, 302, 303]})
    config = engine_config_from_kwargs("sim", dtype="float32", num_gpu_blocks_override=32,
                                       max_num_batched_tokens=16)
    engine = LLMEngine(config, runner=runner, info=info, clock=clock)
    finals = {}

    def step():
        for ro in engine.step():
            if ro.finished:
                finals[ro.request_id] = ro

    greedy = dict(temperature=0)
    engine.add_request(list(range(1000, 1020)), SamplingParams(max_tokens=3, ignore_eos=True, **greedy), "a")
    step()  # a's prompt is 20 tokens, the budget 16: a chunk
    engine.add_request(list(range(2000, 2005)), SamplingParams(max_tokens=8, **greedy), "b")
    engine.add_request(list(range(3000, 3003)), SamplingParams(max_tokens=8, stop_token_ids=[302], **greedy), "c")
    while engine.has_unfinished_requests():
        step()

    assert runner.batches == [
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
    assert engine.kv.usage().used_device_blocks == 0
