"""Incremental detokenization for streaming, with stop strings that may span token boundaries.

Each new token decodes only a short window of ids (vLLM's prefix/read offsets), so a step costs O(1) in the output
length. Text is released only when it is final: not while the window ends in an incomplete UTF-8 / byte-fallback
sequence (U+FFFD), not while a run of byte-fallback tokens (`<0xE4>`...) may still continue (SentencePiece's
ByteFallback decodes a run as a whole: one invalid byte turns every byte of the run into U+FFFD), and not while its
tail could still grow into a stop string.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

# Ids of prompt context decoded before the first output token, so a decoder that treats the start of a sequence
# specially (e.g. strips a leading space) sees the output mid-sequence, as it is.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Invariant: "".join(deltas) + flush() == output_text == tokenizer.decode(output ids, skip_special_tokens)
    cut before the first stop string (or just after it with include_stop_str_in_output).
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._byte_ids = frozenset(getattr(tokenizer, "byte_fallback_ids", ()))
        self._skipped_ids = frozenset(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else frozenset()
        context = list(prompt_token_ids)[-_PROMPT_CONTEXT:]
        # The output must start a fresh byte run, as it does when decoded on its own.
        while context and (context[-1] in self._byte_ids or context[-1] in self._skipped_ids):
            context.pop()
        self._in_byte_run = False
        self._ids: list[int] = context  # decode window source: prompt context, then output ids
        self._prefix_offset = 0  # window start: ids[prefix:read] were already turned into text
        self._read_offset = len(context)
        self.token_ids: list[int] = []  # output ids only
        self._text = ""  # all final text decoded so far (may extend past what was emitted)
        self._emitted = 0  # chars of _text released as deltas
        self._stop_scan_from = 0  # where in _text a stop string could still start
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.stopped = False
        self.stop_reason: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """The text released so far (all deltas, plus flush once finished)."""
        return self._text[: self._emitted]

    def add_token(self, token_id: int) -> str:
        """Append one generated id; return the text that became final (possibly "")."""
        if self.stopped or self._finished:
            return ""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        if token_id in self._byte_ids:
            self._in_byte_run = True
        elif token_id not in self._skipped_ids:  # a skipped special token does not end a byte run
            self._in_byte_run = False
        if self._in_byte_run:
            return ""
        new = self._decode_window(final=False)
        if new:
            self._text += new
        return self._release(final=False)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """At finish: release held text (an incomplete byte sequence decodes to U+FFFD, as a full decode would)."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        new = self._decode_window(final=True)
        if new:
            self._text += new
        return self._release(final=True)

    # -- internals -----------------------------------------------------------------------------------------------

    def _decode_window(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # nothing yet, or a multi-byte character is still incomplete
        if not new_text.startswith(prefix_text):
            # A decoder that rewrites earlier text with more context; fall back to the common prefix.
            common = 0
            for a, b in zip(prefix_text, new_text):
                if a != b:
                    break
                common += 1
            prefix_text = prefix_text[:common]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window short: ids before the prefix are never needed again.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def _release(self, final: bool) -> str:
        text = self._text
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                pos, stop = hit
                end = pos + len(stop) if self.include_stop_str_in_output else pos
                self.stopped = True
                self.stop_reason = stop
                self._text = text[:end]
                delta = self._text[self._emitted :]
                self._emitted = len(self._text)
                return delta
            end = len(text) if final else len(text) - self._held_for_stop(text)
        else:
            end = len(text)
        if end <= self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        """Earliest stop string in the new part of the text (a match may start up to max_stop-1 chars back)."""
        text = self._text
        start = self._stop_scan_from
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(s) > len(best[1]))):
                best = (pos, s)
        self._stop_scan_from = max(start, len(text) - self._max_stop + 1)
        return best

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
