"""/v1/admin: budgets and rate limits per tenant, for admin tokens (`kvserve tenants create NAME --admin`).
A tenant token gets 403; an unknown tenant 404; a bad value 400 naming the field."""
from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvserve.metering.budgets import ALL_MODELS, PERIODS
from kvserve.server.auth import authenticate
from kvserve.server.errors import APIError
from kvserve.server.serving import read_json_body
from kvserve.server.state import ServerState

router = APIRouter(prefix="/v1/admin")


async def _admin(request: Request) -> ServerState:
    state: ServerState = request.app.state.kv
    caller = await authenticate(request, state.store)
    if not caller.admin:
        raise APIError(403, "this endpoint needs an admin token", "permission_error", "permission_denied")
    return state


async def _tenant(state: ServerState, name: str) -> None:
    if await state.store.aget_tenant(name) is None:
        raise APIError(404, f"no tenant {name!r}", "invalid_request_error", "tenant_not_found", param="tenant")


def _budget_json(b) -> dict:
    return {"tenant": b.tenant, "model": None if b.model == ALL_MODELS else b.model, "amount": b.amount,
            "period": b.period, "spent": b.spent, "reserved": b.reserved, "remaining": b.remaining}


@router.get("/budgets")
async def list_budgets(request: Request, tenant: str | None = None):
    state = await _admin(request)
    rows = await asyncio.to_thread(state.store.store.budgets.list, tenant)
    return JSONResponse({"object": "list", "data": [_budget_json(b) for b in rows]})


@router.put("/tenants/{name}/budget")
async def set_budget(request: Request, name: str):
    """Body: {"amount": dollars >= 0, "period": "day" | "month" | "none", "model": optional model id}."""
    state = await _admin(request)
    await _tenant(state, name)
    body = await read_json_body(request, state.config.max_body_bytes)
    amount, period, model = body.get("amount"), body.get("period", "month"), body.get("model")
    if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not math.isfinite(amount) or amount < 0:
        raise APIError(400, f"amount must be a number of dollars >= 0, got {amount!r}", param="amount",
                       code="invalid_value")
    if period not in PERIODS:
        raise APIError(400, f"period must be one of {', '.join(PERIODS)}, got {period!r}", param="period",
                       code="invalid_value")
    if model is not None and model not in state.models:
        raise APIError(400, f"model {model!r} is not served", param="model", code="model_not_found")
    b = await asyncio.to_thread(state.store.store.budgets.set_budget, name, float(amount), period, model or ALL_MODELS)
    return JSONResponse(_budget_json(b))


@router.delete("/tenants/{name}/budget")
async def delete_budget(request: Request, name: str, model: str | None = None):
    state = await _admin(request)
    await _tenant(state, name)
    gone = await asyncio.to_thread(state.store.store.budgets.delete_budget, name, model or ALL_MODELS)
    return JSONResponse({"tenant": name, "model": model, "deleted": gone})


@router.put("/tenants/{name}/limits")
async def set_limits(request: Request, name: str):
    """Body: {"rpm": requests per minute or null, "tpm": tokens per minute or null}; both null removes them."""
    state = await _admin(request)
    await _tenant(state, name)
    body = await read_json_body(request, state.config.max_body_bytes)
    values = {}
    for key in ("rpm", "tpm"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise APIError(400, f"{key} must be an integer >= 1 or null, got {v!r}", param=key, code="invalid_value")
        values[key] = v
    await asyncio.to_thread(state.store.store.rate_limits.set_limits, name, values["rpm"], values["tpm"])
    return JSONResponse({"tenant": name, **values})
