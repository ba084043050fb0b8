"""What LoRA adapters cost: SmolLM2 with random PEFT adapters of its shape, in process (LLM), against the same model
without adapters.

  python -m benchmarks.lora [--model smollm2-135m] [--adapters 8] [--rank 16] [--rounds 3] [--out docs/bench] [--quick]
                            [--parts throughput,loading]

1. Throughput, W1's shape (64 prompts of 256 random tokens, 128 greedy tokens each, 32 running): output tokens/s of
   the base model in an engine without LoRA, and of the same prompts spread round-robin over `--adapters` adapters
   (max_loras = that many, so every adapter may run in every step) in an engine with LoRA. Target: >= 0.85x.
2. Single-stream TPOT: one 256-token prompt, 128 tokens, base against one adapter. Target: <= 1.15x.
The two engines run alternately, `--rounds` times; the medians, and the median of the rounds' ratios.
3. Loading adapters while serving: base-model requests arrive at a steady rate (AsyncLLM, in process; every twice
   a request's time alone, at least 0.25 s, so that the engine keeps up on a slow machine too) while the
   `--adapters` adapters are read one after another (the server's load path: off the engine thread), against the
   same arrivals with no load; the requests' TTFT p99 (the largest of 40). Target: within 1.2x.
Writes lora.json and lora.md under --out. `--parts loading` runs part 3 alone and keeps parts 1 and 2's runs from the
last lora.json (made on this machine).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.pages import stamp, table, write_page

PARTS = ("throughput", "loading")


def _log(msg: str) -> None:
    print(f"[lora] {msg}", file=sys.stderr, flush=True)


def write_adapters(model: str, count: int, rank: int, out: Path) -> list[Path]:
    """`count` random PEFT adapters (every attention and MLP projection) for the model's shape."""
    import copy

    from kvserve.models.catalog import resolve_model
    from kvserve.models.model_info import read_model_info
    from tests.hf_factory import tiny_model
    from tests.lora_factory import write_peft_adapter

    c = read_model_info(resolve_model(model)[1]).config
    base = tiny_model("llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim)
    return [write_peft_adapter(copy.deepcopy(base), out / f"a{i}", rank=rank, alpha=2 * rank, seed=i)
            for i in range(count)]


def run(a) -> dict:
    import asyncio

    from kvserve import LoRARequest, SamplingParams

    shape = dict(prompts=8, prompt_len=64, out=16, seqs=4) if a.quick else dict(prompts=64, prompt_len=256, out=128,
                                                                                  seqs=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(shape["prompt_len"])] for _ in range(shape["prompts"])]
    params = SamplingParams(max_tokens=shape["out"], temperature=0.0, ignore_eos=True)
    common = dict(max_num_seqs=shape["seqs"], enable_prefix_caching=False)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(a.model, a.adapters, a.rank, Path(tmp))
        requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        rows = {}
        if "throughput" in a.parts:
            rows.update(_throughput(a, requests, prompts, params, common))
        if "loading" in a.parts:
            rows.update(asyncio.run(_ttft_while_loading(a.model, paths, a.rounds, a.quick)))
    if a.parts != PARTS:  # one part again: the other's runs from the last result, made on this machine
        last = json.loads((Path(a.out) / "lora.json").read_text())
        here = stamp("benchmarks.lora", [])["machine"]
        if any(last["machine"].get(k) != v for k, v in here.items() if k != "loadavg"):
            raise SystemExit("the last lora.json was made on another machine: run every part")
        rows = {**last["runs"], **rows}
        kept = [x for x in PARTS if x not in a.parts]
        earlier = {part: last.get("made", {}).get(part, f"`{last['command']}` ({last['when']})") for part in kept}
    else:
        earlier = {}
    med = {k: statistics.median(v) for k, v in rows.items()}

    def paired(num: str, den: str) -> float:  # the median of the rounds' ratios (each round's pair side by side)
        return statistics.median(x / y for x, y in zip(rows[num], rows[den]))

    return {"shape": shape, "adapters": a.adapters, "rank": a.rank, "model": a.model, "runs": rows, "median": med,
            "earlier": earlier,
            "throughput_ratio": med["lora_tok_s"] / med["base_tok_s"],
            "tpot_ratio": med["lora_tpot_ms"] / med["base_tpot_ms"],
            "loading_ratio": med["loading_ttft_p99_ms"] / med["quiet_ttft_p99_ms"],
            "paired": {"throughput": paired("lora_tok_s", "base_tok_s"), "tpot": paired("lora_tpot_ms", "base_tpot_ms"),
                       "loading": paired("loading_ttft_p99_ms", "quiet_ttft_p99_ms")}}


def _throughput(a, requests, prompts, params, common) -> dict[str, list[float]]:
    """Per round, W1's output tok/s and one stream's TPOT, the base engine and the one with adapters alternately."""
    import gc

    from kvserve import LLM

    plain = LLM(a.model, **common)
    lora = LLM(a.model, enable_lora=True, max_loras=a.adapters, max_lora_rank=max(a.rank, 16),
               max_cpu_loras=max(16, a.adapters), **common)
    spread = [requests[i % len(requests)] for i in range(len(prompts))]
    lora.generate(prompts[:len(requests)], params, use_tqdm=False, lora_request=spread[:len(requests)])  # reads
    rows = {"base_tok_s": [], "lora_tok_s": [], "base_tpot_ms": [], "lora_tpot_ms": []}
    for r in range(a.rounds):
        for name, llm, loras in (("base", plain, None), ("lora", lora, spread)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            rows[f"{name}_tok_s"].append(sum(len(o.outputs[0].token_ids) for o in outs)
                                         / (time.perf_counter() - t0))
            one = llm.generate(prompts[:1], params, use_tqdm=False,
                               lora_request=None if loras is None else requests[0])[0]
            m = one.metrics
            rows[f"{name}_tpot_ms"].append((m.e2e - m.ttft) / (len(one.outputs[0].token_ids) - 1) * 1000)
        _log(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()))
    plain.close()
    lora.close()
    del plain, lora
    gc.collect()
    return rows


