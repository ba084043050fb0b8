"""OpenAI request and response schemas (pydantic), plus kvserve's and vLLM's extra request fields.

Unknown request fields are ignored (OpenAI clients send extras); the types of known ones are strict, as
OpenAI's are ("2" is no integer, 0 no boolean). Field ranges follow OpenAI; the
SamplingParams built from a request validates once more (its errors are 400s too). Every constraint that
JSON Schema can state is in the types here (or, for a rule across fields, in `json_schema_extra` beside
its validator), so the OpenAPI document (kvserve/server/openapi.py) and the validation say the same. The
`x-kvserve` marks name what only the served models know (their ids, context, vocabulary): the document
fills those in for the server that serves it.

Defaults stated: chat `max_completion_tokens`/`max_tokens` unset -> min(the server's
`default_max_tokens` (1024 unless configured), the context left after the prompt); /v1/completions
`max_tokens` unset -> 16 (OpenAI's default there). An explicit max_tokens that does not fit in the
context with the prompt is a 400 context_length_exceeded (as vLLM). `temperature` unset -> 1.0,
`top_p` -> 1.0, `n` -> 1.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from kvserve.config import TIER_NAMES
from kvserve.engine.sampling import MAX_TOKEN_ID, REPETITION_PENALTY_RANGE, SamplingParams
from kvserve.engine.structured.params import InvalidStructuredOutput, StructuredOutputsParams
from kvserve.metering.budgets import PERIODS as BUDGET_PERIODS
from kvserve.service.reasoning import REASONING_EFFORT_BUDGETS, budget_of

if TYPE_CHECKING:
    from kvserve.service.tool_formats import ToolFormat

Tier = Literal[TIER_NAMES]  # the labels of kvserve.config.Priority
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
# The chat template's variables that the request itself sets (chat_template_kwargs may not)
TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})

# A token id: for a prompt, the document bounds it by the served vocabulary (out of it: 400 invalid_prompt).
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
PromptTokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID, json_schema_extra={"x-kvserve": "vocabulary"})]
# A prompt's text: "" encodes to no tokens (400 invalid_prompt) unless the model adds a BOS token.
PromptText = Annotated[str, Field(json_schema_extra={"x-kvserve": "text"})]
StopString = Annotated[str, Field(min_length=1)]
# A JSON document as text (a schema given as a string, as vLLM takes guided_json)
JsonText = Annotated[str, Field(json_schema_extra={"contentMediaType": "application/json"})]


class InvalidJSON(ValueError):
    """A request body (or batch line) that is not strict JSON in UTF-8."""


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _not_json(name: str):
    raise InvalidJSON(f"{name} is not a JSON value")


def _number(text: str) -> int | float:
    """A JSON number with no fraction is an integer, as JSON Schema counts (2.0 for n is 2; the models'
    strict int types take it then; their float types take ints). One past float's range (1e400) is refused."""
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJSON(f"the number {text[:40]} is out of range")
    return int(value) if value.is_integer() else value


def parse_json(raw: bytes) -> Any:
    """Strict JSON in UTF-8 (a BOM allowed): not Python's extras NaN and Infinity, nor escaped unpaired
    UTF-16 surrogates ("\\ud800"), which are no Unicode text (the tokenizer fails on them). InvalidJSON else."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidJSON(f"not UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_not_json, parse_float=_number)
    except json.JSONDecodeError as e:
        raise InvalidJSON(f"{e.msg} (line {e.lineno} column {e.colno})") from None
    if _SURROGATE_ESCAPE.search(text):  # rare: check that each one was half of a pair
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJSON("a string has an unpaired UTF-16 surrogate escape (not Unicode text)") from None
    return data


class _Lenient(BaseModel):
    """Lenient about unknown fields, strict about the types of known ones."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


# A token count that must fit in the model's context with the prompt (the document: below max_model_len).
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={"x-kvserve": "context"})]


