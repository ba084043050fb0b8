"""The quantized GEMM (kernels/decoder_cpu.cpp, QWeight) against a float64 reference of the very weights
it holds, for int8 and int4, on both of its paths (decode-sized steps multiply the values as read; longer
ones widen a bf16 panel first), at whatever CPU level this run is at (tests/integration/test_cpu_levels.py
reruns this file at the lower levels)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.models import quant


@pytest.fixture(scope="module")
def native():
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.fused:
        pytest.skip("the packed GEMM does not run here")
    return kernels


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def _assert_close(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    """Within the output's bf16 rounding (half an ulp: 2^-9 relative) plus fp32 accumulation over k."""
    bound = ref.abs() * 2.0 ** -8 + 1e-5 * k ** 0.5 * ref.abs().max()
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, f"off by {worst:.3g} beyond the bound (scale {ref.abs().max().item():.3g})"


# Short steps take the direct path (up to quant_direct_rows: 8 with AVX-512 BF16, 4 on AVX2), longer the panel; N of 16 leaves a pair with one block.
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (2, 16, 576), (3, 48, 576), (5, 32, 64), (8, 32, 1536),
                                   (9, 64, 576), (33, 80, 128), (70, 16, 256)])
def test_quantized_linear_matches_its_weights(native, bits, m, n, k):
    torch.manual_seed(m * 1000 + n + k + bits)
    qm = quant.quantize(torch.randn(n, k), bits)
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, bits)
    x = torch.randn(m, k).bfloat16()
    w = qm.dequantize()
    if m > native.quant_direct_rows:  # the panel holds the weights rounded to bf16
        w = w.bfloat16().float()
    _assert_close(native.linear_quant(x, packed, bits, n, torch.float32), _reference(x, w), k)
    as_bf16 = native.linear_quant(x, packed, bits, n)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16.float(), native.linear_quant(x, packed, bits, n, torch.float32))


def test_int4_with_large_offsets_keeps_its_precision(native):
    """The int4 path sums x (128 + q) and takes 128 sum(x) off: rows whose inputs all share a sign must
    still come out right."""
    torch.manual_seed(1)
    qm = quant.quantize(torch.randn(32, 512) * 0.01 + 0.05, 4)
    x = (torch.rand(4, 512) + 1.0).bfloat16()
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, 4)
    _assert_close(native.linear_quant(x, packed, 4, 32, torch.float32), _reference(x, qm.dequantize()), 512)


def test_pack_quant_refuses_inconsistent_shapes(native):
    qm = quant.quantize(torch.randn(16, 64), 4)
    with pytest.raises(ValueError):
        native.pack_quant(qm.values, qm.scales, qm.minimums, 8)
    with pytest.raises(ValueError):
        native.pack_quant(qm.values[:8], qm.scales[:8], qm.minimums[:8], 4)


def test_gguf_blocks_map_exactly(native):
    """Q8_0, Q4_0 and Q4_1 matrices written by gguf's own quantizer come out as the weights gguf itself
    dequantizes, bit for bit, and the kernel computes with them."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        raw = quants.quantize(w, qtype)
        qm = quant.from_gguf(raw, int(qtype))
        expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(w.shape))
        assert qm.bits == quant.exact_gguf_bits(int(qtype))
        assert torch.equal(qm.dequantize(), expected), qtype.name
        x = torch.randn(2, 128).bfloat16()
        packed = native.pack_quant(qm.values, qm.scales, qm.minimums, qm.bits)
        _assert_close(native.linear_quant(x, packed, qm.bits, 32, torch.float32), _reference(x, expected), 128)


def test_quantize_rounds_to_the_nearest_level():
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    for bits, levels in ((8, 254), (4, 15)):
        qm = quant.quantize(w, bits)
        step = qm.scales.float().repeat_interleave(quant.GROUP, dim=1)
        assert ((qm.dequantize() - w).abs() <= step * 0.5 + 1e-6).all()
        spread = w.view(16, 2, 32).amax(-1) - w.view(16, 2, 32).amin(-1)
        assert (qm.scales.float() <= spread / levels * 2.01 + 1e-6).all()
    assert quant.quantize(torch.zeros(16, 32), 8).dequantize().abs().max() == 0
