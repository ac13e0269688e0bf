"""Queries at given slots of the key row (`query_slots`, what a context-parallel device passes):
each query's result equals that of the same token in the whole-row call, for the reference, the
XLA path, the GPU kernels (Pallas' interpreter) and the TPU kernels (Pallas' generic interpreter)
alike, and gradients of the parts add up to the
whole row's. Without query slots the functions are unchanged: slots 0..T-1 give bit-identical
results.

The queries are two runs of consecutive slots, as a zig-zag device holds its chunks
(m3jax/context_parallel.py): a late one before an early one, cutting through documents (inputs:
one of 37 slots, one of 35 starting mid-block, 3 padding slots), 19 slots each so that the
kernels' tiles of 8 queries straddle the two runs and their windows of 16 queries leave a padded
one per run.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_msa_backends import SMALL, TPU_SMALL, inputs

from pallas_kernels.attention import xla as attention_xla
from pallas_kernels.msa import pallas, reference, tpu, xla

SEQ = 75
RUNS = np.stack([np.arange(45, 64), np.arange(6, 25)])  # [2, 19]: a later chunk first
SLOTS = RUNS.reshape(-1)
WINDOWS = dataclasses.replace(SMALL, partial_bytes=40_000, min_window=16)
BACKENDS = {  # the module and what its kernels take beyond the shared signature
    "reference": (reference, {}),
    "xla": (xla, {}),
    "pallas": (pallas, {"config": WINDOWS, "interpret": True}),
    "tpu": (tpu, {"config": TPU_SMALL, "interpret": True}),
}
MSA = {"block_size": 16}
SELECT = {"block_size": 16, "topk_blocks": 2, "local_blocks": 1}


def at_slots(x, slots=SLOTS):
    return np.asarray(x)[:, slots]


def run_all(backend, slots=None):
    """(blocks, sparse out, sparse KL, dense out, dense KL, recall) for the queries at `slots`."""
    module, kernel = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = inputs(seq=SEQ)
    if slots is not None:
        flat = np.asarray(slots).reshape(-1)
        q, index_q = q[:, flat], index_q[:, flat]
    given = {} if slots is None else {"query_slots": slots}
    student = (index_q, index_k)
    blocks = module.top_blocks(index_q, index_k, segments, positions, **SELECT, **given, **kernel)
    sparse = module.sparse_attention(
        q, k, v, blocks, segments, positions, **MSA, student=student, **given, **kernel
    )
    dense = module.dense_attention(q, k, v, segments, student=student, **given)
    recall = module.block_recall(q, k, blocks, segments, positions, **MSA, **given)
    return blocks, *sparse, *dense, recall


# the kernels take runs only (test_kernels_refuse_slots_that_are_not_runs)
FORMS = [(b, f) for b in BACKENDS for f in ("runs", "flat") if (b, f) != ("pallas", "flat")]


@pytest.mark.parametrize("backend, form", FORMS)
def test_queries_at_slots_equal_those_rows_of_the_whole_row(backend, form):
    whole = run_all(backend)
    part = run_all(backend, jnp.asarray(RUNS if form == "runs" else SLOTS))
    assert whole[0].shape[-1] == part[0].shape[-1] == 2  # 5 key blocks, top 2: selection matters
    for name, w, p in zip(("blocks", "out", "kl", "dense", "dense kl", "recall"), whole, part):
        if name == "blocks":  # the same set of blocks (their order is unspecified)
            np.testing.assert_array_equal(np.sort(at_slots(w), -1), np.sort(np.asarray(p), -1))
        else:
            np.testing.assert_allclose(np.asarray(p), at_slots(w), rtol=1e-5, atol=1e-6,
                                       err_msg=name)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_zero_to_t_are_bit_identical_to_no_slots(backend):
    for a, b in zip(run_all(backend), run_all(backend, jnp.arange(SEQ)[None])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernels_refuse_slots_that_are_not_runs():
    q, k, v, index_q, index_k, segments, positions = inputs(seq=SEQ)
    blocks = reference.top_blocks(index_q, index_k, segments, positions, **SELECT)
    kernel = BACKENDS["pallas"][1]
    with pytest.raises(ValueError, match=r"\[runs, length\]"):
        pallas.top_blocks(index_q[:, SLOTS], index_k, segments, positions, **SELECT,
                          query_slots=jnp.asarray(SLOTS), **kernel)  # fmt: skip
    gapped = RUNS.copy()
    gapped[0, 5:] += 1  # a gap inside the first run
    with pytest.raises(ValueError, match="consecutively"):
        pallas.sparse_attention(q[:, SLOTS], k, v, blocks[:, SLOTS], segments, positions, **MSA,
                                query_slots=jnp.asarray(gapped), **kernel)  # fmt: skip


@pytest.mark.parametrize(
    "backend",
    ["xla", "pallas", "tpu", pytest.param("reference", marks=pytest.mark.slow)],  # eager: 9 s
)
def test_gradients_of_query_parts_add_up_to_the_whole_row(backend):
    """Queries split in two parts at slots (runs of 25: two, then one), values and student
    included: dq and d(index_q) per part, dk, dv and d(index_k) the sum over parts (what the
    reduce-scatter of a context-parallel backward adds)."""
    module, kernel = BACKENDS[backend]
    q, k, v, index_q, index_k, segments, positions = inputs(seq=SEQ)
    weights = jax.random.normal(jax.random.key(1), q.shape)
    kl_weights = jax.random.normal(jax.random.key(2), index_q.shape[:3])
    blocks = reference.top_blocks(index_q, index_k, segments, positions, **SELECT)
    parts = [np.stack([np.arange(0, 25), np.arange(50, 75)]), np.arange(25, 50)[None]]

    def loss(q, index_q, k, v, index_k, runs):
        given, picked = {}, np.arange(SEQ)
        if runs is not None:
            given, picked = {"query_slots": jnp.asarray(runs)}, runs.reshape(-1)
        out, kl = module.sparse_attention(
            q, k, v, blocks[:, picked], segments, positions, **MSA, student=(index_q, index_k),
            **given, **kernel,
        )  # fmt: skip
        return (out * weights[:, picked]).sum() + (kl * kl_weights[:, picked]).sum()

    grads = jax.grad(loss, argnums=range(5))
    whole = grads(q, index_q, k, v, index_k, None)
    split = [grads(q[:, r.reshape(-1)], index_q[:, r.reshape(-1)], k, v, index_k, r)
             for r in parts]  # fmt: skip
    for i in (0, 1):  # per query
        for runs, part in zip(parts, split):
            np.testing.assert_allclose(part[i], at_slots(whole[i], runs.reshape(-1)), rtol=1e-4,
                                       atol=1e-5)  # fmt: skip
    for i in (2, 3, 4):  # per key: the parts add up
        np.testing.assert_allclose(split[0][i] + split[1][i], whole[i], rtol=1e-4, atol=1e-5)


def test_bidirectional_attention_at_slots_equals_those_rows():
    q, k, v, _, _, segments, _ = inputs(seq=SEQ)
    whole, _ = attention_xla.dense_attention(q, k, v, segments, causal=False)
    part, _ = attention_xla.dense_attention(
        q[:, SLOTS], k, v, segments, causal=False, query_slots=jnp.asarray(RUNS)
    )
    np.testing.assert_allclose(part, at_slots(whole), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["pallas", "tpu"])
def test_selection_kernels_at_slots_with_many_blocks_before_the_queries(backend):
    """Blocks of 4 keys (19 of them), so that the early run, which comes second, has many blocks
    to choose from: a kernel that took a query's place in the array for its slot would skip the
    causal mask on keys after it."""
    module, kernel = BACKENDS[backend]
    _, _, _, index_q, index_k, segments, positions = inputs(seq=SEQ)
    select = {"block_size": 4, "topk_blocks": 3, "local_blocks": 1}
    expected = reference.top_blocks(index_q, index_k, segments, positions, **select)
    got = module.top_blocks(index_q[:, SLOTS], index_k, segments, positions, **select,
                            query_slots=jnp.asarray(RUNS), **kernel)  # fmt: skip
    np.testing.assert_array_equal(np.sort(np.asarray(got), -1), np.sort(at_slots(expected), -1))
