"""Tool calling: OpenAI's `tools` and `tool_choice`, constrained by a grammar rather than parsed afterwards.

Calls are written in the model's own format (service/tool_formats.py: Hermes's `<tool_call>` blocks, Mistral's
`[TOOL_CALLS]` list, Llama 3.1's JSON), each call a JSON object of the tool's name and its arguments; everything
here works from the format's description, the same code for every format. The grammar (llguidance's Lark with
`%json` for each tool's parameter schema) makes every call well formed:
- `required`: one call, or several where `parallel_tool_calls` (the default), to any of the tools;
- a named function: exactly one call to it;
- `auto`: either calls or an answer; the answer is free text that does not start as the calls do (`<`, `[` or
  `{`: its first character commits to a call; where calls start with a special token, any text), or, with
  `response_format`, JSON of that format;
- `none`: no grammar, and the tools are left out of the prompt (a model cannot call what it is not shown).

The prompt: a chat template that renders `tools` itself (its source names them) gets them, and the messages with
their calls' arguments as objects (Hugging Face's convention: the templates `tojson` them) and call ids as the
format's templates accept them (Mistral's: 9 letters and digits). The shipped models' templates (SmolLM2's
ChatML, Gemma 3's) do not: for them the tools are described in the system message (Hermes's wording, the
format's example), an assistant turn's calls are written back in the format, and `tool` results become a user
turn of the format's result blocks (consecutive results in one turn, as Gemma's alternating roles need).

Responses: the generated text's calls become `message.tool_calls` (content null, `finish_reason: "tool_calls"`);
streamed, `ToolCallStream` turns text deltas into OpenAI's `delta.tool_calls` chunks: per call a first chunk with
its index, id, type and name and empty arguments, then the arguments' text in fragments as generated. A whole
text is parsed by the same stream, so both read calls alike.
Pure Python: no torch, no I/O.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.engine.structured.grammar import JSON_OPTIONS
from kvserve.engine.structured.params import InvalidStructuredOutput, StructuredOutputsParams, interoperable_integers
from kvserve.service.tool_formats import HERMES, ToolFormat

# What the fallback's system message says (Hermes's function-calling prompt), then the format's instruction.
SYSTEM_TEMPLATE = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>{tools}</tools> {instruction}\n{example}")
_NAME_HEAD = '{"name": "'  # how each call's JSON object starts (the grammar writes the name first)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object


def call_schema(tools: list[Tool], arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call to any of `tools`: its name, and the arguments its schema allows."""
    branches = [{"type": "object", "properties": {"name": {"const": t.name},
                                                  arguments_key: interoperable_integers(t.parameters)},
                 "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def tool_grammar(tools: list[Tool], choice: str, parallel: bool, answer_schema: dict | None = None,
                 json_answer: bool = False, fmt: ToolFormat = HERMES) -> StructuredOutputsParams | None:
    """The constraint for `tool_choice` = choice ("auto", "required", or a tool's name) in format `fmt`; None for
    "none". `answer_schema` / `json_answer`: under "auto", the answer's response_format (a schema / any JSON
    object)."""
    if choice == "none" or not tools:
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.name == choice]
        parallel = False
    call = json.dumps({**call_schema(tools, fmt.arguments_key), "x-guidance": JSON_OPTIONS})
    if fmt.marker_token is not None:  # the tokenizer's special token, by id
        marker = f"<[{fmt.marker_token}]>" + ("?" if fmt.marker_optional else "")
    else:  # written out as text where the calls need it (an optional one would read as an answer's start)
        marker = "" if fmt.marker_optional else _literal(fmt.marker)
    calls = _sequence(marker, _literal(fmt.begin), "call", "(SEP call)*" if parallel else "", _literal(fmt.end))
    lines = [f"calls: {calls}", f"call: {_sequence(_literal(fmt.call_open), 'call_json', _literal(fmt.call_close))}",
             f"call_json: %json {call}", f"SEP: {_literal(fmt.separator)}"]
    if choice == "auto":
        if answer_schema is not None or json_answer:
            answer = json.dumps({**(answer_schema if answer_schema is not None else {"type": "object"}),
                                 "x-guidance": JSON_OPTIONS})
            lines += ["start: calls | answer", f"answer: %json {answer}"]
        else:
            first = _first_character(fmt)
            text = r"/(.|\n)+/" if first is None else "/[^" + _class_escape(first) + r"](.|\n)*/"
            lines += ["start: calls | answer", "answer: TEXT", f"TEXT: {text}"]
    else:
        lines.insert(0, "start: calls")
    return StructuredOutputsParams(grammar="\n".join(lines), source="tools")


