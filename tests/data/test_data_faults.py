"""Bad data: skips counted by reason and named with their shard set, a data set with nothing usable
stops instead of looping, batches name their records, the builder flags suspicious documents."""
# ruff: noqa: F811 -- the shard-set fixtures are imported from media_fixtures and used as arguments

import shutil

import numpy as np
import pytest
from media_fixtures import TINY, broken_record_shards, png_bytes  # noqa: F401 (fixtures)

from data.mm_documents import DataError
from data.mm_loader import MultimodalLoader
from data.shard_builder import write_documents
from data.shard_format import decode_record
from data.shard_inputs import InputDocument
from data.shard_reader import ShardSet
from data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _loader(path, **overrides):
    settings = {"seq_len": 96, "batch_size": 2, "patch_budget": 96, "seed": 3, "processor": TINY,
                "shard_index": 0, "shard_count": 1}  # fmt: skip
    return MultimodalLoader([path], **{**settings, **overrides})


def _text_documents(count, prefix="t"):
    return [
        InputDocument(f"{prefix}{i}", f"{prefix}{i}", "tests", "CC0", {}, (("text", f"doc {i}"),))
        for i in range(count)
    ]


def test_skips_are_counted_by_reason_and_named_with_their_shard_set(broken_record_shards, caplog):
    loader = _loader(broken_record_shards, num_epochs=1, batch_size=1)
    assert list(loader)
    counts = loader.skip_counts()
    assert counts["documents_read"] == 2 and counts["skipped_documents"] == 1
    assert counts["skipped_bad_media"] == 1 and counts["skipped_unreadable"] == 0
    assert f"{broken_record_shards}/shard-00000.array_record#1: segment 1 (image)" in caplog.text
    with pytest.raises(DataError, match=rf"^{broken_record_shards}/shard-00000.array_record#1: "):
        list(_loader(broken_record_shards, num_epochs=1, batch_size=1, on_error="fail"))


def test_consecutive_unusable_documents_stop_the_loader(tmp_path):
    write_documents(_text_documents(10), tmp_path / "set", processor=TINY)
    shard = next((tmp_path / "set").glob("shard-*.array_record"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: every record unreadable
    loader = _loader(tmp_path / "set", max_consecutive_skips=3, patch_budget=0)
    with pytest.raises(DataError) as caught:
        next(loader)
    message = str(caught.value)
    assert message.startswith("4 unusable documents in a row, more than ")
    assert "data.max_consecutive_skips=3" in message
    assert f"{tmp_path / 'set'}/shard-00000.array_record#" in message
    assert "unreadable shard (size" in message


def test_a_data_set_with_nothing_usable_stops_after_one_pass(tmp_path):
    """Without a reachable max_consecutive_skips, one epoch of skips is the end (it used to loop
    forever, never yielding a batch)."""
    write_documents(_text_documents(5), tmp_path / "set", processor=TINY)
    shard = next((tmp_path / "set").glob("shard-*.array_record"))
    shard.write_bytes(shard.read_bytes()[:100])
    loader = _loader(tmp_path / "set", max_consecutive_skips=10**9, patch_budget=0)
    with pytest.raises(DataError, match=r"^5 unusable documents in a row, as many as the data"):
        next(loader)


def test_provenance_names_the_records_in_the_last_batch(tmp_path):
    letters = "ABCDEFGHIJKL"  # document i is one letter repeated: any piece of it names it
    documents = [InputDocument(c, c, "t", "CC0", {}, (("text", c * 6),)) for c in letters]
    write_documents(documents, tmp_path / "set", shard_size=200, processor=TINY)
    shards = ShardSet(tmp_path / "set")
    assert len(shards.shards) > 1
    letter_of = {
        shards[p].where: decode_record(shards[p].data)["doc_id"] for p in range(len(shards))
    }
    loader = _loader(tmp_path / "set", seq_len=16, batch_size=2, patch_budget=0)
    for _ in range(4):
        batch = next(loader)
        named = loader.provenance().split(", ")
        assert all(where.startswith(f"{tmp_path / 'set'}/shard-") for where in named)
        used = batch.segment_ids > 0
        seen = TOK.decode(np.concatenate([batch.tokens[used], batch.targets[used]]))
        assert sorted(letter_of[where] for where in named) == sorted(set(seen) & set(letters))


def test_build_warns_about_suspicious_documents_and_strict_skips_them(tmp_path):
    rng = np.random.default_rng(0)
    documents = [
        InputDocument("a:1", "same", "t", "CC0", {}, (("text", "fine"),)),
        InputDocument("a:2", "empty", "t", "CC0", {}, (("text", "  \n"),)),
        InputDocument("a:3", "tiny", "t", "CC0", {}, (("text", "x"),
                                                      ("image", png_bytes(rng, 1, 1)))),
        InputDocument("a:4", "same", "t", "CC0", {}, (("text", "again"),)),
    ]  # fmt: skip
    report = write_documents(documents, tmp_path / "lenient", processor=TINY)
    assert report.documents == 4 and not report.skipped
    warned = dict(report.warnings)
    assert warned["a:2"] == "empty document (no text, no media)"
    assert "image of 1x1 pixels, smaller than one 14x14 patch" in warned["a:3"]
    assert warned["a:4"] == "duplicate id 'same' (first: a:1)"
    strict = write_documents(documents, tmp_path / "strict", processor=TINY, strict=True)
    assert strict.documents == 1
    assert [where for where, _ in strict.skipped] == ["a:2", "a:3", "a:4"]
    assert "duplicate id 'same'" in dict(strict.skipped)["a:4"]
    shutil.rmtree(tmp_path / "strict")
