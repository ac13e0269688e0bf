"""Dense attention over packed documents on cuDNN's fused flash attention (Hopper and later).

cuDNN's packed layout takes, per row, the offsets and lengths of up to M segments and attends
within each segment only (causally, or bidirectionally for the ViT), skipping the tiles between
segments. Segments here are the row's runs of equal
segment id. Packed rows keep each document contiguous (data/packing.py) and the ViT each image or
video chunk, with padding one trailing run, so this equals `xla.dense_attention` (and the
reference's document mask) for every row whose ids each form one run. The work is that of the
documents alone: Σ n² (causal: Σ n(n+1)/2) over a row's documents of n tokens.

M, the most segments a row may have, is a static shape, and cuDNN's cost grows with it: its
backward keeps a float32 dQ accumulator per segment slot, [B·M, S, H, Dh] (17 GB at 32K tokens,
16 heads of 128 and M = 32), and at 4K tokens and six documents a row the backward takes 2.3 ms
at M = 16, 2.7 ms at 32, 3.5 ms at 64 (benchmarks/RESULTS.md). So M is `max_segments`, by default
S/1024 within [16, 32] (a 32K row of documents averaging 1,500 tokens holds ~22) and no more than
2^20 / S past 32K (`default_segments`: at 32 slots, a 256K row of small-gpu's 16 heads would hold 64
GiB of them), and a batch
with a row of more documents runs, under `lax.cond`, a fallback (`fallback`): up to
MASKED_ELEMENTS = B·S² (32K tokens a row), cuDNN over whole rows under the document mask as a
[B, 1, S, S] array (every causal pair's work: ~8× slower at 32K); past it, the XLA path's tiled
attention (linear memory). The mask is what bounds it: XLA allocates a cond's branches side by
side, so a masked branch costs its S² arrays even when no row takes it: at 256K tokens, [S, S]
bf16 arrays held 256 GiB of small-gpu's 289 GiB of temporaries (RESULTS.md).

jax exposes packed offsets only through its private cuDNN module (the public
`jax.nn.dot_product_attention` takes one length per row); jax is pinned in pyproject.toml.

Shapes: B batch, S sequence, H query heads, K kv heads, Dh head dim, M max segments per row.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from pallas_kernels import target
from pallas_kernels.attention import xla
from pallas_kernels.attention.reference import through_whole_rows

SEGMENT_SLOTS = (16, 32)  # the default packed layout's bounds (segment slots per row)
SLOT_TOKENS = 32 << 15  # the most segment slots × row tokens by default (32 slots at 32K)
MASKED_ELEMENTS = 1 << 30  # the largest B·S² whose fallback is cuDNN under an [S, S] mask


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    causal: bool = True,
    max_segments: int | None = None,
    query_slots: jax.Array | None = None,
    bounded: bool = False,
) -> jax.Array:
    """Attention within each segment -> out [B, S, H, Dh] (q [B, S, H, Dh], k/v [B, T, K, Dh],
    segment_ids [B, T]): the packed layout when every row has at most `max_segments` runs, else
    `fallback`'s. query_slots (reference.py; None: S = T): cuDNN runs the whole row, these
    queries in their slots and zeros elsewhere (`through_whole_rows`). bounded: the caller
    checked that every row has at most `max_segments` runs; the fallback and its `lax.cond` are
    left out (a row of more would lose its runs past the slots)."""
    seq = k.shape[1]
    max_segments = min(max_segments or default_segments(seq), seq)
    packed = functools.partial(packed_attention, max_segments=max_segments, causal=causal)
    packed = functools.partial(through_whole_rows, packed, query_slots=query_slots)
    if max_segments == seq or bounded:  # every row fits
        return packed(q, k, v, segment_ids)
    too_many = segment_runs(segment_ids, 1)[2].max() > max_segments
    # rematerialised: under AD both branches return the same residuals, so the packed branch
    # would write zeros for the fallback's [B, 1, S, S] mask in every step (2 GB, ~1 ms at 32K)
    rows = functools.partial(fallback(q.shape[0], seq), causal=causal, query_slots=query_slots)
    return jax.lax.cond(too_many, jax.checkpoint(rows), packed, q, k, v, segment_ids)


def fallback(batch: int, seq: int) -> Callable[..., jax.Array]:
    """What runs rows of more than `max_segments` documents: cuDNN under the document mask while
    the mask is small, else the XLA path's tiled attention (module docstring)."""
    return masked_attention if batch * seq * seq <= MASKED_ELEMENTS else tiled_attention


