"""The Mosaic TPU kernels of MSA sparse attention (`tpu.py` lays out their operands), per window.

Tables (XLA, scalar-prefetched into SMEM): `touched[b, h, t, c]` says that some query of tile t
selected, for kv head h, a document block holding a key of row block c.
- forward order: for each (b, h, t) the row blocks it touched, sorted; grid (B, K, tiles, U);
- inverted order: for each (b, h, c) the tiles that touched it, sorted; grid (B, K, nb, tiles).
Each list repeats its last entry after its count: the pipeline skips a copy whose block index
does not change, and the kernels skip the work (`pl.when`).

Kernels (`fp32` accumulation in VMEM scratch, one MXU product per Q·Kᵀ of R = Tq·G rows):
- `forward`: online softmax -> out and LSE per row (and the student's LSE per query);
- `kl`: the indexer's KL per query, the LSEs known (the teacher averages G heads' probabilities);
- `dq`: dQ per row tile over the forward order (and d index_q, from the KL);
- `dkv`: dK, dV per key block over the inverted order, the queries that chose the block (and
  d index_k per kv head, from the KL).

Shapes: B batch, K kv heads, G heads per group, Tq queries per tile, R = Tq·G rows, W queries
per window, nb row blocks of `block_size` keys, U forward entries per tile, Dh, Di head dims.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.xla import NEG_INF


@dataclasses.dataclass(frozen=True)
class Geometry:
    batch: int
    seq: int  # T keys per row
    queries: int  # S
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


def touched_blocks(blocks, query_slots, positions, geo: Geometry) -> jax.Array:
    """[B, K, tiles, nb] bool for a window: blocks [B, W, K, k], query_slots [W], positions
    [B, W]. A document block starting mid-row-block touches two row blocks."""
    batch, window, heads, _ = blocks.shape
    first = (query_slots - positions)[:, :, None, None] + blocks * geo.block_size  # first key
    nb = geo.key_blocks
    lo = jnp.where(blocks >= 0, first // geo.block_size, nb)  # nb: sliced off below
    hi = jnp.where(blocks >= 0, (first + geo.block_size - 1) // geo.block_size, nb)
    b = jnp.arange(batch)[:, None, None, None]
    t = (jnp.arange(window) // geo.tile)[None, :, None, None]
    h = jnp.arange(heads)[None, None, :, None]
    touched = jnp.zeros((batch, heads, geo.tiles, nb + 1), bool)
    return touched.at[b, h, t, lo].set(True).at[b, h, t, hi].set(True)[..., :nb]


def sorted_lists(flags: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """[..., n] bool -> (table [prod(...)·length], counts [prod(...)]) int32: the ids of the set
    flags in order, the last repeated after the count (0 where none is set)."""
    n = flags.shape[-1]
    ids = jnp.arange(n, dtype=jnp.int32)
    ordered = jnp.sort(jnp.where(flags, ids, n + ids), axis=-1)[..., :length]
    counts = flags.sum(-1, dtype=jnp.int32)
    last = jnp.take_along_axis(ordered, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    table = jnp.where(jnp.arange(length) < counts[..., None], ordered, last)
    return jnp.where(table < n, table, 0).reshape(-1), counts.reshape(-1)


def _forward_order(geo):  # grid (b, h, t, u): tile t, the u-th row block of its list
    def block_of(b, h, t, u, table, counts):
        del counts
        return table[((b * geo.num_kv_heads + h) * geo.tiles + t) * geo.entries + u]

    return (lambda b, h, t, u, *_: t), block_of


def _inverted_order(geo):  # grid (b, h, c, w): row block c, the w-th tile of its list
    def tile_of(b, h, c, w, table, counts):
        del counts
        return table[((b * geo.num_kv_heads + h) * geo.key_blocks + c) * geo.tiles + w]

    return tile_of, (lambda b, h, c, w, *_: c)


def _specs(geo, names, order):
    """BlockSpecs of the named operands (see `window_forward` for their layouts)."""
    tile_of, block_of = order
    rows = lambda b, h, x, y, *p: (b, h, tile_of(b, h, x, y, *p), 0)
    queries = lambda b, h, x, y, *p: (b, tile_of(b, h, x, y, *p), 0)
    keys = lambda b, h, x, y, *p: (b, h, block_of(b, h, x, y, *p), 0)
    key_meta = lambda b, h, x, y, *p: (b, 0, block_of(b, h, x, y, *p))
    index_keys = lambda b, h, x, y, *p: (b, block_of(b, h, x, y, *p), 0)
    row_block, key_block = (None, None, geo.rows, geo.head_dim), (None, None, geo.block_size,
                                                                  geo.head_dim)  # fmt: skip
    blocks = {
        "sel": ((None, None, geo.tile, geo.topk), rows),
        "qslot": ((None, geo.tile, 1), queries),
        "qseg": ((None, geo.tile, 1), queries),
        "kblock": ((None, 1, geo.block_size), key_meta),
        "kseg": ((None, 1, geo.block_size), key_meta),
        "q": (row_block, rows),
        "d_out": (row_block, rows),
        "out": (row_block, rows),
        "lse": ((None, None, geo.rows, 1), rows),
        "delta": ((None, None, geo.rows, 1), rows),
        "k": (key_block, keys),
        "v": (key_block, keys),
        "iq": ((None, None, geo.tile, geo.index_dim), rows),
        "ik": ((None, geo.block_size, geo.index_dim), index_keys),
        "ik_heads": ((None, None, geo.block_size, geo.index_dim), keys),
        "lse_z": ((None, None, geo.tile, 1), rows),
        "kl": ((None, None, geo.tile, 1), rows),
        "d_kl": ((None, None, geo.tile, 1), rows),
    }
    return [pl.BlockSpec(*blocks[name]) for name in names]


def _launch(body, geo, grid, order, ins, outs, scratch, interpret, name):
    """pallas_call of `body(table, counts, refs: dict)`; ins/outs: {name: array/ShapeDtypeStruct}
    (outputs named like the operand whose blocks they share)."""
    in_names, out_names = list(ins), list(outs)

    def kernel(table, counts, *refs):
        named = dict(zip(in_names + out_names, refs[: len(in_names) + len(out_names)]))
        body(table, counts, named, *refs[len(in_names) + len(out_names) :])

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid, in_specs=_specs(geo, in_names, order),
        out_specs=_specs(geo, [n.removeprefix("d_") if n.startswith("d_") and n != "d_out"
                               else n for n in out_names], order),
        scratch_shapes=scratch,
    )  # fmt: skip
    semantics = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )
    call = pl.pallas_call(kernel, out_shape=list(outs.values()), grid_spec=grid_spec,
                          interpret=interpret, name=name, compiler_params=semantics)  # fmt: skip
    return call


def _visible(geo, c, refs):
    """[Tq, block] bool: query i sees key j of row block c (selected, same document, causal)."""
    key_block, key_segment = refs["kblock"][...], refs["kseg"][...]  # [1, block]
    selection = refs["sel"][...]  # [Tq, k]
    chosen = selection[:, 0:1] == key_block
    for j in range(1, geo.topk):
        chosen |= selection[:, j : j + 1] == key_block
    key_slot = c * geo.block_size + jax.lax.broadcasted_iota(jnp.int32, (1, geo.block_size), 1)
    return chosen & (key_segment == refs["qseg"][...]) & (key_slot <= refs["qslot"][...])


def _by_rows(geo, x):  # [Tq, block] -> [R, block]: each query's mask for its G heads
    return jnp.broadcast_to(x[:, None], (geo.tile, geo.group, x.shape[-1])).reshape(geo.rows, -1)


def _dot(a, b, contract=(1, 0)):  # fp32 products; contract=(1, 1): a · bᵀ, (0, 0): aᵀ · b
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _probs(geo, c, refs):
    """[Tq, block] visibility and [R, block] probabilities of row block c, the LSEs known."""
    visible = _visible(geo, c, refs)
    logits = _dot(refs["q"][...], refs["k"][...], (1, 1)) * geo.head_dim**-0.5
    return visible, jnp.where(_by_rows(geo, visible), jnp.exp(logits - refs["lse"][...]), 0.0)


def _online_update(m_ref, l_ref, logits, visible, acc_ref=None, values=None):
    logits = jnp.where(visible, logits, NEG_INF)
    m_new = jnp.maximum(m_ref[...], logits.max(axis=1, keepdims=True))
    scale = jnp.exp(m_ref[...] - m_new)
    p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)
    l_ref[...] = scale * l_ref[...] + p.sum(axis=1, keepdims=True)
    m_ref[...] = m_new
    if acc_ref is not None:
        acc_ref[...] = scale * acc_ref[...] + _dot(p.astype(values.dtype), values)


def _forward_body(geo, with_student, table, counts, refs, *scratch):
    m_ref, l_ref, acc_ref = scratch[:3]
    b, h, t, u = (pl.program_id(axis) for axis in range(4))
    index = (b * geo.num_kv_heads + h) * geo.tiles + t

    @pl.when(u == 0)
    def _():
        for ref, value in zip(scratch, (NEG_INF, 0.0, 0.0, NEG_INF, 0.0)):
            ref[...] = jnp.full_like(ref, value)

    @pl.when(u < counts[index])
    def _():
        c = table[index * geo.entries + u]
        visible = _visible(geo, c, refs)
        logits = _dot(refs["q"][...], refs["k"][...], (1, 1)) * geo.head_dim**-0.5  # [R, block]
        _online_update(m_ref, l_ref, logits, _by_rows(geo, visible), acc_ref, refs["v"][...])
        if with_student:
            z = _dot(refs["iq"][...], refs["ik"][...], (1, 1)) * geo.index_dim**-0.5
            _online_update(scratch[3], scratch[4], z, visible)

    @pl.when(u == geo.entries - 1)
    def _():
        l = jnp.where(l_ref[...] > 0, l_ref[...], 1.0)
        refs["out"][...] = (acc_ref[...] / l).astype(refs["out"].dtype)
        refs["lse"][...] = m_ref[...] + jnp.log(l)
        if with_student:
            l_z = jnp.where(scratch[4][...] > 0, scratch[4][...], 1.0)
            refs["lse_z"][...] = scratch[3][...] + jnp.log(l_z)


def _kl_body(geo, table, counts, refs, acc_ref):
    b, h, t, u = (pl.program_id(axis) for axis in range(4))
    index = (b * geo.num_kv_heads + h) * geo.tiles + t

    @pl.when(u == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(u < counts[index])
    def _():
        visible, probs = _probs(geo, table[index * geo.entries + u], refs)
        teacher = probs.reshape(geo.tile, geo.group, geo.block_size).mean(axis=1)  # [Tq, block]
        z = _dot(refs["iq"][...], refs["ik"][...], (1, 1)) * geo.index_dim**-0.5
        log_ratio = jnp.log(jnp.maximum(teacher, 1e-30)) - (z - refs["lse_z"][...])
        terms = jnp.where(visible & (teacher > 0), teacher * log_ratio, 0.0)
        acc_ref[...] += terms.sum(axis=1, keepdims=True)

    @pl.when(u == geo.entries - 1)
    def _():
        refs["kl"][...] = acc_ref[...]


def _score_gradient(geo, c, refs):
    """-> visibility [Tq, block], probs [R, block], dS [R, block] (of the unscaled logits) and
    the student's d(index logits) [Tq, block] (None without a student)."""
    visible, probs = _probs(geo, c, refs)
    d_probs = _dot(refs["d_out"][...], refs["v"][...], (1, 1))
    d_scores = probs * (d_probs - refs["delta"][...])
    if "iq" not in refs:
        return visible, probs, d_scores, None
    # d KL / d z = student - teacher (the teacher sums to 1 over the query's keys), times d_kl
    teacher = probs.reshape(geo.tile, geo.group, geo.block_size).mean(axis=1)
    z = _dot(refs["iq"][...], refs["ik"][...], (1, 1)) * geo.index_dim**-0.5
    student = jnp.where(visible, jnp.exp(z - refs["lse_z"][...]), 0.0)
    return visible, probs, d_scores, (student - teacher) * refs["d_kl"][...]


