"""Partial rotary position embedding, NeoX half-split layout (spec/m3_architecture.md §3.4, §4).

Only the first R = rotary_dim channels of a head rotate; channel i pairs with channel i + R/2.
cos/sin are computed in fp32 and cast to the activation dtype before rotating, as transformers does.
The text model rotates by a 1-D position; the ViT by (t, h, w) with one frequency band per axis.
Shapes: B batch, S sequence, H heads (query, kv or index), Dh head dim, P patches; `rotary_dim`
rotated channels (a word: R is routed rows).
"""

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [B, S] -> (cos, sin), each [B, S, rotary_dim] fp32, frequencies
    θ^(-2j/rotary_dim) repeated twice."""
    inv_freq = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, rotary_dim/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def axial_rope_tables(
    positions: jax.Array, head_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """ViT positions [..., 3] (t, h, w) -> (cos, sin), each [..., rotary_dim] fp32 (= 3·sd).

    sd = 2·floor(floor(head_dim / 3) / 2) channels per axis, frequencies θ^(-2j/sd); the table is
    [f_t, f_h, f_w] repeated twice, so channel i pairs with i + rotary_dim/2, and head_dim -
    rotary_dim channels pass through.
    """
    axis_dim = 2 * ((head_dim // 3) // 2)
    inv_freq = theta ** (-jnp.arange(0, axis_dim, 2, dtype=jnp.float32) / axis_dim)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., 3, sd/2]
    freqs = freqs.reshape(*positions.shape[:-1], -1)  # [..., 3·sd/2] in (t, h, w) order
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first rotary_dim = cos.shape[-1] channels of x [B, S, H, Dh]; the rest pass
    through."""
    rotary_dim = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = jnp.split(rot, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)
