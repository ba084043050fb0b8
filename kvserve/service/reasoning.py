"""Reasoning models: a chat output's `<think>...</think>` block returned apart from the answer, as vLLM's
`reasoning_content` (and its newer name `reasoning`), and the request's thinking budget.

Per model, once (`thinking_format`): whether it thinks, from the `reasoning_parser` setting ("auto": its chat
template writes `<think>` and its tokenizer spells both tags), and the tags' token ids.
Per request (`ThinkingFormat.plan`): where the output starts, read from the rendered prompt's end:
- inside the block, where the template opened it (Qwen3 thinking models, the R1 distills: the output has only
  `</think>`);
- after it, where the template closed an empty one (Qwen3 with `enable_thinking: false`): all answer;
- otherwise before it: the model may open one (text before it is answer). A request with an output constraint
  starts inside instead (the open tag is added to its prompt, as those templates do), since its constraint
  begins only where the block closes: budget 0 there means no block at all.
The budget is `thinking_token_budget`, else `reasoning_effort`'s (REASONING_EFFORT_BUDGETS); the engine enforces
it (engine/reasoning.py). `ReasoningParser` splits the text, whole or as streamed deltas.
Pure Python: no torch, no I/O.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.engine.reasoning import Phase, ThinkingControl, count_reasoning_tokens

log = logging.getLogger(__name__)

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
# What the templates write around the tags: "<think>\n" opens a block, "</think>\n\n" ends one.
AFTER_OPEN, AFTER_CLOSE = "\n", "\n\n"
# OpenAI's reasoning_effort as thinking budgets (None: no limit); an explicit thinking_token_budget wins.
REASONING_EFFORT_BUDGETS: dict[str, int | None] = {"low": 256, "medium": 1024, "high": None}
# Prompt tokens read back to see whether the template left the output inside or after a block.
_PROMPT_TAIL_TOKENS = 16


def budget_of(thinking_token_budget: int | None, reasoning_effort: str | None) -> int | None:
    """A request's budget: its own, else its effort's, else none."""
    if thinking_token_budget is not None:
        return thinking_token_budget
    return REASONING_EFFORT_BUDGETS[reasoning_effort] if reasoning_effort is not None else None


@dataclass(frozen=True)
class ThinkingFormat:
    """A thinking model's tags, as text and as its tokenizer encodes them."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    after_open_ids: tuple[int, ...]
    after_close_ids: tuple[int, ...]
    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG

    def plan(self, tokenizer, prompt_ids: list[int], budget: int | None,
             constrained: bool) -> tuple[list[int], ThinkingControl]:
        """The prompt to submit (the open tag added where a constraint needs the block opened) and the engine's
        control of the output's block (see the module docstring)."""
        tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:]).rstrip()
        if tail.endswith(self.open_tag):
            start = Phase.THINKING
        elif tail.endswith(self.close_tag) or (constrained and budget == 0):
            start = Phase.ANSWER
        elif constrained:
            prompt_ids, start = [*prompt_ids, *self.open_ids, *self.after_open_ids], Phase.THINKING
        else:
            start = Phase.BEFORE
        return prompt_ids, ThinkingControl(self.open_ids, self.close_ids, self.after_close_ids, budget, start)

    def parser(self, control: ThinkingControl) -> "ReasoningParser":
        return ReasoningParser(self.open_tag, self.close_tag, control.start)


def thinking_format(tokenizer, setting: str) -> ThinkingFormat | None:
    """Whether a model thinks (`setting`: ServedModel.reasoning_parser), and its tags; None: its output is all
    answer. A tokenizer that cannot spell both tags (encoded, then decoded) has none."""
    if setting == "none" or (setting == "auto" and OPEN_TAG not in (tokenizer.chat_template or "")):
        return None
    ids = {text: tuple(tokenizer.encode(text, add_special_tokens=False))
           for text in (OPEN_TAG, CLOSE_TAG, AFTER_OPEN, AFTER_CLOSE)}
    for tag in (OPEN_TAG, CLOSE_TAG):
        if not ids[tag] or tokenizer.decode(list(ids[tag])) != tag:
            log.warning("%s: the tokenizer cannot spell %s, so the model's output is not parsed for reasoning",
                        getattr(tokenizer, "name", "a model"), tag)
            return None
    return ThinkingFormat(ids[OPEN_TAG], ids[CLOSE_TAG], ids[AFTER_OPEN], ids[AFTER_CLOSE])


def reasoning_tokens(control: ThinkingControl | None, token_ids: list[int]) -> int:
    """usage.completion_tokens_details.reasoning_tokens of one output (0 without a thinking block)."""
    return 0 if control is None else count_reasoning_tokens(control, token_ids)


class ReasoningParser:
    """One choice's text split into reasoning and content, fed whole or in deltas alike: a tag split across
    deltas is held until it is whole or cannot be one. As Qwen3's template reads a turn back, the reasoning is
    the block's text without its leading and trailing newlines, and content starts at its first character that
    is not a newline (at the output's start and after the block). Only the first block is reasoning."""

    def __init__(self, open_tag: str, close_tag: str, start: Phase):
        self.open_tag, self.close_tag = open_tag, close_tag
        self.phase = Phase(start)
        self.opened = self.phase is Phase.THINKING  # a block was (or is) there
        self._held = ""  # text not given out yet: a possible tag's start, or newlines that may be dropped
        self._reasoning_started = False
        self._content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds."""
        reasoning, content = [], []
        buf, self._held = self._held + text, ""
        while buf:
            if self.phase is Phase.ANSWER:
                content.append(self._content(buf))
                break
            tag = self.open_tag if self.phase is Phase.BEFORE else self.close_tag
            at = buf.find(tag)
            if at < 0:
                cut = len(buf) - _partial_tag(buf, tag)
                body, self._held = buf[:cut], buf[cut:]
                if self.phase is Phase.BEFORE:
                    content.append(self._content(body))
                else:  # trailing newlines wait: they are dropped if the close tag follows them
                    kept = body.rstrip("\n")
                    reasoning.append(self._reasoning(kept))
                    self._held = body[len(kept):] + self._held
                break
            if self.phase is Phase.BEFORE:
                content.append(self._content(buf[:at]))
                self.phase, self.opened = Phase.THINKING, True
            else:
                reasoning.append(self._reasoning(buf[:at].rstrip("\n")))
                self.phase, self._content_started = Phase.ANSWER, False
            buf = buf[at + len(tag):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What the end of the text leaves: a held partial tag is text after all (trailing newlines of an
        unclosed block are dropped)."""
        held, self._held = self._held, ""
        if self.phase is Phase.THINKING:
            return self._reasoning(held.rstrip("\n")), ""
        return "", self._content(held)

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """A whole output: (its reasoning, None where it has none; its content)."""
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2) or None, c1 + c2
