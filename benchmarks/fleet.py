"""The fleet's targets on this machine: what the Ray Serve fleet costs and what it buys, side by side.

    python -m benchmarks.fleet [--rounds 3] [--out docs/bench] [--only overhead,affinity,failover,update]

Time on a 2-core box (AMD EPYC, no AMX): about 21 minutes with the default 3 rounds (overhead ~8, affinity
~4.5, failover ~4, update ~4.5), about 7.5 with --rounds 1; more when it has to wait for other processes.

Four parts, each `--rounds` rounds (a different seed per round, the same seeds on both sides of a
comparison); the tables give medians over the rounds with [min-max]. The workloads are the suite's
(benchmarks/suite.py build_jobs: W1-W4 of shared/WORKLOADS.md) and the client is the suite's,
`kvserve bench serve` (kvserve.bench.loadgen) in its own process, except in the failover part, whose
client must keep every stream's text and chunk times (a small streaming client here, same request shape).

1. overhead: W1 (64 random 256-token prompts, 128 out, 32 in flight) and W2 (8 such requests one at a
   time) against the single-process server (`kvserve serve`, a config with only smollm2-135m: the
   suite's) and through the fleet gateway to ONE replica of the same model (replicas = 1, cpus = 2: both
   cores' worth of threads, as the single server has). The single server's rounds run first, before
   Ray starts (it is not deployed next to Ray), then the fleet's. Targets: W1 output tokens/s fleet /
   single >= 0.9; W2 TTFT p50 fleet - single <= +10 ms.
2. affinity: W4 (32 requests sharing a 512-token prefix, 64 own tokens, 64 out, 4 in flight) on one
   replica, then on two (cpus = 1 each). Prefix-cache hit rate from the replicas' own counters
   (prefix_hit_tokens / prefix_query_tokens, deltas over the run, summed over the pool: the gateway's
   /metrics, which sums the replica stats /fleet/status shows per replica). Target: two replicas'
   >= 90% of one replica's. Then a run where every request shares one 512-token prefix (a system prompt,
   in tokens: 32 requests, 64 own tokens, 64 out, 16 in flight) on two replicas: the largest share of
   the requests any replica took (the gateway's `routed` counts in /fleet/status, deltas; `accepted`,
   the replicas' own count, alongside). Target <= 65%.
3. failover: two replicas, 32 requests of W1's shape (256 / 128, greedy, ignore_eos) sent at once (32
   streams in flight). Each round: the requests undisturbed, once more undisturbed (the control: how
   often greedy outputs agree between two clean runs), then again with one replica SIGKILLed (os.kill of
   its worker process, found in Ray's actor table; ray.kill when no pid is known) at 35% of the
   undisturbed run's duration; the replica with the most streams in flight is the one killed. Failed
   requests (target 0), the share of outputs identical to the undisturbed run's (target >= 95%), and
   for the migrated streams (the N streams with the longest gap across the kill, N = the gateway's
   migration count): that gap, and their TPOT against the same requests' undisturbed TPOT.
4. update: two replicas under W3's mix (16 batch streams of 256 / 256 + 1 interactive chat request a
   second, 64 / 64) for `--update-duration` seconds; `deploy.apply` of the same config with a new version
   label 8 s in (a rolling update: a new pool of two replicas is loaded next to the old, the gateway
   switches, the old pool drains). Failed requests (target 0; with each failure's status, message and
   time), interactive TTFT p99 of the requests sent while the update ran (from the apply call until the
   old pool's last replica actor is gone), and the same run's TTFT p99 before it; whether the apply
   replaced the gateway's replica too.

The fleet runs in this process (deploy.connect + deploy.start, a TOML in the work directory, port from
a free socket, `[server] home` there, a tenant made with Store.create_tenant) on a local Ray instance
given 4 logical CPUs on this 2-core box, so that a rolling update's new pool fits next to the old one
(Ray sets a replica's OMP_NUM_THREADS to its `cpus` as it starts; a probe task recorded). The gateway
takes 0 CPUs. Other fleet settings are the defaults. Results: `<out>/fleet.json` (every round's numbers,
the machine, the configs) and `<out>/fleet.md`; a part run alone (`--only`) replaces that part in
an existing fleet.json and leaves the others (the replaced result is kept in its "history", which
fleet.md lists). Raw client results, the failover runs' texts and chunk times, logs: `--work` (default
bench_results/fleet-<UTC time>/).

Run it on an otherwise idle box (two cores: any other busy process distorts every number), and, where
other Ray users share it, under their lock: `flock /tmp/ray.lock .venv/bin/python -m benchmarks.fleet`.
It checks: before each measured run it waits (up to 5 min) until processes outside its own process tree
use under 0.15 cores, and it records what they used during the run (CpuMeter); an overhead or affinity
run they disturbed (>= 0.2 cores) is made again with a fresh seed (up to 3 times, the least disturbed
kept), failover and update runs are flagged. A change to kvserve/ during the run (Ray workers import the
code as they start) is flagged too.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.suite import build_jobs, git_info
from benchmarks.targets import REPO, SMOLLM2_SOURCE, KvserveTarget, RunningServer, free_port, shell_join

PARTS = ("overhead", "affinity", "failover", "update")
MODEL = "smollm2-135m"
RAY_NUM_CPUS = 4  # logical: a rolling update's new pool (2 x 1 CPU) is placed next to the old one
TARGETS = {"w1_ratio": 0.9, "w2_ttft_p50_diff_ms": 10.0, "hit_rate_ratio": 0.9, "max_share": 0.65,
           "failed": 0, "identical": 0.95}
SYSPROMPT_ARGS = ["--dataset-name", "shared-prefix", "--shared-prefix-len", "512", "--random-input-len", "64",
                  "--random-output-len", "64", "--ignore-eos", "--num-prompts", "32", "--max-concurrency", "16"]
FAILOVER_SHAPE = dict(streams=32, input=256, output=128, kill_at=0.35)
UPDATE_APPLY_AT_S = 8.0
GATEWAY_PREFIX = "kvserve#gateway#"  # Serve names the gateway's replica actors SERVE_REPLICA::kvserve#gateway#<id>


def log(msg: str) -> None:
    print(f"[fleet-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def percentile(xs, p):
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), p)) if xs else None


# ---- the machine --------------------------------------------------------------------------------

def machine() -> dict:
    from benchmarks.ceilings import machine_info

    info = machine_info()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        flags = fields.get("Flags", "").split()
        info.update(lscpu_model_name=fields.get("Model name"), lscpu_cpus=fields.get("CPU(s)"),
                    avx512_flags=sorted(f for f in flags if f.startswith("avx512")),
                    amx_flags=sorted(f for f in flags if f.startswith("amx")))
        info["avx512"] = bool(info["avx512_flags"])
        info["amx"] = bool(info["amx_flags"])
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        info["lscpu_error"] = str(e)
    try:
        import ray
        import torch

        info.update(torch=torch.__version__, torch_threads_here=torch.get_num_threads(), ray=ray.__version__)
    except ImportError as e:
        info["import_error"] = str(e)
    return info


# ---- other processes on the box -----------------------------------------------------------------

class CpuMeter:
    """CPU used on this box by processes outside this benchmark's process tree (its servers, clients, Ray and
    every replica are inside it), from /proc/<pid>/stat: each outside process's own and reaped children's
    time, deltas between two snapshots (a process that appeared counts whole; one that exited is taken off
    its waiting parent's gain). Counted from the outside because the tree's own books do not balance: the
    raylet does not wait for its workers, so a killed replica's time is reaped by no one. PID 1 (the init
    that adopts orphans) is left out. `quiet()` waits until that is near zero before a measured run;
    `start`/`stop` record it during one. Two cores shared with anything busy make every number here
    meaningless, so this is checked, not hoped."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, threshold_cores: float = 0.15, max_wait_s: float = 300.0):
        self.root = os.getpid()
        self.threshold, self.max_wait = threshold_cores, max_wait_s
        self.log: list[dict] = []

    def snap(self) -> tuple[float, dict]:
        """(time, {pid: (start time, own cpu, reaped children's cpu, parent, in this tree)}) in clock ticks."""
        procs: dict[int, list] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
            except OSError:
                continue
            rest = st[st.rindex(")") + 2:].split()
            procs[int(d)] = [int(rest[19]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14]),
                             int(rest[1]), False]
        kids: dict[int, list[int]] = {}
        for pid, v in procs.items():
            kids.setdefault(v[3], []).append(pid)
        todo = [self.root]
        while todo:
            p = todo.pop()
            if p in procs:
                procs[p][4] = True
            todo += kids.get(p, [])
        return time.monotonic(), procs

    def foreign(self, a, b) -> float:
        """Cores' worth of CPU that processes outside the tree used between two snaps."""
        (ta, pa), (tb, pb) = a, b
        ticks = 0
        for pid, (start, own, reaped, _, tree) in pb.items():
            if tree or pid == 1:
                continue
            old = pa.get(pid)
            if old is None or old[0] != start:
                ticks += own + reaped  # began after the first snap
            elif not old[4]:
                ticks += (own - old[1]) + (reaped - old[2])
        for pid, (start, own, reaped, parent, tree) in pa.items():
            if tree or pid == 1 or (pid in pb and pb[pid][0] == start):
                continue
            gone = pb.get(parent), pa.get(parent)
            if gone[0] is not None and gone[1] is not None and not gone[0][4] and parent != 1:
                ticks -= min(own + reaped, gone[0][2] - gone[1][2])  # the parent's gain holds its whole life
        cores = ticks / self.HZ / max(tb - ta, 1e-6)
        return min(max(cores, 0.0), float(os.cpu_count() or 1))

    def quiet(self, label: str) -> float:
        """Wait (at most max_wait_s) until other processes use under `threshold` cores over 3 s."""
        t0 = time.monotonic()
        said = False
        while True:
            a = self.snap()
            time.sleep(3.0)
            f = self.foreign(a, self.snap())
            if f < self.threshold:
                break
            if time.monotonic() - t0 > self.max_wait:
                log(f"other processes still use {f:.2f} cores after {self.max_wait:.0f} s; running {label} anyway")
                break
            if not said:
                log(f"waiting for the box to quiet down before {label}: other processes use {f:.2f} cores")
                said = True
        return time.monotonic() - t0

    def start(self, label: str) -> dict:
        waited = self.quiet(label)
        return {"label": label, "waited_s": round(waited, 1), "_a": self.snap()}

    def stop(self, m: dict) -> float:
        b = self.snap()
        m["foreign_cores"] = round(self.foreign(m.pop("_a"), b), 3)
        self.log.append(m)
        return m["foreign_cores"]


