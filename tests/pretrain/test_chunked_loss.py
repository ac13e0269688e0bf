"""The chunked cross-entropy against plain logits: values, gradients of the weighted loss, memory."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from jax.sharding import NamedSharding, PartitionSpec

from m3jax import sharding
from pretrain.chunked_loss import chunked_lm_loss, lm_head_gathered
from pretrain.loss import token_losses

M3_VOCAB = 200_064
LM_HEAD_AXES = ("embed", "vocab")  # as M3Model declares them


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
    # per-position weights of nll and logsumexp², some zero (masked) and the z-loss's small
    mask = jax.random.bernoulli(keys[3], 0.8, (batch, seq))
    nll_weights = mask * jax.random.uniform(keys[4], (batch, seq))
    return hidden, lm_head, targets, (nll_weights, 0.1 * nll_weights)


def plain_lm_loss(hidden, lm_head, targets, nll_weights, lse_square_weights):
    """The weighted loss of `plain_token_losses`, and its per-position terms."""
    nll, lse = plain_token_losses(hidden, lm_head, targets)
    return (nll_weights * nll).sum() + (lse_square_weights * lse**2).sum(), nll, lse


def chunked(chunk_tokens):
    def loss(*args):
        return tuple(chunked_lm_loss(*args, chunk_tokens=chunk_tokens))

    return loss


def values_and_gradients(losses, hidden, lm_head, targets, weights):
    """(loss, nll, logsumexp) and the loss's gradients w.r.t. (hidden, lm_head)."""

    def weighted(hidden, lm_head):
        loss, nll, lse = losses(hidden, lm_head, targets, *weights)
        return loss, (loss, nll, lse)

    value_and_grad = jax.jit(jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True))
    (_, outputs), grads = value_and_grad(hidden, lm_head)
    return list(outputs), list(grads)


def assert_close(actual, expected, rtol):
    """Relative to the largest entry: gradients have entries near zero."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


# chunk 10 over 3 rows of 37: 3 positions a row, 13 chunks, 2 padded positions; 64: 21 a row, 2
# chunks, 5 padded; 200: one chunk, no padding
@pytest.mark.parametrize("chunk_tokens", [10, 64, 200])
def test_chunked_lm_loss_matches_plain_logits_in_values_and_gradients(chunk_tokens):
    hidden, lm_head, targets, weights = random_inputs(batch=3, seq=37, dim=16, vocab=50)
    outputs, grads = values_and_gradients(
        chunked(chunk_tokens), hidden, lm_head, targets, weights
    )
    expected_outputs, expected_grads = values_and_gradients(
        plain_lm_loss, hidden, lm_head, targets, weights
    )
    for actual, expected in zip(outputs + grads, expected_outputs + expected_grads, strict=True):
        assert_close(actual, expected, rtol=1e-5)


def test_the_gradient_scales_with_the_loss_cotangent_and_reaches_the_weights():
    """The forward computes the gradient for a cotangent of 1; the backward scales it. The
    weights' gradients are the per-position terms."""
    hidden, lm_head, targets, weights = random_inputs(batch=2, seq=9, dim=8, vocab=20)

    def scaled(losses):
        return jax.grad(lambda *args: -3.0 * losses(args[0], args[1], targets, *args[2:])[0],
                        argnums=(0, 1, 2, 3))(hidden, lm_head, *weights)  # fmt: skip

    for actual, expected in zip(scaled(chunked(4)), scaled(plain_lm_loss), strict=True):
        assert_close(actual, expected, rtol=1e-5)


def test_no_gradient_flows_through_the_per_position_values():
    """nll and logsumexp are metrics: a loss built on them sees them as constants."""
    hidden, lm_head, targets, weights = random_inputs(batch=2, seq=9, dim=8, vocab=20)

    def metric_only(hidden):
        return chunked_lm_loss(hidden, lm_head, targets, *weights, chunk_tokens=4).nll.sum()

    assert not np.asarray(jax.grad(metric_only)(hidden)).any()


