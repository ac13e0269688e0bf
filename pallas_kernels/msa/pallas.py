"""MiniMax Sparse Attention on GPUs through Pallas kernels: `reference.py`'s signatures.

- `top_blocks`: one kernel (selection_kernel.py) streams the indexer's scores over key tiles and
  keeps each (query, index head)'s top-k document blocks in registers.
- `sparse_attention`: key-block-major kernels (forward_kernels.py, backward_kernel.py, chunks.py)
  over the selection inverted
  by one sort (block_lists.py), forward and backward, with the indexer's KL and its gradients into
  the index projections; a custom VJP ties them together. `Config.forward_kernel="mosaic"` runs
  the forward on Mosaic GPU kernels instead (mosaic_forward.py): one pass without a student;
  with one (the indexer's KL) that pass also yields the student's LSE and a second kernel the KL
  and the teacher, which the Mosaic backward's student gradients read (kept within
  `Config.teacher_bytes`, else the backward's gradients kernel takes it from its own P).
  `Config.kl_kernel="slots"` takes the student out of both: the attention pass without it, the
  teacher pass (on the backward's items: `mosaic_backward.teacher_pass`), then the student's LSE
  and KL one row per entry in the student's kernel (mosaic_student.py). Under a KL sink
  (`reference.kl_through_sink`: a training step's way) the forward runs no student at all: the
  backward's student kernel takes LSE_z and the KL from the gradients kernel's teacher.
  The default, "auto", takes them where they were measured faster on the H200 (compiled, G a
  multiple of 8: 2.0× the Triton forward without a student, 1.04× small-gpu's training step at
  32K, benchmarks/RESULTS.md) and the Triton forward elsewhere. `Config.backward_kernel`
  likewise: "auto" runs the backward on Mosaic GPU kernels (mosaic_backward.py) behind a Mosaic
  forward where they fit (1.08× small-gpu's training step at 4K rows and at 32K, 1.07× at
  128K), the Triton backward elsewhere; either backward takes either forward's residuals (every
  forward leaves the same LSE and LSE_z). Queries go in windows small enough that the
  per-entry shares stay within `partial_bytes` of memory (but of at least `min_window`).
- `dense_attention` and `block_recall` are the XLA path's (the dense warm-up and a diagnostic).

Query slots (reference.py): the kernels take them as runs, [R, S / R] consecutive slots each
(context parallelism's two chunks a device, m3jax/context_parallel.py), since they address a
window's queries as one slot offset plus their place in it: each run is cut into windows of its
own. Other query slots are refused.

The other kernels are written for the Triton lowering of Pallas (a stepping stone towards Mosaic
GPU; spec/msa.md §4). On a machine without a GPU they run in Pallas' interpreter (`interpret=None`
picks that; the Mosaic kernel in Mosaic GPU's), which is how the CPU tests check them against the
reference.

Shapes: B batch, S queries, T keys (= S without query slots), H query heads, K kv heads (= Hi),
G = H // K, Dh head dim, Di index head dim, k selected blocks per query, W queries per window,
E = B·W·K·k selection entries, R runs of query slots.
"""

import dataclasses
import functools
import sys
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import target
from pallas_kernels.attention.reference import at_query_slots
from pallas_kernels.msa import (
    backward_kernel,
    block_lists,
    chunks,
    forward_kernels,
    mosaic_backward,
    mosaic_forward,
    mosaic_student,
    selection_kernel,
)
from pallas_kernels.msa.mosaic_chunks import WindowRows
from pallas_kernels.msa.reference import (
    SAVED_BY_ANY_REMAT,
    SAVED_BY_REMAT,
    Student,
    check_kl_sink,
    kl_through_sink,
)
from pallas_kernels.msa.xla import block_recall, dense_attention

