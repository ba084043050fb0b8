"""The CUDA engine's decode and prefill steps on a random-weight model in Llama-3.1-8B's shape, built directly in
GPU memory (no model file, no package beyond torch and Triton): what `scripts/device-check.sh` runs on a lent GPU.

    python -m benchmarks.gpu_decode [--json OUT.json] [--iters 20]
    python -m benchmarks.gpu_decode --device cpu --tiny --json smoke.json   # the pipeline on a CPU (Triton's interpreter)

Per decode shape (batch 1, 16, 64, 256 at contexts 1K and 4K where the KV fits, and 256 mixed: mean 1K, max
8K) it times one model step (every layer and the LM head of the batch's rows) on each attention path: the torch
reference (a gather of every sequence's pages padded to the longest context, then masked matmuls) and Triton's
paged kernels (kernels/triton_attention.py), medians of `--iters` steps by CUDA events after a warm-up. Then a
2048-token prefill on each path, the kernels against the reference on one decode shape (relative error of the
attention output), a profiler split of one decode step (GEMM, attention, copies and other kernels, host time),
and the HBM floor: the weights' bytes over the copy bandwidth measured here. Then the same decode shapes through the
engine's CUDA graphs (engine/worker/cuda_graphs.py; `graph_decode`): replay against the eager forward over the
same buffers, bit for bit, step times and the host's time per replay; last, the projections made FP8 (where the
GPU has it) and the first decode shapes again. One JSON file and Markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.pages import print_and_save, table


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and shapes: a smoke run of the pipeline")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def model_config(tiny: bool):
    from kvserve.config import ModelConfig

    if tiny:
        return ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
                           max_position_embeddings=1024, tie_word_embeddings=False, name="tiny")
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=16384, tie_word_embeddings=False,
                       name="Llama-3.1-8B shape, random weights")


def decode_shapes(tiny: bool) -> list[tuple[str, list[int]]]:
    """(label, each sequence's context) per decode shape."""
    if tiny:
        return [("b1 c64", [64]), ("b4 c40", [40] * 4), ("b4 mixed", [10, 33, 70, 16])]
    shapes = [(f"b{b} c{c // 1024}K", [c] * b) for c in (1024, 4096) for b in (1, 16, 64, 256)]
    import random

    rng = random.Random(0)
    mixed = [8192] + [rng.randint(64, 1936) for _ in range(255)]  # one 8K context among 1K-mean ones
    return shapes + [("b256 mixed (mean 1K, max 8K)", mixed)]


def build_model(config, device, dtype, shard=None):
    """The model with random weights, allocated on the device in `dtype` (nothing in host memory). Each weight is
    drawn whole from a seed of its own name, so `shard` (a models/parallel.TensorParallel rank) holds its slices of
    the very weights the whole model holds."""
    import zlib

    import torch

    from kvserve.models.backend import Backend
    from kvserve.models.llama import LlamaForCausalLM

    shapes = {}
    if shard is not None:  # the whole model's shapes (its weights are left unallocated: torch.empty's pages)
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    torch.set_default_device(device)
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(shard.shard_config(config) if shard is not None else config)
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device("cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            shape = shapes.get(name, p.shape)
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            whole = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, shape[-1] ** -0.5, generator=gen)
            hf_name = "lm_head.weight" if name == "lm_head_weight" else "model." + name  # what slice() reads
            p.copy_(whole if shard is None else shard.slice(hf_name, whole, config))
    model.use_backend(Backend("cuda" if device.type == "cuda" else "cpu-torch"))
    return model.eval()


class Steps:
    """Decode and prefill steps of the model over one KV pool, timed on either attention path."""

    PAGE = 16

    def __init__(self, model, config, device, dtype, pool_tokens: int):
        import torch

        from kvserve.models.attention import new_kv_cache

        self.model, self.config, self.device = model, config, device
        blocks = pool_tokens // self.PAGE + 1
        shape = (config.num_kv_heads, blocks, self.PAGE, config.head_dim)
        gen = torch.Generator(device=device).manual_seed(1)
        # Stored blocks first, as the engine holds them on CUDA (Plan.kv_pages_contiguous).
        self.kv = [tuple(new_kv_cache(shape, dtype, device, pages_contiguous=True).normal_(generator=gen)
                         for _ in "kv") for _ in range(config.num_layers)]
        self.blocks = blocks

    def use(self, kernels: str) -> None:
        from dataclasses import replace

        self.model.use_backend(replace(self.model.backend, attention=kernels))

    def decode_tables(self, contexts: list[int]):
        """Each sequence's pages scattered over the pool (block 0 left out: the graphs' scratch block), as one
        table padded with block 0."""
        import torch

        pages = [-(-c // self.PAGE) for c in contexts]
        perm = torch.randperm(self.blocks - 1, device="cpu")[:sum(pages)] + 1
        tables = torch.zeros(len(contexts), max(pages), dtype=torch.int64)
        at = 0
        for i, n in enumerate(pages):
            tables[i, :n] = perm[at:at + n]
            at += n
        return tables

    def decode_meta(self, contexts: list[int]):
        import torch

        from kvserve.models.attention import AttentionMetadata

        tables = self.decode_tables(contexts)
        lens = torch.tensor(contexts, dtype=torch.int64)
        pos = lens - 1
        slots = tables[torch.arange(len(contexts)), pos // self.PAGE] * self.PAGE + pos % self.PAGE
        meta = AttentionMetadata(slot_mapping=slots.to(self.device), num_decode_tokens=len(contexts),
                                 decode_block_tables=tables.to(self.device), decode_context_lens=lens.to(self.device),
                                 decode_max_context=max(contexts), decode_min_context=min(contexts))
        return pos.to(self.device), meta

    def prefill_meta(self, tokens: int):
        import torch

        from kvserve.models.attention import AttentionMetadata, PrefillChunk

        pages = -(-tokens // self.PAGE)
        table = torch.arange(1, pages + 1, dtype=torch.int64)
        pos = torch.arange(tokens)
        slots = table[pos // self.PAGE] * self.PAGE + pos % self.PAGE
        meta = AttentionMetadata(slot_mapping=slots.to(self.device),
                                 prefills=[PrefillChunk(0, tokens, tokens, table.to(self.device))])
        return pos.to(self.device), meta

    def step(self, positions, meta, last_rows):
        import torch

        ids = torch.randint(0, self.config.vocab_size, positions.shape, device=self.device)
        with torch.no_grad():
            hidden = self.model(ids, positions, self.kv, meta)
            return self.model.compute_logits(hidden[last_rows])

    def timed(self, positions, meta, last_rows, iters: int) -> float:
        """Median ms of a step (CUDA events on a GPU, the wall clock elsewhere), after two warm-up steps."""
        import torch

        for _ in range(2):
            self.step(positions, meta, last_rows)
        times = []
        for _ in range(iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.step(positions, meta, last_rows)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                self.step(positions, meta, last_rows)
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def _paged_tokens(contexts: list[int]) -> int:
    """Tokens of pool the contexts' pages take (whole pages each)."""
    return sum(-(-c // Steps.PAGE) for c in contexts) * Steps.PAGE


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes per second of a device tensor copy (read + written), the median of 5."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:])


def kernel_error(steps: Steps, contexts: list[int]) -> float:
    """Relative error of the Triton decode kernel's output against the reference on one shape (layer 0)."""
    import torch

    from kvserve.kernels.triton_attention import paged_decode_attention
    from kvserve.models.attention import _decode_attention_torch

    c = steps.config
    _, meta = steps.decode_meta(contexts)
    query = torch.randn(len(contexts), c.num_heads, c.head_dim, device=steps.device, dtype=steps.kv[0][0].dtype)
    k, v = steps.kv[0]
    ours = paged_decode_attention(query, k, v, meta.decode_block_tables, meta.decode_context_lens,
                                  c.head_dim ** -0.5, max_context=meta.decode_max_context).float()
    ref = _decode_attention_torch(query.float(), k.float(), v.float(), meta, c.head_dim ** -0.5, None).float()
    return float((ours - ref).abs().max() / ref.abs().max())


def profile_split(steps: Steps, contexts: list[int]) -> dict:
    """One decode step under torch's profiler: device time by kind of kernel, and the host's time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    positions, meta = steps.decode_meta(contexts)
    rows = torch.arange(len(contexts), device=steps.device)
    steps.step(positions, meta, rows)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if steps.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        steps.step(positions, meta, rows)
        host_ms = (time.perf_counter() - t) * 1e3
        if steps.device.type == "cuda":
            torch.cuda.synchronize()
    kinds = {"gemm": 0.0, "attention": 0.0, "copy": 0.0, "other": 0.0}
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if not device_us:
            continue
        name = e.key.lower()
        kind = ("gemm" if any(s in name for s in ("gemm", "cutlass", "matmul", "sm90", "xmma")) else
                "attention" if any(s in name for s in ("_decode_split", "_merge_splits", "_prefill_kernel",
                                                       "softmax", "flash", "fmha")) else
                "copy" if any(s in name for s in ("copy", "index", "gather", "cat")) else "other")
        kinds[kind] += device_us / 1e3
    return {"device_ms": kinds, "host_ms_to_enqueue": host_ms}


def graph_decode(steps: Steps, shapes: list[tuple[str, list[int]]], iters: int) -> list[dict]:
    """Decode steps through the engine's DecodeGraphs (engine/worker/cuda_graphs.py) on Triton's kernels, each
    shape's batch padded to its bucket: captured graphs replayed (CUDA; on the CPU the eager stand-in) against the
    same forward run eagerly over the same buffers. Per shape: whether the two give the same bits, the wall time
    of a step as the engine runs one (stage, copy, forward, the rows' logits, one sync), and the host's time to
    stage and launch a replay."""
    import torch

    from kvserve.engine.worker.cuda_graphs import DecodeGraphs, capture_cuda_graph, replay_eagerly

    steps.use("triton")
    device = steps.device
    longest = max(max(c) for _, c in shapes)
    graph_capture = (capture_cuda_graph(torch.cuda.graph_pool_handle()) if device.type == "cuda"
                     else replay_eagerly)
    runs = {name: DecodeGraphs(steps.model, steps.kv, (), 1, Steps.PAGE, max_blocks=-(-longest // Steps.PAGE),
                               max_batch=max(len(c) for _, c in shapes), scratch_block=0, device=device,
                               capture=capture)
            for name, capture in (("graph", graph_capture), ("eager", replay_eagerly))}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for label, contexts in shapes:
        if _paged_tokens(contexts) > steps.blocks * Steps.PAGE - Steps.PAGE:
            continue
        tables = [[t] for t in steps.decode_tables(contexts).tolist()]
        ids = torch.randint(0, steps.config.vocab_size, (len(contexts),)).tolist()
        starts = [c - 1 for c in contexts]
        row = {"shape": label, "bucket": None}
        with torch.inference_mode():
            out = {name: r.run(ids, starts, tables).clone() for name, r in runs.items()}
            row["bucket"] = next(b for b in runs["graph"].sizes if b >= len(contexts))
            row["graph_equals_eager"] = bool(torch.equal(out["graph"], out["eager"]))
            for name, r in runs.items():
                wall, host = [], []
                for _ in range(iters + 2):
                    sync()
                    t = time.perf_counter()
                    hidden = r.run(ids, starts, tables)
                    launched = time.perf_counter()
                    steps.model.compute_logits(hidden).argmax(-1).tolist()  # the engine's one sync a step
                    wall.append((time.perf_counter() - t) * 1e3)
                    host.append((launched - t) * 1e3)
                row[f"{name}_ms"] = statistics.median(wall[2:])
                row[f"{name}_host_ms"] = statistics.median(host[2:])
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def fp8_decode(steps: Steps, shapes: list[tuple[str, list[int]]], iters: int, bf16_bytes: int,
               bandwidth: float) -> dict:
    """The model's projections made e4m3 with row scales (weights = fp8: models/fp8.py, torch._scaled_mm), then
    the first shapes' decode steps again on Triton's kernels, with their HBM floor; skipped where the GPU has no
    FP8 (compute capability below 8.9). Run last: it converts the model in place."""
    import torch

    device = steps.device
    from kvserve.models import fp8

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < fp8.MIN_CAPABILITY:
        return {"skipped": "no FP8 on this GPU (compute capability below 8.9)"}
    head = steps.model.lm_head
    steps.model.to_fp8()
    held = sum(p.numel() * p.element_size() for p in steps.model.parameters())
    steps.use("triton")
    rows = []
    for label, contexts in shapes[:3]:
        positions, meta = steps.decode_meta(contexts)
        ms = steps.timed(positions, meta, torch.arange(len(contexts), device=device), iters)
        rows.append({"shape": label, "triton_ms": ms})
        print(json.dumps(rows[-1]), flush=True)
    return {"weights_bytes": held, "hbm_floor_ms": held / bandwidth * 1e3, "bf16_weights_bytes": bf16_bytes,
            "lm_head": str(head.dtype).removeprefix("torch."), "decode": rows}


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's kernels on the CPU: its interpreter
    import torch

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(a.tiny)
    shapes = decode_shapes(a.tiny)
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "model": config.name, "dtype": str(dtype).removeprefix("torch."),
              "cuda_graphs": "captured per bucket" if device.type == "cuda" else "eager stand-in (no CUDA)"}
    model = build_model(config, device, dtype)
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2 ** 34
    pool_tokens = min(max(_paged_tokens(c) for _, c in shapes), int(free * 0.85) // kv_token_bytes)
    steps = Steps(model, config, device, dtype, pool_tokens)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24)
    result.update(weights_bytes=weights_bytes, copy_bytes_per_s=bandwidth, kv_pool_tokens=pool_tokens,
                  hbm_floor_ms=weights_bytes / bandwidth * 1e3)
    decode = []
    for label, contexts in shapes:
        row = {"shape": label, "batch": len(contexts), "mean_context": statistics.mean(contexts),
               "max_context": max(contexts)}
        if _paged_tokens(contexts) > pool_tokens:
            row["skipped"] = f"its KV ({sum(contexts)} tokens) does not fit the pool ({pool_tokens})"
        else:
            positions, meta = steps.decode_meta(contexts)
            rows = torch.arange(len(contexts), device=device)
            for kernels in ("torch", "triton"):
                steps.use(kernels)
                row[f"{kernels}_ms"] = steps.timed(positions, meta, rows, a.iters)
            row["speedup"] = row["torch_ms"] / row["triton_ms"]
        decode.append(row)
        print(json.dumps(row), flush=True)
    result["decode"] = decode
    result["graphs"] = graph_decode(steps, shapes, a.iters)
    tokens = 64 if a.tiny else 2048
    positions, meta = steps.prefill_meta(tokens)
    prefill = {"tokens": tokens}
    for kernels in ("torch", "triton"):
        steps.use(kernels)
        ms = steps.timed(positions, meta, torch.tensor([tokens - 1], device=device), max(1, a.iters // 4))
        prefill[f"{kernels}_tok_per_s"] = tokens / ms * 1e3
    result["prefill"] = prefill
    check = shapes[1][1] if len(shapes) > 1 else shapes[0][1]
    result["kernel_rel_err"] = kernel_error(steps, check)
    steps.use("triton")
    result["profile_triton"] = profile_split(steps, check)
    result["fp8"] = fp8_decode(steps, shapes, a.iters, weights_bytes, bandwidth)
    print_and_save(result, render(result), a.json)
    return 0


def render(r: dict) -> str:
    lines = [f"{r['model']} on {r['device']} ({r['dtype']}, torch {r['torch']}): weights "
             f"{r['weights_bytes'] / 1e9:.2f} GB, copy {r['copy_bytes_per_s'] / 1e9:.0f} GB/s, HBM floor "
             f"{r['hbm_floor_ms']:.2f} ms a step; CUDA graphs: {r['cuda_graphs']}", "",
             table(["decode shape", "reference ms", "Triton ms", "reference / Triton"],
                   [[d["shape"], f"skipped: {d['skipped']}", "", ""] if "skipped" in d else
                    [d["shape"], f"{d['torch_ms']:.2f}", f"{d['triton_ms']:.2f}", f"{d['speedup']:.2f}x"]
                    for d in r["decode"]])]
    lines += ["", table(["decode shape (graphs)", "bucket", "eager ms", "graph ms", "eager / graph",
                         "host ms a replay", "same bits"],
                        [[g["shape"], str(g["bucket"]), f"{g['eager_ms']:.2f}", f"{g['graph_ms']:.2f}",
                          f"{g['speedup']:.2f}x", f"{g['graph_host_ms']:.3f}", "yes" if g["graph_equals_eager"]
                          else "NO"] for g in r["graphs"]])]
    f = r["fp8"]
    if "skipped" in f:
        lines += ["", f"FP8 weights: skipped ({f['skipped']})."]
    else:
        lines += ["", f"FP8 weights (e4m3, row scales; LM head {f['lm_head']}): {f['weights_bytes'] / 1e9:.2f} GB, "
                  f"HBM floor {f['hbm_floor_ms']:.2f} ms a step; decode on Triton's kernels: "
                  + ", ".join(f"{d['shape']} {d['triton_ms']:.2f} ms" for d in f["decode"]) + "."]
    p = r["prefill"]
    lines += ["", f"Prefill of {p['tokens']} tokens: reference {p['torch_tok_per_s']:.0f} tok/s, Triton "
              f"{p['triton_tok_per_s']:.0f} tok/s. Kernel against the reference: relative error "
              f"{r['kernel_rel_err']:.2e}. One Triton decode step's device time by kind (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["profile_triton"]["device_ms"].items())
              + f"; host time to enqueue it {r['profile_triton']['host_ms_to_enqueue']:.2f} ms."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
