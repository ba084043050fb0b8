"""FleetClient's migration and refusal handling against fake replicas (no Ray, no model): a stream that
loses its replica goes on elsewhere from the last token sent, is reported once with the real totals, and
fails cleanly (finish reason "error", ModelFailed) past the migration limit or for n > 1."""
from __future__ import annotations

import asyncio

import pytest

from kvserve.config import FleetConfig, ServedModel
from kvserve.engine.client import EngineStatus
from kvserve.engine.errors import CapacityExhausted, ModelFailed, to_wire
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import SamplingParams
from kvserve.fleet import wire
from kvserve.fleet.client import FleetClient


class FakeReplica:
    """Emits token 100 + i for position i, two per message; dies after `die_after` tokens if set."""

    def __init__(self, rid: str, die_after: int | None = None, refuse: Exception | None = None):
        self.rid, self.die_after, self.refuse = rid, die_after, refuse
        self.calls: list[tuple[EngineRequest, dict]] = []

    async def generate(self, request: EngineRequest, route: dict):
        self.calls.append((request, route))
        if self.refuse is not None:
            yield (wire.REFUSED, self.rid, to_wire(self.refuse))
            return
        yield (wire.ACCEPTED, self.rid, "v1")
        start = len(request.resumed_token_ids)
        total = request.params.max_tokens
        pos, charged = start, 0.0
        while pos < total:
            if self.die_after is not None and pos >= self.die_after:
                raise ConnectionError(f"replica {self.rid} died")
            toks = list(range(100 + pos, 100 + min(pos + 2, total)))
            pos += len(toks)
            done = pos >= total
            o = CompletionOutput(0, delta_text="".join(f"<{t}>" for t in toks), delta_token_ids=toks,
                                 finish_reason="length" if done else None)
            charged += 0.25  # engine seconds, cumulative per replica as an engine reports them
            yield (wire.OUTPUTS, [RequestOutput(request.request_id, None, [], [o], done, engine_seconds=charged)])
            await asyncio.sleep(0)


class FakeGen:
    def __init__(self, agen):
        self.agen = agen
        self.cancelled = False

    def __anext__(self):
        return self.agen.__anext__()

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """Routes to the first replica not excluded (the real router ranks by fleet/routing.py)."""

    def __init__(self, replicas: list[FakeReplica]):
        self.replicas = replicas

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request: EngineRequest, route: dict):
        live = [r for r in self.replicas if r.rid not in route["exclude"]]
        if not live:
            async def none():
                await asyncio.sleep(3600)
                yield None
            return FakeGen(none())
        return FakeGen(live[0].generate(request, route))


def client_for(replicas: list[FakeReplica], **fleet) -> tuple[FleetClient, list[RequestOutput]]:
    finished: list[RequestOutput] = []
    spec = ServedModel(id="m", source="x.gguf")
    c = FleetClient(spec, spec.engine_config(), None, finished.append, directory=None,
                    fleet=FleetConfig(route_timeout_s=0.5, **fleet))
    c.handle, c.status = FakeHandle(replicas), EngineStatus.READY
    c.replica_stats = lambda: [(r.rid, {}, {}) for r in replicas]
    return c, finished


async def consume(c: FleetClient, max_tokens: int, n: int = 1):
    stream = await c.submit(EngineRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, n=n), tenant="t",
                                          cache_salt="t"))
    seen = []
    async for out in stream:
        seen += out.outputs[0].delta_token_ids
        last = out
    return stream, seen, last


def test_a_stream_moves_on_when_its_replica_dies():
    a, b = FakeReplica("a", die_after=4), FakeReplica("b")
    c, finished = client_for([a, b])
    stream, seen, last = asyncio.run(consume(c, 9))
    assert seen == list(range(100, 109))  # no gap, no repeat
    assert b.calls[0][0].resumed_token_ids == (100, 101, 102, 103) and b.calls[0][1]["exclude"] == ["a"]
    assert last.finished and last.outputs[0].token_ids == list(range(100, 109))
    assert last.outputs[0].text == "".join(f"<{t}>" for t in range(100, 109))
    assert [f.num_completion_tokens for f in finished] == [9] and finished[0].outputs[0].finish_reason == "length"
    assert c.migrations == {"migrated": 1} and stream.migrations == 1 and c.num_inflight == 0
    assert finished[0].engine_seconds == pytest.approx(0.5 + 0.75)  # both replicas' time is charged


def test_past_the_migration_limit_the_request_fails_and_says_so():
    reps = [FakeReplica(x, die_after=2 * (i + 1)) for i, x in enumerate("abc")]
    c, finished = client_for(reps, migration_limit=2)

    async def run():
        seen = []
        stream = await c.submit(EngineRequest("r", [1], SamplingParams(max_tokens=20), "batch", "t"))
        with pytest.raises(ModelFailed, match="migration limit"):
            async for out in stream:
                seen += out.outputs[0].delta_token_ids
        return seen

    seen = asyncio.run(run())
    assert seen == list(range(100, 106))
    assert len(finished) == 1 and finished[0].outputs[0].finish_reason == "error"
    assert finished[0].num_completion_tokens == 6 and c.migrations == {"migrated": 2, "limit": 1}


def test_no_replica_left_ends_the_stream_within_the_route_timeout():
    c, finished = client_for([FakeReplica("a", die_after=2)])

    async def run():
        stream = await c.submit(EngineRequest("r", [1], SamplingParams(max_tokens=8), "batch", "t"))
        with pytest.raises(ModelFailed, match="no replica"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(run(), 5))
    assert finished[0].outputs[0].finish_reason == "error" and c.migrations == {"no_replica": 1}


def test_a_request_with_forks_is_not_resumed():
    c, finished = client_for([FakeReplica("a", die_after=2), FakeReplica("b")])
    with pytest.raises(ModelFailed, match="n > 1"):
        asyncio.run(consume(c, 6, n=2))
    assert finished[0].outputs[0].finish_reason == "error"


def test_a_full_replica_sends_the_request_to_another_and_a_full_pool_refuses():
    full = CapacityExhausted("queue full", retry_after=2.0)
    a, b = FakeReplica("a", refuse=full), FakeReplica("b")
    c, _ = client_for([a, b])
    _, seen, _ = asyncio.run(consume(c, 4))
    assert seen == [100, 101, 102, 103] and b.calls[0][1]["exclude"] == ["a"]
    c2, finished = client_for([FakeReplica("a", refuse=full), FakeReplica("b", refuse=full)])
    with pytest.raises(CapacityExhausted) as e:
        asyncio.run(consume(c2, 4))
    assert e.value.retry_after == 2.0 and not finished and c2.num_inflight == 0


def test_an_abort_cancels_the_replica_stream_and_reports_once():
    c, finished = client_for([FakeReplica("a")])

    async def run():
        stream = await c.submit(EngineRequest("r", [1], SamplingParams(max_tokens=50), "batch", "t"))
        await stream.__anext__()
        gen = stream._gen
        c.abort("r")
        c.abort("r")
        return gen

    gen = asyncio.run(run())
    assert gen.cancelled and len(finished) == 1 and finished[0].outputs[0].finish_reason == "abort"
    assert finished[0].num_completion_tokens == 2