def _dq_body(geo, table, counts, refs, *scratch):
    b, h, t, u = (pl.program_id(axis) for axis in range(4))
    index = (b * geo.num_kv_heads + h) * geo.tiles + t

    @pl.when(u == 0)
    def _():
        for ref in scratch:
            ref[...] = jnp.zeros_like(ref)

    @pl.when(u < counts[index])
    def _():
        *_, d_scores, d_z = _score_gradient(geo, table[index * geo.entries + u], refs)
        keys = refs["k"][...]
        scratch[0][...] += _dot(d_scores.astype(keys.dtype), keys) * geo.head_dim**-0.5
        if d_z is not None:
            scratch[1][...] += _dot(d_z, refs["ik"][...].astype(jnp.float32)) * geo.index_dim**-0.5

    @pl.when(u == geo.entries - 1)
    def _():
        for name, ref in zip(("d_q", "d_iq"), scratch):
            refs[name][...] = ref[...].astype(refs[name].dtype)


def _dkv_body(geo, table, counts, refs, *scratch):
    b, h, c, w = (pl.program_id(axis) for axis in range(4))

    @pl.when(w == 0)
    def _():
        for ref in scratch:
            ref[...] = jnp.zeros_like(ref)

    @pl.when(w < counts[(b * geo.num_kv_heads + h) * geo.key_blocks + c])
    def _():
        _, probs, d_scores, d_z = _score_gradient(geo, c, refs)
        d_out, q = refs["d_out"][...], refs["q"][...]
        scratch[1][...] += _dot(probs.astype(d_out.dtype), d_out, (0, 0))
        scratch[0][...] += _dot(d_scores.astype(q.dtype), q, (0, 0)) * geo.head_dim**-0.5
        if d_z is not None:
            index_q = refs["iq"][...].astype(jnp.float32)
            scratch[2][...] += _dot(d_z, index_q, (0, 0)) * geo.index_dim**-0.5

    @pl.when(w == geo.tiles - 1)
    def _():
        for name, ref in zip(("d_k", "d_v", "d_ik_heads"), scratch):
            refs[name][...] = ref[...].astype(refs[name].dtype)


