"""MiniMax Sparse Attention in plain XLA with memory linear in S: the path for every backend until a
Pallas kernel replaces it, and the reference those kernels are tested against at long S.

Queries go in tiles of `query_tile` under `lax.map`:
- `top_blocks`: a tile scores all keys with the indexer ([Tq, Hi, T], never [S, T]), takes the
  block max, forces the local blocks and keeps the top-k blocks per (query, index head);
- `sparse_attention`: a tile gathers, per (query, kv head), only the key/value blocks its index
  head selected ([Tq, K, k·block, Dh]; the G query heads of a group share the gather), attends over
  them, and optionally computes the indexer's KL to the attention distribution over the same keys;
- `block_recall`: a diagnostic comparing the selection with the dense teacher's top blocks.
Tile bodies are rematerialised in the backward pass (`jax.checkpoint`).

Semantics equal `reference.py` (transformers' MSA extended to packed documents).
Shapes: B batch, S queries (= T keys), H query heads, K kv heads (= Hi index heads), G = H // K,
Dh head dim, Di index head dim, Tq query tile, k = selected blocks per query.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.xla import (
    NEG_INF,
    distillation_kl,
    grouped_query_tiles,
    query_tiles,
    untile,
    visible_keys,
)


def top_blocks(
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    query_tile: int = 128,
) -> jax.Array:
    """Selected key blocks [B, S, Hi, min(topk_blocks, ceil(S / block_size))] int32, -1 = none.

    index_q: [B, S, Hi, Di] and index_k: [B, S, Di] after norm and RoPE; segment_ids, positions:
    [B, S]. Equals `reference.select_blocks(reference.index_scores(index_q, index_k), ...)`.
    """
    index_q, index_k = jax.lax.stop_gradient((index_q, index_k))
    batch, seq, num_index_heads, _ = index_q.shape
    num_blocks = -(-seq // block_size)
    tile = min(query_tile, seq)
    pad = num_blocks * block_size - seq

    def select_tile(args):
        index, q_tile, segment_tile, position_tile = args
        slots = index * tile + jnp.arange(tile)
        scores = jnp.einsum("bqhd,btd->bqht", q_tile, index_k, preferred_element_type=jnp.float32)
        visible = visible_keys(slots, segment_tile, segment_ids)
        scores = jnp.where(visible[:, :, None], scores, -jnp.inf)
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
        block_scores = scores.reshape(batch, tile, num_index_heads, num_blocks, block_size).max(-1)
        own_block = slots // block_size  # [Tq]
        first_block = jnp.maximum(slots - position_tile, 0) // block_size  # [B, Tq]
        forced = jnp.zeros((batch, tile, num_blocks), bool)
        for offset in range(local_blocks):
            local = jnp.maximum(own_block - offset, first_block)
            forced |= local[..., None] == jnp.arange(num_blocks)
        block_scores = jnp.where(forced[:, :, None], jnp.inf, block_scores)
        values, indices = jax.lax.top_k(block_scores, min(topk_blocks, num_blocks))
        return jnp.where(values == -jnp.inf, -1, indices).astype(jnp.int32)

    xs = (
        jnp.arange(-(-seq // tile)),
        query_tiles(index_q, tile),
        query_tiles(segment_ids, tile, fill=-1),
        query_tiles(positions, tile),
    )
    return untile(jax.lax.map(select_tile, xs), seq)


def sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    *,
    block_size: int,
    student: tuple[jax.Array, jax.Array] | None = None,
    query_tile: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """Each query head attends over its group's selected blocks, causally, within its document.

    Args:
      q: [B, S, H, Dh]; k, v: [B, S, K, Dh]; block_indices: [B, S, K, k] from `top_blocks`;
      segment_ids: [B, S].
      student: (index_q [B, S, Hi, Di], index_k [B, S, Di]) or None: also return the indexer's
        KL(teacher ‖ student) over the selected keys (spec/msa.md §2), teacher = the attention
        probabilities averaged over the group's G heads (stop_gradient), student = softmax of
        index scores · Di^-½ over the same keys.
    Returns:
      out [B, S, H, Dh], and KL [B, S, Hi] fp32 or None.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    num_blocks = -(-seq // block_size)
    tile = min(query_tile, seq)
    pad = num_blocks * block_size - seq

    def blocks(x, fill=0):  # [B, S, ...] -> [B, nb, block, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(batch, num_blocks, block_size, *x.shape[2:])

    k_blocks, v_blocks = blocks(k), blocks(v)  # [B, nb, block, K, Dh]
    segment_blocks = blocks(segment_ids, fill=-2)  # key padding matches no query
    index_k_blocks = None if student is None else blocks(student[1])  # [B, nb, block, Di]
    batch_ids = jnp.arange(batch)[:, None, None, None]
    head_ids = jnp.arange(num_kv_heads)[None, None, :, None]

    def attend_tile(args):
        index, q_tile, segment_tile, indices, student_q = args
        slots = index * tile + jnp.arange(tile)
        safe = jnp.maximum(indices, 0)  # [B, Tq, K, k]
        keys = k_blocks[batch_ids, safe, :, head_ids]  # [B, Tq, K, k, block, Dh]
        values = v_blocks[batch_ids, safe, :, head_ids]
        key_slots = safe[..., None] * block_size + jnp.arange(block_size)  # [B, Tq, K, k, block]
        visible = (
            (indices[..., None] >= 0)
            & (key_slots <= slots[None, :, None, None, None])
            & (segment_blocks[batch_ids, safe] == segment_tile[:, :, None, None, None])
        ).reshape(batch, tile, num_kv_heads, -1)  # [B, Tq, K, n = k·block]
        keys = keys.reshape(batch, tile, num_kv_heads, -1, head_dim)
        values = values.reshape(batch, tile, num_kv_heads, -1, head_dim)
        logits = jnp.einsum("bqkgd,bqknd->bqkgn", q_tile, keys, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[:, :, :, None], logits * head_dim**-0.5, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bqkgn,bqknd->bqkgd", probs.astype(v.dtype), values)
        if student is None:
            return out, None
        index_keys = index_k_blocks[batch_ids, safe].reshape(
            batch, tile, num_kv_heads, -1, student_q.shape[-1]
        )
        student_logits = (
            jnp.einsum(
                "bqhd,bqhnd->bqhn", student_q, index_keys, preferred_element_type=jnp.float32
            )
            * student_q.shape[-1] ** -0.5
        )
        return out, distillation_kl(probs.mean(axis=3), student_logits, visible)

    xs = (
        jnp.arange(-(-seq // tile)),
        grouped_query_tiles(q, num_kv_heads, tile),
        query_tiles(segment_ids, tile, fill=-1),
        query_tiles(block_indices, tile, fill=-1),
        None if student is None else query_tiles(student[0], tile),
    )
    out, kl = jax.lax.map(jax.checkpoint(attend_tile, prevent_cse=False), xs)
    out = untile(out, seq).reshape(batch, seq, num_heads, head_dim)
    return out, None if kl is None else untile(kl, seq)


def block_recall(
    q: jax.Array,
    k: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    *,
    block_size: int,
    query_tile: int = 64,
) -> jax.Array:
    """Fraction of the dense teacher's top blocks that the selection contains, [B, S, K] fp32.

    The teacher's block mass is the dense attention probability (averaged over the group's heads)
    summed per key block; its top min(k, visible blocks) blocks are compared with the selected set.
    A diagnostic (no gradient): 1.0 means the indexer picked exactly the blocks attention wanted.
    """
    q, k = jax.lax.stop_gradient((q, k))
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    num_blocks = -(-seq // block_size)
    topk = block_indices.shape[-1]
    tile = min(query_tile, seq)
    pad = num_blocks * block_size - seq

    def recall_tile(args):
        index, q_tile, segment_tile, indices = args
        slots = index * tile + jnp.arange(tile)
        visible = visible_keys(slots, segment_tile, segment_ids)
        logits = jnp.einsum("bqkgd,btkd->bqkgt", q_tile, k, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[:, :, None, None], logits * head_dim**-0.5, NEG_INF)
        mass = jax.nn.softmax(logits, axis=-1).mean(axis=3)  # [B, Tq, K, T]
        mass = jnp.pad(jnp.where(visible[:, :, None], mass, 0.0), [(0, 0)] * 3 + [(0, pad)])
        block_mass = mass.reshape(batch, tile, num_kv_heads, num_blocks, block_size).sum(-1)
        visible = jnp.pad(visible, [(0, 0), (0, 0), (0, pad)])
        seen = visible.reshape(batch, tile, num_blocks, block_size).any(-1)  # [B, Tq, nb]
        block_mass = jnp.where(seen[:, :, None], block_mass, -1.0)
        values, teacher_top = jax.lax.top_k(block_mass, topk)  # [B, Tq, K, k]
        wanted = values >= 0
        hit = (teacher_top[..., :, None] == indices[..., None, :]).any(-1) & wanted
        return hit.sum(-1) / jnp.maximum(wanted.sum(-1), 1)

    xs = (
        jnp.arange(-(-seq // tile)),
        grouped_query_tiles(q, num_kv_heads, tile),
        query_tiles(segment_ids, tile, fill=-1),
        query_tiles(block_indices, tile, fill=-1),
    )
    return untile(jax.lax.map(recall_tile, xs), seq)
