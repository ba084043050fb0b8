"""The device check's pipeline without a GPU: the script parses, and its benchmark runs on the CPU with a tiny
model (Triton's kernels in its interpreter), writing every figure the GPU run reports."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_device_check_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "device-check.sh")], check=True)


def test_the_gpu_benchmark_runs_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_decode.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu_decode", "--device", "cpu", "--tiny", "--iters", "1",
                    "--json", str(out)], check=True, cwd=REPO, timeout=300, capture_output=True)
    r = json.loads(out.read_text())
    assert [d["shape"] for d in r["decode"]] == ["b1 c64", "b4 c40", "b4 mixed"]
    assert all(d["torch_ms"] > 0 and d["triton_ms"] > 0 and "skipped" not in d for d in r["decode"])
    assert r["prefill"]["tokens"] == 64 and r["prefill"]["triton_tok_per_s"] > 0
    assert r["kernel_rel_err"] < 1e-5  # float32 on the CPU
    assert r["hbm_floor_ms"] > 0 and "stand-in" in r["cuda_graphs"]
    graphs = r["graphs"]  # the same shapes through DecodeGraphs, padded to their buckets
    assert [(g["shape"], g["bucket"]) for g in graphs] == [("b1 c64", 1), ("b4 c40", 4), ("b4 mixed", 4)]
    assert all(g["graph_equals_eager"] and g["graph_ms"] > 0 and g["graph_host_ms"] > 0 for g in graphs)
    fp8 = r["fp8"]  # the projections as e4m3: the weights' bytes shrink (the embeddings and LM head stay)
    assert fp8["weights_bytes"] < r["weights_bytes"] and len(fp8["decode"]) == 3
    assert all(d["triton_ms"] > 0 for d in fp8["decode"])
    assert out.with_suffix(".md").read_text().startswith("tiny on cpu")


def test_the_tensor_parallel_benchmark_runs_tiny_over_two_cpu_ranks(tmp_path):
    out = tmp_path / "gpu_tp.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu_tp", "--device", "cpu", "--tiny", "--iters", "1",
                    "--json", str(out)], check=True, cwd=REPO, timeout=300, capture_output=True)
    r = json.loads(out.read_text())
    assert r["tokens_equal"] and len(r["whole"]["tokens"]) == 16  # two ranks' slices of the same weights
    assert r["whole"]["step_ms"] > 0 and r["split"]["step_ms"] > 0
    assert out.with_suffix(".md").read_text().startswith("Tensor parallelism, tiny on cpu")
