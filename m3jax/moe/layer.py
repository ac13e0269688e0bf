"""M3's mixture-of-experts layer: the router (router.py), the routed experts, one shared expert.

spec/m3_architecture.md §3.6: routed sum × routed_scaling + shared expert. How the chosen experts
compute is `model.moe.dispatch` (local.py: dropless grouped matmul, capacity buffers, or the dense
reference). Given a mesh, dropless and capacity run inside `shard_map` with the experts sharded over
its `expert` axis (expert_parallel.py, with one file per exchange); the dense reference stays one
global computation that XLA partitions. Routing and the statistics stay outside, in the global
view, so the expert loads the trainer sees are global.

Shapes: B batch, S sequence, N = B·S tokens, D model width, E experts, F expert width, k experts
per token.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from m3jax import params, sharding
from m3jax.config import ModelConfig
from m3jax.mlp import MLP, swiglu_mlp, swigluoai
from m3jax.moe import expert_parallel
from m3jax.moe.local import (
    EXPERT_WEIGHT_AXES,
    ExpertWeights,
    dense_experts,
    grouped_matmul_impl,
    local_ffn,
    sorted_experts,
)
from m3jax.moe.router import route


class MoEStats(NamedTuple):
    """An MoE layer's routing statistics, the same whatever the dispatch and exchange (stacked
    layers: a leading layer axis on each)."""

    load: jax.Array  # [E] fp32 tokens routed to each expert (padding excluded)
    score_share: jax.Array  # [E] fp32 Σ over tokens of each expert's normalised router score
    experts: jax.Array  # [B, S, k] int32 the experts each token was routed to (no order)
    # share of (token, expert) pairs that capacity limits dropped (padding included); 0 but for
    # capacity dispatch
    dropped_fraction: jax.Array
    exchange_worst_case: jax.Array  # 1.0 when the padded exchange needed worst-case blocks


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        """mesh: where the routed experts run (sharded over its `expert` axis); None = one device."""
        moe, dim, std = config.moe, config.hidden_size, config.init_std
        experts = moe.num_experts
        self.router = params.normal(rngs, (dim, experts), ("embed", None), std)
        self.correction_bias = params.zeros_buffer((experts,), (None,))
        axes = EXPERT_WEIGHT_AXES
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
        self.config = moe
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.mesh = mesh

    def __call__(self, x: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, MoEStats]:
        """x: [B, S, D]; token_mask: [B, S] (False for padding, excluded from load statistics).
        Returns the output [B, S, D] and the layer's MoEStats."""
        moe, shape, dtype = self.config, x.shape, x.dtype
        tokens = x.reshape(-1, shape[-1])  # [N, D]
        logits = tokens.astype(jnp.float32) @ self.router[...]  # router in fp32 on every path
        chosen, weights, scores = route(logits, self.correction_bias[...], moe.experts_per_token)
        experts = ExpertWeights(
            *(w[...].astype(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        )
        activation = functools.partial(swigluoai, alpha=self.alpha, limit=self.limit)
        dropped, worst_case, shared = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32), None
        impl = grouped_matmul_impl(moe.grouped_matmul, dtype, *experts.gate.shape[1:])
        if moe.dispatch == "dense":
            routed = dense_experts(tokens, chosen, weights, experts, activation)
        elif self.mesh is None:
            routed, dropped = sorted_experts(
                tokens,
                chosen,
                weights,
                moe.num_experts,
                local_ffn(experts, activation, impl),
                dispatch=moe.dispatch,
                capacity_factor=moe.capacity_factor,
            )
        else:
            per_token = (*shape[:-1], moe.experts_per_token)
            routed, dropped, worst_case, shared = expert_parallel.routed_experts(
                self.mesh,
                x,
                chosen.reshape(per_token),
                weights.reshape(per_token),
                experts,
                activation,
                moe,
                grouped_matmul=impl,
                beside=self._shared_expert_in_exchange(dtype),
            )
        if shared is None:
            shared = self.shared_expert(tokens)
        out = moe.routed_scaling * routed.reshape(tokens.shape) + shared.reshape(tokens.shape)

        mask = token_mask.reshape(-1, 1).astype(jnp.float32)
        load = jnp.zeros((moe.num_experts,), jnp.float32).at[chosen].add(mask)
        stats = MoEStats(
            load=load,
            score_share=(scores / scores.sum(-1, keepdims=True) * mask).sum(0),
            experts=chosen.reshape(*shape[:-1], moe.experts_per_token),
            dropped_fraction=dropped.astype(jnp.float32) / chosen.size,
            exchange_worst_case=worst_case,
        )
        return out.reshape(shape), stats

    def _shared_expert_in_exchange(self, dtype) -> expert_parallel.Beside | None:
        """The shared expert as work inside the expert-parallel map, where XLA can run it beside
        the all-to-alls; None (outside, as GSPMD shards it) without an exchange (mesh.expert 1)
        or where the mesh splits its width (`tensor`), which the map would undo."""
        mesh = self.mesh.shape
        if mesh[sharding.EXPERT_AXIS] == 1 or mesh[sharding.TENSOR_AXIS] > 1:
            return None
        fn = functools.partial(swiglu_mlp, alpha=self.alpha, limit=self.limit)
        return expert_parallel.Beside(fn, self.shared_expert.weights(dtype))
