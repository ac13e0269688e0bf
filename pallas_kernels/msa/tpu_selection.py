"""MSA block selection on TPUs in one Mosaic TPU Pallas kernel: the indexer's scores, the max over
each document block, local forcing and the top-k, streamed over key tiles (`reference.top_blocks`).

Rows on lanes: a program holds R = Tq·Hi (query, index head) rows — Tq consecutive queries with
all their index heads, query-major as index_q lies in memory — and walks key tiles of n blocks
(n·block_size slots), from its earliest document's start to its last query. Per fixed block of
`block_size` slots, scoresᵀ = index_k · index_qᵀ [block, R] on the MXU (fp32), so the block max
is a reduction over sublanes that lands lane-dense [1, R]. Document blocks count from each
document's first slot d = a·block + r, so fixed block c holds the tail of document block c-a-1
(its first r slots) and the head of c-a: each row keeps the max of the block still open
(`pending`) and offers a block to its top-k when it ends. The running top-k is [k8, R] scores and
ids in VMEM (k rounded up to 8 sublanes, the extra members +inf so never the worst): a finished
block replaces the worst member if it scores strictly higher; blocks arrive in increasing order
and the worst is taken among ties by the highest id, so ties go to the lower block id, as
`jax.lax.top_k` breaks them. The last key tile ranks the set as `top_k` does (score, then id) and
writes it. Nothing of size [S, S] or [S, S / block] reaches HBM: the output is [B, S, Hi, k].

Tables in scalar prefetch (SMEM), per (row b, query tile t): the first key tile (the earliest
document start of the tile's queries), the last (its latest query's, the same for every row),
where the mask-free key tiles begin and its first query's slot — tiles inside the one document
of all the tile's queries and before its first query need no visibility mask. Key tiles are
fetched by `index_map`s that clamp to [first, last], so skipped grid steps copy nothing.

Query slots (reference.py): each query's slot comes from them (the per-row metadata and the
tables), so a context-parallel device's chunks select against the whole row of keys.

Shapes: B batch, S queries, T keys (= S without query slots), Hi index heads, Di index head dim,
Tq queries per tile, R = Tq·Hi rows, n key blocks per tile, k selected blocks, k8 = k rounded up
to 8.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.reference import at_query_slots

NO_SEGMENT = jnp.iinfo(jnp.int32).min  # padded key slots: in no document
UNSET = 1 << 30  # ids of the top-k's initial (-inf) members: distinct, above every block id
PADDING = -2  # ids of the members past k (scores +inf)
NEVER = jnp.iinfo(jnp.int32).max  # no mask-free key tiles (the tile's queries span documents)
# Rows of the per-row metadata operand [B, 8, S·Hi] (8: one sublane tile).
SLOT, SEGMENT, SHIFT, RESIDUE, OWN, FIRST_FORCED = range(6)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tile sizes (unmeasured: no TPU here). 256 queries × 4 index heads fill 1024 lanes; 4 key
    blocks of 128 a grid step keep the step overhead under the work of 4 MXU passes."""

    queries: int = 256  # Tq
    key_blocks: int = 4  # n

    def __post_init__(self):
        if self.queries < 1 or self.key_blocks < 1:
            raise ValueError(f"{self.queries=} and {self.key_blocks=} must be positive")


