"""The cost model against spec/msa.md §3's M3 figures, the parameter count, and the per-device
memory plan against what a real mesh holds."""

import dataclasses

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from tiny import tiny_run

from m3jax import cost_model, sharding
from m3jax.counting import count_params
from m3jax.model import functional
from pretrain.config import load_run_config

M3 = load_run_config("configs/m3.yaml").model
MILLION = 2**20


def test_attention_flops_match_the_spec_figures_for_m3_at_1m_tokens():
    dense = cost_model.layer_attention_flops(M3, "full_attention", MILLION)
    sparse = cost_model.layer_attention_flops(M3, "minimax_m3_sparse", MILLION)
    np.testing.assert_allclose(dense, 1.72e10, rtol=3e-3)
    np.testing.assert_allclose(sparse, 6.0e8, rtol=1e-2)
    np.testing.assert_allclose(dense / sparse, 28.4, rtol=1e-2)
    total = cost_model.attention_flops_per_token(M3, MILLION)
    assert total == 3 * dense + 57 * sparse


def test_msa_costs_dense_attention_plus_the_indexer_while_every_block_is_kept():
    short = M3.msa.topk_blocks * M3.msa.block_size  # 2048: MSA keeps every block
    indexer = 2 * M3.msa.index_heads * M3.msa.index_head_dim * (short + 1) / 2
    np.testing.assert_allclose(
        cost_model.layer_attention_flops(M3, "minimax_m3_sparse", short),
        cost_model.layer_attention_flops(M3, "full_attention", short) + indexer,
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
