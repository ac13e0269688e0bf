"""The Mosaic GPU MSA backward (`Config.backward_kernel="mosaic"`), with and without the indexer's
student, run by Mosaic GPU's interpreter on CPU: its gradients against jax.grad of the O(S²)
reference in float32 on the same bf16 inputs, and against the Triton backward's; its lowering for
CUDA, which needs no GPU.

Inputs as test_msa_mosaic_forward.py's: S = 300 (not a multiple of the block), batch 2, row 0
packs a document that starts mid-block, early queries have fewer than k valid blocks (-1).
Segments of two chunks, so long block lists go on in later segments (their dK, dV sums meet in
the running sums, by the kernels' adds) and many chunks are a list's partial last one.
"""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_msa_mosaic_forward import (
    BLOCK,
    as_f32,
    assert_gradients_equal,
    cuda_operands,
    gradients,
    inputs,
    student,
)

from m3jax import stacking
from pallas_kernels.msa import (
    backward_kernel,
    block_lists,
    mosaic_backward,
    mosaic_forward,
    mosaic_student,
    pallas,
    reference,
)


def mosaic(forward_kernel: str = "triton", warpgroups: int = 1, kl_kernel: str = "pass"):
    """The Mosaic backward (and the teacher pass, with the KL on slots) on `warpgroups`."""
    tiling = mosaic_forward.Tiling(segment_chunks=2, warpgroups=warpgroups)
    return pallas.Config(forward_kernel=forward_kernel, backward_kernel="mosaic",
                         mosaic_backward=tiling, kl_kernel=kl_kernel,
                         teacher=mosaic_forward.Tiling(warpgroups=warpgroups))  # fmt: skip


def reference_gradients(q, k, v, blocks, segments, positions, index=None):
    """`gradients`' loss through the reference in float32 (same weights)."""
    keys = jax.random.split(jax.random.key(7), 2)
    weights = jax.random.normal(keys[0], q.shape)
    kl_weights = jax.random.normal(keys[1], (*q.shape[:2], k.shape[2]))

    def loss(q, k, v, *index):
        out, kl = reference.sparse_attention(q, k, v, blocks, segments, positions,
                                             block_size=BLOCK, student=index or None)  # fmt: skip
        value = (out * weights).sum()
        return value if kl is None else value + (kl * kl_weights).sum()

    operands = [x.astype(jnp.float32) for x in (q, k, v) + (index or ())]
    return jax.grad(loss, argnums=tuple(range(len(operands))))(*operands)


@pytest.mark.parametrize("group, kv_heads, warpgroups", [(4, 2, 1), (16, 1, 1), (4, 2, 2),
                                                         (16, 1, 2)])  # fmt: skip
def test_gradients_match_reference_and_triton(group, kv_heads, warpgroups):
    """d(q, k, v): G = 4 (Q and dO rows gathered by XLA, entries padded to 8 rows) and G = 16
    (the kernel copies each entry's rows itself); one warpgroup a key half, or both halves of a
    block in one program (one dQ share per entry, summed in the kernel: Dh = 128, two column
    halves of 64)."""
    args = inputs(group, kv_heads, head_dim=64 * warpgroups)
    assert (np.asarray(args[3]) == -1).any()
    with mock.patch.object(mosaic_backward, "half_of", wraps=mosaic_backward.half_of) as halves:
        got = gradients(mosaic(warpgroups=warpgroups), *args)
    assert halves.called == (warpgroups == 2)
    assert all(np.isfinite(as_f32(g)).all() for g in got)
    assert_gradients_equal(got, reference_gradients(*args))
    assert_gradients_equal(got, gradients(pallas.Config(), *args))


@pytest.mark.parametrize("group, kv_heads, forward, warpgroups, kl_kernel",
                         [(4, 2, "mosaic", 1, "pass"), (16, 1, "mosaic", 1, "pass"),
                          (16, 1, "triton", 1, "pass"), (16, 1, "mosaic", 2, "pass"),
                          (16, 1, "mosaic", 1, "slots")])  # fmt: skip
