"""The completion service: one chat or completion call, from a parsed request to typed outputs, with no
transport in it. The HTTP server, the batch runner and tests call it alike.

`CompletionService.start` routes the request (a model id, or "auto"), checks that the model can take
it, tokenizes (the model's tokenizer and chat template, from its EngineClient), and submits one engine
request per prompt (a chat has one; /v1/completions may carry a list). The returned `Completion`
yields (prompt index, RequestOutput) with deltas, or collects the finals; `responses.py` renders
them as OpenAI objects. Every engine request is accounted for by its model's finish hook (metrics and
one usage row with the engine's real token counts), whether it finished or was aborted.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial
from typing import AsyncIterator

from kvserve.config import ServerConfig
from kvserve.engine.client import EngineStatus, RequestStream, check_available
from kvserve.engine.errors import (CapacityExhausted, ContextLengthExceeded, InsufficientQuota, InvalidRequest,
                                   ModelWarming, QueueTimeout, RateLimitExceeded, ServerDraining)
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.reasoning import ThinkingControl
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import SamplingParams
from kvserve.service import protocol as p
from kvserve.service.gate import MeteringGate
from kvserve.service.metrics import ServerMetrics
from kvserve.service.models import ClientFactory, ModelHandle, RequestInfo, calibrated_client, resolve_served
from kvserve.service.reasoning import ThinkingFormat
from kvserve.service.residency import ModelState, to_unload
from kvserve.service.responses import StreamChunks, TokenText, full_response
from kvserve.service.resume import ResumeMismatch, ResumePoint, TokenDigest, resumable
from kvserve.service.tool_formats import ToolFormat
from kvserve.service.usage import UsageLedger

# Calls with up to this many prompt characters (about 2k tokens) are tokenized on the event loop (about a
# millisecond): a worker thread would first have to win a core from the engine's threads, which under
# load costs more than the tokenizing. Longer ones go to a worker thread (tokenizers release the GIL).
INLINE_ENCODE_CHARS = 8192

Request = p.ChatCompletionRequest | p.CompletionRequest


@dataclass
class Completion:
    """One call in flight: its engine requests and their merged outputs."""

    handle: ModelHandle
    kind: str  # "chat" | "completion"
    req: Request
    tenant: str
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    request_ids: list[str] = field(default_factory=list)
    streams: list[RequestStream] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    text: TokenText | None = None
    service: "CompletionService | None" = None
    rate_headers: dict[str, str] = field(default_factory=dict)  # the tenant's x-ratelimit-* after admission
    # A stream resumed from a client's Last-Event-ID (service/resume.py): where it stopped, and the tokens it
    # had received, generated again here (the engine continues from them).
    resume: ResumePoint | None = None
    resumed_token_ids: list[int] = field(default_factory=list)
    # A chat on a thinking model (service/reasoning.py): its tags, and per prompt the engine's control of the
    # output's block (empty: the output is all answer)
    reasoning: ThinkingFormat | None = None
    thinking: list[ThinkingControl] = field(default_factory=list)
    # A chat: the format its model writes tool calls in (service/tool_formats.py), for its prompt and its calls
    tool_format: ToolFormat | None = None
    adapter: str | None = None  # the LoRA adapter the request named (its `model`), or None: the base model
    released: bool = False  # its model's count of open calls was given back (release)

    def release(self) -> None:
        """The call's response has ended: its model may be unloaded again (models loaded by demand)."""
        if not self.released:
            self.released = True
            self.handle.users -= 1

    @property
    def resumable(self) -> bool:
        """Its stream's events carry resume tokens."""
        return resumable(self.kind, self.req)

    @property
    def tier(self) -> str:
        return self.req.priority

    @property
    def n(self) -> int:
        return self.req.n

    @property
    def model(self) -> str:
        """What responses name: the model, or the adapter as the request named it."""
        return self.handle.id if self.adapter is None else self.req.model

    @property
    def model_version(self) -> str:
        """The version label of the weights that serve this call (in a fleet: the replica's, which a rolling
        update may make newer than the gateway's config)."""
        served = getattr(self.streams[0], "model_version", None) if self.streams else None
        return served or self.handle.spec.version

    @property
    def num_prompts(self) -> int:
        return len(self.request_ids)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, RequestOutput) from all engine requests of this call, until all finish; closing
        the iterator early aborts the unfinished ones."""
        try:
            if len(self.streams) == 1:
                async for out in self.streams[0]:
                    if out.finished:
                        self.finished.add(self.request_ids[0])
                    yield 0, out
                return
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: RequestStream) -> None:
                async for out in stream:
                    await merged.put((i, out))

            pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
            try:
                remaining = len(self.streams)
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

    def abort_unfinished(self) -> None:
        for rid in self.request_ids:
            if rid not in self.finished:
                self.finished.add(rid)
                self.handle.client.abort(rid)

    def check_not_timed_out(self, out: RequestOutput) -> None:
        """A request that waited past its tier's queue deadline comes back finished with no tokens."""
        if out.finished and all(o.finish_reason == "queue_timeout" for o in out.outputs):
            exc = QueueTimeout("the request waited too long in the queue; retry later")
            if self.service is not None:
                self.service.count_rejection(self.handle, self.tier, exc)
            raise exc

    async def finals(self) -> list[RequestOutput]:
        """The finished RequestOutput of each prompt, in prompt order."""
        found: dict[int, RequestOutput] = {}
        outputs = self.outputs()
        try:
            async for i, out in outputs:
                if out.finished:
                    found[i] = out
        finally:
            await outputs.aclose()
        finals = [found[i] for i in range(len(found))]
        for out in finals:
            self.check_not_timed_out(out)
        return finals

    def response(self, finals: list[RequestOutput]) -> p.ChatCompletionResponse | p.CompletionResponse:
        return full_response(self, finals)

    def chunks(self) -> StreamChunks:
        return StreamChunks(self)


