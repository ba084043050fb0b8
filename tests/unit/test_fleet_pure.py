"""The fleet's pure parts: the wire's slim outputs and the gateway's accumulator (over a migration), the
autoscaling decision, and the fleet config tables. No Ray."""
from __future__ import annotations

import pytest

from kvserve.config import ConfigError, FleetConfig, ModelFleet, ServerConfig
from kvserve.engine.errors import CapacityExhausted, InvalidRequest, from_wire, to_wire
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.fleet import wire
from kvserve.fleet.autoscale import LLMSignalPolicy, ScalingTargets, desired_replicas, pressure


def _out(tokens: list[int], text: str, total: list[int], finish: str | None = None, lp: bool = False):
    delta_lp = [Logprob(t, str(t), -0.5, 1) for t in tokens] if lp else None
    o = CompletionOutput(0, text="whole " + text, token_ids=list(total), finish_reason=finish,
                         logprobs=[Logprob(t, str(t), -0.5, 1) for t in total] if lp else None,
                         delta_text=text, delta_token_ids=list(tokens), delta_logprobs=delta_lp)
    return RequestOutput("r", "prompt", [1, 2, 3], [o], finish is not None, num_cached_tokens=2,
                         metrics=RequestMetrics(arrival_time=0.0, queue_time=0.01))


def test_slim_keeps_only_what_is_new():
    s = wire.slim(_out([7, 8], "ab", [5, 6, 7, 8], lp=True))
    o = s.outputs[0]
    assert s.prompt_token_ids == [] and s.prompt is None
    assert (o.text, o.token_ids, o.logprobs) == ("", [], [])
    assert (o.delta_text, o.delta_token_ids, len(o.delta_logprobs)) == ("ab", [7, 8], 2)


def test_the_accumulator_rebuilds_a_stream_across_replicas():
    """What a consumer sees of a migrated stream equals an undisturbed one: the second replica outputs only
    the tokens after those sent (it was given them), and the accumulator goes on from there."""
    acc = wire.OutputAccumulator("r", None, [1, 2, 3], arrival=100.0, model="m")
    first = acc.add(wire.slim(_out([5, 6], "He", [5, 6], lp=True)), now=100.5)
    assert first.outputs[0].token_ids == [5, 6] and first.outputs[0].delta_text == "He"
    assert first.metrics.first_token_time == 100.5 and first.metrics.ttft == pytest.approx(0.5)
    assert acc.sent_token_ids == [5, 6]
    # the replica dies; another one continues with resumed_token_ids = [5, 6] and reports only its own tokens
    acc.add(wire.slim(_out([7], "ll", [7], lp=True)), now=101.0)
    last = acc.add(wire.slim(_out([8], "o", [7, 8], finish="length", lp=True)), now=101.2)
    o = last.outputs[0]
    assert last.finished and o.finish_reason == "length"
    assert o.token_ids == [5, 6, 7, 8] and o.text == "Hello" and [lp.token_id for lp in o.logprobs] == [5, 6, 7, 8]
    assert last.num_completion_tokens == 4 and last.prompt_token_ids == [1, 2, 3]
    assert last.num_cached_tokens == 2  # the first replica's prompt hit
    assert last.metrics.finished_time == 101.2 and last.metrics.first_token_time == 100.5


def test_a_request_ended_at_the_gateway_keeps_what_it_had():
    acc = wire.OutputAccumulator("r", None, [1], arrival=0.0)
    acc.add(wire.slim(_out([4], "x", [4])), now=1.0)
    final = acc.final("error", now=2.0)
    assert final.finished and final.outputs[0].finish_reason == "error" and final.outputs[0].token_ids == [4]
    empty = wire.OutputAccumulator("s", None, [1], arrival=0.0).final("abort", now=1.0)
    assert empty.outputs[0].finish_reason == "abort" and empty.num_completion_tokens == 0


def test_typed_errors_cross_the_wire():
    e = from_wire(to_wire(InvalidRequest("bad n", param="n", code="invalid_n")))
    assert isinstance(e, InvalidRequest) and (str(e), e.param, e.code, e.http_status) == ("bad n", "n", "invalid_n", 400)
    c = from_wire(to_wire(CapacityExhausted("full", retry_after=2.5, reason="kv")))
    assert isinstance(c, CapacityExhausted) and (c.retry_after, c.reason, c.http_status) == (2.5, "kv", 429)
    assert type(from_wire({"class": "os.system", "message": "x"})).__name__ == "KVServeError"


# ---- autoscaling ---------------------------------------------------------------------------------

T = ScalingTargets(target_queued_tokens=1000, target_kv_usage=0.8, ttft_slo_s=0.5, downscale_below=0.3)


