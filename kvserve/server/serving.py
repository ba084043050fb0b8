"""The completion path: body -> auth -> validate -> idempotency -> route -> engine -> JSON or SSE.

One API call becomes one engine request per prompt (a chat has one; /v1/completions may carry a
list of prompts). Each engine request is accounted for by the model's on_finish hook (metrics and
one usage row with the engine's real token counts), whether it finished or was aborted.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import AsyncIterator

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvserve.engine.errors import (CapacityExhausted, ContextLengthExceeded, KVServeError, ModelWarming, QueueTimeout,
                                   ServerDraining)
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.server import protocol as p
from kvserve.server.auth import authenticate, check_tenant_claim
from kvserve.server.errors import APIError, api_error_response, to_api_error
from kvserve.server.idempotency import HEADER as IDEMPOTENCY_HEADER
from kvserve.server.idempotency import REPLAY_HEADER, IdempotencyManager, InflightResponse
from kvserve.server.router import LoadLevel
from kvserve.server.state import ModelHandle, RequestInfo, ServerState
from kvserve.server.streaming import DONE, ClientDisconnected, SSEResponse, run_until_disconnect, sse
from kvserve.store import BeginOutcome, StoredResponse

log = logging.getLogger(__name__)

MAX_DRAIN_BYTES = 64 << 20  # past the limit, read (and drop) up to this much so the client sees the 413


async def read_json_body(request: Request, limit: int) -> dict:
    """The request body as a JSON object; 413 past `limit` bytes, 400 when it is not a JSON object."""
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
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "request body is not UTF-8 JSON", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


# ---- token text for logprobs ----------------------------------------------------------------


class TokenText:
    """Decoded text of single token ids (what OpenAI shows as a logprob's `token`)."""

    def __init__(self, tokenizer):
        self._decode = lru_cache(maxsize=65536)(lambda tid: tokenizer.decode([tid]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def chat_logprobs(entries: list[Logprob] | None, text: TokenText) -> p.ChatLogprobs | None:
    if entries is None:
        return None

    def item(tid: int, lp: float) -> dict:
        t = text(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return p.ChatLogprobs(content=[p.ChatTokenLogprob(**item(e.token_id, e.logprob),
                                                      top_logprobs=[p.TopLogprob(**item(tid, lp))
                                                                    for tid, _, lp in e.top])
                                   for e in entries])


def completion_logprobs(entries: list[Logprob] | None, text: TokenText, offset: int) -> tuple[p.CompletionLogprobs | None, int]:
    if entries is None:
        return None, offset
    out = p.CompletionLogprobs()
    for e in entries:
        t = text(e.token_id)
        out.tokens.append(t)
        out.token_logprobs.append(e.logprob)
        top: dict[str, float] = {}
        for tid, _, lp in e.top:
            top.setdefault(text(tid), lp)
        out.top_logprobs.append(top or None)
        out.text_offset.append(offset)
        offset += len(t)
    return out, offset


def usage_of(finals: list[RequestOutput]) -> p.Usage:
    u = p.Usage()
    for out in finals:
        u.add(out.num_prompt_tokens, out.num_completion_tokens, min(out.num_cached_tokens, out.num_prompt_tokens))
    return u


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json")


# ---- one API call ---------------------------------------------------------------------------


@dataclass
class Call:
    """The state of one completion call while it is handled."""

    state: ServerState
    kind: str  # "chat" | "completion"
    request: Request
    req: p.ChatCompletionRequest | p.CompletionRequest | None = None
    tenant: str = ""
    handle: ModelHandle | None = None
    tier: str = "interactive"
    response_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    request_ids: list[str] = field(default_factory=list)
    queues: list[asyncio.Queue] = field(default_factory=list)
    finished: set = field(default_factory=set)
    text: TokenText | None = None

    @property
    def n(self) -> int:
        return self.req.n

    def headers(self, queue_wait_ms: float | None = None, load: LoadLevel | None = None) -> dict[str, str]:
        h = {"x-request-id": self.response_id} if self.response_id else {}
        client_id = self.req.client_request_id if self.req is not None else None
        if client_id and len(client_id) <= 128 and client_id.isascii() and client_id.isprintable():
            h["x-kvserve-client-request-id"] = client_id  # metadata.request_id, echoed for tracing
        if self.handle is not None:
            h.update(self.handle.load_headers(self.tier, queue_wait_ms, load))
        return h

    # ---- engine -----------------------------------------------------------------------------
    async def tokenize(self) -> list[list[int]]:
        llm = self.handle.llm
        try:
            if self.kind == "chat":
                return [await llm.encode(messages=self.req.template_messages())]
            return [await llm.encode(prompt=pr) for pr in self.req.prompts()]
        except KVServeError:
            raise
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error", "invalid_prompt",
                           param="messages" if self.kind == "chat" else "prompt") from None

    async def submit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Add one engine request per prompt (concurrently: one engine step applies them all)."""
        handle, max_len = self.handle, self.handle.max_model_len
        for ids in prompts:
            if len(ids) >= max_len:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {max_len} tokens; the prompt has {len(ids)} tokens.")
        self.request_ids = [f"{self.response_id}-{i}" for i in range(len(prompts))]
        for rid in self.request_ids:
            handle.register(rid, RequestInfo(self.tenant, self.tier, handle.id))
        default_max = self.state.config.default_max_tokens

        def params_for(ids: list[int]) -> SamplingParams:
            sp = copy.deepcopy(params)
            if sp.max_tokens is None:
                sp.max_tokens = max(1, min(default_max, max_len - len(ids)))
                sp.min_tokens = min(sp.min_tokens, sp.max_tokens)
            return sp

        results = await asyncio.gather(*(
            handle.llm.submit(prompt=ids, params=params_for(ids), request_id=rid, priority=self.tier,
                              tenant=self.tenant, cache_salt=self.tenant)
            for rid, ids in zip(self.request_ids, prompts)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for rid, r in zip(self.request_ids, results):
                if isinstance(r, BaseException):
                    handle.unregister(rid)
                    self.finished.add(rid)
                else:
                    handle.llm.abort(rid)
            raise errors[0]
        self.queues = [q for _, q in results]

    def abort_unfinished(self) -> None:
        for rid in self.request_ids:
            if rid not in self.finished:
                self.finished.add(rid)
                self.handle.llm.abort(rid)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, RequestOutput) from all engine requests of this call, until all finish."""
        try:
            if len(self.queues) == 1:
                q, rid = self.queues[0], self.request_ids[0]
                while True:
                    out = await q.get()
                    if out.finished:
                        self.finished.add(rid)
                    yield 0, out
                    if out.finished:
                        return
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, q: asyncio.Queue) -> None:
                while True:
                    out = await q.get()
                    await merged.put((i, out))
                    if out.finished:
                        return

            pumps = [asyncio.ensure_future(pump(i, q)) for i, q in enumerate(self.queues)]
            try:
                remaining = len(self.queues)
                while remaining:
                    i, out = await merged.get()
                    if out.finished:
                        self.finished.add(self.request_ids[i])
                        remaining -= 1
                    yield i, out
            finally:
                for t in pumps:
                    t.cancel()
        finally:
            self.abort_unfinished()


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
    idem: IdempotencyManager = state.idempotency
    key = request.headers.get(IDEMPOTENCY_HEADER)
    inflight: InflightResponse | None = None
    if key is not None:
        result, inflight = await idem.begin(call.tenant, key, request.url.path, data)
        if result.outcome is BeginOutcome.REPLAY:
            return replay_response(result.response)
        if result.outcome is BeginOutcome.IN_PROGRESS:
            return await attach_response(inflight)
    state.active_requests += 1
    owned_by_stream = False
    try:
        try:
            response = await produce(call, inflight)
        except ClientDisconnected:
            response = Response(status_code=499)
        except Exception as exc:
            response = error_for(call, exc)
        if isinstance(response, SSEResponse):
            owned_by_stream = True
        elif inflight is not None:
            if response.status_code == 200:
                idem.complete(call.tenant, key, inflight, 200, dict(response.headers), body=bytes(response.body))
            else:
                idem.abandon(call.tenant, key, inflight, response.status_code, dict(response.headers),
                             bytes(getattr(response, "body", b"") or b""))
        return response
    finally:
        if not owned_by_stream:
            state.active_requests -= 1


def error_for(call: Call, exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    if err.status >= 500 and not isinstance(exc, (KVServeError, APIError)):
        log.error("completion request failed", exc_info=exc)
    if call.handle is not None:
        reason = None
        if isinstance(exc, CapacityExhausted):
            reason = getattr(exc, "reason", "queue_full") or "queue_full"
        elif isinstance(exc, (ModelWarming, ServerDraining, ContextLengthExceeded, QueueTimeout)):
            reason = exc.code
        if reason:
            call.state.metrics.reject(call.handle.id, call.tier, reason)
    # A request shed at admission saw a shedding server, whatever the queue shows a moment later.
    load = LoadLevel.SHEDDING if isinstance(exc, CapacityExhausted) else None
    return api_error_response(exc, call.headers(load=load))


async def produce(call: Call, inflight: InflightResponse | None) -> Response:
    state, req = call.state, call.req
    call.tier = req.priority
    if state.draining:
        raise ServerDraining("the server is draining for shutdown; retry on another replica")
    call.handle = state.resolve(req.model, call.tier, req.prompt_chars())
    call.handle.check_available()
    call.response_id = ("chatcmpl-" if call.kind == "chat" else "cmpl-") + uuid.uuid4().hex
    params = req.sampling_params()
    prompts = await call.tokenize()
    call.text = TokenText(call.handle.llm.tokenizer)
    await call.submit(prompts, params)
    outputs = call.outputs()
    receive = call.request.receive
    if req.stream:
        try:
            first_item = await run_until_disconnect(receive, outputs.__anext__())
        except BaseException:
            await outputs.aclose()
            raise
        first = first_item[1]
        if first.finished and all(o.finish_reason == "queue_timeout" for o in first.outputs):
            await outputs.aclose()
            raise QueueTimeout("the request waited too long in the queue; retry later")
        headers = call.headers(_queue_wait_ms(first))
        events = stream_events(call, first_item, outputs)
        if inflight is not None:
            inflight.start(200, {**headers, "content-type": "text/event-stream"}, stream=True)
            events = record_stream(events, call, inflight, headers)
        closed = False

        def on_close() -> None:  # runs once the response ended, however it ended
            nonlocal closed
            if closed:
                return
            closed = True
            call.abort_unfinished()
            call.state.active_requests -= 1
            if inflight is not None and not inflight.finished:
                call.state.idempotency.abandon(call.tenant, call.request.headers.get(IDEMPOTENCY_HEADER), inflight)

        return SSEResponse(events, headers=headers, on_close=on_close)

    async def collect() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(finals))]

    try:
        finals = await run_until_disconnect(receive, collect())
    finally:
        await outputs.aclose()
    if any(all(o.finish_reason == "queue_timeout" for o in f.outputs) for f in finals):
        raise QueueTimeout("the request waited too long in the queue; retry later")
    body = full_response(call, finals)
    return JSONResponse(_dump(body), headers=call.headers(_queue_wait_ms(finals[0])))


def _queue_wait_ms(out: RequestOutput) -> float:
    m = out.metrics
    if m is None:
        return 0.0
    if m.queue_time is not None:
        return m.queue_time * 1000
    if m.first_scheduled_time is not None:
        return (m.first_scheduled_time - m.arrival_time) * 1000
    return 0.0


def _finish_reason(o: CompletionOutput) -> str | None:
    return o.finish_reason


def full_response(call: Call, finals: list[RequestOutput]) -> BaseModel:
    n, text = call.n, call.text
    usage = usage_of(finals)
    model = call.handle.id
    if call.kind == "chat":
        choices = []
        for i, out in enumerate(finals):
            for o in sorted(out.outputs, key=lambda o: o.index):
                choices.append(p.ChatChoice(index=i * n + o.index, message=p.ChatMessageOut(content=o.text),
                                            logprobs=chat_logprobs(o.logprobs, text),
                                            finish_reason=_finish_reason(o), stop_reason=o.stop_reason))
        return p.ChatCompletionResponse(id=call.response_id, created=call.created, model=model, choices=choices,
                                        usage=usage)
    choices = []
    for i, out in enumerate(finals):
        for o in sorted(out.outputs, key=lambda o: o.index):
            lp, _ = completion_logprobs(o.logprobs, text, 0)
            choices.append(p.CompletionChoice(index=i * n + o.index, text=o.text, logprobs=lp,
                                              finish_reason=_finish_reason(o), stop_reason=o.stop_reason))
    return p.CompletionResponse(id=call.response_id, created=call.created, model=model, choices=choices, usage=usage)


async def stream_events(call: Call, first_item: tuple[int, RequestOutput],
                        outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """SSE events of one call: one chunk per delta, then (optionally) usage, then [DONE]."""
    n, text, model = call.n, call.text, call.handle.id
    chat = call.kind == "chat"
    include_usage = call.req.include_usage
    base = {"id": call.response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": call.created, "model": model}
    if include_usage:
        base["usage"] = None
    finished: set[int] = set()
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choice: dict) -> str:
        return sse({**base, "choices": [choice]})

    def events_for(i: int, out: RequestOutput) -> list[str]:
        evs = []
        for o in out.outputs:
            idx = i * n + o.index
            if idx in finished:
                continue
            has_delta = bool(o.delta_text) or bool(o.delta_logprobs)
            if chat:
                if has_delta:
                    lp = chat_logprobs(o.delta_logprobs, text) if o.delta_logprobs else None
                    evs.append(chunk({"index": idx, "delta": {"content": o.delta_text},
                                      "logprobs": lp.model_dump(mode="json") if lp else None,
                                      "finish_reason": None}))
                if o.finish_reason is not None:
                    finished.add(idx)
                    evs.append(chunk({"index": idx, "delta": {}, "logprobs": None,
                                      "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}))
            else:
                if has_delta or o.finish_reason is not None:
                    lp, offsets[idx] = completion_logprobs(o.delta_logprobs, text, offsets.get(idx, 0)) \
                        if o.delta_logprobs else (None, offsets.get(idx, 0))
                    if o.finish_reason is not None:
                        finished.add(idx)
                    evs.append(chunk({"index": idx, "text": o.delta_text,
                                      "logprobs": lp.model_dump(mode="json") if lp else None,
                                      "finish_reason": o.finish_reason,
                                      "stop_reason": o.stop_reason if o.finish_reason else None}))
        if out.finished:
            finals[i] = out
        return evs

    try:
        if chat:
            for i in range(len(call.request_ids)):
                for k in range(n):
                    yield chunk({"index": i * n + k, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
        for ev in events_for(*first_item):
            yield ev
        async for i, out in outputs:
            for ev in events_for(i, out):
                yield ev
        if include_usage:
            usage = usage_of([finals[i] for i in sorted(finals)])
            yield sse({**base, "choices": [], "usage": usage.model_dump(mode="json")})
        yield DONE
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # headers are sent: report in-band, OpenAI-style
        log.exception("stream %s failed", call.response_id)
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


def replay_response(stored: StoredResponse) -> Response:
    headers = {k: v for k, v in stored.headers.items() if k != "content-type"}
    headers[REPLAY_HEADER] = "true"
    if stored.is_stream:
        async def events():
            for ev in stored.events:
                yield ev
        return SSEResponse(events(), status_code=stored.status_code, headers=headers)
    return Response(stored.body or b"", status_code=stored.status_code, headers=headers,
                    media_type=stored.headers.get("content-type", "application/json"))


async def attach_response(inflight: InflightResponse) -> Response:
    """A duplicate of a request still running in this process: follow its response."""
    await inflight.started.wait()
    headers = {k: v for k, v in inflight.headers.items() if k != "content-type"}
    headers[REPLAY_HEADER] = "true"
    if inflight.events is not None:
        return SSEResponse(inflight.follow_events(), status_code=inflight.status_code or 200, headers=headers)
    await inflight.wait_finished()
    if inflight.body is None:
        return api_error_response(APIError(409, "the original request with this Idempotency-Key did not complete; "
                                                "retry", "invalid_request_error", "idempotency_key_in_progress"))
    return Response(inflight.body, status_code=inflight.status_code or 200, headers=headers,
                    media_type=inflight.headers.get("content-type", "application/json"))
