"""m3jax: MiniMax-M3-class models in JAX.

The one-call API for notebooks and interop:

    config, weights = m3jax.load_pretrained("path/to/MiniMax-M3")   # config.json + safetensors
    logits = m3jax.forward(config, weights, input_ids, pixel_values=..., image_grid_thw=...)
    m3jax.save_pretrained(config, weights, "out/")                   # transformers loads it
    new_tokens = m3jax.generate(config, weights, prompts, max_new_tokens=32)  # KV-cached decoding

weights = {"params": ..., "buffers": ...}: the nested dicts `m3jax.model.functional(config).init`
returns (buffers = the routers' correction biases). Training lives in the `pretrain` package.

Importing m3jax (or any module of it) changes nothing outside it: the API above loads on first use,
and the XLA flags the GPU runs want (`m3jax.xla_flags`) are applied by the entry points that start
them (m3-train, the benchmarks), not here.

Shape letters, in every file's legend, shape comments and einsums, each with one meaning (m3jax,
pretrain and the attention and MoE kernels; pallas_kernels/msa is still to follow: its k, E and R
are selected blocks, selection entries and kernel rows):

    B   batch rows                     S   sequence (queries)        T   keys / cache slots
    D   model width                    Dv  vision width              V   vocab
    H   query heads (text or ViT)      K   kv heads (= Hi)           G   = H / K, heads per kv head
    Hi  index heads                    Dh  head dim                  Di  index head dim
    F   MLP hidden width (dense, expert, ViT, projector)             L   layers
    E   experts                        k   experts per token         N   tokens (= B·S, flattened)
    R   = N·k routed rows (one per token and chosen expert)          C   capacity (rows per expert)
    Ep  expert-parallel devices        P   patches (rows of pixel features)
    U   vision units (an image or a video chunk: a grid_thw row)     m   spatial merge size
    M   segment slots per row (cuDNN's packed attention)

Written as words, never letters: `block_size` and `topk_blocks` (spec/msa.md's B and K),
`rotary_dim`, `patch_dim` (= 3·temporal_patch_size·patch_size²), `tiles` (of a grouped matmul's
`block_m` rows), `chunks`. Subscripted tiles and windows of one kernel (Tq a query
tile, W a window of queries) are local to their files.
"""

import importlib

_API = {
    "forward": "m3jax.inference",
    "forward_with_trace": "m3jax.inference",
    "generate": "m3jax.generation",
    "load_pretrained": "m3jax.convert.pretrained",
    "save_pretrained": "m3jax.convert.pretrained",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'm3jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
