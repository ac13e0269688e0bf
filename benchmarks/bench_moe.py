"""MoE at M3's expert shapes: grouped-matmul variants, the whole MoE layer, expert parallelism.

    python -m benchmarks.bench_moe [--experts 8 32] [--rows 32768 131072] [--ep 2] [--output F]
    python -m benchmarks.bench_moe --ep-only --ep 2 [--exchanges padded] [--profile DIR]
    python -m benchmarks.bench_moe --smoke [--ep 2]   # tiny shapes: does everything run (CPU)

1. Matmuls, bf16, D 6144 -> F 3072 (M3's expert width), per (E local experts, M routed token
   slots = rows): the dense matmul [M, D] @ [D, F] of the same FLOPs (the baseline), each
   grouped-matmul implementation in VARIANTS on rows in uneven groups, and the capacity einsum
   [E, M/E, D] × [E, D, F]; forward, and forward+backward (dX and dW).
2. The MoE layer on one device (router, sort/permute, experts, combine, shared expert), forward +
   backward, dropless and capacity dispatch; TFLOP/s of useful work and MFU vs --peak-tflops.
3. With --ep P: the same layer with P× the tokens and P× the experts over P devices, i.e. the same
   tokens and local experts per device as in 2, per EP exchange (dropless: ragged or padded,
   m3jax/moe/expert_parallel.py; capacity): per-device throughput
   against 1 device ("vs 1 dev" = 1-device time / EP time), and the error of the EP output and
   gradients against each device's token shard run through the layer alone on one device (capacity
   is per device, so this holds with drops too).
A check runs first (fp32, small shapes): every dispatch mode and EP exchange against the dense
reference layer, outputs and gradients. Times are medians of --repeats after a warm-up; "vs
dense" = this row's TFLOP/s / the dense matmul's at the same M (same phase); max err =
max|y - ref| / max|ref| against an fp32 reference (grouped variants: the ragged_dot reference;
backward rows: dX and dW). The last stdout line is JSON.
"""

import argparse
import datetime
import json
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import trace_summary
from m3jax import sharding, xla_flags
from m3jax.config import ModelConfig, MoEConfig
from m3jax.moe.layer import MoE
from pallas_kernels.moe import mosaic_gpu, reference
from pallas_kernels.moe.tiles import from_tiles, tile_layout, to_tiles


def dense_matmul(x, w, group_sizes):
    """The baseline: one [M, D] @ [D, F] matmul, the FLOPs of every grouped variant."""
    del group_sizes
    return x @ w[0]


def capacity_einsum(x, w, group_sizes):
    """E equal groups as [E, M/E, D] buffers: the capacity dispatch's expert matmul."""
    del group_sizes
    return jnp.einsum("ecd,edf->ecf", x.reshape(w.shape[0], -1, x.shape[1]), w).reshape(
        x.shape[0], -1
    )


def mosaic_gpu_grouped(x, w, group_sizes, tiling=mosaic_gpu.Tiling()):
    """Our kernel as the dropless path runs it: sorted rows -> tile layout -> kernel -> back."""
    layout = tile_layout(group_sizes, x.shape[0], mosaic_gpu.BLOCK_M)
    tiled = mosaic_gpu.tiled_matmul(to_tiles(x, layout), w, layout, tiling)
    return from_tiles(tiled, layout)


# (name, fn(x_sorted [M, D], w [E, D, F], group_sizes [E]) -> [M, F], its fp32 reference, run
# eagerly). Grouped variants are checked against per-group buffers (reference.py says why not
# ragged_dot or slices); a masked matmul per expert would cost E times the FLOPs.
GROUPED_REF = reference.grouped_matmul_buffered
VARIANTS = [
    ("dense matmul", dense_matmul, dense_matmul),
    ("ragged_dot", reference.grouped_matmul, GROUPED_REF),
    ("capacity einsum", capacity_einsum, capacity_einsum),
]
GPU_VARIANTS = [("mosaic_gpu", mosaic_gpu_grouped, GROUPED_REF)]  # joined in main on a GPU
try:  # tokamax's Pallas Mosaic GPU ragged_dot (Hopper): measured as a candidate GPU kernel
    import tokamax

    def tokamax_ragged_dot(x, w, group_sizes):
        return tokamax.ragged_dot(x, w, group_sizes.astype(jnp.int32))

    GPU_VARIANTS.append((f"tokamax {tokamax.__version__}", tokamax_ragged_dot, GROUPED_REF))
