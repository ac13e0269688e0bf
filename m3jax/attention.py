"""M3 attention: GQA with per-head QK norm and partial RoPE; on sparse layers, MSA block selection.

spec/m3_architecture.md §3.4-3.5. Order: project -> per-head Gemma norm -> RoPE -> attention.
A "msa" layer adds the lightning indexer: it reads the same normed hidden state, but
through stop_gradient (spec/msa.md §2: the LM loss never trains the indexer; its own KL loss does),
scores key blocks and keeps the top-k per (query, index head); query head h uses the selection of
index head h // G, the same grouping as GQA. During the MSA warm-up (`ForwardMode.msa_dense`) the
layer attends densely and the indexer learns from the dense attention distribution. `decode` runs
one new token per row against a KV cache (m3jax/kv_cache.py) with the same projections. On a mesh,
attention runs per device: on each device's rows (sharding.per_device_rows), or with mesh seq > 1
on each device's chunks of the queries against the whole row's keys (m3jax/context_parallel.py).

Shapes: B batch, S sequence, D model width, H query heads, K kv heads (= Hi index heads),
Dh head dim, Di index head dim; `rotary_dim` rotated channels.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from m3jax import attention_ops, context_parallel, decode_attention, params, sharding
from m3jax.config import ModelConfig
from m3jax.kv_cache import LayerCache, write_token
from m3jax.norms import RMSNorm
from m3jax.rope import apply_rope


class Projections(NamedTuple):
    """One attention layer's inputs after norms and RoPE; the index branch only on MSA layers."""

    q: jax.Array  # [B, S, H, Dh]
    k: jax.Array  # [B, S, K, Dh]
    v: jax.Array  # [B, S, K, Dh]
    index_q: jax.Array | None  # [B, S, Hi, Di]
    index_k: jax.Array | None  # [B, S, Di]: one key head shared by the index heads


class MSAStats(NamedTuple):
    """An MSA layer's statistics, each present as `ForwardMode` asks (stacked layers: a leading
    layer axis on each)."""

    blocks: jax.Array | None = None  # [B, S, Hi, topk_blocks] int32 selected blocks, -1 = none
    kl: jax.Array | None = None  # [] fp32 indexer KL, mean over real tokens
    recall: jax.Array | None = None  # [] fp32 block recall, mean over real tokens


class AttentionInputs(NamedTuple):
    """Per-row quantities shared by every layer of one forward pass."""

    positions: jax.Array  # [B, S] position within the document
    segment_ids: jax.Array  # [B, S] document id; 0 = padding
    rope_cos: jax.Array  # [B, S, rotary_dim] fp32
    rope_sin: jax.Array  # [B, S, rotary_dim] fp32


@dataclasses.dataclass(frozen=True)
class ForwardMode:
    """Static switches of one forward pass; each combination compiles once."""

    msa_dense: bool = False  # MSA warm-up: sparse layers attend densely, the KL teacher is dense
    indexer_loss: bool = False  # sparse layers report the indexer's KL (the loss the trainer adds)
    block_recall: bool = False  # sparse layers report how much of the dense top blocks they keep
    kv_cache: bool = False  # every layer returns its keys and values (and index keys): a prefill
    # every row holds at most `attention_ops.documents_bound` runs of segment ids, checked on the
    # host (`attention_ops.holds_few_documents`): the kernels' fallbacks for rows of more are left
    # out of the program, and with them its conditionals, whose predicates XLA:GPU reads on the
    # host (each step's dispatch then waits for the device; benchmarks/RESULTS.md, 2026-12-06)
    few_documents: bool = False


def _mean_over_tokens(x: jax.Array, valid: jax.Array) -> jax.Array:
    """x: [B, S, Hi] -> its mean over real (non-padding) tokens and heads."""
    total = jnp.maximum(valid.sum(), 1) * x.shape[-1]
    return (x * valid[..., None]).sum() / total


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

    def __call__(self, x: jax.Array, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array]:
        """x: [B, S, D] normed hidden state -> (index_q [B, S, Hi, Di], index_k [B, S, Di])."""
        x = jax.lax.stop_gradient(x)
        index_q = self.q_norm(jnp.einsum("bsd,dhe->bshe", x, self.q_proj[...].astype(x.dtype)))
        index_k = self.k_norm(x @ self.k_proj[...].astype(x.dtype))
        index_q = apply_rope(index_q, inputs.rope_cos, inputs.rope_sin)
        index_k = apply_rope(index_k[:, :, None], inputs.rope_cos, inputs.rope_sin)[:, :, 0]
        return index_q, index_k


