"""Tool calling: OpenAI's `tools` and `tool_choice`, constrained by a grammar rather than parsed afterwards.

The call format is Hermes's (Qwen, NousResearch, many fine-tunes): each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>\\n` and `\\n</tool_call>`, calls one per line. The
grammar (llguidance's Lark with `%json` for each tool's parameter schema) makes every call well formed:
- `required`: one call, or several where `parallel_tool_calls` (the default), to any of the tools;
- a named function: exactly one call to it;
- `auto`: either calls or an answer; the answer is free text that does not start with `<` (a `<` first
  commits to a call), or, with `response_format`, JSON of that format;
- `none`: no grammar, and the tools are left out of the prompt (a model cannot call what it is not shown).

The prompt: a chat template that renders `tools` itself (its source names them) gets them and the messages as
they are. The shipped models' templates (SmolLM2's ChatML, Gemma 3's) do not: for them the tools are described
in the system message (Hermes's wording), an assistant turn's calls are written back in the call format, and
`tool` results become a user turn of `<tool_response>` blocks (consecutive results in one turn, as Gemma's
alternating roles need).

Responses: the generated text's calls become `message.tool_calls` (content null, `finish_reason: "tool_calls"`);
streamed, `ToolCallStream` turns text deltas into OpenAI's `delta.tool_calls` chunks: per call a first chunk with
its index, id, type and name and empty arguments, then the arguments' text in fragments as generated.
Pure Python: no torch, no I/O.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from kvserve.engine.structured.grammar import JSON_OPTIONS
from kvserve.engine.structured.params import InvalidStructuredOutput, StructuredOutputsParams, interoperable_integers

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
SEPARATOR = "\n"
# What the fallback's system message says (Hermes's function-calling prompt).
SYSTEM_TEMPLATE = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>{tools}</tools> For each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object


def call_schema(tools: list[Tool]) -> dict:
    """The JSON schema of one call to any of `tools`: its name, and the arguments its schema allows."""
    branches = [{"type": "object", "properties": {"name": {"const": t.name},
                                                  "arguments": interoperable_integers(t.parameters)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def tool_grammar(tools: list[Tool], choice: str, parallel: bool, answer_schema: dict | None = None,
                 json_answer: bool = False) -> StructuredOutputsParams | None:
    """The constraint for `tool_choice` = choice ("auto", "required", or a tool's name); None for "none".
    `answer_schema` / `json_answer`: under "auto", the answer's response_format (a schema / any JSON object)."""
    if choice == "none" or not tools:
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.name == choice]
        parallel = False
    call = json.dumps({**call_schema(tools), "x-guidance": JSON_OPTIONS})
    calls = 'call (SEP call)*' if parallel else 'call'
    lines = [f"calls: {calls}", 'call: "<tool_call>\\n" call_json "\\n</tool_call>"', f"call_json: %json {call}",
             'SEP: "\\n"']
    if choice == "auto":
        if answer_schema is not None or json_answer:
            answer = json.dumps({**(answer_schema if answer_schema is not None else {"type": "object"}),
                                 "x-guidance": JSON_OPTIONS})
            lines += ["start: calls | answer", f"answer: %json {answer}"]
        else:
            lines += ["start: calls | answer", "answer: TEXT", r"TEXT: /[^<](.|\n)*/"]
    else:
        lines.insert(0, "start: calls")
    return StructuredOutputsParams(grammar="\n".join(lines), source="tools")


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


def render_call(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return OPEN + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + CLOSE


def fallback_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Messages for a template that does not render tools: the tools in the system message, calls and results
    in the call format (see the module docstring)."""
    out: list[dict] = []
    if tools:
        system = SYSTEM_TEMPLATE.format(tools=" ".join(json.dumps(tool_json(t), ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + system})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = SEPARATOR.join(render_call(c["function"]["name"], c["function"]["arguments"])
                                   for c in m["tool_calls"])
            content = (m.get("content") or "")
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
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


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls in a generated text, or None when it is an answer. A call cut short by max_tokens is left out
    (the calls before it stand; the response's finish_reason says "length")."""
    if not text.startswith(OPEN.rstrip("\n")):
        return None
    calls = []
    blocks = text.split(CLOSE)
    for block in blocks[:-1]:  # the last piece: "" after the last call, or a call cut short
        block = block.strip()
        if not block.startswith(OPEN.strip()):
            return None
        try:
            obj = json.loads(block[len(OPEN.strip()):])
            calls.append(ToolCall(new_call_id(), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            return None
    return calls or None


class ToolCallStream:
    """One choice's text deltas -> OpenAI's chat deltas: {"content": ...} for an answer, {"tool_calls": [...]}
    for calls. The grammar fixes each call's text to `<tool_call>\\n{"name": "N", "arguments": A}\\n</tool_call>`,
    so the name is known once its closing quote is out, and A streams as it is generated; A ends where its JSON
    closes (scanned: strings and escapes skipped), before the object's own `}`."""

    NAME_PREFIX = OPEN + '{"name": "'
    ARGS_PREFIX = '", "arguments": '

    def __init__(self):
        self.buffer = ""
        self.mode: str | None = None  # "answer" | "calls", from the first character
        self.calls: list[ToolCall] = []
        self._pos = 0  # in buffer: what has been turned into deltas
        self._state = "open"  # open -> name -> args -> close (per call)
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        if self.mode is None and self.buffer:
            self.mode = "calls" if self.buffer.startswith("<") else "answer"
        if self.mode == "answer":
            out, self._pos = self.buffer[self._pos:], len(self.buffer)
            return [{"content": out}] if out else []
        return self._calls()

    def _calls(self) -> list[dict]:
        deltas = []
        b = self.buffer
        while True:
            if self._state == "open":
                start = self._pos + (0 if not self.calls else len(SEPARATOR))
                if len(b) < start + len(self.NAME_PREFIX):
                    return deltas
                self._name_start = start + len(self.NAME_PREFIX)
                self._state = "name"
            if self._state == "name":
                end = b.find('"', self._name_start)
                if end < 0 or len(b) < end + len(self.ARGS_PREFIX):
                    return deltas
                call = ToolCall(new_call_id(), json.loads('"' + b[self._name_start:end] + '"'), "")
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                self._pos = end + len(self.ARGS_PREFIX)
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
                end = self._pos + len("}" + CLOSE)
                if len(b) < end:
                    return deltas
                self._pos = end
                self._state = "open"
