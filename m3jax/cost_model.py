"""Forward FLOPs per token from a config: the cost model of spec/msa.md §3, for planning and MFU.

Attention per token of a sequence of N tokens, averaged over its positions i = 1..N (a query at
position i sees i keys):
- full attention: 4·H·Dh per visible key (scores and values), i keys -> ≈ 2·H·Dh·N;
- MSA: the main branch over min(i, topk_blocks·block_size) keys, 4·H·Dh each, plus the indexer's
  scores against all i keys, 2·Hi·Di each -> ≈ 4·H·Dh·k·B + Hi·Di·N once N ≫ k·B.
Matmuls: 2 FLOPs per weight a text token passes through (the embedding lookup and the vision tower
excluded; of the routed experts, those with an "expert" axis, only the k chosen of E).

Shapes: H query heads, Dh head dim, Hi index heads, Di index head dim, N context, k·B keys kept.
"""

import jax

from m3jax.config import ModelConfig
from m3jax.model import functional

TEXT_ONLY = ("vision", "projector")  # parameter subtrees a text token never uses


def attention_flops_per_token(config: ModelConfig, context: int) -> float:
    """Forward FLOPs of every layer's attention products (not its projections) per token."""
    return sum(layer_attention_flops(config, kind, context) for kind in config.layer_types)


def layer_attention_flops(config: ModelConfig, attention_type: str, context: int) -> float:
    """One layer of `attention_type` ("full_attention" | "minimax_m3_sparse"), per token."""
    per_key = 4 * config.num_heads * config.head_dim
    mean_keys = (context + 1) / 2  # mean of i over positions 1..N
    if attention_type == "full_attention":
        return per_key * mean_keys
    msa = config.msa
    kept = min(msa.topk_blocks * msa.block_size, context)
    # mean of min(i, kept): i up to `kept`, then `kept` for the remaining positions
    mean_kept = (kept * (kept + 1) / 2 + kept * (context - kept)) / context
    return per_key * mean_kept + 2 * msa.index_heads * msa.index_head_dim * mean_keys


def matmul_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs of the weight matmuls one text token passes through (2 per weight used)."""
    model = functional(config)
    shapes, _ = model.shapes()
    axes = jax.tree.leaves(model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    routed_share = config.moe.experts_per_token / config.moe.num_experts
    used = 0.0
    for (path, leaf), leaf_axes in zip(
        jax.tree_util.tree_flatten_with_path(shapes)[0], axes, strict=True
    ):
        if path[0].key in (*TEXT_ONLY, "embed"):
            continue
        used += leaf.size * (routed_share if "expert" in leaf_axes else 1.0)
    return 2 * used


def forward_flops_per_token(config: ModelConfig, context: int) -> float:
    """Matmuls plus attention: the forward FLOPs per text token at this context length."""
    return matmul_flops_per_token(config) + attention_flops_per_token(config, context)

