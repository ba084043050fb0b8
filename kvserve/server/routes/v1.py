"""/v1 routes: completions, chat completions, models, serving metrics, usage. All need a bearer token."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from kvserve.metering.reports import BUCKET_WIDTHS, DEFAULT_LIMIT, MAX_LIMIT, to_csv
from kvserve.metering.reports import merge as merge_usage
from kvserve.metering.reports import page as usage_page
from kvserve.service import protocol as p
from kvserve.store.usage import REPORT_GROUPS
from kvserve.server import openapi
from kvserve.server.auth import authenticate
from kvserve.server.errors import APIError
from kvserve.server.serving import handle_completion
from kvserve.server.state import ServerState

router = APIRouter(prefix="/v1")
BucketWidth = Literal[tuple(BUCKET_WIDTHS)]


def _state(request: Request) -> ServerState:
    return request.app.state.kv


@router.post("/chat/completions",
             openapi_extra=openapi.json_body(p.ChatCompletionRequest, p.ChatCompletionResponse, stream=True))
async def chat_completions(request: Request):
    return await handle_completion(request, "chat")


@router.post("/completions", openapi_extra=openapi.json_body(p.CompletionRequest, p.CompletionResponse, stream=True))
async def completions(request: Request):
    return await handle_completion(request, "completion")


@router.get("/models", openapi_extra=openapi.json_response(p.ModelList))
async def list_models(request: Request):
    state = _state(request)
    await authenticate(request, state.store)
    cards = [card for h in state.models.values() for card in [_card(state, h)] + _adapter_cards(h)]
    return JSONResponse(p.ModelList(data=cards).model_dump(mode="json"))


def _adapter_cards(h) -> list[p.ModelCard]:
    """A card per LoRA adapter of the model (vLLM's: `parent` the model, `root` its path)."""
    cards = []
    for name in h.adapter_names():
        spec = getattr(h.client, "adapter_spec", None)
        root = spec(name).path if spec is not None and h.status.value == "ready" else None
        cards.append(p.ModelCard(id=name, created=h.created, status=h.status.value, parent=h.id, root=root,
                                 max_model_len=h.max_model_len))
    return cards


def _lora_model(state, model: str | None):
    """The model an adapter load or unload is for: the one named, or the only one serving adapters."""
    if model is not None:
        h = state.models.get(model)
        if h is None:
            raise APIError(404, f"The model {model!r} does not exist", "invalid_request_error", "model_not_found",
                           param="model")
    else:
        serving = [h for h in state.models.values() if h.engine_config.lora_enabled]
        if len(serving) != 1:
            raise APIError(400, "name the model the adapter is for (`model`): "
                           f"{len(serving)} models serve LoRA adapters", "invalid_request_error", "invalid_value",
                           param="model")
        h = serving[0]
    if not hasattr(h.client, "load_adapter"):
        raise APIError(400, f"model {h.id} is served by a fleet: its adapters are its [[models.adapters]] "
                       "(kvserve fleet apply)", "invalid_request_error", "invalid_value", param="model")
    return h


@router.post("/load_lora_adapter", openapi_extra=openapi.json_body(p.LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request):
    """Read a LoRA adapter and serve it as `lora_name` (admin tokens; vLLM's endpoint)."""
    from kvserve.server.routes.admin import require_admin
    from kvserve.server.serving import read_json_body

    state = await require_admin(request)
    body = p.LoadLoRAAdapterRequest.model_validate(await read_json_body(request, state.config.max_body_bytes))
    h = _lora_model(state, body.model)
    if body.lora_name in state.models:
        raise APIError(400, f"{body.lora_name!r} is a model's id; an adapter needs a name of its own",
                       "invalid_request_error", "invalid_value", param="lora_name")
    await h.client.load_adapter(body.lora_name, body.lora_path, body.pinned)
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "parent": h.id, "root": body.lora_path,
                         "pinned": body.pinned})


@router.post("/unload_lora_adapter", openapi_extra=openapi.json_body(p.UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request):
    """Stop serving an adapter (admin tokens): requests in flight finish with it; new ones get 404."""
    from kvserve.server.routes.admin import require_admin
    from kvserve.server.serving import read_json_body

    state = await require_admin(request)
    body = p.UnloadLoRAAdapterRequest.model_validate(await read_json_body(request, state.config.max_body_bytes))
    h = _lora_model(state, body.model)
    h.client.unload_adapter(body.lora_name)
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "parent": h.id, "deleted": True})


