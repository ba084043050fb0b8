"""A tensor-parallel group under one engine (`tensor_parallel_size = N`): rank 0 is the engine's own process (its
EngineCore schedules, its runner samples), ranks 1..N-1 are processes of their own (spawned, or Ray actors in the
bundles of a fleet replica's placement group), each holding its slice of the model (models/parallel.py) and the KV
pool of its heads, with the same blocks and block tables as rank 0's.

Each step rank 0 broadcasts the step's work (its block moves and the batch: token ids, positions, block tables;
no sequences, no sampling state) and every rank runs it; the forward's all-reduces keep the ranks in step, and
every rank ends with the same logits, of which rank 0 samples. The work goes over a gloo group of its own (the
all-reduces over NCCL on CUDA, gloo on the CPU). A rank that dies fails rank 0's next collective (the connection
closes; the group's timeout bounds any wait), which fails the engine's step: the model is reported failed, never
left hanging. Not offered under tensor parallelism: interjections (a nested step would interleave the ranks'
collectives), the host and disk KV tiers (a page would be one rank's heads), the fused CPU decoder and weights kept
quantized (each rank holds dense slices).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.config import EngineConfig
from kvserve.engine.interjection import Interjection
from kvserve.engine.kv.groups import KVLayout
from kvserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from kvserve.engine.worker.runner import BatchItem, ModelRunner
from kvserve.models import backend
from kvserve.models.loader import Checkpoint, build_model, load_checkpoint
from kvserve.models.parallel import TensorParallel, attach

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # the longest a rank waits in a step's all-reduce for the others
IDLE_TIMEOUT = timedelta(days=365)  # the other ranks wait this long for rank 0's next step (an idle server)


@dataclass
class StepWork:
    """What every rank does for a step: the device pool's block moves, then the batch's forward."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)
    items: list[BatchItem] = field(default_factory=list)

    @classmethod
    def of(cls, out: SchedulerOutput) -> "StepWork":
        return cls(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, ModelRunner.batch_items(out))

    def run(self, runner: ModelRunner) -> None:
        runner.swap_out(self.swap_out)
        runner.swap_in(self.swap_in)
        runner.copy_blocks(self.copy)
        if self.items:
            runner.forward(self.items)


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its slice: the engine's settings and plan, the checkpoint, the pool's size."""

    config: EngineConfig
    plan: backend.Plan
    path: str
    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    port: int
    size: int


class TensorParallelExecutor:
    """Rank 0's executor: each step's work to the other ranks, then its own runner's (which samples)."""

    def __init__(self, runner: ModelRunner, processes: list, control):
        self.runner, self._processes, self._control = runner, processes, control
        self.failed = False  # a step failed: the group is broken (a rank gone, a collective timed out)

    def execute(self, out: SchedulerOutput, interjection: Interjection | None = None) -> RunnerOutput:
        try:
            _send(StepWork.of(out), self._control)
            return self.runner.execute(out)
        except Exception:
            self.failed = True
            raise

    def close(self) -> None:
        """Stop the other ranks and leave the group; after a failed step, end the ranks left (a broken group's
        goodbyes would wait out its timeouts) and drop the group (aborted on NCCL), so that the engine can start
        again in this process."""
        if not self.failed:
            try:
                _send(None, self._control)
            except Exception:  # a rank is gone already: nothing to tell it
                self.failed = True
                log.warning("tensor parallel: a rank was gone before the group closed")
        for p in self._processes:
            p.join(timeout=0 if self.failed else 10)
            if p.is_alive():
                p.kill()
        if not dist.is_initialized():
            return
        if self.failed and dist.get_backend() == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        else:
            dist.destroy_process_group()


def start(spec: RankSpec, checkpoint: Checkpoint, eos_token_ids) -> TensorParallelExecutor:
    """Start ranks 1..N-1, join the group as rank 0 and build rank 0's slice from the loaded checkpoint."""
    processes = _start_ranks(spec)
    control = _join(0, spec)
    runner = build_rank(spec, TensorParallel(spec.size, 0), checkpoint, eos_token_ids)
    dist.barrier(group=control)  # every rank built (loading may take longer than a collective's timeout)
    log.info("tensor parallel: %d ranks (%s)", spec.size, dist.get_backend())
    return TensorParallelExecutor(runner, processes, control)


