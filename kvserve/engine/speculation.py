"""Speculative decoding's pure half: the drafters, each sequence's acceptance, and the controller that sizes drafts.

A drafted token costs a row of the step (the target scores the sequence's last token and its k drafts as one
chunk, engine/runner.py) and pays off only when the target agrees. Both drafters here propose point masses (a
draft is a token, not a distribution), so verification is sampling each row of the chunk as decoding would and
keeping the drafts while the samples equal them: the tokens that come out are the target's own samples, greedy
or random, whatever was drafted.

- `NgramDrafter` (prompt lookup): the latest earlier place where the sequence's last n tokens (n from max_n
  down to min_n) occurred in its prompt and output; it proposes what followed there. Indexed incrementally, so a
  step costs the tokens appended since the last one, not a scan of the context.
- `SuffixDrafter`: the same match over a bounded cache of recent outputs of the sequence's tenant (another
  tenant's text never drafts yours): agent loops and repeated tasks continue what earlier answers said.

The controller (`Speculator.plan`) chooses each sequence's draft length per step, 0 included, to maximise the
expected tokens per second of step time: with a sequence's acceptance rate a (a moving average of accepted over
proposed, per drafter; before its first draft, the drafter's over every sequence), the i-th drafted token adds a^i expected tokens and costs a draft row, priced by a
step-time model of its own fitted on the steps that only decode and verify (engine/step_time.py's fit: fixed +
per sequence + per draft row), since a draft row turns a decode into a chunk and costs what prompt rows do not.
Draft rows are added best first while their tokens per second beat the step's own (the decodes' one token each
over the predicted step time): at low load steps are short of rows and drafts run long; as the batch fills, each
row costs more than the tokens it is likely to bring and drafts shorten, then stop. No torch, no I/O.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.engine.step_time import StepTimeModel

# Draft rows in a step, typically (the scale of the row-price fit's feature).
DRAFT_ROWS_SCALE = 32.0
# The guard: the weight of a step in its moving rates, and how often it steps the other way to keep both current.
RATE_WEIGHT = 0.1
EXPLORE_EVERY = 16
# Acceptance of a drafter that has not been measured yet, and the weight of each new observation.
PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_WEIGHT = 0.2


class NgramIndex:
    """For each n-gram size, where each n-gram of a token list last ended (the position its continuation starts),
    extended as the list grows; a lookup finds the latest occurrence before the list's own end."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: the more specific match
        self._where: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # positions below this are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index every continuation position up to len(tokens) - 1 (the list's end has no continuation yet)."""
        end = len(tokens) - 1
        for p in range(max(self._indexed, 1), end + 1):
            for n in self.sizes:
                if p >= n:
                    self._where[n][tuple(tokens[p - n:p])] = p
        self._indexed = max(self._indexed, end + 1)

    def continuation(self, tokens: list[int], suffix: list[int]) -> int | None:
        """Where, in the indexed list, the longest matching n-gram ending `suffix` was last followed; None."""
        for n in self.sizes:
            if len(suffix) >= n:
                p = self._where[n].get(tuple(suffix[-n:]))
                if p is not None:
                    return p
        return None


class NgramDrafter:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last n tokens."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, NgramIndex] = {}  # seq id -> its index

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        index = self._index.get(seq_id)
        if index is None:
            index = self._index[seq_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        p = index.continuation(tokens, tokens[-self.max_n:])
        return [] if p is None else tokens[p:p + k]

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


class SuffixDrafter:
    """Matches the sequence's last tokens in its tenant's recent outputs (at most `max_tokens` tokens of them per
    tenant, oldest out first) and proposes what followed there."""

    name = "suffix"

    def __init__(self, max_tokens: int = 65536, min_n: int = 3, max_n: int = 8):
        if max_tokens <= 0 or not 1 <= min_n <= max_n:
            raise ValueError("need max_tokens > 0 and 1 <= min_n <= max_n")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self._tenants: dict[str, _TenantOutputs] = {}

    def add_output(self, tenant: str, tokens: list[int]) -> None:
        """Remember a finished output (its last max_tokens tokens at most)."""
        if len(tokens) <= self.min_n:
            return
        cache = self._tenants.setdefault(tenant, _TenantOutputs())
        cache.add(tokens[-self.max_tokens:], self.min_n, self.max_n)
        while cache.tokens > self.max_tokens:
            cache.drop_oldest(self.min_n, self.max_n)

    def propose(self, tenant: str, tokens: list[int], k: int) -> list[int]:
        cache = self._tenants.get(tenant)
        if cache is None:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) >= n:
                hit = cache.where.get(tuple(tokens[-n:]))
                if hit is not None:
                    out, p = hit
                    return cache.outputs[out][p:p + k]
        return []


