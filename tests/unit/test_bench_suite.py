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
from benchmarks.shapes import ShapeModel
from benchmarks.suite import ALL_WORKLOADS, build_jobs, parse_args


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
    assert a.targets == ["kvserve"] and a.runs == 3 and a.workloads == ["W1", "W2", "W3", "W4", "W5", "W6", "W7", "SWEEP"]
    monkeypatch.setenv("BENCH_PEERS", "1")
    a = parse_args(["--quick", "--workloads", "w1,W3"])
    assert a.targets == ["kvserve", "vllm", "vllm-fp32", "llamacpp-bf16", "llamacpp-f16", "llamacpp-q4_1", "hf-static",
                         "llamacpp-gguf"]
    assert a.runs == 1 and a.workloads == ["W1", "W3"] and a.models == ["smollm2-135m"]
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "W9"])


def test_models_option():
    a = parse_args(["--models", "smollm2-135m, llama-1b.Q4_K_M,llama-8b.Q8_0"])
    assert a.models == ["smollm2-135m", "llama-1b.Q4_K_M", "llama-8b.Q8_0"]
    for bad in ("llama-3b.Q4_K_M", "llama-1b.Q5_K", "llama-1b"):
        with pytest.raises(SystemExit):
            parse_args(["--models", bad])
    m = ShapeModel.parse("llama-8b.Q4_K_M")
    assert (m.shape, m.quant, m.model_id, m.name) == ("llama-8b", "Q4_K_M", "llama-8b-q4_k_m", "llama-8b.Q4_K_M")


def test_shape_jobs_are_w1_and_w2_at_their_sizes():
    """A shape runs W1 and W2 only (256 in / 128 out), at the sizes of SIZES; no `vllm bench serve` check."""
    for shape, (n1, c1, n2) in (("llama-1b", (32, 32, 4)), ("llama-8b", (16, 8, 2))):
        jobs = {j.name: j for j in build_jobs(list(ALL_WORKLOADS), runs=3, quick=False, model=shape)}
        assert list(jobs) == ["W1", "W2"] and jobs["W1"].runs == jobs["W2"].runs == 3
        w1, w2 = jobs["W1"].args, jobs["W2"].args
        assert (_opt(w1, "--num-prompts"), _opt(w1, "--max-concurrency")) == (str(n1), str(c1))
        assert (_opt(w2, "--num-prompts"), _opt(w2, "--max-concurrency")) == (str(n2), "1")
        assert _opt(w1, "--random-input-len") == "256" and _opt(w2, "--random-output-len") == "128"
        assert not any(j.vllm_client_check for j in jobs.values())
    quick = {j.name: j for j in build_jobs(["W1", "W2"], runs=1, quick=True, model="llama-8b")}
    assert _opt(quick["W1"].args, "--num-prompts") == "8" and _opt(quick["W2"].args, "--random-input-len") == "32"
    assert build_jobs(["W3", "W5"], runs=1, quick=False, model="llama-1b") == []  # W5's W1 is SmolLM2's calibration


def test_targets_on_a_shape_serve_its_file(tmp_path, monkeypatch):
    """kvserve and llama-server load the same GGUF under the same id; vLLM says why not; SmolLM2's llama.cpp
    precisions and hf-static have no shape counterpart (nor llamacpp-gguf a SmolLM2 one)."""
    from kvserve.config import ServerConfig

    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    model = ShapeModel.parse("llama-1b.Q4_K_M")
    path = tmp_path / "models" / "shapes" / "llama-1b.Q4_K_M.gguf"
    assert model.path == path
    made = T.all_targets(["kvserve"] + T.PEER_TARGETS, model=model)
    assert [t.name for t in made] == ["kvserve@llama-1b.Q4_K_M", "vllm@llama-1b.Q4_K_M", "vllm-fp32@llama-1b.Q4_K_M",
                                      "llamacpp-gguf@llama-1b.Q4_K_M"]
    assert "llamacpp-gguf" not in [t.name for t in T.all_targets(["kvserve"] + T.PEER_TARGETS)]
    kv, vllm, _, llama = made
    spec = kv.server_spec("default", 8000, tmp_path)
    cfg = ServerConfig.from_toml(spec.argv[spec.argv.index("--config") + 1])
    assert [(m.id, m.source) for m in cfg.models] == [("llama-1b-q4_k_m", str(path))]
    limits = cfg.models[0].engine_config().scheduler.interactive  # the peers refuse nothing; nor does kvserve
    assert limits.max_ttft_s == limits.max_queue_wait_s == limits.queue_timeout_s == float("inf")
    assert vllm.available() == (False, T.VLLM_NO_GGUF) and vllm.setup_command() is None
    llama._bin = "/opt/llama/bin"
    a = llama.server_spec(llama.variant("plain"), 8200, tmp_path).argv
    assert _opt(a, "-m") == str(path) and _opt(a, "--alias") == "llama-1b-q4_k_m" == llama.model_id
    assert (_opt(a, "-np"), _opt(a, "-c")) == ("32", "16384") and "--no-cache-prompt" in a and "--no-repack" not in a
    assert "the GGUF file's types" in llama.describe()["dtype"]


