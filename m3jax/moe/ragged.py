"""The ragged exchange of expert parallelism (`moe.exchange: ragged`, dropless dispatch).

The (token, expert) rows sorted by expert as on one device (local.py), `jax.lax.ragged_all_to_all`
of exactly the rows each device needs (exact too). The receive buffer has a static size, the
worst case Ep · N · min(k, E/Ep) rows (every token of every device picking this device's
experts). XLA:CPU does not implement ragged-all-to-all (jax 0.11.2: "UNIMPLEMENTED: HLO opcode
`ragged-all-to-all`"): on the CPU backend an all_gather-based equivalent with the same arguments
and result runs instead (`ragged_all_to_all_by_gather`).

Shapes: R rows (sorted by global expert), D model width, E experts (all), Ep expert-parallel
devices.
"""

import jax
import jax.numpy as jnp

from m3jax.moe.local import RowOrder
from m3jax.sharding import EXPERT_AXIS
from pallas_kernels.moe.tiles import inverse_permutation


def exchange(
    x_sorted: jax.Array, group_sizes: jax.Array, *, local, rows_per_source: int, emulate: bool
) -> jax.Array:
    """Rows [R, D] sorted by (global) expert -> their experts' outputs [R, D], across devices.

    group_sizes: [E] this device's rows per expert. Device p receives, from each source s in
    turn, the rows s holds for p's experts (sorted by expert), regroups them expert-major for the
    grouped matmul, and returns each result to the place it came from.
    """
    parts = jax.lax.axis_size(EXPERT_AXIS)
    send_sizes, recv_counts = _exchange_counts(group_sizes)
    send_offsets = _exclusive_cumsum(send_sizes)
    recv_sizes = recv_counts.sum(1)
    recv_offsets = _exclusive_cumsum(recv_sizes)
    # Where my rows land in each receiver's buffer, and where each source keeps its rows for me.
    remote_recv_offsets = jax.lax.all_to_all(recv_offsets, EXPERT_AXIS, 0, 0, tiled=True)
    remote_send_offsets = jax.lax.all_to_all(send_offsets, EXPERT_AXIS, 0, 0, tiled=True)
    exchange = ragged_all_to_all_by_gather if emulate else _ragged_all_to_all
    # zeros_like, not zeros: the buffer must vary over the mesh axes as the rows do, since
    # ragged_all_to_all types its result like `output`; typed invariant, the received rows would
    # get an implicit pvary whose transpose sums their gradient over devices.
    buffer = jnp.zeros_like(x_sorted, shape=(parts * rows_per_source, x_sorted.shape[1]))
    received = exchange(x_sorted, buffer, send_offsets, send_sizes, remote_recv_offsets, recv_sizes)
    y = local(
        received, recv_counts.sum(0), expert_major_order(recv_counts, recv_offsets, len(buffer))
    )
    return exchange(
        y, jnp.zeros_like(x_sorted), recv_offsets, recv_sizes, remote_send_offsets, send_sizes
    )


def expert_major_order(recv_counts: jax.Array, source_starts: jax.Array, num_rows: int) -> RowOrder:
    """How received rows regroup from source-major to expert-major order (both ways).

    recv_counts: [Ep, E_local], rows from source s for local expert j; source s's rows start at
    source_starts[s] in the buffer of `num_rows`, as blocks (s, 0), (s, 1), ... back to back; any
    other row is padding. The row of block (s, j) at offset r goes to sorted position
    start_j + Σ_{s'<s} counts[s', j] + r; padding rows get none (position num_rows).
    """
    blocks = recv_counts.reshape(-1)
    within_source = _exclusive_cumsum(recv_counts, axis=1)
    block_start = (source_starts[:, None] + within_source).reshape(-1)
    group_start = _exclusive_cumsum(recv_counts.sum(0))  # [E_local]
    target = (group_start[None, :] + _exclusive_cumsum(recv_counts, axis=0)).reshape(-1)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    # The last block starting at or before the row: of blocks that share a start, only the last
    # can hold rows.
    block = jnp.searchsorted(block_start, row, side="right", method="compare_all") - 1
    block = jnp.maximum(block, 0)
    offset = row - block_start[block]
    inside = (offset >= 0) & (offset < blocks[block])
    position = jnp.where(inside, target[block] + offset, num_rows).astype(jnp.int32)
    return RowOrder(inverse_permutation(position), position)


def _exchange_counts(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[E] rows per expert -> ([Ep] rows this device sends each peer, [Ep(source), E/Ep] rows it
    receives from each source for each local expert)."""
    counts = group_sizes.reshape(jax.lax.axis_size(EXPERT_AXIS), -1)  # [Ep, E/Ep]
    return counts.sum(1), jax.lax.all_to_all(counts, EXPERT_AXIS, 0, 0, tiled=True)


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return jax.lax.ragged_all_to_all(
        operand,
        output,
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=EXPERT_AXIS,
    )


def ragged_all_to_all_by_gather(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
):
    """`jax.lax.ragged_all_to_all`'s result, built from all_gathers (for XLA:CPU, which lacks it).

    Every device gathers every operand (Ep times the traffic) and scatters the slices addressed to
    it: source s's rows input_offsets[s][me] … + send_sizes[s][me] land at output_offsets[s][me].
    """
    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(EXPERT_AXIS)
    operands = jax.lax.all_gather(operand, EXPERT_AXIS)  # [Ep, rows, ...]
    start, size, dest = (
        jax.lax.all_gather(a, EXPERT_AXIS)[:, me]  # [Ep]: what each source sends me
        for a in (input_offsets, send_sizes, output_offsets)
    )
    row = jnp.arange(operand.shape[0])
    inside = (row[None] >= start[:, None]) & (row[None] < (start + size)[:, None])
    target = jnp.where(inside, dest[:, None] + row[None] - start[:, None], output.shape[0])
    flat = operands.reshape(-1, *operand.shape[1:])
    return output.at[target.reshape(-1)].set(flat, mode="drop")
