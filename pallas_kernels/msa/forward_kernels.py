"""MSA sparse attention forward on GPUs, key-block-major, in two Pallas kernels (Triton lowering).

1. `lse_pass`: per selection entry, the log-sum-exp of the block's logits for each of the G heads
   (and of the student's index logits);
2. `forward_pass`, with the LSEs combined over each query's k selections: per entry, the block's
   share of the output (globally normalised, so a query's shares add up) and of the indexer's KL
   (teacher: the group's mean attention probability; student: softmax of the index scores).
The LSE pass recomputes Q·Kᵀ; in exchange the shares need no rescaling and the KL's teacher is
exact within one pass. Segments, chunks and masks: `chunks.py`.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels.msa import chunks


def lse_pass(geo, tiling, lists, offset, q, k, segment_ids, student, *, interpret=False):
    """Per entry: LSE of the block's logits per head [E·G] and of the student's [E] (or None).

    q: [B·W·H, Dh]; k: [B·S·K, Dh]; segment_ids: [B·S]; student: (index_q [B·W·K, Di],
    index_k [B·S, Di]) or None; offset: [1] int32 slot of the window's first query.
    """
    with_student = student is not None

    def kernel(*refs):
        keys, entries, starts, sizes, count, offset_ref, q_ref, k_ref, seg_ref = refs[:9]
        iq_ref, ik_ref = refs[9:11] if with_student else (None, None)
        lse_ref, lse_z_ref = refs[-2:] if with_student else (refs[-1], None)
        lists_refs = (keys, entries, starts, sizes, count)

        def segment_body(index, part):
            del part  # whole blocks
            seg = chunks.Segment(geo, lists_refs[:4], offset_ref, seg_ref, index)
            keys_block = seg.load_block(k_ref)
            index_keys = seg.load_block(ik_ref, shared=True) if with_student else None

            def chunk_body(chunk, carry):
                position, valid, query = seg.entries(chunk, geo.group)
                q_rows = chunks.load_rows(q_ref, seg.head_rows(query), valid, geo.head_dim)
                logits = chunks.logits(geo, q_rows, keys_block, seg.visible(valid, query))
                top = logits.max(axis=1)
                lse = top + jnp.log(jnp.exp(logits - top[:, None]).sum(axis=1))
                out_rows = position * geo.group + jnp.arange(geo.rows) % geo.group
                chunks.store(lse_ref, out_rows, valid, lse)
                if with_student:
                    s_position, s_valid, s_query = seg.entries(chunk, geo.repeat)
                    _, z = chunks.student_logits(geo, seg, iq_ref, index_keys, s_valid, s_query)
                    z_top = z.max(axis=1)
                    lse_z = z_top + jnp.log(jnp.exp(z - z_top[:, None]).sum(axis=1))
                    chunks.store(
                        lse_z_ref, s_position, s_valid & chunks.first_student_rows(geo), lse_z
                    )
                return carry

            jax.lax.fori_loop(0, seg.num_chunks, chunk_body, 0)

        chunks.for_each_segment(lists_refs, segment_body)

    out_shape = [jax.ShapeDtypeStruct((geo.entries * geo.group,), jnp.float32)]
    args = [*chunks.table(geo, lists), offset, q, k, segment_ids]
    if with_student:
        out_shape.append(jax.ShapeDtypeStruct((geo.entries,), jnp.float32))
        args += list(student)
    outs = chunks.launch(kernel, "msa_lse", tiling, out_shape, *args, interpret=interpret)
    return outs[0], outs[1] if with_student else None


def forward_pass(
    geo, tiling, lists, offset, q, k, v, segment_ids, lse, student, lse_z, *, interpret=False
):
    """Per entry: the block's share of the output [E·G, Dh] (q's dtype; shares of one query add
    up to its output) and of the KL [E] fp32 (or None without a student).

    lse: [B·W·H] combined LSE per (query, head); lse_z: [B·W·K] the student's, or None.
    """
    with_student = student is not None

    def kernel(*refs):
        (keys, entries, starts, sizes, count, offset_ref, q_ref, k_ref, v_ref, seg_ref,
         lse_ref) = refs[:11]  # fmt: skip
        iq_ref, ik_ref, lse_z_ref = refs[11:14] if with_student else (None, None, None)
        out_ref, kl_ref = refs[-2:] if with_student else (refs[-1], None)
        lists_refs = (keys, entries, starts, sizes, count)

        def segment_body(index, part):
            del part  # whole blocks
            seg = chunks.Segment(geo, lists_refs[:4], offset_ref, seg_ref, index)
            keys_block = seg.load_block(k_ref)
            values_block = seg.load_block(v_ref)
            index_keys = seg.load_block(ik_ref, shared=True) if with_student else None

            def chunk_body(chunk, carry):
                position, valid, query = seg.entries(chunk, geo.group)
                rows = seg.head_rows(query)
                visible = seg.visible(valid, query)
                logits = chunks.logits(geo, chunks.load_rows(q_ref, rows, valid, geo.head_dim),
                                 keys_block, visible)  # fmt: skip
                row_lse = plt.load(lse_ref.at[rows], mask=valid, other=0.0)
                probs = jnp.where(visible, jnp.exp(logits - row_lse[:, None]), 0.0)
                share = chunks.matmul(probs.astype(values_block.dtype), values_block)
                out_rows = position * geo.group + jnp.arange(geo.rows) % geo.group
                chunks.store_rows(out_ref, out_rows, valid, share.astype(out_ref.dtype))
                if with_student:
                    s_position, s_valid, s_query = seg.entries(chunk, geo.repeat)
                    _, z = chunks.student_logits(geo, seg, iq_ref, index_keys, s_valid, s_query)
                    z_lse = plt.load(lse_z_ref.at[seg.group_rows(s_query)], mask=s_valid,
                                     other=0.0)  # fmt: skip
                    teacher = chunks.teacher(geo, probs)
                    log_teacher = jnp.log(jnp.maximum(teacher, 1e-30))
                    terms = teacher * (log_teacher - (z - z_lse[:, None]))
                    kl = jnp.where(teacher > 0, terms, 0.0).sum(axis=1)
                    chunks.store(kl_ref, s_position, s_valid & chunks.first_student_rows(geo), kl)
                return carry

            jax.lax.fori_loop(0, seg.num_chunks, chunk_body, 0)

        chunks.for_each_segment(lists_refs, segment_body)

    out_shape = [jax.ShapeDtypeStruct((geo.entries * geo.group, geo.head_dim), q.dtype)]
    args = [*chunks.table(geo, lists), offset, q, k, v, segment_ids, lse]
    if with_student:
        out_shape.append(jax.ShapeDtypeStruct((geo.entries,), jnp.float32))
        args += [*student, lse_z]
    outs = chunks.launch(kernel, "msa_forward", tiling, out_shape, *args, interpret=interpret)
    return outs[0], outs[1] if with_student else None
