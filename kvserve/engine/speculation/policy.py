"""How long each draft is. The controller (`Speculator.plan`) chooses each sequence's draft length per step,
0 included, to maximise the expected tokens per second of step time: with a sequence's acceptance rate a (a moving average of accepted over
tested, per drafter; before its first draft, the drafter's over every sequence, but not below
PROBE_ACCEPTANCE), the i-th drafted token adds a^i expected tokens and costs a draft row, priced by a step-time
model of its own fitted on the steps that only decode and verify (engine/step_time.py's fit: fixed + per sequence
+ per draft row), since a draft row turns a decode into a chunk and costs what prompt rows do not. A step's time
is affine in its rows except where a kernel changes path with the row count (the CPU's quantized GEMM multiplies
weights as read up to a few rows and widens them into a bf16 panel above; CUDA graphs are captured per batch
size): so each total row count also keeps the measured excess over the fit, and a plan may pay a step's jump only
where enough drafted rows follow it. Rows are taken best first; the plan keeps the count of them whose predicted
tokens per second is highest (0 included): at low load steps are short of rows and drafts run long; as the batch
fills, rows cost more than the tokens they are likely to bring and drafts shorten, then stop. No torch, no I/O.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine.speculation.drafters import NgramDrafter, SuffixDrafter
from kvserve.engine.step_time import StepTimeModel

# Draft rows in a step, typically (the scale of the row-price fit's feature).
DRAFT_ROWS_SCALE = 32.0
# The guard: the weight of a step in its moving rates, and how often it steps the other way to keep both current.
RATE_WEIGHT = 0.1
EXPLORE_EVERY = 16
# Acceptance of a drafter that has not been measured yet, and the weight of each verified drafted token.
PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_WEIGHT = 0.1
# The least acceptance assumed of a sequence before its first draft (a drafter's rate over every sequence sinks on
# text nothing drafts, and a sequence never drafted would never show better), and the weight of the pull back
# toward it each step a sequence with a proposal is not drafted: one whose text turns repetitive is tried again.
PROBE_ACCEPTANCE = 0.3
RELAX_WEIGHT = 0.05
# The weight of a step in its row count's measured excess over the affine fit.
EXCESS_WEIGHT = 0.2
# How much more tokens per second a step with drafts must promise than one without: the estimates it rests on
# are noisy, and the rows a plan takes first are those whose acceptance is most overestimated.
DRAFT_MARGIN = 0.05


@dataclass
class Acceptance:
    """The chance that a drafted token is accepted given the ones before it were (what a^i compounds), as a moving
    average: verification stops at the first rejection, so a draft of k with `accepted` tokens tested
    min(k, accepted + 1) of them (accepted over proposed would count the untested tail as rejections)."""

    rate: float = PRIOR_ACCEPTANCE
    proposed: int = 0
    accepted: int = 0

    def relax(self, toward: float) -> None:
        """Drift back toward `toward` (from below only): a step with a proposal that was not drafted."""
        if self.rate < toward:
            self.rate += RELAX_WEIGHT * (toward - self.rate)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:  # each tested token an observation: a long run of acceptances says more than one
            tested = min(proposed, accepted + 1)
            self.rate += (1 - (1 - ACCEPTANCE_WEIGHT) ** tested) * (accepted / tested - self.rate)
            self.proposed += proposed
            self.accepted += accepted


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that may draft: its id, the drafter's proposal (at most its cap) and acceptance."""

    seq_id: int
    proposal: tuple[int, ...]
    acceptance: float


@dataclass
class DrafterStats:
    """Totals per drafter since start (the server's metrics)."""

    proposed: int = 0
    accepted: int = 0
    drafts: int = 0  # verification chunks


