"""The HTTP side of a completion, one step per concern: accept (auth, body, validation) -> the region that serves
it (server/regions.py) -> its Idempotency-Key (replay, attach or claim) -> run it on the completion service
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
from kvserve.server.idempotency import REPLAY_HEADER, InflightResponse
from kvserve.server.in_flight import Place
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

    @property
    def key(self) -> str | None:
        """The client's Idempotency-Key, if it sent one."""
        return self.request.headers.get(IDEMPOTENCY_HEADER)

    def body(self) -> dict:
        """The validated request as JSON: what a peer region is sent and what an Idempotency-Key is bound to,
        the same wherever the call lands (the fields the client set, by their wire names; unknown fields, which
        the schema ignores, are not part of it)."""
        return self.req.model_dump(mode="json", by_alias=True, exclude_unset=True)

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
    call = await accept(request, kind)
    elsewhere = await serve_elsewhere(call)
    if elsewhere is not None:
        return elsewhere
    last_event = request.headers.get(RESUME_HEADER) if call.req.stream else None
    resume = ResumePoint.parse(last_event) if last_event else None
    answered, inflight = await claim_key(call, last_event)
    if answered is not None:
        return answered
    return await run(call, inflight, resume)


async def accept(request: Request, kind: str) -> Call:
    """Authenticate the caller, read the body and validate it (401/403, 413, 400 otherwise)."""
    state: ServerState = request.app.state.kv
    call = Call(state, kind, request)
    tenant = await authenticate(request, state.store)
    call.tenant = tenant.name
    data = await read_json_body(request, state.config.max_body_bytes)
    schema = p.ChatCompletionRequest if kind == "chat" else p.CompletionRequest
    call.req = schema.model_validate(data)
    check_tenant_claim(tenant, call.req.tenant_id)
    return call


async def serve_elsewhere(call: Call) -> Response | None:
    """The response of the peer region that serves what this one cannot now, or of the peer holding a retry's
    Idempotency-Key (server/regions.py); None: this region serves it."""
    front = call.state.regions
    if front is None:
        return None
    decision = front.decide(call.request, call.req.model, call.req.priority)
    target = decision.region if decision.region != front.local else None
    if target is None and call.key is not None:
        target = await front.retry_holder(call.request, call.tenant, call.key)
    return await forward(call, target) if target is not None else None


async def forward(call: Call, peer: str) -> Response | None:
    """The peer's response to the validated request; None when the peer could not be reached."""
    return await call.state.regions.forward(call.request, json.dumps(call.body()).encode(), peer)


async def claim_key(call: Call, last_event: str | None) -> tuple[Response | None, InflightResponse | None]:
    """With an Idempotency-Key: the stored response (a replay), the running one's (attached), or the claim this
    call records its response in (422 for the key used with another body). (None, None) without a key."""
    if call.key is None:
        return None, None
    result, inflight = await call.state.idempotency.begin(call.tenant, call.key, call.request.url.path, call.body())
    if result.outcome is BeginOutcome.REPLAY:
        return replay_response(result.response, last_event), None
    if result.outcome is BeginOutcome.IN_PROGRESS:
        return await attach_response(inflight, last_event), None
    return None, inflight


async def run(call: Call, inflight: InflightResponse | None, resume: ResumePoint | None) -> Response:
    """Run the call here; its response counts as in flight until sent (a stream's, until it ends)."""
    with call.state.in_flight.hold() as place:
        try:
            response = await produce(call, inflight, place, resume)
        except ClientDisconnected:
            response = Response(status_code=499)
        except Exception as exc:
            response = await refused(call, exc)
        if inflight is not None and not isinstance(response, SSEResponse):  # a stream records its own
            settle_key(call, inflight, response)
        return response


async def refused(call: Call, exc: Exception) -> Response:
    """The error response; for a refusal for capacity (without an Idempotency-Key), a peer with room's answer."""
    response = error_for(call, exc)
    front = call.state.regions
    if front is not None and isinstance(exc, CapacityExhausted) and call.key is None:
        peer = front.failover_peer(call.request)
        if peer is not None:
            response = await forward(call, peer) or response
    return response


def settle_key(call: Call, inflight: InflightResponse, response: Response) -> None:
    """Store a JSON response under the call's Idempotency-Key; release the key after a failure."""
    idem = call.state.idempotency
    if response.status_code == 200:
        idem.complete(call.tenant, call.key, inflight, 200, dict(response.headers), body=bytes(response.body))
    elif response.status_code == 499:  # its client left: a duplicate waiting on it is told to retry
        idem.abandon(call.tenant, call.key, inflight)
    else:
        idem.abandon(call.tenant, call.key, inflight, response.status_code, dict(response.headers),
                     bytes(getattr(response, "body", b"") or b""))


def error_for(call: Call, exc: BaseException) -> JSONResponse:
    # A request shed at admission saw a shedding server, whatever the queue shows a moment later.
    load = LoadLevel.SHEDDING if isinstance(exc, CapacityExhausted) else None
    headers = call.headers(load=load)
    if to_api_error(exc).code == "internal_error":
        return internal_error_response(exc, call.completion.response_id if call.completion else None, headers)
    return api_error_response(exc, headers)


async def produce(call: Call, inflight: InflightResponse | None, place: Place,
                  resume: ResumePoint | None = None) -> Response:
    """The service's response to the call: JSON, or a stream that holds the call's `place` in flight till it ends."""
    service = call.state.service
    c = call.completion = service.open(call.kind, call.req, call.tenant)
    place.on_release(c.release)
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
        events = stream_events(c, first_item, outputs, resume_ids=call.key is not None)
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
            place.release()
            if inflight is not None and not inflight.finished:
                call.state.idempotency.abandon(call.tenant, call.key, inflight)

        response = SSEResponse(events, headers=headers, on_close=on_close)
        place.pass_on()  # its on_close gives the place back
        return response
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
                        outputs: AsyncIterator[tuple[int, RequestOutput]], resume_ids: bool = True) -> AsyncIterator[str]:
    """SSE events of one call: the service's chunks (deltas, then usage when asked), then [DONE].

    resume_ids: content events carry resume tokens as SSE ids (service/resume.py) where the stream can be
    resumed. The server asks it where the client sent an Idempotency-Key (the retry contract: a client that
    will reconnect sends one): clients that read each event as one `data:` line (vLLM's `bench serve`) choke
    on an `id:` line, and only a reconnecting client needs it."""
    chunks = c.chunks()
    # Resume tokens (service/resume.py): after each output that did not finish its stream
    digest = TokenDigest.of(c.resumed_token_ids) if c.resumable and resume_ids else None

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
        call.state.idempotency.complete(call.tenant, call.key, inflight, 200,
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