METER = CpuMeter()
BUSY_CORES = 0.2  # other processes using this much during a run disturbed it (overhead and affinity runs are redone)
ATTEMPTS = 3  # at most, per overhead or affinity run; the least disturbed is kept


def foreign_summary(entries: list[dict]) -> dict:
    xs = [e["foreign_cores"] for e in entries]
    return {"runs": len(xs), "mean_cores": round(statistics.mean(xs), 3) if xs else None,
            "max_cores": max(xs) if xs else None, "waited_s": round(sum(e["waited_s"] for e in entries), 1),
            "busy_runs": [e["label"] for e in entries if e["foreign_cores"] >= 0.2]}


# ---- the client (the suite's load generator, in its own process) ----------------------------------

JOBS = {j.name: j for j in build_jobs(["W1", "W2", "W3", "W4"], 1, quick=False)}


def loadgen_argv(base_url: str, args: list[str], seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "kvserve.bench.loadgen", "--base-url", base_url, "--model", MODEL,
            "--tokenizer", MODEL, "--priority-style", "string", *args, "--seed", str(seed), "--quiet",
            "--result-file", str(out)]


def run_loadgen(base_url: str, token: str, args: list[str], seed: int, out: Path) -> dict:
    argv = loadgen_argv(base_url, args, seed, out)
    m = METER.start(str(out.relative_to(out.parents[2]) if len(out.parents) > 2 else out.name))
    with open(out.with_suffix(".log"), "w") as f:
        r = subprocess.run(argv, env={**os.environ, "KVSERVE_API_KEY": token}, stdout=f, stderr=subprocess.STDOUT,
                           cwd=str(REPO))
    foreign = METER.stop(m)
    if not out.exists():
        raise RuntimeError(f"the load generator exited {r.returncode} without a result; see {out.with_suffix('.log')}")
    res = json.loads(out.read_text())
    res["foreign_cores"] = foreign
    return res


def with_duration(args: list[str], seconds: float) -> list[str]:
    args = list(args)
    i = args.index("--duration")
    args[i + 1] = f"{seconds:g}"
    return args


def _git(*a) -> str:
    return subprocess.run(["git", *a], cwd=str(REPO), capture_output=True, text=True).stdout


def code_state() -> str:
    """The product's code (kvserve/) as this run sees it: HEAD's kvserve tree and a digest of the working
    tree's changes to it. Processes import the code as they start (Ray workers, clients), so a change made
    during a run (another engineer's edit, a commit) can skew it."""
    import hashlib

    h = hashlib.sha256(_git("diff", "HEAD", "--", "kvserve").encode())
    for path in _git("ls-files", "--others", "--exclude-standard", "--", "kvserve").split():
        try:
            h.update(path.encode() + (REPO / path).read_bytes())
        except OSError:
            pass
    return _git("rev-parse", "HEAD:kvserve").strip()[:12] + "+" + h.hexdigest()[:12]


def code_changes(a: str, b: str) -> list[str]:
    """kvserve/ files that differ between two code states (committed trees; plus the uncommitted ones now)."""
    files = set(_git("diff", "--name-only", a.split("+")[0], b.split("+")[0]).split())
    if a.split("+")[1] != b.split("+")[1]:
        files |= {line[3:] for line in _git("status", "--porcelain", "--", "kvserve").splitlines()}
    return sorted("kvserve/" + f if not f.startswith("kvserve/") else f for f in files)


def summary(r: dict) -> dict:
    keys = ("completed", "failed", "cancelled", "error_counts", "output_throughput", "request_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "duration",
            "cached_prompt_tokens", "total_input_tokens", "foreign_cores")
    return {k: r.get(k) for k in keys}


# ---- the fleet in this process ------------------------------------------------------------------

FLEET_TOML = """# written by benchmarks.fleet
[server]
host = "127.0.0.1"
port = {port}
home = "{home}"

[fleet]
gateway_cpus = 0

[[models]]
id = "{model}"
source = "{source}"
role = "fast"
version = "{version}"
interactive = {{ max_ttft_s = inf }}  # the single-process W1-W4 runs refuse nothing either
[models.fleet]
replicas = {replicas}
cpus = {cpus}
"""


class Fleet:
    def __init__(self, work: Path):
        self.home = work / "fleet-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.path = self.home / "fleet.toml"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.token = ""
        self.started = False
        self.version_n = 1
        self.shape: tuple[int, float] | None = None
        self.pool: str | None = None
        self.configs: list[dict] = []

    @property
    def version(self) -> str:
        return f"v{self.version_n}"

    def text(self, replicas: int, cpus: float, version: str | None = None) -> str:
        return FLEET_TOML.format(port=self.port, home=self.home, model=MODEL, source=SMOLLM2_SOURCE,
                                 version=version or self.version, replicas=replicas, cpus=cpus)

    def pool_of(self, text: str) -> str:
        from kvserve.config import ServerConfig
        from kvserve.fleet.deploy import pool_name

        self.path.write_text(text)
        return pool_name(ServerConfig.from_toml(str(self.path)).models[0])

    def start(self, replicas: int, cpus: float) -> None:
        from kvserve.config import ServerConfig
        from kvserve.fleet import deploy
        from kvserve.store import Store

        text = self.text(replicas, cpus)
        self.pool = self.pool_of(text)
        with Store(self.home / "kvserve.db") as store:
            _, self.token = store.create_tenant(f"fleet-bench-{int(time.time())}")
        cfg = ServerConfig.from_toml(str(self.path))
        t0 = time.monotonic()
        log(f"starting Ray ({RAY_NUM_CPUS} logical CPUs) and the fleet: {replicas} replica(s) x {cpus:g} CPU, "
            f"gateway on {self.base_url}")
        deploy.connect(None, cfg, num_cpus=RAY_NUM_CPUS)
        deploy.start(cfg, text)
        self.started = True
        self.shape = (replicas, cpus)
        self.wait_pool(self.pool, replicas)
        self.configs.append({"at": "start", "toml": text, "seconds": round(time.monotonic() - t0, 1)})
        log(f"fleet up in {time.monotonic() - t0:.0f} s (pool {self.pool})")

    def ensure(self, replicas: int, cpus: float) -> None:
        """The fleet with this shape: started, or changed by deploy.apply (and the old pool gone)."""
        if not self.started:
            self.start(replicas, cpus)
            return
        if self.shape == (replicas, cpus):
            return
        old = self.pool
        t0 = time.monotonic()
        text = self.text(replicas, cpus)
        self.pool = self.pool_of(text)
        log(f"applying {replicas} replica(s) x {cpus:g} CPU (pool {old} -> {self.pool})")
        changes = self.apply(text)
        self.wait_pool(self.pool, replicas)
        if old != self.pool:
            self.wait_app_gone(old)
            self.wait_actors_gone(old)
        self.shape = (replicas, cpus)
        self.configs.append({"at": "apply", "toml": text, "changes": changes,
                             "seconds": round(time.monotonic() - t0, 1)})
        log(f"fleet now {replicas} x {cpus:g} CPU after {time.monotonic() - t0:.0f} s")

    def apply(self, text: str) -> list[str]:
        from kvserve.fleet import deploy

        return deploy.apply(text, address=None)

    # ---- reading the fleet ----
    def get(self, path: str, timeout: float = 10.0):
        import httpx

        return httpx.get(self.base_url + path, timeout=timeout, trust_env=False)

    def status(self) -> dict:
        return self.get("/fleet/status").json()["models"][MODEL]

    def replicas(self) -> dict[str, dict]:
        return {r["id"]: r for r in self.status()["replicas"]}

    def routing(self) -> dict:
        """The gateway's routing counts now: per replica, and by reason (affinity, spilled, load, ...)."""
        st = self.status()
        return {"routed": {r["id"]: r.get("routed") or 0 for r in st["replicas"]},
                "by_reason": dict(st.get("by_reason") or {})}

    @staticmethod
    def routing_delta(a: dict, b: dict) -> dict:
        return {kind: {k: b[kind].get(k, 0) - a[kind].get(k, 0) for k in set(a[kind]) | set(b[kind])
                       if b[kind].get(k, 0) - a[kind].get(k, 0)} for kind in ("routed", "by_reason")}

    def prefix_counters(self) -> tuple[float, float]:
        """(hit tokens, query tokens) summed over the pool's replicas: the gateway's /metrics."""
        text = self.get("/metrics").text
        out = {}
        for kind in ("hits", "queries"):
            m = re.search(rf'^kvserve:prefix_cache_{kind}(?:_total)?\{{[^}}]*model_name="{MODEL}"[^}}]*\}}\s+(\S+)',
                          text, re.M)
            out[kind] = float(m.group(1)) if m else float("nan")
        return out["hits"], out["queries"]

    def wait_pool(self, pool: str, n: int, exclude: tuple[str, ...] = (), timeout: float = 600) -> None:
        """Until the gateway serves `pool` and its router sees n running replicas (none of `exclude`)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                st = self.status()
                ids = [r["id"] for r in st["replicas"]]
                last = st
                if (st["pool"] == pool and st["status"] == "ready" and len(ids) == n
                        and not set(ids) & set(exclude)):
                    return
            except Exception as e:  # noqa: BLE001 - the gateway is still coming up
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.5)
        raise RuntimeError(f"pool {pool} did not reach {n} replicas in {timeout:.0f} s: {last}")

    def wait_app_gone(self, app: str, timeout: float = 300) -> float:
        from ray import serve

        t0 = time.monotonic()
        while app in serve.status().applications:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{app} still there after {timeout:.0f} s")
            time.sleep(0.25)
        return time.monotonic() - t0

    def actor_of(self, replica_id: str) -> dict | None:
        from ray._private import state

        for a in state.actors(actor_state_name="ALIVE").values():
            if a.get("Name", "").endswith("#" + replica_id):
                return a
        return None

    def replica_threads(self, cpus: float) -> dict:
        """What a Ray worker given `cpus` CPUs runs with, as a replica does: Ray sets OMP_NUM_THREADS from its
        CPUs when the task starts (not in the process's initial environment), and torch reads it."""
        import ray

        @ray.remote(num_cpus=cpus)
        def probe():
            import torch

            return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads()}

        try:
            return ray.get(probe.remote(), timeout=180)
        except Exception as e:  # noqa: BLE001 - informational
            return {"error": f"{type(e).__name__}: {e}"[:300]}

    def serve_actors(self, prefix: str) -> set[str]:
        """Names of the live Serve replica actors whose name starts with SERVE_REPLICA::<prefix>."""
        from ray._private import state

        return {a["Name"] for a in state.actors(actor_state_name="ALIVE").values()
                if a.get("Name", "").startswith("SERVE_REPLICA::" + prefix)}

    def wait_actors_gone(self, app: str, timeout: float = 300) -> float:
        """Until no replica actor of `app` is alive (a deleted pool's replicas finish their streams first)."""
        t0 = time.monotonic()
        while self.serve_actors(app + "#"):
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"replicas of {app} still alive after {timeout:.0f} s")
            time.sleep(0.25)
        return time.monotonic() - t0

    def kill(self, replica_id: str) -> dict:
        """SIGKILL the replica's worker process (os.kill of its pid from Ray's actor table); ray.kill if no pid."""
        import ray

        a = self.actor_of(replica_id)
        if a is None:
            raise RuntimeError(f"no live actor for replica {replica_id}")
        pid = a.get("Pid") or 0
        if pid and os.path.exists(f"/proc/{pid}"):
            t = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            return {"replica": replica_id, "pid": pid, "method": "os.kill SIGKILL", "t": t}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"].endswith("#" + replica_id):
                t = time.perf_counter()
                ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]), no_restart=True)
                return {"replica": replica_id, "pid": None, "method": "ray.kill (no pid known)", "t": t}
        raise RuntimeError(f"no actor for replica {replica_id}")

    def shutdown(self) -> None:
        if not self.started:
            return
        import ray
        from ray import serve

        log("shutting the fleet and Ray down")
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        self.started = False


