"""Loading memory: the host memory a checkpoint's load holds at its peak, beside the weights it keeps (issue 54's
target: loading an 8B-shaped checkpoint peaks at no more than the kept weights + 1 GB).

  python -m benchmarks.load_memory [--cache DIR] [--whole-hf] [--tiny] [--out docs/bench]

The checkpoint is a random-weight Llama-3.1-8B shape (32 layers of 4096, MLP 14336, 32 query heads over 8 KV heads
of 128, a vocabulary of 128256, an LM head of its own), written once under --cache, tensor by tensor, in two forms:
a GGUF file of Q8_0 matrices (F32 norms, Llama 3.1's `rope_freqs`, SmolLM2's tokenizer padded to the vocabulary)
and a safetensors directory in bf16 (shards of at most 5 GB, config.json) as the hub ships it.

Each case loads in a fresh process (`load_checkpoint` as an engine or a tensor-parallel rank calls it), its file
pages dropped from the page cache first (a cold read):
- baseline: the process's RSS after the imports; the peak RSS counter (VmHWM) is reset there (/proc/self/clear_refs);
- kept: the bytes of the tensors the load returns (a quantized matrix's values, scales, minimums and super-blocks),
  then read a byte a page, so that what is mapped but not yet read counts as using the weights would make it count;
  a tensor that is a view of a larger storage (a rank's rows of a whole matrix) keeps all of it alive: the page
  names any such case;
- read from disk: /proc/self/io's read_bytes over the load (a rank reads only its rows of a matrix split by rows);
- peak beyond kept: VmHWM - baseline - kept, against the target of 1 GB; a sampler records the most anonymous and
  file-backed (mapped file pages) memory seen, which says where a peak came from;
- after: the RSS once the load returned, and once glibc handed its freed pages back (loader.return_freed_memory,
  which an engine calls once the model is built).

The safetensors directory whole (16 GB kept in bf16) only with --whole-hf: with the load's overhead it is close to
a 24 GiB machine's memory. --tiny runs every case on a tiny model of the same layout in a temporary directory, in
seconds (tests/unit/test_load_memory_bench.py).

Writes loading.json and loading.md (a BENCHMARKS.md page) under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import shapes

TARGET_BYTES = 10**9  # the "+ 1 GB"
SHARD_BYTES = 5 * 10**9  # the hub's Llama 3.1 8B: shards of about 5 GB
GB = 1e9


@dataclass(frozen=True)
class Shape(shapes.Shape):
    """A model's shape (benchmarks/shapes.py) as a checkpoint of its own: its context and safetensors shards."""

    context: int = 131072
    shard_bytes: int = SHARD_BYTES

    @property
    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


LLAMA_8B = Shape("llama-3.1-8b", "Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, vocab=128256, context=131072)
# The same layout, tiny: the whole pipeline in seconds (SmolLM2's tokenizer sets the smallest vocabulary).
TINY = Shape("tiny-llama", "a tiny Llama", 64, 128, 2, 4, 2, 16, vocab=49152, context=2048, shard_bytes=4 << 20)
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _log(msg: str) -> None:
    print(f"[load_memory] {msg}", file=sys.stderr, flush=True)


# ---- the checkpoints ------------------------------------------------------------------------------------------------

def _matrices(s: Shape) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, GGUF name, [rows, cols] or [n]) of every tensor, in the order the files hold them."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("model.embed_tokens.weight", "token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        out += [(p + "self_attn.q_proj.weight", g + "attn_q.weight", (q, s.hidden)),
                (p + "self_attn.k_proj.weight", g + "attn_k.weight", (kv, s.hidden)),
                (p + "self_attn.v_proj.weight", g + "attn_v.weight", (kv, s.hidden)),
                (p + "self_attn.o_proj.weight", g + "attn_output.weight", (s.hidden, q)),
                (p + "mlp.gate_proj.weight", g + "ffn_gate.weight", (s.intermediate, s.hidden)),
                (p + "mlp.up_proj.weight", g + "ffn_up.weight", (s.intermediate, s.hidden)),
                (p + "mlp.down_proj.weight", g + "ffn_down.weight", (s.hidden, s.intermediate)),
                (p + "input_layernorm.weight", g + "attn_norm.weight", (s.hidden,)),
                (p + "post_attention_layernorm.weight", g + "ffn_norm.weight", (s.hidden,))]
    return out + [("model.norm.weight", "output_norm.weight", (s.hidden,)),
                  ("lm_head.weight", "output.weight", (s.vocab, s.hidden))]


