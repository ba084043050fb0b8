"""Validation of a batch input file, whole, before anything runs (pure: no I/O).

Every line must be a JSON object with a `custom_id` unique in the file, `method` POST, a `url` equal to
the batch's endpoint (/v1/chat/completions or /v1/completions) and a `body` the endpoint accepts (the
server's own request models), naming a served model, not streamed. Errors name the line numbers, as
OpenAI's do; a file with any error fails the batch and runs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from kvserve.service import protocol as p

ENDPOINTS = dict(zip(p.BATCH_ENDPOINTS, (("chat", p.ChatCompletionRequest), ("completion", p.CompletionRequest))))
MAX_ERRORS = 100  # listed; the count is always complete


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as OpenAI counts
    custom_id: str
    body: dict


def parse(data: bytes, endpoint: str, models: set[str]) -> tuple[list[Line], list[dict]]:
    """The file's lines, and the errors ({code, message, param, line}) that fail the batch."""
    kind_model = ENDPOINTS[endpoint][1]
    lines, errors, seen = [], [], set()

    def err(n: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": n})

    for n, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = p.parse_json(raw)
        except p.InvalidJSON as e:
            err(n, "invalid_json", f"line {n} is not JSON: {e}")
            continue
        if not isinstance(obj, dict):
            err(n, "invalid_json", f"line {n} is not a JSON object")
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            err(n, "missing_required_parameter", f"line {n} has no custom_id", "custom_id")
            continue
        if cid in seen:
            err(n, "duplicate_custom_id", f"custom_id {cid!r} on line {n} is used by an earlier line", "custom_id")
            continue
        seen.add(cid)
        if obj.get("method") != "POST":
            err(n, "invalid_value", f"line {n}: method must be POST", "method")
            continue
        if obj.get("url") != endpoint:
            err(n, "invalid_url", f"line {n}: url must be the batch's endpoint {endpoint}, got {obj.get('url')!r}",
                "url")
            continue
        body = obj.get("body")
        if not isinstance(body, dict):
            err(n, "invalid_value", f"line {n}: body must be a JSON object", "body")
            continue
        try:
            req = kind_model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            err(n, "invalid_request", f"line {n}: body.{where}: {first.get('msg')}", f"body.{where}")
            continue
        if req.stream:
            err(n, "invalid_value", f"line {n}: stream is not supported in a batch", "body.stream")
            continue
        if req.model not in models and req.model != "auto":
            err(n, "model_not_found", f"line {n}: model {req.model!r} is not served", "body.model")
            continue
        lines.append(Line(n, cid, body))
    return lines, errors
