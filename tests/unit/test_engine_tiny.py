"""The whole engine (scheduler, KV manager, runner, sampler, detokenizer) on tiny random GGUF models.

Both tiny Llama and tiny Gemma 3 (5 of 6 layers with an 8-token sliding window; prompts are longer
than the window and decoding goes past it). The same checks as tests/integration/test_engine.py,
small enough to run in seconds: outputs do not depend on what else is batched, on chunked prefill,
on prefix caching, on the block size or on preemption (swap and recompute); aborts leak nothing;
n > 1 forks and copy-on-write are right.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import replace

import pytest

from kvserve.config import TierLimits, engine_config_from_kwargs
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import SamplingParams
from tests.engine_checks import (Draw, Req, SeededDrawReplay, assert_no_leaks, blocks_needed, compare_outputs, drive,
                                 forks_as_singles, make_engine, shared_weights, torch_threads)

MAX_TOKENS = 10
HOT = 5.0


@pytest.fixture(scope="module")
def _weights():
    with torch_threads(1), shared_weights():
        yield


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, _weights, tiny_llama_gguf, tiny_gemma_gguf):
    return tiny_llama_gguf if request.param == "llama" else tiny_gemma_gguf


def engine(path, **kwargs):
    args = dict(dtype="float32", num_gpu_blocks_override=256, swap_space="2MiB", max_num_seqs=32)
    args.update(kwargs)
    return make_engine(path, **args)


def replay(path, reqs: list[Req]) -> SeededDrawReplay:
    """Seeded draws replayed on a fresh engine (compare_outputs lets a sampled sequence diverge only at a
    draw boundary)."""
    return SeededDrawReplay(engine(path), reqs)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


def mixed_requests(seed: int = 0) -> list[Req]:
    """16 requests: prompts of 3..70 tokens (four share a prefix of 29-40 tokens), mostly greedy with top-2
    logprobs, two seeded samples and two seeded n=2 forks; output lengths differ, so sequences finish
    at different steps and new ones are admitted into a running batch."""
    rng = random.Random(seed)
    shared = rand_tokens(rng, 40)
    lengths = [3, 5, 9, 12, 17, 20, 31, 33, 47, 64, 70, 26, 15, 7, 38, 55]
    reqs = []
    for i, n in enumerate(lengths):
        prompt = shared[:min(n - 2, 40)] + rand_tokens(rng, n - min(n - 2, 40)) if i % 2 == 0 and n > 20 \
            else rand_tokens(rng, n)
        max_tokens = MAX_TOKENS - (i % 4)
        if i in (5, 11):
            params = SamplingParams(temperature=HOT, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
        elif i in (8, 13):
            params = SamplingParams(n=2, temperature=HOT, seed=200 + i, max_tokens=max_tokens, ignore_eos=True,
                                    logprobs=2)
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        reqs.append(Req(prompt, params))
    return reqs


@pytest.fixture(scope="module")
def reference(tiny):
    """Each request alone (one in flight at a time) on one engine with prefix caching on; and that engine."""
    reqs = mixed_requests()
    eng = engine(tiny)
    alone = [drive(eng, [r]).outputs[0] for r in reqs]
    assert_no_leaks(eng)
    return reqs, alone, eng


CONDITIONS = {
    "chunked prefill, budget 24, no prefix caching": dict(enable_prefix_caching=False, max_num_batched_tokens=24),
    "no chunked prefill, budget 48": dict(enable_chunked_prefill=False, max_num_batched_tokens=48),
    "block size 4, budget 40": dict(block_size=4, max_num_batched_tokens=40),
    "swap preemption": dict(preemption_mode="swap", enable_prefix_caching=False),
    "recompute preemption": dict(preemption_mode="recompute"),
    "every layer holds every block (no KV groups)": dict(kv_groups=False),
}


def test_batch_with_prefix_hits_matches_alone(tiny, reference):
    reqs, alone, eng = reference
    run = drive(eng, reqs)  # the alone runs left every prompt's full blocks in the prefix cache
    compare_outputs(alone, run, "batch of 16, prefix-cache hits", requests=reqs, replay=replay(tiny, reqs))
    assert run.max_running >= 8
    assert sum(ro.num_cached_tokens for ro in run.outputs) >= 16 * 8
    assert_no_leaks(eng)


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_output_invariance(tiny, reference, condition):
    reqs, alone, ref_engine = reference
    kwargs = dict(CONDITIONS[condition])
    if "preemption" in condition:
        total, largest = blocks_needed(reqs, ref_engine.core.kv)
        kwargs["num_gpu_blocks_override"] = max(largest + 1, total // 5)
    eng = engine(tiny, **kwargs)
    run = drive(eng, reqs)
    compare_outputs(alone, run, condition, requests=reqs, replay=replay(tiny, reqs))
    assert_no_leaks(eng)
    if condition.startswith("chunked prefill"):
        assert run.chunked_prefills > 0 and run.max_batched_tokens <= 24
    if condition.startswith("no chunked"):
        assert run.chunked_prefills == 0 and run.max_batched_tokens > 48  # the 64 and 70 token prompts ran alone
    if condition == "swap preemption":
        assert run.preemptions > 0 and run.max_swapped > 0 and run.swapped_in_blocks > 0
    if condition == "recompute preemption":
        assert run.preemptions > 0 and run.max_swapped == 0 and run.swapped_out_blocks == 0
        assert sum(ro.metrics.num_preemptions for ro in run.outputs) == run.preemptions


def test_long_generation_past_the_window(tiny):
    """Decode far past the sliding window (and several blocks), alone and next to a chunked prompt."""
    rng = random.Random(3)
    long_gen = Req(rand_tokens(rng, 11), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2))
    other = Req(rand_tokens(rng, 90), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2))
    alone = [drive(engine(tiny), [r]).outputs[0] for r in (long_gen, other)]
    eng = engine(tiny, max_num_batched_tokens=16, block_size=8)
    run = drive(eng, [long_gen, other])
    compare_outputs(alone, run, "long decode + chunked neighbour", requests=[long_gen, other])
    assert_no_leaks(eng)


# ---- forks (n > 1) and copy-on-write --------------------------------------------------------------

def test_forks_seeded_distinct_reproducible_and_cow(tiny):
    rng = random.Random(5)
    prompt = rand_tokens(rng, 21)  # not block-aligned: the forks share a partial last block
    eng = engine(tiny)
    # A hot temperature: the random tiny models are very sure of themselves.
    sampled = SamplingParams(n=4, temperature=HOT, seed=42, max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    run = drive(eng, [Req(prompt, sampled), Req(prompt, greedy)])
    forks = [o.token_ids for o in run.outputs[0].outputs]
    assert [o.index for o in run.outputs[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(f) for f in forks}) == 4, forks
    assert all(len(f) == 8 for f in forks)
    assert run.cow_copies > 0  # the shared partial block was copied before a fork wrote into it
    assert_no_leaks(eng)

    # Same seed, same outputs; fork i draws from seed + i, so it equals an n=1 request with that seed;
    # greedy forks equal the n=1 greedy output (their K/V is right after copy-on-write).
    singles = [Req(prompt, SamplingParams(temperature=HOT, seed=42 + i, max_tokens=8, ignore_eos=True))
               for i in range(4)]
    one_greedy = Req(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    again = drive(eng, [Req(prompt, sampled), *singles, one_greedy])
    # Another batch around them: equal but for a draw at a boundary (compare_outputs, replayed).
    compare_outputs(run.outputs[:1], again.outputs[:1], "the same request again", requests=[Req(prompt, sampled)],
                    replay=replay(tiny, [Req(prompt, sampled)]))
    compare_outputs(forks_as_singles(run.outputs[0]), again.outputs[1:5], "fork i as seed + i", requests=singles,
                    replay=replay(tiny, singles))
    compare_outputs([again.outputs[5]] * 3, forks_as_singles(run.outputs[1]), "greedy forks as n=1",
                    requests=[one_greedy] * 3)
    assert_no_leaks(eng)


def test_forks_when_the_first_token_ends_the_request(tiny):
    """The parent finishes on the token it samples for all forks (max_tokens=1, a stop token, a stop
    string): the forks must still get their token and share the prompt's blocks (regression: the
    parent used to free them first, and forking it raised)."""
    rng = random.Random(10)
    prompt = rand_tokens(rng, 21)
    eng = engine(tiny)
    first = drive(eng, [Req(prompt, SamplingParams(temperature=0, max_tokens=1))]).outputs[0].outputs[0].token_ids
    text = eng.tokenizer.decode(first)
    reqs = [Req(prompt, SamplingParams(n=4, temperature=HOT, seed=1, max_tokens=1, logprobs=1)),
            Req(prompt, SamplingParams(n=3, temperature=0, max_tokens=5, stop_token_ids=first)),
            Req(prompt, SamplingParams(n=2, temperature=0, max_tokens=5, stop=[text] if text else ["~"]))]
    run = drive(eng, reqs)
    assert [len(ro.outputs) for ro in run.outputs] == [4, 3, 2]
    assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in run.outputs[0].outputs)
    assert all(o.token_ids == first and o.finish_reason == "stop" and o.stop_reason == first[0]
               for o in run.outputs[1].outputs)
    if text:
        assert all(o.token_ids == first and o.finish_reason == "stop" and o.text == ""
                   for o in run.outputs[2].outputs)
    assert_no_leaks(eng)


def test_forks_under_preemption(tiny):
    """Forked sequences hold shared blocks (not swappable): they are recomputed; outputs stay the same."""
    rng = random.Random(6)
    reqs = [Req(rand_tokens(rng, 18 + 7 * i), SamplingParams(n=3, temperature=HOT, seed=i, max_tokens=12,
                                                            ignore_eos=True, logprobs=1)) for i in range(6)]
    ref_engine = engine(tiny)
    ref = drive(ref_engine, reqs)
    total, largest = blocks_needed(reqs, ref_engine.core.kv)
    eng = engine(tiny, num_gpu_blocks_override=max(largest + 1, total // 3), preemption_mode="auto")
    run = drive(eng, reqs)
    assert run.preemptions > 0
    # Recomputed K/V round differently from decoded K/V (other kernels, other batch shapes): at this hot
    # temperature a draw may then land on the neighbouring token, but only at a boundary (the replay).
    compare_outputs(ref, run, "forks under preemption", requests=reqs, max_diverged=3, logprob_tol=1e-3,
                    replay=replay(tiny, reqs))
    assert_no_leaks(eng)


def test_a_request_resumed_after_its_first_tokens_goes_on_as_it_would_have(tiny):
    """A stream moved to another engine (fleet failover) is added with the tokens already sent: it outputs only
    the rest, max_tokens counts the sent ones, penalties see them, and seeded sampling and greedy go on as
    the undisturbed request does (up to rounding at a draw boundary or a near-tie: compare_outputs)."""
    from kvserve.engine.errors import InvalidRequest

    rng = random.Random(11)
    common = dict(max_tokens=12, ignore_eos=True, logprobs=2)
    reqs = [Req(rand_tokens(rng, 30), SamplingParams(temperature=HOT, seed=7, **common)),
            Req(rand_tokens(rng, 21), SamplingParams(temperature=0, **common)),
            Req(rand_tokens(rng, 9), SamplingParams(temperature=1.0, seed=3, frequency_penalty=1.5, **common))]
    whole = drive(engine(tiny), reqs)
    k = 5
    sent = [ro.outputs[0].token_ids[:k] for ro in whole.outputs]
    rest = [replace(ro, outputs=[replace(o, token_ids=o.token_ids[k:], logprobs=o.logprobs[k:])])
            for ro in whole.outputs for o in ro.outputs]
    resumed = [replace(r, resumed=s) for r, s in zip(reqs, sent)]
    eng = engine(tiny)
    run = drive(eng, resumed)
    assert [len(ro.outputs[0].token_ids) for ro in run.outputs] == [12 - k] * 3
    assert [ro.prompt_token_ids for ro in run.outputs] == [r.prompt for r in reqs]
    base = SeededDrawReplay(engine(tiny), reqs)
    compare_outputs(rest, run, "resumed after 5 tokens", requests=reqs, logprob_tol=1e-3,
                    replay=lambda request, fork, prefix: base(request, fork, sent[request] + prefix))
    assert_no_leaks(eng)
    with pytest.raises(InvalidRequest, match="n = 1"):
        eng.core.add_request(eng.request(reqs[0].prompt, SamplingParams(n=2, temperature=1.0),
                                         resumed_token_ids=sent[0]))


# ---- aborts ------------------------------------------------------------------------------------------

@pytest.mark.isa_independent
def test_aborts_at_random_points_leak_nothing(tiny):
    """Requests of every kind aborted while waiting, running, swapped out or mid-prefill, under
    preemption pressure; the engine then still generates what a fresh one does."""
    rng = random.Random(7)
    shared = rand_tokens(rng, 48)
    eng = engine(tiny, num_gpu_blocks_override=40, swap_space="1MiB", max_num_batched_tokens=64, max_num_seqs=16)
    live: list[str] = []
    aborted = 0
    swapped_steps = 0
    for step in range(60):
        for _ in range(rng.randrange(0, 6)):
            head = shared[:rng.randrange(1, 48)] if rng.random() < 0.4 else []
            prompt = head + rand_tokens(rng, rng.randrange(1, 60))
            params = SamplingParams(n=rng.choice([1, 1, 1, 2, 3]), temperature=rng.choice([0.0, 1.0]),
                                    seed=rng.randrange(1000), max_tokens=rng.randrange(1, 30), ignore_eos=True)
            priority = rng.choice(["interactive", "batch"])
            live.append(eng.core.add_request(eng.request(prompt, params, priority=priority)))
        for ro in eng.core.step():
            if ro.finished:
                live.remove(ro.request_id)
        eng.core.kv.check_integrity()
        swapped_steps += eng.core.scheduler.stats().swapped > 0
        for rid in rng.sample(live, k=min(len(live), rng.randrange(0, 3))):
            out = eng.core.abort_request(rid)
            assert out is not None and out.finished
            assert all(o.finish_reason is not None for o in out.outputs)
            live.remove(rid)
            aborted += 1
    assert aborted > 20 and swapped_steps > 0  # some aborts found sequences swapped out
    for rid in live:
        eng.core.abort_request(rid)
    assert eng.core.abort_request("no-such-request") is None
    assert_no_leaks(eng)
    req = Req(rand_tokens(rng, 30), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    compare_outputs(drive(engine(tiny), [req]), drive(eng, [req]), "after the aborts", requests=[req])
    assert_no_leaks(eng)


@pytest.mark.isa_independent
def test_async_cancel_frees_blocks(tiny):
    from kvserve.engine.async_engine import AsyncLLM

    rng = random.Random(8)
    config = engine_config_from_kwargs(str(tiny), dtype="float32", num_gpu_blocks_override=64, swap_space=0)
    llm = AsyncLLM(config).start()
    try:
        assert llm.wait_ready(60)
        eng = llm.engine
        baseline = eng.core.kv.usage().used_device_blocks
        long_params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)

        async def consume(started: asyncio.Event):
            async for _ in llm.generate(rand_tokens(rng, 40), long_params):
                started.set()

        async def main():
            started = asyncio.Event()
            task = asyncio.create_task(consume(started))
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait([waiter, task], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # it failed: raise its error here
            assert started.is_set()
            other = llm.generate(rand_tokens(rng, 20), SamplingParams(max_tokens=5, ignore_eos=True, temperature=0))
            first = await other.__anext__()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            outs = [first] + [o async for o in other]
            return outs[-1]

        last = asyncio.run(main())
        assert last.finished and len(last.outputs[0].token_ids) == 5
        for _ in range(500):  # the abort is applied between steps of the engine thread
            if not eng.core.has_unfinished_requests() and llm.num_inflight == 0:
                break
            time.sleep(0.01)
        assert eng.core.kv.usage().used_device_blocks == baseline
        assert_no_leaks(eng)
    finally:
        llm.stop()


# ---- admission ---------------------------------------------------------------------------------------

@pytest.mark.isa_independent
def test_admission_errors(tiny):
    from kvserve.engine.errors import CapacityExhausted, ContextLengthExceeded

    eng = engine(tiny, interactive=TierLimits(max_waiting=2))
    rng = random.Random(9)
    ids = [eng.core.add_request(eng.request(rand_tokens(rng, 10), SamplingParams(max_tokens=4))) for _ in range(2)]
    with pytest.raises(CapacityExhausted):
        eng.core.add_request(eng.request(rand_tokens(rng, 10), SamplingParams(max_tokens=4)))
    with pytest.raises(ContextLengthExceeded):
        eng.core.add_request(eng.request(rand_tokens(rng, eng.max_model_len), SamplingParams(max_tokens=4)))
    with pytest.raises(ContextLengthExceeded):
        eng.core.add_request(eng.request(rand_tokens(rng, 10), SamplingParams(max_tokens=eng.max_model_len)))
    for rid in ids:
        eng.core.abort_request(rid)
    assert_no_leaks(eng)


# ---- the comparison itself ---------------------------------------------------------------------------

@pytest.mark.isa_independent
def test_compare_outputs_allows_one_near_tie_only():
    from kvserve.engine.outputs import CompletionOutput, Logprob, RequestOutput

    def out(tokens, gaps=None):
        lps = None if gaps is None else [Logprob(t, "", -0.1, 1, [(t, "", -0.1), (t + 1, "", -0.1 - g)])
                                         for t, g in zip(tokens, gaps)]
        return RequestOutput("r", None, [1], [CompletionOutput(0, token_ids=tokens, finish_reason="length",
                                                               logprobs=lps)], True)

    ref = [out([10, 20, 30], [0.5, 5e-5, 0.5]), out([10, 20, 30], [0.5, 0.5, 0.5])]
    greedy = [Req([1], SamplingParams(temperature=0))] * 2
    compare_outputs(ref, [out([10, 20, 30]), out([10, 20, 30])], "same")
    compare_outputs(ref, [out([10, 21, 5]), out([10, 20, 30])], "runner-up at a near-tie", requests=greedy)
    with pytest.raises(AssertionError, match="not at a near-tie"):
        compare_outputs(ref, [out([10, 20, 30]), out([10, 21, 5])], "runner-up, clear winner")
    with pytest.raises(AssertionError, match="not at a near-tie"):
        compare_outputs(ref, [out([10, 22, 5]), out([10, 20, 30])], "not the runner-up")
    with pytest.raises(AssertionError, match="2 sequences diverged"):
        compare_outputs(ref, [out([10, 21, 5]), out([11, 20, 30])], "two")
    with pytest.raises(AssertionError, match="sampled"):
        compare_outputs(ref, [out([10, 21, 5]), out([10, 20, 30])], "sampled",
                        requests=[Req([1], SamplingParams(temperature=1.0, seed=1))] * 2)
    with pytest.raises(AssertionError, match="1 sequences diverged"):
        compare_outputs(ref, [out([10, 21, 5]), out([10, 20, 30])], "none allowed", max_diverged=0)

    # Seeded draws: the neighbour, only where the replayed draw sat on the boundary between the two.
    sampled = [Req([1], SamplingParams(temperature=5.0, seed=1))] * 2

    def replay(token, boundary, distance):
        return lambda request, fork, prefix: Draw(token, boundary, distance)

    flipped = [out([10, 21, 5]), out([10, 20, 30])]
    compare_outputs(ref, flipped, "at a boundary", requests=sampled, replay=replay(20, (20, 21), 3e-8))
    compare_outputs(ref, flipped, "at a boundary, replayed the other way", requests=sampled,
                    replay=replay(21, (20, 21), 3e-8))
    for token, boundary, distance in [(20, (20, 21), 1e-5), (20, (19, 20), 3e-8), (20, None, 0.0), (7, (7, 8), 0.0)]:
        with pytest.raises(AssertionError, match="not at a boundary"):
            compare_outputs(ref, flipped, "not at that boundary", requests=sampled,
                            replay=replay(token, boundary, distance))


# ---- interjections ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["op by op", "fused"])
def test_an_interjected_interactive_request_changes_no_output(tiny, path):
    """An interactive request that arrives during a step of batch work runs in an interjection (that step
    suspended between layers), op by op (float32, every CPU) and on the fused decoder (bf16, AMX). Every
    request generates what it does when the same request arrives between steps, the deltas add up to the
    finals, and nothing leaks."""
    import ctypes

    from kvserve.engine.interjection import Interjection

    rng = random.Random(21)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    flood = [Req(rand_tokens(rng, n), params, priority="batch") for n in (30, 18, 45)]
    chat = Req(rand_tokens(rng, 26), params, priority="interactive")

    def run(interject: bool):
        if path == "fused":
            eng = engine(tiny, dtype="bfloat16")
            if eng.runner.model.native_decoder is None:
                pytest.skip("the fused decoder needs bf16 and AMX or AVX2")
        else:
            eng = engine(tiny)
            assert eng.runner.model.native_decoder is None
        streamed, finals, seen = defaultdict(list), {}, []

        def collect(outputs):
            for ro in outputs or ():
                streamed[ro.request_id] += ro.outputs[0].delta_token_ids
                if ro.finished:
                    finals[ro.request_id] = ro

        ids = [eng.core.add_request(eng.request(r.prompt, r.params, priority=r.priority)) for r in flood]
        collect(eng.core.step())
        collect(eng.core.step())  # the flood decodes now
        if interject:
            flag = ctypes.c_int32(1)

            def run_interjection():
                flag.value = 0
                ids.append(eng.core.add_request(eng.request(chat.prompt, chat.params, priority=chat.priority)))
                outputs = eng.core.interject()
                seen.append([(ro.request_id, list(ro.outputs[0].token_ids)) for ro in outputs])
                collect(outputs)

            eng.core.interjection = Interjection(flag, run_interjection)
        else:
            ids.append(eng.core.add_request(eng.request(chat.prompt, chat.params, priority=chat.priority)))
        while eng.core.has_unfinished_requests():
            collect(eng.core.step())
        for rid in ids:
            assert streamed[rid] == finals[rid].outputs[0].token_ids, "deltas must add up to the final"
        assert_no_leaks(eng)
        return [finals[rid] for rid in ids], seen

    plain, _ = run(False)
    interjected, seen = run(True)
    assert len(seen) == 1 and len(seen[0]) == 1 and len(seen[0][0][1]) == 1  # the chat's first token, alone
    compare_outputs(plain, interjected, "interjected", requests=flood + [chat])


@pytest.mark.isa_independent
def test_an_interjection_applies_interactive_adds_only_and_holds_the_rest():
    """AsyncLLM inside a suspended step: aborts (which would free blocks the step still writes) and batch
    requests wait, in their order, for the step's end."""
    from concurrent.futures import Future

    from kvserve.config import EngineConfig, SchedulerConfig
    from kvserve.engine.async_engine import AsyncLLM, _Abort, _Add
    from kvserve.engine.kv.manager import KVCacheManager
    from kvserve.engine.scheduler import Scheduler

    class Recorder:
        num_unfinished_requests = 0

        def __init__(self):
            self.calls = []
            self.scheduler = Scheduler(SchedulerConfig(), KVCacheManager(8))

        def add_request(self, request):
            self.calls.append(("add", request.request_id))
            return request.request_id

        def abort_request(self, request_id):
            self.calls.append(("abort", request_id))

    llm = AsyncLLM(EngineConfig(model="none"), model_id="fake")
    llm.core = Recorder()

    def add(request_id, priority):
        cmd = _Add(EngineRequest(request_id, [1], priority=priority), None, Future())
        llm._commands.put(cmd)
        return cmd

    add("batch-1", "batch")
    llm._commands.put(_Abort("old"))
    chat = add("chat-1", None)  # no priority: interactive
    add("chat-2", "interactive")
    llm._interject_flag.value = 1
    llm._apply_commands(interactive_adds_only=True)
    assert llm.core.calls == [("add", "chat-1"), ("add", "chat-2")] and chat.done.result() == "chat-1"
    assert llm.is_stalled(timeout=-1.0), "held commands are pending work"
    llm._apply_commands()
    assert llm.core.calls[2:] == [("add", "batch-1"), ("abort", "old")]
    assert llm._interject_flag.value == 0 and not llm._held


