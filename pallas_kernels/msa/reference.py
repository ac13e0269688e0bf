"""MiniMax Sparse Attention in plain `jnp`: readable, exact, O(S²) memory — for tests and small S.

This module owns the MSA signatures; `xla.py` and the GPU kernels implement the same functions.
Follows `spec/msa.md` §1 and transformers' `minimax_m3_vl` (spec/m3_architecture.md §3.5), extended
to packed rows as MiniMax's own kernels do (their `cu_seqlens` layout): key blocks are counted from
each document's first token, so block n of a document holds the keys at positions
[n·block_size, (n+1)·block_size) of that document, wherever the packer put it in the row. A
document's selection, output and KL therefore do not depend on its offset in the row; one document
per row starting at slot 0 is exactly transformers' layout. Keys of other documents are invisible
to the index scores and to attention.

Block ids are per document (0 = the document's first block); `positions` (0 at each document's
first token) locate them.

Query slots (every function's optional `query_slots` [S]): the queries are the tokens at those
slots of the key row, S <= T, e.g. a context-parallel device's two chunks against the keys
gathered from every device (m3jax/context_parallel.py). `segment_ids` and `positions` are then the
key row's [B, T]; a query's own come from its slot. Each query's result equals that of the same
token with all T queries. None (the default): the queries are slots 0..T-1, computed exactly as
without the argument.

Shapes: B batch, S queries, T keys (= S without query slots), Hi index heads, Di index head dim,
H query heads, K kv heads (= Hi), Dh head dim, k selected blocks per query.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import at_query_slots, document_causal_mask, gqa_attention

# `checkpoint_name` of the attention residuals that the kernel backends' forwards compute (the
# output and LSEs): a remat policy that saves them (`model.remat: save_attention`) runs those
# forward kernels once a step, not twice
SAVED_BY_REMAT = "msa_attention"
# `checkpoint_name` of the kernels' LSEs ([B, S, H] and [B, S, K] fp32: 1/64 of the output's
# bytes at M3's layout), which every remat policy saves (m3jax/stacking.py): a layer's recompute
# then runs neither the teacher pass nor the student's kernel for LSE_z (the Mosaic forward with
# the KL on slots), only what the output needs
SAVED_BY_ANY_REMAT = "msa_attention_lses"

Student = tuple[jax.Array, jax.Array] | None  # (index_q [B, S, Hi, Di], index_k [B, S, Di])


def index_scores(index_q: jax.Array, index_k: jax.Array) -> jax.Array:
    """[B, S, Hi, Di] × [B, T, Di] -> [B, Hi, S, T] fp32 token scores (no scale, no softmax)."""
    return jnp.einsum("bshd,btd->bhst", index_q, index_k, preferred_element_type=jnp.float32)


def key_blocks(positions: jax.Array, block_size: int) -> jax.Array:
    """[B, T] positions -> [B, T] the block of each key within its own document."""
    return positions // block_size


def select_blocks(
    scores: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """Top-k key blocks per (query, index head) by block-max score, local blocks forced.

    Args:
      scores: [B, Hi, S, T] fp32 token scores from `index_scores`.
      segment_ids: [B, T] document ids (keys and queries share the row).
      positions: [B, T] position within the document (0 at its first token).
      query_slots: [S] int32 or None (module docstring).
    Returns:
      [B, S, Hi, min(topk_blocks, ceil(T / block_size))] int32 document block ids; -1 marks
      padding (a query with fewer visible blocks than topk_blocks). Only the set of valid ids is
      meaningful. Ties go to the lower block id. The local blocks (the query's own and the
      `local_blocks - 1` before it, never before the document's first) are forced in.
    """
    num_keys = scores.shape[-1]
    num_blocks = -(-num_keys // block_size)
    visible = document_causal_mask(segment_ids, query_slots)[:, None]  # [B, 1, S, T]
    scores = jnp.where(visible, scores, -jnp.inf)

    def block_max(row_scores, row_blocks):  # [Hi, S, T], [T] -> [Hi, S, nb]
        by_key = jnp.moveaxis(row_scores, -1, 0)
        return jnp.moveaxis(jax.ops.segment_max(by_key, row_blocks, num_blocks), 0, -1)

    block_scores = jax.vmap(block_max)(scores, key_blocks(positions, block_size))
    own_block = key_blocks(at_query_slots(positions, query_slots), block_size)  # [B, S]
    block_ids = jnp.arange(num_blocks)
    forced = jnp.zeros(own_block.shape + (num_blocks,), bool)
    for offset in range(local_blocks):
        forced |= jnp.maximum(own_block - offset, 0)[..., None] == block_ids
    # A forced block is kept if it holds a visible key (always so when positions start at 0).
    block_scores = jnp.where(forced[:, None] & (block_scores > -jnp.inf), jnp.inf, block_scores)

    values, indices = jax.lax.top_k(block_scores, min(topk_blocks, num_blocks))
    indices = jnp.where(values == -jnp.inf, -1, indices).astype(jnp.int32)
    return indices.transpose(0, 2, 1, 3)


def selection_mask(block_indices: jax.Array, positions: jax.Array, *, block_size: int) -> jax.Array:
    """[B, S, Hi, k] block ids -> [B, Hi, S, T] bool: key j's block is among the query's selection.

    Block ids are per document, so the mask is meaningful only together with the document mask
    (`document_causal_mask`): it marks key j when its block number within its own document matches.
    """
    key_block = key_blocks(positions, block_size)[:, None, None, None, :]  # [B, 1, 1, 1, T]
    chosen = (block_indices[..., None] == key_block).any(axis=-2)  # [B, S, Hi, T]
    return chosen.transpose(0, 2, 1, 3)


def attended_keys(
    block_indices: jax.Array | None,
    segment_ids: jax.Array,
    positions: jax.Array,
    block_size: int,
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """[B, K, S, T] bool: the keys each query attends to — its selected blocks' keys, causal, within
    its document; every causal key of its document when `block_indices` is None (dense)."""
    visible = document_causal_mask(segment_ids, query_slots)[:, None]
    if block_indices is None:
        return visible
    return visible & selection_mask(block_indices, positions, block_size=block_size)


def top_blocks(
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """Selected blocks [B, S, Hi, k] straight from the index projections (see `select_blocks`).

    index_q: [B, S, Hi, Di] and index_k: [B, T, Di] after norm and RoPE; segment_ids, positions:
    [B, T]; query_slots: [S] or None. No gradient flows through the selection.
    """
    scores = index_scores(*jax.lax.stop_gradient((index_q, index_k)))
    return select_blocks(
        scores,
        segment_ids,
        positions,
        block_size=block_size,
        topk_blocks=topk_blocks,
        local_blocks=local_blocks,
        query_slots=query_slots,
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
    query_slots: jax.Array | None = None,
    kl_sink: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Exact GQA attention of each query over its group's selected blocks, causal, within documents.

    Args:
      q: [B, S, H, Dh]; k, v: [B, T, K, Dh] with K = Hi; block_indices: [B, S, Hi, k] from
        `top_blocks`; segment_ids, positions: [B, T]; query_slots: [S] or None.
      student: (index_q [B, S, Hi, Di], index_k [B, T, Di]) or None: also return the indexer's
        KL(teacher ‖ student) over the selected keys (`indexer_kl`).
      kl_sink: [B, S, Hi] fp32 or None (needs a student): the KL's value goes to the sink's
        cotangent instead of the output (`kl_through_sink`), so a backend may compute it in the
        backward, beside the student's gradients, rather than in the forward.
    Returns:
      out [B, S, H, Dh], and KL [B, S, Hi] fp32 (zeros under a sink) or None.
    """
    attended = attended_keys(block_indices, segment_ids, positions, block_size, query_slots)
    out = gqa_attention(q, k, v, attended[:, :, None])  # the G heads of a group share a mask
    if student is None:
        return out, kl_through_sink(None, kl_sink)
    return out, kl_through_sink(indexer_kl(q, k, *student, attended), kl_sink)


def kl_through_sink(kl: jax.Array | None, kl_sink: jax.Array | None) -> jax.Array | None:
    """The KL [B, S, Hi] as `sparse_attention` returns it under `kl_sink` (None: `kl` itself):
    zeros whose cotangent still reaches the KL (its gradients into the student are unchanged),
    while the sink's cotangent is the KL's value. A training step that differentiates the sink
    too thus reads the KL from its gradients (the loss' value lacks the KL's term then). Only
    where the KL output takes part in the differentiated function does its value arrive."""
    if kl_sink is None:
        return kl
    if kl is None:
        raise ValueError("a KL sink needs the indexer's student")
    check_kl_sink(kl_sink, kl.shape)
    return _sunk(kl, kl_sink)


def check_kl_sink(kl_sink: jax.Array, kl_shape: tuple[int, ...]) -> None:
    """Refuses a KL sink that is not of the KL's shape [B, S, Hi]."""
    if kl_sink.shape != tuple(kl_shape):
        raise ValueError(f"kl_sink has shape {kl_sink.shape}, the KL {tuple(kl_shape)}")


@jax.custom_vjp
def _sunk(kl: jax.Array, kl_sink: jax.Array) -> jax.Array:
    return jnp.zeros_like(kl)


def _sunk_forward(kl, kl_sink):
    return jnp.zeros_like(kl), kl


def _sunk_backward(kl, d_kl):
    return d_kl, kl.astype(jnp.float32)


_sunk.defvjp(_sunk_forward, _sunk_backward)


def indexer_kl(
    q: jax.Array, k: jax.Array, index_q: jax.Array, index_k: jax.Array, attended: jax.Array
) -> jax.Array:
    """The indexer's training objective per (query, index head), spec/msa.md §2: [B, S, Hi] fp32.

    KL(teacher ‖ student) over the keys the query attends to (`attended` [B, K, S, T] from
    `attended_keys`). Teacher: the main branch's attention probabilities averaged over the G query
    heads of index head h's group, treated as a constant. Student: softmax of
    index_q · index_k · Di^-½ over the same keys.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    grouped = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32)
    lowest = jnp.finfo(jnp.float32).min
    logits = jnp.where(attended[:, :, None], logits * head_dim**-0.5, lowest)
    teacher = jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1).mean(axis=2))  # [B, K, S, T]
    student = index_scores(index_q, index_k) * index_q.shape[-1] ** -0.5
    log_student = jax.nn.log_softmax(jnp.where(attended, student, lowest), axis=-1)
    terms = jax.scipy.special.xlogy(teacher, teacher) - teacher * log_student
    terms = jnp.where(attended, terms, 0.0)
    return terms.sum(-1).transpose(0, 2, 1)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    student: Student = None,
    query_slots: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention within documents (the MSA warm-up, and MSA whenever T <= k·block_size);
    with a student, also the indexer's KL over every causal key of the query's document."""
    attended = document_causal_mask(segment_ids, query_slots)[:, None]
    out = gqa_attention(q, k, v, attended[:, :, None])
    if student is None:
        return out, None
    return out, indexer_kl(q, k, *student, attended)


def block_recall(
    q: jax.Array,
    k: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """Share of the dense teacher's top-k blocks (by attention mass) kept by the selection.

    Returns [B, S, K] fp32."""
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    num_blocks = -(-k.shape[1] // block_size)
    visible = document_causal_mask(segment_ids, query_slots)  # [B, S, T]
    grouped = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32)
    logits = jnp.where(visible[:, None, None], logits * head_dim**-0.5, -jnp.inf)
    mass = jax.nn.softmax(logits, axis=-1).mean(axis=2)  # [B, K, S, T]
    one_hot = key_blocks(positions, block_size)[..., None] == jnp.arange(num_blocks)  # [B, T, nb]
    block_mass = jnp.einsum("bkst,btn->bksn", mass, one_hot.astype(mass.dtype))
    seen = jnp.einsum("bst,btn->bsn", visible.astype(jnp.float32), one_hot.astype(jnp.float32)) > 0
    block_mass = jnp.where(seen[:, None], block_mass, -1.0)
    values, teacher_top = jax.lax.top_k(block_mass, block_indices.shape[-1])  # [B, K, S, k]
    selected = block_indices.transpose(0, 2, 1, 3)  # [B, K, S, k]
    wanted = values >= 0
    hit = (teacher_top[..., :, None] == selected[..., None, :]).any(-1) & wanted
    return (hit.sum(-1) / jnp.maximum(wanted.sum(-1), 1)).transpose(0, 2, 1)