__all__ = ["block_recall", "dense_attention", "sparse_attention", "top_blocks"]

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)  # float32 tiles overflow shared memory on Hopper


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything but the shapes that fixes how `sparse_attention` runs."""

    forward: chunks.Tiling = chunks.Tiling(rows=128, num_warps=8)
    backward: chunks.Tiling = chunks.Tiling(
        rows=64, num_warps=8, num_stages=3, segment_chunks=64, key_split=2
    )
    selection: selection_kernel.Tiling = selection_kernel.Tiling()
    partial_bytes: int = 4 << 30  # memory for the per-entry output shares of one window
    min_window: int = 128  # the fewest queries a window takes, however small partial_bytes
    # "triton": LSE pass + forward pass; "mosaic": the Mosaic GPU forward (+ KL pass); "auto":
    # Mosaic where `concrete` picks it
    forward_kernel: str = "auto"
    # the attention pass on two warpgroups a program, one Q stage each (with the teacher pass,
    # since moved to the backward's items: the layer's forward 1.17x at 128K and 1.19x at 32K,
    # fwd+bwd 1.06x and 1.08x, on the H100, benchmarks/RESULTS.md, 2026-12-07); `concrete` takes
    # one where they do not fit
    mosaic: mosaic_forward.Tiling = mosaic_forward.Tiling(stages=1, warpgroups=2)
    # "triton": backward_kernel.py; "mosaic": the Mosaic GPU backward (mosaic_backward.py); "auto":
    # Mosaic where `concrete` picks it
    backward_kernel: str = "auto"
    # two warpgroups a program (paired; 1.03x the layer's fwd+bwd at 32K, 1.01x at 128K on the
    # H200, benchmarks/RESULTS.md, 2026-12-05); `concrete` takes one where they do not fit
    mosaic_backward: mosaic_forward.Tiling = mosaic_forward.Tiling(segment_chunks=32, warpgroups=2)
    # the forward's teacher pass with the KL on slots (`mosaic_backward.teacher_pass`): the
    # backward's items, a key half per warpgroup, over the forward's chunks of `mosaic.rows`;
    # two programs an SM (68 KiB of shared memory each at Dh = 128: the layer's forward 1.085x
    # at 128K on the H100 against one, benchmarks/RESULTS.md, 2026-12-07; three: 1.04x)
    teacher: mosaic_forward.Tiling = mosaic_forward.Tiling(warpgroups=2, programs_per_core=2)
    # the most bytes of the forward's teacher (the teacher pass', or the KL pass' with
    # kl_kernel "pass"; fp32 per selection entry and key: 16 KB a token at
    # 2 kv heads, 4x the attention output) a layer keeps for the Mosaic backward; beyond, the
    # backward's gradients kernel takes it from its P (long rows: 8.6 GB a layer at 512K tokens)
    teacher_bytes: int = 1 << 30
    # the Mosaic forward's KL with a student: "slots", the attention pass runs without the
    # student and the teacher pass computes the teacher; the student's kernel takes LSE_z and
    # the KL one row per entry (mosaic_student.kl_terms; 1.08x the layer's forward at 128K on the
    # H200, benchmarks/RESULTS.md, 2026-12-05); "pass", the attention pass and the KL pass compute
    # the student's logits (its LSE, the KL) on each of an entry's head rows: also the way of
    # windows of more segments than the slots hold
    kl_kernel: str = "slots"
    # the caller checked that every row holds at most `mosaic_backward.most_documents`
    # (m3jax/attention_ops.py: `holds_few_documents`), so no window has more segments than the
    # Mosaic kernels' tables (`mosaic_backward.segment_bound`): their fallbacks and `lax.cond`s,
    # whose predicates XLA:GPU reads on the host, are left out
    few_documents: bool = False

    @property
    def uses_mosaic(self) -> bool:
        """Whether the forward runs the Mosaic GPU kernels (with or without a student)."""
        return self.forward_kernel == "mosaic"

    @property
    def backward_tiling(self):
        """The backward kernel's tiling (`chunk_queries` and `segment_chunks` alike)."""
        return self.mosaic_backward if self.backward_kernel == "mosaic" else self.backward

    def with_fields(self, items) -> "Config":
        """This config with fields set from 'name=value' strings: one of its own
        ('teacher_bytes=8589934592') or a tiling's ('mosaic_backward.warpgroups=2'); a value of
        digits is an int, any other a string, each as the field's default is (the run config's
        `model.msa_kernels` and the benchmarks' tilings set kernels this way)."""
        config = self
        for item in items:
            name, equals, text = str(item).partition("=")
            part, _, field = name.rpartition(".")
            if not equals:
                raise ValueError(f"{item!r} is not 'field=value'")
            if part and part not in {f.name for f in dataclasses.fields(config)}:
                raise ValueError(f"{item!r}: Config has no tiling {part!r}")
            owner = getattr(config, part) if part else config
            if field not in {f.name for f in dataclasses.fields(owner)}:
                raise ValueError(f"{item!r}: {type(owner).__name__} has no field {field!r}")
            if isinstance(getattr(owner, field), int) != text.isdigit():
                raise ValueError(f"{item!r}: {field} is {type(getattr(owner, field)).__name__}")
            value = dataclasses.replace(owner, **{field: int(text) if text.isdigit() else text})
            config = dataclasses.replace(config, **{part: value}) if part else value
        return config


def configured(
    settings: Sequence[str], few_documents: bool = False
) -> types.ModuleType | types.SimpleNamespace:
    """This backend with its kernels under the Config that `settings` name ('field=value', as
    `Config.with_fields` takes them; the model's `msa_kernels`) and `few_documents`: the module
    itself where both are the defaults, else the same functions with that Config."""
    if not settings and not few_documents:
        return sys.modules[__name__]
    config = dataclasses.replace(Config().with_fields(settings), few_documents=few_documents)
    with_config = (top_blocks, sparse_attention, unsupported_reason)
    return types.SimpleNamespace(
        **{f.__name__: functools.partial(f, config=config) for f in with_config},
        dense_attention=dense_attention, block_recall=block_recall, config=config,
    )  # fmt: skip


