"""Lazy safetensors reads: tensors are memory-mapped views, read only when used.

Our own small reader (the format is a JSON header plus raw little-endian data) because
numpy-framework `safe_open` cannot return bfloat16 and we want zero-copy slices for
loading straight into shards.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """One `.safetensors` file: name -> (dtype, shape, byte range), read through a memmap."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self.entries = header
        self.data_offset = 8 + header_len
        self._mmap: np.memmap | None = None

    def get(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {self.path.name} has unsupported dtype "
                             f"{entry['dtype']!r} (supported: {', '.join(_DTYPES)})")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = entry["data_offsets"]
        raw = self._mmap[self.data_offset + start:self.data_offset + end]
        return raw.view(dtype).reshape(entry["shape"])


class CheckpointReader:
    """All safetensors of a checkpoint dir, single-file or sharded via the index json."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {name: directory / fname for name, fname in weight_map.items()}
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise ValueError(f"no *.safetensors files in checkpoint directory {directory}")
            files = {}
            for p in paths:
                files.update({name: p for name in SafetensorsFile(p).entries})
        self.directory = directory
        self._file_of = files
        self._open: dict[Path, SafetensorsFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def keys(self):
        return self._file_of.keys()

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self._file_of:
            shape = f" (expected shape {list(expected_shape)})" if expected_shape else ""
            raise ValueError(f"checkpoint {self.directory} is missing tensor {name!r}{shape}")
        path = self._file_of[name]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        array = self._open[path].get(name)
        if expected_shape is not None and tuple(array.shape) != tuple(expected_shape):
            raise ValueError(f"tensor {name!r} has shape {list(array.shape)}, expected "
                             f"{list(expected_shape)}")
        return array
