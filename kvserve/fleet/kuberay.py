"""A KubeRay `RayService` manifest for the fleet, rendered from the same models TOML.

`render(config)` gives two documents: a ConfigMap holding the TOML, mounted into every pod at
`config_mount`, and a `ray.io/v1` RayService whose `serveConfigV2` runs the applications `kvserve serve
--fleet` runs (fleet/deploy.py): one pool per model and the "kvserve" gateway at "/". Their Serve options
are deploy.py's own (`engine_options`, `router_options`, `gateway_options`), so the manifest and the fleet
cannot disagree; the builders read the mounted TOML in the cluster.

The cluster:
- The head runs Ray's control plane, Serve's controller and proxy, and every gateway: it offers no CPUs
  or GPUs to Ray (no engine lands there) but one unit of `kvserve_gateway` per gateway replica, which each
  gateway asks for instead of its CPUs; those CPUs go into the head pod's request. One pod for all
  gateways is what lets them share the store (below).
- One worker group runs the engines: one pod per replica at the largest pool sizes (sum of each model's
  max replicas), each pod as big as the largest replica (the most CPUs and the most GPUs any model asks,
  rounded up: Ray counts whole CPUs per node and Kubernetes whole GPUs).

Limits:
- The store (tenants, tokens, idempotency keys, usage) is SQLite under $KVSERVE_HOME on the head pod's
  disk, an emptyDir: it is lost with the pod; mount a PersistentVolumeClaim at /var/lib/kvserve on the
  head to keep it. Gateways on several nodes would each get their own file; they need a shared store.
  Tenants are made in the head pod: `kubectl exec <head> -- kvserve tenants create NAME`.
- Pods are sized for every pool at its max replicas and the group does not scale: Serve autoscales
  replicas inside it. No memory requests are set: the TOML does not say how much a model needs.
- A changed model is a new pool app. Re-applying the manifest would start it and delete the old one, but
  the fleet record the gateways route by is only written on the cluster's first start
  (deploy.build_gateway), so they would go on routing to the deleted pool: a model change goes through
  `kvserve fleet apply` in the head pod (new pools warm up, traffic moves, old ones drain). That changes
  the live fleet only; a cluster restarted from the manifest comes back with the manifest's models.
  Replica counts and the other options can be re-applied in place.
- The image must hold kvserve, Ray of the same version, and every model's source (pkg: packages, files).
- The TOML's [server] host is ignored (proxies listen on 0.0.0.0); its port is the Serve port.
"""
from __future__ import annotations

import argparse
import json
import math
import posixpath
import sys
from importlib.metadata import version
from pathlib import Path

import yaml

from kvserve.config import ServedModel, ServerConfig
from kvserve.fleet import deploy

HOME = "/var/lib/kvserve"
GATEWAY_RESOURCE = "kvserve_gateway"  # offered by the head only: one unit per gateway replica
POOL_BUILDER = "kvserve.fleet.deploy:build_pool"
GATEWAY_BUILDER = "kvserve.fleet.deploy:build_gateway"


# ---- serveConfigV2 -------------------------------------------------------------------------------

def pool_application(spec: ServedModel, config: ServerConfig, config_mount: str) -> dict:
    # route_prefix must be null, not absent: Serve's schema defaults an absent one to "/", the gateway's.
    return dict(name=deploy.pool_name(spec), import_path=POOL_BUILDER, route_prefix=None,
                args={"config": config_mount, "model": spec.id},
                deployments=[{**deploy.engine_options(spec, config),
                              "request_router_config": deploy.router_options(spec, config)}])


def on_head(actor_options: dict) -> dict:
    """A gateway's actor options pinned to the head: `kvserve_gateway` instead of CPUs (the head offers
    none, so engines stay off it); its other custom resources stay."""
    return {**actor_options, "num_cpus": 0,
            "resources": {**actor_options.get("resources", {}), GATEWAY_RESOURCE: 1}}


def gateway_application(config: ServerConfig, config_mount: str) -> dict:
    opts = deploy.gateway_options(config)
    return dict(name=deploy.GATEWAY_APP, import_path=GATEWAY_BUILDER, route_prefix="/",
                args={"config": config_mount},
                deployments=[{**opts, "ray_actor_options": on_head(opts["ray_actor_options"])}])


def serve_config(config: ServerConfig, config_mount: str) -> dict:
    apps = [pool_application(m, config, config_mount) for m in config.models]
    return dict(http_options={"host": "0.0.0.0", "port": config.port},
                applications=apps + [gateway_application(config, config_mount)])


# ---- the Ray cluster -----------------------------------------------------------------------------

