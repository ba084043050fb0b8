"""What metering costs on this machine, side by side on one server (SQLite store).

    python -m benchmarks.metering [--rounds 3] [--rows 1000000] [--out docs/bench]

1. Checks on against off: one `kvserve serve` (smollm2-135m only), two tenants: "free" has no budget and no
   rate limits (admission skips the store), "metered" has a budget and requests/tokens-per-minute limits far
   above what the run uses (one admission transaction per request, settled by its usage row). Each round
   runs W2 (8 requests of 256 in / 128 out, one at a time) and W1 (64 such, 32 in flight) for both tenants,
   the order alternating between rounds. Targets: W2 TTFT p50 metered - free <= 1 ms; W1 output tokens/s
   metered / free within 2%.
2. Reports over a large ledger: `--rows` usage rows (50 tenants, 2 models, 2 tiers, 30 days) written into
   the server's store (the hourly roll-up is kept as they are written), then GET /v1/usage grouped by
   tenant over 31 daily buckets with an admin token, 10 times: median latency (target < 200 ms), and
   the same with an unaligned start time, which reads the rows themselves instead of the roll-up.
Results: <out>/metering.json and <out>/metering.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.suite import build_jobs
from benchmarks.targets import SMOLLM2_SOURCE, free_port

TARGETS = {"ttft_p50_diff_ms": 1.0, "w1_ratio_min": 0.98, "usage_ms": 200.0}


def log(msg: str) -> None:
    print(f"[metering-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_server(home: Path, port: int, extra: str = "") -> subprocess.Popen:
    """`kvserve serve` with smollm2-135m only, its data in `home`; `extra`: more TOML tables."""
    config = home / "models.toml"
    config.write_text(f'[server]\nhome = "{home}"\n{extra}[[models]]\nid = "smollm2-135m"\n'
                      f'source = "{SMOLLM2_SOURCE}"\n'
                      "interactive = { max_ttft_s = inf }\n")  # W1 bursts are measured, not refused (as W1-W4)
    logf = open(home / "server.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--config", str(config)],
                            env={**os.environ, "KVSERVE_HOME": str(home)}, stdout=logf, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError("server did not start: " + (home / "server.log").read_text()[-2000:])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def client(port: int, token: str, args: list[str], seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--api-key", token, "--model", "smollm2-135m", "--seed", str(seed), "--result-file", str(out), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def checks(rounds: int, work: Path) -> dict:
    from kvserve.store import Store

    home = work / "checks"
    home.mkdir(parents=True, exist_ok=True)
    with Store(home / "kvserve.db") as store:
        tokens = {name: store.create_tenant(name)[1] for name in ("free", "metered")}
        store.budgets.set_budget("metered", 1_000_000.0, "month")
        store.rate_limits.set_limits("metered", rpm=1_000_000, tpm=1_000_000_000)
    port = free_port()
    proc = start_server(home, port)
    jobs = {j.name: j for j in build_jobs(["W1", "W2"], rounds, quick=False)}
    runs = {(w, t): [] for w in ("W1", "W2") for t in tokens}
    try:
        client(port, tokens["free"], jobs["W2"].args[:-4] + ["--num-prompts", "4", "--max-concurrency", "1"], 1,
               work / "warmup.json")
        for r in range(rounds):
            order = list(tokens) if r % 2 == 0 else list(reversed(tokens))
            for w in ("W2", "W1"):
                for t in order:
                    res = client(port, tokens[t], jobs[w].args, jobs[w].seed_base + r, work / f"{w}-{t}-{r}.json")
                    assert res["failed"] == 0, res["error_counts"]
                    runs[w, t].append(res)
                    log(f"round {r} {w} {t}: TTFT p50 {res['p50_ttft_ms']:.1f} ms, "
                        f"{res['output_throughput']:.1f} tok/s")
    finally:
        stop(proc)

    def med(w, t, key):
        return statistics.median(x[key] for x in runs[w, t])

    return {"rounds": rounds,
            "w2_ttft_p50_ms": {t: med("W2", t, "p50_ttft_ms") for t in tokens},
            "w2_ttft_p50_diff_ms": med("W2", "metered", "p50_ttft_ms") - med("W2", "free", "p50_ttft_ms"),
            "w2_paired_diff_ms": statistics.median(a["p50_ttft_ms"] - b["p50_ttft_ms"]
                                                   for a, b in zip(runs["W2", "metered"], runs["W2", "free"])),
            "w1_output_tok_s": {t: med("W1", t, "output_throughput") for t in tokens},
            "w1_ratio": med("W1", "metered", "output_throughput") / med("W1", "free", "output_throughput"),
            "runs": {f"{w}/{t}": [{k: x[k] for k in ("p50_ttft_ms", "output_throughput", "failed")} for x in v]
                     for (w, t), v in runs.items()}}


def reports(rows: int, work: Path) -> dict:
    from kvserve.store import Store, UsageRecord

    home = work / "reports"
    home.mkdir(parents=True, exist_ok=True)
    now = time.time()
    rng = random.Random(1)
    t0 = time.monotonic()
    with Store(home / "kvserve.db") as store:
        _, admin = store.create_tenant("root", admin=True)
        batch = []
        for i in range(rows):
            batch.append(UsageRecord(request_id=f"r{i}", tenant=f"t{i % 50}", model=("a", "b")[i % 2],
                                     tier=("interactive", "batch")[i % 3 == 0], prompt_tokens=200,
                                     cached_prompt_tokens=50, completion_tokens=100,
                                     created_at=now - rng.random() * 30 * 86400, price=2e-5, cost=4e-6, engine_s=0.1))
            if len(batch) == 50_000:
                store.record_usage_many(batch)
                batch = []
        if batch:
            store.record_usage_many(batch)
    log(f"{rows} usage rows written in {time.monotonic() - t0:.0f} s")
    port = free_port()
    proc = start_server(home, port)
    out = {"rows": rows}
    try:
        day = 86400
        aligned = (int(now) // day - 30) * day
        for label, start in (("rollup", aligned), ("raw", aligned + 1)):
            times = []
            for _ in range(11):
                t = time.perf_counter()
                r = httpx.get(f"http://127.0.0.1:{port}/v1/usage", params={
                    "start_time": start, "bucket_width": "1d", "limit": 31, "group_by": "tenant"},
                    headers={"Authorization": f"Bearer {admin}"}, timeout=120)
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200, r.text
            total = sum(x["num_model_requests"] for b in r.json()["data"] for x in b["results"])
            out[label] = {"median_ms": statistics.median(times[1:]), "requests_counted": total}
            log(f"/v1/usage by tenant and day over {rows} rows ({label}): {out[label]['median_ms']:.1f} ms")
    finally:
        stop(proc)
    return out


def render(result: dict) -> str:
    c, r, m = result.get("checks"), result.get("reports"), result["machine"]
    lines = ["# Metering benchmark", "",
             f"Machine: {m['cpu']}; command: `python -m benchmarks.metering --rounds {result['rounds']} "
             f"--rows {result['rows']}`; {result['when']}.", ""]
    if c:
        lines += ["| check (medians of %d rounds) | free tenant | metered tenant | difference | target |" % c["rounds"],
                  "|---|---|---|---|---|",
                  f"| W2 TTFT p50 (ms) | {c['w2_ttft_p50_ms']['free']:.1f} | {c['w2_ttft_p50_ms']['metered']:.1f} | "
                  f"{c['w2_ttft_p50_diff_ms']:+.2f} ms (paired {c['w2_paired_diff_ms']:+.2f}) | <= +1 ms |",
                  f"| W1 output tok/s | {c['w1_output_tok_s']['free']:.1f} | {c['w1_output_tok_s']['metered']:.1f} | "
                  f"{c['w1_ratio']:.3f}x | within 2% |", ""]
    if r:
        lines += [f"| GET /v1/usage, by tenant, 31 daily buckets, {r['rows']:,} rows | median ms | target |",
                  "|---|---|---|",
                  f"| whole days (the daily roll-up) | {r['rollup']['median_ms']:.1f} | < 200 |",
                  f"| unaligned start (the rows themselves) | {r['raw']['median_ms']:.1f} | |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--only", choices=["checks", "reports"], default=None)
    a = ap.parse_args(argv)
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    kind = "AMX" if any(f.startswith("amx") for f in flags) else "AVX-512" if "avx512f" in flags else "AVX2"
    result = {"rounds": a.rounds, "rows": a.rows, "machine": {"cpu": f"{cpu} ({kind}, {os.cpu_count()} CPUs)"},
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.only in (None, "checks"):
            result["checks"] = checks(a.rounds, work)
        if a.only in (None, "reports"):
            result["reports"] = reports(a.rows, work)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "metering.json"
    if a.only and previous.exists():  # one part run again: keep the other from the last run
        other = "reports" if a.only == "checks" else "checks"
        kept = json.loads(previous.read_text()).get(other)
        if kept:
            result[other] = kept
    (out / "metering.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "metering.md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
