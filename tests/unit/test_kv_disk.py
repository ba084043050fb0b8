"""The disk tier of the KV cache (engine/kv/disk.py): pages survive a restart, stay in their namespace, and
bad data on disk (flipped bytes, truncation, deletion, a kill mid-write) is a miss, never wrong bytes."""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.engine.kv.disk import HEADER_BYTES, DiskKVStore, kv_namespace

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096
FILE = HEADER_BYTES + PAGE
NS = kv_namespace("model-sha", "bfloat16", 16, "groups=1")


def key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def page(k: bytes, size: int = PAGE) -> bytes:
    """The one payload ever stored under `k`, so a read can be checked exactly."""
    return (k * (size // len(k) + 1))[:size]


def files(store: DiskKVStore) -> list[Path]:
    return sorted(p for p in store.root.rglob("*") if p.is_file())


def path_of(store: DiskKVStore, k: bytes) -> Path:
    return store.root / k.hex()[:2] / k.hex()


@pytest.fixture
def store(tmp_path):
    s = DiskKVStore(tmp_path, NS, PAGE, byte_budget=100 * FILE)
    yield s
    s.close()


def test_round_trip_through_the_writer(store):
    assert store.load_seconds([key(1)] * 10) is None  # no read measured yet: admission counts a recompute
    assert store.put(key(1), page(key(1)))
    assert store.put(key(2), bytearray(page(key(2))))
    assert store.put(key(3), memoryview(page(key(3))))
    assert store.flush(5)
    assert [store.get(key(i)) for i in (1, 2, 3, 4)] == [page(key(1)), page(key(2)), page(key(3)), None]
    assert store.contains(key(1)) and not store.contains(key(4))
    s = store.stats()
    assert (s.entries, s.bytes, s.writes, s.hits, s.misses, s.corrupt) == (3, 3 * FILE, 3, 3, 1, 0)
    assert s.bytes_written == 3 * FILE and s.bytes_read == 3 * FILE
    assert path_of(store, key(1)).stat().st_size == FILE
    one = store.load_seconds([key(1)])
    assert one > 0 and store.load_seconds([key(1)] * 10) == pytest.approx(10 * one)
    assert (store.level(key(1)), store.level(key(4))) == ("disk", None)


def test_a_stored_or_pending_key_is_not_rewritten(store):
    assert store.write_now(key(1), page(key(1)))
    assert store.put(key(1), page(key(1)))
    assert store.write_now(key(1), page(key(1)))
    store.flush(5)
    assert store.stats().writes == 1


def test_payload_of_the_wrong_length_is_dropped(store):
    assert not store.put(key(1), b"short")
    assert not store.write_now(key(2), b"x" * (PAGE + 1))
    store.flush(5)
    assert store.stats().dropped_writes == 2 and store.stats().entries == 0


def test_bad_arguments_raise(tmp_path, store):
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, NS, 0, FILE)
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, NS, PAGE, FILE - 1)
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, NS, PAGE, FILE, max_pending=0)
    with pytest.raises(ValueError):
        store.get(b"too short")


def test_restart_finds_pages_and_another_namespace_does_not(tmp_path):
    with DiskKVStore(tmp_path, NS, PAGE, 100 * FILE) as first:
        for i in range(5):
            first.put(key(i), page(key(i)))
    with DiskKVStore(tmp_path, NS, PAGE, 100 * FILE) as again:
        assert again.stats().entries == 5
        assert [again.get(key(i)) for i in range(5)] == [page(key(i)) for i in range(5)]
    other_dtype = kv_namespace("model-sha", "float16", 16, "groups=1")
    with DiskKVStore(tmp_path, other_dtype, PAGE, 100 * FILE) as other:
        assert other.stats().entries == 0 and other.get(key(0)) is None
        assert other.root != again.root
    assert again.root.name == hashlib.sha256(NS.encode()).hexdigest()[:16]


def test_a_page_moved_into_another_namespace_is_refused(tmp_path):
    """Same directory name by accident (or a copied file): the header's namespace digest still refuses it."""
    with DiskKVStore(tmp_path / "a", NS, PAGE, 100 * FILE) as a:
        a.write_now(key(1), page(key(1)))
    other = kv_namespace("other-model", "bfloat16", 16, "groups=1")
    with DiskKVStore(tmp_path / "b", other, PAGE, 100 * FILE) as b:
        dest = path_of(b, key(1))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path_of(a, key(1)), dest)
    with DiskKVStore(tmp_path / "b", other, PAGE, 100 * FILE) as b:
        assert b.contains(key(1)) and b.get(key(1)) is None
        assert b.stats().corrupt == 1 and not dest.exists()