except ImportError:
    pass
FULL = dict(
    dim=6144,
    expert_dim=3072,
    experts=[8, 32],
    rows=[32768, 131072],
    k=4,
    layer_tokens=8192,
    layer_experts=16,
    check=dict(dim=256, expert_dim=128, tokens=512),
)
SMOKE = dict(dim=64, expert_dim=32, experts=[4], rows=[256], k=2, layer_tokens=64,
             layer_experts=4, check=dict(dim=32, expert_dim=16, tokens=64))  # fmt: skip


def relative_error(actual, expected) -> float:
    errors = [
        float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30))
        for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    ]
    return max(errors)


PROFILED_STEPS = 3


def time_call(fn, args: tuple, repeats: int, trace_dir: str | None = None) -> tuple[float, object]:
    """(median seconds, result) of jit(fn)(*args) after one warm-up call.

    With `trace_dir`, PROFILED_STEPS more calls run under jax.profiler and where their device
    time went is printed (benchmarks/trace_summary.py)."""
    compiled = jax.jit(fn).lower(*args).compile()
    result = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    if trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                jax.block_until_ready(compiled(*args))
        print(trace_summary.report(trace_summary.summarize(trace_dir), PROFILED_STEPS), flush=True)
    return float(np.median(times)), result


# ------------------------------------------------------------------------------------------------
# 1. Matmuls


