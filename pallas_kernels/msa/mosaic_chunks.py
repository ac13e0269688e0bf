"""What the Mosaic GPU MSA kernels share (mosaic_forward.py, mosaic_backward.py): the row layout
of a chunk, the TMA copies that fill a chunk's ring slot and store its per-row results, masks and
wgmma helpers.

A chunk is R rows: chunk_queries entries of Ge rows each (an entry's G heads, zero-padded to a
whole 8-row tile), in the sorted entry order of `block_lists.build`. With G a multiple of 8 a
chunk's row matrices (Q, and dO in the backward) are TMA-copied entry by entry straight from their
padded [B·C·W·H, D] arrays (`WindowRows`); with G < 8 XLA gathers them in sorted order first
(`sorted_rows`) so that one copy fills a chunk.

Shapes: G = H // K query heads per kv head, Ge = max(G, 8), R rows of a chunk, block keys.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_smem import swizzled

TILE_ROWS = 8  # rows of a swizzled shared-memory tile: TMA row offsets are multiples of it
TABLE_COLUMNS = 7  # of `mosaic_forward.segment_table`
LOG2E, LN2 = math.log2(math.e), math.log(2)
NOT_VISIBLE = jnp.iinfo(jnp.int32).max  # key slot of keys outside the block's row


def entry_rows(group: int) -> int:
    """Ge: rows of one entry (its G heads, zero-padded to a whole tile)."""
    return max(group, TILE_ROWS)


def gathers_queries(group: int) -> bool:
    """Whether the kernel TMA-copies each entry's G rows straight from q (G a whole number of
    tiles: a query's heads of one kv head are G consecutive rows) rather than from rows XLA
    gathered (G < 8)."""
    return group % TILE_ROWS == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowRows:
    """A window's row matrix [B, W, H, D] (Q, dO) left in place in its padded [B, C·W, H, D]
    array (pallas.py's windows): kernels that copy each entry's rows themselves
    (`gathers_queries`) read them there, so XLA does not copy the window out first (Q and dO
    are 2.1 GB each a layer at 128K tokens of M3's 64 heads)."""

    padded: jax.Array
    start: jax.Array  # int32 []: the window's first slot in `padded`
    size: int = dataclasses.field(metadata=dict(static=True))  # W

    @property
    def dtype(self) -> jnp.dtype:
        return self.padded.dtype

    def sliced(self) -> jax.Array:
        """The window itself [B, W, H, D] (an XLA copy: for the kernels that take no
        `rows_at`)."""
        return jax.lax.dynamic_slice_in_dim(self.padded, self.start, self.size, 1)

    def rows_at(self) -> jax.Array:
        """int32 [2]: the row of the window's query 0 in `padded`'s rows [B·C·W·H, D], and the
        rows from the end of one batch row's window to the start of the next's (`fetch_chunk`)."""
        _, length, heads, _ = self.padded.shape
        between = jnp.asarray((length - self.size) * heads, jnp.int32)
        return jnp.stack([self.start.astype(jnp.int32) * heads, between])


def fetch_chunk(geo, ref, smem, slot, first_entry, matrices, student: bool, row_operands):
    """Issue the TMA copies of the chunk whose first sorted entry is `first_entry` into ring slot
    `slot`: the row matrices `matrices` (each entry's rows, or one copy of XLA-gathered rows) and
    with a student the index rows (a tile of 8 per copy) on `q_bars`, the per-row operands
    `row_operands` ([n, E·Ge + R] each) on `data_bars`."""
    group, queries = entry_rows(geo.group), geo.chunk_queries
    rows, direct = queries * group, gathers_queries(geo.group)
    start, bar = first_entry * group, smem["q_bars"].at[slot]
    # (b·W + i)·K + h of each entry (entries past the list: never stored)
    pairs = [ref["entries"][jnp.minimum(first_entry + query, geo.entries - 1)] // geo.topk
             for query in range(queries if direct or student else 0)]  # fmt: skip
    if direct and matrices:  # entry rows in the padded arrays (`WindowRows.rows_at`)
        window_row, between = ref["rows_at"][0], ref["rows_at"][1]
        per_batch = geo.window * geo.num_kv_heads  # pairs of one batch row's window
        # multiples of G: window_row and between count whole queries of H = K·G rows
        first_rows = [pl.multiple_of(pair * group + window_row + pair // per_batch * between,
                                     group) for pair in pairs]  # fmt: skip
    for name in matrices:
        if direct:  # each entry's G rows from its padded [B·C·W·H, D] array
            for query, first_row in enumerate(first_rows):
                plgpu.copy_gmem_to_smem(ref[name].at[pl.ds(first_row, group)],
                                        smem[name].at[slot, pl.ds(query * group, group)],
                                        bar)  # fmt: skip
        else:
            plgpu.copy_gmem_to_smem(ref[name].at[pl.ds(start, rows)], smem[name].at[slot], bar)
    for query, pair in enumerate(pairs if student else []):  # a tile of 8 per copy
        for part in range(group // TILE_ROWS):
            target = pl.ds(query * group + part * TILE_ROWS, TILE_ROWS)
            plgpu.copy_gmem_to_smem(ref["iq"].at[pl.ds(pair * TILE_ROWS, TILE_ROWS)],
                                    smem["iq"].at[slot, target], bar)  # fmt: skip
    for name in row_operands:
        plgpu.copy_gmem_to_smem(ref[name].at[:, pl.ds(start, rows)], smem[name].at[slot],
                                smem["data_bars"].at[slot])  # fmt: skip


def segment_row(ref, index) -> tuple:
    """The columns of `mosaic_forward.segment_table` for segment `index`: first sorted entry,
    entries, K/V window tile and shift, first key's global slot, b·S, kv head."""
    return tuple(ref["table"][index, column] for column in range(TABLE_COLUMNS))


def copy_whole(ref, smem, name: str, issues: bool = True) -> None:
    """TMA-copy operand `name` into shared memory once per program (the averaging matrix) and
    wait for it: the copy by the one warpgroup that `issues` it, the wait by each."""
    if issues:
        plgpu.copy_gmem_to_smem(ref[name], smem[name], smem[f"{name}_bar"].at[0])
    plgpu.barrier_wait(smem[f"{name}_bar"].at[0])


def chunk_copies(geo, matrices: int, index_dim: int) -> int:
    """TMA copies that arrive on a ring slot's `q_bars` per chunk (`fetch_chunk`)."""
    per_matrix = geo.chunk_queries if gathers_queries(geo.group) else 1
    rows = geo.chunk_queries * entry_rows(geo.group)
    return matrices * per_matrix + (rows // TILE_ROWS if index_dim else 0)


def store_chunk(geo, smem, ref, results: dict, start, valid_queries, stored_rows: int = 0):
    """Stage a chunk's per-row results in shared memory (`<name>_out`) and TMA-store the first
    `stored_rows` rows (Ge by default) of each valid query's entry at GMEM row `start` +
    query·stored_rows: in one copy when the chunk is whole and stores every row, else query by
    query (a list's last chunk: the entries after it belong to the next block's list, whose
    program writes them; the interpreter has no predicated copies)."""
    group, queries = entry_rows(geo.group), geo.chunk_queries
    stored_rows = stored_rows or group
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's stores have read
    staged = {name: staging(smem, name, value.shape[-1]) for name, value in results.items()}
    for name, value in results.items():
        staged[name][...] = value
    plgpu.commit_smem()
    whole = valid_queries >= queries

    if stored_rows == group:

        @pl.when(whole)
        def _():
            for name in results:
                plgpu.copy_smem_to_gmem(smem[f"{name}_out"],
                                        ref[name].at[pl.ds(start, queries * group)],
                                        commit_group=False)  # fmt: skip

    for query in range(queries):

        @pl.when((stored_rows != group or ~whole) & (query < valid_queries))
        def _(query=query):
            some = pl.ds(query * group, stored_rows)
            target = pl.ds(start + query * stored_rows, stored_rows)
            for name in results:
                plgpu.copy_smem_to_gmem(staged[name].at[some], ref[name].at[target],
                                        commit_group=False)  # fmt: skip

    plgpu.commit_smem_to_gmem_group()


def staging(smem, name: str, width: int):
    """`<name>_out` as the [R, width] it stages: a row-padded buffer (`padded_rows`) without
    its padding columns."""
    buffer = smem[f"{name}_out"]
    return buffer if buffer.shape[-1] == width else buffer.at[:, pl.ds(0, width)]


ROW_PAD = 8  # 32-bit words: 8 padded rows are a multiple of 128 bytes at width 128


def padded_rows(rows: int, width: int, dtype):
    """An unswizzled [rows, width] 32-bit staging buffer with ROW_PAD unused words after each
    row: rows of 128 words all start in bank 0, so a warp's store of a WGMMA tile (8 rows of 8
    words an instruction) hits each of its banks 8 times; shifted by 8 words a row, the 8 rows
    take 2 passes, the least for 256 bytes. A row's TMA copy stays 128-byte aligned where its
    index is a multiple of 8 (an entry's first row)."""
    return plgpu.SMEM((rows, width + ROW_PAD), dtype)


def softmax_block(scale: float, scores, visible):
    """Logits [R, block] fp32 (to be scaled by `scale`: Dh^-½, or Di^-½ for the student's) and
    their mask -> (P = exp(S·scale - m) fp32, row max m, row sum l), in base 2 (m in log2 units:
    exp2 of one fused multiply-add per element); rows that see nothing get m = 0, l = 0, P = 0."""
    scaled = jnp.where(visible, scores * (scale * LOG2E), -jnp.inf)
    top = scaled.max(axis=1)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    probs = jnp.exp2(scaled - jax.lax.broadcast_in_dim(top, scaled.shape, [0]))
    return probs, top, probs.sum(axis=1)


def block_lse(top, total):
    """Row max m (log2 units) and row sum l -> the block's natural-log LSE, -inf where l = 0."""
    seen = total > 0
    return jnp.where(seen, (top + jnp.log2(jnp.where(seen, total, 1.0))) * LN2, -jnp.inf)


def normalised(scale: float, scores, lse, visible, axis: int = 0):
    """exp(S·scale - LSE) where visible, else 0: probabilities under a global LSE per query row,
    the rows along `axis` of the tile (0; the backward's transposed tiles have them along 1)."""
    scaled = scores * (scale * LOG2E) - broadcast(lse * LOG2E, scores.shape, axis)
    return jnp.where(visible, jnp.exp2(scaled), 0.0)


def kl_rows(teacher, log_student, axis: int = 1):
    """Per row, Σ over the block's keys of t·(log t - log s) where t > 0 (t = 0 on the keys a
    row does not see, so their student logits never count): teacher t [R, block] (the group's
    mean, alike on all rows of an entry), log s = z·Di^-½ - LSE_z [R, block]."""
    log_teacher = jnp.log2(jnp.maximum(teacher, 1e-30)) * LN2
    return jnp.where(teacher > 0, teacher * (log_teacher - log_student), 0.0).sum(axis=axis)


def visible(query_data, key_slots, key_segments, shape, key_axis: int = 1):
    """bool tile of `shape`: key in the query's document, not after it, in the block's row; keys
    along `key_axis` (1: [R, block]; 0: the backward's transposed [block, R])."""
    slot, segment = query_data
    query_axis = 1 - key_axis
    same_document = broadcast(key_segments, shape, key_axis) == broadcast(segment, shape,
                                                                          query_axis)
    return same_document & (broadcast(key_slots, shape, key_axis)
                            <= broadcast(slot, shape, query_axis))  # fmt: skip


def broadcast(vector, shape, axis: int = 0):
    """A vector broadcast along the other axis of a 2-D tile (axis 0: one value per row)."""
    return jax.lax.broadcast_in_dim(vector, shape, [axis])


def matmul(shape, *products):
    """Σ a · b over the (a, b) pairs of shared-memory operands, on wgmma, into a fresh fp32
    accumulator of `shape`."""

    def body(acc):
        for a, b in products:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def tiles(dtype, *shape):
    """Shared memory of `shape` in swizzled 8-row tiles (TMA and wgmma operands)."""
    return plgpu.SMEM(shape, dtype, transforms=swizzled(shape[-1], dtype))


# ---------------------------------------------------------------------------------------------
# The backward kernels' items (mosaic_backward.py, mosaic_student.py): a segment's key half

KEY_PARTS = 2  # items per segment: key halves, so that dK and dV fit one warpgroup's registers
PART_KEYS = 64  # keys of an item: one wgmma M
# rows past the last entry of the forward's teacher [E + TEACHER_TAIL, block]: the student's
# kernel copies a segment's entries a whole slot of 64 at a time, up to 63 rows past its last
TEACHER_TAIL = 64
WGMMA = plgpu.Layout.WGMMA
ROW_LAYOUT, COLUMN_LAYOUT = WGMMA.reduce(1), WGMMA.reduce(0)


class Item(NamedTuple):
    """An item opened by `open_item`: its segment's `segment_row` and chunks, the chunk ring's
    fetch, and the key half's slots and segment ids (one per tile row)."""

    row: tuple
    num_chunks: jax.Array
    fetch: Callable
    key_slots: jax.Array
    key_segments: jax.Array

    @property
    def first(self) -> jax.Array:  # the segment's first sorted entry
        return self.row[0]

    @property
    def count(self) -> jax.Array:  # the segment's entries
        return self.row[1]


def copy_keys(ref, smem, index, part, block_operands) -> tuple:
    """Issue the TMA copies of item (segment `index`, key half `part`)'s `block_operands` (k, v:
    [8, N, K, D] by kv head; kseg, ik: [8, N, ...]) -> the segment's `segment_row`."""
    row = segment_row(ref, index)
    tile_row, shift, head = row[2], row[3], row[6]
    window = pl.ds(tile_row * TILE_ROWS + part * PART_KEYS, PART_KEYS)
    for bar, name in enumerate(block_operands):
        keys = (shift, window, head) if name in ("k", "v") else (shift, window)
        plgpu.copy_gmem_to_smem(ref[name].at[keys], smem[name], smem["key_bars"].at[bar])
    return row


def key_data(smem, row, part, num_operands: int,
             layout=ROW_LAYOUT) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Wait for `copy_keys`' copies -> the key half's global slots (NOT_VISIBLE before the
    block's row) and segment ids, one per tile row (COLUMN_LAYOUT: one per tile column, for
    tiles with the keys along their columns)."""
    key_slot, row_start = row[4], row[5]
    for bar in range(num_operands):
        plgpu.barrier_wait(smem["key_bars"].at[bar])
    slots = key_slot + part * PART_KEYS + plgpu.broadcasted_iota(
        jnp.int32, (PART_KEYS,), 0, layout=layout
    )
    slots = jnp.where(slots >= row_start, slots, NOT_VISIBLE)
    return slots, plgpu.load(smem["kseg"], layout=layout, optimized=False)


def open_item(geo, tiling, ref, smem, index, part, block_operands, matrices,
              fetches: bool = True) -> Item:  # fmt: skip
    """Start item (segment `index`, key half `part`): TMA-copy the half's `block_operands`
    (`copy_keys`) and, where this warpgroup `fetches` the chunk ring (the other of a pair of
    warpgroups reads the same ring), the first `stages` chunks of `matrices` and row operands
    (data, values); wait for the former."""
    row = copy_keys(ref, smem, index, part, block_operands)
    first, count, queries = row[0], row[1], geo.chunk_queries

    def fetch(chunk):
        if fetches:
            fetch_chunk(geo, ref, smem, chunk % tiling.stages, first + chunk * queries,
                        matrices, False, ["data", "values"])  # fmt: skip

    num_chunks = (count + queries - 1) // queries
    for chunk in range(tiling.stages):
        pl.when(chunk < num_chunks)(lambda chunk=chunk: fetch(chunk))
    slots, key_segments = key_data(smem, row, part, len(block_operands))
    return Item(row, num_chunks, fetch, slots, key_segments)


def chunk_rows(geo, tiling, smem, item: Item, chunk):
    """Wait for `chunk`'s ring slot -> (its [PART_KEYS, R] visibility, its per-row values): rows
    past the block's list (the next block's entries) see no key."""
    rows, slot = tiling.rows, chunk % tiling.stages
    plgpu.barrier_wait(smem["q_bars"].at[slot])
    plgpu.barrier_wait(smem["data_bars"].at[slot])
    query_slot, segment, *values = (
        plgpu.load(smem[name].at[slot, c], layout=COLUMN_LAYOUT, optimized=False)
        for name in ("data", "values") for c in range(smem[name].shape[1])
    )  # fmt: skip
    column = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=COLUMN_LAYOUT)
    valid = item.count - chunk * geo.chunk_queries
    query_slot = jnp.where(column // entry_rows(geo.group) < valid, query_slot, -1)
    seen = visible((query_slot, segment), item.key_slots, item.key_segments,
                   (PART_KEYS, rows), key_axis=0)  # fmt: skip
    return seen, values


def release_chunk(tiling, item: Item, chunk) -> None:
    """After every warp's wgmmas and loads have read `chunk`'s ring slot (a warpgroup barrier;
    the proxy fence orders those reads before the TMA writes), fetch the chunk `stages` on."""
    plgpu.commit_smem()
    pl.when(chunk + tiling.stages < item.num_chunks)(lambda: item.fetch(chunk + tiling.stages))


def add_sum(smem, ref, name: str, value, target, interpret: bool) -> None:
    """Add an fp32 sum held in registers into `target` of the running sums `name` (an operand
    the kernel writes in place), staged in `sum_out` once the staging's last store has read it
    (unswizzled: the rows start at any row, where a swizzled staging's copy takes whole tiles).
    A TMA reduction: programs that add into the same rows (a block's segments) each add whole.
    Mosaic GPU's interpreter has no TMA reductions; it runs programs one after another, so there
    the staging takes the rows' sum and stores it."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem["sum_out"][...] = value + ref[name][target] if interpret else value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["sum_out"], ref[name].at[target],
                            reduction_op=None if interpret else "add")  # fmt: skip


def sum_rows(row, part: int):
    """Rows of item (segment `row`, key half `part`)'s keys in running sums laid out as
    `mosaic_forward.pad_keys` lays out the keys: the K/V window's padded row, plus the half."""
    return pl.ds(row[2] * TILE_ROWS + row[3] + part * PART_KEYS, PART_KEYS)


def zeros(shape):
    """A fresh fp32 accumulator value in the WGMMA layout."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)


def wgmmas(interpret: bool, initial, *products):
    """Accumulators initialised from `initial` (fp32 in the WGMMA layout) plus, for each, the
    sum of its products [(a, b), ...] on wgmma; one wait for all. On the GPU the accumulators
    start from `initial` in place (`run_state`, no second copy in registers); Mosaic GPU's
    interpreter has no `run_state`, so there fresh accumulators are added to `initial`."""
    if not interpret:

        def body(refs):
            for ref, pairs in zip(refs, products, strict=True):
                for a, b in pairs:
                    plgpu.wgmma(ref, a, b)

        return pl.run_state(body)(tuple(plgpu.ACC.init(x) for x in initial))

    def scoped(*refs):
        for ref, pairs in zip(refs, products, strict=True):
            for a, b in pairs:
                plgpu.wgmma(ref, a, b)
        return tuple(ref[...] for ref in refs)

    fresh = pl.run_scoped(scoped, *(plgpu.ACC(x.shape, jnp.float32) for x in initial))
    return tuple(x + y for x, y in zip(initial, fresh))