def _quantity(x: float) -> str:
    """A Kubernetes quantity: whole units as such, else millis."""
    return f"{x:g}" if float(x).is_integer() else f"{round(x * 1000)}m"


def _resources_param(resources: dict) -> str:
    """rayStartParams' `resources`: KubeRay passes the value to a shell, so the JSON is quoted within."""
    return '"' + json.dumps(resources, sort_keys=True).replace('"', '\\"') + '"'


def _pod(role: str, image: str, config_map: str, config_mount: str, port: int, resources: dict,
         ports: dict[str, int]) -> dict:
    """A Ray pod template: the image, $KVSERVE_HOME on a writable volume, the TOML where the builders read it."""
    container = dict(
        name=f"ray-{role}", image=image,
        env=[{"name": "KVSERVE_HOME", "value": HOME}],
        ports=[{"name": n, "containerPort": p} for n, p in {**ports, "serve": port}.items()],
        resources=resources,
        volumeMounts=[{"name": "kvserve-config", "mountPath": posixpath.dirname(config_mount), "readOnly": True},
                      {"name": "kvserve-home", "mountPath": HOME}])
    volumes = [{"name": "kvserve-config",
                "configMap": {"name": config_map,
                              "items": [{"key": "models.toml", "path": posixpath.basename(config_mount)}]}},
               {"name": "kvserve-home", "emptyDir": {}}]
    return {"spec": {"containers": [container], "volumes": volumes}}


def head_group(config: ServerConfig, image: str, config_map: str, config_mount: str) -> dict:
    gw = deploy.gateway_options(config)
    n, actor = gw["num_replicas"], gw["ray_actor_options"]
    offered = {k: v * n for k, v in on_head(actor)["resources"].items()}
    cpus = 1 + n * actor.get("num_cpus", 0)  # one for GCS, the dashboard, Serve's controller and proxy
    return dict(rayStartParams={"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0",
                                "resources": _resources_param(offered)},
                template=_pod("head", image, config_map, config_mount, config.port,
                              {"requests": {"cpu": _quantity(cpus)}},
                              {"gcs-server": 6379, "dashboard": 8265, "client": 10001}))


def worker_group(config: ServerConfig, image: str, config_map: str, config_mount: str) -> dict:
    pods = sum(m.fleet.bounds[1] for m in config.models)
    shapes = [deploy.replica_resources(m) for m in config.models]  # a worker pod holds a replica (all its ranks)
    cpus = max(1, math.ceil(max((c for c, _ in shapes), default=1)))
    gpus = math.ceil(max((g for _, g in shapes), default=0))
    resources = {"requests": {"cpu": str(cpus)}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    return dict(groupName="engines", replicas=pods, minReplicas=pods, maxReplicas=pods,
                rayStartParams={"num-cpus": str(cpus), "num-gpus": str(gpus)},
                template=_pod("worker", image, config_map, config_mount, config.port, resources, {}))


# ---- the manifest --------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the TOML, serveConfigV2) as literal blocks, readable in the manifest."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                              style="|" if "\n" in s else None))


def render(config_path: str, *, image: str = "kvserve:latest", config_mount: str = "/etc/kvserve/models.toml",
           name: str = "kvserve") -> str:
    """The ConfigMap and RayService for the fleet of `config_path`, as YAML (ConfigError if it is invalid)."""
    config = ServerConfig.from_toml(config_path)
    config_map = f"{name}-config"
    cluster = dict(rayVersion=version("ray"),
                   headGroupSpec=head_group(config, image, config_map, config_mount),
                   workerGroupSpecs=[worker_group(config, image, config_map, config_mount)])
    docs = [dict(apiVersion="v1", kind="ConfigMap", metadata={"name": config_map},
                 data={"models.toml": Path(config_path).read_text()}),
            dict(apiVersion="ray.io/v1", kind="RayService", metadata={"name": name},
                 spec=dict(serveConfigV2=yaml.dump(serve_config(config, config_mount), Dumper=_Dumper,
                                                   sort_keys=False),
                           rayClusterConfig=cluster))]
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    from kvserve.config import DEFAULT_CONFIG

    p = argparse.ArgumentParser(prog="python -m kvserve.fleet.kuberay",
                                description="print a KubeRay RayService manifest for a models TOML")
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="default: the packaged models file")
    p.add_argument("--image", default="kvserve:latest", help="holding kvserve, Ray and the models' sources")
    p.add_argument("--config-mount", default="/etc/kvserve/models.toml")
    p.add_argument("--name", default="kvserve")
    args = p.parse_args(argv)
    sys.stdout.write(render(args.config, image=args.image, config_mount=args.config_mount, name=args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