def matmul_inputs(rows: int, experts: int, dim: int, expert_dim: int, seed: int = 0):
    """bf16 x [M, D], w [E, D, F], cotangent [M, F]; uneven group sizes (log-normal shares)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (rows, dim), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (experts, dim, expert_dim)) * dim**-0.5).astype(jnp.bfloat16)
    cotangent = jax.random.normal(keys[2], (rows, expert_dim), jnp.bfloat16)
    rng = np.random.default_rng(seed)
    share = np.exp(0.5 * rng.normal(size=experts))
    sizes = jnp.asarray(rng.multinomial(rows, share / share.sum()), jnp.int32)
    return x, w, sizes, cotangent


def forward(fn):
    return lambda x, w, group_sizes, cotangent: fn(x, w, group_sizes)


def forward_backward(fn):
    def run(x, w, group_sizes, cotangent):
        y, pullback = jax.vjp(lambda x, w: fn(x, w, group_sizes), x, w)
        return y, *pullback(cotangent)  # (Y, dX, dW): three matmuls' worth, none dead code

    return run


def matmul_rows(rows: int, experts: int, shape: dict, repeats: int) -> list[dict]:
    """Every variant in VARIANTS, forward and forward+backward, at one (M, E)."""
    x, w, sizes, cotangent = matmul_inputs(rows, experts, shape["dim"], shape["expert_dim"])
    x32, w32, cotangent32 = (a.astype(jnp.float32) for a in (x, w, cotangent))
    flops = 2 * rows * shape["dim"] * shape["expert_dim"]
    label = f"E={experts} M={rows} D={shape['dim']} F={shape['expert_dim']}"
    out, baseline, references = [], {}, {}
    for name, fn, reference_fn in VARIANTS:
        for phase, wrap, factor in (("fwd", forward, 1), ("fwd+bwd", forward_backward, 3)):
            seconds, result = time_call(wrap(fn), (x, w, sizes, cotangent), repeats)
            if (reference_fn, phase) not in references:
                with jax.default_matmul_precision("highest"):  # eager: sizes on the host
                    references[reference_fn, phase] = jax.block_until_ready(
                        wrap(reference_fn)(x32, w32, sizes, cotangent32)
                    )
            expected = references[reference_fn, phase]
            tflops = factor * flops / seconds / 1e12
            baseline.setdefault(phase, tflops)  # the dense matmul comes first
            out.append(dict(variant=f"{name} {phase}", shape=label, ms=seconds * 1e3,
                            tflops=tflops, vs_dense=tflops / baseline[phase],
                            max_err=relative_error(result, expected)))  # fmt: skip
            print(table_line(out[-1]), flush=True)  # as it comes: shows where a slow run is
    return out


TILINGS = [
    mosaic_gpu.Tiling(),
    mosaic_gpu.Tiling(stages=3),
    mosaic_gpu.Tiling(stages=6),
    mosaic_gpu.Tiling(block_k=128, stages=3),
    mosaic_gpu.Tiling(snake_width=2),
    mosaic_gpu.Tiling(snake_width=32),
    mosaic_gpu.Tiling(gram_stages=2),
    mosaic_gpu.Tiling(persistent=False),
]


def tiling_rows(rows: int, experts: int, shape: dict, repeats: int, tilings: int) -> list[dict]:
    """Each kernel alone on pre-tiled rows, per tiling in TILINGS[:tilings] (forward, dX, dW),
    after the layout moves alone (building the layout, rows into and out of it)."""
    x, w, sizes, cotangent = matmul_inputs(rows, experts, shape["dim"], shape["expert_dim"])
    layout = tile_layout(sizes, rows, mosaic_gpu.BLOCK_M)
    x_tiles, dy_tiles = (to_tiles(a, layout) for a in (x, cotangent))
    flops = 2 * rows * shape["dim"] * shape["expert_dim"]
    label = f"E={experts} M={rows} D={shape['dim']} F={shape['expert_dim']}"
    dense_seconds, _ = time_call(lambda x, w: x @ w[0], (x, w), repeats)
    out = []
    moves = {
        "tile_layout": (lambda sizes: tile_layout(sizes, rows, mosaic_gpu.BLOCK_M), (sizes,)),
        "to_tiles [M, D]": (lambda x, layout: to_tiles(x, layout), (x, layout)),
        "from_tiles [M, F]": (lambda y, layout: from_tiles(y, layout), (dy_tiles, layout)),
    }
    for name, (fn, args) in moves.items():
        seconds, _ = time_call(fn, args, repeats)
        out.append(dict(variant=f"layout move {name}", ms=seconds * 1e3, shape=label))
        print(table_line(out[-1]), flush=True)
    kernels = {
        "fwd": lambda t: lambda x, dy: mosaic_gpu.tile_matmul(x, w, layout.tile_expert, tiling=t),
        "dX": lambda t: (
            lambda x, dy: mosaic_gpu.tile_matmul(
                dy, w, layout.tile_expert, transpose_w=True, tiling=t
            )
        ),
        "dW": lambda t: (
            lambda x, dy: mosaic_gpu.expert_gram(
                x, dy, layout.first_tile, layout.num_tiles, tiling=t
            )
        ),
    }
    for tiling in TILINGS[:tilings]:
        for part, make in kernels.items():
            try:
                seconds, _ = time_call(make(tiling), (x_tiles, dy_tiles), repeats)
            except Exception as error:  # a tiling that does not fit shared memory, say
                print(f"{part} {tiling}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            out.append(dict(variant=f"kernel {part} {tiling}", ms=seconds * 1e3,
                            tflops=flops / seconds / 1e12, vs_dense=dense_seconds / seconds,
                            shape=label))  # fmt: skip
            print(table_line(out[-1]), flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# 2-3. The MoE layer


def layer_config(
    shape: dict,
    experts: int,
    dispatch: str,
    dtype="bfloat16",
    capacity_factor=1.25,
    exchange="padded",
) -> ModelConfig:
    factor = shape.get("exchange_factor", MoEConfig.exchange_factor)
    moe = MoEConfig(num_experts=experts, experts_per_token=shape["k"],
                    expert_dim=shape["expert_dim"], shared_expert_dim=shape["expert_dim"],
                    dispatch=dispatch, capacity_factor=capacity_factor, exchange=exchange,
                    exchange_factor=factor)  # fmt: skip
    return ModelConfig(vocab_size=16, hidden_size=shape["dim"], num_layers=1, dtype=dtype,
                       layer_types=("full",), mlp_layer_types=("moe",), moe=moe)  # fmt: skip


def layer_state(config: ModelConfig, mesh=None) -> dict:
    """A fresh MoE block's params and buffers, sharded by their logical axes over `mesh`."""
    module = MoE(config, rngs=nnx.Rngs(0))
    state = nnx.to_pure_dict(nnx.state(module))
    if mesh is None:
        return state
    axes = nnx.to_pure_dict(
        jax.tree.map(
            lambda v: v.get_metadata()["logical_axes"],
            nnx.state(module),
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    )
    return jax.device_put(state, sharding.tree_shardings(axes, state, mesh))


def layer_apply(config: ModelConfig, mesh, state: dict, x: jax.Array):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0), mesh=mesh)))
    nnx.replace_by_pure_dict(abstract, state)
    return nnx.merge(graphdef, abstract)(x, jnp.ones(x.shape[:2], bool))


def forward_pass(config: ModelConfig, mesh):
    """jit((state, x) -> the layer's output)."""
    return jax.jit(lambda state, x: layer_apply(config, mesh, state, x)[0])


