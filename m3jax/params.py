"""Parameter constructors that attach logical axis names, and the Buffer variable type.

Every array the model owns carries `logical_axes` metadata (one name per dimension, None for
replicated); `m3jax/sharding.py` maps those names to mesh axes. Stacked (scanned) layers prepend
"layers".
"""

import jax
import jax.numpy as jnp
from flax import nnx


class Buffer(nnx.Variable):
    """State that is not trained by the optimizer (the router's correction bias)."""


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, std: float) -> nnx.Param:
    """A float32 parameter drawn from N(0, std²)."""
    _check_axes(shape, axes)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


def zeros(shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    """A float32 zero parameter (norm offsets: Gemma norms scale by 1 + w; biases)."""
    _check_axes(shape, axes)
    return nnx.Param(jnp.zeros(shape, jnp.float32), logical_axes=axes)


def ones(shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    """A float32 parameter of ones (LayerNorm scales)."""
    _check_axes(shape, axes)
    return nnx.Param(jnp.ones(shape, jnp.float32), logical_axes=axes)


def zeros_buffer(shape: tuple[int, ...], axes: tuple) -> Buffer:
    _check_axes(shape, axes)
    return Buffer(jnp.zeros(shape, jnp.float32), logical_axes=axes)


def _check_axes(shape: tuple[int, ...], axes: tuple) -> None:
    if len(shape) != len(axes):
        raise ValueError(f"{shape=} and logical {axes=} differ in rank")
