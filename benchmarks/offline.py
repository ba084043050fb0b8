"""Offline throughput (continuous vs static batching, same engine; HF transformers static batches) and
time to first token with and without a prefix-cache hit.

  python -m benchmarks.offline [--model smollm2-135m] [--dtype auto] [--runs 3] [--out offline.json] [--quick]

1. Throughput: 64 prompts of 256 random tokens, greedy (temperature 0) with ignore_eos, so every
   request generates exactly its max_tokens. Two output-length workloads: all 128 tokens, and
   uniform in [16, 256] (fixed seed). Three ways to serve them:
   - continuous: `LLM.generate` on all 64 at once, the engine capped at `--batch` (32) running
     sequences: a finished sequence's seat goes to the next waiting request at the next step;
   - static, same engine: batches of `--batch` requests; a batch is admitted only when the previous
     one has fully finished, and every request in it generates as many tokens as the longest one asks
     (what a padded static batch computes); only the tokens each request asked for count as output;
   - HF static: transformers `model.generate` on padded batches of `--batch` (bfloat16 by default),
     built from the same checkpoint's weights, max_new_tokens = min_new_tokens = the batch's longest.
   Reported: useful output tokens/s (tokens the requests asked for / wall time), median of `--runs`.
   Prefix caching is off in the throughput engine so repeated runs over the same prompts do not hit.
2. TTFT of a 512-token prompt, max_tokens 1: a miss (a fresh cache salt each run, so nothing is
   cached) and a hit (the same salt as a warm-up run: all full blocks but the last token's are
   cached); wall time from add_request to the first token, median of max(5, runs) runs each.

`--quick` shrinks every shape (8 prompts of 64 tokens, outputs 16 / [4, 32], batch 4, 1 run, a
128-token TTFT prompt, 3 TTFT runs) to check the script works; its numbers mean little.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass


@dataclass
class Shape:
    num_prompts: int = 64
    prompt_len: int = 256
    output_len: int = 128
    varied_min: int = 16
    varied_max: int = 256
    batch: int = 32
    ttft_prompt_len: int = 512
    ttft_runs: int = 5

    @classmethod
    def quick(cls) -> "Shape":
        return cls(num_prompts=8, prompt_len=64, output_len=16, varied_min=4, varied_max=32, batch=4,
                   ttft_prompt_len=128, ttft_runs=3)


def machine_info() -> dict:
    try:
        from benchmarks.ceilings import machine_info as full

        return full()
    except Exception:  # noqa: BLE001 - the header is informative only
        cpu = "?"
        try:
            cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       "?")
        except OSError:
            pass
        return {"cpu_model": cpu, "nproc": os.cpu_count(), "platform": platform.platform()}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab - 1, 40_000)
    return [[rng.randrange(1000, hi) for _ in range(length)] for _ in range(n)]


def output_lengths(shape: Shape, varied: bool, seed: int = 1) -> list[int]:
    if not varied:
        return [shape.output_len] * shape.num_prompts
    rng = random.Random(seed)
    return [rng.randint(shape.varied_min, shape.varied_max) for _ in range(shape.num_prompts)]


def greedy(max_tokens: int):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- kvserve: continuous and static batching on one engine --------------------------------------------

def run_continuous(llm, prompts: list[list[int]], lengths: list[int]) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(lengths), "ignore_eos requests must generate exactly max_tokens"
    return {"seconds": elapsed, "useful_tokens": sum(lengths), "generated_tokens": generated,
            "engine_seconds": sum(o.engine_seconds for o in outs)}  # what metering charges the requests


def run_static(llm, prompts: list[list[int]], lengths: list[int], batch: int) -> dict:
    """Static batching on the same engine: admit `batch` requests, wait for all of them, repeat; each
    request generates as many tokens as the longest in its batch (the padded batch's work)."""
    engine = llm.engine
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        longest = max(lengths[i:i + batch])
        for p in group:
            engine.core.add_request(engine.request(p, greedy(longest)))
        while engine.core.has_unfinished_requests():
            for ro in engine.core.step():
                if ro.finished:
                    generated += len(ro.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "useful_tokens": sum(lengths), "generated_tokens": generated}


# ---- HF transformers static batches -------------------------------------------------------------------

def build_hf_model(model: str, dtype: str):
    import torch

    from kvserve.models.catalog import resolve_model
    from kvserve.models.hf_reference import hf_model_from_checkpoint
    from kvserve.models.loader import load_checkpoint

    _, path = resolve_model(model)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    return hf_model_from_checkpoint(load_checkpoint(path), torch_dtype)


def run_hf_static(hf, prompts: list[list[int]], lengths: list[int], batch: int) -> dict:
    import torch

    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        longest = max(lengths[i:i + batch])
        width = max(len(p) for p in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)  # left padding
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for r, p in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        generated += (out.shape[1] - width) * len(group)
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "useful_tokens": sum(lengths), "generated_tokens": generated}


