"""The indexer student's gradients on Hopper GPUs (Mosaic GPU): d(index_q) and d(index_k) of the
KL between the main branch's head-averaged attention (the teacher) and the student's softmax.

The forward's teacher pass (mosaic_backward.py: `teacher_pass`; or its KL pass, mosaic_forward.py:
`kl_pass`) leaves the teacher of every selection entry over its block's keys, [E (+ a tail), block]
fp32, one row per sorted entry. The kernel walks the gradients kernel's items (mosaic_backward.py: a
segment's key half of 64 keys) and runs on a segment's entries in slots of SLOT_ENTRIES: per slot a
TMA copy brings the slot's teacher rows [entries, keys] (a segment's entries are consecutive sorted
entries, so the rows are one window of the teacher) beside its index_q rows, and the student's
logits z = index_q·index_kᵀ [entries, keys], its probabilities exp(z·Di^-½ - LSE_z), d_z =
(student - teacher)·d_kl·Di^-½, d(index_q) = d_z·index_k and d(index_k) += d_zᵀ·index_q are wgmmas
of M = SLOT_ENTRIES (entries along the rows: the teacher loads as stored; keys along the rows, it
would need a transposed load, which Mosaic GPU lowers for no fp32 WGMMA tile, and XLA laid the
teacher out per key half and slot part first: 28 GB written a bench-h200 step at two rows, by
XLA:GPU's plan). Before the KL pass stored the teacher, this kernel recomputed it (Sᵀ = K·Qᵀ and Pᵀ
of every head, their group mean on wgmma): 32.6 ms of a bench-h200 step on the H200
(benchmarks/RESULTS.md, 2026-12-03).

The same kernel takes the forward's KL with `Config.kl_kernel = "slots"` (`kl_terms`; under a
KL sink the backward's, from the gradients kernel's teacher, before the gradients): per slot
and entry the LSE of z·Di^-½ over the half's keys, Σ t·(log t - z·Di^-½) and Σ t, one value per
entry, where the attention and KL passes compute z, its LSE and the KL's logs on every one of an
entry's Ge head rows (16 at M3's layout), with their own copies of the index rows.

Slots: a segment's entries in runs of SLOT_ENTRIES, numbered across segments by `slot_layout`
(so each slot's operands are one aligned TMA copy and its d(index_q) stores that no other
program touches). XLA lays out per slot row the entry's index_q row, its query's slot and segment
id (the mask), LSE_z and d_kl; and maps the slots' d(index_q) back to sorted entries. A slot's
rows past its segment's entries are empty: no key is visible to them, so the teacher rows the
copy brings there (the next segment's entries, or the teacher's unwritten tail) never count.

Shapes: as mosaic_forward.py's; N = number of slots, Di index head dim.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.msa import block_lists, chunks, mosaic_forward
from pallas_kernels.msa.mosaic_chunks import (
    COLUMN_LAYOUT,
    KEY_PARTS,
    LOG2E,
    PART_KEYS,
    ROW_LAYOUT,
    TEACHER_TAIL,
    WGMMA,
    add_sum,
    block_lse,
    broadcast,
    copy_keys,
    key_data,
    kl_rows,
    matmul,
    normalised,
    sum_rows,
    tiles,
    visible,
    wgmmas,
    zeros,
)
from pallas_kernels.msa.mosaic_forward import Tiling

SLOT_ENTRIES = 64  # entries of a slot: the M of the student's wgmmas, the K of d(index_k)'s
assert SLOT_ENTRIES <= TEACHER_TAIL  # a slot's teacher copy stays within the teacher's rows


class Slots(NamedTuple):
    """Where each segment's entries sit in the slot layout."""

    base: jax.Array  # [E] first slot of each segment (rows past num_segments: junk)
    entry_of_row: jax.Array  # [N·SLOT_ENTRIES] sorted entry of each slot row, E where empty
    row_of_entry: jax.Array  # [E] slot row of each sorted entry (past the rows for invalid ones)