def _card(state, h) -> p.ModelCard:
    p50 = state.metrics.window.ttft_p50_ms(h.id)
    loaded = h.client.health().load_seconds if h.started or not h.on_demand else None
    return p.ModelCard(id=h.id, created=h.created, status=h.status.value, role=h.role,
                       load="on_demand" if h.on_demand else "eager",
                       load_seconds=None if loaded is None else round(loaded, 3),
                       p50_ttft_ms=None if p50 is None else round(p50, 3), inflight=h.client.num_inflight,
                       queue_depth=sum(h.waiting_by_tier().values()), max_model_len=h.max_model_len,
                       weights=h.weights, kv_cache_dtype=h.engine_config.cache.kv_cache_dtype, numerics=h.numerics,
                       activations=h.activations)


@router.get("/models/{model_id}", openapi_extra=openapi.json_response(p.ModelCard))
async def get_model(request: Request, model_id: str):
    state = _state(request)
    await authenticate(request, state.store)
    h = state.models.get(model_id)
    if h is None:
        for card in (c for m in state.models.values() for c in _adapter_cards(m)):
            if card.id == model_id:
                return JSONResponse(card.model_dump(mode="json"))
        raise APIError(404, f"The model {model_id!r} does not exist", "invalid_request_error", "model_not_found",
                       param="model")
    return JSONResponse(_card(state, h).model_dump(mode="json"))


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


# Unix seconds of the dates ISO 8601 can write (years 1 to 9999); NaN and infinities are not times
_TIME_RANGE = (datetime(1, 1, 1, tzinfo=timezone.utc).timestamp(),
               datetime(9999, 12, 31, tzinfo=timezone.utc).timestamp())


def _parse_time(value: str | None, param: str) -> float | None:
    """Unix seconds, or an ISO 8601 date/time (UTC when no zone is given)."""
    if value is None or value == "":
        return None
    bad = APIError(400, f"{param} must be Unix seconds or an ISO 8601 date/time (years 1-9999), got {value!r}",
                   param=param, code="invalid_value")
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not _TIME_RANGE[0] <= seconds <= _TIME_RANGE[1]:  # False for NaN too
            raise bad
        return seconds
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise bad from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


@router.get("/usage", openapi_extra=openapi.media_types("text/csv"))
async def usage(request: Request, start_time: str | None = None, end_time: str | None = None,
                bucket_width: BucketWidth = "1d", limit: int | None = Query(None, ge=1, le=max(MAX_LIMIT.values())),
                page: str | None = None, format: Literal["json", "csv"] = "json",
                group_by: list[str] = Query([], description=f"any of {', '.join(REPORT_GROUPS)}; repeated or "
                                                            "comma-separated"),
                tenant: str | None = Query(None, description="an admin's: one tenant's usage"),
                regions: Literal["local", "all"] = Query("local", description="all: every region's usage, merged")):
    """Usage per time bucket in the shape of OpenAI's usage API (metering/reports.py), grouped by any of
    tenant, model, tier, adapter (`group_by`, repeated or comma-separated; a result's adapter is the LoRA
    adapter's name, null for the base model). A tenant sees its own usage; an admin
    token sees every tenant's, or one's with `tenant=`. `format=csv` exports the same rows. `regions=all`
    merges the peer regions' usage in (each region keeps the rows of what it served); the page says which
    regions it holds (`regions`: included, or unreachable)."""
    state = _state(request)
    caller = await authenticate(request, state.store)
    group_by = [g for v in group_by for g in v.split(",") if g]
    bad = [g for g in group_by if g not in REPORT_GROUPS]
    if bad:
        raise APIError(400, f"group_by must be among {', '.join(REPORT_GROUPS)}, got {bad[0]!r}", param="group_by",
                       code="invalid_value")
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
    if tenant is not None and not caller.admin and tenant != caller.name:
        raise APIError(403, "only an admin token may read another tenant's usage", "permission_error",
                       "permission_denied", param="tenant")
    scope = tenant if tenant is not None else (None if caller.admin else caller.name)
    await state.service.ledger.flush()
    rows = await state.store.ausage_buckets(start, end, width, group_by, scope)
    body = usage_page(rows, start, end, bucket_width, group_by, limit)
    if regions == "all" and state.regions is not None:
        params = {"start_time": str(start), "end_time": str(end), "bucket_width": bucket_width, "limit": str(limit),
                  "group_by": ",".join(group_by), **({"tenant": tenant} if tenant is not None else {})}
        peers = await state.regions.peer_usage(request, params)
        pages = [body] + [p for p in peers.values() if p is not None]
        body = {**merge_usage(pages), "regions": {state.regions.local: "included", **{
            name: "included" if p is not None else "unreachable" for name, p in peers.items()}}}
    if format == "csv":
        return Response(to_csv(body), media_type="text/csv",
                        headers={"content-disposition": "attachment; filename=usage.csv"})
    return JSONResponse(body)
