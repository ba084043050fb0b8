"""OpenAI's response objects built from a completion's RequestOutputs: the whole body (a JSON response,
or a batch's output line) and the chunks of a stream (a transport frames them, as SSE over HTTP). A chat on a
thinking model has its text split first (service/reasoning.py): the reasoning goes to `reasoning_content` and
`reasoning`, the content to `content` or, with tools, to the calls."""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from kvserve.engine.outputs import Logprob, RequestOutput
from kvserve.service import protocol as p
from kvserve.service.reasoning import ReasoningParser, reasoning_tokens, split_reasoning
from kvserve.service.tool_formats import HERMES
from kvserve.service.tools import ToolCallStream, parse_calls, finish_reason as tool_finish_reason

if TYPE_CHECKING:
    from kvserve.service.completion import Completion


class TokenText:
    """Decoded text of single token ids (what OpenAI shows as a logprob's `token`)."""

    def __init__(self, tokenizer):
        self._decode = lru_cache(maxsize=65536)(lambda tid: tokenizer.decode([tid]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def chat_logprobs(entries: list[Logprob] | None, text: TokenText) -> p.ChatLogprobs | None:
    if entries is None:
        return None

    def item(tid: int, lp: float) -> dict:
        t = text(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return p.ChatLogprobs(content=[p.ChatTokenLogprob(**item(e.token_id, e.logprob),
                                                      top_logprobs=[p.TopLogprob(**item(tid, lp))
                                                                    for tid, _, lp in e.top])
                                   for e in entries])


def completion_logprobs(entries: list[Logprob] | None, text: TokenText,
                        offset: int) -> tuple[p.CompletionLogprobs | None, int]:
    if entries is None:
        return None, offset
    out = p.CompletionLogprobs()
    for e in entries:
        t = text(e.token_id)
        out.tokens.append(t)
        out.token_logprobs.append(e.logprob)
        top: dict[str, float] = {}
        for tid, _, lp in e.top:
            top.setdefault(text(tid), lp)
        out.top_logprobs.append(top or None)
        out.text_offset.append(offset)
        offset += len(t)
    return out, offset


def usage_of(c: "Completion", finals: dict[int, RequestOutput]) -> p.Usage:
    """The usage of the finished prompts (prompt index -> its final output)."""
    u = p.Usage()
    for i, out in sorted(finals.items()):
        control = c.thinking[i] if c.thinking else None
        u.add(out.num_prompt_tokens, out.num_completion_tokens, min(out.num_cached_tokens, out.num_prompt_tokens),
              out.num_tier_cached_tokens - out.num_host_cached_tokens, out.num_host_cached_tokens,
              sum(reasoning_tokens(control, o.token_ids) for o in out.outputs))
    return u


def parser_of(c: "Completion", i: int) -> ReasoningParser | None:
    """A new parser of prompt i's outputs, where the call is a chat on a thinking model."""
    return c.reasoning.parser(c.thinking[i]) if c.reasoning is not None and c.thinking else None


def chat_message(c: "Completion", i: int, text: str) -> tuple[p.ChatMessageOut, bool]:
    """One choice's message, and whether it holds tool calls."""
    parser = parser_of(c, i)
    reasoning, content = split_reasoning(parser, text) if parser is not None else (None, text)
    calls = parse_calls(content, c.tool_format or HERMES) if c.req.tool_mode != "none" else None
    if calls:
        message = p.ChatMessageOut(content=None, tool_calls=[x.as_openai() for x in calls])
    else:
        message = p.ChatMessageOut(content=None if reasoning and not content else content)
    message.reasoning_content = message.reasoning = reasoning
    return message, bool(calls)


def full_response(c: "Completion", finals: list[RequestOutput]) -> p.ChatCompletionResponse | p.CompletionResponse:
    """The non-streamed body: one choice per (prompt, fork), index = prompt * n + fork."""
    n, text, usage = c.n, c.text, usage_of(c, dict(enumerate(finals)))
    if c.kind == "chat":
        choices = []
        for i, out in enumerate(finals):
            for o in sorted(out.outputs, key=lambda o: o.index):
                message, called = chat_message(c, i, o.text)
                finish = tool_finish_reason(called, o.finish_reason)
                choices.append(p.ChatChoice(index=i * n + o.index, message=message,
                                            logprobs=chat_logprobs(o.logprobs, text),
                                            finish_reason=finish, stop_reason=o.stop_reason))
        return p.ChatCompletionResponse(id=c.response_id, created=c.created, model=c.model, choices=choices,
                                        usage=usage)
    choices = []
    for i, out in enumerate(finals):
        for o in sorted(out.outputs, key=lambda o: o.index):
            lp, _ = completion_logprobs(o.logprobs, text, 0)
            choices.append(p.CompletionChoice(index=i * n + o.index, text=o.text, logprobs=lp,
                                              finish_reason=o.finish_reason, stop_reason=o.stop_reason))
    return p.CompletionResponse(id=c.response_id, created=c.created, model=c.model, choices=choices, usage=usage)


class StreamChunks:
    """The chunk objects of one streamed completion, in order: for chat, an opening role chunk per
    choice (`opening`); per RequestOutput its deltas and finish reasons (`of`); then, when asked, the
    usage chunk (`closing`)."""

    def __init__(self, c: "Completion"):
        self.c = c
        self.chat = c.kind == "chat"
        self.base = {"id": c.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": c.created, "model": c.model}
        if c.req.include_usage:
            self.base["usage"] = None
        self._finished: set[int] = set()
        self._offsets: dict[int, int] = {}
        # Per choice with tools: its text deltas turned into content or tool_calls deltas
        self._tools: dict[int, ToolCallStream] | None = {} if self.chat and c.req.tool_mode != "none" else None
        # Per choice of a chat on a thinking model: its text deltas split into reasoning and content
        self._parsers: dict[int, ReasoningParser] = {}
        if c.resumed_token_ids and self.chat and (parser := parser_of(c, 0)) is not None:
            # a resumed stream: the text its client already has sets where the split stands
            parser.feed(c.handle.client.tokenizer.decode(c.resumed_token_ids,
                                                         skip_special_tokens=c.req.skip_special_tokens))
            self._parsers[0] = parser
        self._finals: dict[int, RequestOutput] = {}

    def _chunk(self, choice: dict) -> dict:
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._chunk({"index": i * self.c.n + k, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for i in range(self.c.num_prompts) for k in range(self.c.n)]

    def of(self, i: int, out: RequestOutput) -> list[dict]:
        """Chunks for prompt i's latest output."""
        c, evs = self.c, []
        for o in out.outputs:
            idx = i * c.n + o.index
            if idx in self._finished:
                continue
            has_delta = bool(o.delta_text) or bool(o.delta_logprobs)
            if self.chat:
                parser = self._parsers.get(idx)
                if parser is None and c.reasoning is not None:
                    parser = self._parsers[idx] = parser_of(c, i)
                if has_delta:
                    lp = chat_logprobs(o.delta_logprobs, c.text) if o.delta_logprobs else None
                    lp = lp.model_dump(mode="json") if lp else None
                    split = parser.feed(o.delta_text) if parser is not None else ("", o.delta_text)
                    deltas = self._deltas(idx, *split) or ([{"content": ""}] if lp else [])
                    for j, delta in enumerate(deltas):
                        evs.append(self._chunk({"index": idx, "delta": delta, "logprobs": lp if j == 0 else None,
                                                "finish_reason": None}))
                if o.finish_reason is not None:
                    # what the parsers held: a partial tag, or the start of what was not a call, is text after all
                    held = self._deltas(idx, *parser.finish()) if parser is not None else []
                    if self._tools is not None and idx in self._tools:
                        held += self._tools[idx].finish()
                    evs += [self._chunk({"index": idx, "delta": delta, "logprobs": None, "finish_reason": None})
                            for delta in held]
                    self._finished.add(idx)
                    calls = self._tools is not None and idx in self._tools and self._tools[idx].calls
                    finish = tool_finish_reason(bool(calls), o.finish_reason)
                    evs.append(self._chunk({"index": idx, "delta": {}, "logprobs": None,
                                            "finish_reason": finish, "stop_reason": o.stop_reason}))
            elif has_delta or o.finish_reason is not None:
                lp, self._offsets[idx] = completion_logprobs(o.delta_logprobs, c.text, self._offsets.get(idx, 0)) \
                    if o.delta_logprobs else (None, self._offsets.get(idx, 0))
                if o.finish_reason is not None:
                    self._finished.add(idx)
                evs.append(self._chunk({"index": idx, "text": o.delta_text,
                                        "logprobs": lp.model_dump(mode="json") if lp else None,
                                        "finish_reason": o.finish_reason,
                                        "stop_reason": o.stop_reason if o.finish_reason else None}))
        if out.finished:
            self._finals[i] = out
        return evs

    def _deltas(self, idx: int, reasoning: str, content: str) -> list[dict]:
        """A choice's chat deltas for text split into reasoning and content (content through its tool-call
        stream where the request has tools)."""
        deltas = [{"reasoning_content": reasoning, "reasoning": reasoning}] if reasoning else []
        if not content:
            return deltas
        if self._tools is None:
            return deltas + [{"content": content}]
        if idx not in self._tools:
            self._tools[idx] = ToolCallStream(self.c.tool_format or HERMES)
        return deltas + self._tools[idx].feed(content)

    def closing(self) -> list[dict]:
        if not self.c.req.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": usage_of(self.c, self._finals).model_dump(mode="json")}]
