"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens exchanged.

Inside `jax.shard_map` over the whole mesh each device holds a shard of the tokens (rows over the
`batch` axes data, fsdp, expert; sequence over `seq`: the RULES of m3jax/sharding.py) and E/Ep of
the experts (Ep = size of the `expert` axis; device p owns experts p·E/Ep … (p+1)·E/Ep - 1).
Tokens travel to the devices owning their experts, the local experts run, results travel back.
Routing and attention stay outside: for them the expert axis is one more data-parallel axis, and
the router statistics (computed outside) are global. The shared expert (`Beside`: work on the
device's own tokens) may come inside, so that XLA can schedule its matmuls beside the all-to-alls,
even within the padded exchange's branch; its weights are then whole on every device.

Exchanges, by `model.moe.dispatch` and `moe.exchange`, one file each: padded.py (dropless, the
default), ragged.py (dropless), capacity.py (capacity).

Gradients come from autodiff through the collectives (their transposes are the reverse exchanges).
The expert weights enter the map as they are stored (`EXPERT_WEIGHT_AXES` through sharding.RULES:
E over `expert`, D over `fsdp`, F over `tensor`), so a device receives only its E/Ep experts'
shards; inside, it all-gathers the fsdp/tensor shards of its own experts (`_gathered`), whose
transpose reduce-scatters their gradients. Gathering on entry instead would make every device
hold, and all-reduce the gradients of, E/Ep whole experts (with mesh.expert = 1: all E of them).
With mesh.tensor > 1 every tensor rank repeats its group's expert work (no tensor parallelism
inside the experts yet).

Shapes: B batch, S sequence, N = B·S tokens on a device, k experts per token, D model width,
E experts (all), Ep expert-parallel devices (the `expert` axis).
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from m3jax import sharding
from m3jax.config import MoEConfig
from m3jax.moe import capacity, padded, ragged
from m3jax.moe.local import (
    EXPERT_WEIGHT_AXES,
    Activation,
    ExpertFFN,
    ExpertWeights,
    local_ffn,
    sorted_experts,
)
from m3jax.sharding import EXPERT_AXIS
from pallas_kernels.shard_map import vary_like


class Beside(NamedTuple):
    """Work on each device's own tokens that needs no exchange (M3's shared expert)."""

    fn: Callable[..., jax.Array]  # (tokens [N, D], *weights) -> [N, D]
    weights: tuple[jax.Array, ...]  # whole on every device inside the map (gathered on entry)


