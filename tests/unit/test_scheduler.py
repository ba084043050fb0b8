"""Scheduler policy tests on token counts only: a fake runner samples token 7 for every sequence.

The harness plays the engine: schedule, "run" (advance a fake clock), update_from_output, finish
sequences that reached max_tokens. Every step it checks the output contract and the KV manager's
invariants.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import PreemptionMode, SchedulerConfig, TierLimits
from kvserve.engine.errors import CapacityExhausted, ContextLengthExceeded
from kvserve.engine.kv.manager import KVCacheManager, hash_block, tier_key
from kvserve.engine.request import Priority, Sequence, SequenceStatus, SequenceTimings
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduler_output import SchedulerOutput
from kvserve.engine.step_time import StepTimeModel

I, B = Priority.INTERACTIVE, Priority.BATCH


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Harness:
    def __init__(self, *, num_blocks: int = 256, host_blocks: int = 0, block_size: int = 4,
                 prefix_caching: bool = True, tier=None, **config):
        self.clock = FakeClock()
        self.kv = KVCacheManager(num_blocks, host_blocks, block_size, prefix_caching, tier=tier)
        # No TTFT bound unless a test sets one: the shipped bound would refuse the queues these tests build.
        config.setdefault("interactive", TierLimits())
        self.config = SchedulerConfig(**config)
        self.sched = Scheduler(self.config, self.kv, clock=self.clock)
        self.ids = itertools.count()
        self.seqs: list[Sequence] = []
        self.served: Counter[str] = Counter()  # computed tokens per tenant
        self.outputs: list[SchedulerOutput] = []
        # Fake K/V memory, one token id per slot: the runner's copies and writes are played on it.
        self.dev: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(host_blocks)]
        self.forks: dict[int, int] = {}  # seq id -> children to fork after its first token (n > 1)
        self.forked = False

    def make(self, prompt_len: int = 8, max_tokens: int | None = 8, priority: Priority = I, tenant: str = "t",
             tokens: list[int] | None = None, salt: str | None = None) -> Sequence:
        n = next(self.ids)
        prompt = tokens if tokens is not None else [n * 10_000 + i for i in range(prompt_len)]
        return Sequence(seq_id=n, request_id=f"r{n}", prompt_token_ids=prompt,
                        sampling=SamplingParams(max_tokens=max_tokens), priority=priority, tenant=tenant,
                        cache_salt=salt, timings=SequenceTimings(arrival=self.clock()))

    def add(self, *args, **kwargs) -> Sequence:
        seq = self.make(*args, **kwargs)
        self.sched.add_request([seq])
        self.seqs.append(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_output(out)
        self.run_blocks(out)
        return self.finish_step(out)

    def step_interjected(self, arrive: Callable[[], None]) -> tuple[SchedulerOutput, SchedulerOutput]:
        """A step suspended half-way by an interjection: `arrive()` adds what comes meanwhile; the
        interjection runs whole (its blocks are written first), then the suspended step's writes."""
        out = self.sched.schedule()
        self.check_output(out)
        self.clock.t += 0.004
        arrive()
        inner = self.sched.schedule_interjection()
        self.check_output(inner)
        self.run_blocks(inner)
        self.finish_step(inner, 0.005)
        self.run_blocks(out)
        return self.finish_step(out, 0.006), inner

    def finish_step(self, out: SchedulerOutput, seconds: float = 0.01) -> SchedulerOutput:
        self.outputs.append(out)
        self.clock.t += seconds
        sampled = {ss.seq.seq_id: [7] for ss in out.scheduled if ss.sample}
        self.sched.update_from_output(out, sampled)
        for ss in out.scheduled:
            self.served[ss.seq.tenant] += ss.num_new_tokens
            seq = ss.seq
            if ss.sample and seq.num_output_tokens >= (seq.sampling.max_tokens or 10**9):
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
            elif ss.sample and seq.status is SequenceStatus.RUNNING:
                self.fork_children(seq)
        self.kv.check_integrity()
        return out

    def fork_children(self, parent: Sequence) -> None:
        for _ in range(self.forks.pop(parent.seq_id, 0)):
            child = self.make(tokens=[], max_tokens=parent.sampling.max_tokens)
            child.request_id = parent.request_id
            self.sched.fork(parent, child)
            self.forked = True
            child.output_token_ids[-1] = 8  # the engine samples each child's own token
            self.seqs.append(child)

    def run(self, max_steps: int = 2000) -> int:
        for i in range(max_steps):
            if not self.sched.has_unfinished():
                return i
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.sched.stats()}")

    def check_output(self, out: SchedulerOutput) -> None:
        cfg = self.config
        ids = [ss.seq.seq_id for ss in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice"
        if not self.forked:  # forks may exceed max_num_seqs: their request was admitted whole
            assert len(self.sched._running) <= cfg.max_num_seqs
        if cfg.enable_chunked_prefill or len(out.scheduled) > 1:
            assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        for ss in out.scheduled:
            assert ss.seq.status is SequenceStatus.RUNNING
            assert ss.start == ss.seq.num_computed_tokens and ss.num_new_tokens > 0
            assert len(ss.block_table) * self.kv.block_size >= ss.context_len
            assert ss.sample == (ss.context_len == ss.seq.num_tokens)
        for p in out.preempted:
            assert p.seq_id not in ids
        if any(p.priority is I for p in out.preempted):  # batch is always preempted first
            assert all(ss.seq.priority is I for ss in out.scheduled)

    def run_blocks(self, out: SchedulerOutput) -> None:
        """Play the runner: swap-out, swap-in, COW copies; check each sequence reads back its own
        context from its block table; then write the new tokens."""
        for d, hb in out.blocks_to_swap_out:
            self.host[hb] = list(self.dev[d])
        for hb, d in out.blocks_to_swap_in:
            self.dev[d] = list(self.host[hb])
        for src, dst in out.blocks_to_copy:
            self.dev[dst] = list(self.dev[src])
        bs = self.kv.block_size
        for ss in out.scheduled:
            tokens, table = ss.seq.token_ids, ss.block_table
            context = [self.dev[table[p // bs]][p % bs] for p in range(ss.start)]
            assert context == tokens[:ss.start], f"{ss.seq!r} would attend to wrong K/V"
            for p in range(ss.start, ss.context_len):
                self.dev[table[p // bs]][p % bs] = tokens[p]

    def all_blocks_back(self) -> bool:
        u = self.kv.usage()
        return (u.used_device_blocks == 0 and u.free_device_blocks + u.cached_device_blocks == u.num_device_blocks
                and u.used_host_blocks == 0)


def scheduled_ids(out: SchedulerOutput) -> set[int]:
    return {ss.seq.seq_id for ss in out.scheduled}


# ---- batching ------------------------------------------------------------------------------------

def test_continuous_batching_admits_new_sequences_as_others_finish():
    h = Harness(max_num_seqs=2)
    a, b = h.add(max_tokens=2), h.add(max_tokens=6)
    c, d = h.add(max_tokens=3), h.add(max_tokens=3)
    out = h.step()
    assert scheduled_ids(out) == {a.seq_id, b.seq_id}
    h.step()  # a's second token: a finishes
    assert a.status is SequenceStatus.FINISHED_LENGTH
    out = h.step()
    assert c.seq_id in scheduled_ids(out) and b.seq_id in scheduled_ids(out)  # c takes a's seat at once
    h.run()
    assert all(s.num_output_tokens == s.sampling.max_tokens for s in (a, b, c, d))
    assert h.all_blocks_back()


def test_chunked_prefill_keeps_decodes_advancing():
    h = Harness(max_num_batched_tokens=32, max_num_seqs=8)
    decoders = [h.add(prompt_len=8, max_tokens=40) for _ in range(4)]
    h.step()
    h.step()
    long = h.add(prompt_len=200, max_tokens=4)
    steps = 0
    while long.num_output_tokens == 0:
        before = [d.num_output_tokens for d in decoders]
        out = h.step()
        steps += 1
        assert [d.num_output_tokens for d in decoders] == [x + 1 for x in before]  # nobody stalls
        chunk = next(ss for ss in out.scheduled if ss.seq is long)
        assert chunk.num_new_tokens == min(32 - 4, 200 - chunk.start)
    assert steps == -(-200 // 28)


def test_prompt_longer_than_budget_without_chunking_runs_alone():
    h = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    small = h.add(prompt_len=8, max_tokens=3)
    big = h.add(prompt_len=40, max_tokens=2)
    out = h.step()
    assert scheduled_ids(out) == {small.seq_id}  # big cannot share a step
    while small.status is SequenceStatus.RUNNING:
        out = h.step()
        assert big.seq_id not in scheduled_ids(out)
    out = h.step()
    assert [(ss.seq, ss.num_new_tokens) for ss in out.scheduled] == [(big, 40)]
    h.run()
    assert big.num_output_tokens == 2


def test_prefix_cache_through_scheduler_is_per_salt():
    h = Harness()
    prompt = list(range(20))
    first = h.add(tokens=prompt, salt="acme", max_tokens=2)
    h.run()
    same = h.add(tokens=prompt, salt="acme", max_tokens=2)
    other = h.add(tokens=prompt, salt="globex", max_tokens=2)
    out = h.step()
    chunks = {ss.seq.seq_id: ss for ss in out.scheduled}
    assert same.num_cached_tokens == 16 and chunks[same.seq_id].start == 16
    assert other.num_cached_tokens == 0 and chunks[other.seq_id].start == 0
    assert first.num_cached_tokens == 0
    stats = h.sched.stats()
    assert stats.prefix_hit_tokens == 16 and stats.prefix_query_tokens == 60



def test_snapshots_pool_into_one():
    """A fleet gateway's view of its pool (SchedulerStats.pooled): counts add up, the estimates are the
    least loaded replica's, the KV figures are the pools' sums."""
    busy, idle = Harness(num_blocks=64), Harness(num_blocks=32)
    for _ in range(3):
        busy.add(prompt_len=40, max_tokens=8, priority=B)
    busy.add(prompt_len=16, max_tokens=8)
    busy.step()
    idle.add(prompt_len=16, max_tokens=8)
    a, b = busy.sched.stats(), idle.sched.stats()
    pool = type(a).pooled([a, b])
    assert pool.running == a.running + b.running and pool.waiting[B] == a.waiting[B] + b.waiting[B]
    assert pool.kv.num_device_blocks == 96 and pool.blocks_used == a.blocks_used + b.blocks_used
    assert pool.ttft_s[I] == min(a.ttft_s[I], b.ttft_s[I]) and pool.num_waiting == a.num_waiting + b.num_waiting

# ---- priority and fairness -----------------------------------------------------------------------

def test_interactive_behind_100_batch_requests_is_scheduled_within_two_steps():
    h = Harness(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=512)
    for _ in range(100):
        h.add(prompt_len=16, max_tokens=64, priority=B, tenant="bulk")
    for _ in range(3):
        h.step()
    assert len(h.sched._running) == 8
    urgent = h.add(prompt_len=16, max_tokens=4, priority=I, tenant="chat")
    out = h.step()
    assert urgent.seq_id in scheduled_ids(out)
    assert any(p.priority is B for p in out.preempted)  # it took a batch seat
    h.run()
    assert h.all_blocks_back()


def test_interactive_is_not_stuck_behind_long_batch_prefills():
    h = Harness(max_num_seqs=8, max_num_batched_tokens=128, num_blocks=2048)
    for _ in range(100):
        h.add(prompt_len=1000, max_tokens=4, priority=B, tenant="bulk")
    h.step()
    urgent = h.add(prompt_len=16, max_tokens=4, priority=I, tenant="chat")
    steps = 0
    while urgent.num_output_tokens == 0:
        h.step()
        steps += 1
    assert steps <= 2


def test_interactive_preempts_batch_at_max_num_seqs():
    h = Harness(max_num_seqs=2)
    b1, b2 = h.add(priority=B, max_tokens=50), h.add(priority=B, max_tokens=50)
    h.step()
    i1 = h.add(priority=I, max_tokens=4)
    out = h.step()
    assert i1.seq_id in scheduled_ids(out)
    assert out.preempted == [b2]  # latest arrival of the lowest tier
    assert b1.seq_id not in scheduled_ids(out)  # i1's prefill step is its own
    assert scheduled_ids(h.step()) == {i1.seq_id, b1.seq_id}
    h.run()
    assert b2.num_output_tokens == 50 and b2.num_preemptions == 1


def test_batch_never_preempts_interactive():
    h = Harness(max_num_seqs=2)
    i1, i2 = h.add(priority=I, max_tokens=20), h.add(priority=I, max_tokens=20)
    h.step()
    b1 = h.add(priority=B, max_tokens=5)
    for _ in range(19):
        out = h.step()
        assert not out.preempted and b1.seq_id not in scheduled_ids(out)
    h.run()
    assert i1.num_preemptions == i2.num_preemptions == 0 and b1.num_output_tokens == 5


def test_batch_never_preempts_interactive_under_block_pressure():
    # 12 blocks of 4 tokens; each sequence grows to 6 blocks. Batch work must always yield.
    h = Harness(num_blocks=12, max_num_seqs=8, batch_decode_quantum=0)
    inter = [h.add(priority=I, prompt_len=8, max_tokens=16) for _ in range(2)]
    batch = [h.add(priority=B, prompt_len=8, max_tokens=16) for _ in range(3)]
    h.run()  # check_output asserts: whenever interactive is preempted no batch work runs
    assert all(s.num_output_tokens == 16 for s in inter + batch)
    assert sum(s.num_preemptions for s in batch) > 0
    assert h.all_blocks_back()


def test_batch_yields_blocks_after_its_decode_quantum():
    h = Harness(num_blocks=12, max_num_seqs=8, batch_decode_quantum=3)
    bulk = h.add(priority=B, prompt_len=36, max_tokens=8)  # 9 blocks after its prefill
    h.step()  # prefill; its first token is sampled (1 of the quantum)
    urgent = h.add(priority=I, prompt_len=16, max_tokens=2)  # needs 4 blocks: at most 3 free
    waited = 0
    while urgent.status is SequenceStatus.WAITING:
        out = h.step()
        waited += 1
    assert out.preempted == [bulk] and bulk.num_preemptions == 1
    assert waited == 3  # bulk sampled tokens 2 and 3 first, then yielded
    h.run()
    assert bulk.num_output_tokens == 8


def test_two_tenants_flooding_a_tier_share_served_tokens():
    h = Harness(max_num_seqs=4, max_num_batched_tokens=64)
    for _ in range(30):
        h.add(prompt_len=24, max_tokens=8, priority=B, tenant="a")
    for _ in range(30):
        h.add(prompt_len=24, max_tokens=8, priority=B, tenant="b")
    for _ in range(25):
        h.step()
    a, b = h.served["a"], h.served["b"]
    assert a > 200 and b > 200
    assert abs(a - b) <= 0.2 * max(a, b)


def test_returning_tenant_cannot_bank_credit():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    for _ in range(20):
        h.add(prompt_len=16, max_tokens=4, tenant="early")
    for _ in range(15):
        h.step()
    late = [h.add(prompt_len=16, max_tokens=4, tenant="late") for _ in range(20)]
    admitted: list[str] = []
    while len(admitted) < 10:
        out = h.step()
        admitted += [ss.seq.tenant for ss in out.scheduled if ss.start == 0]
    assert admitted.count("early") >= 3, admitted  # "late" did not start with a zero counter
    assert late[0].timings.first_scheduled is not None


# ---- admission and deadlines ---------------------------------------------------------------------

def test_admission_queue_full():
    h = Harness(interactive=TierLimits(max_waiting=2))
    h.add()
    h.add()
    with pytest.raises(CapacityExhausted) as err:
        h.add()
    assert err.value.reason == "queue_full" and err.value.retry_after >= 1.0
    h.add(priority=B)  # the other tier has its own bound


def test_admission_queued_prompt_tokens():
    h = Harness(interactive=TierLimits(max_queued_prompt_tokens=100))
    h.add(prompt_len=60)
    with pytest.raises(CapacityExhausted) as err:
        h.add(prompt_len=60)
    assert err.value.reason == "queue_tokens"
    h.add(prompt_len=40)


class FixedStepTime(StepTimeModel):
    """A step-time model that learns nothing: estimates follow from the coefficients the test sets."""

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        pass


def test_admission_estimated_wait_uses_the_step_time_model():
    h = Harness(max_num_seqs=1, max_num_batched_tokens=64, interactive=TierLimits(max_queue_wait_s=1.0))
    h.sched.step_time = FixedStepTime(fixed_s=0.02, per_decode_s=0.01, per_prefill_token_s=0.001)
    h.add(prompt_len=80, max_tokens=31)
    # A free seat: its 80 prompt tokens wait, in two chunks of 64 (two fixed parts) at 1 ms a token.
    assert h.sched.estimated_queue_wait(I) == pytest.approx(2 * 0.02 + 0.080)
    h.step()
    h.step()  # prefilled: the one seat is held for 30 more tokens, each a 1-sequence decode step
    assert h.sched.estimated_queue_wait(I) == pytest.approx(30 * 0.03)
    assert h.sched.tokens_per_s == pytest.approx(1 / 0.03)
    h.step()
    h.step()  # 28 left: 0.84 s
    h.add(prompt_len=12, max_tokens=4)
    # Behind the 12-token prompt (one chunk beside the decode), which takes the seat first and holds it
    # a round (its 4 tokens): 1.002 s, over the bound.
    assert h.sched.estimated_queue_wait(I) == pytest.approx(0.03 + 0.012 + (28 + 4) * 0.03)
    with pytest.raises(CapacityExhausted) as err:
        h.add(prompt_len=4)
    assert err.value.reason == "queue_wait" and err.value.retry_after >= 1.0


def test_admission_counts_the_wait_since_arrival():
    """A request stamped at the server before the step in flight ended has already waited that long."""
    h = Harness(interactive=TierLimits(max_queue_wait_s=0.5))
    h.sched.step_time = FixedStepTime(fixed_s=0.01, per_decode_s=0.0, per_prefill_token_s=0.0)
    late = h.make(prompt_len=8)
    h.clock.t += 0.6
    with pytest.raises(CapacityExhausted) as err:
        h.sched.add_request([late])
    assert err.value.reason == "queue_wait"
    h.add(prompt_len=8)  # stamped now: 0.01 s


def test_admission_ttft_bound_counts_the_requests_own_prefill():
    h = Harness(max_num_batched_tokens=256, interactive=TierLimits(max_ttft_s=0.5))
    h.sched.step_time = FixedStepTime(fixed_s=0.05, per_decode_s=0.01, per_prefill_token_s=0.001)
    h.add(prompt_len=100, max_tokens=20)
    h.step()  # one running decode: a step of it costs 0.06 s
    assert h.sched.estimated_queue_wait(I) == 0.0
    # 200 tokens: one chunk, 0.06 + 0.2 s. 1000 tokens: four chunks of 255, 4 x 0.06 + 1.0 s.
    assert h.sched.estimated_ttft(I, 200) == pytest.approx(0.26)
    assert h.sched.estimated_ttft(I, 1000) == pytest.approx(1.24)
    with pytest.raises(CapacityExhausted) as err:
        h.add(prompt_len=1000)
    assert err.value.reason == "ttft" and err.value.retry_after >= 1.0
    h.add(prompt_len=200)
    # The queued 200 tokens are ahead of the next request now.
    assert h.sched.estimated_ttft(I, 200) == pytest.approx(2 * 0.06 + 0.4)
    with pytest.raises(CapacityExhausted):
        h.add(prompt_len=200)
    assert h.sched.stats().ttft_s[I] == pytest.approx(0.06 + 0.201)


class MeasuredTier:
    """A lower tier in memory whose page reads take `read_s` each (None: none measured yet)."""

    def __init__(self, read_s: float | None):
        self.pages: dict[bytes, bytes] = {}
        self.read_s = read_s

    def contains(self, key: bytes) -> bool:
        return key in self.pages

    def get(self, key: bytes) -> bytes | None:
        return self.pages.get(key)

    def level(self, key: bytes) -> str | None:
        return "disk" if key in self.pages else None

    def level_bytes(self) -> dict[str, int]:
        return {"disk": len(self.pages)}

    def load_seconds(self, keys: list[bytes]) -> float | None:
        return None if self.read_s is None else len(keys) * self.read_s


def test_admission_counts_a_prefix_in_the_pool_as_no_prefill():
    """A repeat of a cached 1000-token prompt computes its last 4 tokens: inside a TTFT bound that the
    same prompt uncached (four chunks, 1.2 s) is refused by."""
    h = Harness(max_num_batched_tokens=256)
    h.sched.step_time = FixedStepTime(fixed_s=0.05, per_decode_s=0.0, per_prefill_token_s=0.001)
    prompt = list(range(1000))
    h.add(tokens=prompt, max_tokens=1)
    h.run()
    h.sched.config = replace(h.config, interactive=TierLimits(max_ttft_s=0.5))
    with pytest.raises(CapacityExhausted) as err:
        h.add(tokens=[5000 + t for t in prompt])
    assert err.value.reason == "ttft"
    h.add(tokens=prompt)
    assert h.sched._tiers[I].prompt_tokens == 4 and h.sched._tiers[I].load_s == 0.0


@pytest.mark.parametrize("read_s", [None, 1e-4])
def test_admission_counts_a_lower_tier_hit_as_its_read_time(read_s):
    """A prompt whose 249 full blocks the lower tier holds: counted as their read (249 x read_s) and 4 tokens
    to compute, inside the bound; while the tier has measured no read, as a recompute, refused."""
    tier = MeasuredTier(read_s)
    h = Harness(max_num_batched_tokens=256, tier=tier, interactive=TierLimits(max_ttft_s=0.5))
    h.sched.step_time = FixedStepTime(fixed_s=0.05, per_decode_s=0.0, per_prefill_token_s=0.001)
    prompt = list(range(1000))
    parent = None
    for i in range(249):
        parent = hash_block(parent, prompt[4 * i:4 * i + 4], None)
        tier.pages[tier_key(0, parent)] = b"page"
    if read_s is None:
        with pytest.raises(CapacityExhausted) as err:
            h.add(tokens=prompt)
        assert err.value.reason == "ttft"
        return
    h.add(tokens=prompt)
    queued = h.sched._tiers[I]
    assert queued.prompt_tokens == 4 and queued.load_s == pytest.approx(249 * read_s)
    assert h.sched.estimated_queue_wait(I) == pytest.approx(249 * read_s + 0.05 + 0.004)


def test_scheduler_times_each_step_until_the_next_one_starts():
    """A step is timed from its schedule() to the next: the engine's work between steps counts. The last
    step before the engine idles is timed to its end."""

    class Recording(StepTimeModel):
        def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
            seen.append((decodes, prefill_tokens, round(seconds, 6)))

    seen: list[tuple[int, int, float]] = []
    h = Harness()
    h.sched.step_time = Recording()
    h.add(prompt_len=40, max_tokens=3)
    h.step()  # prefill of 40 tokens (the fake runner takes 0.01 s), then 0.05 s of engine work
    h.clock.t += 0.05
    h.step()  # one decode
    assert seen == [(0, 40, 0.06)]
    h.step()  # the last token: nothing left, timed to its end
    assert seen == [(0, 40, 0.06), (1, 0, 0.01), (1, 0, 0.01)]


def test_context_length_exceeded():
    h = Harness(max_model_len=64)
    with pytest.raises(ContextLengthExceeded):
        h.add(prompt_len=60, max_tokens=10)
    with pytest.raises(ContextLengthExceeded):
        h.add(prompt_len=64, max_tokens=None)
    h.add(prompt_len=63, max_tokens=None)
    h.add(prompt_len=54, max_tokens=10)


def test_request_larger_than_the_kv_pool_is_refused_at_entry():
    h = Harness(num_blocks=4)  # 16 tokens of KV
    with pytest.raises(ContextLengthExceeded, match="KV cache pool"):
        h.add(prompt_len=20, max_tokens=None)
    with pytest.raises(ContextLengthExceeded, match="KV cache pool"):
        h.add(prompt_len=10, max_tokens=10)  # 19 tokens of K/V
    assert not h.sched.has_unfinished()
    h.add(prompt_len=10, max_tokens=7)
    h.run()


def test_sequence_outgrowing_the_pool_alone_finishes_with_length():
    h = Harness(num_blocks=4)
    seq = h.add(prompt_len=8, max_tokens=None)
    finished = []
    for _ in range(20):
        finished += h.step().finished
        if not h.sched.has_unfinished():
            break
    assert finished == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.num_tokens == 17 and h.all_blocks_back()


def test_queue_timeout():
    h = Harness(max_num_seqs=1, interactive=TierLimits(queue_timeout_s=1.0))
    first = h.add(max_tokens=500)
    late = h.add()
    h.step()
    h.clock.t += 2.0
    out = h.step()
    assert out.finished == [late] and late.status is SequenceStatus.FINISHED_QUEUE_TIMEOUT
    assert not h.kv.has_blocks(late) and first.status is SequenceStatus.RUNNING
    assert h.sched.stats().waiting[I] == 0


# ---- preemption ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE, PreemptionMode.AUTO])
def test_preemption_under_a_tiny_pool_completes_everything(mode):
    h = Harness(num_blocks=10, host_blocks=40, preemption_mode=mode, max_num_seqs=8)
    seqs = [h.add(prompt_len=8, max_tokens=16, tenant=f"t{i % 2}") for i in range(6)]
    h.run()
    assert all(s.num_output_tokens == 16 and s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert h.sched.stats().num_preemptions > 0
    swapped_out = sum(len(o.blocks_to_swap_out) for o in h.outputs)
    swapped_in = sum(len(o.blocks_to_swap_in) for o in h.outputs)
    if mode is PreemptionMode.RECOMPUTE:
        assert swapped_out == swapped_in == 0
    else:
        assert swapped_out > 0 and swapped_in == swapped_out
    h.kv.check_integrity()
    assert h.all_blocks_back()


def test_swap_mode_falls_back_to_recompute_without_host_space():
    h = Harness(num_blocks=10, host_blocks=0, preemption_mode=PreemptionMode.SWAP)
    seqs = [h.add(prompt_len=8, max_tokens=16) for _ in range(6)]
    h.run()
    assert all(s.num_output_tokens == 16 for s in seqs)
    assert sum(len(o.blocks_to_swap_out) for o in h.outputs) == 0 and h.sched.stats().num_preemptions > 0


def test_recompute_preempted_sequence_is_readmitted_first():
    h = Harness(num_blocks=6, max_num_seqs=4, preemption_mode=PreemptionMode.RECOMPUTE)
    old = h.add(prompt_len=8, max_tokens=12)
    young = h.add(prompt_len=8, max_tokens=12)
    h.step()
    h.clock.t += 1.0
    newcomer = h.add(prompt_len=4, max_tokens=2)
    while young.num_preemptions == 0:
        h.step()
    assert young.status is SequenceStatus.WAITING and newcomer.status is SequenceStatus.WAITING
    while young.status is SequenceStatus.WAITING:
        h.step()
        assert newcomer.timings.first_scheduled is None or young.status is SequenceStatus.RUNNING
    h.run()
    assert old.num_output_tokens == young.num_output_tokens == 12 and newcomer.num_output_tokens == 2


def test_fork_shares_blocks_and_records_copy_on_write():
    h = Harness(prefix_caching=False)
    parent = h.add(prompt_len=6, max_tokens=5)
    h.step()  # prefill + first token
    child = h.make(tokens=[], max_tokens=5)
    child.append_token(8)  # the engine samples the child's own first token from the parent's logits
    h.sched.fork(parent, child)
    assert h.kv.block_table(child) == h.kv.block_table(parent)
    assert child.num_computed_tokens == 6 and child.output_token_ids == [8]
    out = h.step()
    assert len(out.blocks_to_copy) == 1  # both write into the shared partial block
    h.run()
    assert child.num_output_tokens == parent.num_output_tokens == 5
    assert child.output_token_ids[0] == 8 and parent.output_token_ids[0] == 7
    assert h.all_blocks_back()


# ---- abort and leaks -----------------------------------------------------------------------------

def test_abort_frees_blocks():
    h = Harness()
    seq = h.add(prompt_len=30, max_tokens=50)
    h.step()
    assert h.kv.block_table(seq)
    assert h.sched.abort(seq.request_id) == [seq]
    assert seq.status is SequenceStatus.FINISHED_ABORTED and not h.kv.has_blocks(seq)
    assert not h.sched.has_unfinished() and h.all_blocks_back()
    assert h.sched.abort("unknown") == []


def test_a_thousand_aborted_requests_leak_nothing():
    h = Harness(num_blocks=64, host_blocks=32, max_num_seqs=16, max_num_batched_tokens=128,
                interactive=TierLimits(max_waiting=2000, max_queue_wait_s=1e9),
                batch=TierLimits(max_waiting=2000, max_queue_wait_s=1e9))
    for i in range(1000):
        h.add(prompt_len=16, max_tokens=32, priority=I if i % 3 else B, tenant=f"t{i % 7}")
    for _ in range(10):
        h.step()
    assert h.sched.stats().running > 0
    for seq in h.seqs:
        h.sched.abort(seq.request_id)
    assert not h.sched.has_unfinished()
    s = h.sched
    assert not s._state and not s._requests and not s._running and not s._swapped
    for tier in s._tiers.values():
        assert tier.num_waiting == tier.prompt_tokens == tier.output_tokens == 0
        assert not tier.preempted and not tier.by_tenant and not tier.live
    out = h.step()
    assert out.is_empty
    h.kv.check_integrity()
    assert h.all_blocks_back()


# ---- randomized workloads ------------------------------------------------------------------------

request_st = st.tuples(st.integers(0, 6), st.sampled_from([I, B]), st.sampled_from(["a", "b", "c"]),
                       st.integers(1, 40), st.integers(1, 16), st.booleans(), st.sampled_from([1, 1, 2, 3]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_st, min_size=3, max_size=16),
       mode=st.sampled_from(list(PreemptionMode)), chunked=st.booleans(), num_blocks=st.integers(8, 30),
       host_blocks=st.sampled_from([0, 8, 64]), max_num_seqs=st.integers(1, 6),
       budget=st.sampled_from([8, 16, 64]), quantum=st.sampled_from([0, 2, 64]), abort_every=st.integers(0, 9))
def test_random_workloads_complete_without_leaks(requests, mode, chunked, num_blocks, host_blocks, max_num_seqs,
                                                 budget, quantum, abort_every):
    h = Harness(num_blocks=num_blocks, host_blocks=host_blocks, preemption_mode=mode, enable_chunked_prefill=chunked,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, batch_decode_quantum=quantum)
    pending = sorted(requests, key=lambda r: r[0])
    step = 0
    while pending or h.sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prio, tenant, prompt_len, max_tokens, shared, n = pending.pop(0)
            tokens = [1] * prompt_len if shared else None  # shared prompts exercise the prefix cache
            try:
                seq = h.add(prompt_len=prompt_len, max_tokens=max_tokens, priority=prio, tenant=tenant,
                            tokens=tokens)
                h.forks[seq.seq_id] = n - 1
            except ContextLengthExceeded:
                pass
        h.step()
        step += 1
        if abort_every and step % abort_every == 0 and h.sched._running:
            h.sched.abort(h.sched._running[-1].request_id)
        assert step < 3000, "no progress"
    for seq in h.seqs:
        assert seq.is_finished
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.sampling.max_tokens
    assert h.all_blocks_back()


# ---- step length while interactive work is active (W3) ------------------------------------------------

def test_batch_prefill_is_capped_while_interactive_work_is_active():
    h = Harness(max_num_batched_tokens=64, interactive_batch_prefill_tokens=16)
    flood = [h.add(prompt_len=200, max_tokens=50, priority=B) for _ in range(3)]
    out = h.step()
    assert out.num_batched_tokens == 64  # no interactive work: the whole budget goes to batch prefill
    chat = h.add(prompt_len=24, max_tokens=6, priority=I)
    capped_steps = 0
    while chat.status is not SequenceStatus.FINISHED_LENGTH:
        out = h.step()
        batch_prefill = sum(ss.num_new_tokens for ss in out.scheduled
                            if ss.seq.priority is B and ss.num_new_tokens > 1)
        assert batch_prefill <= 16
        capped_steps += 1
    assert chat.num_output_tokens == 6 and capped_steps >= 6
    out = h.step()  # interactive done: batch prefill gets the whole budget again
    assert sum(ss.num_new_tokens for ss in out.scheduled if ss.seq.priority is B) > 16
    h.run()
    assert all(s.num_output_tokens == 50 for s in flood)


def test_interactive_prefill_runs_in_a_step_without_batch_work():
    h = Harness(max_num_batched_tokens=64, interactive_batch_prefill_tokens=16)
    flood = [h.add(prompt_len=12, max_tokens=40, priority=B) for _ in range(3)]
    h.step()
    long_batch = h.add(prompt_len=100, max_tokens=4, priority=B)  # still prefilling in chunks
    h.step()
    assert long_batch.is_prefill
    chat = h.add(prompt_len=24, max_tokens=6, priority=I)
    out = h.step()
    assert scheduled_ids(out) == {chat.seq_id}  # batch decodes and the batch prefill chunk sit it out
    out = h.step()  # decodes of both tiers, and the batch chunk, run together again
    assert scheduled_ids(out) == {chat.seq_id, long_batch.seq_id} | {s.seq_id for s in flood}
    # A long interactive prompt prefilled in chunks alternates: batch keeps every other step.
    doc = h.add(prompt_len=300, max_tokens=2, priority=I)
    kinds = []
    while doc.is_prefill:
        out = h.step()
        kinds.append(any(ss.seq.priority is B for ss in out.scheduled))
    assert kinds[:4] == [False, True, False, True]
    h.run()
    assert all(s.num_output_tokens == s.sampling.max_tokens for s in h.seqs)


def test_batch_work_joins_when_interactive_prefill_cannot_start():
    """No blocks for the interactive prompt (and no batch sequence past its quantum to yield): the step
    is not wasted on interactive work alone."""
    h = Harness(num_blocks=6, block_size=4, batch_decode_quantum=64)
    flood = [h.add(prompt_len=8, max_tokens=8, priority=B) for _ in range(2)]  # 4 of 6 blocks
    h.step()
    h.add(prompt_len=20, max_tokens=2, priority=I)  # needs 5 blocks
    out = h.step()
    assert scheduled_ids(out) == {s.seq_id for s in flood}


def test_interactive_prefill_alone_needs_room_for_the_held_batch_decodes():
    """A prompt that would take the blocks the held batch decodes need next does not get a step alone:
    the decodes go first as usual, and no batch sequence is preempted outside its quantum."""
    h = Harness(num_blocks=8, block_size=4, batch_decode_quantum=64)
    flood = [h.add(prompt_len=8, max_tokens=8, priority=B) for _ in range(2)]  # 4 blocks each in the end
    h.step()
    h.add(prompt_len=12, max_tokens=2, priority=I)  # 3 of the 4 free blocks
    out = h.step()
    assert scheduled_ids(out) == {s.seq_id for s in flood}
    h.run()
    assert all(s.num_preemptions == 0 for s in flood)
    assert all(s.num_output_tokens == s.sampling.max_tokens for s in h.seqs)


def test_interactive_prefill_alone_can_be_turned_off():
    h = Harness(interactive_prefill_alone=False)
    flood = [h.add(prompt_len=12, max_tokens=40, priority=B) for _ in range(2)]
    h.step()
    chat = h.add(prompt_len=24, max_tokens=6, priority=I)
    assert scheduled_ids(h.step()) == {chat.seq_id} | {s.seq_id for s in flood}


# ---- interjections: an interactive prompt runs while the step in flight is suspended -----------------

def test_an_interjection_admits_waiting_interactive_prompts_only():
    h = Harness(max_num_batched_tokens=64)
    flood = [h.add(prompt_len=12, max_tokens=40, priority=B) for _ in range(3)]
    h.step()
    long_batch = h.add(prompt_len=100, max_tokens=4, priority=B)
    h.step()  # flood decodes, long_batch's first chunk
    arrived = []

    def arrive():
        arrived.append(h.add(prompt_len=24, max_tokens=6, priority=I))
        arrived.append(h.add(prompt_len=10, max_tokens=3, priority=B))

    before = {s.seq_id: s.num_computed_tokens for s in (*flood, long_batch)}
    out, inner = h.step_interjected(arrive)
    chat, late_batch = arrived
    assert [(ss.seq, ss.start, ss.num_new_tokens) for ss in inner.scheduled] == [(chat, 0, 24)]
    assert not (inner.preempted or inner.blocks_to_swap_in or inner.blocks_to_swap_out or inner.finished)
    assert chat.num_output_tokens == 1 and late_batch.status is SequenceStatus.WAITING
    # The suspended step went on as scheduled, untouched by the interjection.
    assert scheduled_ids(out) == set(before)
    assert all(s.num_computed_tokens > before[s.seq_id] for s in (*flood, long_batch))
    # The batch tier's turn: the next step is no interactive-alone step.
    assert scheduled_ids(h.step()) >= {s.seq_id for s in flood} | {chat.seq_id}
    h.run()
    assert all(s.num_output_tokens == s.sampling.max_tokens for s in h.seqs)
    assert h.all_blocks_back()


def test_an_interjection_takes_only_free_seats_and_blocks():
    """No preemption, no seat taken from batch: what cannot start now waits for the next regular step."""
    h = Harness(num_blocks=8, block_size=4, batch_decode_quantum=0)
    flood = [h.add(prompt_len=8, max_tokens=8, priority=B) for _ in range(2)]
    h.step()
    _, inner = h.step_interjected(lambda: h.add(prompt_len=12, max_tokens=2, priority=I))  # 3 blocks: no room
    assert not inner.scheduled and all(s.status is SequenceStatus.RUNNING for s in flood)

    h = Harness(max_num_seqs=2, batch_decode_quantum=0)
    flood = [h.add(prompt_len=8, max_tokens=8, priority=B) for _ in range(2)]
    h.step()
    _, inner = h.step_interjected(lambda: h.add(prompt_len=8, max_tokens=2, priority=I))
    assert not inner.scheduled and all(s.num_preemptions == 0 for s in flood)
    h.run()
    assert all(s.num_output_tokens == s.sampling.max_tokens for s in h.seqs)


def test_an_interjection_is_left_out_of_the_suspended_steps_time():
    class Recording(StepTimeModel):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[int, int, float]] = []

        def observe(self, decodes, prefill_tokens, seconds):
            self.seen.append((decodes, prefill_tokens, round(seconds, 6)))
            super().observe(decodes, prefill_tokens, seconds)

    h = Harness()
    model = h.sched.step_time = Recording()
    flood = [h.add(prompt_len=12, max_tokens=10, priority=B) for _ in range(2)]
    h.step()
    h.step_interjected(lambda: h.add(prompt_len=24, max_tokens=2, priority=I))
    h.step()  # observes the suspended step's cycle
    assert (0, 24, 0.005) in model.seen  # the interjection: its own length
    assert model.seen[-1] == (2, 0, 0.01)  # the suspended step: 0.004 + 0.006, without the interjection's 0.005
    assert len(flood) == 2


def test_interjections_can_be_turned_off():
    h = Harness(interactive_interjection=False)
    [h.add(prompt_len=12, max_tokens=10, priority=B) for _ in range(2)]
    h.step()
    _, inner = h.step_interjected(lambda: h.add(prompt_len=24, max_tokens=2, priority=I))
    assert not inner.scheduled


def test_interactive_estimates_count_batch_seats_as_free_and_the_batch_turn_after_an_alone_step():
    """Interactive work takes the seats of batch sequences, so a batch flood filling max_num_seqs adds no seat
    wait to an interactive estimate; but after an interactive step alone the next step is the batch tier's,
    which an interactive prompt arriving then waits out."""
    h = Harness(max_num_seqs=2)
    model = h.sched.step_time = FixedStepTime(fixed_s=0.004, per_decode_s=0.008, per_prefill_token_s=0.0005)
    h.add(prompt_len=8, max_tokens=30, priority=B)
    h.add(prompt_len=8, max_tokens=30, priority=B)
    h.step()  # both seats held by batch sequences
    assert h.sched.estimated_queue_wait(B) == pytest.approx(29 * model.predict(2))  # batch waits for a seat
    assert h.sched.estimated_queue_wait(I) == 0.0  # interactive takes one
    assert h.sched.estimated_ttft(I, 16) == pytest.approx(model.prefill_seconds(16, 2, 64))
    h.add(prompt_len=16, max_tokens=4, priority=I)
    out = h.step()  # the interactive prompt runs alone; the next step is the batch tier's turn
    assert [s.seq.priority for s in out.scheduled] == [I]
    # The batch sequence whose seat it took, to recompute: of its 9 tokens, 8 are in the prefix cache.
    requeued = h.sched._tiers[B].prompt_tokens
    assert requeued == 1
    turn = model.predict(2, requeued)  # the batch step: its decode and the requeued prompt
    assert h.sched.estimated_ttft(I, 16) == pytest.approx(turn + model.prefill_seconds(16, 2, 64))


def test_queue_wait_estimate_counts_the_seats_held_by_running_sequences():
    """max_num_seqs full: a new request waits for running sequences to finish, not just for the queue."""
    h = Harness(max_num_seqs=2)
    model = h.sched.step_time = FixedStepTime(fixed_s=0.004, per_decode_s=0.008, per_prefill_token_s=0.0005)
    a = h.add(prompt_len=8, max_tokens=30)
    b = h.add(prompt_len=8, max_tokens=10)
    h.step()  # both admitted and prefilled: 2 seats taken
    assert len(h.sched._running) == 2
    decode = model.predict(2)  # a decode step of the 2 running sequences: 0.02 s
    # b has 9 tokens left (one sampled at prefill).
    assert h.sched.estimated_queue_wait(I) == pytest.approx(9 * decode)
    c = h.add(prompt_len=8, max_tokens=20)
    # Two seats needed now: a's, with 29 tokens left, is the second to free; c's prompt waits too.
    assert h.sched.estimated_queue_wait(I) == pytest.approx(decode + 8 * 0.0005 + 29 * decode)
    h.add(prompt_len=8, max_tokens=20)
    h.add(prompt_len=8, max_tokens=20)
    # Four seats: two from the running ones (the later after 29 steps), two more a round (20 tokens) later.
    assert h.sched.estimated_queue_wait(I) == pytest.approx(decode + 24 * 0.0005 + (29 + 20) * decode)
    assert c.status is SequenceStatus.WAITING