class Attention(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, sparse: bool, rngs: nnx.Rngs, mesh: Mesh | None = None
    ):
        """mesh: the devices the batch is split over; attention runs on each device's rows."""
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
        self.msa, self.impl = config.msa, config.attention_impl
        self.msa_kernels = config.msa_kernels
        self.mesh = mesh

    def __call__(
        self, x: jax.Array, inputs: AttentionInputs, mode: ForwardMode,
        kl_sink: jax.Array | None = None,
    ) -> tuple[jax.Array, MSAStats | None, LayerCache | None]:
        """x: [B, S, D] normed hidden state -> ([B, S, D], MSAStats on MSA layers, this layer's
        LayerCache entries with mode.kv_cache).

        kl_sink: None, or on an MSA layer with mode.indexer_loss a zero fp32 scalar whose
        gradient is the layer's KL (what MSAStats.kl holds otherwise, which is 0 then): the
        kernels may compute the KL in the backward, beside the student's gradients, and the
        training step reads it from the sink (pallas_kernels/msa/reference.py: kl_through_sink).
        """
        p = self.project(x, inputs)
        msa_stats = None
        if self.indexer is None:

            def dense(q, k, v, segment_ids, query_slots=None):
                return attention_ops.dense(self.impl, q, k, v, segment_ids, query_slots=query_slots,
                                           few_documents=mode.few_documents)  # fmt: skip

            out = self._on_devices(dense, (p.q,), (p.k, p.v), (inputs.segment_ids,))
        else:
            out, msa_stats = self._sparse(p, inputs, mode, kl_sink)
        cache = LayerCache(p.k, p.v, p.index_k) if mode.kv_cache else None
        return self._output(out, x.dtype), msa_stats, cache

    def decode(
        self, x: jax.Array, inputs: AttentionInputs, cache: LayerCache, layer: jax.Array
    ) -> tuple[jax.Array, LayerCache]:
        """One new token per row, attending over the cache (m3jax/decode_attention.py).

        x: [B, 1, D] normed hidden state of tokens at positions inputs.positions [B, 1] (= the
        tokens each row has cached); cache: the layer stack's cache, of which this is layer
        `layer`. Returns ([B, 1, D], the cache with this token's entries written at its slot).
        """
        p = self.project(x, inputs)
        slots = inputs.positions[:, 0]
        cache = write_token(cache, layer, slots, LayerCache(p.k, p.v, p.index_k))
        keys, values = cache.keys[layer], cache.values[layer]
        if self.indexer is None:
            out = decode_attention.dense(p.q, keys, values, slots)
        else:
            msa = self.msa
            blocks = decode_attention.select_blocks(
                p.index_q, cache.index_keys[layer], slots, block_size=msa.block_size,
                topk_blocks=msa.topk_blocks, local_blocks=msa.local_blocks,
            )  # fmt: skip
            out = decode_attention.sparse(p.q, keys, values, blocks, slots, msa.block_size)
        return self._output(out, x.dtype), cache

    def project(self, x: jax.Array, inputs: AttentionInputs) -> Projections:
        """The layer's queries, keys and values (and index branch) after norms and RoPE."""
        dtype = x.dtype
        q = self.q_norm(jnp.einsum("bsd,dhe->bshe", x, self.q_proj[...].astype(dtype)))
        k = self.k_norm(jnp.einsum("bsd,dhe->bshe", x, self.k_proj[...].astype(dtype)))
        v = jnp.einsum("bsd,dhe->bshe", x, self.v_proj[...].astype(dtype))
        q = apply_rope(q, inputs.rope_cos, inputs.rope_sin)
        k = apply_rope(k, inputs.rope_cos, inputs.rope_sin)
        if self.indexer is None:
            return Projections(q, k, v, None, None)
        return Projections(q, k, v, *self.indexer(x, inputs))

    def _on_devices(self, fn: Callable, queries: tuple, head_keys: tuple, token_keys: tuple):
        """fn(*queries, *head_keys, *token_keys[, query_slots]) on each device: its rows, or its
        query chunks against the gathered keys (seq > 1; context_parallel.attention)."""
        if context_parallel.num_parts(self.mesh) > 1:
            num_kv_heads = head_keys[0].shape[2]
            return context_parallel.attention(
                fn, self.mesh, num_kv_heads, queries, head_keys, token_keys
            )
        per_device = sharding.per_device_rows(fn, self.mesh, queries[0].shape[0])
        return per_device(*queries, *head_keys, *token_keys)

    def _output(self, out: jax.Array, dtype) -> jax.Array:
        """The output projection in the activation dtype (that of the layer's input)."""
        return jnp.einsum("bshe,hed->bsd", out, self.o_proj[...].astype(dtype))

    def _sparse(self, p: Projections, inputs: AttentionInputs, mode: ForwardMode, kl_sink):
        """The MSA main branch (dense during warm-up) and the indexer statistics the mode asks
        for; the KL through the layer's sink when given one (`__call__`)."""
        msa, segment_ids, positions = self.msa, inputs.segment_ids, inputs.positions
        q, k, v, index_q, index_k = p
        backend = attention_ops.msa_backend(
            self.impl, msa, q, k, index_q, self.msa_kernels, few_documents=mode.few_documents
        )
        valid = segment_ids > 0
        token_sinks = None
        if kl_sink is not None and mode.indexer_loss:  # its gradient: `_mean_over_tokens` of KL
            weights = valid / (jnp.maximum(valid.sum(), 1) * index_q.shape[2])
            token_sinks = jnp.broadcast_to(kl_sink * weights[..., None], index_q.shape[:3])

        def layer(q, index_q, token_sinks, k, v, index_k, segment_ids, positions,
                  query_slots=None):  # fmt: skip
            out, kl, blocks = attention_ops.msa_layer(
                backend, msa, q, k, v, index_q, index_k, segment_ids, positions,
                dense_phase=mode.msa_dense,
                student=(index_q, index_k) if mode.indexer_loss else None,
                with_blocks=not mode.msa_dense or mode.block_recall, query_slots=query_slots,
                kl_sink=token_sinks,
            )  # fmt: skip
            hits = None
            if mode.block_recall:
                hits = attention_ops.recall(
                    backend, msa, q, k, blocks, segment_ids, positions, query_slots
                )
            return out, kl, blocks, hits

        out, kl, blocks, hits = self._on_devices(
            layer, (q, index_q, token_sinks), (k, v), (index_k, segment_ids, positions)
        )
        stats = MSAStats(blocks, None if kl is None else _mean_over_tokens(kl, valid))
        if hits is not None:
            stats = stats._replace(recall=_mean_over_tokens(hits, valid))
        return out, stats
