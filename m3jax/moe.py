"""M3's mixture-of-experts block: sigmoid router with correction bias, top-k, one shared expert.

spec/m3_architecture.md §3.6: s = sigmoid(router logits) in fp32; experts are *chosen* by s + bias
but *weighted* by s renormalised over the chosen k; routed sum × routed_scaling + shared expert.
The bias is a Buffer: the trainer moves it toward balanced load (aux-loss-free balancing), never the
optimizer. How the chosen experts compute is `model.moe.dispatch` (m3jax/moe_dispatch.py: dropless
grouped matmul, capacity buffers, or the dense reference). Given a mesh, dropless and capacity run
inside `shard_map` with the experts sharded over its `expert` axis (m3jax/expert_parallel.py); the
dense reference stays one global computation that XLA partitions. Routing and the statistics stay
outside, in the global view, so the expert loads the trainer sees are global.

Shapes: N tokens, D model width, E experts, F expert width, k experts per token.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from m3jax import expert_parallel, params
from m3jax.config import ModelConfig
from m3jax.mlp import MLP, swiglu_mlp, swigluoai
from m3jax.moe_dispatch import (
    ExpertWeights,
    dense_experts,
    grouped_matmul_impl,
    local_ffn,
    sorted_experts,
)


def route(
    router_logits: jax.Array, bias: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[N, E] fp32 logits -> (chosen expert ids [N, k], weights [N, k] summing to 1, scores [N, E])."""
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    _, chosen = jax.lax.top_k(scores + bias, k)  # the bias only decides *which* experts
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    return chosen, weights / weights.sum(-1, keepdims=True), scores


def balanced_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """One aux-loss-free balancing step: each expert's bias moves toward the mean load by rate times
    its relative load error, at most ±rate: rate · clip((mean - load_e) / mean, -1, 1).

    bias, load: [..., E] (leading axes = stacked layers); load counts tokens routed per expert.
    An idle expert rises by rate, one with twice the mean load or more falls by rate, and the move
    shrinks to 0 as an expert's load reaches the mean. DeepSeek-V3's rule, rate · sign(mean - load),
    moves every expert by the full ±rate on every step, balanced or not, so its rate trades speed
    for jitter: at the 1e-3 it used, a 32-expert router that starts skewed stays collapsed for
    hundreds of steps (small-gpu: 6-7 times the mean load through step 200), and from 3e-2 up the
    jitter itself unbalances the load. The clipped rule moves as fast as its rate far from balance
    and little near it (README, "Expert balance": the measured curves).
    """
    mean = load.mean(axis=-1, keepdims=True)
    error = (mean - load) / jnp.maximum(mean, 1e-9)  # 0 when no token was routed at all
    return bias + rate * jnp.clip(error, -1.0, 1.0)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        """mesh: where the routed experts run (sharded over its `expert` axis); None = one device."""
        moe, dim, std = config.moe, config.hidden_size, config.init_std
        experts = moe.num_experts
        self.router = params.normal(rngs, (dim, experts), ("embed", None), std)
        self.correction_bias = params.zeros_buffer((experts,), (None,))
        axes = expert_parallel.EXPERT_WEIGHT_AXES
        self.gate_proj = params.normal(rngs, (experts, dim, moe.expert_dim), axes.gate, std)
        self.up_proj = params.normal(rngs, (experts, dim, moe.expert_dim), axes.up, std)
        self.down_proj = params.normal(rngs, (experts, moe.expert_dim, dim), axes.down, std)
        self.shared_expert = MLP(
            dim,
            moe.shared_expert_dim,
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
            std=std,
            rngs=rngs,
        )
        self.k, self.routed_scaling = moe.experts_per_token, moe.routed_scaling
        self.dispatch, self.capacity_factor = moe.dispatch, moe.capacity_factor
        self.grouped_matmul = moe.grouped_matmul
        self.exchange, self.exchange_factor = moe.exchange, moe.exchange_factor
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.mesh = mesh

    def __call__(self, x: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, dict]:
        """x: [B, S, D]; token_mask: [B, S] (False for padding, excluded from load statistics).

        Returns the output [B, S, D] and statistics: load and score_share [E] fp32 per expert,
        experts [B, S, k] int32: the experts each token was routed to (in no particular order),
        dropped_fraction, the share of (token, expert) pairs that capacity limits dropped (padding
        included; 0 unless dispatch is "capacity"), and exchange_worst_case, 1.0 when the padded
        expert-parallel exchange needed its worst-case blocks in this call (else 0).
        """
        shape, dtype = x.shape, x.dtype
        tokens = x.reshape(-1, shape[-1])  # [N, D]
        logits = tokens.astype(jnp.float32) @ self.router[...]  # router in fp32 on every path
        chosen, weights, scores = route(logits, self.correction_bias[...], self.k)
        experts = ExpertWeights(
            *(w[...].astype(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        )
        activation = functools.partial(swigluoai, alpha=self.alpha, limit=self.limit)
        num_experts, dropped = scores.shape[-1], jnp.zeros((), jnp.int32)
        worst_case, shared = jnp.zeros((), jnp.float32), None
        impl = grouped_matmul_impl(self.grouped_matmul, dtype, *experts.gate.shape[1:])
        if self.dispatch == "dense":
            routed = dense_experts(tokens, chosen, weights, experts, activation)
        elif self.mesh is None:
            routed, dropped = sorted_experts(
                tokens,
                chosen,
                weights,
                num_experts,
                local_ffn(experts, activation, impl),
                dispatch=self.dispatch,
                capacity_factor=self.capacity_factor,
            )
        else:
            routed, dropped, worst_case, shared = expert_parallel.routed_experts(
                self.mesh,
                x,
                chosen.reshape(*shape[:-1], self.k),
                weights.reshape(*shape[:-1], self.k),
                experts,
                activation,
                dispatch=self.dispatch,
                capacity_factor=self.capacity_factor,
                grouped_matmul=impl,
                exchange=self.exchange,
                exchange_factor=self.exchange_factor,
                beside=self._shared_expert_in_exchange(dtype),
            )
        if shared is None:
            shared = self.shared_expert(tokens)
        out = self.routed_scaling * routed.reshape(tokens.shape) + shared.reshape(tokens.shape)

        mask = token_mask.reshape(-1, 1).astype(jnp.float32)
        load = jnp.zeros((num_experts,), jnp.float32).at[chosen].add(mask)
        stats = {
            "load": load,  # tokens routed to each expert
            "score_share": (scores / scores.sum(-1, keepdims=True) * mask).sum(0),
            "experts": chosen.reshape(*shape[:-1], self.k),
            "dropped_fraction": dropped.astype(jnp.float32) / chosen.size,
            "exchange_worst_case": worst_case,
        }
        return out.reshape(shape), stats

    def _shared_expert_in_exchange(self, dtype) -> expert_parallel.Beside | None:
        """The shared expert as work inside the expert-parallel map, where XLA can run it beside
        the all-to-alls; None (outside, as GSPMD shards it) without an exchange (mesh.expert 1)
        or where the mesh splits its width (`tensor`), which the map would undo."""
        if self.mesh.shape["expert"] == 1 or self.mesh.shape["tensor"] > 1:
            return None
        fn = functools.partial(swiglu_mlp, alpha=self.alpha, limit=self.limit)
        return expert_parallel.Beside(fn, self.shared_expert.weights(dtype))
