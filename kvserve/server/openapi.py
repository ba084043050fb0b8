"""The OpenAPI document (/openapi.json, /docs): FastAPI's, completed with what FastAPI cannot see.

The completion, batch and admin routes read their bodies themselves (size limit, idempotency hash, one
parse on the hot path), so FastAPI knows no request body for them. Each such route names, as its
`openapi_extra`, the pydantic model its handler validates with: `json_body(Model)`, `multipart_body(Model)`
(and `json_response(Model)` for a response FastAPI is not told of). `install(app)` makes the document:

- those models' JSON schemas under components/schemas (requests as validated, responses as serialized);
- the bearer security scheme, which every /v1 operation requires;
- OpenAI's error schema for every 4XX and 5XX of a /v1 operation (FastAPI's 422 HTTPValidationError is
  never sent: a bad parameter is a 400 in OpenAI's schema, kvserve/server/errors.py);
- what only the served models know, where kvserve/service/protocol.py marks it (`x-kvserve`): the model
  ids (and "auto"), token counts below the context length, prompt token ids below the vocabulary size,
  non-empty prompt text where a model encodes "" to no tokens (the last two known once the models are
  loaded: until then the document is made afresh on each request).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvserve.service import protocol as p
from kvserve.service.router import AUTO_MODEL

REF = "#/components/schemas/{model}"
SECURITY = {"bearerAuth": {"type": "http", "scheme": "bearer",
                           "description": "A tenant's API key (`kvserve tenants create NAME`); admin routes need "
                                          "an admin tenant's (`--admin`)."}}

# components/schemas that routes refer to: name -> (model, pydantic JSON schema mode)
_components: dict[str, tuple[type[BaseModel], str]] = {}


def _ref(model: type[BaseModel], mode: str) -> dict:
    known = _components.setdefault(model.__name__, (model, mode))
    if known != (model, mode):
        raise ValueError(f"two schemas named {model.__name__} in the OpenAPI document")
    return {"$ref": REF.format(model=model.__name__)}


def json_body(model: type[BaseModel], response: type[BaseModel] | None = None, stream: bool = False) -> dict:
    """`openapi_extra` of a route whose handler validates a JSON body with `model` (and answers `response`,
    or server-sent events of it when the request asks to `stream`)."""
    extra: dict[str, Any] = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(model, "validation")}}}}
    if response is not None:
        extra.update(json_response(response))
        if stream:  # the schema of one event (Open API 3.1 reads it so): chunks as JSON text, then [DONE]
            extra["responses"]["200"]["content"]["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
                "description": "One server-sent event: `data: <chunk JSON>`; the last is `data: [DONE]`."}}
    return extra


def multipart_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` of a route whose handler reads a multipart form with the fields of `model`."""
    return {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": _ref(model, "validation")}}}}


def json_response(model: type[BaseModel]) -> dict:
    """`openapi_extra` of a route that answers 200 with `model` as JSON."""
    return {"responses": {"200": {"description": "Successful Response", "content": {
        "application/json": {"schema": _ref(model, "serialization")}}}}}


def media_types(*types: str) -> dict:
    """`openapi_extra` of a route whose 200 may also come as these media types (besides JSON)."""
    return {"responses": {"200": {"content": {t: {"schema": {"type": "string"}} for t in types}}}}


def install(app: FastAPI) -> None:
    """Serve the completed document at app.openapi_url (kept once every model's vocabulary is known)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc, final = build(app)
            if not final:
                return doc
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def build(app: FastAPI) -> tuple[dict, bool]:
    """(the document, whether it is final: the served models' vocabularies are all known)."""
    doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                      description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which is never sent
        schemas.pop(name, None)
    _ref(p.ErrorResponse, "serialization")
    for model, mode in _components.values():
        schema = model.model_json_schema(ref_template=REF, mode=mode)
        for name, sub in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            if schemas.setdefault(name, sub) != sub:
                raise ValueError(f"two different schemas named {name} in the OpenAPI document")
    components["securitySchemes"] = SECURITY
    error = {"description": "OpenAI's error schema", "content": {"application/json": {"schema": _ref(
        p.ErrorResponse, "serialization")}}}
    for path, item in doc["paths"].items():
        for op in item.values():
            op["responses"].pop("422", None)
            if path.startswith("/v1/"):
                op["security"] = [{"bearerAuth": []}]
                op["responses"].update({"4XX": error, "5XX": error})
    return doc, _fill_served(schemas, app.state.kv.models.values())


def _fill_served(schemas: dict, handles) -> bool:
    """Fill the `x-kvserve` marks in with the served models' values; False while a vocabulary is unknown."""
    handles = list(handles)
    infos = [getattr(h.client, "info", None) for h in handles]
    values: dict[str, dict] = {}
    if handles:
        values["model"] = {"enum": sorted(h.id for h in handles) + [AUTO_MODEL]}
        values["context"] = {"maximum": max(h.max_model_len for h in handles) - 1}
    if handles and all(info is not None for info in infos):
        values["vocabulary"] = {"maximum": max(info.config.vocab_size for info in infos) - 1}
        if any(not _encodes(info, "") for info in infos):
            values["text"] = {"minLength": 1}

    def walk(node) -> None:
        if isinstance(node, dict):
            node.update(values.get(node.get("x-kvserve"), {}))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schemas)
    return all(info is not None for info in infos)


def _encodes(info, text: str) -> bool:
    try:
        return bool(info.encode(prompt=text))
    except ValueError:
        return False
