"""The Mosaic GPU MSA forward (`Config.forward_kernel="mosaic"`), with and without the indexer's
student, run by Mosaic GPU's interpreter on CPU, against the O(S²) reference (out, KL); its LSE
and LSE_z residuals through the shared Triton backward (gradients equal to the Triton forward's);
its lowering for CUDA, which needs no GPU.

Random bf16 inputs: row 0 packs a document of 150 slots and one of 147 starting mid-block, then 3
padding slots; row 1 is one document; S = 300 is not a multiple of the 128-key block; early
queries have fewer than k valid blocks (-1). Index projections in bf16 with Di = 64 (the Mosaic
kernels' wgmma takes 16-bit operands and whole 64-element tiles), so that both forwards see the
same values. Segments of two chunks, so long block lists go on in
later segments and many chunks are a list's partial last one (stored query by query).
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.msa import mosaic_forward, mosaic_student, pallas, reference

BLOCK = 128
# bf16 inputs and output: the reference runs in float32 on the same (rounded) inputs
OUT_TOLERANCE = 2e-2  # about two bf16 ulps at the outputs' magnitude (≤ 2)
KL_TOLERANCE = 1e-4  # fp32 KL (≤ 2) from the same bf16 inputs; the teacher's P in two 16-bit parts
GRAD_RELATIVE = 2e-2
INDEX_DIM = 64


def inputs(group: int, kv_heads: int, seq: int = 300, batch: int = 2, head_dim: int = 64):
    keys = jax.random.split(jax.random.key(group), 3)
    q = bf16(keys[0], (batch, seq, group * kv_heads, head_dim))
    k, v = (bf16(key, (batch, seq, kv_heads, head_dim)) for key in keys[1:3])
    index_q, index_k = student(kv_heads, seq, batch)
    first = 150
    segments = np.ones((batch, seq), np.int32)
    segments[0, first:], segments[0, seq - 3 :] = 2, 0
    positions = np.tile(np.arange(seq), (batch, 1))
    positions[0, first:] = np.arange(seq - first)
    positions[0, seq - 3 :] = np.arange(3)
    segments, positions = jnp.asarray(segments), jnp.asarray(positions)
    blocks = reference.top_blocks(index_q, index_k, segments, positions, block_size=BLOCK,
                                  topk_blocks=2, local_blocks=1)  # fmt: skip
    return q, k, v, blocks, segments, positions


def bf16(key, shape):
    return jax.random.normal(key, shape).astype(jnp.bfloat16)


def student(kv_heads: int, seq: int, batch: int):
    """(index_q [B, S, K, Di], index_k [B, S, Di]) in bf16; they also choose `inputs`' blocks."""
    keys = jax.random.split(jax.random.key(kv_heads + 100), 2)
    return bf16(keys[0], (batch, seq, kv_heads, INDEX_DIM)), bf16(keys[1], (batch, seq, INDEX_DIM))


def mosaic(segment_chunks: int = 2, stages: int = 2, kl_kernel: str = "pass",
           warpgroups: int = 1) -> pallas.Config:  # fmt: skip
    tiling = mosaic_forward.Tiling(segment_chunks=segment_chunks, stages=stages,
                                   warpgroups=warpgroups)  # fmt: skip
    return pallas.Config(forward_kernel="mosaic", mosaic=tiling, kl_kernel=kl_kernel)


def as_f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@pytest.mark.parametrize("group, kv_heads, stages, warpgroups",
                         [(4, 2, 2, 1), (16, 1, 3, 1), (4, 2, 3, 2), (16, 1, 2, 2)])
