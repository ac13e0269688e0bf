"""MSA sparse attention forward on Hopper GPUs in Pallas Mosaic GPU kernels: one pass without the
indexer's student, and a second pass for its KL with one.

Key-block-major like `forward_kernels.py`, but in one pass: per segment (one key block of one
(row, kv head), `block_lists.py`) the block's K and V are TMA-copied into shared memory once; per
chunk of R = chunk_queries·Ge rows the kernel computes S = Q·Kᵀ·Dh^-½ on wgmma, masks it, takes
the row max m and sum l of P = exp(S - m) over the block alone, and computes O = P·V on wgmma (P
through shared memory: Mosaic GPU's interpreter takes no register operand for wgmma). It
stores each row's o / l and lse_e = m + log l; an XLA combine over each query's k selections
(`combine`) turns those into the output and the per-(query, head) LSE. The Triton path's separate
LSE pass (a second Q·Kᵀ) is not needed.

With a student (index_q [B, W, K, Di], index_k [B, S, Di]) the same kernel also computes the
student's logits z = index_q·index_kᵀ on wgmma and stores their block-local LSE per row, lse_z_e
(`combine` turns it into LSE_z per (query, kv head) as it does lse). A student row belongs to a
(query, kv head), one per entry, but the rows of a wgmma tile are R ≥ 64: the index rows are laid
out like the entry's Ge Q rows, each the entry's index row (`index_rows` repeats every index row
8 times in GMEM, so one aligned TMA copy fills an 8-row tile; 8× index_q's bytes, where a
per-entry gather would take k·Ge×), so z shares S's tile layout and mask and costs one more
64-row wgmma, as much as zero-padding the entries to 64 rows would. The index keys are
TMA-copied once per segment like K (`shifted_keys` of index_k). Then `kl_pass`, a second kernel
over the same segments and chunks with the global LSEs per row (`row_values` of lse and
lse_z): S again, P = exp(S - LSE) per head, the teacher t = the group's mean as one wgmma A·P
with a constant averaging matrix A [R, R] (a reduction across a tile's rows would cross threads
and warps; P goes in two 16-bit parts for ~16-bit precision), z again, and per row Σ t·(log t -
(z·Di^-½ - LSE_z)) where t > 0, stored per entry; pallas.py adds a query's k entries. The
teacher itself is stored too, one fp32 row per entry ([E + 64, block], from an unswizzled staging
buffer a row at a time): the student's gradients start from it (mosaic_student.py) instead of
computing P again. That is the Triton forward pass minus its P·V (the Triton path pays its two
Q·Kᵀ as well). The index operands enter the wgmma in q's dtype. With `Config.kl_kernel =
"slots"` (the default) this pass runs only for windows of more segments than the student's
slots hold: the teacher alone comes from `mosaic_backward.teacher_pass` (the gradients kernel's
walk: Sᵀ, Pᵀ and column sums in registers, no averaging wgmma), and the student's kernel takes
its LSE and the KL one row per entry (mosaic_student.py: `kl_terms`).

Operands: per row of a chunk, the query's global slot and segment id (for the mask) in the sorted
entry order of `block_lists.build` (`presort`). Q: with G a multiple of 8 the kernel TMA-copies each
entry's G rows (a query's heads of one kv head, consecutive in q) into the chunk's buffer; with G <
8, XLA gathers Q rows [E·Ge, Dh] in sorted entry order (Ge = 8 rows per entry, G of them real), so
that one copy loads a chunk. Mosaic GPU's TMA copies into swizzled tiles of 8 rows need a GMEM row
offset that is a multiple of 8, hence Ge; and K and V are shifted: they keep their [B·S, K, Dh]
layout, padded by one block of rows at both ends (a block that starts before its row or runs past
the end stays inside the array; its outside keys are masked by slot), in 8 copies, copy s shifted
up by s rows, so that a block that starts at any row is an aligned 128-row window of one copy
(`shifted_keys`: 16× K's bytes, small beside the k·G× of the per-entry outputs).

Grid: persistent, one program per SM (or `programs_per_core` of them), walking segments as
`chunks.for_each_segment` does: segments are many and small (≤ segment_chunks chunks), so a fixed
grid avoids a launch-size that depends on the data and keeps the per-program set-up (barriers,
shared-memory carve-out) out of the per-segment cost. Within a segment, the chunks' Q copies go
through a ring of `stages` shared-memory buffers, so the next chunks' TMA overlaps this chunk's
math; output stores are asynchronous TMA and are waited on only before the staging buffer is
reused. A segment's own K and V copies are not overlapped with the previous segment's math (no
warp specialisation yet). `Tiling.warpgroups = 2` runs the attention pass without a student on
two warpgroups a program that take a segment's chunks in turn, each with its own ring and
stagings, so that one's softmax can run beside the other's wgmmas, while the passes with a
student keep one.
`pallas.Config`'s default is two warpgroups at one ring stage: on an H100 at M3's layout the
layer's forward took 112.9 ms at S = 128K against 131.6 on one warpgroup at two stages, and 24.5
against 29.2 ms at 32K (benchmarks/RESULTS.md, 2026-12-07).

On the H200 at M3's layout (64 q / 4 kv heads, Dh 128, top-16, S = 32K), the attention forward
without a student took 14.3 ms against the Triton path's 28.4 (kernel 8.8 ms against 22.9 for
the LSE and forward passes); at 128K, 58 ms against 119 (benchmarks/bench_msa.py
--forward-kernels). With the student, in bench-h200's training step: the forward 33.9 ms and the
KL pass 35.6 ms of a 632 ms step (benchmarks/RESULTS.md, 2026-12-03).

Outputs are o / l in q's dtype (normalised per block, so within V's range: bf16 keeps the
kernel's store and the combine's read at half the bytes of fp32, and the Triton path's per-entry
shares are q's dtype too) and lse_e in fp32 (the combine exponentiates differences of LSEs); the
student's lse_z_e and KL shares in fp32, one value per row (all rows of an entry alike).

A chunk at the end of a block's list holds fewer than chunk_queries valid entries; the entries
after them belong to the next block's list, whose program writes them. The last chunk of a list is
therefore stored query by query (one TMA copy of Ge rows each, under `pl.when`: the interpreter
has no predicated copies), the others in one copy.

Shapes: B batch, S sequence, H query heads, K kv heads, G = H // K, Ge = max(G, 8) rows per
entry, Dh head dim, Di index head dim, k selections per query, W queries per window, E = B·W·K·k
entries, R = chunk_queries·Ge rows of a chunk, block = block_size keys.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import target
from pallas_kernels.msa import block_lists, chunks
from pallas_kernels.msa.mosaic_chunks import (
    NOT_VISIBLE,
    ROW_PAD,
    TABLE_COLUMNS,
    TEACHER_TAIL,
    TILE_ROWS,
    WindowRows,
    block_lse,
    broadcast,
    chunk_copies,
    copy_whole,
    entry_rows,
    fetch_chunk,
    gathers_queries,
    kl_rows,
    matmul,
    normalised,
    padded_rows,
    segment_row,
    softmax_block,
    store_chunk,
    visible,
)
from pallas_kernels.msa.mosaic_chunks import tiles as tiles_of

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
BLOCK_SIZES = (128,)  # one wgmma N / K tile of keys per block
HEAD_DIM_MULTIPLE = 64  # the swizzled tiles' minor size in 16-bit elements
WARPGROUPS = (1, 2)  # a program's warpgroups (`Tiling.warpgroups`)
WARPGROUP_ROWS = (64,)  # wgmma M of the one warpgroup; 128 rows would spill its registers
SHARED_BYTES = 227 * 1024  # the H200's shared memory per program


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch parameters of the Mosaic kernel (pallas.Config holds the timed ones)."""

    rows: int = 64  # R = chunk_queries · Ge rows per chunk
    segment_chunks: int = 16  # chunks per segment: K/V loads amortised vs. load balance
    stages: int = 2  # Q buffers in flight
    # `shared_bytes` at Dh = 128, stages = 2: 130 KiB, so a second program does not fit an SM
    programs_per_core: int = 1
    # 2: the attention pass without a student runs two warpgroups a program, taking a segment's
    # chunks in turn (the passes with a student run one); the backward's gradients kernel and
    # the teacher pass a block's two key halves, one warpgroup each, over one ring of Q (and dO)
    # (mosaic_backward.py)
    warpgroups: int = 1

    def chunk_queries(self, group: int) -> int:
        if self.rows % entry_rows(group):
            raise ValueError(f"Tiling.rows={self.rows} is not whole entries of G={group} heads")
        return self.rows // entry_rows(group)


