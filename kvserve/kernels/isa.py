"""The CPU instruction-set level this process runs at: the CPU's own, or a lower one chosen with
KVSERVE_CPU_ISA so that one machine can run what another kind of machine runs.

The machines this project meets are of three kinds: AMX (Intel, with AVX-512 bf16), AVX-512 with
bf16 and no AMX (AMD Zen 4), and AVX2 only (no native bf16). The level decides, in one place:
- the flags the native kernels are compiled with (`compile_flags`), so an AVX2 build also runs on
  an AVX-512 or AMX machine and exercises the AVX2 code;
- whether the CPU has bfloat16 arithmetic (`native_bf16`), one of the reasons bfloat16 is the default
  dtype (models/backend.resolve_dtype, in the engine's hardware plan);
- the ceilings of torch's own CPU dispatch (ATen's `ATEN_CPU_CAPABILITY`, oneDNN's
  `ONEDNN_MAX_CPU_ISA`, MKL's `MKL_ENABLE_INSTRUCTIONS` for float32 GEMMs), which are read once when
  torch first dispatches: `apply_to_torch` sets them and must run before torch is imported
  (kvserve/__init__.py calls it); `torch_env` gives them to other processes (a benchmarked peer).

No torch import here: the package's import runs this first.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ENV = "KVSERVE_CPU_ISA"
TORCH_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # what torch_env sets


@dataclass(frozen=True)
class IsaLevel:
    name: str
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must have to run this level
    march: tuple[str, ...]  # g++ flags that select the level's instructions
    aten: str | None  # ATEN_CPU_CAPABILITY ceiling (None: torch's own choice)
    onednn: str | None  # ONEDNN_MAX_CPU_ISA ceiling
    mkl: str | None  # MKL_ENABLE_INSTRUCTIONS ceiling (float32 matmul goes to MKL; it obeys on Intel CPUs only)
    bf16: bool | None  # native bf16 arithmetic (None: as the CPU says)


# Lowest first. "native" is whatever the CPU has (AMX where present).
LEVELS = {
    "avx2": IsaLevel("avx2", frozenset({"avx2", "fma", "f16c", "bmi2"}), ("-march=x86-64-v3", "-mtune=native"),
                     "avx2", "AVX2", "AVX2", False),
    "avx512": IsaLevel("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
                       ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"),
                       "avx512", "AVX512_CORE_BF16", "AVX512_E3", True),
    "native": IsaLevel("native", frozenset(), ("-march=native",), None, None, None, None),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def requested() -> str:
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(LEVELS)}")
    return value


@functools.cache
def current() -> IsaLevel:
    """The level in force. A level the CPU cannot run is an error, not a silent fallback."""
    level = LEVELS[requested()]
    missing = level.needs - cpu_flags()
    if missing:
        raise RuntimeError(f"{ENV}={level.name} needs CPU flags this CPU lacks: {', '.join(sorted(missing))}")
    return level


def native_bf16() -> bool:
    """bf16 arithmetic in hardware at the level in force (AVX-512 bf16 or AMX)."""
    level = current()
    if level.bf16 is not None:
        return level.bf16
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def compile_flags() -> list[str]:
    return list(current().march)


def lower_levels() -> list[str]:
    """The levels below the CPU's own that this CPU can run and that differ from it: what `make test`
    runs the kernel and engine tests under, so an AMX machine sees what AVX-512 and AVX2 machines do."""
    flags = cpu_flags()
    native = "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512" if LEVELS["avx512"].needs <= flags else "avx2"
    order = ["avx2", "avx512", "amx"]
    return [name for name in order[:order.index(native)] if LEVELS[name].needs <= flags]


def torch_env() -> dict[str, str]:
    """The environment that caps torch's CPU dispatch (ATen, oneDNN, MKL) at the level in force; empty at
    the CPU's own level."""
    level = current()
    if level.aten is None:
        return {}
    return {name: value for name, value in zip(TORCH_VARS, (level.aten, level.onednn, level.mkl)) if value}


def apply_to_torch() -> None:
    """Cap torch's CPU dispatch at the level in force (only before torch is imported: it reads these once).
    An explicit setting of any of the variables wins."""
    env = torch_env()
    if not env:
        return
    if "torch" in sys.modules:
        import warnings

        warnings.warn(f"{ENV}={current().name} set after torch was imported: torch's own kernels keep the CPU's "
                      "level", stacklevel=2)
        return
    for name, value in env.items():
        os.environ.setdefault(name, value)