def routed_experts(
    mesh: Mesh,
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    experts: ExpertWeights,
    activation: Activation,
    moe: MoEConfig,
    *,
    grouped_matmul: str = "xla",
    beside: Beside | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The routed experts with tokens and experts spread over `mesh` (any axis sizes).

    Args:
      x: [B, S, D] tokens; chosen: [B, S, k] expert ids; weights: [B, S, k] fp32 routing weights.
      experts: all E experts' weights ([E, D, F], [E, D, F], [E, F, D]) in x's dtype.
      moe: its dispatch ("dropless" or "capacity"), capacity_factor, and for dropless the
        exchange and exchange_factor (see the exchanges' files).
      grouped_matmul: the local experts' grouped matmul (local.grouped_matmul_impl).
      beside: work to run on each device's tokens beside the exchange, or None.
    Returns:
      routed output [B, S, D] (before routed_scaling), the global number of dropped rows, 1.0 if
      the padded exchange needed worst-case blocks in this call, else 0.0 (fp32 scalars), and
      beside's output [B, S, D] (None without `beside`).
    """
    batch_axes, seq_axes = _token_axes()
    _check_divisible(mesh, x.shape, experts.gate.shape[0], batch_axes, seq_axes)
    tokens = PartitionSpec(batch_axes, seq_axes)
    stored = ExpertWeights(
        *(
            sharding.partition_spec(axes, w.shape, mesh)
            for axes, w in zip(EXPERT_WEIGHT_AXES, experts, strict=True)
        )
    )
    on_device = functools.partial(
        _routed_on_device,
        moe=moe,
        make_ffn=functools.partial(local_ffn, activation=activation, impl=grouped_matmul),
        beside_fn=beside.fn if beside else None,
        stored=stored,
        emulate_ragged=_lacks_ragged_all_to_all(mesh),
    )
    beside_weights = beside.weights if beside else ()
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, stored, PartitionSpec()),
        out_specs=(tokens, PartitionSpec(), PartitionSpec(), tokens if beside else None),
    )(x, chosen, weights, experts, beside_weights)


def _token_axes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes that split the tokens: (the batch's, the sequence's), as sharding.RULES."""
    rules = dict(sharding.RULES)
    return rules["batch"], rules["seq"]


def _lacks_ragged_all_to_all(mesh: Mesh) -> bool:
    """XLA:CPU has no ragged-all-to-all (jax 0.11.2); GPU and TPU do."""
    return mesh.devices.flat[0].platform == "cpu"


def _check_divisible(mesh: Mesh, shape: tuple, num_experts: int, batch_axes, seq_axes) -> None:
    if EXPERT_AXIS not in batch_axes:
        raise ValueError(f"expert parallelism needs tokens split over {EXPERT_AXIS!r} too")
    if num_experts % mesh.shape[EXPERT_AXIS]:
        raise ValueError(
            f"moe.num_experts={num_experts} is not divisible by "
            f"mesh.expert={mesh.shape[EXPERT_AXIS]}"
        )
    for dim, axes, what in ((0, batch_axes, "batch rows"), (1, seq_axes, "sequence length")):
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            raise ValueError(
                f"MoE on mesh {dict(mesh.shape)}: {what} {shape[dim]} are not divisible by "
                f"the mesh axes {axes} (size {parts})"
            )


def _routed_on_device(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    experts: ExpertWeights,
    beside_weights: tuple[jax.Array, ...],
    *,
    moe: MoEConfig,
    make_ffn: Callable[[ExpertWeights], ExpertFFN],
    beside_fn: Callable[..., jax.Array] | None,
    stored: ExpertWeights,
    emulate_ragged: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One device's shard: x [B/…, S/…, D], chosen and weights [.., .., k]; E/Ep local experts,
    sharded as `stored` (PartitionSpecs) says; make_ffn: how they run (`local_ffn`)."""
    shape, k = x.shape, chosen.shape[-1]
    token_axes = sum(_token_axes(), ())
    parts = jax.lax.axis_size(EXPERT_AXIS)
    local_experts = experts.gate.shape[0]
    num_tokens = math.prod(shape[:-1])
    tokens = x.reshape(num_tokens, shape[-1])
    # Weights typed as varying like the rows, once: autodiff sums their gradient over the token
    # axes here, and the padded exchange's two branches share one residual copy of them.
    experts = ExpertWeights(
        *(vary_like(_gathered(w, spec, token_axes), x) for w, spec in zip(experts, stored))
    )
    beside_weights = tuple(vary_like(w, x) for w in beside_weights)
    ffn = make_ffn(experts)
    chosen, weights = chosen.reshape(num_tokens, k), weights.reshape(num_tokens, k)

    def on_device(routed_fn) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """routed_fn: (tokens, chosen, weights) -> (routed [N, D], dropped rows)."""
        routed, dropped = routed_fn(tokens, chosen, weights)
        return routed, dropped, beside_fn(tokens, *beside_weights) if beside_fn else None

    def sorted_through(ffn: ExpertFFN):
        return functools.partial(
            sorted_experts,
            num_experts=local_experts * parts,
            ffn=ffn,
            dispatch=moe.dispatch,
            capacity_factor=moe.capacity_factor,
        )

    worst_case = jnp.zeros((), jnp.float32)
    if parts == 1:
        routed, dropped, beside = on_device(sorted_through(ffn))
    elif moe.exchange == "padded" and moe.dispatch == "dropless":
        (routed, dropped, beside), worst_case = padded.exchange(
            on_device, chosen, ffn, local_experts, moe.exchange_factor, token_axes
        )
    else:
        worst = num_tokens * min(k, local_experts)  # the most rows a device can send one peer
        exchanged = ExpertFFN(
            grouped=functools.partial(
                ragged.exchange, local=ffn.grouped, rows_per_source=worst, emulate=emulate_ragged
            ),
            batched=functools.partial(capacity.exchange, local=ffn.batched),
        )
        routed, dropped, beside = on_device(sorted_through(exchanged))
    if moe.dispatch == "capacity":
        dropped = jax.lax.psum(dropped, token_axes)
    beside = None if beside is None else beside.reshape(shape)
    return routed.reshape(shape), dropped, worst_case, beside


def _gathered(w: jax.Array, spec: PartitionSpec, token_axes: tuple[str, ...]) -> jax.Array:
    """This device's experts whole along D and F: the shards over the mesh axes that `spec` names
    for the dims after the expert dim, all-gathered. Over an axis the tokens are split on (fsdp),
    the gradient's transpose is a reduce-scatter (the shards' tokens differ); over one they are
    not (tensor: every rank repeats the same work), it is a slice of the same whole gradient."""
    for dim, axes in enumerate(spec):
        if dim == 0 or axes is None:
            continue
        for axis in reversed((axes,) if isinstance(axes, str) else axes):  # minor axis first
            to = "varying" if axis in token_axes else "invarying"
            w = jax.lax.all_gather(w, axis, axis=dim, tiled=True, to=to)
    return w
