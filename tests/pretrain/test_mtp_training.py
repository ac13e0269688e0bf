"""Training with multi-token-prediction modules: their loss, their router biases, and a resumed run
that equals the uninterrupted one (MTP parameters and biases in the checkpoint)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import restored_params, tree_equal
from test_train_step import random_batch
from tiny import tiny_run

from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.loss import mtp_targets, token_losses
from pretrain.metrics import read_metrics
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.train import train
from pretrain.train_step import init_state, make_train_step

RUN = tiny_run(model={"mtp": {"num_modules": 2}}, optimizer={"warmup_steps": 0})


def test_mtp_loss_and_router_biases_train_the_modules():
    model = functional(RUN.model)
    optimizer = make_optimizer(RUN.optimizer, 10, model.param_axes)
    step = jax.jit(make_train_step(model, optimizer, learning_rate(RUN.optimizer, 10), RUN),
                   static_argnums=2)  # fmt: skip
    state, batch = init_state(model, optimizer, seed=0), random_batch()
    new_state, metrics = step(state, batch, ForwardMode(indexer_loss=True))
    params, buffers = state["params"], state["buffers"]
    _, _, outputs = model.apply_normed_with_mtp(
        params, buffers, batch.tokens, batch.positions, batch.segment_ids
    )
    for depth in (0, 1):
        targets, weight = mtp_targets(batch, depth)
        logits = model.head(params, buffers, outputs[depth].normed)
        nll = np.asarray(token_losses(logits, targets)[0])
        expected = (nll * weight).sum() / weight.sum()
        np.testing.assert_allclose(metrics[f"mtp_nll{depth}"], expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["mtp_nll"], (metrics["mtp_nll0"] + metrics["mtp_nll1"]) / 2)
    assert {"expert_imbalance_mtp1", "msa_kl_mtp0", "msa_kl_layer1"} <= set(metrics)
    bias = new_state["buffers"]["mtp"]["depths"][1]["layer"]["mlp"]["correction_bias"]
    assert 0 < np.abs(np.asarray(bias)).max() <= RUN.model.moe.bias_update_rate  # moved, ≤ rate
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state["params"]["mtp"],
                         new_state["params"]["mtp"])  # fmt: skip
    assert all(jax.tree.leaves(moved))


@pytest.mark.slow
def test_mtp_training_resumes_exactly(tmp_path):
    run = tiny_run(model={"mtp": {"num_modules": 1}}, train={"steps": 4},
                   checkpoint={"every_steps": 2})  # fmt: skip
    train(run, tmp_path / "straight")
    interrupted = tmp_path / "interrupted"
    train(run, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "4")
    assert train(run, interrupted)["start_step"] == 2
    straight = restored_params(tmp_path / "straight", 4)
    assert "mtp" in straight and tree_equal(straight, restored_params(interrupted, 4))
    records = read_metrics(interrupted / "metrics.jsonl")
    assert [r["mtp_nll"] for r in records] == [
        r["mtp_nll"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")
    ]
