"""Batch-invariant numerics (EngineConfig.numerics = "batch_invariant", the default) on the two shipped models
in bfloat16, the default dtype, on the fused CPU decoder: a request's tokens and logprobs (the sampled
token's and the top 5, which are its logits less one constant) are the same bits, compared with ==, whether
it ran alone or beside 1..63 others, with its prompt in one chunk or in chunks of 16, 64 or 100 tokens, as
a prefix-cache hit or a miss, preempted by swap or by recompute or not at all, or resumed from any k of its
own tokens (a migrated stream), on one thread or two; greedy and seeded sampling alike.

Rows of the harness (tests.parity.PagedHarness) hold the same for the logits themselves: a token's logits as
one row of a whole prefill, of a chunk, of a decode step beside 1..63 other sequences.

The kernel and engine tests run again at each lower CPU level (tests/integration/test_cpu_levels.py), so
an AVX-512 machine shows the AVX2 kernels holding it too (there on SmolLM2: MODELS says why). What is not promised: the per-op path (float32,
CUDA, or a step the fused decoder does not take) against the fused one; models/backend.numerics_in_force.
"""
from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.worker.runner import BatchItem
from kvserve.kernels import isa
from kvserve.models.loader import load_checkpoint
from tests.engine_checks import (Req, assert_no_leaks, blocks_needed, drive, make_engine, shared_weights,
                                 torch_threads)
from tests.parity import PagedHarness

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MAX_TOKENS = 20
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Hi",
    "Q: What is the capital of Germany?\nA: The capital of Germany is Berlin.\nQ: What is 2 + 2?\nA:",
    ("Charles Babbage designed the Analytical Engine in the 1830s, Ada Lovelace wrote what many call the first "
     "program for it, and a century later Alan Turing described a universal machine. After the war, "
     "engineers built ENIAC, then transistors replaced vacuum tubes, and integrated circuits replaced "
     "transistors. The most important invention of the twentieth century was"),
    "Translate to French: 'Good morning, how are you today?'\nFrench:",
    "Once upon a time, in a small village by the sea,",
]


def _params(i: int) -> SamplingParams:
    """Greedy for even requests, seeded sampling for odd ones; top-5 logprobs for all."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=5)


def _bits(output) -> list:
    """Everything compared: each token and its logprob, rank and top 5, as exact floats."""
    (o,) = output.outputs
    return [(lp.token_id, lp.logprob, lp.rank, [(t, v) for t, _, v in lp.top]) for lp in o.logprobs]


# Both models at the CPU's own level; SmolLM2 alone in the reruns at lower levels (test_cpu_levels.py): each
# GGUF type is held at a 4- or 8-bit class (models/quant.py), so Gemma 3's matrices reach the kernels SmolLM2's
# do, and what Gemma 3 adds (wide heads, windows, q/k norms) is test_native_decoder's and test_engine_tiny's
# tiny Gemma 3 at that level.
MODELS = ["smollm2-135m", "gemma3-270m"] if isa.requested() == "native" else ["smollm2-135m"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    with torch_threads(1), shared_weights():
        yield request.param


def engine(model: str, **kwargs):
    args = dict(dtype="bfloat16", kv_cache_memory="64MiB", swap_space="16MiB")
    args.update(kwargs)
    eng = make_engine(model, **args)
    assert eng.numerics == "batch_invariant" and eng.runner.model.native_decoder is not None
    return eng


@pytest.fixture(scope="module")
def requests(model) -> list[Req]:
    tok = engine(model).tokenizer
    return [Req(tok.encode(p), _params(i)) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def alone(model, requests) -> list[list]:
    """Each request alone on an engine without prefix caching: the reference bits."""
    eng = engine(model, enable_prefix_caching=False)
    return [_bits(drive(eng, [r]).outputs[0]) for r in requests]


def _assert_same(alone: list[list], run, label: str) -> None:
    for i, (want, got) in enumerate(zip(alone, run.outputs)):
        assert _bits(got) == want, f"{label}: request {i} differs from its run alone"


def _others(model: str, n: int) -> list[Req]:
    """n other requests of various lengths (greedy), beside the ones under test."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
    return [Req(" ".join(words[: 2 + (j * 5) % len(words)]) + f" {j}:",
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS - j % 7, ignore_eos=True)) for j in range(n)]


@pytest.mark.parametrize("others", [1, 8, 56])
def test_beside_others_the_bits_are_those_alone(model, requests, alone, others):
    eng = engine(model, enable_prefix_caching=False, max_num_seqs=64, kv_cache_memory="256MiB")
    run = drive(eng, requests + _others(model, others))
    _assert_same(alone, run, f"beside {others} others")
    assert run.max_running >= len(requests) + min(others, 32)
    assert_no_leaks(eng)


