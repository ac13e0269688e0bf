"""The Mosaic GPU grouped matmul (run by Pallas' GPU interpreter on CPU) and its tile layout.

The kernels are compared with `ragged_dot` over the same tile-aligned rows and with a per-group
float64 NumPy product, forward and both gradients, on uneven groups: an expert without rows, a
group that is not a multiple of the tile, one larger than a tile, padding rows past the groups.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.test_util import check_grads

from m3jax.moe.local import ExpertWeights, grouped_ffn, grouped_matmul_impl
from pallas_kernels.moe import mosaic_gpu, reference
from pallas_kernels.moe.tiles import (
    from_tiles,
    inverse_permutation,
    num_tiles_bound,
    tile_layout,
    to_tiles,
)

BLOCK = mosaic_gpu.BLOCK_M
GROUPS = [130, 0, 7, 128, 1]  # 266 rows sorted by expert
ROWS, D, F = 270, 128, 256  # 4 padding rows past the groups


@pytest.fixture
def gpu_interpreter():
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield


def inputs(seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (ROWS, D)), dtype)
    w = jnp.asarray(rng.normal(0, D**-0.5, (len(GROUPS), D, F)), dtype)
    cotangent = jnp.asarray(rng.normal(0, 1, (ROWS, F)), dtype)
    return x, w, jnp.asarray(GROUPS, jnp.int32), cotangent


def as_f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def per_group(x, w, cotangent):
    """float64 (y, dx, dw) of the sorted rows, group by group; rows past the groups are zero."""
    x, w, c = as_f64(x), as_f64(w), as_f64(cotangent)
    y, dx, dw, start = np.zeros((ROWS, F)), np.zeros_like(x), np.zeros_like(w), 0
    for e, size in enumerate(GROUPS):
        rows = slice(start, start + size)
        y[rows], dx[rows], dw[e] = x[rows] @ w[e], c[rows] @ w[e].T, x[rows].T @ c[rows]
        start += size
    return y, dx, dw


def test_layout_puts_each_expert_on_whole_tiles():
    layout = tile_layout(jnp.asarray(GROUPS), ROWS, BLOCK)
    tiles = num_tiles_bound(ROWS, len(GROUPS), BLOCK)
    assert layout.tile_expert.shape == (tiles,)
    np.testing.assert_array_equal(layout.num_tiles, [2, 0, 1, 1, 1])
    np.testing.assert_array_equal(layout.first_tile, [0, 2, 2, 3, 4])
    owners = np.asarray(layout.tile_expert)
    np.testing.assert_array_equal(owners[:5], [0, 0, 2, 3, 4])
    assert np.all(owners[5:] == -1)
    dest, start = np.asarray(layout.destination), 0
    for e, size in enumerate(GROUPS):
        rows = dest[start : start + size]
        assert np.all(owners[rows // BLOCK] == e)  # each row lands on a tile of its expert
        np.testing.assert_array_equal(np.diff(rows), 1)  # in order, contiguous
        start += size
    assert np.all(dest[start:] == tiles * BLOCK)  # padding rows point past the buffer
    source = np.asarray(layout.source)
    np.testing.assert_array_equal(source[dest[:start]], np.arange(start))  # inverse maps
    assert np.sum(source < ROWS) == start and np.all(source[source >= ROWS] == ROWS)


@pytest.mark.parametrize("seed", range(20))
def test_tile_bound_holds_for_any_split(seed):
    rng = np.random.default_rng(seed)
    experts, rows, block = int(rng.integers(1, 40)), int(rng.integers(1, 3000)), 128
    sizes = rng.multinomial(rows, rng.dirichlet(np.full(experts, 0.3)))
    assert np.sum(-(-sizes // block)) <= num_tiles_bound(rows, experts, block)


def test_tiles_round_trip_and_zero_gaps():
    x, *_ = inputs()
    layout = tile_layout(jnp.asarray(GROUPS), ROWS, BLOCK)
    tiled = to_tiles(x, layout)
    back = from_tiles(tiled, layout)
    np.testing.assert_array_equal(back[: sum(GROUPS)], x[: sum(GROUPS)])
    assert np.all(np.asarray(back[sum(GROUPS) :]) == 0)
    assert float(jnp.abs(tiled.astype(jnp.float32)).sum()) == pytest.approx(
        float(jnp.abs(x[: sum(GROUPS)].astype(jnp.float32)).sum()), rel=1e-6
    )


def test_inverse_permutation_full_and_partial():
    np.testing.assert_array_equal(inverse_permutation(jnp.asarray([2, 0, 1])), [1, 2, 0])
    # entry 1 maps nowhere (out of range); places 1 and 2 get no entry: len(index) = 3
    np.testing.assert_array_equal(inverse_permutation(jnp.asarray([3, 7, 0]), 4), [2, 3, 3, 0])


def test_moving_rows_in_and_out_of_tiles_has_exact_gradients():
    x, *_ = inputs(dtype=jnp.float32)
    layout = tile_layout(jnp.asarray(GROUPS), ROWS, BLOCK)
    for move, arg in ((to_tiles, x), (from_tiles, to_tiles(x, layout))):
        check_grads(lambda a, move=move: move(a, layout), (arg,), 1, modes=["rev"])


def run_tiled(matmul, x, w, sizes, cotangent):
    """(y, dx, dw) of `matmul` over the tile layout, back in sorted order."""
    layout = tile_layout(sizes, ROWS, BLOCK)

    def sorted_product(x, w):
        return from_tiles(matmul(to_tiles(x, layout), w, layout), layout)

    y, pullback = jax.vjp(sorted_product, x, w)
    return (y, *pullback(cotangent))


@pytest.mark.parametrize("persistent", [True, False])  # one program per SM / per output tile
def test_kernel_matches_ragged_dot_and_per_group_products(gpu_interpreter, persistent):
    x, w, sizes, cotangent = inputs()
    tiling = mosaic_gpu.Tiling(persistent=persistent)
    kernel = run_tiled(
        lambda a, w, layout: mosaic_gpu.tiled_matmul(a, w, layout, tiling), x, w, sizes, cotangent
    )
    xla = run_tiled(
        lambda a, w, layout: reference.tiled_matmul(a, w, layout, BLOCK), x, w, sizes, cotangent
    )
    for name, got, ragged, exact in zip(("y", "dx", "dw"), kernel, xla, per_group(x, w, cotangent)):
        assert got.dtype == jnp.bfloat16, name
        scale = np.abs(exact).max()
        # bf16 outputs: both are within a rounding of the float64 product, and of each other.
        assert np.abs(as_f64(got) - exact).max() <= 8e-3 * scale, name
        assert np.abs(as_f64(got) - as_f64(ragged)).max() <= 1.6e-2 * scale, name
    assert np.all(np.asarray(kernel[0][sum(GROUPS) :]) == 0)  # padding rows
    assert np.all(np.asarray(kernel[2][1]) == 0)  # the expert without rows


def test_transposed_kernel_is_the_input_gradient(gpu_interpreter):
    _, w, sizes, cotangent = inputs(seed=3)
    layout = tile_layout(sizes, ROWS, BLOCK)
    dy = to_tiles(cotangent, layout)
    dx = mosaic_gpu.tile_matmul(dy, w, layout.tile_expert, transpose_w=True)
    expected = reference.tiled_matmul(dy, jnp.swapaxes(w, 1, 2), layout, BLOCK)
    scale = float(jnp.abs(expected.astype(jnp.float32)).max())
    assert float(jnp.abs((dx - expected).astype(jnp.float32)).max()) <= 1.6e-2 * scale


def test_expert_ffn_with_the_kernel_equals_ragged_dot(gpu_interpreter):
    x, _, sizes, cotangent = inputs(seed=5)
    rng = np.random.default_rng(6)
    experts = ExpertWeights(
        *(
            jnp.asarray(rng.normal(0, 0.1, shape), jnp.bfloat16)
            for shape in ((5, D, D), (5, D, D), (5, D, D))
        )
    )
    activation = lambda gate, up: jax.nn.silu(gate) * up

    def loss(impl, x, experts):
        y = grouped_ffn(x, sizes, experts, activation, impl)
        return (y.astype(jnp.float32) * cotangent[:, :D].astype(jnp.float32)).sum(), y

    results = {
        impl: jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a), (0, 1), has_aux=True)(
            x, experts
        )
        for impl in ("xla", "mosaic_gpu")
    }
    (_, y_xla), grads_xla = results["xla"]
    (_, y_kernel), grads_kernel = results["mosaic_gpu"]
    for got, expected in zip(
        jax.tree.leaves((y_kernel, grads_kernel)), jax.tree.leaves((y_xla, grads_xla))
    ):
        scale = float(jnp.abs(expected.astype(jnp.float32)).max())
        assert float(jnp.abs((got - expected).astype(jnp.float32)).max()) <= 3e-2 * scale


def test_impl_choice():
    assert grouped_matmul_impl("auto", jnp.bfloat16, 256, 128) == "xla"  # CPU: ragged_dot
    assert grouped_matmul_impl("mosaic_gpu", jnp.bfloat16, 256, 128) == "mosaic_gpu"
    with pytest.raises(ValueError, match="float32"):
        grouped_matmul_impl("mosaic_gpu", jnp.float32, 256, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_matmul_impl("mosaic_gpu", jnp.bfloat16, 200, 128)


@pytest.mark.parametrize(
    "mesh_sizes, exchange",
    [({"expert": 2}, "ragged"), ({"expert": 2}, "padded"), ({"data": 2}, "ragged")],
)
def test_kernel_differentiates_inside_expert_parallel_shard_map(mesh_sizes, exchange):
    """Under shard_map the kernels' outputs carry no varying-axes types; the wrapper restores them
    so that autodiff of the MoE block under EP=2 (both exchanges) and under data parallelism
    (tokens straight into the tile layout) type-checks, and every grouped matmul of the forward
    and backward pass is the kernel: none falls back to `ragged_dot`. The GPU interpreter runs one
    device only, so the block is traced here; benchmarks/bench_moe.py checks its numbers on two
    GPUs."""
    from flax import nnx

    from m3jax import sharding
    from m3jax.config import ModelConfig, MoEConfig
    from m3jax.moe.layer import MoE

    moe = MoEConfig(
        num_experts=4, experts_per_token=2, expert_dim=128, grouped_matmul="mosaic_gpu",
        exchange=exchange,
    )  # fmt: skip
    config = ModelConfig(
        vocab_size=16, hidden_size=128, num_layers=1, dtype="bfloat16", moe=moe,
        layer_types=("full",), mlp_layer_types=("moe",),
    )  # fmt: skip
    mesh = sharding.make_mesh(mesh_sizes, devices=jax.devices()[:2])  # data: tokens straight in
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0), mesh=mesh)))
    x = jax.ShapeDtypeStruct((2, 64, 128), jnp.bfloat16)

    def loss(state, x):
        out, _ = nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))
        return out.astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x)
    grads = traced.out_info
    assert grads[1].shape == x.shape
    # gate, up and down projections: 3 products forward, their dX and dW backward (rematerialised
    # products may add more)
    assert primitive_count(traced.jaxpr.jaxpr, "mpmd_map") >= 9
    assert primitive_count(traced.jaxpr.jaxpr, "ragged_dot_general") == 0


def primitive_count(jaxpr, name: str) -> int:
    """Equations named `name` in jaxpr and every jaxpr nested in its equations' parameters."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    count += primitive_count(inner, name)
    return count
