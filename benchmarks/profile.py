"""Where an engine step's time goes: a W1-shaped offline run with timers around each part.

  python -m benchmarks.profile [--model smollm2-135m] [--prompts 64] [--input 256] [--output 128]
                               [--max-seqs 32] [--dtype bfloat16] [--per-op] [--json out.json]
                               [--markdown docs/bench/cpu/KIND-profile.md]

The run is W1's shape on the offline engine (no HTTP): 64 fresh prompts of 256 random tokens,
128 greedy output tokens each (ignore_eos), at most 32 sequences running. A warm-up run of the
same shape comes first (kernels compiled, oneDNN primitives built), then the timed run.

Timers wrap, per step: the scheduler, the runner's input preparation and model forward, the LM
head, sampling and output processing. Inside the forward: steps the fused native decoder runs
(with its own per-phase clocks, read on the kernel's master thread at each barrier) and steps that
go op by op. Reported as milliseconds per step and share of the step, as a Markdown table
(and JSON with --json). Wrapping adds a few microseconds per call; the step total is measured
the same way with and without it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import time
from pathlib import Path

import kvserve  # noqa: F401  (first: it caps torch's CPU dispatch at KVSERVE_CPU_ISA's level)
import torch

from kvserve.kernels import isa
from benchmarks.pages import table
from kvserve.models.native_decoder import PHASES


def _wrap(obj, name: str, clock: collections.Counter, key: str) -> None:
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock[key] += time.perf_counter() - t

    setattr(obj, name, timed)


class _TimedDecoder:
    """The model's fused decoder with a timer around its calls (Python looks `__call__` up on the type)."""

    def __init__(self, inner, clock: collections.Counter):
        self.inner, self.clock = inner, clock

    def applies(self, *args) -> bool:
        return self.inner.applies(*args)

    def compute_logits(self, hidden):  # the LM head: timed by the model's compute_logits wrapper
        return self.inner.compute_logits(hidden)

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.clock["fused"] += time.perf_counter() - t


def run(model: str, prompts: int, input_len: int, output_len: int, max_seqs: int, dtype: str = "bfloat16",
        native_decoder: bool = True, weights: str = "auto", numerics: str = "batch_invariant") -> dict:
    from kvserve import LLM
    from kvserve.engine.sampling import SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory="1GiB", max_num_seqs=max_seqs, enable_prefix_caching=False,
              native_decoder=native_decoder, weights=weights, numerics=numerics)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)

    def workload() -> tuple[int, float]:
        for _ in range(prompts):
            engine.core.add_request(engine.request([rng.randrange(100, 40000) for _ in range(input_len)], params))
        steps, t = 0, time.perf_counter()
        while engine.core.has_unfinished_requests():
            engine.core.step()
            steps += 1
        return steps, time.perf_counter() - t

    workload()  # warm-up
    clock: collections.Counter = collections.Counter()
    model_obj = engine.runner.model
    decoder = model_obj.native_decoder
    _wrap(engine.core.scheduler, "schedule", clock, "scheduler")
    _wrap(engine.runner, "execute", clock, "runner.execute")
    _wrap(model_obj, "forward", clock, "forward")
    _wrap(model_obj, "compute_logits", clock, "lm_head")
    _wrap(engine.runner, "_sample", clock, "sampling")
    _wrap(engine.core, "_update", clock, "update")
    phases = None
    if decoder is not None:
        phases = decoder.enable_profile()
        model_obj.native_decoder = _TimedDecoder(decoder, clock)
    steps, wall = workload()
    per_step = {k: v / steps * 1e3 for k, v in clock.items()}
    rows = [("step (wall)", wall / steps * 1e3)]
    fused = per_step.get("fused", 0.0)
    if phases is not None:
        rows += [(f"fused: {name}", float(phases[i]) / steps * 1e3) for i, name in enumerate(PHASES)]
        rows.append(("fused: call overhead outside the kernel's phases", fused - float(phases.sum()) / steps * 1e3))
    rows += [
        ("forward, op by op (steps the fused decoder does not take)", per_step.get("forward", 0.0) - fused),
        ("LM head (sampled rows) + float32 logits", per_step.get("lm_head", 0.0)),
        ("runner: inputs, metadata, swaps/copies", per_step.get("runner.execute", 0.0) - per_step.get("forward", 0.0)
         - per_step.get("lm_head", 0.0) - per_step.get("sampling", 0.0)),
        ("sampling", per_step.get("sampling", 0.0)),
        ("output processing (tokens into the scheduler, text, stops)", per_step.get("update", 0.0)),
        ("scheduler", per_step.get("scheduler", 0.0)),
    ]
    from benchmarks.ceilings import machine_info

    return {"model": model, "machine": machine_info(), "shape": [prompts, input_len, output_len, max_seqs],
            "dtype": str(model_obj.embed_tokens.weight.dtype).removeprefix("torch."), "weights": engine.weights,
            "steps": steps, "wall_s": wall, "output_tok_s": prompts * output_len / wall,
            "threads": torch.get_num_threads(), "fused_decoder": decoder is not None,
            "rows": [{"part": name, "ms_per_step": ms, "share": ms / (wall / steps * 1e3)} for name, ms in rows]}


