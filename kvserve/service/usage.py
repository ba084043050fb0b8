"""The usage ledger's writer: one row per engine request (real token counts and timings), recorded from
the engine threads' finish hooks and written through the event loop by AsyncStore's writer thread."""
from __future__ import annotations

import asyncio
import logging

from kvserve.store import AsyncStore, UsageRecord

log = logging.getLogger(__name__)


class UsageLedger:
    def __init__(self):
        self.store: AsyncStore | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    def open(self, store: AsyncStore, loop: asyncio.AbstractEventLoop) -> None:
        self.store, self.loop = store, loop

    def record_threadsafe(self, record: UsageRecord) -> None:
        """From any thread: queue the row's write on the event loop."""
        loop, store = self.loop, self.store
        if loop is None or loop.is_closed() or store is None:
            return

        def schedule():
            task = loop.create_task(store.arecord_usage(record))
            self._tasks.add(task)
            task.add_done_callback(self._done)

        try:
            loop.call_soon_threadsafe(schedule)
        except RuntimeError:  # loop closed during shutdown
            log.warning("usage record for %s dropped: event loop closed", record.request_id)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("usage record write failed", exc_info=task.exception())

    async def flush(self) -> None:
        """Wait for the rows queued so far (read-your-writes for /v1/usage, and shutdown)."""
        await asyncio.sleep(0)  # let call_soon_threadsafe callbacks already queued run
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
