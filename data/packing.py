"""Pack document pieces into rows of `seq_len` tokens and `patch_budget` patches (Grain stage).

Packing works in windows, as Grain's own packers do. A document is offered as its longest
piece that fits an empty row; the piece goes into one of up to `num_bins` open rows (first-fit:
the first row with room for its tokens and patches; best-fit: the row left with the fewest free
tokens). When it fits no open row and all bins are open, the piece is cut (between vision units,
text anywhere) to fill the open rows in order; what is left over opens the next window and the
window's rows are emitted in bin order. Text-only data thus fills every row completely.

A window starts at a known (document, pair offset), so the iterator state is small and plain
JSON: the parent iterator's state before that document, the offset, and how many rows of the
window were already emitted. Restoring re-reads and re-packs that window (deterministically)
and drops the rows already emitted.

Unusable documents (`Skipped`) are counted by reason; more than `max_consecutive_skips` of them in
a row, or as many in a row as one epoch holds, raise DataError: a data set with nothing usable left
stops the run instead of being skipped through forever.

Rows are dicts of arrays (what Grain batches and passes between processes), one per field of
`batch_format.batch.Batch` and its `VisionBatch` (their shapes without B; the patch arrays are left
out under patch_budget 0), which data/mm_loader.py builds from them, and the row's bookkeeping
(S = seq_len, R = len(SKIP_REASONS)): doc_source, doc_record [S] int32: the document of each token
(its `Document.origin`, -1 on padding); document_counts [1 + R] int32: documents read, then
skipped by reason, while filling this row's window (on the window's first row only).
"""

import copy
import logging

import grain
import numpy as np

from data.mm_documents import SKIP_REASONS, DataError, Document, Skipped, next_cut

LOG = logging.getLogger("m3jax.data")
STRATEGIES = ("first_fit", "best_fit")
WARN_EVERY = 100
VISION_KEYS = ("patches", "patch_positions", "patch_segment_ids")


class PackIterDataset(grain.IterDataset):
    """Packs the `Document | Skipped` elements of `parent` into fixed-shape rows."""

    def __init__(
        self, parent, *, seq_len, patch_budget, patch_dim, merge_rows, num_bins, strategy, pad_id,
        max_consecutive_skips=1000, epoch_documents=None,
    ):  # fmt: skip
        super().__init__(parent)
        if strategy not in STRATEGIES:
            raise ValueError(f"packing strategy {strategy!r} is not one of {STRATEGIES}")
        self.seq_len, self.patch_budget, self.patch_dim = seq_len, patch_budget, patch_dim
        self.merge_rows = merge_rows  # patches per merged feature row (spatial_merge_size²)
        self.num_bins, self.strategy, self.pad_id = num_bins, strategy, pad_id
        self.max_consecutive_skips = max_consecutive_skips
        self.epoch_documents = epoch_documents  # documents in one pass over the data, if known

    def __iter__(self):
        return _PackIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self.seq_len}, patch_budget={self.patch_budget})"


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent, spec: PackIterDataset):
        super().__init__(parent)
        self._spec = spec
        self._anchor = (copy.deepcopy(parent.get_state()), 0)  # (parent state, pair offset)
        self._emitted = 0  # rows of the anchor's window already returned
        self._ready: list[dict] = []
        self._carry = None  # (parent state before it, Document, offset) opening the next window
        self._exhausted = False
        self._skipped_total = 0
        self._skipped_in_a_row = 0

    def __next__(self) -> dict:
        while not self._ready:
            if self._exhausted:
                raise StopIteration
            self._fill_window()
        self._emitted += 1
        return self._ready.pop(0)

    def get_state(self) -> dict:
        state, offset = self._anchor
        return {"parent": copy.deepcopy(state), "offset": offset, "emitted": self._emitted}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(copy.deepcopy(state["parent"]))
        self._anchor = (copy.deepcopy(state["parent"]), int(state["offset"]))
        self._ready, self._carry, self._exhausted = [], None, False
        self._fill_window(replay=True)
        del self._ready[: state["emitted"]]
        self._emitted = int(state["emitted"])

    def _fill_window(self, replay: bool = False) -> None:
        """Packs one window into self._ready; remembers where the next window starts."""
        spec = self._spec
        bins: list[_Bin] = []
        counts = np.zeros(1 + len(SKIP_REASONS), np.int32)  # read, then skipped by reason
        if self._carry is not None:
            parent_state, document, position = self._carry
            self._carry = None
        else:
            (parent_state, position), document = self._anchor, None
            if position:  # a restored window that starts inside a document
                document = next(self._parent)
        self._anchor, self._emitted = (parent_state, position), 0
        while self._carry is None:
            if document is None:
                parent_state = copy.deepcopy(self._parent.get_state())
                try:
                    document = next(self._parent)
                except StopIteration:
                    self._exhausted = True
                    break
                position = 0
                if isinstance(document, Skipped):
                    counts[1 + SKIP_REASONS.index(document.kind)] += 1
                    self._note_skip(document, replay)
                    document = None
                    continue
                counts[0] += 1
                self._skipped_in_a_row = 0
            while position < document.num_pairs:
                stop = next_cut(document, position, spec.seq_len, spec.patch_budget)
                placed = self._place(bins, document, position, stop)
                if placed < stop:
                    self._carry = (parent_state, document, placed)
                    break
                position = stop
            document = None
        self._ready = [b.to_row(spec) for b in bins]
        if self._ready:
            self._ready[0]["document_counts"] = counts

    def _place(self, bins: list, document: Document, start: int, stop: int) -> int:
        """Places pairs [start, stop) (cut if needed); returns the first pair not placed."""
        spec = self._spec
        while start < stop:
            first, last = _piece_patches(document, start, stop)
            tokens, patches = stop - start, last - first
            fits = [b for b in bins if b.has_room(spec, tokens, patches)]
            if fits or len(bins) < spec.num_bins:
                if not fits:
                    bins.append(_Bin())
                    target = bins[-1]
                elif spec.strategy == "first_fit":
                    target = fits[0]
                else:  # best fit: the row left with the fewest free tokens, then patches
                    target = max(fits, key=lambda b: (b.tokens, b.patches))
                target.add(document, start, stop, tokens, patches)
                return stop
            for row in bins:  # all bins open, none has room: fill them in order
                cut = next_cut(
                    document, start, spec.seq_len - row.tokens, spec.patch_budget - row.patches
                )
                if cut > start:
                    first, last = _piece_patches(document, start, cut)
                    row.add(document, start, cut, cut - start, last - first)
                    start = cut
                    break
            else:
                return start
        return stop

    def _note_skip(self, skipped: Skipped, replay: bool) -> None:
        self._skipped_in_a_row += 1
        spec, in_a_row = self._spec, self._skipped_in_a_row
        if in_a_row > spec.max_consecutive_skips or in_a_row == spec.epoch_documents:
            limit = (
                f"as many as the data holds ({in_a_row}): none of it is usable"
                if in_a_row == spec.epoch_documents
                else f"more than data.max_consecutive_skips={spec.max_consecutive_skips}"
            )
            raise DataError(
                f"{in_a_row} unusable documents in a row, {limit}; the latest: {skipped.where}: "
                f"{skipped.reason}"
            )
        if replay:
            return
        self._skipped_total += 1
        if self._skipped_total == 1 or self._skipped_total % WARN_EVERY == 0:
            LOG.warning(
                "m3jax data: %d document(s) skipped by this reader so far; latest %s: %s",
                self._skipped_total,
                skipped.where,
                skipped.reason,
            )


