"""Routed experts on one device: how the k chosen experts of each token compute its output.

Three modes (`model.moe.dispatch`), equal wherever capacity drops nothing:
- dense: every expert computes every token, weight 0 where not chosen. Exact, E/k times the work;
  the reference the others are tested against.
- dropless: the N·k (token, expert) pairs become rows, stably sorted by expert (so each expert's
  rows are contiguous and in token order) and multiplied by a grouped matmul
  (`pallas_kernels/moe`: XLA's ragged_dot, on GPUs a Pallas Mosaic GPU kernel over a
  tile-aligned copy of the rows, on TPUs jax's megablox kernel; `moe.grouped_matmul`). Exact, and
  only the chosen work.
- capacity: the same sorted rows, but each expert takes at most C = ⌈capacity_factor · N·k / E⌉ of
  them, earliest tokens first, into fixed [E, C, D] buffers that one batched einsum multiplies.
  Rows past C are dropped (their expert's contribution is 0) and counted.

Padding tokens are routed like real ones (packed rows have almost none), so all modes give the
same output at every position. expert_parallel.py reuses these pieces on each device.

Shapes: N tokens, k experts per token, R = N·k rows, D model width, F expert width, E experts,
C capacity (rows per expert).
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import target
from pallas_kernels.moe import megablox, mosaic_gpu
from pallas_kernels.moe.reference import grouped_matmul
from pallas_kernels.moe.tiles import (
    from_tiles,
    inverse_permutation,
    permute_rows,
    reorder,
    tile_layout,
    to_tiles,
)

Activation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden, elementwise


KERNELS = {"mosaic_gpu": mosaic_gpu, "megablox": megablox}  # moe.grouped_matmul -> its module
# the routed experts' gate and up products by name, for the remat policies that keep them
# (`model.remat: save_attention_dots_experts`, m3jax/stacking.py)
EXPERT_PROJECTIONS = "moe_gate_up"


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [E, D, F]
    up: jax.Array  # [E, D, F]
    down: jax.Array  # [E, F, D]


# Logical axes of the routed experts' weights (layer.py), also how they enter the expert-parallel map
EXPERT_WEIGHT_AXES = ExpertWeights(
    ("expert", "embed", "mlp"), ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
)


class RowOrder(NamedTuple):
    """A permutation of rows into expert order, both ways (inverse partial permutations)."""

    source: jax.Array  # [R] int32: sorted position i holds row source[i]
    position: jax.Array  # [R] int32: row r sits at sorted position position[r]


class SortedRows(NamedTuple):
    """The N·k (token, choice) rows in expert order."""

    order: jax.Array  # [R] int32: sorted position i holds row order[i] (= token · k + choice)
    inverse: jax.Array  # [R] int32: row token · k + choice sits at sorted position inverse[·]
    expert_ids: jax.Array  # [R] int32 expert of each sorted row, ascending
    group_sizes: jax.Array  # [E] int32 rows per expert


def capacity(num_tokens: int, experts_per_token: int, num_experts: int, factor: float) -> int:
    """C = ⌈factor · N·k / E⌉ rows per expert, at least 1 and at most N (one row per token)."""
    wanted = math.ceil(factor * num_tokens * experts_per_token / num_experts)
    return max(1, min(num_tokens, wanted))


def sort_rows(chosen: jax.Array, num_experts: int) -> SortedRows:
    """chosen: [N, k] expert ids -> rows stably sorted by expert (token order within an expert)."""
    expert_ids = chosen.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(expert_ids, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[expert_ids].add(1)
    return SortedRows(order, inverse_permutation(order), expert_ids[order], group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def expand_tokens(x: jax.Array, pairs: jax.Array, slots: jax.Array, k: int) -> jax.Array:
    """[N, D] tokens -> rows: row j is token pairs[j] // k, 0 where pairs[j] = N·k (a gap).

    pairs [rows]: the (token · k + choice) pair each row holds; slots [N·k]: the row of each pair
    (the inverse map). Autodiff would scatter-add the row gradients into N tokens; gathering them
    back into pair order and summing the k choices is the same sum, several times faster on GPUs.
    """
    return x.at[pairs // k].get(mode="fill", fill_value=0)


def _expand_tokens_forward(x, pairs, slots, k):
    return expand_tokens(x, pairs, slots, k), slots


def _expand_tokens_backward(k, slots, cotangent):
    per_pair = cotangent.at[slots].get(mode="fill", fill_value=0)
    per_pair = per_pair.reshape(-1, k, cotangent.shape[-1]).sum(1, dtype=jnp.float32)
    return per_pair.astype(cotangent.dtype), None, None


expand_tokens.defvjp(_expand_tokens_forward, _expand_tokens_backward)


def grouped_matmul_impl(requested: str, dtype, dim: int, expert_dim: int) -> str:
    """`moe.grouped_matmul` made concrete: "auto" is the Mosaic GPU kernel on GPUs and megablox
    on TPUs, where they apply."""
    kernel = {"gpu": "mosaic_gpu", "tpu": "megablox"}.get(target.platform())
    if requested == "auto":
        requested = kernel or "xla"
        if kernel and KERNELS[kernel].unsupported_reason(dtype, dim, expert_dim):
            return "xla"
    reason = requested in KERNELS and KERNELS[requested].unsupported_reason(dtype, dim, expert_dim)
    if reason:
        raise ValueError(f"moe.grouped_matmul={requested!r} can't run this layer: {reason}")
    return requested


def grouped_ffn(
    x: jax.Array,
    group_sizes: jax.Array,
    experts: ExpertWeights,
    activation: Activation,
    impl: str = "xla",
    order: RowOrder | None = None,
) -> jax.Array:
    """[R, D] rows -> each row through its expert's FFN, [R, D] in the same row order.

    The rows are sorted by expert, or become so in `order` (then the result is still in x's
    order). impl "mosaic_gpu" gathers the rows straight into a layout where each expert starts on a
    kernel tile (pallas_kernels/moe/tiles.py) and straight back at the end: one gather each way,
    whether or not `order` is given.
    """
    if impl == "mosaic_gpu":
        layout = tile_layout(group_sizes, x.shape[0], mosaic_gpu.BLOCK_M)
        if order is not None:
            layout = reorder(layout, order.source, order.position)
        return from_tiles(_tiled_ffn(to_tiles(x, layout), layout, experts, activation), layout)
    if order is not None:
        x = permute_rows(x, order.source, order.position)
    product = megablox.grouped_matmul if impl == "megablox" else grouped_matmul
    matmul = functools.partial(product, group_sizes=group_sizes)
    y = matmul(activation(*_gate_up(matmul, x, experts)), experts.down)
    return y if order is None else permute_rows(y, order.position, order.source)


def _tiled_ffn(
    x_tiles, layout, experts: ExpertWeights, activation: Activation, row_weights=None
) -> jax.Array:
    """The experts' FFN on tile-aligned rows through the Mosaic GPU kernels; `row_weights` [rows]
    scale each row's hidden state before the down projection.

    The activation is rematerialised in backward: its residuals are then its two inputs. Saved
    as is, its derivative's terms (9 arrays of [rows, F] for the clamped SwiGLU) are written out
    wherever XLA can't fuse them into the backward, as inside the padded exchange's `lax.cond`.
    """
    matmul = functools.partial(mosaic_gpu.tiled_matmul, layout=layout)
    hidden = jax.checkpoint(activation)(*_gate_up(matmul, x_tiles, experts))
    if row_weights is not None:
        hidden = (hidden * row_weights[:, None]).astype(hidden.dtype)
    return matmul(hidden, experts.down)


def _gate_up(matmul, x, experts: ExpertWeights) -> tuple[jax.Array, jax.Array]:
    """The experts' gate and up products of rows x, named `EXPERT_PROJECTIONS`."""
    return tuple(checkpoint_name(matmul(x, w), EXPERT_PROJECTIONS)
                 for w in (experts.gate, experts.up))  # fmt: skip


