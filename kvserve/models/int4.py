"""The GGUF's own 4-bit weights (Q4_0 / Q4_1) kept packed for small-batch decode.

A decode step at batch 1-4 is bound by reading the weights. Q4_0/Q4_1 store each row as groups of
32 four-bit values with a scale (and a minimum): w = d * q + m. That is exactly torch's int4 packed
format, w = (q - 8) * scale + zero with group size 32, taking scale = d and zero = m + 8d, so the
packed kernel reads a quarter of the bytes of the dense bfloat16 copy and computes with the same
weights the file holds (scales rounded to bfloat16). Larger batches, which are compute-bound, use
the dense weights. Other quantization types are not repacked: that would requantize them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
Q4_0, Q4_1 = 2, 3  # GGMLQuantizationType values
# Rows up to which the packed kernel beats dense bfloat16 on CPU (clearly at 1 row; the two are even by 8).
MAX_PACKED_ROWS = 4


@dataclass
class Int4Weight:
    """Unpacked 4-bit values [N, K] (0..15) with per-group scale and zero [N, K / 32] (float32)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def permute_rows(self, perm) -> "Int4Weight":
        return Int4Weight(perm(self.q), perm(self.scale), perm(self.zero))

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))


def unpack_gguf_q4(raw: np.ndarray, qtype: int) -> Int4Weight:
    """raw: uint8 [N, bytes per row] of Q4_0 (18 B / 32 weights) or Q4_1 (20 B / 32 weights) blocks."""
    n = raw.shape[0]
    block_bytes = 18 if qtype == Q4_0 else 20
    blocks = raw.reshape(n, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        zero = m + 8 * d
    else:
        qs = blocks[..., 2:]
        zero = np.zeros_like(d)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # low nibbles are elements 0..15
    return Int4Weight(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero))


class PackedInt4:
    """torch's CPU int4 packed layout plus its [K/32, N, 2] scale-and-zero table."""

    def __init__(self, w: Int4Weight, dtype: torch.dtype):
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.contiguous(), 1)
        self.scales_and_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1).contiguous().to(dtype)
        self.dtype = dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


def packed_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
