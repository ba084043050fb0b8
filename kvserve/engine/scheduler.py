"""Iteration-level scheduler: each step, which sequences compute how many tokens.

Pure Python (no torch, no I/O): it works on token counts and block ids, so the engine, microsecond
unit tests and the planner's simulator (under a fake clock) all drive the very same code.

Queues: per tier (interactive, batch) a waiting queue with its tenants' fairness (engine/tiers.py); one
`running` list; one `swapped` list. A sequence is in exactly one of them until it finishes. Its snapshot for
metrics is engine/stats.py's.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvserve.config import PreemptionMode, SchedulerConfig, TierLimits
from kvserve.engine import admission
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.request import Priority, Sequence, SequenceStatus
from kvserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from kvserve.engine.speculation.policy import Candidate, Speculator
from kvserve.engine.stats import SchedulerStats
from kvserve.engine.step_time import StepTimeModel
from kvserve.engine.tiers import TierQueues, order_key

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED


def _batch_prefill_tokens(seq: Sequence, n: int) -> int:
    """Of n tokens scheduled for seq, those that count against a step's batch prefill budget."""
    return n if n > 1 and seq.priority is Priority.BATCH else 0


@dataclass
class _SeqState:
    decode_steps: int = 0  # tokens sampled since last admitted or swapped in (batch quantum)


@dataclass
class _Step:
    now: float
    budget: int
    batch_prefill_budget: int  # batch-tier prefill tokens still allowed (smaller while interactive is active)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    scheduled: dict[int, ScheduledSequence] = field(default_factory=dict)  # insertion ordered
    preempted: set[int] = field(default_factory=set)  # seq ids preempted this step: not re-admitted in it
    deferred: list[Sequence] = field(default_factory=list)  # batch prefill chunks held back
    # Tiers whose waiting queue may admit no more this step: work ahead of them could not go, and
    # nothing may overtake it.
    closed: set[Priority] = field(default_factory=set)
    loras: set[str] = field(default_factory=set)  # the LoRA adapters of the sequences scheduled so far

    def close_admission(self, prio: Priority) -> None:
        """Close admission for `prio` and every lower tier."""
        self.closed.update(p for p in Priority if p >= prio)


class _Admit(enum.Enum):
    OK = "ok"
    NO_BUDGET = "no_budget"
    NO_BLOCKS = "no_blocks"


