"""MSA sparse attention on GPUs, key-block-major: Pallas kernels (Triton lowering).

Each program walks segments of `block_lists.BlockLists` (a persistent grid: segment s goes to
program s mod P). A segment is one key block of one (row, kv head) and up to `segment_chunks`
chunks of the queries that chose it; a chunk's `chunk_queries` queries × G heads are the rows of
one matmul against the block's keys, which are loaded once per segment. Three passes:

1. `lse_pass`: per entry, the log-sum-exp of the block's logits for each of the G heads (and of
   the student's index logits);
2. `forward_pass`, with the combined LSEs: per entry, the block's share of the output (globally
   normalised, so shares add up) and of the indexer KL;
3. `backward_pass`: dQ and d(index_q) shares per entry; dK, dV and d(index_k) accumulated over a
   segment in registers and added to f32 buffers atomically.
The per-entry shares are reduced over each query's k selections by `block_lists.by_selection`.
Masking: a key is seen by a row iff it is in the row's document (segment ids), not after the
query, and inside the sequence; rows past the end of their block's list are inert.

Shapes: B batch, S sequence (queries of the current window are slots `query_offset` + [0, W)),
H query heads, K kv heads, G = H // K, Dh head dim, Di index head dim, k selections per query,
E = B·W·K·k entries; R = chunk_queries·G rows of a chunk; block = block_size keys.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.msa.block_lists import BlockLists

NEG_INF = float(jnp.finfo(jnp.float32).min)
MIN_DOT_ROWS = 16  # tensor-core matmuls take at least 16 rows: student rows repeat queries


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Kernel launch parameters (the defaults were chosen on the H200, benchmarks/bench_msa.py)."""

    rows: int = 128  # chunk_queries · G rows per matmul
    segment_chunks: int = 16  # chunks per segment: key block loads amortised vs. load balance
    num_warps: int = 8
    num_stages: int = 2
    programs_per_core: int = 2
    # programs per key block: the backward's dK/dV/d(index_k) sums of block / key_split keys stay
    # in registers (the lse and forward passes ignore it)
    key_split: int = 1

    def chunk_queries(self, group: int) -> int:
        if self.rows % group:
            raise ValueError(f"Tiling.rows={self.rows} is not a multiple of G={group}")
        return self.rows // group


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one sparse-attention call."""

    batch: int
    seq: int  # keys per row
    window: int  # queries per row in this call
    num_heads: int
    num_kv_heads: int
    head_dim: int
    index_dim: int
    topk: int
    block_size: int
    chunk_queries: int

    @property
    def total_slots(self) -> int:  # rows of [B·S, ...] arrays
        return self.batch * self.seq

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        return self.chunk_queries * self.group

    @property
    def entries(self) -> int:
        return self.batch * self.window * self.num_kv_heads * self.topk

    @property
    def repeat(self) -> int:  # student rows per query, so that a chunk has >= MIN_DOT_ROWS rows
        return max(1, MIN_DOT_ROWS // self.chunk_queries)


class _Segment:
    """Index arithmetic of one segment, traced inside a kernel."""

    def __init__(self, geo: Geometry, lists, offset_ref, seg_ref, index, part=0, key_split=1):
        """Segment `index`; with key_split > 1 only part `part` of the block's keys."""
        keys_ref, _, starts_ref, sizes_ref = lists
        self.geo, self.lists = geo, lists
        self.first = starts_ref[index]
        self.num_chunks = sizes_ref[index]
        self.key = keys_ref[self.first]
        # the block's first segment (its list may go on in later segments)
        self.leads = (self.first == 0) | (keys_ref[jnp.maximum(self.first - 1, 0)] != self.key)
        two_s = 2 * geo.seq
        pair = self.key // two_s
        self.batch, self.head = pair // geo.num_kv_heads, pair % geo.num_kv_heads
        width = geo.block_size // key_split
        block_start = self.key % two_s - geo.seq
        self.key_slots = block_start + part * width + jnp.arange(width)  # [block / key_split]
        self.key_inside = (self.key_slots >= 0) & (self.key_slots < geo.seq)
        self.safe_slots = jnp.clip(self.key_slots, 0, geo.seq - 1)
        self.slot_rows = self.batch * geo.seq + self.safe_slots  # rows of [B·S, ...] arrays
        self.key_segments = seg_ref[self.slot_rows]
        # the block's own document: that of its first key (always one the choosing queries see)
        first_slot = jnp.clip(block_start, 0, geo.seq - 1)
        self.document = seg_ref[self.batch * geo.seq + first_slot]
        self.query_offset = offset_ref[0]
        self.seg_ref = seg_ref

    def entries(self, chunk: int, repeat: int):
        """(sorted positions, valid, window-local queries) of a chunk's rows, each query `repeat`
        times in a row."""
        geo = self.geo
        keys_ref, entries_ref, _, _ = self.lists
        count = geo.chunk_queries * repeat
        position = self.first + chunk * geo.chunk_queries + jnp.arange(count) // repeat
        inside = position < geo.entries
        safe = jnp.minimum(position, geo.entries - 1)
        valid = inside & (keys_ref[safe] == self.key)
        query = (entries_ref[safe] // (geo.num_kv_heads * geo.topk)) % geo.window
        return position, valid, query

    def visible(self, valid, query):
        """[rows, block] bool: which of the block's keys each row sees."""
        geo = self.geo
        slot = self.query_offset + query
        segment = self.seg_ref[self.batch * geo.seq + slot]
        return (
            valid[:, None]
            & self.key_inside[None, :]
            & (self.key_slots[None, :] <= slot[:, None])
            & (self.key_segments[None, :] == segment[:, None])
        )

    def head_rows(self, query):
        """Rows of [B·W·H, ...] arrays for a chunk's (query, head) rows (query repeated G times)."""
        geo = self.geo
        heads = self.head * geo.group + jnp.arange(geo.rows) % geo.group
        return (self.batch * geo.window + query) * geo.num_heads + heads

    def group_rows(self, query):
        """Rows of [B·W·K, ...] arrays (index_q, KL, LSE_z) for a chunk's queries."""
        return (self.batch * self.geo.window + query) * self.geo.num_kv_heads + self.head


def _load_rows(ref, rows, valid, width):
    """Gather rows [n] of a [N, width] ref -> [n, width]; invalid rows read as 0."""
    return plt.load(
        ref.at[rows[:, None], jnp.arange(width)[None, :]], mask=valid[:, None], other=0.0
    )


def _targets(index, keep, size):
    """Store targets: `index` where `keep`, else distinct indices past the end (size). Masked rows
    then never alias a kept one, which Pallas' interpreter needs (it writes masked rows back)."""
    return jnp.where(keep, index, size + jnp.arange(index.shape[0]))


def _store_rows(ref, rows, valid, value):
    rows = _targets(rows, valid, ref.shape[0])
    plt.store(ref.at[rows[:, None], jnp.arange(value.shape[1])[None, :]], value, mask=valid[:, None])


def _store(ref, index, keep, value):
    plt.store(ref.at[_targets(index, keep, ref.shape[0])], value, mask=keep)


def _add_rows(ref, rows, value):
    """ref[rows] += value with atomics (rows distinct)."""
    plt.atomic_add(ref, (rows[:, None], jnp.arange(value.shape[1])[None, :]), value)


def _matmul(a, b, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _logits(geo: Geometry, q, keys, visible):
    """q [R, Dh] · keys [block, Dh]ᵀ · Dh^-½, NEG_INF where not visible -> [R, block] fp32."""
    logits = _matmul(q, keys, ((1,), (1,))) * geo.head_dim**-0.5
    return jnp.where(visible, logits, NEG_INF)


def _teacher(geo: Geometry, probs):
    """[R, keys] globally normalised probabilities -> the group mean [chunk_queries·repeat, keys]
    (each query's row repeated `repeat` times, matching the student rows)."""
    keys = probs.shape[1]
    mean = probs.reshape(geo.chunk_queries, geo.group, keys).sum(axis=1) / geo.group
    repeated = jnp.broadcast_to(mean[:, None], (geo.chunk_queries, geo.repeat, keys))
    return repeated.reshape(geo.chunk_queries * geo.repeat, keys)


def _for_each_segment(lists, body, parts=1):
    """Persistent loop over (segment, part) items: program p takes items p, p + P, ... of
    num_segments · parts, calling body(segment, part)."""
    items = lists[4][0] * parts
    program, programs = pl.program_id(0), pl.num_programs(0)
    trips = jnp.maximum(items - program + programs - 1, 0) // programs

    def step(n, carry):
        item = program + n * programs
        body(item // parts, item % parts)
        return carry

    jax.lax.fori_loop(0, trips, step, 0)


def _launch(kernel, name, tiling, out_shape, *args, interpret, aliases=None):
    device = jax.devices()[0]
    cores = device.core_count if device.platform == "gpu" else 3
    return pl.pallas_call(
        kernel,
        name=name,  # profiles show kernels by this name
        out_shape=out_shape,
        grid=(cores * tiling.programs_per_core,),
        compiler_params=plt.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        input_output_aliases=aliases or {},
        interpret=interpret,
    )(*args)


def _table(lists: BlockLists):
    return (lists.keys, lists.entries, lists.segment_starts, lists.segment_sizes, lists.num_segments)


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
            seg = _Segment(geo, lists_refs[:4], offset_ref, seg_ref, index)
            kv_rows = seg.slot_rows * geo.num_kv_heads + seg.head
            keys_block = _load_rows(k_ref, kv_rows, seg.key_inside, geo.head_dim)
            index_keys = (
                _load_rows(ik_ref, seg.slot_rows, seg.key_inside, geo.index_dim)
                if with_student else None
            )  # fmt: skip

            def chunk_body(chunk, carry):
                position, valid, query = seg.entries(chunk, geo.group)
                q_rows = _load_rows(q_ref, seg.head_rows(query), valid, geo.head_dim)
                logits = _logits(geo, q_rows, keys_block, seg.visible(valid, query))
                top = logits.max(axis=1)
                lse = top + jnp.log(jnp.exp(logits - top[:, None]).sum(axis=1))
                out_rows = position * geo.group + jnp.arange(geo.rows) % geo.group
                _store(lse_ref, out_rows, valid, lse)
                if with_student:
                    s_position, s_valid, s_query = seg.entries(chunk, geo.repeat)
                    _, z = _student_logits(geo, seg, iq_ref, index_keys, s_valid, s_query)
                    z_top = z.max(axis=1)
                    lse_z = z_top + jnp.log(jnp.exp(z - z_top[:, None]).sum(axis=1))
                    _store(lse_z_ref, s_position, s_valid & _first(geo), lse_z)
                return carry

            jax.lax.fori_loop(0, seg.num_chunks, chunk_body, 0)

        _for_each_segment(lists_refs, segment_body)

    out_shape = [jax.ShapeDtypeStruct((geo.entries * geo.group,), jnp.float32)]
    args = [*_table(lists), offset, q, k, segment_ids]
    if with_student:
        out_shape.append(jax.ShapeDtypeStruct((geo.entries,), jnp.float32))
        args += list(student)
    outs = _launch(kernel, "msa_lse", tiling, out_shape, *args, interpret=interpret)
    return outs[0], outs[1] if with_student else None


def _first(geo: Geometry):
    """[chunk_queries·repeat] bool: the first of each query's repeated student rows."""
    return jnp.arange(geo.chunk_queries * geo.repeat) % geo.repeat == 0


def _student_logits(geo, seg, iq_ref, index_keys, valid, query):
    """(index_q rows, index_q · index_k · Di^-½ over the block with NEG_INF where not visible
    [rows, block] fp32)."""
    index_q = _load_rows(iq_ref, seg.group_rows(query), valid, geo.index_dim)
    z = _matmul(index_q, index_keys, ((1,), (1,))) * geo.index_dim**-0.5
    return index_q, jnp.where(seg.visible(valid, query), z, NEG_INF)


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
            seg = _Segment(geo, lists_refs[:4], offset_ref, seg_ref, index)
            kv_rows = seg.slot_rows * geo.num_kv_heads + seg.head
            keys_block = _load_rows(k_ref, kv_rows, seg.key_inside, geo.head_dim)
            values_block = _load_rows(v_ref, kv_rows, seg.key_inside, geo.head_dim)
            index_keys = (
                _load_rows(ik_ref, seg.slot_rows, seg.key_inside, geo.index_dim)
                if with_student else None
            )  # fmt: skip

            def chunk_body(chunk, carry):
                position, valid, query = seg.entries(chunk, geo.group)
                rows = seg.head_rows(query)
                visible = seg.visible(valid, query)
                logits = _logits(geo, _load_rows(q_ref, rows, valid, geo.head_dim),
                                 keys_block, visible)  # fmt: skip
                row_lse = plt.load(lse_ref.at[rows], mask=valid, other=0.0)
                probs = jnp.where(visible, jnp.exp(logits - row_lse[:, None]), 0.0)
                share = _matmul(probs.astype(values_block.dtype), values_block)
                out_rows = position * geo.group + jnp.arange(geo.rows) % geo.group
                _store_rows(out_ref, out_rows, valid, share.astype(out_ref.dtype))
                if with_student:
                    s_position, s_valid, s_query = seg.entries(chunk, geo.repeat)
                    _, z = _student_logits(geo, seg, iq_ref, index_keys, s_valid, s_query)
                    z_lse = plt.load(lse_z_ref.at[seg.group_rows(s_query)], mask=s_valid,
                                     other=0.0)  # fmt: skip
                    teacher = _teacher(geo, probs)
                    log_teacher = jnp.log(jnp.maximum(teacher, 1e-30))
                    terms = teacher * (log_teacher - (z - z_lse[:, None]))
                    kl = jnp.where(teacher > 0, terms, 0.0).sum(axis=1)
                    _store(kl_ref, s_position, s_valid & _first(geo), kl)
                return carry

            jax.lax.fori_loop(0, seg.num_chunks, chunk_body, 0)

        _for_each_segment(lists_refs, segment_body)

    out_shape = [jax.ShapeDtypeStruct((geo.entries * geo.group, geo.head_dim), q.dtype)]
    args = [*_table(lists), offset, q, k, v, segment_ids, lse]
    if with_student:
        out_shape.append(jax.ShapeDtypeStruct((geo.entries,), jnp.float32))
        args += [*student, lse_z]
    outs = _launch(kernel, "msa_forward", tiling, out_shape, *args, interpret=interpret)
    return outs[0], outs[1] if with_student else None


def accumulators(geo: Geometry, with_student: bool) -> tuple[jax.Array, ...]:
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
    and kept across windows). Atomics are slow (≈ 10⁹ a second here): with balanced selections
    few segments take that path.

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
            seg = _Segment(geo, lists_refs[:4], offset_ref, seg_ref, index, part, tiling.key_split)
            kv_rows = seg.slot_rows * geo.num_kv_heads + seg.head
            keys_block = _load_rows(k_ref, kv_rows, seg.key_inside, geo.head_dim)
            values_block = _load_rows(v_ref, kv_rows, seg.key_inside, geo.head_dim)
            index_keys = (
                _load_rows(ik_ref, seg.slot_rows, seg.key_inside, geo.index_dim)
                if with_student else None
            )  # fmt: skip
            keys = geo.block_size // tiling.key_split
            zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
            carry = (zeros((keys, geo.head_dim)), zeros((keys, geo.head_dim)))
            if with_student:
                carry += (zeros((keys, geo.index_dim)),)

            def chunk_body(chunk, carry):
                position, valid, query = seg.entries(chunk, geo.group)
                rows = seg.head_rows(query)
                visible = seg.visible(valid, query)
                q_rows = _load_rows(q_ref, rows, valid, geo.head_dim)
                do_rows = _load_rows(do_ref, rows, valid, geo.head_dim)
                logits = _logits(geo, q_rows, keys_block, visible)
                row_lse = plt.load(lse_ref.at[rows], mask=valid, other=0.0)
                row_delta = plt.load(delta_ref.at[rows], mask=valid, other=0.0)
                probs = jnp.where(visible, jnp.exp(logits - row_lse[:, None]), 0.0)
                d_probs = _matmul(do_rows, values_block, ((1,), (1,)))
                d_logits = probs * (d_probs - row_delta[:, None]) * geo.head_dim**-0.5
                dtype = q_rows.dtype
                dk = carry[0] + _matmul(d_logits.astype(dtype), q_rows, ((0,), (0,)))
                dv = carry[1] + _matmul(probs.astype(dtype), do_rows, ((0,), (0,)))
                dq = _matmul(d_logits.astype(dtype), keys_block)
                # each part of a split block has its own copy of the shares (summed later)
                out_rows = (part * geo.entries + position) * geo.group + jnp.arange(geo.rows) % geo.group
                _store_rows(dq_ref, out_rows, valid, dq.astype(dq_ref.dtype))
                if not with_student:
                    return dk, dv
                s_position, s_valid, s_query = seg.entries(chunk, geo.repeat)
                index_q, z = _student_logits(geo, seg, iq_ref, index_keys, s_valid, s_query)
                s_rows = seg.group_rows(s_query)
                z_lse = plt.load(lse_z_ref.at[s_rows], mask=s_valid, other=0.0)
                d_kl = plt.load(dkl_ref.at[s_rows], mask=s_valid & _first(geo), other=0.0)
                student_probs = jnp.where(z > NEG_INF, jnp.exp(z - z_lse[:, None]), 0.0)
                d_z = (student_probs - _teacher(geo, probs)) * (d_kl * geo.index_dim**-0.5)[:, None]
                diq = _matmul(d_z.astype(index_keys.dtype), index_keys)
                _store_rows(diq_ref, part * geo.entries + s_position, s_valid & _first(geo), diq)
                dik = carry[2] + _matmul(d_z.astype(index_q.dtype), index_q, ((0,), (0,)))
                return dk, dv, dik

            carry = jax.lax.fori_loop(0, seg.num_chunks, chunk_body, carry)
            spare = jnp.arange(keys)
            kv_spare = geo.total_slots * geo.num_kv_heads + spare
            own = seg.key_inside & (seg.key_segments == seg.document)
            # d(index_k) is summed per kv head too (its one key head serves them all), so that
            # blocks of different heads never store into the same rows
            added_rows = jnp.where(seg.key_inside, kv_rows, kv_spare)
            stored_rows = jnp.where(own, kv_rows, kv_spare)

            @pl.when(seg.leads)
            def _():
                for ref, value in zip(stored, carry):
                    _store_rows(ref, stored_rows, own, value)

            @pl.when(~seg.leads)
            def _():
                for ref, value in zip(added, carry):
                    _add_rows(ref, added_rows, value)

        _for_each_segment(lists_refs, segment_body, tiling.key_split)

    parts = tiling.key_split
    out_shape = [jax.ShapeDtypeStruct((parts * geo.entries * geo.group, geo.head_dim), q.dtype)]
    args = [*_table(lists), offset, q, k, v, segment_ids, lse, delta, d_out]
    if with_student:
        args += [*student, lse_z, d_kl]
        out_shape.append(jax.ShapeDtypeStruct((parts * geo.entries, geo.index_dim), jnp.float32))
    buffers = [*sums, *accumulators(geo, with_student)]
    first_buffer, first_output = len(args), len(out_shape)
    out_shape += [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers]
    aliases = {first_buffer + i: first_output + i for i in range(len(buffers))}
    outs = _launch(kernel, "msa_backward", tiling, out_shape, *args, *buffers, interpret=interpret,
                   aliases=aliases)  # fmt: skip
    sums_out = outs[first_output:]
    half = len(sums_out) // 2
    diq = outs[1] if with_student else None
    return outs[0], diq, tuple(sums_out[:half]), tuple(sums_out[half:])