@pytest.mark.parametrize("offset", [0, 12, HEADER_BYTES - 1, HEADER_BYTES, FILE - 1],
                         ids=["magic", "namespace", "crc", "payload-first", "payload-last"])
def test_one_flipped_byte_is_a_corrupt_miss_and_the_file_goes(store, offset):
    store.write_now(key(1), page(key(1)))
    path = path_of(store, key(1))
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.get(key(1)) is None
    assert not path.exists() and not store.contains(key(1))
    s = store.stats()
    assert (s.misses, s.corrupt, s.entries) == (1, 1, 0)


@pytest.mark.parametrize("size", [0, HEADER_BYTES - 1, HEADER_BYTES, FILE - 1])
def test_a_truncated_file_is_a_miss(store, size):
    store.write_now(key(1), page(key(1)))
    os.truncate(path_of(store, key(1)), size)
    assert store.get(key(1)) is None and store.stats().corrupt == 1
    assert not path_of(store, key(1)).exists()


def test_a_file_with_bytes_appended_is_a_miss(store):
    store.write_now(key(1), page(key(1)))
    with open(path_of(store, key(1)), "ab") as f:
        f.write(b"\0")
    assert store.get(key(1)) is None and store.stats().corrupt == 1


def test_a_page_copied_under_another_key_is_a_miss(store):
    store.write_now(key(1), page(key(1)))
    store.write_now(key(2), page(key(2)))
    shutil.copy(path_of(store, key(1)), path_of(store, key(2)))
    assert store.get(key(2)) is None and store.get(key(1)) == page(key(1))


def test_a_deleted_file_is_a_plain_miss(store):
    store.write_now(key(1), page(key(1)))
    path_of(store, key(1)).unlink()
    assert store.get(key(1)) is None
    s = store.stats()
    assert (s.misses, s.corrupt, s.io_errors, s.entries) == (1, 0, 0, 0)
    shutil.rmtree(store.root)  # the whole directory, even: a write makes it again
    assert store.write_now(key(2), page(key(2))) and store.get(key(2)) == page(key(2))


def test_open_removes_temp_files_and_wrong_sizes_and_keeps_foreign_files(tmp_path):
    with DiskKVStore(tmp_path, NS, PAGE, 100 * FILE) as s:
        s.write_now(key(1), page(key(1)))
        s.write_now(key(2), page(key(2)))
        sub = path_of(s, key(1)).parent
        tmp = sub / f"{key(3).hex()}.123.0.tmp"
        tmp.write_bytes(b"half a page")
        os.truncate(path_of(s, key(2)), 100)
        foreign = s.root / "README"
        foreign.write_text("operator notes")
    with DiskKVStore(tmp_path, NS, PAGE, 100 * FILE) as s:
        assert not tmp.exists() and not path_of(s, key(2)).exists() and foreign.exists()
        assert s.stats().entries == 1 and s.get(key(1)) == page(key(1))


def test_budget_evicts_least_recently_used_and_a_get_makes_recent(tmp_path):
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=3 * FILE + FILE // 2) as s:
        for i in range(3):
            s.write_now(key(i), page(key(i)))
        assert s.get(key(0)) == page(key(0))  # 1 is now the oldest
        s.write_now(key(3), page(key(3)))
        assert [s.contains(key(i)) for i in range(4)] == [True, False, True, True]
        assert not path_of(s, key(1)).exists()
        st = s.stats()
        assert (st.entries, st.evictions) == (3, 1) and st.bytes <= s.byte_budget
        assert len(files(s)) == 3


def test_restart_keeps_recency_by_mtime_and_a_smaller_budget_evicts_the_oldest(tmp_path):
    with DiskKVStore(tmp_path, NS, PAGE, 10 * FILE) as s:
        for i in range(4):
            s.write_now(key(i), page(key(i)))
        now = time.time()
        for age, i in enumerate([2, 0, 3, 1]):  # key 2 newest ... key 1 oldest
            os.utime(path_of(s, key(i)), (now - 100 * age, now - 100 * age))
    with DiskKVStore(tmp_path, NS, PAGE, 2 * FILE) as s:
        assert [s.contains(key(i)) for i in range(4)] == [True, False, True, False]
        assert s.stats().evictions == 2 and len(files(s)) == 2


def test_a_hit_touches_the_file(store):
    store.write_now(key(1), page(key(1)))
    path = path_of(store, key(1))
    os.utime(path, (1_000_000, 1_000_000))
    store.get(key(1))
    assert path.stat().st_mtime > 1_000_000


