"""The KV cache of generation: per layer the keys and values, and on MSA layers the index keys.

A decode step of an MSA layer scores the new query against every cached index key (the indexer's
one shared key head: O(S · Di) per index head), keeps its top-k blocks and attends over those
blocks' cached keys only (O(topk_blocks · block_size)); m3jax/decode_attention.py. Caching the index
keys is what makes that possible without recomputing the index branch over the whole history.

Layout: rows are right-padded, so a token's slot in the cache is its position in its document
(slot = position, as in the prefill), block n of a row is slots [n·block_size, (n+1)·block_size)
and every row writes its next token at its own slot `lengths[b]`. Shapes are static: T (the
cache length) is fixed when the cache is made, a multiple of the MSA block size.

Shapes: L layers of one stack, B batch, S prompt slots, T cache slots, K kv heads, Dh head dim,
Di index head dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LayerCache(NamedTuple):
    """One layer stack's cache (leading L), or one layer's entries for S tokens (no L)."""

    keys: jax.Array  # [L, B, T, K, Dh] after norm and RoPE
    values: jax.Array  # [L, B, T, K, Dh]
    index_keys: jax.Array | None  # [L, B, T, Di] on MSA stacks, else None


class KVCache(NamedTuple):
    stacks: tuple[LayerCache, ...]  # one per layer stack of the model (m3jax/model.layer_runs)
    lengths: jax.Array  # [B] int32: tokens cached per row = the position of the row's next token


def from_prefill(entries: list[LayerCache], lengths: jax.Array, length: int) -> KVCache:
    """The cache after a prefill: each stack's [L, B, S, ...] entries padded to T = `length` slots.

    Slots from a row's length on hold padding's entries (or zeros); they are never attended to
    before a decode step has overwritten them.
    """
    slots = entries[0].keys.shape[2]
    if length < slots:
        raise ValueError(f"cache length {length} is shorter than the {slots} prompt slots")

    def pad(x):
        if x is None:
            return None
        return jnp.pad(x, [(0, 0), (0, 0), (0, length - slots)] + [(0, 0)] * (x.ndim - 3))

    stacks = tuple(LayerCache(*(pad(x) for x in stack)) for stack in entries)
    return KVCache(stacks, lengths.astype(jnp.int32))


def write_token(
    cache: LayerCache, layer: jax.Array, slots: jax.Array, new: LayerCache
) -> LayerCache:
    """Writes one token per row ([B, 1, ...] entries) into layer `layer` of a stack at slots [B]."""
    rows = jnp.arange(slots.shape[0])

    def put(buffer, entry):
        if buffer is None:
            return None
        return buffer.at[layer, rows, slots].set(entry[:, 0].astype(buffer.dtype))

    return LayerCache(*(put(b, e) for b, e in zip(cache, new, strict=True)))
