"""The Mosaic TPU selection kernel (pallas_kernels/msa/tpu_selection.py) against the `jnp`
reference's `top_blocks`: equal selections, order included, in Pallas' generic interpreter (the
shared backend tests in test_msa_backends.py run it too), once in the TPU interpreter (SMEM, VMEM
and the DMAs of the clamped key tiles simulated), and lowered to Mosaic at M3's shapes.

Rows: 0 packs three documents (the second starts mid-block, at slot 37) and padding; 1 holds one
document. S = 200 is a multiple of neither 128 nor the block; 3 index heads. Integer-valued
inputs make every score exact in any summation order, so ties (duplicated keys, equal block
maxima) are real ties in the kernel and the reference alike.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.msa import reference, tpu, tpu_selection
from pallas_kernels.msa.tpu_selection import Tiling

SETTINGS = [(16, 4, 1), (16, 3, 2), (32, 2, 1)]  # (block_size, topk_blocks, local_blocks)
TILINGS = [Tiling(queries=8, key_blocks=1), Tiling(queries=24, key_blocks=3)]


def documents(seq=200, batch=2):
    """[B, S] segment ids and positions: row 0 documents at slots 0, 37 and 150, 3 padding slots."""
    segments = np.ones((batch, seq), np.int32)
    positions = np.tile(np.arange(seq), (batch, 1))
    for segment, start in ((2, 37), (3, 150), (0, seq - 3)):
        segments[0, start:] = segment
        positions[0, start:] = np.arange(seq - start)
    return jnp.asarray(segments), jnp.asarray(positions)


def index_inputs(seq=200, batch=2, heads=3, index_dim=16, integers=False, seed=0):
    """index_q [B, S, Hi, Di], index_k [B, S, Di]; integers: values in -2..2."""
    keys = jax.random.split(jax.random.key(seed), 2)
    shapes = (batch, seq, heads, index_dim), (batch, seq, index_dim)
    if integers:
        return [jax.random.randint(k, s, -2, 3).astype(jnp.float32) for k, s in zip(keys, shapes)]
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def with_duplicated_keys(index_k):
    """Row 1's keys 64..127 repeat keys 0..63: whole blocks with equal maxima."""
    return index_k.at[1, 64:128].set(index_k[1, :64])


def both(index_q, index_k, setting, **kwargs):
    block_size, topk, local = setting
    segments, positions = documents(index_q.shape[1], index_q.shape[0])
    msa = {"block_size": block_size, "topk_blocks": topk, "local_blocks": local}
    expected = reference.top_blocks(index_q, index_k, segments, positions, **msa)
    got = tpu_selection.top_blocks(index_q, index_k, segments, positions, **msa, **kwargs)
    return np.asarray(got), np.asarray(expected)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("tiling", TILINGS, ids=["8q-1block", "24q-3blocks"])
@pytest.mark.parametrize("integers", [False, True], ids=["normal", "integer-ties"])
def test_tpu_selection_equals_reference_in_float32(setting, tiling, integers):
    index_q, index_k = index_inputs(integers=integers)
    got, expected = both(index_q, with_duplicated_keys(index_k), setting, tiling=tiling,
                         interpret=True)  # fmt: skip
    assert got.shape == expected.shape and got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    assert (got == -1).any()  # early queries of each document have fewer than k blocks


def test_tpu_selection_breaks_ties_to_the_lower_block():
    """Every key of row 1 equal: all its blocks tie, so the local block and the lowest ids win."""
    index_q, index_k = index_inputs(integers=True)
    index_k = index_k.at[1].set(index_k[1, :1])
    got, expected = both(index_q, index_k, (16, 3, 1), tiling=TILINGS[1], interpret=True)
    np.testing.assert_array_equal(got, expected)
    query = 150  # own block 9: forced first, then blocks 0 and 1
    assert got[1, query].tolist() == [[9, 0, 1]] * 3


