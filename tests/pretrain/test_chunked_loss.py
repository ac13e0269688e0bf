"""The chunked cross-entropy against plain logits: values, gradients of both outputs, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain.chunked_loss import chunked_token_losses
from pretrain.loss import token_losses

M3_VOCAB = 200_064


def plain_token_losses(hidden, lm_head, targets):
    """token_losses of M3Model.head's logits: what the chunked loss replaces."""
    logits = jnp.einsum(
        "bsd,dv->bsv", hidden, lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32
    )
    return token_losses(logits, targets)


def random_inputs(batch, seq, dim, vocab, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 5)
    hidden = jax.random.normal(keys[0], (batch, seq, dim)).astype(dtype)
    lm_head = jax.random.normal(keys[1], (dim, vocab)) * 0.5
    targets = jax.random.randint(keys[2], (batch, seq), 0, vocab)
    cotangents = [jax.random.normal(k, (batch, seq)) for k in keys[3:]]  # for nll, logsumexp
    return hidden, lm_head, targets, cotangents


def values_and_gradients(losses, hidden, lm_head, targets, cotangents):
    """(nll, logsumexp) and the gradients w.r.t. (hidden, lm_head) of Σ g_nll·nll + g_lse·lse."""

    def weighted(hidden, lm_head):
        nll, lse = losses(hidden, lm_head, targets)
        return (nll * cotangents[0] + lse * cotangents[1]).sum(), (nll, lse)

    value_and_grad = jax.jit(jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True))
    (_, outputs), grads = value_and_grad(hidden, lm_head)
    return outputs, grads


def assert_close(actual, expected, rtol):
    """Relative to the largest entry: gradients have entries near zero."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


# chunk 10 over 3 rows of 37: 3 positions a row, 13 chunks, 2 padded positions; 64: 21 a row, 2
# chunks, 5 padded; 200: one chunk, no padding
@pytest.mark.parametrize("chunk_tokens", [10, 64, 200])
def test_chunked_token_losses_match_token_losses_values_and_gradients(chunk_tokens):
    hidden, lm_head, targets, cotangents = random_inputs(batch=3, seq=37, dim=16, vocab=50)
    chunked = functools.partial(chunked_token_losses, chunk_tokens=chunk_tokens)
    outputs, grads = values_and_gradients(chunked, hidden, lm_head, targets, cotangents)
    expected_outputs, expected_grads = values_and_gradients(
        plain_token_losses, hidden, lm_head, targets, cotangents
    )
    for actual, expected in zip(outputs + grads, expected_outputs + expected_grads, strict=True):
        assert_close(actual, expected, rtol=1e-5)


def test_chunked_token_losses_in_bfloat16_match_the_plain_bfloat16_path():
    """bf16 hidden states: the same bf16 products with fp32 accumulation. d(lm_head) differs by
    the plain path's rounding to bf16 (the transpose of its cast), which the chunks skip."""
    hidden, lm_head, targets, cotangents = random_inputs(4, 24, 32, 40, dtype=jnp.bfloat16)
    chunked = functools.partial(chunked_token_losses, chunk_tokens=16)
    outputs, grads = values_and_gradients(chunked, hidden, lm_head, targets, cotangents)
    expected_outputs, expected_grads = values_and_gradients(
        plain_token_losses, hidden, lm_head, targets, cotangents
    )
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    for actual, expected in zip(outputs, expected_outputs, strict=True):
        assert_close(actual, expected, rtol=1e-5)
    for actual, expected in zip(grads, expected_grads, strict=True):
        assert_close(actual, expected, rtol=2e-2)


def loss_and_grad_temp_bytes(losses, tokens, dim=256, vocab=M3_VOCAB) -> int:
    """XLA's temporary buffers (CPU buffer assignment) of nll + z-loss and their gradients w.r.t.
    hidden and lm_head, for one row of `tokens`; compiled only, never run."""

    def loss(hidden, lm_head, targets):
        nll, lse = losses(hidden, lm_head, targets)
        return nll.mean() + 1e-4 * jnp.square(lse).mean()

    shapes = (
        jax.ShapeDtypeStruct((1, tokens, dim), jnp.float32),
        jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    )
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_loss_and_gradient_temporaries_are_a_fraction_of_one_logits_array():
    """At M3's vocabulary and 4096 tokens, one [T, V] fp32 array is 3.3 GB; the plain path keeps
    more than that, the chunked one (256-token chunks) ≈ 2 · 256 · V · 4 bytes = 0.41 GB, which
    does not grow with the tokens."""
    tokens = 4096
    logits_bytes = tokens * M3_VOCAB * 4
    plain = loss_and_grad_temp_bytes(plain_token_losses, tokens)
    chunked = functools.partial(chunked_token_losses, chunk_tokens=256)
    chunked_bytes = loss_and_grad_temp_bytes(chunked, tokens)
    assert plain > logits_bytes  # the measurement sees the logits
    assert chunked_bytes <= 0.25 * logits_bytes, (chunked_bytes, logits_bytes)
    assert loss_and_grad_temp_bytes(chunked, 2 * tokens) <= 1.05 * chunked_bytes
