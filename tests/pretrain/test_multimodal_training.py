"""Native multimodal training end to end on the demo shard sets: vision inputs reach the model,
per-modality metrics are logged, and a resumed run equals the uninterrupted one."""

import shutil

import numpy as np
import pytest

from m3jax.config_loading import ConfigError
from pretrain.config import RunError
from pretrain.data_loading import make_loader
from pretrain.metrics import read_metrics
from pretrain.train import train
from test_train import restored_params, tree_equal
from tiny import _merged, tiny_vision_run

DEMO_DATA = {
    "shards": ["demo:multimodal", "demo:text"],
    "weights": [0.97, 0.03],
    "patch_budget": 256,  # a demo video chunk needs up to 144 patches
    "seq_len": 64,
    "batch_size": 4,
    "processor": {"image_max_pixels": 12544, "video_max_pixels": 7056, "video_fps": 2.0,
                  "max_video_frames": 16},
}  # fmt: skip
PLACEHOLDERS = {"vision": {"image_token_id": 259, "video_token_id": 260}}  # the byte tokenizer's


def multimodal_run(**sections):
    return tiny_vision_run(**_merged({"model": PLACEHOLDERS, "data": DEMO_DATA}, sections))


def test_multimodal_batches_carry_patches_for_the_vision_tower():
    batch = next(make_loader(multimodal_run()))
    assert batch.vision.patches.shape == (4, 256, 1176)
    assert (batch.vision.feature_index >= 0).sum() * 4 <= (batch.vision.patch_segment_ids > 0).sum()
    assert (batch.modality[batch.vision.feature_index >= 0] > 0).all()
    assert not batch.loss_mask[batch.vision.feature_index >= 0].any()  # placeholders: no loss


@pytest.mark.slow
def test_multimodal_training_logs_modalities_and_resumes_exactly(tmp_path):
    """With what a real run uses and tiny_run turns off: asynchronous saves (the default) and Grain
    worker processes, whose prefetching runs ahead of the batch the checkpoint records."""
    run = multimodal_run(
        train={"steps": 4}, checkpoint={"every_steps": 2, "async_save": True}, data={"workers": 2}
    )
    summary = train(run, tmp_path / "straight")
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert sum(r["image_tokens"] + r["video_tokens"] for r in records) > 0
    assert {"nll_text_docs", "nll_image_docs", "nll_video_docs", "text_tokens"} <= set(records[-1])
    assert 0.99 * 4 * 4 * 64 < sum(summary["modality_tokens"].values()) <= 4 * 4 * 64  # less pads
    interrupted = tmp_path / "interrupted"
    train(run, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "4")  # killed after the step-2 checkpoint
    assert train(run, interrupted)["start_step"] == 2
    assert tree_equal(restored_params(tmp_path / "straight", 4), restored_params(interrupted, 4))
    resumed = read_metrics(interrupted / "metrics.jsonl")
    np.testing.assert_array_equal([r["loss"] for r in resumed], [r["loss"] for r in records])


def test_multimodal_config_errors_name_the_field():
    with pytest.raises(RunError, match="model.vision.image_token_id=270 is not the tokenizer's"):
        make_loader(tiny_vision_run(data=DEMO_DATA))
    with pytest.raises(ConfigError, match="needs a model.vision tower"):
        tiny_vision_run(model={"vision": None}, data=DEMO_DATA)
    with pytest.raises(RunError, match="unknown demo shard set 'demo:nope'"):
        make_loader(multimodal_run(data={"shards": ["demo:nope"], "weights": []}))