def test_chunked_lm_loss_in_bfloat16_matches_the_plain_bfloat16_path():
    """bf16 hidden states: the same bf16 products with fp32 accumulation. d(lm_head) differs by
    the plain path's rounding to bf16 (the transpose of its cast), which the chunks skip."""
    hidden, lm_head, targets, weights = random_inputs(4, 24, 32, 40, dtype=jnp.bfloat16)
    outputs, grads = values_and_gradients(chunked(16), hidden, lm_head, targets, weights)
    expected_outputs, expected_grads = values_and_gradients(
        plain_lm_loss, hidden, lm_head, targets, weights
    )
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    for actual, expected in zip(outputs, expected_outputs, strict=True):
        assert_close(actual, expected, rtol=1e-5)
    for actual, expected in zip(grads, expected_grads, strict=True):
        assert_close(actual, expected, rtol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_logits_are_the_plain_loss_of_the_rounded_logits(dtype):
    """`logits_dtype=bfloat16`: each logit rounded to bf16, then the loss and its gradient in
    fp32, as the plain path computes them on the rounded logits (the rounding's gradient passes
    through unrounded); other than on fp32 logits where the rounding changes them."""
    hidden, lm_head, targets, weights = random_inputs(3, 37, 16, 50, dtype=dtype)

    def rounded_plain(hidden, lm_head, targets, nll_weights, lse_square_weights):
        logits = jnp.einsum("bsd,dv->bsv", hidden, lm_head.astype(hidden.dtype),
                            preferred_element_type=jnp.float32)  # fmt: skip
        rounding = logits.astype(jnp.bfloat16).astype(jnp.float32) - logits
        nll, lse = token_losses(logits + jax.lax.stop_gradient(rounding), targets)
        return (nll_weights * nll).sum() + (lse_square_weights * lse**2).sum(), nll, lse

    def bf16_logits(*args):
        return tuple(chunked_lm_loss(*args, chunk_tokens=10, logits_dtype=jnp.bfloat16))

    outputs, grads = values_and_gradients(bf16_logits, hidden, lm_head, targets, weights)
    expected_outputs, expected_grads = values_and_gradients(
        rounded_plain, hidden, lm_head, targets, weights
    )
    assert all(x.dtype == jnp.float32 for x in outputs)
    for actual, expected in zip(outputs, expected_outputs, strict=True):
        assert_close(actual, expected, rtol=1e-5)
    for actual, expected in zip(grads, expected_grads, strict=True):
        assert_close(actual, expected, rtol=1e-5 if dtype == jnp.float32 else 2e-2)
    fp32_nll = values_and_gradients(chunked(10), hidden, lm_head, targets, weights)[0][1]
    assert np.abs(np.asarray(fp32_nll) - np.asarray(outputs[1])).max() > 1e-4


def loss_and_grad_temp_bytes(losses, tokens, dim=256, vocab=M3_VOCAB) -> int:
    """XLA's temporary buffers (CPU buffer assignment) of nll + z-loss and their gradients w.r.t.
    hidden and lm_head, for one row of `tokens`; compiled only, never run."""

    def loss(hidden, lm_head, targets):
        weights = jnp.full(targets.shape, 1 / tokens)
        return losses(hidden, lm_head, targets, weights, 1e-4 * weights)[0]

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
    plain = loss_and_grad_temp_bytes(plain_lm_loss, tokens)
    chunked_bytes = loss_and_grad_temp_bytes(chunked(256), tokens)
    assert plain > logits_bytes  # the measurement sees the logits
    assert chunked_bytes <= 0.25 * logits_bytes, (chunked_bytes, logits_bytes)
    assert loss_and_grad_temp_bytes(chunked(256), 2 * tokens) <= 1.05 * chunked_bytes


def test_one_pass_logsumexp_matches_jax_over_scales_and_masked_entries():
    from pretrain.chunked_loss import _logsumexp

    logits = 30.0 * jax.random.normal(jax.random.key(3), (3, 5, 1001), jnp.float32)
    logits = logits.at[0, 0, :].set(-jnp.inf).at[1, :, 7:].set(-jnp.inf).at[2, 1, 3].add(500.0)
    for axis in (-1, 1):
        np.testing.assert_allclose(_logsumexp(logits, axis), jax.nn.logsumexp(logits, axis),
                                   rtol=1e-6)  # fmt: skip


def test_lm_head_split_over_fsdp_gathered_for_the_chunks_gives_the_same_loss_and_gradients():
    """4 devices, the lm_head's embed dim over fsdp (as m3-train lays it out), 8 chunks, the
    weight and its gradient's sum in the gathered layout: values and gradients are one
    device's."""
    mesh = sharding.make_mesh({"fsdp": 4})
    hidden, lm_head, targets, weights = random_inputs(4, 64, 16, 40)
    expected = values_and_gradients(plain_lm_loss, hidden, lm_head, targets, weights)
    layout = lm_head_gathered(LM_HEAD_AXES, lm_head.shape, mesh)
    assert layout is not None and layout.spec == PartitionSpec(None, None)
    assert lm_head_gathered(LM_HEAD_AXES, lm_head.shape, sharding.make_mesh({"data": 4})) is None

    def losses(*args):
        return tuple(chunked_lm_loss(*args, chunk_tokens=32, gathered=layout))

    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    hidden, targets, *weights = (jax.device_put(x, rows) for x in (hidden, targets, *weights))
    lm_head = jax.device_put(lm_head, NamedSharding(mesh, PartitionSpec("fsdp", None)))
    got = values_and_gradients(losses, hidden, lm_head, targets, weights)
    for a, e in zip(got[0] + got[1], expected[0] + expected[1]):
        assert_close(a, e, rtol=2e-5)


# Compiled for 4 H200s by XLA:GPU ahead of time (pretrain/gpu_target.py): the collectives of the
# chunked loss's gradient with the lm_head split over fsdp, as JSON
ON_FOUR_H200S = """
import json, sys
from pretrain import gpu_target
gpu_target.start_without_gpu()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from m3jax import sharding
from pretrain import hlo_collectives
from pretrain.chunked_loss import chunked_lm_loss, lm_head_gathered
with gpu_target.compiling_for(gpu_target.h200_devices(4)):
    mesh = sharding.make_mesh({"fsdp": 4})
    axes = ("embed", "vocab")
    layout = lm_head_gathered(axes, (256, 4096), mesh) if sys.argv[1] == "gathered" else None
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    split = NamedSharding(mesh, PartitionSpec("fsdp", None))
    hidden = jax.ShapeDtypeStruct((4, 1024, 256), jnp.bfloat16, sharding=rows)
    targets = jax.ShapeDtypeStruct((4, 1024), jnp.int32, sharding=rows)
    weights = jax.ShapeDtypeStruct((4, 1024), jnp.float32, sharding=rows)
    lm_head = jax.ShapeDtypeStruct((256, 4096), jnp.float32, sharding=split)

    def loss(h, w, t, n):
        return chunked_lm_loss(h, w, t, n, chunk_tokens=512, gathered=layout).loss

    step = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(rows, split))
    hlo = step.lower(hidden, lm_head, targets, weights).compile().as_text()
    print(json.dumps(hlo_collectives.collective_bytes(hlo)))
"""


@pytest.mark.slow
def test_on_h200s_the_lm_head_is_gathered_and_its_gradient_reduced_once_not_per_chunk():
    """XLA:GPU (4 H200s, `--target h200`'s compiler) left to itself all-gathers the lm_head
    and reduce-scatters its gradient in each of the 8 chunks; in the gathered layout, once."""

    def collectives(variant: str) -> dict:
        command = [sys.executable, "-c", ON_FOUR_H200S, variant]
        result = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    weight, gradient = 256 * 4096 * 2, 256 * 4096 * 4  # bf16 in the products, f32 sums
    per_chunk, once = collectives("per-chunk"), collectives("gathered")
    assert per_chunk["all-gather"] >= 8 * weight
    assert per_chunk["reduce-scatter"] + per_chunk.get("all-reduce", 0) >= 8 * gradient
    assert once["all-gather"] <= weight
    assert once.get("reduce-scatter", 0) + once.get("all-reduce", 0) <= gradient
