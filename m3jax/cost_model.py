"""Forward FLOPs from a config: the cost model of spec/msa.md §3, for planning and MFU.

Attention of one n-token document, causal (a query at position i = 1..n sees i keys):
- full attention: 4·H·Dh per visible key (scores and values), Σ_i i = n(n+1)/2 keys;
- MSA: the main branch over min(i, topk_blocks·block_size) keys, 4·H·Dh each, plus the indexer's
  scores against all i keys, 2·Hi·Di each; per token ≈ 4·H·Dh·k·B + Hi·Di·n once n ≫ k·B. During
  the dense warm-up (ForwardMode.msa_dense) the main branch sees all i keys, the indexer runs too.
  The cap min(i, k·B) ignores block alignment: a query whose document starts mid-block may have
  fewer visible keys in its k blocks.
- the ViT: bidirectional within one image or video chunk of m patches, 4·Hv·Dhv·m² per layer.
Per-token figures (`layer_attention_flops`) are those of one document filling the context.
Only useful products count: padding, masked-out scores, top-k, softmax and norms do not.
Matmuls: 2 FLOPs per parameter an input passes through (norm scales and biases included, as the
usual 6·N count does: < 0.1% here). A text token: every decoder weight, the final norm and
lm_head, not the embedding lookup, of the routed experts (arrays with an "expert" axis) only the k
chosen of E; one MTP module adds its own weights and the shared lm_head. A ViT patch: the tower and
the projector's per-patch MLP; one merged m×m window: the projector's merge MLP.

Shapes: H query heads, Dh head dim, Hi index heads, Di index head dim, `length` a document's tokens,
topk_blocks·block_size keys kept; Hv, Dhv the ViT's heads and head dim; B batch rows, S sequence,
P patch budget.
"""

import dataclasses

import jax
import numpy as np

from m3jax.config import ModelConfig
from m3jax.model import Functional, functional

TEXT_ONLY = ("vision", "projector")  # parameter subtrees a text token never uses
PER_WINDOW = ("merge_1", "merge_2")  # projector layers applied once per merged window


@dataclasses.dataclass(frozen=True)
class ActiveWeights:
    """Parameters one input passes through (of the routed experts, k of E)."""

    text_token: float  # decoder layers, final norm, lm_head (not the embedding, not MTP)
    mtp_token: float  # one MTP module's weights plus the lm_head it shares
    patch: float  # the ViT tower and the projector's per-patch linear_1/linear_2
    window: float  # the projector's merge_1/merge_2, once per m×m patch window


