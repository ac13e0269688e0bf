"""M3 processors against numbers-only references written from spec §4.3 and §6.

The bicubic fixtures (literal pixels and SHA-256 digests) were produced by torch 2.13.0's
`F.interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)` on the CPU, the kernel
torchvision's resize calls for uint8 images; the other references are loops written from the spec.
"""

import hashlib

import numpy as np
import pytest

from data.bicubic import filter_taps, resize_bicubic_uint8
from data.vision_processing import (
    ProcessorConfig,
    normalize,
    patchify,
    process_image,
    process_video,
    sample_frame_indices,
    smart_resize,
)

M3 = ProcessorConfig()
TORCH_6x8_FROM_9x13_CHANNEL0 = [
    [39, 80, 84, 163, 78, 40, 117, 40],
    [79, 47, 79, 95, 161, 64, 51, 121],
    [74, 74, 48, 77, 101, 162, 59, 49],
    [149, 76, 70, 51, 77, 109, 155, 53],
    [126, 144, 75, 68, 54, 75, 115, 157],
    [38, 133, 135, 74, 63, 59, 75, 123],
]
TORCH_DIGESTS = {
    (5, 7, 28, 28): "6941175aaf7eba75ce8dabd6611daebe9536b05ee09eec867ca45159c0499e66",
    (333, 500, 336, 504): "6fc0d4b652cc7c83b1d33d667716341c2d82a6aa2116c81d7f59efe28bdc4e74",
    (300, 451, 56, 84): "4108b3af75c028b8b0bf5b4efd1310cf92e6da5730d0432784dd1c8065376d1d",
    (28, 28, 56, 28): "4859445ca60ee92b2a248cf5a9e8c9041a477b910347534810247fa27134e439",
}


def _pattern(height, width):
    i, j, c = np.meshgrid(np.arange(height), np.arange(width), np.arange(3), indexing="ij")
    return ((i * 37 + j * 91 + c * 53) ** 2 % 256).astype(np.uint8)


def _smart(height, width, config=M3):
    return smart_resize(
        height,
        width,
        factor=28,
        min_pixels=config.image_min_pixels,
        max_pixels=config.image_max_pixels,
    )


# ---------------------------------------------------------------------------------------------
# smart_resize and bicubic.


@pytest.mark.parametrize(
    "size, resized, tokens",
    [((500, 333), (504, 336), 216), ((2000, 3000), (532, 812), 551), ((28, 28), (56, 56), 4)],
)
def test_smart_resize_matches_spec_examples(size, resized, tokens):
    assert _smart(*size) == resized
    assert resized[0] * resized[1] // (28 * 28) == tokens


def test_smart_resize_rounds_half_to_even_and_rejects_extreme_aspect():
    assert _smart(70, 420) == (56, 420)  # 70/28 = 2.5 -> 2 (Python round)
    assert _smart(98, 420) == (112, 420)  # 3.5 -> 4
    with pytest.raises(ValueError, match="aspect ratio"):
        _smart(10, 2010)


def test_bicubic_matches_torch_pixels():
    out = resize_bicubic_uint8(_pattern(9, 13), 6, 8)
    assert out[..., 0].tolist() == TORCH_6x8_FROM_9x13_CHANNEL0


@pytest.mark.parametrize("shape", sorted(TORCH_DIGESTS))
def test_bicubic_matches_torch_digests(shape):
    height, width, out_height, out_width = shape
    out = resize_bicubic_uint8(_pattern(height, width), out_height, out_width)
    assert hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest() == TORCH_DIGESTS[shape]


def test_bicubic_weights_follow_keys_kernel_with_scaled_support():
    first, weights, bits = filter_taps(100, 25)  # downscale 4: support 8 -> 16 taps
    assert weights.shape == (25, 16) and bits <= 22
    np.testing.assert_allclose(weights.sum(axis=1) / 2**bits, 1.0, atol=1e-4)
    assert first[0] == 0 and first[10] == int(4 * 10.5 - 8 + 0.5)
    constant = np.full((30, 40, 3), 77, np.uint8)
    assert (resize_bicubic_uint8(constant, 56, 28) == 77).all()


