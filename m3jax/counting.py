"""Parameter counts: total, and active per token (only k of E routed experts touch a token)."""

import dataclasses

import jax

from m3jax.model import Functional


@dataclasses.dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # embeddings and lm_head included, as in MiniMax's and DeepSeek's figures


def count_params(model: Functional) -> ParamCount:
    """Counts from shapes only (nothing allocated); arrays with an "expert" axis count k/E active."""
    moe = model.config.moe
    shapes, _ = model.shapes()
    axes = jax.tree.leaves(model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    sizes = [x.size for x in jax.tree.leaves(shapes)]
    total = sum(sizes)
    routed = sum(size for size, a in zip(sizes, axes, strict=True) if "expert" in a)
    return ParamCount(total, total - routed + routed * moe.experts_per_token // moe.num_experts)
