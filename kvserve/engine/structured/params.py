"""What a request asks its output to match (vLLM's `StructuredOutputsParams`): a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar. Frozen and plain data: it travels inside
SamplingParams through every hop (the engine thread, Ray) and keys the compiled-grammar cache.

Limits on what a request may send are checked here, before anything is compiled: a schema's size and nesting
depth, a pattern's or a grammar's length, the number of choices (kvserve.config.StructuredLimits, set by the
engine's config). The compiler (engine/structured/grammar.py) then bounds the work a grammar may cost.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import StructuredLimits
from kvserve.engine.errors import InvalidStructuredOutput

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. `json` is a schema (a dict, or its JSON text), kept as compact JSON text
    in its own key order (the order its properties are generated in); equal texts share a cache entry."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # The request field it came from (what a 400 names); not part of what it is
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self):
        if isinstance(self.json, dict) or isinstance(self.json, bool):
            object.__setattr__(self, "json", _compact(self.json))
        elif isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _compact(json.loads(self.json)))
            except json.JSONDecodeError as e:
                raise InvalidStructuredOutput(f"the JSON schema is not JSON: {e.msg}") from None
            except RecursionError:
                raise InvalidStructuredOutput("the JSON schema nests too deep to read") from None
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidStructuredOutput("structured outputs take exactly one of json, json_object, regex, choice "
                                          f"and grammar; got {', '.join(set_) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def invalid(self, message: str) -> InvalidStructuredOutput:
        return InvalidStructuredOutput(message, param=self.source)

    def check(self, limits: StructuredLimits) -> None:
        """InvalidStructuredOutput if the request is outside `limits` or malformed (before any compile)."""
        if self.json is not None:
            if len(self.json) > limits.max_schema_bytes:
                raise self.invalid(f"the JSON schema is {len(self.json)} bytes; at most "
                                              f"{limits.max_schema_bytes} are allowed")
            schema = json.loads(self.json)
            if not isinstance(schema, (dict, bool)):
                raise self.invalid("a JSON schema must be an object (or true/false)")
            depth = _depth(schema)
            if depth > limits.max_schema_depth:
                raise self.invalid(f"the JSON schema nests {depth} levels deep; at most "
                                              f"{limits.max_schema_depth} are allowed")
        for name in ("regex", "grammar"):
            text = getattr(self, name)
            if text is not None:
                if not isinstance(text, str) or not text:
                    raise self.invalid(f"the {name} must be a non-empty string")
                if len(text.encode()) > limits.max_pattern_bytes:
                    raise self.invalid(f"the {name} is {len(text.encode())} bytes; at most "
                                                  f"{limits.max_pattern_bytes} are allowed")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise self.invalid("choice must be a non-empty list of non-empty strings")
            if len(self.choice) > limits.max_choices:
                raise self.invalid(f"{len(self.choice)} choices; at most {limits.max_choices} are allowed")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # key order kept: properties come in it


def _depth(value: Any) -> int:
    """Nesting depth of a JSON document (iterative: a hostile depth must not overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


# I-JSON (RFC 7493): integers beyond +-(2^53 - 1) are not exact in the doubles most JSON parsers read them into.
MAX_SAFE_INTEGER = 2**53 - 1


def interoperable_integers(schema: Any) -> Any:
    """A copy of `schema` in which every integer without an upper (lower) bound gets I-JSON's: JSON's grammar
    puts no bound on a number's length, and a small model writing one can run to max_tokens in its digits (an
    output cut there is no JSON). Integers beyond these are not exact in most parsers anyway."""
    if isinstance(schema, list):
        return [interoperable_integers(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: interoperable_integers(v) for k, v in schema.items()}
    kind = out.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_SAFE_INTEGER
    return out
