"""MSA sparse attention forward on Hopper GPUs in one Pallas Mosaic GPU kernel (no student).

Key-block-major like `forward_kernels.py`, but in one pass: per segment (one key block of one
(row, kv head), `block_lists.py`) the block's K and V are TMA-copied into shared memory once; per
chunk of R = chunk_queries·Ge rows the kernel computes S = Q·Kᵀ·Dh^-½ on wgmma, masks it, takes
the row max m and sum l of P = exp(S - m) over the block alone, and computes O = P·V on wgmma (P
through shared memory: Mosaic GPU's interpreter takes no register operand for wgmma). It
stores each row's o / l and lse_e = m + log l; an XLA combine over each query's k selections
(`combine`) turns those into the output and the per-(query, head) LSE. The Triton path's separate
LSE pass (a second Q·Kᵀ) is not needed.

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
reused. A segment's own K and V copies are not overlapped with the previous segment's math (one
warpgroup, no warp specialisation yet).

On the H200 at M3's layout (64 q / 4 kv heads, Dh 128, top-16, S = 32K), the attention forward
without a student took 14.3 ms against the Triton path's 28.4 (kernel 8.8 ms against 22.9 for
the LSE and forward passes); at 128K, 58 ms against 119 (benchmarks/bench_msa.py
--forward-kernels).

Outputs are o / l in q's dtype (normalised per block, so within V's range: bf16 keeps the
kernel's store and the combine's read at half the bytes of fp32, and the Triton path's per-entry
shares are q's dtype too) and lse_e in fp32 (the combine exponentiates differences of LSEs).

A chunk at the end of a block's list holds fewer than chunk_queries valid entries; the entries
after them belong to the next block's list, whose program writes them. The last chunk of a list is
therefore stored query by query (one TMA copy of Ge rows each, under `pl.when`: the interpreter
has no predicated copies), the others in one copy.

Shapes: B batch, S sequence, H query heads, K kv heads, G = H // K, Ge = max(G, 8) rows per
entry, Dh head dim, k selections per query, W queries per window, E = B·W·K·k entries, R =
chunk_queries·Ge rows of a chunk, block = block_size keys.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_smem import swizzled
from pallas_kernels.msa import block_lists, chunks

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
BLOCK_SIZES = (128,)  # one wgmma N / K tile of keys per block
HEAD_DIM_MULTIPLE = 64  # the swizzled tiles' minor size in 16-bit elements
WARPGROUP_ROWS = (64,)  # wgmma M of the one warpgroup; 128 rows would spill its registers
NOT_VISIBLE = jnp.iinfo(jnp.int32).max  # key slot of keys outside the block's row
TILE_ROWS = 8  # rows of a swizzled shared-memory tile: TMA row offsets are multiples of it
TABLE_COLUMNS = 7  # of `segment_table`
SHARED_BYTES = 227 * 1024  # the H200's shared memory per program


def entry_rows(group: int) -> int:
    """Ge: rows of one entry (its G heads, zero-padded to a whole tile)."""
    return max(group, TILE_ROWS)


def gathers_queries(group: int) -> bool:
    """Whether the kernel TMA-copies each entry's G rows straight from q (G a whole number of
    tiles: a query's heads of one kv head are G consecutive rows) rather than from rows XLA
    gathered (G < 8)."""
    return group % TILE_ROWS == 0


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch parameters of the Mosaic kernel (defaults not yet tuned on the H200)."""

    rows: int = 64  # R = chunk_queries · Ge rows per chunk
    segment_chunks: int = 16  # chunks per segment: K/V loads amortised vs. load balance
    stages: int = 2  # Q buffers in flight
    # `shared_bytes` at Dh = 128, stages = 2: 130 KiB, so a second program does not fit an SM
    programs_per_core: int = 1

    def chunk_queries(self, group: int) -> int:
        if self.rows % entry_rows(group):
            raise ValueError(f"Tiling.rows={self.rows} is not whole entries of G={group} heads")
        return self.rows // entry_rows(group)


def shared_bytes(tiling: Tiling, head_dim: int, block_size: int, itemsize: int = 2) -> int:
    """Shared memory of one program: K, V, the Q ring, P, the output staging, row data."""
    tiles = (2 * block_size + (tiling.stages + 1) * tiling.rows) * head_dim
    tiles += tiling.rows * block_size  # P
    return tiles * itemsize + 4 * (block_size + (2 * tiling.stages + 1) * tiling.rows)


