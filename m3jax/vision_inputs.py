"""Host-side (NumPy) preparation of vision inputs: transformers' arguments -> static-shape arrays.

transformers' MiniMax-M3-VL takes `pixel_values` [Σ t·h·w, patch_dim] with `image_grid_thw` [U, 3]
(and the same for videos, one grid row per chunk of at most 4 temporal patches). The jit-able
model core instead takes `VisionInputs`: patches in B rows of a fixed patch budget (one row here;
one per training row in training batches), each patch's (t, h, w) ViT position and segment id (one
id per grid row; 0 = padding), and for every token the row of the merged feature matrix (all B
rows' merged features, in order) that replaces its embedding (-1 = text token). Feature rows are
all images' in `image_grid_thw` order, then all videos'; placeholders are filled batch-major, in
order, as transformers' masked_scatter does (spec §5.3).

Shapes: B batch, S sequence, P patch budget, U vision units (grid rows: an image or a video chunk),
m spatial merge size; `patch_dim` = 3·temporal_patch_size·patch_size² pixel features.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from batch_format.batch import VisionBatch
from batch_format.vision import grid_positions
from m3jax.config import VisionConfig


class VisionInputs(NamedTuple):
    """What the model core needs for vision; a pytree of arrays, so it passes through jit."""

    patches: np.ndarray  # [B, P, patch_dim] float32 pixel rows, zero rows for padding
    positions: np.ndarray  # [B, P, 3] int32 (t, h, w) inside the patch's grid row
    segment_ids: np.ndarray  # [B, P] int32: 1.. per grid row within a row, 0 = padding
    token_index: np.ndarray  # [B, S] int32: merged feature row (of B·P/m²), -1 = text token


def pack_vision_inputs(
    input_ids: np.ndarray,
    vision: VisionConfig,
    *,
    pixel_values: np.ndarray | None = None,
    image_grid_thw: np.ndarray | None = None,
    pixel_values_videos: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    patch_budget: int | None = None,
) -> VisionInputs | None:
    """transformers-named inputs -> VisionInputs, or None when there is no image and no video.

    patch_budget: pad the patches to this many rows (a multiple of m²; default: no padding).
    Raises ValueError naming the argument when shapes, grids or placeholder counts disagree.
    """
    input_ids = np.asarray(input_ids)
    media = [
        _checked_media(kind, pixels, grid, vision)
        for kind, pixels, grid in (
            ("image", pixel_values, image_grid_thw),
            ("video", pixel_values_videos, video_grid_thw),
        )
    ]
    window = vision.spatial_merge_size**2
    token_index = np.full(input_ids.shape, -1, np.int32)
    first_row = 0
    for (kind, _, grid), token_id in zip(media, (vision.image_token_id, vision.video_token_id)):
        placeholders = input_ids == token_id
        num_features = int(np.prod(grid, axis=-1).sum()) // window
        if placeholders.sum() != num_features:
            raise ValueError(
                f"input_ids has {placeholders.sum()} {kind} placeholder tokens (id {token_id}) "
                f"but {kind}_grid_thw gives {num_features} {kind} feature rows "
                f"(t·h·w / {window} per grid row)"
            )
        token_index[placeholders] = first_row + np.arange(num_features, dtype=np.int32)
        first_row += num_features
    if first_row == 0:
        return None
    grids = np.concatenate([grid for _, _, grid in media])
    patches = np.concatenate([pixels for _, pixels, _ in media]).astype(np.float32)
    lengths = np.prod(grids, axis=-1)
    segment_ids = np.repeat(np.arange(1, len(grids) + 1, dtype=np.int32), lengths)
    positions = grid_positions(grids, vision.spatial_merge_size)
    budget = len(patches) if patch_budget is None else patch_budget
    if budget < len(patches) or budget % window:
        raise ValueError(
            f"patch_budget={patch_budget} must be a multiple of {window} and at least the "
            f"{len(patches)} patches given"
        )
    pad = budget - len(patches)
    return VisionInputs(
        patches=np.pad(patches, ((0, pad), (0, 0)))[None],
        positions=np.pad(positions, ((0, pad), (0, 0)))[None],
        segment_ids=np.pad(segment_ids, (0, pad))[None],
        token_index=token_index,
    )


def _checked_media(kind: str, pixels, grid, vision: VisionConfig):
    """(kind, pixels [Σ t·h·w, patch_dim], grid [U, 3]) with shapes checked; empty arrays when
    absent."""
    prefix = "pixel_values" if kind == "image" else "pixel_values_videos"
    if (pixels is None) != (grid is None):
        given, missing = (
            (prefix, f"{kind}_grid_thw") if grid is None else (f"{kind}_grid_thw", prefix)
        )
        raise ValueError(f"{given} was given without {missing}")
    if pixels is None:
        return kind, np.zeros((0, vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    grid, pixels = np.asarray(grid), np.asarray(pixels)
    if grid.ndim != 2 or grid.shape[1] != 3 or (grid < 1).any():
        raise ValueError(
            f"{kind}_grid_thw must be [count, 3] positive (t, h, w), got {grid.tolist()}"
        )
    merge = vision.spatial_merge_size
    for row, (t, h, w) in enumerate(grid.tolist()):
        if h % merge or w % merge:
            raise ValueError(
                f"{kind}_grid_thw[{row}] = {[t, h, w]}: h and w must be multiples of "
                f"spatial_merge_size={merge}"
            )
    expected = (int(np.prod(grid, axis=-1).sum()), vision.patch_dim)
    if pixels.shape != expected:
        raise ValueError(
            f"{prefix} has shape {list(pixels.shape)}, but {kind}_grid_thw needs {list(expected)} "
            f"(sum of t·h·w rows of patch_dim = {vision.patch_dim} values)"
        )
    return kind, pixels, grid


def from_packed_rows(rows: VisionBatch, merge_size: int) -> VisionInputs:
    """A training batch's vision part (batch_format/batch.py: each row with its own patch budget
    and row-local feature rows) -> VisionInputs with one patch row per training row. Feature rows
    are offset to index all rows' merged features in order. Works on NumPy or traced arrays."""
    batch, budget = rows.patch_segment_ids.shape
    window = merge_size**2
    if budget % window:
        raise ValueError(f"the patch budget {budget} must be a multiple of {window} (m²)")
    offsets = jnp.arange(batch)[:, None] * (budget // window)
    token_index = jnp.where(rows.feature_index >= 0, rows.feature_index + offsets, -1)
    return VisionInputs(rows.patches, rows.patch_positions, rows.patch_segment_ids, token_index)
