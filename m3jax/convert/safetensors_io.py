"""Sharded safetensors, read lazily and written one tensor at a time, with NumPy only.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then raw little-endian
data. We read and write it directly rather than through `safetensors.numpy`, which cannot return
bfloat16 arrays (the dtype of released checkpoints): reads are memory maps (a tensor's pages are
read when used), and a writer knows every offset from the shapes before any data exists, so it
streams tensors to disk and never holds more than one.

A checkpoint directory is `model.safetensors.index.json` ({"metadata": {"total_size"},
"weight_map": {name: file}}) with its shards, or, without an index, every `*.safetensors` file.
"""

import json
import math
import os
import pathlib
import re
import struct
from collections.abc import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed or inconsistent; the message names the file."""


class SafetensorsFile:
    """One .safetensors file: header parsed at once, tensors memory-mapped on `read`.

    Opening checks that every tensor's bytes lie inside the file, so a truncated file fails here,
    naming the file and the first tensor it cuts, not later inside a memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        try:
            with open(self.path, "rb") as f:
                (header_size,) = struct.unpack("<Q", f.read(8))
                size = os.fstat(f.fileno()).st_size
                if header_size > size - 8:
                    raise ValueError(f"header of {header_size} bytes in a file of {size}")
                header = json.loads(f.read(header_size))
            if not isinstance(header, dict):
                raise ValueError(f"header is a {type(header).__name__}, not a JSON object")
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_size
        self.entries = header
        self._check_extents(size - self._data_start)

    def _check_extents(self, data_size: int) -> None:
        for name, entry in self.entries.items():
            try:
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} has no valid data_offsets (corrupt header)"
                ) from None
            if not 0 <= begin <= end <= data_size:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} needs data bytes [{begin}, {end}) but the file "
                    f"holds {data_size}: truncated or corrupt"
                )

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory map (nothing is read until it is used)."""
        entry = self.entries[name]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which m3jax cannot read"
            )
        begin, end = entry["data_offsets"]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)} "
                f"{entry['dtype']}"
            )
        if not shape or end == begin:
            with open(self.path, "rb") as f:
                f.seek(self._data_start + begin)
                return np.frombuffer(f.read(end - begin), dtype).reshape(shape)
        array = np.memmap(self.path, dtype, "r", offset=self._data_start + begin, shape=shape)
        return array


class SafetensorsDirectory:
    """The tensors of a checkpoint directory, by name, across its shards."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index}: malformed index ({e!r})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise SafetensorsError(
                    f"{self.directory}: no {INDEX_FILE} and no *.safetensors files"
                )
            weight_map = None
        self._files = {name: SafetensorsFile(self.directory / name) for name in files}
        self._where: dict[str, SafetensorsFile] = {}
        for file in self._files.values():
            for name in file.names():
                if name in self._where:
                    raise SafetensorsError(
                        f"{self.directory}: tensor {name!r} is in both "
                        f"{self._where[name].path.name} and {file.path.name}"
                    )
                self._where[name] = file
        if weight_map is not None:
            for name, file_name in weight_map.items():
                if name not in self._where or self._where[name].path.name != file_name:
                    raise SafetensorsError(
                        f"{index}: lists tensor {name!r} in {file_name}, which does not hold it"
                    )

    def names(self) -> list[str]:
        return list(self._where)

    def file(self, name: str) -> SafetensorsFile:
        return self._where[name]

    def origin(self, name: str) -> str:
        """The file holding a tensor, for error messages."""
        return str(self._where[name].path)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def read(self, name: str) -> np.ndarray:
        return self._where[name].read(name)


def parse_size(text: str | int) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '20KB', or a number of bytes -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match or float(match[1]) <= 0:
        raise ValueError(f"shard size {text!r}: expected a size like '5GB', '500MB' or '2GiB'")
    return int(float(match[1]) * SIZE_UNITS[match[2] or ""])


def plan_shards(tensors: list[tuple[str, tuple[int, ...]]], dtype: np.dtype, shard_size: int):
    """Groups (name, shape) in order into shards of at most shard_size bytes (a bigger tensor gets
    a shard of its own). Returns [[(name, shape), ...], ...]."""
    shards, current, current_size = [], [], 0
    for name, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        if current and current_size + size > shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append((name, shape))
        current_size += size
    if current:
        shards.append(current)
    return shards


def write_file(
    path: pathlib.Path,
    entries: list[tuple[str, tuple[int, ...]]],
    dtype: np.dtype,
    tensors: Iterable[np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Writes one .safetensors file; `tensors` yields the arrays of `entries` in order, each cast
    to `dtype` as it is written. Returns the data size in bytes."""
    header, offset = {}, 0
    for name, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for (name, shape), tensor in zip(entries, tensors, strict=True):
            if tuple(tensor.shape) != tuple(shape):
                raise SafetensorsError(
                    f"{path}: tensor {name!r} has shape {list(tensor.shape)}, planned {list(shape)}"
                )
            f.write(np.ascontiguousarray(tensor, dtype=dtype).tobytes())
    return offset


def write_sharded(
    directory: pathlib.Path,
    tensors: list[tuple[str, tuple[int, ...]]],
    produce: Callable[[str], np.ndarray],
    *,
    dtype: np.dtype,
    shard_size: int,
    on_tensor: Callable[[str], None] = lambda name: None,
) -> dict:
    """Writes model-0000i-of-0000n.safetensors and the index; `produce(name)` makes each tensor
    just before it is written. Returns the index."""
    shards = plan_shards(tensors, dtype, shard_size)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_file(
            directory / file_name,
            shard,
            dtype,
            _produced(shard, produce, on_tensor),
            {"format": "pt"},
        )
        weight_map.update({name: file_name for name, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _produced(shard, produce, on_tensor) -> Iterator[np.ndarray]:
    for name, _ in shard:
        tensor = produce(name)
        yield tensor
        on_tensor(name)
