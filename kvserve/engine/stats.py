"""The scheduler's snapshot for metrics, health and routing (SchedulerStats), and several engines' pooled into
one (a fleet's view). Plain data: the server's threads and a fleet gateway read it while the engine moves on."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvserve.engine.kv.manager import KVCacheUsage
from kvserve.engine.request import Priority
from kvserve.engine.speculation.policy import DrafterStats


@dataclass(frozen=True)
class SchedulerStats:
    waiting: dict[Priority, int]  # queue depth per tier (fresh + recompute-preempted)
    waiting_prompt_tokens: dict[Priority, int]  # their prompt tokens still to compute, per tier
    running: int
    swapped: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    num_preemptions: int  # total since start
    prefix_query_tokens: int
    prefix_hit_tokens: int
    tokens_per_s: float  # decode tokens/s of the running batch, from the step-time model
    queue_wait_s: dict[Priority, float]  # estimated wait for a request arriving now
    ttft_s: dict[Priority, float]  # estimated time to first token of a one-token prompt arriving now
    kv: KVCacheUsage
    # Speculative decoding since start, per drafter; the controller's mean draft length over the decodes it
    # last drafted for (0: none).
    drafts: dict[str, DrafterStats] = field(default_factory=dict)
    draft_length: float = 0.0

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())

    @classmethod
    def pooled(cls, stats: "list[SchedulerStats]") -> "SchedulerStats":
        """Several engines' snapshots as one (a fleet's pool): sums, and the shortest estimated wait and TTFT
        per tier, since a new request goes to the least loaded."""
        def total(name: str):
            return sum(getattr(s, name) for s in stats)

        def per_tier(name: str, combine=sum):
            return {p: combine(getattr(s, name).get(p, 0) for s in stats) for p in Priority}

        def pool(values: list):  # counts add; per-level byte tables add level by level
            if values and isinstance(values[0], dict):
                return dict(sum((Counter(v) for v in values), Counter()))
            return sum(values)

        kv = KVCacheUsage(**{f: pool([getattr(s.kv, f) for s in stats]) for f in KVCacheUsage.__dataclass_fields__})
        return cls(waiting=per_tier("waiting"), waiting_prompt_tokens=per_tier("waiting_prompt_tokens"),
                   running=total("running"), swapped=total("swapped"), blocks_used=total("blocks_used"),
                   blocks_cached=total("blocks_cached"), blocks_free=total("blocks_free"),
                   num_preemptions=total("num_preemptions"), prefix_query_tokens=total("prefix_query_tokens"),
                   prefix_hit_tokens=total("prefix_hit_tokens"), tokens_per_s=total("tokens_per_s"),
                   queue_wait_s=per_tier("queue_wait_s", min), ttft_s=per_tier("ttft_s", min), kv=kv,
                   drafts={name: DrafterStats(*(sum(getattr(s.drafts[name], f) for s in stats if name in s.drafts)
                                                for f in ("proposed", "accepted", "drafts")))
                           for name in {n for s in stats for n in s.drafts}},
                   draft_length=sum(s.draft_length for s in stats) / max(1, sum(s.draft_length > 0 for s in stats)))
