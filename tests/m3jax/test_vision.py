"""Vision inputs and the vision path of the model (exact transformers parity: tests/interop).

Host-side packing (patch order, segments, placeholder index, errors naming the argument) and
properties transformers' API cannot show: padding the patch budget changes nothing, and an image's
features do not depend on the other images of the batch (ViT attention stays in its segment).
"""

import jax
import numpy as np
import pytest
from tiny import tiny_vision_run

import m3jax
from batch_format.batch import VisionBatch
from batch_format.vision import grid_positions
from m3jax.convert.layout import leaf_shapes, nested
from m3jax.model import functional
from m3jax.vision_inputs import from_packed_rows, pack_vision_inputs

IMAGE, VIDEO = 270, 271
CONFIG = tiny_vision_run().model
VISION = CONFIG.vision


def pixels(grid, seed=0):
    rows = int(np.prod(np.asarray(grid), axis=-1).sum())
    return np.random.default_rng(seed).normal(size=(rows, 1176)).astype(np.float32)


def test_pack_vision_inputs_orders_images_then_videos_batch_major():
    ids = np.zeros((2, 10), np.int64)
    ids[0, 1], ids[0, 6:8] = VIDEO, IMAGE  # row 0: a video token, later two image tokens
    ids[1, 2:4] = IMAGE
    ids[1, 5] = VIDEO
    image_grid, video_grid = np.array([[1, 2, 4], [1, 2, 4]]), np.array([[1, 2, 2], [1, 2, 2]])
    packed = pack_vision_inputs(
        ids, VISION, pixel_values=pixels(image_grid), image_grid_thw=image_grid,
        pixel_values_videos=pixels(video_grid, 1), video_grid_thw=video_grid, patch_budget=28,
    )  # fmt: skip
    # 4 image feature rows (2 per image) first, then 2 video rows; placeholders filled batch-major.
    expected = np.full((2, 10), -1)
    expected[0, 6:8], expected[1, 2:4] = [0, 1], [2, 3]
    expected[0, 1], expected[1, 5] = 4, 5
    np.testing.assert_array_equal(packed.token_index, expected)
    np.testing.assert_array_equal(
        packed.segment_ids,
        [[1] * 8 + [2] * 8 + [3] * 4 + [4] * 4 + [0] * 4],  # one patch row
    )
    assert packed.patches.shape == (1, 28, 1176) and not packed.patches[0, 24:].any()
    np.testing.assert_array_equal(packed.patches[0, 16:20], pixels(video_grid, 1)[:4])


@pytest.mark.parametrize(
    "ids_images, kwargs, message",
    [
        (
            3,
            {"grid": [[1, 2, 4]]},
            r"3 image placeholder tokens \(id 270\) but image_grid_thw gives 2",
        ),
        (2, {"grid": [[1, 2, 3]]}, r"image_grid_thw\[0\] = \[1, 2, 3\]: h and w must be multiples"),
        (2, {"grid": [[1, 2, 4]], "rows": 7}, r"pixel_values has shape \[7, 1176\], but"),
        (
            2,
            {"grid": [[1, 2, 4]], "no_pixels": True},
            "image_grid_thw was given without pixel_values",
        ),
        (2, {"grid": [[1, 2, 4]], "budget": 6}, "patch_budget=6 must be a multiple of 4"),
        (2, {}, r"2 image placeholder tokens \(id 270\) but image_grid_thw gives 0"),
    ],
)
def test_pack_vision_inputs_errors_name_the_argument(ids_images, kwargs, message):
    ids = np.zeros((1, 8), np.int64)
    ids[0, :ids_images] = IMAGE
    grid = np.array(kwargs["grid"]) if "grid" in kwargs else None
    pixel_values = None
    if grid is not None and not kwargs.get("no_pixels"):
        pixel_values = pixels(grid)[: kwargs.get("rows")]
    with pytest.raises(ValueError, match=message):
        pack_vision_inputs(
            ids, VISION, pixel_values=pixel_values, image_grid_thw=grid,
            patch_budget=kwargs.get("budget"),
        )  # fmt: skip


@pytest.fixture(scope="module")
def weights():
    """Random weights without compiling `init` (which costs ~15 s on CPU)."""
    rng = np.random.default_rng(0)
    shapes = leaf_shapes(CONFIG).items()
    return nested({leaf: rng.normal(0, 0.2, shape).astype(np.float32) for leaf, shape in shapes})