def test_prefix_cache_hits_give_the_bits_of_a_miss(model, requests, alone):
    eng = engine(model)
    drive(eng, requests)  # fills the cache with every prompt's full blocks
    run = drive(eng, requests)
    assert sum(ro.num_cached_tokens for ro in run.outputs) > 0
    _assert_same(alone, run, "prefix-cache hits")
    assert_no_leaks(eng)


@pytest.mark.parametrize("budget", [16, 64, 100])
def test_chunked_prefill_at_any_size_gives_the_bits_of_one_chunk(model, requests, alone, budget):
    eng = engine(model, enable_prefix_caching=False, max_num_batched_tokens=budget)
    run = drive(eng, requests)
    assert run.chunked_prefills > 0
    _assert_same(alone, run, f"chunked prefill at {budget} tokens")
    assert_no_leaks(eng)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_gives_the_bits_of_no_preemption(model, requests, alone, mode):
    total, largest = blocks_needed(requests, engine(model).core.kv)
    eng = engine(model, num_gpu_blocks_override=max(largest + 1, total // 2), preemption_mode=mode,
                 swap_space="32MiB", enable_prefix_caching=mode != "swap")
    run = drive(eng, requests)
    assert run.preemptions > 0
    _assert_same(alone, run, f"{mode} preemption")
    assert_no_leaks(eng)


def test_a_resume_from_any_k_continues_with_the_same_bits(model, requests, alone):
    """A stream moved to another engine after k tokens (resumed_token_ids, a fresh cache salt: the prompt and
    those tokens recomputed as one prefill) goes on with the bits the uninterrupted run had."""
    eng = engine(model)
    resumes, want = [], []
    for i, (req, ref) in enumerate(zip(requests, alone)):
        tokens = [t for t, *_ in ref]
        ks = range(1, MAX_TOKENS) if i < 2 else (1, 7, MAX_TOKENS - 1)  # every k for one greedy, one seeded
        for k in ks:
            resumes.append(Req(req.prompt, req.params, cache_salt=f"resume-{i}-{k}", resumed=tokens[:k]))
            want.append(ref[k:])
    for start in range(0, len(resumes), 32):
        run = drive(eng, resumes[start:start + 32])
        for j, ro in enumerate(run.outputs):
            assert _bits(ro) == want[start + j], f"resume {start + j} differs from the uninterrupted run"
    assert_no_leaks(eng)


def test_two_threads_give_the_bits_of_one(model, requests, alone):
    with torch_threads(2):
        eng = engine(model, enable_prefix_caching=False)
        run = drive(eng, requests)
    _assert_same(alone, run, "two threads")


# ---- the logits themselves, row by row ----------------------------------------------------------------

@pytest.fixture(scope="module")
def harness(model, smollm2_gguf_path, gemma3_gguf_path):
    path = smollm2_gguf_path if model.startswith("smollm2") else gemma3_gguf_path
    h = PagedHarness(load_checkpoint(path), num_blocks=512, dtype=torch.bfloat16)
    assert h.model.native_decoder is not None and h.model.backend.invariant
    return h


def test_a_tokens_logits_are_the_same_bits_however_its_step_was_made(harness, requests):
    h = harness
    target = [t for r in requests[:4] for t in r.prompt] * 2
    n = len(target)
    whole = h.prefill(target, h.new_table(n))
    assert torch.equal(h.decode_each(target, h.new_table(n)), whole)
    for sizes in ([16] * (n // 16) + [n % 16], [1, 8, 7, 40, n - 56], [n - 1, 1]):
        assert torch.equal(h.chunked(target, h.new_table(n), [s for s in sizes if s]), whole), sizes
    # The last token decoded beside 1..63 other sequences' decodes and a prefill chunk.
    table = h.new_table(n)
    h.prefill(target[:-1], table)
    others = []
    for j in range(63):
        p = requests[j % len(requests)].prompt[: 3 + j % 11]
        t = h.new_table(len(p) + 1)
        h.prefill(p, t)
        others.append(BatchItem([p[-1]], len(p), t))
    for k in (1, 7, 15, 31, 63):
        out = h.runner.forward([BatchItem(target[-1:], n - 1, table)] + others[:k], all_logits=True)
        assert torch.equal(out[0], whole[-1]), f"beside {k} others"
    chunk = requests[5].prompt
    out = h.runner.forward([BatchItem(chunk, 0, h.new_table(len(chunk))), BatchItem(target[-1:], n - 1, table)],
                           all_logits=True)
    assert torch.equal(out[-1], whole[-1]), "beside a prefill chunk"