def test_bytes_a_decode_step_reads(tmp_path):
    """kvserve: the GB its load log says it holds; llama.cpp: the GGUF's tensors, without token_embd where the
    file has an output.weight (only the prompt's rows of it are read)."""
    import gguf
    import numpy as np

    log = tmp_path / "server.log"
    log.write_text("2026 INFO kvserve.engine.worker.llm_engine: llama-1b-q4_k_m weights: int4+int8, 4.88 GB held, "
                   "0.60 GB read per token (112 Q4_K as int4, 33 Q6_K requantized to int8)\n")
    assert T.KvserveTarget().weights_read(log) == {  # a mixture's: its unused experts are held, not read
        "weights_form": "int4+int8", "bytes_per_token": 0.60e9,
        "weights_detail": "112 Q4_K as int4, 33 Q6_K requantized to int8"}
    log.write_text("no load line yet\n")
    assert T.KvserveTarget().weights_read(log) == {}

    def write(path, names, experts=0):
        w = gguf.GGUFWriter(str(path), "llama")
        if experts:
            w.add_expert_count(experts)
            w.add_expert_used_count(2)
        for name in names:
            w.add_tensor(name, np.zeros((4, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    tied = write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.ffn_up.weight"])
    untied = write(tmp_path / "untied.gguf", ["token_embd.weight", "blk.0.ffn_up.weight", "output.weight"])
    assert T.gguf_bytes_per_token(tied) == 2 * 4 * 32 * 4
    assert T.gguf_bytes_per_token(untied) == 2 * 4 * 32 * 4
    moe = write(tmp_path / "moe.gguf", ["token_embd.weight", "blk.0.ffn_up_exps.weight"], experts=8)
    assert T.gguf_bytes_per_token(moe) == 4 * 32 * 4 + 4 * 32 * 4 * 2 // 8  # of the stacked experts, 2 of 8


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
    assert f"## {report.CPU_KINDS['avx512']}" not in md  # a kind never rendered has no section


def test_benchmarks_md_opens_with_a_table_of_contents():
    """A link to each `##` section before the first one, with GitHub's anchors (repeated headings numbered, code
    blocks skipped); rendering again replaces it, and the committed BENCHMARKS.md has the one a render writes."""
    from benchmarks import report

    md = ("# Benchmarks\n\nintro\n\n## Summary: kvserve against each peer\n\n### Machine\n\n```bash\n## not a heading\n"
          "```\n\n## Machine\n\n## Long context: what sinks + window costs\n")
    out = report.with_contents(md)
    assert out.startswith("# Benchmarks\n\nintro\n\n**Contents**\n\n"
                          "- [Summary: kvserve against each peer](#summary-kvserve-against-each-peer)\n"
                          "- [Machine](#machine-1)\n"
                          "- [Long context: what sinks + window costs](#long-context-what-sinks--window-costs)\n\n"
                          "## Summary")
    assert "not a heading](" not in out
    assert report.with_contents(out) == out
    committed = (Path(report.REPO) / "BENCHMARKS.md").read_text()
    assert report.with_contents(committed) == committed, "BENCHMARKS.md's contents are stale: python -m benchmarks.report"


def test_benchmarks_md_opens_with_a_summary_per_cpu_kind(tmp_path):
    """Before the kinds' sections: per kind, kvserve's median / each peer's and the ratio, read from the kind's
    rendered pages (the page's own ratio where it gives one) and from an earlier peers page of that kind; a kind
    with no page says so."""
    from benchmarks import report

    cpu = tmp_path / "cpu"
    cpu.mkdir()
    w1w2 = ("### W1 throughput and W2 single-stream latency\n\n"
            "| target | W1 out tok/s | W2 TTFT p50 | W2 TPOT p50 |\n|---|---|---|---|\n"
            "| kvserve | 300.0 [290.0-310.0] | 150 [140-160] | 12.0 |\n| vLLM CPU | 200.0 | 300 | 24.0 |\n"
            "| llama.cpp Q4_1 | - | - | - |\n")
    ratios = ("### kvserve against each peer\n\n| figure | kvserve | kvserve / vLLM CPU |\n|---|---|---|\n"
              "| W1 out tok/s (higher is better) | 300.0 | 1.49x |\n")
    (cpu / "avx512.md").write_text(f"## {report.CPU_KINDS['avx512']}\n\nfrom the suite session `s1` on ...\n\n"
                                   "### Machine\n\n- CPU: EPYC, 2 cores; avx512f, avx512_bf16.\n\n"
                                   + w1w2 + "\n```bash\n| not | a table |\n```\n\n" + ratios)
    (cpu / "avx512-models.md").write_text(
        "### Larger models: shapes\n\nFrom the suite session `shapes` (started ...)\n\n"
        "| model | engine | weights | W1 out tok/s | W2 TTFT p50 | W2 TPOT p50 |\n|---|---|---|---|---|---|\n"
        "| m1 | kvserve | int4 | 50.0 | 1000 | 30.0 |\n| m1 | llama.cpp | Q4_K_M file | 25.0 | 2000 | 30.0 |\n"
        "| m1 | kvserve / llama.cpp |  | 2.00x | 0.50x | 1.00x |\n")
    (tmp_path / "peers.md").write_text("# Benchmarks\n\nfrom the suite session `old-peers`\n\n## Machine\n\n"
                                       "- CPU: Xeon, 2 cores; avx512f, avx512_bf16, amx. Load 1\n\n"
                                       + w1w2.replace("vLLM CPU", "llama.cpp BF16"))
    md = report.assemble(tmp_path)
    summary = md[md.index("## Summary"):md.index(f"## {report.CPU_KINDS['avx512']}")]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in summary.splitlines()
            if line.startswith("| ")}
    # the page's ratio (1.49x) over the medians' (1.50x); the rest from the medians
    assert "| 300.0 / 200.0 | 1.49x | 12.0 / 24.0 | 0.50x | 150 / 300 | 0.50x | `s1` |" in rows[("SmolLM2-135M",
                                                                                                 "vLLM CPU")]
    assert ("SmolLM2-135M", "llama.cpp Q4_1") not in rows  # a peer with no figures
    assert "| 50.0 / 25.0 | 2.00x | 30.0 / 30.0 | 1.00x | 1000 / 2000 | 0.50x | `shapes` |" in rows[("m1", "llama.cpp")]
    amx = summary[summary.index(report.CPU_KINDS["amx"]):summary.index(report.CPU_KINDS["avx512"])]
    assert "| SmolLM2-135M | llama.cpp BF16 | 300.0 / 200.0 | 1.50x |" in amx and "(docs/bench/peers.md)" in amx
    avx2 = summary[summary.index(report.CPU_KINDS["avx2"]):]
    assert "No measurement on this kind yet." in avx2 and "| " not in avx2


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


def _write_session(root: Path, meta: dict, runs: dict[tuple[str, str], list[dict]]) -> Path:
    root.mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps(meta))
    for (target, job), results in runs.items():
        (root / target / job).mkdir(parents=True)
        for k, r in enumerate(results):
            (root / target / job / f"run{k}.json").write_text(json.dumps(r))
    return root


def test_larger_models_page(tmp_path):
    """A session of shapes alone renders its kind's "Larger models" page (medians, ratios, the weight-bandwidth
    floor, what did not run and why) and leaves the kind's SmolLM2 page alone; a SmolLM2-only session (as every
    earlier one) renders that page as before and keeps the models page."""
    from benchmarks import report

    machine = {"ceilings": {"copy_bytes_per_s": 20e9, "machine": {"cpu_model": "EPYC", "nproc": 2, "avx2": True}}}
    m = "llama-1b.Q4_K_M"
    jobs = [{"name": "W1", "shape": {"input": 256, "output": 128, "num_prompts": 32, "max_concurrency": 32}},
            {"name": "W2", "shape": {"input": 256, "output": 128, "num_prompts": 4, "max_concurrency": 1}}]
    meta = {**machine, "session": "shapes", "models": {m: {"model": "Llama-3.2-1B", "file": "/x/llama-1b.Q4_K_M.gguf",
                                                           "command": "python -m benchmarks.suite --models " + m,
                                                           "jobs": jobs}},
            "targets": {f"kvserve@{m}": {"status": "done", "rss_bytes": 3.1e9, "bytes_per_token": 0.8e9,
                                         "weights_form": "int4+int8",
                                         "servers": {"default": {"command": "kvserve serve --config k.toml"}}},
                        f"llamacpp-gguf@{m}": {"status": "done", "rss_bytes": 1.5e9, "bytes_per_token": 0.6e9,
                                               "weights_form": "Q4_K_M file"},
                        f"vllm@{m}": {"status": "skipped", "reason": T.VLLM_NO_GGUF}}}
    runs = {(f"kvserve@{m}", "W1"): [{"output_throughput": 60.0, "median_ttft_ms": 9000.0}],
            (f"kvserve@{m}", "W2"): [{"median_ttft_ms": 900.0, "median_tpot_ms": 80.0},
                                     {"median_ttft_ms": 1100.0, "median_tpot_ms": 100.0}],
            (f"llamacpp-gguf@{m}", "W1"): [{"output_throughput": 40.0, "median_ttft_ms": 12000.0}],
            (f"llamacpp-gguf@{m}", "W2"): [{"median_ttft_ms": 1000.0, "median_tpot_ms": 60.0}]}
    root = _write_session(tmp_path / "shapes", meta, runs)
    plots, md = tmp_path / "docs", tmp_path / "BENCHMARKS.md"
    (plots / "cpu").mkdir(parents=True)
    (plots / "cpu" / "avx2.md").write_text("## CPU: AVX2 only (no AVX-512, no native bf16)\n\nthe SmolLM2 page\n")
    assert report.main(["--session", str(root), "--markdown", str(md), "--plots", str(plots)]) == 0
    page = (plots / "cpu" / "avx2-models.md").read_text()
    assert "the SmolLM2 page" in (plots / "cpu" / "avx2.md").read_text()  # not rewritten by a shapes-only session
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
            for line in page.splitlines() if line.startswith("| ")}
    kv, ratios = rows[(m, "kvserve")], rows[(m, "kvserve / llama.cpp")]
    # W1 tok/s, W1 TTFT, W2 TTFT (median of 900 and 1100), W2 TPOT, RSS, GB/token, floor 0.8 GB / 20 GB/s = 40 ms
    assert "| int4+int8 | 60.0 | 9000 | 1000 [900-1100] | 90.0 [80.0-100.0] | 3.10 | 0.80 | 40.0 | 45% [40-50] |" in kv
    assert "| 1.50x | 0.75x | 1.00x | 1.50x | 2.07x | 1.33x | 1.33x | - |" in ratios
    assert "| 30.0 | 50% |" in rows[(m, "llama.cpp")]  # 0.6 GB / 20 GB/s over a 60 ms TPOT
    assert "llama-1b: W1 32 requests, at most 32 in flight; W2 4 requests, one at a time; 256 prompt" in page
    assert f"- vLLM CPU, {m}: {T.VLLM_NO_GGUF}" in page and "20.0 GB/s" in page
    assert "python -m benchmarks.suite --models llama-1b.Q4_K_M" in page and "kvserve serve --config k.toml" in page
    text = md.read_text()
    assert text.index("the SmolLM2 page") < text.index("### Larger models") < text.index("| kvserve / llama.cpp")

    old = _write_session(tmp_path / "old", {**machine, "jobs": [{"name": "W2", "shape": {}}],
                                            "targets": {"kvserve": {"status": "done"}}},
                         {("kvserve", "W2"): [{"median_ttft_ms": 50.0, "median_tpot_ms": 5.0}]})
    assert report.main(["--session", str(old), "--markdown", str(md), "--plots", str(plots)]) == 0
    assert "the SmolLM2 page" not in (plots / "cpu" / "avx2.md").read_text()
    assert (plots / "cpu" / "avx2-models.md").read_text() == page
    text = md.read_text()
    assert "### Larger models" not in (plots / "cpu" / "avx2.md").read_text()
    assert text.index("### W1 throughput") < text.index("### Larger models")


