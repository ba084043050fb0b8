"""`kvserve plan`: the cheapest fleet for a load within SLOs; `plan calibrate`, `plan simulate`, `plan specs`,
`plan prices`, `plan context` (what N-token contexts cost in KV, and where they fit)."""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, fields

from kvserve.config import Priority
from kvserve.metering.money import format_money
from kvserve.metering.prices import (CACHED_INPUT_SHARE, DEFAULT_MARGIN, DEFAULT_UTILIZATION, break_even_price,
                                     list_price)
from kvserve.planning.memory import DENSE, DISK_GBS, HOST_GBS, MemoryPlan
from kvserve.planning.search import SLO, Load, Plan, PlanResult, Redundancy, Speculation, plan
from kvserve.planning.serving import models_toml, serve_commands
from kvserve.planning.specs import (UnknownSpec, WeightQuality, accelerator_spec, known_accelerators, known_models,
                                    known_weight_quality, model_spec)
from kvserve.planning.traces import LengthDist, Workload, bursty, poisson, recorded, shape

_SLO_RE = re.compile(r"^(ttft|tpot):p(\d+(?:\.\d+)?)=(\d+(?:\.\d+)?)(ms|s)?$", re.IGNORECASE)


def parse_slo(text: str) -> SLO:
    """"ttft:p50=200ms", "tpot:p99=0.1s" (a bare number is milliseconds)."""
    m = _SLO_RE.match(text.strip().replace(" ", ""))
    if not m:
        raise argparse.ArgumentTypeError(f"an SLO looks like ttft:p50=200ms or tpot:p99=0.1s, not {text!r}")
    value = float(m.group(3)) / (1 if (m.group(4) or "ms").lower() == "s" else 1000)
    return SLO(m.group(1).lower(), float(m.group(2)), value)


