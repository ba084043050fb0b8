"""The trade-off table's arithmetic (benchmarks/quality.py): KLD, top-1, perplexity, the task's scoring, cost per
million output tokens, the targets, and the planner's data file it writes."""
from __future__ import annotations

import math
import tomllib

import pytest
import torch

from benchmarks import quality as q
from kvserve.config import ModelPrice


def test_kl_divergence_hand_worked_and_chunked():
    p = torch.tensor([[0.0, math.log(3)], [1.0, 1.0]])  # P = (1/4, 3/4), then uniform
    u = torch.zeros(2, 2)  # Q uniform
    kld = q.kl_divergence(p, u)
    assert kld[0].item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    assert kld[1].item() == pytest.approx(0.0, abs=1e-12)
    assert q.kl_divergence(p, p + 7.0).abs().max().item() < 1e-12  # logits are shift-invariant
    a, b = torch.randn(50, 300), torch.randn(50, 300)
    assert torch.allclose(q.kl_divergence(a, b, rows=7), q.kl_divergence(a, b))  # chunks change nothing
    assert (q.kl_divergence(a, b) > 0).all() and not torch.allclose(q.kl_divergence(a, b), q.kl_divergence(b, a))


def test_top1_and_perplexity():
    ref = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    other = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 1.0], [9.0, 0.0, 0.0]])
    assert q.top1_agreement(ref, other) == 0.75
    assert q.perplexity(torch.zeros(5, 10), [1, 2, 3, 4, 5]) == pytest.approx(10.0)  # uniform: the vocabulary
    sure = torch.full((3, 4), -30.0)
    sure[0, 2] = sure[1, 1] = 30.0  # the last row predicts past the text: not counted
    assert q.perplexity(sure, [0, 2, 1]) == pytest.approx(1.0)


def test_the_task_prompts_and_scoring():
    task = q.questions()
    assert len(task) == 50 and len({x for x, _ in task}) == 50 and all(a.strip() for _, a in task)
    prompt = q.few_shot("What is the capital of France?")
    assert prompt.startswith("Q: What is the capital of Italy?\nA: Rome\n\n")
    assert prompt.endswith("\n\nQ: What is the capital of France?\nA:")
    assert q.first_line(" Paris\nQ: next") == "Paris"
    reference = ["Paris", "Tokyo", "", "Jupiter"]
    assert q.same_answers(reference, [" Paris", "Kyoto", "", "Jupiter\nQ:"]) == 3
    assert q.correct_answers(["Paris", "Neil Armstrong", "7"], ["paris", "Armstrong", "7 days"]) == 2
    with pytest.raises(ValueError):
        q.same_answers(reference, reference[:2])


def test_cost_per_million_output_tokens_is_metering_cost():
    # 10 engine seconds at $0.36 an hour cost $0.001; over 1,000 output tokens that is $1 a million
    assert q.cost_per_million(ModelPrice(replica_cost_per_hour=0.36), 10.0, 1000) == pytest.approx(1.0)
    assert q.cost_per_million(ModelPrice(), 3600.0, 10 ** 6) == pytest.approx(0.10)  # the shipped default


def _row(weights, kld, top1, **more):
    return {"weights": weights, "kv": "bf16", "loaded": weights, "perplexity": 16.0, "kld": kld, "top1": top1,
            "task_same": 48, "task_correct": 30, "tpot_ms": 12.0, "w1_out_tok_s": 100.0,
            "cost_per_million_output": 0.3, **more}


def test_the_targets():
    rows = [_row("bf16", 0.0033, 0.976), _row("auto", 0.0029, 0.974, kld_vs_dense=0.002, top1_vs_dense=0.97),
            _row("int8", 0.0049, 0.981, kld_vs_dense=0.002, top1_vs_dense=0.97),
            _row("int4", 0.08, 0.85, kld_vs_dense=0.09, top1_vs_dense=0.85)]
    c = q.checks(rows, {"kld": 0.0025, "top1": 0.98})
    assert c["int8"]["passed"] and c["int8"]["kld"] == 0.0049 and c["int8"]["kld_max"] == 0.005
    assert c["auto_vs_dense"]["passed"] and not c["auto_vs_dense"]["closer_to_float32"]  # top-1 is lower
    rows[2]["top1"] = 0.979
    assert not q.checks(rows, {"kld": 0.0019, "top1": 0.98})["int8"]["passed"]
    assert not q.checks(rows, {"kld": 0.0019, "top1": 0.98})["auto_vs_dense"]["passed"]
    assert "auto_vs_dense" not in q.checks(rows, None)


