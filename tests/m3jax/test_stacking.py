"""scan_layers' cast of the stacked projection weights before the scan."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.stacking import scan_layers, stacked_layers


class Layer(nnx.Module):
    """A projection used in the activations' dtype (as the decoder's layers use theirs) and an
    fp32 weight used in fp32 (as the router)."""

    def __init__(self, rngs: nnx.Rngs):
        self.up_proj = nnx.Param(jax.random.normal(rngs.params(), (8, 8)), logical_axes=("a", "b"))
        self.router = nnx.Param(jax.random.normal(rngs.params(), (8, 8)), logical_axes=("a", "b"))

    def __call__(self, x):
        y = x @ self.up_proj[...].astype(x.dtype)
        gate = jax.nn.sigmoid(x.astype(jnp.float32) @ self.router[...])
        return (y * gate).astype(x.dtype)


def loss_and_grads(projection_dtype):
    layers = stacked_layers(Layer, 3, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 8), jnp.bfloat16)

    def loss(layers):
        y, _ = scan_layers(layers, x, lambda layer, h: (layer(h), None), "full",
                           projection_dtype=projection_dtype)  # fmt: skip
        return y.astype(jnp.float32).sum()

    return nnx.value_and_grad(loss)(layers), jax.make_jaxpr(nnx.grad(loss))(layers)


def test_casting_projections_before_the_scan_keeps_the_loss_and_gradients():
    (loss, grads), _ = loss_and_grads(None)
    (cast_loss, cast_grads), jaxpr = loss_and_grads(jnp.bfloat16)
    assert cast_loss == loss
    for name in ("up_proj", "router"):
        got, want = getattr(cast_grads, name)[...], getattr(grads, name)[...]
        assert got.dtype == want.dtype == jnp.float32
        np.testing.assert_array_equal(got, want)
    # the projection's cast happens once, outside the scan: the scan's inputs include it in bf16
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert any(v.aval.dtype == jnp.bfloat16 and v.aval.shape == (3, 8, 8)
               for e in scans for v in e.invars)  # fmt: skip
