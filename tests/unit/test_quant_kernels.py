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


def _assert_close(out: torch.Tensor, ref: torch.Tensor, k: int, extra: torch.Tensor | float = 0.0) -> None:
    """Within the output's bf16 rounding (half an ulp: 2^-9 relative) plus fp32 accumulation over k, plus
    `extra` (what the path rounds on the way: see _path_error)."""
    bound = ref.abs() * 2.0 ** -8 + 1e-5 * k ** 0.5 * ref.abs().max() + extra
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, f"off by {worst:.3g} beyond the bound (scale {ref.abs().max().item():.3g})"


def _path_error(native, x: torch.Tensor, w: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """What a step of x's rows rounds besides the output, by path and build. AVX-512 BF16 and AMX builds:
    short steps multiply the exact weights by the bf16 rows; longer ones the weights rounded to bf16 (a
    panel), off by at most 2^-9 |x| |w|. AVX2 builds: short steps round each 32-deep chunk of a row to
    16-bit integers with a power-of-two scale (off by at most 2^-14 of the chunk's largest |x| per value);
    longer ones multiply the exact weights in fp32. Under the batch-invariant numerics every step rounds as
    one path does: AVX-512 BF16 and AMX builds as the panel, AVX2 builds as the short steps."""
    xd, wd = x.double(), w.double().abs()
    direct = not native.pair_layout if invariant else x.shape[0] <= native.quant_direct_rows
    if native.pair_layout:
        return 0.0 if direct else 2.0 ** -9 * (xd.abs() @ wd.T)
    if not direct:
        return 0.0
    chunk_max = xd.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)
    return 2.0 ** -14 * (chunk_max @ wd.T)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (2, 16, 576), (3, 48, 576), (5, 32, 64), (8, 32, 1536),
                                   (9, 64, 576), (16, 48, 256), (17, 32, 96), (33, 80, 128), (70, 16, 256),
                                   (300, 32, 2048)])  # AVX2 panels take rows in passes of 256 at this k
@pytest.mark.parametrize("invariant", [False, True])
def test_quantized_linear_matches_its_weights(native, bits, m, n, k, invariant):
    torch.manual_seed(m * 1000 + n + k + bits)
    qm = quant.quantize(torch.randn(n, k), bits)
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, bits)
    x = torch.randn(m, k).bfloat16()
    w = qm.dequantize()
    out = native.linear_quant(x, packed, bits, n, torch.float32, invariant)
    _assert_close(out, _reference(x, w), k, _path_error(native, x, w, invariant))
    as_bf16 = native.linear_quant(x, packed, bits, n, invariant=invariant)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16.float(), out)


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_invariant_rows_are_the_same_bits_in_any_step(native, bits):
    """Batch-invariant numerics: a row's outputs are the same bits alone, among the first m rows of a step
    or anywhere in it, for dense bf16 (bits 0) and quantized weights, across every path boundary of the
    fast numerics (decode-sized, AVX2's integer and panel sizes, AVX2's few-row kernels)."""
    torch.manual_seed(bits)
    n, k = 112, 576  # 7 column blocks: a lone row's tasks of four and of three
    if bits:
        qm = quant.quantize(torch.randn(n, k), bits)
        packed = native.pack_quant(qm.values, qm.scales, qm.minimums, bits)
    else:
        packed = native.pack_weight(torch.randn(n, k).bfloat16())
    x = torch.randn(300, k).bfloat16() * torch.logspace(-3, 3, 300).unsqueeze(1).bfloat16()
    full = native.linear_quant(x, packed, bits, n, torch.float32, True)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 299):
        assert torch.equal(native.linear_quant(x[:m], packed, bits, n, torch.float32, True), full[:m]), m
        assert torch.equal(native.linear_quant(x[m - 1:m + 3], packed, bits, n, torch.float32, True),
                           full[m - 1:m + 3]), m
    for i in (5, 150, 299):  # rows alone, of every size of input
        assert torch.equal(native.linear_quant(x[i:i + 1], packed, bits, n, torch.float32, True), full[i:i + 1]), i