def _row_chunks(rows: int, cols: int, elements: int = 1 << 26):
    step = max(1, elements // cols)
    for r in range(0, rows, step):
        yield min(step, rows - r)


def _disk_check(directory: Path, need: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < need + (2 << 30):
        raise SystemExit(f"{directory}: {free / GB:.1f} GB free, writing the checkpoint needs {need / GB:.1f} GB")


def _drop_dirty(f) -> None:
    """Write the file's pages out and drop them from the page cache: writing 16 GB does not evict everything else."""
    f.flush()
    os.fsync(f.fileno())
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def write_gguf(path: Path, s: Shape, seed: int = 0) -> Path:
    """The shape as a Q8_0 GGUF, written tensor by tensor (gguf-py's tensor-info API: only one tensor in memory):
    random int8 values under one fp16 scale per block, F32 norms near 1."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from kvserve.models.catalog import resolve_model
    from tests.gguf_factory import _copy_tokenizer_fields, write_shape
    from tests.hf_factory import _llama3_rope_factors

    block, type_size = gguf.GGML_QUANT_SIZES[T.Q8_0]
    _disk_check(path.parent, s.params * type_size // block)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    vocab = _copy_tokenizer_fields(writer, resolve_model("smollm2-135m")[1], s.vocab)
    assert vocab == s.vocab, (vocab, s.vocab)
    write_shape(writer, s.model, s.layers, s.context, s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim,
                1e-5, vocab)
    writer.add_rope_freq_base(ROPE["rope_theta"])
    writer.add_rope_dimension_count(s.head_dim)
    factors = _llama3_rope_factors(ROPE, s.head_dim)
    writer.add_tensor_info("rope_freqs.weight", factors.shape, np.float32, factors.nbytes)
    tensors = _matrices(s)
    for _, name, dims in tensors:
        if len(dims) == 2:
            byte_shape = (dims[0], dims[1] // block * type_size)
            writer.add_tensor_info(name, byte_shape, np.uint8, byte_shape[0] * byte_shape[1], raw_dtype=T.Q8_0)
        else:
            writer.add_tensor_info(name, dims, np.float32, 4 * dims[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_tensor_data(factors)
    for _, name, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data((1.0 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32))
            continue
        rows, cols = dims
        blocks = cols // block
        scale = np.frombuffer(np.float16(2.5 / math.sqrt(cols) / 127).tobytes(), np.uint8)
        data = np.empty((rows, blocks, type_size), np.uint8)
        r = 0
        for n in _row_chunks(rows, cols):
            data[r:r + n, :, :2] = scale
            data[r:r + n, :, 2:] = rng.integers(-127, 128, (n, blocks, block), dtype=np.int8).view(np.uint8)
            r += n
        writer.write_tensor_data(data.reshape(rows, blocks * type_size))
        del data
    writer.close()
    with open(tmp, "rb+") as f:
        _drop_dirty(f)
    os.replace(tmp, path)
    return path


def hf_config(s: Shape) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab,
            "max_position_embeddings": s.context, "rms_norm_eps": 1e-5, "rope_theta": ROPE["rope_theta"],
            "rope_scaling": {k: v for k, v in ROPE.items() if k != "rope_theta"}, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}


def write_hf_dir(path: Path, s: Shape, seed: int = 0) -> Path:
    """The shape as a safetensors directory in bf16: shards of at most `s.shard_bytes` in the hub's names
    (model-0000k-of-0000n.safetensors, model.safetensors.index.json), each tensor drawn and written in row chunks."""
    import torch

    tensors = [(name, dims) for name, _, dims in _matrices(s)]
    _disk_check(path.parent, 2 * s.params)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > s.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dims in shard:
            nbytes = 2 * math.prod(dims)
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(tmp / file, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for name, dims in shard:
                if len(dims) == 1:
                    w = 1.0 + 0.1 * torch.randn(dims[0], generator=gen)
                    f.write(w.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
                    continue
                rows, cols = dims
                for n in _row_chunks(rows, cols):
                    w = torch.randn(n, cols, generator=gen).mul_(1 / math.sqrt(cols)).to(torch.bfloat16)
                    w.view(torch.int16).numpy().tofile(f)
            _drop_dirty(f)
        total += offset
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(s), indent=2))
    os.replace(tmp, path)
    return path


def checkpoints(s: Shape, cache: Path) -> dict[str, Path]:
    """The shape's GGUF file and safetensors directory under `cache`, written if missing."""
    cache.mkdir(parents=True, exist_ok=True)
    gguf_path, hf_path = cache / f"{s.name}.Q8_0.gguf", cache / f"{s.name}-bf16"
    for path, write in ((gguf_path, write_gguf), (hf_path, write_hf_dir)):
        if not path.exists():
            t0 = time.time()
            _log(f"writing {path}")
            write(path, s)
            _log(f"wrote {path} ({_size(path) / GB:.2f} GB) in {time.time() - t0:.0f} s")
    return {"gguf": gguf_path, "hf": hf_path}


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))


