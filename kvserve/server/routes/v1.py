"""/v1 routes: completions, chat completions, models, serving metrics, usage. All need a bearer token."""
from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvserve.service import protocol as p
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
async def usage(request: Request, since: str | None = None, until: str | None = None, group_by: str | None = None):
    """The caller's own tenant's usage totals (never another tenant's)."""
    state = _state(request)
    tenant = await authenticate(request, state.store)
    if group_by not in (None, "", "model", "day"):
        raise APIError(400, f"group_by must be 'model' or 'day', got {group_by!r}", param="group_by",
                       code="invalid_value")
    await state.service.ledger.flush()
    rows = await state.store.ausage_totals(tenant.name, since=_parse_time(since, "since"),
                                           until=_parse_time(until, "until"), group_by=group_by or None)
    return JSONResponse({"object": "usage", "tenant": tenant.name, "group_by": group_by or None,
                         "since": _parse_time(since, "since"), "until": _parse_time(until, "until"), "data": rows})
