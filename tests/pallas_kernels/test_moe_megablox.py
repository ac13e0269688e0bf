"""The TPU grouped matmul (jax's megablox kernel, in Pallas' interpreter on CPU) against
`reference.grouped_matmul`: values and both gradients, an empty group, rows past the groups, a
row count that is no multiple of the tile; and the dispatch on a (mocked) TPU."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.moe import local
from pallas_kernels import target
from pallas_kernels.moe import megablox, reference

# stand-ins for the devices kernels are chosen for (pallas_kernels/target.py)
A_TPU = mock.Mock(platform="tpu")


def test_megablox_matches_reference_values_and_gradients():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (50, 32))
    w = jax.random.normal(keys[1], (4, 32, 48))
    sizes = jnp.array([10, 0, 25, 9], jnp.int32)  # 44 of 50 rows: 6 padding rows
    y = megablox.grouped_matmul(x, w, sizes, interpret=True)
    np.testing.assert_allclose(y, reference.grouped_matmul(x, w, sizes), atol=1e-4)
    assert not np.asarray(y[44:]).any()
    weights = jax.random.normal(keys[2], (50, 48))

    def grads(matmul):
        return jax.grad(lambda x, w: (matmul(x, w, sizes) * weights).sum(), argnums=(0, 1))(x, w)

    got = grads(lambda *a: megablox.grouped_matmul(*a, interpret=True))
    for g, e in zip(got, grads(reference.grouped_matmul)):
        np.testing.assert_allclose(g, e, atol=1e-4)


def test_auto_takes_megablox_on_a_tpu_where_it_applies():
    impl = local.grouped_matmul_impl
    assert impl("auto", jnp.bfloat16, 256, 128) == "xla"  # this CPU machine
    with target.ahead_of_time([A_TPU]):
        assert impl("auto", jnp.bfloat16, 256, 128) == "megablox"
        assert impl("auto", jnp.bfloat16, 200, 128) == "xla"
        with pytest.raises(ValueError, match="in_width=200"):
            impl("megablox", jnp.bfloat16, 200, 128)
