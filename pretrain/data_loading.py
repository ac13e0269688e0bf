"""The data iterator a run asks for: packed text (`data.source`), or the native multimodal Grain
pipeline over shard sets (`data.shards`), whose batches carry patches for the vision tower.

Either iterator yields dicts of NumPy arrays and has `state()` / `restore(state)`, saved in every
checkpoint so that a resumed run continues with exactly the next batch.
"""

import jax

from data.demo_corpus import demo_shard_sets
from data.mm_documents import DataError
from data.mm_loader import MultimodalLoader, ShardSource
from data.text_corpus import load_documents
from data.text_loader import PackedTextLoader
from data.tokenizer import ByteTokenizer
from m3jax.config import ModelConfig
from pretrain.config import RunConfig, RunError

DEMO_PREFIX = "demo:"  # "demo:multimodal", "demo:text": the bundled corpus, built on first use


def make_loader(run: RunConfig) -> PackedTextLoader | MultimodalLoader:
    tokenizer = ByteTokenizer()
    check_vocabulary(run.model, tokenizer)
    if run.data.shards:
        return _multimodal_loader(run, tokenizer)
    try:
        documents = load_documents(run.data.source)
        return PackedTextLoader(
            documents, tokenizer, seq_len=run.data.seq_len, batch_size=run.data.batch_size,
            seed=run.data.seed,
        )  # fmt: skip
    except (OSError, ValueError, TypeError) as e:
        raise RunError(f"data.source={run.data.source!r}: {e}") from None


def _multimodal_loader(run: RunConfig, tokenizer: ByteTokenizer) -> MultimodalLoader:
    data = run.data
    check_placeholders(run.model, tokenizer)
    weights = data.weights or (1.0,) * len(data.shards)
    if jax.process_count() > 1 and data.batch_size % jax.process_count():
        raise RunError(
            f"data.batch_size={data.batch_size} does not split over {jax.process_count()} processes"
        )
    try:
        sources = [
            ShardSource(_shard_path(name), weight) for name, weight in zip(data.shards, weights)
        ]
        return MultimodalLoader(
            sources, seq_len=data.seq_len, batch_size=data.batch_size // jax.process_count(),
            patch_budget=data.patch_budget, seed=data.seed, tokenizer=tokenizer,
            processor=data.processor, num_workers=data.workers, on_error=data.on_error,
        )  # fmt: skip
    except (OSError, ValueError, DataError) as e:
        raise RunError(f"data.shards={list(data.shards)}: {e}") from None


def check_vocabulary(model: ModelConfig, tokenizer: ByteTokenizer) -> None:
    """The model must have an embedding row for every id of the tokenizer: RunError otherwise."""
    if model.vocab_size < tokenizer.vocab_size:
        raise RunError(
            f"model.vocab_size={model.vocab_size} is smaller than the byte "
            f"tokenizer's {tokenizer.vocab_size} ids"
        )


def check_placeholders(model: ModelConfig, tokenizer: ByteTokenizer) -> None:
    """A vision model's image/video placeholder ids must be the tokenizer's: RunError otherwise."""
    if model.vision is None:
        return
    expected = {"image_token_id": tokenizer.image_id, "video_token_id": tokenizer.video_id}
    for name, token_id in expected.items():
        if getattr(model.vision, name) != token_id:
            raise RunError(
                f"model.vision.{name}={getattr(model.vision, name)} is not the tokenizer's "
                f"placeholder id {token_id}"
            )


def _shard_path(name: str) -> str:
    if not name.startswith(DEMO_PREFIX):
        return name
    sets = demo_shard_sets()
    kind = name.removeprefix(DEMO_PREFIX)
    if kind not in sets:
        raise ValueError(
            f"unknown demo shard set {name!r}; there are {sorted(DEMO_PREFIX + k for k in sets)}"
        )
    return str(sets[kind])
