"""Random access to the records of a shard set, with the sidecar index and clear errors.

`ShardSet(directory)` checks the manifest (format, schema version) and every shard's size when
opened; record reads are lazy and per process (the object pickles without its open readers, so
Grain worker processes reopen the files). A read never raises: it returns a `RawRecord` whose
`error` says what went wrong (truncated shard, checksum mismatch, ...), so the pipeline can skip
or stop according to its policy with the shard set, shard and index in the message.
"""

import dataclasses
import os
import pathlib

import numpy as np
from array_record.python import array_record_module

from data.shard_format import INDEX_DTYPE, ShardFormatError, read_manifest


@dataclasses.dataclass(frozen=True)
class RawRecord:
    """The bytes of record `index` of `shard` in the folder `shard_set` (None when unreadable,
    with `error` saying why). record: its number in the whole set (for provenance); source: the
    set's place in a loader's mixture (-1 outside one)."""

    shard_set: str
    shard: str
    index: int
    record: int
    data: bytes | None
    error: str | None = None
    source: int = -1

    @property
    def where(self) -> str:
        return f"{self.shard_set}/{self.shard}#{self.index}"


class ShardSet:
    """The records of one shard set, in shard order, optionally restricted to a subset.

    Args:
        directory: a folder written by `m3-shards build`.
        keep: optional function of the index (a structured array, INDEX_DTYPE fields) returning a
            boolean mask of the records to keep, e.g. `lambda ix: ix["images"] > 0`.
    """

    def __init__(self, directory: str | os.PathLike, keep=None):
        self.directory = pathlib.Path(directory)
        self.manifest = read_manifest(self.directory)
        self.shards = [entry["file"] for entry in self.manifest["shards"]]
        counts, indexes = [], []
        for entry in self.manifest["shards"]:
            path = self.directory / entry["file"]
            if not path.is_file():
                raise ShardFormatError(f"{path}: listed in the manifest but missing")
            index = _load_index(self.directory / entry["index"], entry["records"])
            counts.append(entry["records"])
            indexes.append(index)
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        full_index = np.concatenate(indexes) if indexes else np.zeros(0, INDEX_DTYPE)
        self.sizes = {entry["file"]: entry["bytes"] for entry in self.manifest["shards"]}
        self.records = np.arange(len(full_index), dtype=np.int64)  # global ids kept
        if keep is not None:
            self.records = self.records[np.asarray(keep(full_index), dtype=bool)]
        self.index = full_index[self.records]
        self._readers: dict[int, object] = {}
        self._broken: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, position: int) -> RawRecord:
        """The record at `position` of this (possibly filtered) set."""
        record = int(self.records[position])
        shard, local = self._locate(record)
        place = (str(self.directory), self.shards[shard], local, record)
        reader = self._reader(shard)
        if reader is None:
            return RawRecord(*place, None, self._broken[shard])
        try:
            return RawRecord(*place, reader.read([local])[0])
        except Exception as e:  # riegeli reports corruption as RuntimeError, others vary
            return RawRecord(*place, None, f"unreadable record ({_first_line(e)})")

    def where(self, record: int) -> str:
        """'<shard set>/<shard file>#<index in its shard>' of a `RawRecord.record` number."""
        shard, local = self._locate(record)
        return f"{self.directory}/{self.shards[shard]}#{local}"

    def _locate(self, record: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self._starts, record, side="right") - 1)
        return shard, record - int(self._starts[shard])

    def _reader(self, shard: int):
        if shard in self._readers or shard in self._broken:
            return self._readers.get(shard)
        entry = self.manifest["shards"][shard]
        path = self.directory / entry["file"]
        try:
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise ShardFormatError(
                    f"size {size} bytes, manifest says {entry['bytes']} (truncated or replaced)"
                )
            reader = array_record_module.ArrayRecordReader(str(path))
            if reader.num_records() != entry["records"]:
                raise ShardFormatError(
                    f"{reader.num_records()} records, manifest says {entry['records']}"
                )
        except Exception as e:
            self._broken[shard] = f"unreadable shard ({_first_line(e)})"
            return None
        self._readers[shard] = reader
        return reader

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_readers"], state["_broken"] = {}, {}
        return state

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers = {}


def _load_index(path: pathlib.Path, records: int) -> np.ndarray:
    try:
        index = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ShardFormatError(f"{path}: unreadable index ({e})") from None
    if index.dtype != INDEX_DTYPE or index.shape != (records,):
        raise ShardFormatError(
            f"{path}: index has dtype {index.dtype} and shape {index.shape}, expected "
            f"{records} rows of {INDEX_DTYPE}"
        )
    return index


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
