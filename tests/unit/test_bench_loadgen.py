"""The load generator against a fake OpenAI SSE server whose timing is fixed: the reported figures must
match the server's schedule (first token after 50 ms, then one every 10 ms)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time

import numpy as np
import pytest

from kvserve.bench.datasets import PromptSource
from kvserve.bench.fake_server import FakeConfig, FakeOpenAIServer
from kvserve.bench.loadgen import ClientConfig, LoadGenerator, TierSpec, parse_mix

TTFT, ITL = 80.0, 10.0
# The machine is shared and loaded: a client and a server in one event loop add a few ms of scheduling noise.
SLACK_MS = 25.0
ITL_SLACK_MS = 3.0


def run(server_cfg: FakeConfig, client_cfg: ClientConfig, tiers, tokenizer):
    async def go():
        async with FakeOpenAIServer(server_cfg, tokenizer=tokenizer) as srv:
            client_cfg.base_url = srv.base_url
            res = await LoadGenerator(client_cfg, tiers, tokenizer).run()
            return res, srv.state

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def test_fixed_timing_gives_exact_figures(tok):
    tier = TierSpec(input_len=32, output_len=16, num_prompts=16, max_concurrency=4, seed=1)
    res, state = run(FakeConfig(ttft_ms=TTFT, itl_ms=ITL), ClientConfig(ignore_eos=True), [tier], tok)
    assert res["completed"] == 16 and res["failed"] == 0
    assert res["total_output_tokens"] == 16 * 16  # from usage
    assert res["total_input_tokens"] == 16 * 32
    assert TTFT - 1 <= res["median_ttft_ms"] <= TTFT + SLACK_MS
    # The fake server sleeps ITL between tokens: a gap is never shorter, and a loaded machine makes some
    # longer. The allowance is per gap, well under what a wrong count would give (the TTFT taken as one
    # more gap: a mean of (80 + 15 x 10) / 16 = 14.4 ms).
    assert ITL - 0.5 <= res["mean_itl_ms"] <= ITL + ITL_SLACK_MS
    assert ITL - 0.5 <= res["median_tpot_ms"] <= ITL + ITL_SLACK_MS
    assert TTFT + 15 * ITL - 1 <= res["median_e2el_ms"] <= TTFT + 15 * ITL + SLACK_MS
    # 4 at a time, each ~230 ms -> ~0.9 s; throughput is tokens over that duration
    assert 0.75 <= res["duration"] <= 2.0
    assert res["output_throughput"] == pytest.approx(256 / res["duration"])
    assert res["request_throughput"] == pytest.approx(16 / res["duration"])
    assert state.max_inflight == 4
    body = state.requests[0].body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert body["model"] == "fake-model"  # taken from /v1/models
    assert isinstance(body["prompt"], str) and "priority" not in body
    # per-request arrays, as in vLLM's result file
    assert len(res["ttfts"]) == 16 and all(t > 0 for t in res["ttfts"])
    assert res["input_lens"] == [32] * 16 and res["output_lens"] == [16] * 16


def test_token_counts_without_usage_and_llamacpp_style_stream(tok):
    tier = TierSpec(input_len=16, output_len=8, num_prompts=4, max_concurrency=2, seed=2)
    # no usage at all: count the chunks that carried text
    res, _ = run(FakeConfig(ttft_ms=5, itl_ms=2, usage="none"), ClientConfig(), [tier], tok)
    assert res["total_output_tokens"] == 32 and res["usage_reported"] == 0
    # llama.cpp: usage in the last chunk *with* choices, after an empty final chunk; Connection: close
    res, state = run(FakeConfig(ttft_ms=5, itl_ms=2, usage="last_choice", final_empty_chunk=True),
                     ClientConfig(connection_close=True, save_detailed=True), [tier], tok)
    assert res["total_output_tokens"] == 32 and res["usage_reported"] == 4
    # as vLLM: the trailing empty chunk is one more ITL sample (8 tokens + 1 empty chunk -> 8 gaps)
    assert [len(x) for x in res["itls"]] == [8] * 4
    assert all(r.headers.get("connection") == "close" for r in state.requests)
    assert state.connections >= 4  # a fresh connection per request (plus /v1/models)


def test_chat_role_preamble_is_not_the_first_token(tok):
    tier = TierSpec(name="interactive", dataset="chat", input_len=64, output_len=8, num_prompts=4,
                    max_concurrency=4, priority="interactive", seed=3)
    res, state = run(FakeConfig(ttft_ms=TTFT, itl_ms=ITL, chat_preamble="immediate"), ClientConfig(ignore_eos=True),
                     [tier], tok)
    assert res["completed"] == 4
    assert res["median_ttft_ms"] >= TTFT - 1  # not the ~0 ms of the role chunk
    body = state.requests[0].body
    assert state.requests[0].path == "/v1/chat/completions"
    assert body["messages"][0]["role"] == "user" and body["max_completion_tokens"] == 8
    assert body["priority"] == "interactive"
    assert res["input_lens"] == [64] * 4  # the templated prompt is the wanted length


def test_error_statuses_are_counted(tok):
    tier = TierSpec(input_len=16, output_len=4, num_prompts=12, max_concurrency=3, seed=4)
    res, _ = run(FakeConfig(ttft_ms=2, itl_ms=1, fail_status=429, fail_every=3), ClientConfig(), [tier], tok)
    assert res["completed"] == 8 and res["failed"] == 4
    assert res["error_counts"] == {"429": 4}
    assert res["error_share"]["429"] == pytest.approx(4 / 12)
    assert sorted(res["statuses"]).count(429) == 4
    res, _ = run(FakeConfig(ttft_ms=2, itl_ms=1, stream_error_every=4), ClientConfig(), [tier], tok)
    assert res["error_counts"] == {"stream_error": 3} and res["completed"] == 9
    res, _ = run(FakeConfig(ttft_ms=2, itl_ms=1, fail_status=503, fail_every=2), ClientConfig(),
                 [TierSpec(input_len=16, output_len=4, num_prompts=4, seed=5)], tok)
    assert res["error_counts"] == {"503": 2}


def test_connection_refused_is_an_error_not_a_crash(tok):
    tier = TierSpec(input_len=16, output_len=4, num_prompts=2, seed=6)
    cfg = ClientConfig(base_url="http://127.0.0.1:9", model="x")  # discard port: nothing listens
    res = asyncio.run(LoadGenerator(cfg, [tier], tok).run())
    assert res["completed"] == 0 and res["failed"] == 2
    assert list(res["error_counts"]) == ["exception:ConnectError"]


def test_poisson_and_constant_arrivals_over_a_duration(tok):
    # constant: 10 req/s for 1 s -> arrivals at 0, 0.1, ..., 0.9
    tier = TierSpec(input_len=16, output_len=2, num_prompts=None, request_rate=10, arrival="constant", seed=7)
    before = time.perf_counter()
    res, state = run(FakeConfig(ttft_ms=1, itl_ms=1), ClientConfig(duration=1.0), [tier], tok)
    assert res["completed"] == 10
    assert before < res["start_monotonic_s"] < time.perf_counter()  # the offsets' origin, for server traces
    gaps = np.diff(sorted(res["start_times"]))
    assert gaps.mean() == pytest.approx(0.1, abs=0.01)
    # Poisson: 40 req/s for 1.5 s -> ~60 requests; deterministic in the seed
    tier = TierSpec(input_len=16, output_len=2, num_prompts=None, request_rate=40, seed=8)
    res1, _ = run(FakeConfig(ttft_ms=1, itl_ms=1), ClientConfig(duration=1.5), [tier], tok)
    assert 30 <= res1["completed"] <= 95
    gaps = np.diff(sorted(res1["start_times"]))
    assert gaps.std() > 0.3 * gaps.mean()  # exponential gaps, not a metronome
    # a fixed number of prompts at a rate
    tier = TierSpec(input_len=16, output_len=2, num_prompts=12, request_rate=40, seed=8)
    res2, _ = run(FakeConfig(ttft_ms=1, itl_ms=1), ClientConfig(), [tier], tok)
    assert res2["completed"] == 12


def test_mix_with_a_background_flood(tok):
    base = TierSpec(seed=11)
    tiers = parse_mix("batch:concurrency=2,input=32,output=1000,drain=0;"
                      "interactive:rate=5,arrival=constant,dataset=chat,input=48,output=4", base, duration=1.0)
    # Goodput's bound is 50x the fake TTFT: the count is what is checked, not this machine's scheduling (at
    # 100 ms, one request in a loaded `make test` went over it).
    res, state = run(FakeConfig(ttft_ms=20, itl_ms=10), ClientConfig(duration=1.0, goodput_ttft_ms=1000), tiers, tok)
    inter, batch = res["tiers"]["interactive"], res["tiers"]["batch"]
    assert inter["completed"] == 5 and inter["failed"] == 0
    assert batch["completed"] == 0 and batch["cancelled"] == 2  # 10 s streams cut off at the end
    # ... yet their tokens were streamed: ~2 x 90 in the second at one per 10 ms
    assert batch["output_throughput"] == 0 and batch["streamed_output_throughput"] * batch["duration"] > 100
    assert res["duration"] < 3.0
    assert inter["good_requests"] == 5
    prios = {r.path: r.body.get("priority") for r in state.requests}
    assert prios == {"/v1/completions": "batch", "/v1/chat/completions": "interactive"}
    assert res["errors"].count("cancelled") == 2
    # vLLM's integer priorities
    res, state = run(FakeConfig(ttft_ms=2, itl_ms=1), ClientConfig(duration=0.5, priority_style="int"),
                     parse_mix("batch:concurrency=1,input=16,output=2;interactive:rate=4,input=16,output=2",
                               base, duration=0.5), tok)
    assert {r.body["priority"] for r in state.requests} == {0, 1}
    res, state = run(FakeConfig(ttft_ms=2, itl_ms=1), ClientConfig(duration=0.3, priority_style="none"),
                     parse_mix("batch:concurrency=1,input=16,output=2", base, duration=0.3), tok)
    assert all("priority" not in r.body for r in state.requests)


def test_token_prompts_and_prompt_sources(tok):
    tier = TierSpec(input_len=24, output_len=2, num_prompts=3, token_prompts=True, seed=12)
    res, state = run(FakeConfig(ttft_ms=1, itl_ms=1), ClientConfig(), [tier], tok)
    prompts = [r.body["prompt"] for r in state.requests]
    assert all(isinstance(p, list) and len(p) == 24 and all(isinstance(i, int) for i in p) for p in prompts)
    assert res["input_lens"] == [24] * 3
    special = set(tok.all_special_ids)
    assert not any(i in special for p in prompts for i in p)
    # deterministic in (seed, i); different seeds differ
    a, b = PromptSource(tok, "random", input_len=64, seed=1), PromptSource(tok, "random", input_len=64, seed=2)
    assert a.prompt(3).prompt == PromptSource(tok, "random", input_len=64, seed=1).prompt(3).prompt
    assert a.prompt(3).prompt != b.prompt(3).prompt and a.prompt(3).prompt != a.prompt(4).prompt
    # text prompts re-encode to the wanted length
    assert [a.prompt(i).prompt_len for i in range(8)] == [64] * 8
    assert len(tok.encode(a.prompt(0).prompt)) == 64
    # shared prefix: prefix + own suffix, the prefix tokens identical across prompts
    s = PromptSource(tok, "shared-prefix", prefix_len=128, input_len=32, seed=3)
    p0, p1 = tok.encode(s.prompt(0).prompt), tok.encode(s.prompt(1).prompt)
    assert len(p0) == len(p1) == 160
    assert p0[:127] == p1[:127] and p0 != p1
    # range ratio: lengths vary around the mean
    r = PromptSource(tok, "random", input_len=100, output_len=50, range_ratio=0.5, seed=4)
    lens = {r.prompt(i).prompt_len for i in range(10)}
    assert len(lens) > 3 and all(50 <= n <= 150 for n in lens)


@contextlib.contextmanager
def threaded_fake_server(cfg: FakeConfig):
    """The fake server on its own loop in a thread, for code that calls asyncio.run itself (the CLI)."""
    loop = asyncio.new_event_loop()
    srv = FakeOpenAIServer(cfg)
    started = threading.Event()

    def main():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start())
        started.set()
        loop.run_forever()

    th = threading.Thread(target=main, daemon=True)
    th.start()
    started.wait(10)
    try:
        yield srv
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)


def test_cli_writes_the_result_file(tmp_path, capsys, smollm2_gguf_path):
    from kvserve.bench.loadgen import main

    out = tmp_path / "r.json"
    with threaded_fake_server(FakeConfig(ttft_ms=TTFT, itl_ms=ITL)) as srv:
        rc = main(["--base-url", srv.base_url, "--tokenizer", str(smollm2_gguf_path), "--model", "m",
                   "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
                   "--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos", "--goodput-ttft-ms", "1000",
                   "--result-file", str(out), "--metadata", "engine=fake", "--label", "t1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms):" in printed
    res = json.loads(out.read_text())
    # Goodput: the requests whose TTFT met the 1000 ms objective (all of them, unless the machine stalled one).
    good = sum(1 for t in res["ttfts"] if t * 1000.0 <= 1000)
    assert res["completed"] == 6 and good >= 5 and res["request_goodput"] == pytest.approx(good / res["duration"])
    assert res["metadata"] == {"engine": "fake"} and res["label"] == "t1"
    assert res["command"][:3] == ["kvserve", "bench", "serve"]
    assert res["config"]["tiers"][0]["max_concurrency"] == 3
    assert "api_key" not in res["config"]["client"]
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "output_throughput",
                "total_token_throughput", "request_throughput"):
        assert isinstance(res[key], float) and not math.isnan(res[key])


def test_kvserve_cli_wires_bench_serve(smollm2_gguf_path, tmp_path):
    """`kvserve bench serve ...` reaches the load generator through kvserve/cli.py."""
    from kvserve import cli

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "serve", "--num-prompts", "2", "--max-concurrency", "1"])
    assert args.bench_cmd == "serve" and args.num_prompts == 2
    out = tmp_path / "c.json"
    with threaded_fake_server(FakeConfig(ttft_ms=5, itl_ms=1)) as srv:
        rc = cli.main(["bench", "serve", "--base-url", srv.base_url, "--tokenizer", str(smollm2_gguf_path),
                       "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "2",
                       "--quiet", "--result-file", str(out)])
    assert rc == 0 and json.loads(out.read_text())["completed"] == 2
