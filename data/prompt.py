"""A generation prompt from text, images and a video: token ids and pixel rows, transformers' names.

Laid out as a document of the training data begins (data/mm_documents.py, the same tokenizer,
processor and placeholder expansion): <bos>, the images in the order given, the video, then the
text, with no <eos> — the model continues the text. `m3jax.generate` takes the result:

    prompt = encode_prompt("A photo of", images=[jpeg_bytes], processor=DEMO_PROCESSOR)
    new_ids = m3jax.generate(config, weights, [prompt.input_ids], **prompt.media)

Shapes: S prompt tokens, N patch rows, n grid rows (an image, or a video chunk of <= 4 temporal
patches), D = C·T·P·P patch features.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from data.media import probe_video
from data.mm_documents import DocumentProcessor
from data.tokenizer import ByteTokenizer
from data.vision_processing import ProcessorConfig


@dataclasses.dataclass(frozen=True)
class Prompt:
    input_ids: np.ndarray  # [S] int32
    # pixel_values [N, D] / image_grid_thw [n, 3] and pixel_values_videos / video_grid_thw, when
    # the prompt has images / a video: the keyword arguments of m3jax.generate and m3jax.forward.
    media: dict[str, np.ndarray]


def encode_prompt(
    text: str,
    *,
    images: Sequence[bytes] = (),
    video: bytes | None = None,
    tokenizer=None,
    processor: ProcessorConfig = ProcessorConfig(),
) -> Prompt:
    """Token ids and vision inputs of a prompt; images and the video as encoded file bytes.

    tokenizer: the byte tokenizer by default. Raises data.media.MediaError for undecodable media.
    """
    tokenizer = tokenizer or ByteTokenizer()
    units = DocumentProcessor(tokenizer, processor, seq_len=0, patch_budget=0)
    segments = [{"type": "image", "bytes": data} for data in images]
    if video is not None:
        info = probe_video(video)
        segments.append(
            {"type": "video", "bytes": video, "fps": info.fps, "num_frames": info.num_frames}
        )
    if text:
        segments.append({"type": "text", "text": text})
    ids, items = [np.array([tokenizer.bos_id], np.int32)], {"image": [], "video": []}
    for segment in segments:
        for unit_ids, _, item in units.segment_units(segment):
            ids.append(np.asarray(unit_ids, np.int32))
            if item is not None:
                items[segment["type"]].append(item)
    media = {}
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                               ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        if items[kind]:
            media[pixels] = np.concatenate([item.patches for item in items[kind]])
            media[grid] = np.array([item.grid for item in items[kind]], np.int64)
    return Prompt(np.concatenate(ids), media)
