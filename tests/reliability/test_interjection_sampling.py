"""Regression (found by test_restart's mixed load): an interactive request interjected into a step of batch work,
with sampling (temperature > 0). The interjection samples inside the suspended step's forward, which runs in
torch's inference mode, so the sampler's reused scratch tensors were made there as inference tensors; the
next ordinary step sampled outside inference mode into them and the engine failed ("Inplace update to
inference tensor outside InferenceMode"), failing every request of the model until a restart. The sampler
now always runs in inference mode."""
from __future__ import annotations

import ctypes
import random

import torch

from kvserve.engine.worker.sampler import Sampler, SamplingMetadata
from kvserve.engine.sampling import SamplingParams
from tests.engine_checks import assert_no_leaks, make_engine, torch_threads


def test_the_sampler_reuses_its_scratch_across_inference_mode_and_outside_it():
    sampler = Sampler()
    params = [SamplingParams(temperature=0.8, max_tokens=4), SamplingParams(temperature=0.0, max_tokens=4)]
    md = SamplingMetadata.build(params, [[], []], [[1, 2], [3]], [None, None], [0])
    logits = torch.randn(2, 64)
    with torch.inference_mode():  # an interjection's step
        first = sampler(logits, md).tolist()
    second = sampler(logits, md).tolist()  # the next ordinary step, same scratch tensors
    assert len(first) == len(second) == 2 and first[1] == second[1]  # the greedy row is the same


def test_an_interjected_sampled_request_and_the_steps_after_it(tiny_llama_gguf):
    from kvserve.engine.interjection import Interjection

    """Greedy batch work, then a sampled interactive request interjected: its sampling is the first to need the
    sampler's scratch for random rows (made in inference mode); the ordinary steps after it reuse it."""
    rng = random.Random(5)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    hot = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    with torch_threads(1):
        eng = make_engine(tiny_llama_gguf, dtype="float32", num_gpu_blocks_override=128, max_num_seqs=16)
        ids = [eng.core.add_request(eng.request([rng.randrange(100, 40_000) for _ in range(n)], greedy,
                                                priority="batch"))
               for n in (30, 18, 45)]
        eng.core.step()
        eng.core.step()  # the batch work decodes now
        flag = ctypes.c_int32(1)
        interjected = []

        def run_interjection():
            flag.value = 0
            ids.append(eng.core.add_request(eng.request([rng.randrange(100, 40_000) for _ in range(26)], hot,
                                       priority="interactive")))
            interjected.append(eng.core.interject())

        eng.core.interjection = Interjection(flag, run_interjection)
        finals = {}
        while eng.core.has_unfinished_requests():
            for ro in eng.core.step():
                if ro.finished:
                    finals[ro.request_id] = ro
    assert interjected and interjected[0], "no interjection ran"
    assert sorted(finals) == sorted(ids)
    assert all(ro.num_completion_tokens == 12 and ro.outputs[0].finish_reason == "length" for ro in finals.values())
    assert_no_leaks(eng)
