"""Sleep mode (engine/worker/sleep.py; LLMEngine.sleep and wake_up) on SmolLM2: asleep, the weights' pages and the KV
pool's are the OS's again (the process's resident memory drops by about what was paged out and freed, a weight reads
as zeros); awake, the memory is held again, every weight holds its bits again and greedy tokens are those before sleep, the prompt's cached
prefix forgotten (its pages were discarded); an engine with a request in flight does not sleep."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.worker.sleep import SleepUnsupported, held_tensors

PROMPT = [17, 2054, 931, 4011, 88, 7, 12500, 301] * 8
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_an_engine_asleep_frees_its_memory_and_wakes_to_the_same_tokens(tmp_path):
    llm = LLM("smollm2-135m", max_num_seqs=4, kv_cache_memory=64 << 20, enable_prefix_caching=True)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        before = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        engine = llm.engine
        weight = max(held_tensors(engine.runner.model), key=lambda t: t.untyped_storage().nbytes())  # (packed)
        kept = weight.clone()
        rss = _rss()
        report = llm.sleep(str(tmp_path))
        freed = report.paged_out_bytes + report.discarded_bytes
        assert report.paged_out_bytes > 40e6 and report.discarded_bytes > 30e6, report
        assert rss - _rss() > 0.6 * freed, (rss - _rss(), report)
        assert weight.count_nonzero() < weight.numel() // 100  # its pages are gone
        with pytest.raises(SleepUnsupported, match="asleep already"):
            llm.sleep(str(tmp_path))
        assert llm.wake_up() > 0 and torch.equal(weight, kept)
        engine._sleeper.populating.join(60)
        assert _rss() > rss - 0.2 * freed  # the KV pool's memory is held again, as at start
        after = llm.generate([PROMPT], params, use_tqdm=False)[0]
        assert after.outputs[0].token_ids == before
        assert after.num_cached_tokens == 0  # the discarded prefix was not hit
        # With a request in the engine it stays awake.
        engine.core.add_request(engine.request(PROMPT, params))
        with pytest.raises(SleepUnsupported, match="in flight"):
            engine.sleep(str(tmp_path))
        assert not engine.asleep
    finally:
        llm.close()

