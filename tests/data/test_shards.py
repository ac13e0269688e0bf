"""Shard format, builder and `m3-shards` CLI: versions, bad inputs, atomic writes, re-encoding."""

import io
import json

import numpy as np
import PIL.Image
import pytest
from media_fixtures import TINY, png_bytes, video_bytes

from data import shard_builder
from data.media import MediaLimits, probe_video
from data.shard_builder import write_documents
from data.shard_format import (
    SCHEMA_VERSION,
    ShardFormatError,
    decode_record,
    encode_record,
    read_manifest,
)
from data.shard_inputs import InputDocument
from data.shard_reader import ShardSet
from data.shards_cli import main, parse_size

RNG = np.random.default_rng(0)


def _record(**segments_and_fields):
    record = {"doc_id": "d", "source": "s", "license": "CC0-1.0", "meta": {"k": 1},
              "segments": [{"type": "text", "text": "hi"}]}  # fmt: skip
    record.update(segments_and_fields)
    return record


def test_record_round_trip_and_validation():
    record = _record()
    decoded = decode_record(encode_record(record))
    assert decoded == {"v": SCHEMA_VERSION, **record}
    with pytest.raises(ShardFormatError, match="field 'license' must be a str"):
        encode_record(_record(license=None))
    with pytest.raises(ShardFormatError, match="format 'gif'"):
        encode_record(_record(segments=[{"type": "image", "bytes": b"x", "format": "gif",
                                         "height": 1, "width": 1}]))  # fmt: skip
    with pytest.raises(ShardFormatError, match="not a msgpack record"):
        decode_record(b"\xc1\xc1")


def test_unknown_schema_versions_are_rejected(tmp_path):
    import msgpack

    future = msgpack.packb({"v": 2, **_record()}, use_bin_type=True)
    with pytest.raises(ShardFormatError, match="schema version 2 is not supported"):
        decode_record(future)
    write_documents([InputDocument("w", "d", "s", "l", {}, (("text", "hi"),))], tmp_path / "set")
    manifest_path = tmp_path / "set" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ShardFormatError, match="schema version 99 is not supported"):
        ShardSet(tmp_path / "set")


