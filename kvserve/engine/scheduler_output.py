"""The scheduler -> runner contract: a plain dataclass, so the scheduler is testable without torch.

The runner executes, in this order: swap_out copies, swap_in copies, copy-on-write copies, then
one forward pass over `scheduled` (flattened), and returns logits for the sequences whose
`sample` flag is set (in the order of `scheduled`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step: token_ids[start : start + num_new_tokens]
    start: int  # = seq.num_computed_tokens at schedule time
    block_table: list[int]  # device block ids covering at least start + num_new_tokens tokens
    sample: bool  # this step reaches the end of the known tokens, so a next token is sampled

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
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # finished by the scheduler (queue timeout)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in
