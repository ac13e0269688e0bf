"""Gemma-style RMSNorm, as every norm of the M3 text model (spec/m3_architecture.md §3.3).

y = x · rsqrt(mean(x²) + eps) · (1 + w), all in fp32, cast back to x's dtype at the end; the stored
weight w is an offset initialised to 0.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import params


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Normalises over the last axis. x: [..., N]; scale: [N] (the offset w)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = params.zeros((dim,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)
