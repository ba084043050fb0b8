"""/v1/files and /v1/batches: OpenAI's batch API over kvserve/batch (each tenant sees its own)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from kvserve.batch.runner import create_batch
from kvserve.server import openapi
from kvserve.server.auth import authenticate
from kvserve.server.errors import APIError
from kvserve.server.serving import read_json_body
from kvserve.server.state import ServerState
from kvserve.service import protocol as p
from kvserve.service.models import served_names

router = APIRouter(prefix="/v1")


async def _caller(request: Request) -> tuple[ServerState, str]:
    state: ServerState = request.app.state.kv
    return state, (await authenticate(request, state.store)).name


def _not_found(what: str, ident: str, param: str) -> APIError:
    return APIError(404, f"no {what} {ident!r}", "invalid_request_error", f"{what}_not_found", param=param)


@router.post("/files", openapi_extra=openapi.multipart_body(p.FileUpload))
async def create_file(request: Request):
    state, tenant = await _caller(request)
    try:
        form = await request.form(max_part_size=state.batch_files.max_bytes + 1)
    except Exception as e:
        raise APIError(400, f"expected a multipart form with 'file' and 'purpose': {e}", param="file",
                       code="invalid_value") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if not hasattr(upload, "read"):
        raise APIError(400, "the form has no 'file' part", param="file", code="missing_required_parameter")
    upload: UploadFile
    data = await upload.read(state.batch_files.max_bytes + 1)
    body = p.FileUpload.model_validate({"file": data, **({"purpose": purpose} if purpose is not None else {})})
    f = await asyncio.to_thread(state.batch_files.upload, tenant, upload.filename or "upload.jsonl", body.purpose,
                                data)
    return JSONResponse(f.to_json())


@router.get("/files")
async def list_files(request: Request, purpose: str | None = None, limit: int = 10_000):
    state, tenant = await _caller(request)
    files = await asyncio.to_thread(state.batch_files.list, tenant, purpose, max(1, min(limit, 10_000)))
    return JSONResponse({"object": "list", "data": [f.to_json() for f in files], "has_more": False})


@router.get("/files/{file_id}")
async def get_file(request: Request, file_id: str):
    state, tenant = await _caller(request)
    f = await asyncio.to_thread(state.batch_files.get, tenant, file_id)
    if f is None:
        raise _not_found("file", file_id, "file_id")
    return JSONResponse(f.to_json())


@router.get("/files/{file_id}/content", openapi_extra=openapi.media_types("application/jsonl"))
async def file_content(request: Request, file_id: str):
    state, tenant = await _caller(request)
    data = await asyncio.to_thread(state.batch_files.read, tenant, file_id)
    if data is None:
        raise _not_found("file", file_id, "file_id")
    return Response(data, media_type="application/jsonl")


@router.delete("/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    state, tenant = await _caller(request)
    if not await asyncio.to_thread(state.batch_files.delete, tenant, file_id):
        raise _not_found("file", file_id, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/batches", openapi_extra=openapi.json_body(p.BatchCreateRequest))
async def create(request: Request):
    state, tenant = await _caller(request)
    body = p.BatchCreateRequest.model_validate(await read_json_body(request, state.config.max_body_bytes))
    b = await state.store.awrite(create_batch, state.batch_jobs, state.batch_files, served_names(state.models),
                                 tenant, body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    return JSONResponse(b.to_json())


@router.get("/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    state, tenant = await _caller(request)
    batches, more = await state.store.aread(state.batch_jobs.list, tenant, after, limit)
    data = [b.to_json() for b in batches]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


@router.get("/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str):
    state, tenant = await _caller(request)
    b = await state.store.aread(state.batch_jobs.get, tenant, batch_id)
    if b is None:
        raise _not_found("batch", batch_id, "batch_id")
    return JSONResponse(b.to_json())


@router.post("/batches/{batch_id}/cancel")
async def cancel(request: Request, batch_id: str):
    state, tenant = await _caller(request)
    b = await state.store.awrite(state.batch_jobs.cancel, tenant, batch_id)
    if b is None:
        raise _not_found("batch", batch_id, "batch_id")
    return JSONResponse(b.to_json())
