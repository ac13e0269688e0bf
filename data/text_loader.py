"""Deterministic packed text batches whose position in the data is one resumable integer.

Layout. Each non-empty document becomes `[bos] + tokens + [eos]`, i.e. n+1 tokens give n
(input, target) pairs, so a target never belongs to another document. Epoch e orders the
documents by `np.random.default_rng((seed, e)).permutation(num_documents)` and lays their pairs
end to end; epochs follow one another in one endless stream. Rows are consecutive `seq_len`
slices of that stream, batches consecutive `batch_size` rows. A document cut by a row boundary
continues in the next row as a new segment whose positions restart at 0. Nothing is padded and
nothing is dropped: the last partial row of an epoch is filled from the next epoch.

Because the stream is a pure function of (documents, seed), the loader's whole state is the
number of rows emitted: any row is computed directly from its stream offsets (searchsorted into
the epoch's cumulative document lengths), so `restore` is O(1) and needs no replay.

Several processes: each loads only its block of every global batch (`shard_index` of
`shard_count` equal blocks of consecutive rows), and counts the global batch's rows, so every
process's state is the same and a run resumes on any number of processes.

Batches are `batch_format.batch.Batch`es of [B, S] arrays (B = batch_size / shard_count,
S = seq_len) without the optional parts (modality and vision are None): segment ids are never 0
(nothing is padded) and loss_mask is 1.0 everywhere.
"""

import hashlib
from collections.abc import Sequence

import numpy as np

from batch_format.batch import Batch, make_batch
from data.provenance import describe
from data.text_corpus import Document
from data.tokenizer import ByteTokenizer

STATE_KEYS = (
    "rows_emitted",
    "seed",
    "seq_len",
    "num_documents",
    "tokens_per_epoch",
    "corpus_digest",
)


