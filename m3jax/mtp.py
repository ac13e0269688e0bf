"""Multi-token prediction (MTP) modules: DeepSeek-V3's sequential design (arXiv:2412.19437, §2.2).

Module i (0-based) sees, at position s, the previous depth's hidden state (the trunk's last layer
output for i = 0, module i - 1's output otherwise) and the embedding of token s + i + 1, and
predicts token s + i + 2:

    h'_i = W_i · [RMSNorm(embedding(t[s + i + 1])); RMSNorm(h_{i-1}[s])]     W_i: [2D] -> [D]
    h_i  = DecoderLayer_i(h'_i)          one layer of the kind of the model's last layer
    p_i  = softmax(lm_head(RMSNorm_i(h_i)))

The embedding table and lm_head are the main model's (shared, as in DeepSeek-V3); the two input
norms, W_i, the decoder layer and the final norm are the module's own (DeepSeek-V3's released
weights also give each module its own final norm, `shared_head.norm`). The concatenation puts the
embedding first, as DeepSeek-V3's `eh_proj` does. The embeddings are the trunk's input embeddings
after the image/video placeholder scatter, so a module that looks ahead at a placeholder sees its
vision feature.

Packed rows: token s + i + 1 must belong to the same document piece as position s. Positions
where it does not (the last i + 1 positions of every piece) get segment id 0 in module i, i.e. they
are padding for its layer: no attention to or from them, no router load, no loss. transformers has
no MTP (spec §3.8); m3jax/convert/layout.py names these weights `mtp.*` for export.

Shapes: B batch, S sequence, D model width, V vocab.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from m3jax import context_parallel, params
from m3jax.attention import AttentionInputs, ForwardMode
from m3jax.config import ModelConfig
from m3jax.decoder import DecoderLayer, LayerStats
from m3jax.norms import RMSNorm


class MTPOutput(NamedTuple):
    """One MTP module's output."""

    normed: jax.Array  # [B, S, D] after its final norm: the lm_head's input (token s + i + 2)
    segment_ids: jax.Array  # [B, S], 0 where position s has no such target in its piece
    stats: LayerStats  # its decoder layer's, without a layer axis


def shifted(x: jax.Array, shift: int, fill=0) -> jax.Array:
    """x[:, s + shift] at position s ([B, S, ...]); the last `shift` positions are `fill`."""
    pad = [(0, 0), (0, shift)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, shift:], pad, constant_values=fill)


def depth_segment_ids(segment_ids: jax.Array, depth: int) -> jax.Array:
    """[B, S] segment ids of module `depth`: 0 where token s + depth + 1 is in another piece."""
    ahead = shifted(segment_ids, depth + 1)
    return jnp.where(ahead == segment_ids, segment_ids, 0)


class MTPModule(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.embed_norm = RMSNorm(dim, eps)
        self.hidden_norm = RMSNorm(dim, eps)
        self.projection = params.normal(rngs, (2 * dim, dim), (None, "embed"), config.init_std)
        kind = config.layer_types[-1], config.mlp_layer_types[-1]
        self.layer = DecoderLayer(config, *kind, rngs=rngs, mesh=mesh)
        self.final_norm = RMSNorm(dim, eps)
        self.mesh = mesh

    def __call__(
        self, embeddings: jax.Array, hidden: jax.Array, inputs: AttentionInputs, mode: ForwardMode
    ) -> tuple[jax.Array, LayerStats]:
        """embeddings (already shifted), hidden: [B, S, D] -> (this depth's hidden [B, S, D],
        the decoder layer's stats)."""
        x = jnp.concatenate([self.embed_norm(embeddings), self.hidden_norm(hidden)], axis=-1)
        x = jnp.einsum("bse,ed->bsd", x, self.projection[...].astype(x.dtype))
        # its own zig-zag round trip (mesh seq > 1): the shifts above need natural order
        return context_parallel.run_balanced(
            self.layer, self.mesh, x, inputs, mode, layer_axis=False
        )


class MultiTokenPrediction(nnx.Module):
    """`config.mtp.num_modules` MTP modules applied in sequence after the trunk."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        self.depths = nnx.List(
            [MTPModule(config, rngs=rngs, mesh=mesh) for _ in range(config.mtp.num_modules)]
        )

    def __call__(
        self,
        embeddings: jax.Array,
        hidden: jax.Array,
        inputs: AttentionInputs,
        mode: ForwardMode,
    ) -> list[MTPOutput]:
        """embeddings: the trunk's input embeddings [B, S, D]; hidden: its last layer's output
        [B, S, D] (before the final norm). Returns one MTPOutput per module."""
        outputs = []
        for depth, module in enumerate(self.depths):
            segment_ids = depth_segment_ids(inputs.segment_ids, depth)
            depth_inputs = inputs._replace(segment_ids=segment_ids)
            ahead = shifted(embeddings, depth + 1)
            hidden, stats = module(ahead, hidden, depth_inputs, mode)
            normed = module.final_norm(hidden)
            outputs.append(MTPOutput(normed, segment_ids, stats))
        return outputs
