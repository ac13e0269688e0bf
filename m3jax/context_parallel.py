"""Context parallelism over the `seq` mesh axis: each device attends with its own load-balanced
chunks of the queries to the keys, values and MSA index keys of the whole row, all-gathered.

Layout (zig-zag, the load balancing of MSA's own training and MaxText's default): a row of S
tokens is cut into 2N chunks of c = S / 2N tokens (N = mesh.shape["seq"]); device i holds chunks
i and 2N - 1 - i. Under a causal mask chunk j's queries see about (j + ½)·c keys, so every
device's pair sees the same 2N·c: kernels that skip masked tiles do equal work on every device.

The permutation happens once per forward pass, at the model level (`run_balanced` around the
trunk's layer stacks and around each MTP module's layer), not inside attention. Everything between
attention layers is per token (norms, MLP, MoE routing and experts, residuals; RoPE reads each
token's own position, which moves with it), so it runs unchanged on permuted rows, while the loss,
the MTP shifts and the vision-feature scatter keep seeing natural order. Permuting inside every
attention layer instead would move each layer's queries (H·Dh per token) and outputs: at M3's
head layout (64 query heads, 4 kv heads) more bytes than the all-gather of K and V itself. The
exchange (`to_balanced`, `to_natural`) is two `ppermute`s of half of each device's tokens.

Attention (`attention`): a `jax.shard_map` over the whole mesh — rows over the batch axes, the
sequence over `seq`, heads over `tensor` where it divides the kv heads (m3jax/sharding.py RULES).
Inside, the key-side arrays (K, V, index keys, segment ids, positions) are all-gathered over `seq`
and put back in natural order (a local reshuffle of whole chunks); the local queries know their
slots in that row (`query_slots`), which the attention functions take
(pallas_kernels/msa/reference.py). MSA selection, sparse and dense attention, the indexer's KL and
block recall thus equal the one-device results query by query. Gradients are exact: the
transpose of the all-gather is a reduce-scatter of the key-side cotangents (psum_scatter), that of
a ppermute the inverse ppermute.

Memory per device: the activations of S/N tokens, plus one layer's gathered K, V and index keys
of the whole row ([B, S, K, Dh] twice and [B, S, Di]) while it attends.

Shapes: B batch, S sequence (T keys), N devices on `seq`, c = S / 2N tokens a chunk, H query
heads, K kv heads (= Hi index heads), Dh head dim, Di index head dim.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from m3jax import sharding

AXIS = "seq"


def num_parts(mesh: Mesh | None) -> int:
    """Devices the sequence is split over (1: no context parallelism)."""
    return 1 if mesh is None else mesh.shape[AXIS]


def chunk_owner(chunk: int, parts: int) -> tuple[int, int]:
    """(device, which of its two chunks) of chunk `chunk` of a row cut into 2·parts."""
    return (chunk, 0) if chunk < parts else (2 * parts - 1 - chunk, 1)


def balanced_chunks(parts: int) -> np.ndarray:
    """The row's chunks in device order: [0, 2N-1, 1, 2N-2, ...] (device i: i, 2N-1-i)."""
    return np.array([c for device in range(parts) for c in (device, 2 * parts - 1 - device)])


def run_balanced(
    fn: Callable, mesh: Mesh | None, x: jax.Array, inputs: Any, *rest, layer_axis: bool
) -> tuple[jax.Array, Any]:
    """fn(x, inputs, *rest) -> (y, stats), run on the zig-zag layout; returns y and stats in
    natural order.

    x: [B, S, D]; inputs: a pytree of [B, S, ...] per-token arrays (positions, segment ids, RoPE
    tables); y: [B, S, D]. Per-token statistics (leaves [B, S, ...], after a leading layer axis
    when `layer_axis`: selected blocks, chosen experts, hidden states, KV cache) go back to
    natural order too; the others (means, loads) do not depend on the order. One device on
    `seq`: fn itself.
    """
    if num_parts(mesh) == 1:
        return fn(x, inputs, *rest)
    tokens = x.shape[:2]
    x, inputs = to_balanced((x, inputs), mesh)
    y, stats = fn(x, inputs, *rest)
    axis = 2 if layer_axis else 1
    leaves, tree = jax.tree.flatten(stats)
    per_token = [i for i, a in enumerate(leaves) if a.shape[axis - 1 : axis + 1] == tokens]
    restored = to_natural([leaves[i] for i in per_token], mesh, axis=axis)
    for i, leaf in zip(per_token, restored, strict=True):
        leaves[i] = leaf
    return to_natural(y, mesh), jax.tree.unflatten(tree, leaves)


def to_balanced(tree: Any, mesh: Mesh) -> Any:
    """A pytree of [B, S, ...] arrays in natural order -> the zig-zag layout (same shapes)."""
    return _exchanged(tree, mesh, 1, to_balanced=True)


def to_natural(tree: Any, mesh: Mesh, axis: int = 1) -> Any:
    """The inverse of `to_balanced`, for leaves whose sequence is dim `axis` (2 after a layer
    axis: [L, B, S, ...])."""
    return _exchanged(tree, mesh, axis, to_balanced=False)


