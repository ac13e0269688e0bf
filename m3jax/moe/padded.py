"""The padded exchange of expert parallelism (`moe.exchange: padded`, dropless dispatch; the
default).

Each token travels once to each device owning any of its k experts, with its expert ids and
routing weights, however many of them that device owns (`_round_trip`); the device sorts the
(token, choice) rows it received by expert, runs its experts, sums each token's weighted outputs
and sends one row per token back, where the partial sums of the Ep devices add up.
`jax.lax.all_to_all` moves fixed blocks of `padded_blocks(...)` tokens per device pair,
zero-padded; the local experts take a fixed number of rows. In a step where some block or some
device's rows would overflow, every device takes the branch sized for the worst case instead (a
`lax.cond` on a global max), so no row is ever dropped. That branch sends the device's tokens in
pieces, one round trip after another, each sized for its own worst case and no larger than the
usual blocks: XLA allocates the untaken branch's buffers too, and one round trip sized for every
token to reach every peer with min(k, E/Ep) rows would hold Ep · min(k, E/Ep) / (factor · k)
times the usual rows (M3 on 8 expert devices at 32K tokens a device: 12.9 GB arrays, 180 GB a
device planned). Either branch holds everything done on the device, `Beside` work
(expert_parallel.py) included. With k = 4 of E = 32 experts on Ep = 2 devices a token has 2 rows
for each device on average but is sent once (0.47 of the rows' traffic); the price is one more
rounding of the partial sums to the activations' dtype than on one device (measured:
benchmarks/RESULTS.md).

Shapes: N tokens on a device, k experts per token, D model width, E experts (all), Ep
expert-parallel devices.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from m3jax.moe.local import ExpertFFN, SortedRows, combine, expand_tokens, pairs_ffn, sort_rows
from m3jax.sharding import EXPERT_AXIS
from pallas_kernels.moe.tiles import inverse_permutation, permute_rows


class Blocks(NamedTuple):
    """Static sizes of the padded exchange."""

    tokens: int  # the most tokens a device sends one peer (all_to_all block rows)
    rows: int  # the most (token, expert) rows a device's experts receive in all
    pieces: int = 1  # round trips, one after another, each for a slice of the device's tokens


def padded_blocks(
    num_tokens: int, k: int, num_experts: int, parts: int, factor: float
) -> tuple[Blocks, Blocks]:
    """(the usual sizes, the worst case) for N = `num_tokens` tokens per device.

    Usual: `factor` times what a device pair and a device need under balanced routing, a token
    reaching a given peer unless all its k distinct choices miss that peer's E/Ep experts
    (probability Π_{i<k} (E - E/Ep - i) / (E - i)), and a device receiving N·k rows. Worst: every
    token to every peer, with min(k, E/Ep) rows each, in as many pieces of ⌈N / pieces⌉ tokens as
    keep a piece's rows about the usual rows (within one piece's rounding).
    """
    local = num_experts // parts
    rows_per_token = parts * min(k, local)  # a device receives at most this many per token sent
    miss = math.prod((num_experts - local - i) / (num_experts - i) for i in range(k))
    tokens = min(num_tokens, math.ceil(factor * num_tokens * (1 - miss)))
    rows = min(parts * tokens * min(k, local), math.ceil(factor * num_tokens * k))
    pieces = min(num_tokens, math.ceil(num_tokens * rows_per_token / rows))
    piece = math.ceil(num_tokens / pieces)
    return Blocks(tokens, rows), Blocks(piece, piece * rows_per_token, pieces)


def exchange(
    on_device,
    chosen: jax.Array,
    ffn: ExpertFFN,
    local_experts: int,
    factor: float,
    token_axes: tuple[str, ...],
):
    """(`on_device(routed_fn)` through the usual blocks, or the worst-case ones where those would
    overflow; 1.0 if it needed the worst case in this call, else 0.0).

    on_device: (routed_fn: (tokens [N, D], chosen [N, k], weights [N, k]) -> (routed [N, D],
    dropped rows)) -> the device's whole result; chosen: [N, k] global expert ids; factor:
    `moe.exchange_factor`.
    """
    num_tokens, k = chosen.shape
    parts = jax.lax.axis_size(EXPERT_AXIS)
    usual, worst = padded_blocks(num_tokens, k, local_experts * parts, parts, factor)
    owned_by = _owned_by(chosen, local_experts)
    fits = _blocks_fit(owned_by, usual, token_axes)
    result = _branches(
        lambda blocks: on_device(_routed(blocks, owned_by.any(1), ffn, local_experts)),
        usual,
        worst,
        fits,
    )
    return result, 1.0 - fits.astype(jnp.float32)


def _branches(padded, usual: Blocks, worst: Blocks, fits: jax.Array):
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


def _routed(blocks: Blocks, visits: jax.Array, ffn: ExpertFFN, local_experts: int):
    """The routed experts' function of `exchange`'s `on_device`: `_round_trip` over the device's
    N tokens in `blocks.pieces` slices of `blocks.tokens`, one after another (a scan; the last
    slice padded with tokens that visit no device). Each slice is rematerialised, so that the
    backward keeps only the slices' inputs, not all pieces' activations at once. visits: [N, Ep]
    whether token t goes to device p."""
    round_trip = functools.partial(_round_trip, ffn=ffn, local_experts=local_experts, blocks=blocks)
    if blocks.pieces == 1:
        return functools.partial(round_trip, visits=visits)

    def run(x: jax.Array, chosen: jax.Array, weights: jax.Array):
        num_tokens = x.shape[0]

        def sliced(a: jax.Array) -> jax.Array:  # [N, ...] -> [pieces, tokens, ...], 0-padded
            padding = [(0, blocks.pieces * blocks.tokens - num_tokens)] + [(0, 0)] * (a.ndim - 1)
            return jnp.pad(a, padding).reshape(blocks.pieces, blocks.tokens, *a.shape[1:])

        def piece(dropped, inputs):
            out, piece_dropped = jax.checkpoint(round_trip)(*inputs)
            return dropped + piece_dropped, out

        dropped, out = jax.lax.scan(
            piece, jnp.zeros((), jnp.int32), tuple(map(sliced, (x, chosen, weights, visits)))
        )
        return out.reshape(-1, x.shape[1])[:num_tokens], dropped

    return run


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


def _round_trip(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    visits: jax.Array,
    *,
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
        pairs_ffn(received, rows, k, ffn, received_weights), k
    )  # [Ep·blocks.tokens, D]
    returned = exchange(partial_sums)
    per_visit = permute_rows(returned, visit_slot, slot_visit).reshape(num_tokens, parts, -1)
    return per_visit.sum(1, dtype=jnp.float32).astype(x.dtype), jnp.zeros((), jnp.int32)