class JsonSchemaFormat(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # an object schema (OpenAI's strict mode: every property required, additionalProperties false; here any
    # schema the grammar backend supports, strict or not: the output always matches it)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    # _schema below, for the document
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"],
                                                                   "properties": {"json_schema": {"not": {"type": "null"}}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class StructuredOutputsField(_Lenient):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: dict[str, Any] | JsonText | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = None


class _CommonRequest(_Lenient):
    # an id of a served model or "auto" (an unknown id: 404 model_not_found)
    model: str = Field(min_length=1, json_schema_extra={"x-kvserve": "model"})
    max_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's prompt caching: a key that routes requests sharing a prefix together (with the prefix itself),
    # and how long their prompt's cached prefix is kept: "in_memory" (as the cache's LRU and the tenants' shares
    # decide) or a TTL such as "24h", "30m", "90s" (within the tenant's limit; the cached blocks of the prompt
    # are kept at least that long after their last use, before any block not so retained)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: str | None = Field(default=None, pattern=r"^(in_memory|[0-9]{1,7}[smhd])$")
    # kvserve extensions
    priority: Tier = "interactive"
    # free-form; metadata.tenant_id must name the token's own tenant (403), request_id is echoed in a header
    metadata: dict[str, Any] | None = Field(default=None, json_schema_extra={
        "properties": {"tenant_id": {"type": "string"}, "request_id": {"type": "string"}}})
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOKEN_ID)
    min_p: float | None = Field(default=None, ge=0, le=1)
    # bounded so that logits / penalty stays finite in float32 (1e-300 was 0 there: the engine died)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # kvserve: false keeps this request out of speculative decoding (where the server runs it). Outputs are the
    # same either way (greedy bit for bit, sampling in distribution); only speed differs.
    speculation: bool = True
    # Structured outputs: OpenAI's response_format, or vLLM's extras (one constraint in all; its output is
    # generated to match it, engine/structured/grammar.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | JsonText | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def structured(self, tool_format: "ToolFormat | None" = None) -> StructuredOutputsParams | None:
        """The request's one constraint, or None. InvalidStructuredOutput (400) for two, or a bad one.
        `tool_format`: the served model's tool-call format (a chat's tools constrain calls to it)."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", _structured("response_format", json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_
            found.append(("response_format", _structured("response_format", json=schema if schema is not None else {})))
        so = self.structured_outputs
        if so is not None:
            found.append(("structured_outputs", _structured(
                "structured_outputs", json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                choice=so.choice, grammar=so.grammar)))
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, _structured(name, **{kw: value})))
        if len(found) > 1:
            raise InvalidStructuredOutput(f"one output constraint per request; got {', '.join(n for n, _ in found)}",
                                          param=found[1][0])
        return found[0][1] if found else None

    @property
    def cache_retention_s(self) -> float:
        """prompt_cache_retention in seconds (0: "in_memory" or unset)."""
        v = self.prompt_cache_retention
        if v is None or v == "in_memory":
            return 0.0
        return float(int(v[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[v[-1]])

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        for key in ("request_id", "tenant_id"):
            if key in v and not isinstance(v[key], str):
                raise ValueError(f"metadata.{key} must be a string")
        return v

    @property
    def tenant_id(self) -> str | None:
        return (self.metadata or {}).get("tenant_id")

    @property
    def client_request_id(self) -> str | None:
        return (self.metadata or {}).get("request_id")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def sampling_params(self, tool_format: "ToolFormat | None" = None) -> SamplingParams:
        """Raises InvalidSamplingParams (a 400) when a combination is out of range. `tool_format`: as for
        `structured`.

        max_tokens stays None when the request sets none: the server fills it per prompt with
        min(default_max_tokens, remaining context).
        """
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            speculation=self.speculation,
            structured_outputs=self.structured(tool_format),
        )


def _structured(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw, source=param)
    except InvalidStructuredOutput as e:
        raise InvalidStructuredOutput(str(e), param=param) from None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionCallIn(_Lenient):
    name: ToolName
    arguments: str  # JSON text, as OpenAI gives it back


class ToolCallIn(_Lenient):
    """A call an assistant message made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(_Lenient):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls always match `parameters` here, strict or not


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: ToolName


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Lenient):
    # _content below, for the document: only an assistant message may leave content out (or null)
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        return self

    def for_template(self) -> dict:
        """The dict the chat template sees ("developer" is OpenAI's new name for "system")."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(_CommonRequest):
    # _logprobs below, for the document: a top_logprobs that is not null needs logprobs: true
    # and a tool_choice other than "none" (or null) needs tools
    model_config = ConfigDict(extra="ignore", json_schema_extra={"dependentSchemas": {"top_logprobs": {"anyOf": [
        {"properties": {"top_logprobs": {"type": "null"}}},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]}, "tool_choice": {"anyOf": [
            {"properties": {"tool_choice": {"enum": ["none", None]}}},
            {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}}})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (service/tools.py): calls constrained to the model's format and each tool's schema
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    # Reasoning models (docs/reasoning.md): variables for the chat template (Qwen3's enable_thinking), and the
    # thinking budget, as OpenAI's effort or vLLM's token count (which wins); other models ignore the budget.
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra={
        "propertyNames": {"not": {"enum": sorted(TEMPLATE_RESERVED)}}})  # _template_kwargs below
    reasoning_effort: Literal[tuple(REASONING_EFFORT_BUDGETS)] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=0, le=MAX_TOKEN_ID)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        reserved = sorted(set(v or ()) & TEMPLATE_RESERVED)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request sets those")
        return v

    @property
    def thinking_budget(self) -> int | None:
        return budget_of(self.thinking_token_budget, self.reasoning_effort)

    @model_validator(mode="after")
    def _tools(self):
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:  # (stated in the document too)
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return self

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or the one function's name."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    def sampling_params(self, tool_format: "ToolFormat | None" = None) -> SamplingParams:
        params = super().sampling_params(tool_format)
        if self.tool_mode != "none" and tool_format is not None and tool_format.keeps_special_tokens:
            return replace(params, skip_special_tokens=False)  # the calls' marker is a special token
        return params

    def structured(self, tool_format: "ToolFormat | None" = None) -> StructuredOutputsParams | None:
        mode = self.tool_mode
        if mode == "none":
            return super().structured()
        from kvserve.service.tool_formats import HERMES
        from kvserve.service.tools import tool_grammar, tools_of

        others = [n for n in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, n) is not None]
        if others:
            raise InvalidStructuredOutput(f"one output constraint per request: tools constrain the output, so "
                                          f"{others[0]} cannot be added to them", param=others[0])
        rf = self.response_format
        answer = rf.json_schema.schema_ or {} if rf is not None and rf.type == "json_schema" else None
        return tool_grammar(tools_of(self.tools), mode, self.parallel_tool_calls, answer_schema=answer,
                            json_answer=rf is not None and rf.type == "json_object", fmt=tool_format or HERMES)

    def prompt(self, template_renders_tools: bool,
               tool_format: "ToolFormat | None" = None) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools the chat template gets, earlier calls and results in the model's tool-call
        format (service/tools.py: as templates that render tools take them, or the fallback for the others)."""
        from kvserve.service.tool_formats import HERMES
        from kvserve.service.tools import fallback_messages, messages_for_template, tool_json, tools_of

        fmt = tool_format or HERMES
        messages = self.template_messages()
        tools = tools_of(self.tools) if self.tool_mode != "none" else []
        if template_renders_tools:
            return messages_for_template(messages, fmt), [tool_json(t) for t in tools] or None
        return fallback_messages(messages, tools, fmt), None

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def prompt_chars(self) -> int:
        return sum(len(m.for_template()["content"]) for m in self.messages)


