"""Dense attention over packed segments: the query-tiled XLA path (causal, and bidirectional for the
ViT) against the reference's masks, cuDNN's packed layout of a row's segments, and which
implementation `attention_ops.dense` picks. cuDNN itself runs only on a GPU: benchmarks/
bench_attention.py checks it against the XLA path there, in values and gradients. TPU splash
attention runs here in Pallas' interpreter."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_values import value_sizes

from m3jax import attention_ops
from pallas_kernels import target
from pallas_kernels.attention import cudnn, splash, xla
from pallas_kernels.attention.reference import document_causal_mask, gqa_attention

# stand-ins for the devices kernels are chosen for (pallas_kernels/target.py)
A_HOPPER = mock.Mock(platform="gpu", compute_capability="9.0", core_count=132)
A_TPU = mock.Mock(platform="tpu")


def packed_segments(rng, batch: int, seq: int, max_documents: int) -> np.ndarray:
    """Rows of contiguous documents of random lengths (ids 1, 2, ...) and trailing padding (0)."""
    rows = []
    for _ in range(batch):
        count = rng.integers(1, max_documents + 1)
        cuts = np.sort(rng.choice(np.arange(1, seq), count, replace=False))
        ids = np.zeros(seq, np.int32)
        for i, (start, stop) in enumerate(zip([0, *cuts[:-1]], cuts)):
            ids[start:stop] = i + 1
        rows.append(ids)  # the tokens from the last cut on are padding
    return np.stack(rows)


def operands(seq: int, heads=4, kv_heads=2, head_dim=16, batch=3, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.float32)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq, tile", [(77, 16), (64, 64), (50, 64)])
def test_xla_dense_attention_equals_the_reference_mask(causal, seq, tile):
    q, k, v = operands(seq)
    segments = jnp.asarray(packed_segments(np.random.default_rng(seq), 3, seq, 5))
    mask = segments[:, :, None] == segments[:, None, :]
    if causal:
        mask = document_causal_mask(segments)

    def reference(q, k, v):
        return gqa_attention(q, k, v, mask[:, None, None])

    def tiled(q, k, v):
        return xla.dense_attention(q, k, v, segments, query_tile=tile, causal=causal)[0]

    np.testing.assert_allclose(tiled(q, k, v), reference(q, k, v), rtol=2e-5, atol=2e-6)
    cotangent = jax.random.normal(jax.random.key(9), q.shape)
    grads = [jax.grad(lambda *a: (f(*a) * cotangent).sum(), (0, 1, 2))(q, k, v)
             for f in (tiled, reference)]  # fmt: skip
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bidirectional_attention_sees_later_keys_of_its_segment_only():
    q, k, v = operands(8, batch=1)
    segments = jnp.array([[1, 1, 1, 2, 2, 2, 0, 0]])
    out = xla.dense_attention(q, k, v, segments, causal=False)[0]
    later = v.at[:, 2].set(100.0)  # a later key of segment 1
    changed = xla.dense_attention(q, k, later, segments, causal=False)[0]
    differs = np.abs(np.asarray(changed - out)).max(axis=(2, 3))[0] > 1e-3
    np.testing.assert_array_equal(differs, [True, True, True, False, False, False, False, False])


def runs_by_numpy(ids: np.ndarray) -> list[tuple[int, int]]:
    starts = [0, *np.flatnonzero(ids[1:] != ids[:-1]) + 1]
    return [(start, stop - start) for start, stop in zip(starts, [*starts[1:], len(ids)])]


@pytest.mark.parametrize("max_segments", [1, 3, 8, 40])
def test_segment_runs_lay_out_each_rows_runs_as_cudnn_reads_them(max_segments):
    rng = np.random.default_rng(max_segments)
    segments = packed_segments(rng, 6, 40, 7)
    segments[0] = 5  # one run: a whole row of one document
    segments[1, ::2] = 0  # forty runs of alternating ids
    offsets, lengths, runs = cudnn.segment_runs(jnp.asarray(segments), max_segments)
    assert offsets.shape == (6, max_segments + 1) and lengths.shape == (6, max_segments)
    assert offsets.dtype == lengths.dtype == jnp.int32
    for row, ids in enumerate(segments):
        expected = runs_by_numpy(ids)
        assert runs[row] == len(expected)
        kept = expected[:max_segments]
        fill = [-1] * (max_segments - len(kept))
        np.testing.assert_array_equal(offsets[row], [s for s, _ in kept] + fill + [-1])
        np.testing.assert_array_equal(lengths[row], [n for _, n in kept] + fill)
        if len(expected) <= max_segments:
            assert sum(n for _, n in kept) == len(ids)  # every token is in a segment


def test_default_segment_slots_follow_the_row_length_within_bounds():
    """Up to 32K, S/1024 slots within [16, 32]; past it, the slots × tokens of 32K (the
    backward's dQ accumulators grow with both)."""
    lengths = (512, 4096, 16384, 32768, 65536, 1 << 18, 1 << 20, 1 << 21)
    assert [cudnn.default_segments(s) for s in lengths] == [16, 16, 16, 32, 16, 4, 1, 1]


def long_row_values(seq: int) -> dict[str, tuple[int, str]]:
    """`cudnn.dense_attention`'s values on one row of `seq` tokens, traced with cuDNN's calls
    replaced by a stand-in of their output's shape (tracing them needs cuDNN)."""
    q = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    stand_in = lambda q, *args, **kwargs: q  # noqa: E731
    with mock.patch.object(cudnn.cudnn_attention, "dot_product_attention", stand_in), \
            mock.patch.object(jax.nn, "dot_product_attention", stand_in):  # fmt: skip
        jaxpr = jax.make_jaxpr(cudnn.dense_attention)(q, k, k, segments)
    return value_sizes(jaxpr.jaxpr)


def test_a_long_rows_fallback_for_many_documents_holds_nothing_quadratic_in_its_length():
    """XLA allocates both branches of the cond, so the fallback's memory counts even when no row
    takes it: past MASKED_ELEMENTS it is the tiled XLA path, not cuDNN under an [S, S] mask."""
    assert cudnn.fallback(1, 32768) is cudnn.masked_attention  # 1 GiB of mask elements
    assert cudnn.fallback(2, 32768) is cudnn.tiled_attention
    short, long = long_row_values(1 << 16), long_row_values(1 << 17)
    assert short.keys() == long.keys()
    quadratic = [f"{long[k][1]} at {k}" for k in long if long[k][0] > 3 * max(short[k][0], 1)]
    assert not quadratic, f"{len(quadratic)} values grow as S², e.g. {quadratic[:3]}"


def test_dense_picks_cudnn_on_a_hopper_gpu_and_says_why_not_elsewhere():
    q, k, _ = operands(32)
    bf16 = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    assert "needs a GPU" in cudnn.unsupported_reason(*bf16)  # this CPU machine
    hopper = mock.Mock(platform="gpu", compute_capability="9.0")
    with target.ahead_of_time([hopper]):
        assert cudnn.unsupported_reason(*bf16) is None
        assert "bfloat16 or float16" in cudnn.unsupported_reason(q, k)
        wide = jnp.zeros((1, 8, 2, 320), jnp.bfloat16)
        assert "head_dim=320" in cudnn.unsupported_reason(wide, wide)
        with pytest.raises(ValueError, match="attention_impl='pallas' cannot run.*bfloat16"):
            attention_ops.dense("pallas", q, k, k, jnp.ones((3, 32), jnp.int32))
        hopper.compute_capability = "8.0"
        assert "compute capability >= 9.0" in cudnn.unsupported_reason(*bf16)


def test_dense_runs_the_xla_path_on_cpu_and_the_reference_when_asked():
    q, k, v = operands(24)
    segments = jnp.asarray(packed_segments(np.random.default_rng(1), 3, 24, 4))
    for causal in (True, False):
        auto = attention_ops.dense("auto", q, k, v, segments, causal=causal)
        interpreted = attention_ops.dense("pallas", q, k, v, segments, causal=causal)
        np.testing.assert_array_equal(interpreted, auto)  # no cuDNN interpreter: the XLA path
        reference = attention_ops.dense("reference", q, k, v, segments, causal=causal)
        np.testing.assert_allclose(auto, reference, rtol=2e-5, atol=2e-6)
    causal = attention_ops.dense("auto", q, k, v, segments)
    assert np.abs(np.asarray(causal - auto)).max() > 1e-3  # the two masks differ


@pytest.mark.parametrize("causal", [True, False])
def test_splash_attention_equals_the_xla_path_in_values_and_gradients(causal):
    """Splash (interpreted) on packed rows of random documents, S = 77 (not a whole block)."""
    q, k, v = operands(77, batch=2)
    segments = jnp.asarray(packed_segments(np.random.default_rng(1), 2, 77, 4))
    weights = jax.random.normal(jax.random.key(3), q.shape)

    def values_and_grads(attention):
        def loss(q, k, v):
            return (attention(q, k, v, segments, causal=causal) * weights).sum()

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    value, grads = values_and_grads(functools.partial(splash.dense_attention, interpret=True))
    expected, expected_grads = values_and_grads(lambda *a, **c: xla.dense_attention(*a, **c)[0])
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, atol=1e-4)