def test_student_gradients_match_reference_and_triton(group, kv_heads, forward, warpgroups,
                                                      kl_kernel):  # fmt: skip
    """d(q, k, v, index_q, index_k) with the student, after the Mosaic forward (its LSE, LSE_z
    and teacher residuals; LSE_z from the student's kernel with the KL on slots) or the Triton
    one (no teacher kept: the gradients kernel takes it from its P); the packed row alone, to
    keep the interpreter's time down."""
    args = inputs(group, kv_heads, batch=1, head_dim=64 * warpgroups)
    index = student(kv_heads, args[0].shape[1], args[0].shape[0])
    got = gradients(mosaic(forward, warpgroups, kl_kernel), *args, index=index)
    assert_gradients_equal(got, reference_gradients(*args, index=index))
    assert_gradients_equal(got, gradients(pallas.Config(), *args, index=index))


@pytest.mark.parametrize("with_student, query_runs, warpgroups, kl_kernel, teacher_bytes",
                         [(False, False, 1, "slots", 1 << 30), (True, False, 1, "pass", 1 << 30),
                          (True, True, 1, "slots", 1 << 30), (True, False, 2, "slots", 1 << 30),
                          (True, False, 2, "slots", 0), (True, False, 1, "pass", 0)])  # fmt: skip
def test_lowers_for_cuda_without_a_gpu(with_student, query_runs, warpgroups, kl_kernel,
                                       teacher_bytes):  # fmt: skip
    """Mosaic GPU's lowering (layout inference, TMA and tile constraints, wgmma operands) of the
    backward kernels at Dh = Di = 128, G = 16: the forward, then the gradients kernel and with a
    student the KL pass (its teacher feeds the student's gradients) and the student's kernel;
    with the KL on slots the forward is the attention pass, the teacher pass and the student's
    kernel, beside the KL pass' way for windows of more segments (a `lax.cond`: 2 kernels); with
    query runs, half the queries as context parallelism's two runs of slots; with no room for
    the teacher (`teacher_bytes=0`) the gradients kernel that takes it from its P. The Triton
    fallback for windows of too many segments lowers only with a GPU present: zeros of its
    kernel's shapes stand in for it here."""
    tiling = mosaic_forward.Tiling(segment_chunks=32, warpgroups=warpgroups)
    config = pallas.Config(forward_kernel="mosaic", backward_kernel="mosaic",
                           mosaic_backward=tiling, kl_kernel=kl_kernel,
                           teacher_bytes=teacher_bytes)  # fmt: skip
    triton = backward_kernel.backward_pass

    def stand_in(geo, tiling, *arrays, **kwargs):
        shapes = jax.eval_shape(functools.partial(triton, geo, tiling, **kwargs), *arrays)
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

    def loss(q, k, v, blocks, segments, positions, slots, *index):
        out, kl = pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=BLOCK,
                                          student=index or None, query_slots=slots,
                                          config=config, interpret=False)  # fmt: skip
        return out.astype(jnp.float32).sum() + (0.0 if kl is None else kl.sum())

    operands = list(cuda_operands(with_student))
    slots = None
    if query_runs:  # the queries' arrays halved, their slots given as [2, 128]
        halved = lambda x: jax.ShapeDtypeStruct((1, 256, *x.shape[2:]), x.dtype)  # noqa: E731
        operands = [halved(x) if i in (0, 3, 6) else x for i, x in enumerate(operands)]
        slots = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    operands.insert(6, slots)
    differentiated = (0, 1, 2, 7, 8) if with_student else (0, 1, 2)
    grad = jax.jit(jax.grad(loss, argnums=differentiated))
    with mock.patch.object(backward_kernel, "backward_pass", stand_in):
        text = grad.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    forward = {"pass": 2, "slots": 3 + 2}[kl_kernel] if with_student else 1
    if with_student and not teacher_bytes:  # the KL pass of "pass" leaves no residual then
        forward -= 1  # and its KL, whose value jax.grad never reads, is dropped
    assert text.count("custom_call @mosaic_gpu") == forward + (2 if with_student else 1)


