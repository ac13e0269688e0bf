"""Build shard sets: check and fit the media of input documents, write shards atomically.

Inputs come from `data/shard_inputs.py` (a JSONL manifest or a document folder). Every image and video is decoded once; media over the `MediaLimits` are re-encoded to fit;
anything undecodable, missing or malformed is skipped with its reason, and the report lists them.
Documents that are valid but suspicious are written with a warning, or skipped with `strict`:
an empty document (no text, no media), an image smaller than one ViT patch on a side, a doc_id seen
before. Shards are written as `.tmp-*` files and renamed when complete; the manifest is written
last.
"""

import dataclasses
import multiprocessing
import os
import pathlib
from collections.abc import Callable, Iterable

import numpy as np
from array_record.python import array_record_module
from tqdm import tqdm

from data.media import MediaError, MediaLimits, fit_image, fit_video
from data.shard_format import (
    FORMAT_NAME,
    INDEX_DTYPE,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    WRITER_OPTIONS,
    ShardFormatError,
    encode_record,
    file_sha256,
    shard_names,
    write_index_atomic,
    write_json_atomic,
)
from data.shard_inputs import BuildError, InputDocument
from data.vision_processing import (
    ProcessorConfig,
    num_image_tokens,
    num_video_tokens,
    sample_frame_indices,
    timestamp_text,
)


@dataclasses.dataclass
class BuildReport:
    output: str
    documents: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: list = dataclasses.field(default_factory=list)  # (where, reason)
    notes: list = dataclasses.field(default_factory=list)  # (where, what was re-encoded)
    warnings: list = dataclasses.field(default_factory=list)  # (where, what looks wrong)
    totals: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Checking one document.


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked document: `record` = (record bytes, index row), or None when it is skipped and
    `message` says why; otherwise `message` says what was re-encoded (or None)."""

    where: str
    doc_id: str
    record: tuple | None
    message: str | None
    warnings: list[str]


@dataclasses.dataclass(frozen=True)
class Preparer:
    """Turns an InputDocument into a `Prepared`. strict: a warning skips the document."""

    limits: MediaLimits
    processor: ProcessorConfig
    max_tokens: int | None = None
    strict: bool = False

    def __call__(self, document: InputDocument):
        try:
            return self.prepare(document)
        except (MediaError, ShardFormatError, ValueError, OSError) as e:
            return Prepared(document.where, document.doc_id, None, str(e), [])

    def prepare(self, document: InputDocument):
        segments, notes = [], []
        for number, (kind, value) in enumerate(document.segments):
            if kind == "text":
                segments.append({"type": "text", "text": value})
                continue
            data = value if isinstance(value, bytes) else _read_bytes(value)
            label = value.name if isinstance(value, pathlib.Path) else f"segment {number}"
            try:
                segment, note = self._media(kind, data)
            except MediaError as e:
                raise MediaError(f"{label}: {e}") from None
            segments.append(segment)
            if note:
                notes.append(f"{label}: {note}")
        record = {
            "doc_id": document.doc_id,
            "source": document.source,
            "license": document.license,
            "meta": document.meta,
            "segments": segments,
        }
        data = encode_record(record)
        row = index_row(record, len(data), self.processor)
        if self.max_tokens is not None and row["est_tokens"] > self.max_tokens:
            raise ValueError(
                f"document of ~{int(row['est_tokens'])} tokens exceeds --max-tokens {self.max_tokens}"
            )
        warnings = content_warnings(segments, self.processor.patch_size)
        if warnings and self.strict:
            raise ValueError("; ".join(warnings) + " (strict)")
        notes = "; ".join(notes) or None
        return Prepared(document.where, document.doc_id, (data, row), notes, warnings)

    def _media(self, kind: str, data: bytes):
        if kind == "image":
            data, fmt, height, width, note = fit_image(data, self.limits)
            return {
                "type": "image",
                "bytes": data,
                "format": fmt,
                "height": height,
                "width": width,
            }, note
        data, info, note = fit_video(data, self.limits)
        segment = {
            "type": "video",
            "bytes": data,
            "format": info.format,
            "fps": info.fps,
            "num_frames": info.num_frames,
            "height": info.height,
            "width": info.width,
            "duration": info.duration,
        }
        return segment, note


def content_warnings(segments: list[dict], patch_size: int) -> list[str]:
    """What is valid but likely a mistake in a document's segments."""
    warnings = []
    if not any(s["type"] != "text" or s["text"].strip() for s in segments):
        warnings.append("empty document (no text, no media)")
    for number, segment in enumerate(segments):
        if segment["type"] == "image" and min(segment["height"], segment["width"]) < patch_size:
            warnings.append(
                f"segment {number}: image of {segment['width']}x{segment['height']} pixels, "
                f"smaller than one {patch_size}x{patch_size} patch"
            )
    return warnings


def _read_bytes(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"{path}: {e.strerror or e}") from None


