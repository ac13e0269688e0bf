"""Build inputs: a JSONL manifest or a document folder, read into `InputDocument`s.

JSONL: one document per line, `{"id", "license", "source", "meta", "segments": [{"text": ...} |
{"image": path} | {"video": path}]}` (paths relative to the manifest's folder) or `{"text": ...}`.
Folder: every `*.txt`/`*.md` directly inside is a text document, every sub-folder an interleaved
document whose files, in name order, are its segments (`meta.json` in it holds id/license/source/
meta), and an optional `defaults.json` gives the license/source of all. Problems are returned as
(where, reason) pairs, never raised, so one bad line does not stop a build.
"""

import dataclasses
import json
import pathlib

TEXT_SUFFIXES = (".txt", ".md")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")
UNSPECIFIED_LICENSE = "unspecified"


class BuildError(ValueError):
    """The build cannot start (bad input path, output already holds a shard set, ...)."""


@dataclasses.dataclass(frozen=True)
class InputDocument:
    """A document before checking: segments are ("text", str) | ("image"/"video", path | bytes)."""

    where: str  # "manifest.jsonl:12" or a folder path, for reports
    doc_id: str
    source: str
    license: str
    meta: dict
    segments: tuple


def read_inputs(path, *, source: str | None, license: str | None):
    """Returns (documents, problems) of a JSONL manifest or a folder; problems are (where, why)."""
    root = pathlib.Path(path)
    if root.is_dir():
        return _read_folder(root, source, license)
    if root.is_file():
        return _read_jsonl(root, source, license)
    raise BuildError(f"{root}: no such file or folder")


def _read_jsonl(path: pathlib.Path, source, license):
    documents, problems = [], []
    base = path.parent
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        where = f"{path.name}:{number}"
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            documents.append(_entry_document(entry, where, base, source, license))
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            problems.append((where, f"bad manifest line ({e})"))
    return documents, problems


def _entry_document(entry, where, base, source, license) -> InputDocument:
    if not isinstance(entry, dict):
        raise TypeError(f"expected a JSON object, got {type(entry).__name__}")
    if "segments" in entry:
        raw_segments = entry["segments"]
    elif "text" in entry:
        raw_segments = [{"text": entry["text"]}]
    else:
        raise ValueError("needs 'segments' (or 'text')")
    if not isinstance(raw_segments, list) or not raw_segments:
        raise ValueError("'segments' must be a non-empty list")
    segments = []
    for i, segment in enumerate(raw_segments):
        if not isinstance(segment, dict) or len(segment) != 1:
            raise ValueError(f"segment {i} must be one of {{text|image|video: ...}}")
        ((kind, value),) = segment.items()
        if kind not in ("text", "image", "video") or not isinstance(value, str):
            raise ValueError(f"segment {i}: {kind!r} must be text, image or video with a string")
        segments.append((kind, value if kind == "text" else base / value))
    meta = entry.get("meta", {})
    if not isinstance(meta, dict):
        raise TypeError("'meta' must be an object")
    return InputDocument(
        where,
        str(entry.get("id", where)),
        str(entry.get("source", source or where.split(":")[0])),
        str(entry.get("license", license or UNSPECIFIED_LICENSE)),
        meta,
        tuple(segments),
    )


def _read_folder(root: pathlib.Path, source, license):
    defaults = {"source": source or root.name, "license": license or UNSPECIFIED_LICENSE}
    documents, problems = [], []
    if (root / "defaults.json").is_file():
        defaults.update(json.loads((root / "defaults.json").read_text()))
    for path in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        if path.is_file() and path.suffix.lower() in TEXT_SUFFIXES:
            text = path.read_text(encoding="utf-8")
            segments = (("text", text),)
            documents.append(_folder_document(path, root, {}, defaults, segments))
        elif path.is_dir():
            try:
                info = {}
                if (path / "meta.json").is_file():
                    info = json.loads((path / "meta.json").read_text())
                files = sorted(
                    f for f in path.iterdir() if f.is_file() and not f.name.startswith(".")
                )
                segments = tuple(s for f in files if (s := _file_segment(f)) is not None)
                if not segments:
                    raise ValueError("no text, image or video files")
                documents.append(_folder_document(path, root, info, defaults, segments))
            except (ValueError, OSError) as e:
                problems.append((str(path), str(e)))
        elif path.name != "defaults.json":
            problems.append((str(path), "not a .txt/.md document or a document folder"))
    return documents, problems


def _file_segment(path: pathlib.Path):
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return ("text", path.read_text(encoding="utf-8"))
    if suffix in IMAGE_SUFFIXES:
        return ("image", path)
    if suffix in VIDEO_SUFFIXES:
        return ("video", path)
    if path.name == "meta.json":
        return None
    raise ValueError(f"{path.name}: unknown file type (not text, image or video)")


def _folder_document(path, root, info, defaults, segments) -> InputDocument:
    merged = {**defaults, **info}
    name = path.relative_to(root).as_posix()
    return InputDocument(
        str(path),
        str(merged.get("id", name)),
        str(merged["source"]),
        str(merged["license"]),
        dict(merged.get("meta", {})),
        segments,
    )
