"""The swigluoai feed-forward block: M3's dense MLP layers and its shared expert (spec §3.6).

Shapes: B batch, S sequence, D model width, F hidden width.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import params


def swigluoai(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """(clip(up, ±limit) + 1) · g · sigmoid(α g) with g = min(gate, limit): the gate is clamped above only."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


class MLP(nnx.Module):
    def __init__(
        self, dim: int, hidden_dim: int, *, alpha: float, limit: float, std: float, rngs: nnx.Rngs
    ):
        self.gate_proj = params.normal(rngs, (dim, hidden_dim), ("embed", "mlp"), std)
        self.up_proj = params.normal(rngs, (dim, hidden_dim), ("embed", "mlp"), std)
        self.down_proj = params.normal(rngs, (hidden_dim, dim), ("mlp", "embed"), std)
        self.alpha, self.limit = alpha, limit

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D], computed in x's dtype."""
        return swiglu_mlp(x, *self.weights(x.dtype), alpha=self.alpha, limit=self.limit)

    def weights(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate [D, F], up [D, F], down [F, D]) in `dtype`: the arguments of `swiglu_mlp`."""
        return tuple(w[...].astype(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))


def swiglu_mlp(
    x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, alpha: float, limit: float
) -> jax.Array:
    """x [..., D] -> [..., D] through one swigluoai MLP, as a function of its weights (so that it
    can run where modules can't, inside `shard_map`: m3jax/moe/expert_parallel.py)."""
    return swigluoai(x @ gate, x @ up, alpha, limit) @ down
