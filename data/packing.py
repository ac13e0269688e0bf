"""Pack document pieces into rows of `seq_len` tokens and `patch_budget` patches (Grain stage).

Packing works in windows, as Grain's own packers do: pieces go into up to `num_bins` open rows
(first-fit: the first row with room for both the tokens and the patches; best-fit: the row left
with the fewest free tokens); when a piece fits no row and all bins are open, the window is
complete, its rows are emitted in bin order and the piece opens the next window. Because a
window starts at a known (document, piece), the iterator state is small and JSON-serialisable:
the parent iterator's state before that document, the piece number, and how many rows of the
window were already emitted. Restoring re-reads and re-packs that window (deterministic) and
drops the rows already emitted.

Row arrays (S = seq_len, P = patch_budget, D = patch features):
  tokens, targets, segment_ids, positions, feature_index [S] int32; loss_mask [S] float32;
  modality [S] int8; patches [P, D] float32; patch_positions [P, 3] int32;
  patch_segment_ids [P] int32; skipped_documents [] int32 (documents skipped while filling
  this row's window, counted on the window's first row only).
"""

import copy
import logging

import grain
import numpy as np

from data.mm_documents import Document, Skipped

LOG = logging.getLogger("m3jax.data")
STRATEGIES = ("first_fit", "best_fit")
WARN_EVERY = 100


class PackIterDataset(grain.IterDataset):
    """Packs the `Document | Skipped` elements of `parent` into fixed-shape rows."""

    def __init__(
        self, parent, *, seq_len, patch_budget, patch_dim, merge_rows, num_bins, strategy, pad_id
    ):
        super().__init__(parent)
        if strategy not in STRATEGIES:
            raise ValueError(f"packing strategy {strategy!r} is not one of {STRATEGIES}")
        self.seq_len, self.patch_budget, self.patch_dim = seq_len, patch_budget, patch_dim
        self.merge_rows = merge_rows  # patches per merged feature row (spatial_merge_size²)
        self.num_bins, self.strategy, self.pad_id = num_bins, strategy, pad_id

    def __iter__(self):
        return _PackIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self.seq_len}, patch_budget={self.patch_budget})"


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent, spec: PackIterDataset):
        super().__init__(parent)
        self._spec = spec
        self._anchor = (parent.get_state(), 0)  # window start: (parent state, piece number)
        self._emitted = 0  # rows of the current window already returned
        self._ready: list[dict] = []
        self._carry = None  # (parent state before it, Document, first piece) opening next window
        self._exhausted = False
        self._skipped_total = 0

    def __next__(self) -> dict:
        while not self._ready:
            if self._exhausted:
                raise StopIteration
            self._fill_window()
        self._emitted += 1
        return self._ready.pop(0)

    def get_state(self) -> dict:
        state, piece = self._anchor
        return {"parent": state, "piece": piece, "emitted": self._emitted}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._anchor = (state["parent"], state["piece"])
        self._ready, self._carry, self._exhausted = [], None, False
        self._emitted = 0
        self._fill_window(replay=True)
        del self._ready[: state["emitted"]]
        self._emitted = state["emitted"]

    def _fill_window(self, replay: bool = False) -> None:
        """Packs one window into self._ready; sets the anchor of the next window."""
        spec = self._spec
        bins: list[_Bin] = []
        skipped = 0
        if self._carry is not None:
            parent_state, document, first_piece = self._carry
            self._carry = None
        else:
            parent_state, first_piece = self._anchor
            document = None
        self._anchor, self._emitted = (parent_state, first_piece), 0
        while True:
            if document is None:
                parent_state = copy.deepcopy(self._parent.get_state())
                try:
                    document = next(self._parent)
                except StopIteration:
                    self._exhausted = True
                    break
                first_piece = 0
                if isinstance(document, Skipped):
                    skipped += 1
                    self._note_skip(document, replay)
                    document = None
                    continue
            for number in range(first_piece, len(document.pieces)):
                if not self._place(bins, document, number):
                    self._carry = (parent_state, document, number)
                    break
            if self._carry is not None:
                break
            document = None
        self._ready = [b.to_row(spec) for b in bins]
        if self._ready:
            self._ready[0]["skipped_documents"] = np.int32(skipped)

    def _place(self, bins: list, document: Document, number: int) -> bool:
        spec = self._spec
        start, stop = document.pieces[number]
        first, last = _piece_patches(document, start, stop)
        tokens, patches = int(stop - start), last - first
        fits = [
            b
            for b in bins
            if b.tokens + tokens <= spec.seq_len and b.patches + patches <= spec.patch_budget
        ]
        if fits and spec.strategy == "first_fit":
            target = fits[0]
        elif fits:  # best fit: the row left with the fewest free tokens (then patches)
            target = min(fits, key=lambda b: (spec.seq_len - b.tokens, spec.patch_budget - b.patches))
        elif len(bins) < spec.num_bins:
            target = _Bin()
            bins.append(target)
        else:
            return False
        target.add(document, start, stop, tokens, patches)
        return True

    def _note_skip(self, skipped: Skipped, replay: bool) -> None:
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
            "skipped_documents": np.int32(0),
        }
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
            first, last = _piece_patches(document, start, stop)
            features = document.feature_of_token[start:stop]
            row["feature_index"][span] = np.where(
                features >= 0, features + (patch_row - first) // spec.merge_rows, -1
            )
            if last > first:
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
