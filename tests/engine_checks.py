"""Helpers for the engine tests: engines that share loaded weights, a step-by-step driver that records
what the scheduler did, output comparison across engine settings, and leak checks.

Used by tests/unit/test_engine_tiny.py (tiny GGUF models) and tests/integration/test_engine.py (SmolLM2).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field, replace

import pytest

from kvserve.config import TierLimits, engine_config_from_kwargs
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling import SamplingParams

# Batched float32 kernels may round differently from single-sequence ones: a greedy pick may flip only
# where the reference's two best logits were this close (the logprob gap equals the logit gap).
NEAR_TIE = 1e-4
# The same rounding moves the boundaries of a seeded inverse-CDF draw: a seeded pick may move to the
# neighbouring token only where the draw fell this close (a fraction of the row's total weight) to the
# boundary between the two. Logit differences of ~4e-6 between kernels move a boundary by at most
# ~3e-7 at temperature 5, while one token of a flat 49152-token row spans ~2e-5.
DRAW_BOUNDARY = 1e-6


@contextlib.contextmanager
def shared_weights():
    """Engines built inside share one loaded copy of each model's weights.

    Loading SmolLM2 costs seconds; the tests build several engines with different KV pools and
    scheduler settings. Only the (read-only) weights are shared: each engine still has its own
    tokenizer, scheduler, KV manager and runner with its own cache tensors.
    """
    import kvserve.engine.worker.llm_engine as llm_engine

    real_load, real_build = llm_engine.load_checkpoint, llm_engine.build_model
    checkpoints, models = {}, {}

    def load_checkpoint(path, *args, **kwargs):
        key = (str(path), *map(str, args), *sorted((name, str(v)) for name, v in kwargs.items()))
        if key not in checkpoints:
            checkpoints[key] = real_load(path, *args, **kwargs)
        return checkpoints[key]

    def build_model(checkpoint, the_plan, **kwargs):
        kwargs["consume"] = False  # the checkpoint is shared: it keeps its tensors
        key = (str(checkpoint.path), checkpoint.weights, the_plan, tuple(sorted(kwargs.items())))
        if key not in models:
            models[key] = real_build(checkpoint, the_plan, **kwargs)
        return models[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "load_checkpoint", load_checkpoint)
        mp.setattr(llm_engine, "build_model", build_model)
        yield
    checkpoints.clear()
    models.clear()


def make_engine(model, **kwargs):
    """An LLMEngine; admission bounds are off unless given (the tests queue whole batches at once)."""
    from kvserve.engine.worker.llm_engine import LLMEngine

    for tier in ("interactive", "batch"):
        kwargs.setdefault(tier, TierLimits.unbounded())
    return LLMEngine(engine_config_from_kwargs(str(model), **kwargs))


def serve_one(engine, prompt, params: SamplingParams, **request_kwargs) -> RequestOutput:
    """Add one request and step the engine until nothing is left; its final output."""
    engine.core.add_request(engine.request(prompt, params, **request_kwargs))
    final = None
    while engine.core.has_unfinished_requests():
        for ro in engine.core.step():
            if ro.finished:
                final = ro
    return final


@contextlib.contextmanager
def torch_threads(n: int):
    """Intra-op threads for a test module. On a shared, oversubscribed CPU a second OpenMP thread makes
    small matmuls many times slower (spin-waiting for a busy core), so the engine tests run on one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Req:
    prompt: list[int] | str
    params: SamplingParams
    priority: str | None = None
    cache_salt: str | None = None
    resumed: list[int] | None = None  # output tokens generated elsewhere (EngineRequest.resumed_token_ids)


@dataclass
class Run:
    """Final outputs (in request order) and what the scheduler did to produce them."""

    outputs: list[RequestOutput] = field(default_factory=list)
    steps: int = 0
    max_running: int = 0
    max_swapped: int = 0
    preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    cow_copies: int = 0
    chunked_prefills: int = 0  # scheduled prompt chunks that did not reach the end of the prompt
    max_batched_tokens: int = 0

    @property
    def tokens(self) -> list[list[list[int]]]:
        return [[o.token_ids for o in ro.outputs] for ro in self.outputs]


@contextlib.contextmanager
def recording(engine, run: Run):
    """Wrap the engine's scheduler so that every SchedulerOutput is tallied into `run`."""
    real = engine.core.scheduler.schedule

    def schedule():
        out = real()
        run.preemptions += len(out.preempted)
        run.swapped_out_blocks += len(out.blocks_to_swap_out)
        run.swapped_in_blocks += len(out.blocks_to_swap_in)
        run.cow_copies += len(out.blocks_to_copy)
        run.chunked_prefills += sum(1 for s in out.scheduled if not s.sample)
        run.max_batched_tokens = max(run.max_batched_tokens, out.num_batched_tokens)
        return out

    engine.core.scheduler.schedule = schedule
    try:
        yield run
    finally:
        del engine.core.scheduler.schedule