def _folder_input(root):
    """A folder input with one good text doc, one good interleaved doc and three bad ones."""
    (root / "good").mkdir(parents=True)
    (root / "plain.txt").write_text("A text document.")
    (root / "good" / "00.txt").write_text("An image and a clip:")
    (root / "good" / "01.png").write_bytes(png_bytes(RNG, 40, 50))
    (root / "good" / "02.mp4").write_bytes(video_bytes(RNG, 5))
    (root / "good" / "meta.json").write_text(json.dumps({"license": "CC-BY-4.0", "meta": {"a": 1}}))
    (root / "bad-image").mkdir()
    (root / "bad-image" / "a.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    (root / "bad-video").mkdir()
    (root / "bad-video" / "a.mp4").write_bytes(video_bytes(RNG, 5)[:300])
    (root / "bad-kind").mkdir()
    (root / "bad-kind" / "a.xyz").write_text("?")
    (root / "defaults.json").write_text(json.dumps({"license": "CC0-1.0", "source": "tests"}))


def test_build_folder_reports_skips_then_verify_and_inspect(tmp_path, capsys):
    _folder_input(tmp_path / "in")
    out = tmp_path / "out"
    assert (
        main(["build", "--input", str(tmp_path / "in"), "--output", str(out), "--no-progress"]) == 0
    )
    text = capsys.readouterr().out
    assert "wrote 2 documents in 1 shard(s)" in text and "1 images, 1 videos" in text
    assert "skipped 3 input(s)" in text
    assert "bad-image: a.jpg: undecodable image" in text
    assert "bad-video: a.mp4: undecodable video" in text
    assert "bad-kind: a.xyz: unknown file type" in text
    shards = ShardSet(out)
    records = [decode_record(shards[i].data) for i in range(len(shards))]
    good = next(r for r in records if r["doc_id"] == "good")
    assert good["license"] == "CC-BY-4.0" and good["meta"] == {"a": 1} and good["source"] == "tests"
    assert [s["type"] for s in good["segments"]] == ["text", "image", "video"]
    assert good["segments"][2]["num_frames"] == 5 and good["segments"][2]["format"] == "mp4"
    assert shards.index["images"].sum() == 1 and shards.index["frames"].sum() == 5
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert "doc_id 'good'" in capsys.readouterr().out
    assert main(["build", "--input", str(tmp_path / "in"), "--output", str(out)]) == 2
    assert "already holds a shard set" in capsys.readouterr().err


def test_build_jsonl_manifest_with_bad_lines(tmp_path, capsys):
    (tmp_path / "img.png").write_bytes(png_bytes(RNG, 30, 30))
    lines = [
        {"id": "ok", "segments": [{"text": "x"}, {"image": "img.png"}]},
        {"id": "missing", "segments": [{"video": "nope.mp4"}]},
        {"id": "wrong", "segments": [{"audio": "a.wav"}]},
        ["not", "an", "object"],
        {"text": "text only"},
    ]
    manifest = tmp_path / "docs.jsonl"
    manifest.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    code = main(["build", "--input", str(manifest), "--output", str(tmp_path / "o"),
                 "--license", "CC0-1.0", "--no-progress"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "wrote 2 documents" in text
    assert "docs.jsonl:2: " in text and "No such file" in text
    assert "docs.jsonl:3: bad manifest line" in text and "docs.jsonl:4: bad manifest line" in text
    assert "docs.jsonl:6: bad manifest line" in text
    assert ShardSet(tmp_path / "o").manifest["records"] == 2


def test_crash_during_build_leaves_nothing_readable(tmp_path, monkeypatch):
    documents = [
        InputDocument(f"w{i}", f"d{i}", "s", "l", {}, (("text", "x" * 500),)) for i in range(6)
    ]
    real_prepare = shard_builder.Preparer.prepare
    calls = []

    def crash_on_fifth(self, document):
        calls.append(document)
        if len(calls) == 5:
            raise KeyboardInterrupt  # a crash the builder does not catch
        return real_prepare(self, document)

    monkeypatch.setattr(shard_builder.Preparer, "prepare", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        write_documents(documents, tmp_path / "set", shard_size=1000)
    assert list((tmp_path / "set").glob("shard-*.array_record"))  # finished shards exist...
    with pytest.raises(ShardFormatError, match="no manifest.json"):  # ...but nothing reads them
        ShardSet(tmp_path / "set")
    monkeypatch.setattr(shard_builder.Preparer, "prepare", real_prepare)
    report = write_documents(documents, tmp_path / "set", shard_size=1000)  # rebuild is clean
    assert report.documents == 6 and len(ShardSet(tmp_path / "set")) == 6
    assert not list((tmp_path / "set").glob(".tmp-*"))


def test_oversize_media_are_reencoded_within_caps(tmp_path):
    gif = io.BytesIO()
    PIL.Image.fromarray(RNG.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(gif, "GIF")
    clip = video_bytes(RNG, 20, height=96, width=128, fps=24.0)
    documents = [
        InputDocument("w", "d", "s", "l", {}, (("image", gif.getvalue()), ("video", clip)))
    ]
    limits = MediaLimits(max_image_pixels=100 * 100, max_video_pixels=64 * 48, max_video_fps=8.0)
    report = write_documents(documents, tmp_path / "set", limits=limits, processor=TINY)
    assert report.documents == 1 and "downscaled 400x300" in report.notes[0][1]
    segments = decode_record(ShardSet(tmp_path / "set")[0].data)["segments"]
    image, video = segments
    assert image["format"] == "png" and image["height"] * image["width"] <= 100 * 100
    info = probe_video(video["bytes"])
    assert info.fps == 8.0 and info.height * info.width <= 64 * 48
    assert video["num_frames"] == info.num_frames == 6  # 20 frames at 24 fps -> 8 fps


def test_verify_finds_a_corrupted_shard(tmp_path, capsys):
    documents = [InputDocument(f"w{i}", f"d{i}", "s", "l", {}, (("image", png_bytes(RNG, 64, 64)),))
                 for i in range(3)]  # fmt: skip
    write_documents(documents, tmp_path / "set")
    shard = tmp_path / "set" / "shard-00000.array_record"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "set"), "--no-progress"]) == 1
    assert "sha256" in capsys.readouterr().out


def test_manifest_totals_and_size_parsing(tmp_path):
    documents = [
        InputDocument(
            "w", "d", "s", "l", {}, (("text", "héllo"), ("image", png_bytes(RNG, 60, 60)))
        )
    ]
    write_documents(documents, tmp_path / "set", processor=TINY)
    totals = read_manifest(tmp_path / "set")["totals"]
    assert totals["text_bytes"] == 6 and totals["images"] == 1
    assert totals["est_tokens"] == 2 + 6 + (4 + 2)  # 60x60 -> 56x56: 4 placeholders + brackets
    assert (
        parse_size("512MB") == 512 << 20 and parse_size("64k") == 65536 and parse_size("100") == 100
    )


@pytest.mark.slow
def test_build_output_does_not_depend_on_workers(tmp_path):
    documents = [
        InputDocument(
            f"w{i}",
            f"d{i}",
            "s",
            "l",
            {},
            (("text", f"doc {i}"), ("image", png_bytes(RNG, 32, 40 + i))),
        )
        for i in range(6)
    ]
    write_documents(documents, tmp_path / "one", workers=1, shard_size=4000)
    write_documents(documents, tmp_path / "two", workers=2, shard_size=4000)
    one, two = ShardSet(tmp_path / "one"), ShardSet(tmp_path / "two")
    assert [s["sha256"] for s in one.manifest["shards"]] == [
        s["sha256"] for s in two.manifest["shards"]
    ]
