"""The demo corpus: built offline from files inside installed wheels, licensed per record."""

import numpy as np
import pytest

from data.demo_corpus import DEMO_PROCESSOR, demo_shard_sets, skimage_images, synthetic_clips
from data.media import probe_video
from data.mm_loader import MultimodalLoader, ShardSource
from data.shard_format import decode_record
from data.shard_reader import ShardSet


def test_skimage_captions_and_licences_come_from_docstrings():
    images = skimage_images()
    path, caption, license = images["astronaut"]
    assert path.is_file() and caption.startswith("Color image of the astronaut Eileen Collins.")
    assert "public domain" in license
    assert len(images) >= 20


def test_synthetic_clips_decode():
    _, caption, data = synthetic_clips()[0]
    info = probe_video(data)
    assert (info.num_frames, info.height, info.width, info.fps) == (24, 96, 96, 8.0)
    assert caption == "A red circle moves left to right over a dark blue background."


@pytest.mark.slow
def test_demo_corpus_builds_once_and_trains_a_loader(tmp_path):
    paths = demo_shard_sets(tmp_path, progress=False)
    mm, text = ShardSet(paths["multimodal"]), ShardSet(paths["text"])
    assert len(text) == 781 and mm.index["images"].sum() >= 30 and mm.index["videos"].sum() >= 10
    licences = {decode_record(mm[i].data)["license"] for i in range(len(mm))}
    assert all(licences) and any("CC-BY-3.0" in x for x in licences)
    assert demo_shard_sets(tmp_path, progress=False) == paths  # cached: no rebuild
    loader = MultimodalLoader(
        [ShardSource(str(paths["multimodal"]), 0.9), ShardSource(str(paths["text"]), 0.1)],
        seq_len=256, batch_size=4, patch_budget=256, seed=0, processor=DEMO_PROCESSOR,
        shard_index=0, shard_count=1,
    )  # fmt: skip
    modality = np.concatenate([next(loader).modality.ravel() for _ in range(8)])
    assert {0, 1, 2} <= set(modality.tolist())