class CompletionRequest(_CommonRequest):
    # one prompt (text or token ids), or a list of up to MAX_N of them
    prompt: (PromptText
             | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_N)]
             | Annotated[list[PromptTokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[PromptTokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_N)])
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(default=False, json_schema_extra={"const": False})  # _echo below
    max_tokens: MaxTokens | None = 16  # OpenAI's default for /v1/completions

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @model_validator(mode="after")
    def _n_prompts(self):
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int) and len(self.prompt) * self.n > MAX_N:
            raise ValueError(f"number of prompts x n must be at most {MAX_N}")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def prompt_chars(self) -> int:
        return sum(len(p) if isinstance(p, str) else 4 * len(p) for p in self.prompts())


# ---- the batch API's and the admin API's request bodies --------------------------------------

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class FileUpload(BaseModel):
    """POST /v1/files, a multipart form. The lines are checked when a batch uses the file (one of blank lines
    only: 400)."""

    file: bytes = Field(min_length=1)
    purpose: Literal["batch"]


class BatchCreateRequest(_Lenient):
    input_file_id: str
    endpoint: Literal[BATCH_ENDPOINTS]
    # "24h" (OpenAI's one value) or any <n>s|m|h|d, n > 0 (kvserve.batch.jobs.window_seconds)
    completion_window: str = Field(pattern=r"^0*[1-9][0-9]{0,6}[smhd]$")
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)


