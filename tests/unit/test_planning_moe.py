"""Capacity planning of mixtures of experts: memory holds every expert, a token computes with its k, and a step
reads the experts its tokens are expected to touch (roofline.experts_touched); the specs against their published
counts, the config.json fields, a plan, the CLI."""
from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from kvserve.planning import memory
from kvserve.planning.calibrate import features
from kvserve.planning.roofline import Deployment, StepModel, Work, experts_touched
from kvserve.planning.search import SLO, Load, plan
from kvserve.planning.specs import ModelSpec, accelerator_spec, known_models, model_from_dict, model_spec, \
    spec_from_hf_config
from kvserve.planning.traces import LengthDist

MOE = ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b")


# ---- the expected distinct experts ------------------------------------------------------------------

def test_experts_touched_is_k_for_one_token_and_approaches_every_expert():
    for e, k in ((128, 8), (8, 2), (64, 6)):
        assert experts_touched(e, k, 0) == 0
        assert experts_touched(e, k, 1) == pytest.approx(k)
        assert experts_touched(e, k, 100_000) == pytest.approx(e)
        counts = [experts_touched(e, k, b) for b in range(1, 4097)]
        assert all(a <= b for a, b in zip(counts, counts[1:]))  # monotone in the step's tokens
        assert all(c <= min(e, b * k) + 1e-9 for b, c in zip(range(1, 4097), counts))  # never past either bound
    # hand-worked: 8 tokens of a 128-expert, top-8 layer touch 128 (1 - (120/128)^8) = 51.6 of them, not 64
    assert experts_touched(128, 8, 8) == pytest.approx(128 * (1 - (120 / 128) ** 8)) == pytest.approx(51.6, abs=0.1)
    assert experts_touched(8, 8, 3) == 8  # every expert for every token


# ---- specs and parameter counts -----------------------------------------------------------------------

def test_moe_specs_match_their_published_total_and_active_counts():
    got = {}
    for name in MOE:
        m = model_spec(name)
        p = memory.parameter_count(m)
        assert m.is_moe and m.num_moe_layers == m.num_layers and m.num_shared_experts == 0
        assert abs(p.total / 1e9 / m.params_b - 1) < 0.03, name
        assert abs(p.active / 1e9 / m.active_params_b - 1) < 0.03, name
        got[name] = (round(p.total / 1e9, 1), round(p.active / 1e9, 1))
    assert got == {"qwen3-30b-a3b": (30.5, 3.4), "qwen3-235b-a22b": (235.1, 22.2), "mixtral-8x7b": (46.7, 12.9)}
    # a dense model's active count is its total
    for m in known_models().values():
        if not m.is_moe:
            p = memory.parameter_count(m)
            assert p.active == p.total and p.expert == 0, m.name


def test_qwen3_30b_a3b_parameters_hand_worked():
    m = model_spec("qwen3-30b-a3b")
    attention = 2048 * 4096 * 2 + 2 * 2048 * 512  # q and o 2048 x 4096; k and v 2048 x 512
    expert = 3 * 2048 * 768
    router = 2048 * 128
    embedding = 151936 * 2048  # and an untied head of the same size
    p = memory.parameter_count(m)
    assert p.total == 48 * (attention + 128 * expert + router + 2 * 2048) + 2 * embedding + 2048 == 30_532_110_336
    assert p.active == p.total - 48 * 120 * expert
    assert p.layer_matmul == 48 * (attention + 8 * expert + router) and p.expert == 48 * expert
    # memory holds every expert
    assert memory.weight_bytes(m, "bf16") == 2 * p.total


