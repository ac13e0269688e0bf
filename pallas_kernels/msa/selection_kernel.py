"""MSA block selection on GPUs in one Pallas kernel (Triton lowering): the lightning indexer's
scores, the max over each document block, local forcing and the top-k, streamed over key tiles.

A program takes R = rows (query, index head) pairs — `rows // Hi` consecutive queries with all
their index heads, which share the one index key head — and walks the key tiles of `block_size`
slots from its earliest document's start to its last query. Per tile: scores = index_q · index_kᵀ
[R, block] on the tensor cores, masked to each row's visible keys. Document blocks are counted
from each document's first slot d, so a fixed tile holds the tail of one document block and the
head of the next; each row keeps the running max of the block still open (`pending`) and hands a
block to its top-k when the block ends. The top-k is a running set of `topk` (score, block) pairs
in registers: a finished block replaces the set's worst member if it scores strictly higher;
blocks arrive in increasing order and the worst is taken among ties by the highest id, so ties go
to the lower block id, as `jax.lax.top_k` breaks them. Nothing of size [S, S] or [S, S / block]
reaches memory: the output is [B, S, Hi, k] int32.

The queries are runs of consecutive slots of the key row (`run_starts`; one run from slot 0
without query slots): a row's slot is its run's start plus its place in the run, so a
context-parallel device's two chunks are one call (reference.py's `query_slots`).

Shapes: B batch, S queries, T keys (= S without query slots), Hi index heads, Di index head dim,
R rows of a program.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

UNSET = 1 << 30  # ids of the top-k's initial (-inf) members; all distinct, all above real ids
PADDING = -2  # ids of columns past k that pad the set to a power of two (scores +inf)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch parameters (the defaults were chosen on the H200, benchmarks/bench_msa.py)."""

    rows: int = 128  # (query, index head) rows per program
    num_warps: int = 8
    num_stages: int = 3


def _insert(scores, ids, candidate, block, forced):
    """Offer one finished block per row to the running top-k ([R, width] scores and ids)."""
    candidate = jnp.where(forced & (candidate > -jnp.inf), jnp.inf, candidate)
    worst = scores.min(axis=1)
    worst_id = jnp.where(scores == worst[:, None], ids, -1).max(axis=1)
    replace = (candidate > worst)[:, None] & (ids == worst_id[:, None])
    return (
        jnp.where(replace, candidate[:, None], scores),
        jnp.where(replace, block[:, None], ids),
    )


