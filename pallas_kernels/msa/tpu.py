"""MiniMax Sparse Attention on TPUs through Mosaic TPU Pallas kernels: `reference.py`'s signatures.

- `sparse_attention`, forward and backward (custom VJP), query-tile-major (spec/msa.md §4 (a)):
  one program per (row, kv head, tile of Tq queries) walks the key blocks its queries selected;
  the G heads of the Tq queries fill the Tq·G rows of each Q·Kᵀ (128 by default: one MXU pass).
  The walk is a table in scalar prefetch (`PrefetchScalarGridSpec`) and K/V blocks come through
  data-dependent `index_map`s reading it, so only the blocks some query of the tile selected are
  DMA'd. Online softmax, fp32 accumulation. A key counts for a query when its own document block
  (positions // block_size, reference.py) is among the query's selection, it is in the query's
  document and not after it; a document starting mid-block touches two row blocks per selected
  block, one per row from slot 0 exactly the selected blocks. dQ (and d index_q) run over the
  same table; dK, dV (and d index_k) over the inverted one, key block -> query tiles. The
  indexer's KL takes a second forward kernel, the LSEs known. Kernels: tpu_kernels.py.
- `top_blocks`: one kernel (tpu_selection.py) streams the indexer's scores over key tiles with
  (query, index head) rows on lanes, the block max and a running top-k per row in VMEM; the first
  and last key tile of each query tile come from scalar prefetch, so tiles before its earliest
  document and after its last query are never fetched. Exactly `reference.top_blocks`' result,
  order included.
- `dense_attention` and `block_recall`: the XLA path's.

Queries go in windows so that one call's tables stay within `table_entries` (SMEM is small).
Query slots (reference.py): the kernels read each query's slot, segment and position from
per-query operands, so a context-parallel device's chunks attend to the whole row of keys.
On a machine without a TPU the kernels run in Pallas' TPU interpreter (`interpret=None` picks it),
which checks block specs and the scalar-prefetch tables on CPU. Speed: unmeasured (no TPU here).
`unsupported_reason` covers both kernels, so a layer either kernel can't take runs the XLA path.

Shapes: B batch, S queries, T keys (= S without query slots), H query heads, K kv heads (= Hi),
G = H // K, Dh head dim, Di index head dim, k selected blocks per query, Tq queries per tile, W
queries per window.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import target
from pallas_kernels.attention.reference import at_query_slots
from pallas_kernels.msa import tpu_kernels, tpu_selection
from pallas_kernels.msa.reference import (
    SAVED_BY_ANY_REMAT,
    SAVED_BY_REMAT,
    Student,
    kl_through_sink,
)
from pallas_kernels.msa.tpu_selection import NO_SEGMENT
from pallas_kernels.msa.xla import block_recall, dense_attention

__all__ = ["block_recall", "dense_attention", "sparse_attention", "top_blocks"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything but the shapes that fixes how the kernels run."""

    rows: int = 128  # Tq·G rows of one Q·Kᵀ tile (Tq = rows // G queries, at least 1)
    table_entries: int = 1 << 16  # int32 table entries per call (256 KiB of SMEM)
    selection: tpu_selection.Tiling = tpu_selection.Tiling()  # `top_blocks`' kernel

    def __post_init__(self):
        if self.rows < 1 or self.table_entries < 1:
            raise ValueError(f"{self.rows=} and {self.table_entries=} must be positive")