log = logging.getLogger(__name__)


def _warming(message: str) -> ModelWarming:
    e = ModelWarming(message)
    e.retry_after = 5.0
    return e


class CompletionService:
    """The served models and the completion path over them."""

    def __init__(self, config: ServerConfig, client_factory: ClientFactory = calibrated_client):
        self.config = config
        self.metrics = ServerMetrics(config.metrics_window_s, live=lambda: [h.live_stats()
                                                                          for h in self.models.values()],
                                     load_samples=config.load_history_samples)
        self.ledger = UsageLedger()
        self.metering = MeteringGate()
        self.models: dict[str, ModelHandle] = {
            m.id: ModelHandle(m, config, self.metrics, self.ledger, client_factory) for m in config.models}
        self.draining = False
        self._residency = asyncio.Lock()  # one load (and the unloads that make room for it) at a time

    def open(self, kind: str, req: Request, tenant: str, key: str | None = None) -> Completion:
        """A call routed to its model (the id it names, or the "auto" policy's choice), not yet started.
        `key`: a stable id for the call instead of a random one (a batch line: run again after a restart,
        it has the same engine request ids, so its usage row, keyed by them, is written once)."""
        if self.draining:
            raise ServerDraining("the server is draining for shutdown; retry on another replica")
        handle, adapter = resolve_served(self.models, self.config, req.model, req.priority, req.prompt_chars())
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        # Open on its model from now until the caller's release(): never unloaded under it (ensure_loaded).
        handle.users += 1
        handle.last_used = time.monotonic()
        return Completion(handle, kind, req, tenant, prefix + (key or uuid.uuid4().hex), service=self, adapter=adapter)

    async def ensure_loaded(self, handle: ModelHandle) -> None:
        """A model loaded by demand, loaded and ready: the least recently used idle ones unloaded first where the
        model memory needs it (service/residency.py). ModelWarming (503, Retry-After) once load_wait_s has passed
        without room or without the load finishing; the load goes on."""
        if not handle.on_demand:
            return
        if handle.started and not handle.unloading:
            return await self._wait_ready(handle, time.monotonic() + self.config.load_wait_s)
        deadline = time.monotonic() + self.config.load_wait_s
        async with self._residency:
            while not handle.started:
                # A model still loading is not unloaded: its load would go on in its thread, past the stop.
                states = [ModelState(m.id, m.resident_bytes(), m.started, m.users > 0, m.last_used,
                                     m.on_demand and not m.pinned and m.status is not EngineStatus.WARMING)
                          for m in self.models.values()]
                victims = to_unload(states, handle.id, self.config.model_memory)
                if victims is not None:
                    await self._unload([self.models[v] for v in victims])
                    handle.start()
                    log.info("loading model %s by demand%s", handle.id,
                             f" (unloaded {', '.join(victims)})" if victims else "")
                    break
                if time.monotonic() >= deadline:
                    raise _warming(f"model {handle.id} is not loaded, and the loaded models that hold the model "
                                   "memory are busy or pinned; retry shortly")
                await asyncio.sleep(0.1)
        await self._wait_ready(handle, deadline)

    async def unload(self, handle: ModelHandle) -> None:
        """An admin's unload of an idle model loaded by demand (under the residency lock: no load meanwhile)."""
        async with self._residency:
            if handle.started and not handle.users:
                await self._unload([handle])

    async def sleep(self, handle: ModelHandle):
        """An admin's sleep of an idle loaded model (engine/worker/sleep.py): its weights paged out to
        <home>/sleep and its KV memory freed; the next request wakes it. The SleepReport."""
        from kvserve.config import kvserve_home

        directory = kvserve_home(self.config.home) / "sleep"
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        async with self._residency:
            return await handle.client.sleep(str(directory))

    async def _unload(self, handles: list[ModelHandle]) -> None:
        for h in handles:
            h.unloading = True
        try:
            for h in handles:
                await asyncio.to_thread(h.unload)
                log.info("unloaded model %s to make room", h.id)
        finally:
            for h in handles:
                h.unloading = False

    async def _wait_ready(self, handle: ModelHandle, deadline: float) -> None:
        while handle.status is EngineStatus.WARMING and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if handle.status is EngineStatus.WARMING and handle.on_demand:
            raise _warming(f"model {handle.id} is loading; retry shortly")

    async def start(self, c: Completion) -> Completion:
        """Check availability, tokenize and submit the call's engine requests; typed errors when refused."""
        try:
            await self.ensure_loaded(c.handle)
            check_available(c.handle.client)
            prompts = await self._tokenize(c)
            c.text = TokenText(c.handle.client.tokenizer)
            params = c.req.sampling_params(c.tool_format)
            prompts = plan_thinking(c, prompts, params)
            if c.resume is not None:
                c.resumed_token_ids = await self._generate_again(c, prompts, params)
            await self._submit(c, prompts, params)
            return c
        except Exception as exc:
            self.count_rejection(c.handle, c.tier, exc)
            raise

    def count_rejection(self, handle: ModelHandle, tier: str, exc: BaseException) -> None:
        """Requests refused at admission, by reason (kvserve:requests_rejected_total)."""
        reason = None
        if isinstance(exc, CapacityExhausted):
            reason = getattr(exc, "reason", "queue_full") or "queue_full"
        elif isinstance(exc, (ModelWarming, ServerDraining, ContextLengthExceeded, QueueTimeout, InsufficientQuota,
                              RateLimitExceeded)):
            reason = exc.code
        if reason:
            self.metrics.reject(handle.id, tier, reason)

    async def _tokenize(self, c: Completion) -> list[list[int]]:
        info = c.handle.client.info
        if info is None:
            raise ModelWarming(f"model {c.handle.id} is still loading; retry shortly")
        if c.kind == "chat":  # the template gets the request's chat_template_kwargs beside the messages
            c.tool_format = c.handle.tool_format
            messages, tools = c.req.prompt(info.tokenizer.renders_tools, c.tool_format)
            variables = c.req.chat_template_kwargs or {}
            jobs = [partial(info.tokenizer.encode_chat, messages, tools=tools, **variables)]
            param = "messages"
        else:
            jobs, param = [partial(info.encode, prompt=pr) for pr in c.req.prompts()], "prompt"

        def encode_all() -> list[list[int]]:
            try:
                return [job() for job in jobs]
            except ValueError as e:
                raise InvalidRequest(str(e), param=param, code="invalid_prompt") from None
            except TypeError as e:  # the template's own expressions on the request's variables (1 < "a")
                if c.kind != "chat" or not c.req.chat_template_kwargs:
                    raise
                raise InvalidRequest(f"the chat template failed on chat_template_kwargs: {e}",
                                     param="chat_template_kwargs", code="invalid_prompt") from None

        if c.req.prompt_chars() <= INLINE_ENCODE_CHARS:
            return encode_all()
        return await asyncio.to_thread(encode_all)

    async def _generate_again(self, c: Completion, prompts: list[list[int]], params: SamplingParams) -> list[int]:
        """The tokens a resumed stream's client received, generated again (not billed: the region that sent
        them bills them, if it lived to write its usage row) and checked against the client's digest."""
        point = c.resume
        if not c.resumable:
            raise InvalidRequest("only a streamed, single-choice, greedy or seeded request without tools can be "
                                 "resumed from Last-Event-ID", param="Last-Event-ID", code="not_resumable")
        if params.max_tokens is not None and point.count >= params.max_tokens:
            raise InvalidRequest("Last-Event-ID is past the request's max_tokens", param="Last-Event-ID",
                                 code="invalid_last_event_id")
        again = replace(params, max_tokens=point.count, min_tokens=min(params.min_tokens, point.count))
        request = EngineRequest(f"{c.response_id}-again", prompts[0], again, c.tier, c.tenant, cache_salt=c.tenant,
                                thinking=c.thinking[0] if c.thinking else None, lora=c.adapter)
        tokens: list[int] = []
        async for out in await c.handle.client.submit(request):
            tokens = list(out.outputs[0].token_ids) if out.finished else tokens
        if TokenDigest.of(tokens).point() != point:
            raise ResumeMismatch("the stream cannot be resumed here: its tokens generated again differ from those "
                                 "the client received (another model version, or other numerics); send the request "
                                 "again without Last-Event-ID")
        return tokens

    async def _submit(self, c: Completion, prompts: list[list[int]], params: SamplingParams) -> None:
        """One engine request per prompt, submitted together (one engine step applies them all)."""
        handle, max_len = c.handle, c.handle.max_model_len
        retention, limit = c.req.cache_retention_s, self.config.retention_limit_s(c.tenant)
        if retention > limit:
            raise InvalidRequest(f"prompt_cache_retention of {retention:g} s exceeds tenant {c.tenant}'s limit of "
                                 f"{limit:g} s", param="prompt_cache_retention", code="invalid_value")
        c.request_ids = [f"{c.response_id}-{i}" for i in range(len(prompts))]
        for rid in c.request_ids:
            handle.register(rid, RequestInfo(c.tenant, c.tier, handle.id, c.adapter))
        default_max = self.config.default_max_tokens

        def params_for(ids: list[int]) -> SamplingParams:
            if params.max_tokens is not None:
                return params
            # the default, capped by what the context leaves (the engine checks it)
            max_tokens = max(1, min(default_max, max_len - len(ids)))
            return replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

        thinking = c.thinking or [None] * len(prompts)
        requests = [EngineRequest(rid, ids, params_for(ids), c.tier, c.tenant, cache_salt=c.tenant,
                                  cache_retention_s=retention, cache_key=c.req.prompt_cache_key,
                                  resumed_token_ids=tuple(c.resumed_token_ids), thinking=control, lora=c.adapter)
                    for rid, ids, control in zip(c.request_ids, prompts, thinking)]
        try:
            rate = await self.metering.admit(c.tenant, handle.id, handle.price_for(c.adapter), c.tier,
                                             [(r.request_id, len(r.prompt_token_ids), r.params.max_tokens * r.params.n)
                                              for r in requests])
            c.rate_headers = rate.headers() if rate is not None else {}
        except BaseException:
            for rid in c.request_ids:
                c.finished.add(rid)
                handle.unregister(rid)
            raise
        results = await asyncio.gather(*(handle.client.submit(r) for r in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            never_ran = []
            for rid, r in zip(c.request_ids, results):
                c.finished.add(rid)
                if isinstance(r, BaseException):
                    handle.unregister(rid)
                    never_ran.append(rid)
                else:
                    handle.client.abort(rid)  # its usage row settles its hold
            await self.metering.release(c.tenant, never_ran)
            raise errors[0]
        c.streams = list(results)


def plan_thinking(c: Completion, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """For a chat on a thinking model: each prompt's control of its output's block (where it starts, the budget),
    maybe with the open tag added to the prompt (service/reasoning.py). /v1/completions' text is not parsed."""
    fmt = c.handle.thinking if c.kind == "chat" else None
    if fmt is None:
        return prompts
    tokenizer = c.handle.client.tokenizer
    planned = [fmt.plan(tokenizer, ids, c.req.thinking_budget, params.structured_outputs is not None)
               for ids in prompts]
    c.reasoning, c.thinking = fmt, [control for _, control in planned]
    return [ids for ids, _ in planned]
