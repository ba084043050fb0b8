"""The engine end to end on the real SmolLM2-135M at float32.

- Output invariance (greedy): a prompt generates the same alone, in a batch of 16 mixed-length
  prompts, with chunked prefill on and off, with prefix caching on (hits) and off, and under forced
  preemption (swap and recompute). Batched float32 kernels may round differently, so at most one
  sequence per setting may diverge, and only at a near-tie: the reference's top-2 logprobs (= logits
  up to a shared constant) at the first differing position are within 1e-4, and the runner-up was
  picked. Afterwards nothing leaks (every block free or cached, bookkeeping consistent).
- Prefix caching, aborts (AsyncLLM cancellation; a thousand aborted requests on a tiny model), n > 1
  forks with seeds and copy-on-write, stop strings / stop tokens / max_tokens / min_tokens /
  ignore_eos / logprobs / finish reasons / detokenized text, and admission errors.

All engines share one loaded copy of the weights (tests.engine_checks.shared_weights) and run on one
torch thread (see torch_threads).
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import TierLimits, engine_config_from_kwargs
from kvserve.engine.errors import CapacityExhausted, ContextLengthExceeded
from tests.engine_checks import (Req, SeededDrawReplay, assert_no_leaks, blocks_needed, compare_outputs, drive,
                                 forks_as_singles, make_engine, shared_weights, torch_threads)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "smollm2-135m"
MAX_TOKENS = 16
# How far the logprob of the same token may move between batch shapes (float32 rounding only).
LOGPROB_TOL = 1e-3

PREAMBLE = ("You are a careful assistant for a science museum. Answer every visitor question in one short, "
            "friendly sentence, and never make things up.\n\nQuestion: ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "Hi",
    "Q: What is the capital of Germany?\nA: The capital of Germany is Berlin.\nQ: What is 2 + 2?\nA:",
    "Photosynthesis is the process by which",
    PREAMBLE + "What is the largest planet in the solar system?",
    "In 1969, the first humans to walk on the Moon were",
    PREAMBLE + "Why is the sky blue?",
    ("Charles Babbage designed the Analytical Engine in the 1830s, Ada Lovelace wrote what many call the first "
     "program for it, and a century later Alan Turing described a universal machine. After the war, "
     "engineers built ENIAC, then transistors replaced vacuum tubes, and integrated circuits replaced "
     "transistors. The most important invention of the twentieth century was"),
    PREAMBLE + "Who wrote the play Romeo and Juliet, and when was it first performed?",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Translate to French: 'Good morning, how are you today?'\nFrench:",
    ("import numpy as np\n\n\ndef softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:\n    \"\"\"Numerically "
     "stable softmax along an axis.\"\"\"\n    shifted = x - x.max(axis=axis, keepdims=True)\n    e = np.exp(shifted)\n"
     "    return e / e.sum(axis=axis, keepdims=True)\n\n\ndef cross_entropy(logits, labels):\n"),
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def _weights():
    with torch_threads(1), shared_weights():
        yield


def smol(**kwargs) -> LLM:
    args = dict(dtype="float32", kv_cache_memory="96MiB", swap_space="16MiB")
    args.update(kwargs)
    return LLM(MODEL, **args)


@pytest.fixture(scope="module")
def llm(_weights) -> LLM:
    """The reference engine: default settings (prefix caching and chunked prefill on, budget 2048)."""
    return smol()


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


# ---- output invariance ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def requests(tokenizer) -> list[Req]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    reqs = [Req(tokenizer.encode(p), params) for p in PROMPTS]
    lengths = sorted(len(r.prompt) for r in reqs)
    assert lengths[0] <= 4 and lengths[-1] > 64  # mixed: the longest exceed the small budgets below
    return reqs


@pytest.fixture(scope="module")
def alone(llm, requests):
    """Each prompt alone on the reference engine, with top-2 logprobs at every position."""
    outs = [drive(llm.engine, [r]).outputs[0] for r in requests]
    assert_no_leaks(llm.engine)
    return outs


def test_batch_with_prefix_hits_matches_alone(llm, requests, alone):
    run = drive(llm.engine, requests)  # the alone runs left every prompt's full blocks cached
    compare_outputs(alone, run, "batch of 16, prefix-cache hits", requests=requests, logprob_tol=LOGPROB_TOL)
    assert run.max_running == 16
    cached = [ro.num_cached_tokens for ro in run.outputs]
    assert all(c == (len(r.prompt) - 1) // 16 * 16 for c, r in zip(cached, requests)), cached
    assert_no_leaks(llm.engine)


def test_chunked_prefill_without_prefix_caching_matches_alone(requests, alone):
    eng = smol(enable_prefix_caching=False, max_num_batched_tokens=64).engine
    run = drive(eng, requests)
    compare_outputs(alone, run, "chunked prefill (budget 64), prefix caching off", requests=requests,
                    logprob_tol=LOGPROB_TOL)
    assert run.chunked_prefills > 0 and run.max_batched_tokens <= 64
    assert all(ro.num_cached_tokens == 0 for ro in run.outputs)
    assert_no_leaks(eng)


def test_unchunked_prefill_matches_alone(requests, alone):
    eng = smol(enable_chunked_prefill=False, max_num_batched_tokens=64).engine
    run = drive(eng, requests)
    compare_outputs(alone, run, "chunked prefill off (budget 64)", requests=requests, logprob_tol=LOGPROB_TOL)
    assert run.chunked_prefills == 0 and run.max_batched_tokens > 64  # the longest prompts ran whole
    assert_no_leaks(eng)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_matches_alone(llm, requests, alone, mode):
    total, largest = blocks_needed(requests, llm.engine.core.kv)
    # Prefix caching off for swap: blocks shared through the cache cannot be swapped out.
    eng = smol(num_gpu_blocks_override=max(largest + 1, total // 2), preemption_mode=mode, swap_space="32MiB",
               enable_prefix_caching=mode != "swap").engine
    run = drive(eng, requests)
    compare_outputs(alone, run, f"{mode} preemption", requests=requests, logprob_tol=LOGPROB_TOL)
    assert run.preemptions > 0
    if mode == "swap":
        assert run.max_swapped > 0 and run.swapped_out_blocks > 0 and run.swapped_in_blocks > 0
    else:
        assert run.max_swapped == 0 and run.swapped_out_blocks == 0
    assert sum(ro.metrics.num_preemptions for ro in run.outputs) == run.preemptions
    assert_no_leaks(eng)


# ---- prefix caching ------------------------------------------------------------------------------

def test_prefix_cache_hit_on_a_512_token_prefix(llm):
    rng = random.Random(11)
    prefix = [rng.randrange(100, 40_000) for _ in range(512)]
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prefix + [rng.randrange(100, 40_000) for _ in range(7)]], params, use_tqdm=False)[0]
    second = llm.generate([prefix + [rng.randrange(100, 40_000) for _ in range(9)]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 480
    assert_no_leaks(llm.engine)


# ---- aborts --------------------------------------------------------------------------------------

@pytest.mark.isa_independent
def test_cancelling_an_async_stream_frees_its_blocks(_weights):
    from kvserve.engine.async_engine import AsyncLLM

    config = engine_config_from_kwargs(MODEL, dtype="float32", kv_cache_memory="64MiB", swap_space=0)
    async_llm = AsyncLLM(config).start()
    try:
        assert async_llm.wait_ready(120)
        eng = async_llm.engine
        baseline = eng.core.kv.usage().used_device_blocks
        seen = []

        async def consume(started: asyncio.Event):
            async for out in async_llm.generate("Tell me a very long story about a dragon.",
                                                SamplingParams(max_tokens=500, ignore_eos=True)):
                seen.append(out)
                if len(seen) >= 2:
                    started.set()

        async def collect(stream):
            return [o async for o in stream]

        async def main():
            started = asyncio.Event()
            task = asyncio.create_task(consume(started))
            other = asyncio.create_task(collect(async_llm.generate(
                "The capital of France is", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))))
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait([waiter, task], timeout=120, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # it failed: raise its error here
            assert started.is_set()
            assert eng.core.kv.usage().used_device_blocks > baseline  # racy read, but blocks are held while it runs
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.wait_for(other, 120)

        others = asyncio.run(main())
        assert others[-1].finished and len(others[-1].outputs[0].token_ids) == 4
        assert not seen[-1].finished
        deadline = time.monotonic() + 60
        while (eng.core.has_unfinished_requests() or async_llm.num_inflight) and time.monotonic() < deadline:
            time.sleep(0.02)  # the abort is applied between engine steps
        assert eng.core.kv.usage().used_device_blocks == baseline
        assert_no_leaks(eng)
    finally:
        async_llm.stop()


@pytest.mark.isa_independent
def test_a_thousand_aborted_requests_leak_nothing(_weights, tiny_llama_gguf):
    rng = random.Random(12)
    shared = [rng.randrange(100, 40_000) for _ in range(64)]
    eng = make_engine(tiny_llama_gguf, dtype="float32", num_gpu_blocks_override=96, swap_space="256KiB",
                      max_num_seqs=48, max_num_batched_tokens=256)
    ids = []
    for i in range(1000):
        prompt = shared[:rng.randrange(0, 64)] + [rng.randrange(100, 40_000) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(n=rng.choice([1, 1, 1, 2, 4]), temperature=rng.choice([0.0, 1.0]), seed=i,
                                max_tokens=rng.randrange(1, 64), ignore_eos=True)
        ids.append(eng.core.add_request(eng.request(prompt, params, priority=rng.choice(["interactive", "batch"]))))
    finished, swapped = set(), 0
    for _ in range(12):
        finished.update(ro.request_id for ro in eng.core.step() if ro.finished)
        swapped = max(swapped, eng.core.scheduler.stats().swapped)
    assert eng.core.scheduler.stats().num_preemptions > 0 and swapped > 0
    rng.shuffle(ids)
    for rid in ids:
        out = eng.core.abort_request(rid)
        if rid in finished:
            assert out is None
        else:
            assert out is not None and out.finished
            assert all(o.finish_reason is not None for o in out.outputs)
            assert any(o.finish_reason == "abort" for o in out.outputs)
    assert_no_leaks(eng)
    req = Req([5, 6, 7, 8, 9] * 7, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    fresh = make_engine(tiny_llama_gguf, dtype="float32", num_gpu_blocks_override=96)
    compare_outputs(drive(fresh, [req]), drive(eng, [req]), "after a thousand aborts", requests=[req])
    assert_no_leaks(eng)


# ---- n > 1 ---------------------------------------------------------------------------------------

def test_forks_seeds_and_copy_on_write(llm, tokenizer):
    greedy_prompt = tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    assert len(greedy_prompt) % 16 != 0  # the forks share a partial last block: copy on write
    sampled_prompt = tokenizer.encode("Write a random word:")
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    one_token = SamplingParams(n=3, temperature=0, max_tokens=1)  # the parent finishes as it forks
    run = drive(llm.engine, [Req(greedy_prompt, greedy), Req(sampled_prompt, sampled),
                             Req(greedy_prompt, one_token)])
    assert run.cow_copies > 0
    forks = [o.token_ids for o in run.outputs[1].outputs]
    assert [o.index for o in run.outputs[1].outputs] == [0, 1, 2]
    assert len({tuple(f) for f in forks}) == 3, forks
    assert_no_leaks(llm.engine)

    # Same seed: same outputs. Fork i draws from seed + i, so it equals an n=1 request seeded so; the
    # greedy forks equal the n=1 greedy output (their K/V survived copy-on-write).
    singles = [Req(sampled_prompt, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True))
               for i in range(3)]
    one_greedy = Req(greedy_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    again = drive(llm.engine, [Req(sampled_prompt, sampled), *singles, one_greedy])
    # Another batch around them: equal but for a draw at a boundary or a greedy near-tie (compare_outputs).
    fresh = smol().engine  # the replays' prefills write into its free blocks
    compare_outputs(run.outputs[1:2], again.outputs[:1], "the same request again",
                    requests=[Req(sampled_prompt, sampled)],
                    replay=SeededDrawReplay(fresh, [Req(sampled_prompt, sampled)]))
    compare_outputs(forks_as_singles(run.outputs[1]), again.outputs[1:4], "fork i as seed + i", requests=singles,
                    replay=SeededDrawReplay(fresh, singles))
    compare_outputs([again.outputs[4]] * 2, forks_as_singles(run.outputs[0]), "greedy forks as n=1",
                    requests=[one_greedy] * 2)
    assert [o.token_ids for o in run.outputs[2].outputs] == [again.outputs[4].outputs[0].token_ids[:1]] * 3
    assert_no_leaks(llm.engine)


# ---- sampling parameters, stops, logprobs, text --------------------------------------------------

STORY = "Once upon a time, in a small village by the sea,"
SUM = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]


def test_stops_lengths_logprobs_and_text(llm, tokenizer):
    eos = set(tokenizer.eos_token_ids)
    ref, chat = llm.generate([STORY], SamplingParams(temperature=0, max_tokens=24, logprobs=3), use_tqdm=False)[0], \
        llm.chat(SUM, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    story, answer = ref.outputs[0], chat.outputs[0]

    # Reference: max_tokens reached; text is the decode of the tokens; logprobs are top-3, sorted.
    assert story.finish_reason == "length" and story.stop_reason is None and len(story.token_ids) == 24
    assert story.text == tokenizer.decode(story.token_ids, skip_special_tokens=True)
    assert len(story.logprobs) == 24
    for tok, lp in zip(story.token_ids, story.logprobs):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3
        values = [v for _, _, v in lp.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert lp.top[0][0] == tok and lp.logprob == pytest.approx(values[0], abs=1e-6)
        assert lp.top[0][1] == tokenizer.id_to_token(tok)
    # The chat answer ends with eos: finish "stop" without a stop reason; eos is not in the text.
    k = len(answer.token_ids) - 1
    assert answer.finish_reason == "stop" and answer.stop_reason is None and answer.token_ids[-1] in eos
    assert 1 <= k < 20 and not eos & set(answer.token_ids[:-1])
    assert answer.text == tokenizer.decode(answer.token_ids, skip_special_tokens=True) == \
        tokenizer.decode(answer.token_ids[:-1])
    assert chat.prompt_token_ids == tokenizer.encode_chat(SUM)

    text, toks = story.text, story.token_ids
    word = "wizard" if "wizard" in text else text.split()[4]
    cut = text.index(word)
    stop_tok = toks[3]
    assert stop_tok not in toks[:3]
    cases = {
        "stop string": (STORY, SamplingParams(temperature=0, max_tokens=24, stop=[word])),
        "stop string kept": (STORY, SamplingParams(temperature=0, max_tokens=24, stop=[word],
                                                   include_stop_str_in_output=True)),
        "earliest of two stop strings": (STORY, SamplingParams(temperature=0, max_tokens=24,
                                                               stop=[text[cut + 1:cut + 4], word])),
        "stop token": (STORY, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok])),
        "stop token kept": (STORY, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok],
                                                  include_stop_str_in_output=True)),
        "max_tokens": (STORY, SamplingParams(temperature=0, max_tokens=5)),
        "logprobs=0": (STORY, SamplingParams(temperature=0, max_tokens=3, logprobs=0)),
        "min_tokens": (chat.prompt_token_ids, SamplingParams(temperature=0, max_tokens=k + 8, min_tokens=k + 5)),
        "ignore_eos": (chat.prompt_token_ids, SamplingParams(temperature=0, max_tokens=k + 6, ignore_eos=True)),
    }
    outs = llm.generate([p for p, _ in cases.values()], [sp for _, sp in cases.values()], use_tqdm=False)
    got = {name: ro.outputs[0] for name, ro in zip(cases, outs)}

    o = got["stop string"]
    assert (o.finish_reason, o.stop_reason, o.text) == ("stop", word, text[:cut])
    assert toks[:len(o.token_ids)] == o.token_ids
    o = got["stop string kept"]
    assert (o.finish_reason, o.stop_reason, o.text) == ("stop", word, text[:cut + len(word)])
    o = got["earliest of two stop strings"]
    assert (o.finish_reason, o.text) == ("stop", text[:cut])
    o = got["stop token"]
    assert (o.finish_reason, o.stop_reason, o.token_ids) == ("stop", stop_tok, toks[:4])
    assert o.text == tokenizer.decode(toks[:3])  # as vLLM: the stop token's text is left out
    o = got["stop token kept"]
    assert (o.finish_reason, o.stop_reason, o.token_ids) == ("stop", stop_tok, toks[:4])
    assert o.text == tokenizer.decode(toks[:4])
    o = got["max_tokens"]
    assert (o.finish_reason, o.token_ids, o.text) == ("length", toks[:5], tokenizer.decode(toks[:5]))
    o = got["logprobs=0"]
    assert len(o.logprobs) == 3 and all(lp.top == [] and lp.rank == 1 for lp in o.logprobs)
    assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in story.logprobs[:3]], abs=1e-4)
    o = got["min_tokens"]  # eos is banned until min_tokens, so the answer goes on past where it ended
    assert len(o.token_ids) >= k + 5 and not eos & set(o.token_ids[:k + 5])
    assert o.token_ids[:k] == answer.token_ids[:k]
    assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
    o = got["ignore_eos"]  # eos is sampled as before but does not end the sequence
    assert (o.finish_reason, len(o.token_ids)) == ("length", k + 6)
    assert o.token_ids[:k + 1] == answer.token_ids
    assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert_no_leaks(llm.engine)


# ---- admission -----------------------------------------------------------------------------------

@pytest.mark.isa_independent
def test_admission_errors(_weights):
    eng = make_engine(MODEL, dtype="float32", kv_cache_memory="16MiB", swap_space=0,
                      interactive=TierLimits(max_waiting=2))
    ids = [eng.core.add_request(eng.request("Hello there", SamplingParams(max_tokens=4))) for _ in range(2)]
    with pytest.raises(CapacityExhausted) as exc:
        eng.core.add_request(eng.request("Hello there", SamplingParams(max_tokens=4)))
    assert exc.value.reason == "queue_full" and exc.value.retry_after >= 1
    # the other tier has room
    eng.core.add_request(eng.request("Hello there", SamplingParams(max_tokens=4), priority="batch"))
    with pytest.raises(ContextLengthExceeded):
        eng.core.add_request(eng.request(list(range(100, 100 + eng.max_model_len)), SamplingParams(max_tokens=1)))
    with pytest.raises(ContextLengthExceeded):
        eng.core.add_request(eng.request("Hello there", SamplingParams(max_tokens=eng.max_model_len)))
    for rid in ids:
        assert eng.core.abort_request(rid).outputs[0].finish_reason == "abort"
    while eng.core.has_unfinished_requests():
        eng.core.step()
    assert_no_leaks(eng)