def test_put_with_a_full_queue_drops_and_never_waits(tmp_path):
    s = DiskKVStore(tmp_path, NS, PAGE, 100 * FILE, max_pending=2)
    release, started = threading.Event(), threading.Event()
    real = s.write_now

    def slow_disk(k, payload):
        started.set()
        release.wait(10)
        return real(k, payload)

    s.write_now = slow_disk  # the writer thread calls through the instance
    try:
        assert s.put(key(1), page(key(1)))
        assert started.wait(5)
        t0 = time.monotonic()
        assert s.put(key(2), page(key(2)))
        assert not s.put(key(3), page(key(3)))
        assert s.put(key(1), page(key(1)))  # pending already: not queued twice, not dropped
        assert time.monotonic() - t0 < 1.0
        assert not s.flush(0.05)
        assert s.stats().dropped_writes == 1
    finally:
        release.set()
    assert s.flush(5)
    assert [s.contains(key(i)) for i in (1, 2, 3)] == [True, True, False]
    assert s.stats().writes == 2
    s.close()


def test_close_finishes_queued_writes_and_refuses_new_ones(tmp_path):
    s = DiskKVStore(tmp_path, NS, PAGE, 100 * FILE)
    for i in range(10):
        s.put(key(i), page(key(i)))
    s.close()
    assert s.stats().entries == 10
    assert not s.put(key(11), page(key(11)))
    assert s.get(key(3)) == page(key(3))


def test_payload_buffer_reused_after_put_does_not_change_the_page(store):
    buf = bytearray(page(key(1)))
    store.put(key(1), buf)
    buf[:] = b"\0" * PAGE
    store.flush(5)
    assert store.get(key(1)) == page(key(1))


def test_concurrent_use_under_disk_damage_returns_exact_pages_or_none(tmp_path):
    """Readers and writers race with eviction (a small budget) and a thread that flips bytes, truncates,
    deletes and swaps files: every read is the page put under that key, or None; nothing raises."""
    s = DiskKVStore(tmp_path, NS, PAGE, byte_budget=40 * FILE, max_pending=16)
    keys = [key(i) for i in range(100)]
    stop = threading.Event()
    errors: list[BaseException] = []
    wrong: list[bytes] = []
    gets = [0, 0]

    def worker(seed: int):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                k = rng.choice(keys)
                op = rng.random()
                if op < 0.35:
                    s.put(k, page(k))
                elif op < 0.45:
                    s.write_now(k, page(k))
                else:
                    got = [s.get(k)]
                    gets[0] += 1
                    if got[0] is not None:
                        gets[1] += 1
                        if got[0] != page(k):
                            wrong.append(k)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    def vandal():
        rng = random.Random(99)
        try:
            while not stop.is_set():
                found = files(s)
                if not found:
                    time.sleep(0.001)
                    continue
                p = rng.choice(found)
                action = rng.randrange(4)
                try:
                    if action == 0:
                        with open(p, "r+b") as f:
                            size = os.fstat(f.fileno()).st_size
                            if size:
                                f.seek(rng.randrange(size))
                                b = f.read(1)
                                f.seek(-1, os.SEEK_CUR)
                                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                    elif action == 1:
                        os.truncate(p, rng.randrange(FILE))
                    elif action == 2:
                        p.unlink()
                    else:  # another page's bytes over this one's ("r+b": never a file the store does not hold,
                        # which a copy onto a path evicted since the listing would make)
                        data = rng.choice(found).read_bytes()
                        with open(p, "r+b") as f:
                            f.truncate(0)
                            f.write(data)
                except OSError:
                    pass  # the store moved it first
                time.sleep(0.002)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=vandal)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    s.flush(5)
    s.close()
    assert not errors, errors
    assert not wrong
    st = s.stats()
    assert gets[1] > 0 and st.corrupt > 0 and st.evictions > 0, (gets, st)
    assert st.entries <= 40 and len([p for p in files(s) if not p.name.endswith(".tmp")]) <= 40
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=40 * FILE) as again:
        for k in keys:
            assert again.get(k) in (None, page(k))


