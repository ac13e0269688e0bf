"""Grouped matmul on Hopper GPUs: Pallas Mosaic GPU kernels over the tile-aligned layout.

Because every row tile belongs to one expert (tiles.py), the forward product and the input
gradient are ordinary tiled matmuls whose weight matrix is looked up per tile, and the weight
gradient of expert e is xᵀ·dY summed over e's own tiles: the trip count and tile offset come from
int32 tables in GMEM. Each kernel is persistent by default (one program per SM walks its share of
output tiles in a snake order that keeps neighbouring tiles' operands in L2; `Tiling.persistent`)
and streams operands through a TMA pipeline into wgmma, accumulating in fp32 registers.

`tiled_matmul(x, w, layout)` is the differentiable entry point; `reference.tiled_matmul` is the
same function through XLA's ragged_dot, the CPU path and the tests' oracle.

Shapes: `tiles` of BLOCK_M rows (tiles·BLOCK_M padded rows), D contraction (input width), F output
width, E experts (words and letters as in the m3jax package docstring).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import target
from pallas_kernels.moe.tiles import TileLayout
from pallas_kernels.mosaic_smem import swizzled
from pallas_kernels.shard_map import vary_like

BLOCK_M = 128  # rows per tile: the layout's granularity and the wgmma M of one warpgroup
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Block sizes and pipeline depth; the defaults were chosen on the H200 (benchmarks/)."""

    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    gram_stages: int = 3  # the weight gradient's blocks are twice as large (BLOCK_M × 128 each)
    snake_width: int = 8  # output tiles per band of the snake order (L2 reuse)
    # True: one program per SM walks its share of the output tiles. False: one program per output
    # tile, which the hardware hands to whichever SM is free (as when NCCL kernels hold some).
    persistent: bool = True