class Sampler(threading.Thread):
    """/fleet/status twice a second while a run goes on: each replica's in-flight count (the gateway
    router's) and running sequences (the replica's own stats)."""

    def __init__(self, fleet: Fleet, period: float = 0.5):
        super().__init__(daemon=True)
        self.fleet, self.period = fleet, period
        self.samples: list[tuple[float, dict]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                st = self.fleet.status()
                self.samples.append((time.perf_counter(), {r["id"]: (r.get("inflight") or 0, r.get("running") or 0)
                                                           for r in st["replicas"]}))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
            self.halt.wait(self.period)

    def stop(self) -> list[tuple[float, dict]]:
        self.halt.set()
        self.join(timeout=10)
        return self.samples

    def shares(self, replica: str) -> dict:
        """Mean and largest share of `replica` in the pool's in-flight and running counts, over the samples
        taken under load (at least half the largest total seen: not the ramp up and down)."""
        out = {"samples": len(self.samples)}
        for j, name in ((0, "inflight"), (1, "running")):
            totals = [sum(v[j] for v in s.values()) for _, s in self.samples]
            floor = max(1, max(totals, default=0) / 2)
            xs = [s[replica][j] / t for (_, s), t in zip(self.samples, totals) if replica in s and t >= floor]
            out[f"{name}_share_mean"] = statistics.mean(xs) if xs else None
            out[f"{name}_share_max"] = max(xs) if xs else None
        return out


# ---- the parts ----------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.stamp = stamp
        self.work = Path(args.work or REPO / "bench_results" / f"fleet-{stamp}").resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.fleet = Fleet(self.work)
        self.rounds = args.rounds

    def warmup(self, base_url: str, token: str, name: str) -> None:
        args = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128", "--ignore-eos",
                "--num-prompts", "4", "--max-concurrency", "4"]
        r = run_loadgen(base_url, token, args, 9000, self.work / f"warmup-{name}.json")
        log(f"warmup ({name}): {r['completed']} ok, {r['failed']} failed")

    # -- 1 --
    def overhead(self) -> dict:
        out = {"rounds": [], "single": [], "fleet": []}
        target = KvserveTarget()
        tdir = self.work / "single"
        tdir.mkdir(exist_ok=True)
        if self.fleet.started:
            raise RuntimeError("the overhead part runs first, before Ray starts (run it alone or first)")
        target.prepare(tdir)
        port = free_port()
        spec = target.server_spec("default", port, tdir)
        server = RunningServer(spec, port, tdir / "server.log")
        out["single_server"] = {"command": shell_join(spec.argv, spec.env), "config": target.config_text("default")}
        log(f"single-process server: {shell_join(spec.argv)}")
        server.start()
        try:
            log(f"single server ready in {server.startup_s:.1f} s")
            self.warmup(server.base_url, target.token, "single")
            for k in range(self.rounds):
                out["single"].append(self._w1_w2(server.base_url, target.token, "single", k))
        finally:
            server.stop()
        self.fleet.ensure(1, 2)
        out["fleet_replica_threads"] = self.fleet.replica_threads(2)
        self.warmup(self.fleet.base_url, self.fleet.token, "fleet-1x2")
        for k in range(self.rounds):
            out["fleet"].append(self._w1_w2(self.fleet.base_url, self.fleet.token, "fleet", k))
        s, f = out["single"], out["fleet"]

        def med(side, w, key):
            return median([r[w][key] for r in side])

        w1s, w1f = med(s, "W1", "output_throughput"), med(f, "W1", "output_throughput")
        t2s, t2f = med(s, "W2", "median_ttft_ms"), med(f, "W2", "median_ttft_ms")
        out["summary"] = {
            "w1_out_tok_s": {"single": w1s, "fleet": w1f, "single_range": spread([r["W1"]["output_throughput"] for r in s]),
                             "fleet_range": spread([r["W1"]["output_throughput"] for r in f]),
                             "ratio": w1f / w1s if w1s else None},
            "w1_ttft_p50_ms": {"single": med(s, "W1", "median_ttft_ms"), "fleet": med(f, "W1", "median_ttft_ms")},
            "w1_tpot_p50_ms": {"single": med(s, "W1", "median_tpot_ms"), "fleet": med(f, "W1", "median_tpot_ms")},
            "w2_ttft_p50_ms": {"single": t2s, "fleet": t2f, "single_range": spread([r["W2"]["median_ttft_ms"] for r in s]),
                               "fleet_range": spread([r["W2"]["median_ttft_ms"] for r in f]),
                               "diff": t2f - t2s if t2s is not None and t2f is not None else None},
            "w2_tpot_p50_ms": {"single": med(s, "W2", "median_tpot_ms"), "fleet": med(f, "W2", "median_tpot_ms")},
            "failed": {"single": sum(r[w]["failed"] for r in s for w in ("W1", "W2")),
                       "fleet": sum(r[w]["failed"] for r in f for w in ("W1", "W2"))},
        }
        sm = out["summary"]
        sm["met"] = {"w1_ratio": sm["w1_out_tok_s"]["ratio"] is not None and sm["w1_out_tok_s"]["ratio"] >= TARGETS["w1_ratio"],
                     "w2_ttft_diff": sm["w2_ttft_p50_ms"]["diff"] is not None
                     and sm["w2_ttft_p50_ms"]["diff"] <= TARGETS["w2_ttft_p50_diff_ms"]}
        return out

    def _w1_w2(self, base_url: str, token: str, side: str, k: int) -> dict:
        res = {}
        for name in ("W1", "W2"):
            job = JOBS[name]
            d = self.work / side / name
            d.mkdir(parents=True, exist_ok=True)
            runs = []
            for attempt in range(ATTEMPTS):  # a run other processes disturbed is made again, with a fresh seed
                r = run_loadgen(base_url, token, job.args, job.seed_base + k + 1000 * attempt,
                                d / f"run{k}{f'-again{attempt}' if attempt else ''}.json")
                runs.append(r)
                if r["foreign_cores"] < BUSY_CORES:
                    break
                log(f"overhead {side} {name} round {k}: other processes used {r['foreign_cores']:.2f} cores "
                    f"during it" + ("; running it again" if attempt + 1 < ATTEMPTS else "; keeping the least disturbed"))
            r = min(runs, key=lambda x: x["foreign_cores"])
            res[name] = dict(summary(r), discarded=[summary(x) for x in runs if x is not r])
            log(f"overhead {side} {name} round {k}: {r['completed']} ok, {r['failed']} failed; "
                f"{r['output_throughput']:.1f} out tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                f"TPOT p50 {r['median_tpot_ms']:.1f} ms")
        return res

    # -- 2 --
    def _prefix_run(self, name: str, args: list[str], seed: int, k: int) -> dict:
        runs = []
        for attempt in range(ATTEMPTS):  # a run other processes disturbed is made again, with a fresh seed (prefix)
            out = self._prefix_run_once(name, args, seed + 1000 * attempt, f"{k}{f'-again{attempt}' if attempt else ''}")
            runs.append(out)
            if out["foreign_cores"] < BUSY_CORES:
                break
            log(f"affinity {name} round {k}: other processes used {out['foreign_cores']:.2f} cores during it"
                + ("; running it again" if attempt + 1 < ATTEMPTS else "; keeping the least disturbed"))
        out = min(runs, key=lambda x: x["foreign_cores"])
        out["discarded"] = [x for x in runs if x is not out]
        return out

    def _prefix_run_once(self, name: str, args: list[str], seed: int, k: str) -> dict:
        fl = self.fleet
        time.sleep(1.5)  # the replicas' stats reach the gateway every 0.5 s
        h0, q0 = fl.prefix_counters()
        reasons0 = dict(fl.status().get("by_reason") or {})
        before = fl.replicas()
        d = self.work / "affinity" / name
        d.mkdir(parents=True, exist_ok=True)
        sampler = Sampler(fl)
        sampler.start()
        try:
            r = run_loadgen(fl.base_url, fl.token, args, seed, d / f"run{k}.json")
        finally:
            sampler.stop()
        time.sleep(2.0)
        h1, q1 = fl.prefix_counters()
        reasons1 = dict(fl.status().get("by_reason") or {})
        after = fl.replicas()
        per = {}
        for rid, a in after.items():
            b = before.get(rid, {})
            per[rid] = {"routed": (a.get("routed") or 0) - (b.get("routed") or 0),
                        "accepted": (a.get("accepted") or 0) - (b.get("accepted") or 0)}
        routed = sum(p["routed"] for p in per.values())
        accepted = sum(p["accepted"] for p in per.values())
        out = summary(r)
        out.update(hit_tokens=h1 - h0, query_tokens=q1 - q0,
                   hit_rate=(h1 - h0) / (q1 - q0) if q1 > q0 else None,
                   client_cached_share=(r["cached_prompt_tokens"] or 0) / r["total_input_tokens"]
                   if r.get("total_input_tokens") else None,
                   per_replica=per, replicas_seen=len(after),
                   routed_by_reason={k: reasons1.get(k, 0) - reasons0.get(k, 0) for k in set(reasons0) | set(reasons1)},
                   max_routed_share=max(p["routed"] for p in per.values()) / routed if routed else None,
                   max_accepted_share=max(p["accepted"] for p in per.values()) / accepted if accepted else None)
        if per and routed:
            top = max(per, key=lambda rid: per[rid]["routed"])
            out["top_replica_load"] = sampler.shares(top)
        log(f"affinity {name} round {k}: {r['completed']} ok, {r['failed']} failed; hit rate "
            f"{_pct(out['hit_rate'])} (client: cached {_pct(out['client_cached_share'])}), routed "
            f"{[p['routed'] for p in per.values()]}, accepted {[p['accepted'] for p in per.values()]}, "
            f"TTFT p50 {r['median_ttft_ms']:.0f} ms")
        return out

    def affinity(self) -> dict:
        out = {"one": [], "two": [], "sysprompt": []}
        w4 = JOBS["W4"]
        self.fleet.ensure(1, 2)
        for k in range(self.rounds):
            out["one"].append(self._prefix_run("W4-1replica", w4.args, w4.seed_base + 60 + k, k))
        self.fleet.ensure(2, 1)
        for k in range(self.rounds):
            out["two"].append(self._prefix_run("W4-2replicas", w4.args, w4.seed_base + k, k))
            out["sysprompt"].append(self._prefix_run("sysprompt-2replicas", SYSPROMPT_ARGS, 480 + k, k))
        one = median([r["hit_rate"] for r in out["one"]])
        two = median([r["hit_rate"] for r in out["two"]])
        share = median([r["max_routed_share"] for r in out["sysprompt"]])
        out["summary"] = {
            "w4_hit_rate": {"one": one, "two": two, "one_range": spread([r["hit_rate"] for r in out["one"]]),
                            "two_range": spread([r["hit_rate"] for r in out["two"]]),
                            "ratio": two / one if one else None},
            "w4_client_cached_share": {"one": median([r["client_cached_share"] for r in out["one"]]),
                                       "two": median([r["client_cached_share"] for r in out["two"]])},
            "w4_ttft_p50_ms": {"one": median([r["median_ttft_ms"] for r in out["one"]]),
                               "two": median([r["median_ttft_ms"] for r in out["two"]])},
            "w4_max_routed_share_two": median([r["max_routed_share"] for r in out["two"]]),
            "sysprompt_max_routed_share": share,
            "sysprompt_max_routed_share_range": spread([r["max_routed_share"] for r in out["sysprompt"]]),
            "sysprompt_max_accepted_share": median([r["max_accepted_share"] for r in out["sysprompt"]]),
            "sysprompt_top_inflight_share_mean": median([(r.get("top_replica_load") or {}).get("inflight_share_mean")
                                                         for r in out["sysprompt"]]),
            "sysprompt_top_inflight_share_max": max([(r.get("top_replica_load") or {}).get("inflight_share_max") or 0
                                                     for r in out["sysprompt"]], default=None),
            "sysprompt_top_running_share_mean": median([(r.get("top_replica_load") or {}).get("running_share_mean")
                                                        for r in out["sysprompt"]]),
            "sysprompt_hit_rate": median([r["hit_rate"] for r in out["sysprompt"]]),
            "failed": sum(r["failed"] for side in ("one", "two", "sysprompt") for r in out[side]),
        }
        sm = out["summary"]
        sm["met"] = {"hit_rate_ratio": sm["w4_hit_rate"]["ratio"] is not None
                     and sm["w4_hit_rate"]["ratio"] >= TARGETS["hit_rate_ratio"],
                     "max_share": share is not None and share <= TARGETS["max_share"]}
        return out

    # -- 3 --
    def failover(self) -> dict:
        from kvserve.bench.datasets import PromptSource, load_tokenizer

        fl = self.fleet
        fl.ensure(2, 1)
        tok = load_tokenizer(MODEL)
        out = {"shape": FAILOVER_SHAPE, "rounds": []}
        for k in range(self.rounds):
            src = PromptSource(tok, "random", input_len=FAILOVER_SHAPE["input"], output_len=FAILOVER_SHAPE["output"],
                               seed=700 + k)
            prompts = [src.prompt(i).prompt for i in range(FAILOVER_SHAPE["streams"])]
            m = METER.start(f"failover-{k}-undisturbed")
            r0 = fl.routing()
            clean = asyncio.run(stream_all(fl, prompts, FAILOVER_SHAPE["output"]))
            METER.stop(m)
            routing = {"undisturbed": fl.routing_delta(r0, fl.routing())}
            clean_s = max(r["end"] for r in clean) - min(r["start"] for r in clean)
            log(f"failover round {k}: undisturbed run {clean_s:.1f} s, {sum(not r['ok'] for r in clean)} failed")
            m = METER.start(f"failover-{k}-control")
            r0 = fl.routing()
            control = asyncio.run(stream_all(fl, prompts, FAILOVER_SHAPE["output"]))
            METER.stop(m)
            routing["control"] = fl.routing_delta(r0, fl.routing())
            mig0 = dict(fl.status().get("migrations", {}))
            kill_after = FAILOVER_SHAPE["kill_at"] * clean_s
            m = METER.start(f"failover-{k}-killed")
            sampler = Sampler(fl)
            sampler.start()
            try:
                hurt = asyncio.run(stream_all(fl, prompts, FAILOVER_SHAPE["output"], kill_after=kill_after))
            finally:
                samples = sampler.stop()
                METER.stop(m)
            if not KILLS:
                raise RuntimeError("the replica was not killed")
            kill = KILLS.pop()
            mig1 = dict(fl.status().get("migrations", {}))
            fl.wait_pool(fl.pool, 2, exclude=(kill["replica"],))
            back = next((t for t, reps in samples if t > kill["t"] and len(reps) == 2 and kill["replica"] not in reps),
                        time.perf_counter())
            d = self.work / "failover"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"round{k}.json").write_text(json.dumps({"prompts": prompts, "undisturbed": clean, "control": control,
                                                          "killed": hurt, "kill": kill}, default=str))
            rnd = failover_figures(clean, control, hurt, kill, mig0, mig1)
            rnd.update(undisturbed_s=clean_s, kill_after_s=kill_after, replacement_wait_s=back - kill["t"], routing=routing,
                       kill={k2: v for k2, v in kill.items() if k2 != "t"})
            out["rounds"].append(rnd)
            log(f"failover round {k}: killed {kill['replica']} ({kill['method']}, pid {kill['pid']}) at "
                f"{kill_after:.1f} s with {kill['inflight']} in flight there; failed {rnd['failed']}, identical "
                f"{_pct(rnd['identical'])} (control {_pct(rnd['control_identical'])}), migrated "
                f"{rnd['migrated_server']}, stall p50 {_ms(rnd['migrated_gap_p50_ms'])}, extra TPOT "
                f"{_ms(rnd['migrated_extra_tpot_p50_ms'])}; replacement replica serving {rnd['replacement_wait_s']:.0f} s "
                f"after the kill")
        rs = out["rounds"]
        out["summary"] = {
            "failed": sum(r["failed"] for r in rs),
            "identical": median([r["identical"] for r in rs]), "identical_range": spread([r["identical"] for r in rs]),
            "control_identical": median([r["control_identical"] for r in rs]),
            "identical_vs_control_run": median([r["identical_vs_control"] for r in rs]),
            "inflight_on_killed": median([r["kill"]["inflight"] for r in rs]),
            "migrated_server": median([r["migrated_server"] for r in rs]),
            "migrated_gap_p50_ms": median([r["migrated_gap_p50_ms"] for r in rs]),
            "migrated_gap_max_ms": max([r["migrated_gap_max_ms"] for r in rs if r["migrated_gap_max_ms"] is not None],
                                       default=None),
            "undisturbed_itl_p50_ms": median([r["undisturbed_itl_p50_ms"] for r in rs]),
            "migrated_extra_tpot_p50_ms": median([r["migrated_extra_tpot_p50_ms"] for r in rs]),
            "migrated_extra_e2e_p50_ms": median([r["migrated_extra_e2e_p50_ms"] for r in rs]),
            "late_first_token": sum(r["late_first_token"] for r in rs),
            "late_extra_ttft_p50_ms": median([r["late_extra_ttft_p50_ms"] for r in rs]),
            "replacement_wait_s": median([r["replacement_wait_s"] for r in rs]),
            "migrated_identical": sum(r["migrated_identical"] for r in rs),
            "migrated_total": sum(len(r["migrated_streams"]) for r in rs),
            "mismatches_also_in_control": sum(len(set(r["mismatched"]) & set(r["control_mismatched"])) for r in rs),
            "mismatches": sum(len(r["mismatched"]) for r in rs),
        }
        sm = out["summary"]
        sm["met"] = {"failed": sm["failed"] == 0,
                     "identical": min(r["identical"] for r in rs) >= TARGETS["identical"] if rs else False}
        return out

    # -- 4 --
    def update(self) -> dict:
        fl = self.fleet
        fl.ensure(2, 1)
        job = JOBS["W3-flood"]
        dur = self.args.update_duration
        args = with_duration(job.args, dur)
        out = {"duration_s": dur, "apply_at_s": UPDATE_APPLY_AT_S, "rounds": []}
        for k in range(self.rounds):
            d = self.work / "update"
            d.mkdir(parents=True, exist_ok=True)
            res_path = d / f"run{k}.json"
            argv = loadgen_argv(fl.base_url, args, job.seed_base + k, res_path) + ["--save-detailed"]
            old_pool, old_version = fl.pool, fl.version
            fl.version_n += 1
            text = fl.text(2, 1)
            new_pool = fl.pool_of(text)
            m = METER.start(f"update-{k}")
            with open(d / f"run{k}.log", "w") as f:
                proc = subprocess.Popen(argv, env={**os.environ, "KVSERVE_API_KEY": fl.token}, stdout=f,
                                        stderr=subprocess.STDOUT, cwd=str(REPO))
            try:
                time.sleep(UPDATE_APPLY_AT_S + 3.0)  # the client loads its tokenizer and prompts first (~3 s)
                log(f"update round {k}: applying version {fl.version} under load ({old_pool} -> {new_pool})")
                gateways0 = fl.serve_actors(f"{GATEWAY_PREFIX}")
                t0 = time.perf_counter()
                changes = fl.apply(text)
                t1 = time.perf_counter()
                fl.pool = new_pool
                fl.wait_app_gone(old_pool)
                fl.wait_actors_gone(old_pool)
                t2 = time.perf_counter()
                gateways1 = fl.serve_actors(f"{GATEWAY_PREFIX}")
                log(f"update round {k}: apply returned after {t1 - t0:.1f} s, the old pool's replicas gone "
                    f"{t2 - t1:.1f} s later")
                rc = proc.wait(timeout=dur + 600)
            except BaseException:
                proc.kill()
                raise
            METER.stop(m)
            r = json.loads(res_path.read_text())
            st = fl.status()
            rnd = update_figures(r, t0, t2)
            rnd.update(apply_s=t1 - t0, drain_s=t2 - t1, changes=changes, client_exit=rc,
                       gateway_replaced=gateways0 != gateways1, gateways_before=sorted(gateways0),
                       gateways_after=sorted(gateways1),
                       version_after=st.get("version"), expected_version=fl.version, from_version=old_version,
                       replica_versions=sorted({str(x.get("version")) for x in st["replicas"]}))
            out["rounds"].append(rnd)
            log(f"update round {k}: failed {rnd['failed']} {rnd['error_counts'] or ''}; interactive TTFT p99 during "
                f"the update {_ms(rnd['interactive_ttft_p99_during_ms'])} ({rnd['interactive_during']} requests), "
                f"before {_ms(rnd['interactive_ttft_p99_before_ms'])}; load covered the update: {rnd['covered']}")
            fl.wait_pool(fl.pool, 2)
        rs = out["rounds"]
        pooled = [t for r in rs for t in r["interactive_ttfts_during_ms"]]
        out["summary"] = {
            "failed": sum(r["failed"] for r in rs),
            "interactive_ttft_p99_during_ms": median([r["interactive_ttft_p99_during_ms"] for r in rs]),
            "interactive_ttft_p99_during_range": spread([r["interactive_ttft_p99_during_ms"] for r in rs]),
            "interactive_ttft_p99_during_pooled_ms": percentile(pooled, 99),
            "interactive_ttft_p50_during_ms": median([r["interactive_ttft_p50_during_ms"] for r in rs]),
            "interactive_ttft_p99_before_ms": median([r["interactive_ttft_p99_before_ms"] for r in rs]),
            "interactive_ttft_p50_before_ms": median([r["interactive_ttft_p50_before_ms"] for r in rs]),
            "interactive_during": sum(r["interactive_during"] for r in rs),
            "apply_s": median([r["apply_s"] for r in rs]), "drain_s": median([r["drain_s"] for r in rs]),
            "all_covered": all(r["covered"] for r in rs),
            "versions_switched": all(r["version_after"] == r["expected_version"] for r in rs),
        }
        out["summary"]["met"] = {"failed": out["summary"]["failed"] == 0}
        return out

    # -- all --
    def run(self, parts: list[str]) -> dict:
        results = {}
        t_all = time.monotonic()
        try:
            for part in PARTS:
                if part not in parts:
                    continue
                t0 = time.monotonic()
                mark = len(METER.log)
                log(f"== {part} ==")
                try:
                    results[part] = getattr(self, part)()
                except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
                    log(f"{part} FAILED: {type(e).__name__}: {e}")
                    results[part] = {"error": f"{type(e).__name__}: {e}"[:3000]}
                results[part]["other_processes"] = foreign_summary(METER.log[mark:])
                results[part]["other_processes_per_run"] = METER.log[mark:]
                results[part]["seconds"] = round(time.monotonic() - t0, 1)
                results[part]["rounds_run"] = self.rounds
                results[part]["measured"] = self.stamp
                log(f"{part} took {time.monotonic() - t0:.0f} s")
        finally:
            self.fleet.shutdown()
        log(f"all parts took {time.monotonic() - t_all:.0f} s")
        return results


