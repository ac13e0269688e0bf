"""The two norms of M3: Gemma-style RMSNorm (text model) and LayerNorm (vision tower).

RMSNorm (spec/m3_architecture.md §3.3): y = x · rsqrt(mean(x²) + eps) · (1 + w), the stored weight w
an offset initialised to 0. LayerNorm (§4, CLIP-style): y = (x - mean) · rsqrt(var + eps) · w + b,
w initialised to 1. Both compute in fp32 and cast back to x's dtype at the end.
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


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """Normalises over the last axis (biased variance, as torch). x: [..., N]; scale, bias: [N]."""
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = params.zeros((dim,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = params.ones((dim,), ("norm",))
        self.bias = params.zeros((dim,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)
