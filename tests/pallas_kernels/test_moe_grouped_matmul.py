"""The grouped matmul (rows sorted by expert) against a per-group NumPy product: values, gradients.

A GPU kernel added beside `reference.grouped_matmul` runs through these same cases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.reference import grouped_matmul, grouped_matmul_buffered

# Odd sizes, an empty group in the middle and at the end, and padding rows past sum(group_sizes).
GROUPS = [3, 0, 5, 1, 6, 0]
ROWS, D, F = 19, 7, 5  # 15 real rows + 4 padding
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (ROWS, D))
    w = rng.normal(0, 1, (len(GROUPS), D, F))
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(GROUPS, jnp.int32)


def numpy_grouped(x, w, sizes):
    y, start = np.zeros((x.shape[0], w.shape[-1])), 0
    for e, size in enumerate(sizes):
        y[start : start + size] = x[start : start + size] @ w[e]
        start += size
    return y


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", [grouped_matmul, grouped_matmul_buffered])
def test_grouped_matmul_matches_per_group_products(impl, dtype):
    x, w, sizes = inputs(dtype)
    y = impl(x, w, sizes)
    assert y.shape == (ROWS, F) and y.dtype == dtype
    expected = numpy_grouped(np.asarray(x, np.float64), np.asarray(w, np.float64), GROUPS)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=tol, atol=tol * 4)
    assert np.all(np.asarray(y)[sum(GROUPS) :] == 0)  # padding rows


@pytest.mark.parametrize("impl", [grouped_matmul, grouped_matmul_buffered])
def test_grouped_matmul_gradients_match_per_group_products(impl):
    x, w, sizes = inputs(jnp.float32, seed=1)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(0, 1, (ROWS, F)), jnp.float32)
    dx, dw = jax.grad(lambda x, w: (impl(x, w, sizes) * cotangent).sum(), (0, 1))(x, w)
    xn, wn, cn = (np.asarray(a, np.float64) for a in (x, w, cotangent))
    dx_expected, dw_expected, start = np.zeros_like(xn), np.zeros_like(wn), 0
    for e, size in enumerate(GROUPS):
        rows = slice(start, start + size)
        dx_expected[rows] = cn[rows] @ wn[e].T
        dw_expected[e] = xn[rows].T @ cn[rows]
        start += size
    np.testing.assert_allclose(np.asarray(dx), dx_expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), dw_expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(dw)[1] == 0) and np.all(np.asarray(dw)[5] == 0)  # empty groups