def parse_length(text: str) -> LengthDist:
    """"1000" or "1000+-0.2" (uniform within 20% of 1000)."""
    mean, _, spread = text.partition("+-")
    try:
        return LengthDist(int(mean), float(spread) if spread else 0.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a token length looks like 1000 or 1000+-0.2, not {text!r}") from None


def parse_tokens(text: str) -> int:
    """"1000000", "1M", "128k", "1e6"."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 10**3, "m": 10**6}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        n = 0
    if n < 1 or n != int(n):
        raise argparse.ArgumentTypeError(f"a token count looks like 1000000, 1M or 128k, not {text!r}")
    return int(n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model name (kvserve plan specs lists them), or a config.json / .gguf path")
    p.add_argument("--accelerator", default="h100-sxm,h200",
                   help="comma-separated accelerators, or cpu for this machine's calibration (default h100-sxm,h200)")
    p.add_argument("--rpm", type=float, default=600.0, help="offered load, requests per minute (default 600)")
    p.add_argument("--input", type=parse_length, default=LengthDist(1000), help="prompt tokens: 1000 or 1000+-0.2")
    p.add_argument("--output", type=parse_length, default=LengthDist(500), help="output tokens: 500 or 500+-0.5")
    p.add_argument("--batch-share", type=float, default=0.0, help="share of the requests in the batch tier (0-1)")
    p.add_argument("--slo", type=parse_slo, action="append", default=None,
                   help="interactive SLO, repeatable: ttft:p50=200ms, tpot:p50=50ms (default those two)")
    p.add_argument("--dtypes", default="bf16,fp8",
                   help="weight and KV dtypes to consider (default bf16,fp8); int8 and int4 are for weights only")
    p.add_argument("--regions", type=int, default=1, help="regions; >1 sizes each to survive one region's loss")
    p.add_argument("--availability", type=float, default=None, help="availability target in percent, e.g. 99.9")
    p.add_argument("--replica-availability", type=float, default=99.0,
                   help="assumed availability of one replica in percent (default 99)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens a request may hold, prompt and output (default: the model's context length)")
    p.add_argument("--speculation", type=float, default=None, metavar="ACCEPTANCE",
                   help="plan with speculative decoding at this per-token acceptance (0-1; n-gram drafts of "
                        "grounded work measured 0.63 on CPU: BENCHMARKS.md); skips the simulator's check")
    p.add_argument("--max-draft", type=int, default=8, help="the longest draft speculation may run (default 8)")
    p.add_argument("--no-simulate", action="store_true", help="skip checking the plan with the simulator")
    p.add_argument("--sim-seconds", type=float, default=30.0, help="seconds of arrivals the check simulates")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--report", metavar="DIR", help="write a page with plots (TTFT against load, KV use) to DIR")
    p.set_defaults(func=cmd_plan)
    sub = p.add_subparsers(dest="plan_cmd")
    c = sub.add_parser("calibrate", help="fit this machine's step-time model from a short profile of the real engine")
    c.add_argument("--model", required=True, help="a served model id (from the models TOML)")
    c.add_argument("--config", default=None, help="models TOML (default: the packaged one)")
    c.add_argument("--out", default=None, help="where to write it (default $KVSERVE_HOME/calibration/MODEL.json)")
    c.add_argument("--price-per-hour", type=float, default=None,
                   help="this machine's cost per hour (default: the model's replica_cost_per_hour)")
    c.set_defaults(func=cmd_calibrate)
    s = sub.add_parser("simulate", help="replay a workload through the real scheduler under the step-time model")
    s.add_argument("--model", required=True)
    s.add_argument("--accelerator", required=True, help="one accelerator, or cpu")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--dtype", default="bf16", help="weight and KV dtype (a calibrated machine uses its own)")
    s.add_argument("--workload", default="W1", help="W1-W5, W3-alone, poisson, bursty, or a JSONL trace path")
    s.add_argument("--rate", type=float, default=1.0, help="requests/s for poisson and bursty (W5: its rate)")
    s.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals for poisson and bursty")
    s.add_argument("--input", type=parse_length, default=LengthDist(256))
    s.add_argument("--output", type=parse_length, default=LengthDist(128))
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None,
                   help="tokens a request may hold, prompt and output (default: the model's context length)")
    s.add_argument("--disk-gib", type=float, default=0.0,
                   help="a disk tier of this many GiB behind the prefix cache (kv_disk_dir), default none")
    s.add_argument("--disk-gbs", type=float, default=DISK_GBS, help="its read bandwidth in GB/s (an assumption)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_simulate)
    k = sub.add_parser("specs", help="the models and accelerators the planner knows, with their sources")
    k.set_defaults(func=cmd_specs)
    pr = sub.add_parser("prices", help="each served model's break-even and suggested list prices, from this "
                                       "machine's calibration and its replica_cost_per_hour")
    pr.add_argument("--config", default=None, help="models TOML (default: the packaged one)")
    pr.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION,
                    help=f"busy share of a replica's hour, 0-1 (default {DEFAULT_UTILIZATION})")
    pr.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help=f"suggested list prices are break-even x (1 + margin) (default {DEFAULT_MARGIN})")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_prices)

    x = sub.add_parser("context", help="KV bytes of one sequence at a context length, full attention against a "
                                       "sliding window, and how many fit on the devices, in host memory, on disk")
    x.add_argument("--model", required=True)
    x.add_argument("--tokens", type=parse_tokens, required=True, help="tokens of one sequence: 1000000, 1M, 128k")
    x.add_argument("--window", type=int, default=4096,
                   help="StreamingLLM window: layers without one keep the last W tokens and the sinks (default "
                        "4096; 0: leave it out)")
    x.add_argument("--sinks", type=int, default=4, help="leading tokens a StreamingLLM window keeps (default 4)")
    x.add_argument("--kv-dtypes", default="bf16,fp8", help="KV dtypes (default bf16,fp8)")
    x.add_argument("--accelerator", default="h100-sxm,h200", help="comma-separated (default h100-sxm,h200)")
    x.add_argument("--tp", type=int, default=None,
                   help="devices per replica (default: the fewest that hold the weights, and the fewest that hold "
                        "one sequence when those hold none)")
    x.add_argument("--weight-dtype", default="bf16", help="weight dtype (default bf16)")
    x.add_argument("--host-gib", type=float, default=1024.0, help="host memory for KV, GiB (default 1024)")
    x.add_argument("--disk-gib", type=float, default=8000.0, help="disk for KV, GiB (default 8000)")
    x.add_argument("--host-gbs", type=float, default=HOST_GBS,
                   help=f"host to device bandwidth, GB/s (default {HOST_GBS:g}, about PCIe 5.0 x16: an assumption)")
    x.add_argument("--disk-gbs", type=float, default=DISK_GBS,
                   help=f"disk read bandwidth, GB/s (default {DISK_GBS:g}, one NVMe drive: an assumption)")
    x.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16, the engine's)")
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=cmd_context)


def _fail(e: Exception) -> int:
    print(f"kvserve plan: {e}", file=sys.stderr)
    return 2


def cmd_plan(a) -> int:
    if a.model is None:
        return _fail("--model is required (kvserve plan specs lists the known models)")
    try:
        model = model_spec(a.model)
        names = (a.model, model.name)  # a calibration is kept under the served model's id
        accs = [accelerator_spec(x.strip(), model=names) for x in a.accelerator.split(",") if x.strip()]
        slos = a.slo or [SLO("ttft", 50, 0.2), SLO("tpot", 50, 0.05)]
        load = Load(a.rpm, a.input, a.output, a.batch_share)
        red = Redundancy(a.regions, a.availability / 100 if a.availability is not None else None,
                         a.replica_availability / 100)
        dtypes = tuple(x.strip() for x in a.dtypes.split(","))
        spec = Speculation(a.speculation, a.max_draft) if a.speculation is not None else None
        result = plan(model, accs, load, slos, red, dtypes=dtypes, simulate=not a.no_simulate,
                      sim_seconds=a.sim_seconds, max_model_len=a.max_model_len, speculation=spec)
    except (UnknownSpec, ValueError) as e:
        return _fail(e)
    if a.json:
        print(json.dumps(plan_json(result, model.name, load, slos), indent=1))
    else:
        print(render(result, model.name, load, slos))
    if a.report:
        from kvserve.planning.report import write_report

        path = write_report(a.report, result, model.name, load, slos, render(result, model.name, load, slos))
        print(f"\nreport: {path}")
    refused = result.best.simulation.refusal() if result.best.simulation else None
    if refused:
        print(f"kvserve plan: {refused}", file=sys.stderr)
    return 0 if result.best.meets_slo and not refused else 1


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _gb(v: float) -> str:
    return f"{v / 1e9:.1f} GB"


def describe(p: Plan) -> list[str]:
    c, d = p.candidate, p.candidate.deployment
    mem = c.memory
    lines = [f"{p.replicas} replica(s) of {d.accelerator.name} x{d.tp} ({d.weight_dtype} weights, {d.kv_dtype} KV), "
             f"max_num_seqs {c.max_num_seqs}: {p.devices} device(s), {format_money(p.cost_per_hour)}/hour"]
    if p.interactive_replicas or p.batch_replicas:
        lines.append(f"  {p.interactive_replicas} for interactive, {p.batch_replicas} for batch only, "
                     f"{p.replicas - p.interactive_replicas - p.batch_replicas} for redundancy")
    lines.append("  per million tokens (prompt + output): " + ", ".join(
        f"{tier} {format_money(v)}" for tier, v in p.cost_per_million.items()))
    if d.accelerator.calibrated is None:
        lines.append(f"  per device: weights {_gb(mem.weight_bytes)}, reserve {_gb(mem.reserve_bytes)}, "
                     f"KV pool {_gb(mem.kv_bytes)} of {_gb(mem.device_bytes)}")
    lines.append(f"  per replica: KV pool of {mem.kv_tokens:,} tokens; capacity {c.capacity_per_s:.2f} req/s "
                 f"planned at {c.batch} sequences (TTFT ~{_ms(c.ttft_s)}, TPOT ~{_ms(c.tpot_s)}); "
                 f"{c.throughput_per_s:.2f} req/s flat out"
                 + (f"; speculative drafts of {c.draft} tokens a step at that batch" if c.draft else ""))
    lines.append(f"  binds: {c.binds}; headroom {p.headroom:.0%} of the interactive capacity")
    if p.simulation is not None:
        t = p.simulation.tiers[Priority.INTERACTIVE].summary()
        s = p.simulation.summary()
        lines.append(f"  simulated (real scheduler, one replica at {1 / max(p.simulated_replicas, 1):.1%} of the "
                     f"load, {t['submitted']} requests): TTFT p50 {_ms(t['ttft_s']['p50'])} p99 "
                     f"{_ms(t['ttft_s']['p99'])}, TPOT p50 {_ms(t['tpot_s']['p50'])} p99 {_ms(t['tpot_s']['p99'])}, "
                     f"KV peak {s['kv_peak']:.0%}, {s['preemptions']} preemptions"
                     + ("" if p.meets_slo else " -- MISSES the SLOs"))
    for note in p.redundancy_notes:
        lines.append(f"  redundancy: {note}")
    if p.unreachable:
        lines.append(f"  UNREACHABLE: {p.unreachable}")
    return lines


def quality_assumptions(weight_dtypes, table: dict[str, WeightQuality]) -> list[str]:
    """What the plans assume of each quantized weight format they use: its measured quality where
    data/quantization.toml has it, else that nothing here measured it."""
    out = []
    for d in sorted(set(weight_dtypes) - set(DENSE)):
        q = table.get(d)
        out.append(q.assumption() if q else f"{d} weights: quality not measured here (data/quantization.toml has "
                                            f"{', '.join(sorted(table)) or 'nothing'}); assumed acceptable")
    return out


def _assumptions(r: PlanResult) -> list[str]:
    out = quality_assumptions({p.candidate.deployment.weight_dtype for p in [r.best, *r.per_accelerator]},
                              known_weight_quality())
    if r.speculation is not None:
        s = r.speculation
        out.append(f"speculative decoding: each drafted token accepted with probability {s.acceptance:.2f}, "
                   f"drafts of up to {s.max_draft} tokens sized per batch as the controller does (measured on CPU "
                   f"for n-gram drafts of grounded work; on a GPU not measured); not checked by the simulator")
    return out


def render(r: PlanResult, model: str, load: Load, slos: list[SLO]) -> str:
    batch = f", {load.batch_share:.0%} batch tier" if load.batch_share else ""
    out = [f"kvserve plan: {model}, {load.requests_per_min:,.0f} requests/min ({load.requests_per_min / 60:,.1f}/s), "
           f"{load.prompt.mean} in / {load.output.mean} out{batch}",
           "SLOs (interactive): " + ", ".join(map(str, slos)), ""]
    out.append("Plan:" if r.best.meets_slo else "No plan meets the SLOs; the closest:")
    out += ["  " + x for x in describe(r.best)]
    if len(r.per_accelerator) > 1:
        out += ["", "Cheapest on each accelerator:"]
        for p in r.per_accelerator:
            d, sim = p.candidate.deployment, p.simulation
            t = sim.tiers[Priority.INTERACTIVE].summary() if sim is not None else None
            checked = (f"; simulated TTFT p50 {_ms(t['ttft_s']['p50'])}, TPOT p50 {_ms(t['tpot_s']['p50'])}"
                       if t else "")
            verdict = "" if p.meets_slo else " -- misses the SLOs"
            out.append(f"  {d.accelerator.name}: {p.replicas} replica(s) x{d.tp} ({d.weight_dtype} weights, "
                       f"{d.kv_dtype} KV, max_num_seqs {p.candidate.max_num_seqs}), {p.devices} device(s), "
                       f"{format_money(p.cost_per_hour)}/hour; binds: {p.candidate.binds}{checked}{verdict}")
    assumptions = _assumptions(r)
    if assumptions:
        out += ["", "Assumed (quality):"] + [f"  {a}" for a in assumptions]
    new_fleet, running = serve_commands()
    out += ["", f"To serve it, a models TOML (plan.toml), then `{new_fleet}` (a running fleet: `{running}`):"]
    out += ["  " + line if line else "" for line in models_toml(r.best, model).splitlines()]
    out += ["", f"searched {r.searched} configurations in {r.seconds:.1f} s"]
    return "\n".join(out)


def _memory_dict(mem: MemoryPlan) -> dict:
    """The memory plan, its KV groups summarized (their layer lists say nothing a reader needs)."""
    out = {f.name: getattr(mem, f.name) for f in fields(mem) if f.name != "layout"}
    return out | {"kv_groups": mem.layout.num_groups, "layers_per_page": mem.layout.group_size}


def _plan_dict(p: Plan) -> dict:
    c, d = p.candidate, p.candidate.deployment
    return {"accelerator": d.accelerator.name, "tp": d.tp, "weight_dtype": d.weight_dtype, "kv_dtype": d.kv_dtype,
            "max_num_seqs": c.max_num_seqs, "replicas": p.replicas, "interactive_replicas": p.interactive_replicas,
            "batch_replicas": p.batch_replicas, "devices": p.devices, "cost_per_hour": p.cost_per_hour,
            "cost_per_million_tokens": p.cost_per_million, "headroom": p.headroom, "binds": c.binds,
            "capacity_per_replica_rps": c.capacity_per_s, "throughput_per_replica_rps": c.throughput_per_s,
            "planned_batch": c.batch, "model_ttft_s": c.ttft_s, "model_tpot_s": c.tpot_s, "draft_tokens": c.draft,
            "memory": _memory_dict(c.memory), "redundancy": p.redundancy_notes, "meets_slo": p.meets_slo,
            "unreachable": p.unreachable or None,
            "simulation": p.simulation.summary() if p.simulation else None}


def plan_json(r: PlanResult, model: str, load: Load, slos: list[SLO]) -> dict:
    return {"model": model, "load": {"requests_per_min": load.requests_per_min, "input": load.prompt.mean,
                                     "output": load.output.mean, "batch_share": load.batch_share},
            "slos": [asdict(s) for s in slos], "plan": _plan_dict(r.best), "models_toml": models_toml(r.best, model),
            "per_accelerator": [_plan_dict(p) for p in r.per_accelerator], "assumptions": _assumptions(r),
            "searched": r.searched, "seconds": r.seconds}


def cmd_calibrate(a) -> int:
    import logging

    from kvserve.planning.calibrate import calibrate

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        doc = calibrate(a.model, a.config, a.out, a.price_per_hour)
    except (ValueError, OSError) as e:
        return _fail(e)
    f = doc["fit"]
    print(f"calibrated {doc['model']} ({doc['weight_dtype']}) on {doc['cpu']}, {doc['cores']} cores, "
          f"from {len(doc['samples'])} steps in {doc['profile_s']:.0f} s:\n"
          f"  {f['flops'] / 1e9:.0f} GFLOP/s, {f['bandwidth'] / 1e9:.1f} GB/s, step overhead "
          f"{f['step_overhead_s'] * 1000:.2f} ms, per sequence {f['per_seq_s'] * 1000:.3f} ms, per prefill step "
          f"{f['prefill_overhead_s'] * 1000:.2f} ms\n"
          f"  fit error: {f['median_abs_relative_error']:.1%} median, {f['rms_relative_error']:.1%} rms")
    print(f"  written to {doc['path']}")
    return 0


def simulation_workload(a) -> Workload:
    if a.workload.startswith("W"):
        return shape(a.workload, a.rate)
    if a.workload == "poisson":
        return Workload("poisson", poisson(a.rate, a.duration, a.input, a.output))
    if a.workload == "bursty":
        return Workload("bursty", bursty(a.rate, a.duration, a.input, a.output))
    return Workload(a.workload, recorded(a.workload))


def cmd_simulate(a) -> int:
    from dataclasses import replace

    from kvserve.planning.roofline import Deployment
    from kvserve.planning.search import engine_scheduler, replica_simulator

    try:
        model = model_spec(a.model)
        acc = accelerator_spec(a.accelerator, model=(a.model, model.name))
        cal = acc.calibrated
        d = Deployment(model, acc, a.tp, cal["weight_dtype"] if cal else a.dtype, cal["kv_dtype"] if cal else a.dtype,
                       a.max_model_len)
        workload = simulation_workload(a)
    except (UnknownSpec, ValueError, OSError) as e:
        return _fail(e)
    cfg = engine_scheduler(d)
    if a.max_num_seqs:
        cfg = replace(cfg, max_num_seqs=a.max_num_seqs)
    sim = replica_simulator(d, cfg, disk_bytes=a.disk_gib * 2 ** 30, disk_bandwidth=a.disk_gbs * 1e9)
    outcome = sim.run(workload)
    result = outcome.summary()
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{workload.name} on {d.label} ({model.name}, {d.context_length:,}-token context), simulated: "
              f"{result['steps']} steps, {result['duration_s']:.1f} s, {result['output_tokens_per_s']:.1f} output "
              f"tokens/s, {result['preemptions']} preemptions, KV peak {result['kv_peak']:.0%}, prefix hits "
              f"{result['prefix_hit_rate']:.0%} ({result['tier_hit_rate']:.0%} from disk)")
        for tier, t in result["tiers"].items():
            print(f"  {tier}: {t['completed']}/{t['submitted']} done, {t['rejected']} refused; TTFT p50 "
                  f"{_ms(t['ttft_s']['p50'])} p99 {_ms(t['ttft_s']['p99'])}; TPOT p50 {_ms(t['tpot_s']['p50'])}")
    refused = outcome.refusal()
    if refused:
        print(f"kvserve plan simulate: {refused}", file=sys.stderr)
        return 1
    return 0


def cmd_specs(a) -> int:
    from kvserve.planning.memory import parameter_count

    print("models:")
    for m in known_models().values():
        params = parameter_count(m)
        moe = (f" ({params.active / 1e9:.2f}B active: {m.experts_per_token} of {m.num_experts} experts)"
               if m.is_moe else "")
        print(f"  {m.name:16} {params.total / 1e9:7.2f}B{moe}  {m.num_layers} layers, {m.num_kv_heads} KV "
              f"heads x {m.head_dim}, {m.max_position_embeddings:,}-token context  {m.source}")
    print("accelerators:")
    for x in known_accelerators().values():
        fp8 = f"{x.fp8_flops / 1e12:.0f}" if x.fp8_flops else "-"
        print(f"  {x.name:10} {x.memory_bytes / 1e9:5.0f} GB {x.memory_bandwidth / 1e12:5.2f} TB/s "
              f"bf16 {x.bf16_flops / 1e12:6.0f} fp8 {fp8:>5} TFLOP/s {format_money(x.price_per_hour)}/h  {x.source}")
    return 0


def model_prices(entry, doc: dict, utilization: float, margin: float) -> dict:
    """One served model's engine time per token (this machine's calibration), break-even and suggested prices
    (dollars per million tokens) beside its list prices."""
    from kvserve.planning.calibrate import token_seconds

    seconds = dict(zip(("input", "output"), token_seconds(doc)))
    even = {k: break_even_price(entry.price, s, utilization) for k, s in seconds.items()}
    suggested = {k: list_price(v, margin) for k, v in even.items()}
    suggested["cached_input"] = list_price(suggested["input"] * CACHED_INPUT_SHARE, 0.0)
    return {"model": entry.id, "replica_cost_per_hour": entry.price.replica_cost_per_hour,
            "engine_s_per_token": seconds, "break_even": even, "suggested": suggested,
            "list": {"input": entry.price.input, "cached_input": entry.price.cached_input,
                     "output": entry.price.output},
            "calibration": {"cpu": doc["cpu"], "measured_at": doc["measured_at"],
                            "fit_median_error": doc["fit"]["median_abs_relative_error"]}}


def cmd_prices(a) -> int:
    """`kvserve plan prices`: what each served model's tokens must cost for its replicas to pay for themselves."""
    from kvserve.config import ServerConfig
    from kvserve.planning.calibrate import PRICE_CONTEXT, PRICE_DECODE_BATCH, PRICE_PROMPT_TOKENS
    from kvserve.planning.specs import calibration_path

    cfg = ServerConfig.from_toml(a.config)
    rows, missing = [], []
    for entry in cfg.models:
        path = calibration_path(entry.id)
        if not path.is_file():
            missing.append(f"{entry.id}: no calibration of this machine; run `kvserve plan calibrate --model "
                           f"{entry.id}` first (about a minute)")
            continue
        try:
            rows.append(model_prices(entry, json.loads(path.read_text()), a.utilization, a.margin))
        except (ValueError, KeyError, OSError) as e:
            return _fail(f"{entry.id}: {e}")
    if a.json:
        print(json.dumps({"utilization": a.utilization, "margin": a.margin, "models": rows}, indent=1))
    else:
        print(f"Dollars per million tokens. Engine time per token from this machine's calibration: a "
              f"{PRICE_PROMPT_TOKENS}-token prompt prefilled alone (input), {PRICE_DECODE_BATCH} sequences decoding "
              f"at {PRICE_CONTEXT} tokens (output). Break-even: that time at replica_cost_per_hour, the replica "
              f"busy {a.utilization:.0%} of the hour. Suggested: break-even + {a.margin:.0%}, cached input at "
              f"{CACHED_INPUT_SHARE:.0%} of input.")
        for r in rows:
            t, e, s, li = r["engine_s_per_token"], r["break_even"], r["suggested"], r["list"]
            loses = [k for k in ("input", "output") if li[k] < e[k]]
            print(f"  {r['model']} ({format_money(r['replica_cost_per_hour'])}/hour; {r['calibration']['cpu']}, "
                  f"fit error {r['calibration']['fit_median_error']:.0%}): engine {t['input'] * 1000:.3g} ms per "
                  f"input token, {t['output'] * 1000:.3g} ms per output token")
            print(f"    break-even input {format_money(e['input'])}, output {format_money(e['output'])}; suggested "
                  f"input {format_money(s['input'])}, cached_input {format_money(s['cached_input'])}, output "
                  f"{format_money(s['output'])}; listed input {format_money(li['input'])}, output "
                  f"{format_money(li['output'])}" + (f" -- BELOW break-even ({', '.join(loses)})" if loses else ""))
    for line in missing:
        print(f"kvserve plan prices: {line}", file=sys.stderr)
    return 0 if rows else 1