@pytest.mark.parametrize("remat, launches", [("none", 8), ("full", 6)])
def test_no_remat_recompute_runs_the_kl_passes_for_the_lses(remat, launches):
    """A layer's loss and gradients under `model.remat` with the KL on slots and no teacher
    kept, lowered for CUDA: the forward launches the attention pass, the teacher pass and the
    student's kernel, the backward the gradients and the student's kernels; recomputing every
    value (jax's nothing_saveable) launches the forward's three again, while `full`, which
    saves the LSEs (SAVED_BY_ANY_REMAT) as every policy does, launches the attention pass alone."""
    config = pallas.Config(forward_kernel="mosaic", backward_kernel="mosaic",
                           mosaic_backward=mosaic_forward.Tiling(segment_chunks=32),
                           few_documents=True, teacher_bytes=0)  # fmt: skip

    def loss(q, k, v, blocks, segments, positions, *index):
        out, kl = pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=BLOCK,
                                          student=index, config=config, interpret=False)
        return out.astype(jnp.float32).sum() + kl.sum()

    policy = (jax.checkpoint_policies.nothing_saveable if remat == "none"
              else stacking.REMAT_POLICIES[remat])  # fmt: skip
    step = jax.jit(jax.value_and_grad(jax.checkpoint(loss, policy=policy), argnums=(0, 6, 7)))
    text = step.trace(*cuda_operands(True)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == launches


@pytest.mark.parametrize("with_student, sink", [(False, False), (True, False), (True, True)])
def test_few_documents_leaves_the_fallbacks_and_their_conditionals_out(with_student, sink):
    """`Config.few_documents` (the host checked the rows' documents): the program lowered for
    CUDA has no `lax.cond` (XLA:GPU reads a conditional's predicate on the host, so the step's
    dispatch would wait for the device) and only the Mosaic kernels of windows that fit: the
    attention pass, with a student the teacher pass and the student's kernel (the KL on slots),
    then the gradients kernel and with a student the student's gradients. Under a KL sink the
    forward is the attention pass alone, the student's kernel runs twice in the backward (LSE_z
    and the KL, then the gradients)."""
    tiling = mosaic_forward.Tiling(segment_chunks=32)
    config = pallas.Config(forward_kernel="mosaic", backward_kernel="mosaic",
                           mosaic_backward=tiling, few_documents=True)  # fmt: skip

    def loss(q, k, v, blocks, segments, positions, *index):
        kl_sink = jnp.zeros((*q.shape[:2], k.shape[2]), jnp.float32) if sink else None
        out, kl = pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=BLOCK,
                                          student=index or None, kl_sink=kl_sink, config=config,
                                          interpret=False)  # fmt: skip
        return out.astype(jnp.float32).sum() + (0.0 if kl is None else kl.sum())

    operands = cuda_operands(with_student)
    differentiated = (0, 1, 2, 6, 7) if with_student else (0, 1, 2)
    grad = jax.jit(jax.grad(loss, argnums=differentiated))
    text = grad.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    launches = {(False, False): 1 + 1, (True, False): 3 + 2, (True, True): 1 + 3}
    assert text.count("custom_call @mosaic_gpu") == launches[with_student, sink]


def test_unsupported_reason_names_the_backward_limits():
    q, k, _, _, _, _ = inputs(4, 2, seq=8, batch=1)
    config = mosaic()
    reason = lambda q, k, index_q=None, **kw: pallas.unsupported_reason(  # noqa: E731
        q, k, q if index_q is None else index_q,
        **{"block_size": BLOCK, "config": config, "interpret": True, **kw},
    )  # fmt: skip
    assert reason(q, k) == ""
    assert "Mosaic backward: dtype float32" in reason(q.astype(jnp.float32), k)
    # Dh = 192: the forward fits, the backward's rings of Q and dO do not
    wide_q, wide_k = jnp.tile(q, (1, 1, 1, 3)), jnp.tile(k, (1, 1, 1, 3))
    assert mosaic_forward.shared_bytes(mosaic_forward.Tiling(), 192, BLOCK) <= 227 * 1024
    assert "shared memory in the backward" in reason(wide_q, wide_k)
    odd = pallas.Config(backward_kernel="cuda")
    assert "backward_kernel='cuda'" in pallas.unsupported_reason(q, k, q, block_size=BLOCK,
                                                                 config=odd)  # fmt: skip
    assert reason(q, k, student(2, 8, 1)[0]) == ""
    # two warpgroups a program: Dh in two column halves of 64, within shared memory at Dh = 128
    paired = mosaic_forward.Tiling(warpgroups=2)
    limits = (jnp.bfloat16, 16, 128, BLOCK)
    assert mosaic_backward.unsupported_reason(*limits, paired, 128) == ""
    assert mosaic_backward.shared_bytes(paired, 128) > mosaic_backward.shared_bytes(
        mosaic_forward.Tiling(), 128)
    assert "two warpgroups" in mosaic_backward.unsupported_reason(jnp.bfloat16, 16, 64, BLOCK,
                                                                  paired)  # fmt: skip
    assert "warpgroups=3" in mosaic_backward.unsupported_reason(
        *limits, mosaic_forward.Tiling(warpgroups=3))
    # the forward's attention pass: two warpgroups' rings and stagings at Dh = 128, not at 192
    assert mosaic_forward.unsupported_reason(*limits, paired) == ""
    assert "shared memory" in mosaic_forward.unsupported_reason(jnp.bfloat16, 16, 192, BLOCK,
                                                                paired)  # fmt: skip


