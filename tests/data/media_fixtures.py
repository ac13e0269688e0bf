"""Synthetic media, documents and shard-set fixtures for the data tests (random pixels, no files).

Not a conftest.py: other test folders import `conftest` by name (for REPO), so a second
conftest module here would shadow theirs.
"""

import io

import numpy as np
import PIL.Image
import pytest

from data.media import encode_video
from data.shard_builder import ShardSetWriter, index_row, write_documents
from data.shard_format import encode_record
from data.shard_inputs import InputDocument
from data.vision_processing import ProcessorConfig

# Tiny budgets: an image is 4..16 placeholder tokens, a video frame pair 4.
TINY = ProcessorConfig(
    image_min_pixels=56 * 56,
    image_max_pixels=56 * 56 * 4,
    video_min_pixels=56 * 56,
    video_max_pixels=56 * 56,
    video_fps=4.0,
    max_video_frames=12,
)


def png_bytes(rng, height, width) -> bytes:
    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def video_bytes(rng, frames, height=48, width=64, fps=8.0) -> bytes:
    pixels = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    return encode_video(pixels, fps)


def multimodal_documents(count: int, seed: int = 0) -> list[InputDocument]:
    """Interleaved documents: text, 0-2 images, sometimes a video, text-only ones too."""
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(count):
        words = " ".join(f"w{i}x{j}" for j in range(int(rng.integers(3, 60))))
        segments = [("text", f"doc {i}: {words}")]
        for _ in range(int(rng.integers(0, 3)) if i % 4 else 0):
            segments.append(("image", png_bytes(rng, *rng.integers(20, 160, 2))))
            segments.append(("text", f" after image in {i}."))
        if i % 5 == 2:
            segments.append(("video", video_bytes(rng, int(rng.integers(2, 12)))))
        documents.append(
            InputDocument(f"doc{i}", f"doc{i}", "tests", "CC0-1.0", {"i": i}, tuple(segments))
        )
    return documents


@pytest.fixture(scope="session")
def mm_shards(tmp_path_factory):
    """24 interleaved documents in several shards."""
    path = tmp_path_factory.mktemp("shards") / "mm"
    write_documents(multimodal_documents(24), path, shard_size=60_000, processor=TINY)
    return path


@pytest.fixture(scope="session")
def text_shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("shards") / "text"
    documents = [
        InputDocument(
            f"t{i}", f"t{i}", "tests", "CC0-1.0", {}, (("text", f"text doc {i} " * (i + 1)),)
        )
        for i in range(30)
    ]
    write_documents(documents, path, shard_size=1_000, processor=TINY)
    return path


@pytest.fixture
def broken_record_shards(tmp_path):
    """Three documents; the second holds an image whose bytes do not decode."""
    rng = np.random.default_rng(0)
    writer = ShardSetWriter(tmp_path / "broken", shard_size=1 << 20, processor=TINY, info={})
    for i in range(3):
        image = png_bytes(rng, 40, 40) if i != 1 else b"\x89PNG but not really"
        record = {"doc_id": f"d{i}", "source": "t", "license": "CC0", "meta": {},
                  "segments": [{"type": "text", "text": f"doc {i}"},
                               {"type": "image", "bytes": image, "format": "png", "height": 40,
                                "width": 40}]}  # fmt: skip
        data = encode_record(record)
        writer.add(data, index_row(record, len(data), TINY))
    writer.close()
    return tmp_path / "broken"