def _literal(text: str) -> str:
    """A Lark string literal ("" for none)."""
    return json.dumps(text) if text else ""


def _sequence(*items: str) -> str:
    return " ".join(i for i in items if i)


def _first_character(fmt: ToolFormat) -> str | None:
    """The character the calls' text starts with; None where they start with the marker's special token."""
    if fmt.marker and not fmt.marker_optional:
        return None if fmt.marker_token is not None else fmt.marker[0]
    return (fmt.begin + fmt.call_open + _NAME_HEAD)[0]


def _class_escape(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[/" else ch


def tools_of(request_tools: list) -> list[Tool]:
    """The request's function tools (protocol models), their names unique."""
    out, seen = [], set()
    for t in request_tools:
        f = t.function
        if f.name in seen:
            raise InvalidStructuredOutput(f"tool names must be unique; {f.name!r} appears twice", param="tools")
        seen.add(f.name)
        out.append(Tool(f.name, f.description, f.parameters if f.parameters is not None else
                        {"type": "object", "properties": {}}))
    return out


# ---- the prompt -------------------------------------------------------------------------------------------------

def tool_json(t: Tool) -> dict:
    """A tool as OpenAI's request carries it (what templates that render tools expect)."""
    fn = {"name": t.name, "parameters": t.parameters}
    if t.description:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def arguments_value(arguments: str):
    """A call's arguments (OpenAI's JSON text) as a value: none is {}, text that is not JSON stays text."""
    if not arguments:
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def render_call(name: str, arguments: str, fmt: ToolFormat = HERMES) -> str:
    """One call as the model writes it."""
    return fmt.call_text(json.dumps(name, ensure_ascii=False), json.dumps(arguments_value(arguments),
                                                                          ensure_ascii=False))


def messages_for_template(messages: list[dict], fmt: ToolFormat = HERMES) -> list[dict]:
    """Messages for a template that renders tools (see the module docstring)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": fmt.template_id(c["id"]),
                                      "function": {**c["function"],
                                                   "arguments": arguments_value(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        if m.get("tool_call_id") is not None:
            m = {**m, "tool_call_id": fmt.template_id(m["tool_call_id"])}
        out.append(m)
    return out


def fallback_messages(messages: list[dict], tools: list[Tool], fmt: ToolFormat = HERMES) -> list[dict]:
    """Messages for a template that does not render tools: the tools in the system message, calls and results
    in the call format (see the module docstring)."""
    out: list[dict] = []
    if tools:
        system = SYSTEM_TEMPLATE.format(tools=" ".join(json.dumps(tool_json(t), ensure_ascii=False) for t in tools),
                                        instruction=fmt.instruction, example=fmt.example())
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + system})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.calls_text([render_call(c["function"]["name"], c["function"]["arguments"], fmt)
                                    for c in m["tool_calls"]])
            content = (m.get("content") or "")
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif m["role"] == "tool":
            block = fmt.result_open + (m.get("content") or "") + fmt.result_close
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


# ---- the response ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def finish_reason(called: bool, engine_reason: str | None) -> str | None:
    """OpenAI's finish_reason for a choice: "tool_calls" where its text held calls and it stopped on its own."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


def parse_calls(text: str, fmt: ToolFormat = HERMES) -> list[ToolCall] | None:
    """The calls in a generated text, or None when it is an answer. A call cut short by max_tokens is left out
    (the calls before it stand; the response's finish_reason says "length")."""
    stream = ToolCallStream(fmt)
    stream.feed(text)
    return (stream.calls[:stream.complete] or None) if stream.mode == "calls" else None


_MORE, _NO = -1, -2  # _match: the text ends before it tells; the text is something else


def _match(text: str, pos: int, literal: str, loose: bool = True) -> int:
    """Where `literal` ends in `text` at `pos`, or _MORE / _NO. Loose: whitespace before it, and at its own
    ends, may differ (a format's markers and separators); else exactly (inside a call's JSON)."""
    if loose:
        literal = literal.strip()
        if not literal:
            return pos
        while pos < len(text) and text[pos].isspace():
            pos += 1
    have = text[pos:pos + len(literal)]
    if not literal.startswith(have):
        return _NO
    return pos + len(literal) if len(have) == len(literal) else _MORE


class ToolCallStream:
    """One choice's text deltas -> OpenAI's chat deltas: {"content": ...} for an answer, {"tool_calls": [...]}
    for calls. The grammar fixes each call's text to `call_open {"name": "N", "KEY": A} call_close` (and the
    format's marker, list and separators around them), so the name is known once its closing quote is out, and
    A streams as it is generated; A ends where its JSON closes (scanned: strings and escapes skipped), before the
    object's own `}`. Text that could still start a call is held until it does or cannot (`finish` gives back
    what is held at the end)."""

    def __init__(self, fmt: ToolFormat = HERMES):
        self.fmt = fmt
        self.buffer = ""
        self.mode: str | None = None  # "answer" | "calls", once the text's start tells
        self.calls: list[ToolCall] = []
        self.complete = 0  # of calls, those whose text is whole
        self._pos = 0  # in buffer: what has been turned into deltas (an answer) or read (calls)
        self._state = "head"  # head -> args -> close -> next -> head ... -> done
        self._depth = 0
        self._in_string = self._escaped = False
        self._args_key = f'", "{fmt.arguments_key}": '

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        if self.mode == "answer":
            return self._answer()
        return self._calls()

    def finish(self) -> list[dict]:
        """At the end of the text: what was held as a possible call's start is an answer."""
        if self.mode is None and self.buffer:
            self.mode = "answer"
            return self._answer()
        return []

    def _answer(self) -> list[dict]:
        out, self._pos = self.buffer[self._pos:], len(self.buffer)
        return [{"content": out}] if out else []

    def _head(self, pos: int) -> int:
        """Where a call's head (up to its arguments) ends, or _MORE / _NO: the format's opening for the first call,
        its separator for the next."""
        fmt, b = self.fmt, self.buffer
        if self.calls:
            steps = [fmt.separator]
        else:
            if fmt.marker:
                after = _match(b, pos, fmt.marker)
                if after == _MORE or (after == _NO and not fmt.marker_optional):
                    return after
                pos = pos if after == _NO else after
            steps = [fmt.begin]
        for literal in (*steps, fmt.call_open, _NAME_HEAD):
            pos = _match(b, pos, literal)
            if pos < 0:
                return pos
        return pos

    def _calls(self) -> list[dict]:
        deltas, b = [], self.buffer
        while True:
            if self._state == "head":
                name_start = self._head(self._pos)
                if name_start == _NO:
                    if self.calls:  # no next call (the list's end, or the text's)
                        self._state = "done"
                        return deltas
                    self.mode = "answer"
                    return self._answer()
                if name_start == _MORE:
                    return deltas
                end = b.find('"', name_start)
                if end < 0:
                    return deltas
                after = _match(b, end, self._args_key, loose=False)
                if after == _MORE:
                    return deltas
                if after == _NO:
                    if not self.calls:
                        self.mode = "answer"
                        return self._answer()
                    self._state = "done"
                    return deltas
                self.mode = "calls"
                call = ToolCall(self.fmt.new_call_id(), json.loads(b[name_start - 1:end + 1]), "")
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                self._pos = after
                self._state, self._depth, self._in_string, self._escaped = "args", 0, False, False
            if self._state == "args":
                start, done = self._pos, None
                for i in range(start, len(b)):
                    ch = b[i]
                    if self._in_string:
                        if self._escaped:
                            self._escaped = False
                        elif ch == "\\":
                            self._escaped = True
                        elif ch == '"':
                            self._in_string = False
                    elif ch == '"':
                        self._in_string = True
                    elif ch in "{[":
                        self._depth += 1
                    elif ch in "}]":
                        self._depth -= 1
                        if self._depth == 0:
                            done = i + 1
                            break
                stop = len(b) if done is None else done
                if stop > start:
                    fragment = b[start:stop]
                    index = len(self.calls) - 1
                    last = self.calls[index]
                    self.calls[index] = ToolCall(last.id, last.name, last.arguments + fragment)
                    deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                self._pos = stop
                if done is None:
                    return deltas
                self._state = "close"
            if self._state == "close":
                end = _match(b, self._pos, "}", loose=False)
                if end >= 0:
                    end = _match(b, end, self.fmt.call_close)
                if end == _MORE:
                    return deltas
                if end == _NO:
                    self._state = "done"
                    return deltas
                self._pos, self.complete, self._state = end, len(self.calls), "head"
            if self._state == "done":
                return deltas
