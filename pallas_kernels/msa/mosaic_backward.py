"""MSA sparse attention backward on Hopper GPUs in Pallas Mosaic GPU kernels
(`Config.backward_kernel="mosaic"`): the math of `backward_kernel.backward_pass` on TMA-fed
shared-memory rings and wgmma.

Walks the forward's segments and chunks (mosaic_forward.py: `walk`, `shifted_keys`, the Q-row
scheme; dO rows in Q's order, `sorted_rows`), each segment as two items of 64 keys, one per key
half of the block: a warpgroup's dK and dV sums of 64 keys × Dh fp32 take 128 registers a thread,
those of 128 keys would not fit. Per item the half's K and V are TMA-copied once; per chunk Q and
dO go through a ring of `stages` slots, with per-row data (slot, segment id) and values (LSE, δ =
Σ dO·O). The tiles are transposed, keys along the wgmma M of 64 rows: Sᵀ = K·Qᵀ, Pᵀ = exp(Sᵀ·Dh^-½
- LSE) (masked), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ - δ)·Dh^-½; Pᵀ and dSᵀ go to shared memory in q's
dtype for dV += Pᵀ·dO, dK += dSᵀ·Q (accumulators carried over the chunks) and the chunk's dQ
share dS·K_half = (dSᵀ)ᵀ·K_half, stored per entry and key half (pallas.py adds a query's shares).

A block's list can span several segments, taken by different programs, and Mosaic GPU has no
convenient atomics: each item stores its dK, dV sums [64, Dh] fp32 at its own rows of a
per-segment buffer (`segment_bound` segments) and XLA adds them into the keys' rows
(`sum_partials`; a key's contributions from blocks of other documents are exact zeros, P = 0).

With the indexer's student a second kernel (`student_gradients`) walks the same items: Sᵀ and
Pᵀ again (global LSE), the teacher Pᵀ·Aᵀ (the forward's averaging matrix, P in two 16-bit parts),
the student's logits zᵀ = index_k·index_qᵀ and probabilities exp(zᵀ·Di^-½ - LSE_z), d_zᵀ =
(student - teacher)·d_kl·Di^-½ on each entry's first row (its other rows repeat it); d(index_k)
+= d_zᵀ·index_q per item as dK is, d(index_q) shares (d_zᵀ)ᵀ·index_k per entry (8 rows an entry,
its first the share). Its own kernel keeps the main one's registers at dK and dV.

On the H200 at M3's layout (64 q / 4 kv heads, Dh 128, index 4×128, top-16, bf16), the layer's
forward+backward with the Mosaic forward and the student took 359 ms at S = 128K against 497 ms
with the Triton backward (cuDNN dense: 1,747 ms), and 80 ms against 118 at 32K (cuDNN: 109); a
profile at 128K: 89 ms in the gradients kernel, 109 ms in the student's (benchmarks/bench_msa.py
--backward-kernels).

Shapes: as mosaic_forward.py's; P = 64 keys of an item (KEY_PARTS = 2 per block).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.msa import block_lists, chunks, mosaic_forward
from pallas_kernels.msa.mosaic_chunks import (
    TILE_ROWS,
    broadcast,
    chunk_copies,
    copy_whole,
    entry_rows,
    fetch_chunk,
    matmul,
    normalised,
    segment_row,
    store_chunk,
    tiles,
    visible,
)
from pallas_kernels.msa.mosaic_forward import NOT_VISIBLE, SHARED_BYTES, Tiling

KEY_PARTS = 2  # items per segment: key halves, so that dK and dV fit one warpgroup's registers
PART_KEYS = 64  # keys of an item: one wgmma M
WGMMA = plgpu.Layout.WGMMA


def shared_bytes(
    tiling: Tiling, head_dim: int, index_dim: int = 0, itemsize: int = 2
) -> int:
    """Shared memory of one program of either kernel (`_scratch` allocates the same): the key
    half's operands, the rings, Pᵀ and dSᵀ (Pᵀ's two parts, d_zᵀ), the output staging (dQ rows;
    the fp32 sums), key segment ids and per-row words; the larger of the two kernels."""
    rows, stages, keys = tiling.rows, tiling.stages, PART_KEYS
    tiles_ = (2 * keys + 2 * stages * rows + rows) * head_dim + 2 * keys * rows
    main = tiles_ * itemsize + 4 * (keys * head_dim + keys + 4 * stages * rows)
    if not index_dim:
        return main
    tiles_ = (keys + stages * rows) * (head_dim + index_dim) + 3 * keys * rows + rows * rows
    words = keys + 5 * stages * rows + keys * index_dim + rows * index_dim
    return max(main, tiles_ * itemsize + 4 * words)


def unsupported_reason(
    dtype, group: int, head_dim: int, block_size: int, tiling: Tiling, index_dim: int = 0
) -> str:
    """Why the Mosaic backward can't take these operands ('' when it can): the forward's limits
    (`mosaic_forward.unsupported_reason`: dtype, tiles, block size) and its own shared memory."""
    reason = mosaic_forward.unsupported_reason(
        dtype, group, head_dim, block_size, tiling, index_dim
    )
    if reason or (needed := shared_bytes(tiling, head_dim, index_dim)) <= SHARED_BYTES:
        return reason
    return (
        f"head_dim={head_dim}, index_head_dim={index_dim} need {needed} bytes of shared memory "
        f"in the backward (> {SHARED_BYTES})"
    )


def segment_bound(geo: chunks.Geometry, tiling: Tiling) -> int:
    """Segments the per-segment sums make room for: the segments that continue a block's list
    (each after segment_chunks whole chunks of it, so at most E / (segment_chunks·chunk_queries))
    and the blocks' first segments, here at most 2·ceil(S / block) + 2 blocks per (row, kv head),
    i.e. rows of up to ceil(S / block) + 2 documents, and never more than E. pallas.py runs a
    window of more segments through the Triton backward (`sum_partials` would return NaN)."""
    continuing = geo.entries // (tiling.segment_chunks * geo.chunk_queries)
    blocks = geo.batch * geo.num_kv_heads * (2 * -(-geo.seq // geo.block_size) + 2)
    return min(geo.entries, continuing + blocks)


def sum_partials(geo: chunks.Geometry, table, num_segments, partials, bound: int, heads: int):
    """Per-item sums [bound·KEY_PARTS·64, D] -> their sum per key [B, S, heads, D] fp32 (heads:
    K for dK and dV, 1 for d(index_k), which its one key head gets from every kv head); NaN
    everywhere when the window had more segments than `bound`."""
    keys = jax.ShapeDtypeStruct((geo.batch, geo.seq), jnp.int8)
    rows = jax.eval_shape(functools.partial(mosaic_forward.pad_keys, block_size=geo.block_size),
                          keys)  # fmt: skip
    segment = jnp.arange(bound)
    first_key = table[:bound, 2] * TILE_ROWS + table[:bound, 3]  # padded row of the window
    key = first_key[:, None] + jnp.arange(KEY_PARTS * PART_KEYS)[None, :]
    target = key * heads + (table[:bound, 6:7] if heads > 1 else 0)
    target = jnp.where((segment < num_segments[0])[:, None], target, rows.shape[0] * heads)
    width = partials.shape[-1]
    total = jnp.zeros((rows.shape[0] * heads, width), jnp.float32)
    total = total.at[target.reshape(-1)].add(partials.reshape(-1, width), mode="drop")
    total = jnp.where(num_segments[0] > bound, jnp.nan, total)
    total = total.reshape(rows.shape[0], heads, width)[geo.block_size :][: geo.total_slots]
    return total.reshape(geo.batch, geo.seq, heads, width)


def window_gradients(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
                     window: dict, keys, student=None, *, interpret: bool = False):  # fmt: skip
    """One window's gradients: (dq shares [KEY_PARTS, E, G, Dh] in q's dtype at sorted
    positions, dk and dv sums [B, S, K, Dh] fp32; with a student also d(index_q) shares
    [KEY_PARTS, E, Di] fp32 and d(index_k) sums [B, S, 1, Di] fp32, else None, None).

    window: q, d_out [B, W, H, Dh], lse, delta [B, W, K, G], segment_ids [B, S], offset; with a
    student also lse_z, d_kl [B, W, K]. keys: `shifted_keys` of k, v, segment ids; student:
    (`index_rows` of the window's index_q, `shifted_keys` of index_k) or None.
    """
    w = window
    chunk_walk = mosaic_forward.walk(geo, tiling, lists, w["q"], w["segment_ids"], w["offset"])
    bound = segment_bound(geo, tiling)
    operands = dict(**chunk_walk.operands(),
                    do=mosaic_forward.sorted_rows(geo, lists, w["d_out"]))  # fmt: skip
    operands["count"] = jnp.minimum(operands["count"], bound)
    per_entry = entry_rows(geo.group)
    rows = KEY_PARTS * geo.entries * per_entry
    sums = jax.ShapeDtypeStruct((bound * KEY_PARTS * PART_KEYS, geo.head_dim), jnp.float32)
    outputs = dict(dq=jax.ShapeDtypeStruct((rows, geo.head_dim), w["q"].dtype), dk=sums, dv=sums)
    values = mosaic_forward.row_values(geo, lists, [w["lse"], w["delta"]])
    results = _launch(geo, tiling, dict(operands, k=keys[0], v=keys[1], kseg=keys[2],
                                        values=values), outputs, interpret)  # fmt: skip
    summed = functools.partial(sum_partials, geo, chunk_walk.table, lists.num_segments,
                               bound=bound)  # fmt: skip
    dq = results["dq"].reshape(KEY_PARTS, geo.entries, per_entry, -1)[:, :, : geo.group]
    dk, dv = (summed(results[name], heads=geo.num_kv_heads) for name in ("dk", "dv"))
    if student is None:
        return dq, dk, dv, None, None
    index_dim = student[0].shape[1]
    sums = jax.ShapeDtypeStruct((bound * KEY_PARTS * PART_KEYS, index_dim), jnp.float32)
    shares = jax.ShapeDtypeStruct((KEY_PARTS * geo.entries * TILE_ROWS, index_dim), jnp.float32)
    values = mosaic_forward.row_values(geo, lists, [w["lse"]], [w["lse_z"], w["d_kl"]])
    average = mosaic_forward.averaging(geo, tiling, w["q"].dtype).T
    results = _launch(geo, tiling, dict(operands, k=keys[0], kseg=keys[2], iq=student[0],
                                        ik=student[1], values=values, average=average),
                      dict(diq=shares, dik=sums), interpret)  # fmt: skip
    diq = results["diq"].reshape(KEY_PARTS, geo.entries, TILE_ROWS, index_dim)[:, :, 0]
    return dq, dk, dv, diq, summed(results["dik"], heads=1)


def _zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)


def _wgmmas(interpret: bool, initial, *products):
    """Accumulators initialised from `initial` (fp32 in the WGMMA layout) plus, for each, the
    sum of its products [(a, b), ...] on wgmma; one wait for all. On the GPU the accumulators
    start from `initial` in place (`run_state`, no second copy of dK, dV in registers); Mosaic
    GPU's interpreter has no `run_state`, so there fresh accumulators are added to `initial`."""
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


def _launch(geo: chunks.Geometry, tiling: Tiling, operands: dict, outputs: dict, interpret: bool):
    """One persistent kernel over the (segment, key half) items -> its outputs by name: the
    gradients kernel (operands v, do; outputs dq, dk, dv) or the student's (operands iq, ik,
    average; outputs diq, dik). Outputs of one row per chunk row are stored per chunk, the others
    (sums) per item."""
    rows, stages, dtype = tiling.rows, tiling.stages, operands["q"].dtype
    queries, per_entry = geo.chunk_queries, entry_rows(geo.group)
    student = "iq" in operands
    row_layout, col_layout = WGMMA.reduce(1), WGMMA.reduce(0)
    block_operands = [name for name in ("k", "v", "kseg", "ik") if name in operands]
    matrices = ["q"] if student else ["q", "do"]
    sums = ["dik"] if student else ["dk", "dv"]
    per_chunk = [name for name in outputs if name not in sums]
    chunk_math = functools.partial(_student_chunk if student else _gradients_chunk, geo, dtype,
                                   functools.partial(_wgmmas, interpret))  # fmt: skip
    stored_rows = TILE_ROWS if student else per_entry
    tile = (PART_KEYS, rows)

    def kernel(*refs, **smem):
        ref = dict(zip([*operands, *outputs], refs))
        if student:
            copy_whole(ref, smem, "average")

        def item_body(index, part):
            first, count, tile_row, shift, key_slot, row_start, head = segment_row(ref, index)
            num_chunks = (count + queries - 1) // queries
            window = pl.ds(tile_row * TILE_ROWS + part * PART_KEYS, PART_KEYS)
            for bar, name in enumerate(block_operands):  # [8, N, K, D] per head, else [8, N, ...]
                keys = (shift, window, head) if name in ("k", "v") else (shift, window)
                plgpu.copy_gmem_to_smem(ref[name].at[keys], smem[name], smem["key_bars"].at[bar])

            def fetch(chunk):
                fetch_chunk(geo, ref, smem, chunk % stages, first + chunk * queries, matrices,
                            student, ["data", "values"])  # fmt: skip

            for chunk in range(stages):
                pl.when(chunk < num_chunks)(lambda chunk=chunk: fetch(chunk))
            for bar in range(len(block_operands)):
                plgpu.barrier_wait(smem["key_bars"].at[bar])
            slots = key_slot + part * PART_KEYS + plgpu.broadcasted_iota(
                jnp.int32, (PART_KEYS,), 0, layout=row_layout
            )
            slots = jnp.where(slots >= row_start, slots, NOT_VISIBLE)
            key_segs = plgpu.load(smem["kseg"], layout=row_layout, optimized=False)
            column = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=col_layout)

            def chunk_body(chunk, accumulators):
                slot, valid = chunk % stages, count - chunk * queries
                plgpu.barrier_wait(smem["q_bars"].at[slot])
                plgpu.barrier_wait(smem["data_bars"].at[slot])
                query_slot, segment, *values = (
                    plgpu.load(smem[name].at[slot, c], layout=col_layout, optimized=False)
                    for name in ("data", "values") for c in range(smem[name].shape[1])
                )  # fmt: skip
                # rows past the block's list (the next block's entries) see no key
                query_slot = jnp.where(column // per_entry < valid, query_slot, -1)
                seen = visible((query_slot, segment), slots, key_segs, tile, key_axis=0)
                accumulators, results = chunk_math(smem, slot, seen, values, accumulators,
                                                   column)  # fmt: skip
                # every warp's wgmmas and loads have read the slot (a warpgroup barrier; the
                # proxy fence orders those reads before the TMA writes)
                plgpu.commit_smem()
                pl.when(chunk + stages < num_chunks)(lambda: fetch(chunk + stages))
                start = (part * geo.entries + first + chunk * queries) * stored_rows
                store_chunk(geo, smem, ref, dict(zip(per_chunk, results)), start, valid,
                            stored_rows)  # fmt: skip
                return accumulators

            width = smem["sum_out"].shape[1]
            accumulators = tuple(_zeros((PART_KEYS, width)) for _ in sums)
            accumulators = jax.lax.fori_loop(0, num_chunks, chunk_body, accumulators)
            target = pl.ds((index * KEY_PARTS + part) * PART_KEYS, PART_KEYS)
            for name, value in zip(sums, accumulators):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last store read
                smem["sum_out"][...] = value
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(smem["sum_out"], ref[name].at[target])

        program = jax.lax.axis_index("sm")
        chunks.for_each_segment((None,) * 4 + (ref["count"],), item_body, KEY_PARTS,
                                grid=(program, mosaic_forward.num_programs(tiling)))  # fmt: skip
        plgpu.wait_smem_to_gmem(0)

    # profiles show the kernel by its function's name
    kernel.__name__ = "msa_mosaic_student_backward" if student else "msa_mosaic_backward"
    run = plgpu.kernel(
        kernel,
        out_type=tuple(outputs.values()),
        scratch_types=_scratch(geo, tiling, operands, len(block_operands), student),
        grid=(mosaic_forward.num_programs(tiling),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return dict(zip(outputs, run(*operands.values())))


def _gradients_chunk(geo, dtype, wgmmas, smem, slot, seen, values, accumulators, column):
    """A chunk's dK, dV sums and dQ share (module docstring)."""
    del column
    lse, delta = values
    dk, dv = accumulators
    q, d_out, scale = smem["q"].at[slot], smem["do"].at[slot], geo.head_dim**-0.5
    tile = (PART_KEYS, q.shape[0])
    logits, d_probs = wgmmas((_zeros(tile), _zeros(tile)), [(smem["k"], q.transpose((1, 0)))],
                              [(smem["v"], d_out.transpose((1, 0)))])  # fmt: skip
    probs = normalised(scale, logits, lse, seen, axis=1)
    d_logits = probs * (d_probs - broadcast(delta, tile, 1)) * scale
    smem["p"][...] = probs.astype(dtype)  # the last chunk's wgmmas have read P and dS
    smem["ds"][...] = d_logits.astype(dtype)
    plgpu.commit_smem()
    dk, dv, dq = wgmmas(
        (dk, dv, _zeros((q.shape[0], geo.head_dim))), [(smem["ds"], q)], [(smem["p"], d_out)],
        [(smem["ds"].transpose((1, 0)), smem["k"])],
    )  # fmt: skip
    return (dk, dv), [dq.astype(dtype)]


def _student_chunk(geo, dtype, wgmmas, smem, slot, seen, values, accumulators, column):
    """A chunk's d(index_k) sums and d(index_q) shares (module docstring)."""
    lse, lse_z, d_kl = values
    (dik,) = accumulators
    q, iq = smem["q"].at[slot], smem["iq"].at[slot]
    tile, index_scale = (PART_KEYS, q.shape[0]), iq.shape[1] ** -0.5
    logits, z = wgmmas((_zeros(tile), _zeros(tile)), [(smem["k"], q.transpose((1, 0)))],
                        [(smem["ik"], iq.transpose((1, 0)))])  # fmt: skip
    probs = normalised(geo.head_dim**-0.5, logits, lse, seen, axis=1)
    high = probs.astype(dtype)  # the last chunk's wgmmas have read both parts and d_z
    smem["p"][...] = high
    smem["p_low"][...] = (probs - high.astype(jnp.float32)).astype(dtype)
    plgpu.commit_smem()
    average = smem["average"]
    teacher = matmul(tile, (smem["p"], average), (smem["p_low"], average))
    student = normalised(index_scale, z, lse_z, seen, axis=1)
    first_rows = column % entry_rows(geo.group) == 0  # an entry's other rows repeat its first
    d_kl = jnp.where(first_rows, d_kl * index_scale, 0.0)
    smem["dz"][...] = ((student - teacher) * broadcast(d_kl, tile, 1)).astype(dtype)
    plgpu.commit_smem()
    dik, diq = wgmmas((dik, _zeros((q.shape[0], iq.shape[1]))), [(smem["dz"], iq)],
                       [(smem["dz"].transpose((1, 0)), smem["ik"])])  # fmt: skip
    return (dik,), [diq]


def _scratch(geo, tiling, operands: dict, key_copies: int, student: bool) -> dict:
    """Shared memory and barriers of `_launch` by name (`shared_bytes` counts the same)."""
    rows, stages, dtype = tiling.rows, tiling.stages, operands["q"].dtype
    smem = functools.partial(tiles, dtype)
    index_dim = operands["iq"].shape[1] if student else 0
    scratch = {"k": smem(PART_KEYS, geo.head_dim), "kseg": plgpu.SMEM((PART_KEYS,), jnp.int32),
               "q": smem(stages, rows, geo.head_dim), "p": smem(PART_KEYS, rows),
               "data": plgpu.SMEM((stages, 2, rows), jnp.int32),
               "values": plgpu.SMEM((stages, operands["values"].shape[0], rows), jnp.float32)}
    if student:
        scratch.update(
            ik=smem(PART_KEYS, index_dim), iq=smem(stages, rows, index_dim),
            p_low=smem(PART_KEYS, rows), dz=smem(PART_KEYS, rows), average=smem(rows, rows),
            average_bar=plgpu.Barrier(num_barriers=1), diq_out=tiles(jnp.float32, rows, index_dim),
            sum_out=tiles(jnp.float32, PART_KEYS, index_dim),
        )  # fmt: skip
    else:
        scratch.update(
            v=smem(PART_KEYS, geo.head_dim), do=smem(stages, rows, geo.head_dim),
            ds=smem(PART_KEYS, rows), dq_out=smem(rows, geo.head_dim),
            sum_out=tiles(jnp.float32, PART_KEYS, geo.head_dim),
        )  # fmt: skip
    matrices = 1 if student else 2
    scratch.update(
        key_bars=plgpu.Barrier(num_barriers=key_copies),
        q_bars=plgpu.Barrier(num_arrivals=chunk_copies(geo, matrices, index_dim),
                             num_barriers=stages),  # fmt: skip
        data_bars=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    )
    return scratch