def page(result: dict, command: str) -> str:
    """The profile as its CPU kind's page in BENCHMARKS.md (docs/bench/cpu/<kind>-profile.md)."""
    m = result.get("machine") or {}
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx") if m.get(f))
    prompts, input_len, output_len, max_seqs = result.get("shape") or ["?"] * 4
    return "\n".join([
        "# Where a W1-shaped step's time goes", "",
        f"Generated by `{command}` (benchmarks/profile.py) on {m.get('cpu_model', '?')} ({flags}) at CPU level "
        f"{m.get('isa_level', 'native')}: the offline engine, no HTTP, {prompts} prompts of {input_len} random "
        f"tokens, {output_len} greedy output tokens each, at most {max_seqs} running; a warm-up run, then the "
        "timed one. The fused decoder's phases are timed on its master thread at each barrier; a row's "
        "milliseconds are per engine step, prefill and decode steps together.", "",
        markdown(result), ""])


def markdown(result: dict) -> str:
    lines = [f"{result['steps']} steps, {result['wall_s']:.2f} s, {result['output_tok_s']:.0f} output tok/s, "
             f"{result.get('dtype', 'bfloat16')}, weights {result.get('weights', 'bfloat16')}, {result['threads']} threads, "
             f"fused decoder {'on' if result['fused_decoder'] else 'off'}", ""]
    return "\n".join(lines) + "\n" + table(["part", "ms / step", "share"], [
        [row["part"], f"{row['ms_per_step']:.2f}", f"{row['share'] * 100:.1f}%"] for row in result["rows"]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", help="auto, bfloat16 or float32")
    parser.add_argument("--per-op", action="store_true", help="without the fused decoder (its per-op path)")
    parser.add_argument("--weights", default="auto", help="auto, bf16, int8 or int4 (EngineConfig.weights)")
    parser.add_argument("--numerics", default="batch_invariant", help="batch_invariant or fast (EngineConfig.numerics)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="write the page here (docs/bench/cpu/<kind>-profile.md)")
    args = parser.parse_args(argv)
    result = run(args.model, args.prompts, args.input, args.output, args.max_seqs, args.dtype, not args.per_op,
                 args.weights, args.numerics)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        level = os.environ.get(isa.ENV)
        command = (f"{isa.ENV}={level} " if level else "") + (
            f"python -m benchmarks.profile --model {args.model} --prompts {args.prompts} --input {args.input} "
            f"--output {args.output} --max-seqs {args.max_seqs} --dtype {args.dtype} --weights {args.weights}"
            f" --numerics {args.numerics}"
            + (" --per-op" if args.per_op else ""))
        Path(args.markdown).write_text(page(result, command))


if __name__ == "__main__":
    main()