def tiled_pairs_ffn(
    x: jax.Array,
    rows: SortedRows,
    k: int,
    weights: jax.Array,
    experts: ExpertWeights,
    activation: Activation,
) -> jax.Array:
    """[N, D] tokens, routing weights [N, k] -> [N·k, D] weighted expert outputs in (token,
    choice) order, through the kernels.

    Tokens go straight into the tile layout and results straight back to pair order: one gather
    each way instead of two (sorted order is never materialised). A row's routing weight scales
    its hidden state, before the down projection (the same product as scaling its output): the
    weight's gradient is then ⟨d(hidden), hidden⟩ from what the backward computes anyway, where
    scaling the output needs the output in the backward, which a rematerialised layer gets by
    running the down projection again (one of the nine grouped matmuls of a layer's step).
    """
    layout = tile_layout(rows.group_sizes, rows.order.shape[0], mosaic_gpu.BLOCK_M)
    layout = reorder(layout, rows.order, rows.inverse)  # tiles <-> (token, choice) pairs
    x_tiles = expand_tokens(x, layout.source, layout.destination, k)
    row_weights = weights.reshape(-1).at[layout.source].get(mode="fill", fill_value=0)
    return from_tiles(_tiled_ffn(x_tiles, layout, experts, activation, row_weights), layout)


