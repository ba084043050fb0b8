"""A thinking block in a sequence's output (`<think>...</think>`, as Qwen3 and the DeepSeek-R1 distills write it),
followed token by token: where the block is, the thinking budget, and when a structured-output constraint begins.

The service decides whether a model thinks (once per model) and how a request may (`ThinkingControl`: the tags'
token ids, the budget, where the output starts); the engine enforces it. `ThinkingTracker` lives on each
sequence: once the sequence has generated `budget` tokens inside the block, it names the tokens the engine must
write next (the closing tag, then the separator the chat template writes after it), and the runner masks the row
to that one token instead of sampling freely. A constraint's matcher starts only when the tracker is answering,
so the grammar never sees the thinking text. Why a matcher that waits rather than a grammar whose first rule is
a free-text block: the thinking then costs no mask (a mask is a pass over the vocabulary per token), the compiled
grammar stays the request's own (one cache entry whether the model thinks or not; the JSON number scanner and the
draft checks see the answer alone), and the forced close needs nothing from the grammar.

Token ids, not text: a model with the tags as single tokens (Qwen3, DeepSeek-R1) is followed exactly; a model
that spells them as text is followed where it writes the tags as the tokenizer encodes them. Only the first block
counts (a later `<think>` is answer text). Pure Python: no torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.errors import InvalidRequest


class Phase(str, enum.Enum):
    """Where a sequence's next token is, relative to its thinking block."""

    BEFORE = "before"  # no block yet: the model may open one (its text until then is answer)
    THINKING = "thinking"  # inside the block (the prompt opened it, or the output did)
    ANSWER = "answer"  # the block closed, or none may open


@dataclass(frozen=True)
class ThinkingControl:
    """What a request asks of the engine about thinking: the tags' ids in the model's vocabulary, the separator
    written after a forced close (as the template writes `</think>\\n\\n`), the budget (thinking tokens at most,
    None: no limit; 0: close at once) and the phase the output starts in."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    separator_ids: tuple[int, ...] = ()
    budget: int | None = None
    start: Phase = Phase.BEFORE

    def __post_init__(self) -> None:
        for name in ("open_ids", "close_ids", "separator_ids"):
            ids = tuple(getattr(self, name))
            object.__setattr__(self, name, ids)
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise InvalidRequest(f"thinking {name} must be token ids")
        if not self.open_ids or not self.close_ids:
            raise InvalidRequest("a thinking block needs its open and close tags' token ids")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 0):
            raise InvalidRequest(f"thinking_token_budget must be a non-negative integer, got {self.budget!r}",
                                 param="thinking_token_budget")
        object.__setattr__(self, "start", Phase(self.start))


class ThinkingTracker:
    """One sequence's way through its thinking block, advanced by every token it takes (generated, forced or
    resumed). `reasoning_tokens` counts the block's tokens: an open tag the output wrote, the thinking and the
    close tag (vLLM counts the close tag as reasoning); text before the block and after the close is answer."""

    __slots__ = ("control", "phase", "thought", "reasoning_tokens", "_forced", "_tail")

    def __init__(self, control: ThinkingControl):
        self.control = control
        self.phase = control.start
        self.thought = 0  # tokens taken inside the block: what the budget counts
        self.reasoning_tokens = 0
        self._forced: tuple[int, ...] = ()  # the tokens the engine writes next, in order
        self._tail: tuple[int, ...] = ()  # the latest tokens, to find a tag written over several
        self._spend()

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take (the budget is spent), or None: sampled as usual."""
        return self._forced[0] if self._forced else None

    @property
    def answering(self) -> bool:
        """The block is behind (or never comes) and nothing is forced: a constraint applies from here."""
        return self.phase is Phase.ANSWER and not self._forced

    def advance(self, token: int) -> None:
        forced = bool(self._forced) and token == self._forced[0]
        self._forced = self._forced[1:] if forced else ()
        if self.phase is Phase.ANSWER:
            return
        c = self.control
        self._tail = (self._tail + (token,))[-max(len(c.open_ids), len(c.close_ids)):]
        if self.phase is Phase.BEFORE:
            if self._tail[-len(c.open_ids):] == c.open_ids:
                self.phase, self._tail = Phase.THINKING, ()
                self.reasoning_tokens += len(c.open_ids)
                self._spend()
            return
        self.reasoning_tokens += 1
        if self._tail[-len(c.close_ids):] == c.close_ids:
            self.phase = Phase.ANSWER
            return
        if not forced:
            self.thought += 1
        self._spend()

    def _spend(self) -> None:
        """Inside the block with the budget spent: the close tag and the separator are what comes next."""
        budget = self.control.budget
        if self.phase is Phase.THINKING and budget is not None and self.thought >= budget and not self._forced:
            self._forced = self.control.close_ids + self.control.separator_ids

    def copy(self) -> "ThinkingTracker":
        other = ThinkingTracker.__new__(ThinkingTracker)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        return other

    def draftable(self, draft: tuple[int, ...] | list[int]) -> int:
        """How many of `draft`'s leading tokens may be verified at once: those after which the next token is
        still sampled as now (unforced, in the same phase). A draft row is sampled in its sequence's state before
        the step, so a draft that reaches the budget, opens or closes the block stops there."""
        if self._forced:
            return 0
        probe = self.copy()
        for i, token in enumerate(draft):
            probe.advance(token)
            if probe.phase is not self.phase or probe._forced:
                return i
        return len(draft)


def count_reasoning_tokens(control: ThinkingControl, token_ids: list[int] | tuple[int, ...]) -> int:
    """The reasoning tokens of an output (the same count the engine's tracker makes as it goes)."""
    tracker = ThinkingTracker(control)
    for token in token_ids:
        tracker.advance(token)
    return tracker.reasoning_tokens
