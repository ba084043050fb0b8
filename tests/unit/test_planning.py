"""Capacity planning: specs, the memory and roofline arithmetic against hand-worked figures, the simulator
driving the real scheduler, the plan search and its redundancy arithmetic, the calibration fit, the CLI."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvserve.config import Priority, SchedulerConfig
from kvserve.planning import memory
from kvserve.planning.calibrate import features, fit
from kvserve.planning.roofline import GPU_EFFICIENCY, Deployment, StepCost, StepModel, Work
from kvserve.planning.search import SLO, Load, Redundancy, plan, redundancy
from kvserve.planning.simulator import Simulator, percentile
from kvserve.planning.specs import (UnknownSpec, accelerator_spec, known_accelerators, known_models, model_spec,
                                    spec_from_hf_config)
from kvserve.planning.traces import Arrival, ClosedLoop, LengthDist, Workload, bursty, poisson, recorded


# ---- specs ----------------------------------------------------------------------------------------

def test_every_model_matches_its_published_parameter_count():
    for m in known_models().values():
        assert m.source.startswith("http")
        assert abs(memory.parameter_count(m).total / 1e9 / m.params_b - 1) < 0.01, m.name


def test_every_accelerator_has_its_sources():
    names = set(known_accelerators())
    assert {"l4", "a10g", "l40s", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x"} <= names
    for a in known_accelerators().values():
        assert a.source.startswith("http") and a.price_source and a.price_per_hour > 0, a.name


def test_unknown_names_list_the_known_ones_and_say_how_to_pass_a_config():
    with pytest.raises(UnknownSpec) as e:
        model_spec("llama-9-1t")
    assert "llama-3.1-70b" in str(e.value) and "config.json" in str(e.value)
    with pytest.raises(UnknownSpec) as e:
        accelerator_spec("tpu-v9")
    assert "h100-sxm" in str(e.value) and "calibrate" in str(e.value)
    assert model_spec("meta-llama/Llama-3.1-70B-Instruct").name == "llama-3.1-70b"  # aliases
    assert accelerator_spec("H100").name == "h100-sxm"


def test_a_config_json_and_a_gguf_file_are_read(tmp_path, tiny_llama_gguf):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
           "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "use_sliding_window": False,
           "sliding_window": 131072, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_spec(str(tmp_path))  # the checkpoint directory
    assert (m.num_layers, m.head_dim, m.num_kv_heads, m.sliding_window, m.attention_bias) == (28, 128, 4, None, True)
    assert abs(memory.parameter_count(m).total / model_spec("qwen2.5-7b").params_b / 1e9 - 1) < 0.01
    g = model_spec(str(tiny_llama_gguf))
    assert g.num_layers >= 1 and g.vocab_size > 0 and g.source == str(tiny_llama_gguf)
    with pytest.raises(UnknownSpec, match="has no 'num_attention_heads'"):
        spec_from_hf_config({"model_type": "bert"}, name="x")


# ---- memory arithmetic ------------------------------------------------------------------------------

def test_kv_bytes_per_token_hand_worked():
    l70, l8 = model_spec("llama-3.1-70b"), model_spec("llama-3.1-8b")
    assert memory.kv_bytes_per_token(l70, "bf16") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert memory.kv_bytes_per_token(l8, "bf16") == 131_072
    assert memory.kv_bytes_per_token(l70, "fp8") == 163_840
    assert memory.kv_bytes_per_token(l70, "bf16", tp=4) == 81_920  # 2 of the 8 KV heads per device
    assert memory.kv_bytes_per_token(l70, "bf16", tp=16) == 40_960  # fewer heads than devices: replicated
    # Gemma 3 27B at 8192 tokens: 10 global layers hold every token, 52 sliding ones their last 1024
    g = model_spec("gemma-3-27b")
    assert g.num_sliding_layers == 52
    assert memory.kv_bytes_at_context(g, 8192, "bf16") == 2 * 16 * 128 * 2 * (10 * 8192 + 52 * 1024)


def test_memory_plan_hand_worked():
    l70, h100 = model_spec("llama-3.1-70b"), accelerator_spec("h100-sxm")
    # embeddings 128256 x 8192, untied (x2); per layer attention 2 x 8192^2 + 2 x 8192 x 1024, MLP
    # 3 x 8192 x 28672, two norms; 80 layers; a final norm
    per_layer = 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert memory.parameter_count(l70).total == 80 * per_layer + 2 * 128256 * 8192 + 8192 == 70_553_706_496
    p = memory.memory_plan(l70, h100, tp=4, weight_dtype="bf16", kv_dtype="bf16", gpu_memory_utilization=0.9,
                           max_num_batched_tokens=8192)
    weights = 70_553_706_496 * 2 / 4
    reserve = 1.5 * 2 ** 30 + 4 * 8192 * 8192 * 2 + 512 * 128256 / 4 * 4
    kv = 80e9 * 0.9 - weights - reserve
    assert p.weight_bytes == weights and p.reserve_bytes == reserve
    assert p.num_blocks == int(kv // (81_920 * 16)) == 26_329
    assert p.max_sequences(8192) == 26_329 // 512 == 51
    # bf16 70B on one 80 GB device: the weights alone do not fit
    assert not memory.memory_plan(l70, h100, tp=1).fits


# ---- roofline ---------------------------------------------------------------------------------------

def test_a_decode_step_hand_worked():
    l8, h100 = model_spec("llama-3.1-8b"), accelerator_spec("h100-sxm")
    sm = StepModel(Deployment(l8, h100, 1, "bf16", "bf16"))
    cost = sm.cost([Work(1, 999)])
    total = memory.parameter_count(l8).total
    embedding = 128256 * 4096
    weights = (total - embedding) * 2  # every weight but the input embedding, read once
    kv = 1000 * 131_072  # the context read (999) and the new token written
    bw = 3.35e12 * GPU_EFFICIENCY.bandwidth
    expected = GPU_EFFICIENCY.step_overhead_s + GPU_EFFICIENCY.per_seq_s + weights / bw + kv / bw
    assert cost.seconds == pytest.approx(expected, rel=1e-9)
    assert cost.bound == "bandwidth" and cost.comm_s == 0
    # a 4096-token prompt is compute-bound, and batching decodes costs far less than running them apart
    assert sm.cost([Work(4096, 0)]).bound == "compute"
    assert sm.decode_step(64, 1000).seconds < 64 * sm.decode_step(1, 1000).seconds / 10


def test_tensor_parallel_and_fp8_terms():
    l70, h100 = model_spec("llama-3.1-70b"), accelerator_spec("h100-sxm")
    one = StepModel(Deployment(l70, h100, 4, "bf16", "bf16")).cost([Work(1, 1000)] * 8)
    # two all-reduces per layer of 8 tokens x 8192 bf16 values, a ring's 2 (tp-1)/tp of them over NVLink
    msg = 8 * 8192 * 2
    assert one.comm_s == pytest.approx(2 * 80 * (2 * 3 / 4 * msg / 450e9 + GPU_EFFICIENCY.allreduce_latency_s))
    fp8 = StepModel(Deployment(l70, h100, 4, "fp8", "bf16")).cost([Work(1, 1000)] * 8)
    assert fp8.memory_s < 0.6 * one.memory_s  # half the weight bytes


def test_int8_and_int4_are_weight_formats_read_at_their_bytes():
    l8, h100 = model_spec("llama-3.1-8b"), accelerator_spec("h100-sxm")
    # a value and, per 32 of them, an fp16 scale and minimum (models/quant.py's format)
    assert memory.dtype_bytes("int8") == 1 + 4 / 32 and memory.dtype_bytes("int4") == 0.5 + 4 / 32
    bf16 = StepModel(Deployment(l8, h100, 1, "bf16", "bf16")).cost([Work(1, 1000)])
    int4 = StepModel(Deployment(l8, h100, 1, "int4", "bf16")).cost([Work(1, 1000)])
    assert int4.memory_s < 0.4 * bf16.memory_s
    with pytest.raises(ValueError, match="not a KV cache dtype"):
        Deployment(l8, h100, 1, "bf16", "int4")
    from kvserve.planning.search import candidates

    kinds = {(d.weight_dtype, d.kv_dtype) for d in candidates(l8, [h100], ("bf16", "int8", "int4"))}
    assert kinds == {("bf16", "bf16"), ("int8", "bf16"), ("int4", "bf16")}
    assert {d.kv_dtype for d in candidates(l8, [h100], ("int4",))} == {"bf16"}  # KV bf16 when none is given


# ---- the simulator ------------------------------------------------------------------------------------

class LinearStep:
    """10 ms a step plus 1 ms a token: easy to work out by hand."""

    def __call__(self, work):
        tokens = sum(w.new for w in work)
        return StepCost(0.010 + 0.001 * tokens if work else 0.0, 0.0, 0.0, 0.0, 0.0)


def test_one_request_hand_worked():
    sim = Simulator(LinearStep(), num_blocks=64)
    r = sim.run(Workload("one", [Arrival(0.0, 32, 4)]))
    t = r.tiers[Priority.INTERACTIVE]
    assert t.completed == 1 and t.output_tokens == 4 and r.steps == 4
    assert t.ttft == [pytest.approx(0.042)]  # the prompt's step: 10 ms + 32 x 1 ms, sampling the first token
    assert t.tpot == [pytest.approx(0.011)]  # then one token a step
    assert t.latency == [pytest.approx(0.075)] and r.duration_s == pytest.approx(0.075)


def test_the_real_scheduler_preempts_in_a_small_pool_and_every_request_finishes():
    # 12 blocks of 16 = 192 tokens; four requests that grow to 128 tokens each
    sim = Simulator(LinearStep(), num_blocks=12, scheduler=SchedulerConfig(max_model_len=256))
    r = sim.run(Workload("tight", loops=[ClosedLoop(4, 4, LengthDist(64), LengthDist(64))]))
    t = r.tiers[Priority.INTERACTIVE]
    assert t.completed == 4 and t.output_tokens == 256
    assert r.preemptions > 0
    sim.kv.check_integrity()
    assert sim.kv.usage().used_device_blocks == 0  # nothing leaked


def test_prefix_caching_and_tiers_come_from_the_real_scheduler():
    w4 = Workload("W4", loops=[ClosedLoop(16, 4, LengthDist(64), LengthDist(16), shared_prefix_tokens=256)])
    assert Simulator(LinearStep(), 512).run(w4).prefix_hit_rate > 0.5
    assert Simulator(LinearStep(), 512, enable_prefix_caching=False).run(w4).prefix_hit_rate == 0
    flood = ClosedLoop(64, 16, LengthDist(256), LengthDist(64), Priority.BATCH)
    chats = [Arrival(0.5 + i * 0.5, 64, 16) for i in range(10)]
    r = Simulator(LinearStep(), 2048).run(Workload("W3", chats, [flood]))
    inter, batch = r.tiers[Priority.INTERACTIVE], r.tiers[Priority.BATCH]
    assert inter.completed == 10 and batch.completed == 64
    assert percentile(inter.ttft, 50) < percentile(batch.ttft, 50)


def test_the_simulator_models_disk_tier_hits():
    """8 prefixes of 512 tokens cycled through a pool of about two: without a tier nearly every prefix is gone when
    it comes back; with one, it loads from there, priced by tier_load_s."""
    arrivals = [Arrival(i * 2.0, 576, 8, prefix_id=i % 8, prefix_tokens=512) for i in range(48)]
    loads = []

    def load_s(pages: int) -> float:
        loads.append(pages)
        return 0.001 * pages

    small = Simulator(LinearStep(), 80).run(Workload("W4-many", arrivals))
    tiered = Simulator(LinearStep(), 80, tier_pages=10_000, tier_load_s=load_s).run(Workload("W4-many", arrivals))
    assert small.prefix_hit_rate < 0.1
    assert tiered.prefix_hit_rate > 0.7 and tiered.tier_hit_rate > 0.7 and sum(loads) >= 40 * 32
    assert Simulator(LinearStep(), 80, tier_pages=64).run(Workload("W4-many", arrivals)).prefix_hit_rate < 0.1


def test_admission_refusals_count_as_refused():
    cfg = SchedulerConfig(interactive=SchedulerConfig().interactive.__class__(max_waiting=2))
    arrivals = [Arrival(0.0, 512, 32) for _ in range(10)]
    r = Simulator(LinearStep(), 1024, scheduler=cfg).run(Workload("burst", arrivals))
    t = r.tiers[Priority.INTERACTIVE]
    assert t.rejected > 0 and t.completed + t.rejected == 10


def test_traces(tmp_path):
    p = poisson(10.0, 30.0, LengthDist(100), LengthDist(50, 0.5), seed=1)
    assert 200 < len(p) < 400 and all(a.time < 30 for a in p) and all(25 <= a.output_tokens <= 75 for a in p)
    b = bursty(10.0, 100.0, LengthDist(100), LengthDist(50), seed=1)
    assert 700 < len(b) < 1300
    on = sum(1 for a in b if a.time % 10 < 2)  # 20% of the time at 4x the rate: ~80% of the arrivals
    assert on / len(b) > 0.6
    f = tmp_path / "trace.jsonl"
    f.write_text('{"time": 1.5, "prompt_tokens": 10, "output_tokens": 5, "priority": "batch"}\n'
                 '{"time": 0.5, "prompt_tokens": 20, "output_tokens": 5}\n')
    r = recorded(f)
    assert [a.time for a in r] == [0.5, 1.5] and r[1].priority is Priority.BATCH
    f.write_text('{"time": 1}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        recorded(f)


# ---- the search -----------------------------------------------------------------------------------------

def test_redundancy_hand_worked():
    # 10 replicas needed, each up 99%: P(>= 10 of 11 up) = 0.99^11 + 11 x 0.01 x 0.99^10 = 0.99482 < 0.999;
    # of 12: + 66 x 0.01^2 x 0.99^10 = 0.99978 -> 2 spares
    assert redundancy(10, Redundancy(1, 0.999, 0.99))[0] == 12
    # 3 regions, each for half the load: 5 a region; P(>= 5 of 6) = 0.99854, of 7 = 0.99997 -> 7 x 3
    total, notes = redundancy(10, Redundancy(3, 0.999, 0.99))
    assert total == 21 and "ceil(10 / 2) = 5" in notes[0]


def test_the_70b_example_meets_its_slos_on_h100_and_h200():
    slos = [SLO("ttft", 50, 0.2), SLO("tpot", 50, 0.05)]
    r = plan(model_spec("llama-3.1-70b"), [accelerator_spec("h100-sxm"), accelerator_spec("h200")],
             Load(10_000, LengthDist(1000), LengthDist(500)), slos, sim_seconds=15)
    assert {p.candidate.deployment.accelerator.name for p in r.per_accelerator} == {"h100-sxm", "h200"}
    for p in r.per_accelerator:
        assert p.meets_slo and p.simulation is not None
        t = p.simulation.tiers[Priority.INTERACTIVE]
        assert percentile(t.ttft, 50) <= 0.2 and percentile(t.tpot, 50) <= 0.05
        # the fleet carries the load: replicas x per-replica capacity >= 10,000 requests a minute
        assert p.interactive_replicas * p.candidate.capacity_per_s >= 10_000 / 60 * 0.999
        assert p.cost_per_hour == pytest.approx(p.devices * p.candidate.deployment.accelerator.price_per_hour)
    assert r.best.cost_per_hour == min(p.cost_per_hour for p in r.per_accelerator)


def test_an_slo_no_configuration_meets_gets_the_closest_plan_and_the_reason():
    r = plan(model_spec("llama-3.1-70b"), [accelerator_spec("l4")], Load(600, LengthDist(1000), LengthDist(200)),
             [SLO("tpot", 50, 0.001)])
    assert not r.best.meets_slo and "TPOT" in r.best.unreachable and r.best.replicas >= 1


def test_batch_work_fills_headroom_and_is_priced_per_tier():
    r = plan(model_spec("llama-3.1-8b"), [accelerator_spec("h100-sxm")],
             Load(6000, LengthDist(500), LengthDist(200), batch_share=0.5), [SLO("ttft", 50, 0.5)], simulate=False)
    p = r.best
    assert set(p.cost_per_million) == {"interactive", "batch"} and p.interactive_replicas >= 1


def test_the_measured_quality_of_int8_and_int4_weights_is_shipped_with_its_provenance():
    from kvserve.planning.specs import known_weight_quality

    table = known_weight_quality()
    assert {"int8", "int4"} <= set(table)
    for q in table.values():
        assert {m for m, _, _ in q.measured} == {"smollm2-135m", "gemma3-270m"}
        assert all(0 <= kld < 10 and 0 < top1 <= 1 for _, kld, top1 in q.measured)
        assert q.machine and q.date and q.page.endswith(".md")
    # 4 bits lose more than 8 on every model measured
    eight = dict((m, kld) for m, kld, _ in table["int8"].measured)
    assert all(kld > eight[m] for m, kld, _ in table["int4"].measured)


def test_a_plan_with_quantized_weights_states_the_quality_it_assumes():
    from kvserve.planning.cli import plan_json, quality_assumptions, render
    from kvserve.planning.specs import WeightQuality

    table = {"int4": WeightQuality("int4", (("smollm2-135m", 0.0812, 0.853), ("gemma3-270m", 0.1, 0.8)),
                                   "AMD EPYC (CPU level native)", "2026-12-02", "docs/bench/quality-tradeoff.md")}
    text = quality_assumptions(["bf16", "int4", "fp8", "int4"], table)
    assert text[0].startswith("fp8 weights: quality not measured here") and len(text) == 2
    assert text[1] == ("int4 weights: smollm2-135m: KLD 0.0812, top-1 85.3%; gemma3-270m: KLD 0.1000, top-1 "
                       "80.0% against float32, measured on AMD EPYC (CPU level native) (2026-12-02, "
                       "docs/bench/quality-tradeoff.md); assumed to carry over to this model and accelerator")
    assert quality_assumptions(["bf16"], table) == []
    # the planner reads the shipped table: a plan that can only use int4 weights says what it assumes
    load, slos = Load(600, LengthDist(500), LengthDist(100)), [SLO("ttft", 50, 1.0)]
    r = plan(model_spec("llama-3.1-8b"), [accelerator_spec("l4")], load, slos, dtypes=("int4",), simulate=False)
    assert r.best.candidate.deployment.weight_dtype == "int4"
    out = render(r, "llama-3.1-8b", load, slos)
    assert "Assumed (quality):\n  int4 weights: smollm2-135m: KLD" in out and "assumed to carry over" in out
    assert plan_json(r, "llama-3.1-8b", load, slos)["assumptions"][0].startswith("int4 weights:")


# ---- calibration fit ----------------------------------------------------------------------------------

def test_the_fit_recovers_known_machine_figures():
    m = model_spec("smollm2-135m")
    shapes = [[Work(1, c)] * b for b in (1, 2, 4, 8, 16, 32, 64) for c in (128, 1024)]
    shapes += [[Work(n, 0)] for n in (16, 64, 256, 1024, 2048)] + [[Work(256, 0)] + [Work(1, 128)] * 8]
    true = dict(o=0.012, p=3e-4, pf=0.004, flops=2.5e11, attention=1.0e11, bw=2.0e10)
    samples = []
    for w in shapes:
        parts = features(m, "bf16", "bf16", w)
        roof = max(parts.linear_flops / true["flops"], parts.weight_bytes / true["bw"]) + \
            max(parts.attention_flops / true["attention"], parts.kv_bytes / true["bw"])
        samples.append((parts, true["o"] + true["p"] * parts.seqs + true["pf"] * parts.has_prefill + roof))
    got = fit(samples, bandwidth=true["bw"])
    assert got["flops"] == pytest.approx(true["flops"], rel=0.03)
    assert got["attention_flops"] == pytest.approx(true["attention"], rel=0.05)
    assert got["step_overhead_s"] == pytest.approx(true["o"], rel=0.1)
    assert got["rms_relative_error"] < 0.02


def test_the_step_time_prior_follows_the_calibrated_roofline():
    from kvserve.planning.calibrate import step_time_prior
    from kvserve.planning.search import step_model
    from kvserve.planning.specs import calibrated_spec

    doc = {"machine": {"name": "cpu (test)", "memory_bytes": 1 << 34, "flops": 3e11, "attention_flops": 1e11,
                       "memory_bandwidth": 3e10}, "weight_dtype": "bf16", "kv_dtype": "bf16",
           "fit": {"step_overhead_s": 0.01, "per_seq_s": 2e-4, "prefill_overhead_s": 0.005,
                   "gemm_half_rate_tokens": 8.0}}
    m = model_spec("smollm2-135m")
    prior = step_time_prior(doc, m)
    sm = step_model(Deployment(m, calibrated_spec(doc), 1, "bf16", "bf16"))
    for b in (1, 8, 32, 64):
        assert prior.predict(b) == pytest.approx(sm.seconds([Work(1, 512)] * b), rel=0.15)
    for n in (64, 256):
        assert prior.predict(0, n) == pytest.approx(sm.seconds([Work(n, 0)]), rel=0.3)


# ---- the CLI --------------------------------------------------------------------------------------------

def test_plan_cli(capsys, tmp_path, monkeypatch):
    from kvserve.cli import main

    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path))  # no calibration of this machine there

    assert main(["plan", "--model", "nope"]) == 2
    assert "llama-3.1-70b" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a malformed SLO is argparse's usage error
        main(["plan", "--model", "llama-3.1-8b", "--slo", "latency:p50=1s"])
    capsys.readouterr()
    assert main(["plan", "--model", "llama-3.1-8b", "--accelerator", "h100-sxm,l4", "--rpm", "1200", "--json",
                 "--sim-seconds", "10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["meets_slo"] and len(doc["per_accelerator"]) == 2
    assert doc["plan"]["simulation"]["tiers"]["interactive"]["completed"] > 0
    assert main(["plan", "--model", "llama-3.1-70b", "--accelerator", "l4", "--slo", "tpot:p50=1ms",
                 "--no-simulate"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out
    assert main(["plan", "specs"]) == 0 and "mi300x" in capsys.readouterr().out
    assert main(["plan", "--model", "smollm2-135m", "--accelerator", "cpu"]) == 2  # not calibrated here
    assert "kvserve plan calibrate" in capsys.readouterr().err


def test_plans_serve_the_models_context_and_fail_a_workload_refused_mostly(tmp_path, capsys):
    """The simulated replica serves the model's own context (Llama-3.1-70B: 128k), or --max-model-len; a
    workload more than half refused fails on stderr instead of passing with no figures."""
    from kvserve.cli import main

    def trace(prompts):
        path = tmp_path / f"trace{len(prompts)}-{prompts[-1]}.jsonl"
        path.write_text("".join(json.dumps({"time": i * 0.5, "prompt_tokens": n, "output_tokens": 64}) + "\n"
                                for i, n in enumerate(prompts)))
        return str(path)

    def simulate(workload, *extra):
        capsys.readouterr()
        rc = main(["plan", "simulate", "--model", "llama-3.1-70b", "--accelerator", "h100-sxm", "--tp", "2",
                   "--dtype", "fp8", "--workload", workload, *extra])
        return rc, capsys.readouterr()

    long = trace([5000] * 4)
    rc, out = simulate(long)
    assert rc == 0 and "131,072-token context" in out.out and "4/4 done" in out.out and not out.err
    rc, out = simulate(long, "--max-model-len", "4096")
    assert rc == 1 and "refused in full" in out.err and "4096 tokens" in out.err
    rc, out = simulate(trace([1000, 5000, 5000, 5000]), "--max-model-len", "4096")
    assert rc == 1 and "refused mostly (3 of 4)" in out.err
    rc, out = simulate(trace([1000, 1000, 5000, 5000]), "--max-model-len", "4096")  # half: served
    assert rc == 0 and "2/4 done, 2 refused" in out.out and not out.err
    rc, out = simulate(long, "--max-model-len", "200000")
    assert rc == 2 and "131,072" in out.err
    assert main(["plan", "--model", "llama-3.1-8b", "--accelerator", "h100-sxm", "--input", "140000",
                 "--no-simulate"]) == 2
    assert "refused mostly" in capsys.readouterr().err


def test_plan_report_writes_its_plots(tmp_path, capsys):
    from kvserve.cli import main

    assert main(["plan", "--model", "llama-3.2-1b", "--accelerator", "l4", "--rpm", "600", "--input", "500",
                 "--output", "100", "--sim-seconds", "5", "--report", str(tmp_path / "rep")]) == 0
    files = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"index.html", "ttft_vs_load.png", "kv_over_time.png"} <= files
    assert "TTFT against load" in (tmp_path / "rep" / "index.html").read_text()


def test_calibration_profiles_the_real_engine_and_plans_with_it(tmp_path, tiny_llama_gguf, capsys, monkeypatch):
    """The tiny model through the real loading path: `plan calibrate` writes a file that `--accelerator`
    takes, and `plan simulate` and `plan` run on it."""
    from kvserve.cli import main

    config = tmp_path / "models.toml"
    config.write_text(f'[[models]]\nid = "tiny"\nsource = "{tiny_llama_gguf}"\ndtype = "float32"\n'
                      'num_gpu_blocks_override = 512\nmax_num_seqs = 16\n')
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    assert main(["plan", "calibrate", "--model", "tiny", "--config", str(config), "--price-per-hour", "0.05"]) == 0
    out = tmp_path / "home" / "calibration" / "tiny.json"
    doc = json.loads(out.read_text())
    assert doc["weight_dtype"] == "fp32" and doc["num_blocks"] == 512 and doc["max_num_seqs"] == 16
    assert doc["fit"]["flops"] > 0 and doc["fit"]["bandwidth"] > 0 and len(doc["samples"]) >= 20
    assert doc["fit"]["median_abs_relative_error"] < 1.0  # a broken fit is off by multiples; noise by tens of %
    capsys.readouterr()
    assert main(["plan", "simulate", "--model", str(tiny_llama_gguf), "--accelerator", str(out),
                 "--workload", "W2", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["tiers"]["interactive"]["completed"] == 8 and sim["output_tokens_per_s"] > 0
    assert main(["plan", "--model", str(tiny_llama_gguf), "--accelerator", str(out), "--rpm", "10", "--input", "64",
                 "--output", "16", "--slo", "ttft:p50=10s", "--sim-seconds", "10"]) == 0
    text = capsys.readouterr().out
    assert "1 replica(s) of cpu" in text and "$0.05/hour" in text
    # break-even prices from the same calibration: its engine time per token at the model's replica cost
    assert main(["plan", "prices", "--config", str(config), "--utilization", "0.25", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    cost_per_s = row["replica_cost_per_hour"] / 3600
    for kind in ("input", "output"):
        assert row["engine_s_per_token"][kind] > 0
        assert row["break_even"][kind] == pytest.approx(row["engine_s_per_token"][kind] * cost_per_s / 0.25 * 1e6)
        assert row["suggested"][kind] >= 2 * row["break_even"][kind]  # the default margin: 100%
    assert main(["plan", "prices"]) == 1  # the packaged models are not calibrated in this home
    assert "kvserve plan calibrate --model smollm2-135m" in capsys.readouterr().err
    # a server's engine for that model starts from this machine's step times, not the generic defaults
    from kvserve.config import engine_config_from_kwargs
    from kvserve.engine.worker.llm_engine import LLMEngine
    from kvserve.engine.step_time import StepTimeModel
    from kvserve.planning.calibrate import calibrated_prior

    prior = calibrated_prior("tiny")
    assert prior is not None and prior.weight_dtype == "fp32" and calibrated_prior("another-model") is None
    config = engine_config_from_kwargs(str(tiny_llama_gguf), dtype="float32", num_gpu_blocks_override=512)
    engine = LLMEngine(config, model_id="tiny", step_time_prior=prior)
    assert engine.core.scheduler.step_time.predict(16) == prior.model().predict(16) != StepTimeModel().predict(16)
    # measured at another dtype: the engine keeps the generic defaults
    engine = LLMEngine(config, model_id="tiny", step_time_prior=replace(prior, weight_dtype="bf16"))
    assert engine.core.scheduler.step_time.predict(16) == StepTimeModel().predict(16)


def test_speculation_drafts_long_where_steps_read_weights_and_short_where_they_compute():
    """Llama-3.1-8B on an H100: one sequence's step is bound by reading the weights, so a draft of 8 costs
    almost nothing and TPOT falls by about the expected tokens a step; at 512 sequences the step computes, and
    drafts shorten; drafts nobody accepts are never run."""
    from kvserve.planning.search import Speculation, decode_draft, steady_state

    sm = StepModel(Deployment(model_spec("llama-3.1-8b"), accelerator_spec("h100-sxm")), GPU_EFFICIENCY)
    spec = Speculation(acceptance=0.63, max_draft=8)
    draft, seconds, tokens = decode_draft(sm, 1, 1250, spec)
    assert draft >= 6 and tokens == pytest.approx(spec.tokens(draft))
    plain = steady_state(sm, 1, 1000, 500, 8192)
    fast = steady_state(sm, 1, 1000, 500, 8192, spec)
    assert plain[3] == 0 and fast[3] == draft
    assert plain[1] / fast[1] > 2.0  # TPOT
    assert decode_draft(sm, 512, 1250, spec)[0] < draft
    assert decode_draft(sm, 1, 1250, Speculation(acceptance=0.0))[0] == 0
    with pytest.raises(ValueError):
        Speculation(acceptance=1.0)
