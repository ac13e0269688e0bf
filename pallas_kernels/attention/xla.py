"""Dense GQA attention over packed documents in plain XLA, with memory linear in S.

Queries are processed in tiles of `query_tile` under `lax.map`; each tile sees all keys, so a tile
holds [Tq, H, T] logits and never the [S, T] matrix. The tile body is rematerialised in the backward
pass (`jax.checkpoint`), so nothing tile-sized is stored across tiles. Optionally the same tiles
compute a distillation KL from the attention distribution (averaged over each GQA group) to a
student's softmax — the MSA indexer's dense warm-up objective (spec/msa.md §2).

Equivalent to `reference.gqa_attention(q, k, v, document_causal_mask(segment_ids))` (or, with
causal=False, to the same-segment mask: the ViT's). With `query_slots` the queries are the tokens
at those slots of the key row (reference.py), as a context-parallel device's chunks are.
Shapes: B batch, S queries, T keys (= S without query slots), H query heads, K kv heads, G = H // K, Dh head dim,
Hi student heads (= K), Di student dim, Tq query tile.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import at_query_slots

NEG_INF = jnp.finfo(jnp.float32).min


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    student: tuple[jax.Array, jax.Array] | None = None,
    query_tile: int = 64,
    causal: bool = True,
    query_slots: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention within documents; optionally the KL to a student over the same keys.

    Args:
      q: [B, S, H, Dh]; k, v: [B, T, K, Dh]; segment_ids: [B, T] (queries and keys share the row).
      student: (index_q [B, S, Hi, Di], index_k [B, T, Di]) with Hi = K, or None. The student's
        distribution for query i, head h is softmax_j(index_q[i, h] · index_k[j] · Di^-½) over the
        keys query i sees; the teacher is the attention distribution averaged over group h's heads
        (stop_gradient). Gradients of the KL reach only the student's inputs.
      query_tile: queries per tile; S is padded up to a multiple of it.
      causal: False attends to every key of the same segment (the ViT's segments: one image or
        video chunk each).
      query_slots: [S] int32, the slot of each query in the key row; None: S = T, slots 0..S-1.
    Returns:
      out [B, S, H, Dh] and KL(teacher ‖ student) [B, S, Hi] fp32 (None without a student).
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    tile = min(query_tile, seq)
    q_tiles = grouped_query_tiles(q, num_kv_heads, tile)
    # padded queries match no key
    segment_tiles = query_tiles(at_query_slots(segment_ids, query_slots), tile, fill=-1)
    student_tiles = None if student is None else query_tiles(student[0], tile)

    def attend_tile(args):
        slots, q_tile, segment_tile, student_q = args
        q_tile, slots, segment_tile = tie_to_queries(q_tile, slots, segment_tile)
        visible = visible_keys(slots, segment_tile, segment_ids, causal=causal)  # [B, Tq, T]
        logits = jnp.einsum("bqkgd,btkd->bqkgt", q_tile, k, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[:, :, None, None], logits * head_dim**-0.5, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bqkgt,btkd->bqkgd", probs.astype(v.dtype), v)
        if student is None:
            return out, None
        student_logits = (
            jnp.einsum("bqhd,btd->bqht", student_q, student[1], preferred_element_type=jnp.float32)
            * student_q.shape[-1] ** -0.5
        )
        return out, distillation_kl(probs.mean(axis=3), student_logits, visible[:, :, None])

    out, kl = jax.lax.map(
        jax.checkpoint(attend_tile, prevent_cse=False),
        (slot_tiles(query_slots, seq, tile), q_tiles, segment_tiles, student_tiles),
    )
    out = untile(out, seq).reshape(batch, seq, num_heads, head_dim)
    return out, None if kl is None else untile(kl, seq)


def distillation_kl(teacher: jax.Array, student_logits: jax.Array, visible: jax.Array) -> jax.Array:
    """KL(teacher ‖ softmax(student_logits)) over the last axis, restricted to visible entries.

    teacher: [..., N] probabilities, treated as a constant (stop_gradient); student_logits:
    [..., N], already scaled; visible: bool, broadcastable. A row with nothing visible gives 0.
    """
    teacher = jax.lax.stop_gradient(teacher)
    log_student = jax.nn.log_softmax(jnp.where(visible, student_logits, NEG_INF), axis=-1)
    terms = jax.scipy.special.xlogy(teacher, teacher) - teacher * log_student
    return jnp.where(visible, terms, 0.0).sum(axis=-1)


def tie_to_queries(q_tile: jax.Array, *tile_inputs: jax.Array) -> tuple[jax.Array, ...]:
    """(q_tile, *tile_inputs), unchanged, through one optimization barrier.

    A tile's key masks depend on its slots, segment ids and positions alone. Inside a layer scan
    that is differentiated, JAX's partial evaluation takes such values for loop-invariant
    residuals and hoists them out of the scan, which stacks them for every tile at once: [S, T]
    bools, memory quadratic in S (small-gpu's XLA-path step at 128K: 121.7 GB of temporaries with
    them, 40.6 GB without). Tied to the tile's queries, they are computed per tile."""
    return jax.lax.optimization_barrier((q_tile, *tile_inputs))


def visible_keys(
    slots: jax.Array, segment_tile: jax.Array, segment_ids: jax.Array, *, causal: bool = True
) -> jax.Array:
    """[B, Tq, T] bool: key j is visible to the query in slot `slots[q]` iff both are in the same
    document and (when causal) j <= slot. slots: [Tq]; segment_tile: [B, Tq]; segment_ids: [B, T]."""
    same = segment_ids[:, None, :] == segment_tile[:, :, None]
    if not causal:
        return same
    return same & (jnp.arange(segment_ids.shape[1])[None, None, :] <= slots[None, :, None])


def grouped_query_tiles(q: jax.Array, num_kv_heads: int, tile: int) -> jax.Array:
    """q [B, S, H, Dh] -> [num_tiles, B, tile, K, G, Dh]: the G query heads of each kv head together."""
    batch, seq, num_heads, head_dim = q.shape
    grouped = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return query_tiles(grouped, tile)


def query_tiles(x: jax.Array, tile: int, fill=0) -> jax.Array:
    """[B, S, ...] -> [num_tiles, B, tile, ...], padding S with `fill`."""
    seq = x.shape[1]
    pad = -seq % tile
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    x = x.reshape(x.shape[0], -1, tile, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def slot_tiles(query_slots: jax.Array | None, seq: int, tile: int) -> jax.Array:
    """[num_tiles, tile] int32: the key-row slot of each query of each tile (padding past the
    last query: 0 with query_slots, the next slots without; padded queries see no key anyway)."""
    if query_slots is None:
        num_tiles = -(-seq // tile)
        return jnp.arange(num_tiles * tile).reshape(num_tiles, tile)
    return query_tiles(query_slots.reshape(1, -1), tile)[:, 0]


def untile(x: jax.Array, seq: int) -> jax.Array:
    """[num_tiles, B, tile, ...] -> [B, S, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :seq]
