"""The 8-bit KV cache (`kv_cache_dtype = "int8"`): each (token, kv head) row of head_dim keys or values is
held as int8 in groups of 16, each group's fp16 scale written after the row's values, so a cache tensor
is uint8 [Hkv, blocks, block_size, head_dim + 2 * groups] (72 bytes for 64 values) and a block copy, a
swap or a prefix hit moves the scales with the values.

Symmetric, per group of 16: scale = fp16(max|x| / 127), q = round-half-even(x / scale), clamped to
+-127. Every value comes back within half a step (about max|x| / 254) of its own. Small groups, not one
scale a row: keys carry a few large channels, and a scale shared with one of them leaves the channels
beside it a handful of steps; keys, with those channels, cause most of the error, and 16 halves it
against groups of 32 at the same bytes (fp16 scales in place of fp32). The rounding is spelled the same in
torch (here: the per-op path, CUDA) and in the fused CPU decoder (kernels/cpu_common.h,
quantize_kv_row / dequantize_kv_row), so a row's bytes, and the bf16 values attention reads back, do not
depend on which path wrote or reads it.
"""
from __future__ import annotations

import torch

GROUP = 16  # values per scale (the last group of a row may be shorter)
SCALE_BYTES = 2  # each group's scale, as fp16
SCALE_MAX = 65504.0  # the largest fp16: a scale is clamped to it, never inf
MODES = ("auto", "int8")  # besides the model's own dtype


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def groups(head_dim: int) -> int:
    return -(-head_dim // GROUP)


def row_width(head_dim: int, quantized: bool) -> int:
    """A cache row's last dimension: head_dim values, or head_dim int8 and an fp16 scale per group."""
    return head_dim + SCALE_BYTES * groups(head_dim) if quantized else head_dim


def head_dim_of(width: int) -> int:
    """The head_dim whose 8-bit row is `width` bytes (row_width grows with head_dim: one answer)."""
    for k in range(1, width // SCALE_BYTES + 1):
        if groups(width - SCALE_BYTES * k) == k:
            return width - SCALE_BYTES * k
    raise ValueError(f"{width} bytes is no 8-bit KV row's width")


def bytes_per_element(head_dim: int, dtype: torch.dtype, quantized: bool) -> float:
    """Cache bytes per K or V element, scales included (the KV pool's arithmetic); `dtype`: a float cache's
    element type (the model's, or float8)."""
    if quantized:
        return row_width(head_dim, True) / head_dim
    return torch.tensor([], dtype=dtype).element_size()


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> uint8 [..., row_width(D)]: D int8 values, then each group's fp16 scale."""
    d, n = x.shape[-1], groups(x.shape[-1])
    xf = torch.nn.functional.pad(x.float(), (0, n * GROUP - d)).unflatten(-1, (n, GROUP))
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_(max=SCALE_MAX).half()
    step = scale.float()
    q = torch.where(step > 0, xf / step, torch.zeros_like(xf)).round_().clamp_(-127, 127).to(torch.int8)
    out = torch.empty((*x.shape[:-1], row_width(d, True)), dtype=torch.uint8, device=x.device)
    out[..., :d] = q.flatten(-2)[..., :d].view(torch.uint8)
    out[..., d:] = scale.squeeze(-1).contiguous().view(torch.uint8)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., row_width(D)] -> [..., D] in `dtype`: q * scale in fp32, then rounded once to `dtype`."""
    d = head_dim_of(rows.shape[-1])
    q = rows[..., :d].contiguous().view(torch.int8)
    scale = rows[..., d:].contiguous().view(torch.float16).float().repeat_interleave(GROUP, dim=-1)[..., :d]
    return (q.float() * scale).to(dtype)
