"""Random m3jax weights drawn per upstream tensor with the same scales as the transformers side."""

import jax.numpy as jnp
import numpy as np
from weight_scales import weight_scale

from m3jax.config import ModelConfig
from m3jax.convert.layout import from_upstream, leaf_shapes, nested, tensor_specs


def random_weights(config: ModelConfig, seed: int) -> dict:
    """{"params": ..., "buffers": ...} for `config`, every tensor ~ weight_scale(upstream name)."""
    rng = np.random.default_rng(seed)
    leaves = {leaf: np.zeros(shape, np.float32) for leaf, shape in leaf_shapes(config).items()}
    for spec in tensor_specs(config):
        mean, std = weight_scale(spec.name, spec.shape)
        tensor = rng.normal(mean, std, spec.shape).astype(np.float32)
        leaves[spec.leaf][spec.index] = from_upstream(spec, tensor)
    return nested({leaf: jnp.asarray(array) for leaf, array in leaves.items()})
