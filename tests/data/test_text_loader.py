"""PackedTextLoader against a slow, obviously-correct reference built one pair at a time."""

import json

import numpy as np
import pytest

from data.text_corpus import Document, shakespeare_documents
from data.text_loader import PackedTextLoader
from data.tokenizer import ByteTokenizer

KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def _documents(seed: int, count: int, max_len: int) -> list[Document]:
    """Random lowercase texts of length 0..max_len (empty ones must be dropped)."""
    rng = np.random.default_rng(seed)
    texts = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(0, max_len + 1)))
        for _ in range(count)
    ]
    return [Document(f"doc-{i}", "test", "none", text) for i, text in enumerate(texts)]


def _reference_rows(documents, seed, seq_len, num_rows):
    """Rows of (token, target, segment_id, position), walking documents pair by pair."""
    tokenizer = ByteTokenizer()
    encoded = [
        tokenizer.encode(d.text, add_bos=True, add_eos=True).tolist() for d in documents if d.text
    ]
    pairs = []
    epoch = 0
    while len(pairs) < num_rows * seq_len:
        for d in np.random.default_rng((seed, epoch)).permutation(len(encoded)):
            ids = encoded[d]
            pairs += [(ids[i], ids[i + 1], i == 0) for i in range(len(ids) - 1)]
        epoch += 1
    rows = []
    for r in range(num_rows):
        row = []
        for column, (token, target, doc_start) in enumerate(pairs[r * seq_len : (r + 1) * seq_len]):
            if column == 0:
                segment, position = 1, 0
            elif doc_start:
                segment, position = segment + 1, 0
            else:
                position += 1
            row.append((token, target, segment, position))
        rows.append(row)
    return np.array(rows, dtype=np.int64)  # [rows, S, 4]


def _take(loader, num_batches):
    return [next(loader) for _ in range(num_batches)]


def _stack(batches, key):
    return np.concatenate([getattr(b, key) for b in batches])


def test_packed_text_loader_matches_reference():
    documents = _documents(seed=1, count=30, max_len=50)
    seq_len, batch_size, seed = 16, 3, 7
    loader = PackedTextLoader(
        documents, ByteTokenizer(), seq_len=seq_len, batch_size=batch_size, seed=seed
    )
    batches = _take(loader, 40)  # 1920 positions: several epochs of ~800 pairs
    assert 40 * batch_size * seq_len > 2 * loader.tokens_per_epoch
    reference = _reference_rows(documents, seed, seq_len, 40 * batch_size)
    for i, key in enumerate(KEYS[:4]):
        np.testing.assert_array_equal(_stack(batches, key), reference[..., i], err_msg=key)
    for batch in batches:
        for key in KEYS[:4]:
            assert (
                getattr(batch, key).shape == (batch_size, seq_len)
                and getattr(batch, key).dtype == np.int32
            )
        assert batch.loss_mask.dtype == np.float32 and (batch.loss_mask == 1.0).all()
        assert batch.modality is None and batch.vision is None  # text only: no optional parts


def test_packed_text_loader_targets_are_next_token_of_same_document():
    tokenizer = ByteTokenizer()
    loader = PackedTextLoader(
        _documents(seed=2, count=20, max_len=40), tokenizer, seq_len=12, batch_size=4, seed=0
    )
    batches = _take(loader, 30)
    tokens, targets, segments = (_stack(batches, k) for k in KEYS[:3])
    same_segment = segments[:, 1:] == segments[:, :-1]
    np.testing.assert_array_equal(targets[:, :-1][same_segment], tokens[:, 1:][same_segment])
    # Where a segment ends inside a row its document ended: the target is eos, the next is bos.
    ends = ~same_segment
    assert (targets[:, :-1][ends] == tokenizer.eos_id).all()
    assert (tokens[:, 1:][ends] == tokenizer.bos_id).all()
    assert (targets != tokenizer.bos_id).all() and (tokens != tokenizer.eos_id).all()


