"""Which drafted tokens the target keeps. The target samples every row of a draft's chunk as decoding would
(row i sees the drafts before it as its outputs so far); the draft stands while those samples equal it. The
tokens kept are then the target's own samples (the equal drafts, and the first sample that differs or the one
after the last draft): greedy gives the bits decoding gives, random sampling its distribution, whatever the
drafter proposed. Pure: engine/worker/runner.py samples the rows and applies this rule.
"""
from __future__ import annotations


def accepted_count(samples: list[int], draft: list[int]) -> int:
    """How many of `draft` stand: the length of the run of rows whose sample equals the draft token there
    (`samples` holds the chunk's rows, one more than the draft)."""
    n = 0
    while n < len(draft) and samples[n] == draft[n]:
        n += 1
    return n

