"""M3's router: sigmoid scores with a correction bias that picks the experts, and the bias update.

spec/m3_architecture.md §3.6: s = sigmoid(router logits) in fp32; experts are *chosen* by s + bias
but *weighted* by s renormalised over the chosen k. The bias is a Buffer that the trainer moves
toward balanced load (aux-loss-free balancing, DeepSeek-V3), never the optimizer.

Shapes: N tokens, E experts, k experts per token.
"""

import jax
import jax.numpy as jnp


def route(
    router_logits: jax.Array, bias: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[N, E] fp32 logits -> (chosen expert ids [N, k], weights [N, k] summing to 1, scores [N, E])."""
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    _, chosen = jax.lax.top_k(scores + bias, k)  # the bias only decides *which* experts
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    return chosen, weights / weights.sum(-1, keepdims=True), scores


def balanced_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """Moves each expert's bias by ±rate toward the mean load (DeepSeek-V3's aux-loss-free rule).

    bias, load: [..., E] (leading axes = stacked layers); load counts tokens routed per expert.
    """
    mean = load.mean(axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load)
