"""The multimodal input pipeline: shard sets -> packed, batched, resumable training batches.

Grain stages, in order:

    per shard set:  ShardSet records -> global shuffle (seed, reshuffled each epoch) -> repeat
    mixture:        MapDataset.mix(shard sets, weights)          (deterministic by index)
    this process:   every shard_count-th element from shard_index (ShardByJaxProcess by default)
    per document:   decode + tokenize + resize + patchify + cut into pieces (DocumentProcessor)
    packing:        PackIterDataset (first/best fit into seq_len tokens and patch_budget patches)
    batch, then:    mp_prefetch over `num_workers` processes (0: all in this process; JAX's
                    async dispatch already overlaps the next batch with the running step. A
                    Grain prefetch thread measured 1.5-3x slower here: GIL contention)

With workers, each worker reads every num_workers-th document of this process's stream, packs
and batches its own documents; batches arrive round-robin, so the order is a function of the
seed and of num_workers (keep num_workers when resuming). `state()` is Grain's iterator state
(plain JSON) plus the document counters; after `restore(state)` the next batch is bit-identical to
the one the uninterrupted run would have produced.

Bad records are skipped (counted by reason: `skip_counts()`) or stop the run (`on_error`); more
than `max_consecutive_skips` unusable documents in a row, or a whole epoch of them, raise
DataError (data/packing.py). `provenance()` names the records of the last batch.

Batches are `batch_format.batch.Batch`es (B = batch_size, S = seq_len, P = patch_budget) with
both optional parts: `modality`, and `vision` (empty, P = 0, under patch_budget 0). loss_mask is 1
where the target is text (not padding, image/video placeholders or vision start/end tokens).
"""

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence

import grain
import numpy as np

from batch_format.batch import Batch, VisionBatch, make_batch
from batch_format.modality import IMAGE, TEXT, VIDEO
from data.mm_documents import SKIP_REASONS, DocumentProcessor
from data.packing import PackIterDataset
from data.provenance import describe
from data.shard_reader import ShardSet
from data.tokenizer import ByteTokenizer
from data.vision_processing import ProcessorConfig

STATE_VERSION = 1
POLICIES = ("skip", "fail")


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """A shard set in a mixture. keep: optional index filter (see `ShardSet`)."""

    path: str
    weight: float = 1.0
    keep: Callable | None = None


