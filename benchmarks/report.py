"""Render a CPU kind's section of BENCHMARKS.md and its plots from a suite session in bench_results/
(measuring is elsewhere), then BENCHMARKS.md from every kind's section. A session with W6 also renders W6's
own page (docs/bench/w6.md and w6.json).

  python -m benchmarks.report [--session bench_results/latest] [--markdown BENCHMARKS.md] [--plots docs/bench]

Tables hold the median of the runs of each workload, with [min-max] when there are several, ratios
of kvserve to each peer, the machine and its ceilings, and the exact commands. A partial session (a
target skipped or failed, a workload missing) renders what is there and says what is not.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

from benchmarks import pages
from benchmarks.pages import table
from benchmarks.shapes import model_names
from benchmarks.targets import OVERLOAD_TTFT_S, REPO, VLLM_NO_GGUF

# The CPU kinds the project meets (kernels/isa.py), in the order of their sections in BENCHMARKS.md.
CPU_KINDS = {"amx": "CPU: Intel Xeon with AMX (and AVX-512 bf16)",
             "avx512": "CPU: AVX-512 with bf16, no AMX (AMD EPYC Zen 4)",
             "avx2": "CPU: AVX2 only (no AVX-512, no native bf16)"}
TARGET_ORDER = ["kvserve", "vllm", "vllm-fp32", "llamacpp-bf16", "llamacpp-f16", "llamacpp-q4_1", "llamacpp-gguf",
                "hf-static", "fake"]
TARGET_LABEL = {"kvserve": "kvserve", "vllm": "vLLM CPU", "vllm-fp32": "vLLM CPU fp32",
                "llamacpp-bf16": "llama.cpp BF16", "llamacpp-f16": "llama.cpp F16", "llamacpp-q4_1": "llama.cpp Q4_1",
                "llamacpp-gguf": "llama.cpp", "hf-static": "HF static batching"}


# ---- loading -------------------------------------------------------------------------------------------------------


class Session:
    def __init__(self, root: Path):
        self.root = root.resolve()
        meta = root / "meta.json"
        self.meta: dict = json.loads(meta.read_text()) if meta.exists() else {}

    def runs(self, target: str, job: str, prefix: str = "run") -> list[dict]:
        out = []
        for p in sorted((self.root / target / job).glob(f"{prefix}*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def _names(self) -> list[str]:
        names = set(self.meta.get("targets", {}))
        for p in self.root.iterdir():  # a target's directory holds job directories of runs (not so plots/)
            if p.is_dir() and (any(q.is_dir() and any(q.glob("run*.json")) for q in p.iterdir())
                               or (p / "baseline.json").exists()):
                names.add(p.name)
        order = {n: i for i, n in enumerate(TARGET_ORDER)}
        return sorted(names, key=lambda n: (order.get(n.partition("@")[0], len(order)), n))

    def targets(self) -> list[str]:
        """SmolLM2's targets; a shape model's are `<target>@<model>` (model_targets)."""
        return [n for n in self._names() if "@" not in n]

    def models(self) -> list[str]:
        """The shape models of the session (the suite's --models other than SmolLM2; not W6's model)."""
        names = set(self.meta.get("models", {})) | {n.partition("@")[2] for n in self._names() if "@" in n}
        return sorted(names & set(model_names()))

    def model_targets(self, model: str) -> list[str]:
        return [n for n in self._names() if n.partition("@")[2] == model]

    def smollm2_ran(self) -> bool:
        """Whether the session ran SmolLM2's workloads: a session of shape models or of W6 alone has no SmolLM2
        page to render (the last one is kept)."""
        return bool(self.targets()) or any(j.get("workload") != "W6" for j in self.meta.get("jobs", []))

    def w6_targets(self) -> list[str]:
        return [n for n in self._names() if self.runs(n, "W6-mix") or self.runs(n, "W6-alone")]

    def jobs(self, target: str) -> list[str]:
        d = self.root / target
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def cpu_kind(session: Session) -> str:
    """The session machine's kind (a key of CPU_KINDS), from the flags its ceilings recorded."""
    machine = ((session.meta.get("ceilings") or {}).get("machine")) or session.meta.get("machine") or {}
    if machine.get("isa_level") in ("avx2", "avx512"):  # a lower level run on a higher machine (KVSERVE_CPU_ISA)
        return machine["isa_level"]
    if machine.get("amx"):
        return "amx"
    return "avx512" if machine.get("avx512_bf16") else "avx2"


def _get(d: dict, path: str) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def values(runs: list[dict], path: str | Callable[[dict], Any]) -> list[float]:
    out = []
    for r in runs:
        v = path(r) if callable(path) else _get(r, path)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            out.append(float(v))
    return out


