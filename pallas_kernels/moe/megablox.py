"""Grouped matmul on TPUs: jax's megablox kernel (`jax.experimental.pallas.ops.tpu.megablox`)
behind `reference.grouped_matmul`'s signature.

megablox tiles the sorted rows by (block_m, block_k, block_n) and walks group metadata through
scalar prefetch; its custom VJP gives dX (a grouped matmul with wᵀ) and dW (`tgmm`). We only pick
the tiling and check the shapes. On a machine without a TPU it runs in Pallas' interpreter
(`interpret=None` picks that). Speed: unmeasured (no TPU here).

Shapes: R rows (sorted by expert), D input width, F output width, E experts.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from pallas_kernels import target

BLOCK = 128  # rows and columns of one MXU tile


def unsupported_reason(dtype, in_width: int, out_width: int) -> str:
    """Why megablox can't run a layer ('' when it can): widths in whole 128-lane tiles."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float32"
    for name, width in (("in_width", in_width), ("out_width", out_width)):
        if width % BLOCK:
            return f"{name}={width} is not a multiple of {BLOCK}"
    return ""


def _tiling(rows: int, in_width: int, out_width: int) -> tuple[int, int, int]:
    # widths below a tile (tests) run as one block; rows go in tiles of at most BLOCK
    block_k = BLOCK if in_width % BLOCK == 0 else in_width
    block_n = BLOCK if out_width % BLOCK == 0 else out_width
    return min(BLOCK, rows), block_k, block_n


def grouped_matmul(
    x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
    """Same arguments and result as `reference.grouped_matmul`: [R, D] × [E, D, F] -> [R, F]."""
    if interpret is None:
        interpret = target.platform() != "tpu"
    group_sizes = group_sizes.astype(jnp.int32)
    tiling = _tiling(x_sorted.shape[0], *w.shape[1:])
    # megablox leaves rows past the groups unwritten (NaN in the interpreter), in y and in dX:
    # selects, not products, zero both (the select's transpose masks dX)
    valid = (jnp.arange(x_sorted.shape[0]) < group_sizes.sum())[:, None]
    x_sorted = jnp.where(valid, x_sorted, 0)
    y = gmm(x_sorted, w.astype(x_sorted.dtype), group_sizes, x_sorted.dtype, tiling, None, None,
            False, interpret)  # fmt: skip
    return jnp.where(valid, y, 0)
