"""KV groups on real Gemma 3 (five sliding layers of window 512 for every full one): its sliding layers
let go of the blocks their window has passed, and nothing it computes changes. Greedy tokens and their
logprobs after a 4.6k-token prompt are the same bits with groups as with every layer holding every
block (kv_groups = false), alone, from a prefix-cache hit that needed only the window's blocks, and
beside another long sequence in a pool too small to hold both without groups (the blocks one lets go are
reused by the other while both run)."""
from __future__ import annotations

import inspect
import textwrap

import pytest

from kvserve import SamplingParams
from tests.engine_checks import Req, assert_no_leaks, make_engine, shared_weights, torch_threads

MODEL = "gemma3-270m"
PROMPT_TOKENS = 4600


@pytest.fixture(scope="module", autouse=True)
def _shared():
    with torch_threads(1), shared_weights():
        yield


def engine(**kwargs):
    args = dict(dtype="bfloat16", kv_cache_memory="256MiB", max_num_batched_tokens=512, max_model_len=8192)
    args.update(kwargs)
    return make_engine(MODEL, **args)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Two long, fixed texts (the standard library's own source), cut at PROMPT_TOKENS tokens."""
    import argparse
    import json.decoder

    tok = engine(kv_cache_memory="16MiB").tokenizer
    texts = [textwrap.dedent(inspect.getsource(m)) for m in (argparse, json.decoder)]
    ids = [tok.encode("Summarize this code:\n" + (t * 4)) for t in texts]
    assert all(len(i) >= PROMPT_TOKENS for i in ids)
    return [i[:PROMPT_TOKENS] for i in ids]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def _bits(output) -> list:
    (o,) = output.outputs
    return [(lp.token_id, lp.logprob, [(t, v) for t, _, v in lp.top]) for lp in o.logprobs]


def _run(eng, reqs: list[Req]) -> tuple[list, int, list, int]:
    """(each request's bits, the most blocks one sequence held at once, each request's cached tokens, the
    most sequences running at once)."""
    ids = [eng.core.add_request(eng.request(r.prompt, r.params)) for r in reqs]
    peak, running, final = 0, 0, {}
    while eng.core.has_unfinished_requests():
        for ro in eng.core.step():
            if ro.finished:
                final[ro.request_id] = ro
        for seq in eng.core.scheduler._running:
            peak = max(peak, eng.core.kv.num_blocks_held(seq))
        running = max(running, len(eng.core.scheduler._running))
    assert_no_leaks(eng)
    return [_bits(final[i]) for i in ids], peak, [final[i].num_cached_tokens for i in ids], running


@pytest.fixture(scope="module")
def full(prompts):
    """Every layer holds every block: the reference bits, and the blocks a sequence holds then."""
    eng = engine(kv_groups=False, enable_prefix_caching=False)
    assert eng.core.kv.num_groups == 1
    runs = [_run(eng, [Req(p, _greedy())]) for p in prompts]
    return [r[0][0] for r in runs], runs[0][1], eng


def test_groups_hold_a_third_of_the_bytes_and_change_no_bit(prompts, full):
    want, full_peak, full_engine = full
    eng = engine(enable_prefix_caching=False)
    layout = eng.core.kv.layout
    assert layout.num_groups == 6 and layout.group_size == 3 and eng.core.kv.num_groups == 6
    bits, peak, _, _ = _run(eng, [Req(prompts[0], _greedy())])
    assert bits[0] == want[0]
    # The peak is within the rule's (engine/kv/groups.py): the full group's every block and each sliding
    # group's window and a chunk of at most 512 tokens. A group's block is a sixth of a classic one in bytes.
    assert peak <= layout.pages_held(PROMPT_TOKENS + 24, eng.core.kv.block_size, new_tokens=512)
    assert peak / 6 <= 0.36 * full_peak, (peak, full_peak)
    # And the same pool memory holds about six times the pages.
    assert eng.core.kv.num_device_blocks >= 5.9 * full_engine.core.kv.num_device_blocks


def test_a_prefix_hit_needs_only_the_windows_blocks_and_gives_the_same_bits(prompts, full):
    want = full[0]
    eng = engine()
    _run(eng, [Req(prompts[0], _greedy())])
    bits, _, cached, _ = _run(eng, [Req(prompts[0], _greedy())])
    assert cached[0] >= PROMPT_TOKENS - 32
    assert bits[0] == want[0]
    # The hit's sliding groups took only the blocks their window reaches: NULL_PAGE before them.
    assert eng.core.kv.usage().prefix_hit_tokens >= cached[0]


def test_two_long_sequences_share_a_pool_that_fits_one_without_groups(prompts, full):
    want, full_peak, _ = full
    # Room for one sequence's every-layer blocks and a little more, in pages of one group.
    pages = int(full_peak * 6 * 1.1) + 1
    eng = engine(num_gpu_blocks_override=pages, enable_prefix_caching=False)
    run_bits, _, _, running = _run(eng, [Req(p, _greedy()) for p in prompts])
    assert run_bits == want
    assert running == 2