def _start_ranks(spec: RankSpec) -> list:
    """Ranks 1..N-1: each in its bundle of this replica's placement group where the replica runs in one (a fleet
    replica: fleet/deploy.rank_bundles), else in a process spawned here."""
    group = _placement_group(spec.size)
    if group is not None:
        return [RayRank(group, rank, spec) for rank in range(1, spec.size)]
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=_rank_main, args=(rank, spec), daemon=True, name=f"kvserve-tp-rank-{rank}")
                 for rank in range(1, spec.size)]
    for p in processes:
        p.start()
    return processes


def _placement_group(size: int):
    """The placement group this process runs in (a Ray actor scheduled into one that captures its children), if
    it has a bundle per rank; else None."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    return group if group is not None and group.bundle_count >= size else None


class _RankActor:
    """A rank as a Ray actor: `run` is the rank's life (ends when rank 0 stops the group)."""

    def run(self, rank: int, spec: RankSpec) -> None:
        _rank_main(rank, spec)


class RayRank:
    """Rank `rank` in bundle `rank` of the placement group, behind the part of multiprocessing.Process's interface
    the executor uses (is_alive, join, kill)."""

    def __init__(self, group, rank: int, spec: RankSpec):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = group.bundle_specs[rank]
        actor = ray.remote(_RankActor).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
            name=f"kvserve-tp-rank-{rank}-{spec.port}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank))
        self.actor = actor.remote()
        self.done = self.actor.run.remote(rank, spec)

    def is_alive(self) -> bool:
        import ray

        return not ray.wait([self.done], timeout=0)[0]

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.done], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def local_device(rank: int) -> int:
    """The CUDA device index of a rank on its machine: its rank where it sees every GPU (processes spawned here),
    0 where Ray gave it only its own (a placement group's bundle)."""
    return rank % torch.cuda.device_count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_weights(setting: str) -> str:
    """The weights setting a rank loads its slices with: dense (bf16) or fp8; a quantized setting (auto on a
    quantized file, int8, int4) is read dense."""
    return setting if setting in ("bf16", "fp8") else "bf16"


def build_rank(spec: RankSpec, tp: TensorParallel, checkpoint: Checkpoint, eos_token_ids=()) -> ModelRunner:
    """The model from this rank's slices (a checkpoint loaded with `shard`: the whole model's config, the rank's
    dense tensors), built on its device, its row-parallel layers reducing over the group, in a runner over its
    share of the KV pool."""
    whole = checkpoint.config
    config = tp.shard_config(whole)
    shard = Checkpoint(config=config, tensors=checkpoint.tensors, path=checkpoint.path, format=checkpoint.format)
    checkpoint.tensors = {}
    plan = spec.plan
    if plan.device.type == "cuda":
        plan = replace(plan, device=torch.device("cuda", local_device(tp.rank)))
    model = build_model(shard, plan, max_positions=spec.max_model_len, consume=True,
                        attention_window=spec.config.sinks_window)
    attach(model, tp, whole)
    # The runner's config: this rank's heads, the whole vocabulary (the logits are gathered).
    model_config = replace(config, vocab_size=whole.vocab_size).with_attention_window(spec.config.sinks_window)
    layout = KVLayout.for_model(model_config, split=spec.config.cache.kv_groups)
    return ModelRunner(model, model_config, spec.num_blocks, spec.num_host_blocks, spec.config.cache.block_size,
                       plan.dtype, plan.device, kv_int8=plan.kv_int8, kv_fp8=plan.kv_fp8, eos_token_ids=eos_token_ids,
                       layout=layout, pages_contiguous=plan.kv_pages_contiguous)


def _join(rank: int, spec: RankSpec):
    """Join the group (NCCL on CUDA, else gloo) and return the gloo group the steps' work goes over."""
    cuda = spec.plan.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(local_device(rank))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                            world_size=spec.size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _send(work: StepWork | None, control) -> None:
    dist.broadcast_object_list([work], src=0, group=control)


def _rank_main(rank: int, spec: RankSpec) -> None:
    """A rank other than 0: build its slice, then run each step's work until rank 0 says stop (None)."""
    if spec.plan.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    control = _join(rank, spec)
    try:
        tp = TensorParallel(spec.size, rank)
        checkpoint = load_checkpoint(spec.path, rank_weights(spec.config.weights), spec.plan.dtype,
                                     shard=tp)
        runner = build_rank(spec, tp, checkpoint)
        dist.barrier(group=control)
        with torch.inference_mode():
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=control)
                if box[0] is None:
                    break
                box[0].run(runner)
    finally:
        dist.destroy_process_group()
