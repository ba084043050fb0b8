"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a float32 softmax router picks `top_k` of the experts for
each token, and the token's output is the sum of those experts' gated MLPs, each weighted by its router
probability (renormalised over the chosen where the model says so).

Each expert is a GatedMLP of its own, so its weights are one contiguous packed matrix per projection (a
routed expert is one sequential read) and every weight form and kernel of the dense MLP serves it. A step
groups its tokens by expert and runs each chosen expert once on all the tokens routed to it: the step reads
only the experts its tokens chose. The fused decoder runs the same arithmetic (kernels/decoder_step.h).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.backend import TORCH, Backend
from kvserve.models.layers import GatedMLP, frozen


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights: (weights float32 [T, k], experts int64 [T, k]) from the
    float32 logits' softmax, its top k (renormalised to sum to 1 where `normalize`)."""
    probs = F.linear(hidden.float(), router).softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """The routed MLP: `gate` is the router [E, hidden], kept in float32 whatever dtype the model is cast to
    (its logits decide which weights a token reads: bf16 would move ties); `experts` the E gated MLPs."""

    backend: Backend = TORCH
    # The all-reduce over tensor-parallel ranks, each holding a slice of every expert (models/parallel.attach).
    reduce: "Callable[[torch.Tensor], torch.Tensor] | None" = None

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool,
                 activation: str = "silu"):
        super().__init__()
        self.gate = nn.Module()
        self.gate.weight = frozen(torch.empty(num_experts, hidden))
        self.experts = nn.ModuleList([GatedMLP(hidden, intermediate, activation) for _ in range(num_experts)])
        self.top_k, self.normalize, self.activation = top_k, normalize, activation

    @property
    def router(self) -> torch.Tensor:
        return self.gate.weight

    def _apply(self, fn, recurse=True):
        """Moves and casts reach the experts; the router stays float32 (its values as loaded)."""
        router = self.gate.weight.data
        super()._apply(fn, recurse)
        self.gate.weight.data = router.to(device=self.gate.weight.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each expert once over the rows routed to it; a row's weighted outputs
        summed in float32 in ascending expert order (the fused kernel's order) and rounded once."""
        weights, experts = route(x, self.router, self.top_k, self.normalize)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start:start + count]
            rows = slots // self.top_k
            y = self.experts[expert](x.index_select(0, rows))
            out.index_add_(0, rows, y.float() * weights.reshape(-1)[slots, None])
            start += count
        if self.reduce is not None:  # each rank's experts' slices: partial sums, added in float32
            out = self.reduce(out)
        return out.to(x.dtype)