# ---- the failover client ------------------------------------------------------------------------

KILLS: list[dict] = []


async def _stream_one(client, url: str, headers: dict, body: dict, rec: dict) -> None:
    rec["start"] = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = (await resp.aread()).decode("utf-8", "replace")[:300]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if not data or data == "[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("error"):
                    rec["error"] = json.dumps(obj["error"])[:300]
                    continue
                for c in obj.get("choices") or []:
                    text = c.get("text") or ""
                    if text:
                        rec["times"].append(time.perf_counter())
                        rec["text"].append(text)
                    if c.get("finish_reason"):
                        rec["finish"] = c["finish_reason"]
                if obj.get("usage"):
                    rec["tokens"] = obj["usage"].get("completion_tokens")
    except Exception as e:  # noqa: BLE001 - a transport failure is a failed request
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        rec["end"] = time.perf_counter()


async def stream_all(fleet: Fleet, prompts: list[str], max_tokens: int, kill_after: float | None = None) -> list[dict]:
    """Every prompt as one streamed greedy completion, all at once; with kill_after, the replica with the
    most streams in flight is SIGKILLed that many seconds after the start (KILLS gets what was done)."""
    import httpx

    url = fleet.base_url + "/v1/completions"
    headers = {"Authorization": f"Bearer {fleet.token}"}
    recs = [{"i": i, "times": [], "text": [], "finish": None, "tokens": None, "error": "", "status": None}
            for i in range(len(prompts))]

    async def killer():
        await asyncio.sleep(kill_after)

        def do():
            reps = fleet.replicas()
            busy = max(reps.values(), key=lambda r: (r.get("inflight") or 0, r.get("running") or 0))
            k = fleet.kill(busy["id"])
            k["inflight"] = busy.get("inflight")
            k["inflight_by_replica"] = {rid: r.get("inflight") for rid, r in reps.items()}
            return k

        KILLS.append(await asyncio.to_thread(do))

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=60.0), trust_env=False) as client:
        tasks = [_stream_one(client, url, headers, {"model": MODEL, "prompt": p, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True, "stream": True,
                                                    "stream_options": {"include_usage": True}}, rec)
                 for p, rec in zip(prompts, recs)]
        if kill_after is not None:
            tasks.append(killer())
        await asyncio.gather(*tasks)
    for r in recs:
        r["text"] = "".join(r["text"])
        r["ok"] = (not r["error"] and r["status"] == 200 and r["finish"] == "length"
                   and (r["tokens"] is None or r["tokens"] == max_tokens))
    return recs


