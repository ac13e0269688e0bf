"""Patch geometry and ViT positions of M3's vision inputs (spec/m3_architecture.md §4.3).

A patch row holds the pixels of temporal_patch_size frames × patch_size² pixels × 3 channels,
ordered (c, t, y, x): the Conv3d patch embedding's kernel layout. Rows run block-major: for t, for
m×m window row, for window column, for row in the window, for column in the window (m the
spatial merge size), so that each window's m² rows merge into one feature row.

Shapes: U vision units (an image or a video chunk: a grid_thw row), m spatial merge size.
"""

import numpy as np


def patch_dim(temporal_patch_size: int, patch_size: int, channels: int = 3) -> int:
    """Pixel features of one patch row (1176 for M3: 3 RGB channels · 2 · 14²)."""
    return channels * temporal_patch_size * patch_size**2


def vit_positions(grid: tuple[int, int, int], merge_size: int) -> np.ndarray:
    """int32 [t·h·w, 3]: the (t, h, w) id of every patch row of one unit, in block-major order."""
    grid_t, grid_h, grid_w = grid
    tt, block_row, block_col, in_row, in_col = np.meshgrid(
        np.arange(grid_t),
        np.arange(grid_h // merge_size),
        np.arange(grid_w // merge_size),
        np.arange(merge_size),
        np.arange(merge_size),
        indexing="ij",
    )
    rows = block_row * merge_size + in_row
    cols = block_col * merge_size + in_col
    return np.stack([tt, rows, cols], axis=-1).reshape(-1, 3).astype(np.int32)


def grid_positions(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """grid_thw [U, 3] -> [sum(t·h·w), 3] int32: every unit's `vit_positions`, one after the other
    (temporal ids restart at 0 for each unit)."""
    rows = [vit_positions(tuple(grid), merge_size) for grid in np.asarray(grid_thw).tolist()]
    return np.concatenate(rows) if rows else np.zeros((0, 3), np.int32)
