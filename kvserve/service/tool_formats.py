"""Tool-call formats: how each model family writes its calls, as data, and which one a model uses.

A `ToolFormat` describes a family's calls: an optional marker before them, text around the list and around each
call, the separator between calls, and the key of the arguments in each call's JSON object. service/tools.py
builds everything from it (the grammar, the prompt fallback, the parser and the stream), one code path for all:
- hermes (Qwen2.5, Qwen3, NousResearch; the default): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one call per line;
- mistral (Mistral v0.3, Ministral, Mistral-Small; vLLM's `mistral` parser): `[TOOL_CALLS] [` then the calls,
  `, `-separated, and `]`; call ids are 9 letters and digits (its templates refuse any other);
- llama3_json (Llama 3.1 / 3.2; vLLM's `llama3_json` parser): `{"name": ..., "parameters": {...}}`, parallel calls
  `; `-separated, maybe after `<|python_tag|>`.

A model's format is decided once (`tool_format`): its `tool_call_parser` setting, or under "auto" the markers its
chat template writes (`detect_format`). A marker that the model's tokenizer has as one special token (Mistral's
`[TOOL_CALLS]`, Llama's `<|python_tag|>`) is generated as that token, as the model was trained to; where the marker
is what tells calls from an answer (Mistral), the output keeps special tokens in its text, as vLLM's mistral parser
has it.
Pure Python: no torch, no I/O.
"""
from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, replace

# Llama 3.1's JSON convention, as its template spells "parameters" (in single or double quotes).
_LLAMA_SIGNS = ("<|python_tag|>", "Environment: ipython", '"parameters"', '\\"parameters\\"')
_ALNUM = re.compile(r"[A-Za-z0-9]")


@dataclass(frozen=True)
class ToolFormat:
    """One family's call format (see the module docstring). A call is `call_open + {"name": N, KEY: A} +
    call_close`; the calls are `marker + begin + call (separator call)* + end`."""

    name: str
    instruction: str  # the fallback's system prompt: how to call, before the example (`example()`)
    arguments_key: str = "arguments"
    marker: str = ""
    # The calls may go without the marker; then it is generated only where the tokenizer has it as a special token
    # (written out as text it would be an answer's start).
    marker_optional: bool = False
    begin: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = "\n"
    end: str = ""
    call_id_chars: int = 0  # 0: OpenAI's ids ("call_" and 24 hex digits); n: n letters and digits
    # A tool result in the fallback prompt: result_open + its content + result_close
    result_open: str = ""
    result_close: str = ""
    marker_token: int | None = None  # the marker as the model's special token (set per model by `tool_format`)

    def __post_init__(self):
        if self.marker_optional and not self.marker:
            raise ValueError("an optional marker needs a marker")

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output's text must keep special tokens: the marker is one, and only it tells calls from an
        answer."""
        return self.marker_token is not None and not self.marker_optional

    def call_text(self, name_json: str, arguments_json: str) -> str:
        """One call, from its name's and its arguments' JSON text (json.dumps's spacing, as the grammar has it)."""
        return f'{self.call_open}{{"name": {name_json}, "{self.arguments_key}": {arguments_json}}}{self.call_close}'

    def calls_text(self, calls: list[str]) -> str:
        """Calls (each `call_text`) as the model writes them (an optional marker left out)."""
        marker = "" if self.marker_optional else self.marker
        return marker + self.begin + self.separator.join(calls) + self.end

    def example(self) -> str:
        return self.calls_text([self.call_text("<function-name>", "<args-dict>")])

    def new_call_id(self) -> str:
        if not self.call_id_chars:
            return "call_" + uuid.uuid4().hex[:24]
        return uuid.uuid4().hex[:self.call_id_chars]

    def template_id(self, call_id: str) -> str:
        """A client's call id as the model's template accepts it: as it is, or (short ids) its last letters and
        digits, or a digest where it has too few; the same id always gives the same, so a call and its result
        still match."""
        n = self.call_id_chars
        if not n:
            return call_id
        kept = "".join(_ALNUM.findall(call_id))
        return kept[-n:] if len(kept) >= n else hashlib.sha256(call_id.encode()).hexdigest()[:n]


HERMES = ToolFormat(
    "hermes", call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n",
    instruction="For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags as follows:",
    result_open="<tool_response>\n", result_close="\n</tool_response>")
MISTRAL = ToolFormat(
    "mistral", marker="[TOOL_CALLS]", begin=" [", separator=", ", end="]", call_id_chars=9,
    instruction="To call functions, write [TOOL_CALLS] and a json list of objects with function name and "
                "arguments as follows:",
    result_open='[TOOL_RESULTS] {"content": ', result_close="}[/TOOL_RESULTS]")
LLAMA3_JSON = ToolFormat(
    "llama3_json", arguments_key="parameters", marker="<|python_tag|>", marker_optional=True, separator="; ",
    instruction='To call a function, respond with a json object with function name and parameters (several calls '
                'separated by "; ") as follows:')
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, MISTRAL, LLAMA3_JSON)}


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template writes calls in, from its source: Mistral's `[TOOL_CALLS]` (its list right
    after the marker where the template writes it so: the tekken-tokenizer models), Hermes's `<tool_call>`, Llama
    3.1's `<|python_tag|>` / "Environment: ipython" / `"parameters"`; else Hermes (the fallback prompt's)."""
    source = template or ""
    if "[TOOL_CALLS][" in source:
        return replace(MISTRAL, begin="[")
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<tool_call>" in source:
        return HERMES
    if any(sign in source for sign in _LLAMA_SIGNS):
        return LLAMA3_JSON
    return HERMES


def tool_format(tokenizer, setting: str) -> ToolFormat:
    """A model's format (`setting`: ServedModel.tool_call_parser), with its marker's special token if the
    tokenizer has one."""
    fmt = detect_format(getattr(tokenizer, "chat_template", None)) if setting == "auto" else FORMATS[setting]
    return replace(fmt, marker_token=special_token(tokenizer, fmt.marker))


def special_token(tokenizer, text: str) -> int | None:
    """The id of `text` where the tokenizer has it as one special token, else None."""
    if not text:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and ids[0] in set(getattr(tokenizer, "all_special_ids", ())) else None