def concrete(
    config: Config, q: jax.Array, k: jax.Array, index_q: jax.Array, block_size: int,
    interpret: bool | None = None,
) -> Config:  # fmt: skip
    """`config` with the "auto" kernels resolved for these operands. The forward: "mosaic" when
    compiled for a GPU, with each entry's G heads copied straight from q (G a multiple of 8: the
    layouts timed) and within the Mosaic forward's limits, else "triton". The backward: "mosaic"
    where the forward resolved to it and the Mosaic backward's limits hold (1.08x small-gpu's
    training step at 4K rows and at 32K, benchmarks/RESULTS.md), else "triton". A Mosaic forward
    or backward, "auto" or pinned, runs one warpgroup a program where the tiling's two do not fit
    (shared memory; the backward's Dh not in two halves of 64). `index_q` is q without a
    student."""
    group = q.shape[2] // k.shape[2]
    index_dim = 0 if index_q is q else index_q.shape[3]
    limits = (q.dtype, group, q.shape[3], block_size)
    forward_fits = _fitting(
        config.mosaic, lambda t: mosaic_forward.unsupported_reason(*limits, t, index_dim)
    )
    if config.forward_kernel == "auto":
        mosaic = (
            not _interpret(interpret)
            and mosaic_forward.gathers_queries(group)
            and bool(forward_fits)
        )
        config = dataclasses.replace(config, forward_kernel="mosaic" if mosaic else "triton")
    if config.uses_mosaic and forward_fits:
        config = dataclasses.replace(config, mosaic=forward_fits[0])
    fits = _fitting(
        config.mosaic_backward, lambda t: mosaic_backward.unsupported_reason(*limits, t, index_dim)
    )
    if config.backward_kernel == "auto":
        mosaic = config.uses_mosaic and bool(fits)
        config = dataclasses.replace(config, backward_kernel="mosaic" if mosaic else "triton")
    if config.backward_kernel == "mosaic" and fits:
        config = dataclasses.replace(config, mosaic_backward=fits[0])
    return config


