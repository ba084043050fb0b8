"""Speculative decoding's pure half, one room: what drafts (drafters.py), how long each draft is (policy.py), and
which drafted tokens the target keeps (verification.py). No torch, no I/O: the torch half (engine/worker/runner.py)
samples the verification chunk and applies verification.py's rule; the scheduler asks policy.py for each step's
drafts and feeds back what was kept.

A drafted token costs a row of the step (the target scores the sequence's last token and its k drafts as one
chunk) and pays off only when the target agrees. Both drafters propose point masses (a draft is a token, not a
distribution), so verification is sampling each row of the chunk as decoding would and keeping the drafts while
the samples equal them: the tokens that come out are the target's own samples, greedy or random, whatever was
drafted.
"""
