"""/v1 routes: completions, chat completions, models, serving metrics, usage. All need a bearer token."""
from __future__ import annotations

import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.metering.reports import BUCKET_WIDTHS, DEFAULT_LIMIT, MAX_LIMIT, to_csv
from kvserve.metering.reports import page as usage_page
from kvserve.service import protocol as p
from kvserve.store.usage import REPORT_GROUPS
from kvserve.server.auth import authenticate
from kvserve.server.errors import APIError
from kvserve.server.serving import handle_completion
from kvserve.server.state import ServerState

router = APIRouter(prefix="/v1")


def _state(request: Request) -> ServerState:
    return request.app.state.kv


@router.post("/chat/completions")
async def chat_completions(request: Request):
    return await handle_completion(request, "chat")


@router.post("/completions")
async def completions(request: Request):
    return await handle_completion(request, "completion")


@router.get("/models")
async def list_models(request: Request):
    state = _state(request)
    await authenticate(request, state.store)
    cards = []
    for h in state.models.values():
        p50 = state.metrics.window.ttft_p50_ms(h.id)
        cards.append(p.ModelCard(id=h.id, created=h.created, status=h.status.value, role=h.role,
                                 p50_ttft_ms=None if p50 is None else round(p50, 3), inflight=h.client.num_inflight,
                                 queue_depth=sum(h.waiting_by_tier().values()), max_model_len=h.max_model_len))
    return JSONResponse(p.ModelList(data=cards).model_dump(mode="json"))


@router.get("/models/{model_id}")
async def get_model(request: Request, model_id: str):
    state = _state(request)
    await authenticate(request, state.store)
    h = state.models.get(model_id)
    if h is None:
        raise APIError(404, f"The model {model_id!r} does not exist", "invalid_request_error", "model_not_found",
                       param="model")
    p50 = state.metrics.window.ttft_p50_ms(h.id)
    card = p.ModelCard(id=h.id, created=h.created, status=h.status.value, role=h.role,
                       p50_ttft_ms=None if p50 is None else round(p50, 3), inflight=h.client.num_inflight,
                       queue_depth=sum(h.waiting_by_tier().values()), max_model_len=h.max_model_len)
    return JSONResponse(card.model_dump(mode="json"))


@router.get("/metrics/serving")
async def serving_metrics(request: Request, model: str | None = None):
    """Sliding-window serving numbers for one model (`?model=ID`), or every model when omitted."""
    state = _state(request)
    await authenticate(request, state.store)
    if model is not None:
        h = state.models.get(model)
        if h is None:
            raise APIError(404, f"The model {model!r} does not exist", "invalid_request_error", "model_not_found",
                           param="model")
        return JSONResponse(state.metrics.window.summary(h.id, h.live_stats()))
    return JSONResponse({"object": "list", "window_s": state.metrics.window.window_s,
                         "data": [state.metrics.window.summary(h.id, h.live_stats()) for h in state.models.values()]})


def _parse_time(value: str | None, param: str) -> float | None:
    """Unix seconds, or an ISO 8601 date/time (UTC when no zone is given)."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise APIError(400, f"{param} must be Unix seconds or an ISO 8601 date/time, got {value!r}",
                       param=param, code="invalid_value") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


@router.get("/usage")
async def usage(request: Request, start_time: str | None = None, end_time: str | None = None,
                bucket_width: str = "1d", limit: int | None = None, page: str | None = None,
                format: str = "json"):
    """Usage per time bucket in the shape of OpenAI's usage API (metering/reports.py), grouped by any of
    tenant, model, tier (`group_by`, repeated or comma-separated). A tenant sees its own usage; an admin
    token sees every tenant's, or one's with `tenant=`. `format=csv` exports the same rows."""
    state = _state(request)
    caller = await authenticate(request, state.store)
    q = request.query_params
    group_by = [g for v in q.getlist("group_by") for g in v.split(",") if g]
    bad = [g for g in group_by if g not in REPORT_GROUPS]
    if bad:
        raise APIError(400, f"group_by must be among {', '.join(REPORT_GROUPS)}, got {bad[0]!r}", param="group_by",
                       code="invalid_value")
    if bucket_width not in BUCKET_WIDTHS:
        raise APIError(400, f"bucket_width must be one of {', '.join(BUCKET_WIDTHS)}, got {bucket_width!r}",
                       param="bucket_width", code="invalid_value")
    if format not in ("json", "csv"):
        raise APIError(400, f"format must be json or csv, got {format!r}", param="format", code="invalid_value")
    width = BUCKET_WIDTHS[bucket_width]
    limit = DEFAULT_LIMIT[bucket_width] if limit is None else limit
    if not 1 <= limit <= MAX_LIMIT[bucket_width]:
        raise APIError(400, f"limit must be in [1, {MAX_LIMIT[bucket_width]}] for bucket_width {bucket_width}",
                       param="limit", code="invalid_value")
    now = time.time()
    start = _parse_time(page, "page") or _parse_time(start_time, "start_time")
    if start is None:  # the last `limit` buckets, aligned to the width (UTC)
        start = (now // width - limit + 1) * width
    end = _parse_time(end_time, "end_time") or now
    if end <= start:
        raise APIError(400, "end_time must be after start_time", param="end_time", code="invalid_value")
    tenant = q.get("tenant")
    if tenant is not None and not caller.admin and tenant != caller.name:
        raise APIError(403, "only an admin token may read another tenant's usage", "permission_error",
                       "permission_denied", param="tenant")
    scope = tenant if tenant is not None else (None if caller.admin else caller.name)
    await state.service.ledger.flush()
    rows = await state.store.ausage_buckets(start, end, width, group_by, scope)
    body = usage_page(rows, start, end, bucket_width, group_by, limit)
    if format == "csv":
        return Response(to_csv(body), media_type="text/csv",
                        headers={"content-disposition": "attachment; filename=usage.csv"})
    return JSONResponse(body)
