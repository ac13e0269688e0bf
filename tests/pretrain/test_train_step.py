"""The train step: router-bias balancing, the indexer's isolation from the LM loss, masking."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_chunked_loss import plain_token_losses as plain_losses
from tiny import tiny_run

from batch_format.batch import Batch, make_batch
from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain import train_step
from pretrain.chunked_loss import LMLoss
from pretrain.loss import loss_totals
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.train_step import init_state, make_loss_fn, make_train_step


def one_document_rows(tokens: jax.Array) -> Batch:
    """tokens [B, S + 1] -> rows of one document each: inputs, next tokens, loss everywhere."""
    rows, seq = tokens.shape[0], tokens.shape[1] - 1
    return make_batch(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        positions=jnp.tile(jnp.arange(seq), (rows, 1)),
        segment_ids=jnp.ones((rows, seq), jnp.int32),
        loss_mask=jnp.ones((rows, seq), jnp.float32),
    )


def random_batch(seed=0, batch=2, seq=32, vocab=263) -> Batch:
    return one_document_rows(jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, vocab))


def model_inputs(batch: Batch) -> tuple:
    return batch.tokens, batch.positions, batch.segment_ids


def setup(**sections):
    run = tiny_run(**sections)
    model = functional(run.model)
    optimizer = make_optimizer(run.optimizer, run.train.steps, model.param_axes)
    jitted = jax.jit(
        make_train_step(model, optimizer, learning_rate(run.optimizer, 10), run), static_argnums=2
    )

    def step(state, batch):
        return jitted(state, batch, ForwardMode(indexer_loss=True))

    return model, run, step, init_state(model, optimizer, seed=0)


def test_train_step_moves_router_bias_against_load():
    model, run, step, state = setup()
    _, stats = model.apply(
        state["params"],
        state["buffers"],
        *model_inputs(random_batch()),
    )
    load = np.asarray(stats[1].moe.load)[0]
    new_state, _ = step(state, random_batch())
    bias = np.asarray(new_state["buffers"]["stacks"][1]["layers"]["mlp"]["correction_bias"])[0]
    rate = run.model.moe.bias_update_rate
    expected = rate * np.clip((load.mean() - load) / load.mean(), -1, 1)
    np.testing.assert_allclose(bias, expected, rtol=1e-6)
    assert (bias[load > load.mean()] < 0).all() and (bias[load < load.mean()] > 0).all()


def test_a_model_without_moe_trains_with_no_router_buffers():
    _, _, step, state = setup(model={"layer_types": ["full"] * 2,
                                     "mlp_layer_types": ["dense"] * 2})  # fmt: skip
    new_state, metrics = step(state, random_batch())
    assert np.isfinite(metrics["loss"])
    assert jax.tree.structure(new_state["buffers"]) == jax.tree.structure(state["buffers"])


def test_lm_loss_gives_the_indexer_no_gradient():
    model, run, _, state = setup()
    batch = random_batch()

    def loss(params):
        logits, _ = model.apply(
            params, state["buffers"], batch.tokens, batch.positions, batch.segment_ids
        )
        return (
            jax.nn.logsumexp(logits, -1).mean()
            - jnp.take_along_axis(logits, batch.targets[..., None], -1).mean()
        )

    grads = jax.grad(loss)(state["params"])
    indexer = grads["stacks"][1]["layers"]["attention"]["indexer"]
    assert all(jnp.all(g == 0) for g in jax.tree.leaves(indexer))
    others = grads["stacks"][1]["layers"]["attention"]["q_proj"]
    assert jnp.any(others != 0)


def test_padding_changes_neither_loss_nor_router_statistics():
    model, run, step, state = setup()
    batch = random_batch(batch=1, seq=32)
    padded = jax.tree.map(lambda x: jnp.concatenate([x, jnp.zeros_like(x[:, :8])], axis=1), batch)
    padded = padded._replace(tokens=padded.tokens.at[:, 32:].set(7))  # arbitrary ids, segment 0
    _, metrics = step(state, batch)
    _, padded_metrics = step(state, padded)
    np.testing.assert_allclose(padded_metrics["nll"], metrics["nll"], rtol=1e-5)
    assert padded_metrics["tokens"] == metrics["tokens"] == 32
    np.testing.assert_allclose(
        padded_metrics["expert_imbalance"], metrics["expert_imbalance"], rtol=1e-6
    )


def test_capacity_dispatch_reports_the_dropped_fraction():
    """Capacity ⌈0.5 · 64·2 / 4⌉ = 16 rows per expert for 128 (token, expert) pairs: a quarter of
    the slots of a perfectly balanced router, so at least half the pairs are dropped."""
    model, run, step, state = setup(model={"moe": {"dispatch": "capacity", "capacity_factor": 0.5}})
    _, stats = model.apply(
        state["params"],
        state["buffers"],
        *model_inputs(random_batch()),
    )
    expected = float(np.asarray(stats[1].moe.dropped_fraction).mean())
    _, metrics = step(state, random_batch())
    assert expected >= 0.5
    np.testing.assert_allclose(float(metrics["moe_dropped_fraction"]), expected, rtol=1e-6)


def test_chunked_lm_loss_gives_the_plain_logits_loss_and_gradients(monkeypatch):
    """The train loss (LM + z-loss + an MTP module + MoE) and every parameter's gradient with
    10-token chunks (3 rows of 32: 3 positions a row, 11 chunks, padding) equal the same loss
    computed from plain [B, S, V] logits (the indexer KL, which never sees them, is left off:
    it only adds compile time)."""
    run = tiny_run(
        model={"mtp": {"num_modules": 1}},
        optimizer={"z_loss_weight": 0.1},
        train={"loss_chunk_tokens": 10},
    )
    model = functional(run.model)
    params, buffers = model.init(0)
    batch, mode = random_batch(batch=3), ForwardMode()
    totals = loss_totals(batch, run.model.mtp.num_modules, parts=1)

    def loss_and_grad():
        loss_fn = jax.value_and_grad(make_loss_fn(model, run), has_aux=True)
        (loss, (metrics, _)), grads = jax.jit(loss_fn, static_argnums=3)(
            params, buffers, batch, mode, totals
        )
        return loss, metrics, grads

    def plain_lm_loss(hidden, lm_head, targets, nll_weights, lse_square_weights=None, **_):
        nll, lse = plain_losses(hidden, lm_head, targets)
        loss = (nll_weights * nll).sum()
        if lse_square_weights is not None:
            loss += (lse_square_weights * lse**2).sum()
        return LMLoss(loss, nll, lse)

    chunked = loss_and_grad()
    monkeypatch.setattr(train_step, "chunked_lm_loss", plain_lm_loss)
    plain = loss_and_grad()
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
    for name in ("nll", "z_loss", "mtp_nll"):
        np.testing.assert_allclose(chunked[1][name], plain[1][name], rtol=1e-6)
    # the weights inside the LM loss are the objective's: its value is the weighted metrics'
    metrics, model_config = chunked[1], run.model
    objective = metrics["nll"] + run.optimizer.z_loss_weight * metrics["z_loss"]
    objective += model_config.mtp.loss_weight * metrics["mtp_nll"]
    objective += model_config.moe.balance_loss_weight * metrics.get("balance_loss", 0.0)
    np.testing.assert_allclose(chunked[0], objective, rtol=1e-6)
    for path, grad in jax.tree_util.tree_leaves_with_path(plain[2]):
        actual = functools.reduce(lambda tree, key: tree[key.key], path, chunked[2])
        scale = np.abs(grad).max()
        np.testing.assert_allclose(actual, grad, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))
    assert np.abs(chunked[2]["lm_head"]).max() > 0


@pytest.mark.parametrize("parts", [1, 2])
def test_the_kl_through_sinks_gives_the_loss_metrics_and_gradients_of_the_kl_in_the_loss(parts):
    """The step differentiates the trunk's MSA layers' KL sinks (the kernels may then compute the
    KL in the backward): their gradients give each layer's KL back, so the loss, `msa_kl` and
    every `msa_kl_<layer>` (an MTP module's MSA layer's KL still from its forward) equal those
    of the loss function without sinks, and so do the parameters' gradients; with gradient
    accumulation too."""
    run = tiny_run(
        model={"num_layers": 3, "layer_types": ["full", "msa", "msa"],
               "mlp_layer_types": ["dense", "moe", "moe"], "mtp": {"num_modules": 1},
               "msa": {"kl_weight": 0.7}},
        train={"grad_accum_steps": parts},
    )  # fmt: skip
    model = functional(run.model)
    optimizer = make_optimizer(run.optimizer, run.train.steps, model.param_axes)
    state = init_state(model, optimizer, seed=0)
    batch = random_batch(batch=4)
    mode = ForwardMode(indexer_loss=True)
    assert [s is None for s in model.kl_sinks()] == [True, False]
    gradients, _ = train_step.make_step_halves(model, optimizer, learning_rate(run.optimizer, 10),
                                               run)  # fmt: skip
    grads, (loss, metrics, _) = jax.jit(gradients, static_argnums=2)(state, batch, mode)
    totals = loss_totals(batch, run.model.mtp.num_modules, 1)
    loss_and_grad = jax.value_and_grad(make_loss_fn(model, run), has_aux=True)
    (expected_loss, (expected, _)), expected_grads = jax.jit(loss_and_grad, static_argnums=3)(
        state["params"], state["buffers"], batch, mode, totals
    )
    # under sinks the loss function leaves the trunk's KLs out: the step got them from the sinks
    _, (sunk, _) = make_loss_fn(model, run)(state["params"], state["buffers"], batch, mode,
                                            totals, model.kl_sinks())  # fmt: skip
    assert float(sunk["msa_kl_layer1"]) == 0 and float(sunk["msa_kl_mtp0"]) > 0.01
    kl_names = ["msa_kl", "msa_kl_layer1", "msa_kl_layer2", "msa_kl_mtp0"]
    assert kl_names[1:] == [name for name in expected if name.startswith("msa_kl_")]
    for name in kl_names:
        assert float(expected[name]) > 0.01, name  # a KL, not zeros
        np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
