"""The attention computations a layer needs, by implementation (config `attention_impl`).

"reference": the O(S²) `jnp` references in pallas_kernels (exact, readable; tests and short S).
"xla": query-tiled XLA with memory linear in S (pallas_kernels/*/xla.py), the default.
Both take the same arrays and return the same things, so the model switches with one field.

Shapes: B batch, S sequence, H query heads, K kv heads (= Hi index heads), Dh head dim, Di index dim.
"""

import jax

from m3jax.config import MSAConfig
from pallas_kernels.attention import xla as attention_xla
from pallas_kernels.attention.reference import document_causal_mask, gqa_attention
from pallas_kernels.msa import reference as msa_reference
from pallas_kernels.msa import xla as msa_xla

Student = tuple[jax.Array, jax.Array] | None  # (index_q [B, S, Hi, Di], index_k [B, S, Di])


def dense(
    impl: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, student: Student
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention within documents -> (out [B, S, H, Dh], indexer KL [B, S, Hi] or None)."""
    if impl == "xla":
        return attention_xla.dense_attention(q, k, v, segment_ids, student=student)
    out = gqa_attention(q, k, v, document_causal_mask(segment_ids)[:, None, None])
    if student is None:
        return out, None
    return out, msa_reference.indexer_kl(q, k, *student, None, segment_ids, block_size=1)


def select(
    impl: str,
    msa: MSAConfig,
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """Top-k key blocks per (query, index head) -> [B, S, Hi, k] int32, -1 = none."""
    module = msa_xla if impl == "xla" else msa_reference
    return module.top_blocks(
        index_q, index_k, segment_ids, positions, block_size=msa.block_size,
        topk_blocks=msa.topk_blocks, local_blocks=msa.local_blocks,
    )  # fmt: skip


def sparse(
    impl: str,
    msa: MSAConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    blocks: jax.Array,
    segment_ids: jax.Array,
    student: Student,
) -> tuple[jax.Array, jax.Array | None]:
    """Attention over the selected blocks -> (out [B, S, H, Dh], indexer KL [B, S, Hi] or None)."""
    if impl == "xla":
        return msa_xla.sparse_attention(
            q, k, v, blocks, segment_ids, block_size=msa.block_size, student=student
        )
    out = msa_reference.sparse_attention(q, k, v, blocks, segment_ids, block_size=msa.block_size)
    if student is None:
        return out, None
    kl = msa_reference.indexer_kl(q, k, *student, blocks, segment_ids, block_size=msa.block_size)
    return out, kl


def recall(
    impl: str, msa: MSAConfig, q: jax.Array, k: jax.Array, blocks: jax.Array, segment_ids: jax.Array
) -> jax.Array:
    """Share of the dense teacher's top blocks that the selection kept -> [B, S, K] fp32."""
    module = msa_xla if impl == "xla" else msa_reference
    return module.block_recall(q, k, blocks, segment_ids, block_size=msa.block_size)
