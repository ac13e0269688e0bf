"""Gradient accumulation (float32): k micro-batches give the whole batch's loss, gradients, router
loads, metrics and parameters, with rows of uneven loss weight so that a mean of micro-batch means
would not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_step import random_batch
from tiny import tiny_run

from batch_format.batch import Batch, VisionBatch, make_batch
from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.accumulation import accumulated, micro_batches
from pretrain.loss import loss_totals
from pretrain.metrics import read_metrics
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.train import train
from pretrain.train_step import init_state, make_loss_fn, make_train_step

MODE = ForwardMode(indexer_loss=True, block_recall=True)
MTP = {"mtp": {"num_modules": 1}}  # with MSA and MoE layers: every loss term and statistic


def uneven_batch() -> Batch:
    """4 rows of 32: full, half padding, three documents, mostly padding (loss 0 on padding)."""
    batch = random_batch(seed=3, batch=4)
    segment_ids = np.ones((4, 32), np.int32)
    segment_ids[1, 16:] = 0
    segment_ids[2, 10:20], segment_ids[2, 20:] = 2, 3
    segment_ids[3, 5:] = 0
    return batch._replace(
        segment_ids=jnp.asarray(segment_ids), loss_mask=jnp.asarray(segment_ids > 0, jnp.float32)
    )


def test_micro_batches_take_every_kth_row_of_every_field_the_vision_part_too():
    def numbered(dtype, *shape):  # each row filled with its row number
        return jnp.broadcast_to(jnp.arange(8).reshape(8, *[1] * len(shape)), (8, *shape)).astype(
            dtype
        )

    ids, vision = numbered(jnp.int32, 4), numbered(jnp.int32, 6)
    batch = make_batch(
        tokens=ids, targets=ids, positions=ids, segment_ids=ids,
        loss_mask=numbered(jnp.float32, 4), modality=numbered(jnp.int8, 4),
        vision=VisionBatch(numbered(jnp.float32, 6, 5), numbered(jnp.int32, 6, 3), vision, ids),
    )  # fmt: skip
    leaves = jax.tree.leaves(micro_batches(batch, 2))
    assert len(leaves) == len(Batch._fields) - 1 + len(VisionBatch._fields)
    for leaf in leaves:
        rows = leaf.reshape(2, 4, -1)[..., 0]
        np.testing.assert_array_equal(rows, [[0, 2, 4, 6], [1, 3, 5, 7]])


@pytest.mark.slow
def test_accumulated_loss_gradients_and_loads_equal_the_whole_batch():
    run = tiny_run(model=MTP)
    model = functional(run.model)
    params, buffers = model.init(0)
    loss_and_grad = jax.value_and_grad(make_loss_fn(model, run), has_aux=True)
    batch = uneven_batch()

    def parts_of(k):
        totals = loss_totals(batch, 1, k)
        return jax.jit(accumulated(loss_and_grad, k), static_argnums=3)(
            params, buffers, batch, MODE, totals
        )

    (loss, (metrics, loads)), grads = parts_of(1)
    (loss_2, (metrics_2, loads_2)), grads_2 = parts_of(2)
    np.testing.assert_allclose(loss_2, loss, rtol=2e-6)
    for name in ("nll", "mtp_nll", "msa_kl", "msa_recall_layer1", "msa_kl_mtp0", "z_loss"):
        np.testing.assert_allclose(metrics_2[name], metrics[name], rtol=2e-6, err_msg=name)
    for a, b in zip(jax.tree.leaves(loads_2), jax.tree.leaves(loads), strict=True):
        np.testing.assert_array_equal(a, b)  # counts: exact
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_2),
                            jax.tree.leaves(grads), strict=True):  # fmt: skip
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * scale + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))  # fmt: skip

    # the test can fail: a plain mean of the micro-batches' own means is 100× further off
    halves = micro_batches(batch, 2)
    own_means = jax.jit(lambda part: make_loss_fn(model, run)(
        params, buffers, part, MODE, loss_totals(part, 1, 1))[0])  # fmt: skip
    naive = sum(own_means(jax.tree.map(lambda x, i=i: x[i], halves)) for i in range(2)) / 2
    assert abs(float(naive - loss)) > 100 * 2e-6 * float(loss)


@pytest.mark.slow
def test_train_step_with_accumulation_updates_parameters_and_biases_as_the_whole_batch():
    def two_steps(k):
        run = tiny_run(model=MTP, train={"grad_accum_steps": k}, optimizer={"warmup_steps": 0})
        model = functional(run.model)
        optimizer = make_optimizer(run.optimizer, 10, model.param_axes)
        step = jax.jit(make_train_step(model, optimizer, learning_rate(run.optimizer, 10), run),
                       static_argnums=2)  # fmt: skip
        state = init_state(model, optimizer, seed=0)
        state, first = step(state, uneven_batch(), MODE)
        state, second = step(state, random_batch(seed=4, batch=4), MODE)
        return state, first, second

    state, first, second = two_steps(1)
    state_2, first_2, second_2 = two_steps(2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state_2["params"]),
                            jax.tree.leaves(state["params"]), strict=True):  # fmt: skip
        # AdamW scales each update to ~lr: where a gradient is ~0 its rounding noise is too,
        # so the tolerance is a share of lr (3e-3): observed at most 3.3e-5 (one element of a
        # q_proj, with the chunked loss's summation order; 6e-6 before it)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=jax.tree_util.keystr(path))
    for a, b in zip(jax.tree.leaves(state_2["buffers"]), jax.tree.leaves(state["buffers"])):
        np.testing.assert_array_equal(a, b)  # router biases: moved by the whole batch's load
    for ours, theirs in ((first_2, first), (second_2, second)):
        assert int(ours["tokens"]) == int(theirs["tokens"])  # every micro-batch counted
        for name in ("loss", "grad_norm", "expert_imbalance", "expert_imbalance_mtp0"):
            np.testing.assert_allclose(ours[name], theirs[name], rtol=2e-5, err_msg=name)
    assert int(first["tokens"]) == 32 + 16 + 32 + 5


@pytest.mark.slow
def test_training_with_accumulation_on_a_mesh_matches_the_whole_batch(tmp_path):
    """m3-train on 4 fake devices: 8 rows as 2 micro-batches of 4 (one row per device each)."""

    def losses(k):
        run = tiny_run(data={"batch_size": 8}, train={"steps": 3, "grad_accum_steps": k})
        summary = train(run, tmp_path / f"accumulate{k}")
        assert summary["end_step"] == 3
        return read_metrics(tmp_path / f"accumulate{k}" / "metrics.jsonl")

    whole, accumulated_ = losses(1), losses(2)
    np.testing.assert_allclose([r["loss"] for r in accumulated_], [r["loss"] for r in whole],
                               rtol=2e-5)  # fmt: skip
    assert [r["step"] for r in accumulated_] == [1, 2, 3]
