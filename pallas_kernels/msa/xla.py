"""MiniMax Sparse Attention in plain XLA with memory linear in S: the path for every backend without
a kernel, and the reference those kernels are tested against at long S.

Queries go in tiles of `query_tile` under `lax.map`:
- `top_blocks`: a tile scores all keys with the indexer ([Tq, Hi, T], never [S, T]), takes the
  max over each of its documents' blocks, forces the local blocks and keeps the top-k per
  (query, index head);
- `sparse_attention`: a tile gathers, per (query, kv head), only the keys of the blocks its index
  head selected ([Tq, K, k·block, Dh]; the G query heads of a group share the gather), attends over
  them, and optionally computes the indexer's KL to the attention distribution over the same keys;
- `block_recall`: a diagnostic comparing the selection with the dense teacher's top blocks.
Tile bodies are rematerialised in the backward pass (`jax.checkpoint`); each tile's key masks are
tied to its queries (`tie_to_queries`), so that none is hoisted out of a layer scan for all tiles.

Blocks are counted from each document's first token (reference.py). A document starting at slot
d = a·block + r splits every fixed row block c into keys before slot c·block + r (its document
block c - a - 1) and the rest (document block c - a); `_document_blocks` reduces the two parts and
regroups them per query, so no per-key gather is needed to find a query's blocks.

Semantics equal `reference.py`, `query_slots` included (the queries at given slots of the key row:
a context-parallel device's chunks). Shapes: B batch, S queries (= T keys without query slots),
H query heads, K kv heads (= Hi index heads), G = H // K, Dh head dim, Di index head dim, Tq query
tile, k = selected blocks per query.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import at_query_slots
from pallas_kernels.attention.xla import (
    NEG_INF,
    dense_attention,
    distillation_kl,
    grouped_query_tiles,
    query_tiles,
    slot_tiles,
    tie_to_queries,
    untile,
    visible_keys,
)
from pallas_kernels.msa.reference import Student, kl_through_sink

__all__ = ["block_recall", "dense_attention", "sparse_attention", "top_blocks"]


def _document_blocks(values, document_start, block_size, reduce, identity):
    """Reduce per-key values [B, Tq, X, T] over each query's document blocks -> [B, Tq, X, nb].

    values: already `identity` wherever the query cannot see the key (other documents included);
    document_start: [B, Tq] slot of each query's document's first token.
    """
    batch, tile, width, num_keys = values.shape
    num_blocks = -(-num_keys // block_size)
    pad = num_blocks * block_size - num_keys
    values = jnp.pad(values, [(0, 0)] * 3 + [(0, pad)], constant_values=identity)
    values = values.reshape(batch, tile, width, num_blocks, block_size)
    shift, residue = jnp.divmod(document_start, block_size)  # [B, Tq]
    before = jnp.arange(block_size) < residue[..., None, None, None]  # [B, Tq, 1, 1, block]
    head = reduce(jnp.where(before, values, identity), axis=-1)  # fixed block c -> doc block c-a-1
    tail = reduce(jnp.where(before, identity, values), axis=-1)  # fixed block c -> doc block c-a

    def at_fixed_block(parts, offset):  # parts[..., n + a + offset] for document block n
        index = jnp.arange(num_blocks) + (shift + offset)[..., None, None]
        inside = (index >= 0) & (index < num_blocks)
        picked = jnp.take_along_axis(parts, jnp.clip(index, 0, num_blocks - 1), axis=-1)
        return jnp.where(inside, picked, identity)

    return reduce(jnp.stack([at_fixed_block(tail, 0), at_fixed_block(head, 1)]), axis=0)


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
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """Selected document blocks [B, S, Hi, min(topk_blocks, ceil(T / block_size))] int32, -1 = none.

    Same arguments and result as `reference.top_blocks`.
    """
    index_q, index_k = jax.lax.stop_gradient((index_q, index_k))
    batch, seq, num_index_heads, _ = index_q.shape
    num_blocks = -(-index_k.shape[1] // block_size)
    tile = min(query_tile, seq)

    def select_tile(args):
        slots, q_tile, segment_tile, position_tile = args
        q_tile, slots, segment_tile, position_tile = tie_to_queries(
            q_tile, slots, segment_tile, position_tile
        )
        scores = jnp.einsum("bqhd,btd->bqht", q_tile, index_k, preferred_element_type=jnp.float32)
        visible = visible_keys(slots, segment_tile, segment_ids)
        scores = jnp.where(visible[:, :, None], scores, -jnp.inf)
        block_scores = _document_blocks(
            scores, slots - position_tile, block_size, jnp.max, -jnp.inf
        )  # [B, Tq, Hi, nb]
        own_block = position_tile // block_size  # [B, Tq]
        forced = jnp.zeros((batch, tile, num_blocks), bool)
        for offset in range(local_blocks):
            forced |= jnp.maximum(own_block - offset, 0)[..., None] == jnp.arange(num_blocks)
        forced = forced[:, :, None] & (block_scores > -jnp.inf)
        block_scores = jnp.where(forced, jnp.inf, block_scores)
        values, indices = jax.lax.top_k(block_scores, min(topk_blocks, num_blocks))
        return jnp.where(values == -jnp.inf, -1, indices).astype(jnp.int32)

    xs = (
        slot_tiles(query_slots, seq, tile),
        query_tiles(index_q, tile),
        *_query_tiles(segment_ids, positions, query_slots, tile),
    )
    return untile(jax.lax.map(select_tile, xs), seq)


def _query_tiles(segment_ids, positions, query_slots, tile):
    """The queries' segment ids (padding: -1, no document) and positions, in query tiles."""
    return (
        query_tiles(at_query_slots(segment_ids, query_slots), tile, fill=-1),
        query_tiles(at_query_slots(positions, query_slots), tile),
    )


def sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    student: Student = None,
    query_tile: int = 64,
    query_slots: jax.Array | None = None,
    kl_sink: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Each query head attends over its group's selected blocks, causally, within its document.

    Same arguments and results as `reference.sparse_attention`.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[1:3]
    tile = min(query_tile, seq)
    segment_ids = jnp.asarray(segment_ids)  # gathered at traced indices below (NumPy can't)
    batch_ids = jnp.arange(batch)[:, None, None, None, None]
    head_ids = jnp.arange(num_kv_heads)[None, None, :, None, None]

    def attend_tile(args):
        slots, q_tile, segment_tile, position_tile, indices, student_q = args
        starts = (slots - position_tile)[..., None, None] + jnp.maximum(indices, 0) * block_size
        key_slots = starts[..., None] + jnp.arange(block_size)  # [B, Tq, K, k, block]
        inside = (key_slots >= 0) & (key_slots < num_keys)
        safe = jnp.clip(key_slots, 0, num_keys - 1)
        visible = (
            (indices[..., None] >= 0)
            & inside
            & (key_slots <= slots[None, :, None, None, None])
            & (segment_ids[batch_ids, safe] == segment_tile[:, :, None, None, None])
        ).reshape(batch, tile, num_kv_heads, -1)  # [B, Tq, K, n = k·block]
        keys = k[batch_ids, safe, head_ids].reshape(batch, tile, num_kv_heads, -1, head_dim)
        values = v[batch_ids, safe, head_ids].reshape(batch, tile, num_kv_heads, -1, head_dim)
        logits = jnp.einsum("bqkgd,bqknd->bqkgn", q_tile, keys, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[:, :, :, None], logits * head_dim**-0.5, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bqkgn,bqknd->bqkgd", probs.astype(v.dtype), values)
        if student is None:
            return out, None
        index_keys = student[1][batch_ids, safe].reshape(
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
        slot_tiles(query_slots, seq, tile),
        grouped_query_tiles(q, num_kv_heads, tile),
        *_query_tiles(segment_ids, positions, query_slots, tile),
        query_tiles(block_indices, tile, fill=-1),
        None if student is None else query_tiles(student[0], tile),
    )
    out, kl = jax.lax.map(jax.checkpoint(attend_tile, prevent_cse=False), xs)
    out = untile(out, seq).reshape(batch, seq, num_heads, head_dim)
    return out, kl_through_sink(None if kl is None else untile(kl, seq), kl_sink)


def block_recall(
    q: jax.Array,
    k: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    query_tile: int = 64,
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """Fraction of the dense teacher's top blocks that the selection contains, [B, S, K] fp32.

    The teacher's block mass is the dense attention probability (averaged over the group's heads)
    summed per document block; its top min(k, visible blocks) blocks are compared with the
    selected set. A diagnostic (no gradient): 1.0 means the indexer picked exactly the blocks
    attention wanted.
    """
    q, k = jax.lax.stop_gradient((q, k))
    batch, seq, num_heads, head_dim = q.shape
    topk = block_indices.shape[-1]
    num_kv_heads = k.shape[2]
    tile = min(query_tile, seq)

    def recall_tile(args):
        slots, q_tile, segment_tile, position_tile, indices = args
        q_tile, slots, segment_tile, position_tile = tie_to_queries(
            q_tile, slots, segment_tile, position_tile
        )
        visible = visible_keys(slots, segment_tile, segment_ids)
        logits = jnp.einsum("bqkgd,btkd->bqkgt", q_tile, k, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[:, :, None, None], logits * head_dim**-0.5, NEG_INF)
        mass = jax.nn.softmax(logits, axis=-1).mean(axis=3)  # [B, Tq, K, T]
        mass = jnp.where(visible[:, :, None], mass, 0.0)
        starts = slots - position_tile
        block_mass = _document_blocks(mass, starts, block_size, jnp.sum, 0.0)
        seen = _document_blocks(visible[:, :, None], starts, block_size, jnp.any, False)
        block_mass = jnp.where(seen, block_mass, -1.0)
        values, teacher_top = jax.lax.top_k(block_mass, topk)  # [B, Tq, K, k]
        wanted = values >= 0
        hit = (teacher_top[..., :, None] == indices[..., None, :]).any(-1) & wanted
        return hit.sum(-1) / jnp.maximum(wanted.sum(-1), 1)

    xs = (
        slot_tiles(query_slots, seq, tile),
        grouped_query_tiles(q, num_kv_heads, tile),
        *_query_tiles(segment_ids, positions, query_slots, tile),
        query_tiles(block_indices, tile, fill=-1),
    )
    return untile(jax.lax.map(recall_tile, xs), seq)