@pytest.mark.parametrize("integers", [False, True], ids=["normal", "integer-ties"])
def test_tpu_selection_matches_reference_in_bfloat16(integers):
    """bf16 operands, the reference on the same bf16 values (as bench_msa compares the GPU
    kernel): products are exact in fp32, only the summation order differs, so at most a rare
    near-tie may go the other way; integer values leave no such freedom."""
    index_q, index_k = (x.astype(jnp.bfloat16) for x in index_inputs(integers=integers, seed=1))
    got, expected = both(index_q, with_duplicated_keys(index_k), SETTINGS[1], tiling=TILINGS[1],
                         interpret=True)  # fmt: skip
    agree = (np.sort(got, -1) == np.sort(expected, -1)).all(-1).mean()
    assert agree == 1.0 if integers else agree >= 0.99, agree


def test_tpu_selection_in_the_tpu_interpreter():
    """The TPU interpreter checks the scalar-prefetch tables and the clamped key-tile DMAs (an
    out-of-bounds read raises): the same exact result."""
    index_q, index_k = index_inputs(seq=56)  # row 0: documents at 0 and 37, 3 padding slots
    got, expected = both(index_q, index_k, SETTINGS[0], tiling=Tiling(queries=32, key_blocks=2),
                         interpret=pltpu.InterpretParams())  # fmt: skip
    np.testing.assert_array_equal(got, expected)


def exported_tensors(seq, heads, index_dim, block_size, topk):
    """The compiled (not interpreted) selection lowered for a TPU on this CPU machine: the
    StableHLO text, and the element counts of its tensors."""
    shape = jax.ShapeDtypeStruct
    ints = shape((1, seq), jnp.int32)
    select = jax.jit(lambda iq, ik, s, p: tpu.top_blocks(iq, ik, s, p, block_size=block_size,
                                                         topk_blocks=topk, local_blocks=1,
                                                         interpret=False))  # fmt: skip
    exported = export.export(select, platforms=["tpu"])(
        shape((1, seq, heads, index_dim), jnp.bfloat16),
        shape((1, seq, index_dim), jnp.bfloat16),
        ints,
        ints,
    )
    text = exported.mlir_module()
    shapes = re.findall(r"tensor<([\dx]+)x", text)
    return text, [np.prod([int(d) for d in dims.split("x")]) for dims in shapes]


def test_tpu_selection_lowers_to_mosaic_at_m3_shapes():
    """Pallas' TPU lowering accepts the kernel as M3 runs it (bf16, 4 index heads of 128, blocks
    of 128, top-16, S not a multiple of the block): block shapes, scalar prefetch, every op.
    Mosaic's own compiler runs only on a TPU."""
    text, _ = exported_tensors(4096 + 77, 4, 128, 128, 16)
    assert "tpu_custom_call" in text


def test_tpu_selection_keeps_scores_out_of_hbm():
    """No tensor outside the kernel grows like [S, S / block]: at S = 4173 with blocks of 16 that
    would be 1.1M elements, 32 times index_q."""
    seq, index_dim = 4096 + 77, 8
    _, sizes = exported_tensors(seq, 1, index_dim, 16, 4)
    assert max(sizes) <= 8 * seq * index_dim < seq * seq // 16


def test_tpu_selection_refuses_rows_that_are_not_lane_dense():
    index_q, index_k = index_inputs()
    segments, positions = documents()
    assert tpu_selection.unsupported_reason(index_q, block_size=16) == ""
    narrow = Tiling(queries=8)  # 8 queries × 3 heads = 24 lanes, in 25 tiles
    assert "8 queries × 3" in tpu_selection.unsupported_reason(index_q, block_size=16,
                                                               tiling=narrow)  # fmt: skip
    assert "block_size=12" in tpu_selection.unsupported_reason(index_q, block_size=12)
    with pytest.raises(ValueError, match="8 queries × 3"):
        tpu_selection.top_blocks(index_q, index_k, segments, positions, block_size=16,
                                 topk_blocks=2, local_blocks=1, tiling=narrow)  # fmt: skip
