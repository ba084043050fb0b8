"""Reading GGUF files: metadata and a tensor index with zero-copy views of the tensor data.

`gguf.GGUFReader` builds a numpy view per string (slow: seconds for Gemma's 262k-token vocabulary); this
walks the header once with `struct` (a small fraction of that) and maps the file, so loading pays only
for dequantizing.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, without touching tensor data.

    `gguf.GGUFReader` builds a numpy view per string (slow: seconds for Gemma's 262k-token vocabulary); this
    walks the header once with `struct` (a small fraction of that). Strings are `str`, string arrays
    `list[str]`, numeric arrays numpy arrays, scalars Python numbers.
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse_gguf_kv(mm, str(path))[0]
    finally:
        mm.close()


def _parse_gguf_kv(buf: mmap.mmap, name: str) -> tuple[dict[str, Any], int, str]:
    """-> (metadata, offset just past the key/value section, endianness)."""
    if buf[:4] != b"GGUF":
        raise ValueError(f"{name} is not a GGUF file (bad magic)")
    endian = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # a big-endian file reads as a huge little-endian version
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version < 2:
        raise ValueError(f"{name}: GGUF v{version} is not supported (v2 and v3 are)")
    _tensor_count, kv_count = struct.unpack_from(endian + "QQ", buf, 8)
    u64 = struct.Struct(endian + "Q").unpack_from
    u32 = struct.Struct(endian + "I").unpack_from
    pos = 24

    def read_str(pos: int) -> tuple[str, int]:
        (n,) = u64(buf, pos)
        pos += 8
        return buf[pos : pos + n].decode("utf-8", "replace"), pos + n

    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = read_str(pos)
        (vtype,) = u32(buf, pos)
        pos += 4
        if vtype == _GGUF_STRING:
            meta[key], pos = read_str(pos)
        elif vtype == _GGUF_ARRAY:
            (etype,) = u32(buf, pos)
            (count,) = u64(buf, pos + 4)
            pos += 12
            if etype == _GGUF_STRING:
                values = [""] * count
                for i in range(count):
                    (n,) = u64(buf, pos)
                    pos += 8
                    values[i] = buf[pos : pos + n].decode("utf-8", "replace")
                    pos += n
                meta[key] = values
            elif etype in _GGUF_NUMPY:
                dtype = np.dtype(endian + _GGUF_NUMPY[etype])
                meta[key] = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
                pos += count * dtype.itemsize
            else:
                raise ValueError(f"{name}: GGUF key {key!r} is an array of unsupported type {etype}")
        elif vtype in _GGUF_SCALAR:
            fmt = endian + _GGUF_SCALAR[vtype]
            (meta[key],) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
        else:
            raise ValueError(f"{name}: GGUF key {key!r} has unsupported value type {vtype}")
    return meta, pos, endian


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (innermost, contiguous) first
    type: int  # GGMLQuantizationType value
    offset: int  # from the start of the file

    @property
    def nbytes(self) -> int:
        """The bytes the tensor's data takes in the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type)]
        return int(np.prod(self.shape)) // block * type_size


class GGUFFile:
    """A GGUF file's metadata and tensors. `data(t)` is a read-only view shaped like GGUFReader's."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata, pos, endian = _parse_gguf_kv(self._mm, str(self.path))
        (count,) = struct.unpack_from(endian + "Q", self._mm, 8)
        u32, u64 = struct.Struct(endian + "I").unpack_from, struct.Struct(endian + "Q").unpack_from
        infos = []
        for _ in range(count):
            (n,) = u64(self._mm, pos)
            name = self._mm[pos + 8:pos + 8 + n].decode("utf-8")
            pos += 8 + n
            (ndim,) = u32(self._mm, pos)
            shape = struct.unpack_from(endian + "Q" * ndim, self._mm, pos + 4)
            pos += 4 + 8 * ndim
            (ttype,) = u32(self._mm, pos)
            (offset,) = u64(self._mm, pos + 4)
            pos += 12
            infos.append((name, tuple(int(x) for x in shape), int(ttype), int(offset)))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        self.tensors = [GGUFTensor(n, s, t, data_start + o) for n, s, t, o in infos]

    def data(self, t: GGUFTensor) -> np.ndarray:
        """Rows of the tensor as stored: float arrays for F32/F16/BF16, uint8 bytes per row when quantized."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(t.type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        row_bytes = t.shape[0] // block * type_size
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=rows * row_bytes, offset=t.offset)
        outer = tuple(reversed(t.shape[1:]))
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(outer + (t.shape[0],))
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(outer + (t.shape[0],))
        return raw.reshape(outer + (row_bytes,))

    def release(self, t: GGUFTensor) -> None:
        """Drop the tensor's file pages from this process's memory once it is converted (the map stays valid: a
        later read faults them in again), so a load's resident memory holds what it keeps, not the file."""
        size = t.nbytes
        start = -(-t.offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
        end = (t.offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._mm.close()