def plan_draft_lengths(candidates: list[Candidate], seconds: float, row_s: float, decodes: int,
                       budget: int, excess: Callable[[int], float] | None = None) -> dict[int, int]:
    """Each candidate's draft length (those left out: 0) maximising the step's expected tokens per second, for a
    step of `seconds` making a token per decode where a draft row costs `row_s`, plus `excess(rows)` seconds for
    a step of that many draft rows (a kernel's jump at a row count): rows best first (a candidate's i-th row
    brings acceptance^i tokens), taken while a row could still beat the best step so far at the affine price;
    the prefix of them with the best rate is the plan, if it beats the step without drafts by DRAFT_MARGIN. At
    most `budget` rows in all."""
    row_s = max(row_s, 1e-9)
    excess = excess or (lambda rows: 0.0)
    tokens = float(max(decodes, 1))
    best_rate, best_rows = (1 + DRAFT_MARGIN) * tokens / max(seconds + excess(0), 1e-9), 0
    # (-gain, row, tie-break, candidate): ties go to the earlier candidate
    heap = [(-c.acceptance, 1, j, c) for j, c in enumerate(candidates) if c.proposal and c.acceptance > 0]
    heapq.heapify(heap)
    taken: list[tuple[int, int]] = []  # (seq id, its draft length with this row), best rows first
    while heap and len(taken) < budget:
        neg_gain, i, j, c = heapq.heappop(heap)
        gain = -neg_gain
        if gain / row_s <= best_rate:
            break  # no row left brings as many tokens per second as the best step found
        taken.append((c.seq_id, i))
        tokens += gain
        seconds += row_s
        rate = tokens / max(seconds + excess(len(taken)), 1e-9)
        if rate > best_rate:
            best_rate, best_rows = rate, len(taken)
        if i < len(c.proposal):
            heapq.heappush(heap, (-gain * c.acceptance, i + 1, j, c))
    return dict(taken[:best_rows])


def batch_bucket(decodes: int) -> int:
    """Batch sizes the guard compares alike: 1, 2-3, 4-7, 8-15, ..."""
    return max(decodes, 1).bit_length()


@dataclass
class RateGuard:
    """The measured tokens per second of steps with drafts and without, at one batch size (moving averages):
    drafts stop where they measured slower, with every EXPLORE_EVERY-th step the other way so both rates stay
    current (a step without drafts while drafting, one with while not)."""

    drafted: float | None = None
    plain: float | None = None
    steps: int = 0

    def allow_drafts(self) -> bool:
        self.steps += 1
        explore = self.steps % EXPLORE_EVERY == 0
        if self.drafted is None or self.plain is None:
            return self.drafted is None or not explore  # measure drafting first, then a plain step now and then
        return (self.drafted >= self.plain) != explore

    def observe(self, drafted: bool, tokens_per_s: float) -> None:
        old = self.drafted if drafted else self.plain
        new = tokens_per_s if old is None else old + RATE_WEIGHT * (tokens_per_s - old)
        if drafted:
            self.drafted = new
        else:
            self.plain = new


