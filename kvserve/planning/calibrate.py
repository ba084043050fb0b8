"""`kvserve plan calibrate`: fit the roofline step-time model to the real engine on this machine.

It loads the model as the server would (the models TOML's engine settings), runs a short profile of
engine steps (decode batches of 1-64 sequences at two context lengths, prefill chunks of 16-2048 tokens,
prefill beside decodes), times each step from one `step()` to the next, and fits

    seconds = overhead + per_seq x sequences + max(FLOPs x a, bytes x b)

with FLOPs and bytes from planning/roofline.py for the model at the engine's dtype: 1/a and 1/b are the
FLOP/s and bytes/s the engine reaches here, the two fixed terms are the host's share. The fit alternates
between assigning each step to the side of the max that binds it and a non-negative least squares on
relative error (so the 5 ms steps count as much as the 500 ms ones) until the assignment is stable.

The result is a calibration file that `--accelerator cpu` plans with. This module runs the engine (torch);
everything it fits with is pure.
"""
from __future__ import annotations

import json
import logging
import platform
import random
import statistics
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from kvserve.engine.step_time import nonnegative_least_squares
from kvserve.planning.roofline import Deployment, Efficiency, StepModel, StepParts, Work
from kvserve.planning.specs import AcceleratorSpec, ModelSpec, calibration_path

log = logging.getLogger(__name__)

_UNIT = AcceleratorSpec(name="unit", memory_bytes=1, memory_bandwidth=1.0, bf16_flops=1.0)
_RAW = Efficiency(flops=1.0, bandwidth=1.0, step_overhead_s=0.0, per_seq_s=0.0, allreduce_latency_s=0.0)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (128, 1024)
PREFILL_LENGTHS = (16, 64, 256, 1024, 2048)
STEPS_PER_POINT = 5


def features(model: ModelSpec, weight_dtype: str, kv_dtype: str, work: list[Work]) -> StepParts:
    return StepModel(Deployment(model, _UNIT, 1, weight_dtype, kv_dtype), _RAW).parts(work)


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _roof(p: StepParts, flops: float, bandwidth: float) -> float:
    return max(p.linear_flops / flops, p.weight_bytes / bandwidth) + max(p.attention_flops / flops,
                                                                         p.kv_bytes / bandwidth)


def _fit_host(samples, flops: float, bandwidth: float) -> tuple[list[float], float]:
    """For a given FLOP/s and bandwidth, the host terms (overhead, per_seq, prefill overhead) >= 0 that
    minimize the squared relative error; returns them and that error."""
    rows = []
    for p, t in samples:
        roof = _roof(p, flops, bandwidth)
        rows.append(([1.0 / t, p.seqs / t, p.has_prefill / t], 1.0 - roof / t))
    a = [[sum(r[0][i] * r[0][j] for r in rows) for j in range(3)] for i in range(3)]
    y = [sum(r[0][i] * r[1] for r in rows) for i in range(3)]
    theta = nonnegative_least_squares(a, y)
    err = sum((sum(x * c for x, c in zip(r[0], theta)) - r[1]) ** 2 for r in rows)
    return theta, err


def fit(samples: list[tuple[StepParts, float]]) -> dict:
    """Fit FLOP/s and bandwidth (a log grid, then a finer one around the best) and, for each pair, the
    host terms by non-negative least squares, all on relative error. Samples: (a step's parts, seconds)."""
    best = (float("inf"), 0.0, 0.0, [0.0, 0.0, 0.0])
    flops_grid, bw_grid = _grid(1e9, 1e16, 36), _grid(1e8, 1e14, 36)
    for _ in range(3):
        for fl in flops_grid:
            for bw in bw_grid:
                theta, err = _fit_host(samples, fl, bw)
                if err < best[0]:
                    best = (err, fl, bw, theta)
        _, fl, bw = best[:3]
        flops_grid, bw_grid = _grid(fl / 2, fl * 2, 13), _grid(bw / 2, bw * 2, 13)
    _, fl, bw, (o, p, pf) = best
    pred = [o + p * s.seqs + pf * s.has_prefill + _roof(s, fl, bw) for s, _t in samples]
    rel = [(q - t) / t for q, (_s, t) in zip(pred, samples)]
    return {"step_overhead_s": o, "per_seq_s": p, "prefill_overhead_s": pf, "flops": fl, "bandwidth": bw,
            "rms_relative_error": (sum(r * r for r in rel) / len(rel)) ** 0.5,
            "median_abs_relative_error": statistics.median(abs(r) for r in rel)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _dtype_name(dtype) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(dtype)]


