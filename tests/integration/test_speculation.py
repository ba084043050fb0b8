"""Speculative decoding on the real models (batch-invariant bfloat16): every request gives the bits it gives
without speculation (tokens, logprobs, ranks, top-5; greedy and seeded sampling, stops, penalties, min_tokens,
n > 1), also under preemption, chunked prefill and prefix-cache hits, while drafts are proposed and accepted;
Gemma 3's sliding-window groups give back the rejected drafts' blocks as the full-attention group does. And a
request with `speculation: false` is never drafted for."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve import SamplingParams
from tests.engine_checks import Req, assert_no_leaks, blocks_needed, drive, make_engine, shared_weights, torch_threads

pytestmark = [pytest.mark.real_model]

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 4) + "def mul(a, b):\n"
PASSAGE = ("The committee met on Tuesday to review the budget. The budget covers roads, schools and parks. "
           "After a long debate, the committee approved the budget for roads, schools and parks.")
PROMPTS = [CODE, f"{PASSAGE}\n\nRepeat the passage word for word:\n", f"Context: {PASSAGE}\nQuestion: what did "
           "the committee approve?\nAnswer:", "Once upon a time, in a small village by the sea,"]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5),
            SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True, logprobs=5),
            SamplingParams(temperature=0, max_tokens=33, stop=["schools"], logprobs=0),
            SamplingParams(temperature=1.0, seed=5, max_tokens=30, n=2, frequency_penalty=0.5, min_tokens=10)]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def model(request):
    with torch_threads(1), shared_weights():
        yield request.param


def engine(model: str, **kwargs):
    args = dict(dtype="bfloat16", kv_cache_memory="64MiB", swap_space="16MiB")
    args.update(kwargs)
    eng = make_engine(model, **args)
    assert eng.numerics == "batch_invariant"
    return eng


def bits(run) -> list:
    return [[(o.token_ids, o.text, o.finish_reason, None if o.logprobs is None else
              [(lp.token_id, lp.logprob, lp.rank, [(t, v) for t, _, v in lp.top]) for lp in o.logprobs])
             for o in ro.outputs] for ro in run.outputs]


@pytest.fixture(scope="module")
def requests(model) -> list[Req]:
    tok = engine(model).tokenizer
    return [Req(tok.encode(p), params) for p in PROMPTS for params in _params()]


@pytest.fixture(scope="module")
def reference(model, requests) -> list:
    return bits(drive(engine(model), requests))


def accepted(eng) -> int:
    return sum(s.accepted for s in eng.scheduler.speculator.stats.values())


def test_speculation_gives_the_bits_of_decoding(model, requests, reference):
    eng = engine(model, speculative_decoding=True)
    run = drive(eng, requests)
    assert bits(run) == reference
    assert accepted(eng) > 0
    assert_no_leaks(eng)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_speculation_under_preemption_gives_the_bits_of_decoding(model, requests, reference, mode):
    total, largest = blocks_needed(requests, engine(model).kv)
    eng = engine(model, speculative_decoding=True, num_gpu_blocks_override=max(largest + 2, total // 2),
                 preemption_mode=mode, swap_space="32MiB", enable_prefix_caching=mode != "swap")
    run = drive(eng, requests)
    assert run.preemptions > 0
    assert bits(run) == reference
    assert_no_leaks(eng)


def test_speculation_with_chunked_prefill_and_prefix_hits_gives_the_bits_of_decoding(model, requests, reference):
    eng = engine(model, speculative_decoding=True, max_num_batched_tokens=32)
    drive(eng, requests)
    run = drive(eng, requests)  # the prompts' blocks are cached now
    assert sum(ro.num_cached_tokens for ro in run.outputs) > 0 and run.chunked_prefills > 0
    assert bits(run) == reference
    assert_no_leaks(eng)


def test_a_request_that_opts_out_is_never_drafted_for(model, requests):
    eng = engine(model, speculative_decoding=True)
    off = [Req(r.prompt, replace(r.params, speculation=False)) for r in requests[:4]]
    drive(eng, off)
    assert all(s.proposed == 0 for s in eng.scheduler.speculator.stats.values())
    assert_no_leaks(eng)
