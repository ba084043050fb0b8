"""Reasoning models, the pure parts: the text split into reasoning and content (whole, and streamed in deltas cut
at every character), the engine's tracker of a thinking block (budget, forced close, counts, drafts), whether a
model thinks and where a request's output starts, and the request fields."""
from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from kvserve.engine.errors import InvalidRequest
from kvserve.engine.reasoning import Phase, ThinkingControl, ThinkingTracker, count_reasoning_tokens
from kvserve.engine.request import EngineRequest, Sequence
from kvserve.service import protocol as p
from kvserve.service.reasoning import (REASONING_EFFORT_BUDGETS, ReasoningParser, split_reasoning,
                                       thinking_format)
from tests.conftest import THINK_TEMPLATE

B, T, A = Phase.BEFORE, Phase.THINKING, Phase.ANSWER

# (where the output starts, its text) -> (reasoning, content)
CASES = [
    (T, "Let me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),  # the template opened the block
    (T, "\nstep 1\n\nstep 2\n\n</think>\n\nanswer\n", ("step 1\n\nstep 2", "answer\n")),
    (T, "all thinking, cut by max_tokens\n\n", ("all thinking, cut by max_tokens", None)),  # never closed
    (T, "ends inside a tag </thi", ("ends inside a tag </thi", None)),
    (T, "</think>\n\nno thoughts", (None, "no thoughts")),  # a budget of 0
    (T, "a < b and </ b > c </think>x", ("a < b and </ b > c ", "x")),  # only newlines are trimmed
    (B, "<think>\nhmm\n</think>\n\nHi!", ("hmm", "Hi!")),  # the model opened it
    (B, "\n\n<think>\nhmm\n</think>\n\nHi!", ("hmm", "Hi!")),
    (B, "Sure. <think>why</think>\n\nDone.", ("why", "Sure. Done.")),  # text before the open tag is content
    (B, "no block at all, a < b", (None, "no block at all, a < b")),
    (B, "cut inside the tag <thi", (None, "cut inside the tag <thi")),
    (B, "<think>a</think>b<think>c</think>d", ("a", "b<think>c</think>d")),  # only the first block
    (A, "<think>not a block here</think>", (None, "<think>not a block here</think>")),
    (A, "\n\n{\"a\": 1}", (None, "{\"a\": 1}")),
]


def parser(start: Phase) -> ReasoningParser:
    return ReasoningParser("<think>", "</think>", start)


@pytest.mark.parametrize("start,text,expected", CASES)
def test_a_whole_text_splits_into_reasoning_and_content(start, text, expected):
    reasoning, content = split_reasoning(parser(start), text)
    assert (reasoning, content or None) == expected


@pytest.mark.parametrize("start,text,expected", CASES)
def test_deltas_cut_anywhere_add_up_to_the_whole_split(start, text, expected):
    """Two deltas cut at every position, and one character at a time: a tag split across deltas is held."""
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for deltas in cuts:
        p_ = parser(start)
        reasoning = content = ""
        for d in deltas:
            r, c = p_.feed(d)
            reasoning, content = reasoning + r, content + c
        r, c = p_.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == expected, deltas


# ---- the engine's tracker -----------------------------------------------------------------------------------

OPEN, CLOSE, SEP = (44, 17400, 46), (9617, 17400, 46), (1116,)


def control(budget=None, start=T) -> ThinkingControl:
    return ThinkingControl(OPEN, CLOSE, SEP, budget, start)


def run(tracker: ThinkingTracker, sampled: list[int], steps: int) -> list[int]:
    """What the engine's sequence takes over `steps` tokens: the forced token where there is one, else the next
    of `sampled`."""
    out, it = [], iter(sampled)
    for _ in range(steps):
        token = tracker.forced_token
        token = next(it) if token is None else token
        tracker.advance(token)
        out.append(token)
    return out


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_spent_budget_forces_the_close_tag_then_the_separator(budget):
    t = ThinkingTracker(control(budget))
    out = run(t, list(range(1000, 1100)), budget + len(CLOSE) + len(SEP) + 3)
    assert out[:budget] == list(range(1000, 1000 + budget))
    assert tuple(out[budget:budget + len(CLOSE) + len(SEP)]) == CLOSE + SEP
    assert t.answering and t.forced_token is None and t.thought == budget
    assert t.reasoning_tokens == budget + len(CLOSE) == count_reasoning_tokens(control(budget), out)


def test_a_block_closed_by_the_model_within_its_budget_is_not_forced():
    t = ThinkingTracker(control(10))
    out = run(t, [5, 6, *CLOSE, 7, 8], 7)
    assert out == [5, 6, *CLOSE, 7, 8] and t.answering and t.reasoning_tokens == 2 + len(CLOSE)


def test_a_block_the_output_opens_counts_from_its_open_tag():
    c = control(2, start=B)
    t = ThinkingTracker(c)
    out = run(t, [1, 2, *OPEN, 3, 4, 5, 6], 2 + len(OPEN) + 2 + len(CLOSE) + len(SEP) + 1)
    assert out == [1, 2, *OPEN, 3, 4, *CLOSE, *SEP, 5]
    assert t.reasoning_tokens == len(OPEN) + 2 + len(CLOSE) == count_reasoning_tokens(c, out)


def test_no_budget_thinks_until_the_model_stops_and_an_answer_start_never_thinks():
    t = ThinkingTracker(control(None))
    run(t, list(range(100, 400)), 300)
    assert t.phase is T and t.forced_token is None and t.reasoning_tokens == 300
    a = ThinkingTracker(control(0, start=A))
    assert a.answering and run(a, [*OPEN, 1], 4) == [*OPEN, 1] and a.reasoning_tokens == 0


def test_drafts_stop_where_the_block_would_move():
    t = ThinkingTracker(control(4))
    assert t.draftable([1, 2, 3, 4, 5]) == 3  # the 4th token spends the budget: the next row is forced
    assert t.draftable([1, *CLOSE, 9]) == 3  # the close tag's last token ends the block
    run(t, [1, 2, 3, 4], 4)
    assert t.forced_token == CLOSE[0] and t.draftable([CLOSE[0]]) == 0
    assert ThinkingTracker(control(None, start=B)).draftable([7, *OPEN, 8]) == 3


def test_a_constraint_waits_for_the_block_to_close():
    """The sequence's matcher takes only the tokens after the close tag and its separator."""

    class Matcher:
        def __init__(self):
            self.taken = []

        def consume_token(self, token):
            self.taken.append(token)
            return True

    class Compiled:
        def __init__(self):
            self.m = Matcher()

        def matcher(self):
            return self.m

        def numbers(self):
            return None

    compiled = Compiled()
    req = EngineRequest("r", [1, 2], thinking=control(1), grammar=compiled)
    seq = Sequence.of(req, 0, max_tokens=16)
    assert seq.grammar is None and seq.forced_token is None
    for token in [50, *CLOSE, *SEP]:
        assert seq.grammar is None
        seq.append_token(seq.forced_token if seq.forced_token is not None else token)
    seq.append_token(60)
    assert seq.grammar is compiled.m and compiled.m.taken == [60]
    # a resumed sequence replays its tokens through the block and the constraint alike
    again = Sequence.of(EngineRequest("r2", [1, 2], thinking=control(1), grammar=Compiled(),
                                      resumed_token_ids=seq.output_token_ids), 1, max_tokens=16)
    assert again.grammar.taken == [60] and again.thinking.reasoning_tokens == 1 + len(CLOSE)


def test_bad_controls_are_refused():
    with pytest.raises(InvalidRequest):
        ThinkingControl((), CLOSE)
    with pytest.raises(InvalidRequest):
        ThinkingControl(OPEN, CLOSE, budget=-1)
    with pytest.raises(TypeError):
        EngineRequest("r", [1], thinking={"budget": 3})


# ---- the model's tags and the request's start -------------------------------------------------------------------

@pytest.fixture
def think_tokenizer(smollm2_tokenizer):
    tok = copy.copy(smollm2_tokenizer)
    tok.chat_template = THINK_TEMPLATE
    return tok


def test_a_model_thinks_where_its_template_writes_think_or_it_is_set_to(smollm2_tokenizer, think_tokenizer):
    assert thinking_format(smollm2_tokenizer, "auto") is None  # SmolLM2's ChatML
    assert thinking_format(think_tokenizer, "none") is None
    fmt = thinking_format(think_tokenizer, "auto")
    assert fmt == thinking_format(smollm2_tokenizer, "think")
    assert think_tokenizer.decode(list(fmt.open_ids)) == "<think>"
    assert think_tokenizer.decode(list(fmt.close_ids + fmt.after_close_ids)) == "</think>\n\n"


@pytest.mark.parametrize("generation,constrained,budget,start,added", [
    ("<think>\n", False, None, T, ""),  # the template opened it
    ("<think>\n\n</think>\n\n", False, None, A, ""),  # it closed an empty one (enable_thinking: false)
    ("", False, 3, B, ""),  # left to the model
    ("", True, 3, T, "<think>\n"),  # a constraint: the block is opened for it
    ("", True, 0, A, ""),  # ... unless the budget is 0: no block
    ("<think>\n\n</think>\n\n", True, None, A, ""),
])
def test_where_an_output_starts(think_tokenizer, generation, constrained, budget, start, added):
    fmt = thinking_format(think_tokenizer, "auto")
    ids = think_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + generation,
                                 add_special_tokens=False)
    planned, c = fmt.plan(think_tokenizer, ids, budget, constrained)
    assert c.start is start and c.budget == budget
    assert planned[:len(ids)] == ids and think_tokenizer.decode(planned[len(ids):]) == added
    assert c.close_ids == fmt.close_ids and c.separator_ids == fmt.after_close_ids


def test_the_request_fields():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert p.ChatCompletionRequest(**base).thinking_budget is None
    for effort, budget in REASONING_EFFORT_BUDGETS.items():
        assert p.ChatCompletionRequest(**base, reasoning_effort=effort).thinking_budget == budget
    assert p.ChatCompletionRequest(**base, reasoning_effort="high", thinking_token_budget=7).thinking_budget == 7
    assert p.ChatCompletionRequest(**base, chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs
    for bad in ({"reasoning_effort": "extreme"}, {"thinking_token_budget": -1}, {"thinking_token_budget": "5"},
                {"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": ["enable_thinking"]}):
        with pytest.raises(ValidationError):
            p.ChatCompletionRequest(**base, **bad)