def _f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def window_forward(geo, interpret, keys, window):
    """One window -> out [B, K, W·G, Dh], lse [B, K, W·G, 1], and kl, lse_z [B, K, W, 1] fp32
    (None without a student).

    keys: k, v [B, K, nb·block, Dh]; kblock, kseg [B, 1, nb·block] (document block and segment of
    each key slot); ik [B, nb·block, Di] or None. window: q [B, K, W·G, Dh] (rows query-major);
    sel [B, K, W, k]; qslot, qseg [B, W, 1]; positions [B, W]; iq [B, K, W, Di] or None.
    """
    q, sel, qslot, qseg, positions, iq = window
    with_student = iq is not None
    table, counts = sorted_lists(
        touched_blocks(sel.transpose(0, 2, 1, 3), qslot[0, :, 0], positions, geo), geo.entries
    )
    grid, order = (geo.batch, geo.num_kv_heads, geo.tiles, geo.entries), _forward_order(geo)
    ins = {"sel": sel, "qslot": qslot, "qseg": qseg, "q": q}
    ins |= {name: keys[name] for name in ("kblock", "kseg", "k", "v")}
    rows = (geo.batch, geo.num_kv_heads, geo.window * geo.group)
    outs = {"out": jax.ShapeDtypeStruct((*rows, geo.head_dim), q.dtype), "lse": _f32(*rows, 1)}
    scratch = [pltpu.VMEM((geo.rows, 1), jnp.float32), pltpu.VMEM((geo.rows, 1), jnp.float32),
               pltpu.VMEM((geo.rows, geo.head_dim), jnp.float32)]  # fmt: skip
    queries = (geo.batch, geo.num_kv_heads, geo.window, 1)
    if with_student:
        ins.update(iq=iq, ik=keys["ik"])
        outs["lse_z"] = _f32(*queries)
        scratch += [pltpu.VMEM((geo.tile, 1), jnp.float32)] * 2
    body = functools.partial(_forward_body, geo, with_student)
    results = _launch(body, geo, grid, order, ins, outs, scratch, interpret, "msa_tpu_forward")(
        table, counts, *ins.values()
    )
    out, lse = results[:2]
    if not with_student:
        return out, lse, None, None
    ins = {name: ins[name] for name in ("sel", "qslot", "qseg", "kblock", "kseg", "q", "k")}
    ins.update(lse=lse, iq=iq, ik=keys["ik"], lse_z=results[2])
    kl_call = _launch(functools.partial(_kl_body, geo), geo, grid, order, ins,
                      {"kl": _f32(*queries)}, [pltpu.VMEM((geo.tile, 1), jnp.float32)],
                      interpret, "msa_tpu_kl")  # fmt: skip
    return out, lse, kl_call(table, counts, *ins.values())[0], ins["lse_z"]