class _Profiler:
    """Runs the engine step by step, recording each step's scheduled work and its cycle time."""

    def __init__(self, engine, vocab: int, seed: int = 0):
        self.engine, self.vocab, self.rng = engine, vocab, random.Random(seed)
        self.samples: list[tuple[list[Work], float]] = []
        self._captured = None
        schedule = engine.scheduler.schedule

        def capture():
            self._captured = schedule()
            return self._captured

        engine.scheduler.schedule = capture

    def add(self, prompt_len: int, max_tokens: int, prompt: list[int] | None = None) -> str:
        from kvserve.engine.sampling import SamplingParams

        prompt = prompt or [self.rng.randrange(self.vocab) for _ in range(prompt_len)]
        return self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                              temperature=0.0))

    def step(self, record: bool) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - t0
        out = self._captured
        if record and out is not None and out.scheduled:
            self.samples.append(([Work(s.num_new_tokens, s.start, s.sample) for s in out.scheduled], seconds))

    def _until_decoding(self) -> None:
        sched = self.engine.scheduler
        while sched.stats().num_waiting or any(s.is_prefill for s in sched._running):
            self.step(False)

    def clear(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort_request(rid)

    def decode_point(self, batch: int, context: int) -> None:
        """`batch` sequences decoding at `context` tokens. They share one prompt, so only the first
        computes it (the others hit the prefix cache): the profile's time goes to the decode steps."""
        prompt = [self.rng.randrange(self.vocab) for _ in range(context)]
        room = self.engine.max_model_len - context
        ids = [self.add(context, room, prompt)]
        self._until_decoding()
        ids += [self.add(context, room, prompt) for _ in range(batch - 1)]
        self._until_decoding()
        for _ in range(STEPS_PER_POINT):
            self.step(True)
        self.clear(ids)

    def prefill_point(self, tokens: int, beside: int = 0, repeats: int = 3) -> None:
        """A prompt of `tokens` computed in one step, alone or beside `beside` decoding sequences."""
        others = [self.add(128, self.engine.max_model_len - 128) for _ in range(beside)]
        self._until_decoding()
        for _ in range(repeats):
            rid = self.add(tokens, 1)
            self.step(True)
            self.clear([rid])
        self.clear(others)


def calibrate(model_id: str, config_path: str | None = None, output: str | Path | None = None,
              price_per_hour: float | None = None) -> dict:
    """Profile the real engine serving `model_id` (as the models TOML configures it), fit, and write the file."""
    from kvserve.config import ServerConfig
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models.catalog import resolve_source
    from kvserve.planning.specs import spec_from_gguf, spec_from_hf_config

    config = ServerConfig.from_toml(config_path)
    entry = next((m for m in config.models if m.id == model_id), None)
    if entry is None:
        raise ValueError(f"model {model_id!r} is not in {config_path or 'the default models'} "
                         f"(there: {', '.join(m.id for m in config.models)})")
    path = resolve_source(entry.source, entry.engine_args.get("install", ""))
    ec = entry.engine_config()
    sched = replace(ec.scheduler, interactive=replace(ec.scheduler.interactive, max_queue_wait_s=float("inf"),
                                                      max_ttft_s=float("inf")))
    engine = LLMEngine(replace(ec, model=str(path), scheduler=sched), model_id=model_id)
    spec = spec_from_gguf(Path(path)) if str(path).endswith(".gguf") else \
        spec_from_hf_config(json.loads((Path(path) / "config.json").read_text()), name=model_id)
    spec = replace(spec, name=model_id)
    dtype = _dtype_name(engine.dtype)
    prof = _Profiler(engine, spec.vocab_size)
    t0 = time.perf_counter()
    prof.decode_point(1, 64)  # warm-up (kernels, allocator), not recorded
    prof.samples.clear()
    cfg = engine.config.scheduler
    pool_tokens = engine.kv.num_device_blocks * engine.kv.block_size
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if batch <= cfg.max_num_seqs and context + 64 <= pool_tokens // 2:
                t = time.perf_counter()
                prof.decode_point(batch, context)
                log.info("decode %d x %d tokens: %.1fs", batch, context, time.perf_counter() - t)
    for tokens in PREFILL_LENGTHS:
        if tokens <= min(cfg.max_num_batched_tokens, engine.max_model_len - 1):
            t = time.perf_counter()
            prof.prefill_point(tokens, repeats=1 if tokens >= 1024 else 3)
            log.info("prefill %d tokens: %.1fs", tokens, time.perf_counter() - t)
    prof.prefill_point(min(256, cfg.max_num_batched_tokens // 2), beside=8)
    profile_s = time.perf_counter() - t0
    rows = [(features(spec, dtype, dtype, w), s) for w, s in prof.samples]
    result = fit(rows)
    import os

    kv_pool = engine.kv.num_device_blocks * engine.kv.block_size * engine.kv_bytes_per_token
    doc = {
        "version": 1, "source": "kvserve plan calibrate", "measured_at": datetime.now(timezone.utc).isoformat(),
        "cpu": _cpu_name(), "cores": os.cpu_count(), "model": model_id, "weight_dtype": dtype, "kv_dtype": dtype,
        "num_blocks": engine.kv.num_device_blocks, "block_size": engine.kv.block_size, "kv_pool_bytes": kv_pool,
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": engine.max_model_len, "profile_s": profile_s, "fit": result,
        "machine": {"name": f"cpu ({_cpu_name()}, {os.cpu_count()} cores)",
                    "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "flops": result["flops"], "memory_bandwidth": result["bandwidth"],
                    "price_per_hour": entry.price.replica_cost_per_hour if price_per_hour is None else price_per_hour,
                    "note": "effective figures of the real engine at its dtype, fitted; not a datasheet"},
        "samples": [{"work": [[x.new, x.start, int(x.sample)] for x in w], "seconds": s} for w, s in prof.samples],
    }
    out = Path(output) if output else calibration_path(model_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    doc["path"] = str(out)
    return doc
