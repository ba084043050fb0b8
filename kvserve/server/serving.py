"""The HTTP side of a completion: body -> auth -> validate -> idempotency -> the completion service
(kvserve/service: route, tokenize, submit, account) -> JSON or SSE, with the load headers.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvserve.engine.errors import CapacityExhausted
from kvserve.engine.outputs import RequestOutput
from kvserve.server.auth import authenticate, check_tenant_claim
from kvserve.server.errors import APIError, api_error_response, internal_error_response, to_api_error
from kvserve.server.idempotency import HEADER as IDEMPOTENCY_HEADER
from kvserve.server.idempotency import REPLAY_HEADER, IdempotencyManager, InflightResponse
from kvserve.server.regions import REGION_HEADER
from kvserve.server.state import ServerState
from kvserve.server.streaming import DONE, ClientDisconnected, SSEResponse, run_until_disconnect, sse
from kvserve.service import protocol as p
from kvserve.service.completion import Completion
from kvserve.service.resume import HEADER as RESUME_HEADER
from kvserve.service.resume import ResumePoint, TokenDigest
from kvserve.service.router import LoadLevel
from kvserve.store import BeginOutcome, StoredResponse

log = logging.getLogger(__name__)

MAX_DRAIN_BYTES = 64 << 20  # past the limit, read (and drop) up to this much so the client sees the 413


async def read_json_body(request: Request, limit: int) -> dict:
    """The request body as a JSON object; 413 past `limit` bytes, 400 when it is not strict JSON (p.parse_json) or
    not an object."""
    too_large = APIError(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                         "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_DRAIN_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > MAX_DRAIN_BYTES:
                break
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body", code="client_disconnected") from None
    if size > limit:
        raise too_large
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = p.parse_json(raw)
    except p.InvalidJSON as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


@dataclass
class Call:
    """One HTTP completion call while it is handled: the request, and the service's Completion once started."""

    state: ServerState
    kind: str  # "chat" | "completion"
    request: Request
    req: p.ChatCompletionRequest | p.CompletionRequest | None = None
    tenant: str = ""
    completion: Completion | None = None  # once routed

    def headers(self, queue_wait_ms: float | None = None, load: LoadLevel | None = None) -> dict[str, str]:
        c = self.completion
        h = {"x-request-id": c.response_id} if c is not None else {}
        client_id = self.req.client_request_id if self.req is not None else None
        if client_id and len(client_id) <= 128 and client_id.isascii() and client_id.isprintable():
            h["x-kvserve-client-request-id"] = client_id  # metadata.request_id, echoed for tracing
        if c is not None:
            h.update(c.handle.load_headers(c.tier, queue_wait_ms, load))
            h["x-kvserve-model-version"] = c.model_version
            h["x-kvserve-kv-policy"] = c.handle.engine_config.kv_policy_label
            h.update(c.rate_headers)
        if self.state.regions is not None:
            h[REGION_HEADER] = self.state.regions.local
        return h


