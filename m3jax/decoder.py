"""Decoder layers and scanned stacks of identical layers.

A layer is pre-norm: h = x + Attn(norm_in(x)); out = h + MLP(norm_post(h)), where MLP is the MoE
block on "sparse" layers and the dense MLP on "dense" layers (spec/m3_architecture.md §3.2).
Consecutive layers of the same kind form a LayerStack whose parameters carry a leading "layers"
axis and which runs under `lax.scan`, so compile time does not grow with depth (M3: 3 + 57 layers,
two stacks).

Shapes: B batch, S sequence, D model width.
"""

import jax
from flax import nnx
from jax.sharding import Mesh

from m3jax.attention import Attention, AttentionInputs, ForwardMode
from m3jax.config import ModelConfig
from m3jax.mlp import MLP
from m3jax.moe import MoE
from m3jax.norms import RMSNorm

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


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
        self.attention = Attention(config, sparse=attention_type == "minimax_m3_sparse", rngs=rngs)
        self.post_attention_norm = RMSNorm(dim, eps)
        if mlp_type == "sparse":
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
        self, x: jax.Array, inputs: AttentionInputs, mode: ForwardMode
    ) -> tuple[jax.Array, dict]:
        """x: [B, S, D] -> ([B, S, D], stats: {"moe": expert stats} and/or {"msa": indexer stats})."""
        attention_out, msa_stats = self.attention(self.input_norm(x), inputs, mode)
        h = x + attention_out
        normed = self.post_attention_norm(h)
        stats = {"msa": msa_stats} if msa_stats else {}
        if isinstance(self.mlp, MoE):
            mlp_out, stats["moe"] = self.mlp(normed, inputs.segment_ids > 0)
        else:
            mlp_out = self.mlp(normed)
        return h + mlp_out, stats


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
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, attention_type, mlp_type, rngs=rngs, mesh=mesh)

        self.layers = create(rngs)
        for _, variable in nnx.iter_graph(self.layers):
            if isinstance(variable, nnx.Variable):
                axes = variable.get_metadata()["logical_axes"]
                variable.set_metadata(logical_axes=("layers", *axes))
        self.remat = config.remat
        self.kind = (attention_type, mlp_type)

    def __call__(
        self, x: jax.Array, inputs: AttentionInputs, mode: ForwardMode
    ) -> tuple[jax.Array, dict]:
        """x: [B, S, D] -> ([B, S, D], stats stacked over layers)."""
        graphdef, state = nnx.split(self.layers)

        def body(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, inputs, mode)

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        return jax.lax.scan(body, x, state)
