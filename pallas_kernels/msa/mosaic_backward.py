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

A block's list can span several segments, taken by different programs: each item adds its dK,
dV sums [64, Dh] fp32 into its keys' rows of the layer's running sums by a TMA reduction
(`add_sum`), the sums an operand written in place, laid out as the keys' `pad_keys` rows
(`running_sums`), so an item's rows are its K/V window's and every one is in bounds (a key's
contributions from blocks of other documents are exact zeros, P = 0). Before, each item stored
its sums in a per-segment buffer and XLA scatter-added them into the keys' rows.

With the indexer's student a second kernel (mosaic_student.py) walks the same items for d(index_q)
and d(index_k), its own kernel so that the main one's registers stay with dK and dV. It starts
from the teacher (the group's mean P per entry and key); where the forward kept none (over
`pallas.Config.teacher_bytes`, or behind the Triton forward) the gradients kernel takes it from
its Pᵀ, which it computes anyway (`teacher_rows`: per entry a column mean over its G heads in
fp32 registers, one row of the half's keys stored per entry), instead of a teacher pass that
computes S and P again (42 ms of the layer's forward+backward at 128K on an H100,
benchmarks/RESULTS.md, 2026-12-07).

The forward's teacher pass (`teacher_pass`, `Config.kl_kernel="slots"`) is the same kernel with
no dO: per chunk Sᵀ, Pᵀ and those column means, stored per entry. The teacher pass it replaced
(mosaic_forward.py's KL pass without the student) took S = Q·Kᵀ [R, block] and averaged P over
an entry's head rows by a wgmma on P in two 16-bit parts through shared memory, as many FLOPs
as S again; with the keys along the rows an entry's heads are whole 8-column tiles of the
WGMMA layout, so their mean is a sum within a thread and its quad's lanes. On one program an SM
it was no faster (28.1 ms at 128K on an H100, as the attention pass: latency-bound on its
per-entry Q copies); its 68 KiB of shared memory (≈ 206 before) let two programs share an SM,
`pallas.Config.teacher`'s default: the layer's forward 1.085x (benchmarks/RESULTS.md, 2026-12-07).

`Tiling.warpgroups = 2` (paired; pallas.Config's default, 1.03x the layer's forward+backward at
32K, 1.01x at 128K on the H200, benchmarks/RESULTS.md 2026-12-05) takes both halves of a segment
in one program, one warpgroup each: the chunks' Q and dO are copied once for both, and the dQ
share of an entry is summed over the block in the kernel (each warpgroup computes half its
columns from both halves' dSᵀ), so that it is stored once instead of once per half and XLA
reads half the bytes (bench-h200's per-query sum of the shares: 17.5 ms a step).

On the H200 at M3's layout (64 q / 4 kv heads, Dh 128, index 4×128, top-16, bf16), the layer's
selection, forward (with its KL) and backward took 376 ms at S = 128K (cuDNN dense: 1,734 ms) and
84 ms at 32K (cuDNN: 108); a profile at 128K: 89 ms in the gradients kernel, 55 ms in the
student's (109 ms before it moved to slots; benchmarks/RESULTS.md, 2026-12-03).

Shapes: as mosaic_forward.py's; P = 64 keys of an item (KEY_PARTS = 2 per block).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.msa import block_lists, chunks, mosaic_forward, mosaic_student
from pallas_kernels.msa.mosaic_chunks import (
    COLUMN_LAYOUT,
    KEY_PARTS,
    PART_KEYS,
    TEACHER_TAIL,
    add_sum,
    broadcast,
    chunk_copies,
    chunk_rows,
    entry_rows,
    normalised,
    open_item,
    release_chunk,
    store_chunk,
    sum_rows,
    tiles,
    wgmmas,
    zeros,
)
from pallas_kernels.msa.mosaic_forward import SHARED_BYTES, Tiling


def shared_bytes(
    tiling: Tiling, head_dim: int, index_dim: int = 0, group: int = 8, itemsize: int = 2
) -> int:
    """Shared memory of one program of either kernel (`_scratch` and the student's allocate the
    same): the key halves' operands, the rings of Q and dO, Pᵀ and dSᵀ, the dQ staging and the
    fp32 sums (in column halves with two warpgroups), key segment ids and per-row words, with a
    student the teacher rows' staging (at most a row per chunk row); the larger of the two
    kernels."""
    rows, stages, keys = tiling.rows, tiling.stages, tiling.warpgroups * PART_KEYS
    tiles_ = (2 * keys + 2 * stages * rows + rows) * head_dim + 2 * keys * rows
    main = tiles_ * itemsize + 4 * (PART_KEYS * head_dim + keys + 4 * stages * rows)
    if not index_dim:
        return main
    main += 4 * tiling.warpgroups * rows * PART_KEYS // entry_rows(group)
    return max(main, mosaic_student.shared_bytes(index_dim, itemsize))


def unsupported_reason(
    dtype, group: int, head_dim: int, block_size: int, tiling: Tiling, index_dim: int = 0
) -> str:
    """Why the Mosaic backward can't take these operands ('' when it can): its warpgroups (key
    halves), the forward's limits on one warpgroup (`mosaic_forward.unsupported_reason`: dtype,
    tiles, block size; the forward's two warpgroups take chunks in turn, not key halves) and
    its own shared memory."""
    if tiling.warpgroups not in (1, KEY_PARTS):
        return f"warpgroups={tiling.warpgroups} is not one of {(1, KEY_PARTS)}"
    one = dataclasses.replace(tiling, warpgroups=1)
    reason = mosaic_forward.unsupported_reason(dtype, group, head_dim, block_size, one, index_dim)
    halves = KEY_PARTS * mosaic_forward.HEAD_DIM_MULTIPLE  # two warpgroups' dQ columns
    if not reason and tiling.warpgroups == KEY_PARTS and head_dim % halves:
        reason = f"head_dim={head_dim} does not split into two warpgroups' dQ columns"
    if reason or (needed := shared_bytes(tiling, head_dim, index_dim, group)) <= SHARED_BYTES:
        return reason
    return (
        f"head_dim={head_dim}, index_head_dim={index_dim} need {needed} bytes of shared memory "
        f"in the backward (> {SHARED_BYTES})"
    )


def most_documents(seq: int, block_size: int) -> int:
    """The most documents a row of `seq` tokens may hold for `segment_bound` to hold its
    segments: blocks counted from each document's start are then at most ceil(S / block) plus
    one per document."""
    return -(-seq // block_size) + 2


def segment_bound(geo: chunks.Geometry, tiling: Tiling) -> int:
    """Segments the kernels' tables make room for: the segments that continue a block's list
    (each after segment_chunks whole chunks of it, so at most E / (segment_chunks·chunk_queries))
    and the blocks' first segments, here at most 2·ceil(S / block) + 2 blocks per (row, kv head),
    i.e. rows of up to `most_documents` documents, and never more than E. pallas.py runs a
    window of more segments through the Triton backward (`window_gradients` would give NaN)."""
    continuing = geo.entries // (tiling.segment_chunks * geo.chunk_queries)
    row_blocks = -(-geo.seq // geo.block_size) + most_documents(geo.seq, geo.block_size)
    return min(geo.entries, continuing + geo.batch * geo.num_kv_heads * row_blocks)


def running_sums(geo: chunks.Geometry, with_student: bool) -> tuple:
    """Zero running sums that `window_gradients` adds each window's key gradients into, in
    `mosaic_forward.pad_keys`' rows [N, ·] fp32: dK and dV [N, K·Dh], with a student also
    d(index_k) [N, Di] (its one key head takes every kv head's)."""
    keys = jax.ShapeDtypeStruct((geo.batch, geo.seq, 1), jnp.float32)
    pad = functools.partial(mosaic_forward.pad_keys, block_size=geo.block_size)
    rows = jax.eval_shape(pad, keys).shape[0]
    widths = [geo.num_kv_heads * geo.head_dim] * 2 + [geo.index_dim] * with_student
    return tuple(jnp.zeros((rows, width), jnp.float32) for width in widths)


def _key_rows(geo: chunks.Geometry) -> slice:
    """The keys' rows of `running_sums` (past `pad_keys`' front block)."""
    return slice(geo.block_size, geo.block_size + geo.total_slots)


def key_gradients(geo: chunks.Geometry, sums: tuple) -> tuple:
    """`running_sums` -> dK, dV [B, S, K, Dh] (and d(index_k) [B, S, Di]) fp32: the keys' rows."""
    shapes = [(geo.num_kv_heads, geo.head_dim)] * 2 + [(geo.index_dim,)]
    return tuple(total[_key_rows(geo)].reshape(geo.batch, geo.seq, *shape)
                 for total, shape in zip(sums, shapes))  # fmt: skip


def with_key_gradients(geo: chunks.Geometry, sums: tuple, gradients: tuple) -> tuple:
    """`running_sums` with key gradients [B, S, ...] fp32 (as `key_gradients` gives) added."""
    return tuple(total.at[_key_rows(geo)].add(g.reshape(geo.total_slots, -1))
                 for total, g in zip(sums, gradients))  # fmt: skip


def window_gradients(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
                     window: dict, keys, index_keys=None, *, sums: tuple,
                     interpret: bool = False):  # fmt: skip
    """One window's gradients: (dq shares [parts, E, G, Dh] in q's dtype at sorted positions
    (parts: KEY_PARTS, or 1 with paired warpgroups), `sums` with the window's added, with a
    student d(index_q)'s (shares at slot rows, the slot row of each sorted entry) as
    `mosaic_student.gradients` gives them, else None; the KL [B, W, K] fp32 where the backward
    computed it, else None). A window of more segments than `segment_bound` gets NaN in dQ and
    in the key rows its segments reach.

    window: q, d_out (`WindowRows`), lse, delta [B, W, K, G], segment_ids [B, S], offset; with a
    student also index_q [B, W, K, Di], lse_z, d_kl [B, W, K] and the forward's teacher, or None:
    then the gradients kernel takes the teacher from its Pᵀ (`teacher_rows`). lse_z None (a KL
    sink: the forward ran no student): the student's kernel takes LSE_z and the KL from that
    teacher first (`mosaic_student.kl_terms`; window's valid [B, W, K, k]: the selections that
    hold a block). keys:
    `shifted_keys` of k, v, segment ids; index_keys: `shifted_keys` of index_k in q's dtype (with
    a student) or None. sums: `running_sums` (with d(index_k)'s when there is a student).
    """
    w = window
    chunk_walk = mosaic_forward.walk(geo, lists, w["q"], w["segment_ids"], w["offset"])
    bound = segment_bound(geo, tiling)
    values = mosaic_forward.row_values(geo, lists, [w["lse"], w["delta"]])
    values = jnp.where(lists.num_segments[0] > bound, jnp.nan, values)
    operands = dict(**chunk_walk.operands(), k=keys[0], kseg=keys[2], values=values)
    operands["count"] = jnp.minimum(operands["count"], bound)
    per_entry, paired = entry_rows(geo.group), tiling.warpgroups == KEY_PARTS
    # dQ shares [2·E·Ge, columns]: per key half, or with paired warpgroups one per entry, in
    # column halves (each warpgroup's)
    rows = KEY_PARTS * geo.entries * per_entry
    shares = (rows, geo.head_dim // (KEY_PARTS if paired else 1))
    outputs = dict(dq=jax.ShapeDtypeStruct(shares, w["q"].dtype))
    if index_keys is not None and w["teacher"] is None:  # rows past E never stored
        teacher = (geo.entries + TEACHER_TAIL, geo.block_size)
        outputs["teacher"] = jax.ShapeDtypeStruct(teacher, jnp.float32)
    totals = [jax.new_ref(total) for total in sums]  # the kernels add into them in place
    gradients = dict(operands, do=mosaic_forward.sorted_rows(geo, lists, w["d_out"]), v=keys[1],
                     dk=totals[0], dv=totals[1])  # fmt: skip
    results = _launch(geo, tiling, gradients, outputs, interpret)
    dq = results["dq"].reshape(KEY_PARTS, geo.entries, per_entry, -1)[:, :, : geo.group]
    if paired:
        dq = jnp.concatenate(list(dq), axis=-1)[None]
    diq = kl = None
    if index_keys is not None:
        if "teacher" in results:
            w = dict(w, teacher=results["teacher"])
        if w["lse_z"] is None:
            terms = mosaic_student.kl_terms(geo, tiling, lists, operands, w, index_keys, bound,
                                            interpret=interpret)  # fmt: skip
            kl, lse_z = mosaic_student.query_kl(geo, lists, w["valid"], terms)
            w = dict(w, lse_z=lse_z)
        diq = mosaic_student.gradients(geo, tiling, lists, dict(operands, dik=totals[2]), w,
                                       index_keys, bound, interpret=interpret)  # fmt: skip
    return dq, tuple(jax.freeze(total) for total in totals), diq, kl


def teacher_pass(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
                 chunk_walk: mosaic_forward.Walk, keys, lse: jax.Array, *,
                 interpret: bool = False) -> jax.Array:  # fmt: skip
    """The forward's teacher pass on the gradients kernel's items, with no dO: per chunk Sᵀ =
    K_half·Qᵀ (one wgmma), Pᵀ under the global LSE and each entry's column mean (`teacher_rows`)
    -> the teacher per sorted entry [E + TEACHER_TAIL, block] fp32, as `mosaic_forward.kl_pass`
    leaves it (the tail rows never written). Where the KL pass averages P on wgmma (A·P in two
    16-bit parts: as many FLOPs as S again) through shared memory, this sums each entry's
    columns in registers.

    chunk_walk: the window's `mosaic_forward.walk`; keys: `shifted_keys` of k, v, segment ids;
    lse: [B, W, K, G] the forward's combined LSE."""
    values = mosaic_forward.row_values(geo, lists, [lse])
    operands = dict(**chunk_walk.operands(), k=keys[0], kseg=keys[2], values=values)
    teacher = jax.ShapeDtypeStruct((geo.entries + TEACHER_TAIL, geo.block_size), jnp.float32)
    return _launch(geo, tiling, operands, dict(teacher=teacher), interpret)["teacher"]


def _launch(geo: chunks.Geometry, tiling: Tiling, operands: dict, outputs: dict, interpret: bool):
    """The gradients kernel: one persistent kernel over the (segment, key half) items -> dq
    shares (stored per chunk) by name; each item's dK, dV sums added into the running sums
    (operands dk, dv: `running_sums`, written in place). Without operand do: the teacher pass
    (`teacher_pass`), whose one output is the teacher.

    With `tiling.warpgroups = 2` (paired) an item is a whole segment, one warpgroup a key half:
    one ring of Q and dO chunks for both (half the loads), and one dQ share per entry, dS·K over
    the block's 128 keys, each warpgroup computing and storing half its columns from both
    halves' dSᵀ (half the shares' bytes, no sum over key halves in XLA). The warpgroups meet
    twice a chunk: once both dSᵀ are in shared memory, once both have read them and the ring
    slot (warpgroup 0 then refills it). Each adds its dK, dV sums in column halves."""
    stages, dtype, paired = tiling.stages, operands["q"].dtype, tiling.warpgroups == KEY_PARTS
    queries, per_entry, means = geo.chunk_queries, entry_rows(geo.group), "teacher" in outputs
    gradients = "do" in operands  # else the teacher pass
    block_operands = ["k", "v", "kseg"] if gradients else ["k", "kseg"]
    matrices, columns = ["q", "do"] if gradients else ["q"], geo.head_dim // tiling.warpgroups
    chunk_math = functools.partial(_gradients_chunk if gradients else _teacher_chunk, geo, dtype,
                                   functools.partial(wgmmas, interpret), means)  # fmt: skip

    def kernel(*refs, **smem):
        ref = dict(zip([*operands, *outputs], refs))

        def meet():
            plgpu.barrier_arrive(smem["pair_bar"])
            plgpu.barrier_wait(smem["pair_bar"])

        def program(half: int | None):  # half: the paired warpgroup's key half, else None
            own = dict(smem, key_bars=smem[f"key_bars{half or 0}"])
            if paired:
                own.update({name: half_of(smem[name], half)
                            for name in ("k", "v", "kseg", "p", "ds", "dq_out", "sum_out",
                                         "teacher_out") if name in smem})  # fmt: skip

            def item_body(index, part):
                part = part if half is None else half
                item = open_item(geo, tiling, ref, own, index, part, block_operands, matrices,
                                 fetches=half in (None, 0))  # fmt: skip

                def chunk_body(chunk, accumulators):
                    seen, values = chunk_rows(geo, tiling, own, item, chunk)
                    accumulators, dq, teacher = chunk_math(smem, own, half, meet, chunk % stages,
                                                           seen, values, accumulators)  # fmt: skip
                    if paired:
                        plgpu.commit_smem()
                        meet()  # both have read this chunk's ring slot and dSᵀ
                    release_chunk(tiling, item, chunk)
                    valid = item.count - chunk * queries
                    if gradients:
                        start = (part * geo.entries + item.first + chunk * queries) * per_entry
                        store_chunk(geo, own, ref, {"dq": dq}, start, valid)
                    if means:  # after the dQ store's wait, which covers the staging's stores
                        store_teacher(own, ref, teacher, item.first + chunk * queries, valid,
                                      part, waits=not gradients)  # fmt: skip
                    return accumulators

                accumulators = tuple(zeros((PART_KEYS, geo.head_dim)) for _ in range(2 * gradients))
                accumulators = jax.lax.fori_loop(0, item.num_chunks, chunk_body, accumulators)
                keys, head = sum_rows(item.row, part), item.row[6]
                for name, value in zip(("dk", "dv"), accumulators):
                    for first in range(0, geo.head_dim, columns):
                        part_of = value if not paired else value[:, first : first + columns]
                        target = (keys, pl.ds(head * geo.head_dim + first, columns))
                        add_sum(own, ref, name, part_of, target, interpret)

            grid = (jax.lax.axis_index("sm"), mosaic_forward.num_programs(tiling))
            chunks.for_each_segment((None,) * 4 + (ref["count"],), item_body,
                                    1 if paired else KEY_PARTS, grid=grid)  # fmt: skip
            plgpu.wait_smem_to_gmem(0)

        if not paired:
            return program(None)
        wg = jax.lax.axis_index("wg")
        for half in range(KEY_PARTS):
            pl.when(wg == half)(functools.partial(program, half))

    # profiles show the kernel by its function's name
    kernel.__name__ = "msa_mosaic_backward" if gradients else "msa_mosaic_teacher_pass"
    run = plgpu.kernel(
        kernel,
        out_type=tuple(outputs.values()),
        scratch_types=_scratch(geo, tiling, dtype, len(block_operands), means, gradients,
                               operands["values"].shape[0]),
        grid=(mosaic_forward.num_programs(tiling),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **(dict(num_threads=KEY_PARTS, thread_name="wg") if paired else {}),
    )
    return dict(zip(outputs, run(*operands.values())))


def _gradients_chunk(geo, dtype, wgmmas, means, smem, own, half, meet, slot, seen, values,
                     accumulators):  # fmt: skip
    """A chunk's dK, dV sums and dQ share (module docstring) and, with `means`, its entries'
    teacher rows over the half's keys (`teacher_rows`; else None): `own` the warpgroup's key
    half of `smem`; with paired warpgroups (`half` not None) the dQ share's columns of this
    warpgroup, Σ over both halves (dSᵀ_h)ᵀ·K_h, once both have stored their dSᵀ (`meet`)."""
    lse, delta = values
    dk, dv = accumulators
    q, d_out, scale = smem["q"].at[slot], smem["do"].at[slot], geo.head_dim**-0.5
    tile = (PART_KEYS, q.shape[0])
    logits, d_probs = wgmmas((zeros(tile), zeros(tile)), [(own["k"], q.transpose((1, 0)))],
                             [(own["v"], d_out.transpose((1, 0)))])  # fmt: skip
    probs = normalised(scale, logits, lse, seen, axis=1)
    teacher = teacher_rows(geo, probs) if means else None
    d_logits = probs * (d_probs - broadcast(delta, tile, 1)) * scale
    own["p"][...] = probs.astype(dtype)  # the last chunk's wgmmas have read P and dS
    own["ds"][...] = d_logits.astype(dtype)
    plgpu.commit_smem()
    keys, columns = smem["k"], geo.head_dim
    if half is not None:
        meet()  # both halves' dSᵀ are in shared memory
        columns = geo.head_dim // KEY_PARTS
        keys = keys.at[:, pl.ds(half * columns, columns)]
    dk, dv, dq = wgmmas(
        (dk, dv, zeros((q.shape[0], columns))), [(own["ds"], q)], [(own["p"], d_out)],
        [(smem["ds"].transpose((1, 0)), keys)],
    )  # fmt: skip
    return (dk, dv), dq.astype(dtype), teacher


def _teacher_chunk(geo, dtype, wgmmas, means, smem, own, half, meet, slot, seen, values,
                   accumulators):  # fmt: skip
    """The teacher pass' chunk (`_gradients_chunk`'s arguments): Sᵀ and Pᵀ of the warpgroup's
    key half, its entries' teacher rows (`teacher_rows`); no accumulators, no dQ."""
    del dtype, means, half, meet
    q = smem["q"].at[slot]
    (logits,) = wgmmas((zeros((PART_KEYS, q.shape[0])),), [(own["k"], q.transpose((1, 0)))])
    probs = normalised(geo.head_dim**-0.5, logits, values[0], seen, axis=1)
    return accumulators, None, teacher_rows(geo, probs)


def teacher_rows(geo: chunks.Geometry, probs) -> list:
    """Pᵀ [keys, R] fp32 -> per entry of the chunk its teacher over the keys [keys] (a column
    mean of its G real head columns, ROW_LAYOUT): the KL pass' A·P, taken in fp32 registers
    where the gradients kernel has P anyway, instead of a teacher pass for it. An entry's Ge
    columns are a whole number of the WGMMA layout's 8-column tiles, so each sums its own slice
    (a thread's few values and its quad's lanes), not a masked copy of the whole tile."""
    per_entry = entry_rows(geo.group)
    real = None
    if per_entry > geo.group:  # zero-padded heads (G < 8) must not count
        column = plgpu.broadcasted_iota(jnp.int32, (per_entry,), 0, layout=COLUMN_LAYOUT)
        real = broadcast(jnp.where(column < geo.group, 1.0, 0.0), (probs.shape[0], per_entry), 1)
    means = []
    for first in range(0, probs.shape[1], per_entry):
        columns = probs[:, first : first + per_entry]
        columns = columns if real is None else columns * real
        means.append(columns.sum(axis=1) * (1.0 / geo.group))
    return means


def store_teacher(own, ref, means: list, first, valid_queries, part: int, waits: bool) -> None:
    """TMA-store a chunk's teacher rows (`teacher_rows`) of its valid queries at GMEM rows
    `first` + query, the key half's columns, staged in `teacher_out` once its last store has
    read it: the kernel `waits` for that here, unless an earlier wait in the chunk covers it
    (`store_chunk`'s in the gradients kernel)."""
    if waits:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    staged = own["teacher_out"]
    for query, mean in enumerate(means):
        staged.at[query][...] = mean
    plgpu.commit_smem()
    columns = pl.ds(part * PART_KEYS, PART_KEYS)
    for query in range(len(means)):

        @pl.when(query < valid_queries)
        def _(query=query):
            plgpu.copy_smem_to_gmem(staged.at[pl.ds(query, 1)],
                                    ref["teacher"].at[pl.ds(first + query, 1), columns],
                                    commit_group=False)  # fmt: skip

    plgpu.commit_smem_to_gmem_group()


def half_of(ref, part: int):
    """Warpgroup `part`'s rows of a paired `_scratch` buffer (the halves stacked along rows: a
    static slice, where a static index would reach wgmma's state as a constant operand that
    Mosaic GPU's lowering rejects)."""
    rows = ref.shape[0] // KEY_PARTS
    return ref.at[pl.ds(part * rows, rows)]


def _scratch(geo, tiling, dtype, key_copies: int, means: bool, gradients: bool,
             num_values: int) -> dict:  # fmt: skip
    """Shared memory and barriers of `_launch` by name (`shared_bytes` counts the same): the key
    halves' K, V, key segment ids, Pᵀ, dSᵀ and the stagings of their dQ and sum columns (and,
    with `means`, of their teacher rows), one per warpgroup stacked along rows (`half_of`), each
    with its key barriers; the rings shared. The teacher pass (not `gradients`) has no V, dO,
    Pᵀ, dSᵀ or their stagings."""
    rows, stages, groups = tiling.rows, tiling.stages, tiling.warpgroups
    smem, keys = functools.partial(tiles, dtype), groups * PART_KEYS
    columns = geo.head_dim // groups
    key_bars = {f"key_bars{group}": plgpu.Barrier(num_barriers=key_copies)
                for group in range(groups)}  # fmt: skip
    extra = {"pair_bar": plgpu.Barrier(num_arrivals=groups)} if groups > 1 else {}
    if means:  # fp32 rows stored one by one: unswizzled
        extra["teacher_out"] = plgpu.SMEM((groups * geo.chunk_queries, PART_KEYS), jnp.float32)
    if gradients:
        extra.update(
            v=smem(keys, geo.head_dim), do=smem(stages, rows, geo.head_dim), p=smem(keys, rows),
            ds=smem(keys, rows), dq_out=smem(groups * rows, columns),
            sum_out=plgpu.SMEM((keys, columns), jnp.float32),
        )  # fmt: skip
    return dict(
        k=smem(keys, geo.head_dim), kseg=plgpu.SMEM((keys,), jnp.int32),
        q=smem(stages, rows, geo.head_dim), data=plgpu.SMEM((stages, 2, rows), jnp.int32),
        values=plgpu.SMEM((stages, num_values, rows), jnp.float32), **key_bars,
        q_bars=plgpu.Barrier(num_arrivals=chunk_copies(geo, 1 + gradients, 0),
                             num_barriers=stages),
        data_bars=plgpu.Barrier(num_arrivals=2, num_barriers=stages), **extra,
    )  # fmt: skip
