"""The block selection inverted: for every key block, the (query, slot) entries that chose it.

Sparse attention is computed key-block-major on GPUs (spec/msa.md §4 (b), MiniMax's own design):
the G query heads of the queries that chose a block fill the rows of one matmul against that
block's keys, so each key block is read once per chunk of `chunk_queries` queries instead of once
per query. This module builds the tables those kernels walk, in plain XLA (one sort):

- entries: every valid selection (b, i, h, j) — query i of row b chose, for kv head h, the block
  `block_indices[b, i, h, j]` of its document — sorted by the block it chose, identified by
  (b, h, slot of its first key); within a block, by query. Invalid selections (-1) sort last.
- segments: runs of at most `segment_chunks` chunks of `chunk_queries` consecutive entries of one
  block. A kernel program takes a segment, loads the block's keys once, and walks its chunks.

Per-entry kernel results live at the entry's sorted position; `by_selection` gathers them back to
the [B, S, K, k] selection layout, where the combine is a plain reduction over k, and
`selection_sums` sums them over each query's k selections.

Shapes: B batch, S keys per row, W queries per row in one call (a window of them), K kv heads,
k selected blocks per query, E = B·W·K·k entries (static: invalid ones included).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

INVALID = jnp.iinfo(jnp.int32).max  # sort key of unused selection slots: after every block


class BlockLists(NamedTuple):
    """Sorted selection entries and the segments that cover them (all int32)."""

    keys: jax.Array  # [E] block key (b·K + h)·2S + S + first key slot, sorted; INVALID last
    entries: jax.Array  # [E] flat selection index ((b·W + i)·K + h)·k + j of each sorted entry
    sorted_position: jax.Array  # [E] inverse of `entries`: where selection e went in the sort
    segment_starts: jax.Array  # [E] sorted position of each segment's first entry
    segment_entries: jax.Array  # [E] entries in each segment (1..segment_chunks·chunk_queries)
    num_segments: jax.Array  # [1]


def block_key_range(batch: int, seq: int, num_kv_heads: int) -> int:
    """Keys are below batch·K·2S; they must fit int32 (checked at trace time)."""
    span = batch * num_kv_heads * 2 * seq
    if span >= INVALID:
        raise ValueError(f"{batch=} × {num_kv_heads=} × 2·{seq=} does not fit int32 block keys")
    return span


def build(
    block_indices: jax.Array,
    positions: jax.Array,
    query_offset: jax.Array,
    *,
    seq: int,
    block_size: int,
    chunk_queries: int,
    segment_chunks: int,
) -> BlockLists:
    """The sorted tables of a window of W queries.

    block_indices: [B, W, K, k] document block ids (-1 = none); positions: [B, W]; query_offset:
    int32 scalar, the slot of the window's first query; seq: S, keys per row.
    """
    batch, window, num_kv_heads, topk = block_indices.shape
    block_key_range(batch, seq, num_kv_heads)
    document_start = query_offset + jnp.arange(window) - positions  # [B, W] first slot of the doc
    first_slot = document_start[:, :, None, None] + block_indices * block_size
    group = (jnp.arange(batch)[:, None, None, None] * num_kv_heads
             + jnp.arange(num_kv_heads)[None, None, :, None])  # fmt: skip
    keys = jnp.where(block_indices >= 0, group * 2 * seq + seq + first_slot, INVALID).reshape(-1)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)  # by block, then by query
    keys = keys[order]

    total = keys.shape[0]
    index = jnp.arange(total, dtype=jnp.int32)
    changes = keys[1:] != keys[:-1]
    starts_group = jnp.concatenate([jnp.ones(1, bool), changes])
    ends_group = jnp.concatenate([changes, jnp.ones(1, bool)])
    # each entry's block list spans [group_first, group_last]: two scans (a segment_sum of the
    # lists' sizes was an int32 scatter-add, 5.9 ms of a bench-h200 step on an H200)
    group_first = jax.lax.cummax(jnp.where(starts_group, index, 0))
    group_last = jax.lax.cummin(jnp.where(ends_group, index, total), reverse=True)
    rank = index - group_first  # position within the block's list
    starts_segment = (rank % (chunk_queries * segment_chunks) == 0) & (keys != INVALID)
    segment_id = jnp.where(starts_segment, jnp.cumsum(starts_segment) - 1, total)
    remaining = group_last + 1 - index
    entries = jnp.minimum(remaining, chunk_queries * segment_chunks).astype(jnp.int32)

    def per_segment(x):  # [E] per entry -> [E] at each segment's index (the rest 0)
        return jnp.zeros(total, jnp.int32).at[segment_id].set(x, mode="drop")

    return BlockLists(
        keys=keys,
        entries=order,
        sorted_position=jnp.zeros(total, jnp.int32).at[order].set(index),
        segment_starts=per_segment(index),
        segment_entries=per_segment(entries),
        num_segments=starts_segment.sum(dtype=jnp.int32)[None],
    )


def by_selection(per_entry: jax.Array, lists: BlockLists, shape: tuple[int, ...]) -> jax.Array:
    """[E, ...] values at sorted positions -> [B, W, K, k, ...] at their selection slots."""
    return per_entry[lists.sorted_position].reshape(*shape, *per_entry.shape[1:])


def by_valid_selection(per_entry: jax.Array, lists: BlockLists, valid: jax.Array,
                       fill) -> jax.Array:  # fmt: skip
    """`by_selection` at the shape of `valid` [B, W, K, k] (the selections that hold a block),
    `fill` where a selection holds none."""
    values = by_selection(per_entry, lists, valid.shape)
    return jnp.where(valid.reshape(*valid.shape, *[1] * (values.ndim - 4)), values, fill)


def selection_sums(shares: jax.Array, rows: jax.Array, valid: jax.Array) -> jax.Array:
    """Σ over parts and over each query's k selections of `shares` [parts, R, ...] at `rows`
    [B, W, K, k] (the row of each selection; invalid selections add 0) -> [B, W, K, ...] fp32.

    One gather per (part, selection slot), added up: XLA fuses them into one pass whose loads
    are independent. A gather of [B, W, K, k, ...] reduced over k made a loop of dependent loads
    per output element: d(index_q)'s sum at 128K ran 4.5x slower on the H100
    (benchmarks/RESULTS.md, 2026-12-07)."""
    rows = jnp.where(valid, rows, shares.shape[1])  # past the end: filled with 0
    total = jnp.float32(0.0)
    for part in shares:
        for slot_rows in jnp.moveaxis(rows, -1, 0):
            total = total + part.at[slot_rows].get(mode="fill", fill_value=0).astype(jnp.float32)
    return total
