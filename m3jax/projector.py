"""The multimodal projector: vision states -> LM tokens, one token per m×m patch window (spec §5.1).

Each patch is projected to the text width first (linear_1 -> GELU -> linear_2), then the m² = 4
consecutive patches of a merge window (the block-major patch order of m3jax/vision_inputs.py) are
concatenated channel-wise and fused by a second MLP (merge_1 -> GELU -> merge_2). All four layers
have biases; GELU is the exact erf form.

Shapes: P patches, Dv vision width, F projector hidden width, D text width, m spatial merge size.
"""

import jax
from flax import nnx

from m3jax.config import ModelConfig
from m3jax.linear import Linear


class Projector(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        vision, dim, std = config.vision, config.hidden_size, config.init_std
        hidden, window = vision.projector_hidden_size, vision.spatial_merge_size**2
        self.linear_1 = Linear(
            (vision.hidden_size,), (hidden,), ("embed", "mlp"), std=std, rngs=rngs
        )
        self.linear_2 = Linear((hidden,), (dim,), ("mlp", "embed"), std=std, rngs=rngs)
        self.merge_1 = Linear((window * dim,), (hidden,), ("embed", "mlp"), std=std, rngs=rngs)
        self.merge_2 = Linear((hidden,), (dim,), ("mlp", "embed"), std=std, rngs=rngs)
        self.window = window

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., P, Dv] with P a multiple of m² -> [..., P / m², D] merged features."""
        y = self.linear_2(jax.nn.gelu(self.linear_1(x), approximate=False))  # [..., P, D]
        y = y.reshape(*y.shape[:-2], y.shape[-2] // self.window, -1)  # [..., P/m², m²·D]
        return self.merge_2(jax.nn.gelu(self.merge_1(y), approximate=False))