class MultimodalLoader:
    """An iterator of packed multimodal batches with JSON state (see the module docstring).

    Args:
        sources: shard-set directories or `ShardSource`s (weights are mixture proportions).
        seq_len: S, tokens per row. batch_size: B, rows per batch (per process).
        patch_budget: P, patch rows per training row (0 for text-only data).
        seed: shuffle seed (0 <= seed < 2**31).
        tokenizer: defaults to the byte tokenizer.
        processor: image/video processing (`ProcessorConfig`; defaults are M3's).
        num_workers: Grain worker processes (0 = decode in this process).
        num_bins: open rows per packing window (default 2·B); strategy: first_fit | best_fit.
        on_error: "skip" (count, warn every 100) or "fail" (DataError naming shard and record).
        max_consecutive_skips: under "skip", DataError after more unusable documents in a row.
        shard_index, shard_count: this process's share; default jax.process_index()/count().
        num_epochs: None repeats forever; an int ends the iterator after that many epochs.
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike | ShardSource],
        *,
        seq_len: int,
        batch_size: int,
        patch_budget: int,
        seed: int,
        tokenizer=None,
        processor: ProcessorConfig = ProcessorConfig(),
        num_workers: int = 0,
        num_bins: int | None = None,
        strategy: str = "first_fit",
        on_error: str = "skip",
        max_consecutive_skips: int = 1000,
        shard_index: int | None = None,
        shard_count: int | None = None,
        num_epochs: int | None = None,
        read_threads: int = 2,
    ):
        _check_ints(
            seq_len=(seq_len, 2), batch_size=(batch_size, 1), patch_budget=(patch_budget, 0)
        )
        _check_ints(seed=(seed, 0), num_workers=(num_workers, 0), read_threads=(read_threads, 1))
        if on_error not in POLICIES:
            raise ValueError(f"on_error={on_error!r} must be one of {POLICIES}")
        if shard_index is None or shard_count is None:
            sharding = grain.sharding.ShardByJaxProcess(drop_remainder=False)
            shard_index, shard_count = sharding.shard_index, sharding.shard_count
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"{shard_index=} must be in [0, {shard_count=})")
        self.tokenizer = tokenizer or ByteTokenizer()
        self.sources = [s if isinstance(s, ShardSource) else ShardSource(str(s)) for s in sources]
        if not self.sources:
            raise ValueError("MultimodalLoader needs at least one shard set")
        self.batch_size, self.patch_dim = batch_size, processor.patch_dim
        self.documents_read = 0
        self.skipped_by_reason = dict.fromkeys(SKIP_REASONS, 0)
        self.batches = 0
        self._last_records: list[tuple[int, int]] = []  # (source, record) of the last batch
        shard_sets = [
            _LockedShardSet(ShardSet(s.path, keep=s.keep), i) for i, s in enumerate(self.sources)
        ]
        self._shard_sets = shard_sets
        for source, shards in zip(self.sources, shard_sets):
            if len(shards) == 0:
                raise ValueError(f"{source.path}: no records (after filtering)")
        self._fingerprint = _fingerprint(
            self.sources, shard_sets, seq_len, batch_size, patch_budget, seed, processor,
            num_workers, num_bins, strategy, shard_index, shard_count, num_epochs,
        )  # fmt: skip
        datasets = [
            grain.MapDataset.source(shards).shuffle(seed=seed + 7919 * i).repeat(num_epochs)
            for i, shards in enumerate(shard_sets)
        ]
        if len(datasets) == 1:
            mixed = datasets[0]
        else:
            mixed = grain.MapDataset.mix(datasets, weights=[s.weight for s in self.sources])
        process = DocumentProcessor(self.tokenizer, processor, seq_len, patch_budget, on_error)
        documents = mixed[shard_index::shard_count].map(process)
        stream = documents.to_iter_dataset(
            grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * read_threads)
        )
        packed = PackIterDataset(
            stream,
            seq_len=seq_len,
            patch_budget=patch_budget,
            patch_dim=processor.patch_dim,
            merge_rows=processor.spatial_merge_size**2,
            num_bins=num_bins or 2 * batch_size,
            strategy=strategy,
            pad_id=self.tokenizer.pad_id,
            max_consecutive_skips=max_consecutive_skips,
            epoch_documents=sum(len(shards) for shards in shard_sets),
        )
        batched = packed.batch(batch_size, drop_remainder=num_epochs is not None)
        if num_workers:
            _use_absl_defaults()
            batched = batched.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=num_workers, per_worker_buffer_size=2)
            )
        self._dataset = batched
        self._iterator = iter(batched)

    def __iter__(self) -> "MultimodalLoader":
        return self

    def __next__(self) -> Batch:
        rows = dict(next(self._iterator))
        counts = rows.pop("document_counts").sum(axis=0)
        self.documents_read += int(counts[0])
        for reason, count in zip(SKIP_REASONS, counts[1:]):
            self.skipped_by_reason[reason] += int(count)
        self._last_records = _distinct_records(rows.pop("doc_source"), rows.pop("doc_record"))
        self.batches += 1
        return _as_batch(rows, self.patch_dim)

    @property
    def skipped_documents(self) -> int:
        return sum(self.skipped_by_reason.values())

    def skip_counts(self) -> dict[str, int]:
        """Documents read and skipped so far (all sessions), by reason: for metrics and summary."""
        by_reason = {f"skipped_{reason}": n for reason, n in self.skipped_by_reason.items()}
        return {
            "documents_read": self.documents_read,
            "skipped_documents": self.skipped_documents,
            **by_reason,
        }

    def provenance(self) -> str:
        """The records in the last batch, e.g. 'shards/web/shard-00003.array_record#17, ...'."""
        return describe([self._shard_sets[s].where(r) for s, r in self._last_records])

    def state(self) -> dict:
        """JSON-serialisable position: restore() continues with exactly the next batch."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "batches": self.batches,
            "documents_read": self.documents_read,
            "skipped_by_reason": dict(self.skipped_by_reason),
            "grain": _to_json(self._iterator.get_state()),
        }

    def restore(self, state: dict) -> None:
        """Continues from a `state()` of a loader built with the same sources and settings."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"MultimodalLoader state: unknown version in {str(state)[:80]!r}")
        if state.get("fingerprint") != self._fingerprint:
            raise ValueError(
                "MultimodalLoader state belongs to different data or settings (sources, record "
                f"counts, seq_len, batch_size, seed, workers, ...): {state.get('fingerprint')} "
                f"!= {self._fingerprint}"
            )
        self._iterator.set_state(_from_json(state["grain"]))
        self.batches = int(state["batches"])
        self.documents_read = int(state.get("documents_read", 0))  # absent in older states
        skipped = state.get("skipped_by_reason", {})
        self.skipped_by_reason = {r: int(skipped.get(r, 0)) for r in SKIP_REASONS}

    def close(self) -> None:
        """Stops worker processes (also done when the loader is garbage collected)."""
        close = getattr(self._iterator, "close", None)
        if close:
            close()


def modality_counts(batch: Batch) -> dict[str, int]:
    """Tokens per modality in a batch (padding excluded), for per-modality metrics."""
    modality = batch.modality[batch.segment_ids > 0]
    return {
        "text_tokens": int((modality == TEXT).sum()),
        "image_tokens": int((modality == IMAGE).sum()),
        "video_tokens": int((modality == VIDEO).sum()),
    }


class _LockedShardSet:
    """A ShardSet whose reads are serialised (Grain reads with several threads) and marked with
    the set's place in the mixture (`RawRecord.source`)."""

    def __init__(self, shards: ShardSet, source: int):
        self._shards, self._source = shards, source
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._shards)

    def __getitem__(self, index):
        with self._lock:
            return dataclasses.replace(self._shards[index], source=self._source)

    def __getstate__(self):
        return {"_shards": self._shards, "_source": self._source}

    def __setstate__(self, state):
        self._shards, self._source = state["_shards"], state["_source"]
        self._lock = threading.Lock()

    @property
    def manifest(self) -> dict:
        return self._shards.manifest

    def where(self, record: int) -> str:
        return self._shards.where(record)


