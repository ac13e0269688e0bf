"""One shard record -> one token sequence with its vision patches, cut into row-sized pieces.

A document becomes `[bos] + segments + [eos]` where a text segment is its tokens, an image is
`START + IMAGE × n + END` (n = merged patch rows, spec §6.3) and a video is, per temporal patch,
an optional timestamp text then `START + VIDEO × (h·w/4) + END`. A *vision unit* is what the ViT
attends over as one: an image, or one chunk of ≤ 4 temporal patches of a video (with the
timestamps inside it). Units are never split across training rows.

Pieces: a document of L tokens gives L - 1 (input, target) pairs; the packer cuts them into
pieces with `next_cut`, only between units (text can be cut anywhere). A unit that alone exceeds
`seq_len` tokens or `patch_budget` patches makes the document unusable (DocumentError).
"""

import dataclasses

import numpy as np

from batch_format.modality import IMAGE, TEXT, VIDEO
from batch_format.vision import vit_positions
from data.media import MediaError, decode_image, decode_video_frames
from data.shard_format import ShardFormatError, decode_record
from data.shard_reader import RawRecord
from data.vision_processing import (
    ProcessorConfig,
    process_image,
    process_video,
    sample_frame_indices,
)

# Why a record is skipped: unreadable shard or record, not a valid record, media that do not
# decode or process, a vision unit larger than a row.
SKIP_REASONS = ("unreadable", "malformed", "bad_media", "too_large")


class DocumentError(ValueError):
    """A record that cannot become training data; the message is the reason, `kind` one of
    SKIP_REASONS."""

    def __init__(self, message: str, kind: str = "bad_media"):
        super().__init__(message)
        self.kind = kind