# ---- TTFT -----------------------------------------------------------------------------------------------

def time_to_first_token(engine, prompt: list[int], salt: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    engine.core.add_request(engine.request(prompt, greedy(1), cache_salt=salt))
    ttft, cached = None, 0
    while engine.core.has_unfinished_requests():
        for ro in engine.core.step():
            if ttft is None and ro.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
                cached = ro.num_cached_tokens
    return ttft, cached


def measure_ttft(engine, prompt: list[int], runs: int) -> dict:
    time_to_first_token(engine, prompt, "hit")  # warm-up, and fills the cache for the hit runs
    miss, hit, miss_cached, hit_cached = [], [], [], []
    for k in range(runs):  # interleaved, so drift in machine load affects both alike
        t, c = time_to_first_token(engine, prompt, f"miss-{k}-{time.time_ns()}")
        miss.append(t)
        miss_cached.append(c)
        t, c = time_to_first_token(engine, prompt, "hit")
        hit.append(t)
        hit_cached.append(c)
    return {"prompt_tokens": len(prompt), "miss_s": miss, "hit_s": hit, "miss_cached_tokens": miss_cached,
            "hit_cached_tokens": hit_cached, "miss_median_s": statistics.median(miss),
            "hit_median_s": statistics.median(hit)}


# ---- report ---------------------------------------------------------------------------------------------

def tok_s(r: dict) -> float:
    return r["useful_tokens"] / r["seconds"]


def summarize(runs: list[dict]) -> dict:
    rates = [tok_s(r) for r in runs]
    return {"runs": runs, "useful_tok_s": rates, "median_useful_tok_s": statistics.median(rates),
            "median_generated_tok_s": statistics.median(r["generated_tokens"] / r["seconds"] for r in runs)}


def fmt_rate(s: dict | None) -> str:
    return "n/a" if not s else f"{s['median_useful_tok_s']:.1f}"


def render(result: dict) -> str:
    sh, cfg = result["shape"], result["config"]
    m = result["machine"]
    mode = "QUICK mode: smoke-test sizes, numbers are not meaningful" if cfg["quick"] else "full"
    lines = [f"# kvserve offline benchmark ({mode})",
             "",
             f"- machine: {m.get('cpu_model', '?')}, {m.get('nproc', '?')} cores visible, "
             f"load average {' '.join(m.get('loadavg', []) or ['?'])}; Python {platform.python_version()}",
             f"- model {cfg['model']}, engine dtype {cfg['dtype']}, torch {cfg['torch']} with {cfg['torch_threads']} "
             f"threads; HF baseline dtype {cfg['hf_dtype']}",
             f"- throughput: {sh['num_prompts']} prompts x {sh['prompt_len']} random tokens, greedy (temperature 0), "
             f"ignore_eos; max concurrency {sh['batch']} (engine max_num_seqs = static batch size); "
             f"median of {cfg['runs']} run(s); output tokens/s counts only the tokens each request asked for",
             "",
             "| outputs | kvserve continuous (tok/s) | kvserve static, same engine (tok/s) | continuous / static "
             "| HF transformers static (tok/s) | continuous / HF |",
             "|---|---|---|---|---|---|"]
    for name, w in result["throughput"].items():
        cont, stat, hf = w["continuous"], w["static"], w.get("hf_static")
        ratio = cont["median_useful_tok_s"] / stat["median_useful_tok_s"]
        hf_ratio = f"{cont['median_useful_tok_s'] / hf['median_useful_tok_s']:.2f}x" if hf else "n/a"
        lines.append(f"| {name} | {fmt_rate(cont)} | {fmt_rate(stat)} | {ratio:.2f}x | {fmt_rate(hf)} | {hf_ratio} |")
    if result.get("hf_error"):
        lines.append(f"\nHF baseline not run: {result['hf_error']}")
    t = result["ttft"]
    miss_cached, hit_cached = statistics.median(t["miss_cached_tokens"]), statistics.median(t["hit_cached_tokens"])
    lines += ["",
              f"| TTFT, {t['prompt_tokens']}-token prompt (median of {len(t['miss_s'])}) | miss | prefix-cache hit "
              f"| speedup |",
              "|---|---|---|---|",
              f"| median TTFT | {t['miss_median_s'] * 1000:.1f} ms (cached {miss_cached:.0f} tokens) "
              f"| {t['hit_median_s'] * 1000:.1f} ms (cached {hit_cached:.0f} tokens) "
              f"| {t['miss_median_s'] / t['hit_median_s']:.1f}x |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", help="engine dtype: auto, float32, bfloat16")
    ap.add_argument("--hf-dtype", default="bfloat16", help="dtype of the transformers baseline")
    ap.add_argument("--runs", type=int, default=3, help="runs per measurement (medians are reported)")
    ap.add_argument("--batch", type=int, default=None, help="max concurrency / static batch size (default 32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one run: a smoke test of this script")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    import torch

    from kvserve import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    shape = Shape.quick() if a.quick else Shape()
    if a.batch:
        shape.batch = a.batch
    runs = 1 if a.quick and a.runs == 3 else a.runs
    if not a.quick:
        shape.ttft_runs = max(shape.ttft_runs, runs)

    def log(msg: str) -> None:
        print(f"[offline] {msg}", file=sys.stderr, flush=True)

    log(f"loading {a.model} ({a.dtype})")
    # KV pool: every running sequence's longest possible context (no preemption), nothing more.
    per_seq = -(-(shape.prompt_len + max(shape.output_len, shape.varied_max)) // 16)
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=shape.batch, enable_prefix_caching=False,
              num_gpu_blocks_override=shape.batch * per_seq + 16, swap_space=0)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(shape.num_prompts, shape.prompt_len, vocab, seed=0)
    llm.generate(prompts[:2], [greedy(4)] * 2, use_tqdm=False)  # warm-up

    result: dict = {"machine": machine_info(), "shape": asdict(shape),
                    "config": {"model": a.model, "dtype": str(engine.dtype).replace("torch.", ""),
                               "hf_dtype": None if a.no_hf else a.hf_dtype, "torch": torch.__version__,
                               "torch_threads": torch.get_num_threads(), "runs": runs, "quick": a.quick,
                               "sampling": "greedy (temperature 0), ignore_eos"},
                    "throughput": {}}
    workloads = {f"all {shape.output_len}": output_lengths(shape, varied=False),
                 f"uniform {shape.varied_min}-{shape.varied_max}": output_lengths(shape, varied=True)}
    for name, lengths in workloads.items():
        cont, stat = [], []
        for k in range(runs):
            log(f"{name}: run {k + 1}/{runs}: continuous")
            cont.append(run_continuous(llm, prompts, lengths))
            log(f"{name}: run {k + 1}/{runs}: static ({tok_s(cont[-1]):.1f} tok/s continuous)")
            stat.append(run_static(llm, prompts, lengths, shape.batch))
            log(f"{name}: run {k + 1}/{runs}: {tok_s(stat[-1]):.1f} tok/s static")
        result["throughput"][name] = {"output_lengths": lengths, "continuous": summarize(cont),
                                      "static": summarize(stat)}

    ttft_blocks = (2 * shape.ttft_runs + 2) * (shape.ttft_prompt_len // 16 + 1) + 16
    ttft_llm = LLM(a.model, dtype=a.dtype, enable_prefix_caching=True, num_gpu_blocks_override=ttft_blocks,
                   swap_space=0)
    ttft_prompt = random_prompts(1, shape.ttft_prompt_len, vocab, seed=2)[0]
    log(f"TTFT: {shape.ttft_runs} runs each, miss and hit")
    result["ttft"] = measure_ttft(ttft_llm.engine, ttft_prompt, shape.ttft_runs)
    del ttft_llm, llm, engine

    if not a.no_hf:
        try:
            import transformers  # noqa: F401

            log(f"HF transformers baseline ({a.hf_dtype})")
            hf = build_hf_model(a.model, a.hf_dtype)
            run_hf_static(hf, prompts[:2], [4, 4], 2)  # warm-up
            for name, lengths in workloads.items():
                hf_runs = []
                for k in range(runs):
                    hf_runs.append(run_hf_static(hf, prompts, lengths, shape.batch))
                    log(f"{name}: run {k + 1}/{runs}: {tok_s(hf_runs[-1]):.1f} tok/s HF static")
                result["throughput"][name]["hf_static"] = summarize(hf_runs)
        except Exception as e:  # noqa: BLE001 - the baseline is optional
            result["hf_error"] = f"{type(e).__name__}: {e}"
            log(f"HF baseline failed: {result['hf_error']}")

    table = render(result)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**result, "markdown": table}, f, indent=1)
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
