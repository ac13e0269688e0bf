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
    """One aux-loss-free balancing step: each expert's bias moves toward the mean load by rate times
    its relative load error, at most ±rate: rate · clip((mean - load_e) / mean, -1, 1).

    bias, load: [..., E] (leading axes = stacked layers); load counts tokens routed per expert.
    An idle expert rises by rate, one with twice the mean load or more falls by rate, and the move
    shrinks to 0 as an expert's load reaches the mean. DeepSeek-V3's rule, rate · sign(mean - load),
    moves every expert by the full ±rate on every step, balanced or not, so its rate trades speed
    for jitter: at the 1e-3 it used, a 32-expert router that starts skewed stays collapsed for
    hundreds of steps (small-gpu: 6-7 times the mean load through step 200), and from 3e-2 up the
    jitter itself unbalances the load. The clipped rule moves as fast as its rate far from balance
    and little near it (README, "Expert balance": the measured curves).
    """
    mean = load.mean(axis=-1, keepdims=True)
    error = (mean - load) / jnp.maximum(mean, 1e-9)  # 0 when no token was routed at all
    return bias + rate * jnp.clip(error, -1.0, 1.0)
