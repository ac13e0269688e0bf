"""Every MSA backend against the O(S²) reference: the same tests for the XLA path, the GPU Pallas
kernels (run by Pallas' interpreter on CPU, at sizes the GPU kernels take: powers of two ≥ 16) and
the TPU kernels (Pallas' generic interpreter here; the TPU interpreter, which simulates SMEM, VMEM
and the DMAs of the scalar-prefetch table, in `test_tpu_kernels_in_the_tpu_interpreter`).

Random inputs (never zeros), lengths that are not multiples of the block size, batch > 1, packed
documents (one starting mid-block) and right padding, queries with fewer than k blocks, values and
gradients of all five inputs; tilings small enough that the kernels' multi-segment, multi-window
and split-block paths run.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_values import kernel_calls

from m3jax import stacking
from pallas_kernels.attention import xla as attention_xla
from pallas_kernels.attention.reference import document_causal_mask, gqa_attention
from pallas_kernels.msa import pallas, reference, tpu, tpu_kernels, xla
from pallas_kernels.msa.chunks import Tiling
from pallas_kernels.msa.selection_kernel import Tiling as SelectionTiling
from pallas_kernels.msa.tpu_selection import Tiling as TPUSelectionTiling

F32_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
# Small tilings: chunks of a few queries, segments of two or three chunks (so long block lists
# continue in later segments, whose sums are added atomically), keys of a block in two parts.
SMALL = pallas.Config(
    forward=Tiling(rows=16, segment_chunks=2),
    backward=Tiling(rows=16, segment_chunks=3, key_split=2),
    selection=SelectionTiling(rows=16),
)
# TPU: tiles of 4 queries × 4 heads, tables of at most 5 tiles (several windows per row);
# selection tiles of 8 queries and 2 key blocks (several of each per row).
TPU_SMALL = tpu.Config(
    rows=16, table_entries=100, selection=TPUSelectionTiling(queries=8, key_blocks=2)
)
BACKENDS = {
    "xla": (xla, {}),
    "pallas": (pallas, {"config": SMALL, "interpret": True}),
    "tpu": (tpu, {"config": TPU_SMALL, "interpret": True}),
}
SETTINGS = [(16, 2, 1), (16, 3, 2), (32, 2, 1)]  # (block_size, topk_blocks, local_blocks)
# The TPU backend where a test adds little for it (it repeats what others check of its kernels)
# and costs seconds of interpreter compile: under `slow`.
BUT_TPU_SLOW = [pytest.param(b, marks=pytest.mark.slow) if b == "tpu" else b for b in BACKENDS]
# (backend, *setting) for the first two settings, the TPU backend's second one under `slow`.
TWO_SETTINGS = [
    pytest.param(b, *setting, marks=pytest.mark.slow) if (b, setting) == ("tpu", SETTINGS[1])
    else (b, *setting)
    for b in BACKENDS
    for setting in SETTINGS[:2]
]  # fmt: skip


def inputs(seq=75, batch=2, heads=8, kv_heads=2, head_dim=16, index_dim=16, seed=0):
    """Row 0: a document of 37 slots, one of 35 starting mid-block, 3 padding slots; row 1: one."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    index_q = jax.random.normal(keys[3], (batch, seq, kv_heads, index_dim))
    index_k = jax.random.normal(keys[4], (batch, seq, index_dim))
    first = 37
    segments = np.ones((batch, seq), np.int32)
    segments[0, first:] = 2
    segments[0, seq - 3 :] = 0
    positions = np.tile(np.arange(seq), (batch, 1))
    positions[0, first:] = np.arange(seq - first)
    positions[0, seq - 3 :] = np.arange(3)
    return q, k, v, index_q, index_k, jnp.asarray(segments), jnp.asarray(positions)


def same_sets(a, b):
    return np.array_equal(np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1))


