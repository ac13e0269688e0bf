"""Shared-memory layouts for Pallas Mosaic GPU kernels (the MoE grouped matmul, the MSA forward).

TMA copies and wgmma operands want SMEM blocks tiled in 8-row tiles and swizzled by the widest
pattern the block's rows allow; every kernel declares its SMEM that way.
"""

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled(minor: int, dtype) -> tuple:
    """Swizzled TMA/wgmma tiling transforms for SMEM blocks whose last dimension is `minor`."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)
