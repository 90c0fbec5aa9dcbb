"""Streaming safetensors reader/writer (handles bfloat16 via ml_dtypes).

The reader reads one tensor at a time straight from the file into a fresh array (no memory map, whose touched
pages would stay resident), so host memory holds one tensor, not the checkpoint. The writer lays out the header
first and then streams tensors one by one.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class SafetensorsFile:
    """Lazy view of one .safetensors file: `keys()`, `shape(k)`, `get(k)` (a fresh numpy array)."""

    def __init__(self, path: str):
        """Reads and checks the header: a file that is not safetensors, a malformed entry, or data shorter than
        the header says (a truncated download or copy) is a ValueError naming the file, raised here rather than
        when the tensor is read."""
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > size - 8:
                raise ValueError(f"{path}: not a safetensors file, or truncated inside its header ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: safetensors header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self._base = 8 + n
        end = 0
        for key, info in header.items():
            end = max(end, self._check_entry(key, info))
        if end > size - self._base:
            raise ValueError(f"{path}: truncated: the header describes {end} bytes of tensor data, the file holds "
                             f"{size - self._base}")

    def _check_entry(self, key: str, info) -> int:
        """The entry's end offset; ValueError if it is malformed or its byte range disagrees with its shape."""
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{self.path}: tensor {key!r} has a malformed header entry {info!r}") from None
        if dtype not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {key!r} has unsupported dtype {dtype} (jspec reads "
                             f"{sorted(_DTYPES)})")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != want:
            raise ValueError(f"{self.path}: tensor {key!r}: data_offsets {[start, end]} do not hold a {dtype} "
                             f"tensor of shape {shape} ({want} bytes)")
        return end

    def dtype(self, key: str) -> str:
        """The tensor's safetensors dtype name ("F32", "BF16", "I64", ...)."""
        return self.header[key]["dtype"]

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        info = self.header[key]
        start, end = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]])
        if end == start:
            return np.zeros(info["shape"], dt)
        count = (end - start) // dt.itemsize
        with open(self.path, "rb") as f:
            arr = np.fromfile(f, dtype=dt, count=count, offset=self._base + start)
        if arr.size != count:
            raise ValueError(f"{self.path}: tensor {key!r} is truncated ({arr.size} of {count} elements)")
        return arr.reshape(info["shape"])


def write_safetensors(path: str, shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
                      fetch: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors named in `shapes` (name -> (shape, dtype)), pulling each from `fetch(name)` only when written."""
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (shape, dtype) in shapes.items():
            arr = np.ascontiguousarray(fetch(name), dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"tensor {name}: expected shape {shape}, got {arr.shape}")
            f.write(arr.tobytes())
    os.replace(tmp, path)


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of an HF checkpoint dir: the index's shards, or the single model.safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{index}: not a safetensors index (JSON with a \"weight_map\" of tensor name "
                                 "-> shard file)") from None
        missing = [s for s in files if not os.path.exists(os.path.join(directory, s))]
        if missing:
            raise FileNotFoundError(f"{directory}: index.json names shard files that are missing: {missing}")
        return [os.path.join(directory, s) for s in files]
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    if found:
        return [os.path.join(directory, p) for p in found]
    bins = [p for p in os.listdir(directory) if p.endswith(".bin")]
    hint = f" (found PyTorch pickles {bins}; re-save with safe_serialization=True)" if bins else ""
    raise FileNotFoundError(f"{directory}: no safetensors weights{hint}")
