"""Generation with a KV cache: a prefill of the prompts, then one decode step per new token.

    tokens = m3jax.generate(config, weights, prompts, pixel_values=..., image_grid_thw=...,
                            max_new_tokens=32, temperature=0.0)

`prefill` runs the ordinary forward pass over the prompts (the same layers, selection and
numerics as `m3jax.forward`) and keeps every layer's keys and values, and on MSA layers the index
keys (m3jax/kv_cache.py). `decode_step` appends one token per row: dense layers attend over the
cache, MSA layers score the cached index keys, keep the query's top-k blocks and attend over those
only (m3jax/decode_attention.py), so a step equals the full forward's last position. Both are
jitted with static shapes: prompts are right-padded to a multiple of `SLOT_BUCKET` slots and the
cache holds a multiple of it too, so calls of similar sizes reuse one compilation. Right padding
keeps every row's tokens at slots 0.. (slot = position), exactly as the row alone, so its MSA
blocks lie where transformers puts them (left padding would shift them, spec §10).

Shapes: B batch, S prompt slots, T cache slots, V vocab.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import kv_cache
from m3jax.attention import ForwardMode
from m3jax.config import ModelConfig
from m3jax.inference import vision_inputs
from m3jax.kv_cache import KVCache
from m3jax.model import functional
from m3jax.sampling import Sampling, sample

SLOT_BUCKET = 64  # prompt slots and cache slots are multiples of this (and of the MSA block size)


def generate(
    config: ModelConfig,
    weights: dict,
    prompts: np.ndarray | Sequence[Sequence[int]],
    pixel_values: np.ndarray | None = None,
    image_grid_thw: np.ndarray | None = None,
    pixel_values_videos: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    on_tokens: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """New tokens for each prompt: greedy by default, else sampled (m3jax/sampling.py).

    prompts: token ids [B, S], or B sequences of different lengths. The vision arguments are
      transformers' (m3jax.forward), covering the placeholders of all prompts in order.
    eos_token_id: a row stops after producing it; generation ends when every row has.
    on_tokens: called after every step with that step's ids [B] (-1 for rows already stopped):
      streaming output.
    Returns [B, max_new_tokens] int32: the new ids, -1 after a row's eos.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    logits, cache = prefill(
        config, weights, prompts, max_new_tokens=max_new_tokens, pixel_values=pixel_values,
        image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
        video_grid_thw=video_grid_thw,
    )  # fmt: skip
    choose = _sampler(sampling)
    rng = jax.random.key(seed)
    out = np.full((len(cache.lengths), max_new_tokens), -1, np.int32)
    stopped = np.zeros(len(out), bool)
    for step in range(max_new_tokens):
        rng, key = jax.random.split(rng)
        tokens = choose(logits, key)
        ids = np.where(stopped, -1, np.asarray(tokens))
        out[:, step] = ids
        if on_tokens is not None:
            on_tokens(ids)
        if eos_token_id is not None:
            stopped |= ids == eos_token_id
        if stopped.all() or step + 1 == max_new_tokens:
            break
        logits, cache = decode_step(config, weights, tokens, cache)
    return out


def prefill(
    config: ModelConfig,
    weights: dict,
    prompts: np.ndarray | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    **media: np.ndarray | None,
) -> tuple[jax.Array, KVCache]:
    """The prompts' forward pass -> (logits [B, V] fp32 at each row's last prompt token, a cache
    with room for `max_new_tokens` more tokens per row). media: the vision arguments of
    `generate` (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)."""
    rows = [np.asarray(row, np.int32).reshape(-1) for row in prompts]
    lengths = np.array([len(row) for row in rows], np.int32)
    if not len(rows) or lengths.min() < 1:
        raise ValueError(f"every prompt needs at least one token, got lengths {lengths.tolist()}")
    bucket = _slot_bucket(config)
    slots = _round_up(int(lengths.max()), bucket)
    tokens = np.zeros((len(rows), slots), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    padding = np.arange(slots)[None, :] >= lengths[:, None]
    vision = vision_inputs(config, np.where(padding, -1, tokens), **media)
    run = _prefill_program(config, _round_up(slots + max_new_tokens, bucket))
    return run(weights["params"], weights["buffers"], tokens, lengths, vision)


def decode_step(
    config: ModelConfig, weights: dict, tokens: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """Appends tokens [B] (one per row) -> (logits [B, V] fp32 for the next, the longer cache).

    The cache is donated: use only the one returned.
    """
    if int(jnp.max(cache.lengths)) >= cache.stacks[0].keys.shape[2]:
        raise ValueError(f"the KV cache is full ({cache.stacks[0].keys.shape[2]} slots)")
    step = _decode_program(config)
    return step(weights["params"], weights["buffers"], jnp.asarray(tokens)[:, None], cache)


def decoding_config(config: ModelConfig) -> ModelConfig:
    """The config generation runs: capacity dispatch would drop tokens by batch composition, so
    its MoE layers run dropless (transformers' semantics); nothing else changes."""
    if config.moe.dispatch != "capacity":
        return config
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, dispatch="dropless"))


@functools.lru_cache(maxsize=8)
def _prefill_program(config: ModelConfig, cache_length: int):
    model = functional(decoding_config(config))

    def run(params, buffers, tokens, lengths, vision):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        segment_ids = (positions < lengths[:, None]).astype(jnp.int32)  # 0 = padding
        logits, stats = model.apply(
            params, buffers, tokens, positions, segment_ids, vision, ForwardMode(kv_cache=True)
        )
        cache = kv_cache.from_prefill([s.cache for s in stats], lengths, cache_length)
        return logits[jnp.arange(tokens.shape[0]), lengths - 1], cache

    return jax.jit(run)


@functools.lru_cache(maxsize=8)
def _decode_program(config: ModelConfig):
    return jax.jit(functional(decoding_config(config)).decode, donate_argnames="cache")


@functools.lru_cache(maxsize=8)
def _sampler(sampling: Sampling):
    return jax.jit(functools.partial(sample, sampling=sampling))


def _slot_bucket(config: ModelConfig) -> int:
    return math.lcm(SLOT_BUCKET, config.msa.block_size)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