def test_auto_takes_the_mosaic_backward_where_the_mosaic_forward_runs_and_it_fits():
    """"auto" (the default): the Mosaic backward behind a Mosaic forward when its own limits hold,
    on two warpgroups a program where Dh splits in two halves of 64, else on one; the Triton
    backward in the interpreter, behind a Triton forward and where it does not fit."""
    backward = lambda q, k, interpret=False, config=pallas.Config(): pallas.concrete(  # noqa: E731
        config, q, k, q, BLOCK, interpret
    ).backward_kernel
    q8, k8, _, _, _, _ = inputs(8, 2, seq=8, batch=1)
    q4, k4, _, _, _, _ = inputs(4, 2, seq=8, batch=1)
    assert pallas.Config().backward_kernel == "auto"
    assert backward(q8, k8) == "mosaic"
    assert backward(q8, k8, interpret=True) == "triton"
    assert backward(q4, k4) == "triton"
    assert backward(q8, k8, config=pallas.Config(forward_kernel="triton")) == "triton"
    # Dh = 192: the Mosaic forward fits, the backward's rings of Q and dO do not
    wide_q, wide_k = jnp.tile(q8, (1, 1, 1, 3)), jnp.tile(k8, (1, 1, 1, 3))
    wide = pallas.concrete(pallas.Config(), wide_q, wide_k, wide_q, BLOCK, False)
    assert (wide.forward_kernel, wide.backward_kernel) == ("mosaic", "triton")
    warpgroups = lambda q, k: pallas.concrete(  # noqa: E731
        pallas.Config(), q, k, q, BLOCK, False
    ).mosaic_backward.warpgroups
    assert pallas.Config().mosaic_backward.warpgroups == 2
    assert q8.shape[-1] == 64 and warpgroups(q8, k8) == 1  # Dh 64: one warpgroup's columns
    assert warpgroups(jnp.tile(q8, (1, 1, 1, 2)), jnp.tile(k8, (1, 1, 1, 2))) == 2  # Dh 128
    pinned = pallas.Config(forward_kernel="mosaic", backward_kernel="mosaic")
    assert pallas.concrete(pinned, q8, k8, q8, BLOCK, False).mosaic_backward.warpgroups == 1
    assert pallas.unsupported_reason(q8, k8, q8, block_size=BLOCK, config=pinned) == ""


def test_running_sums_hold_each_keys_gradients_at_its_padded_key_row():
    """The running sums the kernels add into are laid out as the keys' `pad_keys` rows (the
    kernels' K/V windows address them directly): key gradients added to them come back at their
    keys, the padding rows left out."""
    geo = pallas.chunks.Geometry(batch=2, seq=300, window=300, num_heads=8, num_kv_heads=2,
                                 head_dim=64, index_dim=32, topk=2, block_size=BLOCK,
                                 chunk_queries=8)  # fmt: skip
    sums = mosaic_backward.running_sums(geo, with_student=True)
    rows = mosaic_forward.pad_keys(jnp.zeros((2, 300, 1)), BLOCK).shape[0]
    assert [x.shape for x in sums] == [(rows, 128), (rows, 128), (rows, 32)]
    keys = jax.random.split(jax.random.key(3), 3)
    shapes = [(2, 300, 2, 64), (2, 300, 2, 64), (2, 300, 32)]
    grads = [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]
    twice = mosaic_backward.with_key_gradients(geo, sums, grads)
    twice = mosaic_backward.with_key_gradients(geo, twice, grads)
    for got, grad in zip(mosaic_backward.key_gradients(geo, twice), grads, strict=True):
        np.testing.assert_allclose(got, 2 * grad, rtol=1e-6)
    # key s of the flattened rows sits at padded row BLOCK + s, where a K/V window reads it
    padded = mosaic_forward.pad_keys(grads[2], BLOCK)
    np.testing.assert_allclose(twice[2], 2 * padded, rtol=1e-6)


