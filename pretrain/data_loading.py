"""The data iterators a run asks for: packed text (`data.source`), or the native multimodal Grain
pipeline over shard sets (`data.shards`), whose batches carry patches for the vision tower; and
the same pipeline over the held-out shard sets (`eval.shards`).

Either iterator yields dicts of NumPy arrays and has `state()` / `restore(state)`, saved in every
checkpoint so that a resumed run continues with exactly the next batch. With several processes
each loads only its block of the global batch (pretrain/distributed.py: batch_share), the rows
its devices hold: the text loader that block of the one global stream, the multimodal loader a
stream of its own (every `count`-th document). Both tokenize with
`data.tokenizer` (bytes or a tokenizer.json), checked here against the model: its vocab_size and,
for multimodal data, its placeholder ids.
"""

import dataclasses

import jax

from data.bpe_tokenizer import BPETokenizer, TokenizerError, load_tokenizer
from data.demo_corpus import shard_set_path
from data.mm_documents import DataError
from data.mm_loader import MultimodalLoader, ShardSource
from data.text_corpus import load_documents
from data.text_loader import PackedTextLoader
from data.tokenizer import ByteTokenizer
from m3jax import sharding
from m3jax.config import ModelConfig
from m3jax.config_loading import ConfigError
from pretrain.config import PLACEHOLDER_IDS, RunConfig, RunError
from pretrain.distributed import batch_share


def make_loader(run: RunConfig) -> PackedTextLoader | MultimodalLoader:
    tokenizer = run_tokenizer(run, media=bool(run.data.shards))
    if run.data.shards:
        return _multimodal_loader(run, tokenizer, run.data.shards, run.data.weights, "data.shards")
    index, count = process_share(run)
    try:
        documents = load_documents(run.data.source)
        return PackedTextLoader(
            documents, tokenizer, seq_len=run.data.seq_len, batch_size=run.data.batch_size,
            seed=run.data.seed, shard_index=index, shard_count=count,
        )  # fmt: skip
    except (OSError, ValueError, TypeError) as e:
        raise RunError(f"data.source={run.data.source!r}: {e}") from None


def run_mesh(run: RunConfig) -> jax.sharding.Mesh:
    """The run's device mesh (`mesh.*` over all devices); ConfigError if it does not fit them."""
    try:
        return sharding.make_mesh(dataclasses.asdict(run.mesh))
    except ValueError as e:
        raise ConfigError(f"{e} (set mesh.* to fit the devices)") from None


def process_share(run: RunConfig) -> tuple[int, int]:
    """(index, count): this process loads block `index` of `count` of each global batch."""
    if jax.process_count() == 1:
        return 0, 1
    batch_sharding = sharding.batch_sharding(run_mesh(run))
    try:
        return batch_share(batch_sharding, run.data.batch_size, run.data.seq_len)
    except ValueError as e:
        raise RunError(f"data.batch_size={run.data.batch_size}: {e}") from None


def make_eval_loader(run: RunConfig) -> MultimodalLoader:
    """The held-out batches' loader: `eval.shards` (equal weights) with the data section's
    tokenizer, row shape, processor and seed."""
    return _multimodal_loader(
        run, run_tokenizer(run, media=True), run.eval.shards, (), "eval.shards"
    )


def run_tokenizer(run: RunConfig, *, media: bool) -> ByteTokenizer | BPETokenizer:
    """`data.tokenizer`, checked against the model's vocabulary and, for data with media (shard
    sets), its placeholder ids."""
    tokenizer = named_tokenizer(run.data.tokenizer)
    check_tokenizer(run.model, tokenizer, run.data.tokenizer, media=media)
    return tokenizer


def named_tokenizer(name: str) -> ByteTokenizer | BPETokenizer:
    """ "bytes" or a tokenizer.json path (data.tokenizer); RunError for an unusable file."""
    try:
        return load_tokenizer(name)
    except (OSError, TokenizerError) as e:
        raise RunError(f"data.tokenizer={name!r}: {e}") from None


def check_tokenizer(
    model: ModelConfig, tokenizer: ByteTokenizer | BPETokenizer, name: str, *, media: bool
) -> None:
    """RunError unless the model has an embedding row for every id of the tokenizer and, when
    inputs hold media for a vision tower, the tokenizer's image/video placeholder ids."""
    if model.vocab_size < tokenizer.vocab_size:
        raise RunError(
            f"model.vocab_size={model.vocab_size} is smaller than the {tokenizer.vocab_size} "
            f"ids of data.tokenizer={name!r}"
        )
    if model.vision is None or not media:
        return
    for field, role in PLACEHOLDER_IDS.items():
        if getattr(model.vision, field) != getattr(tokenizer, role):
            raise RunError(
                f"model.vision.{field}={getattr(model.vision, field)} is not the tokenizer's "
                f"placeholder id {getattr(tokenizer, role)} (data.tokenizer={name!r}); "
                "leave it out to take the tokenizer's"
            )


def _multimodal_loader(run, tokenizer, shards, weights, field: str) -> MultimodalLoader:
    data = run.data
    weights = weights or (1.0,) * len(shards)
    index, count = process_share(run)
    try:
        sources = [ShardSource(shard_set_path(n), weight) for n, weight in zip(shards, weights)]
        return MultimodalLoader(
            sources, seq_len=data.seq_len, batch_size=data.batch_size // count,
            patch_budget=data.patch_budget, seed=data.seed, tokenizer=tokenizer,
            processor=data.processor, num_workers=data.workers, on_error=data.on_error,
            max_consecutive_skips=data.max_consecutive_skips, shard_index=index, shard_count=count,
        )  # fmt: skip
    except (OSError, ValueError, DataError) as e:
        raise RunError(f"{field}={list(shards)}: {e}") from None
