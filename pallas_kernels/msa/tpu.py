"""MiniMax Sparse Attention on TPUs through Mosaic TPU Pallas kernels: `reference.py`'s signatures.

- `sparse_attention` forward: query-tile-major (spec/msa.md §4 (a)). One program per (row, kv
  head, tile of Tq queries) walks the key blocks its queries selected; the G heads of the Tq
  queries fill Tq·G rows of each Q·Kᵀ (128 by default: one MXU pass). The walk is a table in
  scalar prefetch (`PrefetchScalarGridSpec`): for every (row, kv head, tile), the fixed row blocks
  of `block_size` keys that hold a key of some selected document block, sorted. K/V blocks come
  through data-dependent `index_map`s reading that table, so only those blocks are DMA'd; the
  table repeats its last block after the end, where the pipeline skips the copy and the kernel
  skips the work. Online softmax, fp32 accumulation. Inside a block, a key counts for a query when
  its own document block (positions // block_size, reference.py) is among the query's selection,
  it is in the query's document and not after it. A document starting mid-block touches two row
  blocks per selected block; one per row from slot 0 touches exactly the selected blocks.
  With a student, a second kernel over the same table computes the indexer's KL with the main
  branch's LSEs known (the teacher averages G heads' probabilities, which an online pass cannot).
- `sparse_attention` backward: the XLA path's (`xla.sparse_attention`) recomputed under `jax.vjp`
  — not a kernel yet.
- `top_blocks`, `dense_attention` and `block_recall`: the XLA path's.

Queries go in windows so that one call's table stays within `table_entries` (SMEM is small).
On a machine without a TPU the kernels run in Pallas' TPU interpreter (`interpret=None` picks it),
which checks block specs and the scalar-prefetch table on CPU. Speed is unmeasured.

Shapes: B batch, S sequence, H query heads, K kv heads (= Hi), G = H // K, Dh head dim, Di index
head dim, k selected blocks per query, Tq queries per tile, R = Tq·G rows, nb row blocks of keys,
U table entries per tile, W queries per window.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.xla import NEG_INF
from pallas_kernels.msa import xla
from pallas_kernels.msa.reference import Student
from pallas_kernels.msa.xla import block_recall, dense_attention

__all__ = ["block_recall", "dense_attention", "sparse_attention", "top_blocks"]

NO_SEGMENT = jnp.iinfo(jnp.int32).min  # padded key slots: in no document


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything but the shapes that fixes how `sparse_attention` runs."""

    rows: int = 128  # Tq·G rows of one Q·Kᵀ tile (Tq = rows // G queries, at least 1)
    table_entries: int = 1 << 16  # int32 table entries per call (256 KiB of SMEM)

    def __post_init__(self):
        if self.rows < 1 or self.table_entries < 1:
            raise ValueError(f"{self.rows=} and {self.table_entries=} must be positive")


