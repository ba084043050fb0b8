"""The pure half of speculative decoding (engine/speculation.py): what each drafter proposes, whose text it may
draft from, and how the controller sizes drafts against the step's cost."""
from __future__ import annotations

import pytest

from kvserve.engine.speculation import Candidate, NgramDrafter, Speculator, SuffixDrafter, plan_draft_lengths


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
    s.finish(99, "a", [1, 2, 3, 4, 5, 6])
    c = s.propose(0, "a", [1, 2, 3], cap=8)
    assert c.proposal == (4, 5, 6) and c.acceptance == pytest.approx(0.5)  # from the tenant's output; a prior
    s.observe(0, 3, 0)
    s.observe(0, 3, 0)
    assert s.propose(0, "a", [1, 2, 3], cap=8).acceptance < 0.5
    own = s.propose(1, "a", [8, 9, 8, 9, 8], cap=2)
    assert own.proposal == (9, 8)  # prompt lookup first, capped
    assert s.propose(2, "a", [1, 2], cap=0) is None
    assert s.stats["suffix"].proposed == 6 and s.stats["suffix"].accepted == 0


class Affine:
    def __init__(self, fixed: float, per_decode: float, per_token: float):
        self.fixed, self.per_decode, self.per_token = fixed, per_decode, per_token

    def predict(self, decodes: int, prefill_tokens: int = 0) -> float:
        return self.fixed + self.per_decode * decodes + self.per_token * prefill_tokens


def test_controller_drafts_long_when_steps_are_short_of_rows_and_stops_when_they_are_full():
    # One decode, a step of 20 ms where a row costs 0.5 ms: even a draft accepted 30% of the time pays for rows.
    step = Affine(fixed=0.02, per_decode=0.001, per_token=0.0005)
    lone = [Candidate(0, tuple(range(8)), 0.9)]
    assert plan_draft_lengths(lone, step, decodes=1, prefill_tokens=0, budget=100) == {0: 8}
    weak = [Candidate(0, tuple(range(8)), 0.3)]
    assert 1 <= plan_draft_lengths(weak, step, 1, 0, 100)[0] < 8
    # 64 decodes in a 0.1 s step (640 tokens/s): a row must bring more than 0.32 tokens.
    busy = [Candidate(i, tuple(range(8)), 0.3) for i in range(64)]
    assert plan_draft_lengths(busy, step, decodes=64, prefill_tokens=0, budget=1000) == {}
    good = [Candidate(i, tuple(range(8)), 0.9) for i in range(64)]
    lengths = plan_draft_lengths(good, step, 64, 0, 1000)
    assert lengths and max(lengths.values()) < 8  # shortened: later rows bring too little
    assert plan_draft_lengths(lone, step, 1, 0, budget=3) == {0: 3}  # the token budget bounds the rows


def test_controller_never_drafts_what_cannot_be_accepted():
    step = Affine(0.02, 0.001, 0.0005)
    assert plan_draft_lengths([Candidate(0, (), 0.9), Candidate(1, (5,), 0.0)], step, 2, 0, 100) == {}
