"""W6, long documents beside interactive work: its jobs, the document dataset, Gemma 3's server config at 32k and
its page, checked without starting a server."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks import targets as T
from benchmarks.suite import (ALL_WORKLOADS, W6_DOCUMENTS, W6_ENGINE_ARGS, W6_MODEL, W6_TARGETS, build_jobs,
                              parse_args)
from kvserve.bench.datasets import DOCUMENT_QUESTION, PromptSource
from kvserve.bench.loadgen import TierSpec, parse_mix


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_w6_jobs():
    assert "W6" in ALL_WORKLOADS and parse_args(["--workloads", "w6"]).workloads == ["W6"]
    jobs = {j.name: j for j in build_jobs(["W6"], runs=3, quick=False)}
    assert list(jobs) == ["W6-mix", "W6-alone"] and {j.kind for j in jobs.values()} == {"long_context"}
    mix, alone = jobs["W6-mix"].args, jobs["W6-alone"].args
    assert (_opt(mix, "--duration"), _opt(alone, "--duration")) == ("240", "60") and "--ignore-eos" in mix
    inter = "interactive:rate=1,arrival=constant,dataset=chat,input=64,output=64"  # W3's stream
    assert _opt(alone, "--mix") == inter == _opt(build_jobs(["W3"], 1, False)[1].args, "--mix")
    docs, beside = parse_mix(_opt(mix, "--mix"), TierSpec(), duration=240.0)
    assert beside.name == "interactive" and beside.priority == "interactive" and beside.request_rate == 1
    assert (docs.dataset, docs.input_lens, docs.output_len, docs.max_concurrency, docs.priority, docs.drain) == \
           ("document", W6_DOCUMENTS, 64, 2, "batch", False)
    assert max(W6_DOCUMENTS) + 64 <= W6_ENGINE_ARGS["max_model_len"] == 32768
    quick = {j.name: j for j in build_jobs(["W6"], runs=1, quick=True)}
    assert max(parse_mix(_opt(quick["W6-mix"].args, "--mix"), TierSpec(), 20.0)[0].input_lens) <= 2048
    assert build_jobs(["W6"], runs=1, quick=False, model="llama-1b") == []  # shapes run W1 and W2 only
    # W6's seeds repeat no other job's
    every = build_jobs(list(ALL_WORKLOADS), runs=3, quick=False)
    seeds = [j.seed_base + k for j in every for k in range(j.runs)]
    assert len(seeds) == len(set(seeds))


def test_document_prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    src = PromptSource(tok, "document", input_lens=(1500, 300, 700), output_len=8, seed=1)
    prompts = [src.prompt(i) for i in range(6)]
    assert [p.prompt_len for p in prompts] == [1500, 300, 700] * 2 and src.mismatches == 0
    assert all(len(tok.encode(p.prompt)) == p.prompt_len and p.prompt.endswith(DOCUMENT_QUESTION) for p in prompts)
    assert "def " in prompts[0].prompt  # the standard library's source
    assert src.prompt(2).prompt == PromptSource(tok, "document", input_lens=(1500, 300, 700), seed=1).prompt(2).prompt
    other_seed = PromptSource(tok, "document", input_lens=(1500,), seed=2)
    assert src.prompt(0).prompt[:200] != other_seed.prompt(0).prompt[:200]
    assert len({p.prompt[:200] for p in prompts}) == 6  # each from its own offset
    ids = PromptSource(tok, "document", input_len=400, token_prompts=True, seed=3).prompt(0)
    assert len(ids.prompt) == ids.prompt_len == 400
    with pytest.raises(ValueError):
        PromptSource(tok, "document", input_lens=(100, 200), range_ratio=0.5)
    assert parse_mix("d:dataset=document,inputs=8/16", TierSpec(), None)[0].input_lens == (8, 16)


def test_w6_server_serves_gemma3_at_32k(tmp_path):
    from kvserve.config import ServerConfig

    if W6_MODEL.missing():
        pytest.skip(W6_MODEL.missing())
    (kv,) = T.all_targets(["kvserve"], engine_args={"max_num_seqs": 8, **W6_ENGINE_ARGS}, model=W6_MODEL)
    assert kv.name == "kvserve@gemma3-270m" and kv.model_id == "gemma3-270m" and set(W6_TARGETS) >= {"kvserve"}
    spec = kv.server_spec(kv.variant("long_context"), 8000, tmp_path)
    cfg = ServerConfig.from_toml(spec.argv[spec.argv.index("--config") + 1])
    (m,) = cfg.models
    assert (m.id, Path(m.source)) == ("gemma3-270m", W6_MODEL.path)
    ec = m.engine_config()
    assert ec.scheduler.max_model_len == 32768 and ec.cache.kv_cache_memory == 2 << 30
    assert ec.scheduler.max_num_seqs == 8  # --engine-arg still applies
    assert ec.scheduler.interactive.max_ttft_s == math.inf  # every request is measured, none refused


def _run(tier_lens: list[tuple[str, int, float]], p50: float, p99: float) -> dict:
    """A result file with per-request arrays and the tiers' figures."""
    return {"tier_of": [t for t, _, _ in tier_lens], "input_lens": [n for _, n, _ in tier_lens],
            "ttfts": [x for _, _, x in tier_lens], "errors": ["" if x else "cancelled" for _, _, x in tier_lens],
            "tiers": {"interactive": {"median_ttft_ms": p50, "p99_ttft_ms": p99, "median_tpot_ms": 20.0,
                                      "completed": 240, "failed": 0},
                      "documents": {"completed": 3, "cancelled": 2, "failed": 0, "total_token_throughput": 300.0,
                                    "output_throughput": 0.8, "median_tpot_ms": 40.0}}}


