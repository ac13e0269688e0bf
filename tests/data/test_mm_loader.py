"""The Grain pipeline: packing invariants, exact resume (workers on), mixtures, sharding, bad data."""
# ruff: noqa: F811 -- the shard-set fixtures are imported from media_fixtures and used as arguments

import json
import logging
import shutil
from collections import Counter

import numpy as np
import pytest
from media_fixtures import (  # noqa: F401 (fixtures)
    TINY,
    broken_record_shards,
    mm_shards,
    text_shards,
)

from data.mm_documents import DataError, DocumentProcessor
from data.mm_loader import MultimodalLoader, ShardSource, modality_counts
from data.shard_reader import ShardSet
from data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
VISION_TOKENS = [TOK.image_id, TOK.video_id, TOK.vision_start_id, TOK.vision_end_id]
S, P, B = 96, 96, 3


def _loader(paths, **overrides):
    settings = {
        "seq_len": S,
        "batch_size": B,
        "patch_budget": P,
        "seed": 3,
        "processor": TINY,
        "shard_index": 0,
        "shard_count": 1,
    }
    settings.update(overrides)
    return MultimodalLoader(paths if isinstance(paths, list) else [paths], **settings)


def _epoch(loader):
    batches = list(loader)
    loader.close()
    return batches


def _pairs_and_patches(batches):
    """Multiset of (input, target) pairs and the float64 sum of all patch rows in use."""
    pairs, total = Counter(), 0.0
    for batch in batches:
        used = batch.segment_ids > 0
        pairs.update(zip(batch.tokens[used].tolist(), batch.targets[used].tolist()))
        total += float(
            batch.vision.patches[batch.vision.patch_segment_ids > 0].astype(np.float64).sum()
        )
    return pairs, total


def _expected_pairs_and_patches(path):
    shards = ShardSet(path)
    process = DocumentProcessor(TOK, TINY, S, P)
    pairs, total = Counter(), 0.0
    for position in range(len(shards)):
        document = process(shards[position])
        pairs.update(zip(document.tokens[:-1].tolist(), document.tokens[1:].tolist()))
        total += float(document.patches.astype(np.float64).sum())
    return pairs, total


def _check_row_invariants(batch):
    for b in range(batch.tokens.shape[0]):
        tokens, targets = batch.tokens[b], batch.targets[b]
        segments, positions = batch.segment_ids[b], batch.positions[b]
        loss, features = batch.loss_mask[b], batch.vision.feature_index[b]
        patch_ids, patch_positions = (
            batch.vision.patch_segment_ids[b],
            batch.vision.patch_positions[b],
        )
        used = segments > 0
        assert used.sum() == np.argmin(np.append(used, False))  # padding only at the end
        assert (np.diff(segments[used]) >= 0).all()
        starts = np.flatnonzero(np.diff(segments, prepend=-1) != 0)
        for start, stop in zip(starts, np.append(starts[1:], len(segments))):
            assert (
                positions[start:stop].tolist() == list(range(stop - start)) or segments[start] == 0
            )
        assert (loss[~used] == 0).all() and (tokens[~used] == TOK.pad_id).all()
        assert (loss[np.isin(targets, VISION_TOKENS)] == 0).all()
        assert (loss[used & ~np.isin(targets, VISION_TOKENS)] == 1).all()
        placeholder = np.isin(tokens, [TOK.image_id, TOK.video_id])
        assert features[placeholder].tolist() == list(range(placeholder.sum()))
        assert (features[~placeholder] == -1).all()
        assert 4 * placeholder.sum() == (patch_ids > 0).sum() <= len(patch_ids)
        assert (batch.modality[b][tokens == TOK.image_id] == 1).all()
        assert (batch.modality[b][tokens == TOK.video_id] == 2).all()
        # Each unit: contiguous ids, complete (t, h, w) grid starting at 0: never split.
        ids = patch_ids[patch_ids > 0]
        assert ids.tolist() == sorted(ids.tolist()) and set(ids) == set(range(1, len(set(ids)) + 1))
        for unit in set(ids.tolist()):
            grid = patch_positions[patch_ids == unit]
            assert grid[0].tolist() == [0, 0, 0]
            assert len(grid) == np.prod(grid.max(axis=0) + 1)
        # All placeholders between one START and END point into one unit.
        for start in np.flatnonzero(tokens == TOK.vision_start_id):
            block = features[
                start + 1 : start + 1 + np.argmax(tokens[start + 1 :] == TOK.vision_end_id)
            ]
            assert len({int(patch_ids[4 * r]) for r in block}) == 1


