"""`make bench`: the workloads of shared/WORKLOADS.md (W1-W5, plus a concurrency sweep) and W6 (below) against
kvserve, and with BENCH_PEERS=1 against vLLM's CPU build, llama.cpp (BF16 and Q4_1) and a Hugging Face
static-batching baseline, one after the other in the same run.

  python -m benchmarks.suite [--workloads W1,W3] [--runs 3] [--quick] [--targets kvserve,vllm]
                             [--models smollm2-135m,llama-1b.Q4_K_M,llama-8b.Q4_K_M]

Models: SmolLM2-135M (the default) runs every workload against every engine. A random-weight model with
Llama-3.2-1B's or Llama-3.1-8B's shape (benchmarks.shapes, at Q4_K_M or Q8_0) runs W1 and W2 at its own
sizes (SIZES), served as the same GGUF file by kvserve and by llama-server (target llamacpp-gguf); its
results go to `<target>@<model>/` and the report's "Larger models" section.

W6, long context (defined here, in the style of WORKLOADS.md; kvserve only):
  | W6 | long documents beside interactive work | Gemma 3 270M (`gemma3-270m`, served at its 32k context:
  |    | max_model_len = 32768, a 2 GiB KV pool) gets documents of 32000, 8000 and 16000 tokens in turn (standard-
  |    | library Python source, the client's `document` dataset, closed by "Summarize the code above in one
  |    | sentence."; 64 output tokens), 2 in flight at `priority: batch` (long, offline-ish work), beside W3's
  |    | interactive stream (chat, ~64 / 64 tokens, 1 request/s, `priority: interactive`) for 240 s; then that
  |    | stream alone for 60 s | interactive TTFT p50 and p99 beside the documents against alone (target:
  |    | p99 < 1 s beside them); the documents' TTFT per size and their tokens/s |
  Its results go to `kvserve@gemma3-270m/` and the W6 page (docs/bench/w6.md, by benchmarks.report). The peers
  are not set up for it: vLLM's CPU build reads no GGUF, and llama-server's bench command splits 16k tokens of
  context over 32 slots.

W7, grounded work (speculative decoding's workload; defined here):
  | W7 | work whose answer repeats its prompt | SmolLM2 gets 512-token passages of standard-library source, each
  |    | closed by a task in turn (copy it, rename in it, quote from it, continue it: the client's `grounded`
  |    | dataset), 128 greedy output tokens (`ignore_eos`), at concurrency 1 (8 prompts) and 8 (32 prompts) |
  |    | TPOT p50 and output tokens/s; with `--engine-arg speculative_decoding=true` against without |

Every server is started and stopped by the suite on a free loopback port; every workload runs
`--runs` times with a different seed each time (so no run hits a prefix cache filled by another);
the client is `kvserve bench serve` (kvserve.bench.loadgen) for every engine. Machine ceilings (peak
bf16/fp32 matmul FLOP/s, copy bandwidth) are measured with torch at the start. Results go to
`bench_results/<session>/` (JSON per run, server logs, meta.json); at the end
`python -m benchmarks.report` renders BENCHMARKS.md and the plots from them (it can also be run
on its own, on a partial session).

Environment:
  BENCH_PEERS=1        add the peers (vllm in bf16 and fp32, llama.cpp at BF16, F16 and Q4_1, hf-static; on a
                       shape: llamacpp-gguf, and vLLM recorded as not run)
  BENCH_PEERS_SETUP=1  run a missing peer's setup.sh (heavy: pip installs, a llama.cpp build) and write a missing
                       shape's GGUF (python -m benchmarks.shapes: minutes, 8 GB for the 8B); else skip them
  PEERS_DIR            where the peers are installed (default /tmp/peers)
  PEERS_SRC            the peers' scripts (default <repo>/../shared/peers)
  BENCH_LOCK           lock file held for the whole run (default /tmp/bench.lock; "none": no lock)
  BENCH_VLLM_PRIORITY=1  start vLLM with --scheduling-policy priority and send integer priorities (W3)
  BENCH_CLIENT_CHECK=0 skip running `vllm bench serve` against kvserve (W1, W2) next to our client
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import shapes
from benchmarks.shapes import SHAPES, ShapeModel
from benchmarks.targets import (PEER_TARGETS, REPO, HfStaticTarget, KvserveTarget, RunningServer, Target,
                                   VllmTarget, all_targets, free_port, shell_join)

ALL_WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "SWEEP")
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
QUICK_SWEEP_CONCURRENCY = (1, 2, 4)
SMOLLM2 = "smollm2-135m"
SHAPE_WORKLOADS = ("W1", "W2")  # what a shape runs: throughput and single-stream latency


@dataclass(frozen=True)
class Sizes:
    """W1's and W2's request counts for a model (256 prompt / 128 output tokens each): WORKLOADS.md's for
    SmolLM2; fewer for the shapes, whose 256-token prefill takes seconds (1B) to a minute (8B) on 2 cores."""

    w1_prompts: int
    w1_concurrency: int
    w2_prompts: int


SIZES = {SMOLLM2: Sizes(64, 32, 8), "llama-1b": Sizes(32, 32, 4), "qwen3-1.7b": Sizes(32, 32, 4),
         "llama-8b": Sizes(16, 8, 2), "qwen3-30b-a3b-l12": Sizes(16, 8, 2)}
QUICK_SIZES = Sizes(8, 4, 2)


@dataclass(frozen=True)
class CatalogModel:
    """A model of kvserve's catalog served as it ships, where the suite serves a shape's file (the same name,
    model_id and path): W6's Gemma 3 270M."""

    model_id: str

    @property
    def name(self) -> str:
        return self.model_id

    @property
    def path(self) -> Path:
        from kvserve.models.catalog import resolve_model

        return Path(resolve_model(self.model_id)[1])

    def missing(self) -> str | None:
        """Why the model cannot be served here (its package is not installed), else None."""
        from kvserve.models.catalog import ModelSourceError

        try:
            self.path
        except ModelSourceError as e:
            return str(e)
        return None