@pytest.mark.parametrize("with_student", [False, True])
def test_a_window_of_more_segments_than_room_takes_the_triton_backward(with_student):
    """Rows of many short documents (3 tokens each: a list per (block, document)) need more
    segments than `segment_bound` makes room for: that window's gradients come from the Triton
    backward (under a `lax.cond`), equal to the reference's, not NaN; under a KL sink (the
    Mosaic forward ran no student) with LSE_z and the KL from the Triton forward's kernels."""
    q, k, v, _, _, _ = inputs(4, 2, batch=1)
    seq = q.shape[1]
    segments = jnp.asarray(np.arange(seq) // 3 + 1, jnp.int32)[None]
    positions = jnp.asarray(np.arange(seq) % 3, jnp.int32)[None]
    index_q, index_k = student(2, seq, 1)
    blocks = reference.top_blocks(index_q, index_k, segments, positions, block_size=BLOCK,
                                  topk_blocks=2, local_blocks=1)  # fmt: skip
    config = mosaic()
    geo = pallas.chunks.Geometry(batch=1, seq=seq, window=seq, num_heads=8, num_kv_heads=2,
                                 head_dim=q.shape[3], index_dim=index_q.shape[3], topk=2,
                                 block_size=BLOCK, chunk_queries=8)  # fmt: skip
    lists = block_lists.build(blocks, positions, jnp.zeros((), jnp.int32), seq=seq,
                              block_size=BLOCK, chunk_queries=geo.chunk_queries,
                              segment_chunks=config.mosaic_backward.segment_chunks)  # fmt: skip
    assert int(lists.num_segments[0]) > mosaic_backward.segment_bound(geo, config.mosaic_backward)
    args = (q, k, v, blocks, segments, positions)
    index = (index_q, index_k) if with_student else None
    got = gradients(config, *args, index)
    assert len(got) == (5 if with_student else 3)
    assert all(np.isfinite(as_f32(g)).all() for g in got)
    assert_gradients_equal(got, reference_gradients(*args, index))
    if not with_student:  # promised few documents, the window's dQ and key gradients are NaN
        unchecked = gradients(dataclasses.replace(config, few_documents=True), *args, index)
        assert all(np.isnan(as_f32(g)).any() for g in unchecked)
        return
    sunk = dataclasses.replace(config, forward_kernel="mosaic", mosaic=FORWARD)
    got, kl = sunk_gradients(sunk, *args, index)
    assert_gradients_equal(got, reference_gradients(*args, index))
    np.testing.assert_allclose(kl, reference_kl(*args, index), atol=KL_TOLERANCE)


def test_slot_layout_gives_each_segment_whole_slots_and_maps_entries_both_ways():
    """Segments of 70, 3 and 64 entries (then junk table rows) take 2, 1 and 1 slots from slot 0;
    each entry's slot row maps back to it, rows past a segment's entries are empty, and the
    entries after the last segment (invalid selections) have no row."""
    entries, bound = 150, 5
    counts = [70, 3, 64]
    starts = np.cumsum([0] + counts[:-1])
    table = np.zeros((entries, mosaic_forward.TABLE_COLUMNS), np.int32)
    table[:3, 0], table[:3, 1] = starts, counts
    table[3:, :2] = 7  # junk past num_segments
    slots = mosaic_student.slot_layout(jnp.asarray(table), jnp.array([3]), entries, bound)
    size = mosaic_student.SLOT_ENTRIES
    assert list(np.asarray(slots.base[:3])) == [0, 2, 3]
    rows = np.asarray(slots.row_of_entry)
    expected = np.concatenate([np.arange(70), 2 * size + np.arange(3), 3 * size + np.arange(64)])
    np.testing.assert_array_equal(rows[:137], expected)
    outside = mosaic_student.num_slots(entries, bound) * size
    assert (rows[137:] == outside).all()
    back = np.asarray(slots.entry_of_row)
    np.testing.assert_array_equal(back[expected], np.arange(137))
    assert (np.delete(back, expected) == entries).all()


@pytest.mark.parametrize("teacher_bytes, warpgroups", [(0, 1), (0, 2), (1 << 30, 1)])
def test_a_teacher_over_its_budget_comes_from_the_gradients_kernel(teacher_bytes, warpgroups):
    """The KL pass' teacher is kept for the backward within `Config.teacher_bytes`, else the
    backward's gradients kernel takes it from its own P (`teacher_rows`) for the student's
    gradients, one key half per warpgroup with two; one KL pass either way (the forward's), and
    the gradients are the reference's."""
    args = inputs(16, 1, batch=1, head_dim=64 * warpgroups)
    index = student(1, args[0].shape[1], args[0].shape[0])
    config = dataclasses.replace(mosaic("mosaic", warpgroups), teacher_bytes=teacher_bytes)
    with (mock.patch.object(mosaic_forward, "kl_pass", wraps=mosaic_forward.kl_pass) as kl_pass,
          mock.patch.object(mosaic_backward, "teacher_rows",
                            wraps=mosaic_backward.teacher_rows) as teacher_rows):  # fmt: skip
        got = gradients(config, *args, index=index)
    assert kl_pass.call_count == 1
    assert teacher_rows.called == (teacher_bytes == 0)
    assert_gradients_equal(got, reference_gradients(*args, index=index))


def test_query_runs_through_the_mosaic_kernels_equal_the_whole_row():
    """Context parallelism's query slots (two runs of 75 consecutive slots, a later one first,
    cutting the packed documents) through the Mosaic forward, KL pass and backward with the
    student: out (up to bf16 rounding), KL, dq and d(index_q) equal the whole row's at those
    rows; dk, dv and d(index_k) of the row's two halves add up to the whole row's."""
    q, k, v, blocks, segments, positions = inputs(4, 2, batch=1)
    index_q, index_k = student(2, q.shape[1], 1)
    config = dataclasses.replace(mosaic("mosaic"), mosaic=mosaic_forward.Tiling(segment_chunks=2))
    keys = jax.random.split(jax.random.key(7), 2)
    weights = jax.random.normal(keys[0], q.shape)
    kl_weights = jax.random.normal(keys[1], (*q.shape[:2], k.shape[2]))
    halves = [np.stack([np.arange(150, 225), np.arange(0, 75)]),
              np.stack([np.arange(75, 150), np.arange(225, 300)])]  # fmt: skip

    def loss(q, index_q, k, v, index_k, runs):
        rows = runs.reshape(-1)
        out, kl = pallas.sparse_attention(
            q, k, v, blocks[:, rows], segments, positions, block_size=BLOCK,
            student=(index_q, index_k), query_slots=jnp.asarray(runs), config=config,
            interpret=True,
        )  # fmt: skip
        value = (out.astype(jnp.float32) * weights[:, rows]).sum()
        return value + (kl * kl_weights[:, rows]).sum(), (out, kl)

    def run(runs):
        rows = runs.reshape(-1)
        grad = jax.grad(loss, argnums=range(5), has_aux=True)
        return grad(q[:, rows], index_q[:, rows], k, v, index_k, runs)

    whole_grads, whole = run(np.arange(300)[None])
    parts = [run(runs) for runs in halves]
    for runs, (grads, (out, kl)) in zip(halves, parts):
        rows = runs.reshape(-1)
        # equal up to bf16 rounding: XLA:CPU orders the combine's fp32 sums by shape and by
        # the machine's vectors (1-2 bf16 ulps on an AMD EPYC; bit-equal on earlier hosts)
        np.testing.assert_allclose(as_f32(out), as_f32(whole[0][:, rows]), rtol=2**-6,
                                   atol=2**-10)
        np.testing.assert_allclose(as_f32(kl), as_f32(whole[1][:, rows]), atol=1e-6)
        assert_gradients_equal(grads[:2], [g[:, rows] for g in whole_grads[:2]])
    summed = [as_f32(a) + as_f32(b) for a, b in zip(parts[0][0][2:], parts[1][0][2:])]
    assert_gradients_equal(summed, whole_grads[2:])


FORWARD = mosaic_forward.Tiling(segment_chunks=2)  # one warpgroup: the interpreter's time
KL_TOLERANCE = 1e-4


def sunk_gradients(config, q, k, v, blocks, segments, positions, index):
    """`gradients`' loss with the KL through a sink: (d(q, k, v, index_q, index_k), the sink's
    gradient)."""
    keys = jax.random.split(jax.random.key(7), 2)
    weights = jax.random.normal(keys[0], q.shape)
    kl_weights = jax.random.normal(keys[1], (*q.shape[:2], k.shape[2]))

    def loss(q, k, v, index_q, index_k, kl_sink):
        out, kl = pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=BLOCK,
                                          student=(index_q, index_k), kl_sink=kl_sink,
                                          config=config, interpret=True)  # fmt: skip
        return (out.astype(jnp.float32) * weights).sum() + (kl * kl_weights).sum(), kl

    sink = jnp.zeros((*q.shape[:2], k.shape[2]), jnp.float32)
    grads, kl = jax.grad(loss, argnums=range(6), has_aux=True)(q, k, v, *index, sink)
    assert not np.asarray(kl).any()  # the KL output: zeros
    return grads[:5], grads[5]