def attention(
    fn: Callable,
    mesh: Mesh,
    num_kv_heads: int,
    queries: tuple[jax.Array, ...],
    head_keys: tuple[jax.Array, ...],
    token_keys: tuple[jax.Array, ...],
) -> Any:
    """fn(*queries, *head_keys, *token_keys, query_slots) on each device's load-balanced queries
    against the whole row's keys -> fn's outputs, a pytree of [B, S, heads, ...] arrays (or None).

    All arrays are [B, S, ...] in the zig-zag layout (`run_balanced`). queries: kept local, heads
    at dim 2 (q, index_q); head_keys: all-gathered, heads at dim 2 (k, v); token_keys: all-gathered,
    no head dim (index_k, segment_ids, positions). fn sees the gathered ones in natural order,
    [B, T = S, ...], and its queries' slots in that row, query_slots [2, S / 2N] int32 (two runs
    of consecutive slots: the form the MSA GPU kernels take, pallas_kernels/msa/pallas.py).
    """
    parts = num_parts(mesh)
    tokens = _token_spec(mesh, queries[0].shape)
    # heads split over `tensor` only where the kv heads are (GQA groups stay on one device)
    head_axis = sharding.partition_spec(("kv_heads",), (num_kv_heads,), mesh)[0]
    heads = PartitionSpec(*tokens, head_axis)
    natural = np.argsort(balanced_chunks(parts))

    def on_device(queries, head_keys, token_keys):
        gathered = [
            _chunks_in(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), natural)
            for x in (*head_keys, *token_keys)
        ]
        return fn(*queries, *gathered, _query_slots(queries[0].shape[1], parts))

    # check_vma off: Pallas kernels' outputs carry no varying type (pallas_kernels/shard_map.py)
    mapped = jax.shard_map(on_device, mesh=mesh, in_specs=(heads, heads, tokens), out_specs=heads,
                           check_vma=False)  # fmt: skip
    return mapped(queries, head_keys, token_keys)


def _token_spec(mesh: Mesh, shape: tuple[int, ...], axis: int = 1) -> PartitionSpec:
    """Rows over the batch axes, the sequence (dim `axis`) over seq, the rest whole."""
    batch, seq = shape[axis - 1], shape[axis]
    if seq % (2 * num_parts(mesh)):
        raise ValueError(
            f"context parallelism: sequence length {seq} is not a multiple of 2 × mesh.seq = "
            f"{2 * num_parts(mesh)} (each device holds two chunks of the row)"
        )
    spec = sharding.partition_spec(("batch", "seq"), (batch, seq), mesh)
    return PartitionSpec(*(None,) * (axis - 1), *spec)


def _exchanged(tree, mesh: Mesh, axis: int, *, to_balanced: bool):
    """Every leaf of `tree` ([..., B, S, ...], S at `axis`) moved between the natural layout
    (device i: chunks 2i, 2i+1) and the zig-zag one (device i: chunks i, 2N-1-i)."""
    parts = num_parts(mesh)
    # natural device d sends its even chunk 2d and its odd chunk 2d+1 each through one ppermute
    sends = [[(d, chunk_owner(2 * d + odd, parts)[0]) for d in range(parts)] for odd in (0, 1)]

    def exchange(x):
        even_device = jax.lax.axis_index(AXIS) % 2 == 0
        first, second = jnp.split(x, 2, axis=axis)
        if to_balanced:  # an even device receives its chunk i from an even one, an odd from odd
            even, odd = (jax.lax.ppermute(h, AXIS, s) for h, s in zip((first, second), sends))
            first, second = jnp.where(even_device, even, odd), jnp.where(even_device, odd, even)
            return jnp.concatenate([first, second], axis=axis)
        even, odd = jnp.where(even_device, first, second), jnp.where(even_device, second, first)
        backs = [[(dst, src) for src, dst in s] for s in sends]
        returned = [jax.lax.ppermute(h, AXIS, b) for h, b in zip((even, odd), backs)]
        return jnp.concatenate(returned, axis=axis)

    specs = jax.tree.map(lambda x: _token_spec(mesh, x.shape, axis), tree)
    return jax.shard_map(
        lambda t: jax.tree.map(exchange, t), mesh=mesh, in_specs=(specs,), out_specs=specs
    )(tree)


def _chunks_in(x: jax.Array, order: np.ndarray) -> jax.Array:
    """x [B, S, ...] as len(order) chunks -> the same chunks in `order` (a local reshuffle)."""
    chunks = x.reshape(x.shape[0], len(order), -1, *x.shape[2:])
    return chunks[:, order].reshape(x.shape)


def _query_slots(local_tokens: int, parts: int) -> jax.Array:
    """[2, S / 2N] int32: the slots in the natural row of this device's tokens, chunk i then
    chunk 2N-1-i."""
    device = jax.lax.axis_index(AXIS)
    chunk = local_tokens // 2
    starts = jnp.stack([device, 2 * parts - 1 - device]) * chunk
    return (starts[:, None] + jnp.arange(chunk)).astype(jnp.int32)
