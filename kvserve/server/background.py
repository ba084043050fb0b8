"""Background tasks of the server's parts (probe loops, release loops, lease renewals): stopping one is
cancelling it and waiting until it has unwound."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task | None) -> None:
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def renew_leases(lease_s: float, held: Callable[[], list], renew: Callable[[list], Awaitable[object]],
                       what: str) -> None:
    """Renew the store leases of what this process holds (`held()`), three times a lease, until cancelled:
    while it lives they stay its own; once it dies they lapse within a lease. A failed round is retried at the
    next: the lease has two more periods."""
    while True:
        await asyncio.sleep(lease_s / 3)
        items = held()
        if items:
            try:
                await renew(items)
            except Exception:  # noqa: BLE001 - see above
                log.warning("could not renew the leases of %s", what, exc_info=True)