def select(x, block_size, topk, local):
    _, _, _, index_q, index_k, segments, positions = x
    return reference.top_blocks(index_q, index_k, segments, positions, block_size=block_size,
                                topk_blocks=topk, local_blocks=local)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size, topk, local", SETTINGS)
def test_top_blocks_matches_reference(backend, block_size, topk, local):
    module, kwargs = BACKENDS[backend]
    x = inputs()
    _, _, _, index_q, index_k, segments, positions = x
    expected = select(x, block_size, topk, local)
    got = module.top_blocks(index_q, index_k, segments, positions, block_size=block_size,
                            topk_blocks=topk, local_blocks=local, **kwargs)  # fmt: skip
    assert got.shape == expected.shape and got.dtype == jnp.int32
    assert same_sets(got, expected)
    assert (np.asarray(got) == -1).any()  # early queries really have fewer than k blocks


@pytest.mark.parametrize("backend, block_size, topk, local", TWO_SETTINGS)
def test_sparse_attention_and_kl_match_reference(backend, block_size, topk, local):
    module, kwargs = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, block_size, topk, local)
    args = (q, k, v, blocks, segments, positions)
    out, kl = module.sparse_attention(*args, block_size=block_size, student=(index_q, index_k),
                                      **kwargs)  # fmt: skip
    expected, expected_kl = reference.sparse_attention(
        *args, block_size=block_size, student=(index_q, index_k)
    )
    np.testing.assert_allclose(out, expected, atol=F32_TOLERANCE)
    np.testing.assert_allclose(kl, expected_kl, atol=F32_TOLERANCE)
    assert float(kl.min()) >= -F32_TOLERANCE and float(kl.max()) > 0.05  # a KL, and not trivial
    assert not np.allclose(out, reference.dense_attention(q, k, v, segments)[0], atol=1e-3)
    out_only, none = module.sparse_attention(*args, block_size=block_size, **kwargs)
    assert none is None
    np.testing.assert_allclose(out_only, out, atol=F32_TOLERANCE)


def loss_of(module, blocks, segments, positions, block_size, weights, **kwargs):
    """A random linear function of out and the KL, of (q, k, v, index_q, index_k[, kl_sink])."""

    def loss(q, k, v, index_q, index_k, kl_sink=None):
        out, kl = module.sparse_attention(q, k, v, blocks, segments, positions,
                                          block_size=block_size, student=(index_q, index_k),
                                          kl_sink=kl_sink, **kwargs)  # fmt: skip
        return (out * weights).sum() + (kl * weights[..., :1, 0]).sum()

    return loss


@pytest.mark.parametrize("backend, block_size, topk, local", TWO_SETTINGS)
def test_sparse_attention_gradients_match_reference(backend, block_size, topk, local):
    module, kwargs = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, block_size, topk, local)
    weights = jax.random.normal(jax.random.key(9), q.shape)
    args = (q, k, v, index_q, index_k)
    expected = jax.grad(loss_of(reference, blocks, segments, positions, block_size, weights),
                        argnums=range(5))(*args)  # fmt: skip
    got = jax.grad(loss_of(module, blocks, segments, positions, block_size, weights, **kwargs),
                   argnums=range(5))(*args)  # fmt: skip
    for name, g, e in zip(("q", "k", "v", "index_q", "index_k"), got, expected):
        np.testing.assert_allclose(g, e, atol=GRAD_TOLERANCE, err_msg=name)
        assert float(jnp.abs(e).max()) > 1e-3, name  # every input really gets a gradient