def active_weights(model: Functional) -> ActiveWeights:
    """Counts from parameter shapes (nothing allocated)."""
    config = model.config
    shapes, _ = model.shapes()
    axes = jax.tree.leaves(model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    routed_share = config.moe.experts_per_token / config.moe.num_experts
    counts = dict.fromkeys(("text_token", "mtp_token", "patch", "window"), 0.0)
    for (path, leaf), leaf_axes in zip(
        jax.tree_util.tree_flatten_with_path(shapes)[0], axes, strict=True
    ):
        keys = [getattr(part, "key", None) for part in path]
        size = leaf.size * (routed_share if "expert" in leaf_axes else 1.0)
        if keys[0] == "embed":
            continue
        if keys[0] == "mtp":
            counts["mtp_token"] += size / config.mtp.num_modules
        elif keys[0] in TEXT_ONLY:
            counts["window" if keys[1] in PER_WINDOW else "patch"] += size
        else:
            counts["text_token"] += size
            if keys[0] == "lm_head" and config.mtp.num_modules:
                counts["mtp_token"] += size
    return ActiveWeights(**counts)


def causal_keys(lengths, cap: int | None = None) -> np.ndarray:
    """Σ over positions i = 1..n of min(i, cap): the keys all queries of an n-token document see
    (causal), for each n in `lengths`; float64, exact for n up to 2^26."""
    n = np.asarray(lengths, np.float64)
    kept = n if cap is None else np.minimum(n, cap)
    return kept * (kept + 1) / 2 + kept * (n - kept)


def document_attention_flops(
    config: ModelConfig, attention_type: str, lengths, *, msa_dense: bool = False
) -> float:
    """Forward FLOPs of one layer's attention products over documents of these lengths, causal
    within each. attention_type: "full" | "msa"; msa_dense: MSA's
    warm-up (its main branch dense)."""
    per_key = 4 * config.num_heads * config.head_dim
    every_key = causal_keys(lengths).sum()
    if attention_type == "full":
        return float(per_key * every_key)
    msa = config.msa
    kept = every_key if msa_dense else causal_keys(lengths, msa.topk_blocks * msa.block_size).sum()
    return float(per_key * kept + 2 * msa.index_heads * msa.index_head_dim * every_key)


def layer_attention_flops(config: ModelConfig, attention_type: str, context: int) -> float:
    """One layer of `attention_type`, per token of a `context`-token document."""
    return document_attention_flops(config, attention_type, [context]) / context


def attention_flops_per_token(config: ModelConfig, context: int) -> float:
    """Forward FLOPs of every layer's attention products (not its projections) per token."""
    return sum(layer_attention_flops(config, kind, context) for kind in config.layer_types)


def matmul_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of the weight matmuls one text token passes through in the trunk (no MTP)."""
    return 2 * active_weights(functional(config)).text_token


def forward_flops_per_token(config: ModelConfig, context: int) -> float:
    """Matmuls plus attention, MTP modules included: forward FLOPs per text token at a context."""
    mtp_layer = layer_attention_flops(config, config.layer_types[-1], context)
    mtp = config.mtp.num_modules * (2 * active_weights(functional(config)).mtp_token + mtp_layer)
    return matmul_flops_per_token(config) + attention_flops_per_token(config, context) + mtp


def piece_lengths(segment_ids) -> np.ndarray:
    """[B, S] segment ids (0 = padding; ids unique within a row) -> the length of every piece."""
    ids = np.atleast_2d(np.asarray(segment_ids))
    width = int(ids.max(initial=0)) + 1
    rows = np.arange(ids.shape[0])[:, None] * width
    counts = np.bincount((ids + rows).ravel(), minlength=width * ids.shape[0])
    counts = counts.reshape(ids.shape[0], width)[:, 1:]
    return counts[counts > 0]


def vision_flops(config: ModelConfig, weights: ActiveWeights, chunk_patches) -> float:
    """Forward FLOPs of the ViT and projector over image/video chunks of these patch counts."""
    vision = config.vision
    patches = np.asarray(chunk_patches, np.float64)
    attention = 4 * vision.num_heads * vision.head_dim * vision.num_layers * np.square(patches)
    windows = patches.sum() / vision.spatial_merge_size**2
    return float(2 * weights.patch * patches.sum() + 2 * weights.window * windows + attention.sum())


def packed_forward_flops(
    config: ModelConfig,
    weights: ActiveWeights,
    segment_ids,
    patch_segment_ids=None,
    *,
    msa_dense: bool = False,
) -> float:
    """Forward FLOPs of the model and its MTP modules on packed rows: segment_ids [B, S] (pieces
    of documents), patch_segment_ids [B, P] (image/video chunks; None or empty: no vision).

    MTP module d works on each piece minus its last d + 1 positions (m3jax/mtp.py)."""
    lengths = piece_lengths(segment_ids)
    flops = 2 * weights.text_token * lengths.sum()
    for kind in config.layer_types:
        flops += document_attention_flops(config, kind, lengths, msa_dense=msa_dense)
    for depth in range(config.mtp.num_modules):
        shorter = np.maximum(lengths - depth - 1, 0)
        flops += 2 * weights.mtp_token * shorter.sum()
        flops += document_attention_flops(
            config, config.layer_types[-1], shorter, msa_dense=msa_dense
        )
    if config.vision is not None and patch_segment_ids is not None:
        flops += vision_flops(config, weights, piece_lengths(patch_segment_ids))
    return float(flops)
