"""Memory-mapped reading and plain writing of safetensors files, bf16 included.

The safetensors package's NumPy API cannot return bf16 tensors (NumPy has no bfloat16:
``TypeError: data type 'bfloat16' not understood``, safetensors 0.8), and Qwen checkpoints are
bf16. The format is small and fixed (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the data), so we read it ourselves: the file is
memory-mapped and a tensor, or a range of its rows, is a view of the mapping that is copied
once; rows that are not asked for are never read. bf16 is ``ml_dtypes.bfloat16`` (jnp.bfloat16),
which jax already depends on. The tests check this reader against the safetensors package and
against files written by transformers.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

__all__ = ["SafetensorsFile", "save_file", "DTYPES"]

# safetensors dtype name -> NumPy dtype (the float types checkpoints use, and ints).
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
# Other dtypes of the format (quantized checkpoints store FP8 beside bf16): their entries are
# listed and size-checked, and reading one raises naming it, so that the file's other tensors
# stay readable.
_OTHER_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8}
_MAX_HEADER = 100 << 20


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped. Raises ValueError naming the file if it is malformed.

    ``keys()``, ``shape(key)``, ``dtype(key)`` read only the header; ``read(key, rows=...)``
    copies the tensor, or only the given row ranges of its first axis, out of the mapping.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"{self.path}: not a safetensors file (header length {n} for a file of {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: unreadable safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: the safetensors header is a JSON {type(header).__name__}, not an object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries = {}
        for key, e in header.items():
            try:
                name = str(e["dtype"])
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{self.path}: header entry {key!r} is malformed: {e!r}") from None
            itemsize = DTYPES[name].itemsize if name in DTYPES else _OTHER_ITEMSIZE.get(name)
            count = int(np.prod(shape, dtype=np.int64))
            if (min(shape, default=0) < 0 or not 0 <= begin <= end <= size - self._data_start
                    or (itemsize is not None and end - begin != count * itemsize)):
                raise ValueError(f"{self.path}: {key!r} data_offsets {begin}..{end} do not fit shape {shape} "
                                 f"{name} in a file of {size} bytes")
            self._entries[key] = (name, shape, begin)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._data_start else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple:
        return self._entries[key][1]

    def dtype_name(self, key: str) -> str:
        """The stored dtype as the format names it ("BF16", "F8_E4M3", ...)."""
        return self._entries[key][0]

    def dtype(self, key: str) -> np.dtype:
        """The NumPy dtype; ValueError naming the key for a dtype this reader does not take."""
        name = self._entries[key][0]
        if name not in DTYPES:
            raise ValueError(f"{self.path}: {key!r} is stored as {name}, a dtype gdn_jax does not read "
                             f"(it reads {', '.join(DTYPES)})")
        return DTYPES[name]

    def _view(self, key: str) -> np.ndarray:
        _, shape, begin = self._entries[key]
        dt = self.dtype(key)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if n == 0:
            return np.zeros(shape, dt)
        start = self._data_start + begin
        return self._map[start:start + n].view(dt).reshape(shape)

    def read(self, key: str, rows: Optional[Sequence[tuple[int, int]]] = None,
             cols: Optional[tuple[int, int]] = None) -> np.ndarray:
        """The tensor ``key`` (a copy), or the concatenation of its rows ``[a, b)`` for each range;
        ``cols=(a, b)``: only columns ``[a, b)`` of a 2-D tensor (each row's piece is read)."""
        v = self._view(key)
        if cols is not None:
            v = v[:, cols[0]:cols[1]]
        if rows is None:
            return np.array(v)
        return np.concatenate([v[a:b] for a, b in rows], axis=0)


def save_file(tensors: dict, path: str | os.PathLike, metadata: Optional[dict] = None) -> None:
    """Write ``{name: array}`` as a safetensors file (bf16 included), names in sorted order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _NAMES:
            raise TypeError(f"save_file: tensor {name!r} has unsupported dtype {a.dtype}")
        b = a.tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)      # data aligned to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)

