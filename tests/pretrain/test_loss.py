"""Losses against direct computations: masked cross-entropy, z-loss, load-balance loss."""

import jax
import jax.numpy as jnp
import numpy as np

from pretrain.loss import (
    document_kinds,
    load_balance_loss,
    masked_mean,
    mean_weights,
    token_losses,
)


def test_next_token_loss_matches_log_softmax_and_ignores_masked_positions():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 7)
    mask = jnp.array([[1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], jnp.float32)
    token_nll, lse = token_losses(logits, targets)
    nll, z_loss = masked_mean(token_nll, mask), masked_mean(lse**2, mask)
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
    nll2 = masked_mean(token_losses(logits.at[0, 2].add(100.0), targets)[0], mask)
    assert nll2 == nll


def test_masked_mean_of_an_empty_mask_is_the_given_value_not_nan():
    values = jnp.arange(6.0).reshape(2, 3)
    assert masked_mean(values, jnp.zeros((2, 3))) == 0
    assert jnp.isnan(masked_mean(values, jnp.zeros((2, 3)), empty=jnp.nan))
    np.testing.assert_allclose(masked_mean(values, jnp.array([[0, 1, 0], [0, 0, 3]])), (1 + 15) / 4)


def test_mean_weights_give_the_masked_mean_and_keep_a_poisoned_mask_non_finite():
    values = jnp.arange(6.0).reshape(2, 3)
    mask = jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    total = jnp.float32(5.0)  # the whole batch's targets, of which this part holds 3
    weights = mean_weights(mask, total)
    np.testing.assert_allclose((weights * values).sum(), masked_mean(values, mask, total=total))
    assert not mean_weights(mask, jnp.float32(0.0)).any()  # no targets: no weight, not NaN
    poisoned = mask.at[0, 1].set(jnp.nan)
    assert not np.isfinite((mean_weights(poisoned, poisoned.sum()) * values).sum())


def test_document_kinds_tags_every_token_with_its_documents_richest_modality():
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 1, 2, 2, 2, 2]])
    modality = jnp.array([[0, 1, 0, 0, 0, 2, 1, 0], [0, 0, 0, 0, 0, 2, 0, 0]])
    expected = [[1, 1, 1, 0, 0, 2, 2, 0], [0, 0, 0, 0, 2, 2, 2, 2]]
    np.testing.assert_array_equal(document_kinds(segment_ids, modality), expected)


def test_load_balance_loss_is_one_when_balanced_and_larger_when_not():
    experts, tokens, k = 4, 8, 2
    balanced_load = jnp.full((1, experts), tokens * k / experts)
    balanced_share = jnp.full((1, experts), tokens / experts)
    np.testing.assert_allclose(load_balance_loss(balanced_load, balanced_share, k), 1.0, rtol=1e-6)
    skewed_load = jnp.array([[tokens, tokens, 0.0, 0.0]])
    skewed_share = jnp.array([[tokens / 2, tokens / 2, 0.0, 0.0]])
    np.testing.assert_allclose(load_balance_loss(skewed_load, skewed_share, k), 2.0, rtol=1e-6)