def drive(engine, requests: list[Req], max_steps: int = 100_000) -> Run:
    """Add all requests, step until every one finishes; checks that streamed deltas add up to the finals."""
    run = Run()
    streamed: dict[tuple[str, int], list[int]] = defaultdict(list)
    streamed_text: dict[tuple[str, int], str] = defaultdict(str)
    final: dict[str, RequestOutput] = {}
    with recording(engine, run):
        ids = [engine.core.add_request(engine.request(r.prompt, r.params, priority=r.priority, cache_salt=r.cache_salt,
                                  resumed_token_ids=r.resumed)) for r in requests]
        while engine.core.has_unfinished_requests():
            for ro in engine.core.step():
                for o in ro.outputs:
                    streamed[ro.request_id, o.index] += o.delta_token_ids
                    streamed_text[ro.request_id, o.index] += o.delta_text
                if ro.finished:
                    final[ro.request_id] = ro
            stats = engine.core.scheduler.stats()
            run.max_running = max(run.max_running, stats.running)
            run.max_swapped = max(run.max_swapped, stats.swapped)
            run.steps += 1
            assert run.steps <= max_steps, f"not done after {max_steps} steps"
    for rid, ro in final.items():
        for o in ro.outputs:
            assert o.finish_reason is not None, f"{rid}[{o.index}] finished without a reason"
            assert streamed[rid, o.index] == o.token_ids, f"{rid}[{o.index}]: deltas != token_ids"
            assert streamed_text[rid, o.index] == o.text, f"{rid}[{o.index}]: delta text != text"
    run.outputs = [final[i] for i in ids]
    return run


def blocks_needed(reqs: list[Req], kv) -> tuple[int, int]:
    """(blocks the whole batch holds decoding its last tokens, the most one sequence holds at once) in `kv`'s
    pool: its KV groups' blocks (a sliding group holds its window, and its prompt while prefilling it)."""
    ends = [(len(r.prompt) + r.params.max_tokens, len(r.prompt)) for r in reqs for _ in range(r.params.n)]
    return sum(kv.blocks_for_tokens(n, 1) for n, _ in ends), max(kv.blocks_for_tokens(n, p) for n, p in ends)


def forks_as_singles(output: RequestOutput) -> list[RequestOutput]:
    """An n > 1 request's forks as n one-output requests (fork i seeded seed + i is an n=1 request so
    seeded), for compare_outputs."""
    return [replace(output, outputs=[replace(o, index=0)]) for o in output.outputs]


def assert_no_leaks(engine) -> None:
    """Nothing is running or queued, and every device block is free or cached; no host block is held."""
    engine.core.kv.check_integrity()
    assert not engine.core.has_unfinished_requests()
    assert not engine.core.scheduler.has_unfinished()
    u = engine.core.kv.usage()
    assert u.used_device_blocks == 0, f"{u.used_device_blocks} device blocks still held: {u}"
    assert u.free_device_blocks + u.cached_device_blocks == u.num_device_blocks, u
    assert u.used_host_blocks == 0, f"{u.used_host_blocks} host blocks still held: {u}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Draw:
    """A seeded draw replayed on freshly computed logits (see SeededDrawReplay)."""

    token: int  # what the draw picks on the replayed weights
    boundary: tuple[int, int] | None  # the two tokens on either side of the nearest interval boundary
    distance: float  # from the draw's target to that boundary, as a fraction of the row's total weight