def test_w6_page(tmp_path):
    """A W6-only session renders W6's page and JSON, leaves the kind's SmolLM2 page alone, and is no shape model
    of the Larger models page."""
    shape = build_jobs(["W6"], runs=1, quick=False)[0].shape
    t = "kvserve@gemma3-270m"
    meta = {"ceilings": {"machine": {"cpu_model": "EPYC", "nproc": 2, "avx512f": True, "avx512_bf16": True,
                                     "loadavg": ["0.1", "0.2", "0.3"]}},
            "argv": ["suite.py", "--workloads", "W6"], "started": "2026-12-04T17:00:00+00:00", "workloads": ["W6"],
            "jobs": [{"name": "W6-mix", "workload": "W6", "shape": shape}, {"name": "W6-alone", "workload": "W6"}],
            "targets": {t: {"status": "done", "servers": {"default": {"command": "kvserve serve --config w6.toml"}},
                            "commands": {"W6-mix": "kvserve bench serve --mix docs"}}}}
    mix = _run([("documents", 32000, 40.0), ("interactive", 64, 0.1), ("documents", 8000, 12.0),
                ("documents", 16000, 0.0), ("documents", 8000, 10.0), ("interactive", 64, 0.2)], 150.0, 900.0)
    alone = {"tiers": {"interactive": {"median_ttft_ms": 60.0, "p99_ttft_ms": 90.0, "median_tpot_ms": 15.0,
                                       "completed": 60, "failed": 0}}}
    root = tmp_path / "s"
    for job, r in (("W6-mix", mix), ("W6-alone", alone)):
        (root / t / job).mkdir(parents=True)
        (root / t / job / "run0.json").write_text(json.dumps(r))
    (root / "meta.json").write_text(json.dumps(meta))
    plots, md = tmp_path / "docs", tmp_path / "BENCHMARKS.md"
    (plots / "cpu").mkdir(parents=True)
    (plots / "cpu" / "avx512.md").write_text("## CPU: AVX-512\n\nthe SmolLM2 page\n")
    assert report.main(["--session", str(root), "--markdown", str(md), "--plots", str(plots)]) == 0
    assert (plots / "cpu" / "avx512.md").read_text() == "## CPU: AVX-512\n\nthe SmolLM2 page\n"
    assert not (plots / "cpu" / "avx512-models.md").exists() and report.Session(root).models() == []
    page, data = (plots / "w6.md").read_text(), json.loads((plots / "w6.json").read_text())
    assert "| kvserve | alone | 60 | 90 | 15.0 | 60 | 0 |" in page
    assert "| kvserve | beside W6 | 150 | 900 | 20.0 | 240 | 0 |" in page and "**met** (900 ms)" in page
    assert "| kvserve | 8000 | 2 | 11.0 [10.0-12.0] | 733 [667-800] |" in page
    assert "| kvserve | 16000 | 0 | - | - |" in page and "| kvserve | 32000 | 1 | 40.0 | 800 |" in page
    assert "EPYC (2 CPUs visible; avx512f, avx512_bf16;" in page and "python -m benchmarks.suite --workloads W6" in page
    assert data["targets"][t]["target_met"] is True and data["targets"][t]["documents"]["ttft_s_by_size"]["8000"] == \
           [12.0, 10.0]
    assert "## W6: long documents beside interactive work" in md.read_text()  # BENCHMARKS.md takes the page


def test_grounded_prompts(smollm2_tokenizer):
    """W7's prompts: a passage of source, then a task in turn (copy, edit, quote, continue), at the length asked."""
    from kvserve.bench.datasets import GROUNDED_TASKS

    src = PromptSource(smollm2_tokenizer, "grounded", input_len=512, output_len=8, seed=1)
    prompts = [src.prompt(i) for i in range(4)]
    assert [p.prompt_len for p in prompts] == [512] * 4 and src.mismatches == 0
    assert [p.prompt.endswith(task) for p, task in zip(prompts, GROUNDED_TASKS)] == [True] * 4
    w7 = [j for j in build_jobs(["W7"], runs=3, quick=False) if j.workload == "W7"]
    assert [(j.name, j.shape["max_concurrency"]) for j in w7] == [("W7-c1", 1), ("W7-c8", 8)]
