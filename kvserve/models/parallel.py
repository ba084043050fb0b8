"""Tensor parallelism inside a replica, Megatron-LM's layout (vLLM's ColumnParallelLinear / RowParallelLinear): each
of `size` ranks holds a slice of every projection and attends with its share of the heads.

- Q, K, V and gate/up are split by their output rows (whole heads; a fused Q/K/V or [gate; up] tensor part by part),
  each rank's attention and activations are its own; the attention output and down projections are split by their
  input columns, so their products are partial sums, added up by one all-reduce each (then the bias, once).
- KV heads go to ranks in equal runs; where there are fewer KV heads than ranks each is replicated on size / kv
  ranks (each rank still holds one, and its cache holds that head only).
- A mixture's experts are split by their intermediate dim (each rank holds a slice of every expert; the router is
  replicated, so every rank routes a token alike) and the weighted sum of the experts' partial outputs is reduced
  once per layer, in float32.
- The embedding table and the LM head are split by vocabulary (vLLM's VocabParallelEmbedding and ParallelLMHead):
  each rank holds an equal run of rows (the last run padded with zero rows); a lookup takes the rank's own ids
  (zeros for the others') and one all-reduce adds them up (exactly: one term is not zero), and each rank's logits
  of its rows are all-gathered into the whole vocabulary's.

The split is decided once here, from the config (`shard_config`) and the checkpoint's HF names (`shard_tensors`);
`attach` gives the row-parallel modules their all-reduce. Dense weights only: a checkpoint's quantized matrices are
dequantized before they are split.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvserve.config import ConfigError, ModelConfig

Reduce = Callable[[torch.Tensor], torch.Tensor]
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group of `size` ranks."""

    size: int
    rank: int

    def __post_init__(self):
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ConfigError(f"tensor parallel rank {self.rank} of {self.size}: want 0 <= rank < size, size >= 1")

    # ---- the split ----------------------------------------------------------------------------
    def check(self, c: ModelConfig) -> None:
        """The model divides over the ranks: its heads, KV heads (or the ranks over them) and MLP widths."""
        n = self.size
        bad = [f"{what} {value}" for what, value in (
            ("attention heads", c.num_heads), ("intermediate size", c.intermediate_size),
            ("expert intermediate size", c.moe_intermediate_size)) if value % n]
        if c.num_kv_heads % n and n % c.num_kv_heads:
            bad.append(f"KV heads {c.num_kv_heads} (nor do the ranks divide over them)")
        if bad:
            raise ConfigError(f"tensor_parallel_size = {n} does not divide the model's " + ", ".join(bad))

    def kv_heads(self, c: ModelConfig) -> tuple[int, int]:
        """(KV heads this rank holds, the first one's index)."""
        if c.num_kv_heads >= self.size:
            per = c.num_kv_heads // self.size
            return per, self.rank * per
        return 1, self.rank // (self.size // c.num_kv_heads)

    def vocab_rows(self, c: ModelConfig) -> tuple[int, int]:
        """(this rank's first row of the embedding table and LM head, rows per rank): the vocabulary in equal runs,
        the last one padded."""
        per = -(-c.vocab_size // self.size)
        return self.rank * per, per

    def shard_config(self, c: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: its heads, KV heads, MLP widths and vocabulary rows (the model code
        builds it as is; the runner's config keeps the whole vocabulary, which the gathered logits have)."""
        self.check(c)
        return replace(c, num_heads=c.num_heads // self.size, num_kv_heads=self.kv_heads(c)[0],
                       intermediate_size=c.intermediate_size // self.size,
                       moe_intermediate_size=c.moe_intermediate_size // self.size, vocab_size=self.vocab_rows(c)[1])

    def shard_tensors(self, tensors: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
        """This rank's slices of a checkpoint's HF-named dense tensors (the others whole)."""
        self.check(c)
        return {name: self.slice(name, t, c) for name, t in tensors.items()}

    def slice(self, name: str, t: torch.Tensor, c: ModelConfig) -> torch.Tensor:
        """This rank's part of the whole model's (config `c`) HF-named dense tensor `name` (the tensor itself where
        every rank holds it whole)."""
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tensor parallelism splits dense weights: {name} is held quantized; dequantize it "
                              "first (Checkpoint.dense_tensors)")
        d = c.head_dim
        q_rows, kv_rows = c.num_heads * d, c.num_kv_heads * d
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return self._rows(t)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            return self._kv_rows(t, c)
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):  # Phi-3's fused [q; k; v]
            q, k, v = t.split([q_rows, kv_rows, kv_rows])
            return torch.cat([self._rows(q), self._kv_rows(k, c), self._kv_rows(v, c)])
        if name.endswith("self_attn.o_proj.weight"):
            return self._columns(t)
        if name.endswith("gate_up_proj.weight"):  # Phi-3's fused [gate; up] (before "up_proj.weight" matches it)
            gate, up = t.chunk(2)
            return torch.cat([self._rows(gate), self._rows(up)])
        if name.endswith((".gate_proj.weight", ".up_proj.weight")):  # dense MLPs and every expert's
            return self._rows(t)
        if name.endswith("down_proj.weight"):
            return self._columns(t)
        if name in VOCAB_TENSORS:
            first, per = self.vocab_rows(c)
            rows = t[first:first + per]
            return torch.cat([rows, rows.new_zeros(per - len(rows), *rows.shape[1:])]) if len(rows) < per \
                else rows.contiguous()
        return t  # norms, the router, a row-parallel projection's bias

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.size, dim=0)[self.rank].contiguous()

    def _columns(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.size, dim=1)[self.rank].contiguous()

    def _kv_rows(self, t: torch.Tensor, c: ModelConfig) -> torch.Tensor:
        count, first = self.kv_heads(c)
        return t[first * c.head_dim:(first + count) * c.head_dim].contiguous()


def attach(model: torch.nn.Module, tp: TensorParallel, config: ModelConfig, group=None) -> None:
    """Give each layer's row-parallel modules their all-reduce over the group: the attention output projection, and
    the dense MLP's down projection or a mixture as a whole (models/layers.linear and models/moe.SparseMoE apply
    it); the embedding its vocabulary rows and all-reduce, the LM head its all-gather. `config`: the whole model's."""
    from kvserve.models.moe import SparseMoE

    if model.native_decoder is not None:
        raise ConfigError("the fused CPU decoder does not add up tensor-parallel ranks: build the model per op")
    reduce = all_reduce(group)
    model.embed_tokens.rows_from = tp.vocab_rows(config)[0]
    model.embed_tokens.reduce = reduce
    model.gather_logits = all_gather_vocab(tp.size, config.vocab_size, group)
    for layer in model.layers:
        layer.self_attn.o_proj.reduce = reduce
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.reduce = reduce
        else:
            layer.mlp.down_proj.reduce = reduce


def all_reduce(group=None) -> Reduce:
    """The sum over the group's ranks (torch.distributed: gloo on the CPU, NCCL on CUDA), in place."""
    import torch.distributed as dist

    def reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    return reduce


def all_gather_vocab(size: int, vocab_size: int, group=None) -> Reduce:
    """The whole vocabulary's logits [..., vocab_size] from each rank's run of rows (the last run's padding cut)."""
    import torch.distributed as dist

    def gather(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    return gather