def test_packing_invariants_and_every_pair_exactly_once(mm_shards):
    batches = _epoch(_loader(mm_shards, num_epochs=1, num_bins=4, batch_size=1))
    assert batches and all(b.tokens.shape == (1, S) for b in batches)
    for batch in batches:
        _check_row_invariants(batch)
    got_pairs, got_total = _pairs_and_patches(batches)
    want_pairs, want_total = _expected_pairs_and_patches(mm_shards)
    assert got_pairs == want_pairs
    assert got_total == pytest.approx(want_total, rel=1e-9)


def test_batch_keys_shapes_and_dtypes(mm_shards):
    batch = next(_loader(mm_shards))
    shapes = {key: (value.shape, value.dtype.name) for key, value in _arrays(batch).items()}
    assert shapes == {
        "tokens": ((B, S), "int32"),
        "targets": ((B, S), "int32"),
        "segment_ids": ((B, S), "int32"),
        "positions": ((B, S), "int32"),
        "loss_mask": ((B, S), "float32"),
        "modality": ((B, S), "int8"),
        "feature_index": ((B, S), "int32"),
        "patches": ((B, P, 1176), "float32"),
        "patch_positions": ((B, P, 3), "int32"),
        "patch_segment_ids": ((B, P), "int32"),
    }


def test_best_fit_fills_rows_at_least_as_well(mm_shards):
    def fill(strategy):
        batches = _epoch(_loader(mm_shards, num_epochs=1, strategy=strategy, num_bins=6))
        return np.mean([(b.segment_ids > 0).mean() for b in batches])

    assert fill("best_fit") >= fill("first_fit") - 0.05


def test_text_only_shards_give_rows_without_patches(text_shards):
    batch = next(_loader(text_shards, patch_budget=0))
    assert batch.vision.patches.shape == (B, 0, 1176)
    assert (batch.vision.feature_index == -1).all() and (batch.modality == 0).all()
    assert (batch.segment_ids > 0).all()  # text packs rows full


def _arrays(batch) -> dict[str, np.ndarray]:
    """Every array of a multimodal batch by field name, the vision part's too."""
    fields = {name: x for name, x in batch._asdict().items() if name != "vision"}
    return {**fields, **batch.vision._asdict()}


def _resume_check(path, num_workers):
    loader = _loader(path, num_workers=num_workers)
    for _ in range(4):
        next(loader)
    state = json.loads(json.dumps(loader.state()))
    expected = [next(loader) for _ in range(3)]
    loader.close()
    resumed = _loader(path, num_workers=num_workers)
    resumed.restore(state)
    for want in expected:
        got, want = _arrays(next(resumed)), _arrays(want)
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    resumed.close()


def test_resume_is_bit_identical_in_process(mm_shards):
    _resume_check(mm_shards, num_workers=0)


@pytest.mark.slow
def test_resume_is_bit_identical_with_worker_processes(mm_shards):
    _resume_check(mm_shards, num_workers=2)


def test_restore_refuses_other_settings(mm_shards):
    state = _loader(mm_shards).state()
    with pytest.raises(ValueError, match="different data or settings"):
        _loader(mm_shards, seed=4).restore(state)


