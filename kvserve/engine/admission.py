"""Admission, beside the scheduler: the one check that a request can ever run, the estimates of queue
wait and time to first token, and the per-tier bounds that refuse work at once (CapacityExhausted,
429 with Retry-After) instead of queueing it past what it can wait. Pure Python, as the scheduler.
"""
from __future__ import annotations

from typing import Protocol

from kvserve.config import SchedulerConfig, TierLimits
from kvserve.engine.errors import CapacityExhausted, ContextLengthExceeded, InvalidRequest
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.request import Sequence
from kvserve.engine.step_time import StepTimeModel

# Output tokens assumed per queued sequence when estimating queue wait (max_tokens caps it).
EXPECTED_OUTPUT_TOKENS = 256


class TierQueue(Protocol):
    """One tier's queued work, as the scheduler counts it."""

    num_waiting: int
    prompt_tokens: int  # prompt tokens waiting sequences have to compute (cached ones left out)
    load_s: float  # seconds their prefix-cache hits in the lower tier take to read back
    output_tokens: int  # expected output tokens of waiting sequences


def check_fits(config: SchedulerConfig, kv: KVCacheManager, seq: Sequence) -> None:
    """The one context check: a request that can never run (an empty prompt, past the model's context, or
    more K/V than the whole pool) is refused at entry."""
    cfg, p, max_tokens = config, seq.num_prompt_tokens, seq.max_tokens
    if p == 0:
        raise InvalidRequest("the prompt encodes to no tokens", param="prompt", code="invalid_prompt")
    if p >= cfg.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {cfg.max_model_len} tokens; the prompt has {p} tokens.")
    if max_tokens is not None and p + max_tokens > cfg.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {cfg.max_model_len} tokens; the prompt ({p} tokens) "
            f"plus max_tokens ({max_tokens}) exceeds it.")
    # K/V is held for every token but the last sampled one.
    kv_tokens = p + (max_tokens - 1 if max_tokens else 0)
    # Its peak: the prompt's last chunk, or the last decode (a sliding group holds its window and the chunk).
    need = max(kv.blocks_for_tokens(p, cfg.max_num_batched_tokens), kv.blocks_for_tokens(kv_tokens, 1))
    if need > kv.num_device_blocks:
        pool = kv.token_capacity
        raise ContextLengthExceeded(
            f"the request needs {kv_tokens} tokens of KV cache ({need} blocks) but the KV cache pool "
            f"holds only {pool} tokens ({kv.num_device_blocks} blocks); shorten the prompt or max_tokens")


def estimates(config: SchedulerConfig, model: StepTimeModel, running: list[Sequence], ahead: list[TierQueue],
              own_prompt_tokens: int, seat_holders: list[Sequence] | None = None,
              turn_s: float = 0.0, own_load_s: float = 0.0) -> tuple[float, float]:
    """(queue wait, time to first token) of a request arriving now with `own_prompt_tokens` to compute and
    `own_load_s` of lower-tier reads, behind the queues `ahead` (its tier's and those above it), from one
    pass over the running batch. Two parts, each timed by the step-time model (fixed + per decode + per
    prefill token):
    - the prompt tokens ahead of it (running sequences still prefilling, then those queued in its tier
      and above; for the TTFT, its own after them), prefilled in chunks of max_num_batched_tokens
      less the running decodes, each chunk's step also decoding those; a prefix-cache hit is not computed:
      one in the pool costs nothing, one in the lower tier its read time (the queues' and its own);
    - the wait for a seat: when the running sequences plus those queued ahead fill max_num_seqs,
      it starts only as running sequences finish. A running sequence has max_tokens minus what it
      has generated left (EXPECTED_OUTPUT_TOKENS without max_tokens; an upper bound when EOS
      comes first), one token per decode step of the running batch. Seats needed beyond the
      running ones free up a round later each, a round being the expected output of the queued
      requests. Only `seat_holders` keep their seats (default: all running; interactive work takes the
      seats of batch sequences);
    - `turn_s`: a step that must run before the tier's next one (the batch tier's turn after an interactive
      step alone).
    """
    num_running = len(running)
    holders = running if seat_holders is None else seat_holders
    # Running sequences still prefilling (chunked, or just admitted) go first.
    owed = sum(s.num_uncomputed_tokens for s in running if s.is_prefill)
    tokens = owed + sum(t.prompt_tokens for t in ahead)
    budget = config.max_num_batched_tokens
    loads = max(0.0, sum(t.load_s for t in ahead))
    queue_prefill = turn_s + loads + model.prefill_seconds(tokens, num_running, budget)
    ttft_prefill = turn_s + loads + own_load_s + model.prefill_seconds(tokens + own_prompt_tokens, num_running,
                                                                        budget)
    waiting = sum(t.num_waiting for t in ahead)
    need = waiting + 1 - (config.max_num_seqs - len(holders))
    if need <= 0 or not holders:
        return queue_prefill, ttft_prefill
    left = sorted(max(1, (s.max_tokens or EXPECTED_OUTPUT_TOKENS) - s.num_output_tokens)
                  for s in holders)
    steps = left[min(need, len(left)) - 1]
    if need > len(left):
        round_tokens = sum(t.output_tokens for t in ahead) / max(1, waiting)
        steps += -(-(need - len(left)) // config.max_num_seqs) * round_tokens
    seat = steps * model.predict(num_running)
    return queue_prefill + seat, ttft_prefill + seat


def check_tier_bounds(name: str, limits: TierLimits, tier: TierQueue, count: int, tokens: int, wait: float,
                      ttft: float) -> None:
    """CapacityExhausted (with a Retry-After and the reason) when `count` sequences of `tokens` prompt
    tokens, expecting `wait` s of queue and `ttft` s to a first token, would pass the tier's bounds."""
    retry = max(1.0, wait)
    if tier.num_waiting + count > limits.max_waiting:
        raise CapacityExhausted(f"the {name} queue is full ({tier.num_waiting} waiting, limit "
                                f"{limits.max_waiting})", retry_after=retry, reason="queue_full")
    # A lone request larger than the bound is let in: it is queued behind nothing.
    if tier.num_waiting and tier.prompt_tokens + tokens > limits.max_queued_prompt_tokens:
        raise CapacityExhausted(f"the {name} queue holds {tier.prompt_tokens} prompt tokens (limit "
                                f"{limits.max_queued_prompt_tokens})", retry_after=retry, reason="queue_tokens")
    if wait > limits.max_queue_wait_s:
        raise CapacityExhausted(f"the estimated {name} queue wait is {wait:.1f}s (limit "
                                f"{limits.max_queue_wait_s:.1f}s)",
                                retry_after=max(1.0, wait - limits.max_queue_wait_s), reason="queue_wait")
    if ttft > limits.max_ttft_s:
        raise CapacityExhausted(f"the estimated {name} time to first token is {ttft:.2f}s (limit "
                                f"{limits.max_ttft_s:.2f}s)",
                                retry_after=max(1.0, ttft - limits.max_ttft_s), reason="ttft")
