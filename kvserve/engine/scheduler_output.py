"""The step contract, plain dataclasses so the scheduler and the engine core run without torch:
scheduler -> executor (`SchedulerOutput`) and executor -> core (`RunnerOutput`).

The executor runs, in this order: offloads (pages copied out to the lower tier), swap_out copies, tier
loads, swap_in copies, copy-on-write copies, then one forward pass over `scheduled` (flattened), and samples a token for each sequence whose `sample` flag is
set, plus one for each new fork in `forks` (from its parent's row, with the fork's own generator).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step: token_ids[start : start + num_new_tokens]
    start: int  # = seq.num_computed_tokens at schedule time
    block_tables: list[list[int]]  # per KV group: device block ids covering start + num_new_tokens tokens
    sample: bool  # this step reaches the end of the known tokens, so a next token is sampled
    # A decode's drafted tokens (speculative decoding): computed after its last token in the same chunk
    # (num_new_tokens = 1 + len), each row sampled; the runner returns the drafts the samples agreed with and the
    # sample after them.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: the sequence's, then its drafts."""
        known = self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[self.start:self.start + known] + self.draft_token_ids

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table (the only one of a model whose layers all attend alike)."""
        return self.block_tables[0]

    @property
    def context_len(self) -> int:
        """Tokens attended to after this step: cached + new."""
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src device, dst device)
    # The lower tier's (engine/kv/disk.py): pages to copy out first, under their keys, and pages read back
    blocks_to_offload: list[tuple[int, bytes]] = field(default_factory=list)  # (device, key)
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)  # (device, page bytes)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # finished by the scheduler (queue timeout)
    # Sequences that ended since the previous step: the executor drops what it keeps for them (generators).
    finished_seq_ids: list[int] = field(default_factory=list)
    # parent seq_id -> the forks (n > 1) to start from the parent's first sample; set by the engine core
    forks: dict[int, list[Sequence]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token under the raw model distribution (log_softmax of the logits)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (1 + number of tokens strictly more likely)
    top: list[tuple[int, float]]  # the top `params.logprobs` (token id, logprob), most likely first


@dataclass
class RunnerOutput:
    """What one executed step gives back: per sequence that sampled (new forks included), its new tokens
    (a list, so a step may later accept several) and, where the request asked, their logprobs."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> tokens sampled this step
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # seq_id -> one per token
    seconds: float = 0.0  # the executor's own time for the step (block moves, forward, sampling)