def _as_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as the 8-bit activations see it (gemm_quant_int8): per 16 inputs, q = x * (127 / max |x|)
    rounded to nearest even, times max |x| / 127, all in fp32 (an all-zero group stays zero)."""
    chunks = x.float().view(x.shape[0], -1, 16)
    amax = chunks.abs().amax(-1, keepdim=True).double()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    # Quotients correctly rounded to fp32 as the kernel's are (from float64: a second rounding that is exact
    # for division); torch's fp32 scalar / tensor may round differently.
    q = torch.round(chunks * (127.0 / safe).float())
    return (q.double() * (safe / 127.0).float().double()).view_as(x)


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (3, 48, 576), (8, 112, 1536), (9, 64, 576), (70, 16, 256),
                                   (300, 32, 2048)])
def test_int8_activations_multiply_the_rows_rounded_to_8_bits(native, bits, m, n, k):
    """8-bit activations: the weights' exact values times each row rounded to int8 per 16 inputs, within
    the output's rounding; the same bits with or without the batch-invariant flag (they always are)."""
    if not native.int8_activations:
        pytest.skip("8-bit activations need AVX-512 BF16 and VNNI")
    torch.manual_seed(m * 1000 + n + k + bits)
    qm = quant.quantize(torch.randn(n, k), bits)
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, bits)
    x = torch.randn(m, k).bfloat16() * torch.logspace(-2, 2, m).unsqueeze(1).bfloat16()
    x[0, :32] = 0  # a chunk of zeros
    out = native.linear_quant(x, packed, bits, n, torch.float32, False, True)
    _assert_close(out, _reference(_as_int8_rows(x), qm.dequantize()), k)
    assert torch.equal(native.linear_quant(x, packed, bits, n, torch.float32, True, True), out)
    # Against the exact rows, the rounding costs at most half a step (max |x| / 254) a value.
    step = x.double().abs().view(m, -1, 16).amax(-1).repeat_interleave(16, dim=1) / 254
    _assert_close(out, _reference(x, qm.dequantize()), k, step @ qm.dequantize().double().abs().T)


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_int8_activation_rows_are_the_same_bits_in_any_step(native, bits):
    """8-bit activations are batch-invariant by construction, at every step size; a non-finite input
    spoils its own row only."""
    if not native.int8_activations:
        pytest.skip("8-bit activations need AVX-512 BF16 and VNNI")
    torch.manual_seed(bits)
    n, k = 112, 576
    qm = quant.quantize(torch.randn(n, k), bits)
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, bits)
    x = torch.randn(300, k).bfloat16() * torch.logspace(-3, 3, 300).unsqueeze(1).bfloat16()
    x[7, 40], x[11, 3] = float("inf"), float("nan")
    full = native.linear_quant(x, packed, bits, n, torch.float32, False, True)
    spoilt = (torch.arange(300) == 7) | (torch.arange(300) == 11)
    assert full[spoilt].isnan().all() and full[~spoilt].isfinite().all()
    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN included
        return torch.equal(a.view(torch.int32), b.view(torch.int32))

    for m in (1, 2, 5, 8, 9, 17, 299):
        assert same_bits(native.linear_quant(x[:m], packed, bits, n, torch.float32, False, True), full[:m]), m
    for i in (5, 7, 11, 150, 299):
        assert same_bits(native.linear_quant(x[i:i + 1], packed, bits, n, torch.float32, False, True),
                         full[i:i + 1]), i


def test_int4_with_large_offsets_keeps_its_precision(native):
    """The int4 path sums x (128 + q) and takes 128 sum(x) off: rows whose inputs all share a sign must
    still come out right."""
    torch.manual_seed(1)
    qm = quant.quantize(torch.randn(32, 512) * 0.01 + 0.05, 4)
    x = (torch.rand(4, 512) + 1.0).bfloat16()
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, 4)
    w = qm.dequantize()
    _assert_close(native.linear_quant(x, packed, 4, 32, torch.float32), _reference(x, w), 512, _path_error(native, x, w))


def test_pack_quant_refuses_inconsistent_shapes(native):
    qm = quant.quantize(torch.randn(16, 64), 4)
    with pytest.raises(ValueError):
        native.pack_quant(qm.values, qm.scales, qm.minimums, 8)
    six = quant.quantize(torch.randn(16, 64), 6)
    with pytest.raises(ValueError):  # 16-value groups: twice the scales of the 8-bit form
        native.pack_quant(six.values, six.scales[:, :2], six.minimums[:, :2], 6)
    if native.int8_activations:
        packed = native.pack_quant(six.values, six.scales, six.minimums, 6)
        with pytest.raises(ValueError):  # only 8-bit activations multiply the 6-bit form
            native.linear_quant(torch.randn(1, 64).bfloat16(), packed, 6, 16)
    with pytest.raises(ValueError):
        native.pack_quant(qm.values[:8], qm.scales[:8], qm.minimums[:8], 4)


