"""Queries at given slots of the key row (`query_slots`, what a context-parallel device passes):
each query's result equals that of the same token in the whole-row call, for the reference and the
XLA path alike, and gradients of the parts add up to the whole row's. Without query slots the
functions are unchanged: slots 0..T-1 give bit-identical results.

The queries are two chunks of the row, as a zig-zag device holds them (m3jax/context_parallel.py):
a late one before an early one, cutting through documents (inputs: one of 37 slots, one of 35
starting mid-block, 3 padding slots).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_msa_backends import inputs

from pallas_kernels.attention import xla as attention_xla
from pallas_kernels.msa import reference, xla

SEQ = 75
SLOTS = np.r_[48:64, 8:24]  # a later chunk first: slots need not be sorted
BACKENDS = {"reference": reference, "xla": xla}
MSA = {"block_size": 16}
SELECT = {"block_size": 16, "topk_blocks": 2, "local_blocks": 1}


def at_slots(x, slots=SLOTS):
    return np.asarray(x)[:, slots]


def run_all(backend, slots=None):
    """(blocks, sparse out, sparse KL, dense out, dense KL, recall) for the queries at `slots`."""
    q, k, v, index_q, index_k, segments, positions = inputs(seq=SEQ)
    if slots is not None:
        q, index_q = q[:, slots], index_q[:, slots]
    given = {} if slots is None else {"query_slots": slots}
    student = (index_q, index_k)
    blocks = backend.top_blocks(index_q, index_k, segments, positions, **SELECT, **given)
    sparse = backend.sparse_attention(
        q, k, v, blocks, segments, positions, **MSA, student=student, **given
    )
    dense = backend.dense_attention(q, k, v, segments, student=student, **given)
    recall = backend.block_recall(q, k, blocks, segments, positions, **MSA, **given)
    return blocks, *sparse, *dense, recall


@pytest.mark.parametrize("backend", BACKENDS)
def test_queries_at_slots_equal_those_rows_of_the_whole_row(backend):
    whole = run_all(BACKENDS[backend])
    part = run_all(BACKENDS[backend], jnp.asarray(SLOTS))
    assert whole[0].shape[-1] == part[0].shape[-1] == 2  # 5 key blocks, top 2: selection matters
    for name, w, p in zip(("blocks", "out", "kl", "dense", "dense kl", "recall"), whole, part):
        if name == "blocks":  # the same set of blocks (their order is unspecified)
            np.testing.assert_array_equal(np.sort(at_slots(w), -1), np.sort(np.asarray(p), -1))
        else:
            np.testing.assert_allclose(np.asarray(p), at_slots(w), rtol=1e-5, atol=1e-6,
                                       err_msg=name)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_zero_to_t_are_bit_identical_to_no_slots(backend):
    for a, b in zip(run_all(BACKENDS[backend]), run_all(BACKENDS[backend], jnp.arange(SEQ))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "backend",
    ["xla", pytest.param("reference", marks=pytest.mark.slow)],  # eager O(S²): 9 s
)
def test_gradients_of_query_parts_add_up_to_the_whole_row(backend):
    """Queries split in two parts at slots: dq per part, dk and dv the sum over parts (what the
    reduce-scatter of a context-parallel backward adds)."""
    backend = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = inputs(seq=SEQ)
    weights = jax.random.normal(jax.random.key(1), q.shape)
    blocks = backend.top_blocks(index_q, index_k, segments, positions, **SELECT)

    def loss(q, k, v, slots):
        given = {} if slots is None else {"query_slots": slots}
        picked = blocks if slots is None else blocks[:, slots]
        out, _ = backend.sparse_attention(q, k, v, picked, segments, positions, **MSA, **given)
        return (out * (weights if slots is None else weights[:, slots])).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))
    whole = grads(q, k, v, None)
    rest = np.setdiff1d(np.arange(SEQ), SLOTS)
    parts = [grads(q[:, s], k, v, jnp.asarray(s)) for s in (SLOTS, rest)]
    np.testing.assert_allclose(parts[0][0], at_slots(whole[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parts[1][0], at_slots(whole[0], rest), rtol=1e-5, atol=1e-6)
    for i in (1, 2):
        np.testing.assert_allclose(parts[0][i] + parts[1][i], whole[i], rtol=1e-5, atol=1e-5)


def test_bidirectional_attention_at_slots_equals_those_rows():
    q, k, v, _, _, segments, _ = inputs(seq=SEQ)
    whole, _ = attention_xla.dense_attention(q, k, v, segments, causal=False)
    part, _ = attention_xla.dense_attention(
        q[:, SLOTS], k, v, segments, causal=False, query_slots=jnp.asarray(SLOTS)
    )
    np.testing.assert_allclose(part, at_slots(whole), rtol=1e-5, atol=1e-6)
