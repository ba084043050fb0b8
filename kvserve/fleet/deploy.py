"""The fleet on Ray Serve: what runs where, starting it, and applying a new config with no downtime.

Serve applications:
- "kvserve": the gateway (fleet/gateway.py), the HTTP ingress at "/", `[fleet].gateway_replicas` replicas.
- one pool per model and model version, "pool-<model>-<digest>", with no HTTP route: its "engine"
  deployment is the model's EngineReplicas (fleet/replica.py). The digest covers what a replica is built
  from (source, engine arguments, version label, CPUs and GPUs), so a change of any of them is a new pool.

Applying a config (`kvserve fleet apply new.toml`, the rolling update):
1. The TOML is parsed and checked (unknown keys and bad values are refused by name), and each replica's
   CPUs and GPUs must fit on some node of the cluster.
2. The pools that change are deployed next to the old ones: their replicas load and warm up (a replica
   starts only once it has run a request). The old pools keep serving meanwhile. A pool that fails to
   come up is deleted again and the apply is refused, naming the model and the error: the fleet is as it
   was.
3. The fleet record switches the models to their new pools; the gateways follow within a second, so new
   requests go to the new replicas.
4. The old pools are deleted: Serve stops sending them requests and lets each replica finish its
   streams for up to `drain_timeout_s`, then stops it. A stream still running then moves to the new pool
   (migration, fleet/client.py): no request fails.
Pools whose digest did not change are redeployed in place (a replica-count or autoscaling change).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from kvserve.config import ModelFleet, ServedModel, ServerConfig

log = logging.getLogger(__name__)

GATEWAY_APP = "kvserve"
MAX_ONGOING = 4096  # per replica: the engine queues and refuses by its own tier bounds, not Serve


class FleetError(RuntimeError):
    """A fleet operation refused or failed; the message says why, and the running fleet is unchanged."""


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def pool_name(spec: ServedModel) -> str:
    f = spec.fleet
    return f"pool-{spec.id}-" + _digest([spec.source, spec.engine_args, spec.version, f.cpus, f.gpus])


def gateway_view(config: ServerConfig) -> ServerConfig:
    """The config a gateway runs with: replica shapes and version labels are the pools' business, and where the
    TOML was read from is nobody's (an apply reads it from a temporary file): a change of these alone must not
    replace the gateways."""
    return replace(config, config_path=None, models=[replace(m, version="1", fleet=ModelFleet()) for m in config.models])


# ---- Serve options (pure: also what deploy/ renders for KubeRay) ---------------------------------

def rank_bundles(spec: ServedModel) -> list[dict[str, float]] | None:
    """A tensor-parallel replica's placement group: a bundle per rank, each of the model's `cpus` and one GPU where
    it has `gpus` (the replica actor, rank 0, takes the first; engine/worker/tensor_parallel.py starts the other
    ranks in theirs). None for a replica of one rank."""
    tp = spec.engine_config().tensor_parallel_size
    if tp == 1:
        return None
    bundle = {k: v for k, v in (("CPU", spec.fleet.cpus), ("GPU", 1.0 if spec.fleet.gpus else 0.0)) if v}
    return [dict(bundle) for _ in range(tp)]


def replica_resources(spec: ServedModel) -> tuple[float, float]:
    """(CPUs, GPUs) one replica of the model reserves: its ranks' bundles together, on one node."""
    bundles = rank_bundles(spec)
    if bundles is None:
        return spec.fleet.cpus, spec.fleet.gpus
    return sum(b.get("CPU", 0) for b in bundles), sum(b.get("GPU", 0) for b in bundles)