def _first_words(batch):
    """The text after <bos> of every document start in the batch."""
    found = []
    for b, column in zip(*np.nonzero((batch.positions == 0) & (batch.tokens == TOK.bos_id))):
        found.append(TOK.decode(batch.tokens[b, column + 1 : column + 13]))
    return found


def test_mixture_follows_weights(mm_shards, text_shards):
    sources = [ShardSource(str(mm_shards), 0.25), ShardSource(str(text_shards), 0.75)]
    loader = _loader(sources)
    starts = [w for _ in range(30) for w in _first_words(next(loader))]
    text_share = np.mean([w.startswith("text doc") for w in starts])
    assert 0.6 < text_share < 0.9, (text_share, len(starts))


def test_process_shards_are_disjoint_and_complete(text_shards):
    seen = []
    for index in range(2):
        loader = _loader(text_shards, shard_index=index, shard_count=2, num_epochs=1, batch_size=1)
        seen.append({w for batch in _epoch(loader) for w in _first_words(batch)})
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 30


# ---------------------------------------------------------------------------------------------
# Bad data.


def _truncated_copy(source, tmp_path):
    target = tmp_path / "truncated"
    shutil.copytree(source, target)
    shard = sorted(target.glob("shard-*.array_record"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return target, shard.name, ShardSet(source).manifest["shards"][1]["records"]


def test_truncated_shard_skipped_and_counted(mm_shards, tmp_path, caplog):
    path, name, records = _truncated_copy(mm_shards, tmp_path)
    loader = _loader(path, num_epochs=1)
    with caplog.at_level(logging.WARNING, logger="m3jax.data"):
        _epoch(loader)
    assert loader.skipped_documents == records
    assert name in caplog.text and "unreadable shard" in caplog.text


def test_truncated_shard_fails_naming_the_record(mm_shards, tmp_path):
    path, name, _ = _truncated_copy(mm_shards, tmp_path)
    with pytest.raises(DataError, match=rf"{name}#\d+: unreadable shard"):
        _epoch(_loader(path, num_epochs=1, on_error="fail"))


def test_undecodable_record_skip_policy(broken_record_shards):
    loader = _loader(broken_record_shards, num_epochs=1, batch_size=1)
    batches = _epoch(loader)
    assert loader.skipped_documents == 1
    assert sorted(w[:5] for b in batches for w in _first_words(b)) == ["doc 0", "doc 2"]


def test_undecodable_record_fail_policy(broken_record_shards):
    with pytest.raises(
        DataError, match=r"shard-00000.array_record#1: segment 1 \(image\): undecodable"
    ):
        _epoch(_loader(broken_record_shards, num_epochs=1, batch_size=1, on_error="fail"))


def test_unit_larger_than_budget_is_skipped_with_reason(broken_record_shards):
    loader = _loader(broken_record_shards, num_epochs=1, batch_size=1, patch_budget=8)
    with pytest.raises(DataError, match=r"3 unusable documents in a row, as many as the data"):
        _epoch(loader)  # every document skipped: nothing to train on
    with pytest.raises(
        DataError, match=r"array_record#\d: a vision unit of 6 tokens and 16 patches"
    ):
        _epoch(
            _loader(
                broken_record_shards, num_epochs=1, batch_size=1, patch_budget=8, on_error="fail"
            )
        )


def test_modality_counts_exclude_padding(mm_shards):
    batch = next(_loader(mm_shards))
    counts = modality_counts(batch)
    assert sum(counts.values()) == (batch.segment_ids > 0).sum()
    placeholders = np.isin(batch.tokens, [TOK.image_id, TOK.video_id]).sum()
    assert counts["image_tokens"] + counts["video_tokens"] >= placeholders


def test_unexpected_errors_name_the_record(broken_record_shards, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("data.mm_documents.process_image", explode)
    with pytest.raises(DataError, match=r"array_record#\d: unexpected RuntimeError: boom"):
        _epoch(_loader(broken_record_shards, num_epochs=1, batch_size=1))