def window_backward(geo, interpret, keys, window, lse, d_out, delta, student_grads):
    """One window's dq [B, K, W·G, Dh] and its share of dk, dv [B, K, nb·block, Dh] (fp32); with
    the student, also d index_q [B, K, W, Di] and the share of d index_k per head [B, K, nb·block,
    Di].

    lse, delta: [B, K, W·G, 1] (delta = Σ d_out·out per row); d_out: like q; student_grads:
    (lse_z, d_kl) [B, K, W, 1] each, or None. Operands as in `window_forward`.
    """
    q, sel, qslot, qseg, positions, iq = window
    touched = touched_blocks(sel.transpose(0, 2, 1, 3), qslot[0, :, 0], positions, geo)
    ins = {"sel": sel, "qslot": qslot, "qseg": qseg, "q": q}
    ins |= {name: keys[name] for name in ("kblock", "kseg", "k", "v")}
    ins |= {"lse": lse, "d_out": d_out, "delta": delta}
    heads = (geo.batch, geo.num_kv_heads)
    key_slots = geo.key_blocks * geo.block_size
    dq_outs = {"d_q": _f32(*heads, geo.window * geo.group, geo.head_dim)}
    dq_scratch = [pltpu.VMEM((geo.rows, geo.head_dim), jnp.float32)]
    dkv_outs = {"d_k": _f32(*heads, key_slots, geo.head_dim)}
    dkv_outs["d_v"] = dkv_outs["d_k"]
    dkv_scratch = [pltpu.VMEM((geo.block_size, geo.head_dim), jnp.float32)] * 2
    if student_grads is not None:
        ins |= {"iq": iq, "ik": keys["ik"], "lse_z": student_grads[0], "d_kl": student_grads[1]}
        dq_outs["d_iq"] = _f32(*heads, geo.window, geo.index_dim)
        dq_scratch.append(pltpu.VMEM((geo.tile, geo.index_dim), jnp.float32))
        dkv_outs["d_ik_heads"] = _f32(*heads, key_slots, geo.index_dim)
        dkv_scratch.append(pltpu.VMEM((geo.block_size, geo.index_dim), jnp.float32))
    dq_grid, dkv_grid = (*heads, geo.tiles, geo.entries), (*heads, geo.key_blocks, geo.tiles)
    dq_call = _launch(functools.partial(_dq_body, geo), geo, dq_grid, _forward_order(geo), ins,
                      dq_outs, dq_scratch, interpret, "msa_tpu_dq")  # fmt: skip
    dq = dq_call(*sorted_lists(touched, geo.entries), *ins.values())
    dkv_call = _launch(functools.partial(_dkv_body, geo), geo, dkv_grid, _inverted_order(geo), ins,
                       dkv_outs, dkv_scratch, interpret, "msa_tpu_dkv")  # fmt: skip
    dkv = dkv_call(*sorted_lists(touched.swapaxes(2, 3), geo.tiles), *ins.values())
    return (*dq, *dkv)
