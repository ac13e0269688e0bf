"""A tiny run config for training tests: MSA selection active, MoE on, a few ms per step."""

from m3jax.config_loading import from_mapping
from pretrain.config import RunConfig

TINY = {
    "model": {
        "vocab_size": 272,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rotary_dim": 4,
        "dense_mlp_dim": 64,
        "layer_types": ["full", "msa"],
        "mlp_layer_types": ["dense", "moe"],
        "msa": {"index_heads": 2, "index_head_dim": 8, "block_size": 4, "topk_blocks": 2},
        "moe": {
            "num_experts": 4,
            "experts_per_token": 2,
            "expert_dim": 16,
            "shared_expert_dim": 16,
            "bias_update_rate": 0.01,
        },
    },
    "data": {"source": "shakespeare", "seq_len": 32, "batch_size": 4},
    "optimizer": {"lr": 3e-3, "warmup_steps": 2},
    "train": {"steps": 6},
    # synchronous saves keep these tests' timing simple; the default (async) has its own tests
    # (test_multimodal_training, test_soak, test_checkpoint_faults)
    "checkpoint": {"every_steps": 3, "keep": 5, "async_save": False},
    "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": True},
}


def tiny_run(**sections) -> RunConfig:
    """TINY with keys replaced, nested dicts merged: tiny_run(model={"msa": {"topk_blocks": 3}})."""
    return from_mapping(RunConfig, _merged(TINY, sections), where="tiny")


def _merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        is_section = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merged(base[key], value) if is_section else value
    return out


# A ViT of head dim 12 (3 axes × 4 rotary channels, none unrotated) and one layer, for model tests.
TINY_VISION = {
    "hidden_size": 24,
    "intermediate_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "projector_hidden_size": 16,
    "image_token_id": 270,
    "video_token_id": 271,
}


def tiny_vision_run(**sections) -> RunConfig:
    """tiny_run with a vision tower (token ids 270/271 lie above the byte tokenizer's 263)."""
    return tiny_run(**_merged({"model": {"vision": TINY_VISION}}, sections))
