"""The m3jax shard format: ArrayRecord files of msgpack documents, a sidecar index, a manifest.

A shard set is one directory:

    manifest.json                 written last: format, version, shards (records, bytes, sha256)
    shard-00000.array_record      one record per document (ArrayRecord, group_size 1)
    shard-00000.index.npy         per-record counts (INDEX_DTYPE), readable without decoding

A record is `msgpack({"v": 1, doc_id, source, license, meta, segments})` where segments are, in
document order, `{"type": "text", "text"}`, `{"type": "image", "bytes", "format", "height",
"width"}` (format jpeg | png | webp) or `{"type": "video", "bytes", "format", "fps",
"num_frames", "height", "width", "duration"}` (format mp4 | webm). Media stay encoded.

Readers accept only a complete shard set: the manifest exists, names schema version 1, and every
shard has the size and record count it lists. A builder that dies leaves temporary files
(".tmp-*") and no manifest entry for them, so nothing half-written is ever read.
"""

import hashlib
import json
import os
import pathlib

import msgpack
import numpy as np

FORMAT_NAME = "m3jax-shards"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
IMAGE_FORMATS = ("jpeg", "png", "webp")
VIDEO_FORMATS = ("mp4", "webm")
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access reads one document
INDEX_DTYPE = np.dtype(
    [
        ("text_bytes", "<i8"),  # UTF-8 bytes of all text segments
        ("images", "<i4"),
        ("videos", "<i4"),
        ("frames", "<i8"),  # decoded video frames (all videos, before sampling)
        ("video_seconds", "<f8"),
        ("est_tokens", "<i8"),  # text bytes + vision tokens under the manifest's processor
        ("record_bytes", "<i8"),  # size of the encoded record
    ]
)
_SEGMENT_FIELDS = {
    "text": {"type": str, "text": str},
    "image": {"type": str, "bytes": bytes, "format": str, "height": int, "width": int},
    "video": {
        "type": str,
        "bytes": bytes,
        "format": str,
        "fps": float,
        "num_frames": int,
        "height": int,
        "width": int,
        "duration": float,
    },
}


class ShardFormatError(ValueError):
    """A shard set, shard or record does not follow the format; the message says where."""


def encode_record(record: dict) -> bytes:
    """Validates a document dict (without "v") and returns its msgpack bytes."""
    record = {"v": SCHEMA_VERSION, **record}
    validate_record(record)
    return msgpack.packb(record, use_bin_type=True)


def decode_record(data: bytes) -> dict:
    """Returns the document dict of a record's bytes; ShardFormatError if it is not one."""
    try:
        record = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for truncated or garbage bytes
        raise ShardFormatError(f"not a msgpack record ({type(e).__name__}: {e})") from None
    validate_record(record)
    return record


def validate_record(record) -> None:
    if not isinstance(record, dict):
        raise ShardFormatError(f"record is a {type(record).__name__}, not a map")
    version = record.get("v")
    if version != SCHEMA_VERSION:
        raise ShardFormatError(
            f"record schema version {version!r} is not supported (this reader knows "
            f"version {SCHEMA_VERSION}); rebuild the shards or update m3jax"
        )
    for key, kind in (("doc_id", str), ("source", str), ("license", str), ("meta", dict)):
        if not isinstance(record.get(key), kind):
            raise ShardFormatError(f"record field {key!r} must be a {kind.__name__}")
    segments = record.get("segments")
    if not isinstance(segments, list):
        raise ShardFormatError("record field 'segments' must be a list")
    for i, segment in enumerate(segments):
        _validate_segment(segment, f"segment {i}")


def _validate_segment(segment, where: str) -> None:
    kind = segment.get("type") if isinstance(segment, dict) else None
    if kind not in _SEGMENT_FIELDS:
        raise ShardFormatError(f"{where}: type {kind!r} is not text, image or video")
    for key, expected in _SEGMENT_FIELDS[kind].items():
        value = segment.get(key)
        ok = isinstance(value, (int, float)) if expected is float else isinstance(value, expected)
        if not ok or isinstance(value, bool):
            raise ShardFormatError(f"{where} ({kind}): field {key!r} must be {expected.__name__}")
    formats = {"image": IMAGE_FORMATS, "video": VIDEO_FORMATS}.get(kind, ())
    if formats and segment["format"] not in formats:
        raise ShardFormatError(f"{where} ({kind}): format {segment['format']!r} not in {formats}")


# ---------------------------------------------------------------------------------------------
# Manifest.


def shard_names(number: int) -> tuple[str, str]:
    """(record file, index file) names of shard `number`."""
    return f"shard-{number:05d}.array_record", f"shard-{number:05d}.index.npy"


def read_manifest(directory: str | os.PathLike) -> dict:
    """Loads and checks DIR/manifest.json; ShardFormatError names the problem."""
    path = pathlib.Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ShardFormatError(
            f"{directory}: no {MANIFEST_NAME} (not a shard set, or its build did not finish)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ShardFormatError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ShardFormatError(f"{path}: not an {FORMAT_NAME} manifest")
    if manifest.get("version") != SCHEMA_VERSION:
        raise ShardFormatError(
            f"{path}: schema version {manifest.get('version')!r} is not supported (this reader "
            f"knows version {SCHEMA_VERSION}); rebuild the shards or update m3jax"
        )
    if not isinstance(manifest.get("shards"), list):
        raise ShardFormatError(f"{path}: 'shards' must be a list")
    return manifest


def write_json_atomic(path: pathlib.Path, value) -> None:
    temporary = path.with_name(f".tmp-{path.name}")
    with open(temporary, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_index_atomic(path: pathlib.Path, rows: np.ndarray) -> None:
    temporary = path.with_name(f".tmp-{path.name}")
    with open(temporary, "wb") as f:
        np.save(f, rows.astype(INDEX_DTYPE), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