def test_model_padding_the_patch_budget_and_other_images_change_nothing(weights):
    """Two images in one batch give each image's tokens the same logits as alone, with or without
    padding patches: ViT attention stays inside its segment, padding is invisible."""
    grid_a, grid_b = np.array([[1, 2, 4]]), np.array([[2, 2, 2]])
    pixels_a, pixels_b = pixels(grid_a, 0), pixels(grid_b, 1)
    ids_a = np.array([[5, IMAGE, IMAGE, 6, 7, 8]])
    ids_b = np.array([[9, IMAGE, IMAGE, 10, 11, 12]])
    alone_a = m3jax.forward(CONFIG, weights, ids_a, pixels_a, grid_a)
    padded_a = m3jax.forward(CONFIG, weights, ids_a, pixels_a, grid_a, patch_budget=24)
    both = m3jax.forward(
        CONFIG, weights, np.concatenate([ids_a, ids_b]),
        np.concatenate([pixels_a, pixels_b]), np.concatenate([grid_a, grid_b]),
    )  # fmt: skip
    np.testing.assert_allclose(padded_a, alone_a, rtol=0, atol=1e-5)
    np.testing.assert_allclose(both[:1], alone_a, rtol=0, atol=1e-5)
    text_only = m3jax.forward(CONFIG, weights, np.where(ids_a == IMAGE, 0, ids_a))
    assert np.abs(np.asarray(text_only) - np.asarray(alone_a)).max() > 1e-2  # features matter


def test_model_text_only_rejects_pixels_and_vision_model_rejects_lonely_placeholders(weights):
    text_config = tiny_vision_run(model={"vision": None}).model
    text_params, text_buffers = jax.eval_shape(functional(text_config).init, 0)
    grid = np.array([[1, 2, 4]])
    with pytest.raises(ValueError, match="the model is text-only"):
        m3jax.forward(text_config, {"params": text_params, "buffers": text_buffers},
                      np.array([[IMAGE, IMAGE]]), pixels(grid), grid)  # fmt: skip
    with pytest.raises(ValueError, match="2 image placeholder tokens"):
        m3jax.forward(CONFIG, weights, np.array([[IMAGE, IMAGE, 3]]))


def test_training_rows_layout_gives_the_same_embeddings_as_one_packed_row(weights):
    """from_packed_rows (one patch row per training row, row-local feature indices, as the data
    pipeline delivers) and pack_vision_inputs (everything in one row) embed identically."""
    grid_a, grid_b = np.array([[1, 2, 4]]), np.array([[2, 2, 2]])  # an image; a 2-frame video
    pixels_a, pixels_b = pixels(grid_a, 3), pixels(grid_b, 4)
    ids = np.array([[5, IMAGE, IMAGE, 6, 7, 8], [9, 10, VIDEO, VIDEO, 11, 12]])
    budget = 16
    one_row = pack_vision_inputs(
        ids, VISION, pixel_values=pixels_a, image_grid_thw=grid_a, pixel_values_videos=pixels_b,
        video_grid_thw=grid_b,
    )  # fmt: skip

    def row(pixel_rows, grid):
        pad = budget - len(pixel_rows)
        return (
            np.pad(pixel_rows, ((0, pad), (0, 0))),
            np.pad(grid_positions(grid, 2), ((0, pad), (0, 0))),
            np.pad(np.ones(len(pixel_rows), np.int32), (0, pad)),
        )

    (patches_a, positions_a, segments_a), (patches_b, positions_b, segments_b) = (
        row(pixels_a, grid_a), row(pixels_b, grid_b)
    )  # fmt: skip
    feature_index = np.full(ids.shape, -1, np.int32)
    feature_index[0, 1:3], feature_index[1, 2:4] = [0, 1], [0, 1]  # row-local merged rows
    packed = VisionBatch(
        np.stack([patches_a, patches_b]), np.stack([positions_a, positions_b]),
        np.stack([segments_a, segments_b]), feature_index,
    )  # fmt: skip
    rows = from_packed_rows(packed, merge_size=2)
    model = functional(CONFIG)
    expected = model.embeddings(weights["params"], weights["buffers"], ids, one_row)
    got = model.embeddings(weights["params"], weights["buffers"], ids, rows)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert np.abs(np.asarray(got[0, 1]) - np.asarray(got[0, 0])).max() > 1e-3  # features landed