def test_a_kind_with_only_shapes_still_gets_its_heading(tmp_path):
    from benchmarks import report

    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "avx512-models.md").write_text("### Larger models: x\n")
    md = report.assemble(tmp_path)
    assert md.index(f"## {report.CPU_KINDS['avx512']}") < md.index("### Larger models: x")


def test_larger_models_page_keeps_other_sessions_sections():
    """A session's Larger models section replaces the sections that measured its shapes; the others stay, and
    the summary reads each section with its own session."""
    from benchmarks import report

    def section(session: str, models: list[str]) -> str:
        return (f"### Larger models: {session} shapes\n\nFrom the suite session `{session}` (started x).\n\n"
                "#### Commands\n\n```bash\n# " + "; ".join(f"{m}: /tmp/{m}.gguf" for m in models) + "\n```\n")

    page = report.merge_models_page("", section("a", ["llama-1b.Q4_K_M", "llama-8b.Q4_K_M"]), ["llama-1b.Q4_K_M"])
    page = report.merge_models_page(page, section("b", ["qwen3-1.7b.Q4_K_M"]), ["qwen3-1.7b.Q4_K_M"])
    assert [report.session_of(s) for s in report.models_sections(page)] == ["a", "b"]
    page = report.merge_models_page(page, section("c", ["llama-8b.Q4_K_M"]), ["llama-8b.Q4_K_M"])  # a's shape again
    assert [report.session_of(s) for s in report.models_sections(page)] == ["b", "c"]
