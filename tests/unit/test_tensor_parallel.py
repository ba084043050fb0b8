"""Tensor parallelism's split (models/parallel.py) on the CPU: two (and four) ranks over gloo, each holding its slice
of a tiny model's weights and its KV heads' cache, against the same model whole: a prompt, a second sequence beside
it, decode steps; logits within float32's summation-order tolerance. The split itself: configs, KV heads replicated
where fewer than ranks, fused Phi-3 tensors part by part, a mixture's experts by their intermediate dim."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.config import ConfigError
from kvserve.engine.kv.groups import KVLayout
from kvserve.engine.worker.runner import BatchItem, ModelRunner
from kvserve.engine.worker.tensor_parallel import free_port
from kvserve.models.loader import Checkpoint, build_model, load_checkpoint, plan_for
from kvserve.models.parallel import TensorParallel, attach
from tests.parity import rel_err

BLOCK = 16


def _steps(path: str, tp: TensorParallel | None) -> list[torch.Tensor]:
    """The model (this rank's slice) over its own KV pool: a prompt in two chunks, a second prompt beside the
    second chunk, then eight decode steps of both, teacher-forced (every rank and the whole model see the same
    tokens): every step's logits."""
    ck = load_checkpoint(path)
    config, tensors = ck.config, ck.dense_tensors()
    if tp is not None:
        config, tensors = tp.shard_config(config), tp.shard_tensors(tensors, config)
    shard = Checkpoint(config=config, tensors=tensors, path=ck.path, format=ck.format)
    model = build_model(shard, plan_for(shard, torch.float32), max_positions=512)
    if tp is not None:
        attach(model, tp, ck.config)
        config = replace(config, vocab_size=ck.config.vocab_size)  # the runner's: the gathered logits'
    layout = KVLayout.for_model(config)
    runner = ModelRunner(model, config, 128, 0, BLOCK, torch.float32, torch.device("cpu"), layout=layout)
    groups = layout.num_groups
    a, b = list(range(30, 67)), list(range(100, 119))
    ta = [[g * 16 + i for i in (3, 1, 5, 7)] for g in range(groups)]
    tb = [[g * 16 + i for i in (2, 4, 6)] for g in range(groups)]
    out = [runner.forward([BatchItem(a[:20], 0, ta[0], group_tables=ta)], all_logits=True),
           runner.forward([BatchItem(a[20:], 20, ta[0], group_tables=ta), BatchItem(b, 0, tb[0], group_tables=tb)],
                          all_logits=True)]
    for step in range(8):
        out.append(runner.forward([BatchItem([200 + step], len(a) + step, ta[0], group_tables=ta),
                                   BatchItem([300 + step], len(b) + step, tb[0], group_tables=tb)]))
    return out


def _rank(rank: int, size: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        logits = _steps(path, TensorParallel(size, rank))
        torch.save(logits, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _gguf(tmp_path_factory, smollm2_gguf_path, **spec) -> Path:
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tmp_path_factory.mktemp("tp") / f"{spec['arch']}-{spec.get('kv_heads', 2)}.gguf"
    write_tiny_gguf(path, TinySpec(quant="F32", **spec), str(smollm2_gguf_path))
    return path


@pytest.mark.parametrize("size,spec", [
    (4, dict(arch="llama", heads=4, kv_heads=2)),  # two KV heads over four ranks: each held twice
    (2, dict(arch="gemma3", layers=6)),  # sliding-window layers, KV groups
])
def test_ranks_together_give_the_whole_models_logits(tmp_path_factory, tmp_path, smollm2_gguf_path, size, spec):
    path = _gguf(tmp_path_factory, smollm2_gguf_path, **spec)
    whole = _steps(str(path), None)
    out = tmp_path / "logits"
    mp.spawn(_rank, args=(size, free_port(), str(path), str(out)), nprocs=size, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(size)]
    for step, want in enumerate(whole):
        for r in ranks:
            assert rel_err(r[step], want) <= 1e-5, step
        for r in ranks[1:]:
            assert torch.equal(r[step], ranks[0][step])  # every rank holds the same logits (after the reductions)


def test_the_split_of_configs_and_tensors(tmp_path_factory, smollm2_gguf_path):
    ck = load_checkpoint(_gguf(tmp_path_factory, smollm2_gguf_path, arch="llama", heads=4, kv_heads=2))
    c, t = ck.config, ck.dense_tensors()
    shards = [TensorParallel(4, r) for r in range(4)]
    assert [s.kv_heads(c) for s in shards] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    sc = shards[0].shard_config(c)
    assert (sc.num_heads, sc.num_kv_heads, sc.intermediate_size) == (1, 1, c.intermediate_size // 4)
    name = "model.layers.0.self_attn.{}_proj.weight"
    d = c.head_dim
    parts = [s.shard_tensors(t, c) for s in shards]
    assert torch.equal(torch.cat([p[name.format("q")] for p in parts]), t[name.format("q")])
    assert torch.equal(parts[3][name.format("k")], t[name.format("k")][d:2 * d])
    assert torch.equal(torch.cat([p[name.format("o")] for p in parts], dim=1), t[name.format("o")])
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([p[down] for p in parts], dim=1), t[down])
    assert parts[1]["model.norm.weight"] is t["model.norm.weight"]  # replicated
    embed = t["model.embed_tokens.weight"]  # by vocabulary: equal runs of rows, the last one padded with zeros
    assert sc.vocab_size == c.vocab_size // 4
    assert torch.equal(torch.cat([p["model.embed_tokens.weight"] for p in parts]), embed)
    odd = replace(c, vocab_size=c.vocab_size - 3)
    rows = [s.slice("lm_head.weight", embed[:odd.vocab_size], odd) for s in shards]
    assert [len(r) for r in rows] == [c.vocab_size // 4] * 4 and not rows[3][-3:].any()
    assert torch.equal(torch.cat(rows)[:odd.vocab_size], embed[:odd.vocab_size])
    # Phi-3's fused tensors, part by part.
    fused = {"model.layers.0.self_attn.qkv_proj.weight": torch.cat([t[name.format(x)] for x in "qkv"]),
             "model.layers.0.mlp.gate_up_proj.weight": torch.arange(2 * c.intermediate_size * 3.).view(-1, 3)}
    got = shards[2].shard_tensors(fused, c)
    qkv = got["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([parts[2][name.format(x)] for x in "qkv"]))
    gate_up = got["model.layers.0.mlp.gate_up_proj.weight"].view(2, -1, 3)
    quarter = c.intermediate_size // 4
    assert gate_up[0, 0, 0] == 2 * quarter * 3 and gate_up[1, 0, 0] == (c.intermediate_size + 2 * quarter) * 3
    with pytest.raises(ConfigError, match="does not divide"):
        TensorParallel(3, 0).shard_config(c)
    with pytest.raises(ConfigError):
        TensorParallel(2, 2)


def test_a_mixtures_experts_split_by_their_width_sum_to_the_whole(tmp_path_factory, smollm2_gguf_path):
    """Each rank's slice of every expert, routed alike (the router is whole on every rank): the ranks' partial
    outputs add up to the whole mixture's."""
    from kvserve.models.moe import SparseMoE

    ck = load_checkpoint(_gguf(tmp_path_factory, smollm2_gguf_path, arch="qwen3moe", num_experts=4,
                               experts_per_token=2, moe_intermediate=32))
    x = torch.randn(7, ck.config.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = []
    for tp in (None, TensorParallel(2, 0), TensorParallel(2, 1)):
        config, tensors = ck.config, ck.dense_tensors()
        if tp is not None:
            config, tensors = tp.shard_config(config), tp.shard_tensors(tensors, config)
        model = build_model(Checkpoint(config=config, tensors=tensors, path=ck.path, format=ck.format),
                            plan_for(ck, torch.float32), max_positions=64)
        moe = model.layers[0].mlp
        assert isinstance(moe, SparseMoE) and moe.experts[0].down_proj.weight.shape[1] == config.moe_intermediate_size
        outs.append(moe(x))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [dict(arch="qwen3"), dict(arch="llama", heads=4, kv_heads=2),
                                  dict(arch="qwen3moe", num_experts=4, experts_per_token=2, moe_intermediate=32)],
                         ids=["qwen3", "llama", "qwen3moe"])
def test_an_engine_over_two_ranks_generates_the_whole_models_tokens(tmp_path_factory, smollm2_gguf_path, spec):
    """`tensor_parallel_size = 2`: rank 1 in a process of its own, rank 0 the engine's; 64 greedy tokens of six
    prompts in a pool too small for them (chunked prefills, swap preemption: every rank moves its own pages) equal
    the whole model's under the same settings; a killed rank fails the next step promptly."""
    import time

    from kvserve import LLM, SamplingParams

    path = str(_gguf(tmp_path_factory, smollm2_gguf_path, **spec))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((50, 13, 41, 60, 33, 27))]
    args = dict(dtype="float32", max_num_batched_tokens=32, max_model_len=256, num_gpu_blocks_override=14,
                preemption_mode="swap", enable_prefix_caching=False)
    whole = LLM(path, **args)
    want = [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]
    whole.close()
    llm = LLM(path, tensor_parallel_size=2, **args)
    try:
        # A device's pool holds a rank's KV heads: half the model's two, so twice the blocks in the same memory.
        assert 2 * llm.engine.kv_bytes_per_token == whole.engine.kv_bytes_per_token
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        (rank1,) = llm.engine.executor._processes
        rank1.kill()
        rank1.join()
        t0 = time.monotonic()
        with pytest.raises(Exception):
            llm.generate(prompts[:1], params, use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        llm.close()


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_a_rank_loads_only_its_slices(tmp_path_factory, smollm2_gguf_path, kind):
    """load_checkpoint(shard=...) cuts each tensor as it is read: the slices equal the whole checkpoint's cut."""
    if kind == "gguf":
        path = _gguf(tmp_path_factory, smollm2_gguf_path, arch="qwen3")
    else:
        from tests.hf_factory import tiny_model, write_hf_dir

        path = write_hf_dir(tiny_model("qwen3", seed=2), tmp_path_factory.mktemp("tp-hf") / "qwen3",
                            str(smollm2_gguf_path))
    whole = load_checkpoint(path, "bf16")
    tp = TensorParallel(2, 1)
    want = tp.shard_tensors(whole.dense_tensors(), whole.config)
    got = load_checkpoint(path, "bf16", shard=tp)
    assert got.config == whole.config and set(got.tensors) == set(want)
    for name, t in want.items():
        assert torch.equal(got.tensors[name], t), name


def test_in_a_placement_group_the_ranks_run_in_its_bundles(tmp_path_factory, smollm2_gguf_path):
    """A replica in a placement group of a bundle per rank (what a fleet's Serve replica of N ranks runs in:
    fleet/deploy.rank_bundles) starts its other ranks as Ray actors in their bundles: the cluster's two CPUs are
    both the group's, so a rank placed anywhere else would never start. Its tokens are the whole model's."""
    ray = pytest.importorskip("ray")
    from ray.util import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kvserve import LLM, SamplingParams

    path = str(_gguf(tmp_path_factory, smollm2_gguf_path, arch="qwen3"))
    prompts = [list(range(7, 40)), list(range(50, 61))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    args = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    whole = LLM(path, **args)
    want = [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]
    whole.close()

    class Replica:
        def generate(self) -> tuple[list, list[str]]:
            llm = LLM(path, tensor_parallel_size=2, **args)
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
                return [o.outputs[0].token_ids for o in outs], [type(p).__name__ for p in llm.engine.executor._processes]
            finally:
                llm.close()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
        ray.get(group.ready(), timeout=60)
        replica = ray.remote(Replica).options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote()
        tokens, ranks = ray.get(replica.generate.remote(), timeout=240)
        assert ranks == ["RayRank"] and tokens == want
        remove_placement_group(group)
    finally:
        ray.shutdown()
