"""benchmarks.load_memory's tiny mode: every case written, loaded in its own process and measured, and the page's rows
consistent (no timings asserted); the load's progress bar, which a tiny checkpoint does not show."""
from __future__ import annotations

import json
import logging

import pytest

from benchmarks import load_memory


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("loading")
    assert load_memory.main(["--tiny", "--out", str(out)]) == 0
    assert "| GGUF Q8_0, whole (kept quantized) |" in (out / "loading.md").read_text()
    return json.loads((out / "loading.json").read_text())


def test_every_case_is_measured(page):
    rows = {(r["source"], r["tp"]): r for r in page["rows"]}
    assert set(rows) == {("gguf", 1), ("gguf", 2), ("hf", 2), ("hf", 4), ("hf", 1)}  # --tiny runs the whole HF too
    assert not page["not_run"]
    for r in page["rows"]:
        assert r["kept"] > 0 and r["tensors"] == 2 + 9 * load_memory.TINY.layers + 1
        assert r["baseline"] > 0 and r["peak"] >= r["baseline"] and r["peak"] >= r["after"] >= r["trimmed"] > 0
        assert r["peak_beyond_kept"] == r["peak"] - r["baseline"] - r["kept"]
        assert r["within_target"]  # a tiny model's load holds nowhere near 1 GB more than it keeps
        assert r["file_bytes"] == page["sizes"][r["source"]] and r["disk_read"] >= 0
        assert r["pinned"] == 0  # no slice keeps its whole matrix alive (loader._own)


def test_kept_bytes_follow_the_split(page):
    rows = {(r["source"], r["tp"]): r["kept"] for r in page["rows"]}
    shape = load_memory.TINY
    whole_hf = 2 * shape.params  # every tensor kept in bf16, as stored
    assert rows["hf", 1] == whole_hf
    assert rows["hf", 4] < rows["hf", 2] < rows["hf", 1]
    # the same slices in bf16 from either file (the embedding table and LM head whole on each rank), but a GGUF's
    # norms are F32 and kept so
    norms = (2 * shape.layers + 1) * shape.hidden
    assert rows["gguf", 2] == rows["hf", 2] + 2 * norms
    # kept quantized: Q8_0's int8 values with an fp16 scale and minimum per 32, the F32 norms
    assert rows["gguf", 1] == (shape.params - norms) * (1 + 4 / 32) + 4 * norms


def test_kept_bytes_count_shared_memory_once_and_storages_apart():
    import torch

    from kvserve.models import quant

    w = torch.randn(64, 64)
    matrix = quant.quantize(w, 8)
    assert load_memory.kept_bytes({"a": w, "b": w[:32], "c": w[16:48], "m": matrix}) == w.nbytes + matrix.nbytes
    assert load_memory.kept_bytes({"rows": w[32:]}) == w.nbytes // 2  # a rank's rows...
    assert load_memory.storage_bytes({"rows": w[32:]}) == w.nbytes  # ...keeping the whole matrix alive


def test_the_progress_bar_logs_lines(caplog, monkeypatch):
    from kvserve.models import loader

    monkeypatch.setattr(loader, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="kvserve.models.loader"):
        with loader.load_progress(loader.PROGRESS_MIN_BYTES, 2, "model.gguf") as bar:
            for done in (1, 2):
                loader._advance(bar, loader.PROGRESS_MIN_BYTES // 2, done, 2)
        with loader.load_progress(loader.PROGRESS_MIN_BYTES - 1, 2, "tiny.gguf") as bar:  # too small: no bar
            loader._advance(bar, 1, 1, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("loading model.gguf:") for line in lines)
    assert "\r" not in "".join(lines) and "2/2 tensors" in lines[-1] and "100%" in lines[-1]
