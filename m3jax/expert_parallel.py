"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens exchanged.

Inside `jax.shard_map` over the whole mesh each device holds a shard of the tokens (rows over the
`batch` axes data, fsdp, expert; sequence over `seq`: the RULES of m3jax/sharding.py) and E/P of
the experts (P = size of the `expert` axis; device p owns experts p·E/P … (p+1)·E/P - 1). Each
device sorts its (token, expert) rows by expert exactly as on one device (moe_dispatch.py); only
the expert FFN is replaced by: send rows to the devices owning their experts -> local FFN ->
send results back. Routing and attention stay outside: for them the expert axis is one more
data-parallel axis, and the router statistics (computed outside) are global. The shared expert
(`Beside`: work on the device's own tokens) may come inside, so that XLA can schedule its matmuls
beside the all-to-alls, even within the padded exchange's branch; its weights are then whole on
every device.

Exchanges, by `model.moe.dispatch`:
- dropless, `moe.exchange: padded` (default): `jax.lax.all_to_all` of fixed blocks of
  ⌈exchange_factor · N·k / P⌉ rows per device pair, zero-padded, and back; in a step where some
  device has more rows than that for some peer, every device takes the branch with blocks of the
  worst case N · min(k, E/P) instead (a `lax.cond` on a global max), so no row is ever dropped.
  The branch holds everything done on the device, `Beside` work included.
- dropless, `moe.exchange: ragged`: `jax.lax.ragged_all_to_all` of exactly the rows each device
  needs (exact too). The receive buffer has a static size, the worst case P · N · min(k, E/P) rows
  (every token of every device picking this device's experts). XLA:CPU does not implement
  ragged-all-to-all (jax 0.11.2: "UNIMPLEMENTED: HLO opcode `ragged-all-to-all`"): on the CPU
  backend an all_gather-based equivalent with the same arguments and result runs instead.
- capacity: `jax.lax.all_to_all` of the fixed [E, C, D] capacity buffers (C per expert and source
  device, moe_dispatch.capacity over the device's N tokens), one batched einsum over the
  [E/P, P·C, D] buffers received, the same all_to_all back. Rows past C are dropped and counted.
Gradients come from autodiff through the collectives (their transposes are the reverse exchanges).
Inside the map the expert weights are whole along D and F: fsdp/tensor shards are gathered on entry,
and with mesh.tensor > 1 every tensor rank repeats its group's expert work (no tensor parallelism
inside the experts yet).

Shapes: B batch, S sequence, N = B·S tokens on a device, k experts per token, R = N·k rows,
D model width, E experts (all), P expert-parallel devices, C capacity.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from m3jax import sharding
from m3jax.moe_dispatch import (
    Activation,
    ExpertFFN,
    ExpertWeights,
    RowOrder,
    SortedRows,
    expand_tokens,
    local_ffn,
    sorted_experts,
)
from pallas_kernels.moe.mosaic_gpu import vary_like
from pallas_kernels.moe.tiles import inverse_permutation, permute_rows

EXPERT_AXIS = "expert"


class Beside(NamedTuple):
    """Work on each device's own tokens that needs no exchange (M3's shared expert)."""

    fn: Callable[..., jax.Array]  # (tokens [N, D], *weights) -> [N, D]
    weights: tuple[jax.Array, ...]  # whole on every device inside the map (gathered on entry)


def routed_experts(
    mesh: Mesh,
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    experts: ExpertWeights,
    activation: Activation,
    *,
    dispatch: str,
    capacity_factor: float,
    grouped_matmul: str = "xla",
    exchange: str = "padded",
    exchange_factor: float = 1.25,
    beside: Beside | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The routed experts with tokens and experts spread over `mesh` (any axis sizes).

    Args:
      x: [B, S, D] tokens; chosen: [B, S, k] expert ids; weights: [B, S, k] fp32 routing weights.
      experts: all E experts' weights ([E, D, F], [E, D, F], [E, F, D]) in x's dtype.
      dispatch: "dropless" or "capacity" (see the module docstring).
      grouped_matmul: the local experts' grouped matmul (moe_dispatch.grouped_matmul_impl).
      exchange, exchange_factor: dropless only, how rows travel (see the module docstring).
      beside: work to run on each device's tokens beside the exchange, or None.
    Returns:
      routed output [B, S, D] (before routed_scaling), the global number of dropped rows, 1.0 if
      the padded exchange needed worst-case blocks in this call, else 0.0 (fp32 scalars), and
      beside's output [B, S, D] (None without `beside`).
    """
    rules = dict(sharding.RULES)
    batch_axes, seq_axes = rules["batch"], rules["seq"]
    _check_divisible(mesh, x.shape, experts.gate.shape[0], batch_axes, seq_axes)
    tokens = PartitionSpec(batch_axes, seq_axes)
    on_device = functools.partial(
        _routed_on_device,
        beside_fn=beside.fn if beside else None,
        activation=activation,
        dispatch=dispatch,
        capacity_factor=capacity_factor,
        grouped_matmul=grouped_matmul,
        exchange=exchange,
        exchange_factor=exchange_factor,
        token_axes=(*batch_axes, *seq_axes),
        emulate_ragged=_lacks_ragged_all_to_all(mesh),
    )
    beside_weights = beside.weights if beside else ()
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, PartitionSpec(EXPERT_AXIS), PartitionSpec()),
        out_specs=(tokens, PartitionSpec(), PartitionSpec(), tokens if beside else None),
    )(x, chosen, weights, experts, beside_weights)


def _lacks_ragged_all_to_all(mesh: Mesh) -> bool:
    """XLA:CPU has no ragged-all-to-all (jax 0.11.2); GPU and TPU do."""
    return mesh.devices.flat[0].platform == "cpu"


def _check_divisible(mesh: Mesh, shape: tuple, num_experts: int, batch_axes, seq_axes) -> None:
    if EXPERT_AXIS not in batch_axes:
        raise ValueError(f"expert parallelism needs tokens split over {EXPERT_AXIS!r} too")
    if num_experts % mesh.shape[EXPERT_AXIS]:
        raise ValueError(
            f"moe.num_experts={num_experts} is not divisible by "
            f"mesh.expert={mesh.shape[EXPERT_AXIS]}"
        )
    for dim, axes, what in ((0, batch_axes, "batch rows"), (1, seq_axes, "sequence length")):
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            raise ValueError(
                f"MoE on mesh {dict(mesh.shape)}: {what} {shape[dim]} are not divisible by "
                f"the mesh axes {axes} (size {parts})"
            )


def _routed_on_device(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    experts: ExpertWeights,
    beside_weights: tuple[jax.Array, ...],
    *,
    beside_fn: Callable[..., jax.Array] | None,
    activation: Activation,
    dispatch: str,
    capacity_factor: float,
    grouped_matmul: str,
    exchange: str,
    exchange_factor: float,
    token_axes: tuple[str, ...],
    emulate_ragged: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One device's shard: x [B/…, S/…, D], chosen and weights [.., .., k]; E/P local experts."""
    shape, k = x.shape, chosen.shape[-1]
    parts = jax.lax.axis_size(EXPERT_AXIS)
    local_experts = experts.gate.shape[0]
    num_tokens = math.prod(shape[:-1])
    tokens = x.reshape(num_tokens, shape[-1])
    # Weights typed as varying like the rows, once: autodiff sums their gradient over the token
    # axes here, and the padded exchange's two branches share one residual copy of them.
    experts = ExpertWeights(*(vary_like(w, x) for w in experts))
    beside_weights = tuple(vary_like(w, x) for w in beside_weights)
    ffn = local_ffn(experts, activation, grouped_matmul)

    def on_device(ffn: ExpertFFN) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        routed, dropped = sorted_experts(
            tokens,
            chosen.reshape(num_tokens, k),
            weights.reshape(num_tokens, k),
            local_experts * parts,
            ffn,
            dispatch=dispatch,
            capacity_factor=capacity_factor,
        )
        return routed, dropped, beside_fn(tokens, *beside_weights) if beside_fn else None

    worst_case = jnp.zeros((), jnp.float32)
    if parts == 1:
        routed, dropped, beside = on_device(ffn)
    else:
        worst = num_tokens * min(k, local_experts)  # the most rows a device can send one peer
        batched = functools.partial(_capacity_exchange, local=ffn.batched)
        if exchange == "padded" and dispatch == "dropless":
            padded = functools.partial(_padded_ffn, local=ffn.grouped, batched=batched)
            block = min(worst, math.ceil(exchange_factor * num_tokens * k / parts))
            fits = _blocks_fit(chosen, local_experts, parts, block, token_axes)
            worst_case = 1.0 - fits.astype(jnp.float32)
            routed, dropped, beside = _padded_branches(on_device, padded, block, worst, fits)
        else:
            ragged = functools.partial(
                _ragged_exchange, local=ffn.grouped, rows_per_source=worst, emulate=emulate_ragged
            )
            routed, dropped, beside = on_device(ExpertFFN(grouped=ragged, batched=batched))
    if dispatch == "capacity":
        dropped = jax.lax.psum(dropped, token_axes)
    beside = None if beside is None else beside.reshape(shape)
    return routed.reshape(shape), dropped, worst_case, beside


def _padded_branches(on_device, padded, block_rows: int, worst_rows: int, fits: jax.Array):
    """`on_device` with rows exchanged in fixed blocks of `block_rows` rows per device pair.

    When any device has more rows than that for a peer (`fits` false, the same on every device:
    `_blocks_fit`), every device takes the branch with blocks of `worst_rows` instead, so no row is
    ever dropped; both branches are compiled, one runs, and the collectives inside match on every
    device. Each branch is all of the device's work, `Beside` included, so that XLA may run it
    beside the all-to-alls (it schedules nothing across a branch's boundary).
    Under autodiff the forward keeps the residuals of both branches, the untaken one's as zeros.
    The worst-case branch is rematerialised (`jax.checkpoint`) so that its residuals are only its
    inputs (tokens [N, D], routing, weights) instead of activations of P · worst_rows rows: the
    common step pays a zero fill of [N, D], the rare worst-case step a second forward pass in
    backward. The weights, typed like the rows before the branch, are residuals shared by both.
    """
    if block_rows >= worst_rows:
        return on_device(padded(worst_rows))
    return jax.lax.cond(
        fits,
        lambda: on_device(padded(block_rows)),
        jax.checkpoint(lambda: on_device(padded(worst_rows))),
    )


def _padded_ffn(block: int, *, local, batched) -> ExpertFFN:
    """The experts reached through the padded exchange with blocks of `block` rows (dropless)."""
    return ExpertFFN(
        grouped=None,
        batched=batched,
        pairs=functools.partial(_padded_round_trip, local=local, block=block),
    )


def _blocks_fit(chosen, local_experts: int, parts: int, block: int, token_axes) -> jax.Array:
    """Whether no device has more than `block` rows for any peer (bool, the same everywhere)."""
    peer = chosen.reshape(-1) // local_experts
    rows_per_peer = jnp.zeros((parts,), jnp.int32).at[peer].add(1)
    return jax.lax.pmax(rows_per_peer.max(), token_axes) <= block


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _exchange_counts(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[E] rows per expert -> ([P] rows this device sends each peer, [P(source), E/P] rows it
    receives from each source for each local expert)."""
    counts = group_sizes.reshape(jax.lax.axis_size(EXPERT_AXIS), -1)  # [P, E/P]
    return counts.sum(1), jax.lax.all_to_all(counts, EXPERT_AXIS, 0, 0, tiled=True)


def _ragged_exchange(
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
    exchange = _ragged_all_to_all_by_gather if emulate else _ragged_all_to_all
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

    recv_counts: [P, E_local], rows from source s for local expert j; source s's rows start at
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


def _padded_round_trip(x: jax.Array, rows: SortedRows, k: int, *, local, block: int) -> jax.Array:
    """[N, D] tokens -> [N·k, D] expert outputs in (token, choice) order, through blocks of `block`
    rows per device pair (each device's rows for the peer's experts, zero-padded; they must fit).

    Tokens go straight into the [P, block] send blocks and results straight back to (token,
    choice) order: the sorted rows are never materialised (one gather each way)."""
    send_sizes, recv_counts = _exchange_counts(rows.group_sizes)
    parts, num_pairs, dim = recv_counts.shape[0], rows.order.shape[0], x.shape[1]
    slot = jnp.arange(block, dtype=jnp.int32)
    send_starts = _exclusive_cumsum(send_sizes)
    # Slot (p, i) of the send blocks holds sorted row send_starts[p] + i, or nothing (zeros).
    sorted_row = jnp.where(slot < send_sizes[:, None], send_starts[:, None] + slot, num_pairs)
    pair = rows.order.at[sorted_row.reshape(-1)].get(mode="fill", fill_value=num_pairs)
    pair_slot = inverse_permutation(pair, num_pairs)  # where each (token, choice) sits in blocks
    sent = expand_tokens(x, pair, pair_slot, k).reshape(parts, block, dim)
    received = jax.lax.all_to_all(sent, EXPERT_AXIS, 0, 0, tiled=True).reshape(-1, dim)
    source_starts = jnp.arange(parts, dtype=jnp.int32) * block
    order = expert_major_order(recv_counts, source_starts, parts * block)
    y = local(received, recv_counts.sum(0), order).reshape(parts, block, dim)
    returned = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0, tiled=True).reshape(-1, dim)
    return permute_rows(returned, pair_slot, pair)


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


def _ragged_all_to_all_by_gather(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
):
    """`jax.lax.ragged_all_to_all`'s result, built from all_gathers (for XLA:CPU, which lacks it).

    Every device gathers every operand (P times the traffic) and scatters the slices addressed to
    it: source s's rows input_offsets[s][me] … + send_sizes[s][me] land at output_offsets[s][me].
    """
    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(EXPERT_AXIS)
    operands = jax.lax.all_gather(operand, EXPERT_AXIS)  # [P, M_in, ...]
    start, size, dest = (
        jax.lax.all_gather(a, EXPERT_AXIS)[:, me]  # [P]: what each source sends me
        for a in (input_offsets, send_sizes, output_offsets)
    )
    row = jnp.arange(operand.shape[0])
    inside = (row[None] >= start[:, None]) & (row[None] < (start + size)[:, None])
    target = jnp.where(inside, dest[:, None] + row[None] - start[:, None], output.shape[0])
    flat = operands.reshape(-1, *operand.shape[1:])
    return output.at[target.reshape(-1)].set(flat, mode="drop")


def _capacity_exchange(buffers: jax.Array, *, local) -> jax.Array:
    """[E, C, D] capacity buffers -> the experts' outputs [E, C, D], across devices."""
    parts = jax.lax.axis_size(EXPERT_AXIS)
    num_experts, size, dim = buffers.shape
    local_experts = num_experts // parts
    sent = buffers.reshape(parts, local_experts * size, dim)
    received = jax.lax.all_to_all(sent, EXPERT_AXIS, 0, 0, tiled=True)  # [P(source), E/P·C, D]
    received = received.reshape(parts, local_experts, size, dim).transpose(1, 0, 2, 3)
    y = local(received.reshape(local_experts, parts * size, dim))
    y = y.reshape(local_experts, parts, size, dim).transpose(1, 0, 2, 3)
    y = jax.lax.all_to_all(y.reshape(parts, -1, dim), EXPERT_AXIS, 0, 0, tiled=True)
    return y.reshape(num_experts, size, dim)
