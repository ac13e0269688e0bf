"""What the MSA attention kernels share (Pallas, Triton lowering): a segment's index arithmetic,
the gathers and stores of its rows, the small matmul helpers and the persistent launch.

Each program of the forward, LSE and backward kernels walks segments of `block_lists.BlockLists`
(a persistent grid: item i goes to program i mod P). A segment is one key block of one (row, kv
head) and up to `segment_chunks` chunks of the queries that chose it; a chunk's `chunk_queries`
queries × G heads are the rows of one matmul against the block's keys, which are loaded once per
segment. Masking: a key is seen by a row iff it is in the row's document (segment ids), not
after the query, and inside the sequence; rows past the end of their block's list are inert.
Stores of masked rows go to distinct indices past the end (Pallas' interpreter writes masked rows
back, so they must never alias kept ones).

Shapes: B batch, S sequence (queries of the current window are slots `query_offset` + [0, W)),
H query heads, K kv heads, G = H // K, Dh head dim, Di index head dim, k selections per query,
E = B·W·K·k entries; R = chunk_queries·G rows of a chunk; block = block_size keys.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import target
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


class Segment:
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

    @property
    def kv_rows(self):
        """Rows of [B·S·K, ...] arrays (k, v, dk, dv) for the block's keys of this head."""
        return self.slot_rows * self.geo.num_kv_heads + self.head

    def load_block(self, ref, shared: bool = False):
        """The block's keys' rows of a [B·S·K, D] ref, or of a [B·S, D] one all heads share
        (index_k): [keys, D], zero outside the sequence."""
        rows = self.slot_rows if shared else self.kv_rows
        return load_rows(ref, rows, self.key_inside, ref.shape[1])

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


def load_rows(ref, rows, valid, width):
    """Gather rows [n] of a [N, width] ref -> [n, width]; invalid rows read as 0."""
    return plt.load(
        ref.at[rows[:, None], jnp.arange(width)[None, :]], mask=valid[:, None], other=0.0
    )


def targets(index, keep, size):
    """Store targets: `index` where `keep`, else distinct indices past the end (size)."""
    return jnp.where(keep, index, size + jnp.arange(index.shape[0]))


def store_rows(ref, rows, valid, value):
    rows = targets(rows, valid, ref.shape[0])
    plt.store(
        ref.at[rows[:, None], jnp.arange(value.shape[1])[None, :]], value, mask=valid[:, None]
    )


def store(ref, index, keep, value):
    plt.store(ref.at[targets(index, keep, ref.shape[0])], value, mask=keep)


def add_rows(ref, rows, value):
    """ref[rows] += value with atomics (rows distinct)."""
    plt.atomic_add(ref, (rows[:, None], jnp.arange(value.shape[1])[None, :]), value)


def matmul(a, b, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def logits(geo: Geometry, q, keys, visible):
    """q [R, Dh] · keys [block, Dh]ᵀ · Dh^-½, NEG_INF where not visible -> [R, block] fp32."""
    logits = matmul(q, keys, ((1,), (1,))) * geo.head_dim**-0.5
    return jnp.where(visible, logits, NEG_INF)


def teacher(geo: Geometry, probs):
    """[R, keys] globally normalised probabilities -> the group mean [chunk_queries·repeat, keys]
    (each query's row repeated `repeat` times, matching the student rows)."""
    keys = probs.shape[1]
    mean = probs.reshape(geo.chunk_queries, geo.group, keys).sum(axis=1) / geo.group
    repeated = jnp.broadcast_to(mean[:, None], (geo.chunk_queries, geo.repeat, keys))
    return repeated.reshape(geo.chunk_queries * geo.repeat, keys)


def for_each_segment(lists, body, parts=1, grid=None):
    """Persistent loop over (segment, part) items: program p takes items p, p + P, ... of
    num_segments · parts, calling body(segment, part). grid: (p, P), where the kernel's own
    program ids are not Pallas' (Mosaic GPU's named axes); Pallas' by default."""
    items = lists[4][0] * parts
    program, programs = grid or (pl.program_id(0), pl.num_programs(0))
    trips = jnp.maximum(items - program + programs - 1, 0) // programs

    def step(n, carry):
        item = program + n * programs
        body(item // parts, item % parts)
        return carry

    jax.lax.fori_loop(0, trips, step, 0)


def launch(kernel, name, tiling, out_shape, *args, interpret, aliases=None):
    device = target.devices()[0]
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


def table(geo: Geometry, lists: BlockLists):
    """The Triton kernels' first operands: the lists, with each segment's size in chunks."""
    sizes = -(-lists.segment_entries // geo.chunk_queries)
    return lists.keys, lists.entries, lists.segment_starts, sizes, lists.num_segments


def first_student_rows(geo: Geometry):
    """[chunk_queries·repeat] bool: the first of each query's repeated student rows."""
    return jnp.arange(geo.chunk_queries * geo.repeat) % geo.repeat == 0


def student_logits(geo, seg, iq_ref, index_keys, valid, query):
    """(index_q rows, index_q · index_k · Di^-½ over the block with NEG_INF where not visible
    [rows, block] fp32)."""
    index_q = load_rows(iq_ref, seg.group_rows(query), valid, geo.index_dim)
    z = matmul(index_q, index_keys, ((1,), (1,))) * geo.index_dim**-0.5
    return index_q, jnp.where(seg.visible(valid, query), z, NEG_INF)
