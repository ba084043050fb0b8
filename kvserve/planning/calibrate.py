"""`kvserve plan calibrate`: fit the roofline step-time model to the real engine on this machine.

It loads the model as the server would (the models TOML's engine settings), runs a short profile of
engine steps (decode batches of 1-64 sequences at 128 tokens and of 2-24 at 512, one to eight prompts of
16-1024 tokens in a step, a prompt beside decodes; two passes over all of them), times each step from
one `step()` to the next, and fits

    seconds = overhead + per_seq x sequences (+ prefill overhead) + the per-operation roofline

with FLOPs and bytes from planning/roofline.py for the model at the engine's dtype: the GEMMs' FLOP/s,
attention's FLOP/s the engine reaches here, and the host's share; the bandwidth is measured (reading a
tensor far larger than the caches), since with one model it trades off against the fixed step time. The
speeds come from log grids, each finer than the last around the best point; at each point the host terms
are a non-negative least squares. Errors are relative (the 5 ms steps count as much as the 2 s ones), and each
profile point counts once, by its median step.

The result is a calibration file that `--accelerator cpu` plans with. This module runs the engine (torch);
everything it fits with is pure.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from kvserve.engine.step_time import DTYPE_LABELS, StepTimePrior, nonnegative_least_squares
from kvserve.planning.roofline import Deployment, Efficiency, StepModel, StepParts, Work
from kvserve.planning.specs import AcceleratorSpec, ModelSpec, calibration_path, model_from_dict

log = logging.getLogger(__name__)

_UNIT = AcceleratorSpec(name="unit", memory_bytes=1, memory_bandwidth=1.0, bf16_flops=1.0)
_RAW = Efficiency(flops=1.0, bandwidth=1.0, step_overhead_s=0.0, per_seq_s=0.0, allreduce_latency_s=0.0)
# (context, batches, shared prompt): short contexts over every batch size, cheaply (one shared prompt);
# a long context with distinct prompts, so attention reads as many blocks as real traffic does.
DECODE_POINTS = ((128, (1, 2, 4, 8, 16, 32, 64), True), (512, (2, 8, 24), False))
# (prompts, tokens) computed in one step: single prompts, and the several short prompts of a chunked-prefill
# step under load (a long prompt's attention, quadratic in its length, is one point, not the scale).
PREFILL_POINTS = ((1, 16), (1, 64), (1, 256), (4, 256), (8, 256), (1, 1024))
STEPS_PER_POINT = 4
PASSES = 2


def features(model: ModelSpec, weight_dtype: str, kv_dtype: str, work: list[Work]) -> StepParts:
    return StepModel(Deployment(model, _UNIT, 1, weight_dtype, kv_dtype), _RAW).parts(work)


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _roof(p: StepParts, speeds: tuple[float, float, float], half: float) -> float:
    flops, attention_flops, bandwidth = speeds
    gemm_rate = flops * p.tokens / (p.tokens + half) if p.tokens else flops
    return max(p.linear_flops / gemm_rate, p.weight_bytes / bandwidth) + max(p.attention_flops / attention_flops,
                                                                             p.kv_bytes / bandwidth)


def _fit_host(samples, speeds: tuple[float, float, float], half: float) -> tuple[list[float], float]:
    """For given speeds (GEMM FLOP/s, attention FLOP/s, bandwidth) and GEMM half-rate tokens, the host terms
    (overhead, per_seq, prefill overhead) >= 0 that minimize the squared relative error; returns them and
    that error."""
    rows = []
    for p, t in samples:
        roof = _roof(p, speeds, half)
        rows.append(([1.0 / t, p.seqs / t, p.has_prefill / t], 1.0 - roof / t))
    a = [[sum(r[0][i] * r[0][j] for r in rows) for j in range(3)] for i in range(3)]
    y = [sum(r[0][i] * r[1] for r in rows) for i in range(3)]
    theta = nonnegative_least_squares(a, y)
    err = sum((sum(x * c for x, c in zip(r[0], theta)) - r[1]) ** 2 for r in rows)
    return theta, err


HALF_RATE_TOKENS = (0.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


def fit(samples: list[tuple[StepParts, float]], bandwidth: float) -> dict:
    """Fit the GEMMs' FLOP/s (and the step size at which they reach half of it) and attention's FLOP/s (log
    grids, each finer than the last around the best point) and, at each point, the host terms by
    non-negative least squares, all on relative error; the bandwidth is measured, not fitted (with one
    model it trades off against the fixed step time). Samples: (a step's parts, seconds)."""
    best = (float("inf"), (0.0, 0.0, bandwidth), 0.0, [0.0, 0.0, 0.0])
    for half in HALF_RATE_TOKENS:
        grids = (_grid(1e9, 1e16, 29), _grid(1e9, 1e16, 29))
        local = (float("inf"), (0.0, 0.0, bandwidth), half, [0.0, 0.0, 0.0])
        for span in (1.8, 1.3, 1.1, 1.03, 1.01, None):  # each grid a finer one around the best so far
            for fl in grids[0]:
                for at in grids[1]:
                    theta, err = _fit_host(samples, (fl, at, bandwidth), half)
                    if err < local[0]:
                        local = (err, (fl, at, bandwidth), half, theta)
            if span is None:
                break
            grids = tuple(_grid(x / span, x * span, 7) for x in local[1][:2])
        best = min(best, local, key=lambda b: b[0])
    _, speeds, half, (o, p, pf) = best
    pred = [o + p * s.seqs + pf * s.has_prefill + _roof(s, speeds, half) for s, _t in samples]
    rel = [(q - t) / t for q, (_s, t) in zip(pred, samples)]
    return {"step_overhead_s": o, "per_seq_s": p, "prefill_overhead_s": pf, "flops": speeds[0],
            "gemm_half_rate_tokens": half, "attention_flops": speeds[1], "bandwidth": bandwidth,
            "rms_relative_error": (sum(r * r for r in rel) / len(rel)) ** 0.5,
            "median_abs_relative_error": statistics.median(abs(r) for r in rel)}


def measure_bandwidth(nbytes: int = 256 << 20, repeats: int = 9) -> float:
    """Bytes/s this machine reads: the median time to sum a bf16 tensor far larger than its caches."""
    import torch

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def point_medians(samples: list[tuple[StepParts, float, int]]) -> list[tuple[StepParts, float]]:
    """One (parts, seconds) per profile point: its median step over every pass, so a slow stretch (a
    neighbour's burst on a shared machine) moves the fit less than a whole point does."""
    by_point: dict[int, list[tuple[StepParts, float]]] = {}
    for parts, seconds, point in samples:
        by_point.setdefault(point, []).append((parts, seconds))
    out = []
    for steps in by_point.values():
        steps.sort(key=lambda x: x[1])
        out.append(steps[len(steps) // 2])
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _dtype_name(dtype) -> str:
    return DTYPE_LABELS[str(dtype)]


class _Profiler:
    """Runs the engine step by step, recording each step's scheduled work and its cycle time."""

    def __init__(self, engine, vocab: int, seed: int = 0):
        self.engine, self.vocab, self.rng = engine, vocab, random.Random(seed)
        self.samples: list[tuple[list[Work], float, int]] = []  # (work, seconds, profile point)
        self.point = 0
        self._captured = None
        schedule = engine.core.scheduler.schedule

        def capture():
            self._captured = schedule()
            return self._captured

        engine.core.scheduler.schedule = capture

    def add(self, prompt_len: int, max_tokens: int, prompt: list[int] | None = None) -> str:
        from kvserve.engine.sampling import SamplingParams

        prompt = prompt or [self.rng.randrange(self.vocab) for _ in range(prompt_len)]
        return self.engine.core.add_request(self.engine.request(prompt, SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True, temperature=0.0)))

    def step(self, record: bool) -> None:
        t0 = time.perf_counter()
        self.engine.core.step()
        seconds = time.perf_counter() - t0
        out = self._captured
        if record and out is not None and out.scheduled:
            self.samples.append(([Work(s.num_new_tokens, s.start, s.sample) for s in out.scheduled], seconds,
                                 self.point))

    def _until_decoding(self) -> None:
        sched = self.engine.core.scheduler
        while sched.stats().num_waiting or any(s.is_prefill for s in sched._running):
            self.step(False)

    def clear(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.core.abort_request(rid)

    def decode_point(self, batch: int, context: int, shared: bool) -> None:
        """`batch` sequences decoding at `context` tokens. `shared`: they share one prompt, so only the first
        computes it (the others hit the prefix cache) and the profile's time goes to decode steps; their
        attention then reads the same blocks, which stay in cache, so long contexts use distinct prompts."""
        prompt = [self.rng.randrange(self.vocab) for _ in range(context)]
        room = self.engine.max_model_len - context
        ids = [self.add(context, room, prompt if shared else None)]
        self._until_decoding()
        ids += [self.add(context, room, prompt if shared else None) for _ in range(batch - 1)]
        self._until_decoding()
        self.point += 1
        for _ in range(STEPS_PER_POINT):
            self.step(True)
        self.clear(ids)

    def prefill_point(self, prompts: int, tokens: int, beside: int = 0, repeats: int = 3) -> None:
        """`prompts` prompts of `tokens` computed in one step, alone or beside `beside` decoding sequences."""
        others = [self.add(128, self.engine.max_model_len - 128) for _ in range(beside)]
        self._until_decoding()
        self.point += 1
        for _ in range(repeats):
            ids = [self.add(tokens, 1) for _ in range(prompts)]
            self.step(True)
            self.clear(ids)
        self.clear(others)


def calibrate(model_id: str, config_path: str | None = None, output: str | Path | None = None,
              price_per_hour: float | None = None) -> dict:
    """Profile the real engine serving `model_id` (as the models TOML configures it), fit, and write the file."""
    from kvserve.config import ServerConfig
    from kvserve.engine.worker.llm_engine import LLMEngine
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
    prof.decode_point(1, 64, True)  # warm-up (kernels, allocator), not recorded
    prof.samples.clear()
    cfg = engine.config.scheduler
    pool_tokens = engine.core.kv.token_capacity
    for _ in range(PASSES):  # whole passes, so a neighbour's burst on a shared machine hits one pass of a point
        prof.point = 0
        for context, batches, shared in DECODE_POINTS:
            for batch in batches:
                if batch <= cfg.max_num_seqs and context + 64 <= min(pool_tokens // 2, engine.max_model_len):
                    prof.decode_point(batch, context, shared)
        for prompts, tokens in PREFILL_POINTS:
            if prompts * tokens <= cfg.max_num_batched_tokens and tokens < engine.max_model_len:
                prof.prefill_point(prompts, tokens, repeats=1 if prompts * tokens >= 1024 else 3)
        prof.prefill_point(1, min(256, cfg.max_num_batched_tokens // 2), beside=8)
        log.info("profile pass: %d steps so far, %.0f s", len(prof.samples), time.perf_counter() - t0)
    profile_s = time.perf_counter() - t0
    bandwidth = measure_bandwidth()
    result = fit(point_medians([(features(spec, dtype, dtype, w), s, p) for w, s, p in prof.samples]), bandwidth)
    # The pool in pages of the engine's KV groups (engine/kv/groups.py), as search.replica_memory reads it back.
    layout, layers = engine.core.kv.layout, engine.model_config.num_layers
    kv = engine.core.kv
    kv_pool = kv.num_pages * kv.block_size * engine.kv_bytes_per_token * layout.group_size / layers
    windows = [layout.groups[layout.placement(layer)[0]].window for layer in range(layers)]  # rebuild the layout
    doc = {
        "version": 1, "source": "kvserve plan calibrate", "measured_at": datetime.now(timezone.utc).isoformat(),
        "cpu": _cpu_name(), "cores": os.cpu_count(), "model": model_id, "weight_dtype": dtype, "kv_dtype": dtype,
        "num_blocks": engine.core.kv.num_pages, "kv_layer_windows": windows,
        "block_size": engine.core.kv.block_size, "kv_pool_bytes": kv_pool,
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": engine.max_model_len, "profile_s": profile_s, "fit": result, "model_spec": asdict(spec),
        "machine": {"name": f"cpu ({_cpu_name()}, {os.cpu_count()} cores)",
                    "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "flops": result["flops"], "attention_flops": result["attention_flops"],
                    "memory_bandwidth": result["bandwidth"],
                    "price_per_hour": entry.price.replica_cost_per_hour if price_per_hour is None else price_per_hour,
                    "note": "effective figures of the real engine at its dtype, fitted; not a datasheet"},
        "samples": [{"work": [[x.new, x.start, int(x.sample)] for x in w], "seconds": s, "point": p}
                    for w, s, p in prof.samples],
    }
    out = Path(output) if output else calibration_path(model_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    doc["path"] = str(out)
    return doc


# Shapes the affine prior is fitted over: decode batches at a typical context, and prompt chunks.
_PRIOR_DECODES = (1, 2, 4, 8, 16, 32, 64)
_PRIOR_PROMPTS = (32, 128, 512, 2048)
_PRIOR_CONTEXT = 512


def calibrated_step_model(doc: dict, model: ModelSpec | None = None) -> StepModel:
    """The step-time model of the machine and model a calibration measured (`model`: its own spec)."""
    from kvserve.planning.search import step_model
    from kvserve.planning.specs import calibrated_spec

    model = model or model_from_dict(doc["model_spec"])
    return step_model(Deployment(model, calibrated_spec(doc), 1, doc["weight_dtype"], doc["kv_dtype"]))


# The shapes a token's engine time is read at for break-even prices (`kvserve plan prices`): a prompt
# prefilled alone, and the decode batch of a lightly loaded server at a typical context.
PRICE_PROMPT_TOKENS = 512
PRICE_DECODE_BATCH = 8
PRICE_CONTEXT = 512


def token_seconds(doc: dict, prompt: int = PRICE_PROMPT_TOKENS, batch: int = PRICE_DECODE_BATCH,
                  context: int = PRICE_CONTEXT) -> tuple[float, float]:
    """(input, output): engine seconds per prompt token and per output token as metering charges them (each
    step's time split over its tokens), from a calibration: a `prompt`-token prompt prefilled alone, and
    `batch` sequences decoding at `context` tokens."""
    sm = calibrated_step_model(doc)
    return (sm.prefill(prompt, doc["max_num_batched_tokens"]) / prompt,
            sm.decode_step(batch, context).seconds / batch)


def step_time_prior(doc: dict, model: ModelSpec):
    """The engine's online step-time model (engine/step_time.py) started from a calibration instead of its
    generic defaults: the calibrated roofline evaluated over typical decode batches and prompt chunks, and
    the affine fit of those. Admission's wait and TTFT estimates are then right from the first request;
    the engine keeps learning from its own steps as before."""
    from kvserve.engine.step_time import StepTimeModel

    sm = calibrated_step_model(doc, model)
    shapes = [(b, 0, sm.seconds([Work(1, _PRIOR_CONTEXT)] * b)) for b in _PRIOR_DECODES]
    shapes += [(0, n, sm.seconds([Work(n, 0)])) for n in _PRIOR_PROMPTS]
    rows = [((1 / t, d / t, n / t), 1.0) for d, n, t in shapes]  # relative error: small steps count too
    a = [[sum(r[0][i] * r[0][j] for r in rows) for j in range(3)] for i in range(3)]
    y = [sum(r[0][i] * r[1] for r in rows) for i in range(3)]
    fixed, per_decode, per_prefill = nonnegative_least_squares(a, y)
    return StepTimeModel(fixed_s=fixed, per_decode_s=per_decode, per_prefill_token_s=per_prefill)


def calibrated_prior(model_id: str) -> StepTimePrior | None:
    """The step-time prior of this machine's calibration for `model_id` (`kvserve plan calibrate`), as data
    for the engine builder (engine/in_process.py), which uses it at the dtype it was measured at; None when
    there is none, or it was measured on another machine (the generic defaults are as good)."""
    path = calibration_path(model_id)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("cpu") != _cpu_name():
            return None
        spec = model_from_dict(doc["model_spec"])  # the very spec the calibration was fitted with
        m = step_time_prior(doc, spec)
        prior = StepTimePrior(m.fixed_s, m.per_decode_s, m.per_prefill_token_s, str(doc["weight_dtype"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("calibration %s not used: %s", path, e)
        return None
    log.info("step-time prior for %s from %s", model_id, path)
    return prior
