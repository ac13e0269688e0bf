"""The cost model against spec/msa.md §3's M3 figures, the parameter count, and the per-device
memory plan against what a real mesh holds."""

import dataclasses

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from tiny import tiny_run, tiny_vision_run

from m3jax import cost_model, sharding
from m3jax.counting import count_params
from m3jax.model import functional
from pretrain.config import load_run_config

M3 = load_run_config("configs/m3.yaml").model
MILLION = 2**20


def test_attention_flops_match_the_spec_figures_for_m3_at_1m_tokens():
    dense = cost_model.layer_attention_flops(M3, "full", MILLION)
    sparse = cost_model.layer_attention_flops(M3, "msa", MILLION)
    np.testing.assert_allclose(dense, 1.72e10, rtol=3e-3)
    np.testing.assert_allclose(sparse, 6.0e8, rtol=1e-2)
    np.testing.assert_allclose(dense / sparse, 28.4, rtol=1e-2)
    total = cost_model.attention_flops_per_token(M3, MILLION)
    assert total == 3 * dense + 57 * sparse


def test_msa_costs_dense_attention_plus_the_indexer_while_every_block_is_kept():
    short = M3.msa.topk_blocks * M3.msa.block_size  # 2048: MSA keeps every block
    indexer = 2 * M3.msa.index_heads * M3.msa.index_head_dim * (short + 1) / 2
    np.testing.assert_allclose(
        cost_model.layer_attention_flops(M3, "msa", short),
        cost_model.layer_attention_flops(M3, "full", short) + indexer,
    )


def test_matmul_flops_are_twice_the_active_text_weights():
    active = count_params(functional(M3)).active
    params = functional(M3).shapes()[0]
    vision = sum(x.size for part in ("vision", "projector") for x in jax.tree.leaves(params[part]))
    embed = M3.vocab_size * M3.hidden_size
    assert cost_model.matmul_flops_per_token(M3) == 2 * (active - vision - embed)
    text_only = dataclasses.replace(M3, vision=None)
    assert cost_model.matmul_flops_per_token(text_only) == cost_model.matmul_flops_per_token(M3)


def test_bytes_per_device_of_a_plan_equal_what_a_real_mesh_holds():
    config = tiny_run().model
    model = functional(config)
    shapes, _ = model.shapes()
    sizes = {"data": 1, "fsdp": 2, "expert": 2, "seq": 1, "tensor": 1}
    mesh = sharding.make_mesh(sizes)  # 4 fake CPU devices (tests/conftest.py)
    real = sharding.tree_shardings(model.param_axes, shapes, mesh)
    params = jax.jit(lambda: model.init(0)[0], out_shardings=real)()
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    plan = AbstractMesh(tuple(sizes.values()), sharding.MESH_AXES)
    planned = sharding.tree_shardings(model.param_axes, shapes, plan)
    assert sharding.bytes_per_device(shapes, planned) == held
    total = sum(x.size * 4 for x in jax.tree.leaves(shapes))
    assert total / 4 <= held < total  # sharded, though not every axis divides
    assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(planned))


def test_packed_forward_flops_match_a_hand_count_for_a_tiny_multimodal_model():
    # tiny: D 32, 4 heads / 2 KV of dim 8, vocab 272; layer 0 full attention + dense MLP (64),
    # layer 1 MSA (2 index heads of dim 8, blocks of 4, top 2) + MoE (top 2 of 4 experts of 16,
    # a shared expert of 16); one MTP module (an MSA + MoE layer); a 1-layer ViT 24 wide, 2 heads.
    config = tiny_vision_run(model={"mtp": {"num_modules": 1}}).model
    attention_weights = 32 * 4 * 8 * 2 + 32 * 2 * 8 * 2 + 8 + 8  # q, o; k, v; q/k norms
    dense_layer = 2 * 32 + attention_weights + 3 * 32 * 64
    indexer = 32 * 2 * 8 + 32 * 8 + 8 + 8
    moe = 32 * 4 + 3 * 32 * 16 + 3 * 32 * 16 * 4 * 2 / 4  # router, shared, routed: 2 of 4
    msa_layer = 2 * 32 + attention_weights + indexer + moe
    lm_head = 32 * 272
    text_token = dense_layer + msa_layer + 32 + lm_head  # + the final norm
    mtp_token = 3 * 32 + 2 * 32 * 32 + msa_layer + lm_head  # 3 norms, the [2D, D] projection
    vit_layer = 4 * 24 + 4 * (24 * 24 + 24) + (24 * 32 + 32) + (32 * 24 + 24)
    patch = 1176 * 24 + 2 * 24 + vit_layer + (24 * 16 + 16) + (16 * 32 + 32)
    window = (4 * 32 * 16 + 16) + (16 * 32 + 32)  # the merge MLP, once per 2×2 patches
    assert cost_model.active_weights(functional(config)) == cost_model.ActiveWeights(
        text_token=text_token, mtp_token=mtp_token, patch=patch, window=window
    )

    segment_ids = np.array([[1] * 5 + [2] * 12 + [3] * 15, [1] * 20 + [0] * 12])
    patch_segment_ids = np.array([[1] * 8 + [2] * 4 + [0] * 4, [1] * 16])
    pieces, chunks = [5, 12, 15, 20], [8, 4, 16]

    def attention(n, kept=None):  # 4·H·Dh per visible key; MSA's indexer 2·Hi·Di per causal key
        keys = sum(min(i, kept or i) for i in range(1, n + 1))
        return 4 * 4 * 8 * keys + (2 * 2 * 8 * sum(range(1, n + 1)) if kept else 0)

    def forward(msa_kept, vision=True):
        text = sum(2 * text_token * n + attention(n) + attention(n, msa_kept) for n in pieces)
        mtp = sum(2 * mtp_token * (n - 1) + attention(n - 1, msa_kept) for n in pieces)
        vit = sum(2 * patch * m + 2 * window * m / 4 + 4 * 2 * 12 * m * m for m in chunks)
        return text + mtp + (vit if vision else 0)  # MTP: each piece less its last position

    weights = cost_model.active_weights(functional(config))
    for msa_dense, kept in ((False, 2 * 4), (True, 10**9)):
        counted = cost_model.packed_forward_flops(
            config, weights, segment_ids, patch_segment_ids, msa_dense=msa_dense
        )
        np.testing.assert_allclose(counted, forward(kept), rtol=1e-12)
    text_only = cost_model.packed_forward_flops(config, weights, segment_ids)
    np.testing.assert_allclose(text_only, forward(8, vision=False), rtol=1e-12)


def test_msa_attention_equals_dense_up_to_topk_blocks_keys_and_costs_less_beyond():
    kept = M3.msa.topk_blocks * M3.msa.block_size  # 2048
    lengths = np.array([1, 7, 128, 1000, kept, kept + 1, 2 * kept, 8 * kept, 64 * kept])
    indexer = 2 * M3.msa.index_heads * M3.msa.index_head_dim * lengths * (lengths + 1) / 2

    def per_document(kind, **mode):
        return np.array(
            [cost_model.document_attention_flops(M3, kind, [n], **mode) for n in lengths]
        )

    dense = per_document("full")
    main_branch = per_document("msa") - indexer
    short = lengths <= kept
    np.testing.assert_allclose(main_branch[short], dense[short])
    assert np.all(main_branch[~short] < dense[~short])
    np.testing.assert_allclose(per_document("msa", msa_dense=True), dense + indexer)
    saving = dense / per_document("msa")  # the indexer included
    long = lengths >= 2 * kept
    assert np.all(saving[long] > 1) and np.all(np.diff(saving[long]) > 0)