KILLED_WRITER = r"""
import hashlib, sys
from kvserve.engine.kv.disk import DiskKVStore
directory, ns, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = DiskKVStore(directory, ns, size, byte_budget=1 << 40)
for i in range(1_000_000):
    k = hashlib.sha256(f"block {i}".encode()).digest()
    s.write_now(k, (k * (size // 32 + 1))[:size])
    if i == 3:
        print("writing", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_only_exact_pages(tmp_path):
    size = 1 << 18  # big enough that a kill lands inside a write often
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path), NS, str(size)], cwd=ROOT,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline() == b"writing\n"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    with DiskKVStore(tmp_path, NS, size, byte_budget=1 << 40) as s:
        written = s.stats().entries
        assert written >= 4
        assert not [p for p in s.root.rglob("*.tmp")]
        for i in range(written + 50):
            got = s.get(key(i))
            assert got is None or got == page(key(i), size)
        assert s.stats().hits == written


# ---- a shutdown's save (DiskKVStore.save, KVCacheManager.save_to, LLMEngine.close) ----------------------------

def pages_of(asked: list[list[bytes]] | None = None):
    """`save`'s page source: each key's one payload; `asked` records the batches asked for."""
    def fetch(keys: list[bytes]) -> list[bytes]:
        if asked is not None:
            asked.append(list(keys))
        return [page(k) for k in keys]
    return fetch


def test_save_writes_what_the_store_lacks_most_recent_first_and_a_restart_keeps_that_order(tmp_path):
    keys = [key(i) for i in range(10)]
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=100 * FILE) as s:
        assert s.put(keys[3], page(keys[3])) and s.flush(5)
        writes = s.stats().writes
        asked: list[list[bytes]] = []
        assert s.save(keys, pages_of(asked), time.monotonic() + 30, batch=4) == 9
        assert [k for batch in asked for k in batch] == keys[:3] + keys[4:]  # in order, the held one never read
        assert s.stats().writes == writes + 9
        assert s.save(keys, pages_of(asked), time.monotonic() + 30) == 0  # all held: nothing rewritten
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=4 * FILE) as s:  # a restart with room for 4: the newest stay
        assert sorted(k for k in keys if s.contains(k)) == sorted(keys[:4])
        assert all(s.get(k) == page(k) for k in keys[:4])


def test_save_keeps_to_the_budget_and_evicts_older_pages_never_its_own(tmp_path):
    old = [key(100 + i) for i in range(3)]
    keys = [key(i) for i in range(8)]
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=5 * FILE) as s:
        for k in old + [keys[2]]:
            s.write_now(k, page(k))
        # keys[2] is the oldest page on disk but one the pool still uses: it is kept, the older pages go
        assert s.save(keys, pages_of(), time.monotonic() + 30) == 4
        assert sorted(k for k in keys + old if s.contains(k)) == sorted(keys[:5])
        assert s.stats().bytes <= 5 * FILE and len(files(s)) == 5


def test_save_stops_at_its_deadline(tmp_path, monkeypatch):
    keys = [key(i) for i in range(20)]
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=100 * FILE) as s:
        assert s.save(keys, pages_of(), time.monotonic() - 1) == 0 and not files(s)
        clock = iter(range(1000))  # each look at the clock a second later: room for the first pages only
        t0 = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: t0 + next(clock))
        written = s.save(keys, pages_of(), t0 + 6, batch=4)
        monkeypatch.undo()
        assert 0 < written < len(keys)
        assert sorted(k for k in keys if s.contains(k)) == sorted(keys[:written])  # the most recent ones


@pytest.fixture(scope="module")
def _weights():
    from tests.engine_checks import shared_weights, torch_threads

    with torch_threads(1), shared_weights():
        yield


BLOCK = 16


def tiny_engine(path, disk: Path, **kwargs):
    from tests.engine_checks import make_engine

    args = dict(dtype="float32", num_gpu_blocks_override=64, swap_space=0, block_size=BLOCK, kv_disk_dir=str(disk))
    args.update(kwargs)
    return make_engine(path, **args)


def serve(eng, prompt: list[int], max_tokens: int = 2):
    from kvserve.engine.sampling import SamplingParams
    from tests.engine_checks import serve_one

    return serve_one(eng, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def prompt_of(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(blocks * BLOCK + 1)]  # `blocks` full blocks are cacheable


@pytest.fixture(params=["llama", "gemma3"])
def tiny(request, _weights, tiny_llama_gguf, tiny_gemma_gguf):
    return tiny_llama_gguf if request.param == "llama" else tiny_gemma_gguf


def test_close_saves_the_pool_and_a_restart_hits_it_with_the_same_tokens(tiny, tmp_path):
    prompt = prompt_of(0, 6)
    eng = tiny_engine(tiny, tmp_path)
    first = serve(eng, prompt)
    assert eng.kv_disk.stats().entries == 0  # nothing was evicted: only the save writes
    started = time.monotonic()
    eng.close()
    assert time.monotonic() - started < 10
    assert eng.kv_disk.stats().entries > 0
    again = tiny_engine(tiny, tmp_path)
    out = serve(again, prompt)
    assert out.num_cached_tokens == out.num_tier_cached_tokens >= 6 * BLOCK - BLOCK  # the window's groups need less
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    writes = again.kv_disk.stats().writes
    again.close()
    assert again.kv_disk.stats().writes == writes  # every page it found there: none written again


def test_close_writes_only_what_the_disk_lacks(tiny_llama_gguf, _weights, tmp_path):
    eng = tiny_engine(tiny_llama_gguf, tmp_path, num_gpu_blocks_override=12)  # two prompts don't fit
    a, b = prompt_of(1, 8), prompt_of(2, 8)
    serve(eng, a)
    serve(eng, b)  # evicts a's blocks to the disk while it serves
    assert eng.kv_disk.flush(30)
    evicted = eng.kv_disk.stats().writes
    assert evicted > 0
    eng.close()
    stats = eng.kv_disk.stats()
    assert stats.writes == stats.entries > evicted  # the pool's pages were added, no page written twice


def test_close_saves_most_recent_first_within_the_budget(tiny_llama_gguf, _weights, tmp_path):
    from kvserve.engine.kv.disk import HEADER_BYTES as HEADER

    probe = tiny_engine(tiny_llama_gguf, tmp_path / "probe")
    page_file = HEADER + probe.runner.page_bytes
    a, b = prompt_of(3, 4), prompt_of(4, 4)
    eng = tiny_engine(tiny_llama_gguf, tmp_path, kv_disk_bytes=4 * page_file)  # room for one prompt's blocks
    serve(eng, a)
    serve(eng, b)
    eng.close()
    assert eng.kv_disk.stats().bytes <= 4 * page_file
    again = tiny_engine(tiny_llama_gguf, tmp_path)
    assert serve(again, b).num_tier_cached_tokens == 4 * BLOCK  # the most recent prompt's blocks were saved
    assert serve(again, a).num_tier_cached_tokens == 0


def test_a_tiny_flush_time_saves_less(tiny_llama_gguf, _weights, tmp_path):
    prompt = prompt_of(5, 6)
    short = tiny_engine(tiny_llama_gguf, tmp_path / "short", kv_disk_flush_seconds=1e-9)
    serve(short, prompt)
    short.close()
    assert short.kv_disk.stats().entries == 0
    full = tiny_engine(tiny_llama_gguf, tmp_path / "full")
    serve(full, prompt)
    full.close()
    assert full.kv_disk.stats().entries == 6


def test_write_through_writes_while_serving(tiny_llama_gguf, _weights, tmp_path):
    prompt = prompt_of(6, 6)
    eng = tiny_engine(tiny_llama_gguf, tmp_path, kv_disk_write_through=True, kv_disk_flush_seconds=0)
    serve(eng, prompt, max_tokens=3)  # the decode steps after the prefill copy its blocks out
    assert eng.kv_disk.flush(30)
    assert eng.kv_disk.stats().entries == 6
    eng.close()  # no save: what it has came from serving
    again = tiny_engine(tiny_llama_gguf, tmp_path)
    assert serve(again, prompt).num_tier_cached_tokens == 6 * BLOCK
    off = tiny_engine(tiny_llama_gguf, tmp_path / "off", kv_disk_flush_seconds=0)
    serve(off, prompt, max_tokens=3)
    assert off.kv_disk.flush(30) and off.kv_disk.stats().entries == 0


def test_host_level_writes_through_to_the_disk_and_lists_its_pages_newest_first(tmp_path):
    from kvserve.engine.kv.host import HostKVStore

    keys = [key(i) for i in range(4)]
    with DiskKVStore(tmp_path, NS, PAGE, byte_budget=100 * FILE) as disk:
        plain, through = HostKVStore(PAGE, 8 * PAGE, below=disk), HostKVStore(PAGE, 8 * PAGE, below=disk,
                                                                                write_through=True)
        plain.put(keys[0], page(keys[0]))
        for k in keys[1:]:
            through.put(k, page(k))
        through.get(keys[1])
        assert disk.flush(5) and sorted(k for k in keys if disk.contains(k)) == sorted(keys[1:])
        assert [k for k, _ in through.newest_pages()] == [keys[1], keys[3], keys[2]]
        assert all(p == page(k) for k, p in through.newest_pages())
