"""Load time, resident memory and single-sequence decode speed of each model and dtype.

    python -m benchmarks.single [--models smollm2-135m,gemma3-270m] [--dtypes float32,bfloat16] [--tokens 64]
                                [--weights auto,bf16] [--kv auto,int8] [--numerics batch_invariant,fast]
                                [--activations auto,bf16,int8]
                                [--context 2048] [--json out.json] [--markdown docs/bench/cpu/KIND-single.md]

Each (model, dtype) runs in a fresh process so the resident-memory figure is that model's alone.
Decode speed is the offline engine's: one greedy sequence, `--tokens` tokens after the first,
timed from the first token to the last (prefill excluded), median of `--runs` runs. `--context N`
starts it from a prompt of N random tokens instead of a short sentence, so each step also reads N
tokens of KV cache (`--kv`: the KV cache's dtype, CacheConfig.kv_cache_dtype); the prefill of that prompt
(from the request's submission to its first token, median of the runs) is reported too. `--markdown` writes the
table with the command and the machine (BENCHMARKS.md shows docs/bench/cpu/<kind>-single.md under its
CPU kind's section).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def decode_rates(engine, tokens: int, runs: int, context: int = 0) -> tuple[list[float], list[float]]:
    """Tokens/s of one greedy sequence, `tokens` tokens after the first (prefill excluded), and seconds from
    its submission to its first token, for each of `runs` runs after a warm-up run; from a prompt of
    `context` random tokens where given."""
    import random

    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    rng = random.Random(0)
    rates, prefills = [], []
    for i in range(runs + 1):  # the first run warms up
        ids = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(context)] if context else None
        submitted = time.perf_counter()
        engine.core.add_request(engine.request(ids or "The history of the city begins", params))
        first = last = None
        while engine.core.has_unfinished_requests():
            for out in engine.core.step():
                now = time.perf_counter()
                if first is None and out.outputs[0].token_ids:
                    first = now
                last = now
        if i:
            rates.append(tokens / (last - first))
            prefills.append(first - submitted)
    return rates, prefills


def measure(model: str, dtype: str, tokens: int, runs: int, weights: str, kv: str = "auto", context: int = 0,
            numerics: str = "batch_invariant", activations: str = "auto") -> dict:
    from kvserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, kv_cache_memory="256MiB", swap_space=0, weights=weights, kv_cache_dtype=kv,
              enable_prefix_caching=False, numerics=numerics, activations=activations)
    load_s = time.perf_counter() - t0
    rss = _rss_mib()
    engine = llm.engine
    rates, prefills = decode_rates(engine, tokens, runs, context)
    import torch

    return {"model": model, "dtype": dtype, "weights": engine.weights, "kv": kv, "context": context,
            "numerics": engine.numerics, "activations": engine.activations, "prefill_ms": round(1000 * statistics.median(prefills), 1),
            "load_s": round(load_s, 2),
            "rss_mib": round(rss), "decode_tok_s": round(statistics.median(rates), 1),
            "decode_ms_per_token": round(1000 / statistics.median(rates), 2), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--weights", default="auto",
                    help="comma-separated EngineConfig.weights settings: auto, bf16, int8, int4 (default auto)")
    ap.add_argument("--kv", default="auto", help="comma-separated KV cache dtypes: auto, int8 (default auto)")
    ap.add_argument("--numerics", default="batch_invariant",
                    help="comma-separated EngineConfig.numerics settings: batch_invariant, fast (default batch_invariant)")
    ap.add_argument("--activations", default="auto",
                    help="comma-separated EngineConfig.activations settings: auto, bf16, int8 (default auto)")
    ap.add_argument("--context", type=int, default=0, help="decode from a prompt of this many random tokens")
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--markdown", default=None, help="write the table, the command and the machine here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, dtype = args.child.split(":")
        print(json.dumps(measure(model, dtype, args.tokens, args.runs, args.weights, args.kv, args.context,
                                 args.numerics, args.activations)))
        return
    rows = []
    settings = (args.models, args.dtypes, args.weights, args.kv, args.numerics, args.activations)
    for model, dtype, weights, kv, numerics, activations in itertools.product(*(s.split(",") for s in settings)):
        cmd = [sys.executable, "-m", "benchmarks.single", "--child", f"{model}:{dtype}", "--tokens", str(args.tokens),
               "--runs", str(args.runs), "--weights", weights, "--kv", kv, "--context", str(args.context),
               "--numerics", numerics, "--activations", activations]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    table = ["| model | dtype | weights | KV | numerics | activations | context | load s | RSS MiB | prefill ms | "
             "decode tok/s | ms/token |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {os.path.basename(r['model'])} | {r['dtype']} | {r['weights']} | {r['kv']} | {r['numerics']} | "
              f"{r['activations']} | {r['context']} | {r['load_s']} | {r['rss_mib']} | {r['prefill_ms']} | {r['decode_tok_s']} | "
              f"{r['decode_ms_per_token']} |" for r in rows]
    print("\n".join(table))
    print(json.dumps(rows))
    if args.markdown:
        from benchmarks.ceilings import machine_info

        m = machine_info()
        flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx") if m.get(f))
        command = "python -m benchmarks.single " + shlex.join(argv if argv is not None else sys.argv[1:])
        head = ["# Single-sequence decode", "",
                f"Generated by `{command}` (benchmarks/single.py; its docstring says how each figure is measured) "
                f"on {m.get('cpu_model', '?')} ({flags}), {m.get('nproc', '?')} cores, {time.strftime('%Y-%m-%d')}: "
                f"one greedy sequence, {args.tokens} tokens after the first"
                + (f", from a prompt of {args.context} random tokens" if args.context else "")
                + f", median of {args.runs} runs, each configuration in a process of its own.", ""]
        with open(args.markdown, "w") as f:
            f.write("\n".join(head + table) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
