"""Dense GQA softmax attention under an arbitrary boolean mask, in plain `jnp`.

Shapes: B batch, S queries, T keys, H query heads, K kv heads, G = H // K, Dh head dim.
Query head h reads kv head h // G (contiguous groups, as transformers' `repeat_kv`).
Query slots: queries are tokens of the key row. By default query i is the token in slot i (S = T);
`query_slots` [S] names each query's slot instead, so a device of a context-parallel mesh
(m3jax/context_parallel.py) can attend with its own chunks of the row against all of its keys.
They may come as runs, [R, S / R] consecutive slots each (what that mesh passes, and the only form
the MSA GPU kernels take): every function here reads them flattened, in that order.
"""

from collections.abc import Callable

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


def document_causal_mask(segment_ids: jax.Array, query_slots: jax.Array | None = None) -> jax.Array:
    """[B, T] segment ids -> [B, S, T] bool: key j visible to query i iff j <= i's slot and both
    are in the same segment. query_slots: [S] int, each query's slot (None: slots 0..T-1)."""
    num_keys = segment_ids.shape[-1]
    slots = jnp.arange(num_keys) if query_slots is None else query_slots.reshape(-1)
    causal = slots[:, None] >= jnp.arange(num_keys)[None, :]
    query_segments = at_query_slots(segment_ids, query_slots)
    same_segment = query_segments[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_segment


def through_whole_rows(
    attend: Callable, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
    query_slots: jax.Array | None,
) -> jax.Array:  # fmt: skip
    """attend(q, k, v, segment_ids) -> out for a kernel that takes whole rows only (S = T), run
    for the queries at `query_slots` of the key row: they go into a row of T queries, zeros in
    the other slots, whose outputs are dropped (their cotangent is zero: they add nothing to the
    key gradients). The kernel does the whole row's work. None: attend itself."""
    if query_slots is None:
        return attend(q, k, v, segment_ids)
    slots = query_slots.reshape(-1)
    row = jnp.zeros((q.shape[0], k.shape[1], *q.shape[2:]), q.dtype).at[:, slots].set(q)
    return attend(row, k, v, segment_ids)[:, slots]


def at_query_slots(x: jax.Array, query_slots: jax.Array | None) -> jax.Array:
    """Per-key values [B, T, ...] -> those of the queries [B, S, ...] (x itself when None)."""
    return x if query_slots is None else jnp.take(x, query_slots.reshape(-1), axis=1)