class BudgetRequest(_Lenient):
    """PUT /v1/admin/tenants/{name}/budget. `model`: a served model's id, or unset for all models."""

    amount: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]  # dollars
    period: Literal[BUDGET_PERIODS] = "month"
    model: str | None = None


class _EscrowCall(_Lenient):
    """A region's call to the ledger region about one shared limit: a tenant's budget (`model`: its model key)
    or rate limit ('#rpm', '#tpm'), in the period (window) that began at `period_start`."""

    tenant: str
    model: str
    period_start: Annotated[float, Field(allow_inf_nan=False)]
    region: str


class EscrowLease(_EscrowCall):
    """POST /v1/region/escrow/lease (region to region): `region` needs `need` more of the limit."""

    need: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    deadline: Annotated[float, Field(allow_inf_nan=False)] | None = None  # Unix seconds: no grant after it


class EscrowRelease(_EscrowCall):
    """POST /v1/region/escrow/release: `region` gives back `amount` of its leases."""

    amount: Annotated[float, Field(ge=0, allow_inf_nan=False)]


MAX_RATE_LIMIT = 10**12  # per minute: more is no limit, and the store keeps 64-bit integers


class LimitsRequest(_Lenient):
    """PUT /v1/admin/tenants/{name}/limits: requests and tokens per minute; null removes a limit."""

    rpm: StrictInt | None = Field(default=None, ge=1, le=MAX_RATE_LIMIT)
    tpm: StrictInt | None = Field(default=None, ge=1, le=MAX_RATE_LIMIT)


# ---- responses ------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error response, whatever its status (OpenAI's error schema)."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Of cached_tokens, those read back from the KV cache's disk tier, and those from its host-memory tier (on
    # CUDA); the rest were in the engine's pool.
    disk_cached_tokens: int = 0
    host_cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    # Of completion_tokens, those of the thinking block (its close tag too; docs/reasoning.md)
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)

    def add(self, prompt: int, completion: int, cached: int, disk_cached: int = 0, host_cached: int = 0,
            reasoning: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.completion_tokens_details.reasoning_tokens += reasoning
        self.prompt_tokens_details.cached_tokens += cached
        self.prompt_tokens_details.disk_cached_tokens += min(disk_cached, cached)
        self.prompt_tokens_details.host_cached_tokens += min(host_cached, cached)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    # A reasoning model's thinking (docs/reasoning.md), under vLLM's two names; null: none
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None  # OpenAI's; kvserve never refuses in place of the content
    tool_calls: list[dict] | None = None  # [{id, type: "function", function: {name, arguments}}]; null: none


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    # A LoRA adapter's card (vLLM's fields): the model it adapts, and where its weights were read from.
    parent: str | None = None
    root: str | None = None
    # "ready", "warming" (loading), "unloaded" (loaded by demand, not now), "sleeping" (its memory freed, it wakes
    # for the next request), "draining", "failed" or "stopped"
    status: str
    load: str = "eager"  # "eager" or "on_demand" (docs/models.md#models-loaded-by-demand)
    load_seconds: float | None = None  # how long its last load took
    role: str = ""
    p50_ttft_ms: float | None = None
    inflight: int = 0
    queue_depth: int = 0
    max_model_len: int | None = None
    # What the engine computes from: the quantized forms in use ("int4+int8", "fp8+bfloat16"), or the dtype where
    # every matrix is dense ("bfloat16"); the setting (auto, bf16, int8, int4, fp8) until the weights are loaded.
    weights: str | None = None
    # The KV cache's dtype setting: "auto" (the model's dtype), "int8" (kernels/kv_quant.py) or "fp8" (models/fp8.py).
    kv_cache_dtype: str | None = None
    # "batch_invariant": a token's logits are the same bits whatever else its step held; "fast": not promised
    # (the setting until the model is loaded; "fast" where the path cannot give it: float32, CUDA).
    numerics: str | None = None
    # What the quantized matrices multiply: "bf16" or "int8" (8-bit activations per 16 inputs, docs/cpu.md);
    # the setting ("auto") until the model is loaded.
    activations: str | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body; `model` names the base where the server serves several)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = None
    pinned: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    model: str | None = None


class PinRequest(BaseModel):
    """POST /v1/admin/models/{id}/pin: a pinned model is never unloaded to make room for another."""

    model_config = ConfigDict(extra="forbid")
    pinned: bool = True


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
