"""`kvserve plan` answers with the settings that serve its plan (planning/serving.py): the models TOML its
deployment maps onto, read back by the server's own config loader into the engine settings and the fleet's
replicas the plan counted."""
from __future__ import annotations

from kvserve.config import ServerConfig, engine_config_from_kwargs
from kvserve.planning.cli import plan_json, render
from kvserve.planning.search import SLO, Load, plan
from kvserve.planning.serving import models_toml
from kvserve.planning.specs import accelerator_spec, model_spec
from kvserve.planning.traces import LengthDist


def _plan(dtypes: tuple[str, ...]):
    load, slos = Load(10000, LengthDist(500), LengthDist(200)), [SLO("tpot", 50, 0.05)]
    return plan(model_spec("llama-3.1-70b"), [accelerator_spec("h100-sxm")], load, slos, dtypes=dtypes,
                simulate=False), load, slos


def test_a_tensor_parallel_plan_comes_with_the_toml_that_serves_it(tmp_path):
    r, load, slos = _plan(("bf16",))
    d = r.best.candidate.deployment
    assert d.tp > 1  # 70B in bf16 does not fit one H100
    text = models_toml(r.best, "llama-70b", source=str(tmp_path / "Llama-3.1-70B"))
    path = tmp_path / "plan.toml"
    path.write_text(text)
    (served,) = ServerConfig.from_toml(str(path)).models
    assert served.id == "llama-70b" and served.fleet.replicas == r.best.replicas and served.fleet.gpus == d.tp
    engine = engine_config_from_kwargs(served.source, **served.engine_args)
    assert engine.tensor_parallel_size == d.tp and engine.device == "cuda" and engine.dtype == "bfloat16"
    assert engine.weights == "bf16" and engine.cache.kv_cache_dtype == "auto"
    assert engine.scheduler.max_num_seqs == r.best.candidate.max_num_seqs
    out = render(r, "llama-3.1-70b", load, slos)
    assert "kvserve serve --fleet --config plan.toml" in out and f"tensor_parallel_size = {d.tp}" in out
    assert plan_json(r, "llama-3.1-70b", load, slos)["models_toml"].startswith("[[models]]")


def test_quantized_plans_map_onto_the_engines_weight_and_kv_settings(tmp_path):
    r, _, _ = _plan(("fp8",))
    text = models_toml(r.best, "llama-70b", source="/models/llama-70b")
    assert 'weights = "fp8"' in text and 'kv_cache_dtype = "fp8"' in text
    path = tmp_path / "plan.toml"
    path.write_text(text)
    (served,) = ServerConfig.from_toml(str(path)).models
    engine = engine_config_from_kwargs(served.source, **served.engine_args)
    assert engine.weights == "fp8" and engine.cache.kv_cache_dtype == "fp8"


def test_a_fleet_replica_of_n_ranks_reserves_n_gpus_in_a_placement_group_of_n_bundles():
    import pytest

    from kvserve.config import ConfigError, ModelFleet, ServedModel, ServerConfig
    from kvserve.fleet.deploy import demand, engine_options, rank_bundles, replica_resources

    gpus = ServedModel(id="g", source="x.gguf", engine_args={"tensor_parallel_size": 4}, fleet=ModelFleet(gpus=4, cpus=2))
    cpus = ServedModel(id="c", source="x.gguf", engine_args={"tensor_parallel_size": 2})  # CPUs: gloo
    one = ServedModel(id="m", source="x.gguf", fleet=ModelFleet(gpus=0.5))  # one rank may share a GPU
    with pytest.raises(ConfigError, match="one GPU each"):
        ServedModel(id="m", source="x.gguf", engine_args={"tensor_parallel_size": 2}, fleet=ModelFleet(gpus=1))
    with pytest.raises(ConfigError, match="bundles empty"):
        ServedModel(id="m", source="x.gguf", engine_args={"tensor_parallel_size": 2}, fleet=ModelFleet(cpus=0))
    assert rank_bundles(gpus) == [{"CPU": 2, "GPU": 1}] * 4 and rank_bundles(cpus) == [{"CPU": 1}] * 2
    assert rank_bundles(one) is None and replica_resources(one) == (1, 0.5)
    assert replica_resources(gpus) == (8, 4) and replica_resources(cpus) == (2, 0)
    config = ServerConfig(models=[gpus, cpus, one])
    opts = engine_options(gpus, config)
    assert opts["placement_group_bundles"] == rank_bundles(gpus) and opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}  # rank 0, the replica, in the first bundle
    assert "placement_group_bundles" not in engine_options(one, config)
    assert demand(config)[1] == 4.5
