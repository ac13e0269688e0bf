"""Grouped matmul for MoE: rows sorted by expert, each group multiplied by its expert's weight.

This file owns the signature that every implementation (XLA's `ragged_dot` here; a GPU kernel
later, beside it as `kernel.py`) keeps: `grouped_matmul(x_sorted, w, group_sizes)`. Gradients come
from autodiff: `ragged_dot`'s transpose rules give dX (a grouped matmul with wᵀ) and dW (a
per-group xᵀ·dY); a kernel may replace them with a `custom_vjp` behind the same signature.

Shapes: R rows (token copies, sorted by expert), D input width, F output width, E experts (groups).
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe.tiles import TileLayout


def grouped_matmul(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """y[i] = x_sorted[i] @ w[e(i)], where rows of expert e are the e-th run of `group_sizes` rows.

    Args:
      x_sorted: [R, D] rows, the first group_sizes[0] for expert 0, the next for expert 1, ...
      w: [E, D, F] one weight matrix per expert.
      group_sizes: [E] int32 rows per expert; sum(group_sizes) <= R.
    Returns:
      [R, F] in x_sorted's dtype. Rows past sum(group_sizes) (padding) are zero.
    """
    return jax.lax.ragged_dot(x_sorted, w, group_sizes.astype(jnp.int32))


def grouped_matmul_buffered(x_sorted: jax.Array, w: jax.Array, group_sizes) -> jax.Array:
    """The same product for benchmark references: each group gathered into its own row of an
    [E, C, D] buffer (C = the largest group), one batched matmul, gathered back.

    Exact, a few ops whatever the sizes, and its gradient one scatter. XLA may lower an fp32
    `ragged_dot` to a dense [R, E·D] product (out of memory at E = 32, R = 128K on the H200); one
    matmul per group slice (the previous reference) pads every group's dX back to [R, D] in
    backward: E full-size arrays, minutes at E = 32, R = 128K (benchmarks/RESULTS.md).
    group_sizes must be concrete (host values): call it eagerly, not under `jax.jit`.
    """
    sizes = np.asarray(group_sizes)
    rows = x_sorted.shape[0]
    starts = np.cumsum(sizes) - sizes
    slot = np.arange(max(int(sizes.max()), 1))
    into = np.where(slot < sizes[:, None], starts[:, None] + slot, rows)  # [E, C]; rows: empty
    y = jnp.einsum("ecd,edf->ecf", x_sorted.at[into].get(mode="fill", fill_value=0), w)
    expert = np.repeat(np.arange(len(sizes)), sizes)  # of each sorted row
    y_sorted = y[expert, np.arange(len(expert)) - starts[expert]]
    return jnp.concatenate([y_sorted, jnp.zeros((rows - len(expert), y.shape[-1]), y.dtype)])


def tiled_matmul(x_tiles: jax.Array, w: jax.Array, layout: TileLayout, block_m: int) -> jax.Array:
    """The GPU kernel's product over the tile-aligned layout (tiles.py), through `ragged_dot`.

    Expert e owns num_tiles[e]·block_m consecutive rows, so the padded group sizes describe it
    exactly; the unused tail past them comes out zero, as from the kernel.
    """
    return grouped_matmul(x_tiles, w.astype(x_tiles.dtype), layout.num_tiles * block_m)