def test_gguf_blocks_map_exactly(native):
    """Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 matrices written by gguf's own quantizer come out as the weights gguf
    itself dequantizes, bit for bit, at their own bits and promoted to 8, and the kernel computes with them."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                  GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1):
        raw = quants.quantize(w, qtype)
        expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(w.shape))
        for bits in sorted({quant.EXACT_BITS[int(qtype)], 8}):
            qm = quant.from_gguf(raw, int(qtype), bits)
            assert qm.bits == bits and quant.is_exact(int(qtype), bits)
            assert torch.equal(qm.dequantize(), expected), (qtype.name, bits)
        x = torch.randn(2, 128).bfloat16()
        packed = native.pack_quant(qm.values, qm.scales, qm.minimums, qm.bits)
        _assert_close(native.linear_quant(x, packed, qm.bits, 32, torch.float32), _reference(x, expected), 128,
                      _path_error(native, x, expected))


def _random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Valid blocks of a K-quant type from random bytes, with small finite fp16 super-block factors."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    factor = lambda: rng.uniform(1e-3, 1e-2, raw.shape[:-1]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    if qtype == T.Q6_K:
        raw[..., -2:] = factor()
    else:
        raw[..., 0:2], raw[..., 2:4] = factor(), factor()
    return raw.reshape(rows, -1)


def test_k_quants_map_to_their_sub_blocks():
    """Q4_K and Q5_K keep their values; each sub-block's scale and minimum (an fp16 factor times a 6-bit
    integer) is rounded to fp16 once, so the weights are gguf's own to 2^-11 of the largest. Q6_K, whose
    16-value sub-blocks do not fit a 32-value group, is quantized again at 8 bits: within half its step."""
    from gguf import GGMLQuantizationType as T, quants

    rng = np.random.default_rng(1)
    for qtype, bits in ((T.Q4_K, 4), (T.Q4_K, 8), (T.Q5_K, 8)):
        raw = _random_blocks(qtype, 16, 512, rng)
        expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(16, 512))
        qm = quant.from_gguf(raw, int(qtype), bits)
        assert qm.bits == bits and quant.is_exact(int(qtype), bits)
        assert (qm.dequantize() - expected).abs().max() <= 2.0 ** -11 * expected.abs().max()
        assert torch.equal(qm.q().view(16, -1, 32).amax(-1) <= (15 if qtype == T.Q4_K else 31),
                           torch.ones(16, 16, dtype=torch.bool))
    raw = _random_blocks(T.Q6_K, 16, 512, rng)
    expected = torch.from_numpy(quants.dequantize(raw, T.Q6_K).reshape(16, 512))
    qm = quant.from_gguf(raw, int(T.Q6_K))
    assert qm.bits == 8 and not quant.is_exact(int(T.Q6_K), 8)
    step = qm.scales.float().repeat_interleave(32, dim=1)
    assert ((qm.dequantize() - expected).abs() <= step / 2 + 1e-7).all()
    # Where 8-bit activations multiply them: at 6 bits, its own values and 16-value sub-blocks.
    six = quant.from_gguf(raw, int(T.Q6_K), 6)
    assert six.bits == 6 and quant.is_exact(int(T.Q6_K), 6) and six.scales.shape == (16, 32)
    assert (six.dequantize() - expected).abs().max() <= 2.0 ** -11 * expected.abs().max()
    assert int(six.q().min()) >= -32 and int(six.q().max()) <= 31
    wide = six.promote(8)  # meeting an 8-bit part: quantized again
    assert wide.bits == 8 and ((wide.dequantize() - six.dequantize()).abs()
                               <= wide.scales.float().repeat_interleave(32, dim=1) / 2 + 1e-7).all()


def _k_form(qtype, rows: int, cols: int, seed: int = 0):
    """A random Q4_K or Q6_K matrix in its K-quant form, and gguf's own dequantization of it."""
    from gguf import quants

    raw = _random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    qm = quant.from_gguf(raw, int(qtype), 6 if int(qtype) == quant.Q6_K else 4, supers=True)
    return qm, torch.from_numpy(quants.dequantize(raw, qtype).reshape(rows, cols))


def test_k_quant_forms_keep_the_files_weights():
    """Where 8-bit activations multiply them, Q4_K and Q6_K keep their own factors (the K-quant forms): the
    weights are gguf's own, bit for bit; the plain form (for the other kernels) rounds each sub-block's factor to fp16 once."""
    from gguf import GGMLQuantizationType as T

    for qtype, size in ((T.Q4_K, 144), (T.Q6_K, 210)):
        qm, expected = _k_form(qtype, 16, 512)
        assert qm.supers is not None and qm.kernel_bits == qm.bits | quant.SUPER
        assert torch.equal(qm.dequantize(), expected), qtype.name
        plain = qm.plain()
        assert plain.supers is None and plain.bits == qm.bits
        assert (plain.dequantize() - expected).abs().max() <= 2.0 ** -11 * expected.abs().max()
        assert qm.for_activations(True) is qm and qm.for_activations(False).supers is None
        assert qm.for_activations(False).bits == (8 if qtype == T.Q6_K else 4)
        both = quant.QuantizedMatrix.cat([qm, qm.map_rows(lambda t: t.flip(0))])
        assert both.supers is not None and torch.equal(both.dequantize()[16:], expected.flip(0))


