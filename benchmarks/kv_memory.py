"""KV memory: what the KV groups (engine/kv/groups.py) save on Gemma 3, whose five sliding layers (window 512)
come with every full one.

  python -m benchmarks.kv_memory [--model gemma3-270m] [--real] [--real-tokens 32000] [--disk] [--out docs/bench]

1. Allocator (every context in CONTEXTS, exact, no model run): the engine's own KVCacheManager, in the model's
   layout with and without groups, drives sequences through chunked prefill (chunks of the engine's default
   max_num_batched_tokens) and then decode, as the scheduler allocates them:
   - the most KV bytes one sequence holds (its last prefill chunk) and what it holds while decoding;
   - how many such sequences fit in one pool of POOL_BYTES at once: sequences are admitted one after another,
     each prefilled while the earlier ones hold their decode-time blocks, until one no longer fits.
2. `--real`: the model itself serves one prompt of `--real-tokens` tokens (a fixed text, the standard
   library's own source) with 32 greedy tokens, with and without groups: the most blocks the sequence held,
   the time to its first token and per output token, and whether the tokens and logprobs are the same bits.
3. `--disk`: the disk tier (engine/kv/disk.py) on `--disk-model`: TTFT of a 2048-token prompt computed, loaded
   from the disk after the pool evicted it, after a restart, and after a graceful restart of a pool that evicted
   nothing (what the shutdown saved); and a W4-like load whose prefixes do not fit the
   pool, its prefix hit rate with the disk tier against an unbounded pool's.
4. Fair shares (always, the allocator): a tenant's cached prefixes beside another tenant's flood of 16k-token
   prompts, with the tenants' shares and with one LRU for all.

Writes kv-memory.json and kv-memory.md (a BENCHMARKS.md page) under --out.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import textwrap
import time
from pathlib import Path

CONTEXTS = (4096, 8192, 16384, 32768)
POOL_BYTES = 4 << 30
CHUNK = 2048  # SchedulerConfig.max_num_batched_tokens' default


def _log(msg: str) -> None:
    print(f"[kv_memory] {msg}", file=sys.stderr, flush=True)


def _model_config(model: str):
    from kvserve.models.catalog import resolve_model
    from kvserve.models.model_info import read_model_info

    _, path = resolve_model(model)
    return read_model_info(path).config


def allocator_rows(config, block_size: int = 16) -> list[dict]:
    """Section 1 for each context: bytes held and sequences that fit, with and without groups."""
    from kvserve.engine.kv.manager import KVCacheManager
    from kvserve.engine.kv.groups import KVLayout
    from kvserve.engine.request import Sequence
    from kvserve.engine.sampling import SamplingParams

    layer_token_bytes = 2 * config.num_kv_heads * config.head_dim * 2  # K and V of one layer, bf16
    rows = []
    for context in CONTEXTS:
        row = {"context": context}
        for label, split in (("groups", True), ("classic", False)):
            layout = KVLayout.for_windows(config.layer_windows, split=split)
            page = layout.page_bytes(block_size, layer_token_bytes)
            kv = KVCacheManager(int(POOL_BYTES // page), 0, block_size, enable_prefix_caching=False, layout=layout)
            peak, decode, fitted = 0, 0, 0
            while True:
                seq = Sequence(seq_id=fitted, request_id=str(fitted), prompt_token_ids=[1] * context,
                               sampling=SamplingParams())
                ok = True
                while seq.num_computed_tokens < context:
                    n = min(CHUNK, context - seq.num_computed_tokens)
                    if not kv.allocate_slots(seq, n):
                        ok = False
                        break
                    peak = max(peak, kv.num_blocks_held(seq))
                    seq.num_computed_tokens += n
                if ok:  # its first decode step: from now on it holds what a decode holds
                    seq.append_token(1)
                    ok = kv.allocate_slots(seq, 1)
                    decode = kv.num_blocks_held(seq)
                if not ok:
                    break
                fitted += 1
            row[label] = {"peak_bytes": peak * page, "decode_bytes": decode * page, "fit": fitted,
                          "pool_pages": kv.num_device_blocks, "page_bytes": page, "groups": layout.num_groups}
        row["held_ratio"] = row["groups"]["decode_bytes"] / row["classic"]["decode_bytes"]
        row["peak_ratio"] = row["groups"]["peak_bytes"] / row["classic"]["peak_bytes"]
        row["fit_ratio"] = row["groups"]["fit"] / max(1, row["classic"]["fit"])
        rows.append(row)
    return rows


def _long_prompt(tokenizer, tokens: int) -> list[int]:
    import argparse as a_module
    import json.decoder as j_module
    import typing as t_module

    text = "".join(textwrap.dedent(inspect.getsource(m)) for m in (a_module, j_module, t_module))
    ids = tokenizer.encode("Summarize this code:\n" + text * (1 + tokens // max(1, len(tokenizer.encode(text)))))
    return ids[:tokens]


def real_rows(model: str, tokens: int) -> dict:
    """Section 2: one long prompt served with and without groups."""
    from kvserve import LLM, SamplingParams

    out: dict = {"tokens": tokens}
    bits = {}
    for label, split in (("groups", True), ("classic", False)):
        llm = LLM(model, dtype="bfloat16", kv_groups=split, enable_prefix_caching=False, kv_cache_memory="2GiB",
                  max_model_len=tokens + 64, swap_space=0)
        eng = llm.engine
        prompt = _long_prompt(eng.tokenizer, tokens)
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
        eng.core.add_request(eng.request(prompt, params))
        t0 = time.perf_counter()
        first, peak, stamps, final = None, 0, [], None
        while eng.core.has_unfinished_requests():
            for ro in eng.core.step():
                now = time.perf_counter()
                if ro.outputs and ro.outputs[0].delta_token_ids:
                    first = first or now
                    stamps.append(now)
                if ro.finished:
                    final = ro
            for seq in eng.core.scheduler._running:
                peak = max(peak, eng.core.kv.num_blocks_held(seq))
        page = eng.kv_page_bytes
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        out[label] = {"peak_bytes": peak * page, "ttft_s": first - t0, "tpot_ms": 1000 * statistics.median(gaps),
                      "pool_pages": eng.core.kv.num_device_blocks}
        bits[label] = [(lp.token_id, lp.logprob) for lp in final.outputs[0].logprobs]
        _log(f"{label}: {out[label]}")
        del llm, eng
    out["same_bits"] = bits["groups"] == bits["classic"]
    out["peak_ratio"] = out["groups"]["peak_bytes"] / out["classic"]["peak_bytes"]
    return out


def _serve(eng, prompt: list[int], max_tokens: int = 1) -> tuple[float, int, int]:
    """(seconds to the first token, cached prompt tokens, of which from the disk)."""
    from kvserve import SamplingParams

    t0 = time.perf_counter()
    eng.core.add_request(eng.request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    first, out = None, None
    while eng.core.has_unfinished_requests():
        for ro in eng.core.step():
            if first is None and ro.outputs and ro.outputs[0].delta_token_ids:
                first = time.perf_counter() - t0
            if ro.finished:
                out = ro
    return first, out.num_cached_tokens, out.num_tier_cached_tokens


def disk_rows(model: str, runs: int, directory: Path) -> dict:
    """Section 3: the disk tier. TTFT of a 2048-token prompt computed, loaded from the disk after the pool evicted
    it, after a restart on the same directory, and after a graceful restart of a pool that evicted nothing (one
    prompt a run, medians); then a W4-like load whose prefixes
    do not fit the pool: its prefix hit rate with the disk tier against an unbounded pool's."""
    import random
    import shutil

    from kvserve import LLM

    shutil.rmtree(directory, ignore_errors=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(2048)] for _ in range(runs)]
    pool = 2048 // 16 + 40  # one prompt and a little: the next one evicts it

    def engine(**kw):
        return LLM(model, dtype="bfloat16", swap_space=0, **kw).engine

    eng = engine(num_gpu_blocks_override=pool, kv_disk_dir=str(directory))
    _serve(eng, [7] * 64)  # warm-up
    cold = [_serve(eng, p) for p in prompts]
    _serve(eng, [rng.randrange(1000, 30000) for _ in range(2048)])  # evicts the last prompt too
    eng.kv_disk.flush(60)
    loaded = [_serve(eng, p) for p in prompts]
    eng.close()
    del eng
    eng = engine(num_gpu_blocks_override=pool, kv_disk_dir=str(directory))
    restarted = [_serve(eng, p) for p in prompts]
    eng.close()
    del eng
    # A graceful restart: a pool that holds every prompt evicts nothing to the disk while it serves; only the
    # shutdown's save (LLMEngine.close) puts the pool's prefix blocks there for the restarted engine.
    graceful_dir, every_prompt = directory / "graceful", runs * (2048 // 16 + 1) + 64
    eng = engine(num_gpu_blocks_override=every_prompt, kv_disk_dir=str(graceful_dir))
    for p in prompts:
        _serve(eng, p)
    pages_before_shutdown = sum(1 for f in graceful_dir.rglob("*") if f.is_file() and len(f.name) == 64)
    eng.close()
    del eng
    eng = engine(num_gpu_blocks_override=every_prompt, kv_disk_dir=str(graceful_dir))
    graceful = [_serve(eng, p) for p in prompts]
    eng.close()
    del eng
    out: dict = {"prompt_tokens": 2048, "runs": runs, "graceful_pages_before_shutdown": pages_before_shutdown}
    for label, rows in (("cold", cold), ("disk", loaded), ("restart", restarted), ("graceful", graceful)):
        out[label] = {"ttft_s": statistics.median(r[0] for r in rows), "cached": [r[1] for r in rows],
                      "from_disk": [r[2] for r in rows]}
    for label in ("disk", "restart", "graceful"):
        out[f"{label}_ratio"] = out[label]["ttft_s"] / out["cold"]["ttft_s"]

    # W4-like: 8 prefixes of 512 tokens (system prompts), 32 requests cycling over them, 64 own tokens each.
    prefixes = [[rng.randrange(1000, 30000) for _ in range(512)] for _ in range(8)]
    requests = [prefixes[i % 8] + [rng.randrange(1000, 30000) for _ in range(64)] for i in range(32)]
    small = 2 * (512 + 64) // 16 + 8  # about two prefixes
    rates = {}
    for label, kw in (("unbounded", dict(num_gpu_blocks_override=8 * 40 + 64)),
                      ("small pool", dict(num_gpu_blocks_override=small)),
                      ("small pool + disk", dict(num_gpu_blocks_override=small, kv_disk_dir=str(directory / "w4")))):
        shutil.rmtree(directory / "w4", ignore_errors=True)
        eng = engine(**kw)
        for r in requests:
            _serve(eng, r, max_tokens=4)
        u = eng.core.kv.usage()
        rates[label] = {"hit_rate": u.prefix_hit_rate, "from_disk": u.tier_hit_tokens / max(1, u.prefix_query_tokens)}
        if eng.kv_disk is not None:
            eng.close()
        del eng
    out["w4"] = rates
    out["w4_ratio"] = rates["small pool + disk"]["hit_rate"] / rates["unbounded"]["hit_rate"]
    shutil.rmtree(directory, ignore_errors=True)
    return out


def fairness_rows(block_size: int = 16) -> dict:
    """Section 4, the allocator: tenant "b" cycles over 4 prefixes of 512 tokens (64 own tokens a request) while
    tenant "a" sends 16k-token prompts, one after each of b's requests, in a pool of 40k tokens; b's prefix hit
    rate alone, beside the flood with the tenants' shares (engine/kv/eviction.py), and beside it with one LRU for
    all (the flood's blocks counted as b's)."""
    import random

    from kvserve.engine.kv.manager import KVCacheManager
    from kvserve.engine.request import Sequence
    from kvserve.engine.sampling import SamplingParams

    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(512)] for _ in range(4)]
    ids = iter(range(10 ** 9))

    def serve(kv, tokens: list[int], tenant: str) -> tuple[int, int]:
        seq = Sequence(seq_id=next(ids), request_id="r", prompt_token_ids=tokens, sampling=SamplingParams(),
                       cache_salt=tenant, tenant=tenant)
        cached = kv.get_computed_blocks(seq)
        seq.num_computed_tokens = cached
        while seq.num_computed_tokens < len(tokens):
            n = min(CHUNK, len(tokens) - seq.num_computed_tokens)
            assert kv.allocate_slots(seq, n)
            seq.num_computed_tokens += n
            kv.cache_full_blocks(seq)
        kv.free(seq)
        return cached, len(tokens)

    def run(flood: bool, fair: bool) -> float:
        kv = KVCacheManager(40_960 // block_size, 0, block_size)
        hit = asked = 0
        for i in range(64):
            b = prefixes[i % 4] + [rng.randrange(1000, 30000) for _ in range(64)]
            c, n = serve(kv, b, "b" if fair else "all")
            if i >= 4:  # after each prefix's first (cold) request
                hit, asked = hit + c, asked + n
            if flood:
                serve(kv, [rng.randrange(1000, 30000) for _ in range(16_384)], "a" if fair else "all")
        return hit / asked

    alone = run(False, True)
    out = {"alone": alone, "flood_fair": run(True, True), "flood_lru": run(True, False)}
    out["fair_ratio"], out["lru_ratio"] = out["flood_fair"] / alone, out["flood_lru"] / alone
    return out


def _mib(b: float) -> str:
    return f"{b / (1 << 20):.1f}"


def render(result: dict) -> str:
    m = result["machine"]
    lines = ["# KV memory: groups per attention kind", "",
             f"Machine: {m.get('cpu_model', '?')} ({m.get('nproc', '?')} CPUs); `{result['command']}`; "
             f"{result['when']}. Model: {result['model']} ({result['layers']}).", "",
             f"## The allocator: one pool of {POOL_BYTES >> 20} MiB, bf16, chunks of {CHUNK} tokens", "",
             "The engine's own KV manager in the model's layout, with KV groups and with every layer holding every "
             "token's block (`kv_groups = false`, the layout before groups). Exact counts, no model run.", "",
             "| context | held decoding, MiB (groups / classic) | ratio | most held (last chunk) | ratio | "
             "sequences that fit (groups / classic) | ratio |", "|---|---|---|---|---|---|---|"]
    for r in result["allocator"]:
        g, c = r["groups"], r["classic"]
        lines.append(f"| {r['context']} | {_mib(g['decode_bytes'])} / {_mib(c['decode_bytes'])} | "
                     f"{100 * r['held_ratio']:.1f}% | {_mib(g['peak_bytes'])} / {_mib(c['peak_bytes'])} | "
                     f"{100 * r['peak_ratio']:.1f}% | {g['fit']} / {c['fit']} | {r['fit_ratio']:.2f}x |")
    real = result.get("real")
    if real:
        g, c = real["groups"], real["classic"]
        lines += ["", f"## Served: one {real['tokens']}-token prompt, 32 greedy tokens", "",
                  "| | most KV held, MiB | TTFT, s | TPOT, ms |", "|---|---|---|---|",
                  f"| groups | {_mib(g['peak_bytes'])} | {g['ttft_s']:.1f} | {g['tpot_ms']:.1f} |",
                  f"| classic | {_mib(c['peak_bytes'])} | {c['ttft_s']:.1f} | {c['tpot_ms']:.1f} |", "",
                  f"Held with groups: {100 * real['peak_ratio']:.1f}% of classic. Tokens and logprobs "
                  f"{'the same bits' if real['same_bits'] else 'DIFFER'} with and without groups. One run each "
                  "(the times are single measurements; the bytes are exact)."]
    disk = result.get("disk")
    if disk:
        lines += ["", f"## The disk tier: {disk['model']}, a {disk['prompt_tokens']}-token prompt, medians of "
                      f"{disk['runs']}", "",
                  "| TTFT | s | of computing it |", "|---|---|---|",
                  f"| computed (cold) | {disk['cold']['ttft_s']:.3f} | 100% |",
                  f"| loaded from the disk (the pool evicted it) | {disk['disk']['ttft_s']:.3f} | "
                  f"{100 * disk['disk_ratio']:.0f}% |",
                  f"| after a restart on the same directory | {disk['restart']['ttft_s']:.3f} | "
                  f"{100 * disk['restart_ratio']:.0f}% |",
                  f"| after a graceful restart, nothing evicted (the shutdown saved the pool) | "
                  f"{disk['graceful']['ttft_s']:.3f} | {100 * disk['graceful_ratio']:.0f}% |", "",
                  "Prompt tokens served from the disk per run: "
                  f"{disk['disk']['from_disk']} (evicted), {disk['restart']['from_disk']} (restart), "
                  f"{disk['graceful']['from_disk']} (graceful restart; pages on the disk before its shutdown: "
                  f"{disk['graceful_pages_before_shutdown']}).", "",
                  "W4-like load whose prefixes do not fit the pool (8 prefixes of 512 tokens, 32 requests cycling over "
                  "them, 64 own tokens each; a pool of about two prefixes):", "",
                  "| pool | prefix hit rate | of it from the disk |", "|---|---|---|"]
        for label, r in disk["w4"].items():
            lines.append(f"| {label} | {100 * r['hit_rate']:.1f}% | {100 * r['from_disk']:.1f}% |")
        lines += ["", f"With the disk tier the small pool's hit rate is {100 * disk['w4_ratio']:.0f}% of the unbounded "
                      "pool's."]
    fair = result.get("fairness")
    if fair:
        lines += ["", "## Fair shares of the prefix cache: the allocator", "",
                  "Tenant b cycles over 4 prefixes of 512 tokens (64 own tokens a request, 64 requests) while tenant a "
                  "sends a 16k-token prompt after each of b's, in a pool of 40k tokens (the engine's KV manager, no "
                  "model run: hit rates do not depend on the compute).", "",
                  "| b's prefix hit rate | | of alone |", "|---|---|---|",
                  f"| alone | {100 * fair['alone']:.1f}% | 100% |",
                  f"| beside a's flood, tenants' shares | {100 * fair['flood_fair']:.1f}% | "
                  f"{100 * fair['fair_ratio']:.0f}% |",
                  f"| beside a's flood, one LRU for all | {100 * fair['flood_lru']:.1f}% | "
                  f"{100 * fair['lru_ratio']:.0f}% |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--real", action="store_true", help="also serve one long prompt with and without groups")
    ap.add_argument("--real-tokens", type=int, default=32000)
    ap.add_argument("--disk", action="store_true", help="also measure the disk tier (TTFT, restart, W4-like hits)")
    ap.add_argument("--disk-model", default="smollm2-135m")
    ap.add_argument("--disk-dir", default="/tmp/kvserve-bench-kv-disk", help="scratch directory for the disk tier")
    ap.add_argument("--runs", type=int, default=3, help="prompts (runs) per disk-tier TTFT, medians reported")
    ap.add_argument("--out", default="docs/bench", help="directory for kv-memory.json and kv-memory.md")
    a = ap.parse_args(argv)
    from benchmarks.pages import stamp, write_page

    config = _model_config(a.model)
    windows = config.layer_windows
    sliding = sum(w is not None for w in windows)
    result = {**stamp("benchmarks.kv_memory", argv), "model": a.model,
              "layers": f"{len(windows)} layers, {sliding} sliding (window {config.sliding_window})"}
    _log("allocator")
    result["allocator"] = allocator_rows(config)
    result["fairness"] = fairness_rows()
    if a.real:
        result["real"] = real_rows(a.model, a.real_tokens)
    if a.disk:
        _log("disk tier")
        result["disk"] = {"model": a.disk_model, **disk_rows(a.disk_model, a.runs, Path(a.disk_dir))}
    write_page(a.out, "kv-memory", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
