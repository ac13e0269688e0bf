"""Helpers for code that runs inside `jax.shard_map`, shared by kernel wrappers and the model.

A Pallas call's outputs carry no varying-manual-axes type (jax 0.11.2), so under `shard_map` with
`check_vma` a kernel's result must be typed again before autodiff or a collective meets it.
"""

import jax


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """x, typed as varying over the manual mesh axes `like` varies over (inside `shard_map`).

    Kernels drop the type, so it is restored around them (pallas_kernels/moe/mosaic_gpu.py);
    m3jax/moe/expert_parallel.py also uses it to give the expert weights the rows' type once,
    before any branch of the padded exchange."""
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying_axes(x: jax.Array) -> frozenset:
    return jax.typeof(x).mat.varying