def test_moe_fields_are_validated_and_round_trip():
    base = dict(name="x", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=100)
    with pytest.raises(ValueError, match="experts_per_token must be an integer from 1 to 4"):
        ModelSpec(**base, num_experts=4, experts_per_token=5)
    with pytest.raises(ValueError, match="num_experts must be an integer at least 0"):
        ModelSpec(**base, num_experts=-1)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelSpec(**base, num_experts=4, experts_per_token=2, moe_intermediate_size=0)
    with pytest.raises(ValueError, match="num_dense_layers"):
        ModelSpec(**base, num_experts=4, experts_per_token=2, num_dense_layers=5)
    with pytest.raises(ValueError, match="num_shared_experts"):
        ModelSpec(**base, num_experts=4, experts_per_token=2, num_shared_experts=-1)
    with pytest.raises(ValueError, match="describe a mixture of experts"):
        ModelSpec(**base, num_shared_experts=1)  # a dense model
    m = ModelSpec(**base, num_experts=4, experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
                  num_dense_layers=1)
    assert (m.num_moe_layers, m.expert_intermediate_size) == (3, 32)
    p = memory.parameter_count(m)
    expert = 3 * 64 * 32
    assert p.total - p.active == 3 * 2 * expert  # 3 MoE layers, 2 of their 4 routed experts unused a token
    assert p.layer_matmul == 4 * (64 * 64 * 2 + 2 * 64 * 32) + 3 * 64 * 128 + 3 * (3 * expert + 64 * 4)
    # 0 experts (the engine's ModelConfig's way of saying dense) is the dense default
    zero, one = ModelSpec(**base, num_experts=0, experts_per_token=0), ModelSpec(**base)
    assert not zero.is_moe and memory.parameter_count(zero) == memory.parameter_count(one)
    h100 = accelerator_spec("h100-sxm")
    work = [Work(1, 10)] * 4 + [Work(20, 0)]
    assert StepModel(Deployment(zero, h100)).parts(work) == StepModel(Deployment(one, h100)).parts(work)
    # a calibration file's spec (asdict, through JSON) reads back; an older file without the MoE keys reads as dense
    assert model_from_dict(json.loads(json.dumps(asdict(m)))) == m
    old = {k: v for k, v in asdict(model_spec("smollm2-135m")).items()
           if k not in ("moe_intermediate_size", "num_shared_experts", "num_dense_layers", "active_params_b")}
    assert model_from_dict(old) == model_spec("smollm2-135m")