def test_splash_kernel_built_under_one_jit_serves_another():
    """The kernel is cached per shape; one first built while tracing must not leak tracers."""
    q, k, v = operands(40, batch=1)
    segments = jnp.ones((1, 40), jnp.int32)
    attention = functools.partial(splash.dense_attention, interpret=True)
    first = jax.jit(lambda q: attention(q, k, v, segments, causal=False))(q)
    again = jax.jit(lambda q: attention(q, k, v, segments, causal=False) * 1.0)(q)
    np.testing.assert_allclose(first, again)


def test_dense_picks_splash_on_a_tpu_and_says_why_not():
    q, k, v = operands(64, head_dim=128)
    segments = jnp.ones((3, 64), jnp.int32)
    sentinel = jnp.zeros(q.shape)
    with target.ahead_of_time([A_TPU]), \
            mock.patch.object(splash, "dense_attention", lambda *a, **c: sentinel):  # fmt: skip
        assert attention_ops.dense("auto", q, k, v, segments) is sentinel
        narrow = operands(64)  # head_dim 16
        with pytest.raises(ValueError, match="head_dim=16"):
            attention_ops.dense("pallas", *narrow, segments)
        assert attention_ops.dense("auto", *narrow, segments).shape == narrow[0].shape  # XLA


@pytest.mark.parametrize("kernel", ["cudnn", "splash"])
def test_whole_row_kernels_take_query_slots_through_a_row_of_zeros(kernel):
    """Dense attention under context parallelism: cuDNN and splash take whole rows, so the queries
    at two runs of slots go into a row of zeros and their outputs come back; values and gradients
    (dq at those rows, dk and dv from those queries alone) equal the XLA path's with query slots.
    cuDNN through `attention_ops.dense` on a mocked GPU, the XLA path standing in for its packed
    call (which must get whole rows); splash in Pallas' interpreter."""
    q, k, v = operands(77, batch=2)
    segments = jnp.asarray(packed_segments(np.random.default_rng(2), 2, 77, 4))
    runs = jnp.asarray(np.stack([np.arange(50, 70), np.arange(5, 25)]))
    rows = np.asarray(runs).reshape(-1)
    weights = jax.random.normal(jax.random.key(3), q[:, rows].shape)
    row_shapes = []

    def packed_stand_in(q, k, v, segments, *, max_segments, causal):
        row_shapes.append(q.shape[1])
        return xla.dense_attention(q, k, v, segments, causal=causal)[0]

    def values_and_grads(attention):
        def loss(q, k, v):
            return (attention(q, k, v, segments, query_slots=runs) * weights).sum()

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q[:, rows], k, v)

    expected = values_and_grads(functools.partial(attention_ops.dense, "xla"))
    if kernel == "cudnn":
        with target.ahead_of_time([A_HOPPER]), \
                mock.patch.object(cudnn, "unsupported_reason", lambda q, k: None), \
                mock.patch.object(cudnn, "packed_attention", packed_stand_in), \
                mock.patch.object(cudnn, "fallback", lambda *_: cudnn.tiled_attention):  # fmt: skip
            got = values_and_grads(functools.partial(attention_ops.dense, "auto"))
        assert row_shapes and set(row_shapes) == {77}  # the whole row of queries
    else:
        got = values_and_grads(functools.partial(splash.dense_attention, interpret=True))
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    for g, e in zip(got[1], expected[1]):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
