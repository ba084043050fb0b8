"""/v1/admin: budgets and rate limits per tenant, for admin tokens (`kvserve tenants create NAME --admin`).
A tenant token gets 403; an unknown tenant 404; a bad value 400 naming the field."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvserve.metering.budgets import ALL_MODELS
from kvserve.server import openapi
from kvserve.server.auth import authenticate
from kvserve.server.errors import APIError
from kvserve.server.serving import read_json_body
from kvserve.server.state import ServerState
from kvserve.service import protocol as p

router = APIRouter(prefix="/v1/admin")


async def require_admin(request: Request) -> ServerState:
    state: ServerState = request.app.state.kv
    caller = await authenticate(request, state.store)
    if not caller.admin:
        raise APIError(403, "this endpoint needs an admin token", "permission_error", "permission_denied")
    return state


async def _tenant(state: ServerState, name: str) -> None:
    if await state.store.aget_tenant(name) is None:
        raise APIError(404, f"no tenant {name!r}", "invalid_request_error", "tenant_not_found", param="tenant")


def budget_json(b) -> dict:
    return {"tenant": b.tenant, "model": None if b.model == ALL_MODELS else b.model, "amount": b.amount,
            "period": b.period, "spent": b.spent, "reserved": b.reserved, "remaining": b.remaining,
            "region_allotment": b.allotment}


@router.get("/budgets")
async def list_budgets(request: Request, tenant: str | None = None):
    state = await require_admin(request)
    rows = await asyncio.to_thread(state.store.store.budgets.list, tenant)
    return JSONResponse({"object": "list", "data": [budget_json(b) for b in rows]})


@router.put("/tenants/{name}/budget", openapi_extra=openapi.json_body(p.BudgetRequest))
async def set_budget(request: Request, name: str):
    """Body: {"amount": dollars >= 0, "period": "day" | "month" | "none", "model": optional model id}."""
    state = await require_admin(request)
    await _tenant(state, name)
    body = p.BudgetRequest.model_validate(await read_json_body(request, state.config.max_body_bytes))
    if body.model is not None and body.model not in state.models:
        raise APIError(400, f"model {body.model!r} is not served", param="model", code="model_not_found")
    b = await asyncio.to_thread(state.store.store.budgets.set_budget, name, float(body.amount), body.period,
                                body.model or ALL_MODELS)
    return JSONResponse(budget_json(b))


@router.delete("/tenants/{name}/budget")
async def delete_budget(request: Request, name: str, model: str | None = None):
    state = await require_admin(request)
    await _tenant(state, name)
    gone = await asyncio.to_thread(state.store.store.budgets.delete_budget, name, model or ALL_MODELS)
    return JSONResponse({"tenant": name, "model": model, "deleted": gone})


@router.put("/tenants/{name}/limits", openapi_extra=openapi.json_body(p.LimitsRequest))
async def set_limits(request: Request, name: str):
    """Body: {"rpm": requests per minute or null, "tpm": tokens per minute or null}; both null removes them."""
    state = await require_admin(request)
    await _tenant(state, name)
    body = p.LimitsRequest.model_validate(await read_json_body(request, state.config.max_body_bytes))
    await asyncio.to_thread(state.store.store.rate_limits.set_limits, name, body.rpm, body.tpm)
    return JSONResponse({"tenant": name, "rpm": body.rpm, "tpm": body.tpm})


# ---- models loaded by demand (service/residency.py) ----------------------------------------------

def _model(state: ServerState, model_id: str):
    h = state.models.get(model_id)
    if h is None:
        raise APIError(404, f"The model {model_id!r} does not exist", "invalid_request_error", "model_not_found",
                       param="model")
    return h


def _residency_json(h) -> dict:
    return {"id": h.id, "status": h.status.value, "load": "on_demand" if h.on_demand else "eager",
            "pinned": h.pinned, "open_calls": h.users}


@router.post("/models/{model_id}/load")
async def load_model(request: Request, model_id: str):
    """Load a model loaded by demand now (making room as a request would), waiting up to load_wait_s."""
    state = await require_admin(request)
    h = _model(state, model_id)
    await state.service.ensure_loaded(h)
    return JSONResponse(_residency_json(h))


@router.post("/models/{model_id}/unload")
async def unload_model(request: Request, model_id: str):
    """Unload an idle model loaded by demand (409 while a call is open on it)."""
    state = await require_admin(request)
    h = _model(state, model_id)
    if not h.on_demand:
        raise APIError(400, f"model {model_id} is loaded eagerly (load = \"eager\"); only models loaded by demand "
                       "unload", "invalid_request_error", "invalid_value", param="model")
    if h.users:
        raise APIError(409, f"model {model_id} has {h.users} calls open; unload it when they are answered",
                       "invalid_request_error", "model_busy", param="model")
    await state.service.unload(h)
    return JSONResponse(_residency_json(h))


@router.post("/models/{model_id}/sleep")
async def sleep_model(request: Request, model_id: str):
    """Put an idle loaded model to sleep (vLLM's sleep mode, level 1): its weights written to <home>/sleep and their
    memory freed, its KV memory freed (prefix cache dropped); the next request, or /wake, reads the weights back.
    409 while a call is open on it; 400 where the engine cannot sleep (not in this process, not on the CPU)."""
    from kvserve.engine.worker.sleep import SleepBusy, SleepUnsupported

    state = await require_admin(request)
    h = _model(state, model_id)
    _check_sleepable(h)
    if h.users:
        raise APIError(409, f"model {model_id} has {h.users} calls open; put it to sleep when they are answered",
                       "invalid_request_error", "model_busy", param="model")
    try:
        report = await state.service.sleep(h)
    except SleepBusy as e:
        raise APIError(409, str(e), "invalid_request_error", "model_busy", param="model") from None
    except SleepUnsupported as e:
        raise APIError(400, str(e), "invalid_request_error", "sleep_unsupported", param="model") from None
    return JSONResponse({**_residency_json(h), "paged_out_bytes": report.paged_out_bytes,
                         "freed_kv_bytes": report.discarded_bytes, "seconds": round(report.seconds, 4)})


@router.post("/models/{model_id}/wake")
async def wake_model(request: Request, model_id: str):
    """Wake a sleeping model now (a request would too): its weights read back."""
    state = await require_admin(request)
    h = _model(state, model_id)
    _check_sleepable(h)
    seconds = await h.client.wake_up()
    return JSONResponse({**_residency_json(h), "seconds": round(seconds, 4)})


def _check_sleepable(h) -> None:
    if not hasattr(h.client, "sleep"):
        raise APIError(400, f"model {h.id} is not served in this process: it cannot sleep",
                       "invalid_request_error", "sleep_unsupported", param="model")
    if h.on_demand and not h.started:
        raise APIError(409, f"model {h.id} is not loaded", "invalid_request_error", "model_not_loaded",
                       param="model")


@router.post("/models/{model_id}/pin", openapi_extra=openapi.json_body(p.PinRequest))
async def pin_model(request: Request, model_id: str):
    """Pin a model (never unloaded to make room for another), or unpin it with {"pinned": false}."""
    state = await require_admin(request)
    h = _model(state, model_id)
    body = p.PinRequest.model_validate(await read_json_body(request, state.config.max_body_bytes) or {})
    h.pinned = body.pinned
    return JSONResponse(_residency_json(h))