def med(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def fmt(vals: list[float], digits: int = 1, pct: bool = False) -> str:
    if not vals:
        return "-"
    scale = 100.0 if pct else 1.0
    m = statistics.median(vals) * scale
    s = f"{m:.{digits}f}" + ("%" if pct else "")
    if len(vals) > 1:
        s += f" [{min(vals) * scale:.{digits}f}-{max(vals) * scale:.{digits}f}]"
    return s


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def error_share(r: dict, kind: str) -> float:
    n = r.get("num_requests") or 0
    return (r.get("error_counts", {}).get(kind, 0) / n) if n else 0.0


def other_errors(r: dict) -> int:
    return sum(v for k, v in (r.get("error_counts") or {}).items() if k != "429")


# ---- markdown ------------------------------------------------------------------------------------------------------


class Report:
    def __init__(self, session: Session, plots_dir: Path, md_path: Path):
        self.s = session
        self.plots_dir = plots_dir
        self.md_path = md_path
        self.targets = [t for t in session.targets() if t != "hf-static"]
        self.out: list[str] = []
        self.headline: dict[str, dict[str, float | None]] = {}

    def w(self, text: str = "") -> None:
        self.out.append(text)

    def shape(self, job: str) -> dict:
        return next((j.get("shape") or {} for j in self.s.meta.get("jobs", []) if j.get("name") == job), {})

    def label(self, t: str) -> str:
        base, _, model = t.partition("@")
        return TARGET_LABEL.get(base, base) + (f", {model}" if model else "")

    def missing(self, job: str) -> list[str]:
        return [self.label(t) for t in self.targets if not self.s.runs(t, job)]

    def note_missing(self, *jobs: str) -> None:
        miss = sorted({m for j in jobs for m in self.missing(j)})
        if miss:
            self.w(f"\nNo results for: {', '.join(miss)}.")

    # -- sections ------------------------------------------------------------------------------------------------------

    def header(self) -> None:
        m = self.s.meta
        kind = cpu_kind(self.s)
        self.w(f"## {CPU_KINDS[kind]}")
        self.w()
        self.w("Generated by `python -m benchmarks.report` from the suite session "
               f"`{self.s.root.name}` (`bench_results/`, not committed) on a machine of this kind; kept in "
               f"`docs/bench/cpu/{kind}.md` until a session on such a machine renders it again.")
        level = (((m.get("ceilings") or {}).get("machine")) or {}).get("isa_level", "native")
        if level != "native":
            self.w()
            self.w(f"**Emulated: no machine of this kind was available.** This session ran on a CPU of a higher kind "
                   f"with every engine held to the {level} instruction set: kvserve by `KVSERVE_CPU_ISA={level}` "
                   "(its kernels built for that level, torch's dispatch capped), vLLM by the same torch caps and "
                   "its CPU probes masked (`benchmarks/isa_cap`), llama.cpp by a build for that level. Cores, "
                   "clocks, caches and memory are the higher machine's, so the absolute figures are not those of a "
                   "real machine of this kind; the engines' ratios are the point.")
        if m.get("quick"):
            self.w()
            self.w("**This is a `--quick` session: tiny sizes to smoke-test the pipeline. The numbers mean nothing.**")
        self.w()
        g = m.get("git") or {}
        self.w(f"- Session started {m.get('started', '?')}, finished {m.get('finished', 'not finished')}; "
               f"commit `{(g.get('commit') or '?')[:12]}`{' (with uncommitted changes)' if g.get('dirty') else ''}.")
        self.w(f"- Workloads {', '.join(m.get('workloads', []))}, {m.get('runs', '?')} run(s) each with a distinct "
               "seed; tables give the median of the runs and [min-max] when there are several. Workload "
               "definitions: `shared/WORKLOADS.md`" + ("; W6's in `benchmarks/suite.py`, its figures on its own "
                                                       "page (W6 below)." if "W6" in m.get("workloads", []) else "."))
        self.w("- Client for every engine: `kvserve bench serve` (streaming, `include_usage`, vLLM's metric "
               "definitions: TTFT = first streamed token chunk, TPOT = (e2e - TTFT)/(output tokens - 1) per request, "
               "ITL = gaps between chunks, throughput = tokens / benchmark duration). Latencies in ms.")
        self.w("- Engines ran one after the other on the same machine, each started and stopped by the suite, "
               "the client on the same cores as the server.")

    def machine(self) -> None:
        m = self.s.meta
        c = m.get("ceilings") or {}
        mach = c.get("machine") or {}
        self.w("\n### Machine\n")
        if not c:
            self.w("Machine ceilings were not measured in this session.")
            return
        flags = ", ".join(f for f in ("avx512f", "avx512_bf16", "amx") if mach.get(f)) or "none of avx512f/bf16/amx"
        self.w(f"- CPU: {mach.get('cpu_model', '?')}, {mach.get('nproc', '?')} cores visible, "
               f"{mach.get('mem_gib', '?')} GiB RAM; {flags}. Load average at the start: "
               f"{' '.join(mach.get('loadavg', []))}.")
        self.w(f"- torch {c.get('torch')}, {c.get('torch_threads')} threads, CPU capability {c.get('cpu_capability')}; "
               f"Python {mach.get('python')}.")
        params = (m.get("model_params") or {}).get("params") or 134_515_008
        self.w()
        rows = []
        for name in ("bf16", "fp32"):
            f = c.get(f"matmul_{name}_flops")
            if f:
                size = c.get(f"matmul_{name}_n", c.get("matmul_n"))
                rows.append([f"{name} matmul, {size}x{size} (best / median)",
                             f"{f / 1e9:.1f} / {c.get(f'matmul_{name}_flops_median', f) / 1e9:.1f} GFLOP/s",
                             f"{f / (2 * params):.0f} tok/s"])
        if c.get("copy_bytes_per_s"):
            rows.append([f"copy bandwidth, {c.get('copy_mib')} MiB fp32 tensor (read + write; best / median)",
                         f"{c['copy_bytes_per_s'] / 1e9:.1f} / {c.get('copy_bytes_per_s_median', 0) / 1e9:.1f} GB/s",
                         "-"])
        self.w(table(["ceiling (torch, this session)", "measured", "tokens/s ceiling = FLOP/s / (2 x params)"], rows))
        self.w(f"\nParameters: {params / 1e6:.1f} M ({(m.get('model_params') or {}).get('model', 'SmolLM2-135M')}, "
               "tied embeddings counted once). Measured by `" + m.get("ceilings_command", "python -m "
                                                                     "benchmarks.ceilings") + "`.")

    def engines(self) -> None:
        self.w("\n### Engines\n")
        rows = []
        for t in self.s.targets():
            info = (self.s.meta.get("targets") or {}).get(t, {})
            status = info.get("status", "?")
            if info.get("reason"):
                status += f": {info['reason']}"
            startups = ", ".join(f"{v} {s.get('startup_s')} s" for v, s in (info.get("servers") or {}).items()
                                 if s.get("startup_s") is not None)
            rows.append([self.label(t), info.get("engine", "?"), str(info.get("dtype", "?")),
                         str(info.get("threads", "?")), startups or "-", status])
        self.w(table(["target", "engine", "dtype / weights", "threads", "startup to ready", "status"], rows))
        capped = [f"{self.label(t)}: {info['isa']}" for t in self.s.targets()
                  if (info := (self.s.meta.get("targets") or {}).get(t, {})).get("isa")]
        if capped:
            self.w("\nInstruction set, per engine:\n\n" + "\n".join(f"- {line}" for line in capped))

    def w1_w2(self) -> None:
        self.w("\n### W1 throughput and W2 single-stream latency\n")
        c = self.s.meta.get("ceilings") or {}
        params = (self.s.meta.get("model_params") or {}).get("params") or 134_515_008
        ceil_bf16 = (c.get("matmul_bf16_flops") or 0) / (2 * params) or None
        if cpu_kind(self.s) == "avx2":  # no bf16 arithmetic: torch's bf16 matmul is no ceiling of anything
            ceil_bf16 = None
        ceil_fp32 = (c.get("matmul_fp32_flops") or 0) / (2 * params) or None
        rows = []
        for t in self.targets:
            w1, w2 = self.s.runs(t, "W1"), self.s.runs(t, "W2")
            out_tps = values(w1, "output_throughput")
            h = self.headline.setdefault(t, {})
            h["W1 out tok/s"] = med(out_tps)
            h["W2 TTFT p50"] = med(values(w2, "median_ttft_ms"))
            h["W2 TPOT p50"] = med(values(w2, "median_tpot_ms"))
            frac = f"{med(out_tps) / ceil_bf16:.1%}" if out_tps and ceil_bf16 else "-"
            tot = values(w1, "total_token_throughput")
            frac_tot = f"{med(tot) / ceil_bf16:.1%}" if tot and ceil_bf16 else "-"
            frac_fp32 = f"{med(tot) / ceil_fp32:.0%}" if tot and ceil_fp32 else "-"
            rows.append([self.label(t), fmt(out_tps), fmt(values(w1, "request_throughput"), 3), fmt(tot),
                         f"{frac} / {frac_tot}", frac_fp32, fmt(values(w1, "median_ttft_ms"), 0),
                         fmt(values(w1, "median_tpot_ms")), fmt(values(w2, "median_ttft_ms"), 0),
                         fmt(values(w2, "median_tpot_ms")), fmt(values(w2, "median_itl_ms")),
                         str(sum(r.get("failed", 0) for r in w1 + w2))])
        self.w(table(["target", "W1 out tok/s", "W1 req/s", "W1 total tok/s",
                      "W1 out / total tok/s vs bf16 ceiling", "W1 total tok/s vs fp32 ceiling",
                      "W1 TTFT p50", "W1 TPOT p50", "W2 TTFT p50",
                      "W2 TPOT p50", "W2 ITL p50", "failed"], rows))
        s1, s2 = self.shape("W1"), self.shape("W2")
        if s1 and s2:
            self.w(f"\nW1: {s1['num_prompts']} requests, {s1['input']} prompt / {s1['output']} output tokens "
                   f"(`ignore_eos`), at most {s1['max_concurrency']} in flight. W2: {s2['num_prompts']} requests, "
                   f"{s2['input']} / {s2['output']}, one at a time.")
        self.w("The ceiling is the bf16 matmul peak over "
               "2 x parameters (decode-only arithmetic, no attention); prefill tokens cost the same FLOPs per "
               "token, hence the second figure. The fp32 column sets all tokens against torch's fp32 matmul peak, "
               "the compute ceiling of a CPU without bf16 arithmetic (a share of output tokens against the same "
               "ceiling's output share gives the same figure).")
        self.note_missing("W1", "W2")

    def w3(self) -> None:
        self.w("\n### W3 tier isolation\n")
        rows = []
        for t in self.targets:
            flood, alone = self.s.runs(t, "W3-flood"), self.s.runs(t, "W3-alone")
            fi = "tiers.interactive."
            h = self.headline.setdefault(t, {})
            h["W3 TTFT p99 (flood)"] = med(values(flood, fi + "p99_ttft_ms"))
            rows.append([self.label(t), fmt(values(flood, fi + "median_ttft_ms"), 0),
                         fmt(values(flood, fi + "p99_ttft_ms"), 0), fmt(values(alone, fi + "median_ttft_ms"), 0),
                         fmt(values(alone, fi + "p99_ttft_ms"), 0), fmt(values(flood, fi + "median_tpot_ms")),
                         fmt(values(flood, "tiers.batch.streamed_output_throughput")),
                         fmt(values(flood, "tiers.batch.output_throughput")),
                         fmt(values(flood, fi + "completed"), 0),
                         str(sum((_get(r, fi + "failed") or 0) for r in flood + alone))])
        self.w(table(["target", "interactive TTFT p50, with flood", "p99, with flood", "TTFT p50, alone",
                      "p99, alone", "interactive TPOT p50, with flood", "batch out tok/s (streamed)",
                      "batch out tok/s (completed only)",
                      "interactive requests / run", "interactive failed"], rows))
        shape = self.shape("W3-flood")
        if shape:
            self.w(f"\nInteractive tier: chat requests (~{shape['interactive_io'][0]} prompt tokens with the chat "
                   f"template / {shape['interactive_io'][1]} output) at {shape['interactive_rate']} request/s, "
                   f"evenly spaced, for {shape['duration']} s (`priority: interactive`). Flood: "
                   f"{shape['batch_concurrency']} batch requests always in flight "
                   f"({shape['batch_io'][0]} / {shape['batch_io'][1]} tokens, `priority: batch`), cancelled when "
                   "the interactive requests are done. Its streamed tokens/s counts every token the batch requests "
                   "received in the run, also those of the requests cut off at the end; the completed-only figure "
                   "counts finished requests, so it moves in steps of whole requests. "
                   "Engines without priorities (the peers, unless BENCH_VLLM_PRIORITY=1) get no priority field.")
        self.note_missing("W3-flood", "W3-alone")
        if (self.plots_dir / "w3_ttft_cdf.png").exists():
            self.w(f"\n![W3 TTFT CDF]({self.rel(self.plots_dir / 'w3_ttft_cdf.png')})")

    def w4(self) -> None:
        self.w("\n### W4 prefix reuse\n")
        rows = []
        for t in self.targets:
            on, off = self.s.runs(t, "W4"), self.s.runs(t, "W4-nocache")
            a, b = med(values(on, "median_ttft_ms")), med(values(off, "median_ttft_ms"))
            self.headline.setdefault(t, {})["W4 TTFT p50"] = a
            cached = values(on, "cached_prompt_tokens")
            total = values(on, "total_input_tokens")
            hit = f"{sum(cached) / sum(total):.0%}" if cached and total and sum(total) else "-"
            rows.append([self.label(t), fmt(values(on, "median_ttft_ms"), 0), fmt(values(off, "median_ttft_ms"), 0),
                         ratio(b, a), hit, fmt(values(on, "output_throughput")),
                         fmt(values(off, "output_throughput"))])
        self.w(table(["target", "TTFT p50, reuse on", "TTFT p50, reuse off", "speed-up", "cached prompt tokens "
                      "(server usage)", "out tok/s on", "out tok/s off"], rows))
        s4 = self.shape("W4")
        if s4:
            self.w(f"\n{s4['num_prompts']} requests sharing a {s4['prefix']}-token prefix, each with its own "
                   f"{s4['suffix']} tokens, {s4['output']} output, {s4['max_concurrency']} in flight.")
        self.w("Reuse off: kvserve `enable_prefix_caching = false`, vLLM `--no-enable-prefix-caching`, llama.cpp "
               "`--no-cache-prompt` (on: its slot prompt cache).")
        self.note_missing("W4", "W4-nocache")

    def w5(self) -> None:
        self.w("\n### W5 overload\n")
        rows = []
        for t in self.targets:
            runs = self.s.runs(t, "W5")
            def offered(r: dict) -> float | None:
                return (r.get("config", {}).get("tiers") or [{}])[0].get("request_rate")

            def goodput_share(r: dict) -> float | None:  # goodput over the W1 rate the offered load is 3x of
                rate, good = offered(r), r.get("request_goodput")
                return good / (rate / 3) if rate and good is not None else None

            rate, good, share = values(runs, offered), values(runs, "request_goodput"), values(runs, goodput_share)
            self.headline.setdefault(t, {})["W5 goodput"] = med(good)
            rows.append([self.label(t), fmt(rate, 2), fmt(values(runs, "num_requests"), 0), fmt(good, 2),
                         fmt(share, 1, pct=True),
                         fmt(values(runs, "request_throughput"), 2),
                         fmt(values(runs, lambda r: error_share(r, "429")), 1, pct=True),
                         fmt(values(runs, other_errors), 0), fmt(values(runs, "median_ttft_ms"), 0),
                         fmt(values(runs, "p99_ttft_ms"), 0)])
        self.w(table(["target", "offered req/s (3x W1)", "requests sent", "goodput req/s (TTFT <= 1 s)",
                      "goodput / W1 req/s", "completed req/s", "429 share", "other errors", "TTFT p50 (admitted)", "TTFT p99"], rows))
        s5 = self.shape("W5") or {"duration": "?"}
        self.w(f"\nPoisson arrivals at 3x the request rate W1 sustained on the same engine, for {s5['duration']} s; "
               "requests in flight at the end finish. Goodput = requests whose TTFT was at most 1 s, per "
               "second of the run. kvserve runs it with its shipped interactive admission bound, "
               f"`interactive = {{max_ttft_s = {OVERLOAD_TTFT_S}}}` (refuse a request whose estimated time to first "
               "token is longer; the rest of the second is left for HTTP, delivery and the estimate's spread); "
               "W1-W4 lift it, as the peers refuse nothing.")
        self.note_missing("W5")

    def ratios(self) -> None:
        peers = [t for t in self.targets if t != "kvserve"]
        if "kvserve" not in self.headline or not peers:
            return
        self.w("\n### kvserve against each peer\n")
        metrics = [("W1 out tok/s", "higher"), ("W2 TTFT p50", "lower"), ("W2 TPOT p50", "lower"),
                   ("W3 TTFT p99 (flood)", "lower"), ("W4 TTFT p50", "lower"), ("W5 goodput", "higher")]
        rows = []
        ours = self.headline["kvserve"]
        for name, better in metrics:
            row = [f"{name} ({better} is better)", "-" if ours.get(name) is None else f"{ours[name]:.1f}"]
            for p in peers:
                row.append(ratio(ours.get(name), self.headline.get(p, {}).get(name)))
            rows.append(row)
        self.w(table(["figure", "kvserve"] + [f"kvserve / {self.label(p)}" for p in peers], rows))

    def sweep(self) -> None:
        self.w("\n### Throughput against concurrency\n")
        if (self.plots_dir / "throughput_vs_concurrency.png").exists():
            self.w(f"![throughput against concurrency]({self.rel(self.plots_dir / 'throughput_vs_concurrency.png')})\n")
        rows = []
        concs = sorted({int(j[len("SWEEP-c"):]) for t in self.targets for j in self.s.jobs(t)
                        if j.startswith("SWEEP-c")})
        if not concs:
            self.w("No sweep in this session.")
            return
        for t in self.targets:
            rows.append([self.label(t)] + [fmt(values(self.s.runs(t, f"SWEEP-c{c}"), "output_throughput"))
                                           for c in concs])
        self.w(table(["target"] + [f"c={c}" for c in concs], rows))
        s = self.shape(f"SWEEP-c{concs[0]}") or {"input": "?", "output": "?"}
        self.w(f"\nOutput tokens/s, {s['input']} / {s['output']} tokens, 2 x c requests (at least 8, or 4 with "
               "--quick), at most c in flight; one run each.")

    def client_check(self) -> None:
        rows = []
        for job in ("W1", "W2"):
            ours, theirs = self.s.runs("kvserve", job), self.s.runs("kvserve", job, prefix="vllm-client-run")
            if not theirs:
                continue
            for key, label, d in (("output_throughput", "out tok/s", 1), ("request_throughput", "req/s", 3),
                                  ("median_ttft_ms", "TTFT p50", 0), ("p99_ttft_ms", "TTFT p99", 0),
                                  ("median_tpot_ms", "TPOT p50", 1), ("median_itl_ms", "ITL p50", 1),
                                  ("median_e2el_ms", "E2E p50", 0)):
                a, b = values(ours, key), values(theirs, key)
                rows.append([job, label, fmt(a, d), fmt(b, d), ratio(med(a), med(b))])
        self.w("\n### Client agreement: `kvserve bench serve` against `vllm bench serve`\n")
        if not rows:
            self.w("Not measured in this session (needs BENCH_PEERS=1 and vLLM installed: the suite then runs "
                   "`vllm bench serve` against kvserve right after each W1/W2 run of our client, same shape).")
            return
        self.w(table(["workload", "figure", "kvserve bench serve", "vllm bench serve", "ratio"], rows))
        self.w("\nSame server, same workload shape, interleaved runs (ours, then vLLM's, per seed). Differences "
               "within the run-to-run spread of either client are noise.")

    def hf_static(self) -> None:
        p = self.s.root / "hf-static" / "baseline.json"
        self.w("\n### Hugging Face static batching (no server)\n")
        if not p.exists():
            info = (self.s.meta.get("targets") or {}).get("hf-static")
            self.w("Not run in this session" + (f" ({info.get('status')}: {info.get('reason', '')})." if info else "."))
            return
        data = json.loads(p.read_text())
        rows = [[r["dtype"], str(r["batch"]), f"{r['gen_s_median']:.2f}", f"{r['out_tok_per_s']:.1f}",
                 f"{r['prefill_s_median']:.2f}", f"{r['decode_tok_per_s']:.1f}"] for r in data.get("results", [])]
        self.w(table(["dtype", "batch", "generate s", "out tok/s", "prefill s", "decode-only tok/s"], rows))
        self.w(f"\n`model.generate`, greedy, B prompts of {data.get('in_len')} tokens, exactly {data.get('out_len')} "
               f"new tokens, median of {data.get('reps')}; torch {data.get('torch')}, {data.get('torch_threads')} "
               "threads. Compare B=32 with W1 and B=1 with W2.")

    def commands(self) -> None:
        self.w("\n### Exact commands\n")
        self.w("Reproduce everything: `make bench` (kvserve) or `BENCH_PEERS=1 make bench` (all engines; a "
               "missing peer is skipped unless `BENCH_PEERS_SETUP=1`). Per engine, the servers and the first "
               "run's client command of each workload (`--seed` goes up by one per run; `$SESSION` is the "
               "results directory; the kvserve token is passed in `KVSERVE_API_KEY`):")
        self.target_commands(self.s.targets(), "####")

    def target_commands(self, targets: list[str], heading: str) -> None:
        """Per target: its server commands, the first run's client command of each job, kvserve's config."""
        for t in targets:
            info = (self.s.meta.get("targets") or {}).get(t, {})
            if not info.get("servers") and not info.get("commands"):
                continue
            self.w(f"\n{heading} {self.label(t)}\n")
            self.w("```bash")
            for v, s in (info.get("servers") or {}).items():
                self.w(f"# server ({v})")
                self.w(s.get("command", "?"))
            for name, cmd in (info.get("commands") or {}).items():
                self.w(f"# {name}")
                self.w(cmd)
            self.w("```")
            notes = [s.get("note") for s in (info.get("servers") or {}).values() if s.get("note")]
            if notes:
                self.w("\n```toml\n" + notes[0].split(":\n", 1)[-1].rstrip() + "\n```")

    def rel(self, p: Path) -> str:
        try:
            return str(p.resolve().relative_to(self.md_path.resolve().parent))
        except ValueError:
            return str(p)

    def render(self) -> str:
        self.header()
        self.machine()
        self.engines()
        self.w1_w2()
        self.w3()
        self.w4()
        self.w5()
        self.sweep()
        self.ratios()
        self.client_check()
        self.hf_static()
        self.commands()
        return "\n".join(self.out) + "\n"


class LargerModels(Report):
    """The kind's "Larger models" page: random-weight GGUFs in real models' shapes (benchmarks.shapes), served
    as the same file by kvserve and llama.cpp; speed set against the floor that streaming the weights sets."""

    COLUMNS = ["W1 out tok/s", "W1 TTFT p50", "W2 TTFT p50", "W2 TPOT p50", "RSS GB", "GB read / token",
               "floor ms", "floor / TPOT"]

    def figures(self, t: str) -> list[tuple[list[float], int, bool]]:
        """(values over runs, digits, as percent) per column."""
        info = (self.s.meta.get("targets") or {}).get(t, {})
        w1, w2 = self.s.runs(t, "W1"), self.s.runs(t, "W2")
        bw = self.bandwidth(t.partition("@")[2])
        per_token = info.get("bytes_per_token")
        floor_ms = per_token / bw * 1e3 if per_token and bw else None
        tpot = values(w2, "median_tpot_ms")
        return [(values(w1, "output_throughput"), 1, False), (values(w1, "median_ttft_ms"), 0, False),
                (values(w2, "median_ttft_ms"), 0, False), (tpot, 1, False),
                ([info["rss_bytes"] / 1e9] if info.get("rss_bytes") else [], 2, False),
                ([per_token / 1e9] if per_token else [], 2, False),
                ([floor_ms] if floor_ms else [], 1, False),
                ([floor_ms / x for x in tpot if x] if floor_ms else [], 0, True)]

    def bandwidth(self, model: str) -> float | None:
        """The copy bandwidth measured by the suite invocation that ran this model (sessions before it was
        recorded per model: the session's last)."""
        rec = (self.s.meta.get("models") or {}).get(model) or {}
        return rec.get("copy_bytes_per_s") or (self.s.meta.get("ceilings") or {}).get("copy_bytes_per_s")

    def model_rows(self, model: str) -> list[list[str]]:
        rows, figs = [], {}
        for t in self.s.model_targets(model):
            if not self.s.jobs(t):  # nothing ran: under "Not run"
                continue
            figs[t] = self.figures(t)
            info = (self.s.meta.get("targets") or {}).get(t, {})
            engine = t.partition("@")[0]
            rows.append([model, TARGET_LABEL.get(engine, engine), info.get("weights_form", "-")]
                        + [fmt(v, d, pct=p) for v, d, p in figs[t]])
        ours, theirs = figs.get(f"kvserve@{model}"), figs.get(f"llamacpp-gguf@{model}")
        if ours and theirs:
            ratios = [ratio(med(a[0]), med(b[0])) for a, b in zip(ours, theirs)]
            rows.append([model, "kvserve / llama.cpp", ""] + ratios[:-1] + ["-"])  # no ratio of two shares
        return rows

    def sizes(self) -> str:
        """W1's and W2's sizes per shape (the suite's SIZES), from the jobs the session ran."""
        said: dict[str, str] = {}
        for model, rec in (self.s.meta.get("models") or {}).items():
            jobs = {j["name"]: j.get("shape") or {} for j in rec.get("jobs", [])}
            parts = []
            if "W1" in jobs:
                parts.append(f"W1 {jobs['W1']['num_prompts']} requests, at most {jobs['W1']['max_concurrency']} "
                             "in flight")
            if "W2" in jobs:
                parts.append(f"W2 {jobs['W2']['num_prompts']} requests, one at a time")
            if parts:
                io_ = next(iter(jobs.values()))
                said[model.rpartition(".")[0]] = (f"{'; '.join(parts)}; {io_['input']} prompt / {io_['output']} "
                                                 "output tokens each (`ignore_eos`)")
        return ". ".join(f"{shape}: {text}" for shape, text in said.items())

    def why_not(self, t: str) -> str:
        info = (self.s.meta.get("targets") or {}).get(t, {})
        errors = [s["error"].splitlines()[0] for s in (info.get("servers") or {}).values() if s.get("error")]
        return info.get("reason") or (errors[0] if errors else info.get("status", "no results"))

    def render(self) -> str:
        m = self.s.meta
        mach = ((m.get("ceilings") or {}).get("machine")) or {}
        g = m.get("git") or {}
        from benchmarks.shapes import SHAPES, ShapeModel

        shapes = [SHAPES[ShapeModel.parse(model).shape] for model in self.s.models()]
        real = " and ".join(dict.fromkeys(s.model for s in shapes))
        self.w(f"### Larger models: {real} shapes, random weights\n")
        if m.get("quick"):
            self.w("**A `--quick` session: tiny sizes to smoke-test the pipeline. The numbers mean nothing.**\n")
        merged = m.get("merged_from") or []  # sessions of other shapes, each run in one go (see their own lines)
        sessions = "; ".join(f"`{x['session']}` (started {x['started']}, commit `{x['commit'][:12]}`: "
                             f"{', '.join(x['models'])})" for x in merged)
        vocab = "; ".join(f"{s.model}'s padded to {s.vocab}" for s in shapes if s.vocab) or "none padded"
        self.w(f"From the suite session `{self.s.root.name}` (started {m.get('started', '?')}, commit "
               f"`{(g.get('commit') or '?')[:12]}`{' with uncommitted changes' if g.get('dirty') else ''})"
               + (f", with the shapes of {sessions} added" if merged else "") + " on "
               f"{mach.get('cpu_model', '?')}, {mach.get('nproc', '?')} cores. GGUF files with the real models' "
               f"shapes, random weights and SmolLM2's vocabulary ({vocab}; `python -m benchmarks.shapes`: written at Q8_0, "
               "quantized to Q4_K_M by llama.cpp's `llama-quantize`); they serve at the real models' speed (the same "
               "bytes and FLOPs per token), their text is noise. kvserve (engine defaults, so `weights = auto`, "
               "unless its config below says otherwise) and llama.cpp's `llama-server` (`-np 32 -c 16384 "
               "--no-cache-prompt`) serve the same file, one after the other, with the same client as the SmolLM2 "
               "tables. Medians over the runs, [min-max] when there are several; latencies in ms.\n")
        rows = [row for model in self.s.models() for row in self.model_rows(model)]
        self.w(table(["model", "engine", "weights"] + self.COLUMNS, rows))
        if self.sizes():
            self.w(f"\n{self.sizes()}.")
        recorded = {model for model, rec in (m.get("models") or {}).items() if rec.get("copy_bytes_per_s")}
        bws = {model: self.bandwidth(model) for model in self.s.models()}
        said = "; ".join(f"{model} {b / 1e9:.1f} GB/s" + ("" if model in recorded else " (not recorded per model: "
                                                          "the session's last measurement)")
                         for model, b in bws.items() if b) or "not measured"
        self.w("\nFloor: the bytes a decode step reads per token over the copy bandwidth measured by the suite "
               f"invocation that ran the model ({said}, `benchmarks.ceilings`: a tensor copy, bytes "
               "read + written), the time a step would take if it did nothing but stream the weights once. kvserve "
               "reads the weights it holds but a mixture's unused experts (its load log: `weights: <forms>, N GB held, "
               "M GB read per token`); llama.cpp the GGUF's tensors (gguf's reader; token_embd left out where the "
               "file has an output.weight, as only the prompt's rows of it are read; of a mixture's stacked expert "
               "tensors, the share of the experts a token uses). floor / TPOT: the share of W2's time per output token (one sequence: one step per "
               "token) that streaming the weights accounts for. RSS: the server process's VmRSS after load and "
               "warm-up, its KV pool included (kvserve's `kv_cache_memory`, 2 GiB by default, and its host swap pool, "
               "`swap_space`, 1 GiB; llama.cpp's 16384 F16 cells) and, for llama.cpp, the pages of the file it maps. Ratios: kvserve's figure over llama.cpp's "
               "(tok/s: higher is better; the rest: lower).")
        targets = [t for model in self.s.models() for t in self.s.model_targets(model)]
        not_run = [f"{self.label(t)}: {self.why_not(t)}" for t in targets if not self.s.jobs(t)]
        if not any(t.startswith("vllm") for t in targets):
            not_run.append(f"vLLM CPU: {VLLM_NO_GGUF}")
        self.w("\nNot run:\n\n" + "\n".join(f"- {line}" for line in not_run))
        self.w("\n#### Commands\n")
        self.w("```bash")
        made_by: dict[str, list[str]] = {}  # one command may have run several models
        for model, rec in (m.get("models") or {}).items():
            made_by.setdefault(rec.get("command", "?"), []).append(f"{model}: {rec.get('file', '?')}")
        for command, files in made_by.items():
            self.w(f"# {'; '.join(files)}\n{command}")
        self.w("```")
        self.target_commands(targets, "#####")
        return "\n".join(self.out) + "\n"


# ---- W6: long documents beside interactive work, its own page --------------------------------------------------------

W6_TARGET_MS = 1000.0  # interactive TTFT p99 beside the documents


def w6_document_ttfts(runs: list[dict], sizes: list[int]) -> dict[int, list[float]]:
    """The TTFTs (s) of the completed documents by size, pooled over the runs (a document cut off at the end has
    none)."""
    out: dict[int, list[float]] = {n: [] for n in sizes}
    for r in runs:
        for tier, n, ttft, err in zip(r.get("tier_of", []), r.get("input_lens", []), r.get("ttfts", []),
                                      r.get("errors", [])):
            if tier == "documents" and not err and ttft > 0 and sizes:
                out[min(sizes, key=lambda size: abs(size - n))].append(ttft)
    return out


def w6_figures(session: Session, t: str, shape: dict) -> dict:
    """A target's W6 figures, per run (documents' TTFTs pooled by size)."""
    mix, alone = session.runs(t, "W6-mix"), session.runs(t, "W6-alone")
    i, d = "tiers.interactive.", "tiers.documents."

    def stream(runs: list[dict]) -> dict:
        return {"ttft_p50_ms": values(runs, i + "median_ttft_ms"), "ttft_p99_ms": values(runs, i + "p99_ttft_ms"),
                "tpot_p50_ms": values(runs, i + "median_tpot_ms"), "completed": values(runs, i + "completed"),
                "failed": values(runs, i + "failed")}

    beside = stream(mix)
    p99 = med(beside["ttft_p99_ms"])
    return {"runs": len(mix), "interactive_alone": stream(alone), "interactive_beside_w6": beside,
            "target_met": None if p99 is None else p99 < W6_TARGET_MS,
            "documents": {"completed": values(mix, d + "completed"), "cancelled": values(mix, d + "cancelled"),
                          "failed": values(mix, d + "failed"),
                          "ttft_s_by_size": {str(n): v for n, v in
                                             w6_document_ttfts(mix, shape.get("documents") or []).items()},
                          "tokens_per_s": values(mix, d + "total_token_throughput"),
                          "output_tokens_per_s": values(mix, d + "output_throughput"),
                          "tpot_p50_ms": values(mix, d + "median_tpot_ms")}}


def w6_page(session: Session) -> tuple[str, dict] | None:
    """W6's page and its JSON from the session's W6 runs; None without any."""
    targets = session.w6_targets()
    if not targets:
        return None
    m = session.meta
    shape = next((j.get("shape") or {} for j in m.get("jobs", []) if j.get("name") == "W6-mix"), {})
    mach = ((m.get("ceilings") or {}).get("machine")) or {}
    flags = [f for f in ("avx512f", "avx512_bf16", "amx") if mach.get(f)]
    infos = {t: (m.get("targets") or {}).get(t, {}) for t in targets}
    g = m.get("git") or {}
    data = {"session": session.root.name, "started": m.get("started"), "finished": m.get("finished"),
            "quick": bool(m.get("quick")),
            "command": "python -m benchmarks.suite " + " ".join((m.get("argv") or [])[1:]),
            "commit": g.get("commit"), "dirty": g.get("dirty"),
            "machine": {"cpu_model": mach.get("cpu_model"), "nproc": mach.get("nproc"), "flags": flags,
                        "loadavg": mach.get("loadavg")},
            "shape": shape, "target_ttft_p99_ms": W6_TARGET_MS,
            "targets": {t: w6_figures(session, t, shape) for t in targets},
            "server_commands": {t: (infos[t].get("servers") or {}).get("default", {}).get("command") for t in targets},
            "client_commands": {t: {j: c for j, c in (infos[t].get("commands") or {}).items() if j.startswith("W6")}
                                for t in targets}}
    label = {t: TARGET_LABEL.get(t.partition("@")[0], t.partition("@")[0]) for t in targets}
    out = ["# W6: long documents beside interactive work", ""]
    if data["quick"]:
        out += ["**A `--quick` session: tiny sizes to smoke-test the pipeline. The numbers mean nothing.**", ""]
    out += [f"Measured {m.get('started', '?')} to {m.get('finished', 'not finished')} on {mach.get('cpu_model', '?')} "
            f"({mach.get('nproc', '?')} CPUs visible; {', '.join(flags) or 'none of avx512f/bf16/amx'}; load average "
            f"at the start {' '.join(mach.get('loadavg') or []) or '?'}), suite session `{data['session']}`, commit "
            f"`{(g.get('commit') or '?')[:12]}`{' (with uncommitted changes)' if g.get('dirty') else ''}: "
            f"`{data['command']}`.", ""]
    if shape:
        args = ", ".join(f"{k} = {v}" for k, v in (shape.get("engine_args") or {}).items())
        out += [f"Model: `{shape.get('model')}` (Gemma 3 270M, Q4_K_M GGUF) served by kvserve with {args}. "
                f"Documents of {', '.join(map(str, shape['documents']))} tokens in turn (standard-library Python source, then "
                f"a request to summarize it in one sentence; {shape['document_output']} output tokens, "
                f"`ignore_eos`), {shape['document_concurrency']} in flight at `priority: batch`, beside W3's "
                f"interactive stream (chat, ~{shape['interactive_io'][0]} prompt tokens with the template / "
                f"{shape['interactive_io'][1]} output, {shape['interactive_rate']} request/s, `priority: "
                f"interactive`) for {shape['duration']} s, the documents in flight then cut off; then the stream "
                f"alone for {shape['alone_duration']} s. Medians over the runs, [min-max] when there are several.", ""]
    rows, docs = [], []
    for t in targets:
        f = data["targets"][t]
        for name, key in (("alone", "interactive_alone"), ("beside W6", "interactive_beside_w6")):
            x = f[key]
            rows.append([label[t], name, fmt(x["ttft_p50_ms"], 0), fmt(x["ttft_p99_ms"], 0), fmt(x["tpot_p50_ms"]),
                         fmt(x["completed"], 0), fmt(x["failed"], 0)])
        for size, ttfts in sorted(f["documents"]["ttft_s_by_size"].items(), key=lambda kv: int(kv[0])):
            rate = [int(size) / v for v in ttfts]
            docs.append([label[t], size, str(len(ttfts)), fmt(ttfts), fmt(rate, 0)])
    out += [table(["target", "interactive stream", "TTFT p50, ms", "TTFT p99, ms", "TPOT p50, ms", "requests / run",
                   "failed / run"], rows), ""]
    for t in targets:
        f = data["targets"][t]
        p99 = med(f["interactive_beside_w6"]["ttft_p99_ms"])
        verdict = "no figure" if p99 is None else f"**{'met' if f['target_met'] else 'not met'}** ({p99:.0f} ms)"
        dd = f["documents"]
        out.append(f"- {label[t]}: interactive TTFT p99 < {W6_TARGET_MS / 1000:g} s beside W6: {verdict}. Documents "
                   f"completed per run {fmt(dd['completed'], 0)} (cut off at the end {fmt(dd['cancelled'], 0)}, failed "
                   f"{fmt(dd['failed'], 0)}); their tokens/s over the run {fmt(dd['tokens_per_s'])} (prompt + output; "
                   f"output alone {fmt(dd['output_tokens_per_s'], 2)}), their TPOT p50 {fmt(dd['tpot_p50_ms'])} ms.")
    out += ["", "Documents' time to first token by size, every completed document of every run (those cut off at the "
                "end have none):", "",
            table(["target", "document, tokens", "completed", "TTFT, s (median [min-max])",
                   "prompt tokens/s (size / TTFT)"], docs), ""]
    for t in targets:
        out.append(f"- {label[t]} server: `{data['server_commands'][t]}`")
        for job, cmd in data["client_commands"][t].items():
            out.append(f"- {label[t]} {job}: `{cmd}`")
    return "\n".join(out) + "\n", data


# ---- plots -----------------------------------------------------------------------------------------------------------


def plots(session: Session, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    targets = [t for t in session.targets() if t != "hf-static"]
    quick = " (--quick: not real numbers)" if session.meta.get("quick") else ""

    # throughput against concurrency
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_line = False
    for t in targets:
        pts = []
        for job in session.jobs(t):
            if job.startswith("SWEEP-c"):
                v = values(session.runs(t, job), "output_throughput")
                if v:
                    pts.append((int(job[len("SWEEP-c"):]), statistics.median(v)))
        if not pts:  # fall back on W2 (c=1) and W1 (c=32)
            for job, c in (("W2", 1), ("W1", 32)):
                v = values(session.runs(t, job), "output_throughput")
                if v:
                    pts.append((c, statistics.median(v)))
        if pts:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=TARGET_LABEL.get(t, t))
            any_line = True
    if any_line:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput against concurrency, 256 in / 128 out" + quick)
        ax.grid(True, alpha=0.3)
        ax.legend()
        p = out_dir / "throughput_vs_concurrency.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        made.append(p)
    plt.close(fig)

    # W3 TTFT CDF, interactive tier, with and without the flood
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_line = False
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, t in enumerate(targets):
        for job, style, what in (("W3-flood", "-", "with batch flood"), ("W3-alone", "--", "alone")):
            ttfts = []
            for r in session.runs(t, job):
                for tier, ttft, err in zip(r.get("tier_of", []), r.get("ttfts", []), r.get("errors", [])):
                    if tier == "interactive" and not err:
                        ttfts.append(ttft * 1000.0)
            if ttfts:
                ttfts.sort()
                ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
                ax.step(ttfts, ys, where="post", linestyle=style, color=colors[i % len(colors)],
                        label=f"{TARGET_LABEL.get(t, t)}, {what}")
                any_line = True
    if any_line:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("interactive TTFT (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("W3: interactive TTFT CDF" + quick)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        p = out_dir / "w3_ttft_cdf.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        made.append(p)
    plt.close(fig)
    return made


def add_report_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--session", default=str(REPO / "bench_results" / "latest"),
                    help="a session directory (default bench_results/latest)")
    ap.add_argument("--markdown", default=str(REPO / "BENCHMARKS.md"), help="default BENCHMARKS.md at the repo root")
    ap.add_argument("--plots", default=str(REPO / "docs" / "bench"), help="default docs/bench/")
    ap.add_argument("--pages-only", action="store_true",
                    help="assemble BENCHMARKS.md from the pages under --plots without rendering a session (after a "
                         "platform benchmark such as benchmarks.kv_memory wrote its page)")
    return ap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    return render(add_report_arguments(ap).parse_args(argv))


# Pages of their own benchmarks, after the CPU kinds: the quantization trade-off (benchmarks.quality --tradeoff),
# W6's (benchmarks.suite, rendered below), then the platform's (benchmarks.fleet / .metering / .batch / .planning).
BENCHMARK_PAGES = ("quality-tradeoff", "kv-memory", "loading", "long-context", "w6", "speculation", "structured",
                   "lora", "sleep", "fleet", "metering", "batch", "planning")


def with_benchmark_pages(md: str, plots: Path) -> str:
    """The pages of BENCHMARK_PAGES (docs/bench/<name>.md, from their last runs), one heading level down,
    after the suite's tables."""
    for name in BENCHMARK_PAGES:
        page = plots / f"{name}.md"
        if page.exists():
            text = "\n".join("#" + line if line.startswith("#") else line for line in page.read_text().splitlines())
            md = md.rstrip("\n") + "\n\n" + text.strip() + "\n"
    return md


INTRO = """# Benchmarks

A summary of kvserve against each peer per CPU kind, then one section per CPU kind, each generated by
`python -m benchmarks.report` from the last suite session run on a machine of that kind (`make bench` for
kvserve alone, `BENCH_PEERS=1 make bench` with the peers); a render rewrites its own kind's section
(`docs/bench/cpu/<kind>.md`, plots in `docs/bench/cpu/<kind>/`) and keeps the others, and the summary is
read from those sections. Do not edit by hand. Then the platform benchmarks' pages and a short analysis.
"""


# ---- the summary BENCHMARKS.md opens with ---------------------------------------------------------------------------

# Pages of earlier suite sessions with peers, kept beside the kinds' pages in the same layout (docs/bench/<name>):
# their rows join the summary of the kind their machine was, with the session named.
PEER_PAGES = ("peers.md",)
# (column of the W1/W2 and Larger models tables, the summary's name for it)
SUMMARY_FIGURES = (("W1 out tok/s", "W1 out tok/s"), ("W2 TPOT p50", "W2 TPOT ms"), ("W2 TTFT p50", "W2 TTFT ms"))


def page_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """A rendered page's tables, each by the heading above it (the first table under a heading), as rows of
    {column: cell}; code blocks are skipped."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading, fenced, header, rows = "", False, None, []
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            fenced = not fenced
        if header is not None and not line.startswith("|"):  # the table ended
            tables.setdefault(heading, rows)
            header, rows = None, []
        if fenced:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|---"):
            continue
        elif line.startswith("| ") and header is None:
            header = cells
        elif line.startswith("| "):
            rows.append(dict(zip(header, cells)))
    return tables


def lead(cell: str | None) -> float | None:
    """A cell's median: its figure before any [min-max]; None for "-"."""
    try:
        return float((cell or "").split(" [")[0])
    except ValueError:
        return None


def page_kind(text: str) -> str | None:
    """The CPU kind a rendered suite page was measured at: the level an emulated session was held to, else the
    flags of its machine line."""
    for line in text.splitlines():
        if line.startswith("**Emulated"):
            return next((k for k in CPU_KINDS if f"held to the {k} instruction set" in line), None)
        if line.startswith("- CPU:"):
            flags = line.rpartition(";")[2]
            return "amx" if "amx" in flags else "avx512" if "avx512_bf16" in flags else "avx2"
    return None


def summary_rows(text: str, source: str) -> list[list[str]]:
    """Per peer and model of a rendered page: kvserve's median / the peer's, and the ratio the page gives
    (computed from the medians where it gives none)."""
    tables = page_tables(text)
    groups: list[tuple[str, dict[str, dict[str, str]], dict[tuple[str, str], str]]] = []
    for heading, rows in tables.items():
        if heading.startswith("W1 throughput and W2"):
            given = {(col[len("kvserve / "):], r.get("figure", "").split(" (")[0]): v
                     for r in tables.get("kvserve against each peer", []) for col, v in r.items()
                     if col.startswith("kvserve / ")}
            groups.append(("SmolLM2-135M", {r.get("target", ""): r for r in rows}, given))
        elif heading.startswith("Larger models"):
            for model in dict.fromkeys(r.get("model", "") for r in rows):
                by_engine = {r.get("engine", ""): r for r in rows if r.get("model") == model}
                given = {(engine[len("kvserve / "):], col): v for engine, r in by_engine.items()
                         if engine.startswith("kvserve / ") for col, v in r.items()}
                groups.append((model, by_engine, given))
    out = []
    for model, by_engine, given in groups:
        ours = by_engine.get("kvserve")
        if not ours:
            continue
        for peer, theirs in by_engine.items():
            if peer.startswith("kvserve") or peer == "HF static batching":
                continue
            if all(lead(theirs.get(col)) is None for col, _ in SUMMARY_FIGURES):  # the peer ran none of them
                continue
            row = [model, peer]
            for col, _ in SUMMARY_FIGURES:
                a, b = (r.get(col) or "-" for r in (ours, theirs))
                row += [f"{a.split(' [')[0]} / {b.split(' [')[0]}",
                        given.get((peer, col)) or ratio(lead(a), lead(b))]
            out.append(row + [source])
    return out


MODELS_HEADING = "### Larger models"


def models_sections(text: str) -> list[str]:
    """A Larger models page's sections, one per suite session that rendered into it."""
    sections: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith(MODELS_HEADING) or not sections:
            sections.append([])
        sections[-1].append(line)
    return ["\n".join(s).strip() + "\n" for s in sections if "".join(s).strip()]


def merge_models_page(old: str, new: str, models: list[str]) -> str:
    """The page with `new` (a session's section for `models`) in place of the sections that measured any of those
    models, the other sessions' sections kept: shapes are run in sessions of their own (a shape at a time fits
    the machine), and each keeps its figures until its shapes are run again."""
    def measured(section: str) -> set[str]:
        return {part.split(":")[0].strip() for line in section.splitlines() if line.startswith("# ")
                for part in line[2:].split("; ")} & set(models)  # its Commands' `# <model>: <file>; ...` lines

    kept = [s for s in models_sections(old) if not measured(s)]
    return "\n".join(kept + [new.strip() + "\n"])


def session_of(text: str) -> str:
    start = text.find("suite session `")
    return text[start:].split("`")[1] if start >= 0 else "?"


def summary(plots_dir: Path) -> str:
    """One table per CPU kind: kvserve against each peer, per model, from the kinds' rendered pages (and
    PEER_PAGES); a kind without a page says there is no measurement yet."""
    extra: dict[str, list[tuple[str, str]]] = {}
    for name in PEER_PAGES:
        path = plots_dir / name
        if path.exists() and (kind := page_kind(text := path.read_text())):
            extra.setdefault(kind, []).append((text, f"`{session_of(text)}` (docs/bench/{name})"))
    out = ["## Summary: kvserve against each peer", "",
           "Each cell: kvserve's median / the peer's, from the same session on the same machine; ratio = kvserve "
           "over the peer (tok/s: above 1x is better for kvserve; ms: below 1x). W1: many requests in flight; "
           "W2: one at a time (TPOT = time per output token, TTFT = time to first token). The sections below "
           "hold the detail."]
    for kind, label in CPU_KINDS.items():
        out += ["", f"**{label}**", ""]
        page, models = plots_dir / "cpu" / f"{kind}.md", plots_dir / "cpu" / f"{kind}-models.md"
        texts = ([(page.read_text(), None)] if page.exists() else []) + \
            ([(section, None) for section in models_sections(models.read_text())] if models.exists() else []) + \
            extra.get(kind, [])
        if not texts:
            out.append("No measurement on this kind yet.")
            continue
        rows = [row for text, source in texts for row in summary_rows(text, source or f"`{session_of(text)}`")]
        if any(line.startswith("**Emulated") for text, _ in texts for line in text.splitlines()):
            out.append("Emulated: a CPU of a higher kind held to this instruction set; compare the ratios, not the "
                       "absolute figures.\n")
        if not rows:
            out.append("kvserve measured alone: no peer on this kind yet.")
            continue
        header = ["model", "peer"]
        for _, name in SUMMARY_FIGURES:
            header += [f"{name}, kvserve / peer", "ratio"]
        out.append(table(header + ["session"], rows))
    return "\n".join(out) + "\n"


def assemble(plots_dir: Path) -> str:
    """BENCHMARKS.md: the intro, the summary, each CPU kind's section that has been rendered, the platform
    pages."""
    md = INTRO.rstrip("\n") + "\n\n" + summary(plots_dir)
    for kind in CPU_KINDS:
        page = plots_dir / "cpu" / f"{kind}.md"
        models = plots_dir / "cpu" / f"{kind}-models.md"  # the Larger models page (LargerModels)
        if page.exists():
            md = md.rstrip("\n") + "\n\n" + page.read_text().strip() + "\n"
        elif models.exists():  # only shapes have been run on this kind
            md = md.rstrip("\n") + f"\n\n## {CPU_KINDS[kind]}\n"
        else:
            continue
        if models.exists():  # written at its level
            md = md.rstrip("\n") + "\n\n" + models.read_text().strip() + "\n"
        # benchmarks.quality, .profile and .single --markdown on a machine of this kind
        for extra in ("quality", "profile", "single"):
            path = plots_dir / "cpu" / f"{kind}-{extra}.md"
            if path.exists():
                text = "\n".join("##" + line if line.startswith("# ") else line
                                 for line in path.read_text().splitlines())
                md = md.rstrip("\n") + "\n\n" + text.strip() + "\n"
    return with_benchmark_pages(md, plots_dir)


# ---- the table of contents BENCHMARKS.md opens with ----------------------------------------------------------------

CONTENTS = "**Contents**"


def heading_anchor(title: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation other than - and _ dropped, spaces to -."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def with_contents(md: str) -> str:
    """`md` with a table of contents before its first `##` section: a link to each `##` section. Anchors count
    every heading outside code blocks, as GitHub numbers repeated ones (-1, -2, ...); an earlier table of contents
    is replaced, so rendering again gives the same page."""
    lines = md.splitlines()
    if CONTENTS in lines:  # drop the old one: its line, the blank after it, its links and the blank after them
        i = lines.index(CONTENTS)
        j = i + 1
        while j < len(lines) and (lines[j].startswith("- [") or not lines[j].strip()):
            j += 1
        lines[i:j] = []
    seen: dict[str, int] = {}
    links, first, fenced = [], None, False
    for n, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        level = len(line) - len(line.lstrip("#"))
        if fenced or not 1 <= level <= 6 or line[level:level + 1] != " ":
            continue
        title = line[level:].strip()
        slug = heading_anchor(title)
        anchor = slug if slug not in seen else f"{slug}-{seen[slug]}"
        seen[slug] = seen.get(slug, 0) + 1
        if level == 2:
            first = n if first is None else first
            links.append(f"- [{title}](#{anchor})")
    if first is None:
        return md
    lines[first:first] = [CONTENTS, "", *links, ""]
    return "\n".join(lines) + "\n"


def render(a: argparse.Namespace) -> int:
    if a.pages_only:  # a platform benchmark wrote its page: assemble BENCHMARKS.md again, no session rendered
        write_markdown(Path(a.plots), Path(a.markdown))
        print(f"wrote {a.markdown}")
        return 0
    root = Path(a.session)
    if not root.is_dir():
        print(f"no session directory {root} (run python -m benchmarks.suite first)")
        return 1
    session = Session(root)
    kind = cpu_kind(session)
    kind_dir = Path(a.plots) / "cpu" / kind
    (Path(a.plots) / "cpu").mkdir(parents=True, exist_ok=True)
    made = []
    if session.smollm2_ran():
        made = plots(session, kind_dir)
        page = Report(session, kind_dir, Path(a.markdown)).render()
        (Path(a.plots) / "cpu" / f"{kind}.md").write_text(page)
    if session.models():
        page = LargerModels(session, kind_dir, Path(a.markdown)).render()
        path = Path(a.plots) / "cpu" / f"{kind}-models.md"
        path.write_text(merge_models_page(path.read_text() if path.exists() else "", page, session.models()))
    for extra in ("profile", "quality"):  # the session's own pages (Suite.kind_pages) replace the kind's
        if (root / f"{extra}.md").exists():
            (Path(a.plots) / "cpu" / f"{kind}-{extra}.md").write_text((root / f"{extra}.md").read_text())
    w6 = w6_page(session)
    if w6:
        pages.write_page(a.plots, "w6", w6[1], w6[0])
    write_markdown(Path(a.plots), Path(a.markdown))
    print(f"wrote {a.markdown}" + (f" and {', '.join(str(p) for p in made)}" if made else ""))
    return 0


def write_markdown(plots: Path, markdown: Path) -> None:
    """BENCHMARKS.md from the pages under `plots` as they are: the kinds' sections, the benchmarks' pages and the
    analysis."""
    md = assemble(plots)
    analysis = plots / "analysis.md"
    if analysis.exists():  # hand-written reading of the numbers (targets, profile), kept across renders
        md = md.rstrip("\n") + "\n\n" + analysis.read_text()
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(with_contents(md))


if __name__ == "__main__":
    raise SystemExit(main())
