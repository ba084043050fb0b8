"""The pure half of speculative decoding (engine/speculation/): what each drafter proposes, whose text it may
draft from, how the controller sizes drafts against the step's cost, and which drafts the target keeps."""
from __future__ import annotations

import pytest

from kvserve.engine.speculation.drafters import NgramDrafter, SuffixDrafter
from kvserve.engine.speculation.policy import Candidate, RateGuard, Speculator, plan_draft_lengths
from kvserve.engine.speculation.verification import accepted_count


def test_ngram_drafter_proposes_what_followed_the_latest_earlier_match():
    d = NgramDrafter(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # [2, 3] (the longest match: [1, 2, 3] at the start) -> what followed its latest occurrence before the end.
    assert d.propose(0, tokens, 3) == [4, 5, 9]
    tokens += [4, 5]
    assert d.propose(0, tokens, 2) == [9, 2]  # [3, 4, 5] -> 9, 2; the index grew with the tokens
    assert d.propose(1, [1, 2, 3, 4], 4) == []  # nothing repeats
    assert d.propose(2, [5, 6, 5, 6], 4) == [5, 6]  # the continuation may run into the tail itself


def test_suffix_drafter_drafts_from_the_same_tenants_outputs_only():
    d = SuffixDrafter(max_tokens=30, min_n=2, max_n=4)
    d.add_output("a", [10, 11, 12, 13, 14, 15, 16])
    assert d.propose("a", [99, 12, 13], 3) == [14, 15, 16]
    assert d.propose("b", [99, 12, 13], 3) == []
    for i in range(5):  # 35 tokens of newer outputs: the oldest goes
        d.add_output("a", [100 + 7 * i + j for j in range(7)])
    assert d.propose("a", [99, 12, 13], 3) == []


def test_speculator_prefers_the_sequences_own_context_and_learns_acceptance():
    s = Speculator(max_draft=4)
    s.finish(99, "a", [1, 2], [3, 4, 5, 6])  # the prompt's end, then the output
    c = s.propose(0, "a", [1, 2, 3], cap=8)
    assert c.proposal == (4, 5, 6) and c.acceptance == pytest.approx(0.5)  # from the tenant's output; a prior
    s.observe(0, 3, 0)
    s.observe(0, 3, 0)
    assert s.propose(0, "a", [1, 2, 3], cap=8).acceptance < 0.5
    own = s.propose(1, "a", [8, 9, 8, 9, 8], cap=2)
    assert own.proposal == (9, 8)  # prompt lookup first, capped
    assert s.propose(2, "a", [1, 2], cap=0) is None
    assert s.stats["suffix"].proposed == 6 and s.stats["suffix"].accepted == 0


def test_controller_drafts_long_when_steps_are_short_of_rows_and_stops_when_they_are_full():
    # One decode in a 20 ms step where a row costs 0.5 ms: even a draft accepted 30% of the time pays for rows.
    lone = [Candidate(0, tuple(range(8)), 0.9)]
    assert plan_draft_lengths(lone, seconds=0.02, row_s=0.0005, decodes=1, budget=100) == {0: 8}
    weak = [Candidate(0, tuple(range(8)), 0.3)]
    assert 1 <= plan_draft_lengths(weak, 0.02, 0.0005, 1, 100)[0] < 8
    # 64 decodes in a 0.1 s step (640 tokens/s): a row must bring more than 0.32 tokens.
    busy = [Candidate(i, tuple(range(8)), 0.3) for i in range(64)]
    assert plan_draft_lengths(busy, 0.1, 0.0005, decodes=64, budget=1000) == {}
    good = [Candidate(i, tuple(range(8)), 0.9) for i in range(64)]
    lengths = plan_draft_lengths(good, 0.1, 0.0005, 64, 1000)
    assert lengths and max(lengths.values()) < 8  # shortened: later rows bring too little
    assert plan_draft_lengths(lone, 0.02, 0.0005, 1, budget=3) == {0: 3}  # the token budget bounds the rows


def test_controller_never_drafts_what_cannot_be_accepted():
    assert plan_draft_lengths([Candidate(0, (), 0.9), Candidate(1, (5,), 0.0)], 0.02, 0.0005, 2, 100) == {}


def test_the_row_price_is_learned_from_decode_and_verify_steps():
    s = Speculator()
    for seqs, rows in ((8, 0), (8, 16), (8, 32), (4, 8), (16, 0), (16, 24)) * 12:
        s.observe_step(seqs, rows, seqs, 0.005 + 0.0003 * seqs + 0.0004 * rows)
    assert s.cost.predict(8, 1) - s.cost.predict(8, 0) == pytest.approx(0.0004, rel=0.05)


def test_the_guard_stops_drafts_that_measured_slower_and_keeps_checking():
    g = RateGuard()
    assert g.allow_drafts()  # nothing measured: draft, to measure it
    g.observe(True, 800.0)
    allowed = [g.allow_drafts() for _ in range(32)]
    assert allowed.count(False) == 2  # a plain step now and then, to measure that too
    g.observe(False, 1000.0)  # plain steps were faster
    allowed = [g.allow_drafts() for _ in range(32)]
    assert allowed.count(True) == 2  # drafts only to check again
    for _ in range(30):
        g.observe(True, 1500.0)  # drafting got faster (say the acceptance rose)
    assert sum(g.allow_drafts() for _ in range(32)) == 30


def test_controller_pays_a_kernels_jump_in_step_time_only_where_enough_rows_follow_it():
    # 8 decodes in an 8 ms step, 0.4 ms a row, but a step of more than 8 rows costs 4 ms more (a quantized GEMM
    # leaving its as-read path): a few drafted rows never pay for the jump; 8 rows each sure to be accepted do.
    jump = lambda drafts: 0.004 if drafts > 0 else 0.0  # noqa: E731
    sure = [Candidate(i, tuple(range(4)), 0.99) for i in range(8)]
    assert plan_draft_lengths(sure, 0.008, 0.0004, 8, 100) == {i: 4 for i in range(8)}
    assert plan_draft_lengths(sure, 0.008, 0.0004, 8, 100, jump) == {i: 4 for i in range(8)}
    assert plan_draft_lengths(sure, 0.008, 0.0004, 8, budget=3, excess=jump) == {}  # 3 rows can't pay 4 ms
    fair = [Candidate(i, tuple(range(4)), 0.6) for i in range(8)]
    assert plan_draft_lengths(fair, 0.008, 0.0003, 8, 100) != {}  # the affine price alone says draft
    assert plan_draft_lengths(fair, 0.008, 0.0003, 8, 100, jump) == {}


def test_the_speculator_learns_a_row_counts_excess_over_the_affine_fit():
    s = Speculator()
    for _ in range(20):  # up to 8 rows one path; above, 4 ms more
        for seqs, rows in ((8, 0), (4, 4), (8, 8), (8, 16), (4, 12)):
            total = seqs + rows
            s.observe_step(seqs, rows, seqs, 0.004 + 0.0004 * total + (0.004 if total > 8 else 0.0))
    for seqs, rows in ((8, 0), (8, 8), (4, 4)):  # the fit plus the row count's excess: the step's time
        total = seqs + rows
        assert s.cost.predict(seqs, rows) + s.excess[total, rows > 0] == pytest.approx(
            0.004 + 0.0004 * total + (0.004 if total > 8 else 0.0), rel=0.15)
    assert s.excess[16, True] - s.excess[8, False] > 0.001  # the affine fit alone smooths the jump over every row count
    c = [Candidate(i, (1, 2), 0.6) for i in range(8)]
    assert s.plan(c, 0.0, 8, 100) == {}  # not worth the jump at 60%


def test_a_sequence_is_tried_again_after_its_drafters_rate_sank():
    s = Speculator(max_draft=4)
    for seq in range(10):  # text nothing drafts: the n-gram drafter's rate over every sequence sinks
        s.propose(seq, "t", [1, 2, 1, 2, 1], cap=4)
        for _ in range(5):
            s.observe(seq, 4, 0)
    assert s._drafter_acceptance["ngram"].rate < 0.01
    fresh = s.propose(100, "t", [5, 6, 5, 6, 5], cap=4)
    assert fresh.acceptance == pytest.approx(0.3)  # a new sequence is still worth a row at low load
    for _ in range(3):
        s.observe(100, 4, 0)
    low = s.propose(100, "t", [5, 6, 5, 6, 5], cap=4).acceptance
    s.last_lengths = {}  # not drafted: its estimate drifts back toward the floor, step by step
    later = [s.propose(100, "t", [5, 6, 5, 6, 5], cap=4).acceptance for _ in range(20)]
    assert low < later[0] < later[-1] < 0.3


def test_acceptance_is_per_tested_token_not_per_proposed():
    # Drafts of 4 at a per-token acceptance of 0.6: verification stops at the first rejection, so the tokens
    # after it were never tested. Accepted over proposed would say 0.33 and cut drafts that pay.
    import random

    from kvserve.engine.speculation.policy import Acceptance

    rng = random.Random(0)
    acc = Acceptance()
    for _ in range(2000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.6:
            accepted += 1
        acc.observe(4, accepted)
    assert acc.accepted / acc.proposed == pytest.approx(0.33, abs=0.03)
    assert acc.rate == pytest.approx(0.6, abs=0.12)  # a moving average: its last few hundred tokens


def test_a_draft_stands_while_the_targets_samples_equal_it():
    assert accepted_count([5, 6, 7, 8], [5, 6, 7]) == 3  # all kept, then the sample after the last draft
    assert accepted_count([5, 9, 7, 8], [5, 6, 7]) == 1  # a later equal sample counts for nothing
    assert accepted_count([4, 6, 7, 8], [5, 6, 7]) == 0
    assert accepted_count([4], []) == 0