# ---- one load, measured in a process of its own ---------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    label: str
    source: str  # "gguf" | "hf"
    weights: str  # load_checkpoint's setting
    tp: int = 1
    rank: int = 0


CASES = (Case("GGUF Q8_0, whole (kept quantized)", "gguf", "auto"),
         Case("GGUF Q8_0, rank 1 of TP=2 (bf16 slices)", "gguf", "bf16", 2, 1),
         Case("safetensors bf16, rank 1 of TP=2", "hf", "auto", 2, 1),
         Case("safetensors bf16, rank 1 of TP=4", "hf", "auto", 4, 1))
WHOLE_HF = Case("safetensors bf16, whole", "hf", "auto")


def _status() -> dict[str, int]:
    """/proc/self/status's memory lines, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def _parts(tensors: dict) -> list:
    """Every torch tensor a checkpoint's tensors are made of (a quantized matrix's values, scales, minimums and
    super-blocks)."""
    from kvserve.models.quant import QuantizedMatrix

    out = []
    for t in tensors.values():
        out += [p for p in (t.values, t.scales, t.minimums, t.supers) if p is not None] \
            if isinstance(t, QuantizedMatrix) else [t]
    return out


def _disk_reads() -> int:
    """The bytes this process has had read from the storage layer (/proc/self/io: read() calls and mapped pages
    faulted in alike; 0 where the kernel does not say)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
    except (OSError, StopIteration):
        return 0


def kept_bytes(tensors: dict) -> int:
    """The bytes of a checkpoint's tensors (contiguous ones), memory that two of them share counted once."""
    total, end = 0, 0
    for start, stop in sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in _parts(tensors)):
        total += max(0, stop - max(start, end))
        end = max(end, stop)
    return total


