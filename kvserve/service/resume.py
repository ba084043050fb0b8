"""Resuming a stream anywhere from the client's `Last-Event-ID`: the resume token.

A stream whose tokens a server can generate again exactly (one choice, greedy or seeded; no tool-call parsing
in flight) carries an SSE `id` on each content event: `r1.<tokens delivered>.<digest>`, the digest a hash
chain over the delivered token ids. A client that lost the stream (its region died, or the connection did)
sends the same request again, to any region, with `Last-Event-ID: <the last id it received>` (what an SSE
client does on reconnect; `Idempotency-Key` as before). The server that takes it generates the delivered
tokens again without sending them (the engine's path for a stream resumed elsewhere then continues from
them: the KV recomputed, max_tokens counted from the start, a seed's generator past their draws), checks
their digest, and streams the rest: no token twice, none lost. Where the tokens come out different (another
model version, numerics that differ between machines) the digest says so and the request is refused (409
`resume_mismatch`) rather than continued on a different text.

Pure Python: the token, its digest, and which requests can be resumed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvserve.engine.errors import InvalidRequest, KVServeError

VERSION = "r1"
HEADER = "last-event-id"


class ResumeMismatch(KVServeError):
    """The tokens generated again are not the ones the client received: the stream cannot go on here."""

    code = "resume_mismatch"
    http_status = 409
    error_type = "invalid_request_error"


@dataclass(frozen=True)
class ResumePoint:
    """Where a client's stream stopped: how many output tokens it received, and their digest."""

    count: int
    digest: str

    def encode(self) -> str:
        return f"{VERSION}.{self.count}.{self.digest}"

    @classmethod
    def parse(cls, value: str) -> "ResumePoint":
        parts = value.strip().split(".")
        if (len(parts) != 3 or parts[0] != VERSION or not parts[1].isdigit() or int(parts[1]) < 1
                or len(parts[2]) != 16 or not all(c in "0123456789abcdef" for c in parts[2])):
            raise InvalidRequest(f"Last-Event-ID {value[:80]!r} is not a resume token this server wrote",
                                 param="Last-Event-ID", code="invalid_last_event_id")
        return cls(int(parts[1]), parts[2])


class TokenDigest:
    """The running digest of a stream's output tokens."""

    __slots__ = ("count", "_state")

    def __init__(self):
        self.count = 0
        self._state = b""

    def add(self, tokens: list[int]) -> None:
        for t in tokens:
            self._state = hashlib.blake2b(self._state + t.to_bytes(4, "little"), digest_size=8).digest()
            self.count += 1

    def point(self) -> ResumePoint:
        return ResumePoint(self.count, self._state.hex())

    @classmethod
    def of(cls, tokens: list[int]) -> "TokenDigest":
        d = cls()
        d.add(tokens)
        return d


def resumable(kind: str, req) -> bool:
    """Whether a request's stream can be generated again exactly: streamed, one prompt and one choice, greedy
    or seeded, and (chat) no tools, whose call parser keeps state across the stream."""
    if not req.stream or req.n != 1:
        return False
    if kind == "completion" and len(req.prompts()) != 1:
        return False
    if kind == "chat" and req.tool_mode != "none":
        return False
    return req.temperature == 0 or req.seed is not None