class Scheduler:
    """Decides each step's batch under a token budget, a sequence cap and the KV block pool."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 step_time: StepTimeModel | None = None):
        self.config = config
        self.kv = kv
        self._clock = clock
        self._tiers = {Priority.INTERACTIVE: TierQueues(), Priority.BATCH: TierQueues()}
        self._running: list[Sequence] = []
        self._swapped: list[Sequence] = []
        self._state: dict[int, _SeqState] = {}
        self._requests: dict[str, list[Sequence]] = {}
        self._num_preemptions = 0
        self.step_time = step_time or StepTimeModel()  # learned from every step; admission estimates use it
        # Drafts for decodes (speculative decoding), sized by its controller from the step-time model.
        self.speculator = Speculator(config.num_speculative_tokens, adaptive=config.speculative_controller) \
            if config.speculative_decoding else None
        self._step_started: float | None = None
        # (decodes, prefill tokens (draft rows included), draft rows, tokens sampled, started) of the last step
        self._cycle: tuple[int, int, int, int, float] | None = None
        self._alone_last = False  # the last step was interactive prefill alone (or an interjection)
        self._interjection: tuple[SchedulerOutput, float] | None = None  # (its output, its start) while it runs
        self._ended: list[int] = []  # seq ids finished since the last step was scheduled (SchedulerOutput)

    # ---- admission -----------------------------------------------------------------------------

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences, or refuse the whole request at once.

        Raises ContextLengthExceeded when it can never run (model context, or more KV blocks than
        the whole pool) and CapacityExhausted when its tier's queue bounds are reached.
        """
        for seq in seqs:
            if seq.status is not WAITING or seq.seq_id in self._state:
                raise ValueError(f"{seq!r} is not a new waiting sequence")
            admission.check_fits(self.config, self.kv, seq)
        work: dict[int, tuple[int, float]] = {}
        for prio in sorted({s.priority for s in seqs}):
            work.update(self._check_tier_bounds(prio, [s for s in seqs if s.priority is prio]))
        for seq in seqs:
            self._track(seq)
            self._tiers[seq.priority].push_back(seq, work[seq.seq_id])

    def estimated_queue_wait(self, tier: Priority) -> float:
        """Seconds before a request arriving now in `tier` is admitted (gets a seat and starts prefill)."""
        return self._estimates(tier, 0)[0]

    def estimated_ttft(self, tier: Priority, prompt_tokens: int) -> float:
        """Seconds before a request arriving now in `tier` with `prompt_tokens` to compute has its first
        token: its queue wait, then its own prefill, chunked beside the running decodes."""
        return self._estimates(tier, prompt_tokens)[1]

    def _prompt_work(self, seq: Sequence) -> tuple[int, float]:
        """(tokens to compute, seconds of lower-tier reads) of a waiting sequence, as admission counts it: its
        prefix found in the pool costs nothing, the part found in the lower tier its measured read time (a
        recompute until the tier has measured a read)."""
        owed = seq.num_uncomputed_tokens
        if self.kv.has_blocks(seq):
            return owed, 0.0
        hit = self.kv.cached_prefix(seq)
        if hit.tier_load_s is None:
            return owed - hit.pool_tokens, 0.0
        return owed - hit.pool_tokens - hit.tier_tokens, hit.tier_load_s

    def _estimates(self, tier: Priority, own_prompt_tokens: int, own_load_s: float = 0.0) -> tuple[float, float]:
        """Admission's estimates with what this scheduler's policy adds: interactive work takes batch seats
        (_take_batch_seat), and after an interactive step alone the next step is the batch tier's."""
        ahead = [t for prio, t in self._tiers.items() if prio <= tier]
        holders = [s for s in self._running if s.priority <= tier]
        turn = 0.0
        if tier is Priority.INTERACTIVE and self._alone_last and len(holders) < len(self._running):
            batch_prefill = min(self.config.interactive_batch_prefill_tokens,
                                self._tiers[Priority.BATCH].prompt_tokens)
            turn = self.step_time.predict(len(self._running), batch_prefill)
        return admission.estimates(self.config, self.step_time, self._running, ahead, own_prompt_tokens,
                                   holders, turn, own_load_s)

    @property
    def tokens_per_s(self) -> float:
        """Generated (decode) tokens per second of a decode step of the running batch (at least one)."""
        n = max(1, len(self._running))
        return n / self.step_time.predict(n)

    def _check_tier_bounds(self, prio: Priority, seqs: list[Sequence]) -> dict[int, tuple[int, float]]:
        """The tier's bounds; the wait bounds count what the request has waited since its arrival stamp (the
        server stamps it on submission, so the step in flight when it came counts). Returns each sequence's
        _prompt_work, which its queue counters take."""
        waited = max(0.0, self._clock() - min(s.timings.arrival for s in seqs))
        work = {s.seq_id: self._prompt_work(s) for s in seqs}
        tokens = sum(t for t, _ in work.values())
        wait, ttft = (waited + e for e in self._estimates(prio, tokens, sum(load for _, load in work.values())))
        admission.check_tier_bounds(prio.label, self._limits(prio), self._tiers[prio], len(seqs), tokens,
                                    wait, ttft)
        return work

    # ---- the step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build one step's batch.

        Policy, stated:
        - Work is "tokens owed" (num_tokens - num_computed_tokens); a decode owes 1, a prompt or a
          recomputed sequence owes many. Each step spends at most max_num_batched_tokens and keeps
          at most max_num_seqs sequences running.
        - Order: running decodes (1 token each), running prefill chunks, swapped sequences brought
          back, waiting interactive, waiting batch. Within each group interactive comes before
          batch, then earlier arrival. While interactive work waits, running batch prefill chunks
          go after the interactive admissions (decodes never wait for prefills).
        - While interactive sequences run or wait, batch-tier prefill chunks share at most
          interactive_batch_prefill_tokens per step (chunked prefill on): the flood keeps decoding
          and prefilling, in steps short enough for interactive TTFT and TPOT.
        - Interactive prefill alone (interactive_prefill_alone): while an interactive prompt waits
          or is part-way through prefill and batch sequences run, the step holds interactive work
          only; batch decodes and prefills sit it out. Only with room in the pool for the prompts
          plus a block per held batch sequence; if no interactive prefill could be scheduled after
          all, the batch work joins the step. Never two such steps in a row, so the batch tier
          keeps at least every other step.
        - Chunked prefill on: a prompt takes what budget is left. Off: a prompt goes whole or not at
          all; one longer than the whole budget goes alone in an otherwise empty step (the step
          exceeds the budget), and everything behind it waits until such a step comes.
        - Out of blocks for a running sequence: preempt the running sequence with the lowest tier,
          then latest arrival (possibly itself: then it is not scheduled this step). So batch
          never preempts interactive. Swap it out (SWAP/AUTO, host room, no shared blocks), else
          recompute: free its blocks and put it at the front of its tier's queue, where it keeps
          its arrival and is re-admitted before any fresh request of that tier.
        - Interactive waiting work takes a seat from the latest running batch sequence when
          max_num_seqs is reached. Interactive work short of blocks preempts running batch
          sequences that have used their decode quantum (batch_decode_quantum sampled tokens since
          admission), latest first; newer batch sequences finish their quantum first (no thrash).
        - Head-of-line within a tier: a swapped sequence that cannot come back, a waiting head that
          cannot be admitted, or one preempted earlier in this step closes admission for its tier
          and the tiers below for the rest of the step, so small requests never overtake a large
          one forever and a preempted sequence is not re-admitted in the step that evicted it.
          Batch sequences are not swapped back in while interactive work waits.
        - Fairness inside a tier: the next fresh waiting sequence is the head of the tenant with the
          smallest virtual-time counter (weighted tokens served; ties by arrival). A tenant that
          becomes active is lifted to the smallest counter among active tenants, so idle time
          does not bank credit.
        - LoRA adapters: a step holds at most max_loras adapters (the device's slots). A sequence of another
          adapter waits as work short of budget does (a waiting head closes its tier's admission for the step),
          so adapters are taken in the order above, and a step's adapters leave room as their sequences finish.
        - Waiting sequences never scheduled and older than their tier's queue_timeout_s finish with
          FINISHED_QUEUE_TIMEOUT. A sequence that cannot fit the KV pool even alone finishes with
          FINISHED_LENGTH. Both are listed in SchedulerOutput.finished.
        """
        cfg, now = self.config, self._clock()
        self._observe_cycle(now)
        step = _Step(now=now, budget=cfg.max_num_batched_tokens,
                     batch_prefill_budget=cfg.interactive_batch_prefill_tokens if self._interactive_active()
                     else cfg.max_num_batched_tokens)
        self._expire_waiting(step)
        alone = self._interactive_prefill_alone()
        self._schedule_running(step, defer_batch_prefill=self._interactive_waiting(), hold_batch=alone)
        self._schedule_swapped(step)
        self._schedule_waiting(step, Priority.INTERACTIVE)
        alone = alone and any(ss.seq.priority is Priority.INTERACTIVE and ss.seq.is_prefill
                              for ss in step.scheduled.values())
        self._alone_last = alone
        if not alone:
            for seq in step.deferred:
                if seq.status is RUNNING:
                    self._schedule_running_seq(step, seq)
            self._schedule_waiting(step, Priority.BATCH)
        if self.speculator is not None:
            self._speculate(step)
        return self._close_step(step)

    def _speculate(self, step: _Step) -> None:
        """Drafts for the step's decodes where the controller expects them to pay for their rows, within the
        step's token budget and the pool's blocks (a draft never preempts or waits: short of blocks, none).
        A draft stays within max_tokens and the model's context, so every token it can bring is wanted."""
        decodes = [ss for ss in step.scheduled.values()
                   if ss.num_new_tokens == 1 and ss.sample and ss.seq.num_output_tokens and not ss.seq.is_prefill]
        candidates: list[Candidate] = []
        for ss in decodes:
            seq = ss.seq
            if not seq.sampling.speculation:
                continue
            left = self.config.max_model_len - seq.num_tokens
            if seq.max_tokens is not None:
                left = min(left, seq.max_tokens - seq.num_output_tokens)
            cap = left - 1
            c = self.speculator.propose(seq.seq_id, seq.tenant, seq.token_ids, cap)
            # a drafted token its constraint forbids, or one that moves its thinking block, ends the draft
            if c is not None and (seq.grammar is not None or seq.thinking is not None):
                allowed = seq.draftable(c.proposal)
                c = replace(c, proposal=c.proposal[:allowed]) if allowed else None
            if c is not None:
                candidates.append(c)
        if not candidates:
            self.speculator.last_lengths = {}
            return
        prefill = sum(ss.num_new_tokens for ss in step.scheduled.values()) - len(decodes)
        lengths = self.speculator.plan(candidates, prefill * self.step_time.per_prefill_token_s, len(decodes),
                                       step.budget, prompt_rows=prefill)
        for c in candidates:
            k = lengths.get(c.seq_id, 0)
            ss = step.scheduled[c.seq_id]
            if k and self.kv.allocate_slots(ss.seq, 1 + k):
                ss.num_new_tokens = 1 + k
                ss.draft_token_ids = list(c.proposal[:k])
                step.budget -= k

    def _interactive_prefill_alone(self) -> bool:
        """Whether this step is for interactive work only: an interactive prompt is owed prefill, batch
        sequences run, the last step was not such a step, and the pool has room for the prompts plus a
        block for each batch sequence held back. Without that room the prompts could take the blocks
        the held decodes need next, and those would then preempt batch work outside its decode quantum:
        under block pressure the usual order (batch decodes first) applies."""
        if not self.config.interactive_prefill_alone or self._alone_last:
            return False
        held = sum(1 for s in self._running if s.priority is Priority.BATCH)
        owed = self._tiers[Priority.INTERACTIVE].prompt_tokens + sum(
            s.num_uncomputed_tokens for s in self._running if s.priority is Priority.INTERACTIVE and s.is_prefill)
        return held > 0 and owed > 0 and self._room_for(owed, held)

    def _room_for(self, tokens: int, held: int) -> bool:
        """Free blocks for `tokens` of prompt plus one block a KV group for each of `held` sequences, which
        may need a new block in their next step."""
        return self.kv.num_free_blocks >= self.kv.blocks_for_tokens(tokens) + held * self.kv.num_groups

    def schedule_interjection(self) -> SchedulerOutput:
        """A step run while the step in flight is suspended between layers (interactive_interjection):
        waiting interactive prompts only, admitted as in schedule() (their first chunk, free seats,
        free blocks, prefix hits). Everything scheduled in the suspended step is mid-step, so nothing
        running is touched: no decodes, no preemption, no swaps, no expiry. Only with room in the pool
        for the waiting prompts plus a block per running sequence (as interactive prefill alone), and
        the next step is not an alone step: the batch tier's turn comes first. update_from_output
        applies it as any step; the suspended step's own timing leaves its length out."""
        cfg, now = self.config, self._clock()
        step = _Step(now=now, budget=cfg.max_num_batched_tokens, batch_prefill_budget=0)
        tier = self._tiers[Priority.INTERACTIVE]
        if cfg.interactive_interjection and tier.num_waiting and self._room_for(tier.prompt_tokens, len(self._running)):
            while tier.num_waiting and step.budget > 0 and len(self._running) < cfg.max_num_seqs:
                seq = tier.next()
                # An adapter's prompt too is left to the next regular step: the suspended step's adapters hold the
                # device's slots until it ends.
                if seq.lora is not None or self._exceeds_pool(seq.num_tokens) or \
                        self._try_admit(step, seq) is not _Admit.OK:
                    break  # left to the next regular step, which handles all of these
        out = self._close_step(step, timed=False)
        if out.scheduled:
            self._alone_last = True
            self._interjection = (out, now)
        return out

    def _expire_waiting(self, step: _Step) -> None:
        for prio, tier in self._tiers.items():
            timeout = self._limits(prio).queue_timeout_s
            for seq in tier.expired(step.now, timeout):
                self._finish_in_step(step, seq, SequenceStatus.FINISHED_QUEUE_TIMEOUT)

    def _schedule_running(self, step: _Step, defer_batch_prefill: bool, hold_batch: bool) -> None:
        """Running decodes, then running prefill chunks. Batch prefill chunks (defer_batch_prefill) or
        all batch work (hold_batch) go to step.deferred, scheduled after interactive admissions."""
        ordered = sorted(self._running, key=order_key)
        decodes = [s for s in ordered if s.num_uncomputed_tokens <= 1]
        prefills = [s for s in ordered if s.num_uncomputed_tokens > 1]
        for seq in decodes:
            if hold_batch and seq.priority is Priority.BATCH:
                step.deferred.append(seq)
            elif seq.status is RUNNING:  # not preempted by an earlier one this step
                self._schedule_running_seq(step, seq)
        for seq in prefills:
            if seq.status is not RUNNING:
                continue
            if (defer_batch_prefill or hold_batch) and seq.priority is Priority.BATCH:
                step.deferred.append(seq)
            else:
                self._schedule_running_seq(step, seq)

    def _schedule_running_seq(self, step: _Step, seq: Sequence) -> None:
        n = self._num_new_tokens(step, seq)
        if n == 0:
            return
        while not self.kv.allocate_slots(seq, n):
            victim = max(self._running, key=order_key)
            if victim is seq and len(self._running) == 1:
                self._finish_in_step(step, seq, SequenceStatus.FINISHED_LENGTH)  # cannot fit even alone
                return
            self._preempt(step, victim)
            if victim is seq:
                return
        self._add_scheduled(step, seq, n)

    def _schedule_swapped(self, step: _Step) -> None:
        """Bring swapped sequences back in order. The first that cannot come back stops the rest and
        closes admission for its tier and below: newer work does not overtake it."""
        interactive_waiting = self._interactive_waiting()
        for seq in sorted(self._swapped, key=order_key):
            # A batch sequence brought back now would be the first victim of interactive admissions.
            held_back = seq.priority is Priority.BATCH and interactive_waiting
            if held_back or not self._try_swap_in(step, seq):
                step.close_admission(seq.priority)
                return

    def _try_swap_in(self, step: _Step, seq: Sequence) -> bool:
        """Swap `seq` in and schedule it; False when it cannot come back this step."""
        n = self._num_new_tokens(step, seq)
        if n == 0 or seq.seq_id in step.preempted or len(self._running) >= self.config.max_num_seqs:
            return False
        if self._exceeds_pool(seq.num_computed_tokens + n, n):
            self._finish_in_step(step, seq, SequenceStatus.FINISHED_LENGTH)
            return True

        def fits() -> bool:
            return self.kv.can_swap_in(seq, n)

        if not fits() and not (seq.priority is Priority.INTERACTIVE and self._yield_batch(step, fits)):
            return False
        self._swap_in(step, seq, n)
        return True

    def _schedule_waiting(self, step: _Step, prio: Priority) -> None:
        tier = self._tiers[prio]
        while tier.num_waiting and prio not in step.closed and step.budget > 0:
            seq = tier.next()
            if seq.seq_id in step.preempted:  # blocks just ran out for it: nothing newer goes either
                step.close_admission(prio)
                break
            if self._exceeds_pool(seq.num_tokens):  # a recomputed sequence outgrew the pool
                self._finish_in_step(step, seq, SequenceStatus.FINISHED_LENGTH)
                continue
            if len(self._running) >= self.config.max_num_seqs:
                if prio is Priority.INTERACTIVE and self._take_batch_seat(step):
                    continue
                step.close_admission(prio)
                break
            result = self._try_admit(step, seq)
            if result is _Admit.OK:
                continue
            if result is _Admit.NO_BLOCKS and prio is Priority.INTERACTIVE and \
                    self._yield_batch(step, lambda: self._try_admit(step, seq) is _Admit.OK):
                continue
            step.close_admission(prio)

    def _try_admit(self, step: _Step, seq: Sequence) -> _Admit:
        """Prefix lookup, then blocks for the first chunk; all or nothing."""
        cached = self.kv.get_computed_blocks(seq)
        seq.num_computed_tokens = cached
        n = self._num_new_tokens(step, seq)
        if n == 0 or not self.kv.allocate_slots(seq, n):
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            return _Admit.NO_BUDGET if n == 0 else _Admit.NO_BLOCKS
        self._tiers[seq.priority].remove(seq)
        if seq.timings.first_scheduled is None:
            seq.timings.first_scheduled = step.now
            seq.num_cached_tokens = cached
            seq.num_tier_cached_tokens, seq.num_host_cached_tokens = self.kv.tier_tokens(seq)
        self._start_running(seq)
        self._add_scheduled(step, seq, n)
        return _Admit.OK

    def _num_new_tokens(self, step: _Step, seq: Sequence) -> int:
        if seq.lora is not None and seq.lora not in step.loras and len(step.loras) >= self.config.max_loras:
            return 0  # the step's adapter slots are taken: it waits like work short of budget
        owed = seq.num_uncomputed_tokens
        budget = step.budget
        if _batch_prefill_tokens(seq, owed) and self.config.enable_chunked_prefill:
            budget = min(budget, step.batch_prefill_budget)
        if owed <= 0 or budget <= 0:
            return 0
        if owed <= budget:
            return owed
        if self.config.enable_chunked_prefill:
            return budget
        if not step.scheduled and step.budget == self.config.max_num_batched_tokens:
            return owed  # longer than any budget: runs alone
        return 0

    def _add_scheduled(self, step: _Step, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        step.scheduled[seq.seq_id] = ScheduledSequence(seq=seq, num_new_tokens=n, start=start, block_tables=[],
                                                       sample=start + n >= seq.num_tokens)
        if seq.lora is not None:
            step.loras.add(seq.lora)
        step.budget -= n
        step.batch_prefill_budget -= _batch_prefill_tokens(seq, n)
        self._tiers[seq.priority].charge(seq, start, n, +1)

    def _close_step(self, step: _Step, timed: bool = True) -> SchedulerOutput:
        out = step.out
        out.scheduled = list(step.scheduled.values())
        for ss in out.scheduled:
            ss.block_tables = self.kv.block_tables(ss.seq)
        tier_ops = self.kv.take_tier_ops()
        out.blocks_to_offload, out.blocks_to_load = tier_ops.offload, tier_ops.load
        out.blocks_to_copy = self.kv.take_pending_copies()
        out.finished_seq_ids, self._ended = self._ended, []
        if timed:
            self._step_started = step.now if out.scheduled else None
        return out

    # ---- preemption ----------------------------------------------------------------------------

    def _preempt(self, step: _Step, seq: Sequence) -> None:
        """Take a running sequence off the device: swap when allowed and possible, else recompute."""
        ss = step.scheduled.pop(seq.seq_id, None)
        if ss is not None:  # scheduled earlier this step: give its tokens back
            step.budget += ss.num_new_tokens
            step.batch_prefill_budget += _batch_prefill_tokens(seq, ss.num_new_tokens)
            self._tiers[seq.priority].charge(seq, ss.start, ss.num_new_tokens, -1)
        self._running.remove(seq)
        seq.num_preemptions += 1
        self._num_preemptions += 1
        step.out.preempted.append(seq)
        step.preempted.add(seq.seq_id)
        if self.config.preemption_mode is not PreemptionMode.RECOMPUTE and self.kv.can_swap_out(seq):
            step.out.blocks_to_swap_out.extend(self.kv.swap_out(seq))
            seq.status = SWAPPED
            self._swapped.append(seq)
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = WAITING
            self._tiers[seq.priority].push_front(seq, self._prompt_work(seq))

    def _take_batch_seat(self, step: _Step) -> bool:
        """max_num_seqs reached with interactive work waiting: the latest running batch sequence yields."""
        batch = [s for s in self._running if s.priority is Priority.BATCH]
        if not batch:
            return False
        self._preempt(step, max(batch, key=order_key))
        return True

    def _yield_batch(self, step: _Step, fits: Callable[[], bool]) -> bool:
        """Preempt running batch sequences past their decode quantum, latest first, until fits()."""
        quantum = self.config.batch_decode_quantum
        while True:
            done = [s for s in self._running
                    if s.priority is Priority.BATCH and self._state[s.seq_id].decode_steps >= quantum]
            if not done:
                return False
            self._preempt(step, max(done, key=order_key))
            if fits():
                return True

    def _swap_in(self, step: _Step, seq: Sequence, n: int) -> None:
        step.out.blocks_to_swap_in.extend(self.kv.swap_in(seq))
        if not self.kv.allocate_slots(seq, n):  # can_swap_in counted these blocks
            raise AssertionError(f"{seq!r}: no blocks after swap-in")
        self._swapped.remove(seq)
        self._start_running(seq)
        self._add_scheduled(step, seq, n)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = RUNNING
        self._running.append(seq)
        self._state[seq.seq_id].decode_steps = 0

    def _limits(self, prio: Priority) -> TierLimits:
        return self.config.interactive if prio is Priority.INTERACTIVE else self.config.batch

    def _exceeds_pool(self, num_tokens: int, new_tokens: int | None = None) -> bool:
        """More blocks than the pool holds for `num_tokens` of which `new_tokens` are computed in one step (default:
        a prompt prefilled in chunks of max_num_batched_tokens; a sliding group holds its window and the chunk)."""
        new = self.config.max_num_batched_tokens if new_tokens is None else new_tokens
        return self.kv.blocks_for_tokens(num_tokens, new) > self.kv.num_device_blocks

    def _interactive_waiting(self) -> bool:
        return self._tiers[Priority.INTERACTIVE].num_waiting > 0

    def _interactive_active(self) -> bool:
        return self._interactive_waiting() or any(s.priority is Priority.INTERACTIVE
                                                  for group in (self._running, self._swapped) for s in group)

    # ---- after the step ------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[int, list[int]],
                           on_token: Callable[[Sequence, int, int], None] | None = None) -> None:
        """Apply a finished step: advance computed tokens, cache full blocks, and take each sampled token.

        `sampled` maps seq_id to its new tokens for every scheduled sequence with sample=True (other ids
        in it are ignored). Sequences finished or aborted while the step ran are skipped.

        This is the one place a sampled token joins its sequence: appended, timed, the blocks it completes
        cached, then `on_token(seq, i, token)` (the engine's stop check) sees it with only the tokens before
        it. A verified draft's tokens go one at a time: a token's K/V is computed once the token after it is
        taken, and a stop inside the draft drops the rest (finish freed their slots)."""
        now = self._clock()
        self._time_step(output, sampled, now)  # before any token can finish the last sequence
        for ss in output.scheduled:
            seq = ss.seq
            if seq.status is not RUNNING:
                continue
            got = sampled.get(seq.seq_id) if ss.sample else None
            if ss.draft_token_ids and got:
                # Its last token is computed; each accepted draft is when the token after it is taken.
                seq.num_computed_tokens = ss.start + 1
                self.speculator.observe(seq.seq_id, len(ss.draft_token_ids), len(got) - 1)
            else:
                seq.num_computed_tokens = ss.start + ss.num_new_tokens
            self.kv.cache_full_blocks(seq)
            for i, token in enumerate(got or ()):
                if i:  # the accepted draft before it is computed
                    seq.num_computed_tokens += 1
                    self.kv.cache_full_blocks(seq)
                seq.append_token(token)
                self._record_token(seq, now)
                if on_token is not None:
                    on_token(seq, i, token)
                    if seq.is_finished:
                        break
            if ss.draft_token_ids:
                self.kv.release_tail(seq)  # the rejected drafts' slots

    def _time_step(self, output: SchedulerOutput, sampled: dict[int, list[int]], now: float) -> None:
        emitted = sum(len(sampled.get(ss.seq.seq_id) or ()) for ss in output.scheduled
                      if ss.sample and ss.seq.status is RUNNING)
        # A verified draft is a decode plus its draft rows; the step-time model counts the rows as prefill.
        drafted = sum(len(ss.draft_token_ids) for ss in output.scheduled)
        decode = sum(1 for ss in output.scheduled if ss.num_new_tokens - len(ss.draft_token_ids) == 1)
        prefill = output.num_batched_tokens - decode  # prompt tokens and draft rows
        if self._interjection is not None and output is self._interjection[0]:
            started = self._interjection[1]
            self._interjection = None
            self.step_time.observe(decode, prefill, now - started)
            if self._step_started is not None:  # the suspended step: its time excludes the interjection's
                self._step_started += now - started
        else:
            self._end_step_timing(prefill, decode, drafted, emitted, now)

    def _record_token(self, seq: Sequence, now: float) -> None:
        t = seq.timings
        if t.first_token is None:
            t.first_token = now
        t.last_token = now
        t.token_times.append(now)
        self._state[seq.seq_id].decode_steps += 1

    def _end_step_timing(self, prefill: int, decode: int, drafted: int, emitted: int, now: float) -> None:
        """Time the step just finished from its schedule() to the next one: what the engine does between
        steps (sampling, detokenizing, delivering, admitting) delays the next token as much as the forward
        does. When its last sequence finishes the engine idles next, so finish() times it instead."""
        started, self._step_started = self._step_started, None
        if started is not None and now > started:
            self._cycle = (decode, prefill, drafted, emitted, started)

    def _observe_cycle(self, now: float) -> None:
        if self._cycle is not None:
            decode, prefill, drafted, emitted, started = self._cycle
            self._cycle = None
            self.step_time.observe(decode, prefill, now - started)
            if self.speculator is not None and prefill == drafted:  # decodes and drafts only
                self.speculator.observe_step(decode, drafted, emitted, now - started)

    # ---- lifecycle -----------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of running `parent` that shares its blocks (n > 1 sampling).

        The child takes the parent's prompt, progress and arrival. If it has no output yet it takes
        the parent's too; the engine may instead give it its own sampled token first (only tokens
        whose K/V is computed must match the parent's). Forks run even past max_num_seqs: the
        request was admitted whole.
        """
        if parent.status is not RUNNING:
            raise ValueError(f"can only fork a running sequence, not {parent!r}")
        if child.seq_id in self._state:
            raise ValueError(f"{child!r} is already scheduled")
        computed = parent.num_computed_tokens
        child.prompt_token_ids = list(parent.prompt_token_ids)
        if not child.output_token_ids:
            child.output_token_ids = list(parent.output_token_ids)
        shared_outputs = max(0, computed - parent.num_prompt_tokens)
        if child.num_tokens <= computed or \
                child.output_token_ids[:shared_outputs] != parent.output_token_ids[:shared_outputs]:
            raise ValueError(f"{child!r} does not share the {computed} computed tokens of {parent!r}")
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_tier_cached_tokens = parent.num_tier_cached_tokens
        child.num_host_cached_tokens = parent.num_host_cached_tokens
        child.priority, child.tenant, child.cache_salt = parent.priority, parent.tenant, parent.cache_salt
        child.lora = parent.lora
        child.timings.arrival = parent.timings.arrival
        child.timings.first_scheduled = parent.timings.first_scheduled
        self.kv.fork(parent, child)
        self._track(child)
        self._start_running(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stop, length, abort, timeout): leave every queue and free its blocks."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.is_finished:
            return
        if seq.seq_id in self._state:
            self._remove_from_queues(seq)
            self._untrack(seq)
        self.kv.free(seq)
        if self.speculator is not None:
            self.speculator.finish(seq.seq_id, seq.tenant, seq.prompt_token_ids, seq.output_token_ids)
        seq.status = status
        seq.timings.finished = self._clock()
        self._ended.append(seq.seq_id)
        if not self.has_unfinished():
            self._observe_cycle(seq.timings.finished)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of a request as aborted; returns them (empty if unknown)."""
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def has_unfinished(self) -> bool:
        return bool(self._running or self._swapped or any(t.num_waiting for t in self._tiers.values()))

    def stats(self) -> SchedulerStats:
        usage = self.kv.usage()
        estimates = {prio: self._estimates(prio, 1) for prio in self._tiers}  # of a one-token prompt
        return SchedulerStats(
            waiting={prio: t.num_waiting for prio, t in self._tiers.items()},
            waiting_prompt_tokens={prio: t.prompt_tokens for prio, t in self._tiers.items()},
            running=len(self._running),
            swapped=len(self._swapped),
            blocks_used=usage.used_device_blocks,
            blocks_cached=usage.cached_device_blocks,
            blocks_free=usage.free_device_blocks,
            num_preemptions=self._num_preemptions,
            prefix_query_tokens=usage.prefix_query_tokens,
            prefix_hit_tokens=usage.prefix_hit_tokens,
            tokens_per_s=self.tokens_per_s,
            queue_wait_s={prio: e[0] for prio, e in estimates.items()},
            ttft_s={prio: e[1] for prio, e in estimates.items()},
            kv=usage,
            drafts={} if self.speculator is None else {n: replace(s) for n, s in self.speculator.stats.items()},
            draft_length=0.0 if self.speculator is None or not self.speculator.last_lengths else
            sum(self.speculator.last_lengths.values()) / len(self.speculator.last_lengths),
        )

    def _finish_in_step(self, step: _Step, seq: Sequence, status: SequenceStatus) -> None:
        self.finish(seq, status)
        step.out.finished.append(seq)

    # ---- queues and bookkeeping ----------------------------------------------------------------

    def _track(self, seq: Sequence) -> None:
        """Register a new live sequence: state, request index, tenant activity."""
        self._state[seq.seq_id] = _SeqState()
        self._requests.setdefault(seq.request_id, []).append(seq)
        self._tiers[seq.priority].activate(seq.tenant)

    def _untrack(self, seq: Sequence) -> None:
        del self._state[seq.seq_id]
        siblings = self._requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self._requests[seq.request_id]
        self._tiers[seq.priority].deactivate(seq.tenant)

    def _remove_from_queues(self, seq: Sequence) -> None:
        if seq.status is RUNNING:
            self._running.remove(seq)
        elif seq.status is SWAPPED:
            self._swapped.remove(seq)
        elif seq.status is WAITING:
            self._tiers[seq.priority].remove(seq)
