"""Decoder layers and scanned stacks of identical layers.

A layer is pre-norm: h = x + Attn(norm_in(x)); out = h + MLP(norm_post(h)), where MLP is the MoE
block on "moe" layers and the dense MLP on "dense" layers (spec/m3_architecture.md §3.2).
Consecutive layers of the same kind form a LayerStack whose parameters carry a leading "layers"
axis and which runs under `lax.scan` (m3jax/stacking.py), so compile time does not grow with depth
(M3: 3 + 57 layers, two stacks). `decode` runs one new token per row against the stack's KV cache.

Shapes: B batch, S sequence, D model width, Hi index heads, k experts per token, topk_blocks
selected blocks per query (words, never letters: spec/msa.md's K and B).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from m3jax import sharding
from m3jax.attention import Attention, AttentionInputs, ForwardMode, MSAStats
from m3jax.config import ModelConfig
from m3jax.kv_cache import LayerCache
from m3jax.mlp import MLP
from m3jax.moe.layer import MoE, MoEStats
from m3jax.norms import RMSNorm
from m3jax.stacking import scan_layers, stacked_layers


class LayerStats(NamedTuple):
    """What a decoder layer reports besides its output; a LayerStack's carry a leading layer axis.
    Under jit, entries nobody reads cost nothing (dead-code eliminated)."""

    moe: MoEStats | None = None  # on MoE layers
    msa: MSAStats | None = None  # on MSA layers
    cache: LayerCache | None = None  # with mode.kv_cache: the layer's keys, values, index keys
    hidden: jax.Array | None = None  # with output_hidden_states: the layer's output [B, S, D]


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention_type: str,
        mlp_type: str,
        *,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_norm = RMSNorm(dim, eps)
        self.attention = Attention(config, sparse=attention_type == "msa", rngs=rngs, mesh=mesh)
        self.post_attention_norm = RMSNorm(dim, eps)
        if mlp_type == "moe":
            self.mlp = MoE(config, rngs=rngs, mesh=mesh)
        else:
            self.mlp = MLP(
                dim,
                config.dense_mlp_dim,
                alpha=config.swiglu_alpha,
                limit=config.swiglu_limit,
                std=config.init_std,
                rngs=rngs,
            )

    def __call__(
        self, x: jax.Array, inputs: AttentionInputs, mode: ForwardMode,
        kl_sink: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerStats]:
        """x: [B, S, D] -> ([B, S, D], its LayerStats: moe, msa, cache as the layer and `mode`
        have them). kl_sink: an MSA layer's (m3jax/attention.py: `Attention.__call__`) or None."""
        attention_out, msa, cache = self.attention(self.input_norm(x), inputs, mode, kl_sink)
        out, moe = self._feed_forward(x + attention_out, inputs)
        return out, LayerStats(moe, msa, cache)

    def decode(
        self, x: jax.Array, inputs: AttentionInputs, cache: LayerCache, layer: jax.Array
    ) -> tuple[jax.Array, LayerCache]:
        """One new token per row: x [B, 1, D] -> ([B, 1, D], the stack's cache with its entries)."""
        attention_out, cache = self.attention.decode(self.input_norm(x), inputs, cache, layer)
        out, _ = self._feed_forward(x + attention_out, inputs)
        return out, cache

    def _feed_forward(self, h: jax.Array, inputs: AttentionInputs):
        normed = self.post_attention_norm(h)
        if isinstance(self.mlp, MoE):
            mlp_out, moe = self.mlp(normed, inputs.segment_ids > 0)
            return h + mlp_out, moe
        return h + self.mlp(normed), None


class LayerStack(nnx.Module):
    """`num_layers` layers of one kind with stacked parameters, applied in order by `lax.scan`."""

    def __init__(
        self,
        config: ModelConfig,
        attention_type: str,
        mlp_type: str,
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        self.layers = stacked_layers(
            lambda rngs: DecoderLayer(config, attention_type, mlp_type, rngs=rngs, mesh=mesh),
            num_layers,
            rngs,
        )
        self.remat, self.mesh = config.remat, mesh

    def __call__(
        self,
        x: jax.Array,
        inputs: AttentionInputs,
        mode: ForwardMode,
        *,
        output_hidden_states: bool = False,
        kl_sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerStats]:
        """x: [B, S, D] -> ([B, S, D], LayerStats stacked over layers; with output_hidden_states
        also `hidden`: each layer's output [L, B, S, D]). kl_sinks: [L] fp32 zeros, each MSA
        layer's KL sink (`Attention.__call__`), or None."""

        def step(layer: DecoderLayer, x: jax.Array, kl_sink=None) -> tuple[jax.Array, LayerStats]:
            y, stats = layer(sharding.constrain_activations(x, self.mesh), inputs, mode, kl_sink)
            y = sharding.constrain_activations(y, self.mesh)
            return y, (stats._replace(hidden=y) if output_hidden_states else stats)

        return scan_layers(self.layers, x, step, self.remat, projection_dtype=x.dtype,
                           per_layer=kl_sinks)  # fmt: skip

    def decode(
        self, x: jax.Array, inputs: AttentionInputs, cache: LayerCache
    ) -> tuple[jax.Array, LayerCache]:
        """One new token per row through every layer: x [B, 1, D] -> ([B, 1, D], updated cache).

        The stack's cache rides in the scan's carry, so each layer writes its token in place.
        """

        def step(layer: DecoderLayer, carry):
            x, cache, index = carry
            x, cache = layer.decode(x, inputs, cache, index)
            return (x, cache, index + 1), None

        (x, cache, _), _ = scan_layers(self.layers, (x, cache, jnp.int32(0)), step, "none")
        return x, cache
