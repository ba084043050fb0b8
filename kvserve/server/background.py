"""Background tasks of the server's parts (probe loops, release loops): stopping one is cancelling it and
waiting until it has unwound."""
from __future__ import annotations

import asyncio


async def stop_task(task: asyncio.Task | None) -> None:
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