def index_row(record: dict, record_bytes: int, processor: ProcessorConfig) -> np.ndarray:
    """The INDEX_DTYPE row of a record: counts, and tokens estimated for the byte tokenizer."""
    row = np.zeros((), INDEX_DTYPE)
    tokens = 2  # bos, eos
    for segment in record["segments"]:
        if segment["type"] == "text":
            size = len(segment["text"].encode("utf-8"))
            row["text_bytes"] += size
            tokens += size
        elif segment["type"] == "image":
            row["images"] += 1
            tokens += num_image_tokens(segment["height"], segment["width"], processor) + 2
        else:
            row["videos"] += 1
            row["frames"] += segment["num_frames"]
            row["video_seconds"] += segment["duration"]
            sampled = len(sample_frame_indices(segment["num_frames"], segment["fps"], processor))
            grid_t = -(-sampled // processor.temporal_patch_size)
            stamp = len(timestamp_text(segment["duration"])) if processor.timestamps else 0
            tokens += num_video_tokens(sampled, segment["height"], segment["width"], processor)
            tokens += grid_t * (2 + stamp)
    row["est_tokens"] = tokens
    row["record_bytes"] = record_bytes
    return row


# ---------------------------------------------------------------------------------------------
# Writing.


class ShardSetWriter:
    """Appends records to shards of about `shard_size` bytes; `close()` writes the manifest."""

    def __init__(self, output, *, shard_size: int, processor: ProcessorConfig, info: dict):
        self.output = pathlib.Path(output)
        if (self.output / MANIFEST_NAME).exists():
            raise BuildError(
                f"{self.output} already holds a shard set; choose another --output or delete it"
            )
        self.output.mkdir(parents=True, exist_ok=True)
        # Leftovers of a build that did not finish (it never wrote a manifest).
        for pattern in ("shard-?????.array_record", "shard-?????.index.npy", ".tmp-*"):
            for stale in self.output.glob(pattern):
                stale.unlink()
        self.shard_size, self.processor, self.info = shard_size, processor, info
        self.shards: list[dict] = []
        self._writer = None
        self._rows: list[np.ndarray] = []
        self._bytes = 0

    def add(self, data: bytes, row: np.ndarray) -> None:
        if self._writer is None:
            record_name, _ = shard_names(len(self.shards))
            self._temporary = self.output / f".tmp-{record_name}"
            self._writer = array_record_module.ArrayRecordWriter(
                str(self._temporary), WRITER_OPTIONS
            )
        self._writer.write(data)
        self._rows.append(row)
        self._bytes += len(data)
        if self._bytes >= self.shard_size:
            self._finish_shard()

    def _finish_shard(self) -> None:
        self._writer.close()
        record_name, index_name = shard_names(len(self.shards))
        with open(self._temporary, "rb+") as f:
            os.fsync(f.fileno())
        write_index_atomic(self.output / index_name, np.stack(self._rows))
        final = self.output / record_name
        os.replace(self._temporary, final)
        self.shards.append(
            {
                "file": record_name,
                "index": index_name,
                "records": len(self._rows),
                "bytes": final.stat().st_size,
                "sha256": file_sha256(final),
            }
        )
        self._writer, self._rows, self._bytes = None, [], 0

    def close(self) -> dict:
        if self._writer is not None:
            self._finish_shard()
        indexes = [np.load(self.output / s["index"]) for s in self.shards]
        index = np.concatenate(indexes) if indexes else np.zeros(0, INDEX_DTYPE)
        manifest = {
            "format": FORMAT_NAME,
            "version": SCHEMA_VERSION,
            "records": int(sum(s["records"] for s in self.shards)),
            "totals": {name: _total(index[name]) for name in INDEX_DTYPE.names},
            "processor_for_estimates": dataclasses.asdict(self.processor),
            **self.info,
            "shards": self.shards,
        }
        write_json_atomic(self.output / MANIFEST_NAME, manifest)
        return manifest


def _total(column: np.ndarray):
    return float(column.sum()) if column.dtype.kind == "f" else int(column.sum())


def write_documents(
    documents: Iterable[InputDocument],
    output,
    *,
    shard_size: int = 512 << 20,
    workers: int = 1,
    limits: MediaLimits = MediaLimits(),
    processor: ProcessorConfig = ProcessorConfig(),
    max_tokens: int | None = None,
    progress: bool = False,
    info: dict | None = None,
    total: int | None = None,
    strict: bool = False,
) -> BuildReport:
    """Checks and writes documents in order (independent of `workers`); returns the report.
    strict: skip documents that would only be warned about (see the module doc)."""
    writer = ShardSetWriter(output, shard_size=shard_size, processor=processor, info=info or {})
    report = BuildReport(str(output))
    prepare = Preparer(limits, processor, max_tokens, strict)
    first_seen: dict[str, str] = {}  # doc_id -> where it was first written
    bar = tqdm(total=total, desc="m3-shards build", unit="doc", disable=not progress)
    with bar, _mapper(workers) as mapper:
        for prepared in mapper(prepare, documents):
            bar.update(1)
            where, warnings = prepared.where, prepared.warnings
            if prepared.record is not None and prepared.doc_id in first_seen:
                first = first_seen[prepared.doc_id]
                duplicate = f"duplicate id {prepared.doc_id!r} (first: {first})"
                if strict:
                    prepared = dataclasses.replace(prepared, record=None, message=duplicate)
                else:
                    warnings = [*warnings, duplicate]
            if prepared.record is None:
                report.skipped.append((where, prepared.message))
                continue
            first_seen[prepared.doc_id] = where
            writer.add(*prepared.record)
            report.documents += 1
            if prepared.message:
                report.notes.append((where, prepared.message))
            report.warnings += [(where, warning) for warning in warnings]
    manifest = writer.close()
    report.shards = len(manifest["shards"])
    report.bytes = sum(s["bytes"] for s in manifest["shards"])
    report.totals = manifest["totals"]
    return report


class _mapper:
    """Ordered map in this process (workers <= 1) or in a process pool."""

    def __init__(self, workers: int):
        self.pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None

    def __enter__(self) -> Callable:
        if self.pool is None:
            return lambda function, items: map(function, items)
        return lambda function, items: self.pool.imap(function, items, chunksize=1)

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()