async def _ttft_while_loading(model: str, paths: list[Path], rounds: int, quick: bool) -> dict[str, list[float]]:
    """Per round, the largest TTFT (ms) of base-model requests arriving at a steady interval (twice one request's
    time alone, at least 0.25 s: the engine keeps up, on a slow machine too), quiet and with the adapters read
    meanwhile, alternately, on one engine."""
    import asyncio

    from dataclasses import replace

    from kvserve import SamplingParams
    from kvserve.config import TierLimits, engine_config_from_kwargs
    from kvserve.engine.async_engine import AsyncLLM

    count = 8 if quick else 40
    config = engine_config_from_kwargs(model, enable_lora=True, max_cpu_loras=len(paths) + 1,
                                       enable_prefix_caching=False, kv_cache_memory=512 << 20)
    # No admission bound: every request is measured, on a slow machine too (a server's TTFT bound would refuse some).
    config = replace(config, scheduler=replace(config.scheduler, interactive=TierLimits.unbounded()))
    llm = AsyncLLM(config).start()
    await asyncio.to_thread(llm.wait_ready)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    async for _ in llm.generate([rng.randrange(100, 40000) for _ in range(128)], params):
        pass
    interval = max(0.25, 2 * (time.perf_counter() - t0))
    _log(f"arrivals every {interval:.2f} s")

    async def one(i: int) -> float:
        await asyncio.sleep(interval * i)
        async for out in llm.generate([rng.randrange(100, 40000) for _ in range(128)], params):
            if out.finished:
                return out.metrics.ttft * 1000

    async def read_all() -> None:
        await asyncio.sleep(0.5)
        for i, p in enumerate(paths):
            await llm.load_adapter(f"a{i}", str(p))
            llm.unload_adapter(f"a{i}")  # the next read is a cold one again

    out = {"quiet_ttft_p99_ms": [], "loading_ttft_p99_ms": [], "arrival_interval_s": [interval]}
    try:
        for r in range(rounds):
            for key, load in (("quiet_ttft_p99_ms", False), ("loading_ttft_p99_ms", True)):
                jobs = [one(i) for i in range(count)] + ([read_all()] if load else [])
                out[key].append(max(t for t in await asyncio.gather(*jobs) if t is not None))
            _log(f"round {r}: quiet {out['quiet_ttft_p99_ms'][-1]:.1f}, loading {out['loading_ttft_p99_ms'][-1]:.1f}")
        return out
    finally:
        await asyncio.to_thread(llm.stop)


def markdown(r: dict, info: dict) -> str:
    m, s, pr = r["median"], r["shape"], r["paired"]
    rows = [[f"W1's shape ({s['prompts']} prompts of {s['prompt_len']} tokens, {s['out']} out, {s['seqs']} running): "
             "output tok/s", f"{m['base_tok_s']:.1f}", f"{m['lora_tok_s']:.1f}", f"{r['throughput_ratio']:.2f}x",
             f"{pr['throughput']:.2f}x", ">= 0.85x"],
            [f"one stream, {s['out']} tokens: TPOT ms", f"{m['base_tpot_ms']:.2f}", f"{m['lora_tpot_ms']:.2f}",
             f"{r['tpot_ratio']:.2f}x", f"{pr['tpot']:.2f}x", "<= 1.15x"],
            [f"base requests every {m['arrival_interval_s']:.2f} s, TTFT p99 ms: quiet / while the {r['adapters']} "
             "adapters are read", f"{m['quiet_ttft_p99_ms']:.1f}", f"{m['loading_ttft_p99_ms']:.1f}",
             f"{r['loading_ratio']:.2f}x", f"{pr['loading']:.2f}x", "<= 1.2x"]]
    return "\n".join([
        "# LoRA adapters: what they cost", "",
        f"{r['model']}, in process (`LLM`), medians of {len(r['runs']['base_tok_s'])} alternating rounds: the base "
        f"model in an engine without LoRA against {r['adapters']} random PEFT adapters of rank {r['rank']} (every "
        "attention and MLP projection) spread round-robin over the requests, `max_loras` = that many. On the "
        "fused CPU decoder a step's adapter rows are grouped by adapter inside its one call (kernels/lora_cpu.h); "
        "the single-stream and throughput figures come from one generate each per round, so a noisy machine moves "
        "them by tens of percent from round to round (the runs are in lora.json).", "",
        table(["", "base", "adapters", "ratio of the medians", "median of the rounds' ratios", "target"], rows), "",
        f"Machine: {info['machine'].get('cpu_model', '?')}. Command: `{info['command']}` ({info['when']})"
        + "".join(f"; the {part} part's runs: {made}" for part, made in r.get("earlier", {}).items()) + ".", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="which to run (throughput, loading); the other's runs are kept from the last lora.json")
    a = ap.parse_args(argv)
    a.parts = tuple(x for x in PARTS if x in a.parts.split(","))
    result = run(a)
    info = stamp("benchmarks.lora", argv)
    result.update(info)
    write_page(a.out, "lora", result, markdown(result, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
