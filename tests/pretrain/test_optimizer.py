"""The learning-rate schedule and which parameters are decayed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.model import functional
from pretrain.config import OptimizerConfig
from pretrain.optimizer import learning_rate, make_optimizer
from tiny import tiny_run


def test_learning_rate_warms_up_linearly_then_decays_to_the_floor():
    config = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    schedule = learning_rate(config, total_steps=100)
    assert schedule(0) == 0
    np.testing.assert_allclose(schedule(5), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(schedule(10), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(schedule(55), 1e-4 + 0.5 * 9e-4, rtol=1e-5)  # cosine midpoint
    np.testing.assert_allclose(schedule(100), 1e-4, rtol=1e-5)
    assert all(schedule(s) >= schedule(s + 1) for s in range(10, 100))


@pytest.mark.parametrize("total_steps, expected", [(1, [1e-3]), (3, [0, 5e-4, 1e-3])])
def test_learning_rate_warmup_shrinks_to_fit_runs_shorter_than_it(total_steps, expected):
    """warmup_steps=10 > total_steps: the warmup ends on the run's last update (at the peak), and
    the step after it is the floor, as in a run of normal length."""
    schedule = learning_rate(OptimizerConfig(lr=1e-3, warmup_steps=10), total_steps)
    np.testing.assert_allclose([schedule(s) for s in range(total_steps)], expected, rtol=1e-6)
    np.testing.assert_allclose(schedule(total_steps), 1e-4, rtol=1e-5)


def test_weight_decay_skips_norm_offsets_only():
    model = functional(tiny_run().model)
    params, _ = jax.jit(model.init, static_argnums=0)(0)
    # norm offsets start at 0, where decay does nothing either: move every parameter off 0
    params = jax.tree.map(lambda p: p + 0.25, params)
    config = OptimizerConfig(lr=1.0, weight_decay=0.5, clip_norm=1e9, warmup_steps=0)
    optimizer = make_optimizer(config, total_steps=10, param_axes=model.param_axes)

    @jax.jit
    def update_from_zero_grads(params):
        zero_grads = jax.tree.map(jnp.zeros_like, params)
        return optimizer.update(zero_grads, optimizer.init(params), params)[0]

    updates = update_from_zero_grads(params)
    # with zero gradients, AdamW's update is -lr · weight_decay · param where decay applies
    is_axes = lambda x: isinstance(x, tuple)
    norms = 0
    for axes, update, param in zip(
        jax.tree.leaves(model.param_axes, is_leaf=is_axes),
        jax.tree.leaves(updates),
        jax.tree.leaves(params),
        strict=True,
    ):
        if axes[-1] == "norm":
            norms += 1
            assert jnp.all(update == 0), axes
        else:
            np.testing.assert_allclose(update, -0.5 * param, rtol=1e-5, err_msg=str(axes))
    assert norms > 0