def shared_bytes(
    tiling: Tiling, head_dim: int, block_size: int, index_dim: int = 0, itemsize: int = 2
) -> int:
    """Shared memory of one program (`_scratch`), the largest of the kernels: the attention
    pass without a student on the tiling's warpgroups; with a student (index_dim > 0) also that
    pass with the student's operands and the KL pass, on one."""
    forward = attention_bytes(tiling, tiling.warpgroups, head_dim, block_size, 0, itemsize)
    if not index_dim:
        return forward
    return max(forward, attention_bytes(tiling, 1, head_dim, block_size, index_dim, itemsize),
               kl_bytes(tiling, head_dim, block_size, index_dim, itemsize))  # fmt: skip


def attention_bytes(tiling: Tiling, groups: int, head_dim: int, block_size: int,
                    index_dim: int, itemsize: int = 2) -> int:  # fmt: skip
    """The attention pass': the block's K, V (index keys) and key segment ids, then per
    warpgroup its Q (and index-row) ring, P, output staging, row data, LSE (and LSE_z)."""
    rows, stages = tiling.rows, tiling.stages
    own_tiles = (stages + 1) * rows * head_dim + rows * block_size + stages * rows * index_dim
    tiles = (2 * head_dim + index_dim) * block_size + groups * own_tiles
    words = block_size + groups * (2 * stages + 1 + (index_dim > 0)) * rows
    return tiles * itemsize + 4 * words


