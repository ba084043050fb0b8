"""The suite's workload shapes (WORKLOADS.md) and the peer server commands (shared/peers/*/run.sh), checked
without starting anything."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import targets as T
from benchmarks.suite import build_jobs, parse_args


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_full_workloads_match_workloads_md():
    jobs = {j.name: j for j in build_jobs(["W1", "W2", "W3", "W4", "W5", "SWEEP"], runs=3, quick=False)}
    w1 = jobs["W1"].args
    assert (_opt(w1, "--num-prompts"), _opt(w1, "--max-concurrency"), _opt(w1, "--random-input-len"),
            _opt(w1, "--random-output-len")) == ("64", "32", "256", "128")
    assert "--ignore-eos" in w1 and jobs["W1"].runs == 3
    w2 = jobs["W2"].args
    assert (_opt(w2, "--num-prompts"), _opt(w2, "--max-concurrency")) == ("8", "1")
    flood, alone = jobs["W3-flood"].args, jobs["W3-alone"].args
    assert _opt(flood, "--duration") == "60" and _opt(alone, "--duration") == "60"
    assert "batch:concurrency=16,input=256,output=256,drain=0" in _opt(flood, "--mix")
    inter = "interactive:rate=1,arrival=constant,dataset=chat,input=64,output=64"
    assert inter in _opt(flood, "--mix") and _opt(alone, "--mix") == inter
    assert jobs["W3-flood"].seed_base != jobs["W3-alone"].seed_base  # no prompt re-use between the two
    w4 = jobs["W4"].args
    assert (_opt(w4, "--dataset-name"), _opt(w4, "--shared-prefix-len"), _opt(w4, "--random-input-len"),
            _opt(w4, "--random-output-len"), _opt(w4, "--num-prompts"), _opt(w4, "--max-concurrency")) == \
           ("shared-prefix", "512", "64", "64", "32", "4")
    assert jobs["W4"].kind == "prefix_on" and jobs["W4-nocache"].kind == "prefix_off"
    w5 = jobs["W5"].args
    assert _opt(w5, "--duration") == "60" and _opt(w5, "--goodput-ttft-ms") == "1000"
    assert sorted(int(n[len("SWEEP-c"):]) for n in jobs if n.startswith("SWEEP")) == [1, 2, 4, 8, 16, 32, 64]
    # seeds never repeat between runs of different jobs
    seeds = [j.seed_base + k for j in jobs.values() for k in range(j.runs)]
    assert len(seeds) == len(set(seeds))


def test_w5_alone_brings_a_w1_calibration_run():
    jobs = build_jobs(["W5"], runs=3, quick=True)
    assert [j.name for j in jobs] == ["W1", "W5"] and jobs[0].runs == 1


def test_parse_args_defaults(monkeypatch):
    monkeypatch.delenv("BENCH_PEERS", raising=False)
    a = parse_args([])
    assert a.targets == ["kvserve"] and a.runs == 3 and a.workloads == ["W1", "W2", "W3", "W4", "W5", "SWEEP"]
    monkeypatch.setenv("BENCH_PEERS", "1")
    a = parse_args(["--quick", "--workloads", "w1,W3"])
    assert a.targets == ["kvserve", "vllm", "vllm-fp32", "llamacpp-bf16", "llamacpp-f16", "llamacpp-q4_1", "hf-static"]
    assert a.runs == 1 and a.workloads == ["W1", "W3"]
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "W9"])


def test_vllm_server_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    monkeypatch.delenv("BENCH_VLLM_PRIORITY", raising=False)
    t = T.VllmTarget()
    ok, why = t.available()
    assert not ok and "setup.sh" in why
    spec = t.server_spec("default", 8100, tmp_path)
    assert spec.argv[:4] == [str(tmp_path / "vllm-venv/bin/python"), str(T.peers_src() / "vllm" / "vllm_cli.py"),
                             "serve", str(tmp_path / "smollm2-135m-instruct-hf")]
    assert _opt(spec.argv, "--dtype") == "bfloat16" and _opt(spec.argv, "--served-model-name") == "smollm2-135m"
    assert _opt(spec.argv, "--host") == "127.0.0.1" and _opt(spec.argv, "--port") == "8100"
    assert "--no-enable-prefix-caching" not in spec.argv
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{(os.cpu_count() or 1) - 1}"
    assert spec.ready_path == "/v1/models"
    assert "--no-enable-prefix-caching" in t.server_spec(t.variant("prefix_off"), 8100, tmp_path).argv
    assert t.variant("plain") == t.variant("long") == t.variant("prefix_on") == "default"
    assert t.priority_style == "none"
    monkeypatch.setenv("BENCH_VLLM_PRIORITY", "1")
    t = T.VllmTarget()
    assert t.priority_style == "int" and "priority" in t.server_spec("default", 1, tmp_path).argv


def test_llamacpp_server_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    t = T.LlamaCppTarget("q4_1")
    assert t.name == "llamacpp-q4_1" and t.connection_close and t.model_id == "smollm2-135m-instruct"
    ok, why = t.available()
    assert not ok and "setup.sh" in why
    t._bin = "/opt/llama/bin"
    spec = t.server_spec(t.variant("plain"), 8200, tmp_path)
    a = spec.argv
    assert a[0] == "/opt/llama/bin/llama-server"
    assert _opt(a, "-m") == str(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (_opt(a, "-np"), _opt(a, "-c"), _opt(a, "--alias")) == ("32", "16384", "smollm2-135m-instruct")
    assert _opt(a, "-t") == _opt(a, "-tb") == str(t.threads)
    assert "--cont-batching" in a and "--no-cache-prompt" in a and "--no-webui" in a
    assert spec.ready_path == "/health"
    # W3/W4 need more than 512 tokens per slot; W4 "on" uses the slot prompt cache
    long = t.server_spec(t.variant("long"), 1, tmp_path).argv
    assert _opt(long, "-c") == "32768" and "--no-cache-prompt" in long
    on = t.server_spec(t.variant("prefix_on"), 1, tmp_path).argv
    assert _opt(on, "-c") == "32768" and "--no-cache-prompt" not in on
    assert "--no-cache-prompt" in t.server_spec(t.variant("prefix_off"), 1, tmp_path).argv
    assert T.LlamaCppTarget("bf16").model_path.name == "SmolLM2-135M-Instruct.BF16.gguf"


def test_hf_static_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    t = T.HfStaticTarget()
    assert not t.available()[0]
    argv = t.command(tmp_path / "b.json", quick=False)
    assert argv[1].endswith("baseline_transformers.py") and argv[2] == str(tmp_path / "smollm2-135m-instruct-hf")
    assert _opt(argv, "--batches") == "1,8,32" and _opt(argv, "--in-len") == "256"


def test_kvserve_bench_configs_parse(tmp_path):
    from kvserve.config import ServerConfig

    from benchmarks.suite import _engine_arg

    args = dict([_engine_arg("max_num_seqs=32"), _engine_arg("interactive={max_queue_wait_s = 2.5}"),
                 _engine_arg("kv_cache_memory=512MiB")])
    assert args == {"max_num_seqs": 32, "interactive": {"max_queue_wait_s": 2.5}, "kv_cache_memory": "512MiB"}
    t = T.KvserveTarget(engine_args=args)
    for variant, caching in (("default", True), ("nocache", False)):
        spec = t.server_spec(variant, 8000, tmp_path)
        cfg_path = Path(spec.argv[spec.argv.index("--config") + 1])
        cfg = ServerConfig.from_toml(str(cfg_path))
        assert [m.id for m in cfg.models] == ["smollm2-135m"]
        ec = cfg.models[0].engine_config()
        assert ec.cache.enable_prefix_caching is caching and ec.scheduler.max_num_seqs == 32
        assert ec.scheduler.interactive.max_queue_wait_s == 2.5 and ec.cache.kv_cache_memory == 512 << 20
        assert ec.scheduler.interactive.max_ttft_s == float("inf")  # peers refuse nothing in W1-W4; nor do we
        assert spec.ready_path == "/ready" and spec.argv[1:4] == ["-m", "kvserve.cli", "serve"]
    assert t.variant("prefix_off") == "nocache" and t.variant("long") == "default"
    spec = t.server_spec(t.variant("overload"), 8000, tmp_path)  # W5: the SLO as the admission bound
    cfg = ServerConfig.from_toml(spec.argv[spec.argv.index("--config") + 1])
    assert cfg.models[0].engine_config().scheduler.interactive.max_ttft_s == T.OVERLOAD_TTFT_S < 1.0


def test_peers_scripts_still_say_what_the_suite_assumes():
    """The commands above come from shared/peers/*/run.sh; fail loudly if those scripts change."""
    src = T.peers_src()
    if not (src / "vllm" / "run.sh").exists():
        pytest.skip(f"no peers scripts at {src}")
    vllm = (src / "vllm" / "run.sh").read_text()
    assert "vllm_cli.py\" serve" in vllm and "--served-model-name" in vllm and "NAME=smollm2-135m" in vllm
    assert 'VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"' in vllm
    llama = (src / "llamacpp" / "run.sh").read_text()
    for flag in ("--cont-batching", "--no-cache-prompt", "--no-webui", "-np", "--alias", "Connection=close"):
        assert flag in llama
    assert "SERVED_NAME=${SERVED_NAME:-smollm2-135m-instruct}" in llama
    assert (src / "vllm" / "baseline_transformers.py").exists()


def test_benchmarks_md_keeps_a_section_per_cpu_kind(tmp_path):
    """A render rewrites its own kind's page; BENCHMARKS.md is every kind's page in a fixed order, then the
    platform pages."""
    from benchmarks import report

    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "avx2.md").write_text("## CPU: avx2 page\n")
    (cpu / "amx.md").write_text("## CPU: amx page\n")
    (cpu / "avx2-profile.md").write_text("# Where a W1-shaped step's time goes\n")
    (cpu / "avx512-profile.md").write_text("# a profile of a kind never rendered\n")
    (tmp_path / "fleet.md").write_text("# Fleet benchmarks\n")
    md = report.assemble(tmp_path)
    assert md.startswith("# Benchmarks")
    assert md.index("amx page") < md.index("avx2 page") < md.index("## Fleet benchmarks")
    assert md.index("avx2 page") < md.index("### Where a W1-shaped step's time goes")  # in its kind, one level down
    assert "never rendered" not in md
    assert report.CPU_KINDS["avx512"] not in md  # a kind never rendered has no section


def test_cpu_kind_follows_the_level_a_session_was_held_to():
    """A session run at KVSERVE_CPU_ISA below the CPU's own renders into the lower kind's section."""
    from types import SimpleNamespace

    from benchmarks import report

    def kind(**machine):
        return report.cpu_kind(SimpleNamespace(meta={"ceilings": {"machine": machine}}))

    zen4 = {"avx512_bf16": True, "amx": False}
    assert kind(**zen4, isa_level="native") == "avx512"
    assert kind(**zen4, isa_level="avx2") == "avx2"
    assert kind(avx512_bf16=True, amx=True, isa_level="avx512") == "avx512"
    assert kind(avx512_bf16=True, amx=True) == "amx"
    assert kind(avx512_bf16=False, amx=False) == "avx2"


def test_a_capped_session_holds_vllm_to_the_level(monkeypatch):
    """At a capped level vLLM's server gets torch's dispatch ceilings and the masked CPU probes; at the CPU's
    own level nothing is added."""
    from kvserve.kernels import isa

    monkeypatch.setattr(isa, "current", lambda: isa.LEVELS["native"])
    spec = T.VllmTarget("float32").server_spec("default", 8000, Path("/tmp"))
    assert "BENCH_PEER_ISA" not in spec.env and "ATEN_CPU_CAPABILITY" not in spec.env
    assert T.LlamaCppTarget("f16").venv.name == "llamacpp-venv" or "LLAMACPP_VENV" in os.environ
    monkeypatch.setattr(isa, "current", lambda: isa.LEVELS["avx2"])
    spec = T.VllmTarget("float32").server_spec("default", 8000, Path("/tmp"))
    assert spec.env["BENCH_PEER_ISA"] == "avx2" and spec.env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert spec.env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and spec.env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert spec.env["PYTHONPATH"].split(os.pathsep)[0] == str(T.REPO / "benchmarks" / "isa_cap")
    if "LLAMACPP_VENV" not in os.environ:
        assert T.LlamaCppTarget("f16").venv.name == "llamacpp-avx2-venv"


def test_isa_cap_masks_torch_cpu_probes_above_the_level():
    """benchmarks/isa_cap/sitecustomize.py, as a peer's interpreter loads it: AVX-512 and AMX probes answer
    False at avx2, AMX only at avx512; AVX2's own probe keeps the hardware's answer."""
    code = ("import torch.cpu as c, json; print(json.dumps([c._is_avx512_supported(), c._is_avx512_bf16_supported(),"
            " c._is_amx_tile_supported(), c._is_avx2_supported()]))")
    env = {**os.environ, "PYTHONPATH": str(T.REPO / "benchmarks" / "isa_cap"), "BENCH_PEER_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    avx512, bf16, amx, avx2 = json.loads(out.stdout.strip().splitlines()[-1])
    assert (avx512, bf16, amx) == (False, False, False)
    assert avx2 == ("avx2" in Path("/proc/cpuinfo").read_text())