def test_pressure_is_the_worst_of_queue_memory_and_latency():
    assert pressure([], T) == 0.0
    assert pressure([{"queued_prompt_tokens": 3000}, {"queued_prompt_tokens": 1000}], T) == pytest.approx(2.0)
    assert pressure([{"kv_usage": 0.8}, {"kv_usage": 0.4}], T) == pytest.approx(0.75)
    assert pressure([{"est_ttft_s": 0.1}, {"est_ttft_s": 1.0}], T) == pytest.approx(2.0)


def test_desired_replicas_scales_with_pressure_and_has_a_dead_band():
    busy = [{"queued_prompt_tokens": 3000}, {"queued_prompt_tokens": 3000}]
    assert desired_replicas(2, busy, T) == 6
    assert desired_replicas(2, [{"kv_usage": 0.5}, {"kv_usage": 0.5}], T) == 2  # 0.625: hold
    assert desired_replicas(3, [{"kv_usage": 0.1}] * 3, T) == 2  # idle: one fewer at a time
    assert desired_replicas(0, [], T) == 1


def test_the_serve_policy_reads_the_replicas_custom_metrics():
    class Ctx:
        current_num_replicas = 2
        policy_state = {"k": 1}
        aggregated_metrics = {"queued_prompt_tokens": {"a": 4096.0, "b": 4096.0}, "kv_usage": {"a": 0.2, "b": 0.3},
                              "est_ttft_s": {"a": 0.1, "b": 0.2}}

    n, state = LLMSignalPolicy(target_queued_tokens=2048)(Ctx())
    assert n == 4 and state == {"k": 1}


# ---- config --------------------------------------------------------------------------------------

def test_fleet_tables_are_read_and_checked(tmp_path):
    p = tmp_path / "f.toml"
    p.write_text('[fleet]\nmigration_limit = 5\ngateway_replicas = 2\n[[models]]\nid = "m"\nsource = "x.gguf"\n'
                 'version = "v7"\n[models.fleet]\nmin_replicas = 1\nmax_replicas = 4\ncpus = 2\n')
    cfg = ServerConfig.from_toml(str(p))
    assert cfg.fleet.migration_limit == 5 and cfg.fleet.gateway_replicas == 2
    m = cfg.models[0]
    assert m.version == "v7" and m.fleet.autoscaling and m.fleet.bounds == (1, 4) and m.fleet.cpus == 2
    assert ModelFleet(replicas=3).bounds == (3, 3) and not ModelFleet(replicas=3).autoscaling
    for bad, match in [('[fleet]\nbogus = 1\n', "bogus"), ('[models.fleet]\nreplicas = -1\n', "replicas"),
                       ('[models.fleet]\nmin_replicas = 5\nmax_replicas = 2\n', "min_replicas"),
                       ('[models.fleet]\nspeed = 2\n', "speed")]:
        text = bad if bad.startswith("[fleet]") else '[[models]]\nid = "m"\nsource = "x.gguf"\n' + bad
        p.write_text(text)
        with pytest.raises(ConfigError, match=match):
            ServerConfig.from_toml(str(p))
    with pytest.raises(ConfigError, match="gateway_resources"):
        FleetConfig(gateway_resources={"node": 0})


def test_pool_names_change_with_what_a_replica_is_built_from():
    from dataclasses import replace

    from kvserve.config import ServedModel
    from kvserve.fleet.deploy import engine_options, gateway_view, pool_name

    m = ServedModel(id="m", source="x.gguf")
    assert pool_name(m) == pool_name(replace(m, fleet=ModelFleet(replicas=4)))  # a count change is in place
    assert pool_name(m) != pool_name(replace(m, version="2"))
    assert pool_name(m) != pool_name(replace(m, fleet=ModelFleet(cpus=2)))
    cfg = ServerConfig(models=[replace(m, fleet=ModelFleet(min_replicas=1, max_replicas=3))])
    opts = engine_options(cfg.models[0], cfg)
    assert opts["autoscaling_config"]["min_replicas"] == 1 and opts["autoscaling_config"]["max_replicas"] == 3
    assert "num_replicas" not in opts
    assert gateway_view(cfg).models[0].fleet == ModelFleet()



def test_a_starting_fleet_answers_503_warming_on_every_path_not_a_proxys_404():
    pytest.importorskip("ray")
    from fastapi.testclient import TestClient

    from kvserve.fleet.gateway import warming_app

    client = TestClient(warming_app())
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/region/status"), ("GET", "/ready"),
                         ("DELETE", "/v1/files/x")):
        r = client.request(method, path)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "warming" and set(r.json()["error"]) == {"message", "type", "param", "code"}