def _piece_patches(document: Document, start: int, stop: int) -> tuple[int, int]:
    """Patch range [first, last) of the units whose tokens lie in inputs [start, stop)."""
    starts = document.unit_spans[:, 0]
    first_unit = int(np.searchsorted(starts, start, "left"))
    last_unit = int(np.searchsorted(starts, stop, "left"))
    return int(document.unit_patches[first_unit]), int(document.unit_patches[last_unit])


class _Bin:
    """One row being filled: its pieces as (document, start, stop)."""

    def __init__(self):
        self.tokens = self.patches = 0
        self.pieces: list[tuple[Document, int, int]] = []

    def has_room(self, spec: PackIterDataset, tokens: int, patches: int) -> bool:
        return self.tokens + tokens <= spec.seq_len and self.patches + patches <= spec.patch_budget

    def add(self, document, start, stop, tokens, patches):
        self.pieces.append((document, start, stop))
        self.tokens += tokens
        self.patches += patches

    def to_row(self, spec: PackIterDataset) -> dict:
        S, P = spec.seq_len, spec.patch_budget
        row = {
            "tokens": np.full(S, spec.pad_id, np.int32),
            "targets": np.full(S, spec.pad_id, np.int32),
            "segment_ids": np.zeros(S, np.int32),
            "positions": np.zeros(S, np.int32),
            "loss_mask": np.zeros(S, np.float32),
            "modality": np.zeros(S, np.int8),
            "feature_index": np.full(S, -1, np.int32),
            "patches": np.zeros((P, spec.patch_dim), np.float32),
            "patch_positions": np.zeros((P, 3), np.int32),
            "patch_segment_ids": np.zeros(P, np.int32),
            "doc_source": np.full(S, -1, np.int32),
            "doc_record": np.full(S, -1, np.int32),
            "document_counts": np.zeros(1 + len(SKIP_REASONS), np.int32),
        }
        if P == 0:  # text only: no vision arrays (Grain's shared memory cannot hold empty ones)
            for key in VISION_KEYS:
                del row[key]
        column = patch_row = 0
        unit_id = 0
        for segment, (document, start, stop) in enumerate(self.pieces, start=1):
            n = stop - start
            span = slice(column, column + n)
            row["tokens"][span] = document.tokens[start:stop]
            row["targets"][span] = document.tokens[start + 1 : stop + 1]
            row["segment_ids"][span] = segment
            row["positions"][span] = np.arange(n)
            row["loss_mask"][span] = document.loss_target[start + 1 : stop + 1]
            row["modality"][span] = document.modality[start:stop]
            row["doc_source"][span], row["doc_record"][span] = document.origin
            first, last = _piece_patches(document, start, stop)
            features = document.feature_of_token[start:stop]
            row["feature_index"][span] = np.where(
                features >= 0, features + (patch_row - first) // spec.merge_rows, -1
            )
            if last > first and P:
                rows = slice(patch_row, patch_row + last - first)
                row["patches"][rows] = document.patches[first:last]
                row["patch_positions"][rows] = document.patch_positions[first:last]
                offsets = document.unit_patches
                units = np.searchsorted(offsets, np.arange(first, last), "right") - 1
                row["patch_segment_ids"][rows] = unit_id + 1 + units - units[0]
                unit_id += int(units[-1] - units[0] + 1)
            column += n
            patch_row += last - first
        return row