@pytest.mark.parametrize("backend", ["reference", *BUT_TPU_SLOW])
def test_a_kl_sink_moves_the_kl_to_its_gradient_and_keeps_the_others(backend):
    """Under `kl_sink` the KL output is zeros, the sink's gradient is the KL, and the inputs'
    gradients (the KL's into the student among them) are those without a sink."""
    module, kwargs = BACKENDS.get(backend, (reference, {}))
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, 16, 2, 1)
    weights = jax.random.normal(jax.random.key(9), q.shape)
    loss = loss_of(module, blocks, segments, positions, 16, weights, **kwargs)
    args = (q, k, v, index_q, index_k)
    value, grads = jax.value_and_grad(loss, argnums=range(5))(*args)
    sink = jnp.zeros(index_q.shape[:3], jnp.float32)
    sunk_value, sunk_grads = jax.value_and_grad(loss, argnums=range(6))(*args, sink)
    _, expected_kl = reference.sparse_attention(q, k, v, blocks, segments, positions,
                                                block_size=16, student=(index_q, index_k))
    np.testing.assert_allclose(sunk_grads[5], expected_kl, atol=F32_TOLERANCE)
    kl_term = (expected_kl * weights[..., :1, 0]).sum()
    np.testing.assert_allclose(sunk_value + kl_term, value, rtol=1e-5)
    for name, g, e in zip(("q", "k", "v", "index_q", "index_k"), sunk_grads, grads):
        np.testing.assert_allclose(g, e, atol=GRAD_TOLERANCE, err_msg=name)
    with pytest.raises(ValueError, match="student"):
        module.sparse_attention(q, k, v, blocks, segments, positions, block_size=16,
                                kl_sink=sink, **kwargs)  # fmt: skip


FORWARD_KERNELS = {"pallas": ("msa_lse", "msa_forward"), "tpu": ("msa_tpu_forward",)}  # KL aside


@pytest.mark.parametrize("backend", FORWARD_KERNELS)
def test_a_remat_policy_saving_the_attention_runs_the_kernels_forward_once(backend):
    """Both kernel backends name their forward's residuals (output SAVED_BY_REMAT, LSEs
    SAVED_BY_ANY_REMAT), so that `model.remat: save_attention` keeps them for the backward
    instead of rerunning the forward kernels, which recomputing everything does."""
    module, kwargs = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, 16, 2, 1)
    loss = loss_of(module, blocks, segments, positions, 16, jnp.ones_like(q), **kwargs)

    def launches(policy):
        grad = jax.grad(jax.checkpoint(loss, policy=policy), argnums=range(5))
        return kernel_calls(jax.make_jaxpr(grad)(q, k, v, index_q, index_k).jaxpr)

    full = launches(jax.checkpoint_policies.nothing_saveable)
    saved = launches(stacking.REMAT_POLICIES["save_attention"])
    for name in FORWARD_KERNELS[backend]:
        assert (full[name], saved[name]) == (2, 1), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_arrays_for_documents_work_under_jit(backend):
    """Segment ids and positions may be NumPy constants of a jitted function (as a host batch
    closed over): the backends must not index them with traced values."""
    module, kwargs = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = inputs()
    segments, positions = np.asarray(segments), np.asarray(positions)

    @jax.jit
    def layer(q, k, v, index_q, index_k):
        blocks = module.top_blocks(index_q, index_k, segments, positions, block_size=16,
                                   topk_blocks=2, local_blocks=1, **kwargs)  # fmt: skip
        return module.sparse_attention(q, k, v, blocks, segments, positions, block_size=16,
                                       student=(index_q, index_k), **kwargs)  # fmt: skip

    out, kl = layer(q, k, v, index_q, index_k)
    expected = select((q, k, v, index_q, index_k, segments, positions), 16, 2, 1)
    expected = reference.sparse_attention(q, k, v, expected, segments, positions, block_size=16,
                                          student=(index_q, index_k))  # fmt: skip
    np.testing.assert_allclose(out, expected[0], atol=F32_TOLERANCE)
    np.testing.assert_allclose(kl, expected[1], atol=F32_TOLERANCE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_gradient_never_reaches_the_attention_inputs(backend):
    module, kwargs = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, 16, 2, 1)

    def kl_only(q, k, v):
        return module.sparse_attention(q, k, v, blocks, segments, positions, block_size=16,
                                       student=(index_q, index_k), **kwargs)[1].sum()  # fmt: skip

    for g in jax.grad(kl_only, argnums=(0, 1, 2))(q, k, v):
        assert not jnp.any(g)