def num_slots(entries: int, bound: int) -> int:
    """Slots room is made for: each of at most `bound` segments rounds its entries up to whole
    slots, and the segments hold at most all E entries."""
    return -(-entries // SLOT_ENTRIES) + bound


def slot_layout(table, num_segments, entries: int, bound: int) -> Slots:
    """`Slots` of a window from its `mosaic_forward.segment_table` (first entry, count)."""
    segment = jnp.arange(entries)
    live = segment < num_segments[0]
    starts, counts = table[:, 0], jnp.where(live, table[:, 1], 0)
    per_segment = -(-counts // SLOT_ENTRIES)
    base = (jnp.cumsum(per_segment) - per_segment).astype(jnp.int32)
    # each sorted entry's segment: a mark at every live segment's first entry, summed up
    marks = jnp.zeros(entries, jnp.int32).at[jnp.where(live, starts, entries)].add(1, mode="drop")
    owner = jnp.maximum(jnp.cumsum(marks) - 1, 0)
    inside = (segment - starts[owner] < counts[owner]) & (marks.sum() > 0)
    rows = num_slots(entries, bound) * SLOT_ENTRIES
    row_of_entry = jnp.where(inside, base[owner] * SLOT_ENTRIES + segment - starts[owner], rows)
    entry_of_row = jnp.full(rows, entries, jnp.int32).at[row_of_entry].set(segment, mode="drop")
    return Slots(base, entry_of_row, row_of_entry.astype(jnp.int32))


def slot_operands(geo: chunks.Geometry, lists: block_lists.BlockLists, slots: Slots, window: dict,
                  values=("lse_z", "d_kl")):  # fmt: skip
    """Per slot row: index_q's row [N·SLOT_ENTRIES, Di] in q's dtype, (query's global slot,
    segment id) [2, N·SLOT_ENTRIES] int32 (slot -1 on empty rows: they see no key) and the
    window's per-(query, kv head) `values` (LSE_z, d_kl) [n, N·SLOT_ENTRIES] fp32 (0 on empty
    rows; None without `values`)."""
    w = window
    entry = jnp.minimum(slots.entry_of_row, geo.entries - 1)
    empty = slots.entry_of_row >= geo.entries
    pair = lists.entries[entry] // geo.topk  # (b·W + i)·K + h
    data = mosaic_forward.entry_data(geo, lists, w["segment_ids"], w["offset"])[:, entry]
    data = data.at[0].set(jnp.where(empty, -1, data[0]))
    index_q = w["index_q"].reshape(-1, w["index_q"].shape[-1])[pair].astype(w["q"].dtype)
    index_q = jnp.where(empty[:, None], 0, index_q)
    if not values:
        return index_q, data, None
    values = jnp.stack([w[name].reshape(-1)[pair] for name in values])
    values = jnp.where(empty | ~jnp.isfinite(values), 0.0, values).astype(jnp.float32)
    return index_q, data, values


def shared_bytes(index_dim: int, itemsize: int = 2) -> int:
    """Shared memory of one program of the kernel (`_scratch`): index_k's key half, a slot's
    index_q rows and d_z, its fp32 teacher rows and d(index_q) staging, the fp32 sum staging,
    key segment ids and slot words."""
    keys, slot = PART_KEYS, SLOT_ENTRIES
    tiles_ = keys * index_dim + slot * index_dim + slot * keys
    words = keys + 4 * slot + slot * keys + slot * index_dim + keys * index_dim
    return tiles_ * itemsize + 4 * words


def gradients(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
              operands: dict, window: dict, index_keys, bound: int, *,
              interpret: bool = False):  # fmt: skip
    """A window's student gradients: (d(index_q) shares [KEY_PARTS, N·SLOT_ENTRIES, Di] fp32 at
    slot rows, the slot row of each sorted entry [E] (`Slots.row_of_entry`: past the rows for
    invalid ones)); each item's d(index_k) sum added into the running sum `operands["dik"]`
    (a ref: `mosaic_backward.running_sums`' third, written in place).

    tiling: the gradients kernel's (its programs); operands: its walk operands (the segment
    table, count and kseg are read) and dik; window: as `mosaic_backward.window_gradients`',
    with the KL pass' `teacher`; index_keys: `shifted_keys` of index_k in q's dtype.
    """
    slots = slot_layout(operands["table"], lists.num_segments, geo.entries, bound)
    index_q, data, values = slot_operands(geo, lists, slots, window)
    index_dim, count = index_q.shape[1], num_slots(geo.entries, bound)
    operands = dict(table=operands["table"], count=operands["count"], kseg=operands["kseg"],
                    ik=index_keys, base=slots.base, iq=index_q, slot_data=data,
                    slot_values=values, teacher=window["teacher"],
                    dik=operands["dik"])  # fmt: skip
    rows = KEY_PARTS * count * SLOT_ENTRIES
    outputs = dict(diq=jax.ShapeDtypeStruct((rows, index_dim), jnp.float32))
    results = _launch(geo, tiling, operands, outputs, interpret)
    # the caller sums the entries' rows of both key halves per query in one pass
    # (`block_lists.selection_sums`), where summing the halves first reads and writes every slot
    # row (2.1x E at bench-h200's bound)
    diq = results["diq"].reshape(KEY_PARTS, -1, index_dim)
    return diq, slots.row_of_entry


TERMS = ("lse_z", "cross", "mass")  # the forward's per-entry terms of the KL (`kl_terms`)


def kl_terms(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
             operands: dict, window: dict, index_keys, bound: int, *,
             interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """The student's side of the indexer's KL, one row per sorted entry (where the KL pass computes
    the student's logits and the KL's logs on each of an entry's Ge head rows), from the teacher
    pass' teacher t (`mosaic_backward.teacher_pass`): over the block's keys the LSE of the student's
    logits z·Di^-½ [KEY_PARTS, E] per key half (-inf where the entry sees none of the half's keys),
    Σ t·(log t - z·Di^-½) [E] and Σ t [E]. A query's KL is Σ of the second over its selections +
    LSE_z · Σ of the third, LSE_z the logsumexp of the first (pallas.py), so the attention pass
    needs no student. Arguments as `gradients`', the window without lse_z and d_kl; at most `bound`
    segments (more: the entries past them are lost, so the caller takes the KL pass there)."""
    slots = slot_layout(operands["table"], lists.num_segments, geo.entries, bound)
    index_q, data, _ = slot_operands(geo, lists, slots, window, values=())
    count = num_slots(geo.entries, bound)
    operands = dict(table=operands["table"], count=operands["count"], kseg=operands["kseg"],
                    ik=index_keys, base=slots.base, iq=index_q, slot_data=data,
                    teacher=window["teacher"])  # fmt: skip
    rows = jax.ShapeDtypeStruct((KEY_PARTS * count * SLOT_ENTRIES,), jnp.float32)
    results = _launch(geo, tiling, operands, dict.fromkeys(TERMS, rows), interpret)
    lse_z, cross, mass = (
        results[name].reshape(KEY_PARTS, -1).at[:, slots.row_of_entry].get(
            mode="fill", fill_value=-jnp.inf if name == "lse_z" else 0.0)
        for name in TERMS
    )  # fmt: skip
    return lse_z, cross.sum(0), mass.sum(0)


def query_kl(geo: chunks.Geometry, lists: block_lists.BlockLists, valid: jax.Array,
             terms: tuple) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`kl_terms`' per-entry terms -> each (query, kv head)'s (KL, LSE_z) [B, W, K] fp32: LSE_z
    the logsumexp of its selections' LSEs, the KL Σ of their cross terms + LSE_z · Σ of their
    masses (0 where the query sees no key). valid: [B, W, K, k] the selections that hold a
    block."""
    def by_slot(per_entry, fill):  # [E] at sorted positions -> [B, W, K, k]
        return block_lists.by_valid_selection(per_entry, lists, valid, fill)

    lse_e, cross, mass = terms
    lse_z = jax.nn.logsumexp(by_slot(jnp.logaddexp(*lse_e), -jnp.inf), axis=3)
    mass = by_slot(mass, 0.0).sum(axis=3)
    kl = by_slot(cross, 0.0).sum(axis=3) + jnp.where(mass > 0, lse_z * mass, 0.0)
    return kl, lse_z


def _launch(geo: chunks.Geometry, tiling: Tiling, operands: dict, outputs: dict, interpret: bool):
    """The student's persistent kernel over the (segment, key half) items (module docstring):
    its gradients (output diq; d(index_k) added into operand dik), or with outputs `TERMS` the
    forward's per slot row and key half (`kl_terms`)."""
    dtype = operands["iq"].dtype
    index_dim = operands["iq"].shape[1]
    index_scale = index_dim**-0.5
    terms = "mass" in outputs  # the forward's KL terms, no gradients
    count = next(iter(outputs.values())).shape[0] // (KEY_PARTS * SLOT_ENTRIES)
    tile = (SLOT_ENTRIES, PART_KEYS)  # entries along the rows, the half's keys along the columns
    block_operands = ["kseg", "ik"]
    per_row = [name for name in ("slot_data", "slot_values") if name in operands]
    accumulate = functools.partial(wgmmas, interpret)

    def kernel(*refs, **smem):
        ref = dict(zip([*operands, *outputs], refs))

        def item_body(index, part):
            row = copy_keys(ref, smem, index, part, block_operands)
            key_slots, key_segments = key_data(smem, row, part, len(block_operands),
                                               layout=COLUMN_LAYOUT)  # fmt: skip
            first, base = row[0], ref["base"][index]
            slot_count = (row[1] + SLOT_ENTRIES - 1) // SLOT_ENTRIES

            def fetch_slot(j):
                rows = pl.ds((base + j) * SLOT_ENTRIES, SLOT_ENTRIES)
                bar = smem["slot_bar"].at[0]
                plgpu.copy_gmem_to_smem(ref["iq"].at[rows], smem["iq"], bar)
                for name in per_row:
                    plgpu.copy_gmem_to_smem(ref[name].at[:, rows], smem[name], bar)
                entries = pl.ds(first + j * SLOT_ENTRIES, SLOT_ENTRIES)
                keys = pl.ds(part * PART_KEYS, PART_KEYS)
                plgpu.copy_gmem_to_smem(ref["teacher"].at[entries, keys], smem["teacher"], bar)

            fetch_slot(0)

            def slot_body(j, dik):
                """Slot j: its student, d_z and d(index_q) stored, d(index_k) += d_zᵀ·index_q
                (or its KL terms stored)."""
                plgpu.barrier_wait(smem["slot_bar"].at[0])
                query_slot, segment, *values = (
                    plgpu.load(smem[name].at[c], layout=ROW_LAYOUT, optimized=False)
                    for name in per_row for c in range(smem[name].shape[0])
                )  # fmt: skip
                seen = visible((query_slot, segment), key_slots, key_segments, tile)
                teacher = plgpu.load(smem["teacher"], layout=WGMMA, optimized=False)
                z = matmul(tile, (smem["iq"], smem["ik"].transpose((1, 0))))
                rows = pl.ds((part * count + base + j) * SLOT_ENTRIES, SLOT_ENTRIES)
                if terms:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slot's stores
                    for name, value in zip(TERMS, _kl_terms(index_scale, z, teacher, seen)):
                        smem[f"{name}_out"][...] = value
                    plgpu.commit_smem()
                    for name in TERMS:
                        plgpu.copy_smem_to_gmem(smem[f"{name}_out"], ref[name].at[rows])
                else:
                    lse_z, d_kl = values
                    student = normalised(index_scale, z, lse_z, seen)
                    teacher = jnp.where(seen, teacher, 0.0)  # empty rows: never-stored tail
                    d_z = (student - teacher) * broadcast(d_kl * index_scale, tile)
                    smem["dz"][...] = d_z.astype(dtype)
                    plgpu.commit_smem()
                    diq = matmul((SLOT_ENTRIES, index_dim), (smem["dz"], smem["ik"]))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last store
                    smem["diq_out"][...] = diq
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(smem["diq_out"], ref["diq"].at[rows])
                    (dik,) = accumulate((dik,), [(smem["dz"].transpose((1, 0)), smem["iq"])])
                plgpu.commit_smem()  # the slot's operands are read: the next slot's may land
                pl.when(j + 1 < slot_count)(lambda: fetch_slot(j + 1))
                return dik

            dik = jax.lax.fori_loop(0, slot_count, slot_body, zeros((PART_KEYS, index_dim)))
            if not terms:
                add_sum(smem, ref, "dik", dik, sum_rows(row, part), interpret)

        program = jax.lax.axis_index("sm")
        chunks.for_each_segment((None,) * 4 + (ref["count"],), item_body, KEY_PARTS,
                                grid=(program, mosaic_forward.num_programs(tiling)))  # fmt: skip
        plgpu.wait_smem_to_gmem(0)

    # profiles show the kernel by this name
    kernel.__name__ = "msa_mosaic_student_kl" if terms else "msa_mosaic_student_backward"
    values = operands["slot_values"].shape[0] if "slot_values" in operands else 0
    run = plgpu.kernel(
        kernel,
        out_type=tuple(outputs.values()),
        scratch_types=_scratch(dtype, index_dim, len(block_operands), terms, values),
        grid=(mosaic_forward.num_programs(tiling),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return dict(zip(outputs, run(*operands.values())))


def _kl_terms(index_scale: float, z, teacher, seen):
    """A slot's `TERMS` per entry (rows; keys along the columns): the LSE of z·Di^-½ over the
    keys it sees (-inf where none), Σ t·(log t - z·Di^-½) where t > 0, Σ t."""
    scaled = jnp.where(seen, z * (index_scale * LOG2E), -jnp.inf)  # base 2, as softmax_block
    top = scaled.max(axis=1)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    total = jnp.exp2(scaled - broadcast(top, scaled.shape)).sum(axis=1)
    teacher = jnp.where(seen, teacher, 0.0)
    cross = kl_rows(teacher, z * index_scale)
    return block_lse(top, total), cross, teacher.sum(axis=1)


def _scratch(dtype, index_dim: int, key_copies: int, terms: bool, values: int) -> dict:
    """Shared memory and barriers of `_launch` by name (`shared_bytes` counts the gradients'):
    with `terms` (the forward's KL) a slot's stagings of them in place of the gradients' d_z and
    stagings; `values` rows of per-slot-row values (none for the terms)."""
    slot = SLOT_ENTRIES
    smem = functools.partial(tiles, dtype)
    scratch = dict(
        kseg=plgpu.SMEM((PART_KEYS,), jnp.int32), ik=smem(PART_KEYS, index_dim),
        iq=smem(slot, index_dim), slot_data=plgpu.SMEM((2, slot), jnp.int32),
        teacher=plgpu.SMEM((slot, PART_KEYS), jnp.float32),  # unswizzled fp32 rows
        key_bars=plgpu.Barrier(num_barriers=key_copies),
        slot_bar=plgpu.Barrier(num_arrivals=3 + bool(values), num_barriers=1),
    )  # fmt: skip
    if values:
        scratch["slot_values"] = plgpu.SMEM((values, slot), jnp.float32)
    if terms:
        return dict(scratch, **{f"{name}_out": plgpu.SMEM((slot,), jnp.float32)
                                for name in TERMS})  # fmt: skip
    return dict(scratch, dz=smem(slot, PART_KEYS),
                diq_out=tiles(jnp.float32, slot, index_dim),
                sum_out=plgpu.SMEM((PART_KEYS, index_dim), jnp.float32))  # fmt: skip
