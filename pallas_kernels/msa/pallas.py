"""MiniMax Sparse Attention on GPUs through Pallas kernels: `reference.py`'s signatures.

- `top_blocks`: one kernel (selection_kernel.py) streams the indexer's scores over key tiles and
  keeps each (query, index head)'s top-k document blocks in registers.
- `sparse_attention`: key-block-major kernels (attention_kernels.py) over the selection inverted
  by one sort (block_lists.py), forward and backward, with the indexer's KL and its gradients into
  the index projections; a custom VJP ties them together. Queries go in windows of at most
  `max_window` so that the per-entry shares stay within `partial_bytes` of memory.
- `dense_attention` and `block_recall` are the XLA path's (the dense warm-up and a diagnostic).

The kernels are written for the Triton lowering of Pallas (a stepping stone towards Mosaic GPU;
spec/msa.md §4). On a machine without a GPU they run in Pallas' interpreter (`interpret=None`
picks that), which is how the CPU tests check them against the reference.

Shapes: B batch, S sequence, H query heads, K kv heads (= Hi), G = H // K, Dh head dim, Di index
head dim, k selected blocks per query, W queries per window, E = B·W·K·k selection entries.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.msa import attention_kernels, block_lists, selection_kernel
from pallas_kernels.msa.reference import Student
from pallas_kernels.msa.xla import block_recall, dense_attention

__all__ = ["block_recall", "dense_attention", "sparse_attention", "top_blocks"]

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything but the shapes that fixes how `sparse_attention` runs."""

    attention: attention_kernels.Tiling = attention_kernels.Tiling()
    selection: selection_kernel.Tiling = selection_kernel.Tiling()
    partial_bytes: int = 4 << 30  # memory for the per-entry output shares of one window


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def unsupported_reason(
    q: jax.Array, k: jax.Array, index_q: jax.Array, *, block_size: int, config: Config = Config()
) -> str:
    """Why the kernels can't run a layer with these operands ('' when they can)."""
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        return f"dtype {jnp.dtype(q.dtype)} is not one of bfloat16, float16, float32"
    sizes = {"head_dim": q.shape[3], "index_head_dim": index_q.shape[3], "block_size": block_size}
    for name, size in sizes.items():
        if not _power_of_two(size):
            return f"{name}={size} is not a power of two >= 16"
    group, rows = q.shape[2] // k.shape[2], config.attention.rows
    if rows % group or (rows // group) & (rows // group - 1):
        return f"attention rows={rows} are not a power-of-two number of queries of G={group} heads"
    if config.selection.rows % index_q.shape[2]:
        return f"selection rows={config.selection.rows} are not whole queries of {index_q.shape[2]} heads"
    return ""


def _interpret(interpret: bool | None) -> bool:
    return jax.devices()[0].platform != "gpu" if interpret is None else interpret


def top_blocks(
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    config: Config = Config(),
    interpret: bool | None = None,
) -> jax.Array:
    """Same arguments and result as `reference.top_blocks`."""
    return selection_kernel.top_blocks(
        index_q, index_k, segment_ids, positions, block_size=block_size,
        topk_blocks=topk_blocks, local_blocks=local_blocks, tiling=config.selection,
        interpret=_interpret(interpret),
    )  # fmt: skip


def sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    student: Student = None,
    config: Config = Config(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Same arguments and results as `reference.sparse_attention`."""
    reason = unsupported_reason(q, k, q if student is None else student[0],
                                block_size=block_size, config=config)  # fmt: skip
    if reason:
        raise ValueError(f"MSA kernels: {reason}")
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads, topk = k.shape[2], block_indices.shape[-1]
    chunk_queries = config.attention.chunk_queries(num_heads // num_kv_heads)
    per_query = batch * num_heads * topk * head_dim * jnp.dtype(q.dtype).itemsize
    window = min(seq, max(chunk_queries, config.partial_bytes // per_query))
    num_windows = -(-seq // window)
    geo = attention_kernels.Geometry(
        batch=batch, seq=seq, window=window, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, index_dim=head_dim if student is None else student[0].shape[-1],
        topk=topk, block_size=block_size, chunk_queries=chunk_queries,
    )  # fmt: skip
    window_fn = _window_attention(geo, config.attention, _interpret(interpret), student is not None)

    def windows(x, fill=0):  # [B, S, ...] -> [num_windows, B, W, ...]
        pad = num_windows * window - seq
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(batch, num_windows, window, *x.shape[2:]), 1, 0)

    index_q, index_k = (None, None) if student is None else student
    offsets = jnp.arange(num_windows, dtype=jnp.int32) * window

    def one_window(args):
        q_w, blocks_w, positions_w, index_q_w, offset = args
        return window_fn(q_w, k, v, index_q_w, index_k, blocks_w, segment_ids, positions_w,
                         offset)  # fmt: skip

    xs = (
        windows(q),
        windows(block_indices, fill=-1),
        windows(positions),
        None if student is None else windows(index_q),
        offsets,
    )
    out, kl = jax.lax.map(one_window, xs)

    def unwindow(x):
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(batch, num_windows * window, *x.shape[3:])[:, :seq]

    return unwindow(out), None if student is None else unwindow(kl)


def _window_attention(geo, tiling, interpret: bool, with_student: bool):
    """The custom-VJP attention of one window of queries against every key of the row."""
    kernels = dict(interpret=interpret)

    def flat(x):  # [B, N, heads, D] -> [B·N·heads, D]
        return x.reshape(-1, x.shape[-1])

    def lists_of(blocks, positions, offset):
        return block_lists.build(
            blocks, positions, offset, seq=geo.seq, block_size=geo.block_size,
            chunk_queries=geo.chunk_queries, segment_chunks=tiling.segment_chunks,
        )  # fmt: skip

    def reduce_selections(per_entry, lists, valid, fill):
        shape = (geo.batch, geo.window, geo.num_kv_heads, geo.topk)
        by_slot = block_lists.by_selection(per_entry, lists, shape)
        mask = valid.reshape(*shape, *[1] * (by_slot.ndim - 4))
        return jnp.where(mask, by_slot, fill)

    def forward(q, k, v, index_q, index_k, blocks, segment_ids, positions, offset):
        lists = lists_of(blocks, positions, offset)
        offset_arr = offset.reshape(1).astype(jnp.int32)
        segments = segment_ids.reshape(-1).astype(jnp.int32)
        student = (flat(index_q), flat(index_k)) if with_student else None
        valid = blocks >= 0
        lse_part, lse_z_part = attention_kernels.lse_pass(
            geo, tiling, lists, offset_arr, flat(q), flat(k), segments, student, **kernels
        )
        lse = jax.nn.logsumexp(
            reduce_selections(lse_part.reshape(-1, geo.group), lists, valid, -jnp.inf), axis=3
        )  # [B, W, K, G]
        lse_z = None
        if with_student:
            lse_z = jax.nn.logsumexp(reduce_selections(lse_z_part, lists, valid, -jnp.inf), axis=3)
        share, kl_part = attention_kernels.forward_pass(
            geo, tiling, lists, offset_arr, flat(q), flat(k), flat(v), segments, lse.reshape(-1),
            student, None if lse_z is None else lse_z.reshape(-1), **kernels,
        )  # fmt: skip
        share = share.reshape(-1, geo.group, geo.head_dim).astype(jnp.float32)
        out = reduce_selections(share, lists, valid, 0.0).sum(axis=3).astype(q.dtype)
        out = out.reshape(q.shape)
        kl = None
        if with_student:
            kl = reduce_selections(kl_part, lists, valid, 0.0).sum(axis=3)
        residuals = (q, k, v, index_q, index_k, blocks, segment_ids, positions, offset, lists,
                     lse, lse_z, out)  # fmt: skip
        return (out, kl), residuals

    def backward(residuals, cotangents):
        (q, k, v, index_q, index_k, blocks, segment_ids, positions, offset, lists, lse, lse_z,
         out) = residuals  # fmt: skip
        d_out, d_kl = cotangents
        delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)
        student = (flat(index_q), flat(index_k)) if with_student else None
        dq_part, dk, dv, diq_part, dik = attention_kernels.backward_pass(
            geo, tiling, lists, offset.reshape(1).astype(jnp.int32), flat(q), flat(k), flat(v),
            segment_ids.reshape(-1).astype(jnp.int32), lse.reshape(-1), delta.reshape(-1),
            flat(d_out.astype(q.dtype)), student, None if lse_z is None else lse_z.reshape(-1),
            None if d_kl is None else d_kl.reshape(-1).astype(jnp.float32), **kernels,
        )  # fmt: skip
        valid = blocks >= 0
        dq_part = dq_part.reshape(-1, geo.group, geo.head_dim).astype(jnp.float32)
        dq = reduce_selections(dq_part, lists, valid, 0.0).sum(axis=3).reshape(q.shape)
        grads = [dq.astype(q.dtype), dk.reshape(k.shape).astype(k.dtype),
                 dv.reshape(v.shape).astype(v.dtype)]  # fmt: skip
        if with_student:
            diq = reduce_selections(diq_part, lists, valid, 0.0).sum(axis=3)
            grads += [diq.astype(index_q.dtype), dik.reshape(index_k.shape).astype(index_k.dtype)]
        else:
            grads += [None, None]
        return (*grads, None, None, None, None)

    @jax.custom_vjp
    def attention(q, k, v, index_q, index_k, blocks, segment_ids, positions, offset):
        return forward(q, k, v, index_q, index_k, blocks, segment_ids, positions, offset)[0]

    attention.defvjp(forward, backward)
    return attention
