"""Held-out evaluation: the mean over every held-out target of fixed batches, by document kind and
modality, with MSA recall; it updates nothing and leaves training exactly as without it."""

import jax
import numpy as np
import pytest
from test_multimodal_training import multimodal_run

from m3jax.model import functional
from m3jax.vision_inputs import from_packed_rows
from pretrain.checkpointing import Checkpoints
from pretrain.evaluation import Evaluator
from pretrain.loss import document_kinds, token_losses
from pretrain.metrics import read_metrics
from pretrain.session import TrainingSession
from pretrain.train import train

EVAL = {"shards": ["demo:heldout"], "every_steps": 2, "batches": 3}


def test_evaluation_is_the_mean_over_all_held_out_targets_and_updates_nothing(tmp_path):
    run = multimodal_run(eval=EVAL, data={"batch_size": 8, "seq_len": 128})  # ~ all held-out docs
    session = TrainingSession(functional(run.model), run, Checkpoints(tmp_path, run.checkpoint))
    session.initialize()
    before = jax.device_get(session.state)
    evaluator = Evaluator(session, run)
    first, second = evaluator(), evaluator()
    np.testing.assert_equal(second, first)  # the same batches every time
    for a, b in zip(jax.tree.leaves(jax.device_get(session.state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)

    nll, weight, kinds = [], [], []
    model, merge = functional(run.model), run.model.vision.spatial_merge_size
    for batch in evaluator.batches:
        vision = from_packed_rows(batch.vision, merge)
        logits, _ = model.apply(before["params"], before["buffers"], batch.tokens,
                                batch.positions, batch.segment_ids, vision)  # fmt: skip
        nll.append(np.asarray(token_losses(logits, batch.targets)[0]))
        weight.append(batch.loss_mask)
        kinds.append(np.asarray(document_kinds(batch.segment_ids, batch.modality)))
    nll, weight, kinds = map(np.concatenate, (nll, weight, kinds))
    np.testing.assert_allclose(first["eval_nll"], (nll * weight).sum() / weight.sum(), rtol=1e-5)
    for code, kind in enumerate(("text", "image", "video")):
        of_kind = weight * (kinds == code)
        assert of_kind.sum() > 0, kind  # the held-out set has every kind of document
        expected = (nll * of_kind).sum() / of_kind.sum()
        np.testing.assert_allclose(first[f"eval_nll_{kind}_docs"], expected, rtol=1e-5)
    assert {"eval_nll_after_image", "eval_nll_after_video", "eval_msa_recall_layer1"} <= set(first)
    assert 0 < first["eval_msa_recall"] <= 1


@pytest.mark.slow
def test_training_logs_evaluations_and_trains_exactly_as_without_them(tmp_path):
    run = multimodal_run(train={"steps": 4}, eval=EVAL, logging={"msa_recall_every": 0})
    summary = train(run, tmp_path / "with_eval")
    records = read_metrics(tmp_path / "with_eval" / "metrics.jsonl")
    evaluations = [r for r in records if "eval_nll" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    assert summary["last_eval_nll"] == evaluations[-1]["eval_nll"]
    assert evaluations[1]["eval_nll"] < evaluations[0]["eval_nll"]  # training helps held-out
    plain = train(multimodal_run(train={"steps": 4}, logging={"msa_recall_every": 0}),
                  tmp_path / "plain")  # fmt: skip
    assert plain["last_eval_nll"] is None
    losses = [r["loss"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl")]
    assert [r["loss"] for r in records if "loss" in r] == losses
