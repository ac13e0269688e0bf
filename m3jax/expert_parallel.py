"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens exchanged.

Inside `jax.shard_map` over the whole mesh each device holds a shard of the tokens (rows over the
`batch` axes data, fsdp, expert; sequence over `seq`: the RULES of m3jax/sharding.py) and E/Ep of
the experts (Ep = size of the `expert` axis; device p owns experts p·E/Ep … (p+1)·E/Ep - 1).
Tokens travel to the devices owning their experts, the local experts run, results travel back.
Routing and attention stay outside: for them the expert axis is one more data-parallel axis, and
the router statistics (computed outside) are global. The shared expert (`Beside`: work on the
device's own tokens) may come inside, so that XLA can schedule its matmuls beside the all-to-alls,
even within the padded exchange's branch; its weights are then whole on every device.

Exchanges, by `model.moe.dispatch`:
- dropless, `moe.exchange: padded` (default): each token travels once to each device owning any
  of its k experts, with its expert ids and routing weights, however many of them that device
  owns (`_padded_round_trip`); the device sorts the (token, choice) rows it received by expert,
  runs its experts, sums each token's weighted outputs and sends one row per token back, where
  the partial sums of the Ep devices add up. `jax.lax.all_to_all` moves fixed blocks of
  `padded_blocks(...)` tokens per device pair, zero-padded; the local experts take a fixed
  number of rows. In a step where some block or some device's rows would overflow, every device
  takes the branch sized for the worst case instead (a `lax.cond` on a global max), so no row is
  ever dropped. The branch holds everything done on the device, `Beside` work included. With
  k = 4 of E = 32 experts on Ep = 2 devices a token has 2 rows for each device on average but is
  sent once (0.47 of the rows' traffic); the price is one more rounding of the partial sums to the
  activations' dtype than on one device (measured: benchmarks/RESULTS.md).
- dropless, `moe.exchange: ragged`: the (token, expert) rows sorted by expert as on one device
  (moe_dispatch.py), `jax.lax.ragged_all_to_all` of exactly the rows each device needs (exact
  too). The receive buffer has a static size, the worst case Ep · N · min(k, E/Ep) rows
  (every token of every device picking this device's experts). XLA:CPU does not implement
  ragged-all-to-all (jax 0.11.2: "UNIMPLEMENTED: HLO opcode `ragged-all-to-all`"): on the CPU
  backend an all_gather-based equivalent with the same arguments and result runs instead.
- capacity: `jax.lax.all_to_all` of the fixed [E, C, D] capacity buffers (C per expert and source
  device, moe_dispatch.capacity over the device's N tokens), one batched einsum over the
  [E/Ep, Ep·C, D] buffers received, the same all_to_all back. Rows past C are dropped and counted.
Gradients come from autodiff through the collectives (their transposes are the reverse exchanges).
The expert weights enter the map as they are stored (`EXPERT_WEIGHT_AXES` through sharding.RULES:
E over `expert`, D over `fsdp`, F over `tensor`), so a device receives only its E/Ep experts'
shards; inside, it all-gathers the fsdp/tensor shards of its own experts (`_gathered`), whose
transpose reduce-scatters their gradients. Gathering on entry instead would make every device
hold, and all-reduce the gradients of, E/Ep whole experts (with mesh.expert = 1: all E of them).
With mesh.tensor > 1 every tensor rank repeats its group's expert work (no tensor parallelism
inside the experts yet).

Shapes: B batch, S sequence, N = B·S tokens on a device, k experts per token, R = N·k rows,
D model width, E experts (all), Ep expert-parallel devices (the `expert` axis), C capacity.
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
    combine,
    expand_tokens,
    local_ffn,
    pairs_ffn,
    sort_rows,
    sorted_experts,
)
from pallas_kernels.moe.mosaic_gpu import vary_like
from pallas_kernels.moe.tiles import inverse_permutation, permute_rows

EXPERT_AXIS = "expert"
# Logical axes of the routed experts' weights (m3jax/moe.py): gate, up [E, D, F]; down [E, F, D].
EXPERT_WEIGHT_AXES = ExpertWeights(
    ("expert", "embed", "mlp"), ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
)


class Blocks(NamedTuple):
    """Static sizes of the padded exchange."""

    tokens: int  # the most tokens a device sends one peer (all_to_all block rows)
    rows: int  # the most (token, expert) rows a device's experts receive in all


def padded_blocks(
    num_tokens: int, k: int, num_experts: int, parts: int, factor: float
) -> tuple[Blocks, Blocks]:
    """(the usual sizes, the worst case) for N = `num_tokens` tokens per device.

    Usual: `factor` times what a device pair and a device need under balanced routing, a token
    reaching a given peer unless all its k distinct choices miss that peer's E/Ep experts
    (probability Π_{i<k} (E - E/Ep - i) / (E - i)), and a device receiving N·k rows. Worst: every
    token to every peer, with min(k, E/Ep) rows each.
    """
    local = num_experts // parts
    worst = Blocks(num_tokens, parts * num_tokens * min(k, local))
    miss = math.prod((num_experts - local - i) / (num_experts - i) for i in range(k))
    tokens = min(worst.tokens, math.ceil(factor * num_tokens * (1 - miss)))
    rows = min(parts * tokens * min(k, local), math.ceil(factor * num_tokens * k))
    return Blocks(tokens, rows), worst


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
      exchange, exchange_factor: dropless only, how tokens travel (see the module docstring).
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
    stored = ExpertWeights(
        *(
            sharding.partition_spec(axes, w.shape, mesh)
            for axes, w in zip(EXPERT_WEIGHT_AXES, experts, strict=True)
        )
    )
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
        stored=stored,
    )
    beside_weights = beside.weights if beside else ()
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, stored, PartitionSpec()),
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
    stored: ExpertWeights,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One device's shard: x [B/…, S/…, D], chosen and weights [.., .., k]; E/Ep local experts,
    sharded as `stored` (PartitionSpecs) says."""
    shape, k = x.shape, chosen.shape[-1]
    parts = jax.lax.axis_size(EXPERT_AXIS)
    local_experts = experts.gate.shape[0]
    num_tokens = math.prod(shape[:-1])
    tokens = x.reshape(num_tokens, shape[-1])
    # Weights typed as varying like the rows, once: autodiff sums their gradient over the token
    # axes here, and the padded exchange's two branches share one residual copy of them.
    experts = ExpertWeights(
        *(vary_like(_gathered(w, spec, token_axes), x) for w, spec in zip(experts, stored))
    )
    beside_weights = tuple(vary_like(w, x) for w in beside_weights)
    ffn = local_ffn(experts, activation, grouped_matmul)
    chosen, weights = chosen.reshape(num_tokens, k), weights.reshape(num_tokens, k)

    def on_device(routed_fn) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """routed_fn: (tokens, chosen, weights) -> (routed [N, D], dropped rows)."""
        routed, dropped = routed_fn(tokens, chosen, weights)
        return routed, dropped, beside_fn(tokens, *beside_weights) if beside_fn else None

    def sorted_through(ffn: ExpertFFN):
        return functools.partial(
            sorted_experts,
            num_experts=local_experts * parts,
            ffn=ffn,
            dispatch=dispatch,
            capacity_factor=capacity_factor,
        )

    worst_case = jnp.zeros((), jnp.float32)
    if parts == 1:
        routed, dropped, beside = on_device(sorted_through(ffn))
    elif exchange == "padded" and dispatch == "dropless":
        usual, worst = padded_blocks(num_tokens, k, local_experts * parts, parts, exchange_factor)
        owned_by = _owned_by(chosen, local_experts)
        fits = _blocks_fit(owned_by, usual, token_axes)
        worst_case = 1.0 - fits.astype(jnp.float32)
        round_trip = functools.partial(
            _padded_round_trip, visits=owned_by.any(1), ffn=ffn, local_experts=local_experts
        )
        routed, dropped, beside = _padded_branches(
            lambda blocks: on_device(functools.partial(round_trip, blocks=blocks)),
            usual,
            worst,
            fits,
        )
    else:
        worst = num_tokens * min(k, local_experts)  # the most rows a device can send one peer
        ragged = functools.partial(
            _ragged_exchange, local=ffn.grouped, rows_per_source=worst, emulate=emulate_ragged
        )
        batched = functools.partial(_capacity_exchange, local=ffn.batched)
        routed, dropped, beside = on_device(
            sorted_through(ExpertFFN(grouped=ragged, batched=batched))
        )
    if dispatch == "capacity":
        dropped = jax.lax.psum(dropped, token_axes)
    beside = None if beside is None else beside.reshape(shape)
    return routed.reshape(shape), dropped, worst_case, beside


def _gathered(w: jax.Array, spec: PartitionSpec, token_axes: tuple[str, ...]) -> jax.Array:
    """This device's experts whole along D and F: the shards over the mesh axes that `spec` names
    for the dims after the expert dim, all-gathered. Over an axis the tokens are split on (fsdp),
    the gradient's transpose is a reduce-scatter (the shards' tokens differ); over one they are
    not (tensor: every rank repeats the same work), it is a slice of the same whole gradient."""
    for dim, axes in enumerate(spec):
        if dim == 0 or axes is None:
            continue
        for axis in reversed((axes,) if isinstance(axes, str) else axes):  # minor axis first
            to = "varying" if axis in token_axes else "invarying"
            w = jax.lax.all_gather(w, axis, axis=dim, tiled=True, to=to)
    return w


def _padded_branches(padded, usual: Blocks, worst: Blocks, fits: jax.Array):
    """`padded(usual)`, or where it would overflow (`fits` false), `padded(worst)`.

    `fits` is the same on every device (`_blocks_fit`): both branches are compiled, one runs, and
    the collectives inside match on every device. Each branch is all of the device's work,
    `Beside` included, so that XLA may run it beside the all-to-alls (it schedules nothing across
    a branch's boundary). Under autodiff the forward keeps the residuals of both branches, the
    untaken one's as zeros. The worst-case branch is rematerialised (`jax.checkpoint`) so that its
    residuals are only its inputs (tokens [N, D], routing, weights) instead of activations of
    worst-case size: the common step pays a zero fill of [N, D], the rare worst-case step a second
    forward pass in backward. The weights, typed like the rows before the branch, are residuals
    shared by both.
    """
    if usual == worst:
        return padded(worst)
    return jax.lax.cond(fits, lambda: padded(usual), jax.checkpoint(lambda: padded(worst)))


def _owned_by(chosen: jax.Array, local_experts: int) -> jax.Array:
    """[N, k] expert ids -> [N, k, Ep] bool: whether choice j of token t is on device p."""
    owner = chosen // local_experts
    return owner[:, :, None] == jnp.arange(jax.lax.axis_size(EXPERT_AXIS), dtype=owner.dtype)


def _blocks_fit(owned_by: jax.Array, blocks: Blocks, token_axes) -> jax.Array:
    """Whether no device sends any peer more than blocks.tokens tokens, nor receives more than
    blocks.rows rows (bool, the same on every device). owned_by: `_owned_by`'s [N, k, Ep]."""
    tokens_per_peer = owned_by.any(1).sum(0, dtype=jnp.int32)
    rows_per_peer = owned_by.sum((0, 1), dtype=jnp.int32)
    rows_received = jax.lax.psum(rows_per_peer, EXPERT_AXIS)  # [Ep]: by each device of my group
    overflow = (tokens_per_peer.max() > blocks.tokens) | (rows_received.max() > blocks.rows)
    return jax.lax.pmax(overflow.astype(jnp.int32), token_axes) == 0


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _exchange_counts(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[E] rows per expert -> ([Ep] rows this device sends each peer, [Ep(source), E/Ep] rows it
    receives from each source for each local expert)."""
    counts = group_sizes.reshape(jax.lax.axis_size(EXPERT_AXIS), -1)  # [Ep, E/Ep]
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


def _padded_round_trip(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    *,
    visits: jax.Array,
    ffn: ExpertFFN,
    local_experts: int,
    blocks: Blocks,
) -> tuple[jax.Array, jax.Array]:
    """[N, D] tokens, [N, k] expert ids and weights -> (routed output [N, D], 0 rows dropped),
    each token sent once to each device owning some of its experts (visits [N, Ep]: whether it
    goes to device p; `blocks` must fit).

    A visit is a (token, peer) pair, numbered token · Ep + peer; it takes the next free slot of
    the [Ep, blocks.tokens] send blocks. Tokens go out and partial sums come back by one gather
    each way (`expand_tokens`, `permute_rows`: gathers in backward too).
    """
    parts, me = jax.lax.axis_size(EXPERT_AXIS), jax.lax.axis_index(EXPERT_AXIS)
    num_tokens, k = chosen.shape
    num_slots = parts * blocks.tokens
    slot = jnp.arange(parts, dtype=jnp.int32) * blocks.tokens + jnp.cumsum(visits, 0) - 1
    visit_slot = jnp.where(visits, slot, num_slots).astype(jnp.int32).reshape(-1)  # [N·Ep]
    slot_visit = inverse_permutation(visit_slot, num_slots)  # [Ep·blocks.tokens], N·Ep: empty

    def exchange(a: jax.Array) -> jax.Array:
        blocked = a.reshape(parts, blocks.tokens, *a.shape[1:])
        return jax.lax.all_to_all(blocked, EXPERT_AXIS, 0, 0, tiled=True).reshape(a.shape)

    received = exchange(expand_tokens(x, slot_visit, visit_slot, parts))  # [Ep·blocks.tokens, D]
    received_weights = exchange(expand_tokens(weights, slot_visit, visit_slot, parts))
    sent_experts = chosen.at[slot_visit // parts].get(mode="fill", fill_value=-1)
    local = (
        exchange(sent_experts) - me * local_experts
    )  # [Ep·blocks.tokens, k]; others' and gaps' out of range
    local = jnp.where((local >= 0) & (local < local_experts), local, local_experts)
    rows = sort_rows(local, local_experts + 1)  # the last group: choices not on this device
    rows = SortedRows(
        rows.order[: blocks.rows],
        rows.inverse,
        rows.expert_ids[: blocks.rows],
        rows.group_sizes[:local_experts],
    )
    partial_sums = combine(
        pairs_ffn(received, rows, k, ffn), received_weights
    )  # [Ep·blocks.tokens, D]
    returned = exchange(partial_sums)
    per_visit = permute_rows(returned, visit_slot, slot_visit).reshape(num_tokens, parts, -1)
    return per_visit.sum(1, dtype=jnp.float32).astype(x.dtype), jnp.zeros((), jnp.int32)


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


def _capacity_exchange(buffers: jax.Array, *, local) -> jax.Array:
    """[E, C, D] capacity buffers -> the experts' outputs [E, C, D], across devices."""
    parts = jax.lax.axis_size(EXPERT_AXIS)
    num_experts, size, dim = buffers.shape
    local_experts = num_experts // parts
    sent = buffers.reshape(parts, local_experts * size, dim)
    received = jax.lax.all_to_all(sent, EXPERT_AXIS, 0, 0, tiled=True)  # [Ep(source), E/Ep·C, D]
    received = received.reshape(parts, local_experts, size, dim).transpose(1, 0, 2, 3)
    y = local(received.reshape(local_experts, parts * size, dim))
    y = y.reshape(local_experts, parts, size, dim).transpose(1, 0, 2, 3)
    y = jax.lax.all_to_all(y.reshape(parts, -1, dim), EXPERT_AXIS, 0, 0, tiled=True)
    return y.reshape(num_experts, size, dim)
