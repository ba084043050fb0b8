"""EngineReplica: one model's engine (an AsyncLLM in this process) as a Ray Serve replica.

Ray Serve places, starts, health-checks, restarts and scales these; the gateway reaches them through a
DeploymentHandle whose request router (fleet/serve_router.py) picks the replica. The constructor loads
the model and runs one short warm-up request, so a replica counts as started (and takes traffic, in a
rolling update too) only once it can serve. The wire messages are fleet/wire.py's.

Health (`check_health`, called by Serve every `health_check_period_s`): failing means the engine failed,
or it has work and finished no step for `stall_timeout_s` (engine/client.is_stalled). A busy engine is not
a dead one: the check reads the engine thread's progress clock, it does not wait for the engine, so a
replica under load keeps passing (the check runs on the replica's event loop, not the engine thread).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from kvserve.config import Priority, ServedModel
from kvserve.engine.client import EngineStatus
from kvserve.engine.errors import KVServeError, ModelFailed, to_wire
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import SamplingParams
from kvserve.fleet import wire

log = logging.getLogger(__name__)

FAULT_INJECTION_ENV = "KVSERVE_FAULT_INJECTION"  # "1": a replica accepts inject_fault (tests, chaos drills)


class EngineReplica:
    async def __init__(self, spec: ServedModel, stall_timeout_s: float = 30.0):
        from ray import serve

        from kvserve.engine.in_process import in_process_client
        from kvserve.planning.calibrate import calibrated_prior

        self.spec = spec
        self.stall_timeout_s = stall_timeout_s
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.accepted = 0  # requests this replica admitted (migrated-in ones too)
        self.client = in_process_client(spec, spec.engine_config(), None, None, calibrated_prior(spec.id)).start()
        # Raises if the model failed to load: Serve reports the replica (and a rollout) failed, naming the error.
        await asyncio.to_thread(self.client.wait_ready)
        stream = await self.client.submit(EngineRequest(f"warmup-{self.replica_id}", (1, 2, 3, 4),
                                                        SamplingParams(max_tokens=2, temperature=0.0),
                                                        tenant="_warmup"))
        async for _ in stream:  # one request through every kernel before the replica counts as started
            pass
        log.info("replica %s of %s (version %s) ready", self.replica_id, spec.id, spec.version)

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, route: dict | None = None):
        """`request` (as the gateway's service built it) as wire messages, until its finished output. `route`:
        the gateway's routing hints, read by the request router (fleet/serve_router.py), not here."""
        try:
            stream = await self.client.submit(request)
        except KVServeError as e:
            yield (wire.REFUSED, self.replica_id, to_wire(e))
            return
        self.accepted += 1
        yield (wire.ACCEPTED, self.replica_id, self.spec.version)
        finished = False
        try:
            async for out in stream:
                batch = [out]
                while not out.finished:  # what else is already queued goes in the same message
                    more = stream.get_nowait()
                    if more is None:
                        break
                    out = more
                    batch.append(out)
                finished = out.finished
                if finished and self.client.status == EngineStatus.FAILED:
                    yield (wire.FAILED, to_wire(ModelFailed(f"replica {self.replica_id}: {self.client.error}")))
                    return
                yield (wire.OUTPUTS, [wire.slim(o) for o in batch])
                if finished:
                    return
        finally:
            if not finished:  # the gateway went away (client disconnect, abort): free the engine's blocks
                await stream.aclose()

    # ---- what Serve asks of a replica --------------------------------------------------------
    def check_health(self) -> None:
        if self.client.status == EngineStatus.FAILED:
            raise RuntimeError(f"engine failed: {self.client.error}")
        if self.client.is_stalled(self.stall_timeout_s):
            raise RuntimeError(f"engine made no step progress for {self.stall_timeout_s:.0f} s with work pending")

    def record_replica_metadata(self) -> dict:
        return {"version": self.spec.version, "source": self.spec.source}

    def record_routing_stats(self) -> dict:
        """The live load the gateways' routers weigh (fleet/routing.py ReplicaView) and their pool view."""
        stats = self.client.stats
        out = {"max_num_seqs": self.client.config.scheduler.max_num_seqs, "version": self.spec.version,
               "busy_seconds": self.client.busy_seconds, "accepted": self.accepted, "at": time.time()}
        if stats is None:
            return out
        kv = stats.kv
        # The snapshot itself (a gateway pools them: SchedulerStats.pooled), and the figures the routers weigh.
        out.update(scheduler=stats, queued_prompt_tokens=sum(stats.waiting_prompt_tokens.values()),
                   running=stats.running, kv_usage=kv.device_usage,
                   est_ttft_s=stats.ttft_s.get(Priority.INTERACTIVE, 0.0),
                   prefix_query_tokens=stats.prefix_query_tokens, prefix_hit_tokens=stats.prefix_hit_tokens)
        return out

    def record_autoscaling_stats(self) -> dict:
        """The autoscaler's per-replica signals (fleet/autoscale.py)."""
        s = self.record_routing_stats()
        return {"queued_prompt_tokens": float(s.get("queued_prompt_tokens", 0)),
                "kv_usage": float(s.get("kv_usage", 0.0)), "est_ttft_s": float(s.get("est_ttft_s", 0.0))}

    def describe(self) -> dict:
        """What a gateway needs of the model before it tokenizes for it."""
        return {"replica": self.replica_id, "version": self.spec.version, "source": self.spec.source,
                "max_model_len": self.client.max_model_len, "weights": self.client.weights,
                "numerics": self.client.numerics, "activations": self.client.activations,
                "block_size": self.client.config.cache.block_size}

    def inject_fault(self, kind: str) -> str:
        """Chaos drills (only with KVSERVE_FAULT_INJECTION=1): "stall" hangs the engine thread at its next
        step, as a wedged kernel would; the health check then fails and Serve replaces the replica."""
        if os.environ.get(FAULT_INJECTION_ENV) != "1":
            raise PermissionError(f"fault injection is off (set {FAULT_INJECTION_ENV}=1)")
        if kind != "stall":
            raise ValueError(f"unknown fault {kind!r}")
        core = self.client.core
        step = core.step

        def stalled_step():
            while True:
                time.sleep(3600)
            return step()  # pragma: no cover

        core.step = stalled_step
        return self.replica_id
