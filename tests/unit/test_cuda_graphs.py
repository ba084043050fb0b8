"""Decode graphs (engine/worker/cuda_graphs.py) without a GPU: the bucket ladder, and a runner that replays its
decode steps over persistent buffers (`replay_eagerly` standing in for capture) against one that runs them
eagerly, on the CUDA path's kernels (Triton's, in its CPU interpreter): the same logits for batches that grow and
shrink across buckets, every real page written as eagerly, padding rows confined to the scratch block; a model
with KV groups (Gemma 3's windows); and the plan's decision (CUDA, a float cache, no mixture)."""
from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles the kernels: they run on the CPU here

import pytest  # noqa: E402
import torch  # noqa: E402

from kvserve.config import ModelConfig  # noqa: E402
from kvserve.engine.kv.groups import KVLayout  # noqa: E402
from kvserve.engine.worker.cuda_graphs import GraphPlan, bucket_for, capture_sizes, replay_eagerly  # noqa: E402
from kvserve.engine.worker.runner import BatchItem, ModelRunner  # noqa: E402
from kvserve.models.backend import Backend, graphs_in_force  # noqa: E402
from kvserve.models.loader import build_model, load_checkpoint, plan_for  # noqa: E402
from tests.parity import rel_err  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 256


def test_the_bucket_ladder():
    assert capture_sizes(64) == (1, 2, 4) + tuple(range(8, 65, 8))
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(10_000)[-1] == 512
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64, 65)] == [1, 4, 8, 8, 16, 64, 64, None]


def _runner(ck, graphs: bool, layout: KVLayout | None = None, attention: str = "triton") -> ModelRunner:
    model = build_model(ck, plan_for(ck, torch.float32), max_positions=512)
    model.use_backend(Backend("cpu-torch", attention=attention))  # CUDA's path: torch ops, Triton's attention
    plan = GraphPlan(replay_eagerly, max_batch=8, max_model_len=256) if graphs else None
    return ModelRunner(model, ck.config, NUM_BLOCKS, 0, BLOCK, torch.float32, torch.device("cpu"), layout=layout,
                       graphs=plan)


def _decode_both(ck, layout_for=None, attention: str = "triton"):
    """Prefill five prompts eagerly on both runners, then decode steps of 5, 3, 1, 4 and 8 rows (buckets 8, 4, 1,
    4, 8; a new sequence joins, others leave) greedily: the graph runner's logits against the eager one's."""
    config: ModelConfig = ck.config
    layout = layout_for and layout_for(config)
    eager, graph = _runner(ck, False, layout, attention), _runner(ck, True, layout, attention)
    groups = eager.layout.num_groups
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((9, 33, 17, 2, 40, 5, 12, 26))]
    # Each sequence's tables: fresh blocks per group, in no particular order, never the scratch block.
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [[[order.pop() for _ in range(4)] for _ in range(groups)] for _ in prompts]
    tokens = [list(p) for p in prompts]
    for i, p in enumerate(prompts):
        for r in (eager, graph):
            r.forward([BatchItem(p, 0, tables[i][0], group_tables=tables[i])])
    replayed = 0
    for rows in ([0, 1, 2, 3, 4], [1, 2, 4], [2], [0, 2, 5, 3], [0, 1, 2, 3, 4, 5, 6, 7]):
        for i in rows:
            if len(tokens[i]) == len(prompts[i]) and i >= 5:  # joins now: its prompt first, eagerly on both
                for r in (eager, graph):
                    r.forward([BatchItem(prompts[i], 0, tables[i][0], group_tables=tables[i])])
        items = [BatchItem(tokens[i][-1:], len(tokens[i]) - 1, tables[i][0], group_tables=tables[i]) for i in rows]
        assert graph._replays(items)
        want, got = eager.forward(items), graph.forward(items)
        assert got.shape == want.shape
        assert rel_err(got, want) <= 1e-5
        for i, t in zip(rows, want.argmax(-1).tolist()):
            tokens[i].append(t)
        replayed += 1
    assert sorted(graph.graphs._graphs) == [1, 4, 8]
    # Every page a sequence holds is as the eager runner wrote it; nothing else but the scratch block was touched.
    held = {b for seq in tables for group in seq for b in group}
    scratch = graph.graphs.scratch_block
    for (ek, ev), (gk, gv) in zip(eager.kv_slots, graph.kv_slots):
        for e, g in ((ek, gk), (ev, gv)):
            for b in range(NUM_BLOCKS):
                if b in held:
                    torch.testing.assert_close(g[:, b], e[:, b], rtol=1e-5, atol=1e-6)
                else:
                    assert not g[:, b].any() and not e[:, b].any()
            assert g[:, scratch].any()  # the padding rows' writes went there
    return replayed


def test_replayed_decode_steps_give_the_eager_logits_and_pages(tiny_llama_gguf):
    assert _decode_both(load_checkpoint(tiny_llama_gguf)) == 5


def test_replayed_decode_steps_with_kv_groups(tiny_gemma_gguf):
    """Gemma 3's sliding-window layers in KV groups of their own: each group's tables and slots in the buffers (on
    the torch reference's attention, which reads the tables' whole width: the interpreter's kernels are slow)."""
    ck = load_checkpoint(tiny_gemma_gguf)
    layout = KVLayout.for_model
    assert layout(ck.config).num_groups > 1
    assert _decode_both(ck, layout, attention="torch") == 5


def test_steps_a_graph_does_not_take_run_eagerly(tiny_llama_gguf):
    """A prefill, a draft being verified, a batch past the largest bucket, a context past the tables' width."""
    runner = _runner(load_checkpoint(tiny_llama_gguf), True)
    table = list(range(1, 17))
    assert not runner._replays([BatchItem([5, 6], 3, table)])
    assert not runner._replays([BatchItem([5], 0, table)])
    assert not runner._replays([BatchItem([5], 3, table, num_logits=2)])
    assert not runner._replays([BatchItem([5], 3, table)] * 9)
    assert not runner._replays([BatchItem([5], 256, table)])
    assert runner._replays([BatchItem([5], 255, table)] * 8)


def test_the_plan_replays_only_where_a_graph_can(tiny_llama_gguf, caplog):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dense = load_checkpoint(tiny_llama_gguf).config
    mixture = replace(dense, num_experts=4, experts_per_token=2, moe_intermediate_size=32)
    assert graphs_in_force(True, cuda, dense, kv_int8=False)
    assert not graphs_in_force(False, cuda, dense, kv_int8=False)
    assert not graphs_in_force(True, cpu, dense, kv_int8=False)
    assert not graphs_in_force(True, cuda, dense, kv_int8=True)
    assert not graphs_in_force(True, cuda, mixture, kv_int8=False)
    assert graphs_in_force(True, cuda, dense, kv_int8=False, kv_fp8=True, capability=(9, 0))
    assert not graphs_in_force(True, cuda, dense, kv_int8=False, kv_fp8=True, capability=(8, 6))
    assert "no effect" in caplog.text