# ---------------------------------------------------------------------------------------------
# Normalisation and patch order.


def test_normalize_is_clip_in_float32():
    out = normalize(np.array([[[0, 128, 255]]], np.uint8))
    expected = [(0 - 0.48145466 * 255) / (0.26862954 * 255), (128 - 0.4578275 * 255) / (0.26130258 * 255),
                (255 - 0.40821073 * 255) / (0.27577711 * 255)]  # fmt: skip
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-6)


def _reference_patches(frames):
    """Spec §4.3 / §6: rows block-major over 2x2 windows, features (c, t, y, x); loops only."""
    num_frames, height, width, _ = frames.shape
    rows = []
    for tt in range(num_frames // 2):
        for block_row in range(height // 28):
            for block_col in range(width // 28):
                for in_row in range(2):
                    for in_col in range(2):
                        y0, x0 = (block_row * 2 + in_row) * 14, (block_col * 2 + in_col) * 14
                        row = [
                            frames[tt * 2 + t, y0 + y, x0 + x, c]
                            for c in range(3)
                            for t in range(2)
                            for y in range(14)
                            for x in range(14)
                        ]
                        rows.append(row)
    return np.array(rows, np.float32)


def test_patchify_matches_spec_order():
    frames = np.random.default_rng(0).normal(size=(4, 56, 84, 3)).astype(np.float32)
    patches, grid = patchify(frames, M3)
    assert grid == (2, 4, 6) and patches.shape == (48, 1176)
    np.testing.assert_array_equal(patches, _reference_patches(frames))


def test_process_image_repeats_the_frame_and_counts_tokens():
    rgb = np.random.default_rng(1).integers(0, 256, (500, 333, 3), dtype=np.uint8)
    item = process_image(rgb, M3)
    assert item.grid == (1, 36, 24) and item.patches.shape == (864, 1176)
    assert item.patches.shape[0] // 4 == 216
    halves = item.patches.reshape(864, 3, 2, 196)
    np.testing.assert_array_equal(halves[:, :, 0], halves[:, :, 1])
    expected = _reference_patches(
        np.repeat(normalize(resize_bicubic_uint8(rgb, 504, 336))[None], 2, 0)
    )
    np.testing.assert_array_equal(item.patches, expected)


# ---------------------------------------------------------------------------------------------
# Videos.


def test_video_nine_frames_give_five_temporal_patches_in_two_chunks():
    frames = np.random.default_rng(2).integers(0, 256, (9, 56, 56, 3), dtype=np.uint8)
    items = process_video(frames, np.arange(9), 2.0, ProcessorConfig(video_fps=None))
    assert [item.grid for item in items] == [(4, 4, 4), (1, 4, 4)]
    assert [len(item.timestamps) for item in items] == [4, 1]
    stamps = [s for item in items for s in item.timestamps]
    assert stamps == [f"]<]{t:.1f} seconds[>[" for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    last = items[1].patches.reshape(16, 3, 2, 196)  # odd frame padded by repeating the last
    np.testing.assert_array_equal(last[:, :, 0], last[:, :, 1])
    pixels = normalize(frames)
    padded = np.concatenate([pixels, pixels[-1:]])
    np.testing.assert_array_equal(items[0].patches, _reference_patches(padded[:8]))


def test_frame_sampling_follows_hf_uniform_sampler():
    config = ProcessorConfig(video_fps=1.0)
    assert sample_frame_indices(30, 10.0, config).tolist() == [0, 10, 20]
    assert sample_frame_indices(5, 25.0, config).tolist() == [0]  # max(1, int(0.2))
    capped = ProcessorConfig(video_fps=None, max_video_frames=4)
    assert sample_frame_indices(10, 25.0, capped).tolist() == [0, 2, 5, 7]