def storage_bytes(tensors: dict) -> int:
    """The bytes of the storages the tensors keep alive, each once: more than kept_bytes where a tensor is a view of
    a larger one (a rank's rows of a whole matrix)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in _parts(tensors)}.values())


def touch(tensors: dict) -> None:
    """Read a byte of every page the tensors hold, so that memory mapped but not yet read is resident as using the
    weights would make it."""
    import torch

    for p in _parts(tensors):
        if p.numel() and p.is_contiguous():
            p.reshape(-1).view(torch.uint8)[::4096].sum()


def measure(spec: dict) -> dict:
    """One load (spec: path, weights, tp, rank) in this process: its RSS figures, in bytes, and seconds."""
    import gc
    import logging
    import threading

    import gguf.quants  # noqa: F401 - what the load imports lazily, in the baseline
    import safetensors.torch  # noqa: F401
    import torch
    import tqdm  # noqa: F401

    from kvserve.models.loader import load_checkpoint, return_freed_memory
    from kvserve.models.parallel import TensorParallel

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[load_memory] %(message)s")
    for f in _files(Path(spec["path"])):  # a cold read: the file's pages out of the page cache
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    gc.collect()
    return_freed_memory()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    except OSError:
        pass
    baseline = _status()
    peaks = {"RssAnon": baseline["RssAnon"], "RssFile": baseline["RssFile"]}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            now = _status()
            for key in peaks:
                peaks[key] = max(peaks[key], now[key])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    shard = TensorParallel(spec["tp"], spec["rank"]) if spec["tp"] > 1 else None
    reads = _disk_reads()
    t0 = time.perf_counter()
    checkpoint = load_checkpoint(spec["path"], spec["weights"], torch.bfloat16, shard=shard)
    wall = time.perf_counter() - t0
    reads = _disk_reads() - reads
    t0 = time.perf_counter()
    touch(checkpoint.tensors)
    touch_s = time.perf_counter() - t0
    done.set()
    sampler.join()
    after = _status()
    return_freed_memory()
    trimmed = _status()
    return {"baseline": baseline["VmRSS"], "peak": after["VmHWM"], "after": after["VmRSS"],
            "trimmed": trimmed["VmRSS"], "kept": kept_bytes(checkpoint.tensors),
            "storage": storage_bytes(checkpoint.tensors), "tensors": len(checkpoint.tensors),
            "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"], "baseline_anon": baseline["RssAnon"],
            "baseline_file": baseline["RssFile"], "wall_s": wall, "touch_s": touch_s,
            "disk_read": reads}


def run_case(case: Case, path: Path) -> dict:
    """The case measured in a fresh process (its peak is the load's own), with the figures the page shows."""
    spec = {"path": str(path), "weights": case.weights, "tp": case.tp, "rank": case.rank}
    _log(f"{case.label}: {path}")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--measure", json.dumps(spec)],
                          stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode:
        raise RuntimeError(f"{case.label}: the measuring process exited with {proc.returncode}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    read = _size(path)
    row = {**asdict(case), **m, "file_bytes": read, "pinned": m["storage"] - m["kept"],
           "peak_beyond_kept": m["peak"] - m["baseline"] - m["kept"],
           "after_beyond_kept": m["after"] - m["baseline"] - m["kept"],
           "trimmed_beyond_kept": m["trimmed"] - m["baseline"] - m["kept"],
           "rate": m["disk_read"] / m["wall_s"] if m["wall_s"] else None}
    row["within_target"] = row["peak_beyond_kept"] <= TARGET_BYTES
    _log(f"{case.label}: kept {m['kept'] / GB:.2f} GB, peak beyond kept {row['peak_beyond_kept'] / GB:.2f} GB, "
         f"{m['wall_s']:.1f} s")
    return row


# ---- the page -------------------------------------------------------------------------------------------------------

def render(result: dict) -> str:
    from benchmarks.pages import table

    m, s = result["machine"], result["shape"]
    lines = ["# Loading: host memory during a checkpoint's load", "",
             "The most resident memory (RSS) a load holds beside the weights it keeps, for each way an engine or a "
             "tensor-parallel rank loads a checkpoint (`models/loader.load_checkpoint`): tensor by tensor, each "
             "converted (and cut to the rank's slice) as it is read. The target (issue 54): the peak at most the kept "
             "weights + 1 GB.", "",
             f"Machine: {m.get('cpu_model', '?')} ({m.get('nproc', '?')} CPUs, {m.get('mem_gib', '?')} GiB); "
             f"`{result['command']}`; {result['when']}.", "",
             f"Checkpoint: random weights in {s['model']}'s shape ({s['params'] / 1e9:.2f} B parameters: "
             f"{s['layers']} layers of {s['hidden']}, MLP {s['intermediate']}, {s['heads']} heads over "
             f"{s['kv_heads']} KV heads, vocabulary {s['vocab']}, its own LM head), as a Q8_0 GGUF file "
             f"({result['sizes']['gguf'] / GB:.2f} GB) and a bf16 safetensors directory "
             f"({result['sizes']['hf'] / GB:.2f} GB). Each case in a fresh process, its files dropped from the page "
             "cache first (a cold read); GB are 10^9 bytes.", ""]
    rows = []
    for r in result["rows"]:
        anon, file = (r["peak_anon"] - r["baseline_anon"]) / GB, (r["peak_file"] - r["baseline_file"]) / GB
        rows.append([r["label"], f"{r['disk_read'] / GB:.2f}", f"{r['kept'] / GB:.2f}",
                     f"{r['peak_beyond_kept'] / GB:.2f}", "yes" if r["within_target"] else "**no**",
                     f"{anon:.2f} / {file:.2f}",
                     f"{r['after_beyond_kept'] / GB:.2f} / {r['trimmed_beyond_kept'] / GB:.2f}",
                     f"{r['wall_s']:.1f}", f"{r['rate'] / GB:.2f}" if r["rate"] else "-"])
    lines.append(table(["case", "read from disk, GB", "kept, GB", "peak beyond kept, GB", "within kept + 1 GB",
                        "most anonymous / file pages seen, GB", "after the load beyond kept, GB (trimmed)",
                        "load, s", "read, GB/s"], rows))
    pinned = [r["label"] for r in result["rows"] if r["pinned"]]
    lines += ["", "Peak beyond kept: VmHWM - the RSS after the imports (the counter reset there) - the kept tensors' "
                  "bytes, over the load and a read of a byte of each kept page. Read from disk: the process's "
                  "`read_bytes` (/proc/self/io) over the load: a rank reads its rows only where its part is a run "
                  "of whole rows. Anonymous / file pages: the most of each a 20 ms sampler saw above the baseline "
                  "(file pages: the GGUF's mapped pages, dropped as each tensor is converted). After: the RSS once "
                  "the load returned, and once glibc gave its freed pages back (`loader.return_freed_memory`, which "
                  "the engine calls once the model is built). Load times: one cold read each, on a disk and CPUs "
                  "other work may share, so indicative only; the memory figures do not depend on them. "
                  + (f"Kept tensors that are views keeping a larger storage alive: {', '.join(pinned)}."
                     if pinned else "No kept tensor is a view keeping a larger storage alive.")]
    if result.get("not_run"):
        lines += ["", "Not run: " + "; ".join(result["not_run"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "kvserve-bench" / "load"),
                    help="where the 8B-shaped checkpoints are written once (8.5 GB GGUF + 16 GB safetensors)")
    ap.add_argument("--whole-hf", action="store_true",
                    help="also load the safetensors directory whole (16 GB kept: tight on a 24 GiB machine)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same layout in a temporary directory")
    ap.add_argument("--out", default="docs/bench", help="directory for loading.json and loading.md")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one load in this process, JSON on stdout
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(json.loads(a.measure))))
        return 0
    from benchmarks.pages import stamp, write_page

    shape = TINY if a.tiny else LLAMA_8B
    result = {**stamp("benchmarks.load_memory", argv), "shape": {**asdict(shape), "params": shape.params},
              "target_bytes": TARGET_BYTES, "not_run": []}
    with tempfile.TemporaryDirectory(prefix="kvserve-load-") as scratch:
        paths = checkpoints(shape, Path(scratch) if a.tiny else Path(a.cache).expanduser())
        result["sizes"] = {k: _size(p) for k, p in paths.items()}
        cases = CASES + ((WHOLE_HF,) if a.whole_hf or a.tiny else ())
        if not (a.whole_hf or a.tiny):
            result["not_run"].append(f"{WHOLE_HF.label} (--whole-hf)")
        result["rows"] = [run_case(c, paths[c.source]) for c in cases]
    write_page(a.out, "loading", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
