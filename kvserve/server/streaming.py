"""Server-sent events: encoding, and a response that always closes its event generator.

Starlette's StreamingResponse can leave the body generator suspended at a `yield` when the client
goes away (nobody resumes or closes it until garbage collection), and then the engine request
would keep its KV blocks. `SSEResponse` races the pump against `http.disconnect` and closes the
generator in every case, so the generator's `finally` (which aborts the engine request) runs at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(data: dict | str, event_id: str | None = None) -> str:
    """One SSE event carrying a JSON object (or a raw string), with its `id` when given (a resume token)."""
    if not isinstance(data, str):
        data = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"id: {event_id}\ndata: {data}\n\n" if event_id else f"data: {data}\n\n"


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], status_code: int = 200, headers: Mapping[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close
        self.status_code = status_code
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **dict(headers or {})})

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _watch(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(self._watch(receive))
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                pump.result()
        finally:
            watch.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
            with contextlib.suppress(Exception):
                await self.events.aclose()
            if self.on_close is not None:
                self.on_close()


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(receive: Receive, coro):
    """Await `coro`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()