class DataError(RuntimeError):
    """Raised under the `fail` policy, and when nothing usable is left under `skip`; the message
    names the shard set, shard, record index and reason."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """Placeholder for a record dropped under the `skip` policy; kind: one of SKIP_REASONS."""

    where: str
    reason: str
    kind: str


@dataclasses.dataclass(frozen=True)
class Document:
    """A processed document. Shapes: L tokens, N patches, U vision units, D patch features.

    tokens, modality [L]; unit_spans [U, 2] first and last token of each unit; unit_patches
    [U + 1] patch offsets of the units; patches [N, D] float32; patch_positions [N, 3] (t, h, w)
    per unit; feature_of_token [L]: for placeholder tokens the document-wide merged feature row
    (patches 4k..4k+3 form row k), else -1; cuts: sorted pair positions where a piece may end
    or start; patches_before [L]: patches of the units that start before each pair position.
    """

    where: str
    tokens: np.ndarray
    modality: np.ndarray
    loss_target: np.ndarray  # [L] 1 where the token, as a target, carries loss (text)
    unit_spans: np.ndarray
    unit_patches: np.ndarray
    patches: np.ndarray
    patch_positions: np.ndarray
    feature_of_token: np.ndarray
    cuts: np.ndarray
    patches_before: np.ndarray
    origin: tuple[int, int] = (-1, -1)  # (source in the mixture, record in its shard set)

    @property
    def num_pairs(self) -> int:
        return len(self.tokens) - 1


@dataclasses.dataclass(frozen=True)
class DocumentProcessor:
    """Turns a `RawRecord` into a `Document` (or `Skipped`, or raises `DataError` under `fail`).

    tokenizer: ids `bos_id, eos_id, image_id, video_id, vision_start_id, vision_end_id` and
    `encode(text)`; the byte tokenizer by default.
    """

    tokenizer: object
    processor: ProcessorConfig
    seq_len: int
    patch_budget: int
    on_error: str = "skip"

    def __call__(self, raw: RawRecord):
        try:
            if raw.error:
                raise DocumentError(raw.error, "unreadable")
            try:
                record = decode_record(raw.data)
            except ShardFormatError as e:
                raise DocumentError(str(e), "malformed") from None
            document = self.process(raw.where, record)
        except DocumentError as e:
            if self.on_error == "fail":
                raise DataError(f"{raw.where}: {e}") from None
            return Skipped(raw.where, str(e), e.kind)
        except Exception as e:  # a bug, not bad data: stop under any policy, naming the record
            raise DataError(f"{raw.where}: unexpected {type(e).__name__}: {e}") from e
        return dataclasses.replace(document, origin=(raw.source, raw.record))

    def process(self, where: str, record: dict) -> Document:
        tok = self.tokenizer
        pieces, modality, unit_spans, unit_items = [[tok.bos_id]], [[TEXT]], [], []
        length = 1
        for number, segment in enumerate(record["segments"]):
            try:
                units = self.segment_units(segment)
            except (MediaError, ValueError) as e:
                reason = f"segment {number} ({segment['type']}): {e}"
                raise DocumentError(reason, "bad_media") from None
            for ids, kinds, item in units:
                if item is not None:
                    unit_spans.append((length, length + len(ids) - 1))
                    unit_items.append(item)
                pieces.append(ids)
                modality.append(kinds)
                length += len(ids)
        pieces.append([tok.eos_id])
        modality.append([TEXT])
        tokens = np.concatenate([np.asarray(p, np.int32) for p in pieces])
        modality = np.concatenate([np.asarray(m, np.int8) for m in modality])
        return self._document(where, tokens, modality, unit_spans, unit_items)

    def segment_units(self, segment: dict) -> list:
        """[(ids, modality, VisionItem or None)] for one record segment, units marked by their
        item: a text's tokens, an image's bracketed placeholders, a video chunk's (with stamps)."""
        tok, config = self.tokenizer, self.processor
        if segment["type"] == "text":
            ids = tok.encode(segment["text"])
            return [(ids, np.zeros(len(ids), np.int8), None)] if len(ids) else []
        merge = config.spatial_merge_size**2
        if segment["type"] == "image":
            item = process_image(decode_image(segment["bytes"]), config)
            n = item.patches.shape[0] // merge
            ids = [tok.vision_start_id] + [tok.image_id] * n + [tok.vision_end_id]
            return [(ids, np.full(len(ids), IMAGE, np.int8), item)]
        indices = sample_frame_indices(segment["num_frames"], segment["fps"], config)
        frames = decode_video_frames(segment["bytes"], indices)
        units = []
        for item in process_video(frames, indices, segment["fps"], config):
            per_frame = item.grid[1] * item.grid[2] // merge
            ids, kinds = [], []
            for f in range(item.grid[0]):
                stamp = tok.encode(item.timestamps[f]) if item.timestamps else []
                block = [tok.vision_start_id] + [tok.video_id] * per_frame + [tok.vision_end_id]
                ids += list(stamp) + block
                kinds += [TEXT] * len(stamp) + [VIDEO] * len(block)
            units.append((ids, np.asarray(kinds, np.int8), item))
        return units

    def _document(self, where, tokens, modality, unit_spans, unit_items) -> Document:
        tok, config = self.tokenizer, self.processor
        dim = config.patch_dim
        if unit_items:
            patches = np.concatenate([item.patches for item in unit_items])
            positions = np.concatenate(
                [vit_positions(item.grid, config.spatial_merge_size) for item in unit_items]
            )
        else:
            patches, positions = np.zeros((0, dim), np.float32), np.zeros((0, 3), np.int32)
        counts = [item.patches.shape[0] for item in unit_items]
        unit_patches = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        spans = np.asarray(unit_spans, np.int64).reshape(-1, 2)
        placeholder = (tokens == tok.image_id) | (tokens == tok.video_id)
        feature = np.where(placeholder, np.cumsum(placeholder) - 1, -1)
        loss_target = (modality == TEXT).astype(np.float32)
        cuts, patches_before = cut_points(
            len(tokens), spans, np.asarray(counts), self.seq_len, self.patch_budget
        )
        return Document(
            where,
            tokens,
            modality,
            loss_target,
            spans,
            unit_patches,
            patches,
            positions,
            feature.astype(np.int64),
            cuts,
            patches_before,
        )


def cut_points(
    num_tokens: int, unit_spans: np.ndarray, unit_counts: np.ndarray, seq_len: int, budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """(allowed cut positions, patches before each pair position) of a document.

    A cut at b (one piece ends before input b, the next starts there) is allowed unless a unit
    [s, e] has s < b <= e. Raises DocumentError if a unit alone exceeds seq_len or budget.
    """
    num_pairs = num_tokens - 1
    allowed = np.ones(num_pairs + 1, bool)
    starting = np.zeros(num_pairs + 1, np.int64)  # patches of units starting at each position
    for (start, end), count in zip(unit_spans, unit_counts):
        if end - start + 1 > seq_len or count > budget:
            raise DocumentError(
                f"a vision unit of {end - start + 1} tokens and {count} patches does not fit "
                f"one row (seq_len={seq_len}, patch_budget={budget})",
                "too_large",
            )
        allowed[start + 1 : end + 1] = False
        starting[start] += count
    patches_before = np.concatenate([[0], np.cumsum(starting)])[: num_pairs + 1]
    return np.flatnonzero(allowed), patches_before


def next_cut(document: Document, start: int, max_tokens: int, max_patches: int) -> int:
    """The furthest allowed cut b > start with b - start <= max_tokens and at most max_patches
    patches in [start, b); returns `start` when not even one unit or token fits."""
    before = document.patches_before
    limit = min(start + max_tokens, document.num_pairs)
    by_patches = int(np.searchsorted(before, before[start] + max_patches, "right")) - 1
    cuts = document.cuts
    stop = int(cuts[np.searchsorted(cuts, min(limit, by_patches), "right") - 1])
    return max(stop, start)
