"""The training batch: what the loaders (`data/`) emit and the train step (`pretrain/`) reads.

`Batch` and its vision part `VisionBatch` are NamedTuples, not dataclasses: JAX treats NamedTuples
as pytrees without registration (registering a dataclass would import jax here, and this package
is NumPy only), so a Batch goes through `jax.jit`, `jax.tree.map` (micro-batch slicing, host ->
device copies) and back unchanged. An absent optional part is None, a pytree node without leaves:
it stays None through all of these. The fields hold NumPy arrays on the host and jax arrays on
the devices. Build host batches with `make_batch`, which checks every field's shape and dtype.

Shapes (m3jax's letters): B rows, S sequence, P patches per row (the patch budget);
`patch_dim` = 3·temporal_patch_size·patch_size² pixel features (batch_format/vision.py).
"""

from typing import NamedTuple

import numpy as np


class VisionBatch(NamedTuple):
    """The images and video chunks of a batch's rows (data/packing.py lays them out)."""

    patches: np.ndarray  # float32 [B, P, patch_dim]: pixel rows (c, t, y, x), zero rows pad
    patch_positions: np.ndarray  # int32 [B, P, 3]: the ViT's (t, h, w) ids (vision.py)
    patch_segment_ids: np.ndarray  # int32 [B, P]: 1, 2, ... per image / chunk in a row, 0 = pad
    feature_index: np.ndarray  # int32 [B, S]: placeholder -> its merged feature row in the row
    # (patches m²r .. m²r + m² - 1), -1 on every other token


class Batch(NamedTuple):
    """Packed rows of document pieces: per-token arrays, plus the optional parts."""

    tokens: np.ndarray  # int32 [B, S]: input ids (the pad id on padding)
    targets: np.ndarray  # int32 [B, S]: next-token ids
    positions: np.ndarray  # int32 [B, S]: index within the document piece
    segment_ids: np.ndarray  # int32 [B, S]: 1, 2, ... per document piece in a row, 0 = padding
    loss_mask: np.ndarray  # float32 [B, S]: 1 where the target counts in the LM loss
    modality: np.ndarray | None = None  # int8 [B, S]: the input token's code (modality.py);
    # None from text-only loaders (no per-modality metrics)
    vision: VisionBatch | None = None  # None from text-only loaders


# field -> (dtype, shape): letters are sizes that must agree across fields, ints fixed sizes
_SPECS = {
    "tokens": (np.int32, ("B", "S")),
    "targets": (np.int32, ("B", "S")),
    "positions": (np.int32, ("B", "S")),
    "segment_ids": (np.int32, ("B", "S")),
    "loss_mask": (np.float32, ("B", "S")),
    "modality": (np.int8, ("B", "S")),
    "patches": (np.float32, ("B", "P", "patch_dim")),
    "patch_positions": (np.int32, ("B", "P", 3)),
    "patch_segment_ids": (np.int32, ("B", "P")),
    "feature_index": (np.int32, ("B", "S")),
}
_OPTIONAL = ("modality",)


def make_batch(
    *, tokens, targets, positions, segment_ids, loss_mask, modality=None,
    vision: VisionBatch | None = None,
) -> Batch:  # fmt: skip
    """A Batch of these arrays (anything with `.shape` and `.dtype`), checked: ValueError naming
    the field whose dtype or shape is not the documented one, or whose B, S or P differs from an
    earlier field's."""
    batch = Batch(tokens, targets, positions, segment_ids, loss_mask, modality, vision)
    fields = [(f"Batch.{name}", name, getattr(batch, name)) for name in Batch._fields[:-1]]
    if vision is not None:
        fields += [(f"Batch.vision.{name}", name, x) for name, x in zip(vision._fields, vision)]
    sizes: dict[str, tuple[int, str]] = {}  # letter -> (its size, the field that set it)
    for label, name, array in fields:
        if array is not None or name not in _OPTIONAL:
            _check_field(label, array, *_SPECS[name], sizes)
    return batch


def _check_field(label: str, array, dtype, letters: tuple, sizes: dict) -> None:
    if array is None or np.dtype(array.dtype) != dtype:
        got = "None" if array is None else f"dtype {np.dtype(array.dtype)}"
        raise ValueError(f"{label}: {got}, expected {np.dtype(dtype)}")
    shape, wanted = tuple(array.shape), f"[{', '.join(map(str, letters))}]"
    if len(shape) != len(letters):
        raise ValueError(f"{label}: shape {shape}, expected {wanted}")
    for letter, size in zip(letters, shape):
        if isinstance(letter, int):
            if size != letter:
                raise ValueError(f"{label}: shape {shape}, expected {wanted}")
            continue
        known, source = sizes.setdefault(letter, (size, label))
        if size != known:
            raise ValueError(
                f"{label}: shape {shape}, expected {wanted} with {letter} = {known} as in {source}"
            )