def _fitting(tiling, reason) -> list:
    """Of `tiling` and the same on one warpgroup a program, in that order, those that `reason`
    (a kernel's `unsupported_reason` of a tiling) accepts."""
    tilings = dict.fromkeys((tiling, dataclasses.replace(tiling, warpgroups=1)))
    return [t for t in tilings if not reason(t)]


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def unsupported_reason(
    q: jax.Array,
    k: jax.Array,
    index_q: jax.Array,
    *,
    block_size: int,
    config: Config = Config(),
    interpret: bool | None = None,
) -> str:
    """Why the kernels can't run a layer with these operands ('' when they can). Dtypes and tile
    sizes (powers of two >= 16) bind the compiled Triton kernels only; the interpreter takes any.
    The Mosaic forward's limits bind always (its interpreter checks tiles and copies too).
    `index_q` is q itself without a student."""
    group, index_heads = q.shape[2] // k.shape[2], index_q.shape[2]
    if config.forward_kernel not in ("auto", "triton", "mosaic"):
        return f"forward_kernel={config.forward_kernel!r} is not 'auto', 'triton' or 'mosaic'"
    if config.backward_kernel not in ("auto", "triton", "mosaic"):
        return f"backward_kernel={config.backward_kernel!r} is not 'auto', 'triton' or 'mosaic'"
    if config.kl_kernel not in ("pass", "slots"):
        return f"kl_kernel={config.kl_kernel!r} is not 'pass' or 'slots'"
    config = concrete(config, q, k, index_q, block_size, interpret)
    index_dim = 0 if index_q is q else index_q.shape[3]
    if config.uses_mosaic:
        rows = config.mosaic.rows
        reason = mosaic_forward.unsupported_reason(
            q.dtype, group, q.shape[3], block_size, config.mosaic, index_dim
        )
        if reason:
            return f"Mosaic forward: {reason}"
        teacher = config.teacher
        if teacher.warpgroups not in (1, mosaic_backward.KEY_PARTS) or teacher.rows != rows:
            return (f"teacher pass: warpgroups={teacher.warpgroups}, rows={teacher.rows} are not "
                    f"one key half or both over the forward's {rows} rows")  # fmt: skip
    if config.backward_kernel == "mosaic":
        reason = mosaic_backward.unsupported_reason(
            q.dtype, group, q.shape[3], block_size, config.mosaic_backward, index_dim
        )
        if reason:
            return f"Mosaic backward: {reason}"
    for rows in (config.forward.rows, config.backward.rows):
        if rows % group or (rows // group) & (rows // group - 1):
            return (
                f"attention rows={rows} are not a power-of-two number of queries of {group} heads"
            )
    if config.selection.rows % index_heads:
        return (
            f"selection rows={config.selection.rows} are not whole queries of {index_heads} heads"
        )
    split = config.backward.key_split
    if block_size % split:
        return f"block_size={block_size} does not split into backward key_split={split} parts"
    if _interpret(interpret):
        return ""
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        return f"dtype {jnp.dtype(q.dtype)} is not bfloat16 or float16"
    sizes = {"head_dim": q.shape[3], "index_head_dim": index_q.shape[3], "block_size": block_size,
             "block_size / backward key_split": block_size // split}  # fmt: skip
    for name, size in sizes.items():
        if not _power_of_two(size):
            return f"{name}={size} is not a power of two >= 16"
    return ""


def _interpret(interpret: bool | None) -> bool:
    return target.platform() != "gpu" if interpret is None else interpret


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
    interpret: bool | None = None,
) -> jax.Array:
    """Same arguments and result as `reference.top_blocks` (query slots as runs: module
    docstring)."""
    return selection_kernel.top_blocks(
        index_q, index_k, segment_ids, positions, block_size=block_size,
        topk_blocks=topk_blocks, local_blocks=local_blocks,
        run_starts=run_starts(query_slots, index_q.shape[1]), tiling=config.selection,
        interpret=_interpret(interpret),
    )  # fmt: skip


def run_starts(query_slots: jax.Array | None, num_queries: int) -> jax.Array | None:
    """[R] int32: the first slot of each run of query slots [R, S / R] (None without them).
    Slots known at trace time are checked to run consecutively; traced ones are trusted."""
    if query_slots is None:
        return None
    if query_slots.ndim != 2 or query_slots.size != num_queries:
        raise ValueError(
            f"MSA kernels take query slots as [runs, length] of consecutive slots for the "
            f"{num_queries} queries, not shape {query_slots.shape}"
        )
    if not isinstance(query_slots, jax.core.Tracer):
        steps = np.diff(np.asarray(query_slots), axis=1)
        if steps.size and not (steps == 1).all():
            raise ValueError("MSA kernels: query slots do not run consecutively within each run")
    return query_slots[:, 0].astype(jnp.int32)


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
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Same arguments and results as `reference.sparse_attention` (query slots as runs: module
    docstring). A KL sink behind the Mosaic forward and backward leaves the student out of the
    forward (the attention pass alone): the backward's student kernel takes LSE_z and the KL from
    the gradients kernel's teacher. Elsewhere the forward computes the KL, routed to the sink."""
    index_q, index_k = (q, None) if student is None else student
    reason = unsupported_reason(
        q, k, index_q, block_size=block_size, config=config, interpret=interpret
    )
    if reason:
        raise ValueError(f"MSA kernels: {reason}")
    config = concrete(config, q, k, index_q, block_size, interpret)
    sinks = student is not None and kl_sink is not None
    if kl_sink is not None and not (sinks and config.uses_mosaic
                                    and config.backward_kernel == "mosaic"):  # fmt: skip
        out, kl = sparse_attention(q, k, v, block_indices, segment_ids, positions,
                                   block_size=block_size, student=student,
                                   query_slots=query_slots, config=config, interpret=interpret)
        return out, kl_through_sink(kl, kl_sink)
    if sinks:
        check_kl_sink(kl_sink, (*q.shape[:2], k.shape[2]))
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads, topk = k.shape[2], block_indices.shape[-1]
    starts = run_starts(query_slots, num_queries)
    starts = jnp.zeros(1, jnp.int32) if starts is None else starts
    run_length = num_queries // starts.shape[0]
    # per-entry shares of a window: the output's (forward), key_split copies of dq's (backward)
    copies = max(1, config.backward.key_split)
    per_query = batch * num_heads * topk * head_dim * jnp.dtype(q.dtype).itemsize * copies
    forward_tiling = config.mosaic if config.uses_mosaic else config.forward
    forward_geo, backward_geo = (
        chunks.Geometry(
            batch=batch,
            seq=k.shape[1],
            window=min(run_length, max(config.min_window, config.partial_bytes // per_query)),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            index_dim=index_q.shape[-1],
            topk=topk,
            block_size=block_size,
            chunk_queries=tiling.chunk_queries(num_heads // num_kv_heads),
        )  # fmt: skip
        for tiling in (forward_tiling, config.backward_tiling)
    )
    attention = _attention(forward_geo, backward_geo, config, _interpret(interpret),
                           student is not None, num_queries, sinks)  # fmt: skip
    index_q = None if student is None else index_q
    # the kernels read the key row's segment ids, and the queries' own positions
    query_positions = at_query_slots(positions, query_slots)
    return attention(q, k, v, index_q, index_k, block_indices, segment_ids, query_positions,
                     starts, kl_sink if sinks else None)  # fmt: skip


class _Windows:
    """Queries in windows of W. The S queries are R runs of consecutive slots from `starts` [R];
    each run is cut into windows, its last padded: a [B, S, ...] array `padded` is [B, count·W,
    ...], window i its slots i·W .. i·W + W - 1. The loops over windows slice their operands out of
    padded arrays and write their results into them in place (`take`, `put`), where stacking the
    windows first ([count, B, W, ...]) copies every operand and result once more at B > 1. The
    row matrices (q, dO) are not sliced at all (`rows`): the Mosaic kernels read a window's rows
    in the padded array."""

    def __init__(self, geo: chunks.Geometry, num_queries: int, starts: jax.Array):
        self.geo, self.runs = geo, starts.shape[0]
        self.run_length = num_queries // self.runs
        self.per_run = -(-self.run_length // geo.window)
        self.count = self.runs * self.per_run
        within = jnp.arange(self.per_run, dtype=jnp.int32) * geo.window
        self.offsets = (starts[:, None] + within).reshape(-1)

    def padded(self, x, fill=0):  # [B, S, ...] -> [B, count·W, ...]
        geo = self.geo
        x = x.reshape(geo.batch, self.runs, self.run_length, *x.shape[2:])
        pad = [(0, 0), (0, 0), (0, self.per_run * geo.window - self.run_length)]
        x = jnp.pad(x, pad + [(0, 0)] * (x.ndim - 3), constant_values=fill)
        return x.reshape(geo.batch, self.count * geo.window, *x.shape[3:])

    def unpadded(self, x):  # [B, count·W, ...] -> [B, S, ...]
        geo = self.geo
        x = x.reshape(geo.batch, self.runs, -1, *x.shape[2:])
        return x[:, :, : self.run_length].reshape(geo.batch, -1, *x.shape[3:])

    def buffer(self, tail: tuple, dtype) -> jax.Array:
        """[B, count·W, *tail] for the windows' results, uninitialised (on a GPU; zeros where
        the backend has no empty buffers): every window's `put` writes its slots, so filling
        it first would only cost a write (2.1 GB for the output at 128K tokens of M3's heads)."""
        return jax.lax.empty((self.geo.batch, self.count * self.geo.window, *tail), dtype)

    def take(self, arrays, index):
        """Window `index` [B, W, ...] of each padded array (a pytree; None stays None)."""
        start, size = index * self.geo.window, self.geo.window
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, 1), arrays)

    def queries(self, q, index_q, blocks, positions) -> tuple:
        """The operands a window's queries own, padded (index_q may be None)."""
        return (self.padded(q), None if index_q is None else self.padded(index_q),
                self.padded(blocks, fill=-1), self.padded(positions))  # fmt: skip

    def rows(self, padded, index) -> WindowRows:
        """Window `index` of a padded row matrix (q, dO), left in place."""
        return WindowRows(padded, index * self.geo.window, self.geo.window)

    def window(self, queries: tuple, index) -> tuple:
        """Window `index` of `queries` and its offset: (q, index_q, blocks, positions, offset),
        q as `WindowRows`."""
        return (self.rows(queries[0], index), *self.take(queries[1:], index), self.offsets[index])

    def put(self, buffers, values, index):
        """`buffers` (padded, a pytree) with window `index` set to `values` [B, W, ...]."""
        start = index * self.geo.window
        return jax.tree.map(
            lambda b, x: jax.lax.dynamic_update_slice_in_dim(b, x.astype(b.dtype), start, 1),
            buffers, values,
        )  # fmt: skip


def _flat(x):  # [B, N, heads, D] -> [B·N·heads, D]
    return x.reshape(-1, x.shape[-1])


def _attention(forward_geo, backward_geo, config: Config, interpret: bool, with_student: bool,
               num_queries: int, sinks: bool):  # fmt: skip
    """The custom-VJP sparse attention of a whole row, computed window by window (the two
    geometries differ only in their chunks' queries). sinks: the KL goes to a sink (its value
    the sink's cotangent) and the backward computes it: the forward runs no student."""
    kernels = dict(interpret=interpret)
    geo = forward_geo
    mosaic = config.uses_mosaic
    forward_student = with_student and not sinks
    teacher_size = geo.batch * num_queries * geo.num_kv_heads * geo.topk * geo.block_size * 4
    keeps_teacher = config.backward_kernel == "mosaic" and teacher_size <= config.teacher_bytes
    selection_shape = (geo.batch, geo.window, geo.num_kv_heads, geo.topk)
    # the Triton backward's chunks, for the windows the Mosaic backward can't take
    fallback_geo = dataclasses.replace(
        backward_geo, chunk_queries=config.backward.chunk_queries(backward_geo.group)
    )

    def lists_of(geo, tiling, blocks, positions, offset):
        return block_lists.build(
            blocks, positions, offset, seq=geo.seq, block_size=geo.block_size,
            chunk_queries=geo.chunk_queries, segment_chunks=tiling.segment_chunks,
        )  # fmt: skip

    by_slot = block_lists.by_valid_selection  # -> [B, W, K, k, ...], `fill` where invalid

    def mosaic_window(keys, index_keys, segment_ids, window):
        """The Mosaic forward of a window (`mosaic_attention`); with `kl_kernel="slots"` the
        KL on slots of entries where they hold the window's segments, else the KL pass."""
        geo, tiling = forward_geo, config.mosaic
        q, index_q, blocks, positions, offset = window
        lists, valid = lists_of(geo, tiling, blocks, positions, offset), blocks >= 0
        chunk_walk = mosaic_forward.walk(geo, lists, q, segment_ids, offset)
        run = functools.partial(mosaic_attention, geo, tiling, lists, valid, chunk_walk, keys,
                                index_keys, segment_ids, window)  # fmt: skip
        if not (forward_student and config.kl_kernel == "slots"):
            return run()
        bound = mosaic_backward.segment_bound(geo, tiling)
        if config.few_documents:  # no window overflows the slots
            return run(bound)
        return jax.lax.cond(lists.num_segments[0] > bound, run, functools.partial(run, bound))

    def mosaic_attention(geo, tiling, lists, valid, chunk_walk, keys, index_keys, segment_ids,
                         window, slots_bound=None):  # fmt: skip
        """Kernel, combine; with a student then the KL and the teacher per sorted entry (for
        the Mosaic backward's student gradients; else None): by the KL pass on the combined
        LSEs, each entry's shares summed per query; or (`slots_bound`: segments the student's
        slots hold) by the attention pass without the student, the teacher pass and the
        student's kernel one row per entry (`mosaic_student.kl_terms`: LSE_z and the KL from
        its per-entry terms)."""
        q, index_q, _, _, offset = window
        student = None
        if forward_student and slots_bound is None:
            student = (mosaic_forward.index_rows(index_q, q.dtype), index_keys)
        o, lse_e, lse_z_e = mosaic_forward.forward(geo, tiling, chunk_walk, *keys, student,
                                                   **kernels)  # fmt: skip
        out, lse, lse_z = mosaic_forward.combine(geo, lists, valid, o, lse_e, lse_z_e)
        kl = teacher = None
        if student is not None:
            lses = mosaic_forward.row_values(geo, lists, [lse], [lse_z])
            kl_e, teacher = mosaic_forward.kl_pass(geo, tiling, chunk_walk, keys[0], keys[2],
                                                   student, lses, with_teacher=keeps_teacher,
                                                   **kernels)  # fmt: skip
            # each entry's KL share sits in its first row; a query's k shares add up
            first_rows = kl_e.reshape(-1, mosaic_forward.entry_rows(geo.group))[:, 0]
            kl = by_slot(first_rows, lists, valid, 0.0).sum(axis=3)
        elif forward_student:
            teacher = mosaic_backward.teacher_pass(geo, config.teacher, lists, chunk_walk, keys,
                                                   lse, **kernels)  # fmt: skip
            entries = dict(index_q=index_q, q=chunk_walk.q_rows, teacher=teacher,
                           segment_ids=segment_ids, offset=offset)  # fmt: skip
            operands = dict(chunk_walk.operands(), kseg=keys[2])
            terms = mosaic_student.kl_terms(geo, tiling, lists, operands, entries, index_keys,
                                            slots_bound, **kernels)  # fmt: skip
            kl, lse_z = mosaic_student.query_kl(geo, lists, valid, terms)
            teacher = teacher if keeps_teacher else None
        return out.astype(q.dtype), kl, lse, lse_z, teacher

    def forward_window(geo, k, v, index_k, segments, window):
        """The Triton forward of a window (`geo`: with the Triton forward's chunks)."""
        tiling = config.forward
        q, index_q, blocks, positions, offset = window
        q = q.sliced()
        lists, valid = lists_of(geo, tiling, blocks, positions, offset), blocks >= 0
        student = (_flat(index_q), _flat(index_k)) if with_student else None
        offset = offset.reshape(1)
        lse_part, lse_z_part = forward_kernels.lse_pass(
            geo, tiling, lists, offset, _flat(q), _flat(k), segments, student, **kernels
        )
        lse = jax.nn.logsumexp(by_slot(lse_part.reshape(-1, geo.group), lists, valid, -jnp.inf), 3)
        lse_z = None
        if with_student:
            lse_z = jax.nn.logsumexp(by_slot(lse_z_part, lists, valid, -jnp.inf), axis=3)
        share, kl_part = forward_kernels.forward_pass(
            geo, tiling, lists, offset, _flat(q), _flat(k), _flat(v), segments, lse.reshape(-1),
            student, None if lse_z is None else lse_z.reshape(-1), **kernels,
        )  # fmt: skip
        share = by_slot(share.reshape(-1, geo.group, geo.head_dim), lists, valid, 0.0)
        out = share.sum(axis=3, dtype=jnp.float32).astype(q.dtype).reshape(q.shape)
        kl = by_slot(kl_part, lists, valid, 0.0).sum(axis=3) if with_student else None
        return out, kl, lse, lse_z, None

    def forward(q, k, v, index_q, index_k, blocks, segment_ids, positions, starts, kl_sink):
        del kl_sink  # only its cotangent counts
        windows = _Windows(geo, num_queries, starts)
        segments = segment_ids.reshape(-1).astype(jnp.int32)
        inputs = windows.queries(q, index_q if forward_student else None, blocks, positions)
        if mosaic:
            shifted = lambda x: mosaic_forward.shifted_keys(x, geo.block_size)  # noqa: E731
            keys = (shifted(k), shifted(v), shifted(segment_ids.astype(jnp.int32)))
            index_keys = shifted(index_k.astype(q.dtype)) if forward_student else None
            attend = functools.partial(mosaic_window, keys, index_keys, segment_ids)
        else:
            attend = functools.partial(forward_window, geo, k, v, index_k, segments)

        def step(joined, index):
            out, kl, *saved = attend(windows.window(inputs, index))
            return windows.put(joined, (out, kl), index), saved

        kl_shape = (geo.num_kv_heads,)
        joined = (windows.buffer(q.shape[2:], q.dtype),
                  windows.buffer(kl_shape, jnp.float32) if forward_student else None)
        (out, kl), (lse, lse_z, teacher) = jax.lax.scan(step, joined, jnp.arange(windows.count))
        out, kl = windows.unpadded(out), kl if kl is None else windows.unpadded(kl)
        if sinks:  # zeros that carry d_kl into the backward (reference.kl_through_sink)
            kl = jnp.zeros((*q.shape[:2], *kl_shape), jnp.float32)
        out, teacher = (None if x is None else checkpoint_name(x, SAVED_BY_REMAT)
                        for x in (out, teacher))  # fmt: skip
        lse, lse_z = (None if x is None else checkpoint_name(x, SAVED_BY_ANY_REMAT)
                      for x in (lse, lse_z))  # fmt: skip
        residuals = (q, k, v, index_q, index_k, blocks, segment_ids, positions, starts, out, lse,
                     lse_z, teacher)  # fmt: skip
        return (out, kl), residuals

    def selection_sums(parts, lists, valid, row_of_entry=None):
        """Per-entry shares [parts, E, ...] (or [parts, R, ...] at `row_of_entry` [E], the row
        of each sorted entry) -> their sums over each query's k selections [B, W, K, ...] fp32."""
        rows = lists.sorted_position.reshape(selection_shape)
        if row_of_entry is not None:
            rows = row_of_entry[rows]
        return block_lists.selection_sums(parts, rows, valid)

    def triton_window(geo, k, v, index_k, segments, sums, window):
        """The Triton backward of a window; sums: (added, stored) `accumulators`."""
        tiling = config.backward
        q, index_q, blocks, positions, offset, d_out, delta, d_kl, lse, lse_z, _ = window
        q, d_out = q.sliced(), d_out.sliced()
        lists, valid = lists_of(geo, tiling, blocks, positions, offset), blocks >= 0
        student = (_flat(index_q), _flat(index_k)) if with_student else None
        added, totals = sums
        dq_part, diq_part, added, stored = backward_kernel.backward_pass(
            geo, tiling, lists, offset.reshape(1), _flat(q), _flat(k), _flat(v), segments,
            lse.reshape(-1), delta.reshape(-1), _flat(d_out), student,
            None if lse_z is None else lse_z.reshape(-1),
            None if d_kl is None else d_kl.reshape(-1).astype(jnp.float32), added, **kernels,
        )  # fmt: skip
        sums = added, tuple(total + new for total, new in zip(totals, stored))
        parts = tiling.key_split
        dq_part = dq_part.reshape(parts, -1, geo.group, geo.head_dim)
        dq = selection_sums(dq_part, lists, valid).reshape(q.shape).astype(q.dtype)
        diq = None
        if with_student:
            diq_part = diq_part.reshape(parts, -1, geo.index_dim)
            diq = selection_sums(diq_part, lists, valid).astype(index_q.dtype)
        return sums, (dq, diq, None)

    def key_sums(added, stored, k, v, index_k):
        """The Triton backward's `accumulators` (added, stored) -> dk, dv [B, S, K, Dh] and
        d(index_k) [B, S, Di] (or None) fp32."""
        sums = [(a + t)[: -geo.block_size] for a, t in zip(added, stored)]
        dk, dv = sums[0].reshape(k.shape), sums[1].reshape(v.shape)
        if not with_student:
            return dk, dv, None
        return dk, dv, sums[2].reshape(*index_k.shape[:2], geo.num_kv_heads, -1).sum(axis=2)

    def triton_fallback(k, v, index_k, segments, sums, window):
        """A window the Mosaic backward has no room for (more segments than `segment_bound`:
        rows of many short documents) through the Triton backward, its sums in the Mosaic
        backward's layout; under a KL sink, LSE_z and the KL from the Triton forward first."""
        kl = None
        if sinks:
            triton_geo = dataclasses.replace(
                forward_geo, chunk_queries=config.forward.chunk_queries(forward_geo.group)
            )
            _, kl, _, lse_z, _ = forward_window(triton_geo, k, v, index_k, segments, window[:5])
            window = (*window[:9], lse_z, *window[10:])
        start = tuple(backward_kernel.accumulators(fallback_geo, with_student) for _ in range(2))
        (added, stored), grads = triton_window(fallback_geo, k, v, index_k, segments, start, window)
        new = key_sums(added, stored, k, v, index_k)[: len(sums)]
        return mosaic_backward.with_key_gradients(backward_geo, sums, new), (*grads[:2], kl)

    def mosaic_backward_window(keys, index_keys, segment_ids, lists, sums, window):
        """The Mosaic backward of a window; sums: `mosaic_backward.running_sums`."""
        geo, tiling = backward_geo, config.mosaic_backward
        q, index_q, blocks, positions, offset, d_out, delta, d_kl, lse, lse_z, teacher = window
        valid = blocks >= 0
        # teacher None (behind the Triton forward, or too large to keep): the gradients kernel
        # takes it from its P
        operands = dict(q=q, d_out=d_out, lse=lse, delta=delta, lse_z=lse_z,
                        d_kl=d_kl, index_q=index_q, segment_ids=segment_ids, offset=offset,
                        teacher=teacher, valid=valid)  # fmt: skip
        dq_e, sums, diq_e, kl = mosaic_backward.window_gradients(
            geo, tiling, lists, operands, keys, index_keys, sums=sums, **kernels
        )
        shape = (geo.batch, geo.window, geo.num_heads, geo.head_dim)
        dq = selection_sums(dq_e, lists, valid).reshape(shape).astype(q.dtype)
        diq = None
        if with_student:
            diq = selection_sums(diq_e[0], lists, valid, diq_e[1]).astype(index_q.dtype)
        return sums, (dq, diq, kl)

    def backward(residuals, cotangents):
        (q, k, v, index_q, index_k, blocks, segment_ids, positions, starts, out, lse, lse_z,
         teacher) = residuals  # fmt: skip
        d_out, d_kl = cotangents
        windows = _Windows(geo, num_queries, starts)
        delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # [B, S, H]
        segments = segment_ids.reshape(-1).astype(jnp.int32)
        inputs = windows.queries(q, index_q if with_student else None, blocks, positions)
        grads_in = (windows.padded(d_out.astype(q.dtype)), windows.padded(delta),
                    windows.padded(d_kl.astype(jnp.float32)) if with_student else None)  # fmt: skip
        mosaic_backward_kernel = config.backward_kernel == "mosaic"
        if mosaic_backward_kernel:
            shifted = lambda x: mosaic_forward.shifted_keys(x, geo.block_size)  # noqa: E731
            keys = (shifted(k), shifted(v), shifted(segment_ids.astype(jnp.int32)))
            index_keys = shifted(index_k.astype(q.dtype)) if with_student else None
            start = mosaic_backward.running_sums(backward_geo, with_student)
            tiling = config.mosaic_backward
            bound = mosaic_backward.segment_bound(backward_geo, tiling)

            def window_step(sums, window):
                blocks, positions, offset = window[2:5]
                lists = lists_of(backward_geo, tiling, blocks, positions, offset)
                gradients = functools.partial(mosaic_backward_window, keys, index_keys,
                                              segment_ids, lists)  # fmt: skip
                fallback = functools.partial(triton_fallback, k, v, index_k, segments)
                if config.few_documents:  # no window overflows the Mosaic tables
                    return gradients(sums, window)
                overflow = lists.num_segments[0] > bound
                return jax.lax.cond(overflow, fallback, gradients, sums, window)

        else:
            start = tuple(backward_kernel.accumulators(backward_geo, with_student)
                          for _ in range(2))  # fmt: skip
            window_step = functools.partial(triton_window, backward_geo, k, v, index_k, segments)

        def step(carry, stacked):
            sums, joined = carry
            index, *saved = stacked  # the forward's per-window residuals
            window = (*windows.window(inputs, index), windows.rows(grads_in[0], index),
                      *windows.take(grads_in[1:], index), *saved)  # fmt: skip
            sums, grads = window_step(sums, window)
            return (sums, windows.put(joined, grads, index)), None

        joined = (windows.buffer(q.shape[2:], q.dtype),
                  windows.buffer(index_q.shape[2:], index_q.dtype) if with_student else None,
                  windows.buffer((geo.num_kv_heads,), jnp.float32) if sinks else None)
        stacked = (jnp.arange(windows.count), lse, lse_z, teacher)
        (sums, (dq, diq, kl)), _ = jax.lax.scan(step, (tuple(start), joined), stacked)
        if mosaic_backward_kernel:
            dk, dv, *dik = mosaic_backward.key_gradients(backward_geo, sums)
            dik = dik[0] if with_student else None
        else:
            dk, dv, dik = key_sums(*sums, k, v, index_k)
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
        d_sink = windows.unpadded(kl) if sinks else None  # the sink's cotangent: the KL
        if not with_student:
            return windows.unpadded(dq), dk, dv, None, None, None, None, None, None, None
        return (windows.unpadded(dq), dk, dv, windows.unpadded(diq), dik.astype(index_k.dtype),
                None, None, None, None, d_sink)

    @jax.custom_vjp
    def attention(q, k, v, index_q, index_k, blocks, segment_ids, positions, starts, kl_sink):
        return forward(q, k, v, index_q, index_k, blocks, segment_ids, positions, starts,
                       kl_sink)[0]  # fmt: skip

    attention.defvjp(forward, backward)
    return attention
