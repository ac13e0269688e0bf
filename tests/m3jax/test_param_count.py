"""The m3 config's parameter count, derived by hand from spec/m3_architecture.md §7.1, and that
of small-gpu-multimodal's vision tower.

Built abstractly (jax.eval_shape): nothing is allocated.
"""

import dataclasses

from conftest import REPO

from m3jax.counting import count_params
from m3jax.model import functional
from pretrain.config import load_run_config


def test_param_count_m3_matches_hand_formula():
    config = load_run_config(REPO / "configs/m3.yaml").model
    d, vocab, heads, kv_heads, head_dim = 6144, 200064, 64, 4, 128
    index_heads, index_dim = 4, 128
    experts, k, expert_dim, shared_dim, dense_dim = 128, 4, 3072, 3072, 12288
    n_dense, n_sparse = 3, 57

    attention = (
        2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 2 * head_dim
    )  # q,o,k,v,norms
    indexer = d * index_heads * index_dim + d * index_dim + 2 * index_dim
    dense_mlp = 3 * d * dense_dim
    routed = experts * 3 * d * expert_dim
    moe = d * experts + routed + 3 * d * shared_dim  # router, experts, shared expert
    layer_norms = 2 * d
    # Vision tower (§4, §7.1): patch embedding, pre-LN, 32 layers; projector and 2x2 merge MLP.
    dv, iv, pj, vision_layers, patch = 1280, 5120, 6144, 32, 3 * 2 * 14 * 14
    vision_layer = 4 * (dv * dv + dv) + 2 * 2 * dv + (dv * iv + iv) + (iv * dv + dv)
    projector = (dv * pj + pj) + (pj * d + d) + (4 * d * pj + pj) + (pj * d + d)
    vision = dv * patch + 2 * dv + vision_layers * vision_layer + projector
    total = (
        2 * vocab * d  # embeddings and untied lm_head
        + d  # final norm
        + n_dense * (attention + dense_mlp + layer_norms)
        + n_sparse * (attention + indexer + moe + layer_norms)
        + vision
    )
    active = total - n_sparse * routed + n_sparse * routed * k // experts

    count = count_params(functional(config))
    assert count.total == total
    assert count.active == active
    # The published "≈400B total, ≈20B active" class: our exact figures are 427.0B and 26.8B
    # (0.87B of both is the vision tower and projector, counted as active).
    assert vision == 865_567_232
    assert 4.2e11 < count.total < 4.3e11 and 2.5e10 < count.active < 2.7e10


def test_param_count_small_gpu_multimodal_is_small_gpu_plus_its_vision_tower():
    text = load_run_config(REPO / "configs/small-gpu.yaml")
    multimodal = load_run_config(REPO / "configs/small-gpu-multimodal.yaml")
    assert dataclasses.replace(multimodal.model, vision=None) == text.model  # the same decoder
    for section in ("optimizer", "train", "mesh", "checkpoint", "logging"):
        assert getattr(multimodal, section) == getattr(text, section)
    assert (multimodal.data.seq_len, multimodal.data.batch_size) == (4096, 4)
    # ViT (§4) of 4 layers, width 1024, MLP 4096, and its projector to the text width 1024
    d, dv, iv, pj, layers, patch = 1024, 1024, 4096, 1024, 4, 3 * 2 * 14 * 14
    vision_layer = 4 * (dv * dv + dv) + 2 * 2 * dv + (dv * iv + iv) + (iv * dv + dv)
    projector = (dv * pj + pj) + (pj * d + d) + (4 * d * pj + pj) + (pj * d + d)
    vision = dv * patch + 2 * dv + layers * vision_layer + projector
    before, after = count_params(functional(text.model)), count_params(functional(multimodal.model))
    assert (after.total - before.total, after.active - before.active) == (vision, vision)
    assert vision == 58_935_296 and 1.1e9 < after.total < 1.2e9
