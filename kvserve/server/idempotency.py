"""Idempotency-Key handling on top of the store's begin/complete/abandon protocol.

The key is scoped to the tenant; the body hash covers the route and the parsed JSON body, so the
same key on another route or with another body is `idempotency_key_reused` (422). Only successful
(200) responses are stored; a failure abandons the key so that a retry runs afresh. While the first
request runs, a duplicate in this process attaches to it (`InflightResponse`): it receives the same
body, or the SSE events so far and then the rest as they are produced.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from kvserve.server.background import renew_leases, stop_task
from kvserve.server.errors import APIError
from kvserve.store import AsyncStore, BeginOutcome, BeginResult, StoredResponse, request_body_hash


HEADER = "idempotency-key"
REPLAY_HEADER = "x-kvserve-idempotent-replay"
STORED_HEADERS = ("content-type", "x-kvserve-model", "x-kvserve-queue-depth", "x-kvserve-queue-wait-ms",
                  "x-kvserve-load", "x-request-id", "x-kvserve-region")


def body_hash(route: str, body: object) -> str:
    return request_body_hash({"route": route, "body": body})


def stored_headers(headers) -> dict[str, str]:
    return {k: v for k, v in ((k.lower(), v) for k, v in dict(headers).items()) if k in STORED_HEADERS}


class InflightResponse:
    """The response of a NEW request as it is produced, for duplicates that arrive meanwhile."""

    def __init__(self) -> None:
        self.status_code: int | None = None
        self.headers: dict[str, str] = {}
        self.body: bytes | None = None
        self.events: list[str] | None = None
        self.started = asyncio.Event()  # status and headers known
        self.finished = False
        self.failed = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def start(self, status_code: int, headers: dict[str, str], stream: bool) -> None:
        self.status_code, self.headers = status_code, stored_headers(headers)
        if stream:
            self.events = []
        self.started.set()
        self._notify()

    def add_event(self, event: str) -> None:
        self.events.append(event)
        self._notify()

    def finish(self, body: bytes | None = None, failed: bool = False) -> None:
        if body is not None:
            self.body = body
        self.finished, self.failed = True, failed
        self.started.set()
        self._notify()

    async def wait_finished(self) -> None:
        while not self.finished:
            await self._changed.wait()

    async def follow_events(self) -> AsyncIterator[str]:
        i = 0
        while True:
            events = self.events or []
            while i < len(events):
                yield events[i]
                i += 1
            if self.finished:
                return
            await self._changed.wait()


class IdempotencyManager:
    def __init__(self, store: AsyncStore, spawn: Callable):
        self.store = store
        self.spawn = spawn  # schedules a coroutine as a tracked background task
        self.inflight: dict[tuple[str, str], InflightResponse] = {}
        self._renewer: asyncio.Task | None = None

    def start(self) -> None:
        """Renew the store leases of this process's keys in progress until stop(): while it lives its keys stay
        claimed; if it dies, a retry after the lease runs afresh (not a 409 for a day)."""
        self._renewer = asyncio.get_running_loop().create_task(renew_leases(
            self.store.store.idempotency.lease_s, lambda: list(self.inflight), self.store.arenew_idempotent,
            "idempotency keys in progress"))

    async def stop(self) -> None:
        await stop_task(self._renewer)
        self._renewer = None

    async def begin(self, tenant: str, key: str, route: str, body: object) -> tuple[BeginResult, InflightResponse | None]:
        try:
            result = await self.store.abegin_idempotent(tenant, key, body_hash(route, body))
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error", "invalid_idempotency_key",
                           param="Idempotency-Key") from None
        if result.outcome is BeginOutcome.MISMATCH:
            raise APIError(422, "Idempotency-Key was already used with a different request body",
                           "invalid_request_error", "idempotency_key_reused", param="Idempotency-Key")
        if result.outcome is BeginOutcome.NEW:
            inflight = InflightResponse()
            self.inflight[(tenant, key)] = inflight
            return result, inflight
        if result.outcome is BeginOutcome.IN_PROGRESS:
            for _ in range(100):  # the NEW request registers right after its own begin() returns
                inflight = self.inflight.get((tenant, key))
                if inflight is not None:
                    return result, inflight
                await asyncio.sleep(0.01)
            raise APIError(409, "A request with this Idempotency-Key is still in progress; retry later",
                           "invalid_request_error", "idempotency_key_in_progress", param="Idempotency-Key",
                           headers={"Retry-After": "1"})
        return result, None

    def complete(self, tenant: str, key: str, inflight: InflightResponse, status_code: int,
                 headers: dict[str, str], body: bytes | None = None, events: list[str] | None = None) -> None:
        inflight.finish(body)
        self.inflight.pop((tenant, key), None)
        response = StoredResponse(status_code=status_code, headers=stored_headers(headers), body=body, events=events)
        self.spawn(self.store.acomplete_idempotent(tenant, key, response))

    def abandon(self, tenant: str, key: str, inflight: InflightResponse, status_code: int | None = None,
                headers: dict[str, str] | None = None, body: bytes | None = None) -> None:
        """The NEW request failed: release the key; attached duplicates get the same failure."""
        if status_code is not None and inflight.status_code is None:
            inflight.start(status_code, headers or {}, stream=False)
        inflight.finish(body, failed=True)
        self.inflight.pop((tenant, key), None)
        self.spawn(self.store.aabandon_idempotent(tenant, key))
