"""MSA sparse attention backward on GPUs, key-block-major, in one Pallas kernel (Triton lowering).

Per chunk: dQ and d(index_q) shares per selection entry (reduced per query afterwards); per
segment: dK, dV and d(index_k) summed in registers over its chunks. A key block may be split over
`key_split` programs so that those [keys, D] fp32 sums fit in registers. Segments, chunks and
masks: `chunks.py`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.msa import chunks


def accumulators(geo: chunks.Geometry, with_student: bool) -> tuple[jax.Array, ...]:
    """Zeroed fp32 buffers for `backward_pass`'s dk, dv (and d(index_k), per kv head): [B·S·K +
    block, Dh] (and Di); the `block` spare rows past the end absorb out-of-sequence keys, so that
    no two rows of one atomic add coincide and no mask is needed."""
    rows = geo.total_slots * geo.num_kv_heads + geo.block_size
    widths = (geo.head_dim, geo.head_dim) + ((geo.index_dim,) if with_student else ())
    return tuple(jnp.zeros((rows, width), jnp.float32) for width in widths)


def backward_pass(
    geo, tiling, lists, offset, q, k, v, segment_ids, lse, delta, d_out, student, lse_z, d_kl,
    sums, *, interpret=False,
):  # fmt: skip
    """Gradients: per-entry shares of dq [key_split·E·G, Dh] (q's dtype) and d(index_q)
    [key_split·E, Di] fp32 (one copy per part of a block), and this window's dk, dv and
    d(index_k).

    A block's first segment stores its sums into fresh zeroed buffers (`accumulators`), rows of
    its own document only, so stores of different blocks never meet; the segments that go on
    with a longer list add theirs atomically to `sums` (also from `accumulators`, updated in place
    and kept across windows). With balanced selections few segments take that path (measured on
    the H200: storing rather than adding did not change the step's time, benchmarks/RESULTS.md).

    delta: [B·W·H] Σ_d dO·O per (query, head); d_out: [B·W·H, Dh]; d_kl: [B·W·K] or None.
    Returns (dq shares, d(index_q) shares or None, updated sums, stored sums).
    """
    with_student = student is not None

    def kernel(*refs):
        (keys, entries, starts, sizes, count, offset_ref, q_ref, k_ref, v_ref, seg_ref, lse_ref,
         delta_ref, do_ref) = refs[:13]  # fmt: skip
        iq_ref, ik_ref, lse_z_ref, dkl_ref = refs[13:17] if with_student else (None,) * 4
        # outputs last (the aliased buffers before them are the same memory)
        if with_student:
            dq_ref, diq_ref, *sums_refs = refs[-8:]
        else:
            (dq_ref, *sums_refs), diq_ref = refs[-5:], None
        added, stored = sums_refs[: len(sums_refs) // 2], sums_refs[len(sums_refs) // 2 :]
        lists_refs = (keys, entries, starts, sizes, count)

        def segment_body(index, part):
            seg = chunks.Segment(
                geo, lists_refs[:4], offset_ref, seg_ref, index, part, tiling.key_split
            )
            keys_block = seg.load_block(k_ref)
            values_block = seg.load_block(v_ref)
            index_keys = seg.load_block(ik_ref, shared=True) if with_student else None
            keys = geo.block_size // tiling.key_split
            zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
            carry = (zeros((keys, geo.head_dim)), zeros((keys, geo.head_dim)))
            if with_student:
                carry += (zeros((keys, geo.index_dim)),)

            def chunk_body(chunk, carry):
                position, valid, query = seg.entries(chunk, geo.group)
                rows = seg.head_rows(query)
                visible = seg.visible(valid, query)
                q_rows = chunks.load_rows(q_ref, rows, valid, geo.head_dim)
                do_rows = chunks.load_rows(do_ref, rows, valid, geo.head_dim)
                logits = chunks.logits(geo, q_rows, keys_block, visible)
                row_lse = plt.load(lse_ref.at[rows], mask=valid, other=0.0)
                row_delta = plt.load(delta_ref.at[rows], mask=valid, other=0.0)
                probs = jnp.where(visible, jnp.exp(logits - row_lse[:, None]), 0.0)
                d_probs = chunks.matmul(do_rows, values_block, ((1,), (1,)))
                d_logits = probs * (d_probs - row_delta[:, None]) * geo.head_dim**-0.5
                dtype = q_rows.dtype
                dk = carry[0] + chunks.matmul(d_logits.astype(dtype), q_rows, ((0,), (0,)))
                dv = carry[1] + chunks.matmul(probs.astype(dtype), do_rows, ((0,), (0,)))
                dq = chunks.matmul(d_logits.astype(dtype), keys_block)
                # each part of a split block has its own copy of the shares (summed later)
                out_rows = (part * geo.entries + position) * geo.group + jnp.arange(
                    geo.rows
                ) % geo.group
                chunks.store_rows(dq_ref, out_rows, valid, dq.astype(dq_ref.dtype))
                if not with_student:
                    return dk, dv
                s_position, s_valid, s_query = seg.entries(chunk, geo.repeat)
                index_q, z = chunks.student_logits(geo, seg, iq_ref, index_keys, s_valid, s_query)
                s_rows = seg.group_rows(s_query)
                z_lse = plt.load(lse_z_ref.at[s_rows], mask=s_valid, other=0.0)
                d_kl = plt.load(
                    dkl_ref.at[s_rows], mask=s_valid & chunks.first_student_rows(geo), other=0.0
                )
                student_probs = jnp.where(z > chunks.NEG_INF, jnp.exp(z - z_lse[:, None]), 0.0)
                d_z = (student_probs - chunks.teacher(geo, probs)) * (d_kl * geo.index_dim**-0.5)[
                    :, None
                ]
                diq = chunks.matmul(d_z.astype(index_keys.dtype), index_keys)
                chunks.store_rows(
                    diq_ref,
                    part * geo.entries + s_position,
                    s_valid & chunks.first_student_rows(geo),
                    diq,
                )
                dik = carry[2] + chunks.matmul(d_z.astype(index_q.dtype), index_q, ((0,), (0,)))
                return dk, dv, dik

            carry = jax.lax.fori_loop(0, seg.num_chunks, chunk_body, carry)
            spare = jnp.arange(keys)
            kv_spare = geo.total_slots * geo.num_kv_heads + spare
            own = seg.key_inside & (seg.key_segments == seg.document)
            # d(index_k) is summed per kv head too (its one key head serves them all), so that
            # blocks of different heads never store into the same rows
            added_rows = jnp.where(seg.key_inside, seg.kv_rows, kv_spare)
            stored_rows = jnp.where(own, seg.kv_rows, kv_spare)

            @pl.when(seg.leads)
            def _():
                for ref, value in zip(stored, carry):
                    chunks.store_rows(ref, stored_rows, own, value)

            @pl.when(~seg.leads)
            def _():
                for ref, value in zip(added, carry):
                    chunks.add_rows(ref, added_rows, value)

        chunks.for_each_segment(lists_refs, segment_body, tiling.key_split)

    parts = tiling.key_split
    out_shape = [jax.ShapeDtypeStruct((parts * geo.entries * geo.group, geo.head_dim), q.dtype)]
    args = [*chunks.table(geo, lists), offset, q, k, v, segment_ids, lse, delta, d_out]
    if with_student:
        args += [*student, lse_z, d_kl]
        out_shape.append(jax.ShapeDtypeStruct((parts * geo.entries, geo.index_dim), jnp.float32))
    buffers = [*sums, *accumulators(geo, with_student)]
    first_buffer, first_output = len(args), len(out_shape)
    out_shape += [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers]
    aliases = {first_buffer + i: first_output + i for i in range(len(buffers))}
    outs = chunks.launch(
        kernel, "msa_backward", tiling, out_shape, *args, *buffers, interpret=interpret,
        aliases=aliases,
    )  # fmt: skip
    sums_out = outs[first_output:]
    half = len(sums_out) // 2
    diq = outs[1] if with_student else None
    return outs[0], diq, tuple(sums_out[:half]), tuple(sums_out[half:])