def _tpot(r: dict) -> float | None:
    n = r["tokens"] or len(r["times"])
    return (r["times"][-1] - r["times"][0]) / (n - 1) if len(r["times"]) > 1 and n > 1 else None


def failover_figures(clean: list[dict], control: list[dict], hurt: list[dict], kill: dict, mig0: dict,
                     mig1: dict) -> dict:
    t_kill = kill["t"]
    n = len(clean)
    migrated = (mig1.get("migrated", 0) - mig0.get("migrated", 0))
    outcomes = {key: mig1.get(key, 0) - mig0.get(key, 0) for key in set(mig0) | set(mig1)}
    # the gap across the kill of each stream that was running then (first token before, last after)
    spans = []
    for r in hurt:
        ts = r["times"]
        if ts and ts[0] < t_kill < ts[-1]:
            j = next(i for i, t in enumerate(ts) if t >= t_kill)
            spans.append((ts[j] - ts[j - 1], r["i"]))
    spans.sort(reverse=True)
    moved = spans[:migrated] if migrated > 0 else []
    gaps = [g * 1000 for g, _ in moved]
    extra_tpot, extra_e2e = [], []
    for _, i in moved:
        a, b = _tpot(hurt[i]), _tpot(clean[i])
        if a is not None and b is not None:
            extra_tpot.append((a - b) * 1000)
        extra_e2e.append(((hurt[i]["end"] - hurt[i]["start"]) - (clean[i]["end"] - clean[i]["start"])) * 1000)
    late = [r["i"] for r in hurt if r["times"] and r["times"][0] >= t_kill]
    extra_ttft = [((hurt[i]["times"][0] - hurt[i]["start"]) - (clean[i]["times"][0] - clean[i]["start"])) * 1000
                  for i in late if clean[i]["times"]]
    itl = [(b - a) * 1000 for r in clean for a, b in zip(r["times"], r["times"][1:])]
    mismatched = [h["i"] for h, c in zip(hurt, clean) if h["text"] != c["text"]]
    return {
        "mismatched": mismatched,
        "control_mismatched": [a["i"] for a, c in zip(control, clean) if a["text"] != c["text"]],
        "migrated_streams": [i for _, i in moved],
        "migrated_identical": sum(hurt[i]["text"] == clean[i]["text"] for _, i in moved),
        "failed": sum(not r["ok"] for r in hurt),
        "errors": [r["error"] or f"finish {r['finish']}, {r['tokens']} tokens" for r in hurt if not r["ok"]][:5],
        "control_failed": sum(not r["ok"] for r in control) + sum(not r["ok"] for r in clean),
        "identical": sum(h["text"] == c["text"] for h, c in zip(hurt, clean)) / n,
        "identical_vs_control": sum(h["text"] == c["text"] for h, c in zip(hurt, control)) / n,
        "control_identical": sum(a["text"] == c["text"] for a, c in zip(control, clean)) / n,
        "running_at_kill": len(spans), "migrated_server": migrated, "migration_outcomes": outcomes,
        "migrated_gap_p50_ms": median(gaps), "migrated_gap_max_ms": max(gaps) if gaps else None,
        "other_gap_p50_ms": median([g * 1000 for g, _ in spans[migrated:]]) if migrated >= 0 else None,
        "undisturbed_itl_p50_ms": median(itl),
        "migrated_extra_tpot_p50_ms": median(extra_tpot), "migrated_extra_e2e_p50_ms": median(extra_e2e),
        "undisturbed_tpot_p50_ms": median([(_tpot(r) or 0) * 1000 for r in clean]),
        "late_first_token": len(late), "late_extra_ttft_p50_ms": median(extra_ttft),
    }


