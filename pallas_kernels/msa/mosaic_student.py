"""The indexer student's gradients on Hopper GPUs (Mosaic GPU): d(index_q) and d(index_k) of the
KL between the main branch's head-averaged attention (the teacher) and the student's softmax.

The forward's KL pass (mosaic_forward.py: `kl_pass`) leaves the teacher of every selection entry
over its block's keys, [E, block] fp32; XLA lays it out per slot part and key half
(`teacher_tiles`). The kernel walks the gradients kernel's items (mosaic_backward.py: a segment's
key half of 64 keys) and runs on a segment's entries in slots of SLOT_ENTRIES, taken in parts of
PART_ENTRIES: per part it loads the teacher tile [keys, PART_ENTRIES] from GMEM, and the
student's logits zᵀ = index_k·index_qᵀ, its probabilities exp(zᵀ·Di^-½ - LSE_z), d_zᵀ =
(student - teacher)·d_kl·Di^-½ and d(index_q)ᵀ = index_kᵀ·d_zᵀ are wgmmas of N = PART_ENTRIES
columns; once per slot d(index_k) += d_zᵀ·index_q (K = SLOT_ENTRIES: Mosaic GPU takes
shared-memory operands of K ≥ 64 only, and a non-transposed B only with N ≥ 64, hence the
transposed d_z). The kernel before recomputed the teacher (Sᵀ = K·Qᵀ and Pᵀ of every head, their
group mean on wgmma): 32.6 ms of a bench-h200 step on the H200 (benchmarks/RESULTS.md,
2026-12-03).

The same kernel takes the forward's KL with `Config.kl_kernel = "slots"` (`kl_terms`): per
part and entry the LSE of zᵀ·Di^-½ over the half's keys, Σ t·(log t - zᵀ·Di^-½) and Σ t, one
value per entry, where the attention and KL passes compute z, its LSE and the KL's logs on every
one of an entry's Ge head rows (16 at M3's layout), with their own copies of the index rows.

Slots: a segment's entries in runs of SLOT_ENTRIES, numbered across segments by `slot_layout`
(so each slot's operands are one aligned TMA copy and its d(index_q) stores that no other
program touches). XLA lays out per slot row the entry's index_q row, its query's slot and segment
id (the mask), LSE_z and d_kl, and the teacher; and maps the slots' d(index_q) back to sorted
entries.

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
    WGMMA,
    block_lse,
    broadcast,
    copy_keys,
    key_data,
    kl_rows,
    matmul,
    normalised,
    store_sum,
    tiles,
    visible,
    wgmmas,
    zeros,
)
from pallas_kernels.msa.mosaic_forward import Tiling

SLOT_ENTRIES = 64  # entries of a slot: the K of d(index_k) += d_zᵀ·index_q (a whole swizzle)
PART_ENTRIES = 16  # entries of a slot's part: the N of the student's other wgmmas
SLOT_PARTS = SLOT_ENTRIES // PART_ENTRIES


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


def teacher_tiles(teacher: jax.Array, slots: Slots, count: int) -> jax.Array:
    """The KL pass' teacher per sorted entry [E, block] fp32 -> per (key half, slot part)
    [KEY_PARTS, count·SLOT_PARTS, PART_KEYS, PART_ENTRIES] (keys along rows; zeros on empty
    slot rows, whose entries were never stored)."""
    entries = teacher.shape[0]
    rows = teacher[jnp.minimum(slots.entry_of_row, entries - 1)]
    rows = jnp.where((slots.entry_of_row < entries)[:, None], rows, 0.0)
    rows = rows.reshape(count * SLOT_PARTS, PART_ENTRIES, KEY_PARTS, PART_KEYS)
    return rows.transpose(2, 0, 3, 1)


def shared_bytes(index_dim: int, itemsize: int = 2) -> int:
    """Shared memory of one program of the kernel (`_scratch`): index_k's key half, a slot's
    index_q rows and d_z, the fp32 d(index_q)ᵀ and sum staging, key segment ids and slot
    words."""
    keys, slot = PART_KEYS, SLOT_ENTRIES
    tiles_ = keys * index_dim + slot * index_dim + slot * keys
    words = keys + 4 * slot + index_dim * PART_ENTRIES + keys * index_dim
    return tiles_ * itemsize + 4 * words


def gradients(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
              operands: dict, window: dict, index_keys, bound: int, *,
              interpret: bool = False):  # fmt: skip
    """A window's student gradients: (d(index_q) shares [1, E, Di] fp32 at sorted positions,
    d(index_k) per-item sums [bound·KEY_PARTS·64, Di] fp32 for `mosaic_backward.sum_partials`).

    tiling: the gradients kernel's (its programs); operands: its walk operands (the segment
    table, count and kseg are read); window: as `mosaic_backward.window_gradients`', with the
    KL pass' `teacher`; index_keys: `shifted_keys` of index_k in q's dtype.
    """
    slots = slot_layout(operands["table"], lists.num_segments, geo.entries, bound)
    index_q, data, values = slot_operands(geo, lists, slots, window)
    index_dim, count = index_q.shape[1], num_slots(geo.entries, bound)
    operands = dict(table=operands["table"], count=operands["count"], kseg=operands["kseg"],
                    ik=index_keys, base=slots.base, iq=index_q, slot_data=data,
                    slot_values=values,
                    teacher=teacher_tiles(window["teacher"], slots, count))  # fmt: skip
    outputs = dict(
        diq=jax.ShapeDtypeStruct((KEY_PARTS * count * SLOT_PARTS * index_dim, PART_ENTRIES),
                                 jnp.float32),
        dik=jax.ShapeDtypeStruct((bound * KEY_PARTS * PART_KEYS, index_dim), jnp.float32),
    )
    results = _launch(geo, tiling, operands, outputs, interpret)
    diq = results["diq"].reshape(KEY_PARTS, count * SLOT_PARTS, index_dim, PART_ENTRIES)
    diq = diq.sum(axis=0).transpose(0, 2, 1).reshape(-1, index_dim)
    return diq.at[slots.row_of_entry].get(mode="fill", fill_value=0.0)[None], results["dik"]


TERMS = ("lse_z", "cross", "mass")  # the forward's per-entry terms of the KL (`kl_terms`)


def kl_terms(geo: chunks.Geometry, tiling: Tiling, lists: block_lists.BlockLists,
             operands: dict, window: dict, index_keys, bound: int, *,
             interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """The student's side of the indexer's KL, one row per sorted entry (where the KL pass
    computes the student's logits and the KL's logs on each of an entry's Ge head rows), from
    the teacher pass' teacher t (`mosaic_forward.kl_pass` without a student): over the block's
    keys the LSE of the student's logits z·Di^-½ [KEY_PARTS, E] per key half (-inf where the
    entry sees none of the half's keys), Σ t·(log t - z·Di^-½) [E] and Σ t [E]. A query's KL is
    Σ of the second over its selections + LSE_z · Σ of the third, LSE_z the logsumexp of the
    first (pallas.py), so the attention pass needs no student. Arguments as `gradients`', the
    window without lse_z and d_kl; at most `bound` segments (more: the entries past them are
    lost, so the caller takes the KL pass there)."""
    slots = slot_layout(operands["table"], lists.num_segments, geo.entries, bound)
    index_q, data, _ = slot_operands(geo, lists, slots, window, values=())
    count = num_slots(geo.entries, bound)
    operands = dict(table=operands["table"], count=operands["count"], kseg=operands["kseg"],
                    ik=index_keys, base=slots.base, iq=index_q, slot_data=data,
                    teacher=teacher_tiles(window["teacher"], slots, count))  # fmt: skip
    rows = jax.ShapeDtypeStruct((KEY_PARTS * count * SLOT_ENTRIES,), jnp.float32)
    results = _launch(geo, tiling, operands, dict.fromkeys(TERMS, rows), interpret)
    lse_z, cross, mass = (
        results[name].reshape(KEY_PARTS, -1).at[:, slots.row_of_entry].get(
            mode="fill", fill_value=-jnp.inf if name == "lse_z" else 0.0)
        for name in TERMS
    )  # fmt: skip
    return lse_z, cross.sum(0), mass.sum(0)


def _launch(geo: chunks.Geometry, tiling: Tiling, operands: dict, outputs: dict, interpret: bool):
    """The student's persistent kernel over the (segment, key half) items (module docstring):
    its gradients (outputs diq, dik), or with outputs `TERMS` the forward's per slot row and key
    half (`kl_terms`)."""
    dtype = operands["iq"].dtype
    index_dim = operands["iq"].shape[1]
    index_scale = index_dim**-0.5
    terms = "mass" in outputs  # the forward's KL terms, no gradients
    count = (outputs["mass"].shape[0] // (KEY_PARTS * SLOT_ENTRIES) if terms
             else outputs["diq"].shape[0] // (KEY_PARTS * index_dim * SLOT_PARTS))  # fmt: skip
    tile = (PART_KEYS, PART_ENTRIES)
    block_operands = ["kseg", "ik"]
    per_row = [name for name in ("slot_data", "slot_values") if name in operands]
    accumulate = functools.partial(wgmmas, interpret)

    def kernel(*refs, **smem):
        ref = dict(zip([*operands, *outputs], refs))

        def item_body(index, part):
            row = copy_keys(ref, smem, index, part, block_operands)
            key_slots, key_segments = key_data(smem, row, part, len(block_operands))
            base, slot_count = ref["base"][index], (row[1] + SLOT_ENTRIES - 1) // SLOT_ENTRIES

            def fetch_slot(j):
                rows = pl.ds((base + j) * SLOT_ENTRIES, SLOT_ENTRIES)
                bar = smem["slot_bar"].at[0]
                plgpu.copy_gmem_to_smem(ref["iq"].at[rows], smem["iq"], bar)
                for name in per_row:
                    plgpu.copy_gmem_to_smem(ref[name].at[:, rows], smem[name], bar)

            fetch_slot(0)

            def slot_part(j, n, carry):
                """Part n of slot j: its student and d_zᵀ (kept for d(index_k)), its
                d(index_q)ᵀ stored."""
                entries = pl.ds(n * PART_ENTRIES, PART_ENTRIES)

                @pl.when(n == 0)
                def _():
                    plgpu.barrier_wait(smem["slot_bar"].at[0])

                query_slot, segment, *values = (
                    plgpu.load(smem[name].at[c, entries], layout=COLUMN_LAYOUT, optimized=False)
                    for name in per_row for c in range(smem[name].shape[0])
                )  # fmt: skip
                seen = visible((query_slot, segment), key_slots, key_segments, tile,
                               key_axis=0)  # fmt: skip
                teacher = plgpu.load(ref["teacher"].at[part, (base + j) * SLOT_PARTS + n],
                                     layout=WGMMA, optimized=False)  # fmt: skip
                index_rows = smem["iq"].at[entries]
                z = matmul(tile, (smem["ik"], index_rows.transpose((1, 0))))
                if terms:
                    for name, value in zip(TERMS, _kl_terms(index_scale, z, teacher, seen)):
                        smem[f"{name}_out"].at[entries][...] = value
                    return carry
                lse_z, d_kl = values
                student = normalised(index_scale, z, lse_z, seen, axis=1)
                d_z = (student - teacher) * broadcast(d_kl * index_scale, tile, 1)
                d_z_rows = smem["dz"].at[entries]  # [entries, keys]: the last slot's wgmmas read it
                d_z_rows.transpose((1, 0))[...] = d_z.astype(dtype)
                plgpu.commit_smem()
                diq = matmul((index_dim, PART_ENTRIES), (smem["ik"].transpose((1, 0)),
                                                         d_z_rows.transpose((1, 0))))  # fmt: skip
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last store
                smem["diq_out"][...] = diq
                plgpu.commit_smem()
                target = ((part * count + base + j) * SLOT_PARTS + n) * index_dim
                plgpu.copy_smem_to_gmem(smem["diq_out"], ref["diq"].at[pl.ds(target, index_dim)])
                return carry

            def slot_body(j, dik):
                """Slot j: its parts, then d(index_k) += d_zᵀ·index_q over its entries (or
                the slot's KL terms stored)."""
                if terms:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slot's stores
                jax.lax.fori_loop(0, SLOT_PARTS, functools.partial(slot_part, j), 0)
                if terms:
                    plgpu.commit_smem()
                    rows = pl.ds((part * count + base + j) * SLOT_ENTRIES, SLOT_ENTRIES)
                    for name in TERMS:
                        plgpu.copy_smem_to_gmem(smem[f"{name}_out"], ref[name].at[rows])
                else:
                    (dik,) = accumulate((dik,), [(smem["dz"].transpose((1, 0)), smem["iq"])])
                plgpu.commit_smem()  # the slot's operands are read: the next slot's may land
                pl.when(j + 1 < slot_count)(lambda: fetch_slot(j + 1))
                return dik

            dik = jax.lax.fori_loop(0, slot_count, slot_body, zeros((PART_KEYS, index_dim)))
            if not terms:
                store_sum(smem, ref, "dik", dik, pl.ds((index * KEY_PARTS + part) * PART_KEYS,
                                                      PART_KEYS))  # fmt: skip

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
    """A part's `TERMS` per entry (columns; keys along rows): the LSE of z·Di^-½ over the keys
    it sees (-inf where none), Σ t·(log t - z·Di^-½) where t > 0, Σ t."""
    scaled = jnp.where(seen, z * (index_scale * LOG2E), -jnp.inf)  # base 2, as softmax_block
    top = scaled.max(axis=0)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    total = jnp.exp2(scaled - broadcast(top, scaled.shape, 1)).sum(axis=0)
    teacher = jnp.where(seen, teacher, 0.0)
    cross = kl_rows(teacher, z * index_scale, axis=0)
    return block_lse(top, total), cross, teacher.sum(axis=0)


def _scratch(dtype, index_dim: int, key_copies: int, terms: bool, values: int) -> dict:
    """Shared memory and barriers of `_launch` by name (`shared_bytes` counts the gradients'):
    with `terms` (the forward's KL) a slot's stagings of them in place of the gradients' d_z and
    stagings; `values` rows of per-slot-row values (none for the terms)."""
    slot = SLOT_ENTRIES
    smem = functools.partial(tiles, dtype)
    scratch = dict(
        kseg=plgpu.SMEM((PART_KEYS,), jnp.int32), ik=smem(PART_KEYS, index_dim),
        iq=smem(slot, index_dim), slot_data=plgpu.SMEM((2, slot), jnp.int32),
        key_bars=plgpu.Barrier(num_barriers=key_copies),
        slot_bar=plgpu.Barrier(num_arrivals=2 + bool(values), num_barriers=1),
    )  # fmt: skip
    if values:
        scratch["slot_values"] = plgpu.SMEM((values, slot), jnp.float32)
    if terms:
        return dict(scratch, **{f"{name}_out": plgpu.SMEM((slot,), jnp.float32)
                                for name in TERMS})  # fmt: skip
    return dict(scratch, dz=smem(slot, PART_KEYS),
                diq_out=tiles(jnp.float32, index_dim, PART_ENTRIES),
                sum_out=tiles(jnp.float32, PART_KEYS, index_dim))  # fmt: skip