def layer_train(config: ModelConfig, mesh):
    """(state, x, cotangent) -> (grads of Σ out · cotangent for state and x, dropped fraction)."""

    def step(state, x, cotangent):
        def loss(state, x):
            out, stats = layer_apply(config, mesh, state, x)
            return (out.astype(jnp.float32) * cotangent).sum(), stats.dropped_fraction

        grads, dropped = jax.grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return grads, dropped

    return step


def layer_inputs(batch: int, tokens: int, dim: int, mesh=None, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(1))
    x = jax.random.normal(keys[0], (batch, tokens, dim), dtype)
    cotangent = jax.random.normal(keys[1], (batch, tokens, dim), jnp.float32)
    if mesh is not None:
        x, cotangent = jax.device_put((x, cotangent), sharding.batch_sharding(mesh))
    return x, cotangent


def layer_flops(shape: dict, tokens: int, experts: int) -> float:
    """Useful forward+backward FLOPs: router, k routed experts and the shared expert (3 matmuls)."""
    dim, width = shape["dim"], shape["expert_dim"]
    forward = 2 * tokens * dim * experts + 6 * tokens * dim * width * (shape["k"] + 1)
    return 3 * forward


def layer_label(shape: dict, tokens: int, local_experts: int, experts: int) -> str:
    return (f"N={tokens} E={local_experts}/{experts} k={shape['k']} D={shape['dim']} "
            f"F={shape['expert_dim']}")  # fmt: skip


# EP exchange -> (dispatch mode, moe.exchange): the two dropless exchanges and the capacity one
# (which ignores moe.exchange)
EXCHANGES = {
    "ragged": ("dropless", "ragged"),
    "padded": ("dropless", "padded"),
    "capacity": ("capacity", "ragged"),
}


def dispatch_modes(exchanges) -> list[str]:
    return list(dict.fromkeys(EXCHANGES[e][0] for e in exchanges))


def layer_rows(
    shape: dict, dense_tflops, peak: float, repeats: int, profile=None, modes=("dropless",)
) -> tuple[list, dict]:
    """The layer on one device per dispatch mode in `modes`; also returns each mode's seconds.
    With `profile` (a folder), each mode's device time is broken down too."""
    tokens, experts = shape["layer_tokens"], shape["layer_experts"]
    flops = layer_flops(shape, tokens, experts)
    out, seconds_by_mode = [], {}
    for dispatch in modes:
        config = layer_config(shape, experts, dispatch)
        inputs = (layer_state(config), *layer_inputs(1, tokens, shape["dim"]))
        trace_dir = profile and f"{profile}/layer-{dispatch}"
        seconds, (_, dropped) = time_call(layer_train(config, None), inputs, repeats, trace_dir)
        seconds_by_mode[dispatch] = seconds
        tflops = flops / seconds / 1e12
        out.append(dict(variant=f"layer {dispatch} fwd+bwd", ms=seconds * 1e3, tflops=tflops,
                        vs_dense=dense_tflops and tflops / dense_tflops, mfu=tflops * 1e12 / peak,
                        dropped=float(dropped),
                        shape=layer_label(shape, tokens, experts, experts)))  # fmt: skip
        print(table_line(out[-1]), flush=True)
    return out, seconds_by_mode


