"""The shared ViT positions and patch geometry (batch_format/vision.py), which the data pipeline
and the model's transformers-style inputs both use."""

import numpy as np

from batch_format.vision import grid_positions, patch_dim, vit_positions


def test_vit_positions_are_block_major():
    positions = vit_positions((2, 4, 6), merge_size=2)
    expected = [
        (tt, br * 2 + ir, bc * 2 + ic)
        for tt in range(2)
        for br in range(2)
        for bc in range(3)
        for ir in range(2)
        for ic in range(2)
    ]
    assert positions.tolist() == [list(p) for p in expected]
    assert positions.dtype == np.int32


def test_grid_positions_restart_per_grid_row():
    positions = grid_positions(np.array([[2, 2, 4], [1, 2, 2]]), merge_size=2)
    # One 2x2 window after the other (row-major inside a window), frame by frame.
    first_frame = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 0, 2), (0, 0, 3), (0, 1, 2),
                   (0, 1, 3)]  # fmt: skip
    assert [tuple(p) for p in positions[:8]] == first_frame
    assert [tuple(p) for p in positions[8:16]] == [(1, h, w) for _, h, w in first_frame]
    assert [tuple(p) for p in positions[16:]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert positions.dtype == np.int32
    assert grid_positions(np.zeros((0, 3), np.int64), merge_size=2).shape == (0, 3)


def test_patch_dim_is_m3s_1176():
    assert patch_dim(temporal_patch_size=2, patch_size=14) == 1176
