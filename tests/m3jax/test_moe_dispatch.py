"""MoE dispatch modes on one device: dropless and capacity equal the dense reference (outputs and
gradients, router included) when nothing drops; capacity drops the latest tokens and counts them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxpr_values import primitive_calls
from moe_cases import assert_trees_close, inputs, moe_config, random_state, run, with_moe
from tiny import tiny_run

from m3jax.model import functional
from m3jax.moe.local import ExpertWeights, RowOrder, capacity, grouped_ffn, sort_rows


def test_capacity_is_factor_times_fair_share_clipped_to_tokens():
    assert capacity(48, 2, 8, 1.0) == 12
    assert capacity(48, 2, 8, 1.25) == 15
    assert capacity(10, 2, 8, 1.0) == 3  # ⌈2.5⌉
    assert capacity(48, 2, 8, 100.0) == 48  # an expert gets at most one row per token
    assert capacity(4, 1, 64, 0.01) == 1


def test_sort_rows_groups_by_expert_in_token_order():
    chosen = jnp.asarray([[2, 0], [0, 1], [2, 1], [0, 2]])  # [N=4, k=2]
    rows = sort_rows(chosen, num_experts=4)
    # rows are token · k + choice: expert 0 <- rows 1, 2, 6; expert 1 <- 3, 5; expert 2 <- 0, 4, 7
    np.testing.assert_array_equal(rows.order, [1, 2, 6, 3, 5, 0, 4, 7])
    np.testing.assert_array_equal(rows.expert_ids, [0, 0, 0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(rows.group_sizes, [3, 2, 3, 0])


def test_dispatch_modes_agree_with_dense_when_nothing_drops():
    config = moe_config()
    state, (x, mask, cotangent) = random_state(config), inputs()
    out, stats, grads = run(with_moe(config, dispatch="dense"), state, x, mask, cotangent)
    load = np.asarray(stats.load)
    assert load[-1] == 0 and load.max() > 2 * load.mean()  # uneven, one expert idle
    assert np.abs(np.asarray(grads["state"]["router"])).max() > 0
    for dispatch, factor in (("dropless", 1.0), ("capacity", 4.0)):  # C = ⌈4 · N·2 / 8⌉ = N
        variant = with_moe(config, dispatch=dispatch, capacity_factor=factor)
        out_v, stats_v, grads_v = run(variant, state, x, mask, cotangent)
        assert_trees_close(out_v, out, err_msg=dispatch)
        assert_trees_close(grads_v, grads, err_msg=dispatch)
        np.testing.assert_array_equal(stats_v.load, stats.load)
        np.testing.assert_allclose(stats_v.score_share, stats.score_share, rtol=1e-6)
        assert float(stats_v.dropped_fraction) == 0.0


def test_capacity_drops_the_latest_tokens_of_a_full_expert():
    """6 tokens, 2 experts, top-1, capacity ⌈1.0 · 6 / 2⌉ = 3. A one-hot router sends tokens
    0, 2, 3, 5 to expert 0 and 1, 4 to expert 1: expert 0 keeps 0, 2, 3 and drops token 5."""
    config = moe_config(
        num_experts=2, experts_per_token=1, dispatch="capacity", capacity_factor=1.0
    )
    state = random_state(config)
    state["correction_bias"] = jnp.zeros(2)
    state["router"] = jnp.zeros((8, 2)).at[0, 0].set(10.0).at[1, 1].set(10.0)
    experts = np.array([0, 1, 0, 0, 1, 0])
    rng = np.random.default_rng(3)
    x = rng.normal(0, 0.1, (1, 6, 8))
    x[0, np.arange(6), experts] = 1.0  # channel e large -> expert e
    x, mask = jnp.asarray(x, jnp.float32), jnp.ones((1, 6), bool)
    cotangent = jnp.ones_like(x)

    out, stats, grads = run(config, state, x, mask, cotangent)
    reference, _, _ = run(with_moe(config, dispatch="dense"), state, x, mask, cotangent)
    no_routed, _, _ = run(with_moe(config, routed_scaling=0.0), state, x, mask, cotangent)
    np.testing.assert_array_equal(stats.load, [4, 2])
    np.testing.assert_allclose(float(stats.dropped_fraction), 1 / 6)
    # capacity and dense dispatch sum in different orders: float32 rounding, also near zero
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[0, :5], reference[0, :5], **close)
    np.testing.assert_allclose(out[0, 5], no_routed[0, 5], **close)  # shared expert only
    assert np.abs(np.asarray(out[0, 5] - reference[0, 5])).max() > 1e-2
    # The dropped token sends no gradient to expert 0's weights; a kept one does.
    _, _, grads_without_5 = run(config, state, x, mask, cotangent.at[0, 5].set(0.0))
    np.testing.assert_allclose(
        grads["state"]["gate_proj"], grads_without_5["state"]["gate_proj"], rtol=1e-6
    )

    larger = with_moe(config, capacity_factor=4 / 3)  # C = 4: nothing drops
    out, stats, _ = run(larger, state, x, mask, cotangent)
    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_allclose(out, reference, **close)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_dispatch_bfloat16_stays_close_to_float32(dispatch):
    config = moe_config(dispatch=dispatch, capacity_factor=4.0)
    state, (x, mask, cotangent) = random_state(config), inputs()
    out32, _, _ = run(config, state, x, mask, cotangent)
    out16, _, _ = run(config, state, x.astype(jnp.bfloat16), mask, cotangent)
    assert out16.dtype == jnp.bfloat16
    scale = float(jnp.abs(out32).max())
    assert float(jnp.abs(out16.astype(jnp.float32) - out32).max()) < 3e-2 * scale


def test_moe_block_with_the_kernel_equals_ragged_dot():
    """The whole MoE block on one device: tokens go straight into the tile layout and back
    (`tiled_pairs_ffn`), uneven loads and an idle expert; outputs and all gradients."""
    config = with_moe(moe_config(), expert_dim=128, grouped_matmul="mosaic_gpu")
    config = dataclasses.replace(config, hidden_size=128, dtype="bfloat16")
    state = random_state(config)
    rng = np.random.default_rng(1)
    x, cotangent = (jnp.asarray(rng.normal(0, 1, (2, 96, 128)), jnp.bfloat16) for _ in range(2))
    mask = jnp.ones((2, 96), bool)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):  # the kernels on CPU
        got = run(config, state, x, mask, cotangent)
    expected = run(with_moe(config, grouped_matmul="xla"), state, x, mask, cotangent)
    np.testing.assert_array_equal(got[1].load, expected[1].load)
    assert np.asarray(got[1].load)[-1] == 0  # the idle expert
    for a, b in zip(jax.tree.leaves((got[0], got[2])), jax.tree.leaves((expected[0], expected[2]))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 3e-2 * np.abs(b).max()


@pytest.mark.parametrize("impl", ["xla", "mosaic_gpu"])
def test_grouped_ffn_in_row_order_equals_sorting_first(impl):
    """Rows that reach expert order only through a permutation (as the EP exchange receives them),
    with unused rows at the end: the result comes back in the rows' own order, and equals
    sorting first, running the sorted rows, and unsorting; outputs and gradients."""
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([70, 0, 131, 9], jnp.int32)  # an idle expert, tiles straddled
    used, num_rows, dim, width = int(sizes.sum()), 256, 128, 128
    position = np.arange(num_rows, dtype=np.int32)
    position[:used] = rng.permutation(used)  # unused rows stay put, as in the exchange
    order = RowOrder(jnp.asarray(np.argsort(position), jnp.int32), jnp.asarray(position))
    x, cotangent = (jnp.asarray(rng.normal(0, 1, (num_rows, dim)), jnp.bfloat16) for _ in range(2))
    experts = ExpertWeights(
        *(jnp.asarray(rng.normal(0, 0.1, shape), jnp.bfloat16)
          for shape in ((4, dim, width), (4, dim, width), (4, width, dim)))
    )  # fmt: skip
    activation = lambda gate, up: jax.nn.silu(gate) * up  # noqa: E731

    def in_order(x, experts):
        return grouped_ffn(x, sizes, experts, activation, impl, order)

    def sorting_first(x, experts):
        x_sorted = x[order.source]
        return grouped_ffn(x_sorted, sizes, experts, activation, "xla")[order.position]

    def value_and_grads(fn):
        y, pullback = jax.vjp(fn, x, experts)
        return y, pullback(cotangent)

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = value_and_grads(in_order)
    expected = value_and_grads(sorting_first)
    assert not np.asarray(got[0][used:], np.float32).any()  # unused rows: no expert, zero
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()


def test_save_attention_dots_experts_keeps_the_gate_and_up_products_for_the_backward():
    """`model.remat=save_attention_dots_experts`: the backward runs the MoE layer's gate and up
    grouped matmuls no second time (`save_attention_dots` runs them again), with the gradients of
    no rematerialisation."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 272, (2, 32)), jnp.int32)
    positions, segments = jnp.tile(jnp.arange(32), (2, 1)), jnp.ones((2, 32), jnp.int32)

    def gradient(remat):
        model = functional(tiny_run(model={"remat": remat}).model)
        params, buffers = model.init(0)

        def loss(params):
            logits, _ = model.apply(params, buffers, tokens, positions, segments)
            return jnp.mean(jax.nn.logsumexp(logits, -1))

        return jax.grad(loss), params

    counts = {}
    for remat in ("save_attention_dots", "save_attention_dots_experts", "none"):
        grad, params = gradient(remat)
        counts[remat] = primitive_calls(jax.make_jaxpr(grad)(params).jaxpr)["ragged_dot_general"]
        if remat == "save_attention_dots_experts":
            kept = grad(params)
    assert counts["save_attention_dots"] - counts["save_attention_dots_experts"] == 2
    assert counts["save_attention_dots_experts"] > counts["none"]  # the rest is recomputed
    for g, e in zip(jax.tree.leaves(kept), jax.tree.leaves(grad(params)), strict=True):
        np.testing.assert_allclose(g, e, atol=1e-6)
