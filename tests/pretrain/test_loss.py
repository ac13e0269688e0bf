"""Losses against direct computations: masked cross-entropy, z-loss, load-balance loss."""

import jax
import jax.numpy as jnp
import numpy as np

from pretrain.loss import load_balance_loss, next_token_loss


def test_next_token_loss_matches_log_softmax_and_ignores_masked_positions():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 7)
    mask = jnp.array([[1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], jnp.float32)
    nll, z_loss = next_token_loss(logits, targets, mask)
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    picked = [-log_probs[b, s, targets[b, s]] for b in range(2) for s in range(5) if mask[b, s]]
    np.testing.assert_allclose(nll, np.mean(picked), rtol=1e-6)
    lse = np.asarray(jax.nn.logsumexp(logits, -1))
    np.testing.assert_allclose(
        z_loss,
        np.mean([lse[b, s] ** 2 for b in range(2) for s in range(5) if mask[b, s]]),
        rtol=1e-6,
    )
    # changing a masked position's logits changes nothing
    nll2, _ = next_token_loss(logits.at[0, 2].add(100.0), targets, mask)
    assert nll2 == nll


def test_next_token_loss_with_empty_mask_is_zero_not_nan():
    nll, z_loss = next_token_loss(
        jnp.ones((1, 3, 4)), jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3))
    )
    assert nll == 0 and z_loss == 0


def test_load_balance_loss_is_one_when_balanced_and_larger_when_not():
    experts, tokens, k = 4, 8, 2
    balanced_load = jnp.full((1, experts), tokens * k / experts)
    balanced_share = jnp.full((1, experts), tokens / experts)
    np.testing.assert_allclose(load_balance_loss(balanced_load, balanced_share, k), 1.0, rtol=1e-6)
    skewed_load = jnp.array([[tokens, tokens, 0.0, 0.0]])
    skewed_share = jnp.array([[tokens / 2, tokens / 2, 0.0, 0.0]])
    np.testing.assert_allclose(load_balance_loss(skewed_load, skewed_share, k), 2.0, rtol=1e-6)
