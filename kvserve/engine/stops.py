"""When a sequence ends, decided in one place (plain Python: the engine calls it per sampled token; a
simulator can too)."""
from __future__ import annotations

from typing import Collection, Protocol

from kvserve.engine.request import Sequence, SequenceStatus


class StopStrings(Protocol):
    """What the incremental detokenizer knows about stop strings."""

    stopped: bool
    stop_reason: str | None


def stop_token(seq: Sequence, token: int, eos_token_ids: Collection[int]) -> tuple[bool, int | None]:
    """Whether `token` (already appended) ends `seq` as a stop token: an eos (unless ignore_eos) or one of
    stop_token_ids, once min_tokens are out. The stop_reason is the token for stop_token_ids, None for eos."""
    p = seq.sampling
    if seq.num_output_tokens < p.min_tokens:
        return False, None
    if not p.ignore_eos and token in eos_token_ids:
        return True, None
    if token in p.stop_token_ids:
        return True, token
    return False, None


def stop_status(seq: Sequence, token: int, eos_token_ids: Collection[int], strings: StopStrings,
                max_model_len: int) -> tuple[SequenceStatus | None, str | int | None]:
    """(the finished status, the stop_reason) after `token`, or (None, None) while the sequence goes on:
    a stop token or a structured-output constraint complete, then a stop string (past min_tokens), then max_tokens, then the model's context."""
    stopped, reason = stop_token(seq, token, eos_token_ids)
    if stopped or seq.grammar_done:
        return SequenceStatus.FINISHED_STOPPED, reason
    p = seq.sampling
    if seq.num_output_tokens >= p.min_tokens and strings.stopped:
        return SequenceStatus.FINISHED_STOPPED, strings.stop_reason
    if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
        return SequenceStatus.FINISHED_LENGTH, None
    if seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH, None
    return None, None