@dataclass
class _TenantOutputs:
    outputs: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)  # id -> tokens, oldest first
    where: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # n-gram -> (output id, next pos)
    tokens: int = 0
    next_id: int = 0

    def add(self, tokens: list[int], min_n: int, max_n: int) -> None:
        oid, self.next_id = self.next_id, self.next_id + 1
        self.outputs[oid] = tokens
        self.tokens += len(tokens)
        for key, p in _ngrams(tokens, min_n, max_n):
            self.where[key] = (oid, p)

    def drop_oldest(self, min_n: int, max_n: int) -> None:
        oid, tokens = self.outputs.popitem(last=False)
        self.tokens -= len(tokens)
        for key, _ in _ngrams(tokens, min_n, max_n):
            if self.where.get(key, (None,))[0] == oid:
                del self.where[key]


def _ngrams(tokens: list[int], min_n: int, max_n: int):
    """(n-gram, the position after it) for every n-gram of min_n..max_n tokens that something follows."""
    for p in range(min_n, len(tokens)):
        for n in range(min_n, min(max_n, p) + 1):
            yield tuple(tokens[p - n:p]), p


@dataclass
class Acceptance:
    """A moving average of the fraction of drafted tokens the target accepted."""

    rate: float = PRIOR_ACCEPTANCE
    proposed: int = 0
    accepted: int = 0

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate += ACCEPTANCE_WEIGHT * (accepted / proposed - self.rate)
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
                       budget: int) -> dict[int, int]:
    """Each candidate's draft length (those left out: 0) maximising the step's expected tokens per second, for a
    step of `seconds` making a token per decode where a draft row costs `row_s`: rows best first (a candidate's
    i-th row brings acceptance^i tokens), each while what it brings per second beats the step's tokens per
    second so far; at most `budget` rows in all."""
    row_s = max(row_s, 1e-9)
    tokens = float(max(decodes, 1))
    # (-gain, row, tie-break, candidate): ties go to the earlier candidate
    heap = [(-c.acceptance, 1, j, c) for j, c in enumerate(candidates) if c.proposal and c.acceptance > 0]
    heapq.heapify(heap)
    lengths: dict[int, int] = {}
    while heap and budget > 0:
        neg_gain, i, j, c = heapq.heappop(heap)
        gain = -neg_gain
        if gain / row_s <= tokens / seconds:
            break  # the best row left brings fewer tokens per second than the step already makes
        lengths[c.seq_id] = i
        tokens += gain
        seconds += row_s
        budget -= 1
        if i < len(c.proposal):
            heapq.heappush(heap, (-gain * c.acceptance, i + 1, j, c))
    return lengths


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
        acc = self._acceptance.get((seq_id, name)) or self._drafter_acceptance[name]
        return Candidate(seq_id, tuple(proposal), acc.rate)

    def plan(self, candidates: list[Candidate], prompt_seconds: float, decodes: int, budget: int) -> dict[int, int]:
        """Draft lengths for a step of `decodes` decodes (and prompt rows costing `prompt_seconds`), unless steps
        with drafts have measured fewer tokens per second than steps without at this batch size (the guard)."""
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
        self.last_lengths = plan_draft_lengths(candidates, seconds, row_s, decodes, budget)
        return self.last_lengths

    def observe_step(self, sequences: int, draft_rows: int, tokens: int, seconds: float) -> None:
        """A step of decodes and verified drafts only (no prompt tokens) that gave `tokens` tokens: the price of a
        draft row, learned apart from prompt prefill (whose long chunks cost another price per row), and the
        guard's rates with and without drafts at this batch size."""
        self.cost.observe(sequences, draft_rows, seconds)
        self._guards.setdefault(batch_bucket(sequences), RateGuard()).observe(draft_rows > 0, tokens / seconds)

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verified draft: `accepted` of its `proposed` tokens were the target's."""
        name = self._drafter_of.get(seq_id)
        if name is None:
            return
        self._acceptance.setdefault((seq_id, name), Acceptance(self._drafter_acceptance[name].rate)).observe(
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
