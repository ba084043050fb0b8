"""The batch API's targets on this machine, on one `kvserve serve` (smollm2-135m only).

    python -m benchmarks.batch [--rounds 3] [--lines 1000] [--out docs/bench]

Each round, on the same server:
1. W1 (the suite's: 64 prompts of 256 random tokens, 128 out, 32 in flight): output tokens/s.
2. A batch of `--lines` short chat requests (a one-sentence question, max_tokens 64, greedy) alone:
   output tokens/s = the output tokens of its lines / (completed_at - in_progress_at). Target >= 0.9x W1's.
3. Interactive chat alone at 1 request/s (64 random tokens in, 64 out, `--interactive` requests): TTFT p50/p99.
4. The same interactive load while a batch of the same lines runs: TTFT p50 within 1.5x of (3), p99 < 1 s.
The server's `[batch] max_inflight` is 32 (W1's concurrency). Results: <out>/batch.json and <out>/batch.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.metering import log, start_server, stop
from benchmarks.suite import build_jobs
from benchmarks.targets import free_port

INTERACTIVE = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "64", "--ignore-eos",
               "--request-rate", "1", "--arrival", "constant", "--priority", "interactive"]


def batch_file(lines: int) -> bytes:
    topics = ["the sea", "a city at night", "bread", "winter", "a clock", "rivers", "the moon", "music"]
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "smollm2-135m", "temperature": 0, "max_tokens": 64, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Write one sentence about {topics[i % 8]} (#{i})."}]}}
            for i in range(lines)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def run_batch(base: str, token: str, data: bytes) -> dict:
    h = {"Authorization": f"Bearer {token}"}
    f = httpx.post(base + "/v1/files", headers=h, files={"file": ("b.jsonl", data)}, data={"purpose": "batch"},
                   timeout=60).json()
    b = httpx.post(base + "/v1/batches", headers=h, timeout=60, json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    while b["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)
        b = httpx.get(base + f"/v1/batches/{b['id']}", headers=h, timeout=60).json()
    out = httpx.get(base + f"/v1/files/{b['output_file_id']}/content", headers=h, timeout=120).text
    tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out.splitlines() if x)
    span = b["completed_at"] - b["in_progress_at"]
    return {"status": b["status"], "lines": b["request_counts"], "output_tokens": tokens, "seconds": span,
            "output_tok_s": tokens / span if span > 0 else None}


def loadgen(port: int, token: str, args: list[str], seed: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--api-key", token, "--model", "smollm2-135m", "--seed", str(seed), "--result-file", str(out),
                    *args],
                   check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--interactive", type=int, default=40, help="interactive requests per run (1 per second)")
    ap.add_argument("--out", default="docs/bench")
    a = ap.parse_args(argv)
    from kvserve.store import Store

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        with Store(home / "kvserve.db") as store:
            token = store.create_tenant("bench")[1]
        port = free_port()
        proc = start_server(home, port, extra="[batch]\nmax_inflight = 32\nmax_inflight_per_batch = 32\n")
        base = f"http://127.0.0.1:{port}"
        w1 = next(j for j in build_jobs(["W1"], 1, quick=False) if j.name == "W1")
        data = batch_file(a.lines)
        inter = INTERACTIVE + ["--num-prompts", str(a.interactive)]
        try:
            loadgen(port, token, w1.args[:-4] + ["--num-prompts", "8", "--max-concurrency", "8"], 1, home / "warm.json")
            for r in range(a.rounds):
                res = {"w1": loadgen(port, token, w1.args, w1.seed_base + r, home / f"w1-{r}.json")}
                log(f"round {r}: W1 {res['w1']['output_throughput']:.1f} tok/s")
                res["batch"] = run_batch(base, token, data)
                log(f"round {r}: batch alone {res['batch']['output_tok_s']:.1f} tok/s over {res['batch']['seconds']} s")
                res["alone"] = loadgen(port, token, inter, 300 + r, home / f"alone-{r}.json")
                under: dict = {}
                t = threading.Thread(target=lambda: under.update(run_batch(base, token, data)))
                t.start()
                time.sleep(3)  # the batch's lines are in flight
                res["with_batch"] = loadgen(port, token, inter, 300 + r, home / f"mixed-{r}.json")
                t.join()
                res["batch_under_interactive"] = under
                log(f"round {r}: interactive TTFT p50/p99 alone {res['alone']['p50_ttft_ms']:.0f}/"
                    f"{res['alone']['p99_ttft_ms']:.0f} ms, with the batch {res['with_batch']['p50_ttft_ms']:.0f}/"
                    f"{res['with_batch']['p99_ttft_ms']:.0f} ms")
                rounds.append(res)
        finally:
            stop(proc)

    def med(f):
        return statistics.median(f(r) for r in rounds)

    summary = {
        "w1_tok_s": med(lambda r: r["w1"]["output_throughput"]),
        "batch_tok_s": med(lambda r: r["batch"]["output_tok_s"]),
        "batch_vs_w1": med(lambda r: r["batch"]["output_tok_s"] / r["w1"]["output_throughput"]),
        "ttft_p50_alone_ms": med(lambda r: r["alone"]["p50_ttft_ms"]),
        "ttft_p99_alone_ms": med(lambda r: r["alone"]["p99_ttft_ms"]),
        "ttft_p50_with_batch_ms": med(lambda r: r["with_batch"]["p50_ttft_ms"]),
        "ttft_p99_with_batch_ms": med(lambda r: r["with_batch"]["p99_ttft_ms"]),
        "ttft_p50_ratio": med(lambda r: r["with_batch"]["p50_ttft_ms"] / r["alone"]["p50_ttft_ms"]),
    }
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    kind = "AMX" if any(f.startswith("amx") for f in flags) else "AVX-512" if "avx512f" in flags else "AVX2"
    result = {"machine": f"{cpu} ({kind}, {os.cpu_count()} CPUs)", "lines": a.lines, "rounds": a.rounds,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": summary,
              "runs": [{k: ({kk: v[kk] for kk in ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "failed")}
                            if "output_throughput" in v else v) for k, v in r.items()} for r in rounds]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(result, indent=2) + "\n")
    s = summary
    md = "\n".join([
        "# Batch API benchmark", "",
        f"Machine: {result['machine']}; `python -m benchmarks.batch --rounds {a.rounds} --lines {a.lines}`; "
        f"{result['when']}; medians of {a.rounds} rounds.", "",
        "| measure | value | target |", "|---|---|---|",
        f"| W1 output tok/s | {s['w1_tok_s']:.1f} | |",
        f"| batch of {a.lines} short chats alone, output tok/s | {s['batch_tok_s']:.1f} ({s['batch_vs_w1']:.2f}x W1) "
        "| >= 0.9x W1 |",
        f"| interactive at 1 req/s alone, TTFT p50 / p99 ms | {s['ttft_p50_alone_ms']:.0f} / {s['ttft_p99_alone_ms']:.0f} | |",
        f"| the same with the batch running, TTFT p50 / p99 ms | {s['ttft_p50_with_batch_ms']:.0f} / "
        f"{s['ttft_p99_with_batch_ms']:.0f} ({s['ttft_p50_ratio']:.2f}x p50) | p50 <= 1.5x, p99 < 1000 |", ""])
    (out / "batch.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
