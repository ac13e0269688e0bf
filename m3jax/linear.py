"""An affine map with bias over named multi-axis shapes: the vision tower's and projector's layers.

The kernel is [*in_shape, *out_shape] (e.g. [Dv, H, Dh] for a query projection, [H, Dh, Dv] for
the output projection), so heads stay a separate, shardable axis; transformers stores the same map
as a Linear weight [prod(out_shape), prod(in_shape)] (m3jax/convert/layout.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import params


class Linear(nnx.Module):
    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axes: tuple,
        *,
        std: float,
        rngs: nnx.Rngs,
    ):
        """axes: logical names of the kernel's dims (in then out); the bias takes the out names."""
        self.kernel = params.normal(rngs, (*in_shape, *out_shape), axes, std)
        self.bias = params.zeros(out_shape, axes[len(in_shape) :])
        self.num_in_axes = len(in_shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., *in_shape] -> [..., *out_shape], in x's dtype."""
        kernel = self.kernel[...].astype(x.dtype)
        y = jnp.tensordot(x, kernel, axes=self.num_in_axes)
        return y + self.bias[...].astype(x.dtype)
