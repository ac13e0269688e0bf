"""MSA training: the indexer's KL trains only the indexer, the dense warm-up, and its checkpointing."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.metrics import read_metrics
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.train import train
from pretrain.train_step import init_state, make_train_step
from test_train_step import random_batch
from tiny import tiny_run

TRAIN = ForwardMode(indexer_loss=True)


def is_indexer(path) -> bool:
    return "indexer" in jax.tree_util.keystr(path)


def test_indexer_kl_gradient_reaches_only_the_indexer():
    run = tiny_run()
    model = functional(run.model)
    params, buffers = model.init(0)
    batch = random_batch()

    def total_kl(params):
        _, stats = model.apply(
            params, buffers, batch.tokens, batch.positions, batch.segment_ids, mode=TRAIN
        )
        return sum(s.msa.kl.sum() for s in stats if s.msa is not None)

    grads = jax.grad(total_kl)(params)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert all(not jnp.any(g) for path, g in flat if not is_indexer(path))
    assert all(jnp.any(g) for path, g in flat if is_indexer(path))  # projections and both norms


def one_step(kl_weight: float) -> dict:
    run = tiny_run(
        model={"msa": {"kl_weight": kl_weight}},
        optimizer={"clip_norm": 1e9, "weight_decay": 0.0, "warmup_steps": 0},
    )
    model = functional(run.model)
    optimizer = make_optimizer(run.optimizer, 10, model.param_axes)
    step = jax.jit(
        make_train_step(model, optimizer, learning_rate(run.optimizer, 10), run), static_argnums=2
    )
    new_state, metrics = step(init_state(model, optimizer, seed=0), random_batch(), TRAIN)
    return new_state["params"], metrics


def test_backbone_update_is_identical_with_and_without_the_kl_loss():
    params_without, metrics_without = one_step(0.0)
    params_with, metrics_with = one_step(1.0)
    assert metrics_with["loss"] > metrics_without["loss"]  # the KL term is really in the loss
    np.testing.assert_allclose(metrics_with["msa_kl"], metrics_without["msa_kl"], rtol=1e-6)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(params_without),
        jax.tree_util.tree_leaves_with_path(params_with),
    ):
        if is_indexer(path):
            continue
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    indexer_without = params_without["stacks"][1]["layers"]["attention"]["indexer"]["q_proj"]
    indexer_with = params_with["stacks"][1]["layers"]["attention"]["indexer"]["q_proj"]
    assert not np.array_equal(indexer_without, indexer_with)  # only the KL moves the indexer


def test_dense_warmup_attends_to_every_causal_block():
    run = tiny_run()
    everything = tiny_run(model={"msa": {"topk_blocks": 64}}).model
    params, buffers = functional(run.model).init(0)
    batch = random_batch()
    args = (params, buffers, batch.tokens, batch.positions, batch.segment_ids)
    warmup, _ = functional(run.model).apply(*args, mode=ForwardMode(msa_dense=True))
    sparse, _ = functional(run.model).apply(*args, mode=ForwardMode())
    dense, _ = functional(everything).apply(*args, mode=ForwardMode())
    np.testing.assert_allclose(warmup, dense, atol=1e-5)
    assert float(jnp.abs(warmup - sparse).max()) > 1e-3  # seq 32 > 2 blocks · 4: selection matters


def test_warmup_switches_at_warmup_tokens_and_is_checkpointed(tmp_path):
    tokens_per_step = 4 * 32
    run = tiny_run(
        model={"msa": {"warmup_tokens": 2 * tokens_per_step}},
        logging={"every_steps": 1, "msa_recall_every": 2},
    )
    train(run, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["msa_warmup"] for r in records] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [("msa_recall" in r) for r in records] == [False, True, False, True, False, True]
    assert all(r["msa_kl"] > 0 and "msa_kl_layer1" in r for r in records)
    progress = json.loads((tmp_path / "run/checkpoints/3/progress/metadata").read_text())
    assert progress["tokens_seen"] == 3 * tokens_per_step and progress["msa_phase"] == "sparse"