def test_packed_text_loader_segments_and_positions_restart():
    loader = PackedTextLoader(
        _documents(seed=3, count=25, max_len=70), ByteTokenizer(), seq_len=20, batch_size=2, seed=5
    )
    batches = _take(loader, 40)
    segments, positions = _stack(batches, "segment_ids"), _stack(batches, "positions")
    assert (segments[:, 0] == 1).all()
    step = np.diff(segments, axis=1)
    assert np.isin(step, [0, 1]).all()  # 1, 2, 3, ... with no gaps
    assert (positions[:, 1:][step == 1] == 0).all()
    assert (positions[:, 0] == 0).all()  # a piece continued from the previous row restarts at 0
    inside = np.diff(positions, axis=1)[step == 0]
    assert (inside == 1).all()


def test_packed_text_loader_epoch_inputs_are_permuted_documents():
    tokenizer = ByteTokenizer()
    documents = _documents(seed=4, count=15, max_len=60)
    documents.insert(3, Document("empty", "test", "none", ""))
    seq_len, batch_size, seed = 8, 2, 11
    loader = PackedTextLoader(
        documents, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed
    )
    kept = [d for d in documents if d.text]
    assert loader.num_documents == len(kept) < len(documents)
    order = np.random.default_rng((seed, 0)).permutation(len(kept))
    expected = np.concatenate(
        [tokenizer.encode(kept[d].text, add_bos=True) for d in order]
    )  # inputs: every token but the final eos
    assert loader.tokens_per_epoch == len(expected)
    num_batches = len(expected) // (seq_len * batch_size) + 1  # into epoch 1
    inputs = _stack(_take(loader, num_batches), "tokens").reshape(-1)
    np.testing.assert_array_equal(inputs[: len(expected)], expected)
    # The tail continues with epoch 1, which starts with a new document.
    assert inputs[len(expected)] == tokenizer.bos_id


def test_packed_text_loader_is_deterministic():
    documents = _documents(seed=5, count=20, max_len=40)
    make = lambda seed: PackedTextLoader(
        documents, ByteTokenizer(), seq_len=16, batch_size=2, seed=seed
    )
    first, second, other = make(3), make(3), make(4)
    a, b, c = _take(first, 10), _take(second, 10), _take(other, 10)
    for key in KEYS:
        np.testing.assert_array_equal(_stack(a, key), _stack(b, key))
    assert not np.array_equal(_stack(a, "tokens"), _stack(c, "tokens"))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_packed_text_loader_restore_continues_exactly(seed):
    # ~300 pairs per epoch, 32 per batch: the 5 batches after the 7th cross into epoch 1.
    documents = _documents(seed=6, count=16, max_len=40)
    make = lambda: PackedTextLoader(documents, ByteTokenizer(), seq_len=16, batch_size=2, seed=seed)
    loader = make()
    assert 7 * 32 < loader.tokens_per_epoch < 12 * 32
    _take(loader, 7)
    state = json.loads(json.dumps(loader.state()))
    expected = _take(loader, 5)
    restored = make()
    _take(restored, 2)  # restore must overwrite progress, not add to it
    restored.restore(state)
    for want, got in zip(expected, _take(restored, 5)):
        for key in KEYS:
            np.testing.assert_array_equal(getattr(got, key), getattr(want, key), err_msg=key)
    assert restored.epoch == loader.epoch == 1


def test_packed_text_loader_restore_mid_document():
    documents = [
        Document("long", "test", "none", "x" * 500),
        Document("short", "test", "none", "y"),
    ]
    make = lambda: PackedTextLoader(documents, ByteTokenizer(), seq_len=16, batch_size=2, seed=0)
    loader = make()
    _take(loader, 7)
    state = loader.state()
    expected = _take(loader, 5)
    assert expected[0].positions[0, 0] == 0 and expected[0].tokens[0, 0] != 256  # mid-doc
    restored = make()
    restored.restore(state)
    for want, got in zip(expected, _take(restored, 5)):
        for key in KEYS:
            np.testing.assert_array_equal(getattr(got, key), getattr(want, key), err_msg=key)