@pytest.mark.parametrize(
    "backend, offset",
    [(b, o) for b in BACKENDS for o in (37, 32) if (b, o) != ("tpu", 32)]
    + [pytest.param("tpu", 32, marks=pytest.mark.slow)],
)
def test_document_packed_at_an_offset_equals_the_document_alone(backend, offset):
    """Blocks count from the document's first token: a document packed after `offset` slots of
    another gets the same selection, output and KL as alone in a row (issue: packed documents
    must not depend on where the packer put them)."""
    module, kwargs = BACKENDS[backend]
    length, block_size, msa = 45, 16, dict(block_size=16, topk_blocks=2, local_blocks=1)
    q, k, v, index_q, index_k, _, _ = inputs(seq=offset + length, batch=1, seed=3)
    segments = jnp.asarray([[1] * offset + [2] * length], jnp.int32)
    positions = jnp.asarray([list(range(offset)) + list(range(length))], jnp.int32)

    def run(q, k, v, index_q, index_k, segments, positions):
        blocks = module.top_blocks(index_q, index_k, segments, positions, **msa, **kwargs)
        out, kl = module.sparse_attention(q, k, v, blocks, segments, positions,
                                          block_size=block_size, student=(index_q, index_k),
                                          **kwargs)  # fmt: skip
        return blocks, out, kl

    packed = run(q, k, v, index_q, index_k, segments, positions)
    tail = lambda a: a[:, offset:]  # noqa: E731
    alone = run(*map(tail, (q, k, v, index_q, index_k, segments, positions)))
    width = alone[0].shape[-1]
    assert same_sets(tail(packed[0])[..., :width], alone[0])
    assert (np.asarray(tail(packed[0])[..., width:]) == -1).all()
    np.testing.assert_allclose(tail(packed[1]), alone[1], atol=F32_TOLERANCE)
    np.testing.assert_allclose(tail(packed[2]), alone[2], atol=F32_TOLERANCE)


@pytest.mark.parametrize("backend", BUT_TPU_SLOW)
def test_sparse_equals_dense_when_every_block_is_selected(backend):
    module, kwargs = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = inputs(seq=60)
    blocks = module.top_blocks(index_q, index_k, segments, positions, block_size=16,
                               topk_blocks=4, local_blocks=1, **kwargs)  # fmt: skip
    sparse = module.sparse_attention(q, k, v, blocks, segments, positions, block_size=16,
                                     student=(index_q, index_k), **kwargs)  # fmt: skip
    dense = module.dense_attention(q, k, v, segments, student=(index_q, index_k))
    for got, expected in zip(sparse, dense):
        np.testing.assert_allclose(got, expected, atol=F32_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("tiling", ["windows", "whole blocks", "one segment per block"])
def test_kernel_tilings_agree(tiling):
    """Several query windows (dK/dV summed across them), unsplit key blocks, and segments long
    enough that no block list continues: the same values and gradients."""
    config = {
        # 40 KB of per-entry shares (3 KB a query): windows of 16 queries, 5 a row
        "windows": dataclasses.replace(SMALL, partial_bytes=40_000, min_window=16),
        "whole blocks": dataclasses.replace(SMALL, backward=Tiling(rows=16, key_split=1)),
        "one segment per block": dataclasses.replace(
            SMALL,
            forward=Tiling(rows=32, segment_chunks=64),
            backward=Tiling(rows=32, segment_chunks=64),
        ),
    }[tiling]
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, 16, 3, 1)
    weights = jax.random.normal(jax.random.key(5), q.shape)
    args = (q, k, v, index_q, index_k)

    def values_and_grads(**kwargs):
        loss = loss_of(pallas, blocks, segments, positions, 16, weights, interpret=True, **kwargs)
        return jax.value_and_grad(loss, argnums=range(5))(*args)

    value, grads = values_and_grads(config=config)
    expected_value, expected_grads = values_and_grads(config=SMALL)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, atol=GRAD_TOLERANCE)


