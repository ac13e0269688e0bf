"""Dense GQA softmax attention under an arbitrary boolean mask, in plain `jnp`.

Shapes: B batch, S queries, T keys, H query heads, K kv heads, G = H // K, Dh head dim.
Query head h reads kv head h // G (contiguous groups, as transformers' `repeat_kv`).
"""

import jax
import jax.numpy as jnp


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax(q·kᵀ·Dh^-½ + mask) · v with fp32 logits and softmax.

    Args:
      q: [B, S, H, Dh] queries.
      k, v: [B, T, K, Dh] keys and values; H must be a multiple of K.
      mask: bool, broadcastable to [B, K, G, S, T]; True = visible. Every query must see at least
        one key (a fully masked row would average all values, as in transformers).
    Returns:
      [B, S, H, Dh] in q's dtype.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=}")
    q = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    logits = logits * head_dim**-0.5
    # finfo.min rather than -inf, as transformers: a fully masked row stays finite.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, seq, num_heads, head_dim).astype(q.dtype)


def document_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, S] segment ids -> [B, S, S] bool: key j visible to query i iff j <= i, same segment."""
    seq = segment_ids.shape[-1]
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_segment