def reference_kl(q, k, v, blocks, segments, positions, index):
    f32 = [x.astype(jnp.float32) for x in (q, k, v, *index)]
    return reference.sparse_attention(*f32[:3], blocks, segments, positions, block_size=BLOCK,
                                      student=tuple(f32[3:]))[1]  # fmt: skip


@pytest.mark.parametrize("kl_kernel", ["slots", "pass"])
def test_a_kl_sink_leaves_the_student_to_the_backward(kl_kernel):
    """Under a KL sink the Mosaic forward is the attention pass alone (no teacher pass, no
    student's kernel, no KL pass, whatever `kl_kernel`); the backward's student kernel takes
    LSE_z and the KL from the gradients kernel's teacher: the sink's gradient is the reference's
    KL, the inputs' gradients are the reference's."""
    args = inputs(16, 1, batch=1)
    index = student(1, args[0].shape[1], 1)
    config = dataclasses.replace(mosaic("mosaic", kl_kernel=kl_kernel), mosaic=FORWARD)
    with (mock.patch.object(mosaic_backward, "teacher_pass") as teacher_pass,
          mock.patch.object(mosaic_forward, "kl_pass") as kl_pass,
          mock.patch.object(mosaic_student, "kl_terms",
                            wraps=mosaic_student.kl_terms) as kl_terms):  # fmt: skip
        got, kl = sunk_gradients(config, *args, index)
    assert not teacher_pass.called and not kl_pass.called and kl_terms.call_count == 1
    assert_gradients_equal(got, reference_gradients(*args, index=index))
    np.testing.assert_allclose(kl, reference_kl(*args, index), atol=KL_TOLERANCE)
    assert float(kl.max()) > 0.05  # a KL, not zeros


