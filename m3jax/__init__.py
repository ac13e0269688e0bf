"""m3jax: MiniMax-M3-class models in JAX.

The one-call API for notebooks and interop:

    config, weights = m3jax.load_pretrained("path/to/MiniMax-M3")   # config.json + safetensors
    logits = m3jax.forward(config, weights, input_ids, pixel_values=..., image_grid_thw=...)
    m3jax.save_pretrained(config, weights, "out/")                   # transformers loads it
    new_tokens = m3jax.generate(config, weights, prompts, max_new_tokens=32)  # KV-cached decoding

weights = {"params": ..., "buffers": ...}: the nested dicts `m3jax.model.functional(config).init`
returns (buffers = the routers' correction biases). Training lives in the `pretrain` package.
"""

from m3jax import xla_flags
from m3jax.convert.pretrained import load_pretrained, save_pretrained
from m3jax.generation import generate
from m3jax.inference import forward, forward_with_trace

xla_flags.apply()  # importing starts no backend, so this still comes in time

__all__ = ["forward", "forward_with_trace", "generate", "load_pretrained", "save_pretrained"]
