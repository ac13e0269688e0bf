"""Attention of one new token per row over a KV cache (m3jax/kv_cache.py): dense and MSA.

The MSA step makes, for the new query, exactly the selection `pallas_kernels/msa/reference.py`'s
`select_blocks` makes for that query in a full forward: index scores against every cached index
key up to the query's own slot, the max over each block, the local block(s) forced, the top
`topk_blocks` blocks (ties to the lower block id, -1 = no block). Attention then gathers only
those blocks' keys and values — topk_blocks · block_size slots per kv head, whatever the cache
length — and attends exactly over them. Rows are right-padded, so slot = position (kv_cache.py).

Shapes: B batch, T cache slots, H query heads, K kv heads (= Hi index heads), G = H / K, Dh head
dim, Di index head dim, topk_blocks selected blocks.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import gqa_attention


def dense(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """q [B, 1, H, Dh] at positions [B] over cached keys, values [B, T, K, Dh] -> [B, 1, H, Dh]."""
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]  # [B, T]
    return gqa_attention(q, keys, values, visible[:, None, None, None, :])


def select_blocks(
    index_q: jax.Array,
    index_keys: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
) -> jax.Array:
    """index_q [B, 1, Hi, Di], cached index_keys [B, T, Di] (T a multiple of block_size) and the
    query positions [B] -> selected blocks [B, Hi, min(topk_blocks, T / block_size)], -1 = none."""
    batch, slots, _ = index_keys.shape
    if slots % block_size:
        raise ValueError(f"cache length {slots} is not a multiple of {block_size=}")
    num_blocks = slots // block_size
    scores = jnp.einsum(
        "bhd,btd->bht", index_q[:, 0], index_keys, preferred_element_type=jnp.float32
    )
    visible = jnp.arange(slots)[None, :] <= positions[:, None]  # [B, T]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    block_scores = scores.reshape(*scores.shape[:2], num_blocks, block_size).max(-1)
    own_block = positions // block_size  # [B]
    block_ids = jnp.arange(num_blocks)
    forced = jnp.zeros((batch, num_blocks), bool)
    for offset in range(local_blocks):
        forced |= jnp.maximum(own_block - offset, 0)[:, None] == block_ids
    block_scores = jnp.where(forced[:, None] & (block_scores > -jnp.inf), jnp.inf, block_scores)
    values, indices = jax.lax.top_k(block_scores, min(topk_blocks, num_blocks))
    return jnp.where(values == -jnp.inf, -1, indices).astype(jnp.int32)


def sparse(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    blocks: jax.Array,
    positions: jax.Array,
    block_size: int,
) -> jax.Array:
    """Exact attention of q [B, 1, H, Dh] over its group's selected blocks [B, K, topk_blocks] of
    the cached keys, values [B, T, K, Dh], causal at positions [B] -> [B, 1, H, Dh]. Reads only
    the selected blocks (a -1 entry re-reads the query's own block, masked)."""
    batch, _, num_kv_heads, _ = keys.shape
    own_block = (positions // block_size)[:, None, None]  # always selected: -1 slots read it
    read = jnp.where(blocks >= 0, blocks, own_block)
    slots = (read[..., None] * block_size + jnp.arange(block_size)).reshape(
        batch, num_kv_heads, -1
    )  # [B, K, topk_blocks·block_size]
    # [B, topk_blocks·block_size, K]: the gathers land in keys' layout (a transposed gather sent
    # XLA:CPU's bf16 dot down a path it does not implement: BF16 x BF16 = F32)
    by_slot = slots.transpose(0, 2, 1)
    rows = jnp.arange(batch)[:, None, None]
    heads = jnp.arange(num_kv_heads)[None, None, :]
    gathered_keys = keys[rows, by_slot, heads]  # [B, topk_blocks·block_size, K, Dh]
    gathered_values = values[rows, by_slot, heads]
    chosen = jnp.repeat(blocks >= 0, block_size, axis=-1)  # [B, K, topk_blocks·block_size]
    visible = chosen & (slots <= positions[:, None, None])
    return gqa_attention(q, gathered_keys, gathered_values, visible[:, :, None, None, :])
