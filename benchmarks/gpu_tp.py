"""Tensor parallelism on a lent machine with several GPUs: the random-weight Llama-3.1-8B-shaped model of
benchmarks/gpu_decode.py whole on one GPU, then split over `--tp` GPUs (models/parallel.py, NCCL), each rank
holding its slices of the very same weights. Greedy tokens of one prompt (a prefill, then decode steps through the
paged cache) must match; a decode step at batch 64 over 1K contexts is timed on each (medians, CUDA events).
What `scripts/device-check.sh` runs after gpu_decode; it says "skipped" where the machine has fewer GPUs.

    python -m benchmarks.gpu_tp [--tp 2] [--json OUT.json]
    python -m benchmarks.gpu_tp --device cpu --tiny --json smoke.json   # the pipeline on a CPU (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.pages import print_and_save

PROMPT_TOKENS = 64
DECODE_TOKENS = 16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and batch: a smoke run of the pipeline")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def measure(a, device, shard=None) -> dict:
    """Greedy tokens of one prompt and the median decode step of a batch, on the whole model or this rank's
    slice (`shard`), each with its own KV pool."""
    import torch

    from benchmarks.gpu_decode import Steps, build_model, model_config
    from kvserve.models.parallel import attach

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(a.tiny)
    model = build_model(config, device, dtype, shard)
    if shard is not None:
        attach(model, shard, config)
    # This rank's heads and the whole vocabulary (its logits are gathered).
    own = replace(shard.shard_config(config), vocab_size=config.vocab_size) if shard is not None else config
    batch, context = (4, 40) if a.tiny else (64, 1024)
    steps = Steps(model, own, device, dtype, pool_tokens=batch * context + 4096)
    steps.use("triton" if device.type == "cuda" else "torch")
    prompt = torch.arange(PROMPT_TOKENS, device=device) * 7 % config.vocab_size
    positions, meta = steps.prefill_meta(PROMPT_TOKENS)
    tokens = []
    with torch.no_grad():
        logits = steps.model.compute_logits(steps.model(prompt, positions, steps.kv, meta)[-1:])
        table = meta.prefills[0].block_table
        for step in range(DECODE_TOKENS):
            tokens.append(int(logits.argmax()))
            pos = PROMPT_TOKENS + step
            decode = _decode_meta(steps, table, pos, device)
            hidden = steps.model(torch.tensor([tokens[-1]], device=device), torch.tensor([pos], device=device),
                                 steps.kv, decode)
            logits = steps.model.compute_logits(hidden)
    positions, meta = steps.decode_meta([context] * batch)
    ms = steps.timed(positions, meta, torch.arange(batch, device=device), a.iters)
    return {"tokens": tokens, "step_ms": ms, "batch": batch, "context": context}


def _decode_meta(steps, table, pos: int, device):
    """One sequence's decode at `pos` over the prompt's pages (a fresh page when it crosses into one)."""
    import torch

    from kvserve.models.attention import AttentionMetadata

    page = steps.PAGE
    need = pos // page + 1
    if len(table) < need:
        table = torch.cat([table, torch.arange(len(table) + 1, need + 1, device=table.device)])
    slot = table[pos // page] * page + pos % page
    return AttentionMetadata(slot_mapping=slot.view(1).to(device), num_decode_tokens=1,
                             decode_block_tables=table.view(1, -1).to(device),
                             decode_context_lens=torch.tensor([pos + 1], device=device),
                             decode_max_context=pos + 1, decode_min_context=pos + 1)


def _rank(rank: int, a, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.models.parallel import TensorParallel

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.tp))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.tp)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        result = measure(a, device, TensorParallel(a.tp, rank))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    from kvserve.engine.worker.tensor_parallel import free_port

    result = {"tp": a.tp, "model": "tiny" if a.tiny else "Llama-3.1-8B shape, random weights"}
    if a.device == "cuda" and torch.cuda.device_count() < a.tp:
        result["skipped"] = f"{torch.cuda.device_count()} GPU(s) here; tensor parallelism over {a.tp} needs {a.tp}"
    else:
        result["device"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
        whole = measure(a, torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu"))
        if a.device == "cuda":
            torch.cuda.empty_cache()
        out = Path(a.json or "gpu_tp.json").with_suffix(".rank0.json")
        mp.spawn(_rank, args=(a, free_port(), str(out)), nprocs=a.tp, join=True)
        split = json.loads(out.read_text())
        out.unlink()
        result.update(whole=whole, split=split, tokens_equal=whole["tokens"] == split["tokens"],
                      step_ratio=split["step_ms"] / whole["step_ms"])
    print_and_save(result, render(result), a.json)
    return 0


def render(r: dict) -> str:
    if "skipped" in r:
        return f"Tensor parallelism (tp {r['tp']}): skipped: {r['skipped']}\n"
    w, s = r["whole"], r["split"]
    return (f"Tensor parallelism, {r['model']} on {r['device']}: a decode step at batch {w['batch']} over "
            f"{w['context']}-token contexts {w['step_ms']:.2f} ms whole, {s['step_ms']:.2f} ms over {r['tp']} "
            f"ranks ({r['step_ratio']:.2f}x); greedy tokens {'equal' if r['tokens_equal'] else 'DIFFER'} "
            f"({DECODE_TOKENS} after a {PROMPT_TOKENS}-token prompt).\n")


if __name__ == "__main__":
    sys.exit(main())