@dataclasses.dataclass(frozen=True)
class Geometry:
    batch: int
    seq: int  # S queries
    keys: int  # T
    heads: int  # Hi
    block_size: int
    topk: int  # k
    local_blocks: int
    queries: int  # Tq
    key_blocks: int  # n

    @classmethod
    def of(
        cls, index_q_shape: tuple[int, ...], keys: int, block_size: int, topk_blocks: int,
        local_blocks: int, tiling: Tiling,
    ) -> "Geometry":  # fmt: skip
        """The geometry of index_q [B, S, Hi, Di] against T = `keys` keys under `tiling`, tiles
        no longer than S and T."""
        batch, seq, heads, _ = index_q_shape
        num_blocks = -(-keys // block_size)
        return cls(batch, seq, keys, heads, block_size, min(topk_blocks, num_blocks),
                   local_blocks, min(tiling.queries, seq),
                   min(tiling.key_blocks, num_blocks))  # fmt: skip

    @property
    def rows(self):  # R
        return self.queries * self.heads

    @property
    def width(self):  # k8
        return -(-self.topk // 8) * 8

    @property
    def key_tile(self):
        return self.key_blocks * self.block_size

    @property
    def query_tiles(self):
        return -(-self.seq // self.queries)

    @property
    def key_tiles(self):
        return -(-self.keys // self.key_tile)


def unsupported_reason(index_q: jax.Array, *, block_size: int, tiling: Tiling = Tiling()) -> str:
    """Why the compiled kernel can't take these operands ('' when it can); the interpreters take
    any. Blocks of whole sublane tiles (8 keys in fp32, 16 in bf16), lane-dense rows (R a
    multiple of 128) unless one tile holds every query."""
    geo = Geometry.of(index_q.shape, index_q.shape[1], block_size, 1, 1, tiling)
    sublanes = 8 * 4 // max(1, jnp.dtype(index_q.dtype).itemsize)
    if block_size % sublanes:
        return f"selection: {block_size=} is not a multiple of {sublanes} ({index_q.dtype} keys)"
    if geo.rows % 128 and geo.query_tiles > 1:
        return f"selection: {geo.queries} queries × {geo.heads} index heads: not 128-lane rows"
    return ""


def _tables(geo, segment_ids, positions, query_slots):
    """Scalar prefetch (first key tile [B·tiles], last [tiles], first mask-free key slot
    [B·tiles], first query's slot [tiles]) and the per-row metadata [B, 8, tiles·R] int32."""
    index = jnp.arange(geo.query_tiles * geo.queries, dtype=jnp.int32)
    real = index < geo.seq
    pad = lambda x: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, index.size - geo.seq)))
    slots = index if query_slots is None else pad(query_slots.reshape(1, -1))[0]
    positions, segment_ids = (at_query_slots(x, query_slots) for x in (positions, segment_ids))
    start = jnp.where(real, slots - pad(positions), index)  # padded queries: documents of one
    earliest = jnp.where(real, start, NEVER).reshape(geo.batch, geo.query_tiles, -1).min(-1)
    latest = jnp.where(real, start, -1).reshape(geo.batch, geo.query_tiles, -1).max(-1)
    by_tile = lambda x, fill: jnp.where(real, x, fill).reshape(geo.query_tiles, -1)  # noqa: E731
    last_query = jnp.minimum(by_tile(slots, 0).max(-1), geo.keys - 1)
    own = jnp.where(real, pad(positions), 0) // geo.block_size
    shift, residue = jnp.divmod(start, geo.block_size)
    meta = [jnp.broadcast_to(slots, start.shape), pad(segment_ids), shift, residue, own,
            jnp.maximum(own - geo.local_blocks + 1, 0)]  # fmt: skip
    meta = jnp.stack(meta + [jnp.zeros_like(start)] * (8 - len(meta)), axis=1)  # [B, 8, S']
    tables = (
        (earliest // geo.key_tile).reshape(-1),
        last_query // geo.key_tile,
        jnp.where(earliest == latest, earliest, NEVER).reshape(-1),
        by_tile(slots, NEVER).min(-1),
    )
    return tables, jnp.repeat(meta, geo.heads, axis=2)  # a query's Hi rows share it


def _key_tile(geo, b, t, u, first, last):
    return jnp.minimum(first[b * geo.query_tiles + t] + u, last[t])


def _insert(state, candidate, block, forced_from, own):
    """Offer one finished block per row ([1, R] score and id) to the running top-k."""
    scores_ref, ids_ref = state
    forced = (block >= forced_from) & (block <= own)
    candidate = jnp.where(forced & (candidate > -jnp.inf), jnp.inf, candidate)
    scores, ids = scores_ref[...], ids_ref[...]
    worst = scores.min(axis=0, keepdims=True)
    worst_id = jnp.where(scores == worst, ids, -1).max(axis=0, keepdims=True)
    replace = (candidate > worst) & (ids == worst_id)
    scores_ref[...] = jnp.where(replace, candidate, scores)
    ids_ref[...] = jnp.where(replace, block, ids)


def _scan_block(geo, c, i, refs, state, *, masked):
    """Fixed block i of key tile c: close the block each row has open, open the next."""
    iq_ref, ik_ref, kseg_ref, meta_ref, pending_ref = refs
    start = i * geo.block_size
    keys = ik_ref[start : start + geo.block_size, :]
    dims = (((1,), (1,)), ((), ()))
    scores = jax.lax.dot_general(keys, iq_ref[...], dims, preferred_element_type=jnp.float32)
    offset = jax.lax.broadcasted_iota(jnp.int32, (geo.block_size, 1), 0)  # slot within the block
    head = offset < meta_ref[RESIDUE : RESIDUE + 1, :]  # [block, R]: the previous document block
    tail = ~head
    if masked:
        slot = (c * geo.key_blocks + i) * geo.block_size + offset
        segment = kseg_ref[start : start + geo.block_size, :]
        visible = (segment == meta_ref[SEGMENT : SEGMENT + 1, :]) & (
            slot <= meta_ref[SLOT : SLOT + 1, :]
        )
        head, tail = head & visible, tail & visible
    closing = jnp.where(head, scores, -jnp.inf).max(axis=0, keepdims=True)
    opening = jnp.where(tail, scores, -jnp.inf).max(axis=0, keepdims=True)
    block = c * geo.key_blocks + i - meta_ref[SHIFT : SHIFT + 1, :]  # document block of the tail
    _insert(state, jnp.maximum(pending_ref[...], closing), block - 1, *_forcing(meta_ref))
    pending_ref[...] = opening


def _forcing(meta_ref):
    return meta_ref[FIRST_FORCED : FIRST_FORCED + 1, :], meta_ref[OWN : OWN + 1, :]


def _write_ranked(geo, state, out_ref):
    """Rows 0..k-1 of the output block: the set ordered as `top_k` orders it, -1 for -inf."""
    scores_ref, ids_ref = state
    ids = ids_ref[...]
    member = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    scores = jnp.where(member < geo.topk, scores_ref[...], -jnp.inf)
    for j in range(geo.topk):
        best = scores.max(axis=0, keepdims=True)
        best_id = jnp.where(scores == best, ids, NEVER).min(axis=0, keepdims=True)
        out_ref[j : j + 1, :] = jnp.where(best > -jnp.inf, best_id, -1)
        scores = jnp.where(ids == best_id, -jnp.inf, scores)


def _kernel(geo, first, last, mask_free, first_query, iq_ref, ik_ref, kseg_ref, meta_ref, out_ref,
            *scratch):  # fmt: skip
    scores_ref, ids_ref, pending_ref = scratch
    b, t, u = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c = first[b * geo.query_tiles + t] + u
    state = (scores_ref, ids_ref)
    refs = (iq_ref, ik_ref, kseg_ref, meta_ref, pending_ref)

    @pl.when(u == 0)
    def _():
        member = jax.lax.broadcasted_iota(jnp.int32, scores_ref.shape, 0)
        scores_ref[...] = jnp.where(member < geo.topk, -jnp.inf, jnp.inf)
        ids_ref[...] = jnp.where(member < geo.topk, UNSET + member, PADDING)
        pending_ref[...] = jnp.full(pending_ref.shape, -jnp.inf, jnp.float32)

    interior = (c * geo.key_tile >= mask_free[b * geo.query_tiles + t]) & (
        (c + 1) * geo.key_tile <= first_query[t] + 1
    )  # every key of the tile in the one document, at or before its first query

    @pl.when((c <= last[t]) & interior)
    def _():
        for i in range(geo.key_blocks):
            _scan_block(geo, c, i, refs, state, masked=False)

    @pl.when((c <= last[t]) & ~interior)
    def _():
        for i in range(geo.key_blocks):
            _scan_block(geo, c, i, refs, state, masked=True)

    @pl.when(c == last[t])
    def _():
        block = (c + 1) * geo.key_blocks - 1 - meta_ref[SHIFT : SHIFT + 1, :]  # the one still open
        _insert(state, pending_ref[...], block, *_forcing(meta_ref))
        _write_ranked(geo, state, out_ref)


def _operands(geo, index_q, index_k, segment_ids):
    """index_q as rows [B, S'·Hi, Di] (query-major), index_k [B, T', Di] and the keys' segments
    [B, T', 1], padded to whole query and key tiles."""
    queries, keys = geo.query_tiles * geo.queries, geo.key_tiles * geo.key_tile
    iq = jnp.pad(index_q, ((0, 0), (0, queries - geo.seq), (0, 0), (0, 0)))
    ik = jnp.pad(index_k, ((0, 0), (0, keys - geo.keys), (0, 0)))
    kseg = jnp.pad(jnp.asarray(segment_ids, jnp.int32), ((0, 0), (0, keys - geo.keys)),
                   constant_values=NO_SEGMENT)  # fmt: skip
    return iq.reshape(geo.batch, queries * geo.heads, -1), ik, kseg[..., None]


def _call(geo, index_dim, interpret):
    """The pallas_call: grid (B, query tiles, key tiles), key tiles clamped to each query tile's
    [first, last] (scalar prefetch), the output block written at the last."""
    rows = lambda b, t, u, *_: (b, t, 0)
    key_rows = lambda b, t, u, *p: (b, _key_tile(geo, b, t, u, *p[:2]), 0)
    lanes = lambda b, t, u, *_: (b, 0, t)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(geo.batch, geo.query_tiles, geo.key_tiles),
        in_specs=[
            pl.BlockSpec((None, geo.rows, index_dim), rows),
            pl.BlockSpec((None, geo.key_tile, index_dim), key_rows),
            pl.BlockSpec((None, geo.key_tile, 1), key_rows),
            pl.BlockSpec((None, 8, geo.rows), lanes),
        ],
        out_specs=pl.BlockSpec((None, geo.width, geo.rows), lanes),
        scratch_shapes=[
            pltpu.VMEM((geo.width, geo.rows), jnp.float32),  # top-k scores
            pltpu.VMEM((geo.width, geo.rows), jnp.int32),  # their block ids
            pltpu.VMEM((1, geo.rows), jnp.float32),  # the open block's max
        ],
    )
    lanes_out = geo.query_tiles * geo.rows
    return pl.pallas_call(
        functools.partial(_kernel, geo),
        out_shape=jax.ShapeDtypeStruct((geo.batch, geo.width, lanes_out), jnp.int32),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="msa_tpu_select",
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
    query_slots: jax.Array | None = None,
    tiling: Tiling = Tiling(),
    interpret=False,
) -> jax.Array:
    """Same arguments and result as `reference.top_blocks`: [B, S, Hi, min(k, ceil(T / block))]
    int32, in `top_k`'s order. interpret: as `pallas_call` takes it (a bool or
    `pltpu.InterpretParams`)."""
    if not interpret and (reason := unsupported_reason(index_q, block_size=block_size,
                                                          tiling=tiling)):  # fmt: skip
        raise ValueError(reason)
    geo = Geometry.of(index_q.shape, index_k.shape[1], block_size, topk_blocks, local_blocks,
                      tiling)  # fmt: skip
    slots = None if query_slots is None else jnp.asarray(query_slots)
    tables, meta = _tables(geo, jnp.asarray(segment_ids), jnp.asarray(positions), slots)
    operands = _operands(geo, *jax.lax.stop_gradient((index_q, index_k)), segment_ids)
    out = _call(geo, index_q.shape[-1], interpret)(*tables, *operands, meta)
    queries = geo.query_tiles * geo.queries
    out = out[:, : geo.topk].reshape(geo.batch, geo.topk, queries, geo.heads)[:, :, : geo.seq]
    return out.transpose(0, 2, 3, 1)