def render_context(r) -> str:
    """`plan context` as text: per KV dtype and policy, a sequence's bytes, then what each tier holds."""
    out = [f"{r.model}: one sequence of {r.tokens:,} tokens (KV in pages of {r.block_size} tokens; "
           f"{r.weight_dtype} weights)"]
    for row in r.rows:
        out += ["", f"{row.kv_dtype} KV, {row.policy}: {row.bytes_per_sequence / 1e9:,.2f} GB a sequence "
                    f"({row.pages_per_sequence:,} pages of {row.page_bytes / 1e6:,.2f} MB)"]
        for t in row.tiers:
            load = "" if t.load_s is None else f"; {t.load_s:,.2f} s to bring one to the device at " \
                                                f"{t.bandwidth / 1e9:g} GB/s"
            plural = "" if t.sequences == 1 else "s"
            out.append(f"  {t.tier:6} {t.where:38} {t.capacity_bytes / 1e9:9,.1f} GB: {t.sequences:7,} "
                       f"sequence{plural}{load}")
    out += ["", "Notes:"] + [f"  {n}" for n in r.notes]
    return "\n".join(out)


def cmd_context(a) -> int:
    """`kvserve plan context`: what N-token contexts cost in KV, and where they fit."""
    from kvserve.planning.long_context import Tiers, long_context
    from kvserve.planning.memory import GIB

    try:
        model = model_spec(a.model)
        accs = [accelerator_spec(x.strip()) for x in a.accelerator.split(",") if x.strip()]
        tiers = Tiers(a.host_gib * GIB, a.disk_gib * GIB, a.host_gbs * 1e9, a.disk_gbs * 1e9)
        r = long_context(model, a.tokens, accs, tuple(d.strip() for d in a.kv_dtypes.split(",") if d.strip()),
                         window=a.window or None, sinks=a.sinks, tiers=tiers, tp=a.tp, weight_dtype=a.weight_dtype,
                         block_size=a.block_size)
    except (UnknownSpec, ValueError) as e:
        return _fail(e)
    print(json.dumps(asdict(r), indent=1) if a.json else render_context(r))
    return 0