def tiled_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
    query_slots: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """The XLA path's query-tiled attention: every tile against the whole row, linear memory."""
    return xla.dense_attention(q, k, v, segment_ids, causal=causal, query_slots=query_slots)[0]


def default_segments(seq: int) -> int:
    """Segment slots for rows of `seq` tokens: S/1024 within SEGMENT_SLOTS (16 at 4K, 32 at
    32K): at 4K, 16 slots take 2.2 ms fwd+bwd against 2.8 ms for 32, and half the memory. Past
    32K, at most SLOT_TOKENS / S (16 at 64K, 1 at 1M), so that the backward's dQ accumulators,
    M·S rows, stay as large as at 32K: long rows hold few documents, and rows of more take the
    fallback."""
    low, high = SEGMENT_SLOTS
    return max(1, min(high, max(low, seq // 1024), SLOT_TOKENS // seq))


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
    query_slots: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """cuDNN over whole rows under the [B, 1, S, S] same-segment (and causal) mask."""
    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    attend = functools.partial(jax.nn.dot_product_attention, mask=mask, is_causal=causal,
                               implementation="cudnn")  # fmt: skip
    return through_whole_rows(lambda q, k, v, _: attend(q, k, v), q, k, v, segment_ids,
                              query_slots)  # fmt: skip


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    max_segments: int,
    causal: bool,
) -> jax.Array:
    """cuDNN over the first `max_segments` runs of each row (rows must have no more)."""
    offsets, lengths, _ = segment_runs(segment_ids, max_segments)
    mask = cudnn_attention.MaskType.PADDING_CAUSAL if causal else cudnn_attention.MaskType.PADDING
    return cudnn_attention.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5, mask_type=mask, qkv_layout="BTNH",
    )  # fmt: skip


def segment_runs(
    segment_ids: jax.Array, max_segments: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed layout of each row's runs of equal id: (offsets [B, M+1], lengths [B, M],
    both int32 and -1 past the row's runs; runs [B], how many runs each row has, which may exceed
    M: then offsets and lengths describe only its first M)."""
    seq = segment_ids.shape[1]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )

    def row_layout(row_starts):
        first = jnp.nonzero(row_starts, size=max_segments + 1, fill_value=seq)[0].astype(jnp.int32)
        lengths = first[1:] - first[:-1]
        valid = first[:-1] < seq
        return jnp.where(jnp.append(valid, False), first, -1), jnp.where(valid, lengths, -1)

    offsets, lengths = jax.vmap(row_layout)(starts)
    return offsets, lengths, starts.sum(1)


def unsupported_reason(q: jax.Array, k: jax.Array) -> str | None:
    """Why cuDNN's packed flash attention cannot run these operands here, or None."""
    if target.platform() != "gpu":
        return f"needs a GPU (backend is {target.platform()})"
    capability = getattr(target.devices()[0], "compute_capability", "0")
    if float(capability) < 9.0:
        return f"the packed layout needs compute capability >= 9.0 (found {capability})"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"needs bfloat16 or float16 operands (found {q.dtype}, {k.dtype})"
    head_dim = q.shape[-1]
    if head_dim > 256 or head_dim % 8:
        return f"head_dim={head_dim} must be <= 256 and a multiple of 8"
    if q.shape[2] % k.shape[2]:
        return f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads"
    return None