W6_MODEL = CatalogModel("gemma3-270m")
# Its whole 32k context (a 32000-token document and its 64 tokens fit); the pool is the CPU default, said aloud:
# with KV groups a 32k sequence holds about 134 MiB at its peak (docs/bench/kv-memory.md).
W6_ENGINE_ARGS = {"max_model_len": 32768, "kv_cache_memory": "2GiB"}
W6_TARGETS = ("kvserve", "fake")
W6_DOCUMENTS, W6_CONCURRENCY, W6_DURATION, W6_ALONE_DURATION = (32000, 8000, 16000), 2, 240, 60
W7_INPUT, W7_OUTPUT = 512, 128


@dataclass
class Job:
    """One benchmark configuration: a workload (or half of one) with its client arguments."""

    name: str  # file/dir name: W1, W3-flood, W4-nocache, SWEEP-c8, ...
    workload: str  # W1..W5, SWEEP
    kind: str  # server need: plain | long | prefix_on | prefix_off
    args: list[str]
    seed_base: int
    runs: int
    vllm_client_check: bool = False  # also run `vllm bench serve` with the same shape (kvserve only)
    shape: dict = field(default_factory=dict)


def _interactive(inp: int, out: int) -> str:
    """W3's interactive stream, also W6's: chat requests at a steady 1 request/s."""
    return f"interactive:rate=1,arrival=constant,dataset=chat,input={inp},output={out}"


def _random(inp: int, out: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(out),
            "--ignore-eos"]