def unsupported_reason(x_dtype, in_width: int, out_width: int, tiling: Tiling = Tiling()) -> str:
    """Why the kernels can't take these operands ('' when they can)."""
    if jnp.dtype(x_dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        return f"dtype {jnp.dtype(x_dtype)} is not bfloat16/float16"
    multiple = max(tiling.block_n, tiling.block_k, BLOCK_M)
    for name, width in (("input", in_width), ("output", out_width)):
        if width % multiple:
            return f"{name} width {width} is not a multiple of {multiple}"
    return ""


def _num_programs(tiling: Tiling, output_tiles: int) -> int:
    """One program per SM (a few under CPU interpret mode), or per output tile (not persistent).
    The kernels' loops over output tiles split them evenly over however many programs run."""
    if not tiling.persistent:
        return output_tiles
    device = target.devices()[0]
    return device.core_count if device.platform == "gpu" else 4


def _store(acc: jax.Array, out_gmem_block) -> None:
    """fp32 accumulator -> output dtype -> SMEM -> TMA store of one output block."""

    def scope(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem_block)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    transforms = swizzled(acc.shape[1], out_gmem_block.dtype)
    pl.run_scoped(scope, plgpu.SMEM(acc.shape, out_gmem_block.dtype, transforms=transforms))


def _compiler_params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def tile_matmul(
    x: jax.Array,
    w: jax.Array,
    tile_expert: jax.Array,
    *,
    transpose_w: bool = False,
    tiling: Tiling = Tiling(),
) -> jax.Array:
    """y[tile] = x[tile] @ w[tile_expert[tile]] (or @ wᵀ), zero for tiles with expert -1.

    x: [tiles·BLOCK_M, D]; w: [E, D, F], or [E, F, D] with transpose_w; tile_expert: [tiles] int32
    -> [tiles·BLOCK_M, F].
    """
    padded, k = x.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    tiles = tile_expert.shape[0]
    bn, bk = tiling.block_n, tiling.block_k
    if padded != tiles * BLOCK_M or k % bk or n % bn:
        raise ValueError(f"tile_matmul: x {x.shape}, w {w.shape}, {tiles} tiles, {tiling}")
    n_blocks = n // bn
    x_spec_transforms = swizzled(bk, x.dtype)
    w_block = (bn, bk) if transpose_w else (bk, bn)

    def tile_matmul_kernel(tile_expert_gmem, x_gmem, w_gmem, out_gmem):
        @plgpu.nd_loop((tiles * n_blocks,), collective_axes="sm")
        def _(loop):
            ti, ni = plgpu.planar_snake(loop.index[0], (tiles, n_blocks), 1, tiling.snake_width)
            expert = tile_expert_gmem[ti]

            def multiply(acc):
                def step(_, x_smem, w_smem):
                    plgpu.wgmma(acc, x_smem, w_smem.transpose((1, 0)) if transpose_w else w_smem)

                @pl.when(expert >= 0)
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(k // bk,),
                        in_specs=[
                            plgpu.BlockSpec(
                                (BLOCK_M, bk),
                                lambda kk: (ti, kk),
                                transforms=x_spec_transforms,
                                delay_release=1,
                            ),
                            plgpu.BlockSpec(
                                w_block,
                                (lambda kk: (ni, kk)) if transpose_w else (lambda kk: (kk, ni)),
                                transforms=swizzled(w_block[1], w.dtype),
                                delay_release=1,
                            ),
                        ],
                        max_concurrent_steps=tiling.stages,
                    )(x_gmem, w_gmem.at[jnp.maximum(expert, 0)])

                return acc[...]

            acc = pl.run_scoped(multiply, plgpu.ACC((BLOCK_M, bn)))
            _store(acc, out_gmem.at[pl.ds(ti * BLOCK_M, BLOCK_M), pl.ds(ni * bn, bn)])

    kernel = plgpu.kernel(
        tile_matmul_kernel,  # profiles name each kernel after its body
        out_type=jax.ShapeDtypeStruct((padded, n), x.dtype),
        grid=(_num_programs(tiling, tiles * n_blocks),),
        grid_names=("sm",),
        compiler_params=_compiler_params(),
    )
    return kernel(tile_expert, x, w)


def expert_gram(
    x: jax.Array,
    dy: jax.Array,
    first_tile: jax.Array,
    num_tiles: jax.Array,
    *,
    tiling: Tiling = Tiling(),
) -> jax.Array:
    """dw[e] = Σ over e's tiles of x[tile]ᵀ @ dy[tile], zero for an expert without tiles.

    x: [tiles·BLOCK_M, D]; dy: [tiles·BLOCK_M, F]; first_tile, num_tiles: [E] int32 -> [E, D, F] in
    x's dtype.
    """
    padded, k = x.shape
    n = dy.shape[1]
    experts = first_tile.shape[0]
    bk_out, bn = BLOCK_M, tiling.block_n  # wgmma M is the K dimension here
    if padded % BLOCK_M or k % bk_out or n % bn:
        raise ValueError(f"expert_gram: x {x.shape}, dy {dy.shape}, {tiling}")
    k_blocks, n_blocks = k // bk_out, n // bn

    def expert_gram_kernel(first_tile_gmem, num_tiles_gmem, x_gmem, dy_gmem, out_gmem):
        @plgpu.nd_loop((experts, k_blocks * n_blocks), collective_axes="sm")
        def _(loop):
            e = loop.index[0]
            ki, ni = plgpu.planar_snake(loop.index[1], (k_blocks, n_blocks), 1, tiling.snake_width)
            first = first_tile_gmem[e]

            def multiply(acc):
                def step(_, x_smem, dy_smem):
                    plgpu.wgmma(acc, x_smem.transpose((1, 0)), dy_smem)

                plgpu.emit_pipeline(
                    step,
                    grid=(num_tiles_gmem[e],),
                    in_specs=[
                        plgpu.BlockSpec(
                            (BLOCK_M, bk_out),
                            lambda j: (first + j, ki),
                            transforms=swizzled(bk_out, x.dtype),
                            delay_release=1,
                        ),
                        plgpu.BlockSpec(
                            (BLOCK_M, bn),
                            lambda j: (first + j, ni),
                            transforms=swizzled(bn, dy.dtype),
                            delay_release=1,
                        ),
                    ],
                    max_concurrent_steps=tiling.gram_stages,
                )(x_gmem, dy_gmem)
                return acc[...]

            acc = pl.run_scoped(multiply, plgpu.ACC((bk_out, bn)))
            _store(acc, out_gmem.at[e, pl.ds(ki * bk_out, bk_out), pl.ds(ni * bn, bn)])

    kernel = plgpu.kernel(
        expert_gram_kernel,
        out_type=jax.ShapeDtypeStruct((experts, k, n), x.dtype),
        grid=(_num_programs(tiling, experts * k_blocks * n_blocks),),
        grid_names=("sm",),
        compiler_params=_compiler_params(),
    )
    return kernel(first_tile, num_tiles, x, dy)


def tiled_matmul(
    x: jax.Array, w: jax.Array, layout: TileLayout, tiling: Tiling = Tiling()
) -> jax.Array:
    """[tiles·BLOCK_M, D] tiled rows @ their experts' [E, D, F] weights -> [tiles·BLOCK_M, F]
    (differentiable in x, w).

    Inside `shard_map`, w is first marked as varying over every mesh axis x varies over (rows
    differ per device, weights may be replicated), so that autodiff sums w's gradient over those
    axes outside the kernel, as it does for any matmul.
    """
    w = vary_like(w.astype(x.dtype), x)
    return _tiled_matmul(vary_like(x, w), w, layout, tiling)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_matmul(x, w, layout, tiling):
    return vary_like(tile_matmul(x, w, layout.tile_expert, tiling=tiling), x)


def _forward(x, w, layout, tiling):
    return _tiled_matmul(x, w, layout, tiling), (x, w, layout)


def _backward(tiling, residuals, dy):
    x, w, layout = residuals
    dy = dy.astype(x.dtype)
    dx = tile_matmul(dy, w, layout.tile_expert, transpose_w=True, tiling=tiling)
    dw = expert_gram(x, dy, layout.first_tile, layout.num_tiles, tiling=tiling)
    return vary_like(dx, x), vary_like(dw, w), None


_tiled_matmul.defvjp(_forward, _backward)