def test_packed_text_loader_restore_with_other_batch_size_continues_rows():
    documents = _documents(seed=7, count=10, max_len=30)
    loader = PackedTextLoader(documents, ByteTokenizer(), seq_len=8, batch_size=4, seed=1)
    _take(loader, 3)
    state = loader.state()
    expected = np.concatenate([b.tokens for b in _take(loader, 2)])
    smaller = PackedTextLoader(documents, ByteTokenizer(), seq_len=8, batch_size=2, seed=1)
    smaller.restore(state)
    np.testing.assert_array_equal(_stack(_take(smaller, 4), "tokens"), expected)


def test_packed_text_loader_process_blocks_make_up_the_global_batch_and_share_one_state():
    documents = _documents(seed=8, count=12, max_len=30)
    make = lambda index, count: PackedTextLoader(
        documents, ByteTokenizer(), seq_len=8, batch_size=6, seed=2,
        shard_index=index, shard_count=count,
    )  # fmt: skip
    whole, blocks = make(0, 1), [make(i, 3) for i in range(3)]
    for _ in range(4):
        batch, pieces = next(whole), [next(block) for block in blocks]
        for key in KEYS:
            np.testing.assert_array_equal(
                np.concatenate([getattr(p, key) for p in pieces]), getattr(batch, key)
            )
    assert all(block.state() == whole.state() for block in blocks)  # global rows: any count resumes


def test_packed_text_loader_rejects_a_block_that_does_not_split_the_batch():
    with pytest.raises(ValueError, match="do not split"):
        PackedTextLoader(
            _documents(seed=8, count=4, max_len=30), ByteTokenizer(), seq_len=8, batch_size=6,
            seed=0, shard_index=0, shard_count=4,
        )  # fmt: skip


def test_packed_text_loader_rejects_malformed_state():
    documents = _documents(seed=8, count=10, max_len=30)
    loader = PackedTextLoader(documents, ByteTokenizer(), seq_len=8, batch_size=2, seed=1)
    good = loader.state()
    bad_states = [
        None,
        {k: v for k, v in good.items() if k != "rows_emitted"},
        {**good, "extra": 1},
        {**good, "rows_emitted": -1},
        {**good, "rows_emitted": 1.5},
        {**good, "rows_emitted": True},
        {**good, "seed": 2},
        {**good, "seq_len": "8"},
        {**good, "corpus_digest": "0" * 16},
        PackedTextLoader(
            _documents(seed=9, count=10, max_len=30),
            ByteTokenizer(),
            seq_len=8,
            batch_size=2,
            seed=1,
        ).state(),
    ]
    for state in bad_states:
        with pytest.raises(ValueError, match="state"):
            loader.restore(state)
    assert loader.state() == good


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seq_len": 1, "batch_size": 2, "seed": 0}, "seq_len"),
        ({"seq_len": 8, "batch_size": 0, "seed": 0}, "batch_size"),
        ({"seq_len": 8, "batch_size": 2, "seed": -1}, "seed"),
    ],
)
def test_packed_text_loader_validates_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackedTextLoader(_documents(seed=0, count=3, max_len=10), ByteTokenizer(), **kwargs)


def test_packed_text_loader_rejects_all_empty_documents():
    empty = [Document("a", "test", "none", ""), Document("b", "test", "none", "")]
    with pytest.raises(ValueError, match="empty"):
        PackedTextLoader(empty, ByteTokenizer(), seq_len=8, batch_size=2, seed=0)


def test_packed_text_loader_shakespeare_batches():
    tokenizer = ByteTokenizer()
    loader = PackedTextLoader(shakespeare_documents(), tokenizer, seq_len=256, batch_size=8, seed=0)
    assert loader.num_documents > 500 and loader.tokens_per_epoch > 5_000_000
    batch = next(loader)
    assert batch.tokens[0, 0] == tokenizer.bos_id  # every epoch starts with a document
    assert tokenizer.decode(batch.tokens[0, 1:3]) == "# "