def test_kernels_refuse_what_they_cannot_run():
    q, k, v, index_q, index_k, segments, positions = inputs()
    bf16 = q.astype(jnp.bfloat16)
    assert "block_size=12" in pallas.unsupported_reason(bf16, k, index_q, block_size=12,
                                                        interpret=False)  # fmt: skip
    assert "key_split=2" in pallas.unsupported_reason(q, k, index_q, block_size=15, config=SMALL,
                                                      interpret=True)  # fmt: skip
    wide = pallas.Config(forward=Tiling(rows=20))
    assert "rows=20" in pallas.unsupported_reason(q, k, index_q, block_size=16, config=wide,
                                                  interpret=True)  # fmt: skip
    assert "float32" in pallas.unsupported_reason(q, k, index_q, block_size=16, interpret=False)
    assert pallas.unsupported_reason(bf16, k, index_q, block_size=32, interpret=False) == ""
    assert "power of two" in pallas.unsupported_reason(bf16, k, index_q, block_size=16,
                                                       config=SMALL, interpret=False)  # fmt: skip
    blocks = select((q, k, v, index_q, index_k, segments, positions), 16, 2, 1)
    with pytest.raises(ValueError, match="block_size=15"):
        pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=15, config=SMALL,
                                interpret=True)  # fmt: skip


def test_tpu_kernels_in_the_tpu_interpreter():
    """Pallas' TPU interpreter simulates SMEM, VMEM and every DMA (out-of-bounds reads raise):
    the scalar-prefetch tables and the blocks their data-dependent index_maps fetch run as on a
    TPU, forward and backward. A second document starts mid-block (slot 37), padding follows;
    batch 2."""
    q, k, v, index_q, index_k, segments, positions = x = inputs(seq=45, heads=4, kv_heads=1)
    blocks = select(x, 16, 2, 1)
    weights = jax.random.normal(jax.random.key(9), q.shape)
    kwargs = {"config": tpu.Config(rows=64), "interpret": None}  # None: the TPU interpreter

    def values_and_grads(module, **kwargs):
        loss = loss_of(module, blocks, segments, positions, 16, weights, **kwargs)
        return jax.value_and_grad(loss, argnums=range(5))(q, k, v, index_q, index_k)

    value, grads = values_and_grads(tpu, **kwargs)
    expected_value, expected_grads = values_and_grads(reference)
    np.testing.assert_allclose(value, expected_value, rtol=F32_TOLERANCE)
    for name, g, e in zip(("q", "k", "v", "index_q", "index_k"), grads, expected_grads):
        np.testing.assert_allclose(g, e, atol=GRAD_TOLERANCE, err_msg=name)


def test_tpu_table_lists_exactly_the_selected_blocks_of_aligned_documents():
    """One document per row from slot 0: a tile visits the union of its queries' selections and
    nothing else (so only those K/V blocks are DMA'd); after the count the last block repeats."""
    q, k, v, index_q, index_k, segments, positions = inputs(seq=80, batch=1)
    segments, positions = jnp.ones_like(segments), jnp.arange(80)[None]
    blocks = select((q, k, v, index_q, index_k, segments, positions), 16, 2, 1)
    geo = tpu._geometry(q, k, 16, 2, 16, tpu.Config(rows=16))  # 4 queries a tile, 20 tiles
    touched = tpu_kernels.touched_blocks(blocks, jnp.arange(80), positions, geo)
    table, counts = tpu_kernels.sorted_lists(touched, geo.entries)
    table = np.asarray(table).reshape(1, 2, 20, geo.entries)
    for head in range(2):
        for tile in range(20):
            chosen = np.asarray(blocks[0, tile * 4 : tile * 4 + 4, head]).ravel()
            wanted = sorted(set(chosen[chosen >= 0].tolist()))
            count = int(counts.reshape(1, 2, 20)[0, head, tile])
            assert table[0, head, tile, :count].tolist() == wanted
            assert (table[0, head, tile, count:] == wanted[-1]).all()