def update_figures(r: dict, t0: float, t2: float) -> dict:
    """The load generator's result cut at the update window [t0, t2] (perf_counter: one clock on this host)."""
    base = r["start_monotonic_s"]
    during, before, after = [], [], []
    for tier, start, ttft, err in zip(r["tier_of"], r["start_times"], r["ttfts"], r["errors"]):
        if tier != "interactive" or err:
            continue
        at = base + start
        (before if at < t0 else during if at <= t2 else after).append(ttft * 1000)
    end = base + r["duration"]
    failures = []
    for req in r.get("requests") or []:
        if not req.get("success") and not req.get("cancelled"):
            failures.append({"tier": req.get("tier"), "kind": req.get("error_kind"),
                             "at_s_after_apply": round(base + req["start"] - t0, 2), "error": req.get("error", "")[:300]})
    return {
        "failures": failures[:40],
        "failed": r["failed"], "error_counts": r["error_counts"], "cancelled": r["cancelled"],
        "completed": r["completed"],
        "tiers": {name: {k: m.get(k) for k in ("completed", "failed", "cancelled", "median_ttft_ms", "p99_ttft_ms",
                                               "streamed_output_throughput")} for name, m in r["tiers"].items()},
        "interactive_during": len(during), "interactive_ttfts_during_ms": [round(x, 1) for x in during],
        "interactive_ttft_p99_during_ms": percentile(during, 99),
        "interactive_ttft_p50_during_ms": percentile(during, 50),
        "interactive_ttft_p99_before_ms": percentile(before, 99),
        "interactive_ttft_p50_before_ms": percentile(before, 50),
        "interactive_ttft_p99_after_ms": percentile(after, 99),
        "window_s": t2 - t0, "apply_started_at_s": t0 - base, "covered": end >= t2,
    }


# ---- the report ---------------------------------------------------------------------------------

def headline(part: str, d: dict) -> dict:
    """The target figures of one measured part (what the history of earlier runs keeps)."""
    s = d.get("summary") or {}
    if not s:
        return {}
    if part == "overhead":
        return {"w1_ratio": s["w1_out_tok_s"]["ratio"], "w2_ttft_p50_diff_ms": s["w2_ttft_p50_ms"]["diff"]}
    if part == "affinity":
        return {"hit_rate_ratio": s["w4_hit_rate"]["ratio"], "sysprompt_max_share": s["sysprompt_max_routed_share"],
                "sysprompt_max_share_range": s.get("sysprompt_max_routed_share_range")}
    if part == "failover":
        return {"failed": s["failed"], "identical": s["identical"], "identical_range": s.get("identical_range"),
                "control_identical": s.get("control_identical")}
    if part == "update":
        return {"failed": s["failed"], "interactive_ttft_p99_during_ms": s["interactive_ttft_p99_during_ms"]}
    return {}


def remember(data: dict, part: str) -> None:
    """Keep the part's current result in data["history"] before a new run replaces it."""
    old = data.get(part)
    if old and old.get("summary"):
        data.setdefault("history", {}).setdefault(part, []).append(
            {"measured": old.get("measured"), "rounds": old.get("rounds_run"), "code": old.get("code_at_start"),
             **headline(part, old)})


def _history_line(part: str, h: dict) -> str:
    if part == "overhead":
        return f"W1 ratio {_n(h.get('w1_ratio'), '{:.2f}x')}, W2 TTFT p50 {_n(h.get('w2_ttft_p50_diff_ms'), '{:+.0f} ms')}"
    if part == "affinity":
        r = h.get("sysprompt_max_share_range")
        return (f"hit-rate ratio {_n(h.get('hit_rate_ratio'), '{:.2f}x')}, largest share {_pct(h.get('sysprompt_max_share'))}"
                + (f" [{r[0] * 100:.1f}-{r[1] * 100:.1f}%]" if r else ""))
    if part == "failover":
        r = h.get("identical_range")
        return (f"failed {h.get('failed')}, identical {_pct(h.get('identical'))}"
                + (f" [{r[0] * 100:.1f}-{r[1] * 100:.1f}%]" if r else "")
                + f" (control {_pct(h.get('control_identical'))})")
    if part == "update":
        return f"failed {h.get('failed')}, interactive TTFT p99 in the window {_ms(h.get('interactive_ttft_p99_during_ms'))}"
    return ""

