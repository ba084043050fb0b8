"""The batch runner: feeds batch lines to the completion service at batch priority, in the capacity the
interactive tier leaves (the engine's scheduler serves interactive work first), durably.

Every `poll_s`: batches being cancelled end their pending lines (cancelled) and abort their lines in
flight here; batches past their completion window end their pending lines (expired); then lines are
claimed (store leases, renewed while they run) round-robin over tenants, then over each tenant's
batches, up to `max_inflight` in this server and `max_inflight_per_batch` per batch, so one tenant's
big batch does not starve another's. A line runs as one call with a key made of its batch and line, so
run again after a crash it has the same engine request ids and its usage row (keyed by them) is written
once. A full engine (429 capacity, queue timeout, a model still loading or a server draining) puts the
line back to wait; a budget that runs out fails it with insufficient_quota; another error response fails
it with that response. A batch with no line left to run is finalized: its output file (2xx lines) and
error file (the rest) are written from the lines' stored results, each line exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections import defaultdict
from typing import TYPE_CHECKING

from kvserve.batch.files import FileStore
from kvserve.batch.jobs import Batch, BatchStore
from kvserve.batch.validate import ENDPOINTS, parse
from kvserve.config import BatchConfig
from kvserve.engine.errors import (CapacityExhausted, InsufficientQuota, KVServeError, ModelWarming, QueueTimeout,
                                   ServerDraining)

if TYPE_CHECKING:
    from kvserve.service.completion import CompletionService
    from kvserve.store import AsyncStore

log = logging.getLogger(__name__)

RETRY_LATER = (CapacityExhausted, QueueTimeout, ModelWarming, ServerDraining)


class BatchRunner:
    def __init__(self, service: "CompletionService", store: "AsyncStore", files: FileStore, jobs: BatchStore,
                 config: BatchConfig):
        self.service, self.store, self.files, self.jobs, self.config = service, store, files, jobs, config
        self.owner = "runner-" + uuid.uuid4().hex[:12]
        self.inflight: dict[tuple[str, int], asyncio.Task] = {}
        self._bodies: dict[str, dict[int, dict]] = {}  # batch id -> line -> request body (read once per batch)
        self._task: asyncio.Task | None = None
        self._turn = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop taking lines; lines in flight are aborted and go back to pending for the next run."""
        if self._task is not None:
            self._task.cancel()
        tasks = list(self.inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        renew_every = max(1, int(self.config.lease_s / 3 / self.config.poll_s))
        tick = 0
        while True:
            try:
                await self.tick()
                tick += 1
                if tick % renew_every == 0 and self.inflight:
                    await self.store.awrite(self.jobs.renew, self.owner, self.config.lease_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # a store hiccup: log, keep the runner alive
                log.exception("batch runner tick failed")
            await asyncio.sleep(self.config.poll_s)

    async def tick(self) -> None:
        batches = await self.store.aread(self.jobs.active)
        now = self.jobs.db.clock()
        runnable: dict[str, list[Batch]] = defaultdict(list)
        for b in batches:
            if b.status == "cancelling":
                await self._wind_down(b, "cancelled", {"code": "batch_cancelled", "message": "the batch was cancelled"})
            elif b.expires_at is not None and now >= b.expires_at:
                await self._wind_down(b, "expired", {"code": "batch_expired",
                                                     "message": "the batch's completion window closed before this "
                                                                "line ran"})
            elif b.counts.get("pending", 0) + b.counts.get("running", 0) == 0:
                await self._finalize(b, "completed")
            else:
                runnable[b.tenant].append(b)
        await self._schedule(runnable)

    async def _schedule(self, runnable: dict[str, list[Batch]]) -> None:
        """Claim lines round-robin over tenants (then their batches) while there is room."""
        tenants = sorted(runnable)
        if not tenants:
            return
        self._turn = (self._turn + 1) % len(tenants)
        tenants = tenants[self._turn:] + tenants[:self._turn]
        per_batch = defaultdict(int)
        for key in self.inflight:
            per_batch[key[0]] += 1
        progress = True
        while progress and len(self.inflight) < self.config.max_inflight:
            progress = False
            for tenant in tenants:
                for b in runnable[tenant]:
                    if per_batch[b.id] >= self.config.max_inflight_per_batch:
                        continue
                    claimed = await self.store.awrite(self.jobs.claim, b.id, 1, self.owner, self.config.lease_s)
                    if not claimed:
                        continue
                    line, custom_id = claimed[0]
                    per_batch[b.id] += 1
                    self.inflight[b.id, line] = asyncio.get_running_loop().create_task(self._line(b, line, custom_id))
                    progress = True
                    break  # one line per tenant per turn
                if len(self.inflight) >= self.config.max_inflight:
                    return

    async def _body(self, b: Batch, line: int) -> dict:
        bodies = self._bodies.get(b.id)
        if bodies is None:
            data = await asyncio.to_thread(self.files.path(b.input_file_id).read_bytes)
            from kvserve.service.models import served_names

            lines, _ = parse(data, b.endpoint, served_names(self.service.models))
            bodies = self._bodies[b.id] = {ln.number: ln.body for ln in lines}
        return bodies[line]

    async def _line(self, b: Batch, line: int, custom_id: str) -> None:
        key = (b.id, line)
        try:
            kind, model_cls = ENDPOINTS[b.endpoint]
            req = model_cls.model_validate(await self._body(b, line)).model_copy(update={"priority": "batch"})
            state, result = "done", None
            try:
                c = self.service.open(kind, req, b.tenant, key=f"{b.id}-{line}")
                try:
                    await self.service.start(c)
                    finals = await c.finals()
                finally:
                    c.release()
                body = c.response(finals).model_dump(mode="json")
                result = _line_result(custom_id, 200, c.response_id, body)
            except RETRY_LATER:
                await self.store.awrite(self.jobs.release, b.id, line, self.owner)
                return
            except KVServeError as e:  # the line's result is the error the API would have answered
                state = "failed"
                result = _line_result(custom_id, e.http_status, None, e.error_body())
                if isinstance(e, InsufficientQuota):
                    result["error"] = {"code": "insufficient_quota", "message": str(e)}
            await self.store.awrite(self.jobs.end_line, b.id, line, state, result, self.owner)
        except asyncio.CancelledError:
            await asyncio.shield(self.store.awrite(self.jobs.release, b.id, line, self.owner))
            raise
        except Exception as e:  # a bug: the line fails with a 500, the batch goes on
            log.exception("batch %s line %d failed", b.id, line)
            await self.store.awrite(self.jobs.end_line, b.id, line, "failed",
                                    _line_result(custom_id, 500, None, {"error": {
                                        "message": f"internal error: {type(e).__name__}", "type": "server_error",
                                        "param": None, "code": "internal_error"}}), self.owner)
        finally:
            self.inflight.pop(key, None)

    async def _wind_down(self, b: Batch, state: str, error: dict) -> None:
        """Cancel or expire: pending lines end now; lines in flight here stop (cancel) or finish (expire)."""
        await self.store.awrite(self.jobs.end_pending, b.id, state, error)
        if state == "cancelled":
            for (bid, line), task in list(self.inflight.items()):
                if bid == b.id:
                    task.cancel()
            await asyncio.sleep(0)
            await self.store.awrite(self.jobs.end_pending, b.id, state, error)  # what the cancelled tasks released
        if await self.store.aread(self.jobs.unfinished, b.id) == 0:
            await self._finalize(b, state)

    async def _finalize(self, b: Batch, status: str) -> None:
        await self.store.awrite(self.jobs.set_status, b.id, "finalizing")
        rows = await self.store.aread(self.jobs.results, b.id)
        out = [r for s, r in rows if s == "done" and r]
        err = [r for s, r in rows if s != "done" and r]
        ids = {}
        for name, lines in (("output_file_id", out), ("error_file_id", err)):
            if lines:
                f = await asyncio.to_thread(self.files.output, b.tenant, f"{b.id}_{name.split('_')[0]}.jsonl",
                                            ("\n".join(lines) + "\n").encode())
                ids[name] = f.id
        await self.store.awrite(lambda: self.jobs.set_status(b.id, status, **ids))
        self._bodies.pop(b.id, None)
        log.info("batch %s %s: %d lines out, %d in the error file", b.id, status, len(out), len(err))


def _line_result(custom_id: str, status: int, request_id: str | None, body: dict) -> dict:
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def create_batch(jobs: BatchStore, files: FileStore, models: set[str], tenant: str, input_file_id: str,
                 endpoint: str, window: str, metadata: dict | None) -> Batch:
    """Validate the whole input file and create the batch (failed, naming the bad lines, or in progress)."""
    from kvserve.engine.errors import InvalidRequest

    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
    f = files.get(tenant, input_file_id)
    if f is None or f.purpose != "batch":
        raise InvalidRequest(f"no batch input file {input_file_id!r}", param="input_file_id", code="file_not_found")
    lines, errors = parse(files.path(input_file_id).read_bytes(), endpoint, models)
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidRequest("metadata must be at most 16 string keys (64 chars) to string values (512 chars)",
                             param="metadata")
    return jobs.create(tenant, input_file_id, endpoint, window, metadata, lines, errors[:100] if errors else [])