def kl_bytes(tiling: Tiling, head_dim: int, block_size: int, index_dim: int,
             itemsize: int = 2) -> int:  # fmt: skip
    """The KL pass' (one warpgroup): the block's K, index keys, key segment ids and the
    averaging matrix, its rings, P's two parts, row data and LSEs, the KL staging and the fp32
    teacher staging."""
    rows, stages = tiling.rows, tiling.stages
    own_tiles = stages * rows * (head_dim + index_dim) + 2 * rows * block_size
    tiles = (head_dim + index_dim) * block_size + rows * rows + own_tiles
    own_words = 4 * stages * rows + rows + rows * (block_size + ROW_PAD)
    return tiles * itemsize + 4 * (block_size + own_words)


def unsupported_reason(
    dtype, group: int, head_dim: int, block_size: int, tiling: Tiling, index_dim: int = 0
) -> str:
    """Why the Mosaic kernels can't take these operands ('' when they can); index_dim: Di with a
    student, 0 without."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float16"
    if tiling.warpgroups not in WARPGROUPS:
        return f"warpgroups={tiling.warpgroups} is not one of {WARPGROUPS}"
    if tiling.rows not in WARPGROUP_ROWS:
        return f"mosaic rows={tiling.rows} is not one of {WARPGROUP_ROWS}"
    per_entry = entry_rows(group)
    if tiling.rows % per_entry or (tiling.rows // per_entry) & (tiling.rows // per_entry - 1):
        return (
            f"mosaic rows={tiling.rows} are not a power-of-two number of queries of {group} heads"
        )
    for name, size in (("head_dim", head_dim), ("index_head_dim", index_dim)):
        if size % HEAD_DIM_MULTIPLE:
            return f"{name}={size} is not a multiple of {HEAD_DIM_MULTIPLE}"
    if block_size not in BLOCK_SIZES:
        return f"block_size={block_size} is not one of {BLOCK_SIZES}"
    if (needed := shared_bytes(tiling, head_dim, block_size, index_dim)) > SHARED_BYTES:
        return (
            f"head_dim={head_dim}, index_head_dim={index_dim} need {needed} bytes of shared "
            f"memory (> {SHARED_BYTES})"
        )
    return ""


def num_programs(tiling: Tiling) -> int:
    """Persistent programs: `programs_per_core` per SM (3 under the CPU interpreter)."""
    device = target.devices()[0]
    cores = device.core_count if device.platform == "gpu" else 3
    return cores * tiling.programs_per_core


# ---------------------------------------------------------------------------------------------
# XLA side: operands in sorted entry order, and the combine over selections


def segment_table(geo: chunks.Geometry, lists: block_lists.BlockLists):
    """[E, TABLE_COLUMNS] int32 per segment (rows past num_segments are junk, never read): sorted
    position of its first entry, its number of entries, the padded K/V row of the block window's
    first key as tile·8 + shift (its aligned row tile·8 in the shifted copy `shift`), that key's
    global slot b·S + slot, b·S, and the kv head."""
    seq, size = geo.seq, geo.block_size
    key = lists.keys[lists.segment_starts]
    pair, offset = key // (2 * seq), key % (2 * seq)
    batch, head = pair // geo.num_kv_heads, pair % geo.num_kv_heads
    # a block entirely before its row (document started earlier) still reads in-bounds rows
    window = jnp.maximum(offset - seq, -size)
    row_start = batch * seq
    kv_row = size + row_start + window
    columns = (lists.segment_starts, lists.segment_entries, kv_row // TILE_ROWS,
               kv_row % TILE_ROWS, row_start + window, row_start, head)  # fmt: skip
    assert len(columns) == TABLE_COLUMNS
    return jnp.stack(columns, axis=1).astype(jnp.int32)


def _entry_pairs(geo: chunks.Geometry, lists: block_lists.BlockLists):
    """(query b·W + i [E], kv head h [E]) of each sorted entry."""
    query = lists.entries // (geo.num_kv_heads * geo.topk)
    return query, (lists.entries // geo.topk) % geo.num_kv_heads


def presort(geo: chunks.Geometry, lists: block_lists.BlockLists, q: WindowRows, segment_ids,
            offset):  # fmt: skip
    """The kernel's Q operand (`sorted_rows`) and row data [2, E·Ge + R] int32 (query's global
    slot, its segment id) in sorted entry order, Ge rows per entry, padded by one chunk so every
    chunk's copy is in bounds.

    q: the window's queries [B, W, H, Dh] in place; segment_ids: [B, S]; offset: slot of query 0.
    """
    data = jnp.pad(entry_data(geo, lists, segment_ids, offset), [(0, 0), (0, geo.chunk_queries)])
    return sorted_rows(geo, lists, q), jnp.repeat(data, entry_rows(geo.group), axis=1)


def entry_data(geo: chunks.Geometry, lists: block_lists.BlockLists, segment_ids, offset):
    """[2, E] int32 per sorted entry: its query's global slot b·S + slot and segment id (the
    kernels' mask); arguments as `presort`'s."""
    query, _ = _entry_pairs(geo, lists)
    batch, index = query // geo.window, query % geo.window
    slot = jnp.minimum(offset + index, geo.seq - 1)  # padded queries of the last window: invalid
    return jnp.stack([batch * geo.seq + slot, segment_ids.astype(jnp.int32)[batch, slot]])


def sorted_rows(geo: chunks.Geometry, lists: block_lists.BlockLists, x: WindowRows) -> jax.Array:
    """A row matrix of the kernels (Q, dO) from a window's rows x: the padded array's rows
    [B·C·W·H, D] as they are where the kernel copies each entry's rows itself (`gathers_queries`,
    at `WindowRows.rows_at`), else rows [E·Ge + R, D] in sorted entry order, padded like
    `presort`'s row data (an XLA gather: as many bytes as the kernel's per-entry output, written
    and read once more)."""
    if gathers_queries(geo.group):
        return x.padded.reshape(-1, x.padded.shape[-1])
    query, head = _entry_pairs(geo, lists)
    window = x.sliced()
    grouped = window.reshape(geo.batch * geo.window, geo.num_kv_heads, geo.group, -1)
    pad = geo.chunk_queries
    padded = (jnp.pad(query, (0, pad)), jnp.pad(head, (0, pad)))  # one gather writes the pad
    rows = jnp.pad(grouped[padded], [(0, 0), (0, entry_rows(geo.group) - geo.group), (0, 0)])
    return rows.reshape(-1, window.shape[-1])


def pad_keys(x: jax.Array, block_size: int) -> jax.Array:
    """[B, S, ...] -> rows [N, ...]: one block of zero rows at each end, and up to 7 more at the
    end, since a TMA copy into 8-row tiles needs a whole number of tiles in GMEM too."""
    flat = x.reshape(-1, *x.shape[2:])
    after = block_size + -flat.shape[0] % TILE_ROWS
    return jnp.pad(flat, [(block_size, after)] + [(0, 0)] * (flat.ndim - 1))


def shifted_keys(x: jax.Array, block_size: int) -> jax.Array:
    """[B, S, ...] -> [8, N, ...]: copy s holds `pad_keys` row r + s at row r (the key segment
    ids too: a 1-D TMA copy's GMEM start must be 16-byte aligned)."""
    flat = pad_keys(x, block_size)
    flat = jnp.pad(flat, [(0, TILE_ROWS)] + [(0, 0)] * (flat.ndim - 1))
    return jnp.stack([flat[s : s + flat.shape[0] - TILE_ROWS] for s in range(TILE_ROWS)])


def index_rows(index_q: jax.Array, dtype) -> jax.Array:
    """index_q [B, W, K, Di] -> [B·W·K·8, Di] in `dtype` (q's: the wgmma takes 16-bit operands):
    each (query, kv head)'s row 8 times, so that the kernels fill each 8-row tile of an entry's
    rows by one aligned TMA copy (8× index_q's bytes; gathering them per entry would take k·Ge)."""
    flat = index_q.reshape(-1, index_q.shape[-1]).astype(dtype)
    return jnp.repeat(flat, TILE_ROWS, axis=0)


def row_values(geo: chunks.Geometry, lists: block_lists.BlockLists, heads=(), groups=()):
    """Per-row fp32 operands [n, E·Ge + R] in sorted entry order (padded like `presort`'s row
    data): values per (query, head) [B, W, K, G] (0 on padding heads), then values per (query, kv
    head) [B, W, K] (alike on an entry's rows); 0 where not finite (an LSE of -inf: the row sees
    no key, so no visible key reads it)."""
    query, head = _entry_pairs(geo, lists)
    per_entry, pad = entry_rows(geo.group), geo.chunk_queries
    rows = []
    for value in heads:
        value = value.reshape(-1, geo.num_kv_heads, geo.group)[query, head]
        rows.append(jnp.pad(value, [(0, pad), (0, per_entry - geo.group)]).reshape(-1))
    for value in groups:
        value = jnp.pad(value.reshape(-1, geo.num_kv_heads)[query, head], (0, pad))
        rows.append(jnp.repeat(value, per_entry))
    rows = jnp.stack(rows).astype(jnp.float32)
    return jnp.where(jnp.isfinite(rows), rows, 0.0)


def _selection_lse(geo: chunks.Geometry, lists, valid, lse, heads: int):
    """Per-entry LSEs of the block [E·Ge] -> (those of the first `heads` rows at the selection
    slots [B, W, K, k, heads], -inf where invalid; their logsumexp over k [B, W, K, heads])."""
    shape = (geo.batch, geo.window, geo.num_kv_heads, geo.topk)
    lse_j = block_lists.by_selection(lse.reshape(-1, entry_rows(geo.group))[:, :heads], lists,
                                     shape)  # fmt: skip
    lse_j = jnp.where(valid.reshape(*shape, 1), lse_j, -jnp.inf)
    return lse_j, jax.nn.logsumexp(lse_j, axis=3)


def combine(geo: chunks.Geometry, lists, valid, o, lse, lse_z=None):
    """Per-entry (o / l [E·G, Dh], lse_e [E·G], lse_z_e [E·Ge] or None) -> (out [B, W, H, Dh]
    fp32, lse [B, W, K, G], lse_z [B, W, K] or None): lse = logsumexp over the query's k
    selections, out = Σ_j exp(lse_j - lse)·o_j, lse_z likewise; a (query, head) that sees no key
    has lse = -inf and out = 0."""
    shape = (geo.batch, geo.window, geo.num_kv_heads, geo.topk)
    ok, per_entry, g = valid.reshape(*shape, 1), entry_rows(geo.group), geo.group
    lse_j, total = _selection_lse(geo, lists, valid, lse, g)
    weights = jnp.exp(lse_j - jnp.where(jnp.isfinite(total), total, 0.0)[:, :, :, None])
    o_j = block_lists.by_selection(o.reshape(-1, per_entry, geo.head_dim)[:, :g], lists, shape)
    # unused slots were never written; an elementwise product and a sum over j fuse with the
    # gather into one pass (as an einsum, XLA transposed o_j for a dot first: 11 of the 31 ms
    # of the attention forward at S = 32K on the H200). The zeros for unused slots come from the
    # (finite) weights: a constant fill of this shape, XLA hoisted out of the training step's
    # layer loop as a [B, W, K, k, G, Dh] fp32 array read back in every layer (4.3 GB at 32K).
    weights = weights[..., None]
    shares = jnp.where(ok[..., None], weights * o_j.astype(jnp.float32), 0.0 * weights)
    out = shares.sum(axis=3).reshape(geo.batch, geo.window, geo.num_heads, geo.head_dim)
    if lse_z is None:
        return out, total, None
    return out, total, _selection_lse(geo, lists, valid, lse_z, 1)[1][..., 0]


# ---------------------------------------------------------------------------------------------
# The kernels


class Walk(NamedTuple):
    """The operands by which both kernels walk segments and chunks (`walk`)."""

    table: jax.Array  # `segment_table`
    num_segments: jax.Array  # [1]
    entries: jax.Array  # [E] `BlockLists.entries`: ((b·W + i)·K + h)·k + j of each sorted entry
    q_rows: jax.Array  # `presort`
    row_data: jax.Array  # `presort`
    rows_at: jax.Array  # `WindowRows.rows_at`: where the window's rows start in q_rows (and dO's)

    def operands(self) -> dict:
        """The kernels' first operands by name."""
        return dict(table=self.table, count=self.num_segments, entries=self.entries,
                    q=self.q_rows, data=self.row_data, rows_at=self.rows_at)  # fmt: skip


def walk(geo: chunks.Geometry, lists: block_lists.BlockLists, q: WindowRows, segment_ids,
         offset) -> Walk:  # fmt: skip
    """A window's `Walk` (arguments as `presort`'s)."""
    table = segment_table(geo, lists)
    return Walk(table, lists.num_segments, lists.entries,
                *presort(geo, lists, q, segment_ids, offset), q.rows_at())  # fmt: skip


def forward(
    geo: chunks.Geometry,
    tiling: Tiling,
    chunk_walk: Walk,
    k: jax.Array,
    v: jax.Array,
    key_segments: jax.Array,
    student: tuple[jax.Array, jax.Array] | None = None,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Per sorted entry: (o / l [E·Ge, Dh] in q's dtype, lse_e [E·Ge] fp32, -inf for rows that see
    no key of the block; with a student also the block's LSE of the student's logits lse_z_e
    [E·Ge] fp32, alike on all rows of an entry, else None).

    chunk_walk: `walk`; k, v, key_segments: [8, N, K, Dh], [8, N, K, Dh], [8, N] from
    `shifted_keys`; student: (index rows [B·W·K·8, Di] from `index_rows`, index keys [8, N, Di]
    from `shifted_keys`) or None.
    """
    operands = dict(**chunk_walk.operands(), k=k, kseg=key_segments, v=v)
    rows = geo.entries * entry_rows(geo.group)
    outputs = dict(o=jax.ShapeDtypeStruct((rows, geo.head_dim), chunk_walk.q_rows.dtype),
                   lse=jax.ShapeDtypeStruct((rows,), jnp.float32))  # fmt: skip
    if student is not None:
        operands.update(iq=student[0], ik=student[1])
        outputs["lse_z"] = jax.ShapeDtypeStruct((rows,), jnp.float32)
    results = _launch(geo, tiling, operands, outputs, interpret)
    return results["o"], results["lse"], results.get("lse_z")


def kl_pass(
    geo: chunks.Geometry,
    tiling: Tiling,
    chunk_walk: Walk,
    k: jax.Array,
    key_segments: jax.Array,
    student: tuple[jax.Array, jax.Array],
    lses: jax.Array,
    *,
    with_teacher: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Per sorted entry: the block's share of the indexer's KL [E·Ge] fp32 (alike on all rows of
    an entry) and, `with_teacher`, the teacher over the block's keys [E + TEACHER_TAIL, block]
    fp32 (the group's mean probability under the global LSEs: the student's gradients start
    from it, mosaic_student.py; else None; the tail rows are never written), over the same
    segments and chunks as `forward`, given the global LSEs per row `lses` (`row_values` of lse
    and lse_z); the other operands as `forward`'s."""
    operands = dict(**chunk_walk.operands(), k=k, kseg=key_segments, lses=lses,
                    average=averaging(geo, tiling, chunk_walk.q_rows.dtype), iq=student[0],
                    ik=student[1])  # fmt: skip
    kl = jax.ShapeDtypeStruct((geo.entries * entry_rows(geo.group),), jnp.float32)
    outputs = dict(kl=kl)
    if with_teacher:
        # rows past E never stored (`TEACHER_TAIL`: the student's slot copies read them)
        rows = geo.entries + TEACHER_TAIL
        outputs["teacher"] = jax.ShapeDtypeStruct((rows, geo.block_size), jnp.float32)
    results = _launch(geo, tiling, operands, outputs, interpret)
    return results["kl"], results.get("teacher")


def averaging(geo: chunks.Geometry, tiling: Tiling, dtype) -> jax.Array:
    """[R, R]: row r of A averages the G real rows of r's entry (1/G each, exact in 16 bits), so
    that the teacher A·P, the group's mean probability, is one wgmma on P in shared memory (a
    reduction across the rows of a wgmma tile would cross threads and warps)."""
    per_entry, rows = entry_rows(geo.group), jnp.arange(tiling.rows)
    same = rows[:, None] // per_entry == rows[None, :] // per_entry
    real = rows[None, :] % per_entry < geo.group
    return jnp.where(same & real, 1.0 / geo.group, 0.0).astype(dtype)


def _launch(geo: chunks.Geometry, tiling: Tiling, operands: dict, outputs: dict, interpret: bool):
    """One persistent kernel over the segments -> its outputs by name. The forward has operand
    v (P·V; outputs o, lse); the KL pass has lses and average (output kl); index rows and keys
    (iq, ik) add the student's logits z = index_q·index_kᵀ (the forward's output lse_z). With
    two warpgroups (the pass without a student) they take a segment's chunks in
    turn, each with its own ring and stagings, over the block's K and V that warpgroup 0 loads
    once both are done with the last segment's: one's softmax runs while the other's wgmmas do."""
    rows, size, dim, group = tiling.rows, geo.block_size, geo.head_dim, entry_rows(geo.group)
    queries, stages, dtype = geo.chunk_queries, tiling.stages, operands["q"].dtype
    student, kl, keeps_teacher = "iq" in operands, "lses" in operands, "teacher" in outputs
    tiling = dataclasses.replace(tiling, warpgroups=1 if student else tiling.warpgroups)
    groups = tiling.warpgroups
    index_scale = operands["iq"].shape[1] ** -0.5 if student else None
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    block_operands = [name for name in ("k", "v", "kseg", "ik") if name in operands]
    row_operands = ["data", "lses"] if kl else ["data"]

    def kernel(*refs, **smem):
        ref = dict(zip([*operands, *outputs], refs))

        def program(wg: int):
            own = own_buffers(smem, wg)
            if kl:  # the averaging matrix, once a program
                copy_whole(ref, smem, "average", issues=wg == 0)

            def segment_body(index, part):
                del part  # whole blocks
                first, count, tile, shift, key_slot, row_start, head = segment_row(ref, index)
                num_chunks = (count + queries - 1) // queries
                turns = (num_chunks - wg + groups - 1) // groups  # chunks wg, wg + groups, ...
                if groups > 1:  # both have read the last segment's block operands
                    plgpu.barrier_arrive(smem["pair_bar"])
                    plgpu.barrier_wait(smem["pair_bar"])
                keys = (shift, pl.ds(tile * TILE_ROWS, size), head)
                for bar, name in enumerate(block_operands if wg == 0 else []):
                    source = ref[name].at[keys if name in ("k", "v") else keys[:2]]
                    plgpu.copy_gmem_to_smem(source, smem[name], smem["key_bars"].at[bar])

                def fetch(turn):
                    fetch_chunk(geo, ref, own, turn % stages,
                                first + (turn * groups + wg) * queries, ["q"], student,
                                row_operands)  # fmt: skip

                for turn in range(stages):
                    pl.when(turn < turns)(lambda turn=turn: fetch(turn))
                for bar in range(len(block_operands)):
                    plgpu.barrier_wait(smem["key_bars"].at[bar])
                slots = key_slot + plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=col_layout)
                slots = jnp.where(slots >= row_start, slots, NOT_VISIBLE)
                key_segs = plgpu.load(smem["kseg"], layout=col_layout, optimized=False)

                def chunk_body(turn, carry):
                    slot, chunk = turn % stages, turn * groups + wg
                    plgpu.barrier_wait(own["q_bars"].at[slot])
                    plgpu.barrier_wait(own["data_bars"].at[slot])
                    logits = matmul((rows, size), (own["q"].at[slot], smem["k"].transpose((1, 0))))
                    per_row = {name: [plgpu.load(own[name].at[slot, c], layout=row_layout,
                                                 optimized=False) for c in range(2)]
                               for name in row_operands}  # fmt: skip
                    seen = visible(per_row["data"], slots, key_segs, logits.shape)
                    z, results = None, {}
                    if student:
                        z = matmul((rows, size),
                                   (own["iq"].at[slot], smem["ik"].transpose((1, 0))))  # fmt: skip
                    if student and not kl:  # the forward: the block's LSE_z; z is done with
                        _, z_top, z_total = softmax_block(index_scale, z, seen)
                        results["lse_z"] = block_lse(z_top, z_total)
                    # every warp's wgmmas have read the slot's Q and index rows and its loads
                    # its row data (a warpgroup barrier; the proxy fence orders those reads
                    # before the TMA writes)
                    plgpu.commit_smem()
                    pl.when(turn + stages < turns)(lambda: fetch(turn + stages))
                    if kl:
                        results["kl"], teacher = _kl_chunk(own, logits, seen, z, *per_row["lses"])
                    else:
                        results.update(_attention_chunk(own, logits, seen))
                    store_chunk(geo, own, ref, results, (first + chunk * queries) * group,
                                count - chunk * queries)  # fmt: skip
                    if keeps_teacher:  # an entry's rows hold one teacher: its first row is stored
                        store_chunk(geo, own, ref, {"teacher": teacher}, first + chunk * queries,
                                    count - chunk * queries, stored_rows=1)  # fmt: skip
                    return carry

                jax.lax.fori_loop(0, turns, chunk_body, 0)

            program_index = jax.lax.axis_index("sm")
            chunks.for_each_segment((None,) * 4 + (ref["count"],), segment_body,
                                    grid=(program_index, num_programs(tiling)))  # fmt: skip
            plgpu.wait_smem_to_gmem(0)

        if groups == 1:
            return program(0)
        wg = jax.lax.axis_index("wg")
        for index in range(groups):
            pl.when(wg == index)(functools.partial(program, index))

    def _attention_chunk(own, logits, visible):
        """The forward's per-row results of a chunk: o / l (P·V on wgmma) and the block's LSE."""
        probs, top, total = softmax_block(geo.head_dim**-0.5, logits, visible)
        own["p"][...] = probs.astype(dtype)  # the last chunk's P·V has read it
        plgpu.commit_smem()
        out = matmul((rows, dim), (own["p"], own["v"]))
        seen = total > 0
        out = out * broadcast(jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0), out.shape)
        return {"o": out.astype(dtype), "lse": block_lse(top, total)}

    def _kl_chunk(own, logits, visible, z, lse, lse_z):
        """The KL pass' per-row KL share of a chunk and its teacher [R, block]: P =
        exp(S·Dh^-½ - LSE) with the global LSE, the teacher A·P on wgmma, the student's
        log-probabilities. P goes through shared memory as a 16-bit high part and the rest
        (P_high + P_low holds P to ~16 bits, where P_high alone, in bf16, put the KL ~1e-3 off
        the fp32 Triton kernels'); A is exact."""
        probs = normalised(geo.head_dim**-0.5, logits, lse, visible)
        high = probs.astype(dtype)  # the last chunk's teacher has read both parts
        own["p"][...] = high
        own["p_low"][...] = (probs - high.astype(jnp.float32)).astype(dtype)
        plgpu.commit_smem()
        average = own["average"]
        teacher = matmul((rows, size), (average, own["p"]), (average, own["p_low"]))
        return kl_rows(teacher, z * index_scale - broadcast(lse_z, z.shape)), teacher

    kernel.__name__ = "msa_mosaic_kl_pass" if kl else "msa_mosaic_forward"  # profiles show it
    run = plgpu.kernel(
        kernel,
        out_type=tuple(outputs.values()),
        scratch_types=_scratch(geo, tiling, operands, outputs, len(block_operands)),
        grid=(num_programs(tiling),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        # Mosaic GPU's own interpreter (CPU tests); Pallas' generic one knows no TMA or wgmma
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **(dict(num_threads=groups, thread_name="wg") if groups > 1 else {}),
    )
    return dict(zip(outputs, run(*operands.values())))


OWN = "_wg"  # the suffix of a warpgroup's own buffers in `_scratch`: q_wg0, q_wg1, ...


def own_buffers(smem: dict, wg: int) -> dict:
    """Warpgroup `wg`'s view of the kernel's shared memory: its own buffers (ring, stagings,
    their barriers) under their plain names, beside the shared ones (the block's operands)."""
    suffix = f"{OWN}{wg}"
    own = {name: buffer for name, buffer in smem.items() if OWN not in name}
    own.update({name.removesuffix(suffix): buffer for name, buffer in smem.items()
                if name.endswith(suffix)})  # fmt: skip
    return own


def _scratch(geo: chunks.Geometry, tiling: Tiling, operands: dict, outputs: dict, key_copies: int):
    """Shared memory and barriers of `_launch` by name (`shared_bytes` counts the same): the
    block's operands, and per warpgroup (`own_buffers`) the rings of chunk operands, P and the
    output stagings `<output>_out`."""
    rows, size, stages, dtype = tiling.rows, geo.block_size, tiling.stages, operands["q"].dtype

    tiles = functools.partial(tiles_of, dtype)
    index_dim = operands["iq"].shape[1] if "iq" in operands else 0
    scratch = {"k": tiles(size, geo.head_dim), "kseg": plgpu.SMEM((size,), jnp.int32)}
    own = dict(q=tiles(stages, rows, geo.head_dim), data=plgpu.SMEM((stages, 2, rows), jnp.int32),
               p=tiles(rows, size))  # fmt: skip
    if "v" in operands:
        scratch["v"] = tiles(size, geo.head_dim)
    if index_dim:
        scratch["ik"] = tiles(size, index_dim)
        own["iq"] = tiles(stages, rows, index_dim)
    if "lses" in operands:
        scratch.update(average=tiles(rows, rows), average_bar=plgpu.Barrier(num_barriers=1))
        own.update(lses=plgpu.SMEM((stages, 2, rows), jnp.float32), p_low=tiles(rows, size))
    for name, out in outputs.items():
        if name == "teacher":  # fp32 rows stored one by one: unswizzled
            own[f"{name}_out"] = padded_rows(rows, out.shape[1], out.dtype)
        elif len(out.shape) == 2:
            own[f"{name}_out"] = tiles(rows, out.shape[1])
        else:
            own[f"{name}_out"] = plgpu.SMEM((rows,), out.dtype)
    own.update(
        q_bars=plgpu.Barrier(num_arrivals=chunk_copies(geo, 1, index_dim), num_barriers=stages),
        data_bars=plgpu.Barrier(num_arrivals=2 if "lses" in operands else 1, num_barriers=stages),
    )
    scratch["key_bars"] = plgpu.Barrier(num_barriers=key_copies)
    if tiling.warpgroups > 1:
        scratch["pair_bar"] = plgpu.Barrier(num_arrivals=tiling.warpgroups)
    for wg in range(tiling.warpgroups):
        scratch.update({f"{name}{OWN}{wg}": buffer for name, buffer in own.items()})
    return scratch
