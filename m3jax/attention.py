"""M3 attention: GQA with per-head QK norm and partial RoPE; on sparse layers, MSA block selection.

spec/m3_architecture.md §3.4-3.5. Order: project -> per-head Gemma norm -> RoPE -> attention.
A "minimax_m3_sparse" layer adds the lightning indexer: it reads the same normed hidden state, but
through stop_gradient (spec/msa.md §2: the LM loss never trains the indexer; its own KL loss does),
scores key blocks and keeps the top-k per (query, index head); query head h uses the selection of
index head h // G, the same grouping as GQA.

Shapes: B batch, S sequence, D model width, H query heads, K kv heads (= Hi index heads),
Dh head dim, Di index head dim, R rotary dims.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import params
from m3jax.config import ModelConfig
from m3jax.norms import RMSNorm
from m3jax.rope import apply_rope
from pallas_kernels.attention.reference import gqa_attention
from pallas_kernels.msa import reference as msa_reference


class AttentionInputs(NamedTuple):
    """Per-row quantities shared by every layer of one forward pass."""

    positions: jax.Array  # [B, S] position within the document
    segment_ids: jax.Array  # [B, S] document id; 0 = padding
    rope_cos: jax.Array  # [B, S, R] fp32
    rope_sin: jax.Array  # [B, S, R] fp32
    dense_mask: jax.Array  # [B, S, S] bool: causal and same document


class Indexer(nnx.Module):
    """MSA's index branch: Hi query heads and ONE shared key head of width Di, no values."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        msa, dim, std = config.msa, config.hidden_size, config.init_std
        self.q_proj = params.normal(
            rngs, (dim, msa.index_heads, msa.index_head_dim), ("embed", "kv_heads", "head_dim"), std
        )
        self.k_proj = params.normal(rngs, (dim, msa.index_head_dim), ("embed", "head_dim"), std)
        self.q_norm = RMSNorm(msa.index_head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(msa.index_head_dim, config.rms_norm_eps)
        self.msa = msa

    def __call__(self, x: jax.Array, inputs: AttentionInputs) -> jax.Array:
        """x: [B, S, D] normed hidden state -> selected block ids [B, S, Hi, k] (-1 = none)."""
        x = jax.lax.stop_gradient(x)
        index_q = self.q_norm(jnp.einsum("bsd,dhe->bshe", x, self.q_proj[...].astype(x.dtype)))
        index_k = self.k_norm(x @ self.k_proj[...].astype(x.dtype))  # [B, S, Di]
        index_q = apply_rope(index_q, inputs.rope_cos, inputs.rope_sin)
        index_k = apply_rope(index_k[:, :, None], inputs.rope_cos, inputs.rope_sin)[:, :, 0]
        scores = msa_reference.index_scores(index_q, index_k)
        return msa_reference.select_blocks(
            scores,
            inputs.segment_ids,
            inputs.positions,
            block_size=self.msa.block_size,
            topk_blocks=self.msa.topk_blocks,
            local_blocks=self.msa.local_blocks,
        )


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, sparse: bool, rngs: nnx.Rngs):
        dim, heads, kv_heads, head_dim = (
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        std = config.init_std
        self.q_proj = params.normal(
            rngs, (dim, heads, head_dim), ("embed", "heads", "head_dim"), std
        )
        self.k_proj = params.normal(
            rngs, (dim, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std
        )
        self.v_proj = params.normal(
            rngs, (dim, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std
        )
        self.o_proj = params.normal(
            rngs, (heads, head_dim, dim), ("heads", "head_dim", "embed"), std
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.indexer = Indexer(config, rngs=rngs) if sparse else None
        self.block_size = config.msa.block_size

    def __call__(self, x: jax.Array, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array | None]:
        """x: [B, S, D] normed hidden state -> ([B, S, D], selected blocks [B, S, Hi, k] or None)."""
        dtype = x.dtype
        q = self.q_norm(jnp.einsum("bsd,dhe->bshe", x, self.q_proj[...].astype(dtype)))
        k = self.k_norm(jnp.einsum("bsd,dhe->bshe", x, self.k_proj[...].astype(dtype)))
        v = jnp.einsum("bsd,dhe->bshe", x, self.v_proj[...].astype(dtype))
        q = apply_rope(q, inputs.rope_cos, inputs.rope_sin)
        k = apply_rope(k, inputs.rope_cos, inputs.rope_sin)
        if self.indexer is None:
            blocks = None
            out = gqa_attention(q, k, v, inputs.dense_mask[:, None, None])
        else:
            blocks = self.indexer(x, inputs)
            out = msa_reference.sparse_attention(
                q, k, v, blocks, inputs.segment_ids, block_size=self.block_size
            )
        return jnp.einsum("bshe,hed->bsd", out, self.o_proj[...].astype(dtype)), blocks
