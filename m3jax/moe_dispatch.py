"""Routed experts on one device: how the k chosen experts of each token compute its output.

Three modes (`model.moe.dispatch`), equal wherever capacity drops nothing:
- dense: every expert computes every token, weight 0 where not chosen. Exact, E/k times the work;
  the reference the others are tested against.
- dropless: the N·k (token, expert) pairs become rows, stably sorted by expert (so each expert's
  rows are contiguous and in token order) and multiplied by a grouped matmul
  (`pallas_kernels/moe`: XLA's ragged_dot, or on GPUs a Pallas Mosaic GPU kernel over a
  tile-aligned copy of the rows, `moe.grouped_matmul`). Exact, and only the chosen work.
- capacity: the same sorted rows, but each expert takes at most C = ⌈capacity_factor · N·k / E⌉ of
  them, earliest tokens first, into fixed [E, C, D] buffers that one batched einsum multiplies.
  Rows past C are dropped (their expert's contribution is 0) and counted.

Padding tokens are routed like real ones (packed rows have almost none), so all modes give the
same output at every position. m3jax/expert_parallel.py reuses these pieces on each device.

Shapes: N tokens, k experts per token, R = N·k rows, D model width, F expert width, E experts,
C capacity (rows per expert).
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.moe import mosaic_gpu
from pallas_kernels.moe.reference import grouped_matmul
from pallas_kernels.moe.tiles import from_tiles, permute_rows, tile_layout, to_tiles

Activation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden, elementwise


class ExpertWeights(NamedTuple):
    gate: jax.Array  # [E, D, F]
    up: jax.Array  # [E, D, F]
    down: jax.Array  # [E, F, D]


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
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[expert_ids].add(1)
    return SortedRows(order, inverse, expert_ids[order], group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gather_sorted(x: jax.Array, rows: SortedRows, k: int) -> jax.Array:
    """[N, D] tokens -> [R, D]: sorted row i is token order[i] // k.

    Autodiff would scatter-add the R row gradients into N tokens; gathering them back into
    (token, choice) order and summing the k choices is the same sum, several times faster on GPUs.
    """
    return x[rows.order // k]


def _gather_sorted_forward(x, rows, k):
    return gather_sorted(x, rows, k), rows


def _gather_sorted_backward(k, rows, cotangent):
    per_choice = cotangent[rows.inverse].reshape(-1, k, cotangent.shape[-1])
    return per_choice.sum(1, dtype=jnp.float32).astype(cotangent.dtype), None


gather_sorted.defvjp(_gather_sorted_forward, _gather_sorted_backward)


def grouped_matmul_impl(requested: str, dtype, dim: int, expert_dim: int) -> str:
    """`moe.grouped_matmul` made concrete: "auto" is the Mosaic GPU kernel where it applies."""
    reason = mosaic_gpu.unsupported_reason(dtype, dim, expert_dim)
    if requested == "auto":
        return "mosaic_gpu" if jax.default_backend() == "gpu" and not reason else "xla"
    if requested == "mosaic_gpu" and reason:
        raise ValueError(f"moe.grouped_matmul='mosaic_gpu' can't run this layer: {reason}")
    return requested


def grouped_ffn(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    experts: ExpertWeights,
    activation: Activation,
    impl: str = "xla",
) -> jax.Array:
    """[R, D] rows sorted by expert -> each row through its expert's FFN, [R, D].

    impl "mosaic_gpu" first spreads the rows so that each expert starts on a kernel tile
    (pallas_kernels/moe/tiles.py) and gathers them back at the end.
    """
    if impl == "mosaic_gpu":
        layout = tile_layout(group_sizes, x_sorted.shape[0], mosaic_gpu.BLOCK_M)
        rows = to_tiles(x_sorted, layout)
        matmul = lambda a, w: mosaic_gpu.tiled_matmul(a, w, layout)
    else:
        rows = x_sorted
        matmul = lambda a, w: grouped_matmul(a, w, group_sizes)
    y = matmul(activation(matmul(rows, experts.gate), matmul(rows, experts.up)), experts.down)
    return from_tiles(y, layout) if impl == "mosaic_gpu" else y


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


def combine(y_sorted: jax.Array, rows: SortedRows, weights: jax.Array) -> jax.Array:
    """[R, D] expert outputs in sorted order, weights [N, k] -> Σ_choices weight · output, [N, D]."""
    num_tokens, k = weights.shape
    y = permute_rows(y_sorted, rows.inverse, rows.order)  # back to (token, choice) order
    y = y.reshape(num_tokens, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


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
    signatures wrap an exchange between devices around the local experts (expert_parallel.py).
    """

    grouped: Callable[[jax.Array, jax.Array], jax.Array]  # ([R, D] sorted, [E] sizes) -> [R, D]
    batched: Callable[[jax.Array], jax.Array]  # [E, C, D] -> [E, C, D]


def local_ffn(experts: ExpertWeights, activation: Activation, impl: str = "xla") -> ExpertFFN:
    """All E experts on this device; impl: the grouped matmul's (`grouped_matmul_impl`)."""
    return ExpertFFN(
        grouped=lambda x_sorted, sizes: grouped_ffn(x_sorted, sizes, experts, activation, impl),
        batched=lambda buffers: batched_ffn(buffers, experts, activation),
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
    rows = sort_rows(chosen, num_experts)
    x_sorted = gather_sorted(x, rows, k)
    if dispatch == "dropless":
        y_sorted = ffn.grouped(x_sorted, rows.group_sizes)
        dropped = jnp.zeros((), jnp.int32)
    elif dispatch == "capacity":
        size = capacity(num_tokens, k, num_experts, capacity_factor)
        y_buffers = ffn.batched(to_buffers(x_sorted, rows.group_sizes, size))
        y_sorted, kept = from_buffers(y_buffers, rows, size)
        dropped = num_tokens * k - kept.sum(dtype=jnp.int32)
    else:
        raise ValueError(f"{dispatch=} is not 'dropless' or 'capacity'")
    return combine(y_sorted, rows, weights), dropped
