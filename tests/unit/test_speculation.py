"""The pure half of speculative decoding (engine/speculation.py): what each drafter proposes, whose text it may
draft from, and how the controller sizes drafts against the step's cost."""
from __future__ import annotations

import pytest

from kvserve.engine.speculation import (Candidate, NgramDrafter, RateGuard, Speculator, SuffixDrafter,
                                       plan_draft_lengths)


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
