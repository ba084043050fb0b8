"""Machine ceilings with torch: peak bf16 / fp32 matmul FLOP/s on large square matrices, copy bandwidth.

  python -m benchmarks.ceilings [--quick] [--threads N] [--json OUT]

Each figure is the best of several timed repetitions (the machine is shared; the best one is the
closest to what the hardware can do); the median is kept too. Matmul: 2*n^3 FLOP per (n x n) @ (n x n).
Copy: a tensor of `copy_mib` MiB copied into another, counting bytes read + written (2 x size) per copy.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time


def _times(fn, reps: int) -> tuple[float, float]:
    """(best, median) seconds of `reps` timed calls after one warm-up call."""
    import statistics

    fn()  # warm up (allocations, oneDNN primitive creation)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def measure(quick: bool = False, threads: int | None = None) -> dict:
    from kvserve.kernels import isa

    isa.apply_to_torch()  # the ceilings of the level in force (KVSERVE_CPU_ISA), as the engine's torch sees it
    import torch

    if threads:
        torch.set_num_threads(threads)
    n = 1024 if quick else 4096
    reps = 2 if quick else 5
    out = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "matmul_n": n, "quick": quick}
    with torch.inference_mode():
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            # Without bf16 arithmetic torch's bf16 matmul runs near 2 GFLOP/s: a quarter of the size
            # (1/64 of the work) measures the same rate in seconds instead of minutes.
            size = n // 4 if name == "bf16" and not isa.native_bf16() else n
            out[f"matmul_{name}_n"] = size
            a = torch.randn(size, size).to(dtype)
            b = torch.randn(size, size).to(dtype)
            c = torch.empty(size, size, dtype=dtype)
            t, med = _times(functools.partial(torch.mm, a, b, out=c), reps)
            out[f"matmul_{name}_flops"] = 2.0 * size ** 3 / t
            out[f"matmul_{name}_flops_median"] = 2.0 * size ** 3 / med
            del a, b, c
        mib = 64 if quick else 512
        src = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        t, med = _times(lambda: dst.copy_(src), reps)
        out["copy_mib"] = mib
        out["copy_bytes_per_s"] = 2.0 * src.numel() * 4 / t
        out["copy_bytes_per_s_median"] = 2.0 * src.numel() * 4 / med
    return out


def machine_info() -> dict:
    info = {"python": platform.python_version(), "nproc": os.cpu_count(), "platform": platform.platform()}
    try:
        cpuinfo = open("/proc/cpuinfo").read()
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                      if line.startswith("model name")), "?")
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                      if line.startswith("flags")), [])
        info.update(cpu_model=model, avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                    amx=any(f.startswith("amx") for f in flags), avx2="avx2" in flags)
    except OSError:
        pass
    from kvserve.kernels import isa

    info["isa_level"] = isa.current().name  # "native", or the lower level KVSERVE_CPU_ISA holds this process to
    try:
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError):
        pass
    try:
        info["loadavg"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a ceiling)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    res = {"machine": machine_info(), **measure(a.quick, a.threads)}
    text = json.dumps(res, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(f"bf16 matmul {res['matmul_bf16_flops'] / 1e9:.1f} GFLOP/s, fp32 matmul "
          f"{res['matmul_fp32_flops'] / 1e9:.1f} GFLOP/s, copy {res['copy_bytes_per_s'] / 1e9:.1f} GB/s "
          f"(threads {res['torch_threads']}, n={res['matmul_n']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
