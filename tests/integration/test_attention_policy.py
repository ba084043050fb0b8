"""The opt-in sinks + window attention policy (StreamingLLM) on real SmolLM2, which has no native window: every
layer attends to the first 4 tokens and the last 128. Its KV group keeps the sinks' block and the window's and
lets the rest go as the sequence grows, and that changes no bit against keeping every block (kv_groups =
false, the same masked attention); the policy does change the outputs against full attention (it is a
trade-off, measured in BENCHMARKS.md, never a silent one)."""
from __future__ import annotations

import random

import pytest

from kvserve import SamplingParams
from tests.engine_checks import assert_no_leaks, make_engine, shared_weights, torch_threads

pytestmark = [pytest.mark.real_model]

POLICY = dict(attention_policy="sinks_window", attention_sinks=4, attention_window=128)


@pytest.fixture(scope="module", autouse=True)
def _shared():
    with torch_threads(1), shared_weights():
        yield


def run(**kwargs) -> tuple[list, int, object]:
    eng = make_engine("smollm2-135m", dtype="bfloat16", max_num_batched_tokens=128, **kwargs)
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 40000) for _ in range(600)]
    eng.core.add_request(eng.request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)))
    peak, out = 0, None
    while eng.core.has_unfinished_requests():
        for ro in eng.core.step():
            out = ro if ro.finished else out
        for seq in eng.core.scheduler._running:
            peak = max(peak, eng.core.kv.num_blocks_held(seq))
    assert_no_leaks(eng)
    (o,) = out.outputs
    return [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs], peak, eng


def test_the_policy_holds_its_window_and_sinks_and_changes_no_bit_for_it():
    bits, peak, eng = run(**POLICY)
    layout = eng.core.kv.layout
    assert layout.num_groups == 1 and layout.groups[0].window == 128 and layout.groups[0].sinks == 4
    assert eng.runner.model.native_decoder is None  # served op by op: the fused kernels have no sinks
    # The sinks' block, the window and the chunk being computed; never the whole 624 tokens' 39 blocks.
    assert peak <= layout.pages_held(624, 16, new_tokens=128) < 39
    kept, full_peak, _ = run(**POLICY, kv_groups=False)
    assert kept == bits and full_peak == 39
    full, _, _ = run()
    assert [t for t, _, _ in full] != [t for t, _, _ in bits] or [lp for _, lp, _ in full] != [lp for _, lp, _ in bits]