def top_blocks(
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    run_starts: jax.Array | None = None,
    tiling: Tiling = Tiling(),
    interpret: bool = False,
) -> jax.Array:
    """Same result as `reference.top_blocks`: [B, S, Hi, min(k, ceil(T / block))]. run_starts:
    [R] int32, the key-row slot of the first query of each of R runs of S / R consecutive queries
    (None: one run from slot 0, S = T); segment_ids and positions are the key row's [B, T]."""
    batch, num_queries, num_heads, index_dim = index_q.shape
    seq = index_k.shape[1]
    if run_starts is None:
        run_starts = jnp.zeros(1, jnp.int32)
    run_length = num_queries // run_starts.shape[0]
    num_blocks = -(-seq // block_size)
    topk = min(topk_blocks, num_blocks)
    width = pl.next_power_of_2(topk)
    if tiling.rows % num_heads:
        raise ValueError(f"Tiling.rows={tiling.rows} is not a multiple of {num_heads=} index heads")
    queries = tiling.rows // num_heads
    num_tiles = -(-num_queries // queries)

    def kernel(starts_ref, iq_ref, ik_ref, seg_ref, pos_ref, out_ref):
        tile, b = num_tiles - 1 - pl.program_id(0), pl.program_id(1)  # longest tiles first
        row = jnp.arange(tiling.rows)
        local = tile * queries + row // num_heads  # the query's place among the S
        inside = local < num_queries
        local = jnp.minimum(local, num_queries - 1)
        query = starts_ref[local // run_length] + local % run_length  # its slot in the key row
        slot_row = b * seq + jnp.minimum(query, seq - 1)
        q_rows = (b * num_queries + local) * num_heads + row % num_heads
        index_queries = plt.load(
            iq_ref.at[q_rows[:, None], jnp.arange(index_dim)[None, :]],
            mask=inside[:, None], other=0.0,
        )  # fmt: skip
        segment = seg_ref[slot_row]
        position = pos_ref[slot_row]
        start = query - position  # slot of the row's document's first token
        own = position // block_size
        first_forced = jnp.maximum(own - local_blocks + 1, 0)
        first_tile = jnp.maximum(jnp.where(inside, start, seq).min(), 0) // block_size
        last_tile = jnp.where(inside, query, 0).max() // block_size
        column = jnp.arange(width)[None, :]
        scores = jnp.where(column < topk, -jnp.inf, jnp.inf) + jnp.zeros((tiling.rows, 1))
        ids = jnp.where(column < topk, UNSET + column, PADDING) + jnp.zeros((tiling.rows, 1), int)

        def first_block(tile):  # document block of each row that holds the tile's first slot
            return (tile * block_size - start) // block_size

        def offer(scores, ids, candidate, block):
            forced = (block >= first_forced) & (block <= own)
            return _insert(scores, ids, candidate, block, forced)

        def index_logits(tile):  # [R, block] fp32 scores against the tile's keys
            slot = tile * block_size + jnp.arange(block_size)
            key_row = b * seq + jnp.minimum(slot, seq - 1)
            index_keys = plt.load(
                ik_ref.at[key_row[:, None], jnp.arange(index_dim)[None, :]],
                mask=(slot < seq)[:, None], other=0.0,
            )  # fmt: skip
            logits = jax.lax.dot_general(
                index_queries, index_keys, (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return slot, key_row, logits

        def tile_body(tile, carry):  # any tile: every mask applies
            scores, ids, pending = carry
            slot, key_row, logits = index_logits(tile)
            visible = (
                inside[:, None]
                & (slot < seq)[None, :]
                & (slot[None, :] <= query[:, None])
                & (seg_ref[key_row][None, :] == segment[:, None])
            )
            block = first_block(tile)
            head = slot[None, :] < (start + (block + 1) * block_size)[:, None]
            closing = jnp.where(visible & head, logits, -jnp.inf).max(axis=1)
            opening = jnp.where(visible & ~head, logits, -jnp.inf).max(axis=1)
            scores, ids = offer(scores, ids, jnp.maximum(pending, closing), block)
            return scores, ids, opening

        def aligned_body(tile, carry):  # inside one document that starts on a tile boundary
            scores, ids, pending = carry
            _, _, logits = index_logits(tile)
            scores, ids = offer(scores, ids, logits.max(axis=1), first_block(tile))
            return scores, ids, pending

        def unaligned_body(split, tile, carry):  # inside one document; columns < split close
            scores, ids, pending = carry  # the block the previous tile opened
            _, _, logits = index_logits(tile)
            head = jnp.arange(block_size)[None, :] < split
            closing = jnp.where(head, logits, -jnp.inf).max(axis=1)
            opening = jnp.where(head, -jnp.inf, logits).max(axis=1)
            scores, ids = offer(scores, ids, jnp.maximum(pending, closing), first_block(tile))
            return scores, ids, opening

        # Tiles that lie inside the one document of all rows and before the first query need no
        # mask: [interior_start, interior_end). The rest take every mask.
        doc_start = jnp.where(inside, start, seq).min()
        one_document = doc_start == jnp.where(inside, start, -1).max()
        first_query = jnp.where(inside, query, seq).min()
        interior_start = jnp.maximum(-(-doc_start // block_size), first_tile)
        interior_end = jnp.maximum((first_query + 1) // block_size, interior_start)
        interior_start = jnp.where(one_document, interior_start, first_tile)
        interior_end = jnp.where(one_document, interior_end, first_tile)
        residue = doc_start % block_size
        carry = (scores, ids, jnp.full((tiling.rows,), -jnp.inf, jnp.float32))
        carry = jax.lax.fori_loop(first_tile, interior_start, tile_body, carry)
        carry = jax.lax.cond(
            residue == 0,
            lambda c: jax.lax.fori_loop(interior_start, interior_end, aligned_body, c),
            lambda c: jax.lax.fori_loop(interior_start, interior_end,
                                        functools.partial(unaligned_body, residue), c),
            carry,
        )  # fmt: skip
        scores, ids, pending = jax.lax.fori_loop(interior_end, last_tile + 1, tile_body, carry)
        scores, ids = offer(scores, ids, pending, first_block(last_tile) + 1)
        chosen = jnp.where(scores == -jnp.inf, -1, ids)
        # rows past the sequence get distinct targets past the end (Pallas' interpreter writes
        # masked rows back, so they must not alias kept ones)
        targets = jnp.where(inside, q_rows, batch * num_queries * num_heads + row)
        plt.store(
            out_ref.at[targets[:, None], column], chosen, mask=inside[:, None] & (column < topk)
        )

    out = pl.pallas_call(
        kernel,
        name="msa_select",
        out_shape=jax.ShapeDtypeStruct((batch * num_queries * num_heads, topk), jnp.int32),
        grid=(num_tiles, batch),
        compiler_params=plt.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
    )(
        run_starts.astype(jnp.int32),
        jax.lax.stop_gradient(index_q).reshape(-1, index_dim),
        jax.lax.stop_gradient(index_k).reshape(-1, index_dim),
        segment_ids.reshape(-1).astype(jnp.int32),
        positions.reshape(-1).astype(jnp.int32),
    )
    return out.reshape(batch, num_queries, num_heads, topk)