class SeededDrawReplay:
    """Replays the engine's seeded inverse-CDF draw (Sampler, method "inverse_cdf", the CPU default) for
    a request's fork after a given output prefix: its logits come from a fresh prefill of prompt + prefix
    on `engine` (which must hold no other sequence), its uniform from the fork's own generator, drawn
    once per output token as the sampler draws it. Supports temperature without top-k/top-p/min-p/penalties."""

    def __init__(self, engine, requests: list[Req]):
        from kvserve.engine.worker.sampler import make_generator

        assert engine.runner.sampler.method in ("inverse_cdf", "auto") and engine.device.type == "cpu", \
            "the replay follows the CPU's inverse-CDF draw"
        assert not engine.core.has_unfinished_requests()
        self.engine, self.requests, self._generator = engine, requests, make_generator

    def __call__(self, request: int, fork: int, prefix: list[int]) -> Draw:
        import torch

        from kvserve.engine.worker.runner import BatchItem

        req = self.requests[request]
        p = req.params
        assert p.seed is not None and p.temperature > 0 and p.top_k in (0, -1) and p.top_p == 1.0 and not p.min_p
        ids = list(req.prompt) + prefix  # token ids
        bs = self.engine.runner.block_size
        table = list(range(1, -(-len(ids) // bs) + 1))  # block 0 is never a sequence's; the others are free
        logits = self.engine.runner.forward([BatchItem(ids, 0, table)], all_logits=True)[-1].double()
        cdf = torch.cumsum(torch.exp((logits - logits.max()) / p.temperature), 0)
        generator = self._generator(p.seed, fork)
        for _ in range(len(prefix) + 1):  # one uniform per output token, as Sampler._draw
            u = torch.empty(1).uniform_(generator=generator)
        total = float(cdf[-1])
        target = float(u) * total
        token = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
        lower = float(cdf[token - 1]) if token else 0.0
        if target - lower <= float(cdf[token]) - target:
            boundary = (token - 1, token) if token else None
            distance = (target - lower) / total
        else:
            boundary = (token, token + 1) if token + 1 < len(cdf) else None
            distance = (float(cdf[token]) - target) / total
        return Draw(token, boundary, distance)


@dataclass
class Divergence:
    request: int
    index: int  # fork index
    position: int
    ref_token: int
    got_token: int | None
    gap: float | None  # reference's top-1 minus top-2 logprob at the position (None: greedy does not apply)
    top: list | None

    def __str__(self) -> str:
        return (f"request {self.request}[{self.index}] diverges at output position {self.position}: reference "
                f"token {self.ref_token}, got {self.got_token}; reference top-2 gap {self.gap} (top {self.top})")


def compare_outputs(reference: Run | list[RequestOutput], got: Run | list[RequestOutput], label: str,
                    requests: list[Req] | None = None, max_diverged: int = 1, near_tie: float = NEAR_TIE,
                    logprob_tol: float | None = None, replay: SeededDrawReplay | None = None) -> None:
    """Assert `got` generates what `reference` did, request by request and fork by fork: the engine's
    promise (docs/ARCHITECTURE.md, "What the engine promises") that settings, batch composition and
    preemption change outputs only through rounding.

    At most `max_diverged` sequences may diverge. A greedy one only at a near-tie: at the first
    differing position the reference (run with logprobs >= 2) had its two best logits within
    `near_tie` and `got` picked the runner-up. A seeded sampled one (temperature > 0 in `requests`)
    only with `replay`, and only where the replayed draw fell within DRAW_BOUNDARY of the boundary
    between the reference's token and got's, its neighbour. Without `replay` sampled outputs must match.
    With logprob_tol, the sampled tokens' logprobs must also agree on the common prefix.
    """
    ref_outs = reference.outputs if isinstance(reference, Run) else reference
    got_outs = got.outputs if isinstance(got, Run) else got
    assert len(ref_outs) == len(got_outs)
    diverged: list[Divergence] = []
    worst_lp = 0.0
    for i, (ref, out) in enumerate(zip(ref_outs, got_outs)):
        assert ref.prompt_token_ids == out.prompt_token_ids, f"{label}: request {i} has another prompt"
        assert len(ref.outputs) == len(out.outputs), f"{label}: request {i}: {len(out.outputs)} outputs"
        for r, o in zip(ref.outputs, out.outputs):
            k = first_difference(r.token_ids, o.token_ids)
            common = len(r.token_ids) if k is None else k
            if logprob_tol is not None and r.logprobs and o.logprobs:
                for a, b in zip(r.logprobs[:common], o.logprobs[:common]):
                    worst_lp = max(worst_lp, abs(a.logprob - b.logprob))
            if k is None:
                assert r.finish_reason == o.finish_reason, f"{label}: request {i}: finish reason differs"
                continue
            got_token = o.token_ids[k] if k < len(o.token_ids) else None
            gap = top = None
            if r.logprobs and k < len(r.logprobs) and len(r.logprobs[k].top) >= 2:
                top = [(t, v) for t, _, v in r.logprobs[k].top[:2]]
                gap = top[0][1] - top[1][1]
            diverged.append(Divergence(i, o.index, k, r.token_ids[k] if k < len(r.token_ids) else None,
                                       got_token, gap, top))
    listing = "\n  ".join(map(str, diverged))
    assert len(diverged) <= max_diverged, f"{label}: {len(diverged)} sequences diverged:\n  {listing}"
    for d in diverged:
        if requests is not None and not requests[d.request].params.greedy:
            assert replay is not None, f"{label}: a sampled (seeded) sequence diverged: {d}"
            prefix = list(ref_outs[d.request].outputs[d.index].token_ids[:d.position])
            draw = replay(d.request, d.index, prefix)
            pair = {d.ref_token, d.got_token}
            assert draw.token in pair and draw.boundary is not None and set(draw.boundary) == pair \
                and draw.distance < DRAW_BOUNDARY, f"{label}: a seeded draw moved, not at a boundary: {d}; {draw}"
            continue
        assert d.gap is not None, f"{label}: a sequence without top-2 logprobs diverged: {d}"
        assert d.gap < near_tie and d.got_token == d.top[1][0], f"{label}: divergence not at a near-tie: {d}"
    if logprob_tol is not None:
        assert worst_lp <= logprob_tol, f"{label}: logprobs differ by up to {worst_lp:.3g} (> {logprob_tol})"
