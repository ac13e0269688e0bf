"""The query-tiled XLA attention and MSA against the O(S²) references: values, gradients, memory.

Random inputs (never zeros), lengths that are not multiples of the block size or of the query tile,
batch > 1, packed documents, several (block_size, topk_blocks, local_blocks) settings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import xla as attention_xla
from pallas_kernels.attention.reference import document_causal_mask, gqa_attention
from pallas_kernels.msa import reference, xla

F32_TOLERANCE = 1e-5
SETTINGS = [  # (block_size, topk_blocks, local_blocks, query_tile)
    (4, 2, 1, 8),
    (4, 3, 2, 5),
    (8, 2, 1, 16),
    (3, 4, 1, 7),
]


def inputs(seq=37, batch=2, heads=4, kv_heads=2, head_dim=8, index_dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    index_q = jax.random.normal(keys[3], (batch, seq, kv_heads, index_dim))
    index_k = jax.random.normal(keys[4], (batch, seq, index_dim))
    # row 0: two documents (the second starts mid-block) and right padding; row 1: one document
    first = 17
    segments = np.ones((batch, seq), np.int32)
    segments[0, first:] = 2
    segments[0, seq - 3 :] = 0
    positions = np.tile(np.arange(seq), (batch, 1))
    positions[0, first:] = np.arange(seq - first)
    positions[0, seq - 3 :] = np.arange(3)
    return q, k, v, index_q, index_k, jnp.asarray(segments), jnp.asarray(positions)


def same_sets(a, b):
    return np.array_equal(np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1))


@pytest.mark.parametrize("block_size, topk, local, tile", SETTINGS)
def test_top_blocks_matches_reference(block_size, topk, local, tile):
    _, _, _, index_q, index_k, segments, positions = inputs()
    kwargs = dict(block_size=block_size, topk_blocks=topk, local_blocks=local)
    expected = reference.top_blocks(index_q, index_k, segments, positions, **kwargs)
    got = xla.top_blocks(index_q, index_k, segments, positions, **kwargs, query_tile=tile)
    assert got.shape == expected.shape
    assert same_sets(got, expected)
    assert (np.asarray(got) == -1).any()  # early queries really have fewer than k blocks


@pytest.mark.parametrize("block_size, topk, local, tile", SETTINGS)
def test_sparse_attention_and_kl_match_reference(block_size, topk, local, tile):
    q, k, v, index_q, index_k, segments, positions = inputs()
    blocks = reference.top_blocks(
        index_q, index_k, segments, positions, block_size=block_size, topk_blocks=topk,
        local_blocks=local,
    )  # fmt: skip
    out, kl = xla.sparse_attention(
        q,
        k,
        v,
        blocks,
        segments,
        block_size=block_size,
        student=(index_q, index_k),
        query_tile=tile,
    )
    expected = reference.sparse_attention(q, k, v, blocks, segments, block_size=block_size)
    expected_kl = reference.indexer_kl(
        q, k, index_q, index_k, blocks, segments, block_size=block_size
    )
    np.testing.assert_allclose(out, expected, atol=F32_TOLERANCE)
    np.testing.assert_allclose(kl, expected_kl, atol=F32_TOLERANCE)
    assert float(kl.min()) >= -F32_TOLERANCE and float(kl.max()) > 0.05  # a KL, and not trivial
    out_only, none = xla.sparse_attention(
        q, k, v, blocks, segments, block_size=block_size, query_tile=tile
    )
    assert none is None and np.array_equal(out_only, out)


@pytest.mark.parametrize("block_size, topk, local, tile", SETTINGS[:2])
def test_sparse_attention_gradients_match_reference(block_size, topk, local, tile):
    q, k, v, index_q, index_k, segments, positions = inputs()
    blocks = reference.top_blocks(
        index_q, index_k, segments, positions, block_size=block_size, topk_blocks=topk,
        local_blocks=local,
    )  # fmt: skip
    weights = jax.random.normal(jax.random.key(9), q.shape)

    def loss_reference(q, k, v, index_q, index_k):
        out = reference.sparse_attention(q, k, v, blocks, segments, block_size=block_size)
        kl = reference.indexer_kl(q, k, index_q, index_k, blocks, segments, block_size=block_size)
        return (out * weights).sum() + kl.sum()

    def loss_xla(q, k, v, index_q, index_k):
        out, kl = xla.sparse_attention(
            q, k, v, blocks, segments, block_size=block_size, student=(index_q, index_k),
            query_tile=tile,
        )  # fmt: skip
        return (out * weights).sum() + kl.sum()

    args = (q, k, v, index_q, index_k)
    expected = jax.grad(loss_reference, argnums=range(5))(*args)
    got = jax.grad(loss_xla, argnums=range(5))(*args)
    for name, g, e in zip(("q", "k", "v", "index_q", "index_k"), got, expected):
        np.testing.assert_allclose(g, e, atol=1e-4, err_msg=name)
        assert float(jnp.abs(e).max()) > 1e-3, name  # every input really gets a gradient


def test_kl_gradient_never_reaches_the_attention_inputs():
    q, k, v, index_q, index_k, segments, positions = inputs()
    blocks = reference.top_blocks(
        index_q, index_k, segments, positions, block_size=4, topk_blocks=2, local_blocks=1
    )

    def kl_only(q, k, v):
        return xla.sparse_attention(
            q, k, v, blocks, segments, block_size=4, student=(index_q, index_k)
        )[1].sum()

    for g in jax.grad(kl_only, argnums=(0, 1, 2))(q, k, v):
        assert not jnp.any(g)


@pytest.mark.parametrize("tile", [5, 16, 64])
def test_dense_attention_with_kl_matches_reference(tile):
    q, k, v, index_q, index_k, segments, _ = inputs()
    out, kl = attention_xla.dense_attention(
        q, k, v, segments, student=(index_q, index_k), query_tile=tile
    )
    np.testing.assert_allclose(
        out,
        gqa_attention(q, k, v, document_causal_mask(segments)[:, None, None]),
        atol=F32_TOLERANCE,
    )
    expected_kl = reference.indexer_kl(q, k, index_q, index_k, None, segments, block_size=4)
    np.testing.assert_allclose(kl, expected_kl, atol=F32_TOLERANCE)

    def loss(fn_out):
        return (fn_out[0] ** 2).sum() + fn_out[1].sum()

    got = jax.grad(
        lambda *a: loss(
            attention_xla.dense_attention(*a[:3], segments, student=a[3:], query_tile=tile)
        ),
        argnums=range(5),
    )(q, k, v, index_q, index_k)

    def reference_loss(q, k, v, index_q, index_k):
        out = gqa_attention(q, k, v, document_causal_mask(segments)[:, None, None])
        return (out**2).sum() + reference.indexer_kl(
            q, k, index_q, index_k, None, segments, block_size=4
        ).sum()

    expected = jax.grad(reference_loss, argnums=range(5))(q, k, v, index_q, index_k)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-4)


def test_sparse_equals_dense_when_every_block_is_selected():
    q, k, v, index_q, index_k, segments, positions = inputs(seq=24)
    blocks = xla.top_blocks(
        index_q, index_k, segments, positions, block_size=4, topk_blocks=6, local_blocks=1
    )
    sparse_out, sparse_kl = xla.sparse_attention(
        q, k, v, blocks, segments, block_size=4, student=(index_q, index_k)
    )
    dense_out, dense_kl = attention_xla.dense_attention(
        q, k, v, segments, student=(index_q, index_k)
    )
    np.testing.assert_allclose(sparse_out, dense_out, atol=F32_TOLERANCE)
    np.testing.assert_allclose(sparse_kl, dense_kl, atol=F32_TOLERANCE)


@pytest.mark.parametrize("block_size, topk, local, tile", SETTINGS[:3])
def test_block_recall_matches_reference_and_is_one_for_the_teachers_choice(
    block_size, topk, local, tile
):
    q, k, v, index_q, index_k, segments, positions = inputs()
    blocks = reference.top_blocks(
        index_q, index_k, segments, positions, block_size=block_size, topk_blocks=topk,
        local_blocks=local,
    )  # fmt: skip
    got = xla.block_recall(q, k, blocks, segments, block_size=block_size, query_tile=tile)
    expected = reference.block_recall(q, k, blocks, segments, block_size=block_size)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert 0 < float(got.mean()) < 1
    # an indexer that scores keys exactly as attention does (one head per group, G = 1) selects
    # the teacher's blocks whenever local forcing agrees: recall is 1 with top-k = all blocks
    everything = reference.top_blocks(
        index_q, index_k, segments, positions, block_size=block_size, topk_blocks=64, local_blocks=1
    )
    assert np.allclose(xla.block_recall(q, k, everything, segments, block_size=block_size), 1.0)


@pytest.mark.slow
def test_memory_grows_linearly_with_sequence_length():
    """Compiled forward+backward memory at S and 2S: ×2 for the XLA path, ×4 for the reference."""

    def compiled_bytes(loss, seq):
        shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
        ints = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        args = (
            shape(1, seq, 4, 16),
            shape(1, seq, 2, 16),
            shape(1, seq, 2, 16),
            shape(1, seq, 2, 16),
            shape(1, seq, 16),
            ints,
            ints,
        )
        grad = jax.jit(jax.grad(loss, argnums=range(5)))
        memory = grad.lower(*args).compile().memory_analysis()
        return (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        )

    def tiled(q, k, v, index_q, index_k, segments, positions):
        blocks = xla.top_blocks(
            index_q, index_k, segments, positions, block_size=16, topk_blocks=4, local_blocks=1
        )
        out, kl = xla.sparse_attention(
            q, k, v, blocks, segments, block_size=16, student=(index_q, index_k)
        )
        return (out**2).sum() + kl.sum()

    def dense_tiled(q, k, v, index_q, index_k, segments, positions):
        out, kl = attention_xla.dense_attention(q, k, v, segments, student=(index_q, index_k))
        return (out**2).sum() + kl.sum()

    def quadratic(q, k, v, index_q, index_k, segments, positions):
        blocks = reference.top_blocks(
            index_q, index_k, segments, positions, block_size=16, topk_blocks=4, local_blocks=1
        )
        out = reference.sparse_attention(q, k, v, blocks, segments, block_size=16)
        return (out**2).sum() + reference.indexer_kl(
            q, k, index_q, index_k, blocks, segments, block_size=16
        ).sum()

    for loss in (tiled, dense_tiled):
        ratio = compiled_bytes(loss, 4096) / compiled_bytes(loss, 2048)
        assert 1.8 < ratio < 2.2, (loss.__name__, ratio)
    assert compiled_bytes(quadratic, 4096) / compiled_bytes(quadratic, 2048) > 3.5