class PackedTextLoader:
    """An endless iterator of packed text `Batch`es.

    Args:
        documents: the corpus; documents with empty text are dropped.
        tokenizer: provides `encode(text, add_bos=, add_eos=)`.
        seq_len: S, positions per row (>= 2).
        batch_size: rows per global batch (>= 1), a multiple of shard_count.
        seed: non-negative int; with the documents it fixes every epoch's order.
        shard_index, shard_count: this process's block of each global batch.
    """

    def __init__(
        self,
        documents: Sequence[Document],
        tokenizer: ByteTokenizer,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        shard_count: int = 1,
    ):
        if not _is_int(seq_len) or seq_len < 2:
            raise ValueError(f"{seq_len=} must be an int >= 2")
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"{batch_size=} must be an int >= 1")
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"{seed=} must be a non-negative int")
        if batch_size % shard_count or not 0 <= shard_index < shard_count:
            raise ValueError(
                f"{batch_size=} rows do not split into {shard_count=} blocks or {shard_index=} "
                "is not one of them"
            )
        kept = [doc for doc in documents if doc.text]
        encoded = [tokenizer.encode(doc.text, add_bos=True, add_eos=True) for doc in kept]
        if not encoded:
            raise ValueError(
                f"PackedTextLoader: all {len(documents)} documents are empty; "
                f"there is nothing to train on"
            )
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self._shard_rows = self.batch_size // shard_count  # this process's rows of a batch
        self._shard_offset = shard_index * self._shard_rows
        self.num_documents = len(encoded)
        # All documents back to back; document d's tokens are _tokens[_starts[d]:_starts[d + 1]].
        self._tokens = np.concatenate(encoded).astype(np.int32)
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self._pairs = lengths - 1  # (input, target) pairs per document
        self.tokens_per_epoch = int(self._pairs.sum())
        self._digest = _corpus_digest(self._tokens, self._starts)
        self._rows_emitted = 0
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._doc_ids = [doc.doc_id for doc in kept]
        self._last_documents = np.zeros(0, np.int64)  # of the last batch, where each starts

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (for logging)."""
        return self._rows_emitted * self.seq_len // self.tokens_per_epoch

    def __iter__(self) -> "PackedTextLoader":
        return self

    def __next__(self) -> Batch:
        first = self._rows_emitted + self._shard_offset
        batch, document = self._rows(first, self._shard_rows)
        self._last_documents = document[np.flatnonzero(np.diff(document, prepend=-1))]
        self._rows_emitted += self.batch_size
        return batch

    def provenance(self) -> str:
        """The documents of this process's rows of the last batch, e.g. 'hamlet/act-1/scene-2, ...'."""
        return describe([self._doc_ids[d] for d in self._last_documents])

    def skip_counts(self) -> dict[str, int]:
        """Nothing is ever skipped here (the multimodal loader counts its skips)."""
        return {}

    def close(self) -> None:
        """Nothing to stop (no worker processes): here so that callers close either loader."""

    def state(self) -> dict:
        """Returns a JSON-serialisable dict from which `restore` resumes at the next batch."""
        return {
            "rows_emitted": self._rows_emitted,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_documents": self.num_documents,
            "tokens_per_epoch": self.tokens_per_epoch,
            "corpus_digest": self._digest,
        }

    def restore(self, state: dict) -> None:
        """Continues from `state` (from `state()` of a loader over the same corpus and seed).

        The batch size may differ: the stream is counted in rows. Raises ValueError if the
        state is malformed or belongs to another corpus, seed or seq_len.
        """
        if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"PackedTextLoader state must have keys {sorted(STATE_KEYS)}, got {got}"
            )
        rows = state["rows_emitted"]
        if not _is_int(rows) or rows < 0:
            raise ValueError(f"PackedTextLoader state: rows_emitted={rows!r} must be an int >= 0")
        expected = self.state()
        for key in STATE_KEYS[1:]:
            if isinstance(expected[key], int) and not _is_int(state[key]):
                raise ValueError(f"PackedTextLoader state: {key}={state[key]!r} must be an int")
            if state[key] != expected[key]:
                raise ValueError(
                    f"PackedTextLoader state: {key}={state[key]!r} does not match "
                    f"this loader's {key}={expected[key]!r} (different corpus, "
                    f"tokenizer, seed or seq_len)"
                )
        self._rows_emitted = rows

    def _rows(self, first_row: int, num_rows: int) -> tuple[Batch, np.ndarray]:
        """(batch, document of each position) of rows first_row..first_row + num_rows."""
        shape = (num_rows, self.seq_len)
        # Stream offset of every position: g = row * S + column.
        offsets = first_row * self.seq_len + np.arange(num_rows * self.seq_len, dtype=np.int64)
        epochs, in_epoch = np.divmod(offsets, self.tokens_per_epoch)
        document = np.empty_like(offsets)
        doc_start = np.empty_like(offsets)  # stream offset where the position's document starts
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            order, ends = self._epoch_layout(int(epoch))
            k = np.searchsorted(ends, in_epoch[mask], side="right")
            document[mask] = order[k]
            doc_start[mask] = offsets[mask] - in_epoch[mask] + ends[k] - self._pairs[order[k]]
        index = self._starts[document] + (offsets - doc_start)
        row_start = (offsets // self.seq_len) * self.seq_len
        segment_start = np.maximum(doc_start, row_start).reshape(shape)
        is_new = np.zeros(shape, dtype=np.int32)
        is_new[:, 1:] = segment_start[:, 1:] != segment_start[:, :-1]
        batch = make_batch(
            tokens=self._tokens[index].reshape(shape),
            targets=self._tokens[index + 1].reshape(shape),
            segment_ids=(1 + np.cumsum(is_new, axis=1)).astype(np.int32),
            positions=(offsets.reshape(shape) - segment_start).astype(np.int32),
            loss_mask=np.ones(shape, dtype=np.float32),
        )
        return batch, document

    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns (document order, cumulative pair counts in that order) of one epoch."""
        if epoch not in self._epoch_cache:
            order = np.random.default_rng((self.seed, epoch)).permutation(self.num_documents)
            if len(self._epoch_cache) >= 2:  # a batch rarely spans more than two epochs
                self._epoch_cache.pop(min(self._epoch_cache))
            self._epoch_cache[epoch] = (order, np.cumsum(self._pairs[order]))
        return self._epoch_cache[epoch]


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _corpus_digest(tokens: np.ndarray, starts: np.ndarray) -> str:
    # Detects restoring onto a different corpus or tokenizer: same counts, other text.
    digest = hashlib.blake2b(digest_size=8)
    digest.update(tokens.tobytes())
    digest.update(starts.tobytes())
    return digest.hexdigest()
