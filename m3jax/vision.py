"""M3's vision tower: a pre-LN ViT over packed patches, with 3-D axial RoPE (spec §4).

Patch embedding = Conv3d(3 channels -> Dv, kernel = stride = (temporal_patch_size, patch_size,
patch_size)) applied to a row of pixel_values, i.e. a matmul over the patch_dim = 3·2·14² = 1176
row features (ordered c, t, y, x); then pre-LayerNorm (no absolute position embedding, no
post-LayerNorm) and `num_layers` encoder layers:
x += out_proj(MHA(RoPE(q(LN1 x)), RoPE(k(LN1 x)), v(LN1 x))); x += fc2(GELU(fc1(LN2 x))).
Attention is bidirectional and confined to one segment: one image, or one video chunk (a row of
grid_thw). Patches come in B rows (one per training row; one row for transformers-style inputs) of
a fixed patch budget P, with a segment id per patch (0 = padding, so shapes stay static under jit);
attention never leaves a segment (attention_ops.dense, causal=False: query-tiled XLA, or cuDNN's
packed flash attention on GPU), so its cost is Σ segment², and its memory never [P, P].

Shapes: B rows, P patches per row, Dv vision width, H vision heads, Dh vision head dim, F MLP width;
`rotary_dim` rotated channels, `patch_dim` = 3·temporal_patch_size·patch_size² pixel features.
"""

from typing import NamedTuple

import jax
from flax import nnx

from m3jax import attention_ops, params
from m3jax.config import ModelConfig, VisionConfig
from m3jax.linear import Linear
from m3jax.norms import LayerNorm
from m3jax.rope import apply_rope, axial_rope_tables
from m3jax.stacking import scan_layers, stacked_layers


class PatchInputs(NamedTuple):
    """Per-patch quantities shared by every encoder layer."""

    rope_cos: jax.Array  # [B, P, rotary_dim] fp32
    rope_sin: jax.Array  # [B, P, rotary_dim] fp32
    segment_ids: jax.Array  # [B, P] int32: a patch sees its segment's (padding sees padding)


class VisionAttention(nnx.Module):
    def __init__(self, vision: VisionConfig, std: float, impl: str, *, rngs: nnx.Rngs):
        width, heads, head_dim = vision.hidden_size, vision.num_heads, vision.head_dim
        qkv_axes = ("embed", "heads", "head_dim")
        self.q_proj = Linear((width,), (heads, head_dim), qkv_axes, std=std, rngs=rngs)
        self.k_proj = Linear((width,), (heads, head_dim), qkv_axes, std=std, rngs=rngs)
        self.v_proj = Linear((width,), (heads, head_dim), qkv_axes, std=std, rngs=rngs)
        out_axes = ("heads", "head_dim", "embed")
        self.out_proj = Linear((heads, head_dim), (width,), out_axes, std=std, rngs=rngs)
        self.impl = impl  # config.attention_impl: cuDNN's packed flash attention on GPU

    def __call__(self, x: jax.Array, inputs: PatchInputs) -> jax.Array:
        """x: [B, P, Dv] -> [B, P, Dv]; multi-head (K = H), bidirectional within each segment."""
        q = apply_rope(self.q_proj(x), inputs.rope_cos, inputs.rope_sin)  # [B, P, H, Dh]
        k = apply_rope(self.k_proj(x), inputs.rope_cos, inputs.rope_sin)
        v = self.v_proj(x)
        out = attention_ops.dense(self.impl, q, k, v, inputs.segment_ids, causal=False)
        return self.out_proj(out)


class VisionMLP(nnx.Module):
    def __init__(self, vision: VisionConfig, std: float, *, rngs: nnx.Rngs):
        width, hidden = vision.hidden_size, vision.intermediate_size
        self.fc1 = Linear((width,), (hidden,), ("embed", "mlp"), std=std, rngs=rngs)
        self.fc2 = Linear((hidden,), (width,), ("mlp", "embed"), std=std, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))  # exact erf GELU


class VisionEncoderLayer(nnx.Module):
    def __init__(self, vision: VisionConfig, std: float, impl: str, *, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(vision.hidden_size, vision.layer_norm_eps)
        self.attention = VisionAttention(vision, std, impl, rngs=rngs)
        self.norm2 = LayerNorm(vision.hidden_size, vision.layer_norm_eps)
        self.mlp = VisionMLP(vision, std, rngs=rngs)

    def __call__(self, x: jax.Array, inputs: PatchInputs) -> jax.Array:
        x = x + self.attention(self.norm1(x), inputs)
        return x + self.mlp(self.norm2(x))


class VisionTower(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        vision, std = config.vision, config.init_std
        self.patch_embed = params.normal(
            rngs, (vision.patch_dim, vision.hidden_size), ("patch", "embed"), std
        )
        self.pre_norm = LayerNorm(vision.hidden_size, vision.layer_norm_eps)
        self.layers = stacked_layers(
            lambda rngs: VisionEncoderLayer(vision, std, config.attention_impl, rngs=rngs),
            vision.num_layers,
            rngs,
        )
        self.head_dim, self.rope_theta = vision.head_dim, vision.rope_theta
        self.dtype, self.remat = config.dtype, config.remat

    def __call__(
        self, patches: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """patches [B, P, patch_dim] pixel rows; positions [B, P, 3] int32 (t, h, w) within the
        patch's segment; segment_ids [B, P] int32 (0 = padding). Returns the last layer's states
        [B, P, Dv]."""
        x = patches.astype(self.dtype) @ self.patch_embed[...].astype(self.dtype)
        x = self.pre_norm(x)
        cos, sin = axial_rope_tables(positions, self.head_dim, self.rope_theta)
        inputs = PatchInputs(cos, sin, segment_ids)
        x, _ = scan_layers(self.layers, x, lambda layer, x: (layer(x, inputs), None), self.remat)
        return x
