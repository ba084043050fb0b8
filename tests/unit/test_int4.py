"""The packed 4-bit decode path computes with the file's own Q4_0/Q4_1 weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.engine.runner import BatchItem, ModelRunner
from kvserve.models.int4 import PackedInt4, unpack_gguf_q4
from kvserve.models.loader import build_model, load_checkpoint
from tests.gguf_factory import TinySpec, write_tiny_gguf


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1"])
def test_unpack_matches_gguf_dequantize(qname):
    from gguf import GGMLQuantizationType as T, quants

    w = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    raw = quants.quantize(w, T[qname])
    ref = torch.from_numpy(quants.dequantize(raw, T[qname]))
    u = unpack_gguf_q4(raw, T[qname].value)
    deq = (u.q.float() - 8) * u.scale.repeat_interleave(32, 1) + u.zero.repeat_interleave(32, 1)
    assert torch.allclose(deq, ref, atol=1e-5)
    x = torch.randn(3, 128)
    packed = PackedInt4(u, torch.float32)
    assert torch.allclose(packed.matmul(x), x @ ref.t(), atol=1e-4, rtol=1e-4)


def test_packed_decode_matches_dense(tmp_path, smollm2_gguf_path):
    path = tmp_path / "tiny-q41.gguf"
    write_tiny_gguf(path, TinySpec(arch="llama", quant="Q4_1", layers=2), str(smollm2_gguf_path))
    ck = load_checkpoint(path)
    assert len(ck.int4) == 2 * 7
    # Without the fused native decoder, which takes these decodes where it attaches (and then no 4-bit copy
    # is kept, test_native_decoder.py).
    dense = build_model(ck, torch.bfloat16, torch.device("cpu"), 512, int4_decode=False, native_decoder=False)
    packed = build_model(ck, torch.bfloat16, torch.device("cpu"), 512, int4_decode=True, native_decoder=False)
    assert sum(m.packed is not None for m in packed.modules() if hasattr(m, "packed")) == 2 * 4
    outs = []
    for model in (dense, packed):
        runner = ModelRunner(model, ck.config, 8, 0, 16, torch.bfloat16, torch.device("cpu"))
        runner.forward([BatchItem(list(range(100, 120)), 0, [1, 2])])
        outs.append(runner.forward([BatchItem([7], 20, [1, 2])]))  # one row: the packed path
    a, b = outs
    assert float((a - b).abs().max() / a.abs().max()) < 0.05