def unsupported_reason(dtype, group: int, head_dim: int, block_size: int, tiling: Tiling) -> str:
    """Why the Mosaic kernel can't take these operands ('' when it can)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float16"
    if tiling.rows not in WARPGROUP_ROWS:
        return f"mosaic rows={tiling.rows} is not one of {WARPGROUP_ROWS}"
    per_entry = entry_rows(group)
    if tiling.rows % per_entry or (tiling.rows // per_entry) & (tiling.rows // per_entry - 1):
        return (
            f"mosaic rows={tiling.rows} are not a power-of-two number of queries of {group} heads"
        )
    if head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim={head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}"
    if block_size not in BLOCK_SIZES:
        return f"block_size={block_size} is not one of {BLOCK_SIZES}"
    if (needed := shared_bytes(tiling, head_dim, block_size)) > SHARED_BYTES:
        return f"head_dim={head_dim} needs {needed} bytes of shared memory (> {SHARED_BYTES})"
    return ""


def num_programs(tiling: Tiling) -> int:
    """Persistent programs: `programs_per_core` per SM (3 under the CPU interpreter)."""
    device = jax.devices()[0]
    cores = device.core_count if device.platform == "gpu" else 3
    return cores * tiling.programs_per_core


# ---------------------------------------------------------------------------------------------
# XLA side: operands in sorted entry order, and the combine over selections


def segment_table(geo: chunks.Geometry, lists: block_lists.BlockLists, segment_chunks: int):
    """[E, TABLE_COLUMNS] int32 per segment (rows past num_segments are junk, never read): sorted
    position of
    its first entry, its number of entries, the padded K/V row of the block window's first key as
    tile·8 + shift (its aligned row tile·8 in the shifted copy `shift`), that key's global slot
    b·S + slot, b·S, and the kv head."""
    seq, size = geo.seq, geo.block_size
    key = lists.keys[lists.segment_starts]
    pair, offset = key // (2 * seq), key % (2 * seq)
    batch, head = pair // geo.num_kv_heads, pair % geo.num_kv_heads
    # a block entirely before its row (document started earlier) still reads in-bounds rows
    window = jnp.maximum(offset - seq, -size)
    end = jnp.searchsorted(lists.keys, key, side="right").astype(jnp.int32)
    count = jnp.minimum(end - lists.segment_starts, segment_chunks * geo.chunk_queries)
    row_start = batch * seq
    kv_row = size + row_start + window
    columns = (lists.segment_starts, count, kv_row // TILE_ROWS, kv_row % TILE_ROWS,
               row_start + window, row_start, head)  # fmt: skip
    assert len(columns) == TABLE_COLUMNS
    return jnp.stack(columns, axis=1).astype(jnp.int32)


def presort(geo: chunks.Geometry, lists: block_lists.BlockLists, q, segment_ids, offset):
    """The kernel's Q operand and row data [2, E·Ge + R] int32 (query's global slot, its segment
    id) in sorted entry order, Ge rows per entry, padded by one chunk so every chunk's copy is in
    bounds. Q: the window's rows [B·W·H, Dh] as they are where the kernel copies each entry's
    rows itself (`gathers_queries`), else Q rows [E·Ge + R, Dh] in sorted entry order (an XLA
    gather: as many bytes as the kernel's output, written and read once more).

    q: [B, W, H, Dh] the window's queries; segment_ids: [B, S]; offset: slot of query 0.
    """
    per_query = geo.num_kv_heads * geo.topk
    query = lists.entries // per_query  # b·W + i
    head = (lists.entries // geo.topk) % geo.num_kv_heads
    batch, index = query // geo.window, query % geo.window
    grouped = q.reshape(geo.batch * geo.window, geo.num_kv_heads, geo.group, geo.head_dim)
    per_entry, pad = entry_rows(geo.group), geo.chunk_queries
    slot = jnp.minimum(offset + index, geo.seq - 1)  # padded queries of the last window: invalid
    data = jnp.stack([batch * geo.seq + slot, segment_ids.astype(jnp.int32)[batch, slot]])
    data = jnp.repeat(jnp.pad(data, [(0, 0), (0, pad)]), per_entry, axis=1)
    if gathers_queries(geo.group):
        return q.reshape(-1, geo.head_dim), data
    padded = (jnp.pad(query, (0, pad)), jnp.pad(head, (0, pad)))  # one gather writes the pad
    rows = jnp.pad(grouped[padded], [(0, 0), (0, per_entry - geo.group), (0, 0)])
    return rows.reshape(-1, geo.head_dim), data


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


def combine(geo: chunks.Geometry, lists, valid, o, lse):
    """Per-entry (o / l [E·G, Dh], lse_e [E·G]) -> (out [B, W, H, Dh] fp32, lse [B, W, K, G]):
    lse = logsumexp over the query's k selections, out = Σ_j exp(lse_j - lse)·o_j; a (query,
    head) that sees no key has lse = -inf and out = 0."""
    shape = (geo.batch, geo.window, geo.num_kv_heads, geo.topk)
    ok, per_entry, g = valid.reshape(*shape, 1), entry_rows(geo.group), geo.group
    lse_j = block_lists.by_selection(lse.reshape(-1, per_entry)[:, :g], lists, shape)
    lse_j = jnp.where(ok, lse_j, -jnp.inf)
    total = jax.nn.logsumexp(lse_j, axis=3)
    weights = jnp.exp(lse_j - jnp.where(jnp.isfinite(total), total, 0.0)[:, :, :, None])
    o_j = block_lists.by_selection(o.reshape(-1, per_entry, geo.head_dim)[:, :g], lists, shape)
    # unused slots were never written; an elementwise product and a sum over j fuse with the
    # gather into one pass (as an einsum, XLA transposed o_j for a dot first: 11 of the 31 ms
    # of the attention forward at S = 32K on the H200)
    shares = jnp.where(ok[..., None], weights[..., None] * o_j.astype(jnp.float32), 0.0)
    out = shares.sum(axis=3)
    return out.reshape(geo.batch, geo.window, geo.num_heads, geo.head_dim), total


# ---------------------------------------------------------------------------------------------
# The kernel


def _softmax_block(geo: chunks.Geometry, scores, visible):
    """Logits [R, block] fp32 and their mask -> (P = exp(S·Dh^-½ - m) fp32, row max m, row sum
    l), in base 2 (m in log2 units: exp2 of one fused multiply-add per element); rows that see
    nothing get m = 0, l = 0, P = 0."""
    log2e = math.log2(math.e)
    scaled = jnp.where(visible, scores * (geo.head_dim**-0.5 * log2e), -jnp.inf)
    top = scaled.max(axis=1)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    probs = jnp.exp2(scaled - jax.lax.broadcast_in_dim(top, scaled.shape, [0]))
    return probs, top, probs.sum(axis=1)


def _visible(query_data, key_slots, key_segments, shape):
    """[R, block] bool: key in the query's document, not after it, in the block's row."""
    slot, segment = query_data
    return (jax.lax.broadcast_in_dim(key_segments, shape, [1])
            == jax.lax.broadcast_in_dim(segment, shape, [0])) & (
        jax.lax.broadcast_in_dim(key_slots, shape, [1])
        <= jax.lax.broadcast_in_dim(slot, shape, [0]))  # fmt: skip


def forward(
    geo: chunks.Geometry,
    tiling: Tiling,
    table: jax.Array,
    num_segments: jax.Array,
    entries: jax.Array,
    q_rows: jax.Array,
    row_data: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_segments: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per sorted entry: (o / l [E·Ge, Dh] in q's dtype, lse_e [E·Ge] fp32, -inf for rows that see
    no key of the block).

    table: `segment_table`; num_segments: [1]; entries: [E] `BlockLists.entries` (the flat
    selection ((b·W + i)·K + h)·k + j of each sorted entry); q_rows, row_data: `presort`; k, v,
    key_segments: [8, N, K, Dh], [8, N, K, Dh], [8, N] from `shifted_keys`.
    """
    rows, size, dim, group = tiling.rows, geo.block_size, geo.head_dim, entry_rows(geo.group)
    queries, stages, dtype = geo.chunk_queries, tiling.stages, q_rows.dtype
    programs = num_programs(tiling)
    direct = gathers_queries(geo.group)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def kernel(table_ref, count_ref, entries_ref, q_ref, data_ref, k_ref, v_ref, kseg_ref, o_ref,
               lse_ref, k_smem, v_smem, kseg_smem, q_smem, data_smem, p_smem, o_smem, lse_smem,
               key_bars, q_bars, data_bars):  # fmt: skip
        def segment_body(index, part):
            del part  # whole blocks
            first, count, tile, shift, key_slot, row_start, head = (
                table_ref[index, column] for column in range(TABLE_COLUMNS)
            )
            num_chunks = (count + queries - 1) // queries
            keys = (shift, pl.ds(tile * TILE_ROWS, size), head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, key_bars.at[0])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, key_bars.at[1])
            plgpu.copy_gmem_to_smem(kseg_ref.at[keys[:2]], kseg_smem, key_bars.at[2])

            def fetch(chunk):
                slot, start = chunk % stages, (first + chunk * queries) * group
                if direct:  # each entry's G rows from q (entries past the list: never stored)
                    for query in range(queries):
                        position = jnp.minimum(first + chunk * queries + query, geo.entries - 1)
                        row = entries_ref[position] // geo.topk * group  # ((b·W + i)·K + h)·G
                        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row, group)],
                                                q_smem.at[slot, pl.ds(query * group, group)],
                                                q_bars.at[slot])  # fmt: skip
                else:
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(start, rows)], q_smem.at[slot],
                                            q_bars.at[slot])  # fmt: skip
                plgpu.copy_gmem_to_smem(data_ref.at[:, pl.ds(start, rows)], data_smem.at[slot],
                                        data_bars.at[slot])  # fmt: skip

            for chunk in range(stages):
                pl.when(chunk < num_chunks)(lambda chunk=chunk: fetch(chunk))
            for bar in range(3):
                plgpu.barrier_wait(key_bars.at[bar])
            slots = key_slot + plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=col_layout)
            slots = jnp.where(slots >= row_start, slots, NOT_VISIBLE)
            key_segs = plgpu.load(kseg_smem, layout=col_layout, optimized=False)

            def chunk_body(chunk, carry):
                slot = chunk % stages
                plgpu.barrier_wait(q_bars.at[slot])
                plgpu.barrier_wait(data_bars.at[slot])

                def scores(acc):
                    plgpu.wgmma(acc, q_smem.at[slot], k_smem.transpose((1, 0)))
                    return acc[...]

                logits = pl.run_scoped(scores, plgpu.ACC((rows, size), jnp.float32))
                query_data = [plgpu.load(data_smem.at[slot, c], layout=row_layout,
                                         optimized=False) for c in range(2)]  # fmt: skip
                # every warp's wgmma has read the slot's Q and its loads its row data (a
                # warpgroup barrier; the proxy fence orders those reads before the TMA writes)
                plgpu.commit_smem()
                pl.when(chunk + stages < num_chunks)(lambda: fetch(chunk + stages))
                visible = _visible(query_data, slots, key_segs, logits.shape)
                probs, top, total = _softmax_block(geo, logits, visible)

                p_smem[...] = probs.astype(dtype)  # the last chunk's P·V has read it
                plgpu.commit_smem()

                def values(acc):
                    plgpu.wgmma(acc, p_smem, v_smem)
                    return acc[...]

                out = pl.run_scoped(values, plgpu.ACC((rows, dim), jnp.float32))
                seen = total > 0
                scale = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
                out = out * jax.lax.broadcast_in_dim(scale, out.shape, [0])
                lse = jnp.where(seen, (top + jnp.log2(jnp.where(seen, total, 1.0))) * math.log(2),
                                -jnp.inf)  # fmt: skip
                _store(
                    o_smem,
                    lse_smem,
                    o_ref,
                    lse_ref,
                    out.astype(dtype),
                    lse,
                    (first + chunk * queries) * group,
                    count - chunk * queries,
                )
                return carry

            jax.lax.fori_loop(0, num_chunks, chunk_body, 0)

        program = jax.lax.axis_index("sm")
        chunks.for_each_segment((None,) * 4 + (count_ref,), segment_body,
                                grid=(program, programs))  # fmt: skip
        plgpu.wait_smem_to_gmem(0)

    def _store(o_smem, lse_smem, o_ref, lse_ref, out, lse, start, valid_queries):
        """Stage a chunk's rows in shared memory and TMA-store its valid queries' rows."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's stores have read
        o_smem[...] = out
        lse_smem[...] = lse
        plgpu.commit_smem()
        whole = valid_queries >= queries

        @pl.when(whole)
        def _():
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(start, rows)], commit_group=False)
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[pl.ds(start, rows)], commit_group=False)

        for query in range(queries):  # a list's last chunk: query by query

            @pl.when(~whole & (query < valid_queries))
            def _(query=query):
                some, target = pl.ds(query * group, group), pl.ds(start + query * group, group)
                plgpu.copy_smem_to_gmem(o_smem.at[some], o_ref.at[target], commit_group=False)
                plgpu.copy_smem_to_gmem(lse_smem.at[some], lse_ref.at[target],
                                        commit_group=False)  # fmt: skip

        plgpu.commit_smem_to_gmem_group()

    out_rows = geo.entries * group
    scratch = (
        plgpu.SMEM((size, dim), dtype, transforms=swizzled(dim, dtype)),
        plgpu.SMEM((size, dim), dtype, transforms=swizzled(dim, dtype)),
        plgpu.SMEM((size,), jnp.int32),
        plgpu.SMEM((stages, rows, dim), dtype, transforms=swizzled(dim, dtype)),
        plgpu.SMEM((stages, 2, rows), jnp.int32),
        plgpu.SMEM((rows, size), dtype, transforms=swizzled(size, dtype)),
        plgpu.SMEM((rows, dim), dtype, transforms=swizzled(dim, dtype)),
        plgpu.SMEM((rows,), jnp.float32),
        plgpu.Barrier(num_barriers=3),
        plgpu.Barrier(num_arrivals=queries if direct else 1, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )
    run = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((out_rows, dim), dtype),
            jax.ShapeDtypeStruct((out_rows,), jnp.float32),
        ),  # fmt: skip
        scratch_types=scratch,
        grid=(programs,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        # Mosaic GPU's own interpreter (CPU tests); Pallas' generic one knows no TMA or wgmma
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return run(table, num_segments, entries, q_rows, row_data, k, v, key_segments)