def engine_options(spec: ServedModel, config: ServerConfig) -> dict:
    """The `engine` deployment's Serve options for one model: a tensor-parallel replica's ranks in a placement
    group of a bundle each, packed on one node (its ranks meet over the node's own links: NVLink, or loopback
    on CPUs)."""
    shape, fleet = spec.fleet, config.fleet
    lo, hi = shape.bounds
    bundles = rank_bundles(spec)
    actor = {"num_cpus": shape.cpus, "num_gpus": shape.gpus} if bundles is None else \
        {"num_cpus": bundles[0].get("CPU", 0), "num_gpus": bundles[0].get("GPU", 0)}
    opts = dict(name="engine",
                ray_actor_options=actor,
                max_ongoing_requests=MAX_ONGOING, health_check_period_s=fleet.health_check_period_s,
                health_check_timeout_s=fleet.health_check_timeout_s,
                graceful_shutdown_timeout_s=fleet.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5)
    if shape.autoscaling:
        opts["autoscaling_config"] = dict(
            min_replicas=lo, max_replicas=hi, initial_replicas=max(lo, min(hi, shape.replicas)),
            upscale_delay_s=shape.upscale_delay_s, downscale_delay_s=shape.downscale_delay_s,
            policy=dict(policy_function="kvserve.fleet.autoscale:LLMSignalPolicy",
                        policy_kwargs=dict(target_queued_tokens=shape.target_queued_tokens,
                                           target_kv_usage=shape.target_kv_usage,
                                           ttft_slo_s=config.ttft_target_ms.get("interactive", 500.0) / 1000)))
    else:
        opts["num_replicas"] = shape.replicas
    if bundles is not None:
        opts.update(placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    return opts


def router_options(spec: ServedModel, config: ServerConfig) -> dict:
    fleet = config.fleet
    return dict(request_router_class="kvserve.fleet.serve_router:KVRequestRouter",
                request_router_kwargs=dict(affinity_blocks=fleet.affinity_blocks, load_bound=fleet.load_bound,
                                           block_size=spec.engine_config().cache.block_size),
                request_routing_stats_period_s=fleet.stats_period_s,
                request_routing_stats_timeout_s=max(1.0, fleet.health_check_timeout_s / 2))


def gateway_options(config: ServerConfig) -> dict:
    fleet = config.fleet
    return dict(name="gateway", num_replicas=fleet.gateway_replicas,
                ray_actor_options={"num_cpus": fleet.gateway_cpus, "resources": dict(fleet.gateway_resources)},
                max_ongoing_requests=MAX_ONGOING,
                graceful_shutdown_timeout_s=fleet.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5)


# ---- Serve applications ---------------------------------------------------------------------------

def pool_app(spec: ServedModel, config: ServerConfig):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvserve.fleet.replica import EngineReplica

    deployment = serve.deployment(EngineReplica).options(
        request_router_config=RequestRouterConfig(**router_options(spec, config)), **engine_options(spec, config))
    # The replica is built from the spec without its pool shape: a count change must not look like new code.
    return deployment.bind(replace(spec, fleet=ModelFleet()), config.stall_timeout_s)


def gateway_app(config: ServerConfig, warming: bool = False):
    from ray import serve

    from kvserve.fleet.gateway import Gateway

    return serve.deployment(Gateway).options(**gateway_options(config)).bind(gateway_view(config), warming)


def build_pool(args: dict):
    """Serve application builder (`import_path: kvserve.fleet.deploy:build_pool`, args {config, model})."""
    config = ServerConfig.from_toml(args["config"])
    return pool_app(next(m for m in config.models if m.id == args["model"]), config)


def build_gateway(args: dict):
    """Serve application builder for the gateway (args {config}, and {region} where the config lists several),
    for a fleet whose config is a manifest (KubeRay): that config is the truth, so the fleet record is written
    from it."""
    from kvserve.fleet.record import record

    config = ServerConfig.from_toml(args["config"], region=args.get("region"))
    ray_get(record(config.fleet.ray_namespace, create=True).set.remote(Path(args["config"]).read_text(),
                                                                       pools_of(config)))
    return gateway_app(config)


def pools_of(config: ServerConfig) -> dict[str, dict]:
    return {m.id: {"app": pool_name(m), "source": m.source, "version": m.version, "max_replicas": m.fleet.bounds[1]}
            for m in config.models}


# ---- the cluster --------------------------------------------------------------------------------

def connect(address: str | None, config: ServerConfig, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address` ("auto": the local one), or start a local instance."""
    import ray

    # Ray 2.60 otherwise binds to the first interface's address, which a sandboxed box may not route.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if ray.is_initialized():
        return
    kwargs = dict(namespace=config.fleet.ray_namespace, ignore_reinit_error=True, log_to_driver=False)
    if address:
        ray.init(address=address, **kwargs)
    else:  # a local instance with twice the logical CPUs the config reserves, so that a rolling update can start
        # the new pools beside the old (Ray schedules by logical CPUs; it does not pin cores)
        ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, math.ceil(2 * demand(config)[0])),
                 include_dashboard=False, **kwargs)


def check_placement(config: ServerConfig) -> None:
    """Every replica's CPUs and GPUs must fit on one alive node (Serve would wait for them forever)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    problems = []

    def fits(cpus: float, gpus: float) -> bool:
        return any(n.get("CPU", 0) >= cpus and n.get("GPU", 0) >= gpus for n in nodes)

    for m in config.models:
        cpus, gpus = replica_resources(m)
        if not fits(cpus, gpus):
            problems.append(f"model {m.id}: a replica needs {cpus:g} CPUs and {gpus:g} GPUs on one node; "
                            f"no node has that")
    gw = config.fleet
    if not any(n.get("CPU", 0) >= gw.gateway_cpus and all(n.get(k, 0) >= v for k, v in gw.gateway_resources.items())
               for n in nodes):
        problems.append(f"the gateway needs {gw.gateway_cpus} CPUs and {gw.gateway_resources or 'no other resources'}"
                        f"; no node has that")
    total = ray.cluster_resources()
    need_cpu, need_gpu = demand(config)
    if not problems and (need_cpu > total.get("CPU", 0) + 1e-9 or need_gpu > total.get("GPU", 0) + 1e-9):
        problems.append(f"the pools and gateways need {need_cpu:g} CPUs and {need_gpu:g} GPUs in all; the cluster "
                        f"has {total.get('CPU', 0):g} and {total.get('GPU', 0):g}")
    if problems:
        biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
        raise FleetError("; ".join(problems) + f" (largest node: {biggest.get('CPU', 0):g} CPUs, "
                         f"{biggest.get('GPU', 0):g} GPUs)")


def demand(config: ServerConfig) -> tuple[float, float]:
    """CPUs and GPUs the fleet reserves at its start size (pools at their initial replicas, the gateways)."""
    cpus = sum(_initial(m) * replica_resources(m)[0] for m in config.models)
    return cpus + config.fleet.gateway_replicas * config.fleet.gateway_cpus, \
        sum(_initial(m) * replica_resources(m)[1] for m in config.models)


def _wait_running(apps: list[str], timeout: float) -> None:
    """Until every app is RUNNING; FleetError naming the first that failed or did not start in time."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while True:
        status = serve.status().applications
        pending = []
        for app in apps:
            st = status.get(app)
            state = str(getattr(st, "status", "NOT_STARTED"))
            if state.endswith("DEPLOY_FAILED") or state.endswith("UNHEALTHY"):
                raise FleetError(f"{app} failed to start: {_app_message(st)}")
            if not state.endswith("RUNNING"):
                pending.append(app)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise FleetError(f"{', '.join(pending)} did not start within {timeout:.0f} s")
        time.sleep(0.5)


def _app_message(st) -> str:
    parts = [st.message] if getattr(st, "message", "") else []
    for name, d in (getattr(st, "deployments", None) or {}).items():
        if getattr(d, "message", ""):
            parts.append(f"{name}: {d.message}")
    return " | ".join(parts)[:2000] or "no message"


def _deploy_pools(specs: list[ServedModel], config: ServerConfig) -> None:
    from ray import serve
    from ray.serve.api import RunTarget

    if specs:
        serve.run_many([RunTarget(pool_app(m, config), name=pool_name(m), route_prefix=None) for m in specs],
                       wait_for_applications_running=False)


def start(config: ServerConfig, config_text: str, address: str | None = None, start_timeout_s: float = 900) -> None:
    """`kvserve serve --fleet`: the pools, the record, then the gateway on config.host:config.port."""
    from ray import serve

    from kvserve.fleet.record import record

    connect(address, config)
    check_placement(config)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(gateway_app(config, warming=True), name=GATEWAY_APP, route_prefix="/")  # 503s, not 404s, meanwhile
    _deploy_pools(config.models, config)
    _wait_running([pool_name(m) for m in config.models], start_timeout_s)
    ray_get(record(config.fleet.ray_namespace, create=True).set.remote(config_text, pools_of(config)))
    serve.run(gateway_app(config), name=GATEWAY_APP, route_prefix="/")


def ray_get(ref):
    import ray

    return ray.get(ref)


def apply(config_text: str, address: str | None = "auto", start_timeout_s: float = 900,
          region: str | None = None) -> list[str]:
    """Apply a new config to the running fleet (the rolling update in the module docstring); what changed.
    ConfigError / FleetError when refused, with the fleet left on its old config."""
    from ray import serve

    from kvserve.fleet.record import record

    new = _parse(config_text, region)
    connect(address, new)
    rec = record(new.fleet.ray_namespace)
    old_text, old_pools = ray_get(rec.get.remote())
    old = {m.id: m for m in _parse(old_text).models} if old_text else {}
    check_placement(new)
    new_pools = pools_of(new)
    fresh = [m for m in new.models if old_pools.get(m.id, {}).get("app") != new_pools[m.id]["app"]]
    same = [m for m in new.models if m not in fresh]
    # Without room for the new pools beside the old ones: a model whose old pool has several replicas gets
    # its new pool with one replica, in room made by stopping one old replica (it drains first), grown to
    # its size once the old pool is gone ("tight"); a model whose old pool has one replica cannot keep it
    # while the new one starts, so its source is checked first, then the gateways move to the new pool and
    # requests wait (at most route_timeout_s) while the old replica drains and the new one loads ("swap").
    room = _room_for(fresh)
    swap = [] if room else [m for m in fresh if m.id in old and _initial(old[m.id]) <= 1]
    tight = [] if room else [m for m in fresh if m not in swap]
    for m in swap:
        _check_source(m)
    for m in tight:
        if m.id in old:
            _deploy_pools([_resized(old[m.id], _initial(old[m.id]) - 1)], new)
    first = [m for m in fresh if m not in swap]
    _deploy_pools([_resized(m, 1) if m in tight else m for m in first], new)
    try:
        _wait_running([pool_name(m) for m in first], start_timeout_s)
    except FleetError:
        for m in first:
            serve.delete(pool_name(m), _blocking=False)
        _deploy_pools([old[m.id] for m in tight if m.id in old], new)  # the old pools back to their size
        raise
    _deploy_pools(same + swap, new)  # counts in place; swap pools wait for the room their old pools leave
    ray_get(rec.set.remote(config_text, new_pools))
    changes = [f"{m.id}: {old_pools.get(m.id, {}).get('version', '-')} -> {m.version} ({pool_name(m)})"
               for m in fresh]
    serve.run(gateway_app(new), name=GATEWAY_APP, route_prefix="/")  # in place unless the gateway view changed
    time.sleep(2.0)  # the gateways poll the record every second: let them all switch before the old pools go
    live = {e["app"] for e in new_pools.values()}
    for model, entry in old_pools.items():
        if entry["app"] not in live:
            serve.delete(entry["app"], _blocking=room is False)  # drains (graceful_shutdown_timeout_s)
            changes.append(f"{model}: pool {entry['app']} drained")
    if tight or swap:
        _deploy_pools(tight, new)  # the tight pools to their size, in place
        _wait_running([pool_name(m) for m in tight + swap], start_timeout_s)
    return changes


def _check_source(m: ServedModel) -> None:
    """The model file can be found and read (before a swap takes the old pool away)."""
    from kvserve.models.catalog import resolve_source
    from kvserve.models.model_info import read_model_info

    try:
        read_model_info(resolve_source(m.source, m.engine_args.get("install", "")), m.id)
    except Exception as e:
        raise FleetError(f"model {m.id}: its source {m.source!r} cannot be read: {e}") from None


def _parse(config_text: str, region: str | None = None) -> ServerConfig:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(config_text)
    try:
        return ServerConfig.from_toml(f.name, region=region)
    finally:
        os.unlink(f.name)


def _initial(m: ServedModel) -> int:
    lo, hi = m.fleet.bounds
    return max(lo, min(hi, m.fleet.replicas))


def _resized(m: ServedModel, replicas: int) -> ServedModel:
    """`m` with a fixed replica count (the same pool: the count is not in its name)."""
    return replace(m, fleet=replace(m.fleet, replicas=max(0, replicas), min_replicas=None, max_replicas=None))


def _room_for(specs: list[ServedModel]) -> bool:
    """Whether the cluster has the CPUs and GPUs free for all these pools' replicas next to the running ones."""
    import ray

    free = ray.available_resources()
    cpus = sum(_initial(m) * replica_resources(m)[0] for m in specs)
    gpus = sum(_initial(m) * replica_resources(m)[1] for m in specs)
    return free.get("CPU", 0) >= cpus and free.get("GPU", 0) >= gpus
