"""The inverted selection the MSA kernels walk: every valid selection exactly once, sorted by the
block it chose (then by query), segments covering each block's list in order, chunk counts right."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.msa import block_lists


def random_selection(seed=0, batch=2, window=23, heads=2, topk=3, blocks=6):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(blocks)[:topk] for _ in range(batch * window * heads)])
    ids = ids.reshape(batch, window, heads, topk).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1  # unused slots
    positions = np.tile(np.arange(window), (batch, 1)).astype(np.int32)
    positions[0, 9:] = np.arange(window - 9)  # a second document starting at slot offset + 9
    return jnp.asarray(ids), jnp.asarray(positions)


@pytest.mark.parametrize("chunk_queries, segment_chunks", [(2, 2), (4, 1), (8, 16)])
def test_block_lists_cover_every_selection_once_in_block_then_query_order(
    chunk_queries, segment_chunks
):
    ids, positions = random_selection()
    offset, seq, block = 5, 40, 4
    lists = block_lists.build(
        ids,
        positions,
        jnp.int32(offset),
        seq=seq,
        block_size=block,
        chunk_queries=chunk_queries,
        segment_chunks=segment_chunks,
    )
    batch, window, heads, topk = ids.shape
    flat = np.asarray(ids).reshape(-1)
    valid = flat >= 0
    entries, keys = np.asarray(lists.entries), np.asarray(lists.keys)
    assert sorted(entries.tolist()) == list(range(flat.size))  # a permutation of the slots
    assert (np.asarray(lists.sorted_position)[entries] == np.arange(flat.size)).all()
    count = int(valid.sum())
    assert (keys[count:] == block_lists.INVALID).all() and not valid[entries[count:]].any()
    # the key of each entry: (row, head) and the slot of the chosen block's first key
    b, i, h = (
        entries // (window * heads * topk),
        entries // (heads * topk) % window,
        entries // topk % heads,
    )
    start = offset + i - np.asarray(positions)[b, i] + flat[entries] * block
    expected = (b * heads + h) * 2 * seq + seq + start
    np.testing.assert_array_equal(keys[:count], expected[:count])
    assert (np.diff(keys[:count]) >= 0).all()
    same_block = np.diff(keys[:count]) == 0
    assert (np.diff(i[:count])[same_block] > 0).all()  # within a block, by query

    # segments: each starts a block's list or continues it after segment_chunks chunks, and their
    # chunks cover every valid entry exactly once
    num = int(lists.num_segments[0])
    starts = np.asarray(lists.segment_starts)[:num]
    entries = np.asarray(lists.segment_entries)[:num]
    sizes = -(-entries // chunk_queries)  # chunks, as the kernels derive them
    assert (sizes >= 1).all() and (sizes <= segment_chunks).all()
    covered = np.zeros(flat.size, int)
    for start, size, held in zip(starts, sizes, entries):
        in_segment = 0
        for chunk in range(size):
            first = start + chunk * chunk_queries
            rows = np.arange(first, min(first + chunk_queries, flat.size))
            rows = rows[keys[rows] == keys[start]]
            assert rows.size > 0  # no empty chunk
            covered[rows] += 1
            in_segment += rows.size
        assert held == in_segment  # the entries its chunks hold
    assert (covered[:count] == 1).all() and (covered[count:] == 0).all()


def test_by_selection_returns_values_to_their_slots():
    ids, positions = random_selection(seed=1)
    lists = block_lists.build(ids, positions, jnp.int32(0), seq=30, block_size=4,
                              chunk_queries=2, segment_chunks=2)  # fmt: skip
    per_entry = jnp.asarray(lists.entries, jnp.float32)[:, None] * jnp.ones((1, 3))
    back = block_lists.by_selection(per_entry, lists, ids.shape)
    assert back.shape == (*ids.shape, 3)
    np.testing.assert_array_equal(back[..., 0].reshape(-1), np.arange(ids.size))


def test_selection_sums_add_each_querys_valid_selections_over_parts():
    rng = np.random.default_rng(2)
    shape, rows_count = (2, 5, 3, 4), 50  # [B, W, K, k]; more rows than selections
    shares = rng.standard_normal((2, rows_count, 3, 2)).astype(np.float32)
    rows = rng.integers(0, rows_count, shape).astype(np.int32)
    valid = rng.random(shape) > 0.3
    got = block_lists.selection_sums(
        jnp.asarray(shares, jnp.bfloat16), jnp.asarray(rows), jnp.asarray(valid)
    )
    shares = np.asarray(jnp.asarray(shares, jnp.bfloat16).astype(jnp.float32))
    expected = (shares[:, rows] * valid[None, ..., None, None]).sum(axis=(0, 4))
    assert got.dtype == jnp.float32 and got.shape == (*shape[:3], 3, 2)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_block_keys_that_would_overflow_int32_are_refused():
    with pytest.raises(ValueError, match="int32"):
        block_lists.block_key_range(1024, 1 << 20, 4)
