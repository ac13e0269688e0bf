"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

The filters apply in transformers' order (temperature, then top-k, then top-p), so the same
settings mean the same distribution there and here. Shapes: B batch, V vocab.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax); else logits / temperature
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the fewest most likely tokens whose probability reaches top_p

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def sample(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] fp32 -> next token ids [B] int32 (the argmax when temperature is 0)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        logits = _nucleus(logits, sampling.top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """Masks every token outside the smallest most-likely set whose probability reaches top_p."""
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the most likely always stays
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)