def _k_form_packed(native, qtype, n: int, k: int, seed: int = 0):
    qm, expected = _k_form(qtype, n, k, seed)
    packed = qm.pack(native)
    # the file's bytes a row and super-block (Q4_K 144, Q6_K 210), Q4_K's 6-bit factors a byte each (+4)
    assert packed.bits == qm.kernel_bits and packed.data.numel() == n * k // 256 * (148 if qm.bits == 4 else 210)
    return packed, expected


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (3, 48, 512), (8, 112, 2048), (9, 64, 256), (300, 32, 512)])
def test_k_quant_forms_multiply_8_bit_activations(native, kind, m, n, k):
    """The K-quant forms' GEMM: gguf's own weights times each row rounded to int8 per 16, within the
    output's rounding, batch-invariant at every step size (a lone row, any slice)."""
    if not native.int8_activations:
        pytest.skip("the K-quant forms need AVX-512 BF16 and VNNI")
    from gguf import GGMLQuantizationType as T

    packed, w = _k_form_packed(native, T[kind], n, k, seed=m + n + k)
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k).bfloat16() * torch.logspace(-2, 2, m).unsqueeze(1).bfloat16()
    x[0, :32] = 0
    out = native.linear_quant(x, packed.data, packed.bits, n, torch.float32, True, True)
    _assert_close(out, _reference(_as_int8_rows(x), w), k)
    for i in {0, m // 2, m - 1}:
        assert torch.equal(native.linear_quant(x[i:i + 1], packed.data, packed.bits, n, torch.float32, True, True),
                           out[i:i + 1]), i
    with pytest.raises(ValueError):  # only the 8-bit-activation kernels read them
        native.linear_quant(x, packed.data, packed.bits, n, torch.float32, True, False)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_rows_read_from_the_packed_layout(native, kind):
    """A tied LM head in a K-quant form serves the embedding lookup too: the file's weights rounded to bf16."""
    if not native.int8_activations:
        pytest.skip("the K-quant forms need AVX-512 BF16 and VNNI")
    from gguf import GGMLQuantizationType as T

    packed, w = _k_form_packed(native, T[kind], 48, 512)
    ids = torch.tensor([[0, 47, 5], [17, 17, 32]])
    assert torch.equal(native.quant_rows(packed.data, packed.bits, 48, ids), w.bfloat16()[ids])


def test_auto_keeps_each_type_at_its_class():
    assert [quant.weight_bits(t, "auto") for t in (quant.F32, quant.F16, quant.BF16)] == [0, 0, 0]
    assert [quant.weight_bits(t, "auto") for t in (quant.Q4_0, quant.Q4_1, quant.Q4_K)] == [4, 4, 4]
    assert [quant.weight_bits(t, "auto") for t in (quant.Q8_0, quant.Q5_0, quant.Q5_K, 14)] == [8, 8, 8, 8]  # 14: Q6_K
    assert quant.weight_bits(quant.Q4_K, "int8") == 8 and quant.weight_bits(quant.Q8_0, "int4") == 4
    assert quant.weight_bits(quant.Q4_K, "bf16") == 0
    assert quant.weight_bits(quant.Q6_K, "auto", int8_acts=True) == 6 and quant.weight_bits(quant.Q6_K, "int8", int8_acts=True) == 8
    assert quant.weight_bits(quant.Q8_0, "auto", int8_acts=True) == 8 and quant.weight_bits(quant.Q4_K, "auto", int8_acts=True) == 4


def test_promoting_4_bits_to_8_is_exact():
    qm = quant.quantize(torch.randn(16, 64), 4)
    wide = qm.promote(8)
    assert wide.bits == 8 and torch.equal(wide.dequantize(), qm.dequantize())
    both = quant.QuantizedMatrix.cat([qm, quant.quantize(torch.randn(16, 64), 8)])
    assert both.bits == 8 and both.shape == (32, 64) and torch.equal(both.dequantize()[:16], qm.dequantize())


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_rows_read_from_the_packed_layout(native, bits):
    """An embedding lookup from a packed, quantized table gives the dense table's rows (w = s q + m, rounded
    to bf16), so a tied LM head and the embedding share one copy."""
    if bits == 6 and not native.int8_activations:
        pytest.skip("the 6-bit form needs AVX-512 BF16 and VNNI")
    qm = quant.quantize(torch.randn(48, 96), bits)
    packed = native.pack_quant(qm.values, qm.scales, qm.minimums, bits)
    ids = torch.tensor([[0, 47, 5], [17, 17, 32]])
    rows = native.quant_rows(packed, bits, 48, ids)
    assert rows.shape == (2, 3, 96) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, qm.dequantize().bfloat16()[ids])
    with pytest.raises(IndexError):
        native.quant_rows(packed, bits, 48, torch.tensor([48]))


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