# ---- engine time per request ------------------------------------------------------------------------

@pytest.mark.isa_independent
def test_engine_time_split_over_requests_adds_up_to_the_busy_time(tiny):
    """Each step's measured time is charged to its sequences by token share (OutputProcessor.charge): over a
    run with chunked prefills, forks, preemption and an abort, the requests' engine_seconds add up to the
    steps' measured time, and a long prompt is charged more than a short one with the same output."""
    rng = random.Random(5)
    eng = engine(tiny, max_num_batched_tokens=64, num_gpu_blocks_override=48, swap_space="1MiB")
    params = dict(max_tokens=6, ignore_eos=True, temperature=0)
    ids = [eng.core.add_request(eng.request(rand_tokens(rng, n), SamplingParams(**params))) for n in (200, 8, 40, 3)]
    ids.append(eng.core.add_request(eng.request(rand_tokens(rng, 20),
                                                SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5))))
    victim = eng.core.add_request(eng.request(rand_tokens(rng, 30), SamplingParams(max_tokens=50, ignore_eos=True)))
    busy, finals, steps = 0.0, {}, 0
    while eng.core.has_unfinished_requests():
        for ro in eng.core.step():
            if ro.finished:
                finals[ro.request_id] = ro
        busy += eng.core.last_step.duration
        steps += 1
        if steps == 4:
            aborted = eng.core.abort_request(victim)
            finals[victim] = aborted
    charged = sum(ro.engine_seconds for ro in finals.values())
    assert set(finals) == set(ids) | {victim}
    assert charged == pytest.approx(busy, rel=0.01)
    assert all(finals[i].engine_seconds > 0 for i in ids)
    assert finals[ids[0]].engine_seconds > finals[ids[3]].engine_seconds