class Speculator:
    """The drafters, each sequence's acceptance per drafter, and the step's draft plan (the scheduler's part)."""

    def __init__(self, max_draft: int = 8, ngram: NgramDrafter | None = None, suffix: SuffixDrafter | None = None,
                 adaptive: bool = True):
        """`adaptive` False: every proposal drafted whole (a static length, as other engines have it)."""
        if max_draft < 1:
            raise ValueError(f"max_draft must be at least 1, got {max_draft}")
        self.max_draft = max_draft
        self.adaptive = adaptive
        self.ngram = ngram or NgramDrafter()
        self.suffix = suffix or SuffixDrafter()
        self.stats = {self.ngram.name: DrafterStats(), self.suffix.name: DrafterStats()}
        self._acceptance: dict[tuple[int, str], Acceptance] = {}  # per sequence and drafter
        # Per drafter over every sequence: a sequence's prior before its own first draft.
        self._drafter_acceptance = {name: Acceptance() for name in self.stats}
        self._drafter_of: dict[int, str] = {}  # seq id -> the drafter of its draft in flight
        self.last_lengths: dict[int, int] = {}  # the last plan: seq id -> draft length (0s left out)
        # Steps of decodes and drafts: seconds ~ fixed + per sequence + per draft row (the controller's row price).
        self.cost = StepTimeModel(prefill_scale=DRAFT_ROWS_SCALE)
        # (a step's rows, whether it verified drafts) -> measured seconds over the fit (moving average)
        self.excess: dict[tuple[int, bool], float] = {}
        self._guards: dict[int, RateGuard] = {}  # batch-size bucket -> its measured rates

    def propose(self, seq_id: int, tenant: str, tokens: list[int], cap: int) -> Candidate | None:
        """A sequence's best proposal now: the n-gram drafter's, else its tenant's earlier outputs'."""
        cap = min(cap, self.max_draft)
        if cap <= 0:
            return None
        name, proposal = self.ngram.name, self.ngram.propose(seq_id, tokens, cap)
        if not proposal:
            name, proposal = self.suffix.name, self.suffix.propose(tenant, tokens, cap)
            if not proposal:
                return None
        self._drafter_of[seq_id] = name
        prior = self._prior(name)
        acc = self._acceptance.get((seq_id, name))
        if acc is None:
            return Candidate(seq_id, tuple(proposal), prior)
        if seq_id not in self.last_lengths:  # not drafted last step
            acc.relax(prior)
        return Candidate(seq_id, tuple(proposal), acc.rate)

    def _prior(self, drafter: str) -> float:
        return max(self._drafter_acceptance[drafter].rate, PROBE_ACCEPTANCE)

    def plan(self, candidates: list[Candidate], prompt_seconds: float, decodes: int, budget: int,
             prompt_rows: int = 0) -> dict[int, int]:
        """Draft lengths for a step of `decodes` decodes (and `prompt_rows` prompt rows costing `prompt_seconds`),
        unless steps with drafts have measured fewer tokens per second than steps without at this batch size
        (the guard)."""
        if not self.adaptive:
            self.last_lengths = {}
            for c in candidates:
                k = min(len(c.proposal), budget)
                if k:
                    self.last_lengths[c.seq_id] = k
                    budget -= k
            return self.last_lengths
        guard = self._guards.setdefault(batch_bucket(decodes), RateGuard())
        if not guard.allow_drafts():
            self.last_lengths = {}
            return self.last_lengths
        seconds = self.cost.predict(decodes, 0) + prompt_seconds
        row_s = self.cost.predict(decodes, 1) - self.cost.predict(decodes, 0)
        rows = decodes + prompt_rows
        self.last_lengths = plan_draft_lengths(candidates, seconds, row_s, decodes, budget,
                                               lambda drafts: self.excess.get((rows + drafts, drafts > 0), 0.0))
        return self.last_lengths

    def observe_step(self, sequences: int, draft_rows: int, tokens: int, seconds: float) -> None:
        """A step of decodes and verified drafts only (no prompt tokens) that gave `tokens` tokens: the price of a
        draft row, learned apart from prompt prefill (whose long chunks cost another price per row), the excess
        over that fit at this step's row count, and the guard's rates with and without drafts at this batch size."""
        self.cost.observe(sequences, draft_rows, seconds)
        over = seconds - self.cost.predict(sequences, draft_rows)
        rows = sequences + draft_rows, draft_rows > 0
        old = self.excess.get(rows)
        self.excess[rows] = over if old is None else old + EXCESS_WEIGHT * (over - old)
        self._guards.setdefault(batch_bucket(sequences), RateGuard()).observe(draft_rows > 0, tokens / seconds)

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verified draft: `accepted` of its `proposed` tokens were the target's."""
        name = self._drafter_of.get(seq_id)
        if name is None:
            return
        self._acceptance.setdefault((seq_id, name), Acceptance(self._prior(name))).observe(
            proposed, accepted)
        self._drafter_acceptance[name].observe(proposed, accepted)
        s = self.stats[name]
        s.proposed += proposed
        s.accepted += accepted
        s.drafts += 1

    def finish(self, seq_id: int, tenant: str, prompt: list[int], output: list[int]) -> None:
        """A sequence ended: its output, after the end of its prompt (so the same prompt again matches from its
        first output token), joins its tenant's suffix cache; its state goes."""
        if output:
            self.suffix.add_output(tenant, prompt[-self.suffix.max_n:] + output)
        self.ngram.forget(seq_id)
        self._drafter_of.pop(seq_id, None)
        self.last_lengths.pop(seq_id, None)
        for name in self.stats:
            self._acceptance.pop((seq_id, name), None)