def test_forward_matches_reference(group, kv_heads, stages, warpgroups):
    """G = 4 (entries padded to 8 rows, 8 queries a chunk) and G = 16 (4 queries a chunk); rows
    R = 64, the one size the kernel takes (128 would not fit one warpgroup's registers); one
    warpgroup a program, or two taking a segment's chunks in turn (segments of 2 chunks: many
    give the second warpgroup one chunk or none)."""
    q, k, v, blocks, segments, positions = args = inputs(group, kv_heads)
    assert (np.asarray(blocks) == -1).any() and (np.asarray(blocks) >= 0).any()
    config = mosaic(stages=stages, warpgroups=warpgroups)
    out, none = pallas.sparse_attention(*args, block_size=BLOCK, config=config, interpret=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    expected, _ = reference.sparse_attention(*f32, blocks, segments, positions, block_size=BLOCK)
    assert none is None and out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(as_f32(out), as_f32(expected), atol=OUT_TOLERANCE)
    # the first padding slot of row 0 sees itself only: its output is its own value row
    own_values = np.repeat(as_f32(v[0, -3]), group, axis=0)
    np.testing.assert_allclose(as_f32(out[0, -3]), own_values, atol=OUT_TOLERANCE)


@pytest.mark.parametrize("group, kv_heads, kl_kernel, warpgroups, stages",
                         [(4, 2, "pass", 1, 2), (16, 1, "pass", 1, 2), (4, 2, "slots", 1, 2),
                          (16, 1, "slots", 1, 2), (16, 1, "slots", 2, 1)])  # fmt: skip
def test_forward_with_student_matches_reference(group, kv_heads, kl_kernel, warpgroups, stages):
    """With the student: out and the KL per (query, kv head) against the reference, on the packed
    row (the forward kernel's per-entry LSE_z combined, then on the global LSEs the KL pass; or
    the attention pass without the student, the teacher pass (on the backward's items, a key
    half per warpgroup) and the student's kernel on slots of entries; with two warpgroups at one
    ring stage, the attention pass on both)."""
    q, k, v, blocks, segments, positions = args = inputs(group, kv_heads, batch=1)
    assert (np.asarray(blocks) == -1).any()
    index = student(kv_heads, q.shape[1], 1)
    config = mosaic(stages=stages, kl_kernel=kl_kernel, warpgroups=warpgroups)
    with mock.patch.object(mosaic_student, "kl_terms", wraps=mosaic_student.kl_terms) as slots:
        out, kl = pallas.sparse_attention(*args, block_size=BLOCK, student=index, config=config,
                                          interpret=True)  # fmt: skip
    assert slots.called == (kl_kernel == "slots")
    f32 = [x.astype(jnp.float32) for x in (q, k, v, *index)]
    expected, expected_kl = reference.sparse_attention(
        *f32[:3], blocks, segments, positions, block_size=BLOCK, student=f32[3:]
    )
    assert out.dtype == q.dtype and kl.dtype == jnp.float32 and kl.shape == expected_kl.shape
    np.testing.assert_allclose(as_f32(out), as_f32(expected), atol=OUT_TOLERANCE)
    np.testing.assert_allclose(as_f32(kl), as_f32(expected_kl), atol=KL_TOLERANCE)
    # the first padding slot sees itself only: teacher and student agree, KL 0
    np.testing.assert_allclose(as_f32(kl[0, -3]), 0.0, atol=KL_TOLERANCE)


def test_kl_on_slots_leaves_a_window_of_more_segments_than_room_to_the_kl_pass():
    """Rows of 3-token documents (a list per (block, document)) hold more segments than the
    student's slots make room for: `kl_kernel="slots"` takes the KL pass there (a `lax.cond`),
    and the KL equals the reference's."""
    q, k, v, _, _, _ = inputs(4, 2, batch=1)
    seq = q.shape[1]
    segments = jnp.asarray(np.arange(seq) // 3 + 1, jnp.int32)[None]
    positions = jnp.asarray(np.arange(seq) % 3, jnp.int32)[None]
    index = student(2, seq, 1)
    blocks = reference.top_blocks(*index, segments, positions, block_size=BLOCK, topk_blocks=2,
                                  local_blocks=1)  # fmt: skip
    args = (q, k, v, blocks, segments, positions)
    with mock.patch.object(mosaic_student, "kl_terms", wraps=mosaic_student.kl_terms) as slots:
        _, kl = pallas.sparse_attention(*args, block_size=BLOCK, student=index,
                                        config=mosaic(kl_kernel="slots"), interpret=True)
    assert slots.called  # traced in the cond's other branch
    f32 = [x.astype(jnp.float32) for x in (q, k, v, *index)]
    _, expected = reference.sparse_attention(*f32[:3], blocks, segments, positions,
                                             block_size=BLOCK, student=f32[3:])  # fmt: skip
    np.testing.assert_allclose(as_f32(kl), as_f32(expected), atol=KL_TOLERANCE)


def gradients(config, q, k, v, blocks, segments, positions, index=None):
    """d(q, k, v[, index_q, index_k]) of a random linear function of out (and of the KL)."""
    keys = jax.random.split(jax.random.key(7), 2)
    weights = jax.random.normal(keys[0], q.shape)
    kl_weights = jax.random.normal(keys[1], (*q.shape[:2], k.shape[2]))

    def loss(q, k, v, *index):
        out, kl = pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=BLOCK,
                                          student=index or None, config=config,
                                          interpret=True)  # fmt: skip
        value = (out.astype(jnp.float32) * weights).sum()
        return value if kl is None else value + (kl * kl_weights).sum()

    operands = (q, k, v) + (index or ())
    return jax.grad(loss, argnums=tuple(range(len(operands))))(*operands)


def assert_gradients_equal(gots, expecteds):
    assert len(gots) == len(expecteds)
    for got, expected in zip(gots, expecteds, strict=True):
        got, expected = as_f32(got), as_f32(expected)
        assert np.linalg.norm(got - expected) <= GRAD_RELATIVE * np.linalg.norm(expected)


@pytest.mark.parametrize("group, kv_heads", [(4, 2), (16, 1)])
def test_gradients_equal_the_triton_forwards(group, kv_heads):
    """The backward is shared: equal gradients mean the Mosaic forward's LSE residual is the
    per-(query, head) logsumexp the Triton forward leaves it (Q rows gathered by XLA for G = 4,
    copied per entry by the kernel for G = 16)."""
    args = inputs(group, kv_heads, seq=200, batch=1)
    assert_gradients_equal(gradients(mosaic(), *args), gradients(pallas.Config(), *args))


@pytest.mark.parametrize("group, kv_heads", [(4, 2), (16, 1)])
def test_student_gradients_equal_the_triton_forwards(group, kv_heads):
    """With the student, d(q, k, v, index_q, index_k) through the shared backward: equal when the
    Mosaic forward's lse and lse_z residuals (and its KL) are the Triton forward's."""
    args = inputs(group, kv_heads, seq=200, batch=1)
    index = student(kv_heads, 200, 1)
    assert_gradients_equal(gradients(mosaic(), *args, index=index),
                           gradients(pallas.Config(), *args, index=index))  # fmt: skip


@pytest.mark.parametrize("with_student, kl_kernel, warpgroups, stages",
                         [(False, "pass", 1, 2), (True, "pass", 1, 2), (True, "slots", 1, 2),
                          (False, "pass", 2, 2), (True, "slots", 2, 2), (True, "slots", 2, 1)])
def test_lowers_for_cuda_without_a_gpu(with_student, kl_kernel, warpgroups, stages):
    """Mosaic GPU's lowering (layout inference, TMA and tile constraints) runs on CPU: the forward
    kernel, with a student also its LSE_z outputs and the KL pass (Di = 128, M3's); with the KL
    on slots also the forward without the student, the teacher pass and the student's KL kernel
    (beside the first two, which a window of more segments than the slots hold takes). With two
    warpgroups, the attention pass without the student runs them; the passes with a student run
    one; the teacher pass two by default (`Config.teacher`: a key half each)."""

    def forward(q, k, v, blocks, segments, positions, *index):
        config = mosaic(16, stages, kl_kernel=kl_kernel, warpgroups=warpgroups)
        return pallas.sparse_attention(q, k, v, blocks, segments, positions, block_size=BLOCK,
                                       student=index or None, config=config,
                                       interpret=False)  # fmt: skip

    with mock.patch.object(plgpu, "kernel", wraps=plgpu.kernel) as launches:
        text = jax.jit(forward).trace(*cuda_operands(with_student)).lower(
            lowering_platforms=("cuda",)
        ).as_text()
    kernels = {"pass": 2, "slots": 5}[kl_kernel] if with_student else 1
    assert text.count("custom_call @mosaic_gpu") == kernels
    names = [(call.args[0].__name__, call.kwargs.get("num_threads", 1))
             for call in launches.call_args_list]  # fmt: skip
    paired = {name for name, threads in names if threads == 2}
    expected = {"msa_mosaic_forward"} if warpgroups == 2 else set()
    if with_student and kl_kernel == "slots":
        expected.add("msa_mosaic_teacher_pass")
    assert paired == expected, names


def cuda_operands(with_student: bool) -> tuple:
    """Abstract operands of a layer with M3's head and index dims (G = 16, Dh = Di = 128) for the
    lowering checks: q, k, v, blocks, segment ids, positions (and index_q, index_k)."""
    struct = jax.ShapeDtypeStruct
    q = struct((1, 512, 32, 128), jnp.bfloat16)
    kv = struct((1, 512, 2, 128), jnp.bfloat16)
    blocks = struct((1, 512, 2, 4), jnp.int32)
    rows = struct((1, 512), jnp.int32)
    index = (struct((1, 512, 2, 128), jnp.bfloat16), struct((1, 512, 128), jnp.bfloat16))
    return (q, kv, kv, blocks, rows, rows) + (index if with_student else ())


def test_unsupported_reason_names_the_mosaic_limits():
    q, k, _, _, _, _ = inputs(4, 2, seq=8, batch=1)
    reason = lambda q, k, **kw: pallas.unsupported_reason(  # noqa: E731
        q, k, q, **{"block_size": BLOCK, "config": mosaic(), "interpret": True, **kw}
    )
    assert reason(q, k) == ""
    assert "float32" in reason(q.astype(jnp.float32), k)
    assert "head_dim=48" in reason(q[..., :48], k[..., :48])
    assert "block_size=64" in reason(q, k, block_size=64)
    wide_heads = jnp.tile(q, (1, 1, 1, 4))  # Dh = 256: K, V, Q ring, P, O over 227 KiB
    assert "shared memory" in reason(wide_heads, jnp.tile(k, (1, 1, 1, 4)))
    wide = pallas.Config(forward_kernel="mosaic", mosaic=mosaic_forward.Tiling(rows=128))
    assert "rows=128" in reason(q, k, config=wide)
    teacher = pallas.Config(forward_kernel="mosaic", teacher=mosaic_forward.Tiling(warpgroups=4))
    assert "teacher pass: warpgroups=4" in reason(q, k, config=teacher)
    assert "forward_kernel='cuda'" in reason(q, k, config=pallas.Config(forward_kernel="cuda"))
    # with a student: Di in whole 64-element tiles, and the index tiles in shared memory too
    with_index = lambda index_q, **kw: pallas.unsupported_reason(  # noqa: E731
        q, k, index_q, **{"block_size": BLOCK, "config": mosaic(), "interpret": True, **kw}
    )
    index_q = student(2, 8, 1)[0]
    assert with_index(index_q) == ""
    assert "index_head_dim=16" in with_index(index_q[..., :16])
    assert "shared memory" in with_index(jnp.tile(index_q, (1, 1, 1, 8)))


def test_auto_takes_the_mosaic_forward_only_compiled_on_the_layouts_it_was_timed_on():
    """"auto" (the default): Mosaic when compiled, G a multiple of 8 and within its limits;
    Triton in the interpreter (the CPU tests of the default path), for G < 8 (the XLA-gathered
    Q rows, not timed) and where the Mosaic kernels can't run."""
    kernel = lambda q, k, index_q=None, interpret=False, block_size=BLOCK: pallas.concrete(  # noqa: E731
        pallas.Config(), q, k, q if index_q is None else index_q, block_size, interpret
    ).forward_kernel
    q8, k8, _, _, _, _ = inputs(8, 2, seq=8, batch=1)
    q4, k4, _, _, _, _ = inputs(4, 2, seq=8, batch=1)
    assert pallas.Config().forward_kernel == "auto"
    assert kernel(q8, k8) == "mosaic"
    assert kernel(q8, k8, index_q=student(2, 8, 1)[0]) == "mosaic"
    assert kernel(q8, k8, interpret=True) == "triton"
    assert kernel(q4, k4) == "triton"
    assert kernel(q8.astype(jnp.float32), k8.astype(jnp.float32)) == "triton"
    assert kernel(q8, k8, block_size=64) == "triton"
    explicit = pallas.Config(forward_kernel="triton", backward_kernel="triton")
    assert pallas.concrete(explicit, q8, k8, q8, BLOCK, False) is explicit


def test_the_forward_takes_one_warpgroup_where_the_default_two_do_not_fit():
    """The default tiling's two warpgroups a program, and one where their shared memory is over
    the limit (Dh = 256: 296,960 bytes on two, 214,272 on one) instead of the Triton forward."""

    def compiled_for(head_dim: int) -> pallas.Config:
        q, k, *_ = inputs(8, 2, seq=8, batch=1, head_dim=head_dim)
        return pallas.concrete(pallas.Config(), q, k, q, BLOCK, False)

    assert pallas.Config().mosaic.warpgroups == 2
    wide = compiled_for(256)
    assert wide.forward_kernel == "mosaic" and wide.mosaic.warpgroups == 1
    assert compiled_for(128).mosaic.warpgroups == 2