def build_jobs(workloads: list[str], runs: int, quick: bool, model: str = SMOLLM2) -> list[Job]:
    """The client side of W1-W5 (WORKLOADS.md) and W6; --quick shrinks every size for a smoke test. `model`:
    SmolLM2, or a shape (a key of SHAPES), which runs only SHAPE_WORKLOADS, at its SIZES."""
    q = quick
    io_ = (32, 16) if q else (256, 128)
    sizes = QUICK_SIZES if q else SIZES[model]
    if model != SMOLLM2:
        workloads = [w for w in workloads if w in SHAPE_WORKLOADS]
    jobs: list[Job] = []
    if "W1" in workloads or "W5" in workloads:
        n, c = sizes.w1_prompts, sizes.w1_concurrency
        jobs.append(Job("W1", "W1", "plain", _random(*io_) + ["--num-prompts", str(n), "--max-concurrency", str(c)],
                        100, runs if "W1" in workloads else 1, vllm_client_check=model == SMOLLM2,
                        shape={"input": io_[0], "output": io_[1], "num_prompts": n, "max_concurrency": c}))
    if "W2" in workloads:
        n = sizes.w2_prompts
        jobs.append(Job("W2", "W2", "plain", _random(*io_) + ["--num-prompts", str(n), "--max-concurrency", "1"],
                        200, runs, vllm_client_check=model == SMOLLM2,
                        shape={"input": io_[0], "output": io_[1], "num_prompts": n, "max_concurrency": 1}))
    if "W3" in workloads:
        dur = 4 if q else 60
        batch_c, batch_io, inter_io = (2, (64, 64), (40, 16)) if q else (16, (256, 256), (64, 64))
        inter = _interactive(*inter_io)
        flood = f"batch:concurrency={batch_c},input={batch_io[0]},output={batch_io[1]},drain=0"
        common = ["--ignore-eos", "--duration", str(dur), "--goodput-ttft-ms", "1000"]
        shape = {"duration": dur, "batch_concurrency": batch_c, "batch_io": batch_io, "interactive_io": inter_io,
                 "interactive_rate": 1}
        jobs.append(Job("W3-flood", "W3", "long", common + ["--mix", f"{flood};{inter}"], 300, runs, shape=shape))
        jobs.append(Job("W3-alone", "W3", "long", common + ["--mix", inter], 350, runs, shape=shape))
    if "W4" in workloads:
        prefix, suffix, out, n, c = (64, 16, 16, 8, 2) if q else (512, 64, 64, 32, 4)
        args = ["--dataset-name", "shared-prefix", "--shared-prefix-len", str(prefix), "--random-input-len",
                str(suffix), "--random-output-len", str(out), "--ignore-eos", "--num-prompts", str(n),
                "--max-concurrency", str(c)]
        shape = {"prefix": prefix, "suffix": suffix, "output": out, "num_prompts": n, "max_concurrency": c}
        jobs.append(Job("W4", "W4", "prefix_on", args, 400, runs, shape=shape))
        jobs.append(Job("W4-nocache", "W4", "prefix_off", args, 450, runs, shape=shape))
    if "W5" in workloads:
        dur = 4 if q else 60
        # the rate (3x what W1 sustained on the same target) is filled in at run time
        jobs.append(Job("W5", "W5", "overload", _random(*io_) + ["--duration", str(dur), "--goodput-ttft-ms", "1000"],
                        500, runs, shape={"input": io_[0], "output": io_[1], "duration": dur, "rate_factor": 3}))
    if "W6" in workloads:
        dur, alone, docs, doc_out, inter_io = ((20, 8, (2048, 512, 1024), 16, (40, 16)) if q else
                                               (W6_DURATION, W6_ALONE_DURATION, W6_DOCUMENTS, 64, (64, 64)))
        documents = (f"documents:priority=batch,concurrency={W6_CONCURRENCY},dataset=document,"
                     f"inputs={'/'.join(map(str, docs))},output={doc_out},drain=0")
        common = ["--ignore-eos", "--goodput-ttft-ms", "1000"]
        shape = {"model": W6_MODEL.model_id, "engine_args": W6_ENGINE_ARGS, "duration": dur, "alone_duration": alone,
                 "documents": list(docs), "document_output": doc_out, "document_concurrency": W6_CONCURRENCY,
                 "interactive_io": inter_io, "interactive_rate": 1}
        jobs.append(Job("W6-mix", "W6", "long_context", common + ["--duration", str(dur), "--mix",
                                                                  f"{documents};{_interactive(*inter_io)}"],
                        800, runs, shape=shape))
        jobs.append(Job("W6-alone", "W6", "long_context", common + ["--duration", str(alone), "--mix",
                                                                    _interactive(*inter_io)], 850, runs, shape=shape))
    if "W7" in workloads:
        inp, out, n1, n8 = (64, 16, 2, 4) if q else (W7_INPUT, W7_OUTPUT, 8, 32)
        for c, n in ((1, n1), (8, n8)):
            args = ["--dataset-name", "grounded", "--random-input-len", str(inp), "--random-output-len", str(out),
                    "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(c)]
            jobs.append(Job(f"W7-c{c}", "W7", "plain", args, 900 + 10 * c, runs,
                            shape={"input": inp, "output": out, "num_prompts": n, "max_concurrency": c}))
    if "SWEEP" in workloads:
        for c in (QUICK_SWEEP_CONCURRENCY if q else SWEEP_CONCURRENCY):
            n = max(4 if q else 8, 2 * c)
            jobs.append(Job(f"SWEEP-c{c}", "SWEEP", "plain",
                            _random(*io_) + ["--num-prompts", str(n), "--max-concurrency", str(c)],
                            600 + 10 * c, 1, shape={"input": io_[0], "output": io_[1], "num_prompts": n,
                                                    "max_concurrency": c}))
    return jobs


def git_info() -> dict:
    def git(*args):
        r = subprocess.run(["git", *args], cwd=str(REPO), capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


@contextlib.contextmanager
def bench_lock(path: str):
    if path == "none":
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for the benchmark lock {path} (another benchmark is running) ...", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.session = args.session or (stamp + ("-quick" if args.quick else ""))
        self.root = Path(args.out).resolve() / self.session
        self.root.mkdir(parents=True, exist_ok=True)
        self.meta_path = self.root / "meta.json"
        self.meta: dict = json.loads(self.meta_path.read_text()) if self.meta_path.exists() else {}
        self.meta.setdefault("targets", {})
        # A session can be added to (--session): its workloads are those of every run into it.
        workloads = sorted(set(self.meta.get("workloads", [])) | set(args.workloads), key=ALL_WORKLOADS.index)
        self.meta.update(session=self.session, quick=args.quick, runs=args.runs, workloads=workloads,
                         argv=sys.argv, git=git_info(),
                         env={k: os.environ.get(k) for k in ("BENCH_PEERS", "BENCH_PEERS_SETUP", "PEERS_DIR",
                                                             "PEERS_SRC", "BENCH_VLLM_PRIORITY", "OMP_NUM_THREADS")})
        self.meta.setdefault("started", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def save_meta(self) -> None:
        self.meta_path.write_text(json.dumps(self.meta, indent=1))

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # -- ceilings ----------------------------------------------------------------------------------------------------

    def ceilings(self) -> None:
        out = self.root / "ceilings.json"
        argv = [sys.executable, "-m", "benchmarks.ceilings", "--json", str(out)] + (["--quick"] if self.args.quick
                                                                                       else [])
        self.log("measuring machine ceilings: " + shell_join(argv))
        r = subprocess.run(argv, cwd=str(REPO), capture_output=True, text=True)
        if r.returncode != 0:
            self.log(f"ceilings failed: {r.stderr[-2000:]}")
            return
        self.log(r.stdout.strip())
        self.meta["ceilings"] = json.loads(out.read_text())
        self.meta["ceilings_command"] = "python -m benchmarks.ceilings" + (" --quick" if self.args.quick else "")
        self.meta["model_params"] = model_params()
        self.save_meta()

    # -- one target --------------------------------------------------------------------------------------------------

    def ensure_model(self, model: ShapeModel) -> str | None:
        """The shape's GGUF file, written by benchmarks.shapes if missing and peers' set-up is allowed; else why
        it is not there."""
        if model.path.exists():
            return None
        make = f"python -m benchmarks.shapes {model.shape} --quants {model.quant}"
        if os.environ.get("BENCH_PEERS_SETUP") != "1":
            return f"missing {model.path}; run {make} or set BENCH_PEERS_SETUP=1"
        self.log(f"{model.name}: writing {model.path} ({make})")
        try:
            shapes.make(model.shape, model.quant, log=self.log)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            return f"{make} failed: {e}"
        return None

    def skip(self, t: Target, why: str) -> None:
        self.log(f"SKIPPING {t.name}: {why}")
        self.meta["targets"][t.name] = {**t.describe(), "status": "skipped", "reason": why}
        self.save_meta()

    def ensure_available(self, t: Target) -> bool:
        ok, why = t.available()
        if not ok and os.environ.get("BENCH_PEERS_SETUP") == "1" and t.setup_command():
            cmd = t.setup_command()
            self.log(f"{t.name}: {why}; running its setup: {shell_join(cmd)}")
            r = subprocess.run(cmd, cwd=str(Path(cmd[-1]).parent))
            if r.returncode != 0:
                why = f"setup failed ({shell_join(cmd)} exited {r.returncode})"
            else:
                ok, why = t.available()
        if not ok:
            self.skip(t, why)
        return ok

    def run_target(self, t: Target, jobs: list[Job]) -> None:
        tdir = self.root / t.name
        tdir.mkdir(parents=True, exist_ok=True)
        before = self.meta["targets"].get(t.name, {})  # an earlier run into this session keeps its commands
        info = {**t.describe(), "status": "running", "servers": dict(before.get("servers", {})),
                "commands": dict(before.get("commands", {}))}
        self.meta["targets"][t.name] = info
        self.save_meta()
        if isinstance(t, HfStaticTarget):
            self.run_hf_static(t, tdir, info)
            return
        t.prepare(tdir)
        order: list[str] = []
        for j in jobs:
            v = t.variant(j.kind)
            if v not in order:
                order.append(v)
        for variant in order:
            vjobs = [j for j in jobs if t.variant(j.kind) == variant]
            port = free_port()
            spec = t.server_spec(variant, port, tdir)
            server = RunningServer(spec, port, tdir / f"server-{variant}.log")
            info["servers"][variant] = {"command": shell_join(spec.argv, spec.env), "note": spec.note}
            self.log(f"{t.name}: starting server ({variant}): {shell_join(spec.argv)}")
            try:
                server.start()
            except RuntimeError as e:
                self.log(f"{t.name}: server ({variant}) failed to start: {e}")
                info["servers"][variant]["error"] = str(e)[-3000:]
                self.save_meta()
                continue
            info["servers"][variant]["startup_s"] = round(server.startup_s or 0, 2)
            self.log(f"{t.name}: ready after {server.startup_s:.1f}s on {server.base_url}")
            self.save_meta()
            try:
                self.warmup(t, server, tdir, variant)
                if t.model:
                    self.record_footprint(t, server, info)
                for j in vjobs:
                    self.run_job(t, server, tdir, j, info)
            finally:
                self.log(f"{t.name}: stopping server ({variant})")
                server.stop()
        info["status"] = "done"
        self.save_meta()

    def record_footprint(self, t: Target, server: RunningServer, info: dict) -> None:
        """The server's RSS after load and warm-up, and what a decode step reads per token (Larger models)."""
        info.update(rss_bytes=server.rss_bytes(), **t.weights_read(server.log_path))
        self.log(f"{t.name}: RSS {(info['rss_bytes'] or 0) / 1e9:.2f} GB; "
                 f"{(info.get('bytes_per_token') or 0) / 1e9:.2f} GB read per token ({info.get('weights_form', '?')})")
        self.save_meta()

    def client_argv(self, t: Target, server: RunningServer, extra: list[str]) -> list[str]:
        tokenizer = t.model.model_id if isinstance(t.model, CatalogModel) else SMOLLM2  # shapes: SmolLM2's vocabulary
        argv = ["--base-url", server.base_url, "--model", t.model_id, "--tokenizer", tokenizer,
                "--priority-style", t.priority_style]
        if t.connection_close:
            argv.append("--connection-close")
        return argv + extra

    def run_client(self, t: Target, argv: list[str], log_path: Path) -> int:
        env = {**os.environ}
        key = t.api_key()
        if key:
            env["KVSERVE_API_KEY"] = key
        with open(log_path, "w") as log:
            r = subprocess.run([sys.executable, "-m", "kvserve.bench.loadgen", *argv], env=env, stdout=log,
                               stderr=subprocess.STDOUT, cwd=str(REPO))
        return r.returncode

    def warmup(self, t: Target, server: RunningServer, tdir: Path, variant: str) -> None:
        io_ = (32, 16) if self.args.quick else (256, 128)
        n = 4
        if t.model:  # a shape's step takes up to seconds: two short requests touch every weight and kernel
            n, io_ = 2, (io_[0], 16)
        argv = self.client_argv(t, server, ["--dataset-name", "random", "--random-input-len", str(io_[0]),
                                            "--random-output-len", str(io_[1]), "--ignore-eos", "--num-prompts",
                                            str(n), "--max-concurrency", str(n), "--seed", "9000", "--quiet",
                                            "--result-file", str(tdir / f"warmup-{variant}.json")])
        rc = self.run_client(t, argv, tdir / f"warmup-{variant}.log")
        self.log(f"{t.name}: warmup ({variant}) exit {rc}")

    def w5_rate(self, t: Target, tdir: Path) -> float:
        if self.args.w5_rate:
            return self.args.w5_rate
        rates = []
        for p in sorted((tdir / "W1").glob("run*.json")):
            with contextlib.suppress(ValueError, OSError, KeyError):
                rates.append(json.loads(p.read_text())["request_throughput"])
        if not rates:
            raise RuntimeError("W5 needs W1's request rate on the same target (run W1 first or pass --w5-rate)")
        return 3.0 * statistics.median(rates)

    def run_job(self, t: Target, server: RunningServer, tdir: Path, job: Job, info: dict) -> None:
        jdir = tdir / job.name
        jdir.mkdir(parents=True, exist_ok=True)
        extra = list(job.args)
        if job.workload == "W5":
            try:
                rate = self.w5_rate(t, tdir)
            except RuntimeError as e:
                self.log(f"{t.name}: {job.name} skipped: {e}")
                return
            extra += ["--request-rate", f"{rate:.4f}"]
            info.setdefault("w5_rate", rate)
        for k in range(job.runs):
            seed = job.seed_base + k
            out = jdir / f"run{k}.json"
            argv = self.client_argv(t, server, extra + ["--seed", str(seed), "--quiet", "--result-file", str(out),
                                                        "--metadata", f"target={t.name}", f"job={job.name}",
                                                        f"run={k}"])
            info["commands"].setdefault(job.name, "kvserve bench serve " + shell_join(
                [a for a in argv if a not in ("--quiet",)]).replace(str(self.root), "$SESSION"))
            self.save_meta()
            t0 = time.monotonic()
            rc = self.run_client(t, argv, jdir / f"run{k}.log")
            summary = ""
            if out.exists():
                r = json.loads(out.read_text())
                summary = (f"{r['completed']} ok, {r['failed']} failed {r['error_counts'] or ''}; "
                           f"{r['output_throughput']:.1f} out tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                           f"TPOT p50 {r['median_tpot_ms']:.1f} ms")
            self.log(f"{t.name}: {job.name} run {k} (seed {seed}) exit {rc} in {time.monotonic() - t0:.0f}s: "
                     f"{summary}")
            if job.vllm_client_check and isinstance(t, KvserveTarget) and self.client_check_enabled():
                self.vllm_client_run(t, server, jdir, job, k, seed, info)

    # -- `vllm bench serve` against kvserve, to check that both clients agree ----------------------------------------

    def client_check_enabled(self) -> bool:
        if os.environ.get("BENCH_CLIENT_CHECK", "1") == "0" or os.environ.get("BENCH_PEERS") != "1":
            return False
        return VllmTarget().available()[0]

    def vllm_client_run(self, t: KvserveTarget, server: RunningServer, jdir: Path, job: Job, k: int, seed: int,
                        info: dict) -> None:
        v = VllmTarget()
        s = job.shape
        argv = [str(v.python), str(v.cli), "bench", "serve", "--backend", "openai", "--base-url", server.base_url,
                "--endpoint", "/v1/completions", "--model", t.model_id, "--tokenizer", str(v.model_dir),
                "--dataset-name", "random", "--random-input-len", str(s["input"]), "--random-output-len",
                str(s["output"]), "--ignore-eos", "--temperature", "0", "--num-prompts", str(s["num_prompts"]),
                "--max-concurrency", str(s["max_concurrency"]), "--seed", str(seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                "--save-result", "--result-dir", str(jdir), "--result-filename", f"vllm-client-run{k}.json",
                "--disable-tqdm"]
        info["commands"].setdefault(job.name + " (vllm bench serve)", "OPENAI_API_KEY=$TOKEN " + shell_join(argv)
                                    .replace(str(self.root), "$SESSION"))
        env = {**os.environ, "OPENAI_API_KEY": t.api_key() or "", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        with open(jdir / f"vllm-client-run{k}.log", "w") as log:
            r = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(jdir))
        self.log(f"{t.name}: {job.name} run {k} with vllm bench serve: exit {r.returncode}")

    # -- HF static batching ------------------------------------------------------------------------------------------

    def run_hf_static(self, t: HfStaticTarget, tdir: Path, info: dict) -> None:
        out = tdir / "baseline.json"
        argv = t.command(out, self.args.quick)
        info["commands"]["baseline"] = shell_join(argv).replace(str(self.root), "$SESSION")
        self.save_meta()
        self.log(f"hf-static: {shell_join(argv)}")
        with open(tdir / "baseline.log", "w") as log:
            r = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        info["status"] = "done" if r.returncode == 0 else f"failed (exit {r.returncode})"
        self.save_meta()

    # -- all ---------------------------------------------------------------------------------------------------------

    def kind_pages(self) -> None:
        """This CPU kind's profile (where a W1 step's time goes) and bf16 quality pages, for its section of
        BENCHMARKS.md (the report files them under the session's kind)."""
        for name in ("profile", "quality"):
            argv = [sys.executable, "-m", f"benchmarks.{name}", "--markdown", str(self.root / f"{name}.md")]
            self.log(f"{name}: " + shell_join(argv))
            r = subprocess.run(argv, capture_output=True, text=True, cwd=str(REPO), timeout=3600)
            if r.returncode != 0:
                self.log(f"{name} failed: {r.stderr[-2000:]}")
            self.meta.setdefault("kind_pages", {})[name] = {"command": shell_join(argv[1:]), "rc": r.returncode}
            self.save_meta()

    def run_model(self, model: ShapeModel | None) -> None:
        """Every target on one model: SmolLM2 (None; its jobs in meta["jobs"], as always) or a shape's file
        (its jobs, file and command in meta["models"][name])."""
        jobs = build_jobs(self.args.workloads, self.args.runs, self.args.quick, model.shape if model else SMOLLM2)
        record = self.meta if model is None else self.meta.setdefault("models", {}).setdefault(model.name, {})
        ran = {j["name"]: j for j in record.get("jobs", [])}  # an earlier run into this session
        ran.update({j.name: {"name": j.name, "workload": j.workload, "kind": j.kind, "runs": j.runs,
                             "seed_base": j.seed_base, "shape": j.shape} for j in jobs})
        record["jobs"] = list(ran.values())
        if model:  # the copy bandwidth of this invocation: a later one into the session re-measures it
            record.update(model=SHAPES[model.shape].model, file=str(model.path),
                          command=shell_join(["python", "-m", "benchmarks.suite", *sys.argv[1:]]),
                          copy_bytes_per_s=(self.meta.get("ceilings") or {}).get("copy_bytes_per_s"))
        self.save_meta()
        w6 = [j for j in jobs if j.workload == "W6"]
        jobs = [j for j in jobs if j.workload != "W6"]
        targets = all_targets(self.args.targets, engine_args=dict(self.args.engine_arg), model=model)
        if jobs or not w6:
            self.log(f"{model.name if model else SMOLLM2}: targets {', '.join(t.name for t in targets)}; "
                     f"jobs {', '.join(j.name for j in jobs) or 'none (shapes run W1 and W2 only)'}")
        if jobs:
            self.run_targets(targets, jobs, self.ensure_model(model) if model else None)
        if w6:
            self.run_w6(w6)

    def run_w6(self, jobs: list[Job]) -> None:
        """W6 on its model at its whole context, on the targets of W6_TARGETS among --targets; --engine-arg
        applies as far as W6_ENGINE_ARGS leaves it."""
        names = [n for n in self.args.targets if n in W6_TARGETS]
        targets = all_targets(names, engine_args={**dict(self.args.engine_arg), **W6_ENGINE_ARGS}, model=W6_MODEL)
        self.log(f"W6 on {W6_MODEL.model_id}: targets {', '.join(t.name for t in targets) or 'none (kvserve only)'}; "
                 f"jobs {', '.join(j.name for j in jobs)}")
        self.run_targets(targets, jobs, W6_MODEL.missing())

    def run_targets(self, targets: list[Target], jobs: list[Job], missing: str | None = None) -> None:
        """Each target through `jobs`, or skipped with `missing` (the model file is not there) or its reason."""
        for t in targets:
            if missing and not isinstance(t, VllmTarget):  # vLLM would not load the file anyway: its own reason
                self.skip(t, missing)
                continue
            if not self.ensure_available(t):
                continue
            try:
                self.run_target(t, jobs)
            except Exception as e:  # noqa: BLE001 - one target failing must not lose the others
                self.log(f"{t.name}: FAILED: {type(e).__name__}: {e}")
                self.meta["targets"].setdefault(t.name, {})["status"] = f"failed: {e}"[:2000]
                self.save_meta()

    def run(self) -> int:
        names = self.args.targets
        self.log(f"session {self.root}; models {', '.join(self.args.models)}; targets {', '.join(names)}")
        self.ceilings()
        for name in self.args.models:
            self.run_model(None if name == SMOLLM2 else ShapeModel.parse(name))
        if SMOLLM2 in self.args.models and "kvserve" in names and not self.args.quick and not self.args.no_kind_pages:
            self.kind_pages()
        self.meta["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.save_meta()
        latest = self.root.parent / "latest"
        with contextlib.suppress(OSError):
            if latest.is_symlink() or latest.exists():
                latest.unlink()
            latest.symlink_to(self.root.name)
        return 0


def model_params() -> dict:
    """Parameter count of the served SmolLM2 GGUF (element count of every tensor; tied embedding once)."""
    try:
        from gguf import GGUFReader

        from kvserve.models.catalog import resolve_model

        _, path = resolve_model("smollm2-135m")
        reader = GGUFReader(str(path))
        n = sum(int(t.n_elements) for t in reader.tensors)
        return {"model": "SmolLM2-135M-Instruct", "params": n, "file": Path(path).name}
    except Exception as e:  # noqa: BLE001
        return {"model": "SmolLM2-135M-Instruct", "params": 134_515_008, "note": f"counted elsewhere ({e})"}


def _engine_arg(text: str) -> tuple[str, object]:
    import tomllib

    key, eq, value = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a TOML value), got {text!r}")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key.strip(), parsed


def add_suite_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--workloads", default=",".join(ALL_WORKLOADS),
                    help=f"comma-separated subset of {','.join(ALL_WORKLOADS)} (default: all)")
    ap.add_argument("--runs", type=int, default=None, help="runs per workload, each with its own seed "
                                                           "(default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of the pipeline, not numbers")
    ap.add_argument("--targets", default=None,
                    help="comma-separated: kvserve," + ",".join(PEER_TARGETS) +
                         " (default: kvserve, plus the peers when BENCH_PEERS=1)")
    ap.add_argument("--models", default=SMOLLM2,
                    help=f"comma-separated: {SMOLLM2} (every workload) and random-weight shapes, run on W1 and W2: "
                         f"{','.join(shapes.model_names())} (default {SMOLLM2})")
    ap.add_argument("--out", default=str(REPO / "bench_results"), help="results root (default bench_results/)")
    ap.add_argument("--session", default=None, help="session directory name (default: a UTC time stamp)")
    ap.add_argument("--w5-rate", type=float, default=None, help="W5 request rate (default: 3x W1's req/s)")
    ap.add_argument("--engine-arg", action="append", default=[], type=_engine_arg, metavar="KEY=VALUE",
                    help="extra kvserve engine argument for the bench config (TOML value), repeatable")
    ap.add_argument("--no-report", action="store_true", help="do not render the report at the end")
    ap.add_argument("--no-kind-pages", action="store_true",
                    help="skip the profile and quality pages of this CPU kind (run after kvserve's workloads)")
    ap.add_argument("--report-dir", default=None,
                    help="where the report goes (default: the repo root, or the session dir with --quick)")
    return ap


def finish_args(a: argparse.Namespace, error=None) -> argparse.Namespace:
    """Defaults that depend on other options and the environment."""
    def fail(msg):
        if error is not None:
            error(msg)
        raise SystemExit(msg)

    if isinstance(a.workloads, str):
        a.workloads = [w.strip().upper() for w in a.workloads.split(",") if w.strip()]
    bad = [w for w in a.workloads if w not in ALL_WORKLOADS]
    if bad:
        fail(f"unknown workloads {bad}; known: {', '.join(ALL_WORKLOADS)}")
    if isinstance(a.models, str):
        a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in a.models if m != SMOLLM2 and m not in shapes.model_names()]
    if bad:
        fail(f"unknown models {bad}; known: {', '.join([SMOLLM2] + shapes.model_names())}")
    if a.runs is None:
        a.runs = 1 if a.quick else 3
    if a.targets is None:
        a.targets = ["kvserve"] + (PEER_TARGETS if os.environ.get("BENCH_PEERS") == "1" else [])
    elif isinstance(a.targets, str):
        a.targets = [x.strip() for x in a.targets.split(",") if x.strip()]
    return a


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    add_suite_arguments(ap)
    return finish_args(ap.parse_args(argv), ap.error)


def _interrupt(signum, frame):  # SIGTERM: unwind like Ctrl-C, so every started server is stopped
    raise KeyboardInterrupt


def main(argv=None) -> int:
    return run_suite(parse_args(argv))


def run_suite(args: argparse.Namespace) -> int:
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    with bench_lock(os.environ.get("BENCH_LOCK", "/tmp/bench.lock")):
        suite = Suite(args)
        try:
            rc = suite.run()
        except KeyboardInterrupt:
            suite.log("interrupted; results so far are in " + str(suite.root))
            rc = 130
    if not args.no_report:
        from benchmarks import report

        if args.report_dir:
            out_dir = Path(args.report_dir)
        else:
            out_dir = suite.root if args.quick else REPO
        report_argv = ["--session", str(suite.root), "--markdown", str(out_dir / "BENCHMARKS.md"),
                       "--plots", str(out_dir / "docs" / "bench" if out_dir == REPO else out_dir / "plots")]
        suite.log("rendering: python -m benchmarks.report " + " ".join(report_argv))
        report.main(report_argv)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
