"""make_batch (batch_format/batch.py): a batch of the documented shapes and dtypes, or an error
that names the field that is not."""

import numpy as np
import pytest

from batch_format.batch import VisionBatch, make_batch

B, S, P, D = 2, 8, 4, 12


def fields(**changed) -> dict:
    ids = np.zeros((B, S), np.int32)
    vision = VisionBatch(
        patches=np.zeros((B, P, D), np.float32),
        patch_positions=np.zeros((B, P, 3), np.int32),
        patch_segment_ids=np.zeros((B, P), np.int32),
        feature_index=np.full((B, S), -1, np.int32),
    )
    vision = vision._replace(**{k: v for k, v in changed.items() if k in VisionBatch._fields})
    return {
        "tokens": ids, "targets": ids, "positions": ids, "segment_ids": ids,
        "loss_mask": np.ones((B, S), np.float32), "modality": np.zeros((B, S), np.int8),
        "vision": vision, **{k: v for k, v in changed.items() if k not in VisionBatch._fields},
    }  # fmt: skip


def test_a_text_batch_has_no_optional_parts_and_a_multimodal_one_both():
    text = make_batch(**fields(modality=None, vision=None))
    assert text.modality is None and text.vision is None
    multimodal = make_batch(**fields())
    assert multimodal.vision.patches.shape == (B, P, D) and multimodal.modality.dtype == np.int8


def test_an_empty_patch_budget_is_a_batch_too():
    empty = make_batch(**fields(patches=np.zeros((B, 0, D), np.float32),
                                patch_positions=np.zeros((B, 0, 3), np.int32),
                                patch_segment_ids=np.zeros((B, 0), np.int32)))  # fmt: skip
    assert empty.vision.patches.shape == (B, 0, D)


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"loss_mask": np.ones((B, S), np.int32)}, "Batch.loss_mask: dtype int32, expected float32"),
        ({"modality": np.zeros((B, S), np.int32)}, "Batch.modality: dtype int32, expected int8"),
        ({"targets": None}, "Batch.targets: None, expected int32"),
        ({"positions": np.zeros((B, S + 1), np.int32)},
         r"Batch.positions: shape \(2, 9\), expected \[B, S\] with S = 8 as in Batch.tokens"),
        ({"segment_ids": np.zeros((B * S,), np.int32)},
         r"Batch.segment_ids: shape \(16,\), expected \[B, S\]$"),
        ({"patch_positions": np.zeros((B, P, 2), np.int32)},
         r"Batch.vision.patch_positions: shape \(2, 4, 2\), expected \[B, P, 3\]$"),
        ({"patch_segment_ids": np.zeros((B, P + 4), np.int32)},
         r"Batch.vision.patch_segment_ids: .* with P = 4 as in Batch.vision.patches"),
        ({"feature_index": np.zeros((B + 1, S), np.int32)},
         r"Batch.vision.feature_index: .* with B = 2 as in Batch.tokens"),
    ],
)  # fmt: skip
def test_a_wrong_field_is_named_with_what_was_expected(changed, message):
    with pytest.raises(ValueError, match=message):
        make_batch(**fields(**changed))