async def handle_completion(request: Request, kind: str) -> Response:
    """POST /v1/chat/completions (kind="chat") and /v1/completions (kind="completion")."""
    state: ServerState = request.app.state.kv
    call = Call(state, kind, request)
    tenant = await authenticate(request, state.store)
    call.tenant = tenant.name
    data = await read_json_body(request, state.config.max_body_bytes)
    schema = p.ChatCompletionRequest if kind == "chat" else p.CompletionRequest
    call.req = schema.model_validate(data)
    check_tenant_claim(tenant, call.req.tenant_id)
    key = request.headers.get(IDEMPOTENCY_HEADER)
    front = state.regions
    if front is not None:  # another region serves what this one cannot now (server/regions.py)
        decision = front.decide(request, call.req.model, call.req.priority)
        target = decision.region if decision.region != front.local else None
        if target is None and key is not None and not front.is_forwarded(request) and front.is_retry(request) \
                and await state.store.aidempotency_state(call.tenant, key) is None:
            target = await front.key_holder(request, key)  # a retry of a request another region holds
        if target is not None:
            forwarded = await front.forward(request, json.dumps(data).encode(), target)
            if forwarded is not None:
                return forwarded
    idem: IdempotencyManager = state.idempotency
    inflight: InflightResponse | None = None
    last_event = request.headers.get(RESUME_HEADER) if call.req.stream else None
    resume = ResumePoint.parse(last_event) if last_event else None
    if key is not None:
        result, inflight = await idem.begin(call.tenant, key, request.url.path, data)
        if result.outcome is BeginOutcome.REPLAY:
            return replay_response(result.response, last_event)
        if result.outcome is BeginOutcome.IN_PROGRESS:
            return await attach_response(inflight, last_event)
    state.active_requests += 1
    owned_by_stream = False
    try:
        try:
            response = await produce(call, inflight, resume)
        except ClientDisconnected:
            response = Response(status_code=499)
        except Exception as exc:
            response = error_for(call, exc)
            peer = front.failover_peer(request) if front is not None and isinstance(exc, CapacityExhausted) \
                and key is None else None
            if peer is not None:  # refused here for capacity: a peer with room takes it
                response = await front.forward(request, json.dumps(data).encode(), peer) or response
        if isinstance(response, SSEResponse):
            owned_by_stream = True
        elif inflight is not None:
            if response.status_code == 200:
                idem.complete(call.tenant, key, inflight, 200, dict(response.headers), body=bytes(response.body))
            elif response.status_code == 499:  # its client left: a duplicate waiting on it is told to retry
                idem.abandon(call.tenant, key, inflight)
            else:
                idem.abandon(call.tenant, key, inflight, response.status_code, dict(response.headers),
                             bytes(getattr(response, "body", b"") or b""))
        return response
    finally:
        if not owned_by_stream:
            state.active_requests -= 1


def error_for(call: Call, exc: BaseException) -> JSONResponse:
    # A request shed at admission saw a shedding server, whatever the queue shows a moment later.
    load = LoadLevel.SHEDDING if isinstance(exc, CapacityExhausted) else None
    headers = call.headers(load=load)
    if to_api_error(exc).code == "internal_error":
        return internal_error_response(exc, call.completion.response_id if call.completion else None, headers)
    return api_error_response(exc, headers)


async def produce(call: Call, inflight: InflightResponse | None, resume: ResumePoint | None = None) -> Response:
    service = call.state.service
    c = call.completion = service.open(call.kind, call.req, call.tenant)
    c.resume = resume
    await service.start(c)
    receive = call.request.receive
    if call.req.stream:
        outputs = c.outputs()
        try:
            first_item = await run_until_disconnect(receive, outputs.__anext__())
            c.check_not_timed_out(first_item[1])
        except BaseException:
            await outputs.aclose()
            raise
        headers = call.headers(_queue_wait_ms(first_item[1]))
        events = stream_events(c, first_item, outputs)
        if inflight is not None:
            inflight.start(200, {**headers, "content-type": "text/event-stream"}, stream=True)
            events = record_stream(events, call, inflight, headers)
        closed = False

        def on_close() -> None:  # runs once the response ended, however it ended
            nonlocal closed
            if closed:
                return
            closed = True
            c.abort_unfinished()
            call.state.active_requests -= 1
            if inflight is not None and not inflight.finished:
                call.state.idempotency.abandon(call.tenant, call.request.headers.get(IDEMPOTENCY_HEADER), inflight)

        return SSEResponse(events, headers=headers, on_close=on_close)
    finals = await run_until_disconnect(receive, c.finals())
    return JSONResponse(c.response(finals).model_dump(mode="json"), headers=call.headers(_queue_wait_ms(finals[0])))


