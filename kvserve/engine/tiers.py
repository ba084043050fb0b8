"""One priority tier's waiting sequences and the fairness between its tenants (the scheduler keeps one per tier).

Pure Python, like the scheduler: sequences, token counts and counters only.
"""
from __future__ import annotations

from collections import deque

from kvserve.engine.admission import EXPECTED_OUTPUT_TOKENS
from kvserve.engine.request import Sequence

# Virtual-time fair queuing weights (VTC's defaults): a generated token costs about two prompt tokens.
PROMPT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0


def order_key(seq: Sequence) -> tuple[int, float, int]:
    """Scheduling order; the maximum is the preemption victim (lowest tier, latest arrival)."""
    return (int(seq.priority), seq.timings.arrival, seq.seq_id)


class TierQueues:
    """A tier's waiting queue and its tenants' virtual-time counters.

    Fairness policy, stated:
    - Recompute-preempted sequences wait in `preempted`, in scheduling order (arrival), and come back before
      any fresh request of the tier: they keep their place.
    - Fresh requests wait in one FIFO per tenant. The next is the head of the tenant with the smallest
      virtual-time counter (`served`: weighted tokens scheduled for it, a prompt token PROMPT_TOKEN_WEIGHT and
      a generated one OUTPUT_TOKEN_WEIGHT; a chunk preempted in the step that scheduled it is refunded), ties
      by arrival, then sequence id.
    - A tenant becoming active (its first live sequence in the tier) starts no lower than the least-served
      active tenant, so idle time banks no credit; its counter is kept while any of its sequences lives.

    The queue's counters (num_waiting, prompt_tokens, load_s, output_tokens) are what admission's bounds and
    estimates read (admission.TierQueue)."""

    def __init__(self) -> None:
        self.preempted: deque[Sequence] = deque()  # earliest arrival first
        self.by_tenant: dict[str, deque[Sequence]] = {}  # only non-empty deques
        self.num_waiting = 0
        self.prompt_tokens = 0  # prompt tokens waiting sequences have to compute (Scheduler._prompt_work)
        self.load_s = 0.0  # seconds their lower-tier hits take to read back (admission's estimates)
        self.output_tokens = 0  # expected output tokens of waiting sequences (wait estimate)
        self.served: dict[str, float] = {}  # VTC counter per tenant
        self.live: dict[str, int] = {}  # unfinished sequences per active tenant
        self._queued: dict[int, tuple[int, float, int]] = {}  # seq id: what it added to the counters

    # ---- tenants -------------------------------------------------------------------------------
    def activate(self, tenant: str) -> None:
        """A live sequence of `tenant` joins the tier (a new request's, or a fork)."""
        if tenant not in self.live:
            active = [self.served.get(t, 0.0) for t in self.live]
            floor = min(active) if active else max(self.served.values(), default=0.0)
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
            self.live[tenant] = 0
        self.live[tenant] += 1

    def deactivate(self, tenant: str) -> None:
        """A live sequence of `tenant` finished."""
        self.live[tenant] -= 1
        if self.live[tenant] == 0:
            del self.live[tenant]

    def charge(self, seq: Sequence, start: int, n: int, sign: int) -> None:
        """Add (sign +1) or refund (-1) the weighted tokens of a scheduled chunk to its tenant's counter."""
        prompt = max(0, min(start + n, seq.num_prompt_tokens) - start)
        cost = PROMPT_TOKEN_WEIGHT * prompt + OUTPUT_TOKEN_WEIGHT * (n - prompt)
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + sign * cost

    # ---- the queue -----------------------------------------------------------------------------
    def next(self) -> Sequence:
        """The sequence to admit next (the tier has some waiting)."""
        if self.preempted:
            return self.preempted[0]
        heads = (q[0] for q in self.by_tenant.values())
        return min(heads, key=lambda s: (self.served.get(s.tenant, 0.0), s.timings.arrival, s.seq_id))

    def push_back(self, seq: Sequence, work: tuple[int, float]) -> None:
        """A new request's sequence, with its (prompt tokens to compute, seconds of lower-tier reads)."""
        self.by_tenant.setdefault(seq.tenant, deque()).append(seq)
        self._count(seq, work)

    def push_front(self, seq: Sequence, work: tuple[int, float]) -> None:
        """A recompute-preempted sequence: ahead of every fresh request, ordered by arrival."""
        key = order_key(seq)
        idx = next((i for i, s in enumerate(self.preempted) if order_key(s) > key), len(self.preempted))
        self.preempted.insert(idx, seq)
        self._count(seq, work)

    def remove(self, seq: Sequence) -> None:
        """Take a waiting sequence out (admitted, expired or finished), and its work out of the counters."""
        if seq in self.preempted:
            self.preempted.remove(seq)
        else:
            queue = self.by_tenant[seq.tenant]
            queue.remove(seq)
            if not queue:
                del self.by_tenant[seq.tenant]
        prompt_tokens, load_s, output_tokens = self._queued.pop(seq.seq_id)
        self.num_waiting -= 1
        self.prompt_tokens -= prompt_tokens
        self.load_s -= load_s
        self.output_tokens -= output_tokens

    def expired(self, now: float, timeout: float) -> list[Sequence]:
        """Fresh sequences that have waited longer than `timeout`: each tenant's queue from its head up to the
        first that has not."""
        out = []
        for queue in self.by_tenant.values():
            for seq in queue:
                if now - seq.timings.arrival <= timeout:
                    break
                out.append(seq)
        return out

    def _count(self, seq: Sequence, work: tuple[int, float]) -> None:
        prompt_tokens, load_s = work
        max_tokens = seq.max_tokens
        output_tokens = EXPECTED_OUTPUT_TOKENS if max_tokens is None else min(max_tokens, EXPECTED_OUTPUT_TOKENS)
        self._queued[seq.seq_id] = (prompt_tokens, load_s, output_tokens)
        self.num_waiting += 1
        self.prompt_tokens += prompt_tokens
        self.load_s += load_s
        self.output_tokens += output_tokens
