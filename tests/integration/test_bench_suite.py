"""The benchmark pipeline end to end: `python -m benchmarks.suite --quick` starts a server, runs the
workloads with `kvserve bench serve`, stops it, and `benchmarks.report` renders BENCHMARKS.md and
the plots from the results. Against the fake server (no model: seconds) and, when the shipped SmolLM2
is installed, against `kvserve serve` itself (W1 and W2 only)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]


def run_suite(tmp_path: Path, *args: str, timeout: float = 600) -> Path:
    env = {**os.environ, "BENCH_LOCK": "none", "BENCH_PEERS": "0"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--out", str(tmp_path),
                        "--session", "s", *args], cwd=str(REPO), env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return tmp_path / "s"


@pytest.mark.slow
def test_suite_and_report_against_the_fake_server(tmp_path):
    root = run_suite(tmp_path, "--targets", "fake", "--w5-rate", "10")
    meta = json.loads((root / "meta.json").read_text())
    assert meta["targets"]["fake"]["status"] == "done"
    assert meta["ceilings"]["matmul_bf16_flops"] > 0 and meta["ceilings"]["copy_bytes_per_s"] > 0
    for job in ("W1", "W2", "W3-flood", "W3-alone", "W4", "W4-nocache", "W5", "SWEEP-c1", "SWEEP-c4"):
        res = json.loads((root / "fake" / job / "run0.json").read_text())
        assert res["completed"] > 0 and res["failed"] == 0, (job, res["error_counts"])
    w3 = json.loads((root / "fake" / "W3-flood" / "run0.json").read_text())
    assert w3["tiers"]["interactive"]["completed"] == 4 and w3["tiers"]["batch"]["cancelled"] == 2
    w5 = json.loads((root / "fake" / "W5" / "run0.json").read_text())
    assert w5["config"]["tiers"][0]["request_rate"] == 10.0
    md = (root / "BENCHMARKS.md").read_text()
    kind = report.cpu_kind(report.Session(root))
    assert f"## {report.CPU_KINDS[kind]}" in md  # this machine's kind of CPU has its section
    for heading in ("### Machine", "### W1 throughput", "### W3 tier isolation", "### W4 prefix reuse",
                    "### W5 overload", "### Throughput against concurrency", "### Exact commands"):
        assert heading in md
    assert "| fake |" in md and "--quick" in md
    assert (root / "plots" / "cpu" / f"{kind}.md").read_text() in md  # kept for the next render
    if importlib.util.find_spec("matplotlib"):
        assert (root / "plots" / "cpu" / kind / "throughput_vs_concurrency.png").stat().st_size > 1000
        assert (root / "plots" / "cpu" / kind / "w3_ttft_cdf.png").stat().st_size > 1000
    # the report renders again on its own, from the results alone
    out = tmp_path / "again.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.report", "--session", str(root), "--markdown", str(out),
                        "--plots", str(tmp_path / "p")], cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and out.read_text().count("| fake |") >= 5


@pytest.mark.slow
def test_missing_peers_are_skipped_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERS_DIR", str(tmp_path / "no-peers"))
    root = run_suite(tmp_path, "--targets", "vllm,llamacpp-bf16,hf-static", "--workloads", "W2")
    meta = json.loads((root / "meta.json").read_text())
    for name in ("vllm", "llamacpp-bf16", "hf-static"):
        assert meta["targets"][name]["status"] == "skipped" and meta["targets"][name]["reason"]
    md = (root / "BENCHMARKS.md").read_text()
    assert "skipped" in md


@pytest.mark.slow
@pytest.mark.real_model
def test_suite_quick_against_kvserve(tmp_path, smollm2_gguf_path):
    root = run_suite(tmp_path, "--targets", "kvserve", "--workloads", "W1,W2", timeout=900)
    meta = json.loads((root / "meta.json").read_text())
    assert meta["targets"]["kvserve"]["status"] == "done", meta["targets"]["kvserve"]
    for job, n in (("W1", 8), ("W2", 2)):
        res = json.loads((root / "kvserve" / job / "run0.json").read_text())
        assert res["completed"] == n and res["failed"] == 0, res["error_counts"]
        assert res["total_output_tokens"] == n * 16 and res["usage_reported"] == n
        # the random prompts re-tokenize on the server to exactly the length we meant
        assert res["server_prompt_tokens"] == res["input_lens"] == [32] * n
    assert "| kvserve |" in (root / "BENCHMARKS.md").read_text()


@pytest.mark.slow
def test_a_shape_model_runs_w1_and_w2_into_its_own_results(tmp_path, monkeypatch):
    """--models with a shape: its targets' results go to <target>@<model>/, W1 and W2 only, with the server's RSS;
    vLLM is recorded as not run and why; the report has its Larger models section and no SmolLM2 tables."""
    from benchmarks.targets import VLLM_NO_GGUF

    shapes = tmp_path / "peers" / "models" / "shapes"
    shapes.mkdir(parents=True)
    (shapes / "llama-1b.Q4_K_M.gguf").write_bytes(b"")  # the fake server loads nothing
    monkeypatch.setenv("PEERS_DIR", str(tmp_path / "peers"))
    root = run_suite(tmp_path, "--targets", "fake,vllm", "--models", "llama-1b.Q4_K_M,llama-1b.Q8_0",
                     "--workloads", "W1,W2,W3")
    meta = json.loads((root / "meta.json").read_text())
    fake = meta["targets"]["fake@llama-1b.Q4_K_M"]
    assert fake["status"] == "done" and fake["rss_bytes"] > 1 << 20
    assert meta["targets"]["vllm@llama-1b.Q4_K_M"]["reason"] == meta["targets"]["vllm@llama-1b.Q8_0"]["reason"] \
        == VLLM_NO_GGUF
    assert "missing" in meta["targets"]["fake@llama-1b.Q8_0"]["reason"]  # no file, no BENCH_PEERS_SETUP
    assert sorted(p.name for p in (root / "fake@llama-1b.Q4_K_M").iterdir() if p.is_dir()) == ["W1", "W2"]
    for job, n in (("W1", 8), ("W2", 2)):
        res = json.loads((root / "fake@llama-1b.Q4_K_M" / job / "run0.json").read_text())
        assert res["completed"] == n and res["failed"] == 0 and res["model_id"] == "llama-1b-q4_k_m"
    assert [j["name"] for j in meta["models"]["llama-1b.Q4_K_M"]["jobs"]] == ["W1", "W2"] and "jobs" not in meta
    md = (root / "BENCHMARKS.md").read_text()
    assert "### Larger models" in md and "| llama-1b.Q4_K_M | fake |" in md and "### W1 throughput" not in md