def unsupported_reason(
    q: jax.Array, k: jax.Array, index_q: jax.Array, *, block_size: int, config: Config = Config()
) -> str:
    """Why the compiled kernels can't run a layer with these operands ('' when they can); the
    interpreters take any. Conservative (unverified on a TPU): lane-dense head dims and blocks
    (multiples of 128 lanes) and whole sublane tiles of queries (multiples of 8)."""
    sizes = {"head_dim": q.shape[3], "index_head_dim": index_q.shape[3], "block_size": block_size}
    for name, size in sizes.items():
        if size % 128:
            return f"{name}={size} is not a multiple of 128"
    queries = max(1, config.rows // (q.shape[2] // k.shape[2]))
    if queries % 8:
        return f"rows={config.rows} give {queries} queries a tile, not a multiple of 8"
    return ""


def _interpret(interpret):
    """None: the TPU interpreter (`pltpu.InterpretParams`, which simulates SMEM, VMEM and DMAs)
    unless on a TPU; anything else goes to `pallas_call` as it is (True: Pallas' generic
    interpreter, compiled into one XLA loop: far faster, and what most tests use)."""
    if interpret is None:
        return pltpu.InterpretParams() if jax.default_backend() != "tpu" else False
    return interpret


@dataclasses.dataclass(frozen=True)
class _Geometry:
    batch: int
    seq: int
    num_kv_heads: int
    group: int
    head_dim: int
    index_dim: int
    topk: int
    block_size: int
    tile: int  # Tq
    tiles: int  # tiles per window
    entries: int  # U

    @property
    def rows(self):
        return self.tile * self.group

    @property
    def window(self):
        return self.tile * self.tiles

    @property
    def key_blocks(self):
        return -(-self.seq // self.block_size)


def _geometry(q, k, index_dim, topk, block_size, config):
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    tile = min(max(1, config.rows // group), seq)
    num_tiles = -(-seq // tile)
    key_blocks = -(-seq // block_size)
    entries = min(key_blocks, 2 * tile * topk)
    per_tile = batch * num_kv_heads * entries
    tiles = max(1, min(num_tiles, config.table_entries // per_tile))
    return _Geometry(batch, seq, num_kv_heads, group, head_dim, index_dim, topk, block_size,
                     tile, tiles, entries)  # fmt: skip


def block_table(blocks, query_slots, positions, geo: _Geometry):
    """The row blocks each (row, kv head, tile) must visit -> (table [B·K·tiles·U], counts
    [B·K·tiles]) int32, for a window: blocks [B, W, K, k], query_slots [W], positions [B, W]."""
    batch, window, heads, _ = blocks.shape
    first = (query_slots - positions)[:, :, None, None] + blocks * geo.block_size  # first key
    valid = blocks >= 0
    nb = geo.key_blocks
    lo = jnp.where(valid, first // geo.block_size, nb)  # nb: dropped by the scatter
    hi = jnp.where(valid, (first + geo.block_size - 1) // geo.block_size, nb)
    b = jnp.arange(batch)[:, None, None, None]
    t = (jnp.arange(window) // geo.tile)[None, :, None, None]
    h = jnp.arange(heads)[None, None, :, None]
    touched = jnp.zeros((batch, heads, geo.tiles, nb + 1), bool)
    touched = touched.at[b, h, t, lo].set(True).at[b, h, t, hi].set(True)[..., :nb]
    ids = jnp.arange(nb, dtype=jnp.int32)
    ordered = jnp.sort(jnp.where(touched, ids, nb + ids), axis=-1)[..., : geo.entries]
    counts = touched.sum(-1, dtype=jnp.int32)
    last = jnp.take_along_axis(ordered, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    table = jnp.where(jnp.arange(geo.entries) < counts[..., None], ordered, last)
    return jnp.where(table < nb, table, 0).reshape(-1), counts.reshape(-1)


def _visible(geo, c, sel_ref, qslot_ref, qseg_ref, kblock_ref, kseg_ref):
    """[Tq, block] bool: query i sees key j of row block c (selected, same document, causal)."""
    key_block, key_segment = kblock_ref[...], kseg_ref[...]  # [1, block]
    selection = sel_ref[...]  # [Tq, k]
    chosen = selection[:, 0:1] == key_block
    for j in range(1, geo.topk):
        chosen |= selection[:, j : j + 1] == key_block
    key_slot = c * geo.block_size + jax.lax.broadcasted_iota(jnp.int32, (1, geo.block_size), 1)
    return chosen & (key_segment == qseg_ref[...]) & (key_slot <= qslot_ref[...])


def _by_rows(geo, x):  # [Tq, block] -> [Tq·G, block]: each query's mask for its G heads
    return jnp.broadcast_to(x[:, None], (geo.tile, geo.group, x.shape[-1])).reshape(geo.rows, -1)


def _dot_t(a, b):  # a · bᵀ in fp32
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _specs(geo, with_values, with_student, with_lse):
    """In-specs of one window's kernels; grid (B, K, tiles, U); prefetch (table, counts)."""

    def entry(b, h, t, u, table, counts):
        del counts
        return table[((b * geo.num_kv_heads + h) * geo.tiles + t) * geo.entries + u]

    query_rows = lambda b, h, t, u, *_: (b, h, t, 0)
    key_block = lambda b, h, t, u, *p: (b, h, entry(b, h, t, u, *p), 0)
    key_meta = lambda b, h, t, u, *p: (b, 0, entry(b, h, t, u, *p))
    query_meta = lambda b, h, t, u, *_: (b, t, 0)
    specs = [
        pl.BlockSpec((None, None, geo.tile, geo.topk), query_rows),  # selection
        pl.BlockSpec((None, geo.tile, 1), query_meta),  # query slots
        pl.BlockSpec((None, geo.tile, 1), query_meta),  # query segments
        pl.BlockSpec((None, 1, geo.block_size), key_meta),  # key document blocks
        pl.BlockSpec((None, 1, geo.block_size), key_meta),  # key segments
        pl.BlockSpec((None, None, geo.rows, geo.head_dim), query_rows),  # q
        pl.BlockSpec((None, None, geo.block_size, geo.head_dim), key_block),  # k
    ]
    if with_values:
        specs.append(pl.BlockSpec((None, None, geo.block_size, geo.head_dim), key_block))
    if with_lse:
        specs.append(pl.BlockSpec((None, None, geo.rows, 1), query_rows))
    if with_student:
        specs.append(pl.BlockSpec((None, None, geo.tile, geo.index_dim), query_rows))
        specs.append(pl.BlockSpec((None, geo.block_size, geo.index_dim),
                                  lambda b, h, t, u, *p: (b, entry(b, h, t, u, *p), 0)))  # fmt: skip
    if with_lse and with_student:
        specs.append(pl.BlockSpec((None, None, geo.tile, 1), query_rows))
    return specs


def _call(kernel, geo, in_specs, out_shapes, out_specs, scratch, interpret, name):
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(geo.batch, geo.num_kv_heads, geo.tiles, geo.entries),
        in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch,
    )  # fmt: skip
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    return pl.pallas_call(
        kernel, out_shape=out_shapes, grid_spec=grid_spec, interpret=interpret, name=name,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
    )  # fmt: skip


def _forward_kernel(geo, with_student, *refs):
    """Online softmax over the tile's table: out [R, Dh], lse [R, 1] (and the student's [Tq, 1])."""
    table, counts, sel, qslot, qseg, kblock, kseg, q_ref, k_ref, v_ref = refs[:10]
    rest = refs[10:]
    iq_ref, ik_ref = rest[:2] if with_student else (None, None)
    rest = rest[2:] if with_student else rest
    out_ref, lse_ref = rest[:2]
    lse_z_ref = rest[2] if with_student else None
    m_ref, l_ref, acc_ref = rest[-5:-2] if with_student else rest[-3:]
    b, h, t, u = (pl.program_id(axis) for axis in range(4))
    tile_index = (b * geo.num_kv_heads + h) * geo.tiles + t

    @pl.when(u == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if with_student:
            rest[-2][...] = jnp.full_like(rest[-2], NEG_INF)
            rest[-1][...] = jnp.zeros_like(rest[-1])

    @pl.when(u < counts[tile_index])
    def _():
        c = table[tile_index * geo.entries + u]
        visible = _visible(geo, c, sel, qslot, qseg, kblock, kseg)
        rows_visible = _by_rows(geo, visible)
        logits = _dot_t(q_ref[...], k_ref[...]) * geo.head_dim**-0.5  # [R, block] fp32
        _online_update(m_ref, l_ref, logits, rows_visible, acc_ref, v_ref[...])
        if with_student:
            z = _dot_t(iq_ref[...], ik_ref[...]) * geo.index_dim**-0.5  # [Tq, block]
            _online_update(rest[-2], rest[-1], z, visible)

    @pl.when(u == geo.entries - 1)
    def _():
        l = jnp.where(l_ref[...] > 0, l_ref[...], 1.0)
        out_ref[...] = (acc_ref[...] / l).astype(out_ref.dtype)
        lse_ref[...] = m_ref[...] + jnp.log(l)
        if with_student:
            l_z = jnp.where(rest[-1][...] > 0, rest[-1][...], 1.0)
            lse_z_ref[...] = rest[-2][...] + jnp.log(l_z)


def _online_update(m_ref, l_ref, logits, visible, acc_ref=None, values=None):
    logits = jnp.where(visible, logits, NEG_INF)
    m_new = jnp.maximum(m_ref[...], logits.max(axis=1, keepdims=True))
    scale = jnp.exp(m_ref[...] - m_new)
    p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)
    l_ref[...] = scale * l_ref[...] + p.sum(axis=1, keepdims=True)
    m_ref[...] = m_new
    if acc_ref is not None:
        pv = jax.lax.dot(p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        acc_ref[...] = scale * acc_ref[...] + pv


def _kl_kernel(geo, *refs):
    """KL(teacher ‖ student) per query [Tq, 1] over the tile's table, the LSEs known."""
    (table, counts, sel, qslot, qseg, kblock, kseg, q_ref, k_ref, lse_ref, iq_ref, ik_ref,
     lse_z_ref, kl_ref, acc_ref) = refs  # fmt: skip
    b, h, t, u = (pl.program_id(axis) for axis in range(4))
    tile_index = (b * geo.num_kv_heads + h) * geo.tiles + t

    @pl.when(u == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(u < counts[tile_index])
    def _():
        c = table[tile_index * geo.entries + u]
        visible = _visible(geo, c, sel, qslot, qseg, kblock, kseg)
        logits = _dot_t(q_ref[...], k_ref[...]) * geo.head_dim**-0.5
        probs = jnp.where(_by_rows(geo, visible), jnp.exp(logits - lse_ref[...]), 0.0)
        teacher = probs.reshape(geo.tile, geo.group, geo.block_size).mean(axis=1)  # [Tq, block]
        z = _dot_t(iq_ref[...], ik_ref[...]) * geo.index_dim**-0.5
        log_ratio = jnp.log(jnp.maximum(teacher, 1e-30)) - (z - lse_z_ref[...])
        terms = jnp.where(visible & (teacher > 0), teacher * log_ratio, 0.0)
        acc_ref[...] += terms.sum(axis=1, keepdims=True)

    @pl.when(u == geo.entries - 1)
    def _():
        kl_ref[...] = acc_ref[...]


def _window_forward(geo, interpret, keys, window):
    """One window of W queries -> out [B, K, W·G, Dh], kl [B, K, W, 1] fp32 or None."""
    k, v, kblock, kseg, index_k = keys
    q, sel, qslot, qseg, positions, index_q = window
    with_student = index_q is not None
    table, counts = block_table(sel.transpose(0, 2, 1, 3), qslot[0, :, 0], positions, geo)
    prefetch = (table, counts)
    query_rows = lambda b, h, t, u, *_: (b, h, t, 0)
    rows_shape = (geo.batch, geo.num_kv_heads, geo.window * geo.group)
    queries_shape = (geo.batch, geo.num_kv_heads, geo.window, 1)
    meta = (sel, qslot, qseg, kblock, kseg, q, k)
    student = (index_q, index_k) if with_student else ()
    out_shapes = [jax.ShapeDtypeStruct((*rows_shape, geo.head_dim), q.dtype),
                  jax.ShapeDtypeStruct((*rows_shape, 1), jnp.float32)]  # fmt: skip
    out_specs = [pl.BlockSpec((None, None, geo.rows, geo.head_dim), query_rows),
                 pl.BlockSpec((None, None, geo.rows, 1), query_rows)]  # fmt: skip
    scratch = [pltpu.VMEM((geo.rows, 1), jnp.float32), pltpu.VMEM((geo.rows, 1), jnp.float32),
               pltpu.VMEM((geo.rows, geo.head_dim), jnp.float32)]  # fmt: skip
    if with_student:
        out_shapes.append(jax.ShapeDtypeStruct(queries_shape, jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, geo.tile, 1), query_rows))
        scratch += [pltpu.VMEM((geo.tile, 1), jnp.float32)] * 2
    forward = _call(functools.partial(_forward_kernel, geo, with_student), geo,
                    _specs(geo, True, with_student, False), out_shapes, out_specs, scratch,
                    interpret, "msa_tpu_forward")  # fmt: skip
    out, lse, *lse_z = forward(*prefetch, *meta, v, *student)
    if not with_student:
        return out, None
    kl_call = _call(functools.partial(_kl_kernel, geo), geo, _specs(geo, False, True, True),
                    jax.ShapeDtypeStruct(queries_shape, jnp.float32),
                    pl.BlockSpec((None, None, geo.tile, 1), query_rows),
                    [pltpu.VMEM((geo.tile, 1), jnp.float32)], interpret, "msa_tpu_kl")  # fmt: skip
    return out, kl_call(*prefetch, *meta, lse, *student, lse_z[0])


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
    interpret=None,
) -> jax.Array:
    """Same arguments and result as `reference.top_blocks`: the XLA path's selection (config and
    interpret are accepted for a uniform call and unused)."""
    del config, interpret
    return xla.top_blocks(index_q, index_k, segment_ids, positions, block_size=block_size,
                          topk_blocks=topk_blocks, local_blocks=local_blocks)  # fmt: skip


def _pad(x, size, fill=0, axis=1):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(jnp.asarray(x), pad, constant_values=fill)


def _forward(geo, interpret, q, k, v, index_q, index_k, blocks, segment_ids, positions):
    """The kernels over every window -> out [B, S, H, Dh], KL [B, S, K] fp32 or None."""
    batch, seq, num_heads, head_dim = q.shape
    heads, group = geo.num_kv_heads, geo.group
    count = -(-seq // geo.window)
    queries, key_slots = count * geo.window, geo.key_blocks * geo.block_size

    def windows(x):  # [B, K, Sp, ...] -> [count, B, K, W, ...]
        x = x.reshape(batch, heads, count, geo.window, *x.shape[3:])
        return jnp.moveaxis(x, 2, 0)

    q_rows = _pad(q, queries).reshape(batch, queries, heads, group, head_dim)
    q_rows = windows(q_rows.transpose(0, 2, 1, 3, 4))
    q_rows = q_rows.reshape(count, batch, heads, geo.window * group, head_dim)
    selection = windows(_pad(blocks, queries, fill=-1).transpose(0, 2, 1, 3))
    slots = jnp.arange(queries, dtype=jnp.int32).reshape(count, 1, geo.window, 1)
    slots = jnp.broadcast_to(slots, (count, batch, geo.window, 1))
    query_segments = _pad(segment_ids, queries, fill=-1).astype(jnp.int32)
    query_segments = jnp.moveaxis(query_segments.reshape(batch, count, geo.window, 1), 1, 0)
    query_positions = jnp.moveaxis(_pad(positions, queries).reshape(batch, count, -1), 1, 0)
    index_rows = None
    if index_q is not None:
        index_rows = windows(_pad(index_q, queries).transpose(0, 2, 1, 3))
        index_k = _pad(index_k, key_slots)
    kblock = _pad(jnp.asarray(positions) // geo.block_size, key_slots, fill=-2)
    kseg = _pad(segment_ids, key_slots, fill=NO_SEGMENT).astype(jnp.int32)
    keys = (
        _pad(k, key_slots).transpose(0, 2, 1, 3),
        _pad(v, key_slots).transpose(0, 2, 1, 3),
        kblock.astype(jnp.int32)[:, None],
        kseg[:, None],
        index_k,
    )
    xs = (q_rows, selection, slots, query_segments, query_positions, index_rows)
    out, kl = jax.lax.map(functools.partial(_window_forward, geo, interpret, keys), xs)
    out = out.reshape(count, batch, heads, geo.window, group, head_dim)
    out = out.transpose(1, 0, 3, 2, 4, 5).reshape(batch, queries, num_heads, head_dim)
    if kl is not None:
        kl = kl[..., 0].transpose(1, 0, 3, 2).reshape(batch, queries, heads)[:, :seq]
    return out[:, :seq], kl


@functools.cache
def _attention(geo: _Geometry, block_size: int, interpret):
    """Custom-VJP sparse attention: the kernels forward, the XLA path's gradients backward."""

    kernels = jax.jit(functools.partial(_forward, geo, interpret))  # one trace per geometry

    @jax.custom_vjp
    def attention(q, k, v, index_q, index_k, blocks, segment_ids, positions):
        return kernels(q, k, v, index_q, index_k, blocks, segment_ids, positions)

    def forward(*args):
        return attention(*args), args

    def backward(residuals, cotangents):
        q, k, v, index_q, index_k, blocks, segment_ids, positions = residuals
        student = None if index_q is None else (index_q, index_k)

        def xla_path(q, k, v, student):
            return xla.sparse_attention(q, k, v, blocks, segment_ids, positions,
                                        block_size=block_size, student=student)  # fmt: skip

        _, vjp = jax.vjp(xla_path, q, k, v, student)
        dq, dk, dv, d_student = vjp(cotangents)
        d_index_q, d_index_k = (None, None) if d_student is None else d_student
        return dq, dk, dv, d_index_q, d_index_k, None, None, None

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
    config: Config = Config(),
    interpret=None,
) -> tuple[jax.Array, jax.Array | None]:
    """Same arguments and results as `reference.sparse_attention`.

    interpret: None (the TPU interpreter unless on a TPU), a bool, or `pltpu.InterpretParams`.
    """
    index_q, index_k = (None, None) if student is None else student
    index_dim = q.shape[3] if index_q is None else index_q.shape[3]
    geo = _geometry(q, k, index_dim, block_indices.shape[-1], block_size, config)
    attention = _attention(geo, block_size, _interpret(interpret))
    return attention(q, k, v, index_q, index_k, block_indices, segment_ids, positions)
