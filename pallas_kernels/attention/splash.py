"""Dense attention over packed documents on TPUs: jax's splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) with segment ids.

Splash takes one row at a time in the [heads, S, Dh] layout, a static mask (causal, or full for
the ViT) and segment ids that it ands with the mask; tiles of the mask that are all zero are
skipped. GQA runs as its MQA form: the G query heads of a kv head against that head's keys,
vmapped over kv heads and rows. Rows are padded to whole blocks with a segment of their own.
Equals `xla.dense_attention` (the reference's document mask). On a machine without a TPU it runs
in Pallas' interpreter (`interpret=None` picks that). Speed: unmeasured (no TPU here).

Shapes: B batch, S sequence, H query heads, K kv heads, G = H // K, Dh head dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from pallas_kernels import target
from pallas_kernels.attention.reference import through_whole_rows

BLOCK = 128  # queries and keys per splash tile
PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # padding slots: a segment of their own


def unsupported_reason(q: jax.Array, k: jax.Array) -> str:
    """Why splash can't run these operands ('' when it can): lane-dense head dims."""
    if q.shape[-1] % BLOCK:
        return f"head_dim={q.shape[-1]} is not a multiple of {BLOCK}"
    if q.shape[2] % k.shape[2]:
        return f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads"
    return ""


@functools.cache
def _kernel(seq: int, group: int, causal: bool, interpret: bool):
    shape = (seq, seq)
    mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
    # The kernel holds its mask tables as arrays: made eagerly, or the first trace that builds
    # the (cached) kernel would leak them as tracers into every later one.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa_single_device(
            masks.MultiHeadMask([mask] * group), interpret=interpret
        )


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    causal: bool = True,
    query_slots: jax.Array | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention within each segment -> out [B, S, H, Dh] (q [B, S, H, Dh], k/v [B, T, K, Dh],
    segment_ids [B, T]); causal=False: bidirectional within each segment (the ViT).
    query_slots (reference.py; None: S = T): splash runs the whole row, these queries in their
    slots and zeros elsewhere (`through_whole_rows`)."""
    if query_slots is not None:
        attend = functools.partial(dense_attention, causal=causal, interpret=interpret)
        return through_whole_rows(attend, q, k, v, segment_ids, query_slots)
    if interpret is None:
        interpret = target.platform() != "tpu"
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    padded = -(-seq // BLOCK) * BLOCK
    pad = [(0, 0), (0, padded - seq), (0, 0), (0, 0)]
    segments = jnp.pad(jnp.asarray(segment_ids, jnp.int32), pad[:2], constant_values=PAD_SEGMENT)
    q = jnp.pad(q * jnp.asarray(head_dim**-0.5, q.dtype), pad)  # splash does not scale
    q = q.reshape(batch, padded, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, S, Dh]
    kernel = _kernel(padded, group, causal, interpret)

    def row(q, k, v, segments):  # [K, G, S, Dh], [K, S, Dh], [K, S, Dh], [S]
        ids = splash.SegmentIds(q=segments, kv=segments)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)

    out = jax.vmap(row)(q, k, v, segments)  # [B, K, G, S, Dh]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, num_heads, head_dim)
    return out[:, :seq]