def unsupported_reason(
    q: jax.Array, k: jax.Array, index_q: jax.Array, *, block_size: int, config: Config = Config()
) -> str:
    """Why the compiled kernels can't run a layer with these operands ('' when they can); the
    interpreters take any. Conservative (unverified on a TPU): lane-dense head dims and blocks
    (multiples of 128 lanes), whole sublane tiles of queries (multiples of 8), and the selection
    kernel's own conditions (`tpu_selection.unsupported_reason`)."""
    sizes = {"head_dim": q.shape[3], "index_head_dim": index_q.shape[3], "block_size": block_size}
    for name, size in sizes.items():
        if size % 128:
            return f"{name}={size} is not a multiple of 128"
    queries = max(1, config.rows // (q.shape[2] // k.shape[2]))
    if queries % 8:
        return f"rows={config.rows} give {queries} queries a tile, not a multiple of 8"
    return tpu_selection.unsupported_reason(index_q, block_size=block_size, tiling=config.selection)


def _interpret(interpret):
    """None: the TPU interpreter (`pltpu.InterpretParams`, which simulates SMEM, VMEM and DMAs)
    unless on a TPU; anything else goes to `pallas_call` as it is (True: Pallas' generic
    interpreter, compiled into one XLA loop: far faster, and what most tests use)."""
    if interpret is None:
        return pltpu.InterpretParams() if target.platform() != "tpu" else False
    return interpret


def _geometry(q, k, index_dim, topk, block_size, config) -> tpu_kernels.Geometry:
    batch, queries, num_heads, head_dim = q.shape
    seq, num_kv_heads = k.shape[1:3]
    group = num_heads // num_kv_heads
    tile = min(max(1, config.rows // group), queries)
    num_tiles = -(-queries // tile)
    key_blocks = -(-seq // block_size)
    entries = min(key_blocks, 2 * tile * topk)
    per_tile = batch * num_kv_heads * max(entries, key_blocks)  # forward or inverted table
    tiles = max(1, min(num_tiles, config.table_entries // per_tile))
    return tpu_kernels.Geometry(batch, seq, queries, num_kv_heads, group, head_dim, index_dim,
                                topk, block_size, tile, tiles, entries)  # fmt: skip


def top_blocks(
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    query_slots: jax.Array | None = None,
    config: Config = Config(),
    interpret=None,
) -> jax.Array:
    """Same arguments and result as `reference.top_blocks`, from the selection kernel.

    interpret: None (the TPU interpreter unless on a TPU), a bool, or `pltpu.InterpretParams`.
    """
    return tpu_selection.top_blocks(
        index_q, index_k, segment_ids, positions, block_size=block_size, topk_blocks=topk_blocks,
        local_blocks=local_blocks, query_slots=query_slots, tiling=config.selection,
        interpret=_interpret(interpret),
    )  # fmt: skip


def _pad(x, size, fill=0, axis=1):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(jnp.asarray(x), pad, constant_values=fill)


def _count(geo):
    return -(-geo.queries // geo.window)


def _windows(geo, x):  # [B, K, count·W, ...] -> [count, B, K, W, ...]
    x = x.reshape(*x.shape[:2], _count(geo), geo.window, *x.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _rows(geo, x):  # [B, S, H, D] -> [count, B, K, W·G, D], rows query-major
    batch, _, _, width = x.shape
    x = _pad(x, _count(geo) * geo.window).reshape(batch, -1, geo.num_kv_heads, geo.group, width)
    x = _windows(geo, x.transpose(0, 2, 1, 3, 4))
    return x.reshape(_count(geo), batch, geo.num_kv_heads, geo.window * geo.group, width)


def _from_rows(geo, x):  # the inverse of `_rows`
    count, batch, heads, _, width = x.shape
    x = x.reshape(count, batch, heads, geo.window, geo.group, width).transpose(1, 0, 3, 2, 4, 5)
    return x.reshape(batch, count * geo.window, heads * geo.group, width)[:, : geo.queries]


def _operands(geo, k, v, index_q, index_k, blocks, segment_ids, positions, query_slots):
    """Keys (whole rows) and per-window queries in the kernels' layouts (tpu_kernels); padded
    queries are in no segment."""
    batch, queries = k.shape[0], _count(geo) * geo.window
    key_slots = geo.key_blocks * geo.block_size
    to_heads = lambda x: _pad(x, key_slots).transpose(0, 2, 1, 3)  # [B, K, nb·block, Dh]
    kblock = _pad(jnp.asarray(positions) // geo.block_size, key_slots, fill=-2)
    keys = {
        "k": to_heads(k), "v": to_heads(v), "kblock": kblock.astype(jnp.int32)[:, None],
        "kseg": _pad(segment_ids, key_slots, fill=NO_SEGMENT).astype(jnp.int32)[:, None],
        "ik": None if index_k is None else _pad(index_k, key_slots),
    }  # fmt: skip
    slots = jnp.arange(geo.queries) if query_slots is None else query_slots.reshape(-1)
    slots = _pad(slots[None].astype(jnp.int32), queries)[0].reshape(-1, 1, geo.window, 1)
    segments = _pad(at_query_slots(segment_ids, query_slots), queries, fill=-1)
    segments = segments.astype(jnp.int32)
    query_positions = _pad(at_query_slots(positions, query_slots), queries)
    windows = (
        _windows(geo, _pad(blocks, queries, fill=-1).transpose(0, 2, 1, 3)),
        jnp.broadcast_to(slots, (slots.shape[0], batch, geo.window, 1)),
        jnp.moveaxis(segments.reshape(batch, -1, geo.window, 1), 1, 0),
        jnp.moveaxis(query_positions.reshape(batch, -1, geo.window), 1, 0),
        None if index_q is None else _windows(geo, _pad(index_q, queries).transpose(0, 2, 1, 3)),
    )
    return keys, windows


def _queries(geo, x):  # [B, S, K] -> [count, B, K, W, 1]
    return _windows(geo, _pad(x, _count(geo) * geo.window).transpose(0, 2, 1)[..., None])


def _from_queries(geo, x):  # [count, B, K, W, D] -> [B, S, K, D]
    x = jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], -1, x.shape[-1])
    return x.transpose(0, 2, 1, 3)[:, : geo.queries]


def _forward(geo, interpret, q, k, v, index_q, index_k, blocks, segment_ids, positions,
             query_slots):  # fmt: skip
    """The kernels over every window -> out [B, S, H, Dh], KL [B, S, K] fp32 or None, and for
    the backward the LSE rows [count, B, K, W·G, 1] and the student's [count, B, K, W, 1]."""
    keys, windows = _operands(geo, k, v, index_q, index_k, blocks, segment_ids, positions,
                              query_slots)  # fmt: skip
    run = functools.partial(tpu_kernels.window_forward, geo, interpret, keys)
    out, lse, kl, lse_z = jax.lax.map(run, (_rows(geo, q), *windows))
    kl = None if kl is None else _from_queries(geo, kl)[..., 0]
    return _from_rows(geo, out), kl, lse, lse_z


def _backward(geo, interpret, residuals, d_out, d_kl):
    """The kernels' gradients of q, k, v (and of index_q, index_k with a student), summed over
    windows in fp32."""
    (q, k, v, index_q, index_k, blocks, segment_ids, positions, query_slots, out, lse,
     lse_z) = residuals  # fmt: skip
    with_student = index_q is not None
    delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1, keepdims=True)
    keys, windows = _operands(geo, k, v, index_q, index_k, blocks, segment_ids, positions,
                              query_slots)  # fmt: skip
    student_grads = (lse_z, _queries(geo, d_kl.astype(jnp.float32))) if with_student else None
    xs = (_rows(geo, q), *windows, lse, _rows(geo, d_out.astype(q.dtype)), _rows(geo, delta),
          student_grads)  # fmt: skip

    def window(sums, x):
        grads = tpu_kernels.window_backward(geo, interpret, keys, x[:6], *x[6:])
        dq, d_index_q = grads[0], grads[1] if with_student else None
        key_grads = grads[2:] if with_student else grads[1:]
        return tuple(total + g for total, g in zip(sums, key_grads)), (dq, d_index_q)

    zeros = [jnp.zeros(keys["k"].shape, jnp.float32)] * 2
    if with_student:
        zeros.append(jnp.zeros((*keys["k"].shape[:3], geo.index_dim), jnp.float32))
    sums, (dq, d_index_q) = jax.lax.scan(window, tuple(zeros), xs)
    to_rows = lambda x, like: x.transpose(0, 2, 1, 3)[:, : geo.seq].astype(like.dtype)
    grads = (_from_rows(geo, dq).astype(q.dtype), to_rows(sums[0], k), to_rows(sums[1], v))
    if not with_student:
        return (*grads, None, None)
    d_index_k = sums[2].sum(axis=1)[:, : geo.seq].astype(index_k.dtype)  # over the kv heads
    return (*grads, _from_queries(geo, d_index_q).astype(index_q.dtype), d_index_k)


@functools.cache
def _attention(geo: tpu_kernels.Geometry, interpret):
    """Custom-VJP sparse attention, the kernels both ways."""
    forward_kernels = jax.jit(functools.partial(_forward, geo, interpret))
    backward_kernels = jax.jit(functools.partial(_backward, geo, interpret))

    @jax.custom_vjp
    def attention(q, k, v, index_q, index_k, blocks, segment_ids, positions, query_slots):
        args = (q, k, v, index_q, index_k, blocks, segment_ids, positions, query_slots)
        return forward_kernels(*args)[:2]

    def forward(*args):
        out, kl, lse, lse_z = forward_kernels(*args)
        out = checkpoint_name(out, SAVED_BY_REMAT)
        lse, lse_z = (None if x is None else checkpoint_name(x, SAVED_BY_ANY_REMAT)
                      for x in (lse, lse_z))  # fmt: skip
        return (out, kl), (*args, out, lse, lse_z)

    def backward(residuals, cotangents):
        return (*backward_kernels(residuals, *cotangents), None, None, None, None)

    attention.defvjp(forward, backward)
    return attention


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
    query_slots: jax.Array | None = None,
    kl_sink: jax.Array | None = None,
    config: Config = Config(),
    interpret=None,
) -> tuple[jax.Array, jax.Array | None]:
    """Same arguments and results as `reference.sparse_attention`.

    interpret: None (the TPU interpreter unless on a TPU), a bool, or `pltpu.InterpretParams`.
    """
    index_q, index_k = (None, None) if student is None else student
    index_dim = q.shape[3] if index_q is None else index_q.shape[3]
    geo = _geometry(q, k, index_dim, block_indices.shape[-1], block_size, config)
    attention = _attention(geo, _interpret(interpret))
    slots = None if query_slots is None else jnp.asarray(query_slots, jnp.int32)
    out, kl = attention(q, k, v, index_q, index_k, block_indices, segment_ids, positions, slots)
    return out, kl_through_sink(kl, kl_sink)
