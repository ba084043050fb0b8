"""The one place where errors become HTTP responses, always in OpenAI's error schema.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Typed engine errors (`KVServeError` subclasses, `InvalidRequest` for bad input) carry their own status,
type and code; server-side refusals (auth, body size, idempotency) raise `APIError`. Anything else is
a bug: a 500 with a request id, logged with its traceback. FastAPI's default 422 body is never sent.
"""
from __future__ import annotations

import json
import logging
import math
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvserve.config import InvalidPriority
from kvserve.engine.errors import CapacityExhausted, KVServeError
from kvserve.engine.sampling import InvalidSamplingParams

log = logging.getLogger(__name__)


class APIError(Exception):
    """A refusal decided by the server itself (not the engine)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, code, param), status_code=status, headers=headers)


def retry_after_header(seconds: float | None) -> str:
    """Retry-After as an integer number of seconds, at least 1."""
    try:
        value = float(seconds) if seconds is not None else 1.0
    except (TypeError, ValueError):
        value = 1.0
    if not math.isfinite(value):
        value = 1.0
    return str(max(1, math.ceil(value)))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "set"}


def _is_type_tag(part: str) -> bool:
    """pydantic puts the union member tried into `loc` (('stop', 'list[str]')); those are not params."""
    return (part in _TYPE_TAGS or "[" in part or "(" in part or "-" in part or part[:1].isupper())


def _path(parts: list) -> str | None:
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) or str(p).isdigit() else f".{p}"
    return out


def _loc_to_param(loc: tuple, whole: bool = False) -> str | None:
    """The parameter an error's `loc` names: up to the union that pydantic tried members of (`whole`: the
    path inside the member too, for the message)."""
    parts = []
    for p in loc:
        if p in ("body", "query", "path", "header"):
            continue
        if not isinstance(p, int) and _is_type_tag(str(p)):
            if whole:
                continue
            break
        parts.append(p)
    return _path(parts)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of the first error. Of a union's errors (one per member tried), the message is the
    first that is not a type mismatch: for stop=[""], "stop[0]: String should have at least 1 character"."""
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())))
    same = [e for e in errors if _loc_to_param(tuple(e.get("loc", ()))) == param]
    shown = next((e for e in same if not str(e.get("type", "")).endswith("_type")), first) if len(same) > 1 else first
    where = _loc_to_param(tuple(shown.get("loc", ())), whole=True)
    msg = shown.get("msg", "invalid request")
    if where:
        msg = f"{where}: {msg}"
    more = len(errors) - len(same)  # errors about other params
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return msg, param


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the APIError the client sees (status, type, code, headers)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, CapacityExhausted):
        return APIError(exc.http_status, str(exc), exc.error_type, exc.code,
                        headers={"Retry-After": retry_after_header(exc.retry_after)})
    if isinstance(exc, KVServeError):
        retry = exc.retry_after if exc.retry_after is not None else (1 if exc.http_status == 503 else None)
        headers = {**(exc.headers or {}), **({"Retry-After": retry_after_header(retry)} if retry is not None else {})}
        return APIError(exc.http_status, str(exc), exc.error_type, exc.code, param=exc.param, headers=headers)
    if isinstance(exc, (InvalidSamplingParams, InvalidPriority)):
        return APIError(400, str(exc), "invalid_request_error", "invalid_value", param=exc.param)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        errors = list(exc.errors())
        msg, param = validation_message(errors)
        code = "missing_required_parameter" if errors and errors[0].get("type") == "missing" else "invalid_value"
        return APIError(400, msg, "invalid_request_error", code, param=param)
    if isinstance(exc, json.JSONDecodeError):
        return APIError(400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
                        "invalid_request_error", "invalid_json")
    return APIError(500, "internal server error", "server_error", "internal_error")


def internal_error_response(exc: BaseException, request_id: str | None = None,
                            headers: dict[str, str] | None = None) -> JSONResponse:
    """A 500 for an exception nobody mapped (a bug): logged with its traceback under a request id that
    the client sees too, so the two can be matched."""
    request_id = request_id or f"req-{uuid.uuid4().hex}"
    log.error("internal error in request %s", request_id, exc_info=exc)
    return error_response(500, f"internal server error (request id {request_id})", "server_error",
                          "internal_error", headers={**(headers or {}), "x-request-id": request_id})


def api_error_response(exc: BaseException, extra_headers: dict[str, str] | None = None) -> JSONResponse:
    err = to_api_error(exc)
    headers = {**err.headers, **(extra_headers or {})}
    return error_response(err.status, err.message, err.type, err.code, err.param, headers)


def allowed_methods(request: Request) -> str:
    """The Allow header of a 405: the methods some route takes on the request's path."""
    routes = request.app.router.routes
    return ", ".join(m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
                     if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes))


def install_exception_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error_response(exc)

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # Starlette names the methods of the first route on the path only
            headers["Allow"] = allowed_methods(request)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code, headers=headers)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(exc)

    for cls in (APIError, KVServeError, InvalidSamplingParams, InvalidPriority, RequestValidationError,
                ValidationError, json.JSONDecodeError):
        app.add_exception_handler(cls, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
