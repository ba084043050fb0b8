"""FP8 (e4m3: 4 exponent bits, 3 mantissa bits, no infinities, largest finite value E4M3_MAX) for the weights
(`weights = "fp8"`) and the KV cache (`kv_cache_dtype = "fp8"`), as vLLM and TensorRT-LLM hold them on Hopper.

Weights: each projection's rows [N, K] as e4m3 with one float32 scale per output row (row amax / E4M3_MAX, so
a row's largest value lands on the largest code); each step's activations get one scale per token, found as
the step runs (dynamic). `linear` multiplies the two in torch._scaled_mm, which applies both scales to the
float32 sums: on CUDA the tensor cores' FP8 GEMM (compute capability 8.9 and later); on the CPU torch's
reference implementation, which checks the path and is not fast.

KV cache: keys and values cast to e4m3 with a per-tensor scale of 1 (vLLM's default without calibration data),
saturated at +-E4M3_MAX, so a cache element is one byte and attention reads it back cast to the query's dtype.
"""
from __future__ import annotations

import torch

DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(DTYPE).max
MIN_CAPABILITY = (8, 9)  # CUDA compute capability with FP8 tensor cores and e4m3 conversions (Ada, Hopper, later)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x saturated at +-E4M3_MAX and rounded to e4m3 (the cast alone may give NaN past the range on some
    builds; saturation is what vLLM's conversions do)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(DTYPE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (e4m3 [..., K], float32 scales [..., 1]) with x ~ q * scale: each row's amax maps to
    E4M3_MAX; an all-zero row gets scale 1 (its values are zero whatever the scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return to_e4m3(xf / scale), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 q * scale (scale [..., 1] or [N] per row of a [N, K] matrix)."""
    return q.float() * (scale if scale.dim() == q.dim() else scale[:, None])


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's [N, K] weight -> (e4m3 [N, K], row-major, float32 scales [N]): the layout
    torch._scaled_mm reads as its column-major second operand once transposed (`fp8_linear`)."""
    q, scale = quantize_rows(w)
    return q.contiguous(), scale.reshape(-1).contiguous()


def _mm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype _scaled_mm writes: the input's, but bfloat16 on CUDA for other dtypes, then cast: its row-wise
    scaled kernels write bfloat16 (and float16 on newer builds) on every FP8 GPU, float32 only through cuBLAS
    on SM 9.0 with CUDA 12.9 or later. The CPU writes any."""
    return x.dtype if x.device.type == "cpu" or x.dtype == torch.bfloat16 else torch.bfloat16


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times an e4m3 weight [N, K] with per-row scales [N] -> [..., N] in x's dtype: the tokens'
    rows quantized to e4m3 with a scale each, both scales applied to the float32 sums; the bias after."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        out = rows.new_empty((0, weight.shape[0]))
    else:
        xq, x_scale = quantize_rows(rows)
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
                               out_dtype=_mm_dtype(x)).to(x.dtype)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
