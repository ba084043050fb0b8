"""A model's LoRA adapters: the ones it knows (configured, or loaded at run time by an admin), read from their files
off the step's thread (models/lora.read_adapter) and kept resident by engine/lora.AdapterCache. A request names an
adapter; `acquire` gives the key the engine runs it under ("name@digest": the prefix cache and the device slots key
by it, so a name reloaded from other weights never meets the old one's K/V) and holds it in use until `release`."""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from kvserve.config import ConfigError, LoRAAdapterSpec, ModelConfig
from kvserve.engine.errors import LoRAAdapterError, LoRAAdaptersBusy, LoRANotFound
from kvserve.engine.lora import AdapterCache, LoRAFull

log = logging.getLogger(__name__)


def adapter_digest(path: str | Path) -> str:
    """A digest of the adapter's files (a PEFT directory's config and weights, or a GGUF file)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                 if p.name.startswith("adapter_") and p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


class Adapters:
    """The adapters of one model: names -> specs, and their resident weights by key."""

    def __init__(self, specs: tuple[LoRAAdapterSpec, ...], model_config: ModelConfig, max_rank: int,
                 max_resident: int):
        self.model_config, self.max_rank = model_config, max_rank
        self.cache: AdapterCache = AdapterCache(max_resident)
        self._specs: dict[str, LoRAAdapterSpec] = {s.name: s for s in specs}
        self._keys: dict[str, str] = {}  # name -> the key of its resident weights
        self._lock = threading.Lock()  # one read at a time: two requests for a cold adapter read it once

    def names(self) -> list[str]:
        return list(self._specs)

    def spec(self, name: str) -> LoRAAdapterSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise LoRANotFound(f"no LoRA adapter {name!r}; known: {', '.join(self._specs) or 'none'}") from None

    def load(self, spec: LoRAAdapterSpec) -> str:
        """Register the adapter and read it now (an admin's load, or a configured one at start): its key. A name
        already known must come with the same path (unload it first to change it)."""
        with self._lock:
            known = self._specs.get(spec.name)
            if known is not None and known.path != spec.path:
                raise LoRAAdapterError(f"LoRA adapter {spec.name!r} is loaded from {known.path}; unload it first")
            key = self._read(spec)
            self._specs[spec.name] = spec
            return key

    def acquire(self, name: str) -> str:
        """The key of a request's adapter, read first if it is not resident, held in use until `release`."""
        spec = self.spec(name)
        with self._lock:
            key = self._keys.get(name)
            if key is None or key not in self.cache:
                key = self._read(spec)
            self.cache.acquire(key)
            return key

    def release(self, key: str) -> None:
        self.cache.release(key)

    def get(self, key: str):
        """The resident weights under `key` (the runner copies them into a slot)."""
        return self.cache.get(key)

    def unload(self, name: str) -> None:
        """Forget the adapter (an admin's unload): requests in flight keep it until they end; new ones get 404."""
        with self._lock:
            self.spec(name)
            del self._specs[name]
            key = self._keys.pop(name, None)
            if key is not None and not self.cache.remove(key):
                log.info("LoRA adapter %s unloaded; its weights stay until its requests end", name)

    def _read(self, spec: LoRAAdapterSpec) -> str:
        from kvserve.models.lora import LoRAError, read_adapter

        path = Path(spec.path).expanduser()
        if not path.exists():
            raise LoRAAdapterError(f"LoRA adapter {spec.name!r}: {path} does not exist")
        key = f"{spec.name}@{adapter_digest(path)}"
        if key in self.cache:
            self._keys[spec.name] = key
            return key
        try:
            adapter = read_adapter(path, self.model_config, self.max_rank, name=spec.name)
        except (LoRAError, ConfigError, OSError) as e:
            raise LoRAAdapterError(f"LoRA adapter {spec.name!r}: {e}") from None
        try:
            evicted = self.cache.put(key, adapter, pinned=spec.pinned)
        except LoRAFull as e:
            raise LoRAAdaptersBusy(str(e)) from None
        for old in evicted:
            self._keys = {n: k for n, k in self._keys.items() if k != old}
        self._keys[spec.name] = key
        log.info("LoRA adapter %s read from %s (rank %d, %.1f MB)%s", spec.name, path, adapter.rank,
                 adapter.nbytes / 1e6, f"; unloaded {', '.join(evicted)}" if evicted else "")
        return key
