"""MiniMax Sparse Attention in plain `jnp`: readable, exact, O(S²) memory — for tests and small S.

Follows `spec/msa.md` §1 and transformers' `minimax_m3_vl` (spec/m3_architecture.md §3.5), extended
to packed rows: keys of other documents are invisible to the index scores as well as to attention, and
local forcing never reaches before the query's document start, so a document that starts at a block
boundary is selected exactly as if it ran alone.

Shapes: B batch, S queries, T keys (= S here), Hi index heads, Di index head dim, H query heads,
K kv heads (= Hi), Dh head dim. Block size and top-k are `block_size` and `topk_blocks`.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import document_causal_mask, gqa_attention


def index_scores(index_q: jax.Array, index_k: jax.Array) -> jax.Array:
    """[B, S, Hi, Di] × [B, T, Di] -> [B, Hi, S, T] fp32 token scores (no scale, no softmax)."""
    return jnp.einsum("bshd,btd->bhst", index_q, index_k, preferred_element_type=jnp.float32)


def select_blocks(
    scores: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
) -> jax.Array:
    """Top-k key blocks per (query, index head) by block-max score, local blocks forced.

    Args:
      scores: [B, Hi, S, T] fp32 token scores from `index_scores`.
      segment_ids: [B, S] document ids (keys and queries share the row).
      positions: [B, S] position within the document (0 at its first token).
    Returns:
      [B, S, Hi, min(topk_blocks, ceil(T / block_size))] int32 block ids; -1 marks padding (a query
      with fewer visible blocks than topk_blocks). Only the set of valid ids is meaningful.
    """
    batch, num_index_heads, seq, num_keys = scores.shape
    num_blocks = -(-num_keys // block_size)
    visible = document_causal_mask(segment_ids)[:, None]  # [B, 1, S, T]
    scores = jnp.where(visible, scores, -jnp.inf)
    pad = num_blocks * block_size - num_keys
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    block_scores = scores.reshape(batch, num_index_heads, seq, num_blocks, block_size).max(-1)

    slot = jnp.arange(seq)[None, :]
    own_block = slot // block_size  # [1, S]
    first_block = jnp.maximum(slot - positions, 0) // block_size  # the document's first block
    block_ids = jnp.arange(num_blocks)
    forced = jnp.zeros((batch, seq, num_blocks), bool)
    for offset in range(local_blocks):
        local = jnp.maximum(own_block - offset, first_block)  # [B, S]
        forced |= local[..., None] == block_ids
    block_scores = jnp.where(forced[:, None], jnp.inf, block_scores)

    values, indices = jax.lax.top_k(block_scores, min(topk_blocks, num_blocks))
    indices = jnp.where(values == -jnp.inf, -1, indices).astype(jnp.int32)
    return indices.transpose(0, 2, 1, 3)


def selection_mask(block_indices: jax.Array, num_keys: int, *, block_size: int) -> jax.Array:
    """[B, S, Hi, k] block ids -> [B, Hi, S, T] bool: key j's block is among the query's selection."""
    key_block = jnp.arange(num_keys) // block_size
    chosen = (block_indices[..., None] == key_block).any(axis=-2)  # [B, S, Hi, T]
    return chosen.transpose(0, 2, 1, 3)


def sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    *,
    block_size: int,
) -> jax.Array:
    """Exact GQA attention of each query over its group's selected blocks, causal, within documents.

    Args:
      q: [B, S, H, Dh]; k, v: [B, S, K, Dh] with K = Hi; block_indices: [B, S, Hi, k] from
        `select_blocks`; segment_ids: [B, S].
    Returns:
      [B, S, H, Dh].
    """
    num_keys = k.shape[1]
    chosen = selection_mask(block_indices, num_keys, block_size=block_size)  # [B, K, S, T]
    visible = document_causal_mask(segment_ids)[:, None]  # [B, 1, S, T]
    mask = (chosen & visible)[:, :, None]  # [B, K, 1, S, T]: shared by the G heads of a group
    return gqa_attention(q, k, v, mask)


def top_blocks(
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
) -> jax.Array:
    """Selected blocks [B, S, Hi, k] straight from the index projections (see `select_blocks`)."""
    scores = index_scores(index_q, index_k)
    return select_blocks(
        scores,
        segment_ids,
        positions,
        block_size=block_size,
        topk_blocks=topk_blocks,
        local_blocks=local_blocks,
    )


def indexer_kl(
    q: jax.Array,
    k: jax.Array,
    index_q: jax.Array,
    index_k: jax.Array,
    block_indices: jax.Array | None,
    segment_ids: jax.Array,
    *,
    block_size: int,
) -> jax.Array:
    """The indexer's training objective per (query, index head), spec/msa.md §2: [B, S, Hi] fp32.

    KL(teacher ‖ student) over the keys the query attends to — its selected blocks, or every causal
    key of its document when `block_indices` is None (the dense warm-up). Teacher: the main
    branch's attention probabilities averaged over the G query heads of index head h's group,
    treated as a constant. Student: softmax of index_q · index_k · Di^-½ over the same keys.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    visible = document_causal_mask(segment_ids)[:, None]  # [B, 1, S, T]
    if block_indices is not None:
        visible = visible & selection_mask(block_indices, seq, block_size=block_size)
    grouped = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32)
    lowest = jnp.finfo(jnp.float32).min
    logits = jnp.where(visible[:, :, None], logits * head_dim**-0.5, lowest)
    teacher = jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1).mean(axis=2))  # [B, K, S, T]
    student = index_scores(index_q, index_k) * index_q.shape[-1] ** -0.5
    log_student = jax.nn.log_softmax(jnp.where(visible, student, lowest), axis=-1)
    terms = jax.scipy.special.xlogy(teacher, teacher) - teacher * log_student
    terms = jnp.where(visible, terms, 0.0)
    return terms.sum(-1).transpose(0, 2, 1)


def block_recall(
    q: jax.Array,
    k: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    *,
    block_size: int,
) -> jax.Array:
    """Share of the dense teacher's top-k blocks (by attention mass) that were selected: [B, S, K]."""
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    num_blocks = -(-seq // block_size)
    visible = document_causal_mask(segment_ids)  # [B, S, T]
    grouped = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32)
    logits = jnp.where(visible[:, None, None], logits * head_dim**-0.5, -jnp.inf)
    mass = jax.nn.softmax(logits, axis=-1).mean(axis=2)  # [B, K, S, T]
    key_block = jnp.arange(seq) // block_size
    one_hot = key_block[:, None] == jnp.arange(num_blocks)  # [T, nb]
    block_mass = jnp.einsum("bkst,tn->bksn", mass, one_hot.astype(mass.dtype))
    seen = jnp.einsum("bst,tn->bsn", visible.astype(jnp.float32), one_hot.astype(jnp.float32)) > 0
    block_mass = jnp.where(seen[:, None], block_mass, -1.0)
    values, teacher_top = jax.lax.top_k(block_mass, block_indices.shape[-1])  # [B, K, S, k]
    selected = block_indices.transpose(0, 2, 1, 3)  # [B, K, S, k]
    wanted = values >= 0
    hit = (teacher_top[..., :, None] == selected[..., None, :]).any(-1) & wanted
    return (hit.sum(-1) / jnp.maximum(wanted.sum(-1), 1)).transpose(0, 2, 1)