def batched_ffn(buffers: jax.Array, experts: ExpertWeights, activation: Activation) -> jax.Array:
    """[E, C, D] capacity buffers -> [E, C, D]: buffer e through expert e's FFN."""
    gate = jnp.einsum("ecd,edf->ecf", buffers, experts.gate)
    up = jnp.einsum("ecd,edf->ecf", buffers, experts.up)
    return jnp.einsum("ecf,efd->ecd", activation(gate, up), experts.down)


def to_buffers(x_sorted: jax.Array, group_sizes: jax.Array, capacity: int) -> jax.Array:
    """[R, D] sorted rows -> [E, C, D]: expert e's first C rows, zero-padded."""
    starts = jnp.cumsum(group_sizes) - group_sizes  # [E]
    slot = jnp.arange(capacity)
    filled = slot[None, :] < group_sizes[:, None]  # [E, C]
    source = jnp.where(filled, starts[:, None] + slot[None, :], 0)
    return jnp.where(filled[..., None], x_sorted[source], 0).astype(x_sorted.dtype)


def from_buffers(
    y_buffers: jax.Array, rows: SortedRows, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """[E, C, D] outputs -> ([R, D] per sorted row, 0 where dropped; [R] bool kept)."""
    starts = jnp.cumsum(rows.group_sizes) - rows.group_sizes
    position = jnp.arange(rows.expert_ids.shape[0]) - starts[rows.expert_ids]  # within its expert
    kept = position < capacity
    y = y_buffers[rows.expert_ids, jnp.minimum(position, capacity - 1)]
    return jnp.where(kept[:, None], y, 0).astype(y_buffers.dtype), kept


def weighted(y_pairs: jax.Array, weights: jax.Array) -> jax.Array:
    """[N·k, D] expert outputs in (token, choice) order times their routing weights [N, k]."""
    scaled = y_pairs.astype(jnp.float32) * weights.reshape(-1, 1)
    return scaled.astype(y_pairs.dtype)


def combine(weighted_pairs: jax.Array, k: int) -> jax.Array:
    """[N·k, D] weighted expert outputs in (token, choice) order -> their sum over each token's
    k choices [N, D] (an fp32 sum, in the outputs' dtype)."""
    per_token = weighted_pairs.reshape(-1, k, weighted_pairs.shape[-1])
    return per_token.sum(1, dtype=jnp.float32).astype(weighted_pairs.dtype)


def dense_experts(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    experts: ExpertWeights,
    activation: Activation,
) -> jax.Array:
    """The reference: every expert on every token, combined with zeros where not chosen. [N, D]."""
    num_tokens, num_experts = x.shape[0], experts.gate.shape[0]
    combine_weights = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine_weights = combine_weights.at[jnp.arange(num_tokens)[:, None], chosen].set(weights)
    gate = jnp.einsum("nd,edf->enf", x, experts.gate)
    up = jnp.einsum("nd,edf->enf", x, experts.up)
    expert_out = jnp.einsum("enf,efd->end", activation(gate, up), experts.down)
    return jnp.einsum("end,ne->nd", expert_out, combine_weights.astype(x.dtype))


class ExpertFFN(NamedTuple):
    """How the experts run: on sorted rows (dropless) and on capacity buffers (capacity).

    On one device these are `grouped_ffn` and `batched_ffn`; under expert parallelism the same
    signatures wrap an exchange between devices around the local experts (ragged.py, capacity.py).
    """

    # ([R, D] rows, [E] sizes, their order into expert order or None if sorted) -> [R, D]
    grouped: Callable[[jax.Array, jax.Array, RowOrder | None], jax.Array]
    batched: Callable[[jax.Array], jax.Array]  # [E, C, D] -> [E, C, D]
    # dropless straight from tokens: ([N, D], rows, k, weights [N, k]) -> [N·k, D] weighted, in
    # (token, choice) order; None: through `grouped` on sorted rows (`pairs_ffn`).
    pairs: Callable[[jax.Array, SortedRows, int, jax.Array], jax.Array] | None = None


def local_ffn(experts: ExpertWeights, activation: Activation, impl: str = "xla") -> ExpertFFN:
    """All E experts on this device; impl: the grouped matmul's (`grouped_matmul_impl`)."""
    return ExpertFFN(
        grouped=lambda x, sizes, order=None: grouped_ffn(
            x, sizes, experts, activation, impl, order
        ),
        batched=lambda buffers: batched_ffn(buffers, experts, activation),
        pairs=(
            functools.partial(tiled_pairs_ffn, experts=experts, activation=activation)
            if impl == "mosaic_gpu"
            else None
        ),
    )


def sorted_experts(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    num_experts: int,
    ffn: ExpertFFN,
    *,
    dispatch: str,
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """The dropless or capacity mode.

    Args:
      x: [N, D] tokens; chosen: [N, k] int expert ids; weights: [N, k] fp32 routing weights.
      num_experts: E, the number of experts the ids refer to.
      ffn: how the experts run (`local_ffn`, or across devices).
    Returns:
      routed output [N, D] (before routed_scaling) and the number of dropped rows (int32 scalar).
    """
    num_tokens, k = chosen.shape
    if dispatch not in ("dropless", "capacity"):
        raise ValueError(f"{dispatch=} is not 'dropless' or 'capacity'")
    rows = sort_rows(chosen, num_experts)
    if dispatch == "dropless":
        return combine(pairs_ffn(x, rows, k, ffn, weights), k), jnp.zeros((), jnp.int32)
    x_sorted = expand_tokens(x, rows.order, rows.inverse, k)  # sorted row i: token order[i] // k
    size = capacity(num_tokens, k, num_experts, capacity_factor)
    y_buffers = ffn.batched(to_buffers(x_sorted, rows.group_sizes, size))
    y_sorted, kept = from_buffers(y_buffers, rows, size)
    y_pairs = permute_rows(y_sorted, rows.inverse, rows.order)  # back to (token, choice) order
    return combine(weighted(y_pairs, weights), k), num_tokens * k - kept.sum(dtype=jnp.int32)


def pairs_ffn(
    x: jax.Array, rows: SortedRows, k: int, ffn: ExpertFFN, weights: jax.Array
) -> jax.Array:
    """[N, D] tokens, routing weights [N, k] -> [N·k, D]: each (token, choice) pair through its
    expert times its weight, in pair order.

    `rows` may hold fewer sorted rows than pairs (the first ones, `group_sizes` covering only
    them): pairs whose sorted place lies past them come out zero.
    """
    if ffn.pairs is not None:
        return ffn.pairs(x, rows, k, weights)
    x_sorted = expand_tokens(x, rows.order, rows.inverse, k)  # sorted row i: token order[i] // k
    y_sorted = ffn.grouped(x_sorted, rows.group_sizes)
    y_pairs = permute_rows(y_sorted, rows.inverse, rows.order)  # back to (token, choice) order
    return weighted(y_pairs, weights)