def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def _n(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _rng(r, fmt="{:.1f}") -> str:
    return "" if not r else f" [{fmt.format(r[0])}-{fmt.format(r[1])}]"


def _met(ok) -> str:
    return "met" if ok else "**missed**"


def render(data: dict) -> str:
    m = data.get("machine", {})
    lines = ["# Fleet benchmarks", "",
             "Generated by `python -m benchmarks.fleet` (benchmarks/fleet.py; its docstring says how each part is "
             "measured). Do not edit by hand: rerun it, under the Ray lock where other Ray users share the box: "
             "`flock /tmp/ray.lock .venv/bin/python -m benchmarks.fleet`.", "",
             f"- Last run {data.get('finished', '?')}, commit `{(data.get('git') or {}).get('commit', '?')[:12]}`"
             f"{' (working tree dirty)' if (data.get('git') or {}).get('dirty') else ''}; command "
             f"`{data.get('command', '?')}`.",
             f"- CPU: {m.get('lscpu_model_name') or m.get('cpu_model', '?')}, {m.get('nproc', '?')} cores visible, "
             f"{m.get('mem_gib', '?')} GiB RAM; AVX-512: {'yes (' + ', '.join(m.get('avx512_flags', [])) + ')' if m.get('avx512') else 'no'}; "
             f"AMX: {'yes (' + ', '.join(m.get('amx_flags', [])) + ')' if m.get('amx') else 'no'}. "
             f"torch {m.get('torch', '?')}, Ray {m.get('ray', '?')}, Python {m.get('python', '?')}. "
             f"Load average at the start: {' '.join(m.get('loadavg', []))}.",
             f"- Ray: a local instance in the benchmark process with {RAY_NUM_CPUS} logical CPUs on the "
             f"{m.get('nproc', '?')} cores (so a rolling update's second pool can be placed); gateway_cpus = 0; "
             "each replica's `cpus` becomes its OMP_NUM_THREADS (Ray). Everything (client, Ray, gateway, "
             "replicas) shares the same cores.",
             "- Medians over the rounds, [min-max] over the rounds. Latencies in ms.",
             "- Other processes: the box is shared, so before each measured run the benchmark waits (up to 5 min) "
             "until processes outside its own tree use under 0.15 cores, and records what they used during the "
             "run (/proc/stat busy time less the benchmark's tree). An overhead or affinity run during which they "
             "used 0.2 cores or more is made again with a fresh seed, up to 3 times, and the least disturbed kept "
             "(the others are in fleet.json as discarded); failover and update runs are only flagged:"]
    for part in PARTS:
        op = data.get(part, {}).get("other_processes")
        if op and op.get("runs"):
            busy = op.get("busy_runs") or []
            lines.append(f"  {part}: {op['runs']} runs, other processes used {op['mean_cores']:.2f} cores on average, "
                         f"{op['max_cores']:.2f} at most; {op['waited_s']:.0f} s spent waiting for quiet"
                         + (f"; runs with >= 0.2 cores of others: {', '.join(busy)}" if busy else "") + ".")
    lines.append("")
    lines += ["## Targets", "", "| part | measure | result | target | status |", "|---|---|---|---|---|"]
    o = data.get("overhead", {})
    if "summary" in o:
        s = o["summary"]
        w1, w2 = s["w1_out_tok_s"], s["w2_ttft_p50_ms"]
        lines.append(f"| overhead (rounds: {o['rounds_run']}) | W1 output tok/s, fleet (1 replica) / single process | "
                     f"{_n(w1['fleet'])} / {_n(w1['single'])} = **{_n(w1['ratio'], '{:.2f}')}x** | >= 0.90x | "
                     f"{_met(s['met']['w1_ratio'])} |")
        lines.append(f"| overhead | W2 TTFT p50, fleet - single process | {_n(w2['fleet'], '{:.0f}')} - "
                     f"{_n(w2['single'], '{:.0f}')} = **{_n(w2['diff'], '{:+.1f}')} ms** | <= +10 ms | "
                     f"{_met(s['met']['w2_ttft_diff'])} |")
    a = data.get("affinity", {})
    if "summary" in a:
        s = a["summary"]
        h = s["w4_hit_rate"]
        lines.append(f"| affinity (rounds: {a['rounds_run']}) | W4 prefix-cache hit rate, 2 replicas / 1 replica | "
                     f"{_pct(h['two'])} / {_pct(h['one'])} = **{_n(h['ratio'], '{:.2f}')}x** | >= 0.90x | "
                     f"{_met(s['met']['hit_rate_ratio'])} |")
        lines.append(f"| affinity | one shared 512-token prefix, 2 replicas: largest share of requests on one replica "
                     f"(routed) | **{_pct(s['sysprompt_max_routed_share'])}**"
                     f"{_rng([x * 100 for x in s['sysprompt_max_routed_share_range']] if s['sysprompt_max_routed_share_range'] else None, '{:.1f}')} "
                     f"| <= 65% | {_met(s['met']['max_share'])} |")
    f = data.get("failover", {})
    if "summary" in f:
        s = f["summary"]
        lines.append(f"| failover (rounds: {f['rounds_run']}) | failed requests, one replica SIGKILLed under 32 streams | "
                     f"**{s['failed']}** (all rounds) | 0 | {_met(s['met']['failed'])} |")
        lines.append(f"| failover | greedy outputs identical to an undisturbed run | **{_pct(s['identical'])}** "
                     f"(lowest round {_pct((s['identical_range'] or [None])[0])}; two undisturbed runs agree "
                     f"{_pct(s['control_identical'])}) | >= 95% (every round) | {_met(s['met']['identical'])} |")
    u = data.get("update", {})
    if "summary" in u:
        s = u["summary"]
        lines.append(f"| update (rounds: {u['rounds_run']}) | failed requests, rolling update under W3's mix | "
                     f"**{s['failed']}** (all rounds) | 0 | {_met(s['met']['failed'])} |")
        lines.append(f"| update | interactive TTFT p99 while the update ran | "
                     f"**{_ms(s['interactive_ttft_p99_during_ms'])}**"
                     f"{_rng(s['interactive_ttft_p99_during_range'], '{:.0f}')} (before it, same runs: "
                     f"{_ms(s['interactive_ttft_p99_before_ms'])}) | reported | - |")
    changed = [p for p in PARTS if p in data and data[p].get("code_at_start") != data[p].get("code_at_end")]
    if changed:
        files = sorted({f for p in changed for f in data[p].get("code_changed_files", [])})
        lines[lines.index("## Targets")] = (
            f"**Warning: the product code changed during the run that measured {', '.join(changed)}** "
            f"({', '.join(files) or 'kvserve/'}): processes started after the change (Ray workers, clients) ran "
            "the new code, the benchmark process the code it had imported.\n\n## Targets")
    for part in PARTS:
        if "error" in data.get(part, {}):
            lines.append(f"| {part} | could not be measured | {data[part]['error'][:300]} | - | - |")
    lines.append("")
    hist = data.get("history") or {}
    if any(hist.get(p) for p in PARTS):
        lines += ["Earlier runs of the same parts (replaced by the ones above; kept so that a lucky run does not hide "
                  "an unlucky one):", ""]
        for part in PARTS:
            for h in hist.get(part, []):
                lines.append(f"- {part}, {h.get('measured')} ({h.get('rounds')} rounds): {_history_line(part, h)}"
                             + (f"; {h['note']}" if h.get("note") else ""))
        lines.append("")

    if "summary" in o:
        s = o["summary"]
        lines += ["## 1. Overhead: single process against the fleet with one replica", "",
                  f"Measured {o.get('measured')}, {o['rounds_run']} rounds, {o['seconds']:.0f} s. Single process: "
                  f"`kvserve serve` with the suite's config (smollm2-135m only, engine defaults), rounds run before Ray "
                  f"started. Fleet: replicas = 1, cpus = 2 (a Ray worker with 2 CPUs runs with OMP_NUM_THREADS "
                  f"{(o.get('fleet_replica_threads') or {}).get('OMP_NUM_THREADS', '?')}, torch threads "
                  f"{(o.get('fleet_replica_threads') or {}).get('torch_threads', '?')}), client -> Serve "
                  "HTTP proxy -> gateway -> replica. Same client, same seeds.", "",
                  "| measure | single process | fleet, 1 replica | fleet / single |", "|---|---|---|---|"]

        def row(name, d, fmt="{:.1f}", ratio=True):
            r = d["fleet"] / d["single"] if ratio and d.get("single") and d.get("fleet") is not None else None
            lines.append(f"| {name} | {_n(d['single'], fmt)}{_rng(d.get('single_range'), fmt)} | "
                         f"{_n(d['fleet'], fmt)}{_rng(d.get('fleet_range'), fmt)} | {_n(r, '{:.2f}x')} |")

        row("W1 output tok/s", s["w1_out_tok_s"])
        row("W1 TTFT p50", s["w1_ttft_p50_ms"], "{:.0f}")
        row("W1 TPOT p50", s["w1_tpot_p50_ms"])
        row("W2 TTFT p50", s["w2_ttft_p50_ms"], "{:.0f}")
        row("W2 TPOT p50", s["w2_tpot_p50_ms"])
        lines.append(f"| failed requests (all rounds) | {s['failed']['single']} | {s['failed']['fleet']} | - |")
        lines += ["", "W1: 64 requests, 256 prompt / 128 output tokens (ignore_eos), 32 in flight. W2: 8 such "
                  "requests one at a time.", ""]
    if "summary" in a:
        s = a["summary"]
        lines += ["## 2. Prefix affinity", "",
                  f"Measured {a.get('measured')}, {a['rounds_run']} rounds, {a['seconds']:.0f} s. Hit rate: the "
                  "replicas' prefix_hit_tokens / prefix_query_tokens, deltas over each run, summed over the pool "
                  "(the gateway's /metrics); the client's figure is the server-reported cached prompt tokens / prompt "
                  "tokens. One replica: cpus = 2; two: cpus = 1 each. Seeds differ between the sides (each run its own "
                  "prefix, none cached by an earlier run).", "",
                  "| measure | 1 replica | 2 replicas |", "|---|---|---|",
                  f"| W4 hit rate (replica counters) | {_pct(s['w4_hit_rate']['one'])} | {_pct(s['w4_hit_rate']['two'])} |",
                  f"| W4 cached share (client usage) | {_pct(s['w4_client_cached_share']['one'])} | "
                  f"{_pct(s['w4_client_cached_share']['two'])} |",
                  f"| W4 TTFT p50 | {_ms(s['w4_ttft_p50_ms']['one'])} | {_ms(s['w4_ttft_p50_ms']['two'])} |",
                  f"| W4 largest routed share | 100% | {_pct(s['w4_max_routed_share_two'])} |", "",
                  "W4: 32 requests sharing a 512-token prefix, 64 own tokens, 64 output, 4 in flight.", "",
                  f"One shared 512-token prefix, 32 requests (64 own tokens, 64 output), 16 in flight, two replicas: "
                  f"largest share routed to one replica {_pct(s['sysprompt_max_routed_share'])} (accepted by one "
                  f"replica: {_pct(s['sysprompt_max_accepted_share'])}), hit rate {_pct(s['sysprompt_hit_rate'])}. "
                  f"While it ran (/fleet/status sampled twice a second), the replica that took the most held on "
                  f"average {_pct(s.get('sysprompt_top_inflight_share_mean'))} of the requests in flight (the "
                  f"router's count, samples with at least half the peak in flight; at most "
                  f"{_pct(s.get('sysprompt_top_inflight_share_max'))} in one) and "
                  f"{_pct(s.get('sysprompt_top_running_share_mean'))} of the running sequences (the replicas' "
                  "stats). Per round:", "",
                  "| round | routed per replica | accepted per replica | hit rate | top replica: mean in-flight share "
                  "| mean running share | routing decisions by reason |", "|---|---|---|---|---|---|---|"]
        for k, r in enumerate(a["sysprompt"]):
            load = r.get("top_replica_load") or {}
            lines.append(f"| {k} | {', '.join(str(p['routed']) for p in r['per_replica'].values())} | "
                         f"{', '.join(str(p['accepted']) for p in r['per_replica'].values())} | {_pct(r['hit_rate'])} | "
                         f"{_pct(load.get('inflight_share_mean'))} | {_pct(load.get('running_share_mean'))} | "
                         f"{', '.join(f'{k} {v}' for k, v in sorted((r.get('routed_by_reason') or {}).items()) if v) or '-'} |")
        lines.append("")
    if "summary" in f:
        s = f["summary"]
        lines += ["## 3. Failover", "",
                  f"Measured {f.get('measured')}, {f['rounds_run']} rounds, {f['seconds']:.0f} s. Two replicas (cpus = "
                  "1). 32 greedy completions (256 / 128 tokens, ignore_eos) sent at once; the same requests "
                  "undisturbed, again undisturbed (control), then with the replica holding the most streams "
                  "SIGKILLed at 35% of the undisturbed run's duration. Migrated streams: the N with the longest gap "
                  "between two chunks across the kill, N = the gateway's migration count.", "",
                  "| round | killed (how) | streams on it | failed | identical to undisturbed | control: two clean runs "
                  "agree | migrated | gap across the kill, migrated p50 / max | other streams' gap p50 | "
                  "undisturbed ITL p50 | migrated extra TPOT p50 | migrated extra e2e p50 | replica back after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, r in enumerate(f["rounds"]):
            lines.append(f"| {k} | {r['kill']['replica']} ({r['kill']['method']}) | {r['kill']['inflight']} | "
                         f"{r['failed']} | {_pct(r['identical'])} | {_pct(r['control_identical'])} | "
                         f"{r['migrated_server']} | {_ms(r['migrated_gap_p50_ms'])} / {_ms(r['migrated_gap_max_ms'])} | "
                         f"{_ms(r['other_gap_p50_ms'])} | {_n(r['undisturbed_itl_p50_ms'])} ms | "
                         f"{_n(r['migrated_extra_tpot_p50_ms'], '{:+.1f}')} ms | "
                         f"{_n(r['migrated_extra_e2e_p50_ms'], '{:+.0f}')} ms | {r['replacement_wait_s']:.0f} s |")
        routing = [(k, r["routing"]) for k, r in enumerate(f["rounds"]) if r.get("routing")]
        if routing:
            lines += ["", "How the gateway spread the 32 streams over the two replicas (routed counts and the router's "
                      "reasons, per run):", ""]
            for k, rt in routing:
                parts = []
                for run, d in rt.items():
                    parts.append(f"{run}: {sorted(d['routed'].values(), reverse=True)} by "
                                 + (", ".join(f"{a} {b}" for a, b in sorted(d["by_reason"].items())) or "-"))
                lines.append(f"- round {k}: " + "; ".join(parts))
        lines += ["", f"Migrated streams whose output was identical to the undisturbed run's: {s['migrated_identical']} of "
                  f"{s['migrated_total']}. Of the {s['mismatches']} outputs that differed from the undisturbed run (all "
                  f"rounds), {s['mismatches_also_in_control']} also differed in the control run (no kill): greedy "
                  "decoding's ties and near-ties resolve differently with another batch composition or a cached "
                  "prefix, kill or not.", "",
                  f"Requests whose first token came after the kill (extra TTFT measurable): "
                  f"{s['late_first_token']} in all rounds"
                  + (f", extra TTFT p50 {_ms(s['late_extra_ttft_p50_ms'])}." if s["late_first_token"] else
                     " (every request had its first token before the kill, so a migration shows as the gap above, "
                     "not as TTFT)."), ""]
    if "summary" in u:
        s = u["summary"]
        lines += ["## 4. Rolling update", "",
                  f"Measured {u.get('measured')}, {u['rounds_run']} rounds, {u['seconds']:.0f} s. Two replicas "
                  f"(cpus = 1) under W3's mix for {u['duration_s']:g} s (16 batch streams 256 / 256, cancelled at the "
                  f"end, + 1 interactive chat request a second, 64 / 64); `deploy.apply` of a new version label "
                  f"{u['apply_at_s']:g} s in. Window: from the apply call until the old pool's last replica actor is gone "
                  "(drained). Fleet defaults: drain_timeout_s 60.", "",
                  "| round | versions | failed (by status) | apply returned | old replicas gone after | gateway replica "
                  "replaced | interactive requests in the window | TTFT p50 / p99 in the window | TTFT p50 / p99 before "
                  "| load covered the window |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for k, r in enumerate(u["rounds"]):
            lines.append(f"| {k} | {r['from_version']} -> {r['version_after']} | {r['failed']} "
                         f"{json.dumps(r['error_counts']) if r['error_counts'] else ''} | {r['apply_s']:.1f} s | "
                         f"{r['drain_s']:.1f} s | {'yes' if r.get('gateway_replaced') else 'no'} | "
                         f"{r['interactive_during']} | "
                         f"{_ms(r['interactive_ttft_p50_during_ms'])} / {_ms(r['interactive_ttft_p99_during_ms'])} | "
                         f"{_ms(r['interactive_ttft_p50_before_ms'])} / {_ms(r['interactive_ttft_p99_before_ms'])} | "
                         f"{'yes' if r['covered'] else 'no'} |")
        lines += ["", f"Pooled over the rounds' {s['interactive_during']} interactive requests in the windows: TTFT p99 "
                  f"{_ms(s['interactive_ttft_p99_during_pooled_ms'])}.", ""]
        fails = [(k, x) for k, r in enumerate(u["rounds"]) for x in r.get("failures", [])]
        if fails:
            when = [x["at_s_after_apply"] for _, x in fails]
            msgs = sorted({f"{x['kind']}: {x['error'][:200]}" for _, x in fails})
            lines += [f"The failed requests were sent {min(when):.1f} to {max(when):.1f} s after the apply call "
                      f"(apply returned after {s['apply_s']:.1f} s, median). What they got back:", ""]
            lines += [f"- `{m}`" for m in msgs[:6]]
            lines.append("")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per part (default 3); medians over them")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench"), help="where fleet.json and fleet.md go")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)} (default all)")
    ap.add_argument("--work", default=None, help="raw results and logs (default bench_results/fleet-<UTC time>)")
    ap.add_argument("--update-duration", type=float, default=80.0,
                    help="seconds of W3's load per update round (default 80: the update must finish inside it)")
    ap.add_argument("--render", action="store_true", help="only render fleet.md again from <out>/fleet.json")
    a = ap.parse_args(argv)
    a.only = [p.strip() for p in a.only.split(",") if p.strip()]
    bad = [p for p in a.only if p not in PARTS]
    if bad:
        ap.error(f"unknown parts {bad}; known: {', '.join(PARTS)}")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    return a


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "fleet.json"
    if args.render:
        (out_dir / "fleet.md").write_text(render(json.loads(json_path.read_text())) + "\n")
        return 0
    bench = Bench(args)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    mach = machine()
    log(f"product code {code_state()}; CPU {mach.get('lscpu_model_name')}, {mach.get('nproc')} cores, avx512 {mach.get('avx512')}, "
        f"amx {mach.get('amx')}; parts {', '.join(args.only)}, {args.rounds} round(s); work dir {bench.work}")
    t0 = time.monotonic()
    code0 = code_state()
    results = bench.run(args.only)
    code1 = code_state()
    if code0 != code1:
        log(f"WARNING: the product code changed during the run ({code0} -> {code1}); the numbers may mix versions")
    changed_files = code_changes(code0, code1) if code0 != code1 else []
    for part in results.values():
        part.update(code_at_start=code0, code_at_end=code1, code_changed_files=changed_files)
    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    for part in results:
        remember(data, part)
    data.update(results)
    data.update(machine=mach, git=git_info(), started=started,
                finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python -m benchmarks.fleet " + " ".join(sys.argv[1:] if argv is None else argv),
                seconds=round(time.monotonic() - t0, 1), work_dir=str(bench.work), targets=TARGETS,
                fleet_configs=bench.fleet.configs, ray_num_cpus=RAY_NUM_CPUS)
    json_path.write_text(json.dumps(data, indent=1, default=str))
    (out_dir / "fleet.md").write_text(render(data) + "\n")
    log(f"wrote {json_path} and {out_dir / 'fleet.md'}")
    return 0 if all("error" not in results[p] for p in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