def _queue_wait_ms(out: RequestOutput) -> float:
    m = out.metrics
    if m is None:
        return 0.0
    if m.queue_time is not None:
        return m.queue_time * 1000
    if m.first_scheduled_time is not None:
        return (m.first_scheduled_time - m.arrival_time) * 1000
    return 0.0


async def stream_events(c: Completion, first_item: tuple[int, RequestOutput],
                        outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """SSE events of one call: the service's chunks (deltas, then usage when asked), then [DONE]."""
    chunks = c.chunks()
    # Resume tokens (service/resume.py): after each output that did not finish its stream
    digest = TokenDigest.of(c.resumed_token_ids) if c.resumable else None

    def events_of(i: int, out: RequestOutput) -> list[str]:
        event_id = None
        if digest is not None:
            digest.add(out.outputs[0].delta_token_ids)
            event_id = digest.point().encode() if digest.count and not out.finished else None
        return [sse(chunk, event_id) for chunk in chunks.of(i, out)]

    try:
        for chunk in ([] if c.resume is not None else chunks.opening()):  # a resumed client has the opening
            yield sse(chunk)
        for ev in events_of(*first_item):
            yield ev
        async for i, out in outputs:
            for ev in events_of(i, out):
                yield ev
        for chunk in chunks.closing():
            yield sse(chunk)
        yield DONE
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # headers are sent: report in-band, OpenAI-style
        log.exception("stream %s failed", c.response_id)
        err = to_api_error(exc)
        yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
    finally:
        with contextlib.suppress(Exception):
            await outputs.aclose()


async def record_stream(events: AsyncIterator[str], call: Call, inflight: InflightResponse,
                        headers: dict[str, str]) -> AsyncIterator[str]:
    """Record the SSE events for Idempotency-Key replays; store them once [DONE] went out.

    An incomplete stream is abandoned by the response's on_close (the key can then be retried).
    """
    try:
        async for ev in events:
            inflight.add_event(ev)
            yield ev
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()
    if inflight.events and inflight.events[-1] == DONE:
        call.state.idempotency.complete(call.tenant, call.request.headers.get(IDEMPOTENCY_HEADER), inflight, 200,
                                        {**headers, "content-type": "text/event-stream"}, events=list(inflight.events))


async def _after_event(events: AsyncIterator[str], last_event: str | None) -> AsyncIterator[str]:
    """The events after the one whose id is `last_event` (all of them without one): a client that resumes a
    stream its region still has gets only what it missed."""
    mark = f"id: {last_event}\n" if last_event else None
    async for ev in events:
        if mark is None:
            yield ev
        elif ev.startswith(mark):
            mark = None


def replay_response(stored: StoredResponse, last_event: str | None = None) -> Response:
    headers = {k: v for k, v in stored.headers.items() if k != "content-type"}
    headers[REPLAY_HEADER] = "true"
    if stored.is_stream:
        async def events():
            for ev in stored.events:
                yield ev
        return SSEResponse(_after_event(events(), last_event), status_code=stored.status_code, headers=headers)
    return Response(stored.body or b"", status_code=stored.status_code, headers=headers,
                    media_type=stored.headers.get("content-type", "application/json"))


async def attach_response(inflight: InflightResponse, last_event: str | None = None) -> Response:
    """A duplicate of a request still running in this process: follow its response."""
    await inflight.started.wait()
    headers = {k: v for k, v in inflight.headers.items() if k != "content-type"}
    headers[REPLAY_HEADER] = "true"
    if inflight.events is not None:
        return SSEResponse(_after_event(inflight.follow_events(), last_event), status_code=inflight.status_code or 200,
                           headers=headers)
    await inflight.wait_finished()
    if inflight.body is None:
        return api_error_response(APIError(409, "the original request with this Idempotency-Key did not complete; "
                                                "retry", "invalid_request_error", "idempotency_key_in_progress"))
    return Response(inflight.body, status_code=inflight.status_code or 200, headers=headers,
                    media_type=inflight.headers.get("content-type", "application/json"))
