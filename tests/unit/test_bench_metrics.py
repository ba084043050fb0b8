"""Benchmark figures from hand-made request records: vLLM's definitions, exactly."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvserve.bench.loadgen import TierSpec, parse_mix, tier_seed
from kvserve.bench.metrics import RequestRecord, compute_metrics, format_table


def rec(ttft, itl, usage=None, text_chunks=None, prompt_len=10, **kw):
    latency = ttft + sum(itl)
    r = RequestRecord(prompt_len=prompt_len, success=True, status=200, ttft=ttft, latency=latency, itl=list(itl),
                      chunks=len(itl) + 1, text_chunks=len(itl) + 1 if text_chunks is None else text_chunks,
                      usage_completion_tokens=usage, **kw)
    return r


def test_vllm_definitions():
    a = rec(0.100, [0.010] * 9)  # 10 tokens from chunks
    b = rec(0.300, [0.020] * 4, usage=5)  # usage wins over chunks
    c = rec(0.050, [], usage=1)  # one token: no TPOT sample
    m = compute_metrics([a, b, c], duration=2.0, goodput_ttft_ms=100)
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["total_output_tokens"] == 16
    assert m["total_input_tokens"] == 30
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_token_throughput"] == pytest.approx(23.0)
    assert m["request_throughput"] == pytest.approx(1.5)
    # TPOT over requests with >1 token: a -> 90ms/9, b -> 80ms/4
    assert m["mean_tpot_ms"] == pytest.approx((10.0 + 20.0) / 2)
    # ITL pooled over gaps: 9 x 10ms + 4 x 20ms
    itls = [10.0] * 9 + [20.0] * 4
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["p90_itl_ms"] == pytest.approx(np.percentile(itls, 90))
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100.0, 300.0, 50.0], 99))
    assert m["mean_e2el_ms"] == pytest.approx(np.mean([190.0, 380.0, 50.0]))
    # goodput: ttft <= 100 ms -> a and c
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)


def test_failures_and_cancellations_are_kept_apart():
    ok = rec(0.1, [0.01] * 3)
    e429 = RequestRecord(status=429, error_kind="429")
    e503 = RequestRecord(status=503, error_kind="503")
    e429b = RequestRecord(status=429, error_kind="429")
    cancelled = RequestRecord(cancelled=True, error_kind="cancelled", chunks=5)  # cut off after 5 tokens
    m = compute_metrics([ok, e429, e503, e429b, cancelled], duration=1.0)
    assert (m["completed"], m["failed"], m["cancelled"]) == (1, 3, 1)
    assert m["error_counts"] == {"429": 2, "503": 1}
    assert m["error_share"]["429"] == pytest.approx(2 / 5)
    assert m["total_output_tokens"] == 4
    assert m["output_throughput"] == pytest.approx(4.0) and m["streamed_output_throughput"] == pytest.approx(9.0)
    assert m["request_goodput"] is None
    text = format_table(m)
    assert "429:" in text and "Successful requests:" in text


def test_prompt_tokens_from_usage_when_the_server_sends_them():
    a = rec(0.1, [0.01], prompt_len=10, usage_prompt_tokens=12)
    b = rec(0.1, [0.01], prompt_len=10)
    m = compute_metrics([a, b], duration=1.0)
    assert m["total_input_tokens"] == 22


def test_empty_run_gives_zeros_not_errors():
    m = compute_metrics([], duration=1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_parse_mix():
    base = TierSpec(input_len=1024, output_len=128, seed=7)
    tiers = parse_mix("batch:concurrency=16,input=256,output=256,drain=0;"
                      "interactive:rate=1,arrival=constant,dataset=chat,input=64,output=64", base, duration=60)
    batch, inter = tiers
    assert (batch.name, batch.priority, batch.max_concurrency, batch.input_len, batch.output_len) == \
           ("batch", "batch", 16, 256, 256)
    assert batch.drain is False and math.isinf(batch.request_rate) and batch.num_prompts is None
    assert (inter.priority, inter.request_rate, inter.arrival, inter.dataset, inter.drain) == \
           ("interactive", 1.0, "constant", "chat", True)
    assert inter.resolved_endpoint == "/v1/chat/completions" and batch.resolved_endpoint == "/v1/completions"
    # a tier's seed depends only on its name: the same prompts alone or mixed
    alone = parse_mix("interactive:rate=1,dataset=chat", base, duration=60)[0]
    assert alone.seed == inter.seed == tier_seed(7, "interactive") != batch.seed
    with pytest.raises(ValueError):
        parse_mix("batch:bogus=1", base, duration=None)
    with pytest.raises(ValueError):
        parse_mix("a:rate=1;a:rate=2", base, duration=None)
    other = parse_mix("bulk:concurrency=2,priority=none", base, duration=None)[0]
    assert other.priority is None and other.num_prompts == base.num_prompts


def test_tier_validation():
    with pytest.raises(ValueError):
        TierSpec(num_prompts=None).validate(duration=10)  # unbounded: needs a rate or a concurrency cap
    with pytest.raises(ValueError):
        TierSpec(num_prompts=None).validate(duration=None)
    TierSpec(num_prompts=None, max_concurrency=2).validate(duration=10)
    with pytest.raises(ValueError):
        TierSpec(dataset="chat", token_prompts=True).validate(None)