def ep_rows(
    shape: dict,
    ep: int,
    one_device: dict,
    dense_tflops,
    peak,
    repeats,
    profile=None,
    exchanges=tuple(EXCHANGES),
) -> list[dict]:
    """The layer over `ep` devices, each with the tokens and local experts of the 1-device run."""
    mesh = sharding.make_mesh({"expert": ep}, devices=jax.devices()[:ep])
    tokens, experts = shape["layer_tokens"], shape["layer_experts"] * ep
    flops = layer_flops(shape, tokens, experts)  # per device (its router scores all experts)
    out = []
    for name in exchanges:
        dispatch, exchange = EXCHANGES[name]
        config = layer_config(shape, experts, dispatch, exchange=exchange)
        state = layer_state(config, mesh)
        x, cotangent = layer_inputs(ep, tokens, shape["dim"], mesh)
        trace_dir = profile and f"{profile}/ep{ep}-{name}"
        seconds, (grads, dropped) = time_call(
            layer_train(config, mesh), (state, x, cotangent), repeats, trace_dir
        )
        actual = (forward_pass(config, mesh)(state, x), grads)
        tflops = flops / seconds / 1e12
        if name == "padded":
            name += f" ×{config.moe.exchange_factor:g}"  # blocks of factor × a fair share
        out.append(dict(variant=f"EP{ep} {name} fwd+bwd", ms=seconds * 1e3, tflops=tflops,
                        vs_dense=dense_tflops and tflops / dense_tflops, mfu=tflops * 1e12 / peak,
                        vs_one_device=one_device[dispatch] / seconds, dropped=float(dropped),
                        max_err=relative_error(jax.device_put(actual, jax.devices()[0]),
                                               per_shard_reference(config, state, x, cotangent)),
                        shape=layer_label(shape, tokens, experts // ep, experts)))  # fmt: skip
        print(table_line(out[-1]), flush=True)
    return out


def per_shard_reference(config: ModelConfig, state: dict, x: jax.Array, cotangent: jax.Array):
    """(output, grads) with each batch row (= one device's tokens) through the layer alone on one
    device: what expert parallelism must equal, capacity drops included (C is per device)."""
    device = jax.devices()[0]
    state, x, cotangent = jax.device_put((state, x, cotangent), device)
    forward, train = forward_pass(config, None), jax.jit(layer_train(config, None))
    outs, state_grads, x_grads = [], [], []
    for i in range(x.shape[0]):
        outs.append(forward(state, x[i : i + 1]))
        (state_grad, x_grad), _ = train(state, x[i : i + 1], cotangent[i : i + 1])
        state_grads.append(state_grad)
        x_grads.append(x_grad)
    state_grad = jax.tree.map(lambda *g: sum(a.astype(jnp.float32) for a in g), *state_grads)
    return jnp.concatenate(outs), (state_grad, jnp.concatenate(x_grads))


def check(shape: dict, ep: int, exchanges=tuple(EXCHANGES)) -> dict:
    """fp32, small: each dispatch (and EP exchange) vs the dense reference layer, forward and
    gradients (params and input)."""
    small = {**shape, **shape["check"]}
    experts, tokens, parts = 8, small["tokens"], max(ep, 1)
    x, cotangent = layer_inputs(parts, tokens // parts, small["dim"], dtype=jnp.float32)
    dense = layer_config(small, experts, "dense", "float32")
    state = layer_state(dense)

    def results(config, mesh):
        return forward_pass(config, mesh)(state, x), jax.jit(layer_train(config, mesh))(
            state, x, cotangent
        )[0]

    def error(dispatch, mesh=None, exchange="padded"):
        # capacity_factor E/k: C = N, nothing drops
        config = layer_config(small, experts, dispatch, "float32", experts / small["k"], exchange)
        return relative_error(jax.device_put(results(config, mesh), jax.devices()[0]), expected)

    expected = results(dense, None)
    result = {f"{dispatch} vs dense": error(dispatch) for dispatch in dispatch_modes(exchanges)}
    if ep > 1:
        mesh = sharding.make_mesh({"expert": ep}, devices=jax.devices()[:ep])
        for name in exchanges:
            dispatch, exchange = EXCHANGES[name]
            result[f"EP{ep} {name} vs dense"] = error(dispatch, mesh, exchange)
    return result


# ------------------------------------------------------------------------------------------------


def markdown(rows: list[dict], args, checks: dict) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    header = [
        f"## MoE grouped matmul, layer and expert parallelism — {datetime.date.today()}, "
        f"commit {commit or 'unknown'}",
        "",
        f"{jax.devices()[0].device_kind} × {jax.device_count()}, jax {jax.__version__}; bf16; "
        f"median of {args.repeats} after a warm-up; MFU vs {args.peak_tflops:.0f} TFLOP/s. "
        "vs dense = TFLOP/s / the dense matmul's at the same M and phase; vs 1 dev = 1-device "
        "time / EP time at equal per-device tokens and local experts; max err: matmuls vs an fp32 "
        "reference, EP rows (output and gradients) vs each device's tokens through the layer on "
        "one device.",
        "Check (fp32 vs dense layer): "
        + ", ".join(f"{name} {error:.1e}" for name, error in checks.items()),
        "",
        "| variant | shape | ms | TFLOP/s | vs dense | MFU | vs 1 dev | dropped | max err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(header + [table_line(row) for row in rows]) + "\n"


def table_line(row: dict) -> str:
    cell = lambda key, spec: "" if row.get(key) is None else format(row[key], spec)
    return (f"| {row['variant']} | {row['shape']} | {cell('ms', '.2f')} | {cell('tflops', '.1f')} | "
            f"{cell('vs_dense', '.2f')} | {cell('mfu', '.2f')} | {cell('vs_one_device', '.2f')} | "
            f"{cell('dropped', '.3f')} | {cell('max_err', '.1e')} |")  # fmt: skip


def main() -> None:
    xla_flags.apply()  # before the first backend starts
    if jax.default_backend() == "gpu":
        VARIANTS.extend(GPU_VARIANTS)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU run-through")
    parser.add_argument("--experts", type=int, nargs="+", help="local experts (matmuls)")
    parser.add_argument("--rows", type=int, nargs="+", help="routed token slots M (matmuls)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel devices (layer)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H200 dense bf16")
    parser.add_argument("--output", help="also write the markdown section here")
    parser.add_argument("--layer-only", action="store_true", help="skip the matmul sweep (1.)")
    parser.add_argument("--matmuls-only", action="store_true", help="skip the layer (2., 3.)")
    parser.add_argument("--tune", action="store_true", help="first time each kernel per tiling")
    parser.add_argument("--tilings", type=int, default=len(TILINGS), help="--tune: how many")
    parser.add_argument("--variants", nargs="+", help="matmul variants to run (default: all)")
    parser.add_argument(
        "--exchanges",
        nargs="+",
        choices=list(EXCHANGES),
        default=list(EXCHANGES),
        help="EP exchanges to run (and the layer's dispatch modes they use)",
    )
    parser.add_argument("--ep-only", action="store_true",
                        help="the layer on 1 and --ep devices only: no matmuls (no vs dense)")  # fmt: skip
    parser.add_argument("--profile", help="folder: profile the layer runs, print their kernels")
    parser.add_argument("--exchange-factor", type=float, default=MoEConfig.exchange_factor,
                        help="EP padded exchange: moe.exchange_factor")  # fmt: skip
    args = parser.parse_args()
    shape = dict(SMOKE if args.smoke else FULL)
    shape["experts"] = args.experts or shape["experts"]
    shape["rows"] = args.rows or shape["rows"]
    shape["exchange_factor"] = args.exchange_factor
    if args.variants:  # the dense matmul stays first: it is every row's baseline
        VARIANTS[1:] = [v for v in VARIANTS[1:] if v[0].split()[0] in args.variants]
    if args.ep > jax.device_count():
        parser.error(f"--ep {args.ep} needs {args.ep} devices, found {jax.device_count()}")

    started = time.perf_counter()

    def stage(name: str) -> None:  # where a long run spends its minutes (compiles, references)
        print(f"[{time.perf_counter() - started:6.0f} s] {name}", flush=True)

    checks = check(shape, args.ep, args.exchanges)
    print("check:", checks, flush=True)
    rows = []
    if args.tune:
        stage("tilings")
        rows += tiling_rows(
            shape["rows"][0], shape["experts"][0], shape, args.repeats, args.tilings
        )
    for experts in [] if args.layer_only or args.ep_only else shape["experts"]:
        for m in shape["rows"]:
            stage(f"matmuls E={experts} M={m}")
            rows += matmul_rows(m, experts, shape, args.repeats)
    if args.matmuls_only:
        print("\n" + markdown(rows, args, checks))
        return
    # The matmuls at the layer's own expert shape, then the layer (and EP) against them.
    dense, layer_matmuls = None, []
    if not args.ep_only:
        stage("matmuls at the layer's shape")
        layer_matmuls = matmul_rows(
            shape["layer_tokens"] * shape["k"], shape["layer_experts"], shape, args.repeats
        )
        dense = next(r["tflops"] for r in layer_matmuls if r["variant"] == "dense matmul fwd+bwd")
    rows += layer_matmuls
    peak = args.peak_tflops * 1e12
    stage("layer, 1 device")
    modes = dispatch_modes(args.exchanges)
    layer, one_device = layer_rows(shape, dense, peak, args.repeats, args.profile, modes)
    rows += layer
    ep = []
    if args.ep > 1:
        stage(f"layer, {args.ep} devices")
        ep = ep_rows(
            shape, args.ep, one_device, dense, peak, args.repeats, args.profile, args.exchanges
        )
    rows += ep
    stage("done")
    section = markdown(rows, args, checks)
    print("\n" + section)
    if args.output:
        with open(args.output, "w") as f:
            f.write(section)
    print(json.dumps({"check": checks, "rows": rows}))


if __name__ == "__main__":
    main()
