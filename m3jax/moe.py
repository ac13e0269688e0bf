"""M3's mixture-of-experts block: sigmoid router with correction bias, top-k, one shared expert.

spec/m3_architecture.md §3.6: s = sigmoid(router logits) in fp32; experts are *chosen* by s + bias
but *weighted* by s renormalised over the chosen k; routed sum × routed_scaling + shared expert.
The bias is a Buffer: the trainer moves it toward balanced load (aux-loss-free balancing), never the
optimizer. Dispatch here is dense (every expert sees every token, weights zero where unchosen): exact
and simple, the reference the grouped-matmul path is tested against.

Shapes: N tokens, D model width, E experts, F expert width, k experts per token.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import params
from m3jax.config import ModelConfig
from m3jax.mlp import MLP, swigluoai


def route(
    router_logits: jax.Array, bias: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[N, E] fp32 logits -> (chosen expert ids [N, k], weights [N, k] summing to 1, scores [N, E])."""
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    _, chosen = jax.lax.top_k(scores + bias, k)  # the bias only decides *which* experts
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    return chosen, weights / weights.sum(-1, keepdims=True), scores


def balanced_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """Moves each expert's bias by ±rate toward the mean load (DeepSeek-V3's aux-loss-free rule).

    bias, load: [..., E] (leading axes = stacked layers); load counts tokens routed per expert.
    """
    mean = load.mean(axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        moe, dim, std = config.moe, config.hidden_size, config.init_std
        experts = moe.num_experts
        self.router = params.normal(rngs, (dim, experts), ("embed", None), std)
        self.correction_bias = params.zeros_buffer((experts,), (None,))
        self.gate_proj = params.normal(
            rngs, (experts, dim, moe.expert_dim), ("expert", "embed", "mlp"), std
        )
        self.up_proj = params.normal(
            rngs, (experts, dim, moe.expert_dim), ("expert", "embed", "mlp"), std
        )
        self.down_proj = params.normal(
            rngs, (experts, moe.expert_dim, dim), ("expert", "mlp", "embed"), std
        )
        self.shared_expert = MLP(
            dim,
            moe.shared_expert_dim,
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
            std=std,
            rngs=rngs,
        )
        self.k, self.routed_scaling = moe.experts_per_token, moe.routed_scaling
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def __call__(self, x: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, dict]:
        """x: [B, S, D]; token_mask: [B, S] (False for padding, excluded from load statistics).

        Returns the output [B, S, D] and statistics: load and score_share [E] fp32 per expert,
        experts [B, S, k] int32: the experts each token was routed to (in no particular order).
        """
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1])  # [N, D]
        logits = x.astype(jnp.float32) @ self.router[...]  # router in fp32 on every path
        chosen, weights, scores = route(logits, self.correction_bias[...], self.k)
        num_experts = scores.shape[-1]
        combine = jnp.zeros((x.shape[0], num_experts), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], chosen].set(weights)  # [N, E]

        gate = jnp.einsum("nd,edf->enf", x, self.gate_proj[...].astype(dtype))
        up = jnp.einsum("nd,edf->enf", x, self.up_proj[...].astype(dtype))
        expert_out = jnp.einsum(
            "enf,efd->end",
            swigluoai(gate, up, self.alpha, self.limit),
            self.down_proj[...].astype(dtype),
        )
        routed = jnp.einsum("end,ne->nd", expert_out, combine.astype(dtype))
        out = self.routed_scaling * routed + self.shared_expert(x)

        mask = token_mask.reshape(-1, 1).astype(jnp.float32)
        stats = {
            "load": ((combine > 0) * mask).sum(0),  # tokens routed to each expert
            "score_share": (scores / scores.sum(-1, keepdims=True) * mask).sum(0),
            "experts": chosen.reshape(*shape[:-1], self.k),
        }
        return out.reshape(shape), stats
