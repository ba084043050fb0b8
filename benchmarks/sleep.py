"""Sleep mode against a cold load (issue 55's target: waking takes at most 0.3x a cold load).

  python -m benchmarks.sleep [--models smollm2-135m,llama-1b.Q8_0] [--rounds 3] [--out docs/bench]

Per model and round, in a fresh process (the kernels already built): the checkpoint's file dropped from the page
cache, then a cold load (`LLM(model)`: the checkpoint read, the model built and packed, the KV pool allocated), 16
greedy tokens, then `sleep()` (the weights written to a file that is then dropped from the page cache too, and the
weights' and KV pool's pages freed) and `wake_up()` (the weights read back; the KV pool's memory is taken again in
a thread meanwhile), and the same 16 tokens again. The resident memory (RSS) loaded, asleep and awake (once the KV
pool's memory is held again). Medians over the rounds. Model names: the catalog's, or a shape of
benchmarks/shapes.py (`llama-1b.Q8_0`, written once if missing). Writes sleep.json and sleep.md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.pages import stamp, table, write_page

PROMPT = [17, 2054, 931, 4011, 88, 7, 12500, 301] * 8


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drop_from_page_cache(path) -> None:
    from pathlib import Path

    path = Path(path)
    for f in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_round(model: str, sleep_dir: str) -> dict:
    """A cold load, a sleep and a wake in this process (run by `--one`)."""
    from kvserve import LLM, SamplingParams
    from kvserve.models.catalog import resolve_model

    _drop_from_page_cache(resolve_model(model)[1])
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=8)
    cold = time.perf_counter() - t0
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    loaded = _rss()
    report = llm.sleep(sleep_dir)
    asleep = _rss()
    t0 = time.perf_counter()
    wake = llm.wake_up()
    again = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine._sleeper.populating.join()  # the KV pool's memory taken again (in a thread after the wake)
    held = time.perf_counter() - t0
    return {"cold_load_s": cold, "sleep_s": report.seconds, "wake_s": wake, "kv_held_s": held, "paged_out_gb": report.paged_out_bytes / 1e9,
            "freed_kv_gb": report.discarded_bytes / 1e9, "rss_loaded_gb": loaded / 1e9, "rss_asleep_gb": asleep / 1e9,
            "rss_awake_gb": _rss() / 1e9, "same_tokens": again == tokens}


def _model_arg(name: str) -> str:
    """A catalog name as it is; a benchmarks/shapes.py shape name as its GGUF's path (written once)."""
    from benchmarks.shapes import SHAPES, ShapeModel, make

    if name.rpartition(".")[0] in SHAPES:
        shape = ShapeModel.parse(name)
        return str(make(shape.shape, shape.quant, log=lambda m: print(f"[sleep] {m}", file=sys.stderr)))
    return name


def run(a) -> dict:
    import tempfile

    rows = {}
    for name in a.models.split(","):
        model = _model_arg(name)
        runs = []
        for r in range(a.rounds):
            with tempfile.TemporaryDirectory(prefix="kvserve-sleep-bench-") as tmp:
                proc = subprocess.run([sys.executable, "-m", "benchmarks.sleep", "--one", model, "--sleep-dir", tmp],
                                      capture_output=True, text=True, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"[sleep] {name} round {r}: {runs[-1]}", file=sys.stderr, flush=True)
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0] if k != "same_tokens"}
        rows[name] = {"runs": runs, "median": med, "wake_ratio": med["wake_s"] / med["cold_load_s"],
                      "same_tokens": all(run["same_tokens"] for run in runs)}
    return {"rounds": a.rounds, "models": rows}


def markdown(result: dict, info: dict) -> str:
    body = []
    for name, r in result["models"].items():
        m = r["median"]
        body.append([name, f"{m['cold_load_s']:.2f}", f"{m['sleep_s']:.2f}", f"{m['wake_s']:.3f}",
                     f"{m['kv_held_s']:.2f}",
                     f"{r['wake_ratio']:.3f}", "yes" if r["wake_ratio"] <= 0.3 else "no",
                     f"{m['paged_out_gb']:.3f}", f"{m['freed_kv_gb']:.3f}",
                     f"{m['rss_loaded_gb']:.2f} / {m['rss_asleep_gb']:.2f} / {m['rss_awake_gb']:.2f}",
                     "yes" if r["same_tokens"] else "NO"])
    return "\n".join([
        "# Sleep mode: waking against a cold load", "",
        "Sleep mode (docs/models.md#sleep-mode) frees a loaded model's memory and keeps its engine: the weights are "
        "written to a file and their pages freed, the KV pool's pages freed unsaved; waking reads the weights back "
        "into the same addresses (the model serves from then; the KV pool's memory is taken again in a thread "
        "meanwhile, not counted in the wake). The target (issue 55): waking takes at most 0.3x a cold load. Each round in a fresh "
        "process, the kernels built already; the checkpoint's file and the sleep file are both read cold (dropped "
        f"from the page cache). Medians of {result['rounds']} rounds; GB are 10^9 bytes.", "",
        table(["model", "cold load, s", "sleep, s", "wake, s", "KV memory held again (16 tokens served meanwhile), s",
               "wake / cold", "<= 0.3x", "weights paged out, GB",
               "KV freed, GB", "RSS loaded / asleep / awake, GB", "same 16 greedy tokens after waking"], body), "",
        f"Machine: {info['machine'].get('cpu_model', '?')}. Command: `{info['command']}` ({info['when']}).", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-1b.Q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a round in this process: its figures as JSON
    ap.add_argument("--sleep-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one_round(a.one, a.sleep_dir)))
        return 0
    info = stamp("benchmarks.sleep", argv)
    result = {**run(a), **info}
    write_page(a.out, "sleep", result, markdown(result, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