def test_moe_config_json_fields_are_read():
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "use_sliding_window": False, "sliding_window": None}
    m, table = spec_from_hf_config(qwen, name="q"), model_spec("qwen3-30b-a3b")
    for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "num_experts", "experts_per_token", "moe_intermediate_size", "num_shared_experts",
              "num_dense_layers", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(m, f) == getattr(table, f), f
    assert memory.parameter_count(m) == memory.parameter_count(table)
    # Qwen's dense layers: mlp_only_layers and every layer off the sparse step
    some_dense = spec_from_hf_config({**qwen, "decoder_sparse_step": 2, "mlp_only_layers": [1]}, name="q")
    assert some_dense.num_dense_layers == 25  # the 24 even-indexed layers (off the step of 2) and layer 1
    assert spec_from_hf_config({**qwen, "mlp_only_layers": [0, 5]}, name="q").num_dense_layers == 2
    # Mixtral: experts of intermediate_size
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
               "sliding_window": None, "tie_word_embeddings": False}
    mx = spec_from_hf_config(mixtral, name="m")
    assert (mx.num_experts, mx.experts_per_token, mx.moe_intermediate_size, mx.expert_intermediate_size) == \
        (8, 2, None, 14336)
    assert memory.parameter_count(mx) == memory.parameter_count(model_spec("mixtral-8x7b"))
    # DeepSeek-style: shared experts, the first k layers dense; Qwen2-MoE's shared expert in expert widths
    ds = spec_from_hf_config({**qwen, "num_experts": None, "n_routed_experts": 64, "n_shared_experts": 2,
                              "first_k_dense_replace": 1}, name="d")
    assert (ds.num_experts, ds.num_shared_experts, ds.num_dense_layers) == (64, 2, 1)
    q2 = spec_from_hf_config({**qwen, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
                             name="q2")
    assert q2.num_shared_experts == 4
    # a dense config stays dense
    dense = spec_from_hf_config({k: v for k, v in qwen.items() if "expert" not in k}, name="d")
    assert not dense.is_moe and dense.moe_intermediate_size is None and dense.num_dense_layers == 0


# ---- roofline ---------------------------------------------------------------------------------------

def _dense_twin(m: ModelSpec) -> ModelSpec:
    """A dense model of (nearly) the same total: one MLP as wide as all the experts together."""
    return replace(m, name=m.name + "-dense", num_experts=1, experts_per_token=1, moe_intermediate_size=None,
                   intermediate_size=m.expert_intermediate_size * m.num_experts)


def test_a_moe_decode_reads_far_fewer_bytes_than_a_dense_model_of_its_size():
    h100 = accelerator_spec("h100-sxm")
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        moe = model_spec(name)
        dense = _dense_twin(moe)
        assert memory.parameter_count(dense).total == pytest.approx(memory.parameter_count(moe).total, rel=1e-3)
        a, b = StepModel(Deployment(moe, h100, 1, "fp8")), StepModel(Deployment(dense, h100, 1, "fp8"))
        one = a.parts([Work(1, 999)]).weight_bytes
        assert one < b.parts([Work(1, 999)]).weight_bytes / 2
        assert a.decode_step(1, 1000).seconds < b.decode_step(1, 1000).seconds / 2
        # the more tokens a step has, the more experts it reads, up to all of them (a long prompt's chunk)
        reads = [a.parts([Work(1, 999)] * n).weight_bytes for n in (1, 2, 8, 32, 128)]
        assert all(x < y for x, y in zip(reads, reads[1:]))
        assert a.parts([Work(4096, 0)]).weight_bytes == pytest.approx(b.parts([Work(4096, 0)]).weight_bytes,
                                                                      rel=1e-3)
        # FLOPs follow the active parameters, not the total
        flops = a.parts([Work(1, 0)]).linear_flops
        assert flops < b.parts([Work(1, 0)]).linear_flops / 2


def test_a_moe_step_hand_worked():
    m, h100 = model_spec("qwen3-30b-a3b"), accelerator_spec("h100-sxm")
    p = memory.parameter_count(m)
    sm = StepModel(Deployment(m, h100, 2, "bf16", "bf16"))
    for batch in (1, 8, 64):
        parts = sm.parts([Work(1, 511)] * batch)
        dense = (p.total - p.embedding - 128 * p.expert) * 2 / 2  # attention, routers, norms, head; over tp 2
        assert parts.weight_bytes == pytest.approx(dense + p.expert * 2 / 2 * experts_touched(128, 8, batch))
        assert parts.linear_flops == pytest.approx((2 * p.layer_matmul * batch + 2 * p.head * batch) / 2)
    # a prefill chunk: the same formula over its tokens
    chunk = sm.parts([Work(300, 0)] + [Work(1, 511)] * 4)
    assert chunk.weight_bytes == pytest.approx((p.total - p.embedding - 128 * p.expert + p.expert *
                                                experts_touched(128, 8, 304)))
    # the calibration's features are the roofline's parts: one formula for both
    work = [Work(1, 100)] * 3
    assert features(m, "bf16", "bf16", work).weight_bytes == \
        pytest.approx((p.total - p.embedding - 128 * p.expert + p.expert * experts_touched(128, 8, 3)) * 2)


# ---- a plan and the CLI -------------------------------------------------------------------------------

def test_a_plan_for_qwen3_30b_a3b_on_one_h100():
    m, h100 = model_spec("qwen3-30b-a3b"), accelerator_spec("h100-sxm")
    load, slos = Load(600, LengthDist(1000), LengthDist(200)), [SLO("ttft", 50, 0.5), SLO("tpot", 50, 0.05)]
    r = plan(m, [h100], load, slos, dtypes=("bf16",), simulate=False)
    c = r.best.candidate
    assert r.best.meets_slo and r.best.replicas >= 1 and c.capacity_per_s > 0
    assert c.deployment.model.name == "qwen3-30b-a3b" and c.deployment.accelerator.name == "h100-sxm"
    assert c.memory.weight_bytes == 2 * memory.parameter_count(m).total / c.deployment.tp  # every expert held
    assert c.memory.fits


def test_plan_specs_lists_the_moe_models_with_their_active_parameters(capsys):
    from kvserve.cli import main

    assert main(["plan", "specs"]) == 0
    out = capsys.readouterr().out
    for name in MOE:
        assert name in out
    line = next(x for x in out.splitlines() if "qwen3-30b-a3b" in x)
    assert "30.53B (3.35B active: 8 of 128 experts)" in line
    assert "active" not in next(x for x in out.splitlines() if "llama-3.1-8b" in x)