def test_8bit_activation_rows_stand_beside_their_weights_bf16_rows():
    """An 8-bit activations row is reported against the same weights with bf16 activations; it takes no
    other row's place (the int8 weights' target and the planner read the bf16 activations row)."""
    rows = [_row("bf16", 0.0033, 0.976), _row("int8", 0.0029, 0.981),
            _row("int8", 0.0060, 0.970, activations="int8", tpot_ms=9.0)]
    c = q.checks(rows, None)
    assert c["int8"]["kld"] == 0.0029 and c["int8"]["passed"]
    assert c["activations_int8"] == {"weights": "int8", "kld": 0.0060, "top1": 0.970, "task_same": 48,
                                     "tpot_ms": 9.0, "kld_bf16": 0.0029, "top1_bf16": 0.981, "task_same_bf16": 48,
                                     "tpot_ms_bf16": 12.0}


def test_the_8bit_kv_target_is_the_cache_alone():
    """Held to float32 with an 8-bit cache against float32; the bf16 comparison is reported, not held."""
    rows = [_row("bf16", 0.0033, 0.976), {**_row("bf16", 0.0090, 0.970), "kv": "int8", "kld_vs_kv": 0.0068,
                                          "top1_vs_kv": 0.974}]
    c = q.checks(rows, None, {"kld": 0.0016, "top1": 0.985})
    assert c["kv_int8"]["passed"] and c["kv_int8"]["kld_max"] == 0.002
    assert c["kv_int8_bf16"] == {"weights": "bf16", "kv": "int8", "kld": 0.0068, "top1": 0.974}
    assert not q.checks(rows, None, {"kld": 0.0021, "top1": 0.985})["kv_int8"]["passed"]
    assert "kv_int8" not in q.checks(rows, None)


def test_the_page_and_the_planner_data(monkeypatch):
    from kvserve.planning.specs import weight_quality_from_toml

    rows = [_row("bf16", 0.0033, 0.976), _row("int8", 0.0029, 0.974, kld_vs_dense=0.004, top1_vs_dense=0.96),
            _row("int4", 0.0865, 0.848, kld_vs_dense=0.09, top1_vs_dense=0.85)]
    model = {"model": "smollm2-135m", "reference": {"perplexity": 16.2, "task_correct": 31}, "rows": rows,
             "checks": q.checks(rows, None)}
    data = {"machine": {"cpu_model": "AMD EPYC", "avx2": True, "nproc": 2}, "level": "native", "torch": "2",
            "date": "2026-12-02", "quick": False, "text": "quality_text.txt", "questions": 50, "answer_tokens": 16,
            "tpot_tokens": 64, "tpot_runs": 3, "w1_runs": 1, "models": [model],
            "shape": {"num_prompts": 64, "prompt_len": 256, "output_len": 128, "batch": 32}}
    page = q.tradeoff_markdown(data, "python -m benchmarks.quality --tradeoff")
    assert "| smollm2-135m | int8 | bf16 | bf16 | int8 | 16.000 | 0.00290 | 97.4% | 48 | 30 | 0.00400 | 96.0% | 12.0 " \
           "| 100.0 | $0.30 | FAIL |" in page
    assert "8-bit weights (`weights = int8`): KLD 0.00290 (target <= 0.005), top-1 97.4% (target >= 98%): FAIL" in page
    table = weight_quality_from_toml(tomllib.loads(q.planner_data(data, "docs/bench/quality-tradeoff.md")))
    assert table["int4"].measured == (("smollm2-135m", 0.0865, 0.848),)
    assert table["int8"].machine == "AMD EPYC (CPU level native)" and table["int8"].date == "2026-12-02"
    assert "bf16" not in table