@pytest.mark.parametrize("tile", [5, 16, 64])
def test_dense_attention_with_kl_matches_reference(tile):
    q, k, v, index_q, index_k, segments, _ = inputs()
    out, kl = attention_xla.dense_attention(
        q, k, v, segments, student=(index_q, index_k), query_tile=tile
    )
    expected, expected_kl = reference.dense_attention(q, k, v, segments, student=(index_q, index_k))
    np.testing.assert_allclose(out, expected, atol=F32_TOLERANCE)
    np.testing.assert_allclose(
        out, gqa_attention(q, k, v, document_causal_mask(segments)[:, None, None]),
        atol=F32_TOLERANCE,
    )  # fmt: skip
    np.testing.assert_allclose(kl, expected_kl, atol=F32_TOLERANCE)

    def loss(fn, *args):
        out, kl = fn(*args)
        return (out**2).sum() + kl.sum()

    got = jax.grad(
        lambda *a: loss(lambda *b: attention_xla.dense_attention(
            *b[:3], segments, student=b[3:], query_tile=tile), *a),
        argnums=range(5),
    )(q, k, v, index_q, index_k)  # fmt: skip
    expected_grads = jax.grad(
        lambda *a: loss(lambda *b: reference.dense_attention(*b[:3], segments, student=b[3:]), *a),
        argnums=range(5),
    )(q, k, v, index_q, index_k)
    for g, e in zip(got, expected_grads):
        np.testing.assert_allclose(g, e, atol=GRAD_TOLERANCE)


@pytest.mark.parametrize("block_size, topk, local", SETTINGS)
def test_block_recall_matches_reference_and_is_one_for_every_block(block_size, topk, local):
    q, k, v, index_q, index_k, segments, positions = x = inputs()
    blocks = select(x, block_size, topk, local)
    got = xla.block_recall(q, k, blocks, segments, positions, block_size=block_size, query_tile=7)
    expected = reference.block_recall(q, k, blocks, segments, positions, block_size=block_size)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert 0 < float(got.mean()) < 1
    everything = select(x, block_size, 64, 1)  # every block of the document selected
    recall = xla.block_recall(q, k, everything, segments, positions, block_size=block_size)
    assert np.allclose(recall, 1.0)


@pytest.mark.slow
def test_xla_memory_grows_linearly_with_sequence_length():
    """Compiled forward+backward memory at S and 2S: ×2 for the XLA path, ×4 for the reference."""

    def compiled_bytes(loss, seq):
        shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
        ints = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        args = (shape(1, seq, 4, 16), shape(1, seq, 2, 16), shape(1, seq, 2, 16),
                shape(1, seq, 2, 16), shape(1, seq, 16), ints, ints)  # fmt: skip
        grad = jax.jit(jax.grad(loss, argnums=range(5)))
        memory = grad.lower(*args).compile().memory_analysis()
        return (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        )

    def sparse(module):
        def loss(q, k, v, index_q, index_k, segments, positions):
            blocks = module.top_blocks(index_q, index_k, segments, positions, block_size=16,
                                       topk_blocks=4, local_blocks=1)  # fmt: skip
            out, kl = module.sparse_attention(
                q, k, v, blocks, segments, positions, block_size=16, student=(index_q, index_k)
            )
            return (out**2).sum() + kl.sum()

        return loss

    def dense_tiled(q, k, v, index_q, index_k, segments, positions):
        out, kl = attention_xla.dense_attention(q, k, v, segments, student=(index_q, index_k))
        return (out**2).sum() + kl.sum()

    for loss in (sparse(xla), dense_tiled):
        ratio = compiled_bytes(loss, 4096) / compiled_bytes(loss, 2048)
        assert 1.8 < ratio < 2.2, ratio
    assert compiled_bytes(sparse(reference), 4096) / compiled_bytes(sparse(reference), 2048) > 3.5