def test_windows_of_both_rows_read_their_queries_in_place():
    """Windows of 128 queries (three a row, the last padded: 300 -> 384) in batch 2 through the
    Mosaic forward and backward with the KL through a sink, G = 16: the kernels copy each
    entry's Q and dO rows from the padded arrays (`WindowRows.rows_at`: the window's first row
    and the rows between the batch rows' windows), not from XLA's copy of the window. Out, the
    gradients and the KL equal the reference's."""
    args = inputs(16, 1)
    index = student(1, args[0].shape[1], 2)
    config = dataclasses.replace(mosaic("mosaic", kl_kernel="slots"), mosaic=FORWARD,
                                 partial_bytes=1, min_window=128)  # fmt: skip
    with mock.patch.object(mosaic_forward, "sorted_rows",
                           wraps=mosaic_forward.sorted_rows) as rows:  # fmt: skip
        out, _ = pallas.sparse_attention(*args, block_size=BLOCK, config=config, interpret=True)
        got, kl = sunk_gradients(config, *args, index)
    windows = {call.args[2].padded.shape[1] // call.args[2].size for call in rows.call_args_list}
    assert windows == {3}
    f32 = [x.astype(jnp.float32) for x in args[:3]]
    expected, _ = reference.sparse_attention(*f32, *args[3:], block_size=BLOCK)
    np.testing.assert_allclose(as_f32(out), as_f32(expected), atol=2e-2)
    assert_gradients_equal(got, reference_gradients(*args, index=index))
    np.testing.assert_allclose(kl, reference_kl(*args, index), atol=KL_TOLERANCE)
