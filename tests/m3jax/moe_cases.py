"""A small MoE block with random weights and a skewed router, run forward and backward.

Shared by the dispatch and expert-parallel tests. The correction bias pushes most tokens to
experts 0 and 1 and none to the last expert, so loads are uneven and one expert idles.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.config import ModelConfig, MoEConfig
from m3jax.moe.layer import MoE

B, S, D = 8, 6, 8


def moe_config(num_experts: int = 8, experts_per_token: int = 2, **moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=16,
        hidden_size=D,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rotary_dim=4,
        dense_mlp_dim=8,
        layer_types=("full",),
        mlp_layer_types=("moe",),
        moe=MoEConfig(
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            expert_dim=6,
            shared_expert_dim=7,
            **moe,
        ),
    )


def with_moe(config: ModelConfig, **moe) -> ModelConfig:
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe))


def skewed_bias(num_experts: int) -> np.ndarray:
    bias = np.zeros(num_experts)
    bias[:2] = (0.6, 0.4)
    bias[-1] = -10.0  # never chosen
    return bias


def random_state(config: ModelConfig, seed: int = 0) -> dict:
    """Params and buffers of one MoE block as a pure dict: N(0, 1) weights, a skewed bias."""
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 1, x.shape), jnp.float32), state)
    state["correction_bias"] = jnp.asarray(skewed_bias(config.moe.num_experts), jnp.float32)
    return state


def inputs(seed: int = 1, batch: int = B) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, S, D], token mask [B, S] (a few padding positions), cotangent [B, S, D]."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (batch, S, D)), jnp.float32)
    mask = jnp.asarray(np.arange(S)[None, :] < S - (np.arange(batch)[:, None] % 3))
    cotangent = jnp.asarray(rng.normal(0, 1, (batch, S, D)), jnp.float32)
    return x, mask, cotangent


def run(config: ModelConfig, state: dict, x, mask, cotangent, mesh=None):
    """(out [B, S, D], stats, grads {"state": ..., "x": ...}) of Σ out · cotangent, under jit."""

    def loss(state, x):
        graphdef, module_state = nnx.split(
            nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0), mesh=mesh))
        )
        nnx.replace_by_pure_dict(module_state, state)
        out, stats = nnx.merge(graphdef, module_state)(x, mask)
        return (out * cotangent).sum(), (out, stats)

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (out, stats)), (state_grads, x_grads) = grad_fn(state, x)
    return out, stats, {"state": state_grads, "x": x_grads}


def assert_trees_close(actual, expected, rtol: float = 1e-5, err_msg: str = "") -> None:
    """Leaf by leaf, to rtol of each leaf's largest magnitude (float32 sums in another order)."""
    flat_actual, flat_expected = jax.tree.leaves_with_path(actual), jax.tree.leaves(expected)
    assert len(flat_actual) == len(flat_expected)
    for (path, a), b in zip(flat_actual, flat_expected, strict=True):
        b = np.asarray(b)
        scale = max(float(np.abs(b).max()), 1e-30)
        np.testing.assert_allclose(
            np.asarray(a), b, rtol=rtol, atol=rtol * scale, err_msg=f"{err_msg} {path}"
        )
