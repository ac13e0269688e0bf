"""MSA's plain-jnp reference (block selection and sparse attention) on hand-checkable cases.

Why: the MSA kernels are tested against `pallas_kernels/msa/reference.py`, so the reference's
own rules must be pinned first, each on a case small enough to check by hand: -1 padding for
queries with fewer than K visible blocks, block score = max (not mean), local forcing (own block and
L-1 before it, even when they score lowest), no future block, dense causal attention whenever
S <= K·B (spec/m3_architecture.md §3.5), and for packed rows, blocks counted from each document's
first token (MiniMax's `cu_seqlens` layout) with no selection of or attention to another
document's keys (`spec/msa.md` §1).

Layout: scores [B, Hi, S, T]; selections [B, S, Hi, k]; q [B, S, H, Dh]; k, v [B, S, K, Dh].
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import gqa_attention
from pallas_kernels.msa.reference import (
    index_scores,
    select_blocks,
    selection_mask,
    sparse_attention,
)


def _select(scores, *, block_size, topk_blocks, local_blocks=1, segment_ids=None, positions=None):
    """Single-row helper: scores [Hi, S, S] -> (raw ids [S, Hi, k], sets[h][i] of valid ids)."""
    scores = jnp.asarray(scores, jnp.float32)[None]
    seq = scores.shape[-1]
    if segment_ids is None:
        segment_ids = np.ones(seq, np.int32)
    if positions is None:
        positions = np.arange(seq, dtype=np.int32)
    ids = np.asarray(
        select_blocks(
            scores,
            jnp.asarray(segment_ids)[None],
            jnp.asarray(positions)[None],
            block_size=block_size,
            topk_blocks=topk_blocks,
            local_blocks=local_blocks,
        )
    )[0]
    sets = [
        [{int(b) for b in ids[i, h] if b >= 0} for i in range(seq)] for h in range(ids.shape[1])
    ]
    return ids, sets


def _random_scores(heads, seq, seed):
    return np.random.default_rng(seed).normal(0, 1, (heads, seq, seq))


def _qkv(seq, seed, heads=4, kv_heads=2, head_dim=8):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, seq, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, seq, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, seq, kv_heads, head_dim)), jnp.float32)
    return q, k, v


# --------------------------------------------------------------------------------------------------
# select_blocks


def test_select_blocks_pads_early_queries_with_minus_one():
    """B=4, K=2: queries 0-3 see only block 0 -> {0} plus one -1; later queries have no -1."""
    ids, sets = _select(_random_scores(1, 12, seed=0), block_size=4, topk_blocks=2)
    assert ids.shape == (12, 1, 2)
    for i in range(4):
        assert sorted(ids[i, 0].tolist()) == [-1, 0]
    for i in range(4, 8):
        assert sorted(ids[i, 0].tolist()) == [0, 1]
    for i in range(8, 12):
        assert -1 not in ids[i, 0] and 2 in sets[0][i]


def test_select_blocks_width_is_min_of_topk_and_block_count():
    ids, sets = _select(_random_scores(2, 6, seed=1), block_size=4, topk_blocks=5)
    assert ids.shape == (6, 2, 2)  # ceil(6 / 4) = 2 blocks < K = 5
    assert all(sets[h][i] == set(range(i // 4 + 1)) for h in range(2) for i in range(6))


def test_select_blocks_ranks_blocks_by_max_not_mean():
    scores = np.zeros((1, 16, 16))
    scores[0, 15, :12] = [0, 0, 0, 5] + [4, 4, 4, 4] + [1, 1, 1, 1]  # query 15, own block 3
    _, sets = _select(scores, block_size=4, topk_blocks=2)
    assert sets[0][15] == {0, 3}  # block 0's max (5) beats block 1's (4), though its mean is lower


def test_select_blocks_forces_own_block_even_when_it_scores_lowest():
    scores = np.abs(_random_scores(1, 16, seed=2)) + 1.0
    scores[0, :, 12:] = -100.0  # every key of block 3 scores lowest
    scores[0, 13, 4:8] += 10.0  # query 13 prefers block 1 among the others
    _, sets = _select(scores, block_size=4, topk_blocks=2)
    assert sets[0][13] == {1, 3}
    assert all(3 in sets[0][i] for i in range(12, 16))


def test_select_blocks_forces_two_local_blocks():
    scores = np.abs(_random_scores(1, 16, seed=3)) + 1.0
    scores[0, :, 8:] = -100.0  # blocks 2 and 3 score lowest for everyone
    scores[0, 14, 0:4] += 10.0  # query 14 prefers block 0 over block 1
    _, sets = _select(scores, block_size=4, topk_blocks=3, local_blocks=2)
    assert sets[0][14] == {0, 2, 3}
    # Forcing clamps at block 0: a query in block 0 gets {0} and padding, never a negative id.
    ids, sets = _select(scores, block_size=4, topk_blocks=3, local_blocks=2)
    assert sets[0][2] == {0} and sorted(ids[2, 0].tolist()) == [-1, -1, 0]
    # A query in block 1 gets blocks 0 and 1 forced, the third slot is padding.
    assert sets[0][5] == {0, 1} and -1 in ids[5, 0]


def test_select_blocks_never_selects_future_blocks():
    """Future keys score +1e6; S=10 leaves a partial last block."""
    scores = _random_scores(2, 10, seed=4)
    future = np.triu(np.ones((10, 10), bool), k=1)
    scores[:, future] = 1e6
    _, sets = _select(scores, block_size=4, topk_blocks=2)
    for h in range(2):
        for i in range(10):
            assert max(sets[h][i]) <= i // 4 and i // 4 in sets[h][i]


def test_select_blocks_heads_choose_independently():
    scores = np.abs(_random_scores(2, 16, seed=5))
    scores[0, 15, 0:4] += 10.0  # head 0 of query 15 wants block 0, head 1 wants block 2
    scores[1, 15, 8:12] += 10.0
    _, sets = _select(scores, block_size=4, topk_blocks=2)
    assert sets[0][15] == {0, 3} and sets[1][15] == {2, 3}


# --------------------------------------------------------------------------------------------------
# selection_mask and sparse_attention


def test_selection_mask_marks_keys_of_selected_blocks():
    ids = jnp.asarray([[[[0, -1]], [[2, 0]], [[-1, -1]]]], jnp.int32)  # [B=1, S=3, Hi=1, k=2]
    mask = np.asarray(selection_mask(ids, jnp.arange(10)[None], block_size=4))  # 0-3, 4-7, 8-9
    assert mask.shape == (1, 1, 3, 10)
    expected = np.zeros((3, 10), bool)
    expected[0, 0:4] = True
    expected[1, 0:4] = expected[1, 8:10] = True
    np.testing.assert_array_equal(mask[0, 0], expected)


@pytest.mark.parametrize("seq", [16, 13])
def test_sparse_attention_is_dense_causal_when_seq_fits_in_topk_blocks(seq):
    """S <= K·B (B=4, K=4): every causal block is selected, so MSA = causal GQA attention."""
    q, k, v = _qkv(seq, seed=6)
    scores = jnp.asarray(_random_scores(2, seq, seed=7), jnp.float32)[None]
    segments, positions = jnp.ones((1, seq), jnp.int32), jnp.arange(seq)[None]
    ids = select_blocks(scores, segments, positions, block_size=4, topk_blocks=4, local_blocks=1)
    out, _ = sparse_attention(q, k, v, ids, segments, positions, block_size=4)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(gqa_attention(q, k, v, causal)), rtol=1e-6, atol=1e-6
    )


def test_sparse_attention_matches_explicit_block_mask():
    """S=21 > K·B: each query head h attends to the keys of index head h // G's blocks, causally."""
    seq, heads, kv_heads, head_dim = 21, 4, 2, 8
    q, k, v = _qkv(seq, seed=8)
    ids, sets = _select(_random_scores(kv_heads, seq, seed=9), block_size=4, topk_blocks=2)
    out = np.asarray(
        sparse_attention(
            q,
            k,
            v,
            jnp.asarray(ids)[None],
            jnp.ones((1, seq)),
            jnp.arange(seq)[None],
            block_size=4,
        )[0]
    )
    dropped = 0
    q, k, v = (np.asarray(a[0], np.float64) for a in (q, k, v))
    for h in range(heads):
        group = h // (heads // kv_heads)
        for i in range(seq):
            keys = [j for j in range(i + 1) if j // 4 in sets[group][i]]
            dropped += len(keys) < i + 1
            logits = k[keys, group] @ q[i, h] / np.sqrt(head_dim)
            probs = np.exp(logits - logits.max())
            expected = probs / probs.sum() @ v[keys, group]
            np.testing.assert_allclose(out[0, i, h], expected, rtol=1e-5, atol=1e-6)
    assert dropped > 0  # the selection really removed keys


# --------------------------------------------------------------------------------------------------
# Packed rows: documents never see each other, in selection or in attention.

# Document 1 fills slots 0-9, document 2 slots 10-23. Blocks are counted from each document's first
# token: document 1 has blocks 0 (slots 0-3), 1 (4-7), 2 (8-9); document 2 has blocks 0 (slots
# 10-13), 1 (14-17), 2 (18-21), 3 (22-23) — the row's fixed slots 8-11 hold two documents' blocks.
PACKED_SEGMENTS = np.array([1] * 10 + [2] * 14, np.int32)
PACKED_POSITIONS = np.concatenate([np.arange(10), np.arange(14)]).astype(np.int32)


@pytest.mark.parametrize("local_blocks", [1, 2])
def test_select_blocks_packed_rows_never_score_other_documents(local_blocks):
    scores = _random_scores(2, 24, seed=10)
    scores[:, 10:, :10] += 100.0  # document 1's keys would win every comparison if they leaked
    _, sets = _select(
        scores,
        block_size=4,
        topk_blocks=2,
        local_blocks=local_blocks,
        segment_ids=PACKED_SEGMENTS,
        positions=PACKED_POSITIONS,
    )
    _, alone_sets = _select(scores[:, 10:, 10:], block_size=4, topk_blocks=2,
                                local_blocks=local_blocks)  # fmt: skip
    for h in range(2):
        for i in range(14):
            assert sets[h][10 + i] == alone_sets[h][i], (h, i)
            assert (
                PACKED_POSITIONS[10 + i] // 4 in sets[h][10 + i]
            )  # its own block, counted in doc 2
        # Document 2's first queries (its block 0) have no other visible block: padding only.
        assert sets[h][10] == {0}


@pytest.mark.parametrize("offset", [8, 5, 37])
def test_select_blocks_document_anywhere_in_the_row_selects_as_if_alone(offset):
    """A document packed at slot `offset` (on a block boundary or not) picks the blocks it picks
    alone, with the same ids: blocks are counted from its first token."""
    length = 13
    alone = _random_scores(2, length, seed=11)
    packed = _random_scores(2, offset + length, seed=12)
    packed[:, offset:, offset:] = alone
    segments = np.array([1] * offset + [2] * length, np.int32)
    positions = np.concatenate([np.arange(offset), np.arange(length)]).astype(np.int32)
    for local_blocks in (1, 2):
        kwargs = {"block_size": 4, "topk_blocks": 2, "local_blocks": local_blocks}
        _, packed_sets = _select(packed, segment_ids=segments, positions=positions, **kwargs)
        _, alone_sets = _select(alone, **kwargs)
        for h in range(2):
            for i in range(length):
                assert packed_sets[h][offset + i] == alone_sets[h][i]


def test_sparse_attention_packed_rows_do_not_cross_documents():
    """Changing document 1's keys, values and index keys leaves document 2's outputs unchanged."""
    seq = 24
    q, k, v = _qkv(seq, seed=13)
    rng = np.random.default_rng(14)
    index_q = jnp.asarray(rng.normal(size=(1, seq, 2, 8)), jnp.float32)
    index_k = jnp.asarray(rng.normal(size=(1, seq, 8)), jnp.float32)
    segments, positions = jnp.asarray(PACKED_SEGMENTS)[None], jnp.asarray(PACKED_POSITIONS)[None]

    def run(k, v, index_k):
        scores = index_scores(index_q, index_k)
        ids = select_blocks(
            scores, segments, positions, block_size=4, topk_blocks=2, local_blocks=1
        )
        out, _ = sparse_attention(q, k, v, ids, segments, positions, block_size=4)
        return np.asarray(out), np.asarray(ids)

    out, ids = run(k, v, index_k)
    assert np.any(ids[0, 12:] == 0)  # document-2 queries use its block 0 (slots 10-13)

    def noise(a):  # redraws document 1's slots
        return a.at[:, :10].add(jnp.asarray(rng.normal(0, 5, a[:, :10].shape), a.dtype))

    perturbed, _ = run(noise(k), noise(v), noise(index_k))
    np.testing.assert_allclose(perturbed[0, 10:], out[0, 10:], rtol=0, atol=1e-6)
    assert not np.allclose(perturbed[0, :10], out[0, :10])  # the perturbation was real
    # And each query attends exactly to its document's earlier keys whose document-relative block
    # its kv group selected: softmax attention over that key set, in float64, one query at a time.
    np.testing.assert_allclose(out, _attention_over_selected_keys(q, k, v, ids), atol=1e-5)


def _attention_over_selected_keys(q, k, v, ids, block_size=4):
    """float64 NumPy: out[0, i, h] = softmax over the keys j <= i of i's document whose block
    (PACKED_POSITIONS[j] // block_size) is in ids[0, i, kv group of h]."""
    q, k, v = (np.asarray(a, np.float64)[0] for a in (q, k, v))
    seq, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros_like(q)
    for i in range(seq):
        for h in range(heads):
            kv = h // group
            keys = [
                j
                for j in range(i + 1)
                if PACKED_SEGMENTS[j] == PACKED_SEGMENTS[i]
                and PACKED_POSITIONS[j] // block_size in ids[0, i, kv]
            ]
            logits = k[keys, kv] @ q[i, h] / np.sqrt(head_dim)
            weights = np.exp(logits - logits.max())
            out[i, h] = weights @ v[keys, kv] / weights.sum()
    return out[None]
