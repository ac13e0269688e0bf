"""One-call inference with transformers' argument names: `forward(config, weights, input_ids,
pixel_values=..., image_grid_thw=..., ...)` -> logits, for notebooks, tests and parity checks.

The vision arguments are converted on the host into static-shape `VisionInputs`
(m3jax/vision_inputs.py); the jitted model is compiled once per config and input shape.
`forward_with_trace` also returns what transformers can be asked for layer by layer (hidden states,
MSA block selections, router choices), indexed by transformers' global layer numbers.

Shapes: B batch, S sequence, D width, V vocab, Hi index heads, k experts per token,
topk_blocks selected blocks per query.
"""

import functools

import jax
import numpy as np

from m3jax.config import ModelConfig
from m3jax.model import functional, layer_runs
from m3jax.vision_inputs import VisionInputs, pack_vision_inputs


def forward(
    config: ModelConfig,
    weights: dict,
    input_ids: np.ndarray,
    pixel_values: np.ndarray | None = None,
    image_grid_thw: np.ndarray | None = None,
    pixel_values_videos: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    *,
    positions: np.ndarray | None = None,
    segment_ids: np.ndarray | None = None,
    patch_budget: int | None = None,
) -> jax.Array:
    """Logits [B, S, V] fp32 for input_ids [B, S] (transformers' names and meaning).

    weights: {"params": ..., "buffers": ...} (`load_pretrained`, or `functional(config).init`).
    positions / segment_ids: [B, S]; default 0..S-1 and one document per row, as transformers.
    patch_budget: pad the packed patches to this many rows (fixed shapes across calls).
    """
    tokens, positions, segment_ids, vision = _inputs(
        config, input_ids, positions, segment_ids, patch_budget,
        pixel_values=pixel_values, image_grid_thw=image_grid_thw,
        pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
    )  # fmt: skip
    apply, _ = _compiled(config)
    logits, _ = apply(weights["params"], weights["buffers"], tokens, positions, segment_ids, vision)
    return logits


def forward_with_trace(
    config: ModelConfig,
    weights: dict,
    input_ids: np.ndarray,
    pixel_values: np.ndarray | None = None,
    image_grid_thw: np.ndarray | None = None,
    pixel_values_videos: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    *,
    positions: np.ndarray | None = None,
    segment_ids: np.ndarray | None = None,
    patch_budget: int | None = None,
) -> tuple[jax.Array, dict]:
    """`forward`, plus a trace: {"hidden_states": [L + 1] x [B, S, D] (the first layer's input,
    then every layer's output), "blocks": {layer: [B, S, Hi, topk_blocks]} on MSA layers (-1 =
    none), "experts": {layer: [B, S, k]} on MoE layers}."""
    tokens, positions, segment_ids, vision = _inputs(
        config, input_ids, positions, segment_ids, patch_budget,
        pixel_values=pixel_values, image_grid_thw=image_grid_thw,
        pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
    )  # fmt: skip
    apply, embeddings = _compiled(config)
    params, buffers = weights["params"], weights["buffers"]
    logits, stats = apply(
        params, buffers, tokens, positions, segment_ids, vision, output_hidden_states=True
    )
    trace = {"hidden_states": [embeddings(params, buffers, tokens, vision)], "blocks": {},
             "experts": {}}  # fmt: skip
    layer = 0
    for stack_stats, (_, _, count) in zip(stats, layer_runs(config), strict=True):
        for i in range(count):
            trace["hidden_states"].append(stack_stats.hidden[i])
            if stack_stats.msa is not None and stack_stats.msa.blocks is not None:
                trace["blocks"][layer] = stack_stats.msa.blocks[i]
            if stack_stats.moe is not None:
                trace["experts"][layer] = stack_stats.moe.experts[i]
            layer += 1
    return logits, trace


def vision_inputs(
    config: ModelConfig, tokens: np.ndarray, patch_budget: int | None = None, **media
) -> VisionInputs | None:
    """transformers' vision arguments (`media`: pixel_values, image_grid_thw, ...) for the tokens
    [B, S] -> VisionInputs, or None without media. Raises ValueError when they do not fit."""
    if any(value is not None for value in media.values()):
        if config.vision is None:
            raise ValueError("pixel inputs given, but the model is text-only (config.vision=None)")
        return pack_vision_inputs(tokens, config.vision, patch_budget=patch_budget, **media)
    if config.vision is not None:
        pack_vision_inputs(tokens, config.vision)  # raises if placeholders have no pixels
    return None


@functools.lru_cache(maxsize=8)
def _compiled(config: ModelConfig):
    model = functional(config)
    return jax.jit(model.apply, static_argnames="output_hidden_states"), jax.jit(model.embeddings)


def _inputs(config, input_ids, positions, segment_ids, patch_budget, **media):
    tokens = np.asarray(input_ids, np.int32)
    if tokens.ndim != 2:
        raise ValueError(f"input_ids must be [batch, sequence], got shape {list(tokens.shape)}")
    if positions is None:
        positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    if segment_ids is None:
        segment_ids = np.ones(tokens.shape, np.int32)
    vision = vision_inputs(config, tokens, patch_budget, **media)
    return tokens, np.asarray(positions, np.int32), np.asarray(segment_ids, np.int32), vision