def _as_batch(rows: dict[str, np.ndarray], patch_dim: int) -> Batch:
    """The packer's batched row arrays (data/packing.py) -> a Batch. Under patch_budget 0 the rows
    carry no patch arrays (Grain's shared memory cannot hold empty ones): they become [B, 0, ...]."""
    count = len(rows["tokens"])
    empty = {
        "patches": np.zeros((count, 0, patch_dim), np.float32),
        "patch_positions": np.zeros((count, 0, 3), np.int32),
        "patch_segment_ids": np.zeros((count, 0), np.int32),
    }
    rows = {**empty, **rows}
    vision = VisionBatch(**{name: rows.pop(name) for name in VisionBatch._fields})
    return make_batch(**rows, vision=vision)


def _distinct_records(source: np.ndarray, record: np.ndarray) -> list[tuple[int, int]]:
    """(source, record) of the documents in a batch, in order of appearance, padding left out."""
    source, record = source.ravel(), record.ravel()
    starts = (np.diff(source, prepend=-2) != 0) | (np.diff(record, prepend=-2) != 0)
    pairs = zip(source[starts].tolist(), record[starts].tolist())
    return list(dict.fromkeys((s, r) for s, r in pairs if s >= 0))


def _use_absl_defaults() -> None:
    # Grain's worker processes read absl flags; outside an absl app nothing parses them, and
    # reading an unparsed flag raises. Marking them parsed keeps every default.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _fingerprint(sources, shard_sets, *settings) -> str:
    # Identifies the data by content (shard checksums), not by path: shard sets may move.
    parts = [
        (s.weight, len(shards), [e.get("sha256") for e in shards.manifest["shards"]])
        for s, shards in zip(sources, shard_sets)
    ]
    text = json.dumps([parts, [repr(x) for x in settings]], default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _to_json(value):
    """Grain's state as JSON values. Dicts with non-string keys (Grain's interleave keys some by
    int) become {"__items__": [[key, value], ...]} so that `_from_json` restores them exactly."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _to_json(v) for k, v in value.items()}
        return {"__items__": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise TypeError(f"Grain iterator state holds a {type(value).__name__}, not JSON-serialisable")


def _from_json(value):
    if isinstance(value, dict):
        if set(value) == {"__items__"}:
            return {_from_json(k): _from_json(v) for k, v in value["__items__"]}
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _check_ints(**named) -> None:
    for name, (value, minimum) in named.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
